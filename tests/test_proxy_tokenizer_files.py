"""Which of a model directory's files the proxy reads, and how, against ``transformers`` 5.19 (what vLLM
0.32 loads a model's tokenizer with): chat templates in files, special tokens named only in the config.

The expected strings and ids here are what ``transformers`` 5.19.0 (``tokenizers`` 0.23.3) gave for the
same files; with ``KV_ROUTER_VLLM_PYTHON`` set (the real-engine lane's venv), ``test_transformers_agrees``
asks it again (``AutoTokenizer.from_pretrained``, ``apply_chat_template``, offline).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from api.config import ProxyConfig
from api.proxy.chat_template import NotLocal
from api.proxy.tokens import ModelFiles, load_model_files
from api.proxy.wire import ChatBody
from indexer.hashing import unpack_tokens
from router.errors import ConfigError
from tests.chat_vectors.models import assemble

_USER = [{"role": "user", "content": "hi"}]
_TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
_LOOP = "{% for m in messages %}|{{ m.content }}{% endfor %}"
_NAMES = "{{ bos_token }}|{{ eos_token }}|{{ image_token }}" + _LOOP


def _saved_templates(directory: Path) -> Path:
    """Templates as ``save_pretrained`` writes them today: ``chat_template.jinja`` and
    ``additional_chat_templates/``; the config's own ``chat_template`` is then not read."""
    assemble("chatml-tools", directory)
    (directory / "chat_template.jinja").write_text("DEFAULT" + _LOOP)
    (directory / "additional_chat_templates").mkdir()
    (directory / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS {{ tools | length }}" + _LOOP)
    return directory


def _only_additional(directory: Path) -> Path:
    """Named template files without a default: the config's template is not read either."""
    _saved_templates(directory)
    (directory / "chat_template.jinja").unlink()
    return directory


def _configured(special_map: dict[str, Any] | None = None, **config: Any) -> Callable[[Path], Path]:
    """ChatML-like files, ``config`` added to the tokenizer_config.json (``added_tokens_decoder: True``:
    tokenizer.json's added tokens, as save_pretrained writes them), and a special_tokens_map.json."""

    def make(directory: Path) -> Path:
        assemble("chatml-tools", directory)
        if config.get("added_tokens_decoder") is True:
            added = json.loads((directory / "tokenizer.json").read_text())["added_tokens"]
            config["added_tokens_decoder"] = {str(token.pop("id")): token for token in added}
        path = directory / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
        if special_map is not None:
            (directory / "special_tokens_map.json").write_text(json.dumps(special_map))
        return directory

    return make


_NEW = {"content": "<new>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}

# name -> how its directory is made
DIRECTORIES: dict[str, Callable[[Path], Path]] = {
    "saved-templates": _saved_templates,
    "only-additional": _only_additional,
    # special tokens named in tokenizer_config.json only, none an added token of tokenizer.json
    "config-specials": _configured(
        additional_special_tokens=["<tool>", "<|im_end|>"],
        bos_token="<|endoftext|>",
        image_token="<image>",
        added_tokens_decoder={"400": {**_NEW, "special": False}, "8": {"content": "<|im_end|>", "special": True}},
    ),
    # an older config (no added_tokens_decoder): special_tokens_map.json's tokens win, even over a null
    "older-config": _configured(
        {
            "bos_token": "<s>",
            "eos_token": {"content": "</s>", "lstrip": False},
            "additional_special_tokens": ["<tool>"],
        },
        bos_token=None,
        eos_token="<|im_end|>",
        image_token="<image>",
        chat_template=_NAMES,
    ),
    # today's config (added_tokens_decoder): special_tokens_map.json is not read
    "todays-config": _configured(
        {"bos_token": "<s>", "additional_special_tokens": ["<tool>"]}, added_tokens_decoder=True, chat_template=_NAMES
    ),
    "extra-named": _configured(
        extra_special_tokens={"audio_token": "<audio>"}, eos_token={"__type": "AddedToken", **_NEW, "special": False}
    ),
}

# (directory, request) -> the rendered text (transformers 5.19.0), None: transformers finds no template
RENDERED: list[tuple[str, dict[str, Any], str | None]] = [
    ("saved-templates", {"messages": _USER}, "DEFAULT|hi"),
    ("saved-templates", {"messages": _USER, "tools": [_TOOL]}, "TOOLS 1|hi"),
    ("only-additional", {"messages": _USER, "tools": [_TOOL]}, "TOOLS 1|hi"),
    ("only-additional", {"messages": _USER}, None),
    ("older-config", {"messages": _USER}, "<s>|</s>|<image>|hi"),
    ("todays-config", {"messages": _USER}, "|<|im_end|>||hi"),
]


def _files(tmp_path: Path, name: str) -> ModelFiles:
    return load_model_files({"m": DIRECTORIES[name](tmp_path / name)}, ProxyConfig().proxy_tokenizer_cache_tokens)["m"]


def _render(files: ModelFiles, request: dict[str, Any]) -> str:
    assert files.template is not None
    return files.template.render(msgspec.convert({"model": "m", **request}, ChatBody))


@pytest.mark.parametrize(("name", "request_", "text"), RENDERED)
def test_chat_templates_are_read_from_files_as_transformers_does(
    tmp_path: Path, name: str, request_: dict[str, Any], text: str | None
) -> None:
    files = _files(tmp_path, name)
    if text is None:  # no default: the engine's own fallback, not ours
        with pytest.raises(NotLocal):
            _render(files, request_)
    else:
        assert _render(files, request_) == text


def test_a_bad_named_template_file_is_named(tmp_path: Path) -> None:
    directory = _saved_templates(tmp_path / "bad")
    bad = directory / "additional_chat_templates" / "tool_use.jinja"
    bad.write_text("{% if %}")
    with pytest.raises(ConfigError, match=f"chat template {bad}: line 1"):
        load_model_files({"m": directory})


_ORACLE = """
import json, sys
from transformers import AutoTokenizer
out = []
for directory, request in json.loads(sys.stdin.read()):
    tokenizer = AutoTokenizer.from_pretrained(directory)
    if "prompt" in request:
        out.append(tokenizer(request["prompt"], add_special_tokens=request["add_special_tokens"])["input_ids"])
        continue
    try:
        out.append(tokenizer.apply_chat_template(request["messages"], tools=request.get("tools"), tokenize=False,
                                                 add_generation_prompt=request.get("add_generation_prompt", True)))
    except ValueError:
        out.append(None)
print(json.dumps(out))
"""


@pytest.mark.skipif(not os.environ.get("KV_ROUTER_VLLM_PYTHON"), reason="KV_ROUTER_VLLM_PYTHON not set")
def test_transformers_agrees(tmp_path: Path) -> None:
    """The expectations above are what the lane venv's ``transformers`` gives now."""
    directories = {name: make(tmp_path / name) for name, make in DIRECTORIES.items()}
    asked: list[tuple[str, dict[str, Any]]] = [(str(directories[name]), request) for name, request, _ in RENDERED]
    expected: list[Any] = [text for _, _, text in RENDERED]
    asked += [
        (str(directories[name]), {"prompt": text, "add_special_tokens": special}) for name, text, special, _ in ENCODED
    ]
    expected += [ids for _, _, _, ids in ENCODED]
    done = subprocess.run(
        [os.environ["KV_ROUTER_VLLM_PYTHON"], "-c", _ORACLE], input=json.dumps(asked), capture_output=True, text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300, check=True,
    )  # fmt: skip
    assert json.loads(done.stdout.splitlines()[-1]) == expected


# (directory, text, add_special_tokens) -> the ids (transformers 5.19.0)
ENCODED: list[tuple[str, str, bool, list[int]]] = [
    (
        "config-specials",
        "a <tool> b<|endoftext|>c<image>d<new>e<|im_end|>",
        True,
        [75, 231, 357, 231, 76, 355, 77, 356, 78, 354, 79, 8],
    ),
    ("extra-named", "a<audio>b<new>c", False, [75, 355, 76, 354, 77]),
    ("older-config", "a<tool>b</s>c", False, [75, 355, 76, 2, 77]),
    ("todays-config", "a<tool>b", False, [75, 38, 351, 40, 76]),
]


@pytest.mark.parametrize(("name", "text", "special", "ids"), ENCODED)
def test_text_is_encoded_as_transformers_does(
    tmp_path: Path, name: str, text: str, special: bool, ids: list[int]
) -> None:
    encoder = _files(tmp_path, name).encoder
    assert encoder.cache is not None
    for _ in range(2):  # its pieces encoded, then found in the tokenizer cache
        assert unpack_tokens(asyncio.run(encoder.encode(text, add_special_tokens=special))) == ids
    assert encoder.tokenizer.encode(text, add_special_tokens=special).ids == ids

"""Which of a model directory's files the proxy reads, and how, against ``transformers`` 5.19 (what vLLM
0.32 loads a model's tokenizer with): chat templates in files, special tokens named only in the config,
the legacy ``added_tokens.json``, a Llama-2-style tokenizer.json that ``LlamaTokenizer`` rebuilds.

The expected strings and ids here are what ``transformers`` 5.19.0 (``tokenizers`` 0.23.3) gave for the
same files; with ``KV_ROUTER_VLLM_PYTHON`` set (the real-engine lane's venv), ``test_transformers_agrees``
asks it again (``AutoTokenizer.from_pretrained``, ``apply_chat_template``, offline), and
``test_llama_texts_are_encoded_as_transformers_does`` compares random texts with it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
from tokenizers.models import BPE

from api.config import ProxyConfig
from api.proxy.chat_template import NotLocal
from api.proxy.tokens import ModelFiles, PromptTokenizer, TokenizeFailed, load_model_files
from api.proxy.upstream import Upstream
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


def _legacy_added(directory: Path) -> Path:
    """An older config (no added_tokens_decoder) beside the legacy ``added_tokens.json``, which
    transformers 5.19 still reads then: a token new to tokenizer.json, one the config lists as special."""
    _configured(additional_special_tokens=["<tool>"], eos_token="<|im_end|>")(directory)
    (directory / "added_tokens.json").write_text(json.dumps({"<extra>": 400, "<tool>": 401}))
    return directory


# A Llama-2-style tokenizer.json (as converted from SentencePiece): a normalizer that prepends "▁" and
# writes spaces as "▁", a byte-fallback BPE (built here, its merges spelling the words below), BOS from
# the post-processor; and an added token that is not special ("<tool>").
_LLAMA_WORDS = ("▁▁", "▁Hello", "Hello", "▁world", "world", "▁two", "▁spaces", "▁[", "INST", "▁a", "▁b")


def _llama_tokenizer() -> Tokenizer:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{byte:02X}>": 3 + byte for byte in range(256)}
    merges: list[tuple[str, str]] = []
    for char in "▁abcdefghijklmnopqrstuvwxyzHINST[]/":
        vocab.setdefault(char, len(vocab))
    for word in _LLAMA_WORDS:
        for end in range(2, len(word) + 1):
            merge = (word[: end - 1], word[end - 1])
            if merge not in merges:
                merges.append(merge)
            vocab.setdefault(word[:end], len(vocab))
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens(
        [AddedToken(token, normalized=False, special=True) for token in ("<unk>", "<s>", "</s>")]
    )
    tokenizer.add_tokens([AddedToken("<tool>", normalized=True)])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)]
    )
    return tokenizer


_LLAMA_CONFIG = {
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "add_bos_token": True,
    "add_eos_token": False,
}
_LLAMA_DECODER = {
    str(index): {
        "content": token,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }
    for index, token in enumerate(("<unk>", "<s>", "</s>"))
}


def _llama(model_type: str | None = None, **config: Any) -> Callable[[Path], Path]:
    """A Llama-2-style model directory: ``config`` in its tokenizer_config.json (LlamaTokenizerFast by
    default), a config.json of ``model_type`` (none: no config.json)."""

    def make(directory: Path) -> Path:
        directory.mkdir(parents=True)
        _llama_tokenizer().save(str(directory / "tokenizer.json"))
        given = {"tokenizer_class": "LlamaTokenizerFast", **_LLAMA_CONFIG, **config}
        (directory / "tokenizer_config.json").write_text(json.dumps(given))
        if model_type is not None:
            (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
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
    "legacy-added": _legacy_added,
    # LlamaTokenizer rebuilds the pipeline: no normalizer, Metaspace prepending "▁" always (legacy) or to
    # the text's start only (legacy false, the default), never without add_prefix_space
    "llama-legacy": _llama(legacy=True),
    "llama": _llama("llama", legacy=False, added_tokens_decoder=_LLAMA_DECODER),  # <tool> not kept
    "llama-no-prefix": _llama(tokenizer_class="LlamaTokenizer", add_prefix_space=False, legacy=True),
    # a model type registered with a class loading tokenizer.json as it is wins over LlamaTokenizer
    "llama-mistral-type": _llama("mistral", legacy=True),
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
    ("legacy-added", "a<extra>b<tool>c", False, [75, 354, 76, 355, 77]),
    ("llama-legacy", "[INST] Hello [/INST] world", True, [1, 322, 325, 292, 299, 322, 293, 325, 292, 308]),
    ("llama-legacy", "[INST] Hello [/INST] world", False, [322, 325, 292, 299, 322, 293, 325, 292, 308]),
    ("llama-legacy", "  two  spaces ", True, [1, 294, 279, 309, 294, 278, 275, 260, 262, 264, 278, 259]),
    ("llama-legacy", "  two  spaces ", False, [294, 279, 309, 294, 278, 275, 260, 262, 264, 278, 259]),
    ("llama-legacy", "a <tool>\nb</s>Hello world", True, [1, 326, 259, 328, 259, 13, 261, 2, 299, 308]),
    ("llama-legacy", "a <tool>\nb</s>Hello world", False, [326, 259, 328, 259, 13, 261, 2, 299, 308]),
    ("llama", "[INST] Hello [/INST] world", True, [1, 322, 325, 292, 299, 322, 293, 325, 292, 308]),
    ("llama", "[INST] Hello [/INST] world", False, [322, 325, 292, 299, 322, 293, 325, 292, 308]),
    ("llama", "  two  spaces ", True, [1, 294, 279, 309, 294, 278, 275, 260, 262, 264, 278, 259]),
    ("llama", "  two  spaces ", False, [294, 279, 309, 294, 278, 275, 260, 262, 264, 278, 259]),
    ("llama", "a <tool>\nb</s>Hello world", True, [1, 326, 259, 63, 279, 274, 274, 271, 65, 13, 261, 2, 303, 308]),
    ("llama", "a <tool>\nb</s>Hello world", False, [326, 259, 63, 279, 274, 274, 271, 65, 13, 261, 2, 303, 308]),
    ("llama-no-prefix", "[INST] Hello [/INST] world", True, [1, 291, 325, 292, 299, 322, 293, 325, 292, 308]),
    ("llama-no-prefix", "[INST] Hello [/INST] world", False, [291, 325, 292, 299, 322, 293, 325, 292, 308]),
    ("llama-no-prefix", "  two  spaces ", True, [1, 294, 279, 309, 294, 278, 275, 260, 262, 264, 278, 259]),
    ("llama-no-prefix", "  two  spaces ", False, [294, 279, 309, 294, 278, 275, 260, 262, 264, 278, 259]),
    ("llama-no-prefix", "a <tool>\nb</s>Hello world", True, [1, 260, 259, 328, 13, 261, 2, 303, 308]),
    ("llama-no-prefix", "a <tool>\nb</s>Hello world", False, [260, 259, 328, 13, 261, 2, 303, 308]),
    ("llama-mistral-type", "[INST] Hello [/INST] world", True, [1, 322, 325, 292, 299, 322, 293, 325, 292, 308]),
    ("llama-mistral-type", "[INST] Hello [/INST] world", False, [322, 325, 292, 299, 322, 293, 325, 292, 308]),
    ("llama-mistral-type", "  two  spaces ", True, [1, 294, 313, 309, 294, 278, 275, 260, 262, 264, 278, 259]),
    ("llama-mistral-type", "  two  spaces ", False, [294, 313, 309, 294, 278, 275, 260, 262, 264, 278, 259]),
    ("llama-mistral-type", "a <tool>\nb</s>Hello world", True, [1, 326, 328, 13, 261, 2, 299, 308]),
    ("llama-mistral-type", "a <tool>\nb</s>Hello world", False, [326, 328, 13, 261, 2, 299, 308]),
]


@pytest.mark.parametrize(("name", "text", "special", "ids"), ENCODED)
def test_text_is_encoded_as_transformers_does(
    tmp_path: Path, name: str, text: str, special: bool, ids: list[int]
) -> None:
    encoder = _files(tmp_path, name).encoder
    assert encoder is not None
    # the cache is off where a text cannot be encoded piece by piece (Metaspace prepending to the first)
    assert (encoder.cache is None) == (name in ("llama", "llama-mistral-type"))
    for _ in range(2):  # its pieces encoded, then found in the tokenizer cache
        assert unpack_tokens(asyncio.run(encoder.encode(text, add_special_tokens=special))) == ids
    assert encoder.tokenizer.encode(text, add_special_tokens=special).ids == ids


_ORACLE_LINES = """
import json, sys
from transformers import AutoTokenizer
tokenizers = {}
for line in sys.stdin:
    directory, text, special = json.loads(line)
    if directory not in tokenizers:
        tokenizers[directory] = AutoTokenizer.from_pretrained(directory)
    print(json.dumps(tokenizers[directory](text, add_special_tokens=special)["input_ids"]), flush=True)
"""

_LLAMA_DIRECTORIES = ("llama-legacy", "llama", "llama-no-prefix", "llama-mistral-type")
_PIECES = (
    " ", "  ", "\n", "\r\n", "\t", "▁", "Hello", "world", "two", "spaces", "a", "b", "[INST]", "[/INST]",
    "<s>", "</s>", "<unk>", "<tool>", "é", "日本", "🙂",
)  # fmt: skip


@pytest.fixture(scope="module")
def llama_oracle(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[dict[str, ModelFiles], Callable[..., Any]]]:
    """The Llama-style directories' files loaded here, and a function asking the lane venv's
    ``transformers`` for a text's ids (one process, each tokenizer loaded once)."""
    root = tmp_path_factory.mktemp("llama")
    directories = {name: DIRECTORIES[name](root / name) for name in _LLAMA_DIRECTORIES}
    oracle = subprocess.Popen(
        [os.environ["KV_ROUTER_VLLM_PYTHON"], "-c", _ORACLE_LINES], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert oracle.stdin is not None and oracle.stdout is not None
    stdin, stdout = oracle.stdin, oracle.stdout

    def ask(name: str, text: str, special: bool) -> Any:
        stdin.write(json.dumps([str(directories[name]), text, special]) + "\n")
        stdin.flush()
        return json.loads(stdout.readline())

    cache_tokens = ProxyConfig().proxy_tokenizer_cache_tokens
    try:
        yield {name: load_model_files({"m": path}, cache_tokens)["m"] for name, path in directories.items()}, ask
    finally:
        stdin.close()
        oracle.wait(timeout=30)
        stdout.close()


@pytest.mark.skipif(not os.environ.get("KV_ROUTER_VLLM_PYTHON"), reason="KV_ROUTER_VLLM_PYTHON not set")
@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(_LLAMA_DIRECTORIES),
    text=st.lists(st.one_of(st.sampled_from(_PIECES), st.text(max_size=4)), max_size=12).map("".join),
    special=st.booleans(),
)
def test_llama_texts_are_encoded_as_transformers_does(
    llama_oracle: tuple[dict[str, ModelFiles], Callable[..., Any]], name: str, text: str, special: bool
) -> None:
    """Random texts (spaces leading, trailing, doubled; newlines; added tokens; any unicode) on the
    Llama-2-style files, legacy or not, as the lane venv's ``transformers`` encodes them."""
    files, ask = llama_oracle
    encoder = files[name].encoder
    assert encoder is not None
    assert unpack_tokens(asyncio.run(encoder.encode(text, add_special_tokens=special))) == ask(name, text, special)


def test_code_llama_is_tokenized_by_the_workers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """CodeLlamaTokenizer cuts a text at its fill token (infilling) as transformers 5.19 encodes it: its
    model has no local tokenizer, and its prompts go to the workers, not to the files for every model."""
    code_llama = _llama(tokenizer_class="CodeLlamaTokenizerFast")(tmp_path / "code")
    other = DIRECTORIES["todays-config"](tmp_path / "other")
    with caplog.at_level(logging.WARNING, logger="api.proxy.tokens"):
        files = load_model_files({"code": code_llama, "*": other})
    assert files["code"].encoder is None and files["code"].template is None
    assert [record.getMessage() for record in caplog.records] == [
        "model 'code': CodeLlamaTokenizer (as transformers 5.19 loads it) encodes a text holding its fill token "
        "as an infilling prompt, which is not repeated here; its prompts are tokenized by the workers"
    ]
    tokenizer = PromptTokenizer(files, Upstream(ProxyConfig()))
    with pytest.raises(TokenizeFailed, match="none serves it"):  # it asked the (absent) workers
        asyncio.run(tokenizer.text("code", "def f(<FILL_ME>)", []))
    assert unpack_tokens(asyncio.run(tokenizer.text("any", "a<tool>b", [], False))) == [75, 38, 351, 40, 76]

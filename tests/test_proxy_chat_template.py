"""The proxy's local tokenization against vLLM's: the same token ids for the same model files.

``tests/chat_vectors/vectors.json`` holds what vLLM 0.32's ``/tokenize`` code gave for each request of
``tests/chat_vectors/models.py`` (``regenerate.py`` there makes it again): Llama-3-like, ChatML-like
with tools and a system prompt, one without a generation-prompt branch that raises on bad turns, named
templates; templates from ``tokenizer_config.json`` and from ``chat_template.jinja``.
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import msgspec
import pytest

from api.config import ProxyConfig
from api.proxy.chat_template import NotLocal
from api.proxy.tokens import ModelFiles, PromptRefused, PromptTokenizer, TokenizeFailed, load_model_files
from api.proxy.upstream import Upstream
from api.proxy.wire import ChatBody
from indexer.hashing import unpack_tokens
from router.errors import ConfigError
from tests.chat_vectors.models import CASES, MODELS, VECTORS, assemble

pytestmark = pytest.mark.anyio

EXPECTED: dict[str, dict[str, Any]] = json.loads(VECTORS.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {model: assemble(model, root / model) for model in MODELS}


def local_only(model_dirs: dict[str, Path], model: str) -> PromptTokenizer:
    """A tokenizer for ``model`` from its files (its tokenizer cache on), with no worker to fall back on."""
    files = load_model_files({model: model_dirs[model]}, ProxyConfig().proxy_tokenizer_cache_tokens)
    return PromptTokenizer(files, Upstream(ProxyConfig()))


def test_every_case_has_a_recorded_answer() -> None:
    assert EXPECTED.keys() == CASES.keys()


@pytest.mark.parametrize("case", sorted(CASES))
async def test_local_tokens_equal_vllms(case: str, model_dirs: dict[str, Path]) -> None:
    body, expected = CASES[case], EXPECTED[case]
    tokenizer = local_only(model_dirs, body["model"])
    for _ in range(2):  # its pieces encoded, then found in the tokenizer cache
        if "prompt" in body:
            special = body.get("add_special_tokens", True)
            assert unpack_tokens(await tokenizer.text(body["model"], body["prompt"], [], special)) == expected["tokens"]
        elif "error" in expected:
            with pytest.raises(PromptRefused, match="Conversation roles must alternate"):
                await tokenizer.chat(msgspec.convert(body, ChatBody), [])
        else:
            assert unpack_tokens(await tokenizer.chat(msgspec.convert(body, ChatBody), [])) == expected["tokens"]


async def test_a_directory_or_its_tokenizer_json_or_one_for_every_model(model_dirs: dict[str, Path]) -> None:
    body = msgspec.convert(CASES["chatml-tools"], ChatBody)
    expected = EXPECTED["chatml-tools"]["tokens"]
    for paths in ({"chatml-tools": model_dirs["chatml-tools"] / "tokenizer.json"}, {"*": model_dirs["chatml-tools"]}):
        tokenizer = PromptTokenizer(load_model_files(paths), Upstream(ProxyConfig()))
        assert unpack_tokens(await tokenizer.chat(body, [])) == expected
    config = ProxyConfig(tokenizer=[str(model_dirs["chatml-tools"]), f"other={model_dirs['llama3-like']}"])
    assert config.tokenizer_paths() == {"*": model_dirs["chatml-tools"], "other": model_dirs["llama3-like"]}


@pytest.mark.parametrize(
    "change",
    [
        {"chat_template_kwargs": {"date_string": 5}},  # the template adds it to a text: a TypeError
        {"chat_template_kwargs": {"date_string": None}},
    ],
)
async def test_a_template_failing_on_the_requests_arguments_refuses_it(
    model_dirs: dict[str, Path], change: dict[str, Any]
) -> None:
    """vLLM answers a template's TypeError or ValueError as it answers its ``raise_exception``: a 400 (was
    a 500 here)."""
    given = {"model": "llama3-like", "messages": [{"role": "user", "content": "hi"}], **change}
    tokenizer = local_only(model_dirs, "llama3-like")
    with pytest.raises(PromptRefused, match="the chat template refused the messages: can only concatenate str"):
        await tokenizer.chat(msgspec.convert(given, ChatBody), [])


def render(files: ModelFiles, body: dict[str, Any]) -> str:
    assert files.template is not None
    return files.template.render(msgspec.convert(body, ChatBody))


def test_strftime_now_gives_todays_date_when_the_request_names_none(model_dirs: dict[str, Path]) -> None:
    files = load_model_files({"m": model_dirs["llama3-like"]})["m"]
    text = render(files, {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert f"Today Date: {datetime.now().strftime('%d %b %Y')}" in text


@pytest.mark.parametrize(
    "change",
    [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        {"continue_final_message": True, "add_generation_prompt": False},
        {"chat_template": "{{ messages }}"},
        {"chat_template_kwargs": {"tools": []}},
        {"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]},
    ],
)
async def test_what_is_not_rendered_here_goes_to_the_engine(
    model_dirs: dict[str, Path], change: dict[str, Any]
) -> None:
    given = {"model": "chatml-tools", "messages": [{"role": "user", "content": "hi"}], **change}
    body = msgspec.convert(given, ChatBody)
    tokenizer = local_only(model_dirs, "chatml-tools")
    with pytest.raises(TokenizeFailed, match="none serves it"):  # it asked the (absent) workers
        await tokenizer.chat(body, [])


def test_a_template_iterating_over_content_is_left_to_the_engine(tmp_path: Path, model_dirs: dict[str, Path]) -> None:
    # vLLM hands such templates content as a list of parts ("openai" format), even for a string.
    directory = assemble("chatml-tools", tmp_path / "parts")
    (directory / "chat_template.jinja").write_text(
        "{% for m in messages %}{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endfor %}"
    )
    files = load_model_files({"m": directory})["m"]
    with pytest.raises(NotLocal):
        render(files, {"model": "m", "messages": [{"role": "user", "content": "hi"}]})


@pytest.mark.parametrize("file", ["processor_config.json", "preprocessor_config.json", "chat_template.json"])
async def test_a_multimodal_models_chat_is_left_to_the_engine(tmp_path: Path, file: str) -> None:
    # vLLM renders with the processor's template first: text stays local, chat goes to /tokenize.
    directory = assemble("chatml-tools", tmp_path / "vlm")
    (directory / file).write_text("{}")
    files = load_model_files({"m": directory})["m"]
    assert files.template is None
    tokenizer = PromptTokenizer({"m": files}, Upstream(ProxyConfig()))
    assert unpack_tokens(await tokenizer.text("m", "hello", [])) == files.encoder.tokenizer.encode("hello").ids
    chat = msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, ChatBody)
    with pytest.raises(TokenizeFailed):
        await tokenizer.chat(chat, [])


def test_the_template_cannot_reach_python_internals(tmp_path: Path) -> None:
    directory = assemble("chatml-tools", tmp_path / "evil")
    (directory / "chat_template.jinja").write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    files = load_model_files({"m": directory})["m"]
    with pytest.raises(jinja2.exceptions.SecurityError):
        render(files, {"model": "m", "messages": [{"role": "user", "content": "hi"}]})


@pytest.mark.parametrize(
    ("file", "content", "message"),
    [
        ("tokenizer.json", "{not json", "tokenizer.json"),
        ("tokenizer_config.json", "[1, 2]", "tokenizer_config.json: expected a JSON object"),
        ("tokenizer_config.json", '{"chat_template": 3}', "tokenizer_config.json: chat_template is neither"),
        ("chat_template.jinja", "{% for m in messages %}{{ m.content }", "chat_template.jinja: line 1"),
        ("special_tokens_map.json", "{", "special_tokens_map.json"),
    ],
)
def test_a_bad_file_is_named_in_one_line(tmp_path: Path, file: str, content: str, message: str) -> None:
    directory = assemble("chatml-tools", tmp_path / "bad")
    (directory / file).write_text(content)
    with pytest.raises(ConfigError, match=message) as raised:
        load_model_files({"m": directory})
    assert "\n" not in str(raised.value) and str(directory / file) in str(raised.value)


async def test_long_texts_encoded_together_off_the_loop_equal_inline_ones(model_dirs: dict[str, Path]) -> None:
    encoder = load_model_files({"m": model_dirs["llama3-like"]})["m"].encoder
    texts = [f"text number {i}: " + "the dragon tells a story about the weather " * (30 + i) for i in range(12)]
    specials = [i % 2 == 0 for i in range(12)]
    gone = asyncio.ensure_future(encoder.encode(texts[0], add_special_tokens=True))
    await asyncio.sleep(0)
    gone.cancel()  # a request that left while queued: the others still get their ids
    got = await asyncio.gather(*(encoder.encode(t, add_special_tokens=s) for t, s in zip(texts, specials, strict=True)))
    for text, special, packed in zip(texts, specials, got, strict=True):
        ids = unpack_tokens(packed)
        assert ids == encoder.tokenizer.encode(text, add_special_tokens=special).ids
        assert (ids[0] == encoder.tokenizer.token_to_id("<|begin_of_text|>")) is special

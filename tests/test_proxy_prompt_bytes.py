"""Prompts routed by their bytes on a fleet without KV events (`api.proxy.prompt_bytes`), through the
real `openai` client, a real nats-server and mock workers serving the OpenAI API: nothing tokenized,
the same prefix predicted on its holder, the calibration in the engine's tokens; tokenized as before
with events, with the setting off, and for Dynamo's instance query."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from api.proxy.prompt_bytes import BYTES_PER_TOKEN, chat_bytes, text_bytes
from api.proxy.wire import ChatBody, ChatMessage
from router.event_plane.embedded_server import EmbeddedNats
from tests.metrics import sample
from tests.proxy_fleet import MODEL, fleet, idle
from tests.test_api_proxy import BLOCK, scrape

pytestmark = pytest.mark.anyio

# A routing token is four bytes of the prompt, a block BLOCK of them.
BLOCK_BYTES = BYTES_PER_TOKEN * BLOCK


def _predicted(first: bytes, second: bytes) -> int:
    """The cached routing tokens predicted for ``second`` once ``first`` was routed: their common
    prefix's whole blocks."""
    common = next(
        (i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b), min(map(len, (first, second)))
    )
    return common // BLOCK_BYTES * BLOCK


def test_text_is_its_utf8_bytes_four_to_a_token_zero_padded() -> None:
    assert text_bytes("") == b""
    assert text_bytes("abcd") == b"abcd"
    assert text_bytes("héllo") == "héllo".encode() + b"\0\0"  # 6 bytes: two tokens
    assert text_bytes("\ud800x") == b"\xed\xa0\x80x"  # a lone surrogate is routed, not refused


def test_a_later_turn_extends_the_earlier_ones_bytes_and_the_billing_line_is_left_out() -> None:
    system = ChatMessage(role="system", content="x-anthropic-billing-header: cc_version=1; cch=a1\nYou code.")
    same = ChatMessage(role="system", content="x-anthropic-billing-header: cc_version=1; cch=b2\nYou code.")
    user = ChatMessage(role="user", content="fix it")
    first = chat_bytes(ChatBody(model=MODEL, messages=[system, user]))
    later = chat_bytes(
        ChatBody(model=MODEL, messages=[same, user, ChatMessage(role="assistant", content="done"), user])
    )
    assert len(first) % 4 == 0 and b"cch=" not in first
    assert later.startswith(first.rstrip(b"\0")[:-1])  # all but the closing bracket
    tools = ChatBody(model=MODEL, messages=[system, user], tools=[{"type": "function", "function": {"name": "f"}}])
    assert chat_bytes(tools) != first  # tools come before the messages in a template: another prefix


def test_an_image_is_routed_by_a_digest_of_itself_not_by_its_megabytes() -> None:
    def chat(image: str) -> bytes:
        parts = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": image}}]
        return chat_bytes(ChatBody(model=MODEL, messages=[ChatMessage(role="user", content=parts)]))

    inlined = "data:image/png;base64," + "iVBORw0KGgo" * 400_000  # 4.4 MB
    assert len(chat(inlined)) < 200 and b"what is this?" in chat(inlined)
    assert chat(inlined) == chat(inlined) != chat(inlined[:-1] + "A")


async def test_without_kv_events_nothing_is_tokenized_and_a_prefix_is_predicted_on_its_holder(
    nats_server: EmbeddedNats,
) -> None:
    async with fleet(nats_server.url, kv_events=False) as f:
        prefix = "the same long system prompt. " * 40  # 1,160 bytes: four blocks of routing tokens
        first = await f.client.completions.with_raw_response.create(model=MODEL, prompt=prefix + "one", max_tokens=2)
        holder = first.headers["x-kv-router-worker"]
        assert first.headers["x-kv-router-cached-tokens"] == "0"
        second = await f.client.completions.with_raw_response.create(model=MODEL, prompt=prefix + "two", max_tokens=2)
        assert second.headers["x-kv-router-worker"] == holder
        predicted = _predicted(text_bytes(prefix + "one"), text_bytes(prefix + "two"))
        assert int(second.headers["x-kv-router-cached-tokens"]) == predicted == 4 * BLOCK
        usage = second.parse().usage
        assert usage is not None and usage.prompt_tokens == len(prefix) + 3  # the mock's tokens are the bytes
        assert usage.prompt_tokens_details is not None
        actual = usage.prompt_tokens_details.cached_tokens
        assert actual == len(prefix) // BLOCK * BLOCK  # what the engine had: 18 of its blocks
        # The gauge compares in the engine's tokens: the prediction scaled by the prompt's tokens per
        # routing token (1,163 over 291), against what the engine reported.
        converted = round(predicted * (len(prefix) + 3) / (len(text_bytes(prefix + "two")) // 4))
        text = await scrape(f.url)
        assert sample(text, "kv_router_proxy_cache_calibration", worker_id=holder) == actual / converted

        # Chat: a conversation's next turn lands where the first was predicted.
        system: Any = {"role": "system", "content": "You answer questions about routing. " * 12}
        turn = [system, {"role": "user", "content": "first?"}]
        one = await f.client.chat.completions.with_raw_response.create(model=MODEL, messages=turn, max_tokens=1)
        chat_holder = one.headers["x-kv-router-worker"]
        later = [*turn, {"role": "assistant", "content": "w1"}, {"role": "user", "content": "second?"}]
        two = await f.client.chat.completions.with_raw_response.create(model=MODEL, messages=later, max_tokens=1)
        assert two.headers["x-kv-router-worker"] == chat_holder
        as_sent = [chat_bytes(ChatBody(model=MODEL, messages=[ChatMessage(**m) for m in ms])) for ms in (turn, later)]
        assert int(two.headers["x-kv-router-cached-tokens"]) == _predicted(*as_sent) > 0

        assert all(api.tokenized == 0 for api in f.apis.values())  # no worker was asked to tokenize
        text = await scrape(f.url)
        assert sample(text, "kv_router_proxy_prompts_total", source="bytes") == 4
        assert sample(text, "kv_router_proxy_prompts_total", source="engine") == 0
        assert idle(f.router)


async def test_with_the_setting_off_or_kv_events_on_the_workers_tokenize(nats_server: EmbeddedNats) -> None:
    for kv_events, proxy in ((False, {"proxy_route_text_by_bytes": False}), (True, None)):
        async with fleet(nats_server.url, proxy=proxy, kv_events=kv_events) as f:
            await f.client.completions.create(model=MODEL, prompt="some text", max_tokens=1)
            await f.client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1
            )
            await f.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1)
            assert sum(api.tokenized for api in f.apis.values()) == 2
            text = await scrape(f.url)
            counts = {s: sample(text, "kv_router_proxy_prompts_total", source=s) for s in ("ids", "bytes", "engine")}
            assert counts == {"ids": 1, "bytes": 0, "engine": 2}
            assert idle(f.router)


async def test_an_instance_query_gets_the_engine_s_tokens_without_kv_events(nats_server: EmbeddedNats) -> None:
    async with fleet(nats_server.url, kv_events=False) as f, httpx.AsyncClient() as http:
        body = {"model": MODEL, "prompt": "héllo", "nvext": {"annotations": ["query_instance_id:"]}}
        reply = (await http.post(f"{f.url}/v1/completions", json=body)).json()
        assert reply["nvext"]["token_ids"] == list("héllo".encode())
        assert sum(api.tokenized for api in f.apis.values()) == 1
        assert idle(f.router)

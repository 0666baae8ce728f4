"""The mock worker's own OpenAI API (``mock-worker --http-port``), called directly as vLLM's would be:
batch prompts and ``n`` (a choice each, indexed as vLLM indexes them), and vLLM's refusal of
``max_tokens`` and ``n`` below 1. A real mock worker on a real nats-server, its KV events reaching a
router."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from mocker.openai_api import MockOpenAI, text_tokens
from router.event_plane.embedded_server import EmbeddedNats
from tests.proxy_fleet import MODEL, fleet
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

# Longer than a block (64 tokens, one per byte) and apart from the first byte on.
FIRST = "first prompt " * 12
SECOND = "second prompt " * 12


async def test_a_batch_prompt_and_n_answer_a_choice_each_numbered_as_vllm(nats_server: EmbeddedNats) -> None:
    async with fleet(nats_server.url, (1,)) as f:
        url = _url(f.apis[1])
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        try:
            batch = await client.completions.create(model=MODEL, prompt=[FIRST, SECOND], max_tokens=2)
            assert [(c.index, c.text) for c in batch.choices] == [(0, " w1 w2"), (1, " w1 w2")]
            assert batch.usage is not None
            assert (batch.usage.prompt_tokens, batch.usage.completion_tokens) == (len(FIRST) + len(SECOND), 4)
            # Each prompt was a request of its own to the engine: the router holds both prompts' blocks.
            for prompt in (FIRST, SECOND):
                tokens = text_tokens(prompt)
                await eventually(lambda tokens=tokens: f.router.overlap(tokens).workers[0].device_blocks == 2)
            ids = await client.completions.create(model=MODEL, prompt=[text_tokens(FIRST), [7, 8, 9]], max_tokens=1)
            assert [c.index for c in ids.choices] == [0, 1]
            # n samples per prompt, prompt by prompt: vLLM's index = prompt index * n + sample.
            both = await client.completions.create(model=MODEL, prompt=[FIRST, SECOND], n=2, max_tokens=3)
            assert [c.index for c in both.choices] == [0, 1, 2, 3]
            assert both.usage is not None
            assert (both.usage.prompt_tokens, both.usage.completion_tokens) == (len(FIRST) + len(SECOND), 12)
            chat = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_completion_tokens=2
            )
            assert [(c.index, c.message.content) for c in chat.choices] == [(0, " w1 w2"), (1, " w1 w2")]
            stream = await client.completions.create(
                model=MODEL, prompt=FIRST, n=2, max_tokens=3, stream=True, stream_options={"include_usage": True}
            )
            texts: dict[int, str] = {}
            finished: dict[int, str | None] = {}
            usage = None
            async for chunk in stream:
                for choice in chunk.choices:
                    texts[choice.index] = texts.get(choice.index, "") + choice.text
                    finished[choice.index] = choice.finish_reason
                usage = chunk.usage or usage
            assert texts == {0: " w1 w2 w3", 1: " w1 w2 w3"} and finished == {0: "length", 1: "length"}
            assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (len(FIRST), 6)
        finally:
            await client.close()


REFUSED = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": -2}, "max_tokens must be at least 1, got -2."),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens must be at least 1, got 0."),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n must be at least 1, got 0."),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "got 0."),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}, "-1."),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 0}, "max_tokens must be at least 1, got 0."),
    # Each was a plain-text 500 (a TypeError, a ValueError raised past the check, an AttributeError) or,
    # on /tokenize, a 200 echoing ids no engine has.
    ("/v1/completions", {"prompt": [1, [2]]}, "token ids are ints in 0 .. 2^32 - 1, got [2]"),
    ("/tokenize", {"prompt": [1, [2]]}, "token ids are ints in 0 .. 2^32 - 1, got [2]"),
    ("/v1/completions", {"prompt": [-1, 5]}, "token ids are ints in 0 .. 2^32 - 1, got -1"),
    ("/tokenize", {"prompt": [-1]}, "token ids are ints in 0 .. 2^32 - 1, got -1"),
    ("/v1/completions", {"prompt": [2**33]}, "got 8589934592"),
    ("/v1/completions", {"prompt": [[2**33]]}, "got 8589934592"),
    ("/v1/completions", {"prompt": [[1], [2, True]]}, "got `bool`"),
    ("/v1/completions", {"prompt": [[1], "text"]}, "a list of texts or of token id lists"),
    ("/v1/responses", {"input": [1, 2]}, "input: an item is an object with a role and content, got 1"),
    ("/v1/responses", {"input": [{"role": "user", "content": ["hi"]}]}, "content: a text, or a list of parts"),
]


async def test_max_tokens_or_n_below_one_or_malformed_prompts_are_a_400_as_vllm_answers(
    nats_server: EmbeddedNats,
) -> None:
    async with fleet(nats_server.url, (1,)) as f, httpx.AsyncClient() as http:
        for path, fields, says in REFUSED:
            reply = await http.post(f"{_url(f.apis[1])}{path}", content=json.dumps({"model": MODEL, **fields}))
            assert reply.status_code == 400, (path, fields, reply.text)
            error = reply.json()["error"]
            assert error["code"] == 400 and says in error["message"], (path, fields, error)
        assert f.apis[1].generated == 0  # refused before any engine request


def _url(api: MockOpenAI) -> str:
    return f"http://{api.host}:{api.port}"


async def test_a_decode_leg_pulls_no_more_than_its_prompts_blocks_whatever_its_params_claim(
    nats_server: EmbeddedNats,
) -> None:
    """Params naming a million remote blocks for a two-block prompt slept through the transfer of all
    of them (84 s); the pull is the prompt's blocks less those cached here."""
    async with fleet(nats_server.url, (1,)) as f, httpx.AsyncClient(timeout=30) as http:
        params = {"do_remote_prefill": True, "remote_block_ids": [1] * 1_000_000}
        prompt = list(range(1, 2 * f.workers[1].engine.block_size + 1))
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "kv_transfer_params": params}
        reply = await http.post(f"{_url(f.apis[1])}/v1/completions", content=json.dumps(body))
        assert reply.status_code == 200, reply.text
        assert f.apis[1].pulled_blocks == 2


@pytest.mark.parametrize("stream", [True, False])
async def test_an_answer_completed_by_the_last_pass_before_the_worker_stops_goes_out_whole(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """The engine's last pass completes a request and its loop ends in the same turn: the answer is
    whole and goes out (a stream's end was taken for a stopped worker's, a 503 or an error event)."""
    async with fleet(nats_server.url, (1,)) as f:
        worker = f.workers[1]
        feed = worker._feed_streams

        def feed_then_stop() -> None:  # as if `run` ended right after the pass that completed it
            streams = list(worker._streams.values())
            feed()
            if any(s.done for s in streams):
                worker.stopped = True

        monkeypatch.setattr(worker, "_feed_streams", feed_then_stop)
        client = openai.AsyncOpenAI(base_url=f"{_url(f.apis[1])}/v1", api_key="unused", max_retries=0)
        try:
            if stream:
                chunks = await client.completions.create(model=MODEL, prompt=FIRST, max_tokens=3, stream=True)
                texts = [chunk.choices[0].text async for chunk in chunks]
                assert "".join(texts) == " w1 w2 w3"
            else:
                whole = await client.completions.create(model=MODEL, prompt=FIRST, max_tokens=3)
                assert whole.choices[0].text == " w1 w2 w3"
            assert worker.stopped
        finally:
            await client.close()

"""Dynamo's ``query_instance_id`` on the OpenAI proxy, with the real `openai` client, a real
nats-server and mock workers: the decision in Dynamo 1.6's response ``nvext`` (``worker_id``,
``token_ids``), streamed or not, on both routes, aggregated and disaggregated; no worker gets the
request and nothing is booked."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from router.event_plane.embedded_server import EmbeddedNats
from router.types import WorkerConfig
from tests.metrics import sample
from tests.proxy_fleet import MODEL, Fleet, fleet, idle, raw_worker
from tests.test_api_proxy import BLOCK, scrape, stored_event

pytestmark = pytest.mark.anyio

QUERY = {"nvext": {"annotations": ["query_instance_id:"]}}  # as Dynamo's gateway sends it (stage 1)


def _aggregated(worker_id: int) -> dict[str, int]:
    return {"prefill_worker_id": worker_id, "prefill_dp_rank": 0, "decode_worker_id": worker_id, "decode_dp_rank": 0}


def _whole(chat: bool, tokens: list[int], worker_id: dict[str, int], reply: dict[str, Any]) -> dict[str, Any]:
    """The whole answer expected, with the generated ``id`` and ``created`` taken from ``reply``."""
    choice = {"message": {"role": "assistant", "content": ""}} if chat else {"text": ""}
    assert reply["id"].startswith("chatcmpl-" if chat else "cmpl-") and isinstance(reply["created"], int)
    return {
        "id": reply["id"],
        "object": "chat.completion" if chat else "text_completion",
        "created": reply["created"],
        "model": MODEL,
        "choices": [{"index": 0, **choice, "logprobs": None, "finish_reason": None}],
        "usage": {"prompt_tokens": len(tokens), "completion_tokens": 0, "total_tokens": len(tokens)},
        "nvext": {"worker_id": worker_id, "token_ids": tokens},
    }


def _chunk(chat: bool, tokens: list[int], worker_id: dict[str, int], event: dict[str, Any]) -> dict[str, Any]:
    choice = {"delta": {"role": "assistant"}} if chat else {"text": ""}
    return {
        "id": event["id"],
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": event["created"],
        "model": MODEL,
        "choices": [{"index": 0, **choice, "logprobs": None, "finish_reason": None}],
        "nvext": {"worker_id": worker_id, "token_ids": tokens},
    }


def _nothing_reached_a_worker(f: Fleet) -> None:
    assert [api.generated for api in f.apis.values()] == [0] * len(f.apis)
    assert all(worker.engine.stats.prompt_tokens == 0 for worker in f.workers.values())
    assert idle(f.router)


async def test_the_decision_comes_back_on_both_routes_streamed_or_not_and_nothing_runs(
    nats_server: EmbeddedNats,
) -> None:
    async with fleet(nats_server.url) as f:
        prompt = list(range(7000, 7000 + 4 * BLOCK))
        messages: Any = [{"role": "user", "content": "which worker holds me? " * 20}]
        async with httpx.AsyncClient(base_url=f.url) as http:
            # The chat's ids as the engine renders them (the proxy tokenizes it there too).
            chat_tokens = await http.post(
                f"{f.router.worker(1).url}/tokenize", json={"model": MODEL, "messages": messages}
            )
            chat_prompt = chat_tokens.json()["tokens"]
            for event_id, tokens in enumerate((prompt, chat_prompt), 1):  # worker 2 holds both: the choice
                event = stored_event(2, tokens)
                event["event"]["event_id"] = event_id
                assert (await http.post("/v1/events", json=event)).json()["applied"] == 1
        api = f.client
        holder = _aggregated(2)

        raw = await api.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=5, extra_body=QUERY)
        body = raw.http_response.json()
        assert body == _whole(False, prompt, holder, body)
        assert raw.headers["x-kv-router-worker"] == "2" and raw.headers["x-kv-router-cached-tokens"] == str(len(prompt))
        assert raw.parse().model_extra == {"nvext": body["nvext"]}  # the client keeps Dynamo's extension

        raw_chat = await api.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=5, extra_body=QUERY
        )
        body = raw_chat.http_response.json()
        assert body == _whole(True, chat_prompt, holder, body)

        for chat in (False, True):
            if chat:
                stream = await api.chat.completions.with_raw_response.create(
                    model=MODEL, messages=messages, max_tokens=5, stream=True, extra_body=QUERY
                )
            else:
                stream = await api.completions.with_raw_response.create(
                    model=MODEL, prompt=prompt, max_tokens=5, stream=True, extra_body=QUERY
                )
            assert stream.headers["content-type"] == "text/event-stream"
            events = (await stream.http_response.aread()).split(b"\n\n")
            assert len(events) == 3 and events[1:] == [b"data: [DONE]", b""]
            first = json.loads(events[0].removeprefix(b"data: "))
            assert first == _chunk(chat, chat_prompt if chat else prompt, holder, first)

        # The same through the client's own stream reader: one chunk, Dynamo's nvext on it.
        chunks = [
            c async for c in await api.completions.create(model=MODEL, prompt=prompt, stream=True, extra_body=QUERY)
        ]
        assert len(chunks) == 1 and chunks[0].model_extra == {"nvext": {"worker_id": holder, "token_ids": prompt}}
        _nothing_reached_a_worker(f)
        text = await scrape(f.url)
        assert sample(text, "kv_router_proxy_requests_total", route="completions", outcome="instance_query") == 3
        assert sample(text, "kv_router_proxy_requests_total", route="chat_completions", outcome="instance_query") == 2


async def test_which_annotations_ask_and_the_hints_still_apply(nats_server: EmbeddedNats) -> None:
    async with fleet(nats_server.url) as f:
        prompt = list(range(9000, 9000 + 2 * BLOCK))
        api = f.client
        # Any phase (Dynamo's gateway sets prefill / decode on its inner calls), and the bare form.
        for annotation in ("query_instance_id:decode", "query_instance_id"):
            hints = {"annotations": ["other", annotation], "backend_instance_id": 1, "dp_rank": 0}
            answer = await api.completions.create(model=MODEL, prompt=prompt, extra_body={"nvext": hints})
            assert answer.model_extra == {"nvext": {"worker_id": _aggregated(1), "token_ids": prompt}}
        _nothing_reached_a_worker(f)
        # A hint that cannot hold is refused as for any request, naming its field; nothing booked.
        async with httpx.AsyncClient(base_url=f.url) as http:
            body = {"model": MODEL, "prompt": prompt, "nvext": {**QUERY["nvext"], "backend_instance_id": 99}}
            refused = await http.post("/v1/completions", json=body)
        assert refused.status_code == 404 and "nvext.backend_instance_id" in refused.json()["error"]["message"]
        # Counted, as any refused hint (its error type was taken for an outcome, and the count failed).
        text = await scrape(f.url)
        assert sample(text, "kv_router_proxy_requests_total", route="completions", outcome="bad_request") == 1
        # Not Dynamo's key (its exact `query_instance_id:` prefix): an ordinary request, which runs.
        ran = await api.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, extra_body={"nvext": {"annotations": ["query_instance_id_x:1"]}}
        )
        assert ran.choices[0].text == " w1 w2" and ran.model_extra == {}
        assert sum(api.generated for api in f.apis.values()) == 1
        assert idle(f.router)


async def test_a_disaggregated_fleet_answers_both_legs_and_no_worker_is_contacted(nats_server: EmbeddedNats) -> None:
    contacted: list[bytes] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        contacted.append(await reader.read(4096))
        writer.close()

    async with raw_worker(record) as url, fleet(nats_server.url, ()) as f:
        for worker_id, role in ((1, "prefill"), (2, "decode"), (3, "decode")):
            f.router.register_worker(WorkerConfig(worker_id=worker_id, role=role, url=url, models=frozenset({MODEL})))
        api = f.client
        long_prompt = list(range(20_000, 20_000 + 40 * BLOCK))  # well over the remote-prefill threshold
        answer = await api.completions.create(model=MODEL, prompt=long_prompt, extra_body=QUERY)
        worker_id = answer.model_extra["nvext"]["worker_id"] if answer.model_extra else {}
        assert worker_id["decode_worker_id"] in (2, 3)
        assert worker_id == {"prefill_worker_id": 1, "prefill_dp_rank": 0,
                             "decode_worker_id": worker_id["decode_worker_id"], "decode_dp_rank": 0}  # fmt: skip
        # Legs pinned by hints (as the gateway's second stage sends them) are the ones named back.
        pinned = {"nvext": {**QUERY["nvext"], "prefill_worker_id": 1, "decode_worker_id": 3}}
        answer = await api.completions.create(model=MODEL, prompt=long_prompt, extra_body=pinned)
        expected = {"prefill_worker_id": 1, "prefill_dp_rank": 0, "decode_worker_id": 3, "decode_dp_rank": 0}
        assert answer.model_extra == {"nvext": {"worker_id": expected, "token_ids": long_prompt}}
        # A short prompt is prefilled by its decode worker: no prefill leg to name.
        short = list(range(1, 9))
        decode_only = {"nvext": {**QUERY["nvext"], "decode_worker_id": 3}}
        answer = await api.completions.create(model=MODEL, prompt=short, extra_body=decode_only)
        assert answer.model_extra == {
            "nvext": {"worker_id": {"decode_worker_id": 3, "decode_dp_rank": 0}, "token_ids": short}
        }
        assert contacted == [] and idle(f.router)

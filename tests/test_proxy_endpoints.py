"""The proxy's other OpenAI routes with the real `openai` client and mock workers: ``/v1/embeddings`` and
``/v1/rerank`` go to the least loaded worker (cache credit zeroed), ``/v1/responses`` is routed by its
prompt rendered as a chat (the engine's cached tokens are the router's prediction), streamed or not."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from router.event_plane.embedded_server import EmbeddedNats
from router.types import RouteDecision, RouteRequest
from tests.metrics import sample
from tests.proxy_fleet import MODEL, Fleet, fleet, idle
from tests.waiting import eventually

pytestmark = pytest.mark.anyio


async def load(f: Fleet, worker_id: int, request_id: str) -> None:
    """Another gateway's request, booked on ``worker_id``: its prefill loads that worker."""
    await f.router.new(RouteRequest(tokens=list(range(1, 2000)), request_id=request_id), pinned_worker=(worker_id, 0))


async def test_embeddings_and_rerank_go_to_the_least_loaded_worker(nats_server: EmbeddedNats) -> None:
    async with fleet(nats_server.url) as f:
        for busy, free in ((1, 2), (2, 1)):
            await load(f, busy, "elsewhere")
            raw = await f.client.embeddings.with_raw_response.create(model=MODEL, input="embed me " * 20)
            assert raw.headers["x-kv-router-worker"] == str(free)
            embedding = raw.parse().data[0].embedding
            assert embedding == [float(len("embed me " * 20)), float(free)]  # the engine that answered
            async with httpx.AsyncClient(base_url=f.url) as http:
                ranked = await http.post(
                    "/v1/rerank", json={"model": MODEL, "query": "which?", "documents": ["a", "b", "c"]}
                )
            assert ranked.status_code == 200 and ranked.headers["x-kv-router-worker"] == str(free)
            assert [result["document"]["text"] for result in ranked.json()["results"]] == ["a", "b", "c"]
            assert f.router.mark_free("elsewhere")
        assert f.apis[1].pooled == f.apis[2].pooled == 2
        assert idle(f.router)
        async with httpx.AsyncClient(base_url=f.url) as http:
            bad = await http.post("/v1/rerank", json={"model": MODEL, "query": "which?", "documents": []})
            assert bad.status_code == 400 and "documents is empty" in bad.json()["error"]["message"]
            text = (await http.get("/metrics")).text
        assert sample(text, "kv_router_proxy_requests_total", route="embeddings", outcome="ok") == 2
        assert sample(text, "kv_router_proxy_requests_total", route="rerank", outcome="ok") == 2
        assert sample(text, "kv_router_proxy_requests_total", route="rerank", outcome="bad_request") == 1


async def test_a_batch_is_routed_by_its_first_prompt_and_booked_with_them_all(nats_server: EmbeddedNats) -> None:
    """A batch of embeddings inputs or completion prompts loads its worker with every prompt's prefill:
    booked with its first alone, 256 inputs weighed as one. Rows of token ids count exactly; texts
    after the first at its tokens per byte."""
    async with fleet(nats_server.url) as f:
        booked: list[int] = []
        new = f.router.new

        async def watched(*args: Any, **kwargs: Any) -> RouteDecision:
            await eventually(lambda: idle(f.router))  # the request before freed: its load is not counted
            decision = await new(*args, **kwargs)
            booked.append(sum(load.active_prefill_tokens for load in f.router.rank_loads()))
            return decision

        f.router.new = watched  # type: ignore[method-assign]
        rows = [list(range(1, 101)), list(range(7, 207)), list(range(3, 53))]
        await f.client.embeddings.create(model=MODEL, input=rows)
        fresh = [[token + 1000 for token in row] for row in rows]  # nothing of it cached (completions get the credit)
        await f.client.completions.create(model=MODEL, prompt=fresh, max_tokens=2)
        single = await f.client.embeddings.create(model=MODEL, input="embed me " * 20)
        # As long, and none of it cached anywhere: its prefill is all it books.
        await f.client.embeddings.create(model=MODEL, input=["embed us " * 20] * 3)
        assert booked == [350, 350, single.usage.prompt_tokens, 3 * single.usage.prompt_tokens]
        assert idle(f.router)


async def test_a_response_is_routed_by_its_rendered_chat_streamed_or_not(nats_server: EmbeddedNats) -> None:
    async with fleet(nats_server.url) as f:
        instructions = "answer in three words " * 12
        question = [{"role": "user", "content": [{"type": "input_text", "text": "what is a radix tree?"}]}]
        raw = await f.client.responses.with_raw_response.create(
            model=MODEL, instructions=instructions, input=question, max_output_tokens=3
        )
        holder = raw.headers["x-kv-router-worker"]
        first = raw.parse()
        assert first.output_text == " w1 w2 w3"
        rendered = f"<|system|>\n{instructions}\n<|user|>\nwhat is a radix tree?\n<|assistant|>\n"
        assert first.usage is not None and first.usage.input_tokens == len(rendered)  # the tokens routed by
        tokens = list(rendered.encode())
        await eventually(
            lambda: any(row.worker_id == int(holder) and row.device_blocks for row in f.router.overlap(tokens).workers),
            what="the holder's blocks indexed",
        )
        # The same instructions again, streamed: to the holder, its cached prefix predicted exactly.
        again = await f.client.responses.with_raw_response.create(
            model=MODEL, instructions=instructions, input="and a trie?", max_output_tokens=4, stream=True
        )
        assert again.headers["x-kv-router-worker"] == holder
        predicted = int(again.headers["x-kv-router-cached-tokens"])
        assert predicted >= len(f"<|system|>\n{instructions}\n") // 64 * 64 > 0
        events = [event async for event in again.parse()]
        assert [event.type for event in events][-1] == "response.completed"  # no error event after it
        deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
        assert deltas == " w1 w2 w3 w4"
        completed = events[-1].response  # type: ignore[union-attr]
        assert completed.usage is not None
        assert completed.usage.input_tokens_details.cached_tokens == predicted  # what the engine really had
        assert idle(f.router)
        async with httpx.AsyncClient(base_url=f.url) as http:
            text = (await http.get("/metrics")).text
        assert sample(text, "kv_router_proxy_requests_total", route="responses", outcome="ok") == 2


@pytest.mark.parametrize(
    ("item", "field"),
    [
        ({"role": "user", "content": 5}, "input[1].content"),
        ({"role": "user", "content": {"text": "hi"}}, "input[1].content"),
        ({"role": None, "content": "hi"}, "input[1].role"),
    ],
)
async def test_a_response_input_item_of_the_wrong_shape_is_a_400_naming_it(
    nats_server: EmbeddedNats, item: dict[str, object], field: str
) -> None:
    """Refused as the engine refuses it, before anything is tokenized or booked (a number was handed
    to the chat template as a message's content, a null role routed as the role "None")."""
    async with fleet(nats_server.url, (1,)) as f, httpx.AsyncClient(base_url=f.url) as http:
        given = [{"role": "user", "content": "first"}, item]
        refused = await http.post("/v1/responses", json={"model": MODEL, "input": given})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error" and field in error["message"]
        assert f.apis[1].tokenized == 0 and f.workers[1].engine.stats.prompt_tokens == 0 and idle(f.router)

"""The OpenAI-compatible proxy with the real `openai` client, a real nats-server and mock workers that
serve the OpenAI API from their simulated engines (in-process uvicorn servers on loopback)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
import uvicorn

from indexer.hashing import compute_block_hashes, compute_sequence_hashes
from mocker.openai_api import write_model_files
from router.event_plane.embedded_server import EmbeddedNats, free_port
from router.types import RouteRequest, WorkerConfig
from tests.metrics import sample
from tests.proxy_fleet import MODEL, fleet, idle
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

BLOCK = 64


def stored_event(worker_id: int, prompt: list[int]) -> dict[str, Any]:
    """The KV event of a worker storing every full block of ``prompt``."""
    hashes = compute_block_hashes(prompt, BLOCK)
    blocks = [{"block_hash": s, "tokens_hash": t} for s, t in zip(compute_sequence_hashes(hashes), hashes, strict=True)]
    stored = {"stored": {"parent_hash": None, "blocks": blocks}}
    return {"worker_id": worker_id, "event": {"event_id": 1, "dp_rank": 0, "data": stored}}


async def scrape(url: str) -> str:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"{url}/metrics")).text


async def test_streamed_completion_and_chat_reach_the_client_and_free_their_bookings(
    nats_server: EmbeddedNats,
) -> None:
    async with fleet(nats_server.url) as f:
        api = f.client
        stream = await api.completions.create(model=MODEL, prompt="tell me " * 40, max_tokens=5, stream=True)
        texts = [chunk.choices[0].text async for chunk in stream]
        assert "".join(texts) == " w1 w2 w3 w4 w5"
        chat = await api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": "be brief " * 30}, {"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in chat]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " w1 w2 w3 w4"
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 4
        # The proxy tokenized the chat through the worker's /tokenize: the same ids the engine saw.
        assert usage.prompt_tokens == len(b"<|system|>\n" + b"be brief " * 30 + b"\n<|user|>\nhi\n<|assistant|>\n")
        assert idle(f.router)
        models = await api.models.list()
        assert [model.id for model in models.data] == [MODEL]


async def test_same_prefix_lands_on_the_holder_and_calibration_is_recorded(nats_server: EmbeddedNats) -> None:
    async with fleet(nats_server.url) as f:
        api = f.client
        prefix = list(range(1000, 1000 + 8 * BLOCK))
        first = await api.completions.with_raw_response.create(model=MODEL, prompt=[*prefix, 1], max_tokens=2)
        holder = int(first.headers["x-kv-router-worker"])
        assert first.headers["x-kv-router-dp-rank"] == "0"
        assert first.headers["x-kv-router-cached-tokens"] == "0"
        hashes = compute_sequence_hashes(compute_block_hashes(prefix, BLOCK))

        def holder_indexed() -> bool:
            rows = f.router.overlap(prefix).workers
            return any(row.worker_id == holder and row.device_blocks == len(hashes) for row in rows)

        await eventually(holder_indexed)
        for suffix in range(2, 6):
            raw = await api.completions.with_raw_response.create(model=MODEL, prompt=[*prefix, suffix], max_tokens=2)
            assert int(raw.headers["x-kv-router-worker"]) == holder
            assert int(raw.headers["x-kv-router-cached-tokens"]) == 8 * BLOCK
            completion = raw.parse()
            assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
            assert completion.usage.prompt_tokens_details.cached_tokens == 8 * BLOCK  # what the pool really had
        assert idle(f.router)
        text = await scrape(f.url)
        assert sample(text, "kv_router_proxy_cache_calibration", worker_id=str(holder)) == 1.0
        assert sample(text, "kv_router_proxy_cached_tokens_error_bucket", le="0.0") == 5
        assert sample(text, "kv_router_proxy_cached_tokens_error_bucket", le="-1.0") == 0
        assert sample(text, "kv_router_proxy_requests_total", route="completions", outcome="ok") == 5


async def test_a_client_leaving_mid_stream_frees_its_booking_and_cancels_the_engine_request(
    nats_server: EmbeddedNats,
) -> None:
    async with fleet(nats_server.url, (1,)) as f:
        api = f.client
        stream = await api.completions.create(model=MODEL, prompt=list(range(1, 300)), max_tokens=5000, stream=True)
        received = 0
        async for _chunk in stream:
            received += 1
            if received == 3:
                break
        assert not idle(f.router)  # still booked while it streams
        await stream.close()
        await eventually(lambda: idle(f.router))
        await eventually(lambda: f.apis[1].aborted == 1)  # the upstream request was cancelled too
        assert not f.workers[1].engine.has_work()
        text = await scrape(f.url)
        assert sample(text, "kv_router_proxy_requests_total", route="completions", outcome="client_disconnected") == 1


async def _failing_server(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A worker whose engine is broken: every request is a 503."""
    assert scope["type"] == "http"
    body = b'{"error": {"message": "engine dead", "type": "internal", "code": 503}}'
    await send({"type": "http.response.start", "status": 503, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def failing_worker(how: str) -> AsyncIterator[str]:
    """The URL of a worker that refuses connections (nothing listens) or answers 5xx."""
    port = free_port()
    if how == "refused":
        yield f"http://127.0.0.1:{port}"
        return
    config = uvicorn.Config(_failing_server, host="127.0.0.1", port=port, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    await eventually(lambda: server.started)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await serving


@pytest.mark.parametrize("how", ["refused", "5xx"])
async def test_a_failing_worker_sends_the_request_to_the_next_best_and_its_circuit_opens(
    nats_server: EmbeddedNats, how: str
) -> None:
    async with fleet(nats_server.url, (1,), router={"worker_breaker_failures": 1}) as f, failing_worker(how) as url:
        # Worker 9 claims the prompt's blocks, so it is the router's first choice, but it fails.
        dead = WorkerConfig(worker_id=9, block_size=BLOCK, url=url, models=frozenset({MODEL}))
        async with httpx.AsyncClient(base_url=f.url) as http:
            assert (await http.post("/v1/workers", content=msgspec.json.encode(dead))).status_code == 201
            prompt = list(range(5000, 5000 + 4 * BLOCK))
            assert (await http.post("/v1/events", json=stored_event(9, prompt))).json()["applied"] == 1
        assert f.router.overlap(prompt).workers[-1].device_blocks == 4
        api = f.client
        raw = await api.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert raw.headers["x-kv-router-worker"] == "1"
        assert raw.parse().choices[0].text == " w1 w2"
        assert f.router.health.state(9) == "open"
        # While its circuit is open it is not tried again.
        raw = await api.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert raw.headers["x-kv-router-worker"] == "1"
        text = await scrape(f.url)
        assert sample(text, "kv_router_proxy_upstream_failures_total") == 1
        assert idle(f.router)


async def test_queue_rejection_is_a_429_with_retry_after(nats_server: EmbeddedNats) -> None:
    router = {"router_queue_threshold": 0.0, "router_queue_request_limit_per_worker": 1}
    async with fleet(nats_server.url, (1,), router=router, proxy={"proxy_retry_after_secs": 3}) as f:
        # Another gateway's requests hold the only worker's prefill and the one place in the queue.
        await f.router.new(RouteRequest(tokens=list(range(1, 200)), request_id="elsewhere"))
        queued = asyncio.ensure_future(f.router.new(RouteRequest(tokens=list(range(1, 50)), request_id="queued")))
        await eventually(lambda: f.router.queue_stats().pending_count == 1)
        api = f.client
        with pytest.raises(openai.RateLimitError) as caught:
            await api.completions.create(model=MODEL, prompt=list(range(1, 100)), max_tokens=2)
        assert caught.value.response.headers["retry-after"] == "3"
        assert caught.value.response.json()["error"]["type"] == "rate_limit_exceeded"
        assert f.router.mark_free("elsewhere")
        await queued
        assert f.router.mark_free("queued")
        completion = await api.completions.create(model=MODEL, prompt=list(range(1, 100)), max_tokens=2)
        assert completion.choices[0].text == " w1 w2"
        assert idle(f.router)


@pytest.mark.parametrize(
    ("path", "body", "problem"),
    [
        ("/v1/completions", b"{not json", "malformed"),
        ("/v1/completions", b'{"prompt": "hi"}', "model"),
        ("/v1/completions", b'{"model": "mock-model", "prompt": 7}', "prompt"),
        ("/v1/completions", b'{"model": "mock-model", "prompt": []}', "empty"),
        ("/v1/completions", b'{"model": "mock-model", "prompt": [1, -2]}', "token ids"),
        ("/v1/completions", b'{"model": "mock-model", "prompt": [1, "a"]}', "mixes"),
        ("/v1/chat/completions", b'{"model": "mock-model", "messages": []}', "empty"),
        ("/v1/chat/completions", b'{"model": "mock-model", "messages": [{"content": "x"}]}', "role"),
        ("/v1/chat/completions", b'{"model": "mock-model", "x": ' + b"[" * 3000, "recursion"),  # past msgspec's depth
    ],
)
async def test_a_malformed_body_is_a_400_and_books_nothing(
    nats_server: EmbeddedNats, path: str, body: bytes, problem: str
) -> None:
    async with fleet(nats_server.url, (1,)) as f:
        async with httpx.AsyncClient(base_url=f.url) as http:
            reply = await http.post(path, content=body, headers={"content-type": "application/json"})
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error" and problem in error["message"].lower()
        assert idle(f.router)
        assert f.workers[1].engine.stats.prompt_tokens == 0  # nothing reached the worker either
        route = path.removeprefix("/v1/").replace("/", "_")
        assert sample(await scrape(f.url), "kv_router_proxy_requests_total", outcome="bad_request", route=route) == 1


async def test_nvext_pins_a_worker_as_route_does_and_names_what_it_refuses(nats_server: EmbeddedNats) -> None:
    async with fleet(nats_server.url) as f:
        prompt = list(range(5000, 5000 + 4 * BLOCK))
        async with httpx.AsyncClient(base_url=f.url) as http:
            assert (await http.post("/v1/events", json=stored_event(1, prompt))).json()["applied"] == 1
        api = f.client
        raw = await api.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert raw.headers["x-kv-router-worker"] == "1"  # the holder, left to itself
        # Dynamo's extension, read by the same struct as /v1/route's hints: the pin wins over the cache.
        nvext = {"backend_instance_id": 2, "dp_rank": 0, "priority": 5, "annotations": [],
                 "agent_hints": {"osl": 8, "priority": 2.5, "strict_priority": 1}}  # fmt: skip
        raw = await api.completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=2, extra_body={"nvext": nvext}
        )
        assert raw.headers["x-kv-router-worker"] == "2" and raw.parse().choices[0].text == " w1 w2"
        with pytest.raises(openai.NotFoundError) as unknown:
            await api.completions.create(
                model=MODEL, prompt=prompt, max_tokens=2, extra_body={"nvext": {"backend_instance_id": 99}}
            )
        assert (
            "nvext.backend_instance_id: worker 99 is not registered"
            in unknown.value.response.json()["error"]["message"]
        )
        with pytest.raises(openai.BadRequestError) as bad:
            await api.completions.create(
                model=MODEL, prompt=prompt, max_tokens=2, extra_body={"nvext": {"dp_rank": -1}}
            )
        assert "nvext.dp_rank" in bad.value.response.json()["error"]["message"]
        assert idle(f.router)


async def test_an_nvext_worker_id_past_u64_is_refused_naming_it(nats_server: EmbeddedNats) -> None:
    """Dynamo fails to deserialize a worker id above u64: refused as any bad nvext field, not a 404 for a
    worker that cannot exist."""
    async with fleet(nats_server.url) as f:
        prompt = list(range(5000, 5000 + 4 * BLOCK))
        async with httpx.AsyncClient(base_url=f.url) as http:
            for name in ("backend_instance_id", "prefill_worker_id", "decode_worker_id"):
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "nvext": {name: 2**64}}
                refused = await http.post("/v1/completions", json=body)
                assert refused.status_code == 400, refused.text
                message = refused.json()["error"]["message"]
                assert name in message and "$.nvext" in message and "u64" in message
        assert idle(f.router)


async def test_an_unknown_model_is_a_404_naming_the_models_served(nats_server: EmbeddedNats) -> None:
    async with fleet(nats_server.url, (1,)) as f:
        with pytest.raises(openai.NotFoundError) as caught:
            await f.client.completions.create(model="other", prompt="hi", max_tokens=2)
        message = caught.value.response.json()["error"]["message"]
        assert message == f"the model 'other' does not exist here: the workers serve {MODEL!r}"
        assert idle(f.router)


async def test_many_concurrent_streams_leave_no_load_behind(nats_server: EmbeddedNats) -> None:
    async with fleet(nats_server.url) as f:
        api = f.client

        async def one(i: int) -> str:
            stream = await api.completions.create(
                model=MODEL, prompt=list(range(i % 4 * 1000, i % 4 * 1000 + 200)), max_tokens=3, stream=True
            )
            return "".join([chunk.choices[0].text async for chunk in stream])

        texts = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(40))), 60)
        assert texts == [" w1 w2 w3"] * 40
        assert idle(f.router)


def reported_cached(usage: Any) -> int:
    return int(usage.prompt_tokens_details.cached_tokens)


async def test_a_model_with_local_files_is_tokenized_by_the_proxy_for_text_and_chat(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    files = write_model_files(tmp_path / "model")
    async with fleet(nats_server.url, proxy={"tokenizer": [f"{MODEL}={files}"]}) as f:
        prefix = "the same long system prompt. " * 20  # 580 characters: 9 blocks of 64
        first = await f.client.completions.with_raw_response.create(model=MODEL, prompt=prefix + "one", max_tokens=2)
        holder = first.headers["x-kv-router-worker"]
        ids = list(prefix.encode())

        def indexed(ids: list[int]) -> bool:
            return any(row.device_blocks == len(ids) // BLOCK for row in f.router.overlap(ids).workers)

        await eventually(lambda: indexed(ids))
        second = await f.client.completions.with_raw_response.create(model=MODEL, prompt=prefix + "two", max_tokens=2)
        assert second.headers["x-kv-router-worker"] == holder
        assert int(second.headers["x-kv-router-cached-tokens"]) == len(ids) // BLOCK * BLOCK
        assert reported_cached(second.parse().usage) == len(ids) // BLOCK * BLOCK

        # Chat: rendered here by the model's template, the engine's tokens; the prediction is what it reports.
        system: Any = {"role": "system", "content": "You answer questions about routing. " * 12}
        await f.client.chat.completions.create(
            model=MODEL, messages=[system, {"role": "user", "content": "first?"}], max_tokens=1
        )
        rendered = list(f"<|system|>\n{system['content']}\n<|user|>\n".encode())
        await eventually(lambda: indexed(rendered))
        again = await f.client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[system, {"role": "user", "content": "second?"}],
            max_tokens=1,
        )
        predicted = int(again.headers["x-kv-router-cached-tokens"])
        assert predicted == len(rendered) // BLOCK * BLOCK > 0
        assert reported_cached(again.parse().usage) == predicted
        assert all(api.tokenized == 0 for api in f.apis.values())  # no worker was asked to tokenize
        assert sample(await scrape(f.url), "kv_router_proxy_prompts_total", source="local") == 4
        assert idle(f.router)


async def test_a_chat_the_models_template_refuses_is_a_400_naming_its_reason(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    files = write_model_files(tmp_path / "model")
    refusing = "{{ raise_exception('only one message, please') if messages | length > 1 }}"
    (files / "chat_template.jinja").write_text(refusing)
    async with fleet(nats_server.url, proxy={"tokenizer": [f"{MODEL}={files}"]}) as f:
        two = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
        async with httpx.AsyncClient() as http:
            refused = await http.post(f"{f.url}/v1/chat/completions", json={"model": MODEL, "messages": two})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["message"] == "the chat template refused the messages: only one message, please"
        assert all(api.tokenized == 0 for api in f.apis.values()) and idle(f.router)


async def test_without_local_files_text_and_chat_are_tokenized_by_a_worker(nats_server: EmbeddedNats) -> None:
    async with fleet(nats_server.url) as f:
        await f.client.completions.create(model=MODEL, prompt="some text", max_tokens=1)
        await f.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        assert sum(api.tokenized for api in f.apis.values()) == 2
        assert idle(f.router)


async def test_a_chat_the_engines_tokenize_refuses_is_its_400_at_once(nats_server: EmbeddedNats) -> None:
    """Without local files, a chat the engine's ``/tokenize`` refuses (vLLM: its template's
    ``raise_exception``, its request validation) is the client's 400 with the engine's reason, as the
    engine's own chat endpoint would answer; not a 503 after asking every worker (each would refuse it)."""
    async with fleet(nats_server.url) as f:
        messages: Any = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
        with pytest.raises(openai.BadRequestError) as refused:
            await f.client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=1, extra_body={"continue_final_message": True}
            )
        error: Any = refused.value.body
        assert error["type"] == "invalid_request_error"
        assert "Cannot set both `continue_final_message` and `add_generation_prompt`" in error["message"]
        assert sum(api.tokenized for api in f.apis.values()) == 1
        assert all(worker.engine.stats.prompt_tokens == 0 for worker in f.workers.values()) and idle(f.router)
        text = await scrape(f.url)
        assert sample(text, "kv_router_proxy_requests_total", route="chat_completions", outcome="bad_request") == 1


async def test_a_client_leaving_while_queued_leaves_the_queue_and_books_nothing(nats_server: EmbeddedNats) -> None:
    router = {"router_queue_threshold": 0.0, "router_queue_request_limit_per_worker": 4}
    async with fleet(nats_server.url, (1,), router=router) as f:
        await f.router.new(RouteRequest(tokens=list(range(1, 200)), request_id="elsewhere"))
        waiting = asyncio.ensure_future(
            f.client.completions.create(model=MODEL, prompt=list(range(1, 100)), max_tokens=2)
        )
        await eventually(lambda: f.router.queue_stats().pending_count == 1)
        waiting.cancel()  # the client goes away: its connection closes
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        await eventually(lambda: f.router.queue_stats().pending_count == 0)
        assert f.router.mark_free("elsewhere")
        assert idle(f.router)
        assert f.workers[1].engine.stats.prompt_tokens == 0  # it never reached the worker
        text = await scrape(f.url)
        assert sample(text, "kv_router_proxy_requests_total", route="completions", outcome="client_disconnected") == 1


async def test_a_worker_without_a_url_is_never_proxied_to(nats_server: EmbeddedNats) -> None:
    async with fleet(nats_server.url, (1,)) as f:
        prompt = list(range(7000, 7000 + 4 * BLOCK))
        event = stored_event(7, prompt)
        async with httpx.AsyncClient(base_url=f.url) as http:
            # Routed by /v1/new only (another gateway's worker): it holds the whole prompt.
            registered = await http.post("/v1/workers", json={"worker_id": 7, "block_size": BLOCK, "models": ["other"]})
            assert registered.status_code == 201
            assert (await http.post("/v1/events", json=event)).json()["applied"] == 1
            decision = (await http.post("/v1/new", json={"tokens": prompt, "request_id": "direct"})).json()
            assert decision["worker_id"] == 7  # the decision API still sees it
            assert (await http.post("/v1/mark_free", json={"request_id": "direct"})).status_code == 200
        raw = await f.client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=1)
        assert raw.headers["x-kv-router-worker"] == "1"
        assert [model.id for model in (await f.client.models.list()).data] == [MODEL]
        assert idle(f.router)


@pytest.mark.anyio
async def test_a_stream_outlasting_the_request_expiry_keeps_its_booking_to_its_end(
    nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    """request_expiry_secs frees bookings their callers forgot; the proxy frees its own on every path.
    A generation longer than it (300 s by default: a reasoning model's long answer) was expired while it
    still decoded, its worker looking idle to every decision meanwhile."""
    from mocker.config import EngineConfig

    slow = EngineConfig(num_gpu_blocks=512, speedup_ratio=2.0)  # about 3 ms a token
    async with fleet(nats_server.url, (1,), engine=slow, router={"request_expiry_secs": 0.3}) as f:
        stream = await f.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=600, stream=True)
        pieces = 0
        async for _ in stream:
            pieces += 1
            if pieces in (200, 400):  # past the expiry: a decision (which expires stale bookings first)
                assert f.router.expire_stale() == []
                await f.client.completions.create(model=MODEL, prompt=[9, 9, 9], max_tokens=1)
                assert sum(load.active_requests for load in f.router.rank_loads()) == 1  # the stream's own
        assert pieces > 400
        assert "expiring" not in caplog.text
        await eventually(lambda: idle(f.router))

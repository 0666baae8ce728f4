"""The proxy's two ways in, with the real `openai` client: its routes answered inside the HTTP
protocol (the default) and as FastAPI routes (``fast_protocol`` off), their refusals (413, 401) in
OpenAI's shape and counted alike; and a worker whose stream breaks in the middle of a chunk, whose
client gets the SSE error event while nothing stays booked."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import msgspec
import openai
import pytest

from router.event_plane.embedded_server import EmbeddedNats
from router.types import WorkerConfig
from tests.metrics import sample
from tests.proxy_fleet import MODEL, SSE_HEAD, fleet, idle, raw_worker, sse_chunk
from tests.waiting import eventually

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("fast_protocol", [True, False])
async def test_streams_whole_answers_and_disconnects_on_either_path(
    nats_server: EmbeddedNats, fast_protocol: bool
) -> None:
    async with fleet(nats_server.url, (1,), service={"fast_protocol": fast_protocol}) as f:
        api = f.client
        raw = await api.completions.with_raw_response.create(
            model=MODEL, prompt=list(range(1, 200)), max_tokens=4, stream=True
        )
        assert raw.headers["x-kv-router-worker"] == "1" and raw.headers["content-type"] == "text/event-stream"
        assert "".join([chunk.choices[0].text async for chunk in raw.parse()]) == " w1 w2 w3 w4"
        whole = await api.completions.create(model=MODEL, prompt=list(range(1, 200)), max_tokens=3)
        assert whole.choices[0].text == " w1 w2 w3"
        chat = await api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
        )
        assert "".join([c.choices[0].delta.content or "" async for c in chat if c.choices]) == " w1 w2"
        # A client leaving mid-stream frees its booking and stops the engine's request.
        stream = await api.completions.create(model=MODEL, prompt=list(range(1, 300)), max_tokens=5000, stream=True)
        async for _chunk in stream:
            break
        await stream.close()
        await eventually(lambda: idle(f.router))
        await eventually(lambda: f.apis[1].aborted == 1)
        # Sequential requests reuse the worker connection the first one opened.
        assert f.app.proxy is not None
        pool = next(iter(f.app.proxy.upstream._pools.values()))
        assert pool.opened <= 2  # the aborted stream's connection was closed, one is kept alive


def breaking_worker() -> contextlib.AbstractAsyncContextManager[str]:
    """A worker that starts an SSE stream, sends one event and half a chunk, then closes."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(SSE_HEAD + sse_chunk(" w1") + b"40\r\ndata: {")
        await writer.drain()
        writer.close()

    return raw_worker(serve)


async def test_a_stream_broken_mid_chunk_ends_with_the_sse_error_event_and_frees_the_booking(
    nats_server: EmbeddedNats,
) -> None:
    async with fleet(nats_server.url, ()) as f, breaking_worker() as url:
        broken = WorkerConfig(worker_id=5, block_size=64, url=url, models=frozenset({MODEL}))
        async with httpx.AsyncClient(base_url=f.url) as http:
            assert (await http.post("/v1/workers", content=msgspec.json.encode(broken))).status_code == 201
        stream = await f.client.completions.create(model=MODEL, prompt=list(range(1, 100)), max_tokens=8, stream=True)
        texts = []
        with pytest.raises(openai.APIError, match="failed mid-stream"):
            async for chunk in stream:
                texts.append(chunk.choices[0].text)
        assert texts == [" w1"]
        assert idle(f.router)
        assert f.router.health.availability(5).consecutive_failures == 1  # told to its circuit breaker
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"{f.url}/metrics")).text
        assert sample(text, "kv_router_proxy_requests_total", route="completions", outcome="upstream_error") == 1


def slow_first_token_worker() -> contextlib.AbstractAsyncContextManager[str]:
    """A worker that sends its answer's head at once and its first event only later (its prefill)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(SSE_HEAD)
        await writer.drain()
        await asyncio.sleep(0.1)  # the behaviour under test: a slow prefill before the first event
        writer.write(sse_chunk(" w1") + sse_chunk(" w2") + b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
        await writer.drain()
        writer.close()

    return raw_worker(serve)


@pytest.mark.parametrize("fast_protocol", [True, False])
async def test_a_first_event_after_the_head_gives_the_client_one_head_with_the_router_s_headers(
    nats_server: EmbeddedNats, fast_protocol: bool
) -> None:
    async with (
        fleet(nats_server.url, (), service={"fast_protocol": fast_protocol}) as f,
        slow_first_token_worker() as url,
    ):
        slow = WorkerConfig(worker_id=7, block_size=64, url=url, models=frozenset({MODEL}))
        async with httpx.AsyncClient(base_url=f.url) as http:
            assert (await http.post("/v1/workers", content=msgspec.json.encode(slow))).status_code == 201
        raw = await f.client.completions.with_raw_response.create(
            model=MODEL, prompt=list(range(1, 100)), max_tokens=2, stream=True
        )
        assert raw.headers.get_list("content-type") == ["text/event-stream"]
        assert raw.headers.get_list("x-kv-router-worker") == ["7"]
        assert "".join([chunk.choices[0].text async for chunk in raw.parse()]) == " w1 w2"
        assert idle(f.router)


@pytest.mark.parametrize("fast_protocol", [True, False])
async def test_a_body_over_the_limit_is_an_openai_shaped_413_and_books_nothing(
    nats_server: EmbeddedNats, fast_protocol: bool
) -> None:
    limit = 4096
    service = {"fast_protocol": fast_protocol, "max_body_bytes": limit}
    async with fleet(nats_server.url, (1,), service=service) as f:
        with pytest.raises(openai.APIStatusError) as caught:
            await f.client.completions.create(model=MODEL, prompt=list(range(1, 2000)), max_tokens=2)
        assert caught.value.status_code == 413
        assert caught.value.body == {
            "message": f"request body exceeds the limit of {limit} bytes",
            "type": "invalid_request_error",
            "param": None,
            "code": 413,
        }

        async def pieces() -> AsyncIterator[bytes]:  # no content-length: the body grows past the limit
            yield b'{"model": "mock-model", "messages": [{"role": "user", "content": "'
            for _ in range(8):
                yield b"x" * 1024
            yield b'"}]}'

        async with httpx.AsyncClient(base_url=f.url) as http:
            chunked = await http.post("/v1/chat/completions", content=pieces())
            # The decision API keeps the service's own error shape.
            service_reply = await http.post("/v1/new", content=b"[" + b"1," * limit + b"1]")
            text = (await http.get("/metrics")).text
        assert chunked.status_code == 413
        assert set(chunked.json()["error"]) == {"message", "type", "param", "code"}
        assert service_reply.status_code == 413 and "param" not in service_reply.json()["error"]
        # Counted as the bad requests they are, whichever path refused them.
        for route in ("completions", "chat_completions"):
            assert sample(text, "kv_router_proxy_requests_total", route=route, outcome="bad_request") == 1
        assert idle(f.router)
        assert f.workers[1].engine.stats.prompt_tokens == 0  # nothing reached the worker


@pytest.mark.parametrize("fast_protocol", [True, False])
async def test_a_prompt_over_the_token_limit_is_the_same_413_as_the_decision_api_s(
    nats_server: EmbeddedNats, fast_protocol: bool
) -> None:
    limit = 64
    service = {"fast_protocol": fast_protocol, "max_prompt_tokens": limit}
    async with fleet(nats_server.url, (1,), service=service) as f:
        with pytest.raises(openai.APIStatusError) as caught:
            await f.client.completions.create(model=MODEL, prompt=list(range(1, 100)), max_tokens=2)
        async with httpx.AsyncClient(base_url=f.url) as http:
            service_reply = await http.post("/v1/new", content=msgspec.json.encode({"tokens": list(range(1, 100))}))
            text = (await http.get("/metrics")).text
        assert caught.value.status_code == service_reply.status_code == 413
        message = f"prompt has 99 tokens; the limit is {limit}"
        assert caught.value.body == {"message": message, "type": "invalid_request_error", "param": None, "code": 413}
        assert service_reply.json()["error"]["message"].endswith(message)
        assert sample(text, "kv_router_proxy_requests_total", route="completions", outcome="bad_request") == 1
        assert idle(f.router)
        assert f.workers[1].engine.stats.prompt_tokens == 0


@pytest.mark.parametrize("fast_protocol", [True, False])
async def test_a_request_without_the_api_token_is_an_openai_shaped_401_and_books_nothing(
    nats_server: EmbeddedNats, fast_protocol: bool
) -> None:
    token = "proxy-token-0123456789abcdef"
    service = {"fast_protocol": fast_protocol}
    security = {"api_token": token, "protect_decisions": True, "protect_reads": True}
    async with fleet(nats_server.url, (1,), service=service, security=security) as f:
        refused = {
            "message": "this route needs the API token: Authorization: Bearer <token>",
            "type": "unauthorized",
            "param": None,
            "code": 401,
        }
        with pytest.raises(openai.AuthenticationError) as caught:
            await f.client.completions.create(model=MODEL, prompt=list(range(1, 100)), max_tokens=2, stream=True)
        assert caught.value.body == refused
        assert caught.value.response.headers["www-authenticate"] == 'Bearer realm="kv-router"'
        with pytest.raises(openai.AuthenticationError) as caught:
            await f.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert caught.value.body == refused
        with pytest.raises(openai.AuthenticationError) as caught:
            await f.client.models.list()
        assert caught.value.body == refused
        assert idle(f.router) and f.workers[1].engine.stats.prompt_tokens == 0
        # The decision API keeps the service's own shape for the same refusal.
        async with httpx.AsyncClient(base_url=f.url) as http:
            service_reply = await http.post("/v1/new", content=b'{"tokens": [1, 2, 3]}')
        assert service_reply.status_code == 401 and set(service_reply.json()["error"]) == {"type", "message"}
        # With the token, the same client is served.
        async with openai.AsyncOpenAI(base_url=f"{f.url}/v1", api_key=token, max_retries=0) as allowed:
            whole = await allowed.completions.create(model=MODEL, prompt=list(range(1, 100)), max_tokens=2)
            assert whole.choices[0].text == " w1 w2"
            assert [model.id async for model in allowed.models.list()] == [MODEL]
        # Each refusal is counted on its route (the models list is a read, not a proxied request).
        async with httpx.AsyncClient(base_url=f.url, headers={"authorization": f"Bearer {token}"}) as http:
            text = (await http.get("/metrics")).text
        for route in ("completions", "chat_completions"):
            assert sample(text, "kv_router_proxy_requests_total", route=route, outcome="unauthorized") == 1
        assert sample(text, "kv_router_proxy_requests_total", route="completions", outcome="ok") == 1

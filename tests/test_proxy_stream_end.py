"""A stream the client read to its last event is a finished request, even when the client closes the
connection before the worker's answer has ended: the official `openai` client waits only 0.1 s for the
rest of the HTTP answer after ``data: [DONE]`` and then closes. Such a stream counts as ``ok``, in the
calibration of predicted against reported cached tokens and in the proxy's latency histogram, on both
ways in; a stream left before its last event is still ``client_disconnected``."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import msgspec
import pytest

from router.event_plane.embedded_server import EmbeddedNats
from router.types import WorkerConfig
from tests.metrics import sample
from tests.proxy_fleet import MODEL, SSE_HEAD, fleet, idle, raw_worker, sse_chunk
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

USAGE = (
    b'data: {"choices": [], "object": "text_completion", "usage": {"prompt_tokens": 99, "completion_tokens": 2,'
    b' "total_tokens": 101, "prompt_tokens_details": {"cached_tokens": 64}}}\n\n'
)


def chunk(event: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(event), event)


def slow_to_end_worker(
    release: asyncio.Event, last_event: bytes = b"data: [DONE]\n\n"
) -> contextlib.AbstractAsyncContextManager[str]:
    """A worker that streams two tokens, its usage and ``last_event``, and ends its HTTP answer only
    once ``release`` is set (as vLLM does when its generator's clean-up is slow)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(SSE_HEAD + sse_chunk(" w1") + sse_chunk(" w2") + chunk(USAGE) + chunk(last_event))
        await writer.drain()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(release.wait(), 10)
        writer.write(b"0\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    return raw_worker(serve)


async def outcomes(url: str) -> tuple[str, dict[str, float | None]]:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{url}/metrics")).text
    found = {
        outcome: sample(text, "kv_router_proxy_requests_total", route="completions", outcome=outcome)
        for outcome in ("ok", "client_disconnected")
    }
    return text, found


async def settled(url: str) -> dict[str, float | None]:
    """The outcomes once the request has been counted."""
    found: dict[str, float | None] = {}

    async def counted() -> bool:
        nonlocal found
        _, found = await outcomes(url)
        return bool(found["ok"] or found["client_disconnected"])

    await eventually(counted, what="the request is counted")
    return found


@pytest.mark.parametrize("fast_protocol", [True, False])
async def test_a_stream_read_to_data_done_by_the_openai_client_is_ok_and_calibrated(
    nats_server: EmbeddedNats, fast_protocol: bool
) -> None:
    release = asyncio.Event()
    async with (
        fleet(nats_server.url, (), service={"fast_protocol": fast_protocol}) as f,
        slow_to_end_worker(release) as url,
    ):
        worker = WorkerConfig(worker_id=7, block_size=64, url=url, models=frozenset({MODEL}))
        async with httpx.AsyncClient(base_url=f.url) as http:
            assert (await http.post("/v1/workers", content=msgspec.json.encode(worker))).status_code == 201
        stream = await f.client.completions.create(
            model=MODEL, prompt=list(range(1, 100)), max_tokens=2, stream=True, stream_options={"include_usage": True}
        )
        chunks = [piece async for piece in stream]  # the client closes 0.1 s after [DONE]
        assert "".join(piece.choices[0].text for piece in chunks if piece.choices) == " w1 w2"
        assert chunks[-1].usage is not None

        found = await settled(f.url)
        release.set()
        assert found == {"ok": 1.0, "client_disconnected": 0.0}
        await eventually(lambda: idle(f.router))
        text, _ = await outcomes(f.url)
        # The engine's 64 cached tokens against the router's prediction (0: nothing was indexed).
        assert sample(text, "kv_router_proxy_calibration_samples", worker_id="7") == 1
        assert sample(text, "kv_router_proxy_cached_tokens_error_bucket", le="64.0") == 1
        assert sample(text, "kv_router_proxy_cached_tokens_error_bucket", le="16.0") == 0
        assert sample(text, "kv_router_proxy_added_seconds_count") == 1


@pytest.mark.parametrize("fast_protocol", [True, False])
async def test_a_stream_left_before_its_last_event_is_still_client_disconnected(
    nats_server: EmbeddedNats, fast_protocol: bool
) -> None:
    release = asyncio.Event()
    unfinished = b'data: {"choices": [{"index": 0, "text": " w3"}], "object": "text_completion"}\n\n'
    async with (
        fleet(nats_server.url, (), service={"fast_protocol": fast_protocol}) as f,
        slow_to_end_worker(release, last_event=unfinished) as url,
    ):
        worker = WorkerConfig(worker_id=7, block_size=64, url=url, models=frozenset({MODEL}))
        async with httpx.AsyncClient(base_url=f.url) as http:
            assert (await http.post("/v1/workers", content=msgspec.json.encode(worker))).status_code == 201
        stream = await f.client.completions.create(model=MODEL, prompt=list(range(1, 100)), max_tokens=8, stream=True)
        texts = []
        async for piece in stream:
            texts.append(piece.choices[0].text if piece.choices else "")
            if len(texts) == 4:
                break
        await stream.close()

        assert (await settled(f.url))["client_disconnected"] == 1
        release.set()
        assert (await outcomes(f.url))[1]["ok"] == 0
        await eventually(lambda: idle(f.router))

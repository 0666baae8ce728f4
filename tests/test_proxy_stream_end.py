"""A stream the client read to its last event is a finished request, even when the client closes the
connection before the worker's answer has ended: the official `openai` client waits only 0.1 s for the
rest of the HTTP answer after ``data: [DONE]`` and then closes. Such a stream counts as ``ok``, in the
calibration of predicted against reported cached tokens and in the proxy's latency histogram, on both
ways in; a stream left before its last event is still ``client_disconnected``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import msgspec
import pytest

from router.event_plane.embedded_server import EmbeddedNats
from router.types import WorkerConfig
from tests.metrics import sample
from tests.proxy_fleet import MODEL, SSE_HEAD, Fleet, fleet, idle, raw_worker, sse_chunk
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


@contextlib.asynccontextmanager
async def streamed_from(
    nats_url: str, serve: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
) -> AsyncIterator[tuple[Fleet, httpx.Response]]:
    """A fleet whose one worker (7) is ``serve``, and the answer to a streamed completion through it."""
    async with fleet(nats_url, ()) as f, raw_worker(serve) as url:
        worker = WorkerConfig(worker_id=7, block_size=64, url=url, models=frozenset({MODEL}))
        async with httpx.AsyncClient(base_url=f.url) as http:
            assert (await http.post("/v1/workers", content=msgspec.json.encode(worker))).status_code == 201
            answer = await http.post("/v1/completions", content=STREAM_BODY)
        yield f, answer


async def test_a_worker_lost_after_its_last_event_leaves_the_client_a_whole_stream(nats_server: EmbeddedNats) -> None:
    """A worker that dies (its connection reset) after ``data: [DONE]`` but before its HTTP answer's
    end: the client has every event, the stream ends cleanly (no error event after its end), the
    request is ``ok``, and the worker's circuit breaker is not told of a failure."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(SSE_HEAD + sse_chunk(" w1") + sse_chunk(" w2") + chunk(USAGE) + chunk(b"data: [DONE]\n\n"))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()  # no terminating chunk

    async with streamed_from(nats_server.url, serve) as (f, answer):
        assert answer.status_code == 200
        assert answer.text.endswith("data: [DONE]\n\n") and "upstream_error" not in answer.text
        assert (await settled(f.url)) == {"ok": 1.0, "client_disconnected": 0.0}
        text, _ = await outcomes(f.url)
        assert sample(text, "kv_router_proxy_upstream_failures_total") == 0
        assert sample(text, "kv_router_proxy_calibration_samples", worker_id="7") == 1
        await eventually(lambda: idle(f.router))


async def test_bytes_after_the_last_whole_event_of_a_stream_cut_short_never_reach_the_client(
    nats_server: EmbeddedNats,
) -> None:
    """A worker whose stream ends its answer cleanly in the middle of an event (no blank line, no
    [DONE]): the client gets the whole events, then the error event, itself whole. The fragment went
    on first and the error event ran into it: an SSE parser read them as one line of garbage, and the
    client never learnt that the stream had failed."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(SSE_HEAD + sse_chunk(" w1") + chunk(b"this is not sse at all" * 10) + b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async with streamed_from(nats_server.url, serve) as (f, answer):
        assert answer.status_code == 200
        assert "this is not sse" not in answer.text
        events = answer.text.split("\n\n")
        assert events[-1] == "" and events[-2].startswith('data: {"error"')
        assert "the stream ended before data: [DONE]" in events[-2]

        async def failed() -> bool:
            text, _ = await outcomes(f.url)
            counted = sample(text, "kv_router_proxy_requests_total", route="completions", outcome="upstream_error")
            return counted == 1

        await eventually(failed, what="the request counted as upstream_error")
        await eventually(lambda: idle(f.router))


WHOLE_STREAM = SSE_HEAD + sse_chunk(" w1") + sse_chunk(" w2") + chunk(USAGE) + chunk(b"data: [DONE]\n\n")
STREAM_BODY = msgspec.json.encode(
    {"model": MODEL, "prompt": list(range(1, 100)), "max_tokens": 2, "stream": True,
     "stream_options": {"include_usage": True}}
)  # fmt: skip


def keep_alive_worker(
    connections: list[int], end_after_s: float | None = None
) -> contextlib.AbstractAsyncContextManager[str]:
    """A worker answering every request on a connection with the stream above and its end: in one
    write (the end in the same read as the last events), or ``end_after_s`` after the events.
    ``connections`` gets one entry a connection, the requests it carried."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(0)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(content_length(head))
                connections[-1] += 1
                if end_after_s is None:
                    writer.write(WHOLE_STREAM + b"0\r\n\r\n")
                else:
                    writer.write(WHOLE_STREAM)
                    await writer.drain()
                    await asyncio.sleep(end_after_s)
                    writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return raw_worker(serve)


def content_length(head: bytes) -> int:
    lines = (line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    return next((int(line.split(b":")[1]) for line in lines), 0)


async def read_answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One HTTP answer off the connection: its head and its body (chunked, by length, or up to the close:
    an HTTP/1.0 client's stream on kv-router's protocol)."""
    head = await reader.readuntil(b"\r\n\r\n")
    if b"content-length:" in head.lower():
        return head, await reader.readexactly(content_length(head))
    if b"transfer-encoding: chunked" not in head.lower():
        return head, await reader.read()
    body = b""
    while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
        body += (await reader.readexactly(size + 2))[:-2]
    await reader.readexactly(2)
    return head, body


def stream_request(version: bytes = b"1.1", extra: bytes = b"") -> bytes:
    return (
        b"POST /v1/completions HTTP/%b\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%b\r\n%b"
        % (version, len(STREAM_BODY), extra, STREAM_BODY)
    )


async def register_keep_alive_worker(f: Fleet, url: str) -> None:
    worker = WorkerConfig(worker_id=7, block_size=64, url=url, models=frozenset({MODEL}))
    async with httpx.AsyncClient(base_url=f.url) as http:
        assert (await http.post("/v1/workers", content=msgspec.json.encode(worker))).status_code == 201


@pytest.mark.parametrize("fast_protocol", [True, False])
@pytest.mark.parametrize("end_after_s", [None, 0.05])
async def test_pipelined_streams_are_answered_in_order_each_freed_before_the_next_is_routed(
    nats_server: EmbeddedNats, fast_protocol: bool, end_after_s: float | None
) -> None:
    """A stream's end goes to the client with its last events (in the worker connection's read
    callback, or from the handler when it comes later); a client that pipelines its next requests
    gets them answered in order, each counted and calibrated, and (on our HTTP protocol) the next is
    routed only once the one before has given its worker connection back: one connection serves all."""
    connections: list[int] = []
    async with (
        fleet(nats_server.url, (), service={"fast_protocol": fast_protocol}) as f,
        keep_alive_worker(connections, end_after_s) as url,
    ):
        await register_keep_alive_worker(f, url)
        host, port = f.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(stream_request() * 4)
        for _ in range(4):
            head, body = await asyncio.wait_for(read_answer(reader), 10)
            assert head.startswith(b"HTTP/1.1 200") and body.endswith(b"data: [DONE]\n\n")
        writer.close()
        await eventually(lambda: idle(f.router))
        text, found = await outcomes(f.url)
        assert found == {"ok": 4.0, "client_disconnected": 0.0}
        assert sample(text, "kv_router_proxy_calibration_samples", worker_id="7") == 4
        if fast_protocol:
            assert connections == [4]


@pytest.mark.parametrize("fast_protocol", [True, False])
@pytest.mark.parametrize("close", ["keep-alive", "connection: close", "HTTP/1.0"])
async def test_a_client_gone_as_soon_as_it_has_the_end_is_a_finished_request(
    nats_server: EmbeddedNats, fast_protocol: bool, close: str
) -> None:
    connections: list[int] = []
    async with (
        fleet(nats_server.url, (), service={"fast_protocol": fast_protocol}) as f,
        keep_alive_worker(connections) as url,
    ):
        await register_keep_alive_worker(f, url)
        host, port = f.url.removeprefix("http://").split(":")
        for _ in range(3):
            reader, writer = await asyncio.open_connection(host, int(port))
            version = b"1.0" if close == "HTTP/1.0" else b"1.1"
            writer.write(stream_request(version, b"connection: close\r\n" if close == "connection: close" else b""))
            head, body = await asyncio.wait_for(read_answer(reader), 10)
            writer.transport.abort()  # gone the moment it has the end
            assert head.startswith(b"HTTP/1.1 200") and body.endswith(b"data: [DONE]\n\n")
        await eventually(lambda: idle(f.router))

        async def all_counted() -> bool:
            found = (await outcomes(f.url))[1]
            return (found["ok"] or 0) + (found["client_disconnected"] or 0) == 3

        await eventually(all_counted, what="the three requests are counted")
        text, found = await outcomes(f.url)
        assert found == {"ok": 3.0, "client_disconnected": 0.0}
        assert sample(text, "kv_router_proxy_calibration_samples", worker_id="7") == 3
        assert sample(text, "kv_router_proxy_added_seconds_count") == 3


async def test_the_proxy_s_added_latency_holds_only_its_own_work_when_the_end_comes_with_the_events(
    nats_server: EmbeddedNats,
) -> None:
    """``kv_router_proxy_added_seconds`` is the proxy's share of the time to first token: what the
    connection does once the answer is complete (its access log line here, made slow) is not in it."""
    connections: list[int] = []
    access = logging.getLogger("uvicorn.access")
    slow, level = _SlowHandler(), access.level
    async with (
        fleet(nats_server.url, (), service={"access_log": True}) as f,
        keep_alive_worker(connections) as url,
    ):
        await register_keep_alive_worker(f, url)
        access.addHandler(slow)
        access.setLevel(logging.INFO)
        try:
            for _ in range(3):
                stream = await f.client.completions.create(
                    model=MODEL, prompt=list(range(1, 100)), max_tokens=2, stream=True,
                    stream_options={"include_usage": True},
                )  # fmt: skip
                assert [piece async for piece in stream][-1].usage is not None
        finally:
            access.removeHandler(slow)
            access.setLevel(level)
        await eventually(lambda: idle(f.router))
        text, _ = await outcomes(f.url)
    assert sample(text, "kv_router_proxy_added_seconds_count") == 3
    assert slow.records >= 3
    total = sample(text, "kv_router_proxy_added_seconds_sum")
    assert total is not None and total < 3 * _SlowHandler.DELAY_S / 2


class _SlowHandler(logging.Handler):
    DELAY_S = 0.02

    def __init__(self) -> None:
        super().__init__()
        self.records = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.records += 1
        time.sleep(self.DELAY_S)  # a slow log sink, on the event loop as the access log is

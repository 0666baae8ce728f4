"""A client that stops reading its stream is dropped after ``proxy_client_write_timeout_secs``: the
worker's stream is closed (its engine stops generating for nobody), the booking freed, the request
counted as ``client_disconnected``, and the proxy keeps answering others. Both ways in (the protocol's
and ASGI's)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import httpx
import msgspec
import pytest

from router.event_plane.embedded_server import EmbeddedNats
from router.types import WorkerConfig
from tests.metrics import sample
from tests.proxy_fleet import MODEL, SSE_HEAD, Fleet, fleet, idle, raw_worker, sse_chunk
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

# Far more than the kernel's and the transports' buffers hold between the worker and a client that
# reads nothing (a few MiB on loopback), and still a bounded stream.
MAX_EVENTS = 40_000
TEXT = "x" * 512
# The stalled client's request (the others ask for one token).
STALLED_MAX_TOKENS = 10**6


class EndlessWorker:
    """A worker that streams token events as fast as it may, until its connection is closed
    (``closed``) or ``MAX_EVENTS``; answers a plain request (no stream) at once. ``written``: the
    events it streamed, or the whole answers it sent."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self.written = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"GET"):  # the proxy's health check
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            await writer.drain()
            writer.close()
            return
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        body = msgspec.json.decode(await reader.readexactly(length))
        if not body.get("stream"):
            # The stalled client's whole answer is far larger than the buffers between us; others are small.
            text = "x" * (32 << 20) if body["max_tokens"] == STALLED_MAX_TOKENS else " ok"
            answer = msgspec.json.encode({"choices": [{"index": 0, "text": text}], "object": "text_completion"})
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                         % (len(answer), answer))  # fmt: skip
            await writer.drain()
            self.written += 1
            writer.close()
            return
        writer.write(SSE_HEAD)
        try:
            for _ in range(MAX_EVENTS):
                writer.write(sse_chunk(TEXT))
                self.written += 1
                await writer.drain()
        except ConnectionError:
            self.closed.set()
            return
        writer.close()


@contextlib.asynccontextmanager
async def stalled(nats_url: str, fast_protocol: bool, *, stream: bool) -> AsyncIterator[tuple[Fleet, EndlessWorker]]:
    """A proxy (write timeout 0.5 s) in front of an `EndlessWorker`, and a completion sent to it on a
    socket that is never read (a small receive window), closed on the way out."""
    worker = EndlessWorker()
    proxy = {"proxy_client_write_timeout_secs": 0.5}
    async with (
        fleet(nats_url, (), service={"fast_protocol": fast_protocol}, proxy=proxy) as f,
        raw_worker(worker.serve) as url,
    ):
        registration = WorkerConfig(worker_id=7, block_size=64, url=url, models=frozenset({MODEL}))
        async with httpx.AsyncClient(base_url=f.url) as http:
            assert (await http.post("/v1/workers", content=msgspec.json.encode(registration))).status_code == 201
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            await loop.sock_connect(sock, ("127.0.0.1", int(f.url.rsplit(":", 1)[1])))
            body = msgspec.json.encode(
                {"model": MODEL, "prompt": list(range(1, 100)), "max_tokens": STALLED_MAX_TOKENS, "stream": stream}
            )
            await loop.sock_sendall(
                sock,
                b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%b" % (len(body), body),
            )
            yield f, worker
        finally:
            sock.close()


async def answers_others(f: Fleet) -> None:
    """The proxy keeps answering: the same worker, another client."""
    answer = await f.client.completions.create(model=MODEL, prompt=list(range(1, 100)), max_tokens=1)
    assert answer.choices[0].text == " ok"


@pytest.mark.parametrize("fast_protocol", [True, False])
async def test_a_client_that_stops_reading_is_dropped_and_its_worker_freed(
    nats_server: EmbeddedNats, fast_protocol: bool
) -> None:
    async with stalled(nats_server.url, fast_protocol, stream=True) as (f, worker):
        # The worker's stream is closed by the proxy, long before the stream's end.
        await asyncio.wait_for(worker.closed.wait(), 15)
        assert worker.written < MAX_EVENTS
        await eventually(lambda: idle(f.router), what="the stalled request's booking is freed")
        async with httpx.AsyncClient(base_url=f.url) as http:

            async def counted() -> bool:
                text = (await http.get("/metrics")).text
                found = sample(text, "kv_router_proxy_requests_total", route="completions",
                               outcome="client_disconnected")  # fmt: skip
                return found == 1

            await eventually(counted, what="the stalled request counted as a disconnect")
        await answers_others(f)


@pytest.mark.parametrize("fast_protocol", [True, False])
async def test_a_client_that_reads_nothing_of_a_whole_answer_leaves_no_booking(
    nats_server: EmbeddedNats, fast_protocol: bool
) -> None:
    """A whole (not streamed) answer larger than the buffers, to a client that reads none of it: the
    request is over for the router all the same, both ways in (the answer waits in the transport)."""
    async with stalled(nats_server.url, fast_protocol, stream=False) as (f, worker):
        await eventually(lambda: worker.written == 1, what="the worker answered")
        await eventually(lambda: idle(f.router), 15, "the unread answer's booking is freed")
        await answers_others(f)

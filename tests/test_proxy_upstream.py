"""The proxy's HTTP/1.1 client to the workers (`api.proxy.upstream`) against a scripted HTTP peer on
loopback: answers framed as chunks, by content-length or by the close, split into any TCP writes;
keep-alive reuse; a worker closing mid-chunk, an idle connection the worker closed, silence,
refusal, cancellation; the pool's bound; a client that is behind pausing the worker's connection."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api import eager
from api.config import ProxyConfig
from api.proxy import tokens
from api.proxy import upstream as upstream_module
from api.proxy.upstream import Streaming, Upstream, UpstreamConnection, UpstreamError
from api.proxy.wire import finished_stream
from indexer.hashing import pack_tokens
from router.event_plane.embedded_server import free_port
from router.types import WorkerConfig
from tests.proxy_fleet import raw_worker
from tests.waiting import eventually

pytestmark = pytest.mark.anyio
T = TypeVar("T")

# One answer: a list of TCP writes (bytes), with a pause after each so that they arrive as separate reads.
Script = list[bytes]


@dataclass
class Peer:
    """A loopback HTTP server that answers each request with the next script, byte for byte."""

    url: str
    scripts: list[Script | Callable[[asyncio.StreamWriter], None]] = field(default_factory=list)
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    closed_by_client: int = 0
    answered: int = 0  # scripts written whole (and drained into the socket)


async def _read_request(reader: asyncio.StreamReader) -> bytes | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = next(
        (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0
    )
    return head + await reader.readexactly(length)


@contextlib.asynccontextmanager
async def peer() -> AsyncIterator[Peer]:
    port = free_port()
    state = Peer(f"http://127.0.0.1:{port}")

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.connections += 1
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    state.closed_by_client += 1
                    return
                state.requests.append(request)
                script = state.scripts.pop(0)
                if callable(script):
                    script(writer)
                    return
                for piece in script:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.002)  # the behaviour under test: each piece arrives on its own
                state.answered += 1
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", port)
    try:
        yield state
    finally:
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def client(**config: object) -> AsyncIterator[Upstream]:
    upstream = Upstream(ProxyConfig(**config))  # type: ignore[arg-type]
    await upstream.start()
    try:
        yield upstream
    finally:
        await upstream.stop()


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    """``data`` cut at the given offsets (modulo its length), in order."""
    points = sorted({cut % len(data) for cut in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


def chunked(events: list[bytes], sizes: list[int]) -> bytes:
    """``events`` framed as HTTP/1.1 chunks, each event cut into chunks of the given sizes."""
    framed = []
    for index, event in enumerate(events):
        size = max(1, sizes[index % len(sizes)]) if sizes else len(event)
        for start in range(0, len(event), size):
            piece = event[start : start + size]
            framed.append(b"%x\r\n%b\r\n" % (len(piece), piece))
    return b"".join(framed) + b"0\r\n\r\n"


class Collect:
    """A `Sink` that keeps what it is given; ``behind`` says the client is behind until resumed."""

    def __init__(self, behind: int = 0) -> None:
        self.data: list[bytes] = []
        self.behind = behind  # how many writes answer "behind"
        self.resume: Callable[[], None] | None = None
        self.began: list[bytes | None] = []  # the content types `begin` was called with
        self.finished = False  # `finish` was called: the stream's end went with its last piece

    def begin(self, content_type: bytes | None) -> Collect:
        """`api.proxy.upstream.Begin`: the stream starts here."""
        self.began.append(content_type)
        return self

    def write(self, data: bytes) -> bool:
        self.data.append(data)
        if self.behind:
            self.behind -= 1
            return True
        return False

    def when_drained(self, resume: Callable[[], None]) -> None:
        self.resume = resume

    def finish(self, data: bytes) -> None:
        if data:
            self.data.append(data)
        self.finished = True


events_strategy = st.lists(st.binary(min_size=1, max_size=200).map(lambda b: b"data: " + b.hex().encode() + b"\n\n"),
                           min_size=1, max_size=12)  # fmt: skip


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    events=events_strategy,
    sizes=st.lists(st.integers(1, 300), max_size=5),
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
    framing=st.sampled_from(["chunked", "length", "close"]),
    taken=st.sampled_from(["read", "handed on"]),
)
def test_any_framing_split_anywhere_gives_the_body_back_and_keeps_the_connection(
    events: list[bytes], sizes: list[int], cuts: list[int], framing: str, taken: str
) -> None:
    body = b"".join(events)
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    if framing == "chunked":
        answer = head + b"transfer-encoding: chunked\r\n\r\n" + chunked(events, sizes)
    elif framing == "length":
        answer = head + b"content-length: %d\r\n\r\n" % len(body) + body
    else:  # HTTP/1.0 style: the body ends with the connection
        answer = head + b"connection: close\r\n\r\n" + body

    async def scenario() -> None:
        async with peer() as worker, client() as upstream:
            for _ in range(2):
                script: Script = split(answer, cuts)
                if framing == "close":
                    pieces = script

                    def then_close(writer: asyncio.StreamWriter, pieces: list[bytes] = pieces) -> None:
                        writer.write(b"".join(pieces))

                    worker.scripts.append(then_close)
                else:
                    worker.scripts.append(script)
                sink = Collect()
                streaming = Streaming(sink.begin) if taken == "handed on" else None
                connection = await upstream.open(worker.url, b"/v1/completions", b'{"model": "m"}', streaming=streaming)
                assert connection.status == 200 and connection.content_type == b"text/event-stream"
                if taken == "read":  # a whole answer
                    got = await connection.read()
                else:  # a stream handed on from the socket's callback, from its start
                    assert await connection.handed_on()
                    assert sink.began == [b"text/event-stream"]
                    got = b"".join(sink.data)
                if taken != "read":
                    assert connection.tail.endswith(events[-1])  # the stream's end is kept for usage
                assert got == body
                connection.release()
            # Delimited answers are read to their end: the second connection reused the connection.
            assert worker.connections == (2 if framing == "close" else 1)

    asyncio.run(asyncio.wait_for(scenario(), 10))


_RESPONSES_STREAM = [b"event: response.output_text.delta\ndata: {}\n\n", b"event: response.completed\ndata: {}\n\n"]
# A stream's events, its last one ending it: chat and completions, the Responses API, and the same
# framed as some engines' servers frame SSE (sse-starlette's default separator).
FINISHED_STREAMS = {
    "[DONE]": [b"data: a\n\n", b"data: b\n\n", b"data: [DONE]\n\n"],
    "response.completed": _RESPONSES_STREAM,
    "response.completed, CRLF": [event.replace(b"\n", b"\r\n") for event in _RESPONSES_STREAM],
}


@pytest.mark.parametrize("framing", ["chunked", "length"])
@pytest.mark.parametrize("arrival", ["one read", "event by event"])
@pytest.mark.parametrize("ending", list(FINISHED_STREAMS))
async def test_a_stream_that_ends_as_it_should_goes_to_the_client_with_its_end(
    framing: str, arrival: str, ending: str
) -> None:
    """Once the answer is whole and its last events end the stream (``ends``), they go to the sink
    with the stream's end (`Sink.finish`: one write to the client, not the events then the end); a
    stream cut short of its last event is only written, its end left to the caller (who says why)."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    finished = FINISHED_STREAMS[ending]
    cut_short = finished[:-1]
    async with peer() as worker, client() as upstream:
        for events in (finished, cut_short):
            body = b"".join(events)
            if framing == "chunked":
                pieces = [
                    head + b"transfer-encoding: chunked\r\n\r\n",
                    *(chunked([e], [])[:-5] for e in events),
                    b"0\r\n\r\n",
                ]
            else:
                pieces = [head + b"content-length: %d\r\n\r\n" % len(body), *events]
            worker.scripts.append([b"".join(pieces)] if arrival == "one read" else pieces)
            sink = Collect()
            connection = await upstream.open(
                worker.url, b"/v1/completions", b"{}", streaming=Streaming(sink.begin, ends=finished_stream)
            )
            assert await connection.handed_on()
            assert b"".join(sink.data) == body
            assert sink.finished is (events is finished)
            connection.release()
        assert worker.connections == 1


async def test_a_stream_of_whole_events_larger_than_the_bound_in_one_read_ends_at_once() -> None:
    """proxy_max_answer_bytes bounds what is held of a stream (an event not yet ended), not a stream's
    whole events: 10 kB of them arriving with the stream's end in one read, past a 4 KiB bound, go to
    the client with the end at once (held incomplete, the stream waited for a read timeout)."""
    events = [b'data: {"i": %d, "pad": "%s"}\n\n' % (i, b"x" * 100) for i in range(80)] + [b"data: [DONE]\n\n"]
    body = b"".join(events)
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    async with peer() as worker, client(proxy_max_answer_bytes=4096, proxy_read_timeout_secs=30.0) as upstream:
        worker.scripts.append([head + b"content-length: %d\r\n\r\n" % len(body) + body])
        sink = Collect()
        connection = await upstream.open(
            worker.url, b"/v1/completions", b"{}", streaming=Streaming(sink.begin, ends=finished_stream)
        )
        assert await asyncio.wait_for(connection.handed_on(), 5)
        assert b"".join(sink.data) == body and sink.finished
        connection.release()


async def test_the_request_goes_out_as_one_http11_post_with_the_given_headers() -> None:
    async with peer() as worker, client() as upstream:
        worker.scripts.append([b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"])
        status, body = await upstream.post(worker.url + "/base/", b"/tokenize", b'{"a": 1}')
        assert (status, body) == (200, b"{}")
        worker.scripts.append([b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"])
        connection = await upstream.open(worker.url, b"/v1/completions", b"{}", b"authorization: Bearer t\r\n")
        assert await connection.read() == b""
        connection.release()
    port = worker.url.rsplit(":", 1)[1]
    assert worker.requests[0] == (
        b"POST /base/tokenize HTTP/1.1\r\nhost: 127.0.0.1:" + port.encode() + b"\r\n"
        b"content-type: application/json\r\ncontent-length: 8\r\n\r\n" + b'{"a": 1}'
    )
    assert b"\r\nauthorization: Bearer t\r\n" in worker.requests[1]


async def test_a_worker_closing_mid_chunk_is_an_upstream_error_and_the_connection_is_dropped() -> None:
    async with peer() as worker, client() as upstream:
        cut_short = b'HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nf\r\ndata: {"a":1}\n\n\r\n20\r\ndata: {'

        def close_mid_chunk(writer: asyncio.StreamWriter) -> None:
            writer.write(cut_short)

        worker.scripts.append(close_mid_chunk)
        sink = Collect()
        connection = await upstream.open(worker.url, b"/v1/completions", b"{}", streaming=Streaming(sink.begin))
        with pytest.raises(UpstreamError, match="mid-answer"):
            await connection.handed_on()
        # The whole event before the close went on; the one cut short did not.
        assert connection.begun and b"".join(sink.data) == b'data: {"a":1}\n\n'
        connection.release()
        worker.scripts.append([b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"])
        assert await upstream.post(worker.url, b"/x", b"{}") == (200, b"ok")
        assert worker.connections == 2  # the broken connection was not reused


async def test_a_read_that_breaks_the_answer_hands_none_of_it_on() -> None:
    """The first events and a malformed chunk in one read: the client's stream is not begun (the
    request may go again), and the failure is the answer's, not the head's (the head was in)."""
    async with peer() as worker, client() as upstream:
        worker.scripts.append([b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\nzz\r\n"])
        sink = Collect()
        connection = await upstream.open(worker.url, b"/x", b"{}", streaming=Streaming(sink.begin))
        with pytest.raises(UpstreamError, match="malformed answer"):
            await connection.handed_on()
        assert sink.began == [] and sink.data == [] and not connection.begun
        connection.release()


async def test_an_event_held_back_over_many_reads_is_searched_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """An event whose end comes many reads later is searched for its end once per byte, not once per
    read (which was seconds of the loop for an event of a few MiB), and reaches the client whole."""
    searched: list[int] = []
    search = upstream_module.after_last_event

    def counting(data: bytes) -> int:
        searched.append(len(data))
        return search(data)

    monkeypatch.setattr(upstream_module, "after_last_event", counting)
    event = b"data: " + b"y" * (1 << 20) + b"\n\n"
    pieces = [event[start : start + 16384] for start in range(0, len(event), 16384)]
    async with peer() as worker, client() as upstream:
        head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (len(event) + 9)
        worker.scripts.append([head, *pieces, b"data: 2\n\n"])
        sink = Collect()
        connection = await upstream.open(worker.url, b"/x", b"{}", streaming=Streaming(sink.begin))
        assert await connection.handed_on()
        assert b"".join(sink.data) == event + b"data: 2\n\n"
        connection.release()
    assert len(searched) > 10  # the event came in many reads
    assert sum(searched) < 2 * len(event)


async def test_an_idle_connection_the_worker_closed_is_replaced_without_a_failure() -> None:
    async with peer() as worker, client() as upstream:
        worker.scripts.append([b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"])
        assert await upstream.post(worker.url, b"/x", b"{}") == (200, b"ok")

        def close_unanswered(writer: asyncio.StreamWriter) -> None:
            writer.transport.abort()  # the worker's keep-alive ran out just as the request came

        worker.scripts.append(close_unanswered)
        worker.scripts.append([b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nagain"])
        assert await upstream.post(worker.url, b"/x", b"{}") == (200, b"again")
        assert worker.connections == 2


async def test_a_fresh_connection_closed_unanswered_is_a_failure() -> None:
    async with peer() as worker, client() as upstream:
        worker.scripts.append(lambda writer: writer.transport.abort())
        with pytest.raises(UpstreamError, match="closed the connection"):
            await upstream.open(worker.url, b"/x", b"{}")


async def test_silence_is_a_read_timeout_and_refusal_a_connect_failure() -> None:
    async with peer() as worker, client(proxy_read_timeout_secs=0.2) as upstream:
        worker.scripts.append([b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n"])
        sink = Collect()
        connection = await upstream.open(worker.url, b"/x", b"{}", streaming=Streaming(sink.begin))
        with pytest.raises(UpstreamError, match="read timeout"):
            await connection.handed_on()
        assert sink.data == [b"data: 1\n\n"]
        connection.release()
        await eventually(lambda: worker.closed_by_client == 1, 5, "the released connection is closed")
        with pytest.raises(UpstreamError, match="ConnectionRefused"):
            await upstream.open(f"http://127.0.0.1:{free_port()}", b"/x", b"{}")


async def test_a_cancelled_exchange_closes_its_connection_so_the_worker_stops() -> None:
    async with peer() as worker, client() as upstream:
        worker.scripts.append([b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n"])
        connection = await upstream.open(worker.url, b"/x", b"{}", streaming=Streaming(Collect().begin))

        async def forward() -> None:
            try:
                await connection.handed_on()
            finally:
                connection.release()

        task = asyncio.ensure_future(forward())
        # The worker has written everything and keeps the connection open; the connection is waiting.
        await eventually(lambda: worker.answered == 1 and not task.done(), 5, "the connection waits for more")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await eventually(lambda: worker.closed_by_client == 1, 5, "the cancelled connection's connection is closed")


async def test_the_pool_bound_makes_a_request_wait_for_a_released_connection() -> None:
    async with peer() as worker, client(proxy_connections_per_worker=1) as upstream:
        worker.scripts += [
            [b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\na"],
            [b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nb"],
        ]
        first = await upstream.open(worker.url, b"/x", b"{}")
        second = asyncio.ensure_future(upstream.post(worker.url, b"/x", b"{}"))
        await asyncio.sleep(0.05)  # a negative: time in which an unbounded pool would have sent it
        assert not second.done() and len(worker.requests) == 1
        assert await first.read() == b"a"
        first.release()
        assert await second == (200, b"b")
        assert worker.connections == 1


async def test_a_request_waiting_for_a_connection_to_a_worker_that_left_fails_without_connecting_to_it() -> None:
    """The worker's connection, closed as it left routing, gave its place in the pool to the request
    waiting for one, which connected to the departed worker before failing (against an unreachable
    host, after the connect timeout)."""
    async with peer() as worker, client(proxy_connections_per_worker=1) as upstream:
        worker.scripts.append([b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n"])  # its body never comes
        first = await upstream.open(worker.url, b"/x", b"{}", worker_id=5)
        second = asyncio.ensure_future(upstream.post(worker.url, b"/x", b"{}", worker_id=5))
        await asyncio.sleep(0.05)  # waiting for the pool's one connection
        assert upstream.abandon(5, "removed (api)") == 1
        with pytest.raises(UpstreamError, match=r"left routing: removed \(api\)"):
            await first.read()
        first.release()
        with pytest.raises(UpstreamError, match=r"left routing: removed \(api\)"):
            await second
        await asyncio.sleep(0.05)  # a negative: time for a connection to be accepted
        assert worker.connections == 1


async def test_a_client_that_is_behind_pauses_the_worker_connection_until_it_drains(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    connections: list[asyncio.Transport] = []  # the transport of each connection to the worker
    made = UpstreamConnection.connection_made

    def spy(self: UpstreamConnection, transport: asyncio.BaseTransport) -> None:
        connections.append(cast(asyncio.Transport, transport))
        made(self, transport)

    monkeypatch.setattr(UpstreamConnection, "connection_made", spy)
    events = [b"data: %d\n\n" % i for i in range(6)]
    async with peer() as worker, client() as upstream:
        frames = [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"]
        frames += [b"%x\r\n%b\r\n" % (len(event), event) for event in events] + [b"0\r\n\r\n"]
        worker.scripts.append(frames)
        sink = Collect(behind=1)
        connection = await upstream.open(worker.url, b"/x", b"{}", streaming=Streaming(sink.begin))
        transport = connections[-1]
        forwarding = asyncio.ensure_future(connection.handed_on())
        await eventually(lambda: worker.answered == 1, 5, "the worker wrote its whole answer")
        await eventually(lambda: sink.resume is not None, 5, "the sink was told the client is behind")
        # The pause itself: the socket is not read, so the rest of the answer waits in the kernel.
        assert not transport.is_reading()
        assert len(sink.data) == 1 and not forwarding.done()
        sink.resume()
        assert transport.is_reading()
        assert await forwarding
        assert b"".join(sink.data) == b"".join(events)
        connection.release()


async def test_a_client_behind_for_longer_than_the_read_timeout_is_no_silence_of_the_worker() -> None:
    """Paused because the client is behind, the connection reads nothing, so it hears nothing: the
    worker's silence is not counted meanwhile (it was, and a healthy worker was failed for a slow
    client: a 502 event in the stream and a failure told to its circuit breaker)."""
    events = [b"data: %d\n\n" % i for i in range(6)]
    async with peer() as worker, client(proxy_read_timeout_secs=0.2) as upstream:
        frames = [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"]
        frames += [b"%x\r\n%b\r\n" % (len(event), event) for event in events] + [b"0\r\n\r\n"]
        worker.scripts.append(frames)
        sink = Collect(behind=1)
        connection = await upstream.open(worker.url, b"/x", b"{}", streaming=Streaming(sink.begin))
        forwarding = asyncio.ensure_future(connection.handed_on())
        await eventually(lambda: sink.resume is not None, 5, "the sink was told the client is behind")
        await asyncio.sleep(0.6)  # the time itself is what is tested: three read timeouts, the client behind
        assert not forwarding.done()
        sink.resume()
        assert await forwarding
        assert b"".join(sink.data) == b"".join(events)
        connection.release()


async def test_a_waiter_cancelled_as_it_is_handed_a_connection_passes_it_on() -> None:
    """With one connection a worker, a request waiting for it is cancelled (its client left) in the
    loop turn it is handed the connection: the next request in line gets it, rather than waiting
    until the worker closes a connection nobody holds."""
    async with peer() as worker, client(proxy_connections_per_worker=1) as upstream:
        worker.scripts += [[b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\n%b" % name] for name in (b"a", b"b", b"c")]
        first = await upstream.open(worker.url, b"/x", b"{}")
        assert await first.read() == b"a"
        leaving = asyncio.ensure_future(upstream.post(worker.url, b"/x", b"{}"))
        behind = asyncio.ensure_future(upstream.post(worker.url, b"/x", b"{}"))
        await asyncio.sleep(0.05)  # both wait for the one connection (a negative: nothing may happen)
        assert not leaving.done() and not behind.done()
        first.release()  # handed to the first waiter ...
        leaving.cancel()  # ... whose client leaves in the same loop turn
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert await asyncio.wait_for(behind, 5) == (200, b"b")
        assert worker.connections == 1


async def test_a_connection_opened_as_its_request_is_cancelled_is_closed_and_its_place_given_back_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The client leaves in the loop turn the worker's connection completes: that connection was left
    open for nobody (the worker holding it), and its place in the pool given back twice, once then and
    once when the worker closed it, so the pool later opened more than its bound."""
    async with peer() as worker, client(proxy_connections_per_worker=1) as upstream:
        loop = asyncio.get_running_loop()
        opens = loop.create_connection
        leaving: list[asyncio.Future[tuple[int, bytes]]] = []

        async def connected_as_the_client_leaves(*args: Any, **kwargs: Any) -> Any:
            opened = await opens(*args, **kwargs)
            loop.call_soon(leaving[0].cancel)
            return opened

        monkeypatch.setattr(loop, "create_connection", connected_as_the_client_leaves)
        leaving.append(asyncio.ensure_future(upstream.post(worker.url, b"/x", b"{}")))
        with pytest.raises(asyncio.CancelledError):
            await leaving[0]
        monkeypatch.undo()
        await eventually(lambda: worker.closed_by_client == 1, 5, "the connection opened for nobody is closed")
        # One place, given back once: two requests go one after the other on one connection.
        worker.scripts += [[b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\n%b" % name] for name in (b"a", b"b")]
        first = await upstream.open(worker.url, b"/x", b"{}")
        second = asyncio.ensure_future(upstream.post(worker.url, b"/x", b"{}"))
        await asyncio.sleep(0.05)  # a negative: time in which a pool past its bound would have sent it
        assert not second.done() and worker.connections == 2
        assert await first.read() == b"a"
        first.release()
        assert await second == (200, b"b")
        assert worker.connections == 2


async def test_a_request_cancelled_before_its_task_first_runs_leaves_no_connection_open() -> None:
    """A request the proxy runs on a protocol callback (`api.eager.start`) waits for a new worker
    connection, and its client leaves before the request's task ever ran: the connection being opened
    is abandoned (closed, if the worker saw it), not kept for nobody, and its place in the pool is
    given back once (twice, the pool would later open more than its bound)."""
    async with peer() as worker, client(proxy_connections_per_worker=1) as upstream:
        outcome = eager.start(upstream.post(worker.url, b"/x", b"{}"))
        assert isinstance(outcome, eager.Suspended)
        task = outcome.task(asyncio.get_running_loop())
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.2)  # a negative: time for a connection kept open to show at the worker
        assert worker.closed_by_client == worker.connections
        opened = worker.connections
        worker.scripts += [[b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\n%b" % name] for name in (b"a", b"b")]
        first = await upstream.open(worker.url, b"/x", b"{}")
        second = asyncio.ensure_future(upstream.post(worker.url, b"/x", b"{}"))
        await asyncio.sleep(0.05)  # a negative: time in which a pool past its bound would have sent it
        assert not second.done() and worker.connections == opened + 1
        assert await first.read() == b"a"
        first.release()
        assert await second == (200, b"b")


def _outside_any_task(coroutine: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
    """``coroutine`` run as the proxy runs a request (`api.eager.start`, on a protocol callback, with
    no current task) up to its first wait, then to its end; its outcome."""
    loop = asyncio.get_running_loop()
    outcome: asyncio.Future[T] = loop.create_future()

    def finish(task: asyncio.Future[T]) -> None:
        if task.exception() is not None:
            outcome.set_exception(cast(BaseException, task.exception()))
        else:
            outcome.set_result(task.result())

    def run() -> None:
        assert asyncio.current_task() is None
        try:
            started = eager.start(coroutine)
        except BaseException as exc:  # the outcome, whatever it is
            outcome.set_exception(exc)
            return
        if isinstance(started, eager.Suspended):
            asyncio.ensure_future(started).add_done_callback(finish)
        else:
            outcome.set_result(started)

    loop.call_soon(run)
    return outcome


@pytest.fixture
def wait_for_as_in_python_312(monkeypatch: pytest.MonkeyPatch) -> None:
    """From Python 3.12 `asyncio.wait_for` is `asyncio.timeout` inside, which needs a current task:
    that behaviour is put in here, so this Python fails as 3.12 would."""

    async def wait_for(awaitable: Awaitable[T], timeout: float | None) -> T:
        async with asyncio.timeout(timeout):
            return await awaitable

    monkeypatch.setattr(asyncio, "wait_for", wait_for)


@pytest.mark.usefixtures("wait_for_as_in_python_312")
async def test_a_connection_is_opened_and_timed_out_outside_any_task() -> None:
    """The proxy opens worker connections from requests that run with no current task (under 3.12's
    `wait_for`, a 500 for every request needing a new connection)."""
    async with peer() as worker, client(proxy_connect_timeout_secs=0.2) as upstream:
        worker.scripts.append([b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\na"])
        assert await _outside_any_task(upstream.post(worker.url, b"/x", b"{}")) == (200, b"a")
        # A listener whose accept queue is full: a new connection's SYN goes unanswered, so it times out.
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(0)
            fillers = [socket.socket() for _ in range(3)]
            try:
                for filler in fillers:
                    filler.setblocking(False)
                    filler.connect_ex(listener.getsockname())
                url = f"http://127.0.0.1:{listener.getsockname()[1]}"
                with pytest.raises(UpstreamError, match=r"connect timeout after 0\.2 s"):
                    await _outside_any_task(upstream.post(url, b"/x", b"{}"))
            finally:
                for filler in fillers:
                    filler.close()


@pytest.mark.usefixtures("wait_for_as_in_python_312")
async def test_a_prompt_is_tokenized_outside_any_task_and_a_silent_worker_given_up_at_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request without local tokenizer files asks a worker's ``/tokenize``, with no current task
    (`api.eager`): one that never answers is given up at the timeout and the next one asked. Under
    3.12's `wait_for` every such request was a 500."""
    monkeypatch.setattr(tokens, "REMOTE_TOKENIZE_TIMEOUT_S", 0.3)
    asked: list[bytes] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                asked.append(await reader.readuntil(b"\r\n"))
                await reader.read()  # never answers; reads until the proxy gives up and closes
        finally:
            writer.close()

    async with peer() as worker, raw_worker(silent) as silent_url, client() as upstream:
        answer = b'{"tokens": [7, 8, 9], "count": 3, "max_model_len": 4096}'
        worker.scripts.append([b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(answer), answer)])
        tokenizer = tokens.PromptTokenizer({}, upstream)
        # The workers take turns: the first prompt asks the second of the list first.
        fleet = [WorkerConfig(worker_id=1, url=worker.url), WorkerConfig(worker_id=2, url=silent_url)]
        started = time.monotonic()
        packed = await _outside_any_task(tokenizer.text("m", "hello", fleet))
        assert time.monotonic() - started >= 0.3
        assert asked == [b"POST /tokenize HTTP/1.1\r\n"] and len(worker.requests) == 1
        assert packed == bytes(pack_tokens([7, 8, 9]))

        with pytest.raises(tokens.TokenizeFailed, match=r"worker 2: no answer in 0\.3 s"):
            await _outside_any_task(tokenizer.text("m", "hello", fleet[1:]))


async def test_a_stream_opened_to_be_handed_on_is_read_whole_when_the_worker_refuses_it() -> None:
    async with peer() as worker, client() as upstream:
        worker.scripts.append([b'HTTP/1.1 400 Bad Request\r\ncontent-length: 13\r\n\r\n{"error": {}}'])
        sink = Collect()
        connection = await upstream.open(worker.url, b"/x", b"{}", streaming=Streaming(sink.begin))
        assert connection.status == 400 and await connection.read() == b'{"error": {}}'
        assert sink.began == [] and sink.data == [] and not connection.begun
        connection.release()
        # A stream ending without an event never begins: the proxy tries the next worker.
        worker.scripts.append([b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"])
        connection = await upstream.open(worker.url, b"/x", b"{}", streaming=Streaming(sink.begin))
        assert not await connection.handed_on() and sink.began == []
        connection.release()

"""The HTTP/1.1 client to the workers: an asyncio protocol per connection, httptools' response parser,
a keep-alive pool per worker, timeouts, and body pieces handed on straight from the socket's callback.

Why not aiohttp's client (used before): per request it builds a request object, a response object,
a stream reader, header multidicts and a timer, and every chunk it reads wakes the coroutine that
forwards it; that was about a third of the proxy's CPU per request (docs/performance.md). Here a
request is one ``transport.write`` of a head built from the worker's pooled prefix, the response is
parsed by httptools (C) on the loop's read callback, and a stream is handed on from that callback:
its first events start the client's answer there (`Streaming`, given with the request) and every
later read goes to the client's `api.http_stream.Sink` the same way. No coroutine wakes up per chunk,
not even for the first (a wake-up waits behind every callback the loop has ready: under load, most of
the proxy's share of the time to first token), and the pieces of one read are joined into one write.

A connection carries one exchange (a request and its answer) at a time, no pipelining. It goes back
to its pool when its answer was read to its end and the worker keeps it alive; a request cancelled or
cut short closes it,
which tells the engine to stop. An idle connection is dropped after `IDLE_SECS` (below the 5 s
keep-alive of uvicorn, which vLLM and SGLang serve with), and a reused connection the worker had
closed before it answered is replaced once by a fresh one, which is not a failure of the worker.

A worker that leaves routing as gone or unreachable (`abandon`: removed, or failing its health check)
has its exchanges still open failed at once, as if their connections broke, rather than each waiting
out its read timeout (minutes) on a worker the router has dropped; so are requests for it that were
waiting for a connection (`_Departures`). Nothing is registered per request for this: an exchange
carries its worker's id, and the pools' open connections are looked through only when a worker leaves.
"""

from __future__ import annotations

import asyncio
import math
import ssl
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import cast
from urllib.parse import urlsplit

import httptools

from api.config import ProxyConfig
from api.eager import within
from api.http_stream import Sink
from api.proxy.wire import after_last_event, finished_stream
from router.engines.openai_server import openai_base

__all__ = ["IDLE_SECS", "AnswerTooLarge", "Begin", "Streaming", "Upstream", "UpstreamConnection", "UpstreamError"]

# An idle pooled connection older than this is closed rather than reused.
IDLE_SECS = 4.0

# Called in the read callback with the answer's content type when the first whole events of a 200
# answer are in: starts the client's answer and gives the sink they and the rest of the stream go to.
Begin = Callable[[bytes | None], Sink]


@dataclass(frozen=True, slots=True)
class Streaming:
    """How a 200 answer is handed on as a stream, from the read callback (`UpstreamConnection.handed_on`),
    given with the request: ``begin`` starts the client's answer with the first whole events; ``on_events``
    is told of every piece handed on; ``ends``, given the stream's last two pieces once the answer is
    whole (in the read callback that completes it, else in `handed_on`), says whether the stream's end
    may go to the client with them (`Sink.finish`: one write, not two)."""

    begin: Begin
    on_events: Callable[[bytes], None] | None = None
    ends: Callable[[bytes], bool] | None = None


class UpstreamError(Exception):
    """A failure of the worker or of the way to it: refused, reset, timed out, a malformed answer."""


class WorkerSilent(UpstreamError):
    """Nothing from the worker for the read timeout (it may be waiting on something else: a decode leg
    on KV its prefill worker never sends)."""


class AnswerTooLarge(UpstreamError):
    """The answer (a whole one, or a stream's event not yet ended) grew past ``proxy_max_answer_bytes``."""


@dataclass(frozen=True, slots=True)
class _Endpoint:
    host: str
    port: int
    tls: bool
    prefix: bytes  # the request line up to the path: b"POST /base"
    host_header: bytes


def _endpoint(url: str) -> _Endpoint:
    parts = urlsplit(openai_base(url))  # a worker's URL may end in /v1: the paths are the server root's
    assert parts.hostname is not None
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    base = parts.path.rstrip("/")
    return _Endpoint(parts.hostname, port, tls, b"POST " + base.encode("latin-1"), parts.netloc.encode("idna"))


def _whole_events(data: bytes) -> bytes:
    """The last bytes of a stream whose answer is whole, without an event it ended in the middle of (a
    partial event never reaches the client: it would run into the error event that follows it), unless
    that is the stream's end (``data: [DONE]`` without its blank line)."""
    cut = after_last_event(data)
    if cut < len(data) and data[cut:].strip() and not finished_stream(data[cut:]):
        return data[:cut]
    return data


class _Departures:
    """The workers that left routing (`Upstream.abandon`) while requests waited for a connection (being
    made, or freed by another request): such a request, booked before its worker left, is failed once it
    has one, as the exchanges open then were. Who left is kept only while some request waits."""

    __slots__ = ("_left", "count", "waiting")

    def __init__(self) -> None:
        self.count = 0  # departures so far
        self.waiting = 0  # requests waiting for a connection now
        self._left: dict[int, tuple[int, str]] = {}  # worker id: its last departure's number, and why

    def left(self, worker_id: int, why: str) -> None:
        self.count += 1
        if self.waiting:
            self._left[worker_id] = (self.count, why)
        else:
            self._left.clear()  # no request waits that began before these departures

    def since(self, worker_id: int | None, seen: int) -> str | None:
        """Why the worker left after departure number ``seen`` (None: it did not)."""
        left = self._left.get(worker_id) if worker_id is not None and self.count != seen else None
        return left[1] if left is not None and left[0] > seen else None


class Upstream:
    """The pools, one per worker URL; created on the running loop (`start`), closed with the app."""

    def __init__(self, config: ProxyConfig) -> None:
        self._config = config
        self._pools: dict[str, _Pool] = {}
        self._departures = _Departures()
        self._tls: ssl.SSLContext | None = None
        self._running = False

    async def start(self) -> None:
        self._running = True

    async def stop(self) -> None:
        self._running = False
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    async def open(
        self,
        url: str,
        path: bytes,
        body: bytes,
        headers: bytes = b"",
        streaming: Streaming | None = None,
        patient: Callable[[], bool] | None = None,
        worker_id: int | None = None,
    ) -> UpstreamConnection:
        """Send ``POST path`` with ``body`` (JSON) and the raw header lines ``headers`` to the worker
        at ``url``; returns once the answer's status and headers are in. Raises `UpstreamError`.
        ``worker_id``: the worker the exchange is with, failed at once if it leaves routing (`abandon`).
        ``streaming``: a 200 answer is a stream, handed on from the read callback as it says.
        ``patient``: asked when the worker has been silent for the read timeout; True (its worker still
        in routing) waits on: a whole answer (no stream) comes at its end, so its silence says nothing
        of the worker. Whatever the worker sends, a whole answer's end (a stream's first events) comes
        within ``proxy_request_timeout_secs`` of the request, or the answer fails."""
        pool = self._pools.get(url)
        if pool is None:
            if not self._running:
                raise RuntimeError("the proxy's upstream client is not started")
            pool = self._pools[url] = _Pool(_endpoint(url), self._config, self._tls_context, self._departures)
        return await pool.send(path, body, headers, streaming, patient, worker_id)

    async def post(self, url: str, path: bytes, body: bytes, worker_id: int | None = None) -> tuple[int, bytes]:
        """A whole exchange: the status and body of ``POST path`` (used for ``/tokenize``)."""
        connection = await self.open(url, path, body, worker_id=worker_id)
        try:
            return connection.status, await connection.read()
        finally:
            connection.release()

    def abandon(self, worker_id: int, why: str) -> int:
        """The worker left routing as gone or unreachable (``why``): each of its exchanges whose answer is
        not yet whole fails now, as a broken connection fails it (before the client has a byte, the
        request goes to another worker; mid-stream, the stream ends with an error event), and so does each
        request for it still waiting for a connection. Returns how many exchanges failed."""
        self._departures.left(worker_id, why)
        abandoned = [
            connection
            for pool in self._pools.values()
            for connection in pool.connections
            if connection.worker_id == worker_id and connection.answering
        ]
        for connection in abandoned:
            connection._fail(UpstreamError(f"left routing: {why}"))
        return len(abandoned)

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls


class _Pool:
    """The connections to one worker: idle ones (most recently used last) and a bound on how many."""

    def __init__(
        self, endpoint: _Endpoint, config: ProxyConfig, tls: Callable[[], ssl.SSLContext], departures: _Departures
    ) -> None:
        self.endpoint = endpoint
        self._departures = departures
        self._limit = config.proxy_connections_per_worker
        self._connect_timeout = config.proxy_connect_timeout_secs
        self.read_timeout = config.proxy_read_timeout_secs
        self.request_timeout = config.proxy_request_timeout_secs
        self.first_check = min(self.read_timeout, self.request_timeout)  # the first of an exchange's timeouts
        self.max_answer_bytes = config.proxy_max_answer_bytes
        self._tls = tls
        self.idle: list[UpstreamConnection] = []
        self.connections: set[UpstreamConnection] = set()  # connected and not yet lost: idle or carrying an exchange
        self.opened = 0  # connections open or being opened
        self._waiting: deque[asyncio.Future[UpstreamConnection | None]] = deque()
        self.closed = False

    async def send(
        self,
        path: bytes,
        body: bytes,
        headers: bytes,
        streaming: Streaming | None,
        patient: Callable[[], bool] | None,
        worker_id: int | None,
    ) -> UpstreamConnection:
        endpoint = self.endpoint
        request = b"".join(
            (endpoint.prefix, path, b" HTTP/1.1\r\nhost: ", endpoint.host_header,
             b"\r\ncontent-type: application/json\r\ncontent-length: ", str(len(body)).encode(), b"\r\n",
             headers, b"\r\n", body)
        )  # fmt: skip
        connection = await self._acquire(worker_id)
        reused = connection.used
        try:
            try:
                await connection.send(request, streaming, patient, worker_id)
            except _ClosedBeforeAnswer:
                if not reused:
                    raise UpstreamError("the worker closed the connection before answering") from None
                # The worker closed an idle connection as this request went out: once more, afresh.
                connection = await self._acquire(worker_id, fresh=True)
                await connection.send(request, streaming, patient, worker_id)
        except asyncio.CancelledError:
            connection.close()  # cancelled before the answer's head: the engine must stop the request too
            raise
        return connection

    async def _acquire(self, worker_id: int | None, fresh: bool = False) -> UpstreamConnection:
        """An idle connection (unless ``fresh``), else a new one once there is room for it. Raises
        `UpstreamError` if ``worker_id`` left routing while the request waited (`_Departures`)."""
        loop = asyncio.get_running_loop()
        if not fresh:
            idle = self._idle_connection(loop)
            if idle is not None:
                return idle
        departures = self._departures
        seen = departures.count
        departures.waiting += 1
        try:
            connection = await self._new_or_freed(loop, fresh, partial(departures.since, worker_id, seen))
        finally:
            departures.waiting -= 1
        why = departures.since(worker_id, seen)
        if why is not None:  # it left while the connection was being made
            connection.close()
            raise UpstreamError(f"left routing: {why}")
        return connection

    def _idle_connection(self, loop: asyncio.AbstractEventLoop) -> UpstreamConnection | None:
        now = loop.time()
        while self.idle:
            connection = self.idle.pop()
            if connection.reusable(now):
                return connection
            connection.close()
        return None

    async def _new_or_freed(
        self, loop: asyncio.AbstractEventLoop, fresh: bool, departed: Callable[[], str | None]
    ) -> UpstreamConnection:
        """A new connection once there is room for it, or one another request freed; raises `UpstreamError`
        once ``departed`` says why the worker left routing, before connecting to it again (its connections
        closed as it left made room for one)."""
        while True:
            why = departed()
            if why is not None:
                raise UpstreamError(f"left routing: {why}")
            if self._limit == 0 or self.opened < self._limit:
                return await self._connect(loop)
            waiter: asyncio.Future[UpstreamConnection | None] = loop.create_future()
            self._waiting.append(waiter)
            try:
                handed = await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():  # handed one as it was cancelled: pass it on
                    self._hand_on(waiter.result())
                raise
            finally:
                if waiter in self._waiting:
                    self._waiting.remove(waiter)
            if handed is not None:
                return handed
            if not fresh:
                idle = self._idle_connection(loop)
                if idle is not None:
                    return idle

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> UpstreamConnection:
        endpoint = self.endpoint
        self.opened += 1
        made: list[UpstreamConnection] = []  # the connection's protocol, once its socket connected

        def protocol() -> UpstreamConnection:
            made.append(UpstreamConnection(self))
            return made[0]

        opening = loop.create_connection(
            protocol, endpoint.host, endpoint.port, ssl=self._tls() if endpoint.tls else None
        )
        try:
            _, connection = await within(self._connect_timeout, opening)
        except BaseException as exc:
            if made and made[0].connected:
                # Open all the same (the request cancelled as it connected): closed, and its
                # connection_lost gives the place back, once.
                made[0].close()
            else:
                self._gone()
            if isinstance(exc, TimeoutError):
                raise UpstreamError(f"connect timeout after {self._connect_timeout:g} s") from None
            if isinstance(exc, OSError):
                raise UpstreamError(_describe(exc)) from None
            raise
        self.connections.add(connection)
        return connection

    def put_back(self, connection: UpstreamConnection) -> None:
        self._hand_on(connection)

    def _gone(self) -> None:
        """A connection closed (or never opened): its place may go to a waiting request."""
        self.opened -= 1
        self._hand_on(None)

    def _hand_on(self, connection: UpstreamConnection | None) -> None:
        """A connection, or (None) a free place for one, to the first request still waiting; a
        connection nobody waits for is kept idle."""
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(connection)
                return
        if connection is not None:
            self.idle.append(connection)

    def forget(self, connection: UpstreamConnection) -> None:
        if connection in self.idle:
            self.idle.remove(connection)
        self.connections.discard(connection)
        self._gone()

    def close(self) -> None:
        self.closed = True
        for connection in self.idle:
            connection.close()
        self.idle.clear()


class _ClosedBeforeAnswer(UpstreamError):
    """The connection closed before a byte of the answer came back."""


class _AfterTheAnswer(Exception):
    """Raised in the parser's callback: more bytes came after the whole answer."""


class UpstreamConnection(asyncio.Protocol):
    """One connection to a worker and the exchange it carries (the parser's callbacks are its methods).

    After `Upstream.open`: `status` and `content_type` are known; then either `read` the whole body,
    or (opened with ``begin``) await `handed_on`, the
    stream going to the client from the read callback; finally `release` (back to the pool if the
    answer is complete and the worker keeps the connection alive) or `close`.
    """

    def __init__(self, pool: _Pool) -> None:
        self._pool = pool
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.used = False  # has carried an exchange before
        self.status = 0
        self.content_type: bytes | None = None
        self.retry_after: bytes | None = None  # the answer's Retry-After (an overloaded engine's 429 or 503)
        self._delimited = False  # the body's end is marked (content-length or chunked), not the close
        self._keep_alive = False  # the worker keeps the connection open after this answer
        self._pieces: list[bytes] = []  # decoded body not yet taken
        # A stream's event not yet ended, held back until it is (its pieces, and its last 3 bytes: a
        # blank line may straddle two reads).
        self._unended: list[bytes] = []
        self._unended_tail = b""
        self._held = 0  # bytes received and not yet taken: at most the pool's max_answer_bytes
        # The last two pieces handed on: pieces hold whole events, and the usage report is the event
        # before [DONE], so it is in one of them.
        self._last = self._before_last = b""
        self._sink: Sink | None = None
        self._streaming: Streaming | None = None  # see `Upstream.open`
        self._head_in = False
        self.complete = False  # the whole answer is in
        self._problem: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self._paused = False  # reading paused: the client is behind
        self._idle_since = 0.0
        self._heard = 0.0  # loop time of the last byte from the worker
        self._sent_at = 0.0  # loop time the request went out
        self._patient: Callable[[], bool] | None = None  # see `Upstream.open`
        self.worker_id: int | None = None  # the worker of the exchange it carries (`Upstream.abandon`)
        self._finished = False  # the stream handed on has ended at the client (`Sink.finish`)
        self.read_at = 0.0  # perf_counter time of the last read a waiting coroutine was woken for
        self.begun_at = 0.0  # streaming: perf_counter time of the read that brought the first events
        self.first_sent_at = 0.0  # and of their write to the client (0: not begun)
        self._silence: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass, but is one

    def data_received(self, data: bytes) -> None:
        if self.complete or not self.used:
            self.close()  # bytes nobody asked for: the connection cannot be trusted with another request
            return
        self._heard = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamError("the worker switched protocols"))
            return
        except httptools.HttpParserError as exc:
            # Nothing of a read that broke the answer is handed on: the client has only whole events
            # of an answer that was sound when they went (and nothing at all if none had gone).
            self._fail(UpstreamError(f"malformed answer: {exc}"))
            return
        pieces = self._pieces
        sink = self._sink
        if sink is None:
            self.read_at = time.perf_counter()
            if pieces and self._handed_on_as_it_comes:
                self._start_handing_on()
            self._wake()
        elif pieces:  # handed on in this callback; the coroutine waiting is woken only at the end
            self._hand_on(sink, self._take_events())
        if self._held > self._pool.max_answer_bytes:
            what = "an event of its stream" if self.begun else "its answer"
            limit = self._pool.max_answer_bytes
            self._fail(AnswerTooLarge(f"{what} exceeds proxy_max_answer_bytes ({limit} bytes)"))

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        was_closed = self._closed
        self._closed = True
        self._cancel_silence()
        self._pool.forget(self)
        if was_closed or self.complete:
            return
        if self._head_in and not self._delimited:
            self.on_message_complete()  # an answer whose end is the connection's
            return
        if not self._head_in and not self._pieces and self.status == 0:
            self._fail(_ClosedBeforeAnswer(_describe(exc) if exc else "the worker closed the connection"))
        else:
            why = f" ({_describe(exc)})" if exc else ""
            self._fail(UpstreamError("the worker closed the connection mid-answer" + why))

    # ------------------------------------------------------------------ httptools callbacks
    def on_message_begin(self) -> None:
        if self.complete:
            # Bytes after the whole answer, in the same read: an answer to nothing we asked (a second
            # one glued to the first, say). Raised, it stops the parser before it reads them into
            # this exchange; the connection is closed (`data_received`), never reused.
            raise _AfterTheAnswer

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-type":
            self.content_type = value
        elif name == b"retry-after":
            self.retry_after = value
        elif name in (b"content-length", b"transfer-encoding"):
            self._delimited = True

    def on_headers_complete(self) -> None:
        parser = self._parser
        self.status = parser.get_status_code()
        self._keep_alive = parser.should_keep_alive()  # read here: the parser forgets it at the message's end
        if self.status < 200:  # an interim answer (100 Continue, 103 Early Hints): the real one follows
            self.status = 0
            self._delimited = False
            self.content_type = self.retry_after = None  # its headers are not the answer's
            return
        if self.status in (204, 304):
            self._delimited = True
        self._head_in = True

    def on_body(self, body: bytes) -> None:
        self._pieces.append(body)
        self._held += len(body)

    def on_message_complete(self) -> None:
        if not self._head_in:
            return  # the end of an interim answer
        if self._held > self._pool.max_answer_bytes and not self._handed_on_as_it_comes:
            # A whole answer left incomplete: `data_received` fails it as too large, in one read as over
            # several. (A stream's whole events are handed on first; what stays held is checked then.)
            return
        self.complete = True
        self._cancel_silence()
        self._resume_reading()
        self._wake()

    # ------------------------------------------------------------------ the exchange
    async def send(
        self,
        request: bytes,
        streaming: Streaming | None = None,
        patient: Callable[[], bool] | None = None,
        worker_id: int | None = None,
    ) -> None:
        """Write the request; returns once the answer's head is in (see `Upstream.open`)."""
        self.used = True
        self._reset()
        self._streaming = streaming
        self._patient = patient
        self.worker_id = worker_id
        transport = self._transport
        if self._closed or transport is None or transport.is_closing():
            raise _ClosedBeforeAnswer("the connection was closed")
        transport.write(request)
        self._heard = self._sent_at = self._loop.time()
        self._silence = self._loop.call_later(self._pool.first_check, self._check_silence)
        while not self._head_in:
            await self._wait()

    async def read(self) -> bytes:
        """The whole body."""
        while not self.complete:
            await self._wait()
        pieces = self._pieces
        body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        return body

    # A stream is handed on in whole SSE events: an event cut short by a broken connection never
    # reaches the client (its error event follows the last whole one), and one cut by the network is
    # sent once its end has come.

    async def handed_on(self) -> bool:
        """Opened with `Streaming`: returns at the end of the stream handed on from the read callback,
        True if it began (its first events went to the client). Raises the answer's `UpstreamError`
        (`begun` tells whether the client has had part of the stream)."""
        while not self.complete:
            await self._wait()
        # What followed the last event boundary, once the answer is whole (an answer the close ends).
        sink = self._sink
        if sink is not None:
            self._hand_on(sink, self._take_events())
        elif self._handed_on_as_it_comes:
            self._start_handing_on()
        self._sink = None
        return self.begun

    @property
    def begun(self) -> bool:
        return self.first_sent_at != 0.0

    @property
    def _handed_on_as_it_comes(self) -> bool:
        """A stream's events go to the client from the read callback: opened with `Streaming`, and
        answered 200 (any other answer is read whole: an error to pass on, or to try again)."""
        return self._streaming is not None and self.status == 200

    def _start_handing_on(self) -> None:
        data = self._take_events()
        streaming = self._streaming
        if not data or streaming is None or self.begun_at:
            return
        self.begun_at = self.read_at
        sink = self._sink = streaming.begin(self.content_type)
        self._hand_on(sink, data)
        self.first_sent_at = time.perf_counter()

    def _hand_on(self, sink: Sink, data: bytes) -> None:
        assert self._streaming is not None  # handing on began
        ends = self._streaming.ends
        if self.complete and ends is not None and not self._finished and ends(self.tail):
            # The end goes with the last events: one write, not a second one when the handler next runs.
            self._finished = True
            sink.finish(data)
            return
        if data and sink.write(data) and not self.complete:
            self._pause_reading()
            sink.when_drained(self._resume_reading)

    def _take_events(self) -> bytes:
        """The body received so far up to its last event boundary (all of it once complete)."""
        pieces = self._pieces
        if self._unended and (pieces or self.complete):
            data = self._after_unended()
        elif not pieces:
            return b""
        else:
            data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            pieces.clear()
            if not self.complete:
                cut = after_last_event(data)
                if cut < len(data):
                    self._hold_back(data[cut:])
                    data = data[:cut]
        if data:
            self._held -= len(data)
            if self.complete:
                data = _whole_events(data)
        if data:
            self._before_last = self._last
            self._last = data
            streaming = self._streaming
            if streaming is not None and streaming.on_events is not None:
                streaming.on_events(data)
        return data

    def _hold_back(self, unended: bytes) -> None:
        self._unended.append(unended)
        self._unended_tail = unended[-3:]

    def _after_unended(self) -> bytes:
        """`_take_events` while an event is held back: only the bytes that came since (and the three
        before them) are searched for its end, so that an event many reads long is joined and searched
        once, not once a read (which took seconds of the loop for an event of a few MiB)."""
        pieces, unended = self._pieces, self._unended
        fresh = b"".join(pieces)
        pieces.clear()
        if self.complete:
            data = b"".join(unended) + fresh
            unended.clear()
            return data
        probe = self._unended_tail + fresh
        cut = after_last_event(probe) - len(self._unended_tail)  # in fresh; none: at most 0
        if cut <= 0:
            unended.append(fresh)
            self._unended_tail = probe[-3:]
            return b""
        data = b"".join(unended) + fresh[:cut]
        unended.clear()
        if cut < len(fresh):
            self._hold_back(fresh[cut:])
        return data

    def release(self) -> None:
        """Done with the answer: back to the pool if it was read to its end, else closed."""
        self._cancel_silence()
        self._streaming = self._patient = None  # they hold the request's answer: not kept while idle
        if not self.complete or self._closed or not self._keep_alive or self._pool.closed:
            self.close()
            return
        self._idle_since = self._loop.time()
        self._pool.put_back(self)

    @property
    def answering(self) -> bool:
        """Carrying an exchange whose answer is not yet whole."""
        return self.used and not self.complete and not self._closed

    @property
    def connected(self) -> bool:
        """Its socket connected (and connection_lost will come, once)."""
        return self._transport is not None

    def close(self) -> None:
        self._cancel_silence()
        if self._transport is not None and not self._closed:
            self._closed = True
            self._transport.close()  # connection_lost gives the pool its place back

    def reusable(self, now: float) -> bool:
        return not self._closed and now - self._idle_since < IDLE_SECS

    # ------------------------------------------------------------------ internals
    def _reset(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.content_type = None
        self.retry_after = None
        self._delimited = False
        self._keep_alive = False
        self._pieces = []
        self._unended = []
        self._unended_tail = b""
        self._held = 0
        self._last = self._before_last = b""
        self._sink = None
        self._finished = False
        self.begun_at = self.first_sent_at = 0.0
        self._head_in = False
        self.complete = False
        self._problem = None

    async def _wait(self) -> None:
        """Wait for the next read (or the answer's failure); raises the answer's problem only before
        a wait, so that a caller's loop returns on what it waited for (the head, say) even when the
        same read brought a failure: the stream may have begun from that read, and its failure is
        then the client's error event (`handed_on`), not a retry of an unanswered request."""
        if self._problem is not None:
            raise self._problem
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, problem: UpstreamError) -> None:
        if self._problem is None and not self.complete:
            self._problem = problem
            self._pieces.clear()  # never handed on nor read now: not held until the connection goes
            self._unended.clear()
        self.close()
        self._wake()

    @property
    def tail(self) -> bytes:
        """The last two pieces of the body handed on: at least its last two events."""
        return self._before_last + self._last

    def _pause_reading(self) -> None:
        if not self._paused and self._transport is not None and not self._closed:
            self._paused = True
            self._transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._paused and self._transport is not None and not self._closed:
            self._paused = False
            self._heard = self._loop.time()  # the worker's silence counts from here: we were not listening
            self._transport.resume_reading()

    def _check_silence(self) -> None:
        """The exchange's timeouts: a worker silent for the read timeout has failed (unless ``patient``
        says to wait on), and until the client has a byte of the answer (a whole answer's end, a
        stream's first events) the request timeout bounds the wait in all, silent or not: a worker
        trickling its answer is heard, yet holds the request and its booking."""
        self._silence = None
        if self.complete or self._closed:
            return
        pool = self._pool
        now = self._loop.time()
        left = math.inf if self.begun else self._sent_at + pool.request_timeout - now
        if left <= 0:
            self._fail(UpstreamError(f"no answer within {pool.request_timeout:g} s (proxy_request_timeout_secs)"))
            return
        timeout = pool.read_timeout
        if self._paused:  # the client is behind, not the worker: nothing is read, so nothing is heard
            self._silence = self._loop.call_later(timeout, self._check_silence)
            return
        remaining = self._heard + timeout - now
        if remaining > 0:
            self._silence = self._loop.call_later(min(remaining, left), self._check_silence)
            return
        patient = self._patient
        if patient is None or not patient():
            self._fail(WorkerSilent(f"read timeout: nothing from the worker for {timeout:g} s"))
            return
        self._silence = self._loop.call_later(min(timeout, left), self._check_silence)

    def _cancel_silence(self) -> None:
        if self._silence is not None:
            self._silence.cancel()
            self._silence = None


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

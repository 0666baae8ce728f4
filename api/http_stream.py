"""Stream routes: a handler gets a whole request (`StreamCall`: body, ``Authorization``) and writes
its answer whole or as a stream; the OpenAI proxy's routes are stream routes.

The contract is `StreamRoute` and `StreamCall`; it has two adapters: the HTTP protocol's
`StreamedRequest` here, written straight to the client's transport, and `api.asgi`'s
`AsgiStreamedRequest` (a FastAPI route, `api.asgi.StreamEndpoint`) for any ASGI server.
`api.http_protocol.HttpProtocol` collects a stream
route's request as it collects a hot one (body limit, ``Expect: 100-continue``, keep-alive and
pipelining are the protocol's), then its handler gets a `StreamedRequest` writing the answer
straight to the client's transport. A streamed body goes out as HTTP/1.1 chunks, one per piece
handed on (the head with the first; to an HTTP/1.0 client, which knows no chunks, as they come, the
connection's end ending the body); the handler's coroutine runs at once on the protocol's
callback and gets a task only if it has to wait (it does, for the worker). When the client's
connection is lost, that task is cancelled. A body over the limit never reaches the handler: the
protocol answers what the route's own `StreamRoute.too_large` gives (the proxy's: OpenAI's error
shape, counted in its metrics).

Per request this saves an ASGI cycle (scope, task, receive / send dicts) and a task watching
for the disconnect; per piece, an ASGI message and its checks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from http import HTTPStatus
from typing import NamedTuple, Protocol

from api.codec import Reply
from api.eager import Suspended, start

logger = logging.getLogger(__name__)

__all__ = [
    "STATUS_LINE",
    "Headers",
    "Sink",
    "StreamCall",
    "StreamHandler",
    "StreamRoute",
    "StreamedRequest",
    "client_stalled",
    "head_of",
    "header_value",
    "whole_headers",
]

Headers = list[tuple[bytes, bytes]]
StreamHandler = Callable[["StreamCall"], Coroutine[object, object, None]]
_JSON = b"application/json"


def _phrase(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b""  # a status without a standard phrase (499: the client left)


# Status -> an HTTP/1.1 status line, made once.
STATUS_LINE = {status: b"HTTP/1.1 %d %s\r\n" % (status, _phrase(status)) for status in range(100, 600)}


class StreamRoute(NamedTuple):
    """A route the protocol answers with a `StreamedRequest`: its handler, what gives its answer
    to a body over the limit (a 413 in the route's own error shape, sent by the protocol instead of
    calling the handler; called once per such request, so that the route may count it), and how long
    a streamed answer waits for a client that has stopped reading before dropping its connection (the
    handler then ends as on a disconnect: a stalled client must not hold a worker's stream, and its
    booking, for good)."""

    handle: StreamHandler
    too_large: Callable[[bytes], Reply]  # given the request's header lines (`StreamCall.head`)
    write_timeout_secs: float


class Sink(Protocol):
    """Where a forwarded body goes, piece by piece, as it arrives (the client's connection)."""

    def write(self, data: bytes) -> bool:
        """Hand ``data`` on; True when the client is behind (the source then pauses until the sink
        calls the callback given to `when_drained`)."""
        ...

    def when_drained(self, resume: Callable[[], None]) -> None: ...

    def finish(self, data: bytes) -> None:
        """Hand on the answer's last piece (possibly empty) with its end, in one write: nothing is
        written after it, and `StreamCall.end` then adds nothing (it is called all the same)."""
        ...


class StreamCall(Protocol):
    """What a stream route's handler gets: the whole request, and its answer to write, whole
    (`whole`) or streamed (`begin`, then pieces through its `Sink`; `end`)."""

    body: bytes
    authorization: bytes | None
    # The request's header lines as the client sent them (``name: value\r\n`` each), read with
    # `header_value` for the few a handler needs besides Authorization.
    head: bytes

    def is_disconnected(self) -> bool:
        """Whether the client has gone (a cancellation of the handler is then the request's end)."""
        ...

    async def whole(self, status: int, headers: Headers, body: bytes) -> None:
        """A complete answer; ``headers`` without content-length (added here) nor content-type
        (``application/json`` unless given)."""
        ...

    def begin(self, status: int, headers: Headers) -> Sink:
        """The head of a streamed answer (``headers`` with its content-type), written with the first
        piece; the sink takes the pieces, from a read callback, without a wait."""
        ...

    async def end(self, last: bytes = b"") -> None:
        """The streamed answer's end, after ``last`` (an error event, say)."""
        ...


def client_stalled(timeout_secs: float) -> None:
    """Say why an answer's connection is dropped (both ways in: the protocol's and ASGI's)."""
    logger.warning(
        "a client read nothing of its answer for %g s: its connection is dropped and the request "
        "ended as a disconnect (proxy_client_write_timeout_secs)",
        timeout_secs,
    )


def header_value(head: bytes, name: bytes, lowered: bytes | None = None) -> bytes | None:
    """The value of header ``name`` (lower-case) in a request's header lines, or None. One search of
    the head (a few hundred bytes), only for the headers a handler asks for; ``lowered``: the head
    already lower-cased, with a leading newline (``b"\\n" + head.lower()``), to read several."""
    if not head:
        return None
    at = (lowered if lowered is not None else b"\n" + head.lower()).find(b"\n" + name + b":")
    if at < 0:
        return None
    start = at + len(name) + 1
    end = head.find(b"\r\n", start)
    return head[start : end if end >= 0 else len(head)].strip(b" \t\r\n")


def head_of(headers: Headers) -> bytes:
    """Header lines of (name, value) pairs (uvicorn's and ASGI's), as `StreamCall.head` holds them."""
    return b"".join(name + b": " + value + b"\r\n" for name, value in headers)


def whole_headers(headers: Headers, body: bytes) -> Headers:
    """``headers`` with content-type (JSON unless given) and content-length first."""
    if not any(name == b"content-type" for name, _ in headers):
        headers = [(b"content-type", _JSON), *headers]
    return [*headers, (b"content-length", str(len(body)).encode())]


class _Request(Protocol):
    """The protocol's record of the request (`api.http_protocol`'s hot request)."""

    http_version: str
    keep_alive: bool
    response_complete: bool


class _Connection(Protocol):
    """What a streamed request uses of the protocol (`api.http_protocol.HttpProtocol`)."""

    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    tasks: set[asyncio.Task[None]]

    def stream_complete(self, status: int) -> None: ...

    def stream_crashed(self, exc: BaseException | None, started: bool) -> None: ...

    def default_header_lines(self) -> bytes: ...

    def write_paused(self) -> bool: ...

    async def drain(self) -> None: ...


class StreamedRequest:
    """One request on a stream route and its answer, written to the connection's transport."""

    __slots__ = (
        "_chunked", "_connection", "_drain_waiter", "_ended", "_head", "_request", "_status", "_task",
        "_write_timeout", "authorization", "body", "disconnected", "head",
    )  # fmt: skip

    def __init__(
        self,
        connection: _Connection,
        request: _Request,
        body: bytes,
        authorization: bytes | None,
        head: bytes = b"",
        *,
        write_timeout_secs: float,
    ) -> None:
        self._connection = connection
        self._request = request  # the protocol's record of it: keep_alive, response_complete
        self.body = body
        self.authorization = authorization
        self.head = head
        self._write_timeout = write_timeout_secs
        self._drain_waiter: asyncio.Task[None] | None = None  # `when_drained`'s, until the client catches up
        self.disconnected = False
        self._head: bytes | None = None  # a streamed answer's head, written with its first piece
        self._ended = False  # a streamed answer's end has been written (`finish`)
        # A streamed answer in chunks; to an HTTP/1.0 client (which knows none) its body ends with the connection.
        self._chunked = request.http_version != "1.0"
        self._status = 0
        self._task: asyncio.Task[None] | None = None

    def run(self, handler: StreamHandler) -> None:
        """Start ``handler`` on this request (eagerly: a task only once it waits)."""
        try:
            outcome = start(handler(self))
        except Exception as exc:
            self._crashed(exc)
            return
        if isinstance(outcome, Suspended):
            connection = self._connection
            task = self._task = outcome.task(connection.loop)
            connection.tasks.add(task)  # uvicorn's graceful shutdown waits for it
            task.add_done_callback(self._finished)
        else:
            self._done()

    def is_disconnected(self) -> bool:
        return self.disconnected

    def lost(self) -> None:
        """The client's connection is gone: the handler's wait ends in a cancellation (unless the
        client has its whole answer: the handler then ends as it would have)."""
        if self._ended:
            return
        self.disconnected = True
        if self._task is not None and not self._task.done():
            self._task.cancel()

    # ------------------------------------------------------------------ StreamCall
    async def whole(self, status: int, headers: Headers, body: bytes) -> None:
        self._write(self._head_lines(status, whole_headers(headers, body), b"") + body)

    def begin(self, status: int, headers: Headers) -> Sink:
        if not self._chunked:  # to an HTTP/1.0 client the streamed body ends with the connection
            self._request.keep_alive = False
        self._head = self._head_lines(status, headers, b"transfer-encoding: chunked\r\n" if self._chunked else b"")
        return self

    def write(self, data: bytes) -> bool:
        """One chunk of the streamed body; True while the client is not keeping up (`Sink.write`)."""
        head = self._head
        chunk = b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data
        if head is not None:
            self._head = None
            chunk = head + chunk
        connection = self._connection
        transport = connection.transport
        if not transport.is_closing():
            transport.write(chunk)
        return connection.write_paused()

    def finish(self, data: bytes) -> None:
        """The last chunk and the body's end in one write (`Sink.finish`). The answer is complete: a
        client leaving from here on no longer cancels the handler, and the connection takes the
        client's next request once the handler has had its turn (its wake-up is queued already: it
        frees what the request held first), not when its task's end is reported a loop turn later
        (the client may send its next request as soon as it has this end)."""
        head, self._head = self._head, None
        self._ended = True
        if self._chunked:
            data = (b"%x\r\n%b\r\n" % (len(data), data) if data else b"") + b"0\r\n\r\n"
        self._write((head or b"") + data)
        self._connection.loop.call_soon(self._done)

    def when_drained(self, resume: Callable[[], None]) -> None:
        """Call ``resume`` once the client has caught up (`Sink.when_drained`)."""
        task = self._drain_waiter = asyncio.ensure_future(self._drained(resume))
        self._connection.tasks.add(task)
        task.add_done_callback(self._connection.tasks.discard)

    async def end(self, last: bytes = b"") -> None:
        if self._ended:  # written with the last piece
            return
        if last:
            self.write(last)
        head, self._head = self._head, None
        self._write((head or b"") + (b"0\r\n\r\n" if self._chunked else b""))

    # ------------------------------------------------------------------ internals
    def _head_lines(self, status: int, headers: Headers, framing: bytes) -> bytes:
        self._status = status
        lines = [STATUS_LINE[status]]
        for name, value in headers:
            lines += (name, b": ", value, b"\r\n")
        lines.append(framing)
        lines.append(self._connection.default_header_lines())
        if not self._request.keep_alive:
            lines.append(b"connection: close\r\n")
        elif not self._chunked:  # an HTTP/1.0 client asked to keep it (`Connection: keep-alive`)
            lines.append(b"connection: keep-alive\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    def _write(self, data: bytes) -> None:
        transport = self._connection.transport
        if not transport.is_closing():
            transport.write(data)

    async def _drained(self, resume: Callable[[], None]) -> None:
        try:
            async with asyncio.timeout(self._write_timeout):
                await self._connection.drain()
        except TimeoutError:
            client_stalled(self._write_timeout)
            self._connection.transport.abort()  # connection_lost ends the handler as a disconnect
            return
        resume()

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._connection.tasks.discard(task)
        # Ended (a worker that failed while the client was behind): no drain to wait for, and no stall
        # to find later on a connection that may carry the next request by then.
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None:
            waiter.cancel()
        if not task.cancelled() and task.exception() is not None:
            self._crashed(task.exception())
            return
        self._done()

    def _done(self) -> None:
        if self._request.response_complete:
            return
        if self._status == 0 and not self.disconnected:
            self._crashed(None)  # the handler ended without an answer: a bug
            return
        self._connection.stream_complete(self._status)

    def _crashed(self, exc: BaseException | None) -> None:
        if not self._request.response_complete:
            self._connection.stream_crashed(exc, started=self._status != 0)
        elif exc is not None:  # after `finish`: the client has its whole answer, the defect is only logged
            logger.error("Exception after a streamed answer's end", exc_info=exc)

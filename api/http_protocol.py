"""The hot routes answered inside uvicorn's HTTP protocol, before ASGI.

uvicorn's httptools protocol costs about 45 µs of CPU per request on this VM before the app sees it:
an ASGI scope dict, an `asyncio.Event`, a task per request, and receive / send message dicts. A
routing decision on a 1k-token prompt costs about as much, and a decision is two requests (``new``,
then ``mark_free``). So `FastHttpProtocol`, a subclass of that protocol, answers ``POST`` to a hot
path itself: httptools parses the request as before, the body is collected from the parser's
callbacks, the route's `Handlers` method runs right there (its reply, with no coroutine, unless it
has to wait, which only a ``new`` parked in the router's queue does: that coroutine is started
eagerly, `api.eager`, and finished in a task only once it suspends), and one complete HTTP/1.1 response is
written to the transport.

Everything else is uvicorn's own code path, unchanged: other methods and paths reach the FastAPI
app through ASGI; so do the hot paths with ``fast_path`` off, under a ``root_path``, with
``limit_concurrency``, or on an upgrade request. Both kinds of request share uvicorn's per-connection
machinery, so keep-alive, pipelining (one request at a time per connection, answers in order),
reading paused while a pipelined request waits, graceful shutdown (a request in flight finishes, then
the connection closes) and the 400 for an unparsable request are uvicorn's; the keep-alive timeout
is too, with one lazily re-armed timer per connection instead of a new one per response. What the
ASGI fast path (`api.fastpath.FastPath`) does per request is kept: the body limit (a 413 before
reading a body whose ``Content-Length`` is over it, or as soon as a chunked body grows past it), the
same replies, headers (``content-type``, ``content-length``, ``x-request-id``) and metrics, and
``Expect: 100-continue``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar, cast

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import (
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)
from uvicorn.server import ServerState

from api.codec import Reply, RequestHead, call_of, read_head
from api.eager import Suspended, start
from api.fastpath import HotHandler, HotRoutes, too_large_reply
from api.http_stream import StreamedRequest, StreamRoute, head_of
from api.native import ENABLED as NATIVE
from api.native import accel

__all__ = ["FastHttpProtocol", "fast_protocol", "response_bytes"]

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_INTERNAL_ERROR = (
    STATUS_LINE[500] + b"content-type: text/plain; charset=utf-8\r\ncontent-length: 21\r\n"
    b"connection: close\r\n\r\nInternal Server Error"
)
_MEDIA = {False: b"application/json", True: b"application/msgpack"}
# (status, msgpack) -> a response's bytes up to its content-length value, made once each.
_HEADS: dict[tuple[int, bool], bytes] = {}


def _head(status: int, msgpack: bool) -> bytes:
    return STATUS_LINE[status] + b"content-type: " + _MEDIA[msgpack] + b"\r\ncontent-length: "


# (path, query, content_type, accept, x_request_id, authorization, body) of one whole request.
ParsedPost = tuple[bytes, bytes, bytes | None, bytes | None, str | None, bytes | None, bytes]
ParsePost = Callable[[bytes], ParsedPost | int | None]


def fast_protocol(hot: HotRoutes) -> type[FastHttpProtocol]:
    """The protocol class to give uvicorn (``Config(http=...)``) for an app's hot routes and stream
    routes (`api.http_stream`)."""
    routes = {path.encode("ascii"): handler for path, handler in hot.routes.items()}
    streamed = {path.encode("ascii"): handler for path, handler in hot.streams.items()}

    class BoundFastHttpProtocol(FastHttpProtocol):
        hot_routes = routes
        stream_routes = streamed
        max_body_bytes = hot.max_body_bytes

    return BoundFastHttpProtocol


class _NoEvent:
    __slots__ = ()

    def set(self) -> None:
        pass


class _HotRequest:
    """One hot request on a connection: what its handler reads, its body so far, where it stands.

    It takes the place of uvicorn's `RequestResponseCycle` as the connection's current ``cycle`` and
    in its pipeline, and has the attributes uvicorn's connection code reads there.
    """

    __slots__ = (
        "chunks",
        "complete",
        "disconnected",
        "expect_continue",
        "handler",
        "head",
        "http_version",
        "keep_alive",
        "path",
        "query",
        "raw_head",
        "refused",
        "response_complete",
        "size",
        "started",
    )
    message_event = _NoEvent()  # uvicorn's connection_lost sets the current cycle's event

    def __init__(
        self, handler: HotHandler, path: bytes, query: bytes, head: RequestHead, http_version: str, keep_alive: bool
    ) -> None:
        self.handler = handler
        self.path = path
        self.query = query
        self.head = head
        self.raw_head = b""  # a stream route's header lines (`StreamCall.head`)
        self.http_version = http_version
        self.keep_alive = keep_alive
        self.expect_continue = False
        self.chunks: list[bytes] = []
        self.size = 0
        self.started = False  # its turn on the connection has come
        self.complete = False  # the whole body is in
        self.refused = False  # over the body limit
        self.response_complete = False
        self.disconnected = False


class FastHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, answering ``POST`` to ``hot_routes`` without ASGI (see the module)."""

    hot_routes: ClassVar[dict[bytes, HotHandler]] = {}
    stream_routes: ClassVar[dict[bytes, StreamRoute]] = {}
    max_body_bytes: ClassVar[int] = 0
    # A read holding exactly one plain hot POST (its head possibly read before its body) is parsed in
    # one C call instead of httptools' six or more callbacks (`api._native.parse_post`; None:
    # httptools parses every request).
    parse_whole: ClassVar[ParsePost | None] = accel.parse_post if NATIVE else None

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        # Under a root path or a concurrency limit uvicorn's own handling differs per request: leave
        # every request to it.
        served = not config.root_path and config.limit_concurrency is None
        self._routes = self.hot_routes if served else {}
        self._streams = self.stream_routes if served else {}
        self._streamed: tuple[StreamedRequest, _HotRequest] | None = None  # the stream route being answered
        self._gone = False
        self._lost: asyncio.Future[None] | None = None
        self._wait_disconnect = self._disconnected
        self._reading_paused_for_writes = False
        self._idle_since = -1.0  # loop time of the last response while idle; -1 while busy
        self._between_messages = True  # httptools has no partial request
        self._head_read: bytes | None = None  # a plain hot request's head, its body still coming

    def data_received(self, data: bytes) -> None:
        waiting = self._head_read
        if waiting is not None:
            self._head_read = None
            data = waiting + data
        parse = type(self).parse_whole
        if parse is not None and self._between_messages and not self.pipeline:
            cycle: object = self.cycle
            if cycle is None or cycle.response_complete:  # type: ignore[attr-defined]
                parsed = parse(data)
                if isinstance(parsed, int):
                    # A plain head whose body is still coming (clients often write the two apart):
                    # keep the bytes and parse them whole with the rest; httptools never saw them.
                    if parsed <= self.max_body_bytes:
                        self._unset_keepalive_if_required()
                        self._head_read = data
                        return
                elif parsed is not None and self._whole_request(parsed, data):
                    return
        super().data_received(data)

    def _whole_request(self, parsed: ParsedPost, data: bytes) -> bool:
        """Answer one whole hot request parsed in C, as the httptools callbacks would; False for a
        path that is not hot or a body over the limit (httptools then parses it, as any request)."""
        path, query, content_type, accept, request_id, authorization, body = parsed
        handler = self._routes.get(path)
        if handler is not None and not self.access_log and len(body) <= self.max_body_bytes:
            # The usual request: its handler runs at once and its answer is written, with no request
            # record; one is made only if the handler has to wait (a `new` parked in the queue).
            self._idle_since = -1.0  # busy (`_unset_keepalive_if_required`, without the call)
            call = call_of(body, query, content_type, accept, request_id, authorization, self._wait_disconnect)
            try:
                answer = handler(call)
                outcome = answer if isinstance(answer, Reply) else start(answer)
            except Exception as exc:  # a bug: the handlers answer every error they know
                self._crashed(None, exc)
                return True
            if isinstance(outcome, Suspended):
                request = self._whole_hot_request(handler, parsed)
                self.cycle = request  # type: ignore[assignment]
                request.started = True
                self._wait_for(request, outcome)
            else:
                self._respond(None, outcome)
            return True
        handler = handler or cast(HotHandler | None, self._streams.get(path))
        if handler is None or len(body) > self.max_body_bytes:
            return False
        self._unset_keepalive_if_required()
        request = self._whole_hot_request(handler, parsed)
        request.raw_head = data[data.find(b"\r\n") + 2 : data.find(b"\r\n\r\n") + 2]  # its header lines
        self.cycle = request  # type: ignore[assignment]
        self._begin(request)
        return True

    @staticmethod
    def _whole_hot_request(handler: HotHandler, parsed: ParsedPost) -> _HotRequest:
        path, query, content_type, accept, request_id, authorization, body = parsed
        head = RequestHead(len(body), content_type, accept, request_id, authorization)
        request = _HotRequest(handler, path, query, head, "1.1", True)
        request.chunks.append(body)
        request.size = len(body)
        request.complete = True
        return request

    # ------------------------------------------------------------------ httptools callbacks
    def on_message_begin(self) -> None:
        self._between_messages = False
        # What a hot request needs; the ASGI scope is only built once the request is known not to be hot.
        self.url = b""
        self.expect_100_continue = False
        self.headers = []

    def on_headers_complete(self) -> None:
        parser = self.parser
        handler = None
        if parser.get_method() == b"POST" and not parser.should_upgrade():
            path, _, query = self.url.partition(b"?")
            handler = self._routes.get(path) or cast(HotHandler | None, self._streams.get(path))
        if handler is None:
            self._asgi_headers_complete()
            return
        http_version = parser.get_http_version()
        head = read_head(self.headers)
        keep_alive = http_version != "1.0" and parser.should_keep_alive()
        request = _HotRequest(handler, path, query, head, http_version, keep_alive)
        request.expect_continue = self.expect_100_continue
        if path in self._streams:
            request.raw_head = head_of(self.headers)
        request.refused = head.content_length > self.max_body_bytes  # answered before a byte of the body is read
        previous = self.cycle
        self.cycle = cast(RequestResponseCycle, request)
        if previous is None or previous.response_complete:
            self._begin(request)
        else:  # pipelined behind a request still being answered: its turn comes in on_response_complete
            self.flow.pause_reading()
            self.pipeline.appendleft((cast(RequestResponseCycle, request), self.app))

    def on_body(self, body: bytes) -> None:
        request: object = self.cycle
        if not isinstance(request, _HotRequest):
            super().on_body(body)
            return
        if request.refused or request.response_complete:
            return  # the parser reads the rest of a refused body; nobody keeps it
        request.size += len(body)
        if request.size > self.max_body_bytes:
            request.refused = True
            request.chunks = []
            if request.started:
                self._respond(request, self._too_large(request))
            return
        request.chunks.append(body)

    def on_message_complete(self) -> None:
        self._between_messages = True
        request: object = self.cycle
        if not isinstance(request, _HotRequest):
            super().on_message_complete()
            return
        request.complete = True
        if request.started and not request.refused:
            self._run(request)

    # ------------------------------------------------------------------ uvicorn's connection hooks
    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        """The next pipelined request's turn (called by uvicorn's on_response_complete)."""
        request: object = cycle
        if isinstance(request, _HotRequest):
            self._begin(request)
        else:
            super()._start_asgi_task(cycle, app)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._gone = True
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)
        if self._streamed is not None:
            self._streamed[0].lost()

    def _unset_keepalive_if_required(self) -> None:
        # Called on every read: the connection is busy. Rather than cancelling the idle timer here and
        # arming a new one after every response (2-3 µs a request), one timer per connection checks,
        # when it fires, whether the connection has really been idle that long.
        self._idle_since = -1.0

    def on_response_complete(self) -> None:
        """uvicorn's, with the lazily re-armed keep-alive timer: start the next pipelined request, or
        close the connection ``timeout_keep_alive`` seconds after this response if nothing comes."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        flow = self.flow
        if flow.read_paused:  # as its resume_reading checks: no call on a connection never paused
            flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._idle_since = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self._check_idle)

    def _check_idle(self) -> None:
        self.timeout_keep_alive_task = None
        if self._idle_since < 0:
            return  # busy: armed again when its response is complete
        remaining = self._idle_since + self.timeout_keep_alive - self.loop.time()
        if remaining > 0:
            self.timeout_keep_alive_task = self.loop.call_later(remaining, self._check_idle)
        else:
            self.timeout_keep_alive_handler()

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown; a head kept for its body is a request in flight: httptools
        takes it over (as if it had read it), so the request is answered before the connection closes."""
        held = self._head_read
        if held is not None:
            self._head_read = None
            super().data_received(held)
        super().shutdown()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._reading_paused_for_writes:
            self._reading_paused_for_writes = False
            self.flow.resume_reading()

    # ------------------------------------------------------------------ hot requests
    def _asgi_headers_complete(self) -> None:
        """Hand the request to uvicorn's ASGI path, with the scope its on_message_begin would have built."""
        url, headers, expect = self.url, self.headers, self.expect_100_continue
        super().on_message_begin()
        self.url, self.headers, self.expect_100_continue = url, headers, expect
        self.scope["headers"] = headers
        super().on_headers_complete()

    def _begin(self, request: _HotRequest) -> None:
        """Its turn has come: answer now if its body is in (or refused), else when it is."""
        request.started = True
        if request.refused:
            self._respond(request, self._too_large(request))
        elif request.complete:
            self._run(request)
        elif request.expect_continue and not self.transport.is_closing():
            self.transport.write(_CONTINUE)

    def _too_large(self, request: _HotRequest) -> Reply:
        """The 413 of a body over the limit: a stream route's own, or the service's."""
        stream = self._streams.get(request.path)
        return stream.too_large() if stream is not None else too_large_reply(self.max_body_bytes)

    def _run(self, request: _HotRequest) -> None:
        chunks = request.chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        request.chunks = []
        stream = self._streams.get(request.path)
        if stream is not None:
            streamed = StreamedRequest(self, request, body, request.head.authorization, request.raw_head)
            self._streamed = (streamed, request)
            streamed.run(stream.handle)
            return
        call = request.head.call(body, request.query, self._wait_disconnect)
        try:
            answer = request.handler(call)
            outcome = answer if isinstance(answer, Reply) else start(answer)
        except Exception as exc:  # a bug: the handlers answer every error they know
            self._crashed(request, exc)
            return
        if isinstance(outcome, Suspended):
            self._wait_for(request, outcome)
        else:
            self._respond(request, outcome)

    def _wait_for(self, request: _HotRequest, outcome: Suspended[Reply]) -> None:
        """A `new` waiting in the router's queue: it finishes in a task, answered when it is done."""
        task = outcome.task(self.loop)
        self.tasks.add(cast("asyncio.Task[None]", task))
        task.add_done_callback(partial(self._finished, request))

    def _finished(self, request: _HotRequest, task: asyncio.Task[Reply]) -> None:
        self.tasks.discard(cast("asyncio.Task[None]", task))
        if task.cancelled():  # uvicorn cancels what is left when the graceful shutdown times out
            self._crashed(request, None)
            return
        exc = task.exception()
        if exc is not None:
            self._crashed(request, exc)
        else:
            self._respond(request, task.result())

    def _respond(self, request: _HotRequest | None, reply: Reply) -> None:
        """Write ``reply`` (``request``: its record; None for a whole request answered at once, which
        is HTTP/1.1, keep-alive, with the access log off)."""
        keep_alive = True
        if request is not None:
            request.response_complete = True
            keep_alive = request.keep_alive
        transport = self.transport
        if not transport.is_closing():
            key = (reply.status, reply.msgpack)
            head = _HEADS.get(key) or _HEADS.setdefault(key, _head(*key))
            lines = b""
            if reply.headers or self.server_state.default_headers or not keep_alive:
                lines = self._header_lines(reply, keep_alive)
            transport.write(
                _response(head, reply.body, reply.request_id, lines)
                or response_bytes(head, reply.body, reply.request_id, lines)
            )
            if request is not None and self.access_log:
                self._log_access(request, reply.status)
            if not keep_alive:
                transport.close()
        self.on_response_complete()
        if self.flow.write_paused and not self._gone:
            # The client is not reading its answers: stop reading its requests until it catches up.
            self._reading_paused_for_writes = True
            self.flow.pause_reading()

    def _header_lines(self, reply: Reply, keep_alive: bool) -> bytes:
        """The header lines after content-length and x-request-id: the reply's own, uvicorn's
        defaults (none in the service: no date or server header), ``connection: close``."""
        lines = b""
        for extra_name, extra_value in reply.headers:
            lines += b"%s: %s\r\n" % (extra_name.encode("latin-1"), extra_value.encode("latin-1"))
        for name, value in self.server_state.default_headers:
            lines += b"%s: %s\r\n" % (name, value)
        if not keep_alive:
            lines += b"connection: close\r\n"
        return lines

    def _crashed(self, request: _HotRequest | None, exc: BaseException | None) -> None:
        """As uvicorn answers an app that raised: log it, send a 500, close the connection."""
        self.logger.error("Exception in ASGI application\n", exc_info=exc or asyncio.CancelledError())
        if request is not None:
            request.response_complete = True
        if not self.transport.is_closing():
            self.transport.write(_INTERNAL_ERROR)
            self.transport.close()
        self.on_response_complete()

    # ------------------------------------------------------------------ for stream routes (api.http_stream)
    def stream_complete(self, status: int) -> None:
        """The stream route's answer has been written to its end."""
        assert self._streamed is not None
        request = self._streamed[1]
        self._streamed = None
        request.response_complete = True
        if self.access_log:
            self._log_access(request, status)
        if not request.keep_alive and not self.transport.is_closing():
            self.transport.close()
        self.on_response_complete()

    def stream_crashed(self, exc: BaseException | None, started: bool) -> None:
        """The stream route's handler raised: a 500 if nothing was written yet, else the connection closes."""
        assert self._streamed is not None
        request = self._streamed[1]
        self._streamed = None
        if not started:
            self._crashed(request, exc)
            return
        self.logger.error("Exception in a streamed answer\n", exc_info=exc or asyncio.CancelledError())
        request.response_complete = True
        self.transport.close()
        self.on_response_complete()

    def default_header_lines(self) -> bytes:
        return b"".join(name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers)

    def write_paused(self) -> bool:
        return self.flow.write_paused

    async def drain(self) -> None:
        await self.flow.drain()

    def _log_access(self, request: _HotRequest, status: int) -> None:
        target = request.path + (b"?" + request.query if request.query else b"")
        client = f"{self.client[0]}:{self.client[1]}" if self.client else ""
        self.access_logger.info(
            '%s - "%s %s HTTP/%s" %d', client, "POST", target.decode("latin-1"), request.http_version, status
        )

    async def _disconnected(self) -> None:
        """Returns once the client has closed the connection (watched by a request in the queue)."""
        if self._gone:
            return
        if self._lost is None or self._lost.done():
            self._lost = self.loop.create_future()
        await self._lost


def response_bytes(head: bytes, body: bytes, request_id: str | None, lines: bytes) -> bytes:
    """One whole response: ``head`` (up to the content-length value), the length, ``x-request-id``,
    the other header ``lines``, the body (the twin of `api._native.response`)."""
    length = b"%d\r\n" % len(body)
    if request_id is not None:
        # The id is schema-checked visible ASCII, a uuid, or X-Request-Id as httptools let it
        # through (no control characters): this check is uvicorn's, kept as a guard.
        value = request_id.encode("latin-1")
        if not HEADER_VALUE_RE.search(value):
            length += b"x-request-id: %s\r\n" % value
    return b"%s%s%s\r\n%s" % (head, length, lines, body)


# The response in one C call (None: a request id that is not latin-1, left to `response_bytes`).
_response: Callable[[bytes, bytes, str | None, bytes], bytes | None] = accel.response if NATIVE else response_bytes

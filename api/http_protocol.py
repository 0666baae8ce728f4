"""kv-router's HTTP/1.1 protocol: the hot routes and the stream routes answered before ASGI, every
other request run on the ASGI app.

uvicorn's own protocols cost about 45 µs of CPU per request on this VM before the app sees it (an
ASGI scope dict, an `asyncio.Event`, a task, receive / send message dicts), about what a routing
decision on a 1k-token prompt costs, and a decision is two requests (``new``, then ``mark_free``).
So `HttpProtocol`, an `asyncio.Protocol` of our own on httptools' public `HttpRequestParser`,
answers ``POST`` to a hot path itself: the body is collected from the parser's callbacks, the
route's `Handlers` method runs right there (its reply, with no coroutine, unless it has to wait,
which only a ``new`` parked in the router's queue does: that coroutine is started eagerly,
`api.eager`, and finished in a task only once it suspends), and one complete HTTP/1.1 response is
written to the transport. With the C accelerator, a read holding exactly one plain hot ``POST`` is
parsed in one call (`api._native.parse_post`) instead of httptools' callbacks.

Every other request (other methods and paths; every path under a ``root_path`` or a concurrency
limit) is run on the ASGI app (`api.http_asgi.AsgiRequest`): scope, ``receive`` and
``send`` as the ASGI HTTP spec has them, a task per request. Both kinds share the connection's
machinery here: keep-alive (an idle connection closed after ``timeout_keep_alive``), a request's
head and body held to their timeouts (a 408, then the connection closes: a client must not hold a
connection with a request it never finishes; a lingering close, so that a client still sending gets
its 408 rather than a reset), all on one lazily re-armed timer per connection;
pipelining (one request answered at a time, in order; reading paused while a request waits its turn,
and the next one started only while the client reads its answers), ``Expect: 100-continue`` (a
refusal before the body closes the connection), chunked request bodies, HTTP/1.0 (kept alive on
``Connection: keep-alive``), ``Connection: close`` (no request read after the one a connection
closes with is run), a 400 for an unparsable request, flow control both ways, and graceful
shutdown: uvicorn hands each protocol `Config`, its `ServerState` and the lifespan's state
(``Config(http=HttpProtocol)``, `fast_protocol`); the connection registers in
``server_state.connections`` and its tasks in ``server_state.tasks``, which uvicorn's shutdown
drains, calling `shutdown` on each connection. No upgrade (WebSocket, h2c) is served: the service
has no such route, and such a request is answered as a plain HTTP one (its Content-Length body read
after the head, where httptools stops; a chunked one refused with a 400), then the connection closes.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, cast
from urllib.parse import unquote

import httptools
import msgspec

from api.codec import Reply, RequestHead, call_of, read_head
from api.contract import HotHandler, HotRoutes, too_large_reply
from api.eager import Suspended, start
from api.http_asgi import BAD_HEADER_VALUE, CONTINUE, Answered, AsgiRequest
from api.http_stream import STATUS_LINE, StreamedRequest, StreamRoute, head_of
from api.native import ENABLED as NATIVE
from api.native import accel

if TYPE_CHECKING:
    from uvicorn import Config
    from uvicorn.server import ServerState

__all__ = ["HttpProtocol", "fast_protocol", "response_bytes"]


def _json_closing(status: int, kind: str, message: str) -> bytes:
    """A whole JSON error (the service's shape) that closes the connection."""
    body = msgspec.json.encode({"error": {"type": kind, "message": message}})
    head = b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
    return STATUS_LINE[status] + head + body


# A request's target and its header section are bounded (unbounded, a client's 60 MB URL, gathered
# piece by piece, stalled every connection's loop for seconds and held that much memory). The section's
# bytes are counted as on the wire (a line's ": " and CRLF included), and its fields are at most
# MAX_HEADERS (Apache's default; a client's, a proxy's forwarding and tracing headers are a few dozen):
# counted by name and value alone, 65,000 empty fields passed (~100 bytes each kept: 200 such heads, 1.5 GB).
MAX_TARGET_BYTES = 65_536
MAX_HEADER_BYTES = 65_536
MAX_HEADERS = 100
_TARGET_TOO_LONG = _json_closing(414, "uri_too_long", f"the request target exceeds {MAX_TARGET_BYTES} bytes")
_HEADERS_TOO_LARGE = _json_closing(
    431, "headers_too_large", f"the request's header fields exceed {MAX_HEADER_BYTES} bytes"
)
_TOO_MANY_HEADERS = _json_closing(431, "headers_too_large", f"the request has more than {MAX_HEADERS} header fields")


# An upgrade is not served, so its request is plain HTTP/1.1, its body read after the head where httptools
# stops (`HttpProtocol._unsupported_upgrade`): a Content-Length one; a chunked one is refused.
_CHUNKED_UPGRADE = _json_closing(
    400,
    "malformed_request",
    "a chunked request body with an Upgrade header is not read (no upgrade is served): "
    "send it with a Content-Length, or without Upgrade",
)


def _upgrade_body_length(headers: list[tuple[bytes, bytes]]) -> int:
    """The Content-Length of an upgrade request's body (0: none); a chunked one is refused."""
    length = 0
    for name, value in headers:
        if name == b"transfer-encoding":
            raise _Refused(_CHUNKED_UPGRADE)
        if name == b"content-length":
            length = int(value)
    return length


def _timed_out(message: str) -> bytes:
    """The 408 of a request that did not arrive in time."""
    return _json_closing(408, "request_timeout", message)


def _malformed(error: httptools.HttpParserError) -> bytes:
    """The 400 of bytes that are not an HTTP/1.1 request, saying what the parser found."""
    found = str(error) or type(error).__name__
    return _json_closing(400, "malformed_request", f"not a valid HTTP/1.1 request: {found}")


# A connection closed while its client may still be sending (a 408, a 413, a refusal before the body, bytes
# that are not HTTP) lingers: its write side shut (the client sees the answer end), its input read and dropped
# for at most this long or this many bytes, then closed. Closed with unread input, or sent bytes once
# closed, the kernel resets the connection, and the client may lose the answer (or fail its send first).
LINGER_SECS = 2.0
LINGER_BYTES = 1 << 20


class _Lingering(asyncio.Transport):
    """A connection's transport in its lingering close, as the requests see it: closing, so that nothing
    more is written to it (its write side is shut); reading it and closing it go on."""

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__()
        self._transport = transport

    def is_closing(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        return None

    def close(self) -> None:
        self._transport.close()

    def abort(self) -> None:
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def can_write_eof(self) -> bool:
        return False  # shut already

    def write_eof(self) -> None:
        return None

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()


class _Refused(Exception):
    """Raised in a parser callback: the connection is answered ``reply`` and closed."""

    def __init__(self, reply: bytes) -> None:
        super().__init__()
        self.reply = reply


class _Closed(Exception):
    """Raised in a parser callback: a request began after the connection began to close (its answer
    said so, or an error ended it); it is never run (RFC 9112 §9.6), and what follows is dropped."""


_INTERNAL_ERROR = _json_closing(500, "internal_error", "the service failed on this request (its log says why)")
_UNAVAILABLE = _json_closing(503, "service_unavailable", "the server is at its limit of concurrent requests")
_MEDIA = {False: b"application/json", True: b"application/msgpack"}
# (status, msgpack) -> a response's bytes up to its content-length value, made once each.
_HEADS: dict[tuple[int, bool], bytes] = {}


def _head(status: int, msgpack: bool) -> bytes:
    return STATUS_LINE[status] + b"content-type: " + _MEDIA[msgpack] + b"\r\ncontent-length: "


# (path, query, content_type, accept, x_request_id, authorization, body) of one whole request.
ParsedPost = tuple[bytes, bytes, bytes | None, bytes | None, str | None, bytes | None, bytes]
ParsePost = Callable[[bytes], ParsedPost | int | None]


def fast_protocol(hot: HotRoutes) -> type[HttpProtocol]:
    """The protocol class to give uvicorn (``Config(http=...)``) for an app's hot routes and stream
    routes (`api.http_stream`)."""
    routes = {path.encode("ascii"): handler for path, handler in hot.routes.items()}
    streamed = {path.encode("ascii"): handler for path, handler in hot.streams.items()}

    class BoundHttpProtocol(HttpProtocol):
        hot_routes = routes
        stream_routes = streamed
        max_body_bytes = hot.max_body_bytes
        head_timeout_secs = hot.head_timeout_secs
        body_timeout_secs = hot.body_timeout_secs
        write_timeout_secs = hot.write_timeout_secs

    return BoundHttpProtocol


class _HotRequest:
    """One hot or stream-route request on a connection: what its handler reads, its body so far,
    where it stands."""

    __slots__ = (
        "body",
        "complete",
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
        # Its body so far: the first piece as it came; from a second on, one buffer holding them all (each
        # piece kept as its own bytes object, a body of tiny chunks cost ~28x its size).
        self.body: bytes | bytearray = b""
        self.size = 0
        self.started = False  # its turn on the connection has come
        self.complete = False  # the whole body is in
        self.refused = False  # over the body limit
        self.response_complete = False


class HttpProtocol(asyncio.Protocol):
    """One HTTP/1.1 connection: ``POST`` to ``hot_routes`` / ``stream_routes`` answered here, the
    rest run on the ASGI app (see the module)."""

    hot_routes: ClassVar[dict[bytes, HotHandler]] = {}
    stream_routes: ClassVar[dict[bytes, StreamRoute]] = {}
    max_body_bytes: ClassVar[int] = 0
    head_timeout_secs: ClassVar[float]  # from a request's first byte to its head's end
    body_timeout_secs: ClassVar[float]  # the longest a body being read may go without a byte
    write_timeout_secs: ClassVar[float]  # the longest a client may read nothing of a written answer
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
        self.loop = _loop or asyncio.get_event_loop()
        self.app = config.loaded_app
        self.app_state = app_state
        self.server_state = server_state
        self.tasks: set[asyncio.Task[None]] = server_state.tasks  # uvicorn's shutdown waits for them
        self.logger = logging.getLogger("uvicorn.error")
        self.access_logger = logging.getLogger("uvicorn.access")
        self.access_log = bool(config.access_log) and self.access_logger.hasHandlers()
        self.root_path = config.root_path
        self.limit_concurrency = config.limit_concurrency
        self.timeout_keep_alive = float(config.timeout_keep_alive)
        self.parser = httptools.HttpRequestParser(self)
        # Requests pipelined ahead of one saying `Connection: close` are answered, not refused with it
        # (uvicorn's setting: llhttp otherwise fails on any byte after such a request).
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        # Under a root path or a concurrency limit every request goes to the app.
        served = not config.root_path and config.limit_concurrency is None
        self._routes = self.hot_routes if served else {}
        self._streams = self.stream_routes if served else {}
        self.transport: asyncio.Transport = cast(asyncio.Transport, None)
        self.client: tuple[str, int] | None = None
        self.server: tuple[str, int] | None = None
        self.scheme = "http"
        # The request being answered (None between requests; a whole hot request answered at once
        # never becomes one), the one httptools is reading, and those waiting their turn.
        self._current: _HotRequest | AsgiRequest | None = None
        self._parsing: _HotRequest | AsgiRequest | None = None
        self._waiting: deque[_HotRequest | AsgiRequest] = deque()
        # `_start_waiting` is running, and a request it started asked for the next meanwhile.
        self._starting_waiting = False
        self._start_next = False
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._header_bytes = 0  # of the request being parsed: its header lines, as on the wire
        self._expect_continue = False
        self._streamed: tuple[StreamedRequest, _HotRequest] | None = None  # the stream route being answered
        self._gone = False
        self._lost: asyncio.Future[None] | None = None
        self._wait_disconnect = self._disconnected
        self._read_paused = False
        self._write_paused = False
        self._writable: asyncio.Event | None = None
        self._timer: asyncio.TimerHandle | None = None  # the connection's one timer (`_check_clocks`)
        self._timer_due = math.inf  # the loop time it fires at
        self._idle_since = -1.0  # loop time of the last response while idle; -1 while busy
        # A request being read: the loop time its head began, or its body last brought bytes; -1 while
        # none is. Its clock stands still while reading is paused here (it waits its turn).
        self._reading_since = -1.0
        self._reading_head = False  # its head is not all in yet (the head timeout), else its body
        # A stream route's answer is complete but not all read: the loop time by which the client must
        # have read some of it, else its connection is dropped (-1: none); that route's write timeout;
        # the bytes waiting for it then.
        self._write_deadline = -1.0
        self._write_timeout_secs = 0.0
        self._write_buffered = 0
        self._between_messages = True  # httptools has no partial request
        # A plain hot request's head and its body so far (parsed whole in C once the body is in), and the
        # bytes of its body still to come.
        self._held_post: list[bytes] | None = None
        self._held_missing = 0
        self._upgraded = False
        # An upgrade request whose body follows its head (started once httptools has stopped at the head),
        # and the bytes of that body still to come.
        self._upgrade_request: _HotRequest | AsgiRequest | None = None
        self._upgrade_left = 0
        # The connection is closing: no further request is read, let alone run (`on_message_begin`).
        self._closing = False
        self._linger_until = -1.0  # the loop time a lingering close ends at (`close_lingering`); -1: none
        self._linger_bytes_left = 0

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.server_state.connections.add(self)  # type: ignore[arg-type]  # uvicorn calls its shutdown()
        self.client = _address(transport.get_extra_info("peername"))
        self.server = _address(transport.get_extra_info("sockname"))
        if transport.get_extra_info("sslcontext") is not None:
            self.scheme = "https"
        self._idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server_state.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._client_gone()
        # What it held of the requests being read is freed now, by reference counting: this protocol is
        # in reference cycles (its parser and it refer to each other), and a full GC pass, which would
        # free them, can be long in coming (`api.server` freezes start-up's objects).
        parsing = self._parsing
        if type(parsing) is _HotRequest and not parsing.complete:
            parsing.body = b""  # its rest will not come: it is never run
        self._parsing = None
        self._waiting.clear()
        self._held_post = None
        self._headers = []
        self._url = b""

    def _client_gone(self) -> None:
        """The requests in flight see the client gone (its connection lost, or lingering)."""
        self._gone = True
        for request in (self._current, *self._waiting):
            if isinstance(request, AsgiRequest):
                request.lost()
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)
        if self._streamed is not None:
            self._streamed[0].lost()
        if self._writable is not None:
            self._writable.set()  # a send waiting for the client to read returns; the cycle sees it gone

    def eof_received(self) -> None:
        pass

    def pause_writing(self) -> None:
        self._write_paused = True
        if self._writable is not None:
            self._writable.clear()
        if self._streamed is None and self._write_deadline < 0 and not self.transport.is_closing():
            # An answer of the service's own routes (a stream route's clock is its own while it runs,
            # then `stream_complete` arms it).
            self._expect_reading(self.write_timeout_secs)

    def resume_writing(self) -> None:
        self._write_paused = False
        self._write_deadline = -1.0
        if self._writable is not None:
            self._writable.set()
        if self._current is None and self._waiting and not self.transport.is_closing():
            self._start_waiting()  # held back while the client did not read its answers (`request_answered`)
        elif self._read_paused and not self._waiting:
            self.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self._linger_until >= 0:
            self._linger_bytes_left -= len(data)
            if self._linger_bytes_left <= 0:
                self.transport.close()
            return
        held = self._held_post
        if held is not None:
            # Joined once, when the whole body is in: joined and parsed again on every read, a body sent
            # in small pieces cost time quadratic in its size.
            held.append(data)
            self._held_missing -= len(data)
            if self._held_missing > 0:
                self._reading_since = self.loop.time()
                return
            self._held_post = None
            self._reading_since = -1.0
            data = b"".join(held)
        parse = type(self).parse_whole
        if parse is not None and self._between_messages and self._current is None and not self._waiting:
            parsed = parse(data)
            if isinstance(parsed, int):
                # A plain head whose body is still coming (clients often write the two apart): keep
                # the bytes and parse them whole with the rest; httptools never saw them.
                if parsed <= self.max_body_bytes:
                    self._idle_since = -1.0
                    self._held_post = [data]
                    self._held_missing = data.index(b"\r\n\r\n") + 4 + parsed - len(data)
                    self._reading_head = False
                    now = self._reading_since = self.loop.time()
                    self._arm(now + self.body_timeout_secs)
                    return
            elif parsed is not None and self._whole_request(parsed, data):
                return
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        if self._upgraded:
            # The rest of its body, then what is not HTTP: the connection closes after its answer.
            self._upgrade_body(data)
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            self._unsupported_upgrade(data, upgrade.args[0])
        except httptools.HttpParserError as exc:
            if self._closing:
                return  # a request after the connection began to close (`_Closed`), and what follows
            refused = exc.__context__  # what a callback raised (httptools chains it so)
            reply = refused.reply if isinstance(refused, _Refused) else _malformed(exc)
            self.logger.warning("Invalid HTTP request received.")
            if not self.transport.is_closing():
                self.transport.write(reply)
                self.close_lingering()
            return
        if not (self._between_messages or self._reading_head):
            self._reading_since = self.loop.time()  # a body still coming brought bytes

    def _unsupported_upgrade(self, data: bytes, offset: int) -> None:
        """An upgrade request, answered as plain HTTP (`on_headers_complete` made it close the
        connection after its answer). httptools stops at its head (``offset`` in ``data``): a body
        (RFC 9110 §7.8: ignoring the upgrade, it is part of the request) is read here, from the bytes
        after it, before the request is complete."""
        self.logger.warning("Unsupported upgrade request.")
        self._upgraded = True
        request = self._upgrade_request
        if request is None:
            if self._parsing is not None:
                self.on_message_complete()
            return
        self._upgrade_request = None
        request.complete = False  # httptools completed it at its head
        self._parsing = request
        self._between_messages = False
        if self._current is None and not self._write_paused:
            self._current = request
            self._start(request)
        else:  # behind a request still being answered, as in `on_headers_complete`
            self.pause_reading()
            self._waiting.append(request)
        self._upgrade_body(data[offset:])

    def _upgrade_body(self, data: bytes) -> None:
        """Bytes after an upgrade request's head: its body's, up to its Content-Length; the rest dropped."""
        left = self._upgrade_left
        if left <= 0:
            return
        body = data[:left]
        self._upgrade_left = left = left - len(body)
        if body:
            self.on_body(body)
        if left > 0:
            now = self._reading_since = self.loop.time()  # the body's clock, as `_feed` keeps it
            self._arm(now + self.body_timeout_secs)
        elif self._parsing is not None:
            self.on_message_complete()

    # ------------------------------------------------------------------ uvicorn's server hooks
    def shutdown(self) -> None:
        """Graceful shutdown (uvicorn calls it on each connection): an idle connection closes now, a
        busy one after the answer to its request in flight. A head kept for its body is a request
        in flight: httptools takes it over (as if it had read it). A lingering close ends now."""
        if self._linger_until >= 0:
            self.transport.close()
            return
        held = self._held_post
        if held is not None:
            self._held_post = None
            self._feed(b"".join(held))
        request = self._current or self._parsing
        if request is None or request.response_complete:
            if not self.transport.is_closing():
                self.transport.close()
        else:
            request.keep_alive = False
            self._waiting.clear()

    # ------------------------------------------------------------------ whole hot requests (C parse)
    def _whole_request(self, parsed: ParsedPost, data: bytes) -> bool:
        """Answer one whole hot request parsed in C, as the httptools callbacks would; False for a
        path that is not hot or a body over the limit (httptools then parses it, as any request)."""
        path, query, content_type, accept, request_id, authorization, body = parsed
        handler = self._routes.get(path)
        if handler is not None and not self.access_log and len(body) <= self.max_body_bytes:
            # The usual request: its handler runs at once and its answer is written, with no request
            # record; one is made only if the handler has to wait (a `new` parked in the queue).
            self._idle_since = -1.0
            call = call_of(body, query, content_type, accept, request_id, authorization, self._wait_disconnect)
            try:
                answer = handler(call)
                outcome = answer if isinstance(answer, Reply) else start(answer)
            except Exception as exc:  # a bug: the handlers answer every error they know
                self.crashed(None, exc)
                return True
            if isinstance(outcome, Suspended):
                request = self._whole_hot_request(handler, parsed)
                self._current = request
                request.started = True
                self._wait_for(request, outcome)
            else:
                self._respond(None, outcome)
            return True
        handler = handler or cast(HotHandler | None, self._streams.get(path))
        if handler is None or len(body) > self.max_body_bytes:
            return False
        self._idle_since = -1.0
        request = self._whole_hot_request(handler, parsed)
        request.raw_head = data[data.find(b"\r\n") + 2 : data.find(b"\r\n\r\n") + 2]  # its header lines
        self._current = request
        self._begin(request)
        return True

    @staticmethod
    def _whole_hot_request(handler: HotHandler, parsed: ParsedPost) -> _HotRequest:
        path, query, content_type, accept, request_id, authorization, body = parsed
        head = RequestHead(len(body), content_type, accept, request_id, authorization)
        request = _HotRequest(handler, path, query, head, "1.1", True)
        request.body = body
        request.size = len(body)
        request.complete = True
        return request

    # ------------------------------------------------------------------ httptools callbacks
    def on_message_begin(self) -> None:
        if self._closing:
            raise _Closed
        self._between_messages = False
        self._idle_since = -1.0
        self._reading_head = True
        now = self._reading_since = self.loop.time()
        self._arm(now + self.head_timeout_secs)
        self._url = b""
        self._headers = []
        self._header_bytes = 0
        self._expect_continue = False

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_TARGET_BYTES:
            raise _Refused(_TARGET_TOO_LONG)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value) + 4  # its line: name, ": ", value, CRLF
        if self._header_bytes > MAX_HEADER_BYTES:
            raise _Refused(_HEADERS_TOO_LARGE)
        if len(self._headers) >= MAX_HEADERS:
            raise _Refused(_TOO_MANY_HEADERS)
        name = name.lower()
        value = value.rstrip(b" \t")  # llhttp drops a value's leading whitespace, not its trailing
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self.parser
        http_version = parser.get_http_version()
        # An upgrade is not served: the bytes after the request are not HTTP, so the connection closes.
        # Otherwise kept alive as llhttp reads on (HTTP/1.0 with `Connection: keep-alive` too): a
        # connection closed after an answer while llhttp went on had its next request run unanswered.
        upgrade = parser.should_upgrade()
        keep_alive = parser.should_keep_alive() and not upgrade
        method = parser.get_method()
        if upgrade and method != b"CONNECT":
            self._upgrade_left = _upgrade_body_length(self._headers)
        handler = None
        if method == b"POST" and not upgrade:
            path, _, query = self._url.partition(b"?")
            handler = self._routes.get(path) or cast(HotHandler | None, self._streams.get(path))
        request: _HotRequest | AsgiRequest
        if handler is None:
            request = self._asgi_request(method, http_version, keep_alive)
        else:
            head = read_head(self._headers)
            request = _HotRequest(handler, path, query, head, http_version, keep_alive)
            if path in self._streams:
                request.raw_head = head_of(self._headers)
            request.refused = head.content_length > self.max_body_bytes  # answered before the body is read
        request.expect_continue = self._expect_continue
        self._parsing = request
        self._reading_head = False
        if upgrade and self._upgrade_left:
            self._upgrade_request = request  # its body comes after httptools stops (`_unsupported_upgrade`)
            return
        if self._current is None and not self._write_paused:
            self._current = request
            self._start(request)
        else:
            # Pipelined behind a request still being answered, or behind answers the client has not
            # read: its turn comes in `request_answered` or `resume_writing`.
            self.pause_reading()
            self._waiting.append(request)

    def on_body(self, body: bytes) -> None:
        request = self._parsing
        if type(request) is AsgiRequest:
            request.body_received(body)
            return
        request = cast(_HotRequest, request)
        if request.refused or request.response_complete:
            return  # the rest of the read that brought its refusal; the lingering close drops what follows
        request.size += len(body)
        if request.size > self.max_body_bytes:
            request.refused = True
            request.keep_alive = False  # its connection ends with the 413 (see `_begin`)
            request.body = b""
            if request.started:
                self._respond(request, self._too_large(request))
            return
        held = request.body
        if isinstance(held, bytearray):
            held += body
        elif held:
            buffer = request.body = bytearray(held)
            buffer += body
        else:
            request.body = body

    def on_message_complete(self) -> None:
        self._between_messages = True
        self._reading_since = -1.0
        request = cast(_HotRequest | AsgiRequest, self._parsing)
        self._parsing = None
        # Its answer went out before its body was in (a 401, 404, 413): reading that body made the
        # connection busy, and nothing else would make it idle again for its keep-alive timeout.
        answered_early = request.response_complete
        if type(request) is AsgiRequest:
            request.body_complete()
        else:
            request = cast(_HotRequest, request)
            request.complete = True
            if request.started and not request.refused:
                self._run(request)
        if answered_early:
            self._idle()

    # ------------------------------------------------------------------ the connection's turns
    def _start(self, request: _HotRequest | AsgiRequest) -> None:
        if type(request) is AsgiRequest:
            self._run_asgi(request)
        else:
            self._begin(cast(_HotRequest, request))

    def request_answered(self) -> None:
        """The current request is answered: start the next pipelined one, or close the connection
        ``timeout_keep_alive`` seconds from now if nothing comes. While the client is not reading its
        answers, none of its requests is read or started (`resume_writing` starts the next one): they
        would pile up answers nobody reads."""
        self.server_state.total_requests += 1
        self._current = None
        if self.transport.is_closing():
            self._closing = True  # a request read after this one is never run
            return
        if self._write_paused:
            self.pause_reading()
            if self._waiting:
                return
        elif self._waiting:
            self._start_waiting()
            return
        elif self._read_paused:
            self.resume_reading()
        if self._between_messages:
            now = self._idle_since = self.loop.time()  # `_idle`, inline: once per response
            if now + self.timeout_keep_alive < self._timer_due:
                self._arm(now + self.timeout_keep_alive)
        elif not self._read_paused:
            self._arm(self._read_deadline())  # the next request is being read: its clock runs

    def _start_waiting(self) -> None:
        """The next pipelined request's turn (reading resumes: its body may still be coming). In a loop,
        not a recursion: a request answered at once asks for the next one from within `_start`
        (`request_answered`), and hundreds pipelined would overflow the stack (the connection then hung
        with its requests unanswered)."""
        if self._starting_waiting:
            self._start_next = True  # the loop below starts it once the answered request unwinds
            return
        self._starting_waiting = True
        try:
            self._start_next = True
            while self._start_next and self._waiting and self._current is None:
                self._start_next = False
                if self._read_paused:
                    self.resume_reading()
                request = self._current = self._waiting.popleft()
                self._start(request)
        finally:
            self._starting_waiting = False

    def _expect_reading(self, timeout_secs: float) -> None:
        """The client must read some of what was written to it within ``timeout_secs``, and as long
        again for each further piece, else its connection is dropped (`_check_clocks`): a client that
        never reads would hold it, and what was written to it, for good."""
        self._write_timeout_secs = timeout_secs
        self._write_deadline = self.loop.time() + timeout_secs
        self._write_buffered = self.transport.get_write_buffer_size()
        self._arm(self._write_deadline)

    def _idle(self) -> None:
        self._idle_since = self.loop.time()
        self._arm(self._idle_since + self.timeout_keep_alive)

    def _arm(self, deadline: float) -> None:
        """Have the connection's timer fire by loop time ``deadline``."""
        if deadline < self._timer_due:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_at(deadline, self._check_clocks)
            self._timer_due = deadline

    def _read_deadline(self) -> float:
        """When the request being read runs out of time: its head's, or its body's."""
        limit = self.head_timeout_secs if self._reading_head else self.body_timeout_secs
        return self._reading_since + limit

    def _check_clocks(self) -> None:
        """The connection's one timer: rather than cancelled on every read and armed again after every
        response (2-3 µs a request), it checks when it fires which clock has run out (a client not
        reading a stream route's complete answer, the idle keep-alive, the request being read, once its
        turn has come) and is armed again for the next deadline."""
        self._timer = None
        self._timer_due = math.inf
        now = self.loop.time()
        if 0 <= self._write_deadline <= now:
            buffered = self.transport.get_write_buffer_size()
            if buffered >= self._write_buffered:
                self.logger.warning(
                    "a client read nothing of its complete answer for %g s: its connection is dropped "
                    "(proxy_client_write_timeout_secs for the proxy's streams, else response_write_timeout_secs)",
                    self._write_timeout_secs,
                )
                self.transport.abort()
                return
            self._write_buffered = buffered  # it reads, slowly: as long again for the rest
            self._write_deadline = now + self._write_timeout_secs
        due = self._write_deadline if self._write_deadline >= 0 else math.inf
        if self._linger_until >= 0:
            if self._linger_until <= now:
                self.transport.close()
                return
            due = min(due, self._linger_until)
        elif self._idle_since >= 0:
            idle_until = self._idle_since + self.timeout_keep_alive
            if idle_until > now:
                due = min(due, idle_until)
            elif not self.transport.is_closing():
                self.transport.close()
        elif self._reading_since >= 0 and not self._read_paused and self._current in (None, self._parsing):
            read_until = self._read_deadline()
            if read_until > now:
                due = min(due, read_until)
            elif not self.transport.is_closing():
                self._read_timed_out()
        if due < math.inf:
            self._arm(due)

    def _read_timed_out(self) -> None:
        """The request being read did not come in time: a 408, unless it was answered already (a
        refusal before its body), and the connection closes."""
        if self._reading_head:
            message = f"the request's head did not arrive within {self.head_timeout_secs:g} s"
        else:
            message = f"the request's body brought nothing for {self.body_timeout_secs:g} s"
        self.logger.warning("%s: answered 408 and its connection closed", message)
        request = self._parsing
        answered = request is not None and (
            request.response_complete or (type(request) is AsgiRequest and request.response_started)
        )
        if not answered:
            self.transport.write(_timed_out(message))
        self.close_lingering()

    def close_lingering(self) -> None:
        """Close the connection after an answer written while its client may still be sending (see
        `LINGER_SECS`); the client's own close ends it sooner (`eof_received`). For the requests it is
        closed at once: they see their client gone and write nothing more (`_Lingering`)."""
        transport = self.transport
        if transport.is_closing():
            return
        if transport.can_write_eof():  # not under TLS: the client then has the answer's length alone
            transport.write_eof()
        self.transport = _Lingering(transport)
        self._client_gone()
        self._waiting.clear()
        self._held_post = None
        self._reading_since = self._idle_since = -1.0
        self._linger_bytes_left = LINGER_BYTES
        self._linger_until = self.loop.time() + LINGER_SECS
        if self._read_paused:
            self.resume_reading()
        self._arm(self._linger_until)

    def pause_reading(self) -> None:
        if not self._read_paused:
            self._read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._read_paused:
            self._read_paused = False
            self.transport.resume_reading()
            if self._reading_since >= 0:
                # Its clock stood still while the service did not read: it runs again from now.
                self._reading_since = self.loop.time()
                self._arm(self._read_deadline())

    async def drain(self) -> None:
        """Returns once the client reads its answers again (or has gone)."""
        if not self._write_paused or self._gone:
            return
        if self._writable is None:
            self._writable = asyncio.Event()
        await self._writable.wait()

    # ------------------------------------------------------------------ hot requests
    def _begin(self, request: _HotRequest) -> None:
        """Its turn has come: answer now if its body is in (or refused), else when it is."""
        request.started = True
        if request.refused:
            # The connection ends with the refusal (a lingering close, bounded: `LINGER_SECS`,
            # `LINGER_BYTES`): kept, it read and dropped what the client sent on for as long as it sent
            # (a chunked body never ended kept the loop busy for every client). With ``Expect``, too:
            # the body the client sends anyway and its next request cannot be told apart.
            request.keep_alive = False
            self._respond(request, self._too_large(request))
        elif request.complete:
            self._run(request)
        elif request.expect_continue and not self.transport.is_closing():
            self.transport.write(CONTINUE)

    def _too_large(self, request: _HotRequest) -> Reply:
        """The 413 of a body over the limit: a stream route's own, or the service's."""
        stream = self._streams.get(request.path)
        return stream.too_large(request.raw_head) if stream is not None else too_large_reply(self.max_body_bytes)

    def _run(self, request: _HotRequest) -> None:
        held = request.body
        body = held if type(held) is bytes else bytes(held)
        request.body = b""
        stream = self._streams.get(request.path)
        if stream is not None:
            streamed = StreamedRequest(
                self, request, body, request.head.authorization, request.raw_head,
                write_timeout_secs=stream.write_timeout_secs,
            )  # fmt: skip
            self._streamed = (streamed, request)
            streamed.run(stream.handle)
            return
        call = request.head.call(body, request.query, self._wait_disconnect)
        try:
            answer = request.handler(call)
            outcome = answer if isinstance(answer, Reply) else start(answer)
        except Exception as exc:  # a bug: the handlers answer every error they know
            self.crashed(request, exc)
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
            self.crashed(request, None)
            return
        exc = task.exception()
        if exc is not None:
            self.crashed(request, exc)
        else:
            self._respond(request, task.result())

    def _respond(self, request: _HotRequest | None, reply: Reply) -> None:
        """Write ``reply`` (``request``: its record; None for a whole request answered at once, which
        is HTTP/1.1, keep-alive, with the access log off)."""
        keep_alive = True
        if request is not None:
            request.response_complete = True
            keep_alive = request.keep_alive
            if keep_alive and request.http_version == "1.0":  # an HTTP/1.0 client closes unless told
                reply = replace(reply, headers=(*reply.headers, ("connection", "keep-alive")))
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
            if not keep_alive and self._between_messages:
                transport.close()
            elif not keep_alive:  # refused before its body, which may still be coming
                self.close_lingering()
        self.request_answered()

    def _header_lines(self, reply: Reply, keep_alive: bool) -> bytes:
        """The header lines after content-length and x-request-id: the reply's own, uvicorn's
        defaults (none in the service: no date or server header), ``connection: close``."""
        lines = b""
        for extra_name, extra_value in reply.headers:
            lines += b"%s: %s\r\n" % (extra_name.encode("latin-1"), extra_value.encode("latin-1"))
        lines += self.default_header_lines()
        if not keep_alive:
            lines += b"connection: close\r\n"
        return lines

    def crashed(self, request: Answered | None, exc: BaseException | None) -> None:
        """As for an ASGI app that raised: log it, send a 500, close the connection."""
        self.logger.error("Exception in ASGI application\n", exc_info=exc or asyncio.CancelledError())
        if request is not None:
            request.response_complete = True
        if not self.transport.is_closing():
            self.transport.write(_INTERNAL_ERROR)
            self.transport.close()
        self.request_answered()

    # ------------------------------------------------------------------ for stream routes (api.http_stream)
    def stream_complete(self, status: int) -> None:
        """The stream route's answer has been written to its end."""
        assert self._streamed is not None
        request = self._streamed[1]
        self._streamed = None
        request.response_complete = True
        if self.access_log:
            self._log_access(request, status)
        if self._write_paused and not self.transport.is_closing():
            # The client has not read all of this answer yet: within the route's write timeout, as
            # between two pieces of a stream.
            self._expect_reading(self._streams[request.path].write_timeout_secs)
        if not request.keep_alive and not self.transport.is_closing():
            self.transport.close()
        self.request_answered()

    def stream_crashed(self, exc: BaseException | None, started: bool) -> None:
        """The stream route's handler raised: a 500 if nothing was written yet, else the connection closes."""
        assert self._streamed is not None
        request = self._streamed[1]
        self._streamed = None
        if not started:
            self.crashed(request, exc)
            return
        self.logger.error("Exception in a streamed answer\n", exc_info=exc or asyncio.CancelledError())
        request.response_complete = True
        self.transport.close()
        self.request_answered()

    def default_header_lines(self) -> bytes:
        return b"".join(name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers)

    def write_paused(self) -> bool:
        return self._write_paused

    def _log_access(self, request: _HotRequest, status: int) -> None:
        target = request.path + (b"?" + request.query if request.query else b"")
        self.access_log_line("POST", target.decode("latin-1"), request.http_version, status)

    def access_log_line(self, method: str, target: str, http_version: str, status: int) -> None:
        """uvicorn's access line, with its arguments (`api.logs` reads them for JSON records)."""
        client = f"{self.client[0]}:{self.client[1]}" if self.client else ""
        self.access_logger.info('%s - "%s %s HTTP/%s" %d', client, method, target, http_version, status)

    async def _disconnected(self) -> None:
        """Returns once the client has closed the connection (watched by a request in the queue)."""
        if self._gone:
            return
        if self._lost is None or self._lost.done():
            self._lost = self.loop.create_future()
        await self._lost

    # ------------------------------------------------------------------ ASGI requests
    def _asgi_request(self, method: bytes, http_version: str, keep_alive: bool) -> AsgiRequest:
        url = httptools.parse_url(self._url)
        raw_path = url.path or b"/"
        path = raw_path.decode("ascii", "replace")
        if "%" in path:
            path = unquote(path)
        root_path = self.root_path
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": http_version,
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "method": method.decode("ascii"),
            "root_path": root_path,
            "path": root_path + path,
            "raw_path": root_path.encode("ascii") + raw_path,
            "query_string": url.query or b"",
            "headers": self._headers,
            "state": self.app_state.copy(),
        }
        return AsgiRequest(self, scope, keep_alive)

    def _run_asgi(self, request: AsgiRequest) -> None:
        limit = self.limit_concurrency
        if limit is not None and (len(self.server_state.connections) >= limit or len(self.tasks) >= limit):
            self.logger.warning("Exceeded concurrency limit.")
            request.response_complete = True
            if not self.transport.is_closing():
                self.transport.write(_UNAVAILABLE)
                self.close_lingering()  # its body may still be coming
            self.request_answered()
            return
        task: asyncio.Task[None] = self.loop.create_task(request.run(self.app))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


def _address(address: object) -> tuple[str, int] | None:
    if isinstance(address, (tuple, list)) and len(address) >= 2:
        return str(address[0]), int(address[1])
    return None


def response_bytes(head: bytes, body: bytes, request_id: str | None, lines: bytes) -> bytes:
    """One whole response: ``head`` (up to the content-length value), the length, ``x-request-id``,
    the other header ``lines``, the body (the twin of `api._native.response`)."""
    length = b"%d\r\n" % len(body)
    if request_id is not None:
        # The id is schema-checked visible ASCII, a uuid, or X-Request-Id as httptools let it
        # through (no control characters): this check is the ASGI path's, kept as a guard.
        value = request_id.encode("latin-1")
        if not BAD_HEADER_VALUE.search(value):
            length += b"x-request-id: %s\r\n" % value
    return b"%s%s%s\r\n%s" % (head, length, lines, body)


# The response in one C call (None: a request id that is not latin-1, left to `response_bytes`).
_response: Callable[[bytes, bytes, str | None, bytes], bytes | None] = accel.response if NATIVE else response_bytes

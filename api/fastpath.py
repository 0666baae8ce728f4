"""The outermost ASGI layer: the body-size limit for every request, and the hot routes and stream
routes (`api.http_stream`: the OpenAI proxy's) served straight from bytes.

FastAPI's per-request work (routing by regex over every route, the Request object, dependency
solving, the Response object) costs several times more than a routing decision on a short prompt,
so ``POST`` to a hot path is answered here: read the body, hand a `Call` to its handler, send the
`Reply`. Everything else (other methods, other paths, the lifespan) goes on to the FastAPI app,
whose routes for the same paths call the same handlers: with ``fast_path`` off, or when the app is
mounted under a prefix, they serve the hot routes with identical results.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.codec import Call, Reply, RequestHead, read_head
from api.errors import BodyTooLarge, error_reply
from api.http_stream import Headers, Sink, StreamRoute, head_of, whole_headers

__all__ = [
    "AsgiStreamedRequest",
    "ClientGone",
    "FastPath",
    "HotHandler",
    "HotOutcome",
    "HotRoutes",
    "answered",
    "read_body",
    "send_reply",
    "too_large_reply",
    "wait_disconnect",
]

# A hot route's answer: the reply itself when it never had to wait (the usual case: no coroutine is
# made), else a coroutine for it (a `new` waiting in the router's queue).
HotOutcome = Reply | Coroutine[Any, Any, Reply]
HotHandler = Callable[[Call], HotOutcome]


async def answered(outcome: HotOutcome) -> Reply:
    """The reply of a hot route's `HotOutcome`, awaited if it has to be."""
    return outcome if isinstance(outcome, Reply) else await outcome


@dataclass(frozen=True, slots=True)
class HotRoutes:
    """What answers the data plane before FastAPI: ``POST`` path -> hot handler, the body limit, and
    ``POST`` path -> stream route (`api.http_stream`)."""

    routes: Mapping[str, HotHandler]
    max_body_bytes: int
    streams: Mapping[str, StreamRoute] = field(default_factory=dict)


def _too_large(limit: int) -> BodyTooLarge:
    return BodyTooLarge(f"request body exceeds the limit of {limit} bytes")


def too_large_reply(limit: int) -> Reply:
    """The 413 for a body over ``limit`` bytes."""
    return _error(_too_large(limit))


class ClientGone(Exception):
    """The client disconnected before its request body was read."""


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body; `BodyTooLarge` as soon as it grows past ``limit`` bytes, `ClientGone`
    if the client leaves first."""
    message = await receive()
    body: bytes = message.get("body", b"")
    if not message.get("more_body"):  # the common case: one message holds the whole body
        if message["type"] == "http.disconnect":
            raise ClientGone
        if len(body) > limit:
            raise _too_large(limit)
        return body
    chunks = [body]
    size = len(body)
    while message.get("more_body"):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def wait_disconnect(receive: Receive) -> None:
    """Returns once the client has disconnected (call it after the body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _limited(receive: Receive, limit: int) -> Receive:
    """A ``receive`` that raises `BodyTooLarge` once more than ``limit`` body bytes went through."""
    seen = 0

    async def limited_receive() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _too_large(limit)
        return message

    return limited_receive


class FastPath:
    """ASGI middleware: enforces ``max_body_bytes`` for every request and serves the hot routes."""

    def __init__(self, app: ASGIApp, hot: HotRoutes) -> None:
        self._app = app
        self._hot = dict(hot.routes)
        self._streams = dict(hot.streams)
        self._limit = hot.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        head = read_head(scope["headers"])
        if self._streams and scope["method"] == "POST":
            stream = self._streams.get(scope["path"])
            if stream is not None:
                await self._stream(stream, head, head_of(scope["headers"]), receive, send)
                return
        if head.content_length > self._limit:
            # Refused before a byte of the body is read.
            await send_reply(send, too_large_reply(self._limit))
            return
        handler = self._hot.get(scope["path"]) if scope["method"] == "POST" else None
        if handler is None:
            await self._app(scope, _limited(receive, self._limit), send)
            return
        try:
            body = await read_body(receive, self._limit)
        except BodyTooLarge as exc:
            await send_reply(send, _error(exc))
            return
        except ClientGone:
            return
        call = head.call(body, scope["query_string"], partial(wait_disconnect, receive))
        await send_reply(send, await answered(handler(call)))

    async def _stream(self, route: StreamRoute, head: RequestHead, lines: bytes, receive: Receive, send: Send) -> None:
        """A stream route's request: its body read, the client watched while the handler runs (its
        leaving cancels the handler, as the protocol's connection_lost does)."""
        try:
            if head.content_length > self._limit:
                raise _too_large(self._limit)
            body = await read_body(receive, self._limit)
        except BodyTooLarge:
            await send_reply(send, route.too_large())
            return
        except ClientGone:
            return
        request = AsgiStreamedRequest(send, body, head.authorization, lines)
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.ensure_future(receive())
        watcher.add_done_callback(partial(request.watched, task))
        try:
            await route.handle(request)
        finally:
            request.finished = True
            watcher.cancel()


def _error(exc: Exception) -> Reply:
    mapped = error_reply(exc)
    assert mapped is not None
    return Reply(mapped[0], mapped[2])


async def send_reply(send: Send, reply: Reply) -> None:
    """``reply`` as ASGI messages."""
    headers: list[Any] = [
        (b"content-type", reply.media_type.encode()),
        (b"content-length", str(len(reply.body)).encode()),
    ]
    if reply.request_id is not None:
        headers.append((b"x-request-id", reply.request_id.encode("latin-1")))
    for name, value in reply.headers:
        headers.append((name.encode("latin-1"), value.encode("latin-1")))
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body})


class AsgiStreamedRequest:
    """A stream route's request answered as ASGI messages (`api.http_stream.StreamCall`; the
    protocol's twin is `api.http_stream.StreamedRequest`). Pieces handed on from a read callback
    (`begin`'s sink) are sent in order by one task; the source pauses while it is behind."""

    __slots__ = ("_pending", "_pump", "_resume", "_send", "authorization", "body", "disconnected", "finished", "head")

    # Pieces queued before the source is told to pause.
    BEHIND = 8

    def __init__(self, send: Send, body: bytes, authorization: bytes | None, head: bytes = b"") -> None:
        self._send = send
        self.body = body
        self.authorization = authorization
        self.head = head
        self.disconnected = False
        self.finished = False
        self._pending: deque[Message] = deque()
        self._pump: asyncio.Future[None] | None = None
        self._resume: Callable[[], None] | None = None

    def is_disconnected(self) -> bool:
        return self.disconnected

    def watched(self, task: asyncio.Task[Any], watcher: asyncio.Future[Message]) -> None:
        """The watcher's ``receive`` returned: the client has gone, so the handler is cancelled
        (unless it has finished)."""
        if self.finished or watcher.cancelled():
            return
        self.disconnected = True
        task.cancel()

    async def whole(self, status: int, headers: Headers, body: bytes) -> None:
        await self._flushed()
        await self._send({"type": "http.response.start", "status": status, "headers": whole_headers(headers, body)})
        await self._send({"type": "http.response.body", "body": body})

    def begin(self, status: int, headers: Headers) -> Sink:
        self._queue({"type": "http.response.start", "status": status, "headers": headers})
        return self

    def write(self, data: bytes) -> bool:
        """One piece from a read callback (`Sink.write`); True while the client is behind."""
        self._queue({"type": "http.response.body", "body": data, "more_body": True})
        return len(self._pending) >= self.BEHIND

    def when_drained(self, resume: Callable[[], None]) -> None:
        if self._pending:
            self._resume = resume
        else:
            asyncio.get_running_loop().call_soon(resume)

    async def end(self, last: bytes = b"") -> None:
        if last:
            self.write(last)
        self._queue({"type": "http.response.body", "body": b""})
        await self._flushed()

    def _queue(self, message: Message) -> None:
        self._pending.append(message)
        if self._pump is None or self._pump.done():
            self._pump = asyncio.ensure_future(self._send_pending())

    async def _send_pending(self) -> None:
        pending = self._pending
        while pending:
            await self._send(pending[0])
            pending.popleft()
        resume, self._resume = self._resume, None
        if resume is not None:
            resume()

    async def _flushed(self) -> None:
        if self._pump is not None:
            await self._pump

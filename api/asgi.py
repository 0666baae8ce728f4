"""The ASGI side of the data plane: the body limit of every request reaching the app (`BodyLimit`),
the one body reader and reply writer of the FastAPI adapters (`read_body`, `send_reply`), and the
stream routes (`api.http_stream`: the OpenAI proxy's) as ASGI endpoints (`StreamEndpoint`, answering
on an `AsgiStreamedRequest`).

kv-router's HTTP protocol (`api.http_protocol`) answers the hot routes and the stream routes itself;
these serve them wherever it does not (``--no-fast-protocol``, another ASGI server, the test client),
through the FastAPI app's routes, with the same handlers.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.codec import Reply, read_head
from api.contract import body_too_large, too_large_reply
from api.errors import BodyTooLarge
from api.http_stream import Headers, Sink, StreamRoute, client_stalled, head_of, whole_headers

__all__ = [
    "AsgiStreamedRequest",
    "BodyLimit",
    "ClientGone",
    "StreamEndpoint",
    "read_body",
    "send_reply",
    "wait_disconnect",
]


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
            raise body_too_large(limit)
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
            raise body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def wait_disconnect(receive: Receive) -> None:
    """Returns once the client has disconnected (call it after the body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class BodyLimit:
    """ASGI middleware: every request's body held to ``limit`` bytes. A ``Content-Length`` over it is
    refused before a byte of the body is read (the 413 of `api.contract.too_large_reply`); a body
    that grows past it (chunked) raises `BodyTooLarge` in the app's ``receive``, answered by the
    app's error handler. The paths in ``own_413`` (stream routes: `StreamEndpoint`) hold their
    requests to the limit themselves, with a 413 in their own shape."""

    def __init__(self, app: ASGIApp, limit: int, own_413: frozenset[str] = frozenset()) -> None:
        self._app = app
        self._limit = limit
        self._own_413 = own_413

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._own_413:
            await self._app(scope, receive, send)
            return
        limit = self._limit
        if read_head(scope["headers"]).content_length > limit:
            await send_reply(send, too_large_reply(limit))
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise body_too_large(limit)
            return message

        await self._app(scope, limited_receive, send)


class StreamEndpoint:
    """A stream route as an ASGI endpoint (a FastAPI app's route): its body read, the client watched
    while the handler runs (its leaving cancels the handler, as the protocol's connection_lost does);
    a body over the limit gets the route's own 413."""

    def __init__(self, route: StreamRoute, limit: int) -> None:
        self._route = route
        self._limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        head = read_head(scope["headers"])
        try:
            if head.content_length > self._limit:
                raise body_too_large(self._limit)
            body = await read_body(receive, self._limit)
        except BodyTooLarge:
            await send_reply(send, self._route.too_large(head_of(scope["headers"])))
            return
        except ClientGone:
            return
        task = asyncio.current_task()
        assert task is not None
        request = AsgiStreamedRequest(
            send, body, head.authorization, head_of(scope["headers"]),
            handler=task, write_timeout_secs=self._route.write_timeout_secs,
        )  # fmt: skip
        watcher = asyncio.ensure_future(receive())
        watcher.add_done_callback(request.watched)
        try:
            await self._route.handle(request)
        finally:
            request.finished = True
            watcher.cancel()


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

    __slots__ = (
        "_ended", "_handler", "_pending", "_pump", "_resume", "_send", "_write_timeout", "authorization", "body",
        "disconnected", "finished", "head",
    )  # fmt: skip

    # Pieces queued before the source is told to pause.
    BEHIND = 8

    def __init__(
        self,
        send: Send,
        body: bytes,
        authorization: bytes | None,
        head: bytes = b"",
        *,
        handler: asyncio.Task[Any],
        write_timeout_secs: float,
    ) -> None:
        self._send = send
        self._handler = handler  # cancelled when the client goes or stops reading
        self._write_timeout = write_timeout_secs
        self.body = body
        self.authorization = authorization
        self.head = head
        self.disconnected = False
        self.finished = False
        self._ended = False  # the body's last message is queued (`finish`)
        self._pending: deque[Message] = deque()
        self._pump: asyncio.Future[None] | None = None
        self._resume: Callable[[], None] | None = None

    def is_disconnected(self) -> bool:
        return self.disconnected

    def watched(self, watcher: asyncio.Future[Message]) -> None:
        """The watcher's ``receive`` returned: the client has gone, so the handler is cancelled
        (unless it has finished)."""
        if not watcher.cancelled():
            self._gone()

    def _gone(self) -> None:
        if self.finished:
            return
        self.disconnected = True
        self._handler.cancel()

    async def whole(self, status: int, headers: Headers, body: bytes) -> None:
        await self._flushed()
        start = {"type": "http.response.start", "status": status, "headers": whole_headers(headers, body)}
        if await self._sent_in_time(start):
            await self._sent_in_time({"type": "http.response.body", "body": body})

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

    def finish(self, data: bytes) -> None:
        """The last piece as the body's last message (`Sink.finish`)."""
        self._ended = True
        self._queue({"type": "http.response.body", "body": data})

    async def end(self, last: bytes = b"") -> None:
        if not self._ended:
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
            if not await self._sent_in_time(pending[0]):
                pending.clear()
                return
            pending.popleft()
        resume, self._resume = self._resume, None
        if resume is not None:
            resume()

    async def _sent_in_time(self, message: Message) -> bool:
        """Send ``message``; False when the client read nothing of it for the write timeout (the
        server's send waits while the client is behind): the handler is then ended as on a disconnect."""
        try:
            async with asyncio.timeout(self._write_timeout):
                await self._send(message)
        except TimeoutError:
            client_stalled(self._write_timeout)
            self._gone()
            return False
        return True

    async def _flushed(self) -> None:
        if self._pump is not None:
            await self._pump

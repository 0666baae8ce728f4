"""The outermost ASGI layer: the body-size limit for every request, and the hot routes served
straight from bytes.

FastAPI's per-request work (routing by regex over every route, the Request object, dependency
solving, the Response object) costs several times more than a routing decision on a short prompt,
so ``POST`` to a hot path is answered here: read the body, hand a `Call` to its handler, send the
`Reply`. Everything else (other methods, other paths, the lifespan) goes on to the FastAPI app,
whose routes for the same paths call the same handlers: with ``fast_path`` off, or when the app is
mounted under a prefix, they serve the hot routes with identical results.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.codec import Call, Reply, read_head
from api.errors import BodyTooLarge, error_reply

__all__ = [
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
    """What answers the hot routes before FastAPI: ``POST`` path -> handler, and the body limit."""

    routes: Mapping[str, HotHandler]
    max_body_bytes: int


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
        self._limit = hot.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        head = read_head(scope["headers"])
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

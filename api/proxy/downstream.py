"""The client's side of a proxied request: `Downstream`, what the request flow writes its answer to.

Two kinds: `AsgiDownstream` sends ASGI messages (the proxy as an ASGI layer, `Proxy.front`); the HTTP
protocol writes to the client's transport itself (`api.http_stream.StreamReply`, the proxy's
routes answered inside uvicorn's protocol like the hot routes). The flow (`api.proxy.service`) is
the same for both; only a streamed body differs: the protocol's reply is started and takes every
piece in the worker connection's read callback (`StreamedRequest.begin`, `Exchange.handed_on`), the
ASGI reply awaits ``send`` for each (`write`).
"""

from __future__ import annotations

from typing import Protocol

from starlette.types import Send

from api.http_stream import Headers

__all__ = ["AsgiDownstream", "Downstream", "whole_headers"]

_JSON = b"application/json"


class Downstream(Protocol):
    """One answer to the client: whole, or streamed (`start`, `write`, `end`)."""

    async def whole(self, status: int, headers: Headers, body: bytes) -> None:
        """A complete answer; ``headers`` without content-length (added here) nor content-type
        (``application/json`` unless given)."""
        ...

    async def start(self, status: int, headers: Headers) -> None:
        """The head of a streamed answer (``headers`` with its content-type)."""
        ...

    async def write(self, data: bytes) -> None: ...

    async def end(self) -> None: ...


def whole_headers(headers: Headers, body: bytes) -> Headers:
    """``headers`` with content-type (JSON unless given) and content-length first."""
    if not any(name == b"content-type" for name, _ in headers):
        headers = [(b"content-type", _JSON), *headers]
    return [*headers, (b"content-length", str(len(body)).encode())]


class AsgiDownstream:
    """A `Downstream` sent as ASGI messages."""

    __slots__ = ("_send",)

    def __init__(self, send: Send) -> None:
        self._send = send

    async def whole(self, status: int, headers: Headers, body: bytes) -> None:
        await self._send({"type": "http.response.start", "status": status, "headers": whole_headers(headers, body)})
        await self._send({"type": "http.response.body", "body": body})

    async def start(self, status: int, headers: Headers) -> None:
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def write(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self) -> None:
        await self._send({"type": "http.response.body", "body": b""})

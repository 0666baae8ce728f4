"""kv-router's HTTP protocol (`api.http_protocol`) under an in-process client (this module holds no
tests).

`ThroughProtocol(app)` is an ASGI app for Starlette's TestClient or httpx's ASGITransport: each HTTP
request is written as HTTP/1.1 bytes into a fresh connection of the protocol `kv-router serve`
gives uvicorn (`fast_protocol(app.hot)`), and the bytes it writes back are parsed by httptools into
the answer. So the in-process suites run every hot-route case through the protocol's own parsing,
handlers and bytes, and through FastAPI's routes (``fast_protocol`` off), as `tests/test_api_protocol.py`
does over loopback. The lifespan goes to the app itself.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httptools
import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.server import ServerState

from api.app import RouterApp
from api.http_protocol import fast_protocol

__all__ = ["ThroughProtocol"]

# Left out of the request written to the protocol: the length is the body's own, and a keep-alive
# HTTP/1.1 client sends no Connection header (so the C parser sees the usual request).
_DROPPED = {b"content-length", b"transfer-encoding", b"connection"}


class ThroughProtocol:
    """The app, reached through kv-router's HTTP protocol (see the module)."""

    def __init__(self, app: RouterApp) -> None:
        self.app = app
        self._protocol = fast_protocol(app.hot)
        self._config = uvicorn.Config(
            app, http=self._protocol, ws="none", lifespan="off", log_config=None, access_log=False, proxy_headers=False
        )
        self._config.load()

    def __getattr__(self, name: str) -> Any:  # the app's routes, state, ... for tests that read them
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        target = scope["raw_path"] + (b"?" + scope["query_string"] if scope["query_string"] else b"")
        lines = [b"%s %s HTTP/1.1" % (scope["method"].encode(), target)]
        lines += [name + b": " + value for name, value in scope["headers"] if name.lower() not in _DROPPED]
        lines += (b"content-length: %d" % len(body), b"")
        connection = _Connection(head_only=scope["method"] == "HEAD")
        protocol = self._protocol(self._config, ServerState(), {}, asyncio.get_running_loop())
        protocol.connection_made(connection)
        lines.append(body)
        protocol.data_received(b"\r\n".join(lines))  # one copy of the body: the read a server would get
        try:
            status, headers, answer = await connection.answer
        finally:
            protocol.connection_lost(None)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": answer})


class _Connection(asyncio.Transport):
    """The client's end: parses the protocol's bytes into one answer (a 100 Continue skipped)."""

    def __init__(self, head_only: bool) -> None:
        super().__init__()
        self._head_only = head_only  # the answer to a HEAD request: its head is all of it
        self.answer: asyncio.Future[tuple[int, list[tuple[bytes, bytes]], bytes]] = (
            asyncio.get_running_loop().create_future()
        )
        self._parser = httptools.HttpResponseParser(self)
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._closing = False

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        if self._head_only and self._parser.get_status_code() != 100:
            self.on_message_complete()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        status = self._parser.get_status_code()
        if status == 100:
            self._headers = []
            return
        if not self.answer.done():
            self.answer.set_result((status, self._headers, b"".join(self._body)))

    # asyncio.Transport
    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self.answer.done():
            self._parser.feed_data(bytes(data))

    def close(self) -> None:
        self._closing = True
        if not self.answer.done():
            self._parser.feed_eof()  # an answer framed by the connection's end
        if not self.answer.done():
            self.answer.set_exception(ConnectionError("the protocol closed the connection without an answer"))

    def is_closing(self) -> bool:
        return self._closing

    def can_write_eof(self) -> bool:
        return False  # a lingering close (a refusal before the body's end) then just closes in the end

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

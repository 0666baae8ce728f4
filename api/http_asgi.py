"""One request run on the ASGI app by kv-router's HTTP protocol (`api.http_protocol`): the ASGI
HTTP cycle (scope, ``receive``, ``send``) on the protocol's connection.

The body is buffered as it arrives and handed to the app by ``receive`` (reading pauses while more
than `BODY_HIGH_WATER` bytes wait for it; ``Expect: 100-continue`` answered when the app first asks
for a body still to come); after the whole body, ``receive`` waits for the client to leave or the
answer to end. ``send`` writes the head with the first body bytes, frames the body by the app's
``content-length`` or else in chunks (none for ``HEAD``, 204, 304), adds ``connection: close`` when
the connection ends with the answer, and waits while the client is not reading. An app that raises
before answering gets a 500; one that raises or returns mid-answer has its connection closed.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, Protocol

from api.http_stream import STATUS_LINE

__all__ = ["BAD_HEADER_VALUE", "BODY_HIGH_WATER", "CONTINUE", "AsgiRequest", "Connection"]

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# A header value must not hold a control character (a response splitting guard).
BAD_HEADER_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")
# Request body bytes buffered for an ASGI app before reading pauses until it takes them.
BODY_HIGH_WATER = 65536


class Answered(Protocol):
    """A request record of the connection: whether its answer has been written to its end."""

    response_complete: bool


class Connection(Protocol):
    """What an ASGI request uses of the protocol (`api.http_protocol.HttpProtocol`)."""

    transport: asyncio.Transport
    logger: logging.Logger
    access_log: bool

    def write_paused(self) -> bool: ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    async def drain(self) -> None: ...

    def default_header_lines(self) -> bytes: ...

    def close_lingering(self) -> None:
        """Close after an answer written while the client may still be sending its body."""

    def access_log_line(self, method: str, target: str, http_version: str, status: int) -> None: ...

    def crashed(self, request: Answered | None, exc: BaseException | None) -> None:
        """Log ``exc``, answer 500 and close the connection."""
        ...

    def request_answered(self) -> None:
        """The current request's answer is complete: the connection goes on to the next."""
        ...


class AsgiRequest:
    """One request run on the ASGI app: its scope, the body as it arrives (``receive``), the answer
    as the app sends it (``send``), written to the connection."""

    __slots__ = (
        "_body_given",
        "_chunked",
        "_event",
        "_head",
        "_length_left",
        "_protocol",
        "body",
        "complete",
        "disconnected",
        "expect_continue",
        "keep_alive",
        "response_complete",
        "response_started",
        "scope",
        "status",
    )

    def __init__(self, protocol: Connection, scope: dict[str, Any], keep_alive: bool) -> None:
        self._protocol = protocol
        self.scope = scope
        self.keep_alive = keep_alive
        self.expect_continue = False
        self.body = bytearray()
        self.complete = False  # the whole body is in
        self.disconnected = False
        self.response_started = False
        self.response_complete = False
        self.status = 0
        self._event = asyncio.Event()  # set when body arrives, the body ends, or the client goes
        self._body_given = False  # receive has given the body's last bytes
        self._head = b""  # the response's head, written with its first body bytes
        self._chunked = False
        self._length_left: int | None = None  # of the content-length the app declared

    # ------------------------------------------------------------------ from the protocol
    def body_received(self, data: bytes) -> None:
        if self.response_complete:
            return  # answered without it (a 401, 404, 413): the parser reads the rest, nobody keeps it
        self.body += data
        self._event.set()
        if len(self.body) > BODY_HIGH_WATER:
            self._protocol.pause_reading()

    def body_complete(self) -> None:
        self.complete = True
        self._event.set()

    def lost(self) -> None:
        self.disconnected = True
        self._event.set()

    # ------------------------------------------------------------------ the app
    async def run(self, app: Any) -> None:
        protocol = self._protocol
        try:
            await app(self.scope, self.receive, self.send)
        except BaseException as exc:  # the app's bug, or a cancellation at the end of a graceful shutdown
            if self.response_complete or self.disconnected:
                protocol.logger.error("Exception in ASGI application\n", exc_info=exc)
            elif not self.response_started:
                protocol.crashed(self, exc)
            else:
                protocol.logger.error("Exception in ASGI application\n", exc_info=exc)
                self._abort()
            return
        if self.response_complete or self.disconnected:
            return
        if not self.response_started:
            protocol.logger.error("ASGI callable returned without starting response.")
            protocol.crashed(self, RuntimeError("no response"))
        else:
            protocol.logger.error("ASGI callable returned without completing response.")
            self._abort()

    def _abort(self) -> None:
        self.response_complete = True
        self._protocol.transport.close()
        self._protocol.request_answered()

    async def receive(self) -> dict[str, Any]:
        protocol = self._protocol
        if self.expect_continue and not self.complete and not protocol.transport.is_closing():
            protocol.transport.write(CONTINUE)
        self.expect_continue = False
        while not (self.disconnected or self.response_complete):
            if self.body or (self.complete and not self._body_given):
                break
            # Nothing to give yet, or the whole body given: wait for more, the client leaving or the
            # answer's end.
            self._event.clear()
            if not protocol.write_paused():
                protocol.resume_reading()
            await self._event.wait()
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        body = bytes(self.body)
        self.body.clear()
        self._body_given = self.complete
        return {"type": "http.request", "body": body, "more_body": not self.complete}

    async def send(self, message: dict[str, Any]) -> None:
        protocol = self._protocol
        if protocol.write_paused():
            await protocol.drain()
        if self.disconnected:
            return  # the client has gone: nobody reads it
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(f"Expected ASGI message 'http.response.start', but got '{kind}'.")
            self.response_started = True
            self._start_response(message["status"], message.get("headers", ()))
            return
        if self.response_complete:
            raise RuntimeError(f"Unexpected ASGI message '{kind}' sent, after response already completed.")
        if kind != "http.response.body":
            raise RuntimeError(f"Expected ASGI message 'http.response.body', but got '{kind}'.")
        body: bytes = message.get("body", b"")
        more_body = message.get("more_body", False)
        if self.scope["method"] == "HEAD":
            body = b""
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
            if not more_body:
                data += b"0\r\n\r\n"
        else:
            data = body
            if self._length_left is not None:
                self._length_left -= len(body)
                if self._length_left < 0:
                    raise RuntimeError("Response content longer than Content-Length")
        head, self._head = self._head, b""
        transport = protocol.transport
        if (head or data) and not transport.is_closing():
            transport.write(head + data if head else data)
        if more_body:
            return
        if self._length_left and self.scope["method"] != "HEAD":
            raise RuntimeError("Response content shorter than Content-Length")
        self.response_complete = True
        self._event.set()
        if not self.keep_alive and not transport.is_closing():
            if self.complete:
                transport.close()
            else:  # refused before its body (a 401, 404, 413), which may still be coming
                protocol.close_lingering()
        protocol.request_answered()

    def _start_response(self, status: int, headers: Any) -> None:
        protocol = self._protocol
        self.status = status
        method = self.scope["method"]
        if self.expect_continue and not self.complete:
            # Answered before its body was asked for (a 401, 404): what the client sends next, the body
            # anyway or its next request, cannot be told apart, so the connection ends with the answer.
            self.keep_alive = False
        if status == 413 and not self.complete:
            # A body over the limit is not read to its end to keep the connection (the hot path's 413
            # ends it too): the connection ends with the answer.
            self.keep_alive = False
        lines = [STATUS_LINE.get(status) or b"HTTP/1.1 %d \r\n" % status, protocol.default_header_lines()]
        framed = False
        for raw_name, value in headers:
            name = bytes(raw_name).lower()
            value = bytes(value)
            if BAD_HEADER_VALUE.search(value):
                raise RuntimeError("Invalid HTTP header value.")
            if name == b"content-length" and not framed:
                self._length_left = int(value)
                framed = True
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self._chunked = framed = True
                self._length_left = None
            elif name == b"connection" and value.lower() == b"close":
                self.keep_alive = False
            lines += (bytes(raw_name), b": ", value, b"\r\n")
        http_1_0 = self.scope["http_version"] == "1.0"
        if not framed and method != "HEAD" and status not in (204, 304):
            if http_1_0:  # no chunks in HTTP/1.0: an answer of unknown length ends with the connection
                self.keep_alive = False
            else:
                lines.append(b"transfer-encoding: chunked\r\n")
                self._chunked = True
        if method == "HEAD":
            self._length_left = None
        if not any(name.lower() == b"connection" for name, _ in headers):
            if not self.keep_alive:
                lines.append(b"connection: close\r\n")
            elif http_1_0:  # an HTTP/1.0 client asked to keep it (`Connection: keep-alive`): told it is kept
                lines.append(b"connection: keep-alive\r\n")
        lines.append(b"\r\n")
        self._head = b"".join(lines)
        if protocol.access_log:
            scope = self.scope
            query = scope["query_string"]
            target = scope["raw_path"].decode("latin-1") + ("?" + query.decode("latin-1") if query else "")
            protocol.access_log_line(method, target, scope["http_version"], status)

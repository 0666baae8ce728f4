"""The ASGI cycle kv-router's HTTP protocol runs for every request it does not answer itself
(`api.http_asgi`): apps that misbehave, streamed answers, a body larger than the read buffer, the
client leaving. Each case feeds raw bytes to one protocol connection over an in-memory transport and
reads the exact bytes it writes back (the service's own app is checked against uvicorn's protocol
byte for byte in tests/test_api_protocol.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from api.config import ServiceConfig
from api.contract import HotRoutes
from api.http_protocol import HttpProtocol, fast_protocol

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False
        self.reading = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


async def connect(app: App) -> tuple[HttpProtocol, Transport, ServerState]:
    config = uvicorn.Config(app, ws="none", lifespan="off", log_config=None, proxy_headers=False)
    config.load()
    state = ServerState()
    service = ServiceConfig()
    hot = HotRoutes(
        {},
        1 << 20,
        head_timeout_secs=service.request_head_timeout_secs,
        body_timeout_secs=service.request_body_timeout_secs,
        write_timeout_secs=service.response_write_timeout_secs,
    )
    protocol = fast_protocol(hot)(config, state, {}, asyncio.get_running_loop())
    transport = Transport()
    protocol.connection_made(transport)
    return protocol, transport, state


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


GET = b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n"


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())


async def answer(send: Any, body: bytes = b"ok", headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": headers or [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": body})


def test_an_app_raising_before_its_answer_gets_a_500_and_the_connection_closes() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise RuntimeError("bug")

    async def scenario() -> None:
        protocol, transport, state = await connect(app)
        protocol.data_received(GET)
        await settle()
        assert bytes(transport.written).startswith(b"HTTP/1.1 500 Internal Server Error\r\n")
        assert transport.closed and not state.tasks

    run(scenario)


def test_an_app_raising_after_its_whole_answer_keeps_the_answer_and_the_connection() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await answer(send)
        raise RuntimeError("bug after the answer")

    async def scenario() -> None:
        protocol, transport, state = await connect(app)
        protocol.data_received(GET + GET)  # pipelined: the second is answered after the first
        await settle()
        one = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
        assert bytes(transport.written) == one * 2 and not transport.closed
        assert state.total_requests == 2

    run(scenario)


def test_an_app_returning_without_an_answer_gets_a_500() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        return

    async def scenario() -> None:
        protocol, transport, _ = await connect(app)
        protocol.data_received(GET)
        await settle()
        assert bytes(transport.written).startswith(b"HTTP/1.1 500 ") and transport.closed

    run(scenario)


def test_an_answer_without_content_length_is_chunked_and_head_gets_none_http10_its_bytes() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for piece in (b"abc", b"", b"de"):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def scenario() -> None:
        protocol, transport, _ = await connect(app)
        protocol.data_received(GET)
        await settle()
        assert bytes(transport.written) == (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n"
            b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
        )
        transport.written.clear()
        protocol.data_received(b"HEAD /x HTTP/1.1\r\nhost: t\r\n\r\n")
        await settle()
        assert bytes(transport.written) == b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\n"
        transport.written.clear()
        protocol.data_received(b"GET /x HTTP/1.0\r\n\r\n")  # no chunks in HTTP/1.0: the close ends the body
        await settle()
        closing = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: close\r\n\r\n"
        assert bytes(transport.written) == closing + b"abcde" and transport.closed

    run(scenario)


def test_a_body_larger_than_the_buffer_pauses_reading_until_the_app_reads() -> None:
    received: list[bytes] = []
    reading = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await reading.wait()
        while True:
            message = await receive()
            received.append(message["body"])
            if not message["more_body"]:
                break
        await answer(send, b"%d" % sum(map(len, received)), [(b"content-length", b"6")])

    async def scenario() -> None:
        protocol, transport, _ = await connect(app)
        size = 200_000
        protocol.data_received(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n" % size)
        for _ in range(size // 50_000):
            protocol.data_received(b"x" * 50_000)
        await settle()
        assert not transport.reading  # over 64 KiB waits for the app
        reading.set()
        await settle()
        assert transport.reading and bytes(transport.written).endswith(b"\r\n\r\n200000")

    run(scenario)


@pytest.mark.parametrize("answered", [False, True])
def test_receive_after_the_body_waits_for_the_client_to_leave(answered: bool) -> None:
    seen: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append((await receive())["type"])
        if answered:
            await answer(send)
        seen.append((await receive())["type"])  # returns when the client goes or the answer is complete
        if not answered:
            await answer(send)

    async def scenario() -> None:
        protocol, transport, state = await connect(app)
        protocol.data_received(GET)
        await settle()
        if answered:
            assert seen == ["http.request", "http.disconnect"]
        else:
            assert seen == ["http.request"]  # still waiting
            protocol.connection_lost(None)
            await settle()
            assert seen == ["http.request", "http.disconnect"] and transport.written == b""
        assert not state.tasks

    run(scenario)

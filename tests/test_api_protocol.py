"""kv-router's HTTP protocol (`api.http_protocol`) under a real uvicorn on loopback, through raw
sockets: exact bytes on the wire, keep-alive, pipelining, bodies split across TCP
segments and chunked, the body limit, malformed bodies, a queued ``new`` finished by a ``mark_free``
on another connection, a client leaving the queue, the keep-alive timeout, a request's head and body
timeouts, and SIGTERM with requests in flight; the rest of the app run on ASGI by the protocol. Where
a request is deterministic, the answer must be byte for byte what uvicorn's own protocol and FastAPI's
routes give (``fast_protocol`` off), which the in-process suites test in depth.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import re
import signal
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
import uvicorn

from api.codec import Call, Reply
from api.config import SecurityConfig, ServiceConfig, Settings
from api.contract import HotRoutes
from api.http_protocol import LINGER_SECS
from api.http_protocol import fast_protocol as protocol_for
from api.server import uvicorn_config
from router.config import RouterConfig
from router.event_plane.embedded_server import free_port
from tests.router_processes import RouterProcess
from tests.test_api_errors import CASES
from tests.test_api_server import _CLEAN_EXIT
from tests.test_api_support import BLOCK_SIZE, prompt, stored_event
from tests.test_http_asgi import Transport
from tests.waiting import until

JSON = "application/json"


@contextmanager
def uvicorn_on_loopback(*, keep_alive_s: float | None = None, **overrides: Any) -> Iterator[int]:
    """``kv-router serve``'s uvicorn (`uvicorn_config`) in a thread; yields its port. ``overrides`` go
    to `ServiceConfig`, `SecurityConfig` or `RouterConfig` by name."""
    service = {k: v for k, v in overrides.items() if k in ServiceConfig.__struct_fields__}
    security = {k: v for k, v in overrides.items() if k in SecurityConfig.__struct_fields__}
    router = {k: v for k, v in overrides.items() if k not in service and k not in security}
    port = free_port()
    settings = Settings(
        service=ServiceConfig(port=port, log_level="warning", **service),
        router=RouterConfig(**{"block_size": BLOCK_SIZE, **router}),
        security=SecurityConfig(**security),
    )
    config = uvicorn_config(settings)
    if keep_alive_s is not None:
        config.timeout_keep_alive = keep_alive_s  # type: ignore[assignment]  # uvicorn takes whole seconds
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    until(lambda: server.started or not thread.is_alive(), 20, "uvicorn starts")
    assert server.started, "uvicorn did not start"
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(20)


def request(method: str, path: str, body: bytes | None = None, **headers: str) -> bytes:
    """One HTTP/1.1 request; ``body`` gets a Content-Length and, unless given, a JSON content type."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    if body is not None:
        headers.setdefault("content_type", JSON)
        headers.setdefault("content_length", str(len(body)))
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


def post(path: str, value: Any, **headers: str) -> bytes:
    return request("POST", path, json.dumps(value, separators=(",", ":")).encode(), **headers)


class Client:
    """A raw keep-alive connection that reads whole responses (Content-Length bodies) off the wire."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def response(self) -> bytes:
        """The next whole response, head and body, exactly as sent."""
        while b"\r\n\r\n" not in self.buffer:
            self._recv()
        head, _, _ = self.buffer.partition(b"\r\n\r\n")
        match = re.search(rb"\r\ncontent-length: (\d+)", head)
        assert match, head
        size = len(head) + 4 + int(match.group(1))
        while len(self.buffer) < size:
            self._recv()
        reply, self.buffer = self.buffer[:size], self.buffer[size:]
        return reply

    def ask(self, data: bytes) -> bytes:
        self.send(data)
        return self.response()

    def nothing_within(self, seconds: float) -> bool:
        self.sock.settimeout(seconds)
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            return not self.buffer
        finally:
            self.sock.settimeout(10)
        self.buffer += data
        return False

    def closed_by_server(self, seconds: float = 5) -> bool:
        self.sock.settimeout(seconds)
        try:
            return self.sock.recv(65536) == b""
        except TimeoutError:
            return False

    def _recv(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed by the server; unread: {self.buffer!r}")
        self.buffer += chunk

    def close(self) -> None:
        self.sock.close()


def reply(status: str, body: bytes, *, media: str = JSON, request_id: str | None = None, close: bool = False) -> bytes:
    """The exact bytes uvicorn's ASGI path sends for a hot route's reply."""
    head = f"HTTP/1.1 {status}\r\ncontent-type: {media}\r\ncontent-length: {len(body)}\r\n"
    if request_id is not None:
        head += f"x-request-id: {request_id}\r\n"
    if close:
        head += "connection: close\r\n"
    return (head + "\r\n").encode() + body


def error(status: str, kind: str, message: str) -> bytes:
    return reply(status, json.dumps({"error": {"type": kind, "message": message}}, separators=(",", ":")).encode())


def body_of(response: bytes) -> Any:
    return json.loads(response.partition(b"\r\n\r\n")[2])


def without_timing(response: bytes) -> bytes:
    """A `new` reply with its timing and event age (which vary) taken out, Content-Length included."""
    head, _, body = response.partition(b"\r\n\r\n")
    body = re.sub(rb',"timing":\{[^}]*\}', b"", body)
    body = re.sub(rb'"newest_event_age_s":[-+.e0-9]+,', b"", body)
    return re.sub(rb"content-length: \d+", b"content-length: %d" % len(body), head) + b"\r\n\r\n" + body


TOKENS = prompt(0, 64)  # 4 blocks
# FastAPI's own responses (non-hot routes) put content-length first.
HEALTHY = b'HTTP/1.1 200 OK\r\ncontent-length: 15\r\ncontent-type: application/json\r\n\r\n{"status":"ok"}'


def _setup(client: Client, *workers: int) -> None:
    for worker_id in workers:
        assert client.ask(post("/v1/workers", {"worker_id": worker_id})).startswith(b"HTTP/1.1 201 ")
    applied = client.ask(post("/v1/events", [stored_event(workers[0], TOKENS, blocks=3)]))
    assert applied == reply(
        "200 OK", b'{"received":1,"applied":1,"rejected":0,"duplicate":0,"held":0,"relayed":0,"errors":[]}'
    )


def _decision(blocks: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The answer to TOKENS routed to worker 1 with ``blocks`` of them cached there, and its receipt."""
    decision = {"worker_id": 1, "dp_rank": 0, "overlap_blocks": blocks, "cached_tokens": blocks * BLOCK_SIZE}
    receipt = {"device_blocks": blocks, "host_pinned_blocks": 0, "disk_blocks": 0, "credited_blocks": float(blocks),
               "stream_trusted": True, "reason": "lowest_cost", "candidates": 2}  # fmt: skip
    return decision, receipt


def _new_a_answer(blocks: int) -> bytes:
    decision, receipt = _decision(blocks)
    body = {**decision, "request_id": "a", "explanation": None, "receipt": receipt, "disaggregation": None}
    return reply("200 OK", json.dumps(body, separators=(",", ":")).encode(), request_id="a")


# One connection's script and the exact answers expected (a `new` without its timing).
def _script() -> list[tuple[bytes, bytes]]:
    # Asked after "a"'s first token: its whole prompt (4 blocks) is computed on worker 1, credited there
    # while the engine's events about it may be on their way (`computed_prompt_credit_secs`).
    query_answer, query_receipt = _decision(4)
    loads = b'{"loads":[{"worker_id":1,"dp_rank":0,"potential_prefill_tokens":32,"potential_decode_blocks":4,'
    loads += b'"active_requests":1},{"worker_id":2,"dp_rank":0,"potential_prefill_tokens":64,'
    loads += b'"potential_decode_blocks":4,"active_requests":0}],"pending_count":0,"pending_isl_tokens":0}'
    return [
        (post("/v1/new", {"tokens": TOKENS, "request_id": "a"}), _new_a_answer(3)),
        (post("/v1/potential_loads", {"tokens": TOKENS}), reply("200 OK", loads)),
        (post("/v1/mark_prefill", {"request_id": "a"}),
         reply("200 OK", b'{"request_id":"a","success":true}', request_id="a")),
        (request("GET", "/healthz"), HEALTHY),  # through ASGI and FastAPI, between hot requests
        # Dynamo's PreprocessedRequest on the tagged route, asked without booking (query_instance_id).
        (post("/v1/router", {"method": "route", "token_ids": TOKENS, "annotations": ["query_instance_id"],
                             "sampling_options": {"temperature": 0.5}}),
         reply("200 OK", json.dumps({"method": "route", **query_answer, "receipt": query_receipt,
                                     "nvext": {"worker_id": {"prefill_worker_id": 1, "prefill_dp_rank": 0,
                                                             "decode_worker_id": 1, "decode_dp_rank": 0},
                                               "token_ids": TOKENS}},
                                    separators=(",", ":")).encode())),
        (post("/v1/router", {"method": "mark_free"}, x_request_id="a"),
         reply("200 OK", b'{"method":"free_marked","success":true}', request_id="a")),
        (post("/v1/mark_free", {"request_id": "a"}),
         error("404 Not Found", "unknown_request_id", "request 'a' is not active")),
        (request("POST", "/v1/new", b'{"tokens": [1, 2', content_type=JSON),
         error("400 Bad Request", "malformed_body", "body is not valid JSON: Input data was truncated")),
        (request("GET", "/v1/new"),  # FastAPI's 405
         b"HTTP/1.1 405 Method Not Allowed\r\ncontent-length: 83\r\ncontent-type: application/json\r\n\r\n"
         b'{"error":{"type":"method_not_allowed","message":"GET /v1/new: Method Not Allowed"}}'),
        (post("/v1/overlap", {"tokens": TOKENS[:32]}),
         reply("200 OK", b'{"block_size":16,"num_blocks":2,"workers":[{"worker_id":1,"dp_rank":0,"device_blocks":2,'
                         b'"host_pinned_blocks":2,"disk_blocks":2,"host_pinned_extension_blocks":0,'
                         b'"disk_extension_blocks":0,"router_credit_blocks":2.0,"cached_tokens":32},{"worker_id":2,'
                         b'"dp_rank":0,"device_blocks":0,"host_pinned_blocks":0,"disk_blocks":0,'
                         b'"host_pinned_extension_blocks":0,"disk_extension_blocks":0,"router_credit_blocks":0.0,'
                         b'"cached_tokens":0}]}')),
    ]  # fmt: skip


@pytest.mark.parametrize("fast_protocol", [True, False], ids=["protocol", "asgi"])
def test_keep_alive_one_connection_exact_bytes(fast_protocol: bool) -> None:
    with uvicorn_on_loopback(fast_protocol=fast_protocol) as port:
        client = Client(port)
        _setup(client, 1, 2)
        for sent, expected in _script():
            assert without_timing(client.ask(sent)) == expected
        client.close()


@pytest.mark.parametrize("fast_protocol", [True, False], ids=["protocol", "asgi"])
def test_pipelined_requests_are_answered_in_order(fast_protocol: bool) -> None:
    with uvicorn_on_loopback(fast_protocol=fast_protocol) as port:
        client = Client(port)
        _setup(client, 1, 2)
        script = _script()
        client.send(b"".join(sent for sent, _ in script))  # every request before any answer
        assert [without_timing(client.response()) for _ in script] == [expected for _, expected in script]
        client.close()


def test_a_head_read_before_its_body_is_answered_once_the_body_is_in() -> None:
    """What a client writing the head and the body apart sends: the protocol keeps the head (parsed
    whole in C once the body is in), answers nothing before, and the same bytes as in one read; a
    body arriving with a pipelined request behind it goes to httptools, both answered in order."""
    with uvicorn_on_loopback() as port:
        client = Client(port)
        _setup(client, 1, 2)
        for sent, expected in _script():
            head, _, body = sent.partition(b"\r\n\r\n")
            if not body:
                continue
            client.send(head + b"\r\n\r\n")
            assert client.nothing_within(0.05)
            client.send(body[:1])
            if len(body) > 1:
                assert client.nothing_within(0.05)
                client.send(body[1:])
            assert without_timing(client.response()) == expected
        first, then = _script()[0], _script()[-1]
        head, _, body = first[0].partition(b"\r\n\r\n")
        client.send(head + b"\r\n\r\n")
        assert client.nothing_within(0.05)
        client.send(body + then[0])
        # "a" again, its whole prompt credited to worker 1 since its first token a moment ago.
        assert [without_timing(client.response()) for _ in range(2)] == [_new_a_answer(4), then[1]]
        client.close()


def test_bad_requests_get_the_same_bytes_as_through_asgi() -> None:
    """Every case of the error suite, on one keep-alive connection per server: identical answers."""
    answers = []
    for fast_protocol in (True, False):
        with uvicorn_on_loopback(fast_protocol=fast_protocol, max_prompt_tokens=100, max_body_bytes=4096) as port:
            client = Client(port)
            _setup(client, 1, 2)
            assert client.ask(post("/v1/workers", {"worker_id": 3, "dp_size": 2})).startswith(b"HTTP/1.1 201 ")
            answers.append([client.ask(request("POST", route, body, **_headers(h))) for route, body, h, _, _ in CASES])
            client.close()
    assert answers[0] == answers[1]
    assert [int(a[9:12]) for a in answers[0]] == [status for _, _, _, status, _ in CASES]


def _headers(headers: dict[str, str]) -> dict[str, str]:
    return {name.replace("-", "_"): value for name, value in headers.items()}


def test_body_split_across_tcp_segments_and_chunked() -> None:
    with uvicorn_on_loopback() as port:
        client = Client(port)
        _setup(client, 1, 2)
        sent = post("/v1/new", {"tokens": TOKENS, "request_id": "s"})
        for piece in (sent[:7], sent[7:60], sent[60:-40], sent[-40:-1], sent[-1:]):
            client.send(piece)
            assert client.nothing_within(0.05) or piece is sent[-1:]
        assert body_of(client.response())["overlap_blocks"] == 3

        # Chunked transfer encoding, each chunk in its own segment.
        body = json.dumps({"request_id": "s"}).encode()
        client.send(b"POST /v1/mark_free HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
        for start in range(0, len(body), 5):
            chunk = body[start : start + 5]
            client.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            time.sleep(0.01)  # the behaviour under test: each chunk arrives on its own, later
        client.send(b"0\r\n\r\n")
        assert client.response() == reply("200 OK", b'{"request_id":"s","success":true}', request_id="s")
        client.close()


def test_a_body_over_the_limit_is_refused_and_its_connection_closed() -> None:
    """A body over ``max_body_bytes``, refused on its Content-Length or once a chunked body grows past
    it: a 413 saying ``connection: close``, then the connection ends (its lingering close). A client
    that sends on regardless, a chunked body of 1-byte chunks without end, is closed ``LINGER_SECS``
    later at most, and the others are served meanwhile (before, the connection read and dropped what
    it sent for as long as it sent: hundreds of MB, every client's requests waiting on the loop)."""
    too_large = reply(
        "413 Request Entity Too Large",
        b'{"error":{"type":"body_too_large","message":"request body exceeds the limit of 1000 bytes"}}',
        close=True,
    )
    with uvicorn_on_loopback(max_body_bytes=1000) as port:
        client, other = Client(port), Client(port)
        _setup(other, 1)
        big = json.dumps({"tokens": list(range(400))}).encode()
        head = request("POST", "/v1/new", big)[: -len(big)]
        # Refused on its Content-Length, before a byte of the body is sent.
        assert client.ask(head) == too_large
        assert client.closed_by_server()
        client.close()

        # Chunked: refused as soon as it grows past the limit.
        client = Client(port)
        client.send(b"POST /v1/potential_loads HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        client.send(b"%x\r\n%s\r\n" % (600, big[:600]))
        assert client.nothing_within(0.1)
        client.send(b"%x\r\n%s\r\n" % (600, big[600:1200]))
        assert _answer_then_closed(client, 10) == too_large
        client.close()

        flood = Client(port)
        flood.send(b"POST /v1/router HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n" + b"1\r\nx\r\n" * 1001)  # fmt: skip
        refused_at = time.monotonic()
        assert _answer_then_closed(flood, 10) == too_large  # the answer, then its end (the write side shut)
        with pytest.raises((BrokenPipeError, ConnectionResetError)):  # 1-byte chunks until sending fails
            while time.monotonic() - refused_at < LINGER_SECS + 5:
                flood.send(b"1\r\nx\r\n" * 1000)
                assert other.ask(post("/v1/mark_free", {"request_id": "x"}))[9:12] == b"404"
        assert time.monotonic() - refused_at < LINGER_SECS + 2
        flood.close()
        other.close()


def test_a_body_of_tiny_chunks_is_held_at_about_its_size_and_freed_with_its_connection() -> None:
    """A chunked body of 2-byte chunks (7 bytes on the wire each), held unfinished: what the protocol
    keeps of it is about its size (each piece kept as its own bytes object cost ~28x: 8 MiB of body,
    225 MB), and it is freed when the client leaves, by reference counting, without a GC pass (the
    protocol and its parser refer to each other: it stayed until a full collection)."""
    size = 1 << 18

    def unused(call: Call) -> Reply:
        raise AssertionError("the body never ends: nothing is run")

    async def scenario() -> tuple[int, int]:
        service = ServiceConfig()
        hot = HotRoutes(
            {"/v1/h": unused},
            1 << 23,
            head_timeout_secs=service.request_head_timeout_secs,
            body_timeout_secs=service.request_body_timeout_secs,
            write_timeout_secs=service.response_write_timeout_secs,
        )
        config = uvicorn.Config(unused, ws="none", lifespan="off", log_config=None, proxy_headers=False)
        config.load()
        protocol = protocol_for(hot)(config, uvicorn.server.ServerState(), {}, asyncio.get_running_loop())
        transport = Transport()
        protocol.connection_made(transport)
        protocol.data_received(b"POST /v1/h HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        read = b"2\r\nxy\r\n" * 9362  # 64 KiB reads, as a socket's
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(size // 2 // 9362 + 1):
            protocol.data_received(read)
        held = tracemalloc.get_traced_memory()[0] - before
        protocol.connection_lost(None)
        left = tracemalloc.get_traced_memory()[0] - before
        assert transport.written == b""
        return held, left

    gc.disable()
    tracemalloc.start()
    try:
        held, left = asyncio.run(scenario())
    finally:
        tracemalloc.stop()
        gc.enable()
    assert size < held < 2 * size, held
    assert left < size // 8, left


def test_a_body_sent_after_its_refusal_leaves_the_connection_usable_and_closable() -> None:
    """An app route that answers before reading the body (401 on an admin route without the token,
    404): the body that follows, far more than the read buffer holds (64 KiB), is dropped; the
    connection answers the next request, and once idle its keep-alive timeout closes it (a connection
    busy reading an answered body was never closed: its descriptor leaked)."""
    with uvicorn_on_loopback(keep_alive_s=1.0, api_token="s3cret") as port:
        client = Client(port)
        big = b"x" * 1_000_000
        # Connection: keep-alive makes the C parser decline it: httptools and the app's route read it.
        head = request("POST", "/v1/workers", big, connection="keep-alive")[: -len(big)]
        refused = client.ask(head)
        assert refused.startswith(b"HTTP/1.1 401 "), refused
        client.send(big)
        assert client.ask(request("GET", "/healthz")) == HEALTHY
        assert client.closed_by_server(3)
        client.close()


def test_an_app_routes_413_before_its_body_ends_the_connection() -> None:
    """A body over the limit, declared so before it is sent, is refused with its head, as the hot
    path refuses one: the connection closes with the 413 rather than read the whole body it will not
    use (50 MB here, read to the end before)."""
    declared = 50_000_000
    with uvicorn_on_loopback(keep_alive_s=30.0) as port:
        client = Client(port)
        # Connection: keep-alive makes the C parser decline it: httptools and the app's route read it.
        head = request("POST", "/v1/workers", b"x", connection="keep-alive").replace(
            b"content-length: 1", b"content-length: %d" % declared
        )[:-1]
        client.send(head)
        sent = 0
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            while sent < 10 * 8_388_608:  # bounded: far past the 8 MiB limit, far short of the declared
                client.send(b"x" * 65_536)
                sent += 65_536
        refused = _answer_then_closed(client, 10)
        assert refused.startswith(b"HTTP/1.1 413 "), refused[:100]
        assert b"\r\nconnection: close" in refused.partition(b"\r\n\r\n")[0]
        assert body_of(refused)["error"]["type"] == "body_too_large"
        assert sent < 10 * 8_388_608  # refused and closed long before
        client.close()


@pytest.mark.parametrize(
    ("head", "status", "kind"),
    [
        (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", b"414", "uri_too_long"),
        (b"GET /healthz HTTP/1.1\r\n" + b"X-Pad: %b\r\n" % (b"p" * 8000) * 9 + b"\r\n", b"431", "headers_too_large"),
    ],
    ids=["target", "headers"],
)
def test_a_request_target_or_header_section_over_64_kib_is_refused_as_json(
    head: bytes, status: bytes, kind: str
) -> None:
    """Sent in pieces, as a slow client would: refused once past the bound, the connection closed, and
    the server answers others at once."""
    with uvicorn_on_loopback() as port:
        client, other = Client(port), Client(port)
        for start in range(0, len(head), 4096):
            try:
                client.send(head[start : start + 4096])
            except (BrokenPipeError, ConnectionResetError):
                break  # refused and closed before the rest was sent
        refused = client.response()
        assert refused.startswith(b"HTTP/1.1 " + status + b" "), refused[:100]
        assert body_of(refused)["error"]["type"] == kind
        assert other.ask(request("GET", "/healthz")) == HEALTHY
        client.close()
        other.close()


def test_a_header_section_is_counted_as_on_the_wire_and_held_to_100_fields() -> None:
    """A header section's bytes are counted with each line's ": " and CRLF (by name and value alone,
    65,000 empty fields passed the 64 KiB bound, ~100 bytes each kept: 200 connections, 1.5 GB), and
    more than ``MAX_HEADERS`` fields are refused: a JSON 431, then the connection closes."""
    too_many = "the request has more than 100 header fields"
    too_large = "the request's header fields exceed 65536 bytes"
    fields = request("GET", "/healthz")[:-2]  # Host: one field
    cases = {
        fields + b"a:\r\n" * 99 + b"\r\n": None,  # 100 fields: served
        fields + b"a:\r\n" * 100 + b"\r\n": too_many,
        fields + b"a:\r\n" * 65_000: too_many,  # never finished
        # 90 lines of 728 bytes of name and value: 65,520, under the bound; 65,880 on the wire.
        b"GET /healthz HTTP/1.1\r\n" + b"x: %b\r\n" % (b"v" * 727) * 90 + b"\r\n": too_large,
    }
    with uvicorn_on_loopback() as port:
        for sent, refusal in cases.items():
            client = Client(port)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused before the rest was sent
                client.send(sent)
            if refusal is None:
                assert client.response() == HEALTHY
            else:
                refused = _answer_then_closed(client, 10)
                assert refused.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), refused[:100]
                assert body_of(refused)["error"] == {"type": "headers_too_large", "message": refusal}
            client.close()


@pytest.mark.parametrize(
    ("target", "fields", "status", "message"),
    [
        ("/v1/new?" + "a" * 70_000, b"", b"414", "the request target exceeds 65536 bytes"),
        ("/v1/new", b"a: b\r\n" * 100, b"431", "the request has more than 100 header fields"),
        ("/v1/new", b"x: %b\r\n" % (b"v" * 727) * 90, b"431", "the request's header fields exceed 65536 bytes"),
    ],
    ids=["target", "fields", "bytes"],
)
def test_a_plain_post_sent_whole_is_held_to_the_same_head_bounds(
    target: str, fields: bytes, status: bytes, message: str
) -> None:
    """A POST of the plainest form, sent in one write, is parsed whole in C (`api._native.parse_post`):
    its target, field count and header bytes are bounded as httptools' path bounds them."""
    body = b'{"tokens": [1, 2, 3]}'
    head = request("POST", target, body)[: -len(body) - 2]  # before the blank line: fields follow
    with uvicorn_on_loopback() as port:
        client = Client(port)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            client.send(head + fields + b"\r\n" + body)
        refused = _answer_then_closed(client, 10)
        assert refused.startswith(b"HTTP/1.1 " + status + b" "), refused[:100]
        assert body_of(refused)["error"]["message"] == message
        client.close()


def test_bytes_that_are_no_http_request_get_a_json_400_saying_what_the_parser_found() -> None:
    with uvicorn_on_loopback() as port:
        client, other = Client(port), Client(port)
        client.send(b"GARBAGE /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        refused = client.response()
        assert refused.startswith(b"HTTP/1.1 400 "), refused[:100]
        assert b"content-type: application/json\r\n" in refused
        assert body_of(refused)["error"] == {
            "type": "malformed_request",
            "message": "not a valid HTTP/1.1 request: Invalid method encountered",
        }
        assert client.closed_by_server()
        assert other.ask(request("GET", "/healthz")) == HEALTHY
        client.close()
        other.close()


def test_requests_ahead_of_a_connection_close_are_answered_then_it_closes() -> None:
    with uvicorn_on_loopback() as port:
        client = Client(port)
        free = post("/v1/mark_free", {"request_id": "x"})
        closing = post("/v1/mark_free", {"request_id": "y"}, connection="close")
        client.send(request("GET", "/healthz") + closing + free)
        assert client.response() == HEALTHY
        assert client.response().startswith(b"HTTP/1.1 404 ")
        assert client.closed_by_server()
        client.close()


def test_no_request_after_the_one_its_connection_closes_with_is_run() -> None:
    """A connection closed after an answer runs no request read after it (RFC 9112 §9.6): one pipelined
    in the same write behind HTTP/1.0, ``Connection: close`` or a refusal before an expected body is never
    booked (a ``new`` run unanswered held its load until its expiry). HTTP/1.0 with ``Connection:
    keep-alive`` is kept alive, as llhttp reads on: told so, and the next request answered."""
    with uvicorn_on_loopback(max_body_bytes=1000) as port:
        setup = Client(port)
        _setup(setup, 1)

        def new(request_id: str) -> bytes:
            return post("/v1/new", {"tokens": TOKENS, "request_id": request_id})

        def booked(request_id: str) -> bool:
            answer = setup.ask(post("/v1/mark_free", {"request_id": request_id}))
            assert answer[9:12] in (b"200", b"404"), answer
            return answer[9:12] == b"200"

        loads = post("/v1/router", {"method": "potential_loads", "tokens": [1, 2, 3]})
        old_kept = Client(port)
        old_kept.send(post("/v1/router", {"method": "potential_loads", "tokens": [1, 2, 3]}, connection="keep-alive")
                      .replace(b"HTTP/1.1", b"HTTP/1.0", 1) + new("after-kept"))  # fmt: skip
        first = old_kept.response()
        assert first.startswith(b"HTTP/1.1 200 ") and b"\r\nconnection: keep-alive\r\n" in first, first
        assert body_of(old_kept.response())["worker_id"] == 1
        assert old_kept.ask(loads).startswith(b"HTTP/1.1 200 ")  # still open
        health = old_kept.ask(request("GET", "/healthz", connection="keep-alive").replace(b"HTTP/1.1", b"HTTP/1.0", 1))
        assert health.startswith(b"HTTP/1.1 200 ") and b"\r\nconnection: keep-alive\r\n" in health, health  # ASGI
        assert old_kept.ask(loads).startswith(b"HTTP/1.1 200 ")
        assert booked("after-kept")
        old_kept.close()

        refused = request("POST", "/v1/mark_free", b"x" * 5000, expect="100-continue")
        for name, closing in (
            ("http-1.0", loads.replace(b"HTTP/1.1", b"HTTP/1.0", 1)),
            ("close", post("/v1/router", {"method": "potential_loads", "tokens": [1]}, connection="close")),
            ("refused", refused),
        ):
            client = Client(port)
            client.send(closing + new(f"after-{name}"))
            answer = client.response()
            assert b"\r\nconnection: close\r\n" in answer, (name, answer)
            assert client.closed_by_server(), (name, client.buffer)
            client.close()
            assert not booked(f"after-{name}"), name
        setup.close()


def test_an_upgrade_request_with_a_body_is_run_whole_as_plain_http() -> None:
    """No upgrade is served, so a request asking for one is plain HTTP/1.1, its body included (RFC 9110
    §7.8), whether it comes in the head's read or after (curl's ``--http2`` on a POST: ``Upgrade: h2c``):
    answered as without the upgrade, then the connection closes. A chunked body with Upgrade is
    refused with a 400 saying so, never run without its body."""
    with uvicorn_on_loopback() as port:
        client = Client(port)
        _setup(client, 1)
        body = b'{"method":"potential_loads","tokens":[1,2,3]}'
        plain = client.ask(request("POST", "/v1/router", body))
        assert plain.startswith(b"HTTP/1.1 200 "), plain
        client.close()
        h2c = {"connection": "Upgrade, HTTP2-Settings", "upgrade": "h2c", "http2_settings": "AAMAAABkAAQAoAAAAAIAAAAA"}
        upgrade = request("POST", "/v1/router", body, **h2c)
        for split in (0, 10, len(body)):  # the body in the head's read, part of it, none of it
            client = Client(port)
            at = len(upgrade) - split
            client.send(upgrade[:at])
            if split:
                time.sleep(0.05)
                client.send(upgrade[at:])
            answer = client.response()
            assert answer == plain.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n", 1), (split, answer)
            assert client.closed_by_server(), split
            client.close()
        client = Client(port)
        client.send(
            _chunked("POST", "/v1/router", body).replace(b"\r\n", b"\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n", 1)
        )
        refused = _until_closed(client)
        assert refused.startswith(b"HTTP/1.1 400 ") and b"\r\nconnection: close\r\n" in refused, refused
        assert body_of(refused)["error"]["type"] == "malformed_request"
        assert "Upgrade" in body_of(refused)["error"]["message"]
        client.close()


def test_a_header_request_id_is_trimmed_and_held_to_the_body_fields_rule() -> None:
    """Trailing whitespace of a header value is not part of it (as through uvicorn's protocol); an
    X-Request-Id a body's request_id could not name (spaces, non-ASCII, over 256 characters) is refused
    with a 422, nothing booked."""
    with uvicorn_on_loopback() as port:
        client = Client(port)
        _setup(client, 1)
        tokens = {"tokens": list(range(3 * BLOCK_SIZE))}
        booked = client.ask(request("POST", "/v1/new", json.dumps(tokens).encode(), x_request_id="abc \t"))
        assert body_of(booked)["request_id"] == "abc"
        assert body_of(client.ask(post("/v1/mark_free", {"request_id": "abc"}))) == {
            "request_id": "abc",
            "success": True,
        }
        for bad in ("has space", "\xe9t\xe9", "x" * 257):
            lines = request("POST", "/v1/new", json.dumps(tokens).encode()).split(b"\r\n\r\n", 1)
            refused = client.ask(lines[0] + b"\r\nX-Request-Id: " + bad.encode("latin-1") + b"\r\n\r\n" + lines[1])
            assert refused.startswith(b"HTTP/1.1 422 "), refused
            assert "X-Request-Id: a request id is 1 to 256 visible ASCII" in body_of(refused)["error"]["message"]
        loads = body_of(client.ask(post("/v1/potential_loads", tokens)))
        assert all(load["active_requests"] == 0 for load in loads["loads"]), loads
        client.close()


def test_msgpack_bytes_expect_continue_http10_and_explain() -> None:
    with uvicorn_on_loopback() as port:
        client = Client(port)
        _setup(client, 1, 2)
        packed = msgspec.msgpack.encode({"tokens": b"".join(t.to_bytes(4, "little") for t in TOKENS)})
        answer = client.ask(
            request(
                "POST",
                "/v1/new?explain=true",
                packed,
                content_type="application/msgpack",
                accept="application/msgpack",
                x_request_id="m",
            )
        )
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\ncontent-type: application/msgpack\r\n")
        assert head.endswith(b"\r\nx-request-id: m")
        decision = msgspec.msgpack.decode(body)
        assert (decision["worker_id"], decision["overlap_blocks"], decision["request_id"]) == (1, 3, "m")
        assert {c["worker_id"] for c in decision["explanation"]["candidates"]} == {1, 2}

        # Expect: 100-continue: the interim answer comes before the body is sent.
        body = b'{"request_id":"m"}'
        client.send(request("POST", "/v1/mark_free", body, expect="100-continue")[: -len(body)])
        assert client.sock.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        assert client.ask(body) == reply("200 OK", b'{"request_id":"m","success":true}', request_id="m")
        client.close()

        # HTTP/1.0: answered, then closed.
        old = Client(port)
        sent = post("/v1/mark_free", {"request_id": "m"}).replace(b"HTTP/1.1", b"HTTP/1.0", 1)
        gone = b'{"error":{"type":"unknown_request_id","message":"request \'m\' is not active"}}'
        assert old.ask(sent) == reply("404 Not Found", gone, close=True)
        assert old.closed_by_server()
        old.close()


def test_queued_new_completes_after_mark_free_on_another_connection() -> None:
    queue = {"router_queue_threshold": 0.0, "router_queue_request_limit_per_worker": 2}
    with uvicorn_on_loopback(**queue) as port:
        first, second = Client(port), Client(port)
        assert first.ask(post("/v1/workers", {"worker_id": 1, "max_num_batched_tokens": 16})).startswith(
            b"HTTP/1.1 201 "
        )
        assert body_of(first.ask(post("/v1/new", {"tokens": prompt(8, 64), "request_id": "first"})))["worker_id"] == 1
        # `second` waits in the queue; a request pipelined behind it waits for its turn.
        second.send(post("/v1/new", {"tokens": prompt(9, 64), "request_id": "second"}))
        second.send(post("/v1/mark_free", {"request_id": "nope"}))
        assert second.nothing_within(0.3)
        pending = body_of(first.ask(post("/v1/potential_loads", {"tokens": [1]})))
        assert (pending["pending_count"], pending["pending_isl_tokens"]) == (1, 64)
        assert first.ask(post("/v1/mark_free", {"request_id": "first"})) == reply(
            "200 OK", b'{"request_id":"first","success":true}', request_id="first"
        )
        decision = body_of(second.response())
        assert decision["request_id"] == "second" and decision["timing"]["queued_s"] > 0.2
        assert second.response() == error("404 Not Found", "unknown_request_id", "request 'nope' is not active")

        # A client that leaves while queued gives its place back; nothing stays booked under its id.
        leaver = Client(port)
        leaver.send(post("/v1/new", {"tokens": prompt(10, 64), "request_id": "leaver"}))

        def pending() -> int:
            return int(body_of(first.ask(post("/v1/potential_loads", {"tokens": [1]})))["pending_count"])

        until(lambda: pending() == 1, 30, "the leaver is queued")
        leaver.close()
        until(lambda: pending() == 0, 30, "the leaver's place is given back")
        assert first.ask(post("/v1/mark_free", {"request_id": "second"})).startswith(b"HTTP/1.1 200 ")
        assert first.ask(post("/v1/mark_free", {"request_id": "leaver"})).startswith(b"HTTP/1.1 404 ")
        first.close()
        second.close()


def test_keep_alive_timeout_closes_only_idle_connections() -> None:
    # 1 s: a loaded machine's stall between two of the busy client's asks stays well short of it.
    with uvicorn_on_loopback(keep_alive_s=1.0) as port:
        busy, idle = Client(port), Client(port)
        for client in (busy, idle):
            assert client.ask(post("/v1/mark_free", {"request_id": "x"})).startswith(b"HTTP/1.1 404 ")
        for _ in range(10):  # 1.5 s of traffic, never 1 s idle
            time.sleep(0.15)  # the behaviour under test: time passes on the keep-alive clock
            assert busy.ask(post("/v1/mark_free", {"request_id": "x"})).startswith(b"HTTP/1.1 404 ")
        assert idle.closed_by_server(0.1)
        assert busy.closed_by_server(2)
        busy.close()
        idle.close()


def test_hot_routes_move_the_metrics() -> None:
    with uvicorn_on_loopback() as port:
        client = Client(port)
        _setup(client, 1)
        client.ask(post("/v1/new", {"tokens": TOKENS, "request_id": "k"}))
        client.ask(post("/v1/mark_free", {"request_id": "k"}))
        client.ask(post("/v1/mark_free", {"request_id": "k"}))
        text = client.ask(request("GET", "/metrics")).decode()
        client.close()
    assert 'kv_router_requests_total{method="new",outcome="ok"} 1.0' in text
    assert 'kv_router_requests_total{method="mark_free",outcome="ok"} 1.0' in text
    assert 'kv_router_requests_total{method="mark_free",outcome="unknown_request_id"} 1.0' in text
    assert 'kv_router_decision_duration_seconds_count{phase="request"} 1.0' in text
    assert "kv_router_overlap_blocks_sum 3.0" in text


def test_sigterm_lets_requests_in_flight_finish(tmp_path: Path) -> None:
    """A queued `new` and the `mark_free` that will let it through are both in flight when SIGTERM
    arrives (the free's body not yet complete): both are answered, with ``connection: close``, and
    the process exits cleanly."""
    flags = ["--block-size", str(BLOCK_SIZE), "--log-level", "warning", "--no-embedded-nats",
             "--router-queue-threshold", "0.0"]  # fmt: skip
    with RouterProcess(tmp_path, *flags, ready_path="/healthz") as service:
        port, process = service.port, service.process
        assert process is not None
        first, second = Client(port), Client(port)
        first.ask(post("/v1/workers", {"worker_id": 1, "max_num_batched_tokens": 16}))
        first.ask(post("/v1/new", {"tokens": prompt(8, 64), "request_id": "first"}))
        second.send(post("/v1/new", {"tokens": prompt(9, 64), "request_id": "second"}))
        assert second.nothing_within(0.2)
        free = post("/v1/mark_free", {"request_id": "first"})
        first.send(free[:-5])
        # A round trip on another connection: the server's loop has read what was sent before it.
        barrier = Client(port)
        assert barrier.ask(post("/v1/mark_free", {"request_id": "x"})).startswith(b"HTTP/1.1 404 ")
        barrier.close()
        process.send_signal(signal.SIGTERM)
        until(lambda: not service.accepting(), what="the shutdown starts (the listener closes)")
        first.send(free[-5:])
        assert first.response() == reply(
            "200 OK", b'{"request_id":"first","success":true}', request_id="first", close=True
        )
        answer = second.response()
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\nconnection: close\r\n" in answer
        assert body_of(answer)["request_id"] == "second"
        assert first.closed_by_server() and second.closed_by_server()
        assert process.wait(30) in _CLEAN_EXIT
        first.close()
        second.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1)


def _chunked(method: str, path: str, body: bytes, size: int = 7) -> bytes:
    pieces = [body[start : start + size] for start in range(0, len(body), size)]
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    return head.encode() + b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n"


# Requests for the rest of the app (FastAPI's routes, run on the ASGI app by either protocol).
_REST = [
    request("GET", "/healthz"),
    request("GET", "/v1/workers/2"),
    request("GET", "/v1/workers/%32?unused=1"),  # a percent-encoded path and a query string
    request("GET", "/v1/nope"),
    request("DELETE", "/v1/new"),
    _chunked("POST", "/v1/workers", b'{"worker_id": 5, "total_kv_blocks": 64}'),
    request("POST", "/v1/workers", b'{"worker_id": ', content_type=JSON),
    request("GET", "/v1/workers/5"),
    request("DELETE", "/v1/workers/5"),
    request("GET", "/readyz"),
]


def _head_only(client: Client) -> bytes:
    while b"\r\n\r\n" not in client.buffer:
        client._recv()
    head, _, client.buffer = client.buffer.partition(b"\r\n\r\n")
    return head


def _until_closed(client: Client) -> bytes:
    while True:
        chunk = client.sock.recv(65536)
        if not chunk:
            return client.buffer
        client.buffer += chunk


def test_the_rest_of_the_app_answers_the_same_bytes_through_either_protocol() -> None:
    """Every request the protocol does not answer itself is run on the ASGI app: one by one, pipelined,
    chunked, with ``Expect: 100-continue``, ``HEAD``, HTTP/1.0, an upgrade and an unparsable request,
    the bytes on the wire are those of uvicorn's own httptools protocol (``fast_protocol`` off), but for
    the unparsable request's body: ours is JSON."""
    answers: dict[bool, list[bytes]] = {}
    for fast_protocol in (True, False):
        got: list[bytes] = []
        with uvicorn_on_loopback(fast_protocol=fast_protocol) as port:
            client = Client(port)
            _setup(client, 1)
            got += [client.ask(sent) for sent in _REST]
            client.send(b"".join(_REST))
            got += [client.response() for _ in _REST]
            # Expect: 100-continue on an app route: the interim answer once the app reads the body.
            body = b'{"worker_id": 6}'
            client.send(request("POST", "/v1/workers", body, expect="100-continue")[: -len(body)])
            got.append(client.sock.recv(100))
            got.append(client.ask(body))
            client.send(request("HEAD", "/healthz"))
            got.append(_head_only(client))
            got.append(client.ask(request("GET", "/healthz")))  # the connection goes on after a HEAD
            client.close()
            old = Client(port)  # HTTP/1.0: answered, then closed
            old.send(request("GET", "/v1/workers/2").replace(b"HTTP/1.1", b"HTTP/1.0", 1))
            got.append(_until_closed(old))
            old.close()
            upgrade = Client(port)  # no WebSocket: answered as plain HTTP
            answer = upgrade.ask(request("GET", "/healthz", connection="Upgrade", upgrade="websocket"))
            if fast_protocol:
                # Then closed: what follows an upgrade request is not HTTP (uvicorn's own protocol
                # keeps the connection, its parser stuck in the upgrade: a later request is never answered).
                assert b"\r\nconnection: close\r\n" in answer and upgrade.closed_by_server()
            got.append(answer.replace(b"connection: close\r\n", b""))
            upgrade.close()
            bad = Client(port)  # unparsable: a 400, then closed
            bad.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n")
            refused = _until_closed(bad)
            got.append(refused.split(b"\r\n", 1)[0])
            if fast_protocol:  # ours says why in JSON, as every error of the service (uvicorn: text/plain)
                assert body_of(refused)["error"]["type"] == "malformed_request", refused
            bad.close()
        answers[fast_protocol] = got
    assert answers[True] == answers[False]
    statuses = [int(answer[9:12]) for answer in answers[True][: len(_REST)]]
    assert statuses == [200, 404, 404, 404, 405, 201, 400, 200, 200, 200]
    assert answers[True][2 * len(_REST)] == b"HTTP/1.1 100 Continue\r\n\r\n"


def test_a_client_still_sending_after_its_400_reads_it_and_is_closed_within_the_linger_bound() -> None:
    """Bytes that are not HTTP, the client sending on: it reads its 400 and the answer's end (the server
    shut its side and reads on, dropping what comes; before, it closed with the client's bytes unread,
    and the kernel's reset failed the client's next send and could take the 400 with it), and the
    connection closes ``LINGER_SECS`` later at most though the client never stops."""
    with uvicorn_on_loopback() as port:
        client = Client(port)
        client.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n")
        answered = time.monotonic()
        for _ in range(10):  # still sending for 0.5 s, the 400 not read yet
            client.send(b"x" * 1000)
            time.sleep(0.05)
        refused = _answer_then_closed(client, 10)
        assert refused.startswith(b"HTTP/1.1 400 Bad Request\r\n"), refused
        assert body_of(refused)["error"]["type"] == "malformed_request", refused
        with pytest.raises((BrokenPipeError, ConnectionResetError)):  # sending until it fails
            while time.monotonic() - answered < LINGER_SECS + 5:
                client.send(b"x" * 1000)
                time.sleep(0.05)
        assert time.monotonic() - answered < LINGER_SECS + 2
        client.close()


@pytest.mark.parametrize(("path", "status"), [("/nope", b"404 Not Found"), ("/v1/models", b"405 Method Not Allowed")])
def test_a_client_sending_the_body_an_app_route_refused_before_it_reads_the_refusal(path: str, status: bytes) -> None:
    """An app route's refusal of a request before its body (``Expect: 100-continue``, answered at once):
    the client that sends its body all the same sends it whole and reads the refusal and the answer's
    end (before, the connection closed with the body coming in, and the kernel's reset broke the
    client's send)."""
    piece, pieces = b"x" * 1000, 10
    with uvicorn_on_loopback() as port:
        client = Client(port)
        client.send(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(piece) * pieces}\r\nExpect: 100-continue\r\n\r\n".encode()
        )
        for _ in range(pieces):  # the body sent for 0.5 s, the refusal not read yet
            client.send(piece)
            time.sleep(0.05)
        refused = _answer_then_closed(client, 10)
        assert refused.startswith(b"HTTP/1.1 " + status + b"\r\n"), refused
        assert b"\r\nconnection: close" in refused.partition(b"\r\n\r\n")[0].lower()
        client.close()


def _answer_then_closed(client: Client, within: float) -> bytes:
    """What the server sends until it closes the connection; fails if that takes more than ``within`` s."""
    client.sock.settimeout(within)
    try:
        return _until_closed(client)
    except TimeoutError:
        raise AssertionError(f"the connection is still open after {within} s; read: {client.buffer!r}") from None


def _timed_out(answer: bytes, part: str) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"), answer
    assert b"\r\nconnection: close" in head
    assert json.loads(body)["error"] == {"type": "request_timeout", "message": part}


def test_a_request_that_does_not_arrive_in_time_gets_a_408_and_its_connection_closes() -> None:
    """A head not all in within ``request_head_timeout_secs`` of its first byte (trickling in, too),
    or a body that brings nothing for ``request_body_timeout_secs`` (a plain head kept for its body, a
    chunked body, an app route's body): a JSON 408, then the connection closes (a client held every
    such connection open for good). A body still coming in, however slowly, is read to its end, and an
    idle keep-alive connection is closed by its own timeout, without a 408."""
    timeouts = {"request_head_timeout_secs": 0.5, "request_body_timeout_secs": 0.5}
    head_late = "the request's head did not arrive within 0.5 s"
    body_late = "the request's body brought nothing for 0.5 s"
    stalled = {
        b"POST /v1/mark_free HTTP/1.1\r\nHost: x\r\n": head_late,
        b"GET /healthz HTTP/1.1\r\n": head_late,
        b"POST /v1/mark_free HTTP/1.1\r\nHost: x\r\nContent-Length: 18\r\n\r\n": body_late,  # kept for the C parser
        b"POST /v1/mark_free HTTP/1.1\r\nHost: x\r\nContent-Length: 18\r\n\r\n" + b'{"requ': body_late,
        b'POST /v1/mark_free HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{"r\r\n': body_late,
        b"POST /v1/workers HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\nContent-Length: 9\r\n\r\n{": body_late,
    }
    with uvicorn_on_loopback(keep_alive_s=1.0, **timeouts) as port:
        clients = {sent: Client(port) for sent in stalled}
        started = time.monotonic()
        for sent, client in clients.items():
            client.send(sent)
        for sent, client in clients.items():
            _timed_out(_answer_then_closed(client, 10), stalled[sent])
            client.close()
        assert time.monotonic() - started >= 0.5

        trickle = Client(port)
        trickled = b"POST /v1/mark_free HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
        first_byte = time.monotonic()
        # A byte every 0.1 s for 1.5 s: bytes keep coming, the head never ends, and the client still sends
        # after its 408 (not read yet). The server lingers, reading and dropping them: closed with unread
        # input, or given a byte once closed, the kernel would reset the connection, and the client could
        # lose its 408.
        for byte in range(15):
            trickle.send(trickled[byte : byte + 1])
            time.sleep(0.1)
        _timed_out(_answer_then_closed(trickle, 10), head_late)
        assert time.monotonic() - first_byte < 5
        trickle.close()

        slow, idle = Client(port), Client(port)
        plain = post("/v1/mark_free", {"request_id": "x"})  # its head kept for the C parser
        # Connection: keep-alive makes the C parser decline it: httptools and the app's route read it.
        app = post("/v1/workers", {"worker_id": "x"}, connection="keep-alive")
        for sent, status in ((plain, b"404"), (app, b"422")):
            head, _, body = sent.partition(b"\r\n\r\n")
            slow.send(head + b"\r\n\r\n")
            for start in range(0, len(body), 3):  # a piece every 0.3 s: more than 0.5 s for the whole body
                assert slow.nothing_within(0.3)
                slow.send(body[start : start + 3])
            assert slow.response()[9:12] == status
        assert idle.closed_by_server(5) and idle.buffer == b""
        slow.close()
        idle.close()


def test_a_client_that_reads_nothing_of_its_answers_is_dropped_after_the_write_timeout() -> None:
    """A client that pipelines requests for the service's own routes and reads none of the answers
    (more than the buffers between us hold): once it has read nothing for ``response_write_timeout_secs``
    its connection is dropped, what was written to it with it. Before, only the proxy's streams had
    such a clock: the connection, and the answers held for it, stayed for as long as the client lived,
    its keep-alive close waiting for a flush that never came. A client that keeps reading, pausing
    less than the timeout, reads every answer."""
    dropped = "a client read nothing of its complete answer for 1 s"
    warnings: list[str] = []
    with uvicorn_on_loopback(keep_alive_s=1.0, response_write_timeout_secs=1.0) as port:
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("uvicorn.error").addHandler(handler)
        asked = request("GET", "/openapi.json")
        probe = Client(port)
        answer_bytes = len(probe.ask(asked))
        probe.close()
        pipelined = 200  # several MiB of answers: more than the kernel's buffers hold

        stalled = Client(port)
        stalled.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the kernel holds less for it
        stalled.sock.sendall(asked * pipelined)
        until(lambda: any(dropped in line for line in warnings), 10, "the stalled client dropped")
        stalled.close()

        slow = Client(port)
        slow.sock.sendall(asked * pipelined)
        slow.sock.settimeout(5)
        read = 0
        while read < answer_bytes * pipelined:  # bounded: it ends with the last answer or fails
            got = slow.sock.recv(1 << 16)
            assert got, f"closed after {read} bytes while its client kept reading"
            if read // (1 << 20) != (read + len(got)) // (1 << 20):
                time.sleep(0.2)  # a pause after each MiB, well within the timeout
            read += len(got)
        assert sum(dropped in line for line in warnings) == 1
        slow.close()
        logging.getLogger("uvicorn.error").removeHandler(handler)


def test_a_refusal_before_an_expected_body_closes_the_connection() -> None:
    """``Expect: 100-continue`` refused before the body is asked for (a 413 on its Content-Length, the
    app's 401 or 404): the answer says ``connection: close`` and the connection closes, so what the
    client sends next (here a request, where the body was expected) is never read as either. A body
    the service asks for (100 Continue) keeps the connection."""
    with uvicorn_on_loopback(max_body_bytes=1000, api_token="s3cret") as port:
        smuggled = request("GET", "/healthz")
        for path, length, status in (("/v1/mark_free", 5000, b"413"), ("/v1/workers", 20, b"401"),
                                     ("/v1/nothere", 20, b"404")):  # fmt: skip
            client = Client(port)
            client.send(request("POST", path, b"x" * length, expect="100-continue")[:-length])
            refused = client.response()
            assert refused[9:12] == status and b"\r\nconnection: close\r\n" in refused, refused
            try:
                client.send(smuggled)
                assert client.closed_by_server(), client.buffer
            except (BrokenPipeError, ConnectionResetError):
                pass  # closed before these bytes came: the kernel refused them
            client.close()
        client = Client(port)
        body = b'{"request_id":"m"}'
        client.send(request("POST", "/v1/mark_free", body, expect="100-continue")[: -len(body)])
        assert client.sock.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        assert client.ask(body)[9:12] == b"404"
        assert client.ask(smuggled) == HEALTHY
        client.close()


@pytest.mark.parametrize("fast_protocol", [True, False], ids=["protocol", "asgi"])
def test_head_on_the_probes_is_answered_as_get_without_a_body(fast_protocol: bool) -> None:
    """Load balancers probe with ``HEAD``: each probe (and alias) answers its GET's status and headers,
    no body, and the connection goes on."""
    with uvicorn_on_loopback(fast_protocol=fast_protocol) as port:
        client = Client(port)
        for path in ("/healthz", "/health", "/liveness", "/readyz", "/readiness"):
            got = client.ask(request("GET", path))
            client.send(request("HEAD", path))
            assert _head_only(client) == got.partition(b"\r\n\r\n")[0]
        assert client.ask(request("GET", "/healthz")) == HEALTHY
        client.close()

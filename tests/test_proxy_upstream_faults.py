"""Workers misbehaving in ways only the bytes on the wire show, through the proxy on real sockets (a
worker written by hand on loopback, the client's answer read raw): a failure in the read that brings a
stream's first events, an answer larger than the proxy holds, a second answer glued to the first, an
interim answer's headers, a reused connection the worker closes long after the request went out. Each
time the client gets one answer (one head; a stream begun ends with its error event and the end of
its chunked body), every booking is freed and the next request goes through."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools
import msgspec
import pytest

from api.proxy.wire import error_body
from router.event_plane.embedded_server import EmbeddedNats
from tests.gate_worker import register
from tests.proxy_fleet import MODEL, SSE_HEAD, Fleet, fleet, idle, raw_worker, sse_chunk
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

DONE = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"  # the stream's last event, and the end of its chunked body
WHOLE_STREAM = SSE_HEAD + sse_chunk(" ok") + DONE
WHOLE_STREAM_EVENTS = (
    b'data: {"choices": [{"index": 0, "text": " ok"}], "object": "text_completion"}\n\ndata: [DONE]\n\n'
)
MALFORMED_CHUNK = b"zz\r\n"  # no chunk size: the answer cannot be read on from here


def body(stream: bool) -> bytes:
    return msgspec.json.encode({"model": MODEL, "prompt": list(range(1, 40)), "max_tokens": 4, "stream": stream})


# A worker's answer to its n-th request (from 1): its writes (each one drained before the next), then
# whether it closes the connection.
Script = Callable[[int], tuple[list[bytes], bool]]


@dataclass
class Worker:
    url: str
    requests: int = 0
    connections: int = 0


@contextlib.asynccontextmanager
async def worker_scripted(script: Script) -> AsyncIterator[Worker]:
    """A worker that reads each request whole and writes what ``script`` gives for it."""
    state = Worker("")

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.connections += 1
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                state.requests += 1
                writes, close = script(state.requests)
                for data in writes:
                    writer.write(data)
                    await writer.drain()  # raises once the proxy has closed the connection
                if close:
                    break
        writer.close()

    async with raw_worker(serve) as url:
        state.url = url
        yield state


@dataclass
class Answer:
    """One HTTP answer as the client got it."""

    status: int = 0
    headers: dict[bytes, bytes] = field(default_factory=dict)
    body: bytes = b""
    complete: bool = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True


async def exchange(f: Fleet, content: bytes) -> Answer:
    """``POST /v1/completions`` on a connection of its own: the one answer the client got, whole (one
    head, its body to its end: a chunked body terminated), read from the raw bytes."""
    address = urlsplit(f.url)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: proxy\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\nconnection: close\r\n\r\n%b" % (len(content), content))  # fmt: skip
        raw = await asyncio.wait_for(reader.read(), 10)  # to the close
    finally:
        writer.close()
    assert raw.count(b"HTTP/1.1 ") == 1, f"not one answer: {raw!r}"
    answer = Answer()
    parser = httptools.HttpResponseParser(answer)
    parser.feed_data(raw)
    answer.status = parser.get_status_code()
    assert answer.complete, f"an answer cut short: {raw!r}"
    return answer


async def next_request_goes_through(f: Fleet) -> None:
    """Every booking freed, and the proxy (and the worker's pool) serve the next request."""
    await eventually(lambda: idle(f.router), what="every booking freed")
    answer = await exchange(f, body(stream=True))
    assert answer.status == 200 and answer.body == WHOLE_STREAM_EVENTS
    await eventually(lambda: idle(f.router), what="every booking freed")


def then_whole_streams(first: bytes, close: bool = True) -> Script:
    """A worker answering its first request ``first``, and every later one the whole stream."""

    def script(n: int) -> tuple[list[bytes], bool]:
        return ([first], close) if n == 1 else ([WHOLE_STREAM], False)

    return script


@pytest.mark.parametrize("fast_protocol", [True, False])
async def test_a_failure_in_the_read_of_a_streams_first_events_is_retried_as_nothing_reached_the_client(
    nats_server: EmbeddedNats, fast_protocol: bool
) -> None:
    """The first events and a malformed chunk in one read: none of that read reaches the client, the
    request goes again and the client gets one answer, the next attempt's. Before, the first events
    went to the client and the retry wrote a second head into its stream."""
    first = SSE_HEAD + sse_chunk(" broken") + MALFORMED_CHUNK
    async with (
        fleet(nats_server.url, (), service={"fast_protocol": fast_protocol}) as f,
        worker_scripted(then_whole_streams(first)) as worker,
    ):
        await register(f, 7, worker.url)
        answer = await exchange(f, body(stream=True))
        assert answer.status == 200 and answer.headers[b"x-kv-router-worker"] == b"7"
        assert b"broken" not in answer.body and answer.body.endswith(b"data: [DONE]\n\n")
        assert worker.requests == 2
        await next_request_goes_through(f)


@pytest.mark.parametrize("fast_protocol", [True, False])
async def test_without_retries_that_failure_is_one_502_in_json(nats_server: EmbeddedNats, fast_protocol: bool) -> None:
    first = SSE_HEAD + sse_chunk(" broken") + MALFORMED_CHUNK
    async with (
        fleet(nats_server.url, (), service={"fast_protocol": fast_protocol}, proxy={"proxy_retries": 0}) as f,
        worker_scripted(then_whole_streams(first)) as worker,
    ):
        await register(f, 7, worker.url)
        answer = await exchange(f, body(stream=True))
        assert answer.status == 502 and answer.headers[b"content-type"] == b"application/json"
        error = msgspec.json.decode(answer.body)["error"]
        assert error["type"] == "upstream_error" and "malformed answer" in error["message"]
        assert worker.requests == 1
        await next_request_goes_through(f)


LIMIT = 16 * 1024  # proxy_max_answer_bytes in these tests: more than that fits in one read
MORE_THAN_THE_LIMIT = [b"%x\r\n%b\r\n" % (4096, b"y" * 4096)] * 64  # 256 KiB as chunks, no event's end


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


@pytest.mark.parametrize("fast_protocol", [True, False])
async def test_a_whole_answer_over_the_limit_is_one_502_at_once(nats_server: EmbeddedNats, fast_protocol: bool) -> None:
    """Past ``proxy_max_answer_bytes`` a whole answer is given up: the client gets a 502 in JSON naming
    the setting, the request is not tried again (another worker would send as much) nor the worker
    blamed. Before, the proxy held all of it, however long (hundreds of MiB a second)."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"

    too_large = [head, chunk(b'{"text": "'), *MORE_THAN_THE_LIMIT, chunk(b'"}'), b"0\r\n\r\n"]

    def script(n: int) -> tuple[list[bytes], bool]:
        return (too_large, True) if n == 1 else ([WHOLE_STREAM], False)

    proxy = {"proxy_max_answer_bytes": LIMIT}
    async with (
        fleet(nats_server.url, (), service={"fast_protocol": fast_protocol}, proxy=proxy) as f,
        worker_scripted(script) as worker,
    ):
        await register(f, 7, worker.url)
        answer = await exchange(f, body(stream=False))
        assert answer.status == 502 and answer.headers[b"content-type"] == b"application/json"
        error = msgspec.json.decode(answer.body)["error"]
        assert error == {"message": f"worker 7: its answer exceeds proxy_max_answer_bytes ({LIMIT} bytes)",
                         "type": "upstream_error", "param": None, "code": 502}  # fmt: skip
        assert worker.requests == 1
        assert f.router.health.availability(7).consecutive_failures == 0
        await next_request_goes_through(f)


@pytest.mark.parametrize("fast_protocol", [True, False])
@pytest.mark.parametrize("arrival", ["after the first events", "in the read of the first events"])
async def test_a_stream_event_never_ended_past_the_limit_ends_the_stream_with_its_error_event(
    nats_server: EmbeddedNats, fast_protocol: bool, arrival: str
) -> None:
    """An event whose end does not come is held back (only whole events go to the client) up to
    ``proxy_max_answer_bytes``; past it the stream ends with the proxy's error event, also when the
    limit is passed in the very read that began the client's stream (one head all the same)."""
    first = SSE_HEAD + sse_chunk(" w1")
    unended = chunk(b"data: " + b"y" * (LIMIT + 16))
    writes = [first] if arrival == "after the first events" else [first + unended]

    def script(n: int) -> tuple[list[bytes], bool]:
        return ([*writes, *MORE_THAN_THE_LIMIT, DONE], True) if n == 1 else ([WHOLE_STREAM], False)

    proxy = {"proxy_max_answer_bytes": LIMIT}
    async with (
        fleet(nats_server.url, (), service={"fast_protocol": fast_protocol}, proxy=proxy) as f,
        worker_scripted(script) as worker,
    ):
        await register(f, 7, worker.url)
        answer = await exchange(f, body(stream=True))
        assert answer.status == 200
        w1, error = answer.body.split(b"\n\n", 1)
        assert w1 == b'data: {"choices": [{"index": 0, "text": " w1"}], "object": "text_completion"}'
        message = f"worker 7 failed mid-stream: an event of its stream exceeds proxy_max_answer_bytes ({LIMIT} bytes)"
        assert error == b"data: " + error_body(502, "upstream_error", message) + b"\n\n"
        assert worker.requests == 1
        await next_request_goes_through(f)


OK_JSON = b'{"choices": [{"index": 0, "text": " ok"}], "object": "text_completion"}'


@pytest.mark.parametrize("fast_protocol", [True, False])
async def test_a_second_answer_glued_to_the_first_is_not_read_into_it_and_the_connection_is_dropped(
    nats_server: EmbeddedNats, fast_protocol: bool
) -> None:
    """Bytes after a whole answer in the same read answer nothing the proxy asked: the client gets the
    first answer alone, and the connection is not used again. Before, the second was parsed into the
    same exchange: the client got its status and content type, and both bodies."""
    evil = b'{"evil": true}'
    glued = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (
        len(OK_JSON),
        OK_JSON,
    ) + b"HTTP/1.1 201 Created\r\ncontent-type: text/evil\r\ncontent-length: %d\r\n\r\n%b" % (len(evil), evil)
    async with (
        fleet(nats_server.url, (), service={"fast_protocol": fast_protocol}) as f,
        worker_scripted(then_whole_streams(glued, close=False)) as worker,
    ):
        await register(f, 7, worker.url)
        answer = await exchange(f, body(stream=False))
        assert (answer.status, answer.headers[b"content-type"], answer.body) == (200, b"application/json", OK_JSON)
        await next_request_goes_through(f)
        assert worker.connections == 2  # the next request on a new one


@pytest.mark.parametrize("fast_protocol", [True, False])
@pytest.mark.parametrize("status", [b"200 OK", b"429 Too Many Requests"])
async def test_an_interim_answers_headers_are_not_the_answers(
    nats_server: EmbeddedNats, fast_protocol: bool, status: bytes
) -> None:
    """A 103 Early Hints before the answer: its content type and Retry-After are not the answer's. Before,
    an answer without a content type went out as the hints', and an engine's 429 with the hints'
    Retry-After (waited for before a retry, or past the budget, given to the client)."""
    hints = b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>\r\ncontent-type: text/x-hints\r\nretry-after: 3600\r\n\r\n"
    final = b"HTTP/1.1 %b\r\ncontent-length: %d\r\n\r\n%b" % (status, len(OK_JSON), OK_JSON)
    proxy = {"proxy_retries": 0}
    async with (
        fleet(nats_server.url, (), service={"fast_protocol": fast_protocol}, proxy=proxy) as f,
        worker_scripted(then_whole_streams(hints + final, close=False)) as worker,
    ):
        await register(f, 7, worker.url)
        answer = await exchange(f, body(stream=False))
        assert answer.status == int(status[:3]) and answer.body == OK_JSON
        assert b"retry-after" not in answer.headers
        assert answer.headers[b"content-type"] == b"application/json"
        await next_request_goes_through(f)
        assert worker.connections == 1

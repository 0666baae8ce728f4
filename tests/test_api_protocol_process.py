"""kv-router's HTTP protocol in a ``kv-router serve`` process, through raw sockets on loopback: what
a body sent in small pieces costs the service (its CPU time, read from /proc), and, with the proxy in
front of an engine's HTTP server (`EngineHttp`), a client that pipelines completions and reads none
of their answers, and an HTTP/1.0 client's streamed answer."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine_fakes import EngineHttp, SideLoop
from tests.router_processes import RouterProcess
from tests.test_api_protocol import Client, _answer_then_closed, request
from tests.waiting import until

MODEL = "tiny-model"
WRITE_TIMEOUT_S = 1.0


def _cpu_ns(pid: int) -> int:
    """The CPU time of every thread of process ``pid`` so far, in ns (/proc's schedstat)."""
    return sum(int(stat.read_text().split()[0]) for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"))


def test_a_body_sent_in_small_pieces_costs_time_linear_in_its_size(tmp_path: Path) -> None:
    """A plain POST whose body comes 1 KiB at a time (the C parser keeps its head for the body) costs
    the service time linear in the body's size: 4 MB costs about 4 times what 1 MB does, each read's
    bytes handled once (joined and parsed again on every read, it cost about 16 times: quadratic).
    Sizes compared at one piece size, so the cost of a read, which a loaded machine inflates, cancels."""
    head = b"POST /v1/mark_free HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    with RouterProcess(tmp_path, "--no-embedded-nats", "--log-level", "warning", ready_path="/healthz") as service:

        def upload(size: int) -> int:
            """The service's CPU time (ns) for one upload of a ``size``-byte body in 1 KiB writes."""
            body = b'{"request_id":"' + b"a" * (size - 18) + b'"}'
            client = Client(service.port)
            before = _cpu_ns(service.pid)
            client.send(head % len(body))
            for start in range(0, len(body), 1024):
                client.send(body[start : start + 1024])
                time.sleep(0.0005)  # each piece its own read
            answer = client.response()
            spent = _cpu_ns(service.pid) - before
            assert answer.startswith(b"HTTP/1.1 422 "), answer[:100]  # a request id over 256 characters
            client.close()
            return spent

        upload(1_000_000)  # warm
        small = min(upload(1_000_000) for _ in range(2))
        large = min(upload(4_000_000) for _ in range(2))
    assert large < 8 * small, (large, small)


def test_thousands_of_pipelined_requests_held_while_the_client_did_not_read_are_all_answered(
    tmp_path: Path,
) -> None:
    """A client pipelines small POSTs into a small receive buffer and reads nothing until the service
    stops taking them (its answers fill the socket's buffers, and it stops reading): it holds the
    requests while it cannot write, then answers every whole one, once the client reads. Started one
    from another's answer, the held requests overflowed the stack after about 165: the rest were never
    answered and the connection hung."""
    one = (
        b"POST /v1/potential_loads HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b'content-length: 18\r\n\r\n{"tokens":[1,2,3]}'
    )
    burst = one * 500
    with RouterProcess(tmp_path, "--no-embedded-nats", "--log-level", "warning", ready_path="/healthz") as service:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", service.port))
        client.settimeout(2)
        sent = 0
        with contextlib.suppress(TimeoutError):
            for _ in range(200):  # at most 100,000 requests; the service stops taking them far sooner
                view = memoryview(burst)
                while view:
                    taken = client.send(view)
                    sent += taken
                    view = view[taken:]
        whole = sent // len(one)
        assert whole < 100_000, "the service never stopped taking requests: its writes never paused"
        answers = bytearray()
        client.settimeout(10)
        with contextlib.suppress(TimeoutError):
            while answers.count(b"HTTP/1.1 ") < whole:
                piece = client.recv(1 << 20)
                if not piece:
                    break
                answers += piece
        client.close()
    assert answers.count(b"HTTP/1.1 200 OK") == whole, (answers.count(b"HTTP/1.1 "), whole)


@pytest.fixture(scope="module")
def proxied(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterProcess, EngineHttp]]:
    """A ``kv-router serve --proxy`` process (a client that reads nothing is dropped after 1 s) in front of
    one engine's HTTP server, registered over HTTP."""
    side = SideLoop()
    engine = side.call(EngineHttp(models=(MODEL,)).start())
    flags = ["--no-embedded-nats", "--log-level", "warning", "--proxy",
             "--proxy-client-write-timeout-secs", str(WRITE_TIMEOUT_S)]  # fmt: skip
    try:
        with RouterProcess(tmp_path_factory.mktemp("proxied"), *flags, ready_path="/healthz") as router:
            status, _ = router.post("/v1/workers", {"worker_id": 1, "url": engine.url, "models": [MODEL]})
            assert status == 201
            yield router, engine
    finally:
        side.call(engine.stop())
        side.close()


def _completion(stream: bool, version: bytes = b"1.1") -> bytes:
    body = json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1, "stream": stream}).encode()
    sent = request("POST", "/v1/completions", body)
    return sent.replace(b"HTTP/1.1", b"HTTP/" + version, 1)


def _closed_by_the_service(service_port: int, client: socket.socket) -> bool:
    """Whether the service has closed its end of ``client``'s connection, seen without reading: its
    socket is no longer ESTABLISHED (/proc/net/tcp; a close leaves what the client did not read with
    the kernel, a FIN behind it)."""
    client_port = client.getsockname()[1]
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, remote, state = line.split()[1:4]
        if int(local.split(":")[1], 16) == service_port and int(remote.split(":")[1], 16) == client_port:
            return state != "01"
    return True


def test_a_client_that_reads_none_of_its_answers_gets_no_more_requests_forwarded(
    proxied: tuple[RouterProcess, EngineHttp],
) -> None:
    """Completions pipelined by a client that reads nothing, each answer 4 MiB: once the buffers
    between the service and the client are full, no further request of it is started (each one was
    forwarded to the engine, its answer held for nobody: the service's memory grew by every answer),
    and its connection is closed after the write timeout."""
    router, engine = proxied
    engine.completion_text = "x" * (4 << 20)
    pipelined = 20
    before = engine.asked["/v1/completions"]
    client = Client(router.port)
    try:
        client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.send(_completion(stream=False) * pipelined)
        until(lambda: _closed_by_the_service(router.port, client.sock), 10 + WRITE_TIMEOUT_S, "the connection closed")
        forwarded = engine.asked["/v1/completions"] - before
        assert 0 < forwarded < pipelined // 2, forwarded
    finally:
        client.close()
        engine.completion_text = " w1"


def test_an_http10_client_gets_its_stream_without_chunks_ended_by_the_close(
    proxied: tuple[RouterProcess, EngineHttp],
) -> None:
    """HTTP/1.0 has no chunked framing: a streamed answer comes as the events themselves, with
    ``connection: close``, its end the connection's; a whole answer keeps its content-length."""
    router, _ = proxied
    client = Client(router.port)
    client.send(_completion(stream=True, version=b"1.0"))
    head, _, events = _answer_then_closed(client, 10).partition(b"\r\n\r\n")
    client.close()
    assert head.startswith(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"), head
    assert b"transfer-encoding" not in head.lower() and b"\r\nconnection: close" in head
    first, done = events.split(b"\n\n")[:2]
    assert json.loads(first.removeprefix(b"data: "))["choices"][0]["text"] == " w1"
    assert done == b"data: [DONE]" and events.endswith(b"data: [DONE]\n\n"), events
    whole = Client(router.port)
    whole.send(_completion(stream=False, version=b"1.0"))
    answer = _answer_then_closed(whole, 10)
    whole.close()
    length = int(answer.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    assert len(answer.partition(b"\r\n\r\n")[2]) == length

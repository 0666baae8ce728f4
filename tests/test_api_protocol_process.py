"""kv-router's HTTP protocol in a ``kv-router serve`` process, through raw sockets on loopback: what
a body sent in small pieces costs the service (its CPU time, read from /proc)."""

from __future__ import annotations

import time
from pathlib import Path

from tests.router_processes import RouterProcess
from tests.test_api_protocol import Client


def _cpu_ns(pid: int) -> int:
    """The CPU time of every thread of process ``pid`` so far, in ns (/proc's schedstat)."""
    return sum(int(stat.read_text().split()[0]) for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"))


def test_a_body_sent_in_small_pieces_costs_time_linear_in_its_size(tmp_path: Path) -> None:
    """A plain POST whose 4 MB body comes 1 KiB at a time (the C parser keeps its head for the body)
    costs the service no more than a few times what the same body in 64 KiB pieces does: 64 times the
    reads, but each one's bytes handled once (joined and parsed again on every read, the 1 KiB upload
    cost about 30 times the other)."""
    body = b'{"request_id":"' + b"a" * (4_000_000 - 18) + b'"}'
    head = b"POST /v1/mark_free HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    with RouterProcess(tmp_path, "--no-embedded-nats", "--log-level", "warning", ready_path="/healthz") as service:

        def upload(piece: int) -> int:
            """The service's CPU time (ns) for one upload of ``body`` in ``piece``-byte writes."""
            client = Client(service.port)
            before = _cpu_ns(service.pid)
            client.send(head % len(body))
            for start in range(0, len(body), piece):
                client.send(body[start : start + piece])
                time.sleep(0.0005)  # each piece its own read
            answer = client.response()
            spent = _cpu_ns(service.pid) - before
            assert answer.startswith(b"HTTP/1.1 422 "), answer[:100]  # a request id over 256 characters
            client.close()
            return spent

        upload(65536)  # warm
        small, large = upload(1024), upload(65536)
    assert small < 12 * large, (small, large)

"""What the API token costs a hot request, in the same run: ``kv-router serve`` without a token,
with one guarding the admin routes only (the decision routes stay open), and with
``--protect-decisions`` (every decision checked), each answering ``POST /v1/mark_free`` of an unknown
id (the cheapest hot request, so the check's share is largest) on one keep-alive loopback connection.

    nice -n 10 python bench/auth_bench.py [--requests 20000] [--rounds 3]

Each round runs the three servers one after the other; the median requests/s per configuration and
its ratio to the no-token server are printed, with the in-process cost of the check itself.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from api.auth import ApiAuth
from router.event_plane.embedded_server import free_port

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-token-0123456789abcdef"
CONFIGS = {
    "no token": [],
    "token, admin only": ["--api-token", TOKEN],
    "token, --protect-decisions": ["--api-token", TOKEN, "--protect-decisions"],
}


def _request(authorized: bool) -> bytes:
    body = b'{"request_id":"nobody"}'
    auth = f"authorization: Bearer {TOKEN}\r\n".encode() if authorized else b""
    return (b"POST /v1/mark_free HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n" + auth
            + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip


def _measure(flags: list[str], requests: int) -> float:
    port = free_port()
    command = [sys.executable, "-m", "api.cli", "serve", "--port", str(port), "--no-embedded-nats",
               "--log-level", "warning", *flags]  # fmt: skip
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as server:
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                    break
                except OSError:
                    assert time.monotonic() < deadline and server.poll() is None, "server did not start"
                    time.sleep(0.05)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            payload = _request(authorized=bool(flags))
            for _ in range(500):  # warm-up
                sock.sendall(payload)
                sock.recv(65536)
            started = time.perf_counter()
            for _ in range(requests):
                sock.sendall(payload)
                reply = sock.recv(65536)
            elapsed = time.perf_counter() - started
            assert reply.startswith(b"HTTP/1.1 404"), reply[:80]  # answered by the handler, past the check
            sock.close()
            return requests / elapsed
        finally:
            server.terminate()
            server.wait(20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for _ in range(args.rounds):
        for name, flags in CONFIGS.items():
            rates[name].append(_measure(flags, args.requests))
    base = statistics.median(rates["no token"])
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"{name:28s} {median:9,.0f} req/s  ({median / base:.3f} of no token; runs {[round(v) for v in values]})")
    auth = ApiAuth(TOKEN)
    header = f"Bearer {TOKEN}".encode()
    per_check = min(timeit.repeat(lambda: auth.allows(header), number=100_000, repeat=5)) / 100_000
    print(f"the check itself (ApiAuth.allows, good token): {per_check * 1e6:.2f} µs")


if __name__ == "__main__":
    main()

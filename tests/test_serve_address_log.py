"""``kv-router serve`` logs the address it serves HTTP on, once its socket listens: one INFO line
``serving HTTP on http://HOST:PORT`` (uvicorn names no address for a socket it is handed).

A real ``kv-router serve`` process on a free loopback port, stopped by its PID.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from api.server import http_address
from tests.router_processes import RouterProcess


def test_http_address_of_a_socket_name() -> None:
    assert http_address(("127.0.0.1", 8000)) == "http://127.0.0.1:8000"
    assert http_address(("::1", 8443, 0, 0), tls=True) == "https://[::1]:8443"


@pytest.mark.slow
def test_serve_logs_the_http_address_it_listens_on(tmp_path: Path) -> None:
    with RouterProcess(tmp_path, "--no-embedded-nats", ready_path="/healthz") as router:
        log = router.log()
    line = f"INFO api.server: serving HTTP on http://127.0.0.1:{router.port}"
    assert log.count(line) == 1, log
    assert log.index(line) > log.index("Application startup complete")  # once it listens, the app started

"""Every ZMQ endpoint a user gives (``serve --engine``'s event and ``replay=`` sockets, ``bridge
--zmq-endpoint`` and ``--replay-endpoint``) is checked at start-up by one rule: without ``tcp://`` (or
``ipc://``) the command says so in one line on stderr and exits 2, never retrying a socket ZMQ refuses
(a ZMQError traceback every few seconds, forever).

Real ``kv-router serve`` and ``bridge`` processes (the bridge with a real nats-server to reach), each
ended by its own exit or, should it hang, killed by its PID when ``subprocess.run`` times out.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from router.engines.engine_spec import check_zmq_endpoint, parse_engine_spec
from router.event_plane.embedded_server import EmbeddedNats, free_port
from tests.router_processes import ROOT, kv_router_command

TIMEOUT_S = 40  # the old code never exited: the run would time out


@pytest.mark.parametrize("endpoint", ["127.0.0.1:5557", "tcp://127.0.0.1", "tcp://h:x", "udp://h:1", "tcp://h:1=2"])
def test_an_endpoint_without_tcp_scheme_and_port_is_refused(endpoint: str) -> None:
    with pytest.raises(ValueError, match=r"the replay endpoint must be tcp://HOST:PORT, got '"):
        check_zmq_endpoint(endpoint, "replay")


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5557", "tcp://[::1]:5557", "tcp://host.example:1", "ipc:///x"])
def test_tcp_and_ipc_endpoints_pass(endpoint: str) -> None:
    check_zmq_endpoint(endpoint, "event")


def test_an_engine_spec_checks_its_replay_endpoint_as_its_event_endpoint() -> None:
    with pytest.raises(ValueError, match=re.escape("the event endpoint must be tcp://HOST:PORT, got '127.0.0.1:5557'")):
        parse_engine_spec("1=127.0.0.1:5557")
    with pytest.raises(
        ValueError, match=re.escape("the replay endpoint must be tcp://HOST:PORT, got '127.0.0.1:5558'")
    ):
        parse_engine_spec("1=tcp://127.0.0.1:5557,replay=127.0.0.1:5558")


def _run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*kv_router_command(), *args], capture_output=True, text=True, timeout=TIMEOUT_S, env=env,
                          cwd=ROOT, stdin=subprocess.DEVNULL)  # fmt: skip


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    return lines[0]


@pytest.mark.slow
def test_serve_refuses_a_replay_endpoint_without_tcp(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    done = _run("serve", "--port", str(free_port()), "--no-embedded-nats",
                "--engine", "1=tcp://127.0.0.1:5557,replay=127.0.0.1:5558", env=env)  # fmt: skip
    line = _one_line(done)
    assert "the replay endpoint must be tcp://HOST:PORT, got '127.0.0.1:5558' (from flag --engine)" in line


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (
            ["--zmq-endpoint", "127.0.0.1:5557"],
            "kv-router bridge: zmq_endpoint: the event endpoint must be tcp://HOST:PORT, got '127.0.0.1:5557' "
            "(from flag --zmq-endpoint)",
        ),
        (
            ["--zmq-endpoint", "tcp://127.0.0.1:{port}", "--replay-endpoint", "127.0.0.1:5558"],
            "kv-router bridge: replay_endpoint: the replay endpoint must be tcp://HOST:PORT, got '127.0.0.1:5558' "
            "(from flag --replay-endpoint)",
        ),
    ],
)
def test_bridge_refuses_endpoints_without_tcp(tmp_path: Path, flags: list[str], said: str) -> None:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    port = free_port()
    with EmbeddedNats() as nats:  # reachable: the old bridge got past NATS and looped on the socket
        done = _run("bridge", "--worker-id", "3", "--nats-url", nats.url,
                    *[flag.format(port=port) for flag in flags], env=env)  # fmt: skip
    assert _one_line(done) == said

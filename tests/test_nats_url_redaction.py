"""Credentials inside a NATS URL (``nats://user:password@host:port``, ``nats://token@host:port``) are never
shown: not in ``/healthz``, ``/readyz`` or ``/v1/info``, not in the service's log, not by ``kv-router config
show``, not in the start-up lines of ``mock-worker`` and ``bridge``; each shows ``nats://***@host:port``.

Real ``kv-router serve``, ``mock-worker`` and ``bridge`` processes on free loopback ports, each stopped by its
PID, each with its own ``XDG_RUNTIME_DIR``.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from router.event_plane.embedded_server import EmbeddedNats, free_port
from router.event_plane.urls import redact_nats_url
from tests.router_processes import ROOT, RouterProcess, ToolProcess, kv_router_command
from tests.waiting import until

pytestmark = pytest.mark.slow

PASSWORD = "s3cret-pw"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("nats://user:pw@127.0.0.1:4222", "nats://***@127.0.0.1:4222"),
        ("nats://only-a-token@127.0.0.1:4222", "nats://***@127.0.0.1:4222"),
        ("tls://u:p@a:1,tls://u:p@b:2", "tls://***@a:1,tls://***@b:2"),
        ("u:p@host:4222", "***@host:4222"),
        ("nats://u:p@ss@host:4222", "nats://***@host:4222"),
        ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
        ("127.0.0.1:4222", "127.0.0.1:4222"),
    ],
)
def test_redact_nats_url(url: str, shown: str) -> None:
    assert redact_nats_url(url) == shown


def _runtime(tmp_path: Path) -> dict[str, str]:
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700, exist_ok=True)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    env.pop("KV_ROUTER_NATS_CONNECTION_FILE", None)
    return env


def _body(port: int, path: str) -> Any:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as error:  # /readyz: 503 while the event plane has not started
        return json.loads(error.read())


# nats-py leaves a refused connection's socket to the garbage collector: the library's warning, not ours.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_serve_never_shows_the_credentials_of_its_nats_url(tmp_path: Path) -> None:
    nats_port = free_port()  # nothing listens there: the service keeps retrying
    url = f"nats://router:{PASSWORD}@127.0.0.1:{nats_port}"
    shown = f"nats://***@127.0.0.1:{nats_port}"
    with RouterProcess(tmp_path, "--nats-url", url, env=_runtime(tmp_path), ready_path="/healthz") as router:
        until(lambda: "unreachable" in router.log(), 30, "a retry WARNING")
        health = _body(router.port, "/healthz")
        ready = _body(router.port, "/readyz")
        info = _body(router.port, "/v1/info")
    assert health["event_plane"]["nats_url"] == shown
    assert ready["event_plane"]["nats_url"] == shown and f"NATS at {shown} unreachable" in ready["reason"]
    assert info["nats_url"] == shown
    log = router.log()
    assert f"WARNING api.plane_lifecycle: NATS at {shown} unreachable" in log
    assert PASSWORD not in json.dumps([health, ready, info]) and PASSWORD not in log


def test_config_show_masks_the_credentials_of_the_nats_url() -> None:
    env = {**os.environ, "KV_ROUTER_NATS_URL": f"nats://router:{PASSWORD}@nats.example:4222"}
    done = subprocess.run([*kv_router_command(), "config", "show"], capture_output=True, text=True, timeout=60,
                          env=env, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert 'nats_url = "nats://***@nats.example:4222"  # environment variable KV_ROUTER_NATS_URL' in done.stdout
    assert PASSWORD not in done.stdout + done.stderr


def test_tools_never_show_the_credentials_of_their_nats_url(tmp_path: Path) -> None:
    env = _runtime(tmp_path)
    with EmbeddedNats(require_token=True) as server:
        assert server.token is not None
        url = f"nats://{server.token}@127.0.0.1:{server.port}"  # a token alone in the URL: nats-py sends it
        shown = f"nats://***@127.0.0.1:{server.port}"
        worker = ToolProcess(tmp_path, env, "--worker-id", "5", "--nats-url", url)
        bridge = ToolProcess(tmp_path, env, "--worker-id", "6", "--zmq-endpoint", f"tcp://127.0.0.1:{free_port()}",
                             "--nats-url", url, command="bridge")  # fmt: skip
        with worker, bridge:
            until(lambda: f"mock worker 5 on {shown}" in worker.log(), 60, "the mock worker's start-up line")
            until(lambda: f"-> {shown}" in bridge.log(), 60, "the bridge's start-up line")
        assert server.token not in worker.log() and server.token not in bridge.log()

    # Nothing answers: the waiting and the final lines name the URL, masked.
    unreachable = f"nats://worker:{PASSWORD}@127.0.0.1:{free_port()}"
    for command, flags in (
        ("mock-worker", ()),
        ("bridge", ("--worker-id", "7", "--zmq-endpoint", f"tcp://127.0.0.1:{free_port()}")),
    ):
        with ToolProcess(tmp_path, env, *flags, "--nats-url", unreachable, "--nats-wait-secs", "1",
                         command=command) as tool:  # fmt: skip
            until(tool.ended, 60, f"{command} gives up")
            log = tool.log()
        assert "cannot connect to NATS at nats://***@127.0.0.1:" in log, log
        assert PASSWORD not in log

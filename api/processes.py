"""``kv-router serve --processes N``: N router processes on one host sharing one port, each a replica.

The parent starts the embedded nats-server when no URL is given (and starts it again if it dies:
`api.plane_lifecycle.embedded_nats`), then N children. Each child binds
its own listening socket to the same address with ``SO_REUSEPORT`` (the kernel spreads connections
over them) and runs the whole service with replica sync on, so a request booked through one child's
connection can be marked through any other's and every child routes on the load of all of them.

The parent supervises: a child that dies is started again after a second (it rejoins through replica
sync; its bookings leave the others after the lease). While a sibling runs, the child started again
listens only once its event plane has caught up: started, and the full dumps it asked the workers
registered by heartbeat for are in (`api.server.serve_child`): its socket would take its share of
new connections at once, answered from an empty view (no workers, no bookings, no caches) while the
siblings answer from the fleet's. It listens sooner, blind, once no sibling listens any more (they
died meanwhile, or wait as it does for a NATS out of reach): the port must not go unserved. The
first children listen as soon as their app starts (``/healthz`` answers at once, ``/readyz`` says
when each is ready), and so does one started again when no sibling runs: there is then no one else
to answer.
SIGTERM / SIGINT to the parent is passed on to every child (once each; those not yet started are not
started), which shuts down gracefully; the parent exits when they have. A parent killed outright
(SIGKILL) takes its children with it: each gets SIGTERM from the kernel (Linux).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

import msgspec

from api.config import Settings
from api.process_metrics import ProcessGroup
from router.event_plane.embedded_server import die_with_parent

__all__ = ["CHILD_CATCH_UP_ENV", "CHILD_SETTINGS_ENV", "child_settings", "run_children"]

log = logging.getLogger(__name__)

CHILD_SETTINGS_ENV = "KV_ROUTER__CHILD_SETTINGS"
# "1": the child listens only once its event plane has caught up (started again beside a running sibling).
CHILD_CATCH_UP_ENV = "KV_ROUTER__CHILD_CATCH_UP"
RESTART_AFTER_S = 1.0


def child_settings(settings: Settings, index: int) -> Settings:
    """A child's settings: replica sync on, one process, its own snapshot name."""
    base = settings.ha.router_name or f"{socket.gethostname()}-{settings.service.port}"
    ha = msgspec.structs.replace(settings.ha, replica_sync=True, processes=1, router_name=f"{base}-{index}")
    return msgspec.structs.replace(settings, ha=ha)


def run_children(settings: Settings) -> int:
    """Start and supervise ``settings.ha.processes`` children until SIGTERM / SIGINT; returns 0."""
    count = settings.ha.processes
    # The children's metrics sockets (`api.process_metrics`): private to this user, removed when the parent
    # stops (a parent killed outright leaves the directory, emptied as its children exit).
    try:
        group_directory: Path | None = Path(tempfile.mkdtemp(prefix="kv-router-processes-"))
    except OSError as exc:  # no writable temporary directory: each process's /metrics answers for itself
        log.warning("/metrics will answer for the process a scrape reaches only: %s", exc)
        group_directory = None
    children: dict[int, subprocess.Popen[bytes]] = {}
    stopping = False
    # Each child is sent SIGTERM once: a second one makes uvicorn give up its graceful shutdown.
    signalled: set[int] = set()

    def terminate(child: subprocess.Popen[bytes]) -> None:
        if child.poll() is None and child.pid not in signalled:
            signalled.add(child.pid)
            child.send_signal(signal.SIGTERM)

    def start(index: int, catch_up: bool = False) -> None:
        env = {
            **os.environ,
            CHILD_SETTINGS_ENV: msgspec.json.encode(child_settings(settings, index)).decode(),
            **(ProcessGroup(group_directory, index, count).environment() if group_directory is not None else {}),
            CHILD_CATCH_UP_ENV: "1" if catch_up else "",
        }
        command = [sys.executable, "-c", "from api.server import serve_child; serve_child()"]
        # A child outliving the parent (kill -9) would keep its share of the port, ready but cut off
        # from the plane it can never rejoin, beside the children of a restarted parent.
        children[index] = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, preexec_fn=functools.partial(die_with_parent, os.getpid())
        )
        log.info("router process %d started (pid %d)", index, children[index].pid)

    def stop(sig: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for child in list(children.values()):
            terminate(child)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for index in range(count):
            if stopping:  # a signal while they start: start no more
                break
            start(index)
        while not stopping:
            time.sleep(0.2)
            for index, child in list(children.items()):
                if child.poll() is not None and not stopping:
                    log.warning("router process %d (pid %d) ended with %s; starting it again in %.0f s",
                                index, child.pid, child.returncode, RESTART_AFTER_S)  # fmt: skip
                    time.sleep(RESTART_AFTER_S)
                    if not stopping:
                        siblings = (other for other_index, other in children.items() if other_index != index)
                        start(index, catch_up=any(other.poll() is None for other in siblings))
        for child in children.values():
            terminate(child)  # one whose start the signal interrupted is not in what stop() saw
            child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if group_directory is not None:
            shutil.rmtree(group_directory, ignore_errors=True)
    return 0

"""Shared fixtures: where the team's reference material (../shared) lives, a real nats-server, a client.

The suite's one way to do each of these (use them, do not write another):
- wait for an asynchronous effect: `tests.waiting` (``eventually`` on the loop, ``until`` blocking);
  wait on a condition, never a fixed time (a sleep stays only where time passing is what is tested,
  with a comment saying so);
- read ``/metrics``: `tests.metrics` (``sample``, ``total``, ``label_names``), on prometheus_client's parser;
- start a process: `tests.router_processes` (``RouterProcess`` for the service, ``ToolProcess`` for
  ``mock-worker`` and ``bridge``), logged to a file, stopped by its PID.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client

import api.native
import indexer.native
import router.native
from router.event_plane.connection import NatsOptions, connect
from router.event_plane.embedded_server import EmbeddedNats, find_nats_server, free_port
from tests.waiting import accepting, until

SHARED_DIR = Path(os.environ.get("KV_ROUTER_SHARED", Path(__file__).resolve().parents[2] / "shared"))


def pytest_report_header() -> str:
    layers = {"indexer": indexer.native.ENABLED, "router": router.native.ENABLED, "api": api.native.ENABLED}
    state = ", ".join(f"{layer} {'on' if on else 'off'}" for layer, on in layers.items())
    switch = indexer.native.NATIVE_DISABLED_ENV
    return f"kv-router C accelerators: {state} ({switch}={os.environ.get(switch, '')!r})"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED_DIR.is_dir():
        pytest.skip(f"reference material not found at {SHARED_DIR} (set KV_ROUTER_SHARED)")
    return SHARED_DIR


@pytest.fixture
def anyio_backend() -> str:
    """Async tests (``@pytest.mark.anyio``) run on asyncio, the loop the service uses."""
    return "asyncio"


@pytest.fixture
def nats_server() -> Iterator[EmbeddedNats]:
    """A real nats-server with JetStream on a free loopback port, stopped after the test."""
    with EmbeddedNats() as server:
        yield server


@pytest.fixture
def plain_nats_url() -> Iterator[str]:
    """An operator's plain nats-server, without JetStream, on a free loopback port: its URL."""
    port = free_port()
    server = subprocess.Popen([find_nats_server(), "-a", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        until(lambda: accepting(port), 20, "nats-server listens")
        yield f"nats://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(10)


@pytest.fixture
async def client(nats_server: EmbeddedNats) -> AsyncIterator[Client]:
    """A NATS client connected to ``nats_server``."""
    nc = await connect(NatsOptions(nats_server.url))
    yield nc
    await nc.close()

"""Shared fixtures: where the team's reference material (../shared) lives."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from indexer.native import ENABLED as NATIVE
from indexer.native import NATIVE_DISABLED_ENV
from router.event_plane.connection import NatsOptions, connect
from router.event_plane.embedded_server import EmbeddedNats

SHARED_DIR = Path(os.environ.get("KV_ROUTER_SHARED", Path(__file__).resolve().parents[2] / "shared"))


def pytest_report_header() -> str:
    state = "on" if NATIVE else f"off (pure Python; {NATIVE_DISABLED_ENV}={os.environ.get(NATIVE_DISABLED_ENV, '')!r})"
    return f"kv-router C accelerator: {state}"


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
async def client(nats_server: EmbeddedNats) -> AsyncIterator[Client]:
    """A NATS client connected to ``nats_server``."""
    nc = await connect(NatsOptions(nats_server.url))
    yield nc
    await nc.close()

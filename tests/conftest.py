"""Shared fixtures: where the team's reference material (../shared) lives."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED_DIR = Path(os.environ.get("KV_ROUTER_SHARED", Path(__file__).resolve().parents[2] / "shared"))


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED_DIR.is_dir():
        pytest.skip(f"reference material not found at {SHARED_DIR} (set KV_ROUTER_SHARED)")
    return SHARED_DIR


@pytest.fixture
def anyio_backend() -> str:
    """Async tests (``@pytest.mark.anyio``) run on asyncio, the loop the service uses."""
    return "asyncio"

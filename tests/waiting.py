"""Waiting for asynchronous effects in tests: poll a condition until it holds or time runs out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["eventually", "until"]


async def eventually(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """On the event loop: yield until ``condition()`` holds; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Blocking: sleep until ``condition()`` holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)

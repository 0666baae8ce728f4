"""The tests' one way to wait for an asynchronous effect: poll a condition until it holds or time runs
out, then fail saying what was awaited. Never wait a fixed time for something to happen.

A timeout only bounds a failure (a wait that succeeds ends at once), so it is generous: CI runs on
fresh, slower machines, where NATS, JetStream and subprocesses take several times longer than here."""

from __future__ import annotations

import asyncio
import inspect
import socket
import time
from collections.abc import Awaitable, Callable

__all__ = ["accepting", "eventually", "until"]

POLL_S = 0.02
DEFAULT_TIMEOUT_S = 30.0


async def eventually(
    condition: Callable[[], bool | Awaitable[bool]],
    timeout: float = DEFAULT_TIMEOUT_S,
    what: str = "condition",
    *,
    in_thread: bool = False,
    poll: float = POLL_S,
) -> None:
    """On the event loop: yield until ``condition()`` holds (a coroutine function is awaited; with
    ``in_thread`` a blocking one runs off the loop, which keeps serving meanwhile); fail after
    ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = await asyncio.to_thread(condition) if in_thread else condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        await asyncio.sleep(poll)


def until(
    condition: Callable[[], bool], timeout: float = DEFAULT_TIMEOUT_S, what: str = "condition", *, poll: float = POLL_S
) -> None:
    """Blocking: sleep until ``condition()`` holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(poll)


def accepting(port: int) -> bool:
    """Whether something takes TCP connections on the loopback ``port`` now."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False

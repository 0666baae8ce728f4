"""Run a coroutine on the caller's stack until it first has to wait (Python 3.12's eager tasks, by hand).

A hot route almost never waits: a routing decision runs synchronously and only a request parked in
the router's queue awaits. `start` runs the coroutine right away; if it finishes, the caller has the
result with no task and no trip through the event loop. If it suspends, `start` returns a
`Suspended`, an awaitable that continues it exactly where it stopped, with asyncio's usual
semantics: the future it waits on wakes it, and a cancellation is delivered at that ``await``.

Such a coroutine has no current task until it first waits, so it must not use ``asyncio.timeout``
(nor ``asyncio.wait_for``, which is ``asyncio.timeout`` from Python 3.12): both raise ``RuntimeError``
there. `within` is the deadline it uses instead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Generator
from typing import Any, Generic, TypeVar

__all__ = ["Suspended", "retrieve", "start", "within"]

T = TypeVar("T")

logger = logging.getLogger(__name__)


def start(coro: Coroutine[Any, Any, T]) -> T | Suspended[T]:
    """Run ``coro`` until it returns (its value), raises (raised here), or first suspends (`Suspended`)."""
    try:
        waiting_on = coro.send(None)
    except StopIteration as done:
        result: T = done.value
        return result
    return Suspended(coro, waiting_on)


async def within(seconds: float, work: Coroutine[Any, Any, T]) -> T:
    """``work``'s outcome, or `TimeoutError` once ``seconds`` have passed (``work`` cancelled and
    waited for first, as ``asyncio.wait_for`` does); usable with no current task. ``work`` runs as a
    task of its own, which a timer cancels, and so does any other end of the wait: a cancellation
    thrown in with no task driving us (`Suspended.task` cancelled before its first step) does not
    reach ``work`` through the task, and it would finish for nobody (a connection opened, kept)."""
    task = asyncio.ensure_future(work)
    timed_out = False

    def time_out() -> None:
        nonlocal timed_out
        timed_out = task.cancel()

    timer = asyncio.get_running_loop().call_later(seconds, time_out)
    try:
        return await task
    except asyncio.CancelledError:
        caller = asyncio.current_task()  # the task driving us by now: we were resumed
        # Cancelled as the timer fired: the caller's own cancellation is not turned into a timeout.
        if timed_out and (caller is None or not caller.cancelling()):
            raise TimeoutError(f"no outcome within {seconds:g} s") from None
        raise
    finally:
        timer.cancel()
        if not task.done():
            task.cancel()
            task.add_done_callback(retrieve)  # nobody awaits it now


def retrieve(task: asyncio.Future[Any]) -> None:
    """A done callback for a task nobody awaits: its outcome is read, so that what it raised is not
    logged as an exception never retrieved."""
    if not task.cancelled():
        task.exception()


class Suspended(Generic[T]):
    """A coroutine `start` ran up to its first suspension; await it (once) to let it finish."""

    __slots__ = ("_coro", "_resumed", "_waiting_on")

    def __init__(self, coro: Coroutine[Any, Any, T], waiting_on: Any) -> None:
        self._coro = coro
        self._waiting_on = waiting_on  # what it yielded: the future it waits on (or None, a bare yield)
        self._resumed = False

    def __await__(self) -> Generator[Any, Any, T]:
        self._resumed = True
        coro, waiting_on = self._coro, self._waiting_on
        while True:
            try:
                # Hand the future up to the task that awaits us; it wakes us once the future is done,
                # exactly as it would have woken the coroutine itself.
                sent = yield waiting_on
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # thrown in by the task (its cancellation): deliver it
                try:
                    waiting_on = coro.throw(exc)
                except StopIteration as done:
                    thrown: T = done.value
                    return thrown
            else:
                try:
                    waiting_on = coro.send(sent)
                except StopIteration as done:
                    result: T = done.value
                    return result

    def task(self, loop: asyncio.AbstractEventLoop) -> asyncio.Task[T]:
        """Finish in a task of its own. If that task is cancelled before its first step, the
        cancellation is still delivered at the coroutine's ``await``, so its clean-up runs."""
        task = loop.create_task(_finish(self))
        task.add_done_callback(self._if_never_resumed)
        return task

    def _if_never_resumed(self, task: asyncio.Task[T]) -> None:
        if self._resumed:
            return
        self._resumed = True
        try:
            self._coro.throw(asyncio.CancelledError())
        except (asyncio.CancelledError, StopIteration):
            pass
        except BaseException:
            logger.exception("coroutine failed while being cancelled")
        else:  # it awaited again while being cancelled: nothing can run it any more
            self._coro.close()


async def _finish(suspended: Suspended[T]) -> T:
    return await suspended

"""Background work that is never silently dead.

A `Supervisor` owns the tasks one component runs beside its callers:

- ``keep_running(name, loop)``: a loop meant to run until stopped. If it raises, the exception is
  logged with its traceback (a `ServiceFault`, whose message says all, in one line), counted in
  ``restarts``, and the loop is started again after a backoff that doubles up to ``max_backoff_s``
  (reset once a run lasted longer than the backoff).
- ``spawn(name, coroutine)``: one-shot work (a resync, a request). If it raises, the exception is
  logged with its traceback and counted in ``failures``; nothing is restarted.
- ``stop()``: cancels everything and waits for it, at most ``stop_timeout_s``, cancelling again every
  half second what still runs: a cancellation can be lost on its way (Python 3.11's ``asyncio.wait_for``
  returns its result when the two land together, and nats-py's requests, key-value calls and
  ``next_msg`` are built on it). A task still running at the timeout is named in an ERROR log and
  left behind rather than hanging the shutdown; whatever ended with an exception meanwhile has
  already been logged. A loop whose cancellation was lost is not restarted, and `raise_if_cancelling`
  lets a loop end at once after such an await rather than run another round; a clean-up that must
  not be cut by the next ask runs under `unwind`.
- ``cancel(task)``: one of its tasks cancelled and waited for as by ``stop()`` (a loop to be started
  afresh).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

__all__ = ["ServiceFault", "Supervisor", "raise_if_cancelling", "unwind"]

_log = logging.getLogger(__name__)
_CANCEL_AGAIN_S = 0.5  # long enough for a cancelled task's own clean-up, which another cancel would cut


class ServiceFault(Exception):
    """A failure of the service's surroundings whose message says what is wrong and what to do (a NATS
    server without JetStream): logged in one line, its traceback would only bury that."""


def raise_if_cancelling() -> None:
    """Raise `asyncio.CancelledError` in a task whose cancellation was asked for but lost on its way (see
    the module's docstring): called after an await that may have swallowed it, before the next round."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def unwind(cleanup: Coroutine[Any, Any, None]) -> None:
    """Run ``cleanup`` to its end even while the task is cancelled again (`Supervisor.stop` asks every
    half second), then deliver the cancellation: a clean-up that awaits NATS must not be cut half way."""
    work = asyncio.ensure_future(cleanup)
    cancelled = False
    while not work.done():
        try:
            await asyncio.wait({work})  # which cancels the waiting, never the clean-up
        except asyncio.CancelledError:
            cancelled = True  # even as the clean-up ends in the same turn: not lost
    if cancelled:
        if not work.cancelled() and (failure := work.exception()) is not None:
            _log.error("a clean-up failed while its task was being cancelled", exc_info=failure)
        raise asyncio.CancelledError
    work.result()


class Supervisor:
    def __init__(
        self, owner: str, *, max_backoff_s: float = 5.0, first_backoff_s: float = 0.1, stop_timeout_s: float = 5.0
    ) -> None:
        self.owner = owner
        self._stop_timeout = stop_timeout_s
        self._max_backoff = max_backoff_s
        self._first_backoff = first_backoff_s
        self._tasks: set[asyncio.Task[None]] = set()
        self.restarts: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()

    def keep_running(self, name: str, loop: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        return self._track(asyncio.create_task(self._supervise(name, loop), name=f"{self.owner}:{name}"))

    def spawn(self, name: str, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = self._track(asyncio.create_task(work, name=f"{self.owner}:{name}"))
        task.add_done_callback(lambda done: self._report(name, done))
        return task

    @property
    def running(self) -> int:
        return len(self._tasks)

    async def stop(self) -> None:
        await self._cancel(list(self._tasks))

    async def cancel(self, task: asyncio.Task[None]) -> None:
        """Cancel one of its tasks and wait for it as `stop` does (a loop to be started afresh)."""
        await self._cancel([task])

    # ------------------------------------------------------------------ internals
    async def _cancel(self, tasks: list[asyncio.Task[None]]) -> None:
        for task in tasks:
            task.cancel()
        if not tasks:
            return
        deadline = time.monotonic() + self._stop_timeout
        stuck = set(tasks)
        while stuck and (left := deadline - time.monotonic()) > 0:
            _, stuck = await asyncio.wait(stuck, timeout=min(_CANCEL_AGAIN_S, left))
            for task in stuck:  # its cancellation lost on the way: asked again
                task.cancel()
        if stuck:
            names = ", ".join(sorted(task.get_name() for task in stuck))
            _log.error(
                "%s: %d task(s) ignored cancellation for %.0f s: %s", self.owner, len(stuck), self._stop_timeout, names
            )

    def _track(self, task: asyncio.Task[None]) -> asyncio.Task[None]:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _report(self, name: str, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.failures[name] += 1
            _log.error("%s: %s failed", self.owner, name, exc_info=exc)

    async def _supervise(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        backoff = self._first_backoff
        while True:
            started = time.monotonic()
            try:
                await loop()
            except asyncio.CancelledError:
                raise
            except ServiceFault as fault:
                raise_if_cancelling()
                self.restarts[name] += 1
                _log.error("%s: %s failed: %s; retrying in %.1f s", self.owner, name, fault, backoff)
            except Exception:
                raise_if_cancelling()  # it ended because its cancellation was lost: not restarted
                self.restarts[name] += 1
                _log.exception("%s: %s crashed; restarting in %.1f s", self.owner, name, backoff)
            else:
                raise_if_cancelling()
                self.restarts[name] += 1
                _log.error("%s: %s returned, though it should run until stopped; restarting", self.owner, name)
            if time.monotonic() - started > backoff:
                backoff = self._first_backoff
            await asyncio.sleep(backoff)
            backoff = min(self._max_backoff, backoff * 2)

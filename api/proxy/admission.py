"""The proxy's concurrency cap: at most ``proxy_max_concurrent_requests`` requests past it at a time,
the next ones waiting in a bounded queue, each at most ``proxy_queue_timeout_secs``.

The waiting requests are the router's `PendingQueue` (one queue concept, one place): ordered the way
the router's own queue orders them (its ``router_queue_policy`` under strict priority, a request's
``nvext.agent_hints`` priority and tier counted as there), bounded by ``proxy_max_waiting_requests``
as the router bounds its queue (the request that finds it full is refused). A request refused, or
still waiting at its timeout, is a 429 with ``Retry-After`` (`QueueRejected`, as the router's queue
refuses). A slot freed goes to the head of the queue at once. With a cap of 0 (the default) nothing
is counted and nothing waits: one compare per request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext

from api.config import ProxyConfig
from router.config import QueuePolicy
from router.errors import QueueRejected
from router.queue import POLICY_CLASS, PendingQueue
from router.types import QueueRejection, RouteRequest

__all__ = ["Admission"]


class Admission:
    """The slots of one proxy and the requests waiting for one."""

    def __init__(self, config: ProxyConfig, policy: QueuePolicy) -> None:
        self.limit = config.proxy_max_concurrent_requests
        self._timeout = config.proxy_queue_timeout_secs
        self._waiting_limit = config.proxy_max_waiting_requests
        self.in_flight = 0
        self.queue: PendingQueue[asyncio.Future[bool]] = PendingQueue(
            policy, started_at=time.monotonic(), request_limit_per_worker=self._waiting_limit
        )

    def slot(self, request: RouteRequest, isl_tokens: int) -> AbstractAsyncContextManager[None]:
        """Hold one slot for the block; waits in the queue while none is free. Raises `QueueRejected`
        when the queue is full or the wait times out. Without a cap: a shared no-op."""
        return _NO_CAP if self.limit == 0 else self._slot(request, isl_tokens)

    @asynccontextmanager
    async def _slot(self, request: RouteRequest, isl_tokens: int) -> AsyncIterator[None]:
        if self.in_flight >= self.limit or len(self.queue):
            await self._wait(request, isl_tokens)
        else:
            self.in_flight += 1
        try:
            yield
        finally:
            self._release()

    def refusal(self) -> QueueRejected | None:
        """Why a request arriving now would be refused (every slot held and the queue full), or None.
        Asked before anything costs a worker a call (a prompt sent to its ``/tokenize``): a request
        that cannot wait is refused at once, not after a round trip the cap does not cover."""
        if self.limit == 0 or self.in_flight < self.limit:
            return None
        rejection = self.queue.rejection(1)
        return None if rejection is None else _QueueFull(rejection, self.in_flight)

    async def _wait(self, request: RouteRequest, isl_tokens: int) -> None:
        refused = self.refusal()
        if refused is not None:
            raise refused
        loop = asyncio.get_running_loop()
        # True: the slot is ours; False: timed out. A result, not an exception: an exception raised from
        # the future would keep its traceback, and through it this request's frames, body included, for
        # as long as the queue holds the future.
        granted: asyncio.Future[bool] = loop.create_future()
        ticket = self.queue.push(
            granted,
            strict_priority=request.strict_priority,
            priority_jump=request.priority_jump,
            isl_tokens=isl_tokens,
            cached_tokens=0,
            now=time.monotonic(),
        )

        def time_out() -> None:
            if self.queue.cancel(ticket) and not granted.done():
                granted.set_result(False)

        # call_later, not asyncio.timeout: the proxy's request may run eagerly, outside any task.
        timer = loop.call_later(self._timeout, time_out)
        try:
            if not await granted:  # granted: the slot is counted for us by whoever granted it
                waited = QueueRejection(
                    policy_class=POLICY_CLASS, limit_kind="requests", current=self.in_flight, limit=self.limit
                )
                raise _TimedOut(waited, self._timeout)
        except BaseException:
            granted_meanwhile = granted.done() and not granted.cancelled() and granted.result()
            if not self.queue.cancel(ticket) and granted_meanwhile:
                self._release()  # granted as we were cancelled: hand it on
            raise
        finally:
            timer.cancel()

    def _release(self) -> None:
        while self.queue.head() is not None:
            granted = self.queue.pop_head()
            if not granted.done():
                granted.set_result(True)  # the slot passes to it: in_flight unchanged
                return
        self.in_flight -= 1


_NO_CAP: AbstractAsyncContextManager[None] = nullcontext()


class _QueueFull(QueueRejected):
    """Every slot held and ``proxy_max_waiting_requests`` waiting."""

    def __init__(self, rejection: QueueRejection, in_flight: int) -> None:
        super().__init__(rejection)
        self.args = (
            f"{in_flight} requests in flight (proxy_max_concurrent_requests) and {rejection.current} waiting for a "
            f"slot, the most that may (proxy_max_waiting_requests)",
        )


class _TimedOut(QueueRejected):
    """Waited ``proxy_queue_timeout_secs`` for a slot."""

    def __init__(self, rejection: QueueRejection, timeout: float) -> None:
        super().__init__(rejection)
        self.args = (
            f"no free slot within {timeout:g} s: {rejection.current} of {rejection.limit} concurrent requests "
            "in flight (proxy_max_concurrent_requests)",
        )

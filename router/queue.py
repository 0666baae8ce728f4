"""The pending queue: requests parked while every eligible rank is over the queue threshold (§4.7).

Ordered by ``(strict_priority, policy score)``, highest first, first-in first-out on ties, with the
score of Dynamo's `scheduling/policy.rs`:

    fcfs: max(priority_jump, 0) - arrival_offset_secs
    lcfs: max(priority_jump, 0) + arrival_offset_secs        (experiments only)
    wspt: (1 + max(priority_jump, 0)) / max(isl - cached_tokens, 1)

Limits scale with the number of registered workers and, as in Dynamo, compare only what is already
waiting: the request that crosses a limit is accepted, the next one is rejected.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Generic, TypeVar

from router.config import QueuePolicy
from router.types import LimitKind, QueueRejection, QueueStats

__all__ = ["POLICY_CLASS", "PendingQueue", "QueueTicket"]

T = TypeVar("T")

# Dynamo's name for the one policy class a config without `router_policy_config` has.
POLICY_CLASS = "default"
# Cancelled tickets the heap may hold beyond twice the waiting ones before it is compacted.
_CANCELLED_SLACK = 64


class QueueTicket(Generic[T]):
    """A place in the queue; `PendingQueue.cancel` gives it up."""

    __slots__ = ("isl_tokens", "item", "waiting")

    def __init__(self, item: T, isl_tokens: int) -> None:
        self.item = item
        self.isl_tokens = isl_tokens
        self.waiting = True


class PendingQueue(Generic[T]):
    """A priority queue of waiting items with Dynamo's ordering, counters and limits."""

    def __init__(
        self,
        policy: QueuePolicy,
        *,
        started_at: float,
        request_limit_per_worker: int | None = None,
        isl_token_limit_per_worker: int | None = None,
    ) -> None:
        self._policy = policy
        self._started_at = started_at
        self._request_limit = request_limit_per_worker
        self._isl_token_limit = isl_token_limit_per_worker
        self._heap: list[tuple[int, float, int, QueueTicket[T]]] = []
        self._sequence = itertools.count()
        self._pending_count = 0
        self._pending_isl_tokens = 0

    def __len__(self) -> int:
        return self._pending_count

    def stats(self) -> QueueStats:
        return QueueStats(pending_count=self._pending_count, pending_isl_tokens=self._pending_isl_tokens)

    def rejection(self, worker_count: int) -> QueueRejection | None:
        """Why one more request may not wait, or None if it may."""
        checks: tuple[tuple[LimitKind, int, int | None], ...] = (
            ("requests", self._pending_count, self._request_limit),
            ("raw_isl_tokens", self._pending_isl_tokens, self._isl_token_limit),
        )
        for kind, current, per_worker in checks:
            if per_worker is not None and current >= per_worker * worker_count:
                return QueueRejection(
                    policy_class=POLICY_CLASS,
                    limit_kind=kind,
                    current=current,
                    limit=per_worker * worker_count,
                )
        return None

    def push(
        self,
        item: T,
        *,
        strict_priority: int,
        priority_jump: float,
        isl_tokens: int,
        cached_tokens: int,
        now: float,
    ) -> QueueTicket[T]:
        """Park an item; ``cached_tokens`` is the best eligible rank's (it orders `wspt`). O(log n)."""
        jump = max(priority_jump, 0.0)
        if self._policy == "wspt":
            score = (1.0 + jump) / max(isl_tokens - cached_tokens, 1)
        else:
            offset = max(now - self._started_at, 0.0)
            score = jump - offset if self._policy == "fcfs" else jump + offset
        ticket = QueueTicket(item, isl_tokens)
        heapq.heappush(self._heap, (-strict_priority, -score, next(self._sequence), ticket))
        self._pending_count += 1
        self._pending_isl_tokens += isl_tokens
        return ticket

    def head(self) -> T | None:
        """The next item to dispatch, or None when nothing waits."""
        heap = self._heap
        # Cancelled tickets stay in the heap until they surface here.
        while heap and not heap[0][3].waiting:
            heapq.heappop(heap)
        return heap[0][3].item if heap else None

    def pop_head(self) -> T:
        """Remove and return the item `head` returned."""
        if self.head() is None:
            raise IndexError("pop from an empty queue")
        ticket = heapq.heappop(self._heap)[3]
        self._forget(ticket)
        return ticket.item

    def cancel(self, ticket: QueueTicket[T]) -> bool:
        """Give up a place; False if it was already dispatched or cancelled. O(1) amortised."""
        if not ticket.waiting:
            return False
        self._forget(ticket)
        heap = self._heap
        if len(heap) > 2 * self._pending_count + _CANCELLED_SLACK:
            # Cancelled tickets surface only when the queue moves; under a stuck head (every slot held by
            # long streams) timed-out waiters, and whatever their items hold, would pile up without bound.
            self._heap = [entry for entry in heap if entry[3].waiting]
            heapq.heapify(self._heap)
        return True

    def _forget(self, ticket: QueueTicket[T]) -> None:
        ticket.waiting = False
        self._pending_count -= 1
        self._pending_isl_tokens -= ticket.isl_tokens

    def take_all(self) -> list[T]:
        """Empty the queue, returning every waiting item in dispatch order (for shutdown)."""
        items = []
        while self.head() is not None:
            items.append(self.pop_head())
        return items

"""Prompts computed lately, credited as cached on their rank while the engine's events about them may
still be on their way.

An engine's KV events trail its answer: vLLM publishes a step's events from a thread after the step,
and a bridge and NATS carry them on, so a prompt sent again the moment its first answer came back would
find its blocks unindexed. `KvRouter.mark_prefill` adds a booked request's prompt here (its first token
is out: the prompt is computed and its blocks are in the engine's cache) by the sequence hashes its
booking carries, so every replica holding the booking credits it alike; each stays ``ttl_s`` seconds.
A decision's overlap on a rank is the larger of the index's and what is credited here. Blocks leaving
a rank's index (an eviction, a cleared cache, a restarted engine) end every credit of the rank.

Kept as bookings are (`router.booked_blocks`: per rank a refcount per sequence hash, a prompt's holdings a
prefix of it, and the ranks holding each first block), with the credits queued in expiry order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from indexer.slots import WorkerRank
from router.booked_blocks import BookedBlocksLike, new_booked_blocks

__all__ = ["ComputedPrompts"]


class ComputedPrompts:
    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._ranks: dict[WorkerRank, BookedBlocksLike] = {}
        self._first_holders: dict[int, set[WorkerRank]] = {}
        self._firsts: dict[WorkerRank, set[int]] = {}  # per rank, the first blocks it is credited with
        # (expiry, rank, hashes, the rank's blocks then: a rank forgotten and credited again is not released)
        self._expiring: deque[tuple[float, WorkerRank, Sequence[int], BookedBlocksLike]] = deque()

    def add(self, key: WorkerRank, hashes: Sequence[int]) -> None:
        """Credit the prompt with these sequence hashes on ``key`` for the next ``ttl_s`` seconds. O(n)."""
        if not hashes:
            return
        blocks = self._ranks.get(key)
        if blocks is None:
            blocks = self._ranks[key] = new_booked_blocks()
        if not blocks.book(hashes):
            self._first_holders.setdefault(hashes[0], set()).add(key)
            self._firsts.setdefault(key, set()).add(hashes[0])
        self._expiring.append((self._clock() + self._ttl_s, key, hashes, blocks))

    def depths(self, hashes: Sequence[int]) -> dict[WorkerRank, int]:
        """Per rank credited with any of it, the longest prefix of ``hashes`` credited there; what
        expired is released first (one clock read and one comparison while nothing is due)."""
        self._expire(self._clock())
        holders = self._first_holders.get(hashes[0]) if hashes else None
        if not holders:
            return {}
        ranks = self._ranks
        return {key: ranks[key].held(hashes) for key in holders}

    def forget(self, worker_id: int, dp_rank: int | None = None) -> None:
        """Drop every credit of the rank (None: of every rank of the worker): blocks left its index (an
        eviction, a cleared cache, a restarted engine), and a prompt credited there may have left with
        them. At worst a removal that lagged the prompt's own stores leaves it unindexed a moment longer."""
        keys = [key for key in self._ranks if key[0] == worker_id] if dp_rank is None else [(worker_id, dp_rank)]
        for key in keys:
            if self._ranks.pop(key, None) is None:
                continue
            for first in self._firsts.pop(key, ()):
                holders = self._first_holders[first]
                holders.discard(key)
                if not holders:
                    del self._first_holders[first]

    def credited_blocks(self) -> dict[WorkerRank, int]:
        """Distinct blocks credited now, per rank credited with any."""
        self._expire(self._clock())
        return {key: len(blocks) for key, blocks in self._ranks.items()}

    def _expire(self, now: float) -> None:
        expiring = self._expiring
        while expiring and expiring[0][0] <= now:
            _, key, hashes, blocks = expiring.popleft()
            if self._ranks.get(key) is not blocks:  # forgotten meanwhile (blocks left it, or its worker did)
                continue
            if not blocks.release(hashes):
                holders = self._first_holders[hashes[0]]
                holders.discard(key)
                if not holders:
                    del self._first_holders[hashes[0]]
                self._firsts[key].discard(hashes[0])
            if not len(blocks):
                del self._ranks[key]
                self._firsts.pop(key, None)

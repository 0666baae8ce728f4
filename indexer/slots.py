"""Small integer slots for (worker_id, dp_rank) pairs, so ownership sets can be int bitmasks."""

from __future__ import annotations

import heapq
from collections.abc import Iterator

__all__ = ["SlotTable", "WorkerRank", "iter_bits"]

WorkerRank = tuple[int, int]


def iter_bits(mask: int) -> Iterator[int]:
    """The indices of the set bits of ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class SlotTable:
    """Assigns each (worker_id, dp_rank) the lowest free slot, so bitmasks stay short after churn."""

    def __init__(self) -> None:
        self._slot_of: dict[WorkerRank, int] = {}
        self._by_worker: dict[int, set[int]] = {}
        self._free: list[int] = []
        # Indexed by slot; None for a free slot. Read directly on the query hot path.
        self.key_list: list[WorkerRank | None] = []

    def find(self, worker: WorkerRank) -> int | None:
        return self._slot_of.get(worker)

    def acquire(self, worker: WorkerRank) -> int:
        slot = self._slot_of.get(worker)
        if slot is not None:
            return slot
        if self._free:
            slot = heapq.heappop(self._free)
            self.key_list[slot] = worker
        else:
            slot = len(self.key_list)
            self.key_list.append(worker)
        self._slot_of[worker] = slot
        self._by_worker.setdefault(worker[0], set()).add(slot)
        return slot

    def release(self, slot: int) -> None:
        worker = self.key_list[slot]
        if worker is None:
            return
        self.key_list[slot] = None
        del self._slot_of[worker]
        ranks = self._by_worker[worker[0]]
        ranks.discard(slot)
        if not ranks:
            del self._by_worker[worker[0]]
        heapq.heappush(self._free, slot)

    def slots_of(self, worker_id: int) -> list[int]:
        return sorted(self._by_worker.get(worker_id, ()))

    def items(self) -> list[tuple[int, WorkerRank]]:
        return sorted((slot, worker) for worker, slot in self._slot_of.items())

    def keys(self) -> list[WorkerRank]:
        return sorted(self._slot_of)

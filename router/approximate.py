"""Approximate mode: the cache of workers that send no KV events, predicted from what is routed to them.

For a worker registered with ``kv_events: false`` (or every worker, with the router's ``kv_events``
off) each routed prompt's blocks are recorded on the chosen rank, in an index of their own, as
Dynamo's approximate indexer does (``use_kv_events=false``): keyed by the router's sequence hashes,
kept ``router_ttl_secs`` after the last prompt that used them, and at most the worker's
``total_kv_blocks`` per rank (the least recently routed go first, a chain's tail before its head).
The router's overlap is the larger of the real index's and this one's, rank by rank.

Predictions are replaced by the real thing: once events of a rank reach the sequencer, its predicted
blocks are dropped and no more are recorded for it. A prompt its worker never computed (the worker
failed the request before its first token) is withdrawn: the blocks it added go (`withdraw`). What a
booked prompt added is kept by its booking id until the prompt is computed or the booking ends
(`computed`), so at most one entry per booking in flight.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from indexer.errors import KvIndexError
from indexer.events import RouterEvent, removed_event, stored_event
from indexer.hashing import compute_sequence_hashes
from indexer.radix_tree import RadixTree
from indexer.sequencer import EventSequencer
from indexer.slots import WorkerRank
from router.types import WorkerConfig

__all__ = ["DEFAULT_PREDICTED_BLOCKS", "PredictedCache"]

log = logging.getLogger(__name__)

# A worker that did not say how many KV blocks it has keeps at most this many predicted per rank.
DEFAULT_PREDICTED_BLOCKS = 1 << 16
# Expired predictions of ranks nobody routes to are swept at most this often.
SWEEP_EVERY_S = 1.0


class _Recorded(NamedTuple):
    """What recording one prompt added to its rank's prediction: the blocks new there (sequence hashes,
    head first) and the expiry it gave them."""

    rank: WorkerRank
    added: Sequence[int]
    expiry: float


class PredictedCache:
    def __init__(
        self,
        ttl_s: float,
        sequencer: EventSequencer,
        worker: Callable[[int], WorkerConfig | None],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tree = RadixTree()
        self._ttl_s = ttl_s
        self._sequencer = sequencer
        self._worker = worker
        self._clock = clock
        self._ranks: dict[WorkerRank, OrderedDict[int, float]] = {}  # seq hash -> expiry, least recent first
        self._replaced: set[WorkerRank] = set()
        self._swept = clock()
        # What a booking's prompt added, by booking id, until it is computed or the booking ends.
        self._uncomputed: dict[str, _Recorded] = {}

    def _capacity(self, worker_id: int) -> int:
        """How many predicted blocks a rank of the worker keeps: its ``total_kv_blocks``, else the default."""
        worker = self._worker(worker_id)
        return DEFAULT_PREDICTED_BLOCKS if worker is None or worker.total_kv_blocks is None else worker.total_kv_blocks

    def record(
        self,
        rank: WorkerRank,
        local_hashes: list[int],
        sequence: Sequence[int] | None = None,
        booking_id: str | None = None,
    ) -> None:
        """The prompt with these local hashes (and these sequence hashes, when known: computed
        otherwise) was routed to ``rank`` (a worker without events; nothing once the rank's events
        replace its predictions). With ``booking_id``, what it added is kept until `computed` or
        `withdraw` names the booking."""
        if rank in self._replaced:
            return
        if self._sequencer.heard_from(*rank):
            log.info("worker %d dp_rank %d sends KV events now: its predicted blocks are dropped", *rank)
            self.forget(rank)
            self._replaced.add(rank)
            return
        capacity = self._capacity(rank[0])
        now = self._clock()
        held = self._ranks.get(rank)
        if held is None:
            held = self._ranks[rank] = OrderedDict()
        self._expire(rank, held, now)
        if sequence is None:
            sequence = compute_sequence_hashes(local_hashes)
        expiry = now + self._ttl_s
        added: Sequence[int]
        if held.keys().isdisjoint(sequence):  # a prompt new to the rank (the common case): one run, in C
            added = sequence  # the router's tuple (or the list computed here): kept, not copied
            if sequence:
                self._store(rank, None, zip(sequence, local_hashes, strict=True))
            for block_hash in reversed(sequence):  # the head most recent, as below; OrderedDict.update is 2-3x slower
                held[block_hash] = expiry
        else:
            added = [block_hash for block_hash in sequence if block_hash not in held]
            self._record_known(rank, held, local_hashes, sequence, expiry)
        if len(held) > capacity:  # the least recently routed go, in one removal
            popitem = held.popitem
            self._remove(rank, [popitem(last=False)[0] for _ in range(len(held) - capacity)])
        if now - self._swept >= SWEEP_EVERY_S:
            self.sweep(now)
        if booking_id is not None and added:
            self._uncomputed[booking_id] = _Recorded(rank, added, expiry)

    def computed(self, booking_id: str) -> None:
        """The booking's prompt was computed, or the booking ended: what it predicted stands."""
        self._uncomputed.pop(booking_id, None)

    def withdraw(self, booking_id: str) -> None:
        """The booking's prompt was never computed on its rank: the blocks its `record` added go, tail
        first, but those a prompt routed there since has refreshed (another expiry: that one may be)."""
        recorded = self._uncomputed.pop(booking_id, None)
        if recorded is None:
            return
        held = self._ranks.get(recorded.rank)
        if held is None:
            return
        gone = [block_hash for block_hash in reversed(recorded.added) if held.get(block_hash) == recorded.expiry]
        for block_hash in gone:
            del held[block_hash]
        self._remove(recorded.rank, gone)

    def _record_known(
        self, rank: WorkerRank, held: OrderedDict[int, float], local_hashes: list[int], sequence: Sequence[int],
        expiry: float,
    ) -> None:  # fmt: skip
        """A prompt some of whose blocks the rank holds: the runs of those it does not, each stored under
        the block before it; every block's expiry pushed back."""
        run: list[tuple[int, int]] = []
        parent: int | None = None
        previous: int | None = None
        for block_hash, local_hash in zip(sequence, local_hashes, strict=True):
            if block_hash in held:
                if run:
                    self._store(rank, parent, run)
                    run = []
            elif run:
                run.append((block_hash, local_hash))
            else:
                parent = previous
                run = [(block_hash, local_hash)]
            previous = block_hash
        if run:
            self._store(rank, parent, run)
        move_to_end = held.move_to_end
        for block_hash in reversed(sequence):  # the head most recent: a chain's tail is evicted first
            held[block_hash] = expiry
            move_to_end(block_hash)

    def sweep(self, now: float | None = None) -> None:
        """Drop every expired prediction."""
        now = self._clock() if now is None else now
        self._swept = now
        for rank, held in list(self._ranks.items()):
            self._expire(rank, held, now)

    def forget(self, rank: WorkerRank) -> None:
        self._ranks.pop(rank, None)
        self.tree.remove_worker_dp_rank(*rank)

    def forget_worker(self, worker_id: int) -> None:
        for rank in [rank for rank in self._ranks if rank[0] == worker_id]:
            del self._ranks[rank]
        self._replaced = {rank for rank in self._replaced if rank[0] != worker_id}
        self.tree.remove_worker(worker_id)

    def blocks(self) -> dict[WorkerRank, int]:
        return {rank: len(held) for rank, held in self._ranks.items() if held}

    def dump_events(self) -> list[RouterEvent]:
        return self.tree.dump_events()

    # ------------------------------------------------------------------ internals
    def _expire(self, rank: WorkerRank, held: OrderedDict[int, float], now: float) -> None:
        expired = []
        for block_hash, expiry in held.items():
            if expiry > now:
                break
            expired.append(block_hash)
        for block_hash in expired:
            del held[block_hash]
        self._remove(rank, expired)

    def _store(self, rank: WorkerRank, parent: int | None, run: Iterable[tuple[int, int]]) -> None:
        with contextlib.suppress(KvIndexError):  # a parent evicted meanwhile: the run is left out
            self.tree.apply_event(rank[0], stored_event(0, run, parent_hash=parent, dp_rank=rank[1]))

    def _remove(self, rank: WorkerRank, block_hashes: list[int]) -> None:
        """One removal event for all of them: the index removes each in turn and reports the missing
        ones after (an evicted chain's blocks may already be gone), as one event per block would."""
        if block_hashes:
            with contextlib.suppress(KvIndexError):
                self.tree.apply_event(rank[0], removed_event(0, block_hashes, dp_rank=rank[1]))

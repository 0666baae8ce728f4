"""What one worker holds, kept by its own publisher to answer a router's full-dump resync.

Nothing here is queried by prefix, so it is not a tree: per (dp_rank, storage tier) one dict
``block_hash -> (parent_hash, tokens_hash)``, exactly what the engine holds. A store is one C-level
dict update for the whole chain, a removal one pop per hash, a clear one dict; the chains are walked
only when a dump is asked for (rare, and bounded by what the worker holds).

A dump replayed into a router's `RadixTree` gives what the live events gave it, for engines whose
block hashes are content-addressed (a hash names one parent and one token block, as vLLM, SGLang
and TensorRT-LLM hash): device blocks are emitted along their chains from the root, one event per
linear run, and a block whose parent is no longer held is left out (it cannot score); lower-tier
blocks are emitted one edge each, as `LowerTierIndex` keeps them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import repeat

from indexer.errors import InvalidBlockSequence, ParentBlockNotFound
from indexer.events import (
    KvCacheEvent,
    KvCacheEventData,
    KvStoredData,
    RouterEvent,
    StorageTier,
    StoredBlock,
)
from indexer.events_native import ENABLED as NATIVE
from indexer.events_native import accel

__all__ = ["HeldBlocks"]

_Held = dict[int, tuple[int | None, int]]  # block_hash -> (parent_hash, tokens_hash)
# Why a store is refused (the codes `indexer._events_native.hold_chain` returns); _COPY: not refused,
# a block already held is in the chain (nothing recorded: `_store_copies` does it).
_PARENT_NOT_HELD, _HOLDS_PARENT, _REPEATS_HASH, _COPY = 1, 2, 3, 4


class HeldBlocks:
    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        self._held: dict[tuple[int, StorageTier], _Held] = {}
        # vLLM does not share physical blocks: one hash stored again (two requests computing one prefix
        # at once) is another copy, evicted by its own removal. Per (dp_rank, tier) the copies past the
        # first, by hash (Dynamo's dedup.rs refcount); a removal while copies remain is not the block's.
        self._copies: dict[tuple[int, StorageTier], dict[int, int]] = {}

    @property
    def has_copies(self) -> bool:
        """Whether some block is held in more than one copy (`bridge_batch`, which does not count them,
        is then not asked)."""
        return bool(self._copies)

    @property
    def tables(self) -> dict[tuple[int, StorageTier], _Held]:
        """The dicts by (dp_rank, tier), for `indexer._events_native.bridge_batch`, which stores and
        removes in them as `store` and `remove` do."""
        return self._held

    def store(
        self,
        dp_rank: int,
        tier: StorageTier,
        parent_hash: int | None,
        block_hashes: Sequence[int],
        tokens_hashes: Sequence[int],
    ) -> None:
        """Record a chain stored under ``parent_hash``; raises (and records nothing) for a device store
        under a parent this rank does not hold, or a chain that repeats a hash or holds its parent."""
        key = (dp_rank, tier)
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = {}
        if NATIVE and type(block_hashes) is list and type(tokens_hashes) is list:
            refused = accel.hold_chain(held, parent_hash, block_hashes, tokens_hashes, tier is StorageTier.DEVICE)
            if refused == _COPY:
                self._store_copies(key, held, parent_hash, block_hashes, tokens_hashes)
            elif refused:
                self._refuse(refused, dp_rank, parent_hash)
            return
        if parent_hash is not None:
            if tier is StorageTier.DEVICE and parent_hash not in held:
                self._refuse(_PARENT_NOT_HELD, dp_rank, parent_hash)
            if parent_hash in block_hashes:
                self._refuse(_HOLDS_PARENT, dp_rank, parent_hash)
        if len(tokens_hashes) != len(block_hashes):
            raise ValueError(f"{len(block_hashes)} block hashes but {len(tokens_hashes)} tokens hashes")
        if len(set(block_hashes)) != len(block_hashes):
            self._refuse(_REPEATS_HASH, dp_rank, parent_hash)
        if not held.keys().isdisjoint(block_hashes):
            self._store_copies(key, held, parent_hash, block_hashes, tokens_hashes)
        elif block_hashes:
            parents = [parent_hash, *block_hashes[:-1]]
            held.update(zip(block_hashes, zip(parents, tokens_hashes, strict=True), strict=True))

    def _store_copies(
        self,
        key: tuple[int, StorageTier],
        held: _Held,
        parent_hash: int | None,
        block_hashes: Sequence[int],
        tokens_hashes: Sequence[int],
    ) -> None:
        """A chain (checked) with blocks already held: each of those one more copy, the others held."""
        copies = self._copies.setdefault(key, {})
        parents = [parent_hash, *block_hashes[:-1]]
        for block_hash, parent, tokens_hash in zip(block_hashes, parents, tokens_hashes, strict=True):
            if block_hash in held:
                copies[block_hash] = copies.get(block_hash, 0) + 1
            else:
                held[block_hash] = (parent, tokens_hash)

    def _refuse(self, reason: int, dp_rank: int, parent_hash: int | None) -> None:
        if reason == _PARENT_NOT_HELD:
            raise ParentBlockNotFound(f"worker {self.worker_id} dp_rank {dp_rank}: parent block {parent_hash}")
        if reason == _HOLDS_PARENT:
            raise InvalidBlockSequence(f"worker {self.worker_id}: stored blocks contain their parent {parent_hash}")
        raise InvalidBlockSequence(f"worker {self.worker_id}: a store repeats a block hash")

    def remove(self, dp_rank: int, tier: StorageTier, block_hashes: list[int]) -> list[int]:
        """Forget the blocks, and return the hashes whose removal routers must hear: all of them but a
        copy's while another copy is held (hashes not held are returned too: routers report them as the
        engine sent them)."""
        copies = self._copies.get((dp_rank, tier))
        if copies:
            block_hashes = self._drop_copies(dp_rank, tier, copies, block_hashes)
        held = self._held.get((dp_rank, tier))
        if held:
            # The pops run from C (a Python loop over the hashes was the bridge's largest cost).
            if NATIVE:
                accel.drop_blocks(held, block_hashes)
            else:
                deque(map(held.pop, block_hashes, repeat(None, len(block_hashes))), maxlen=0)
        return block_hashes

    def _drop_copies(
        self, dp_rank: int, tier: StorageTier, copies: dict[int, int], block_hashes: list[int]
    ) -> list[int]:
        """One copy less of each hash that has copies left; the others, the removal to forward."""
        last = []
        for block_hash in block_hashes:
            count = copies.get(block_hash)
            if count is None:
                last.append(block_hash)
            elif count > 1:
                copies[block_hash] = count - 1
            else:
                del copies[block_hash]
        if not copies:
            del self._copies[dp_rank, tier]
        return last

    def clear(self, dp_rank: int, tier: StorageTier) -> None:
        self._held.pop((dp_rank, tier), None)
        self._copies.pop((dp_rank, tier), None)

    def holds(self, dp_rank: int, block_hash: int) -> bool:
        """Whether ``dp_rank`` holds a copy of the block, in any tier."""
        return any(rank == dp_rank and block_hash in held for (rank, _), held in self._held.items())

    def tiers(self, dp_rank: int) -> set[StorageTier]:
        """The tiers ``dp_rank`` stored blocks in since each was last cleared."""
        return {tier for rank, tier in self._held if rank == dp_rank}

    def block_count(self, dp_rank: int, tier: StorageTier = StorageTier.DEVICE) -> int:
        return len(self._held.get((dp_rank, tier), ()))

    def dump_events(self, dp_rank: int | None = None) -> list[RouterEvent]:
        """Stored events that rebuild what ``dp_rank`` (every rank: None) holds; ids number the list."""
        events: list[RouterEvent] = []
        keys = sorted(key for key in self._held if dp_rank is None or key[0] == dp_rank)
        for rank, tier in keys:
            held = self._held[rank, tier]
            chains = _device_chains(held) if tier is StorageTier.DEVICE else _edges(held)
            for parent_hash, blocks in chains:
                stored = KvStoredData(blocks=blocks, parent_hash=parent_hash)
                event = KvCacheEvent(event_id=len(events), data=KvCacheEventData(stored=stored), dp_rank=rank)
                events.append(RouterEvent(worker_id=self.worker_id, event=event, storage_tier=tier))
        return events


def _device_chains(held: _Held) -> list[tuple[int | None, list[StoredBlock]]]:
    """Every block reachable from the root, parents first, merged into linear runs."""
    children: dict[int | None, list[int]] = {}
    for block_hash, (parent_hash, _) in held.items():
        children.setdefault(parent_hash, []).append(block_hash)
    chains = []
    pending: list[tuple[int, int | None]] = [(child, None) for child in children.get(None, ())]
    while pending:
        block_hash, parent_hash = pending.pop()
        chain = []
        while True:
            chain.append(StoredBlock(block_hash, held[block_hash][1]))
            below = children.get(block_hash, ())
            if len(below) != 1:
                break
            block_hash = below[0]
        pending.extend((child, block_hash) for child in below)
        chains.append((parent_hash, chain))
    return chains


def _edges(held: _Held) -> list[tuple[int | None, list[StoredBlock]]]:
    return [(parent, [StoredBlock(block_hash, tokens_hash)]) for block_hash, (parent, tokens_hash) in held.items()]

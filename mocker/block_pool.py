"""A vLLM-like KV block pool with prefix caching, and the KV events it emits.

The pool has ``num_blocks`` slots. A *full* block is identified by its sequence hash (the hash of its
tokens and of every block before it), so equal prefixes share blocks; it is *active* while a running
sequence references it (reference counted) and *cached* (inactive) once no sequence does. Cached
blocks stay reusable until evicted, least recently released first. A sequence releases its blocks
tail first, so a prefix outlives its extensions: a parent is always released after (and so evicted
after) its children, and the cached set stays closed under prefixes. A *partial* block (the
unfinished tail of a sequence) takes a slot but holds no reusable content.

Every change the router must know is recorded as a `KvOp`: `Stored` when a full block enters the pool
(with the hash of the block before it, ``None`` at the root), `Removed` when cached blocks are
evicted, `Cleared` when the whole cache is dropped. Replaying the ops in order reproduces exactly the
pool's set of full blocks; that is what routers index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from indexer.events import KvCacheEvent, cleared_event, removed_event, stored_event

__all__ = ["BlockPool", "Cleared", "KvOp", "Removed", "Stored", "kv_cache_event"]


class Stored(NamedTuple):
    """Full blocks now in the pool, chained under ``parent_hash``: ``(block_hash, tokens_hash)`` pairs."""

    parent_hash: int | None
    blocks: list[tuple[int, int]]


class Removed(NamedTuple):
    block_hashes: list[int]


class Cleared(NamedTuple):
    pass


KvOp = Stored | Removed | Cleared


def kv_cache_event(op: KvOp, event_id: int) -> KvCacheEvent:
    """The KV event an engine publishes for ``op``."""
    if isinstance(op, Stored):
        return stored_event(event_id, op.blocks, parent_hash=op.parent_hash)
    if isinstance(op, Removed):
        return removed_event(event_id, op.block_hashes)
    return cleared_event(event_id)


class BlockPool:
    """Slots, reference counts and the LRU of cached blocks; appends its `KvOp`s to ``ops``."""

    __slots__ = ("_active", "_cached", "_partial", "num_blocks", "ops")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._active: dict[int, int] = {}  # block hash -> reference count (>= 1)
        self._cached: OrderedDict[int, None] = OrderedDict()  # inactive blocks, least recent first
        self._partial = 0
        self.ops: list[KvOp] = []

    # ------------------------------------------------------------------ reads
    @property
    def active_blocks(self) -> int:
        """Slots held by running sequences (full blocks and partial ones)."""
        return len(self._active) + self._partial

    @property
    def cached_blocks(self) -> int:
        """Full blocks no sequence references, kept for reuse until evicted."""
        return len(self._cached)

    @property
    def free_for_activation(self) -> int:
        """Blocks that can still become active: free slots plus evictable cached blocks."""
        return self.num_blocks - len(self._active) - self._partial

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._active or block_hash in self._cached

    def ref_count(self, block_hash: int) -> int:
        return self._active.get(block_hash, 0)

    def full_blocks(self) -> set[int]:
        """Every full block in the pool, active or cached."""
        return set(self._active) | set(self._cached)

    def cached_order(self) -> list[int]:
        """Cached blocks in eviction order (next victim first)."""
        return list(self._cached)

    def cached_prefix(self, hashes: Sequence[int], limit: int) -> tuple[int, int]:
        """How many leading ``hashes`` (at most ``limit``) are in the pool, and how many of those are active."""
        active = self._active
        cached = self._cached
        found = in_use = 0
        for block_hash in hashes:
            if found >= limit:
                break
            if block_hash in active:
                in_use += 1
            elif block_hash not in cached:
                break
            found += 1
        return found, in_use

    def slots_needed(self, hashes: Sequence[int], start: int, end: int, partial: bool) -> int:
        """Blocks that must become active to hold ``hashes[start:end]`` (plus a partial block)."""
        active = self._active
        return sum(1 for i in range(start, end) if hashes[i] not in active) + partial

    # ------------------------------------------------------------------ changes
    def acquire(
        self, hashes: Sequence[int], local_hashes: Sequence[int], start: int, end: int, *, partial: bool = False
    ) -> bool:
        """Reference full blocks ``start..end`` of a sequence (and a partial block after them).

        All or nothing: returns False, changing nothing, when the pool cannot hold them without
        evicting active blocks (the caller preempts someone and retries). New blocks are stored in
        runs under the block before them; cached blocks are evicted, least recent first, as slots run
        out.
        """
        if self.slots_needed(hashes, start, end, partial) > self.free_for_activation:
            return False
        active = self._active
        cached = self._cached
        run: list[tuple[int, int]] = []
        run_parent: int | None = None
        evicted: list[int] = []
        for i in range(start, end):
            block_hash = hashes[i]
            count = active.get(block_hash)
            if count is not None:
                active[block_hash] = count + 1
            elif block_hash in cached:
                del cached[block_hash]
                active[block_hash] = 1
            else:
                if self._full():
                    evicted.append(cached.popitem(last=False)[0])
                active[block_hash] = 1
                if not run:
                    run_parent = hashes[i - 1] if i else None
                run.append((block_hash, local_hashes[i]))
                continue
            # An already-present block ends the run of new ones before it.
            if run:
                self._flush(evicted, run_parent, run)
                run = []
        if partial:
            if self._full():
                evicted.append(cached.popitem(last=False)[0])
            self._partial += 1
        self._flush(evicted, run_parent, run)
        return True

    def acquire_partial(self) -> bool:
        """Take a slot for a new partial block; False when none can be freed without preemption."""
        if self.free_for_activation < 1:
            return False
        if self._full():
            self.ops.append(Removed([self._cached.popitem(last=False)[0]]))
        self._partial += 1
        return True

    def promote(self, block_hash: int, local_hash: int, parent_hash: int | None) -> None:
        """A sequence's partial block filled up: it becomes the full block ``block_hash``."""
        self._partial -= 1
        count = self._active.get(block_hash)
        if count is not None:
            self._active[block_hash] = count + 1
        elif block_hash in self._cached:
            del self._cached[block_hash]
            self._active[block_hash] = 1
        else:
            self._active[block_hash] = 1  # reuses the partial block's slot
            self.ops.append(Stored(parent_hash, [(block_hash, local_hash)]))

    def release(self, hashes: Sequence[int], count: int, *, partial: bool) -> None:
        """Drop a sequence's references: its partial block, then its first ``count`` full blocks from
        the last to the first, so its tail is evicted before its prefix."""
        if partial:
            self._partial -= 1
        active = self._active
        cached = self._cached
        for i in range(count - 1, -1, -1):
            block_hash = hashes[i]
            remaining = active[block_hash] - 1
            if remaining:
                active[block_hash] = remaining
            else:
                del active[block_hash]
                cached[block_hash] = None

    def clear_cached(self) -> bool:
        """Drop every cached block (vLLM's prefix-cache reset); refused while any block is active."""
        if self._active or self._partial:
            return False
        self._cached.clear()
        self.ops.append(Cleared())
        return True

    def _full(self) -> bool:
        return len(self._active) + len(self._cached) + self._partial >= self.num_blocks

    def _flush(self, evicted: list[int], parent: int | None, run: list[tuple[int, int]]) -> None:
        # Evictions are reported before the stores that needed their slots, as they happened.
        if evicted:
            self.ops.append(Removed(list(evicted)))
            evicted.clear()
        if run:
            self.ops.append(Stored(parent, run))

"""Index of one lower storage tier (host-pinned memory, disk or external storage).

As in Dynamo 1.6.x, a lower tier is not a tree of its own: it records *continuation edges*
``(parent block hash or None, tokens_hash) -> child block hash`` with their owners. A query first
matches the device tree; each worker then continues from the engine hash of its last device block
and counts how many further query blocks this tier holds for it. The first writer of an edge wins;
a store that meets an edge with a different child hash stops there.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence

from indexer.errors import BlockNotFound
from indexer.events import KvCacheEvent, KvCacheEventData, KvStoredData, StoredBlock
from indexer.slots import SlotTable, WorkerRank, iter_bits

__all__ = ["LowerTierIndex"]

EdgeKey = tuple[int | None, int]
# Per slot: where its match ended so far (query position, engine hash of the last matched block).
Cursors = dict[int, tuple[int, int | None]]


class _Edge:
    __slots__ = ("child_hash", "owners")

    def __init__(self, child_hash: int, owners: int) -> None:
        self.child_hash = child_hash
        self.owners = owners


_EDGE_BYTES = sys.getsizeof(_Edge(0, 0)) + sys.getsizeof((None, 1 << 63)) + 2 * sys.getsizeof(1 << 63) + 2 * 48


class LowerTierIndex:
    def __init__(self, slots: SlotTable) -> None:
        self._slots = slots
        self.edges: dict[EdgeKey, _Edge] = {}
        self._by_slot: dict[int, dict[int, EdgeKey]] = {}  # slot -> child hash -> edge key

    @property
    def edge_count(self) -> int:
        return len(self.edges)

    def estimated_bytes(self) -> int:
        return len(self.edges) * _EDGE_BYTES

    def apply_event(self, worker_id: int, event: KvCacheEvent) -> None:
        worker = (worker_id, event.dp_rank)
        stored, removed = event.stored, event.removed
        if event.is_cleared:
            slot = self._slots.find(worker)
            if slot is not None:
                self.clear_slot(slot)
        elif stored is not None:
            self._store(self._slots.acquire(worker), stored)
        elif removed is not None:
            slot = self._slots.find(worker)
            owned = self._by_slot.get(slot, {}) if slot is not None else {}
            missing = []
            for block_hash in removed.block_hashes:
                key = owned.pop(block_hash, None)
                if key is None or slot is None:
                    missing.append(block_hash)
                else:
                    self._disown(key, slot)
            if missing:
                raise BlockNotFound(worker, missing)

    def _store(self, slot: int, stored: KvStoredData) -> None:
        bit = 1 << slot
        owned = self._by_slot.setdefault(slot, {})
        parent = stored.parent_hash
        for block in stored.blocks:
            key = (parent, block.tokens_hash)
            edge = self.edges.get(key)
            if edge is None:
                self.edges[key] = _Edge(block.block_hash, bit)
            elif edge.child_hash != block.block_hash:
                return
            else:
                edge.owners |= bit
            previous = owned.get(block.block_hash)
            if previous is not None and previous != key:
                # The block is stored again under another parent: it left the old edge, which
                # nothing could remove later (the slot's bit would outlive the slot).
                self._disown(previous, slot)
            owned[block.block_hash] = key
            parent = block.block_hash

    def _disown(self, key: EdgeKey, slot: int) -> None:
        edge = self.edges[key]
        edge.owners &= ~(1 << slot)
        if not edge.owners:
            del self.edges[key]

    def clear_slot(self, slot: int) -> None:
        for key in self._by_slot.pop(slot, {}).values():
            if key in self.edges and self.edges[key].owners >> slot & 1:
                self._disown(key, slot)

    def clear_worker(self, worker_id: int) -> None:
        for slot in self._slots.slots_of(worker_id):
            self.clear_slot(slot)

    def extend(self, local_hashes: Sequence[int], cursors: Cursors) -> dict[WorkerRank, int]:
        """Blocks this tier adds beyond each worker's cursor; advances the cursors it extends.

        Workers without a cursor that hold the query's first block on this tier start at the root.
        """
        if not self.edges:
            return {}
        root_edge = self.edges.get((None, local_hashes[0]))
        if root_edge is not None:
            for slot in iter_bits(root_edge.owners):
                cursors.setdefault(slot, (0, None))
        hits: dict[WorkerRank, int] = {}
        edges = self.edges
        keys = self._slots.key_list
        end = len(local_hashes)
        for slot, (start, last) in cursors.items():
            bit = 1 << slot
            position = start
            while position < end:
                edge = edges.get((last, local_hashes[position]))
                if edge is None or not edge.owners & bit:
                    break
                last = edge.child_hash
                position += 1
            if position > start:
                hits[keys[slot]] = position - start  # type: ignore[index]
                cursors[slot] = (position, last)
        return hits

    def dump(self, first_event_id: int) -> Iterator[tuple[int, KvCacheEvent]]:
        """One single-block stored event per (edge, owner)."""
        event_id = first_event_id
        keys = self._slots.key_list
        for (parent, local_hash), edge in self.edges.items():
            for slot in iter_bits(edge.owners):
                worker = keys[slot]
                assert worker is not None
                stored = KvStoredData(blocks=[StoredBlock(edge.child_hash, local_hash)], parent_hash=parent)
                yield worker[0], KvCacheEvent(event_id, KvCacheEventData(stored=stored), dp_rank=worker[1])
                event_id += 1

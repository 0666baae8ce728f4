"""The KV-cache index: which (worker, dp_rank) holds which prompt prefix.

A prefix tree over local block hashes (``tokens_hash``), one node per block, with per-block ownership:
a node records, as a bitmask, every (worker, dp_rank) that currently holds that block. A worker's
score for a query is the number of leading query blocks it holds along one root-anchored path, which
is what NVIDIA Dynamo 1.6.1's compressed tree answers for every stream engines produce (leaf-first
eviction; see shared/reference/oracle.md §2.4).

Events reach nodes through each (worker, dp_rank)'s own map ``block_hash -> node``: a store's
``parent_hash`` and a removal's hashes are resolved only in the sender's map, so a worker that uses a
different engine hash for a shared node can still extend and remove it by its own hash.

Memory matters at millions of blocks, so a node keeps a single child inline and only grows a dict
when it branches, and ownership is an int bitmask over small slot numbers.

With the C accelerator (`indexer.native`) nodes are its `Node` (the hashes, and the owners while they
fit, held as machine words, not int objects), each rank's map is its `BlockMap` (u64 keys as machine
words) and the store and match walks run in C for trees of up to 64 slots; the Python walks below are
the fallback and give the same answers (tests/test_native.py).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import msgspec

from indexer.errors import BlockNotFound, InvalidBlockSequence, KvIndexError, ParentBlockNotFound
from indexer.events import (
    LOWER_TIERS,
    KvCacheEvent,
    KvCacheEventData,
    KvStoredData,
    RouterEvent,
    StorageTier,
    StoredBlock,
)
from indexer.lower_tier import LowerTierIndex
from indexer.native import ENABLED as NATIVE
from indexer.native import accel, declined
from indexer.slots import SlotTable, WorkerRank

__all__ = [
    "BlockNotFound",
    "IndexStats",
    "InvalidBlockSequence",
    "KvIndexError",
    "OverlapScores",
    "ParentBlockNotFound",
    "RadixTree",
]


@dataclass(slots=True)
class OverlapScores:
    """Device-tier matched blocks per (worker_id, dp_rank), zeros omitted, and per lower tier the
    consecutive blocks found beyond the device match (extension blocks), zeros omitted."""

    scores: dict[WorkerRank, int] = field(default_factory=dict)
    tier_hits: dict[StorageTier, dict[WorkerRank, int]] = field(default_factory=dict)


@dataclass(slots=True)
class IndexStats:
    blocks: dict[WorkerRank, int]
    nodes: int
    lower_tier_blocks: dict[StorageTier, int]
    estimated_bytes: int


class _Node(msgspec.Struct, gc=False, eq=False, repr_omit_defaults=True):
    """One block under its parent. Untracked by the cyclic GC: millions of nodes would otherwise
    make every full collection a pause of many milliseconds on the routing loop. The parent/child
    links do form cycles, so a dropped tree is dismantled explicitly (see `_dismantle`)."""

    block_hash: int
    local_hash: int
    parent: _Node | None
    owners: int
    # None (leaf), the only child itself, or a dict local_hash -> child once the node branches.
    children: _Node | dict[int, _Node] | None = None

    def __repr__(self) -> str:  # the default would recurse through parent and children
        return f"_Node(block_hash={self.block_hash}, local_hash={self.local_hash}, owners={self.owners:#x})"


# The C walks keep owner masks in a machine word.
_NATIVE_MAX_SLOTS = 64
_NodeFactory = Callable[[int, int, "_Node | None", int], "_Node"]


def _dismantle(root: _Node) -> None:
    """Break every parent/child link below ``root`` so reference counting frees the nodes."""
    pending = [root]
    while pending:
        node = pending.pop()
        kids = node.children
        node.children = None
        node.parent = None
        if isinstance(kids, dict):
            pending.extend(kids.values())
        elif kids is not None:
            pending.append(kids)


def _child(node: _Node, local_hash: int) -> _Node | None:
    kids = node.children
    if kids is None:
        return None
    if isinstance(kids, dict):
        return kids.get(local_hash)
    return kids if kids.local_hash == local_hash else None


def _children(node: _Node) -> Iterator[_Node]:
    kids = node.children
    if kids is None:
        return iter(())
    if isinstance(kids, dict):
        return iter(kids.values())
    return iter((kids,))


def _children_last_first(node: _Node) -> Iterator[_Node]:
    kids = node.children
    if kids is None:
        return iter(())
    if isinstance(kids, dict):
        return reversed(kids.values())
    return iter((kids,))


def _remove_child(node: _Node, child: _Node) -> None:
    kids = node.children
    if kids is child:
        node.children = None
    elif isinstance(kids, dict):
        del kids[child.local_hash]
        if len(kids) == 1:
            node.children = next(iter(kids.values()))


class _Lookup(Protocol):
    """A rank's ``block_hash -> node`` map: a dict in the Python tree, the C ``BlockMap`` (u64 keys as
    machine words) in the native one."""

    def get(self, key: int, /) -> _Node | None: ...
    def setdefault(self, key: int, value: _Node, /) -> _Node: ...
    def pop(self, key: int, default: None, /) -> _Node | None: ...
    def values(self) -> Iterable[_Node]: ...
    def __setitem__(self, key: int, value: _Node, /) -> None: ...
    def __len__(self) -> int: ...


class _SlotBlocks:
    """One (worker, dp_rank)'s device-tier state."""

    __slots__ = ("aliases", "lookup", "owned", "slot")

    def __init__(self, slot: int, lookup: _Lookup) -> None:
        self.slot = slot
        self.lookup = lookup
        # Nodes this worker knows under a different block hash than the node's own (first writer's).
        self.aliases: dict[_Node, int] = {}
        self.owned = 0


# Rough per-object costs on 64-bit CPython, for `stats().estimated_bytes`; the C node holds its
# hashes as machine words, the Python node as two int objects.
_PY_NODE_BYTES = sys.getsizeof(_Node(0, 0, None, 0)) + 2 * sys.getsizeof(1 << 63)
_LOOKUP_ENTRY_BYTES = 48
# A BlockMap entry is 16 bytes, in a table kept between three eighths and three quarters full.
_NATIVE_LOOKUP_ENTRY_BYTES = 28
_BRANCH_DICT_BYTES = sys.getsizeof({1: 1, 2: 2})


class RadixTree:
    """Per-block radix tree over local block hashes with per-(worker, dp_rank) ownership.

    ``native`` picks the C accelerator's nodes and walks (the default when it is built and not
    disabled, see `indexer.native`) or the pure-Python ones; both give the same answers.
    """

    def __init__(self, *, native: bool = NATIVE) -> None:
        if native and accel is None:
            raise ValueError("the C accelerator indexer._native is not built")
        self._native = native
        self._new_node: _NodeFactory = cast(_NodeFactory, accel.Node) if native else _Node
        self._node_bytes = sys.getsizeof(accel.Node(0, 0, None, 0)) if native else _PY_NODE_BYTES
        self._new_lookup = cast(Callable[[], _Lookup], accel.BlockMap if native else dict)
        self._lookup_entry_bytes = _NATIVE_LOOKUP_ENTRY_BYTES if native else _LOOKUP_ENTRY_BYTES
        self._root = self._new_node(0, 0, None, 0)
        weakref.finalize(self, _dismantle, self._root)
        self._slots = SlotTable()
        self._states: dict[WorkerRank, _SlotBlocks] = {}
        self._lower = {tier: LowerTierIndex(self._slots) for tier in LOWER_TIERS}
        # The tiers' edge maps themselves (never replaced), so "any lower-tier data?" is one C call.
        self._lower_edges = tuple(lower.edges for lower in self._lower.values())
        self._nodes = 0
        self._branch_nodes = 0
        # Changes begun so far (events, clears, removals): a dump read in slices between other work
        # (`iter_dump_events`) is consistent only while this stays the same.
        self.changes = 0

    # ------------------------------------------------------------------ events
    def apply_router_event(self, router_event: RouterEvent) -> None:
        self.apply_event(router_event.worker_id, router_event.event, router_event.storage_tier)

    def apply_event(self, worker_id: int, event: KvCacheEvent, storage_tier: StorageTier = StorageTier.DEVICE) -> None:
        """Apply one event of ``worker_id``; raises a ``KvIndexError`` for a (partly) rejected one."""
        self.changes += 1
        if storage_tier is not StorageTier.DEVICE:
            self._lower[storage_tier].apply_event(worker_id, event)
            return
        worker = (worker_id, event.dp_rank)
        data = event.data
        state = self._states.get(worker)
        if isinstance(data, str):
            if state is not None:
                self._clear(state)
            return
        if data.stored is not msgspec.UNSET:
            if state is None:
                state = self._states[worker] = _SlotBlocks(self._slots.acquire(worker), self._new_lookup())
            self._store(worker, state, data.stored)
        elif data.removed is not msgspec.UNSET:
            hashes = data.removed.block_hashes
            missing = list(hashes) if state is None else self._remove(state, hashes)
            if missing:
                raise BlockNotFound(worker, missing)

    def _store(self, worker: WorkerRank, state: _SlotBlocks, stored: KvStoredData) -> None:
        bit = 1 << state.slot
        lookup = state.lookup
        parent_hash = stored.parent_hash
        blocks = stored.blocks
        if self._native and state.slot < _NATIVE_MAX_SLOTS:
            counts = accel.store_chain(self._root, parent_hash, blocks, bit, lookup, state.aliases, self._disown, state)
            if counts is not None:
                created, newly_owned, branched = counts
                self._branch_nodes += branched
                self._nodes += created
                state.owned += created + newly_owned
                return
            # Refused with nothing changed (parent not held, or named by a block): the checks below
            # raise the error.
            declined("indexer._native", "store_refused")
        elif self._native:
            declined("indexer._native", "slots_past_64")
        if parent_hash is None:
            node = self._root
        else:
            found = lookup.get(parent_hash)
            if found is None or not found.owners & bit:
                raise ParentBlockNotFound(f"worker {worker[0]} dp_rank {worker[1]}: parent block {parent_hash}")
            for block in blocks:
                if block.block_hash == parent_hash:
                    raise InvalidBlockSequence(f"worker {worker[0]}: stored blocks contain their parent {parent_hash}")
            node = found
        # The hot loop of event ingestion: child lookup and insertion are inlined on purpose.
        created = newly_owned = 0
        new_node = self._new_node
        child: _Node | None
        for block in blocks:
            block_hash = block.block_hash
            local_hash = block.tokens_hash
            kids = node.children
            if kids is None:
                child = None
            elif isinstance(kids, dict):
                child = kids.get(local_hash)
            else:
                child = kids if kids.local_hash == local_hash else None
            if child is None:
                child = new_node(block_hash, local_hash, node, bit)
                if kids is None:
                    node.children = child
                elif isinstance(kids, dict):
                    kids[local_hash] = child
                else:
                    node.children = {kids.local_hash: kids, local_hash: child}
                    self._branch_nodes += 1
                created += 1
            else:
                if not child.owners & bit:
                    child.owners |= bit
                    newly_owned += 1
                if child.block_hash != block_hash:
                    state.aliases[child] = block_hash
            previous = lookup.setdefault(block_hash, child)
            if previous is not child:
                if previous.owners & bit:
                    # The worker reuses a hash for another position: it no longer holds the old one.
                    self._disown(state, previous)
                lookup[block_hash] = child
            node = child
        self._nodes += created
        state.owned += created + newly_owned

    def _remove(self, state: _SlotBlocks, hashes: Sequence[int]) -> list[int]:
        bit = 1 << state.slot
        lookup = state.lookup
        if self._native and state.slot < _NATIVE_MAX_SLOTS:
            missing, disowned, pruned, unbranched = accel.remove_blocks(self._root, lookup, state.aliases, hashes, bit)
            state.owned -= disowned
            self._nodes -= pruned
            self._branch_nodes -= unbranched
            return missing
        if self._native:
            declined("indexer._native", "slots_past_64")
        missing = []
        for block_hash in hashes:
            node = lookup.pop(block_hash, None)
            if node is None or not node.owners & bit:
                missing.append(block_hash)
            else:
                self._disown(state, node)
        return missing

    def _disown(self, state: _SlotBlocks, node: _Node) -> None:
        node.owners &= ~(1 << state.slot)
        state.owned -= 1
        if state.aliases:
            state.aliases.pop(node, None)
        self._prune(node)

    def _prune(self, node: _Node) -> None:
        """Detach ``node`` and its ancestors while they are ownerless leaves."""
        root = self._root
        while node is not root and not node.owners and node.children is None:
            parent = node.parent
            assert parent is not None
            if isinstance(parent.children, dict) and len(parent.children) == 2:
                self._branch_nodes -= 1
            _remove_child(parent, node)
            node.parent = None
            self._nodes -= 1
            node = parent

    def _clear(self, state: _SlotBlocks) -> None:
        slot = state.slot
        for node in list(state.lookup.values()):
            if node.owners >> slot & 1:
                self._disown(state, node)
        state.lookup = self._new_lookup()
        state.aliases = {}

    # ------------------------------------------------------------------ workers
    def clear_all_blocks(self, worker_id: int) -> None:
        """Forget every block of every dp rank of ``worker_id`` (all tiers); the worker stays known."""
        self.changes += 1
        for slot in self._slots.slots_of(worker_id):
            state = self._states.get(self._slot_key(slot))
            if state is not None:
                self._clear(state)
        for lower in self._lower.values():
            lower.clear_worker(worker_id)

    def remove_worker(self, worker_id: int) -> None:
        """Forget ``worker_id`` entirely, returning its memory."""
        self.changes += 1
        for slot in self._slots.slots_of(worker_id):
            self._drop_slot(slot)

    def remove_worker_dp_rank(self, worker_id: int, dp_rank: int) -> None:
        self.changes += 1
        slot = self._slots.find((worker_id, dp_rank))
        if slot is not None:
            self._drop_slot(slot)

    def _drop_slot(self, slot: int) -> None:
        state = self._states.pop(self._slot_key(slot), None)
        if state is not None:
            self._clear(state)
        for lower in self._lower.values():
            lower.clear_slot(slot)
        self._slots.release(slot)

    def _slot_key(self, slot: int) -> WorkerRank:
        worker = self._slots.key_list[slot]
        assert worker is not None
        return worker

    def workers(self) -> list[WorkerRank]:
        """Every (worker_id, dp_rank) the index has seen and not removed."""
        return self._slots.keys()

    # ------------------------------------------------------------------ queries
    def find_matches(self, local_hashes: Sequence[int]) -> OverlapScores:
        """Per (worker, dp_rank), how many leading blocks of ``local_hashes`` it holds."""
        result = OverlapScores()
        if not local_hashes:
            return result
        scores = result.scores
        keys = self._slots.key_list
        if self._native and len(keys) <= _NATIVE_MAX_SLOTS:
            matched: list[_Node] | None = [] if self._has_lower_tiers() else None
            accel.match_prefix(self._root, local_hashes, keys, scores, matched)
            return result if matched is None else self._lower_tier_matches(result, local_hashes, matched)
        if self._native:
            declined("indexer._native", "slots_past_64")
        node = _child(self._root, local_hashes[0])
        if node is None or not node.owners:
            return self._lower_tier_matches(result, local_hashes, []) if self._has_lower_tiers() else result
        active = node.owners
        depth = 1
        path = [node] if self._has_lower_tiers() else None
        child: _Node | None
        for local_hash in local_hashes[1:]:
            kids = node.children
            if kids is None:
                break
            if isinstance(kids, dict):
                child = kids.get(local_hash)
                if child is None:
                    break
            elif kids.local_hash == local_hash:
                child = kids
            else:
                break
            owners = child.owners
            if owners != active:
                remaining = active & owners
                if remaining != active:
                    dropped = active ^ remaining
                    while dropped:  # iter_bits, inlined: this is the query hot loop
                        low = dropped & -dropped
                        scores[keys[low.bit_length() - 1]] = depth  # type: ignore[index]
                        dropped ^= low
                    if not remaining:
                        active = 0
                        break
                    active = remaining
            node = child
            depth += 1
            if path is not None:
                path.append(node)
        while active:
            low = active & -active
            scores[keys[low.bit_length() - 1]] = depth  # type: ignore[index]
            active ^= low
        return result if path is None else self._lower_tier_matches(result, local_hashes, path)

    def _has_lower_tiers(self) -> bool:
        return any(self._lower_edges)

    def _lower_tier_matches(
        self, result: OverlapScores, local_hashes: Sequence[int], path: list[_Node]
    ) -> OverlapScores:
        """Extend ``result`` with each lower tier's blocks; ``path`` holds the device nodes matched."""
        # Each worker continues from the end of its device match with its own hash for that block.
        cursors: dict[int, tuple[int, int | None]] = {}
        for worker, depth in result.scores.items():
            last = path[depth - 1]
            state = self._states[worker]
            cursors[state.slot] = (depth, state.aliases.get(last, last.block_hash))
        for tier in LOWER_TIERS:
            hits = self._lower[tier].extend(local_hashes, cursors)
            if hits:
                result.tier_hits[tier] = hits
        return result

    # ------------------------------------------------------------------ dumps and stats
    def dump_events(self) -> list[RouterEvent]:
        """The whole index as stored events; replaying them into an empty tree gives the same answers.

        Device chains are merged into one multi-block event per linear run a worker holds; blocks a
        worker holds below a block it does not hold cannot score and are left out.
        """
        return list(self.iter_dump_events())

    def iter_dump_events(self, max_event_blocks: int | None = None) -> Iterator[RouterEvent]:
        """`dump_events` one event at a time, each of at most ``max_event_blocks`` blocks (a longer
        run is cut into chained events), so a caller can bound the work between two events. The tree
        must not change while the iterator is in use (`changes` tells)."""
        event_id = 0
        for _, (worker_id, dp_rank) in self._slots.items():
            state = self._states.get((worker_id, dp_rank))
            if state is not None and state.owned:
                for parent_hash, blocks in self._owned_chains(state, max_event_blocks):
                    event = KvCacheEvent(event_id=event_id, data=_stored_data(blocks, parent_hash), dp_rank=dp_rank)
                    yield RouterEvent(worker_id=worker_id, event=event)
                    event_id += 1
        for tier, lower in self._lower.items():
            for worker_id, lower_event in lower.dump(first_event_id=event_id):
                yield RouterEvent(worker_id=worker_id, event=lower_event, storage_tier=tier)
                event_id += 1

    def _owned_chains(
        self, state: _SlotBlocks, max_blocks: int | None
    ) -> Iterator[tuple[int | None, list[StoredBlock]]]:
        bit = 1 << state.slot
        aliases = state.aliases
        # The root's children are taken one at a time (last first, as a stack of them all would be):
        # a list of them all at once is one step of the whole root's width (~16k children per 1M blocks).
        tops = _children_last_first(self._root)
        pending: list[tuple[_Node, int | None]] = []
        while True:
            if not pending:
                top = next((child for child in tops if child.owners & bit), None)
                if top is None:
                    return
                pending.append((top, None))
            node, parent_hash = pending.pop()
            chain = []
            while True:
                chain.append(StoredBlock(aliases.get(node, node.block_hash), node.local_hash))
                owned = [child for child in _children(node) if child.owners & bit]
                if len(owned) != 1:
                    break
                node = owned[0]
                if len(chain) == max_blocks:
                    yield parent_hash, chain
                    parent_hash, chain = chain[-1].block_hash, []
            last_hash = chain[-1].block_hash
            pending.extend((child, last_hash) for child in owned)
            yield parent_hash, chain

    def blocks_per_rank(self) -> dict[WorkerRank, int]:
        """The blocks each (worker, dp_rank) holds: `stats().blocks` without the rest of the stats, cheap
        enough to read on every query. O(ranks)."""
        return {worker: state.owned for worker, state in self._states.items()}

    def stats(self) -> IndexStats:
        blocks = {}
        lookup_entries = 0
        for _, worker in self._slots.items():
            state = self._states.get(worker)
            if state is not None:
                blocks[worker] = state.owned
                lookup_entries += len(state.lookup)
        lower_blocks = {tier: lower.edge_count for tier, lower in self._lower.items() if lower.edge_count}
        estimated = (
            self._nodes * self._node_bytes
            + lookup_entries * self._lookup_entry_bytes
            + self._branch_nodes * _BRANCH_DICT_BYTES
            + sum(lower.estimated_bytes() for lower in self._lower.values())
        )
        return IndexStats(blocks=blocks, nodes=self._nodes, lower_tier_blocks=lower_blocks, estimated_bytes=estimated)


def _stored_data(blocks: list[StoredBlock], parent_hash: int | None) -> KvCacheEventData:
    return KvCacheEventData(stored=KvStoredData(blocks=blocks, parent_hash=parent_hash))

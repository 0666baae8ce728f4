"""What a publisher answers a full-dump resync with (`HeldBlocks`) rebuilds what its live events built.

A property over random engine activity: stores along content-addressed chains (as vLLM, SGLang and
TensorRT-LLM hash blocks), on two ranks and two tiers, removals of leaves, of inner blocks and of
unknown hashes, clears and re-stores, while another worker shares the router's tree. After every few
steps the router resyncs the worker's rank from its dump, as the sequencer does (the rank's state
dropped, the dump applied), and must then hold exactly what the live events left it: the same
edges per (rank, tier) and the same scores for every prefix.
"""

from __future__ import annotations

import random
import struct

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer.errors import InvalidBlockSequence, KvIndexError, ParentBlockNotFound
from indexer.events import (
    RouterEvent,
    StorageTier,
    cleared_event,
    removed_event,
    stored_event,
)
from indexer.held_blocks import HeldBlocks
from indexer.radix_tree import RadixTree
from tests.engine_fakes import canonical

WORKER, OTHER = 5, 6
TIERS = (StorageTier.DEVICE, StorageTier.DEVICE, StorageTier.DEVICE, StorageTier.HOST_PINNED)


def engine_hash(parent: int | None, tokens_hash: int) -> int:
    """A content-addressed block hash: one parent and one token block name it."""
    return xxhash.xxh3_64_intdigest(struct.pack("<QQ", 0 if parent is None else parent, tokens_hash), seed=3)


class Engine:
    """One worker's engine: what it holds per (rank, tier), and the events it sends."""

    def __init__(self, worker_id: int, rng: random.Random) -> None:
        self.worker_id = worker_id
        self.rng = rng
        self.held: dict[tuple[int, StorageTier], dict[int, int | None]] = {}  # block -> parent
        # Copies past the first of a block stored again (vLLM shares no physical block): each has its removal.
        self.copies: dict[tuple[int, StorageTier], dict[int, int]] = {}
        self.event_id = 0

    def next_op(self) -> tuple[str, int, StorageTier, int | None, list[int], list[int]]:
        rng = self.rng
        rank, tier = rng.randrange(2), rng.choice(TIERS)
        held = self.held.setdefault((rank, tier), {})
        roll = rng.random()
        if roll < 0.55 or not held:
            parent = rng.choice([None, *held]) if held and rng.random() < 0.8 else None
            tokens = [rng.randrange(6) for _ in range(rng.randint(1, 4))]  # a small alphabet: shared prefixes
            hashes = []
            previous = parent
            for tokens_hash in tokens:
                previous = engine_hash(previous, tokens_hash)
                hashes.append(previous)
            return "stored", rank, tier, parent, hashes, tokens
        if roll < 0.93:
            gone = rng.sample(sorted(held), rng.randint(1, min(3, len(held))))
            if rng.random() < 0.2:
                gone.append(rng.getrandbits(64))  # a hash it never stored
            return "removed", rank, tier, None, gone, []
        return "cleared", rank, tier, None, [], []

    def applied(self, kind: str, rank: int, tier: StorageTier, parent: int | None, hashes: list[int]) -> None:
        held = self.held.setdefault((rank, tier), {})
        copies = self.copies.setdefault((rank, tier), {})
        if kind == "stored":
            if tier is StorageTier.DEVICE and parent is not None and parent not in held:
                return
            for block in hashes:
                if block in held:
                    copies[block] = copies.get(block, 0) + 1
                else:
                    held[block] = parent
                parent = block
        elif kind == "removed":
            for block in hashes:
                if copies.get(block):
                    copies[block] -= 1
                else:
                    held.pop(block, None)
        else:
            held.clear()
            copies.clear()

    def event(self, kind: str, rank: int, tier: StorageTier, parent: int | None, hashes: list[int],
              tokens: list[int]) -> RouterEvent:  # fmt: skip
        self.event_id += 1
        if kind == "stored":
            data = stored_event(self.event_id, zip(hashes, tokens, strict=True), parent_hash=parent, dp_rank=rank)
        elif kind == "removed":
            data = removed_event(self.event_id, hashes, dp_rank=rank)
        else:
            data = cleared_event(self.event_id, dp_rank=rank)
        return RouterEvent(self.worker_id, data, tier)


def _state_of(tree: RadixTree, worker_id: int) -> list[tuple[int, int, str, int | None, int, int]]:
    return [edge for edge in canonical(tree.dump_events()) if edge[0] == worker_id]


def _scores(tree: RadixTree, worker_id: int, paths: list[list[int]]) -> list[dict[tuple[int, int], int]]:
    return [
        {key: score for key, score in tree.find_matches(path).scores.items() if key[0] == worker_id} for path in paths
    ]


def _resynced(live: RadixTree, held: HeldBlocks) -> RadixTree:
    """The router's tree after a full resync of every rank of the worker from its dump."""
    tree = RadixTree()
    for event in live.dump_events():
        if event.worker_id != WORKER:
            tree.apply_router_event(event)
    for event in held.dump_events():
        tree.apply_router_event(event)
    return tree


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32))
def test_a_dump_rebuilds_what_the_live_events_built(seed: int) -> None:
    rng = random.Random(seed)
    live = RadixTree()
    held = HeldBlocks(WORKER)
    engines = {WORKER: Engine(WORKER, rng), OTHER: Engine(OTHER, rng)}
    paths: list[list[int]] = []
    for step in range(160):
        engine = engines[WORKER if rng.random() < 0.75 else OTHER]
        kind, rank, tier, parent, hashes, tokens = engine.next_op()
        if kind == "stored":
            paths.append(tokens)
        live_error = held_error = None
        forwarded = hashes
        if engine.worker_id == WORKER:
            try:
                if kind == "stored":
                    held.store(rank, tier, parent, hashes, tokens)
                elif kind == "removed":
                    forwarded = held.remove(rank, tier, hashes)  # what its publisher sends
                else:
                    held.clear(rank, tier)
            except KvIndexError as exc:
                held_error = type(exc)
        try:
            if forwarded or not hashes:
                live.apply_router_event(engine.event(kind, rank, tier, parent, forwarded, tokens))
        except KvIndexError as exc:
            live_error = type(exc)
        if engine.worker_id == WORKER:
            # A removal of unknown hashes is the router's to report; every store is refused alike.
            assert held_error == (None if kind == "removed" else live_error)
        engine.applied(kind, rank, tier, parent, hashes)
        if step % 20 == 19:
            rebuilt = _resynced(live, held)
            assert _state_of(rebuilt, WORKER) == _state_of(live, WORKER)
            assert _scores(rebuilt, WORKER, paths) == _scores(live, WORKER, paths)
    for (rank, tier), blocks in engines[WORKER].held.items():
        assert held.block_count(rank, tier) == len(blocks)  # exactly what the engine holds


def test_a_store_under_a_parent_not_held_or_repeating_a_hash_is_refused_and_nothing_is_held() -> None:
    held = HeldBlocks(WORKER)
    with pytest.raises(ParentBlockNotFound):
        held.store(0, StorageTier.DEVICE, 99, [1, 2], [10, 11])
    held.store(0, StorageTier.DEVICE, None, [1, 2], [10, 11])
    held.store(0, StorageTier.DEVICE, 2, [], [])  # an empty store holds nothing more, as in the tree
    with pytest.raises(InvalidBlockSequence):
        held.store(0, StorageTier.DEVICE, 1, [3, 1], [12, 13])
    with pytest.raises(InvalidBlockSequence):
        held.store(0, StorageTier.DEVICE, 2, [3, 3], [12, 13])
    held.store(0, StorageTier.HOST_PINNED, 99, [7], [70])  # lower tiers keep continuation edges as they come
    assert (held.block_count(0), held.block_count(0, StorageTier.HOST_PINNED)) == (2, 1)
    held.remove(0, StorageTier.DEVICE, [1])  # its child stays held but cannot score: left out of the dump
    dump = held.dump_events(0)
    assert [(e.storage_tier, e.event.stored.parent_hash) for e in dump if e.event.stored] == [
        (StorageTier.HOST_PINNED, 99)
    ]
    with pytest.raises(ParentBlockNotFound):
        held.store(0, StorageTier.DEVICE, 1, [4], [14])  # the removed parent is not held any more
    held.clear(0, StorageTier.DEVICE)
    assert held.block_count(0) == 0

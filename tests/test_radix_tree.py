"""Radix-tree semantics users rely on: scores, rejections, ownership, tiers, dumps and memory."""

from __future__ import annotations

import gc
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer.events import RouterEvent, StorageTier, cleared_event, removed_event, stored_event
from indexer.radix_tree import BlockNotFound, InvalidBlockSequence, ParentBlockNotFound, RadixTree
from tests.event_streams import EventOp, QueryOp, WorkerOp, generate

A, B = 2**64 - 5, 7  # one id above 2^63, as Dynamo's random ids often are


def chain(tree: RadixTree, worker: int, pairs: list[tuple[int, int]], parent: int | None = None, rank: int = 0) -> None:
    tree.apply_event(worker, stored_event(1, pairs, parent_hash=parent, dp_rank=rank))


def scores(tree: RadixTree, query: list[int]) -> dict[tuple[int, int], int]:
    return tree.find_matches(query).scores


def test_longest_owned_prefix_per_worker_and_rank() -> None:
    tree = RadixTree()
    chain(tree, A, [(100, 1), (101, 2), (102, 3)])
    chain(tree, B, [(100, 1), (200, 4)])
    chain(tree, B, [(100, 1)], rank=1)
    assert scores(tree, [1, 2, 3]) == {(A, 0): 3, (B, 0): 1, (B, 1): 1}
    assert scores(tree, [1, 4, 9]) == {(A, 0): 1, (B, 0): 2, (B, 1): 1}
    assert scores(tree, [2, 3]) == {}  # matching is anchored at the root
    assert scores(tree, []) == {}


def test_store_under_unknown_parent_is_rejected_whole() -> None:
    tree = RadixTree()
    chain(tree, A, [(100, 1)])
    with pytest.raises(ParentBlockNotFound):
        chain(tree, B, [(101, 2), (102, 3)], parent=100)  # parent known only to another worker
    assert scores(tree, [1, 2, 3]) == {(A, 0): 1}
    assert tree.stats().nodes == 1


def test_store_listing_its_own_parent_is_rejected() -> None:
    tree = RadixTree()
    chain(tree, A, [(100, 1)])
    with pytest.raises(InvalidBlockSequence):
        chain(tree, A, [(101, 2), (100, 3)], parent=100)
    assert scores(tree, [1, 2]) == {(A, 0): 1}


def test_removal_of_unknown_hash_applies_the_rest_then_raises() -> None:
    tree = RadixTree()
    chain(tree, A, [(100, 1), (101, 2), (102, 3)])
    with pytest.raises(BlockNotFound) as info:
        tree.apply_event(A, removed_event(2, [999, 102, 101]))
    assert info.value.missing == [999]
    assert scores(tree, [1, 2, 3]) == {(A, 0): 1}
    with pytest.raises(BlockNotFound):
        tree.apply_event(B, removed_event(1, [100]))  # a worker the index has never seen
    assert scores(tree, [1]) == {(A, 0): 1}


def test_removed_block_cannot_be_a_parent_any_more() -> None:
    tree = RadixTree()
    chain(tree, A, [(100, 1), (101, 2)])
    tree.apply_event(A, removed_event(2, [101]))
    with pytest.raises(ParentBlockNotFound):
        chain(tree, A, [(102, 3)], parent=101)


def test_cleared_clears_only_the_sending_rank() -> None:
    tree = RadixTree()
    chain(tree, A, [(100, 1), (101, 2)], rank=0)
    chain(tree, A, [(100, 1)], rank=1)
    tree.apply_event(A, cleared_event(9, dp_rank=0))
    assert scores(tree, [1, 2]) == {(A, 1): 1}
    tree.apply_event(A, cleared_event(10, dp_rank=3))  # an unknown rank: nothing to do
    assert scores(tree, [1, 2]) == {(A, 1): 1}


def test_duplicate_stores_are_idempotent() -> None:
    tree = RadixTree()
    for _ in range(3):
        chain(tree, A, [(100, 1), (101, 2)])
        chain(tree, A, [(102, 3)], parent=101)
    assert scores(tree, [1, 2, 3]) == {(A, 0): 3}
    assert tree.stats().blocks == {(A, 0): 3}
    tree.apply_event(A, removed_event(5, [102]))
    assert scores(tree, [1, 2, 3]) == {(A, 0): 2}


def test_worker_with_its_own_hash_for_a_shared_block_can_extend_and_remove_it() -> None:
    tree = RadixTree()
    chain(tree, A, [(100, 1), (101, 2)])
    chain(tree, B, [(500, 1), (501, 2)])  # same tokens, different engine hashes
    chain(tree, B, [(502, 3)], parent=501)
    assert scores(tree, [1, 2, 3]) == {(A, 0): 2, (B, 0): 3}
    tree.apply_event(B, removed_event(2, [502, 501]))
    assert scores(tree, [1, 2, 3]) == {(A, 0): 2, (B, 0): 1}
    # The dump speaks each worker's own hashes, so the worker can keep going after a restore.
    restored = RadixTree()
    for event in tree.dump_events():
        restored.apply_router_event(event)
    chain(restored, B, [(501, 2)], parent=500)
    assert scores(restored, [1, 2]) == {(A, 0): 2, (B, 0): 2}


def test_lower_tiers_extend_the_device_match() -> None:
    tree = RadixTree()
    chain(tree, A, [(100, 1), (101, 2)])
    tree.apply_router_event(
        RouterEvent(A, stored_event(2, [(102, 3)], parent_hash=101), storage_tier=StorageTier.HOST_PINNED)
    )
    tree.apply_router_event(
        RouterEvent(A, stored_event(3, [(103, 4), (104, 5)], parent_hash=102), storage_tier=StorageTier.DISK)
    )
    # B has nothing on the device but the prompt's first blocks on host memory.
    tree.apply_router_event(RouterEvent(B, stored_event(1, [(100, 1), (101, 2)]), storage_tier=StorageTier.HOST_PINNED))
    result = tree.find_matches([1, 2, 3, 4, 5, 6])
    assert result.scores == {(A, 0): 2}
    assert result.tier_hits == {StorageTier.HOST_PINNED: {(A, 0): 1, (B, 0): 2}, StorageTier.DISK: {(A, 0): 2}}
    tree.apply_router_event(RouterEvent(A, removed_event(4, [103]), storage_tier=StorageTier.DISK))
    assert tree.find_matches([1, 2, 3, 4, 5]).tier_hits[StorageTier.HOST_PINNED] == {(A, 0): 1, (B, 0): 2}
    assert StorageTier.DISK not in tree.find_matches([1, 2, 3, 4, 5]).tier_hits
    with pytest.raises(BlockNotFound):
        tree.apply_router_event(RouterEvent(A, removed_event(5, [103]), storage_tier=StorageTier.DISK))
    tree.remove_worker(B)
    assert tree.find_matches([1, 2, 3]).tier_hits == {StorageTier.HOST_PINNED: {(A, 0): 1}}


def test_a_lower_tier_block_stored_again_under_another_parent_leaves_its_old_edge() -> None:
    host = StorageTier.HOST_PINNED
    tree = RadixTree()
    tree.apply_event(A, stored_event(1, [(5, 50)]), host)
    tree.apply_event(A, stored_event(2, [(5, 51)], parent_hash=9), host)  # the same block, another parent
    assert tree.find_matches([50]).tier_hits == {}
    [dumped] = tree.dump_events()  # the one edge it holds
    assert dumped.event.stored is not None and dumped.event.stored.parent_hash == 9
    tree.remove_worker(A)
    tree.apply_event(B, stored_event(1, [(7, 77)]))  # takes the slot A held
    assert tree.find_matches([50]).tier_hits == {}
    assert tree.find_matches([51]).tier_hits == {}
    assert [event.worker_id for event in tree.dump_events()] == [B]


def test_worker_known_only_on_a_lower_tier_gets_clean_device_errors() -> None:
    tree = RadixTree()
    tree.apply_router_event(RouterEvent(A, stored_event(1, [(100, 1)]), storage_tier=StorageTier.DISK))
    with pytest.raises(BlockNotFound):
        tree.apply_event(A, removed_event(2, [100]))
    tree.apply_event(A, cleared_event(3))
    assert tree.find_matches([1]).tier_hits == {StorageTier.DISK: {(A, 0): 1}}


def test_stats_count_blocks_nodes_and_bytes() -> None:
    tree = RadixTree()
    chain(tree, A, [(100, 1), (101, 2), (102, 3)])
    chain(tree, B, [(100, 1), (200, 4)])
    stats = tree.stats()
    assert stats.blocks == {(A, 0): 3, (B, 0): 2}
    assert stats.nodes == 4
    assert stats.estimated_bytes > 0
    tree.remove_worker(A)
    assert tree.stats().nodes == 2
    assert tree.workers() == [(B, 0)]


def _build(tree: RadixTree, worker_id: int, documents: int) -> None:
    for doc in range(documents):
        base = doc * 1000
        chain(tree, worker_id, [(base + i + 1, base + i + 1) for i in range(64)])


def test_removed_worker_returns_its_memory() -> None:
    tree = RadixTree()
    _build(tree, B, 20)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        _build(tree, A, 200)
        grown = tracemalloc.get_traced_memory()[0] - before
        tree.remove_worker(A)
        gc.collect()
        left = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown > 1_000_000  # 12,800 blocks
    assert left < grown * 0.02
    assert tree.stats().blocks == {(B, 0): 1280}
    assert tree.stats().nodes == 1280


# ------------------------------------------------------------------------- properties
def _replay(seed: int, requests: int, skip_worker: int | None = None) -> tuple[RadixTree, list[list[int]]]:
    tree = RadixTree()
    queries = []
    for op in generate(seed, workers=4, dp_size=2, requests=requests, capacity=96, groups=6, query_every=2):
        if isinstance(op, QueryOp):
            queries.append(op.local_hashes)
        elif isinstance(op, WorkerOp):
            if op.worker_id != skip_worker:
                getattr(tree, op.kind)(op.worker_id)
        elif isinstance(op, EventOp) and op.worker_id != skip_worker:
            tree.apply_event(op.worker_id, op.event)
    return tree, queries


property_settings = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@property_settings
@given(st.integers(0, 2**32))
def test_dump_replayed_into_an_empty_tree_gives_identical_answers(seed: int) -> None:
    tree, queries = _replay(seed, 150)
    restored = RadixTree()
    for event in tree.dump_events():
        restored.apply_router_event(event)
    for query in queries:
        assert restored.find_matches(query).scores == tree.find_matches(query).scores
    held = {worker: count for worker, count in tree.stats().blocks.items() if count}
    assert restored.stats().blocks == held
    assert restored.stats().nodes <= tree.stats().nodes


@property_settings
@given(st.integers(0, 2**32))
def test_applying_every_event_twice_changes_nothing(seed: int) -> None:
    once, queries = _replay(seed, 120)
    twice = RadixTree()
    for op in generate(seed, workers=4, dp_size=2, requests=120, capacity=96, groups=6, query_every=2):
        if isinstance(op, WorkerOp):
            getattr(twice, op.kind)(op.worker_id)
        elif isinstance(op, EventOp):
            twice.apply_event(op.worker_id, op.event)
            if op.event.stored is not None:
                twice.apply_event(op.worker_id, op.event)
    for query in queries:
        assert twice.find_matches(query).scores == once.find_matches(query).scores


@property_settings
@given(st.integers(0, 2**32), st.integers(0, 3))
def test_removing_a_worker_is_as_if_it_never_sent_anything(seed: int, victim_index: int) -> None:
    tree, queries = _replay(seed, 150)
    victim = sorted({w for w, _ in tree.workers()})[victim_index % len({w for w, _ in tree.workers()})]
    tree.remove_worker(victim)
    without, _ = _replay(seed, 150, skip_worker=victim)
    for query in queries:
        assert tree.find_matches(query).scores == without.find_matches(query).scores
    assert tree.stats().nodes == without.stats().nodes


def test_a_dropped_tree_frees_its_nodes() -> None:
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tree = RadixTree()
        _build(tree, A, 100)
        grown = tracemalloc.get_traced_memory()[0] - before
        del tree
        gc.collect()
        left = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown > 500_000
    assert left < grown * 0.02

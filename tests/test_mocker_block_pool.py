"""The simulated KV block pool: reference counts, LRU eviction order, and KV events that replay into a
router's index as exactly the pool's contents."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.events import RouterEvent
from indexer.radix_tree import RadixTree
from mocker.block_pool import BlockPool, Cleared, KvOp, Removed, Stored, kv_cache_event

WORKER = 3


def chain(name: int, length: int) -> tuple[list[int], list[int]]:
    """Sequence and local hashes of a prompt's blocks: block i of chain n is (n, i) (a prefix of n)."""
    local = [name * 1000 + i for i in range(length)]
    return [name * 1_000_000 + i + 1 for i in range(length)], local


def index_of(ops: list[KvOp], tree: RadixTree | None = None, first_id: int = 1) -> RadixTree:
    """Replay pool ops into a router index, as a router would receive them (raises if one is rejected)."""
    tree = tree if tree is not None else RadixTree()
    for event_id, op in enumerate(ops, first_id):
        tree.apply_router_event(RouterEvent(WORKER, kv_cache_event(op, event_id)))
    return tree


def indexed_blocks(tree: RadixTree) -> set[int]:
    held: set[int] = set()
    for event in tree.dump_events():
        stored = event.event.stored
        assert stored is not None
        held.update(block.block_hash for block in stored.blocks)
    return held


def test_shared_blocks_are_reference_counted() -> None:
    pool = BlockPool(10)
    hashes, local = chain(1, 3)
    assert pool.acquire(hashes, local, 0, 3)
    assert pool.acquire(hashes, local, 0, 2)  # a second sequence sharing two blocks
    assert [pool.ref_count(h) for h in hashes] == [2, 2, 1]
    assert pool.active_blocks == 3
    assert pool.ops == [Stored(None, list(zip(hashes, local, strict=True)))]  # stored once
    pool.release(hashes, 3, partial=False)
    assert [pool.ref_count(h) for h in hashes] == [1, 1, 0]
    assert pool.cached_order() == [hashes[2]]
    pool.release(hashes, 2, partial=False)
    assert pool.active_blocks == 0
    assert pool.cached_blocks == 3


def test_eviction_is_least_recently_released_first_and_tail_first_within_a_sequence() -> None:
    pool = BlockPool(5)
    a, a_local = chain(1, 3)
    b, b_local = chain(2, 2)
    assert pool.acquire(a, a_local, 0, 3)
    assert pool.acquire(b, b_local, 0, 2)
    pool.release(a, 3, partial=False)
    pool.release(b, 2, partial=False)
    # A sequence releases its tail first, so its prefix is evicted last.
    assert pool.cached_order() == [a[2], a[1], a[0], b[1], b[0]]
    c, c_local = chain(3, 2)
    pool.ops.clear()
    assert pool.acquire(c, c_local, 0, 2)
    assert pool.ops == [Removed([a[2], a[1]]), Stored(None, list(zip(c, c_local, strict=True)))]
    assert pool.cached_prefix(a, 3) == (1, 0)


def test_a_cache_hit_reactivates_and_refreshes_the_block() -> None:
    pool = BlockPool(4)
    a, a_local = chain(1, 2)
    b, b_local = chain(2, 2)
    for hashes, local in ((a, a_local), (b, b_local)):
        assert pool.acquire(hashes, local, 0, 2)
        pool.release(hashes, 2, partial=False)
    assert pool.cached_prefix(a, 2) == (2, 0)
    pool.ops.clear()
    assert pool.acquire(a, a_local, 0, 2)  # a hit: no event, no eviction
    assert pool.ops == []
    assert pool.cached_prefix(a, 2) == (2, 2)
    pool.release(a, 2, partial=False)
    assert pool.cached_order() == [b[1], b[0], a[1], a[0]]


def test_acquire_is_all_or_nothing_when_active_blocks_fill_the_pool() -> None:
    pool = BlockPool(4)
    a, a_local = chain(1, 3)
    assert pool.acquire(a, a_local, 0, 3)
    b, b_local = chain(2, 2)
    pool.ops.clear()
    assert not pool.acquire(b, b_local, 0, 2)
    assert pool.ops == []
    assert pool.active_blocks == 3
    assert pool.free_for_activation == 1
    assert pool.acquire(b, b_local, 0, 1)


def test_partial_blocks_take_a_slot_and_become_full_when_promoted() -> None:
    pool = BlockPool(3)
    a, a_local = chain(1, 2)
    assert pool.acquire(a, a_local, 0, 1, partial=True)
    assert pool.active_blocks == 2
    pool.promote(a[1], a_local[1], a[0])
    assert pool.ops[-1] == Stored(a[0], [(a[1], a_local[1])])
    assert pool.active_blocks == 2
    assert pool.acquire_partial()
    assert not pool.acquire_partial()  # three active slots out of three
    pool.release(a, 2, partial=True)
    assert pool.active_blocks == 0
    assert pool.cached_order() == [a[1], a[0]]


def test_promote_to_a_block_already_cached_stores_nothing() -> None:
    pool = BlockPool(4)
    a, a_local = chain(1, 2)
    assert pool.acquire(a, a_local, 0, 2)
    pool.release(a, 2, partial=False)
    assert pool.acquire(a, a_local, 0, 1, partial=True)
    pool.ops.clear()
    pool.promote(a[1], a_local[1], a[0])
    assert pool.ops == []
    assert pool.ref_count(a[1]) == 1


def test_clearing_is_refused_while_blocks_are_active() -> None:
    pool = BlockPool(4)
    a, a_local = chain(1, 2)
    assert pool.acquire(a, a_local, 0, 2)
    assert not pool.clear_cached()
    pool.release(a, 2, partial=False)
    assert pool.clear_cached()
    assert pool.ops[-1] == Cleared()
    assert pool.full_blocks() == set()
    assert indexed_blocks(index_of(pool.ops)) == set()


# A random program of sequences over a small tree of prompts (chains share prefixes), on a small pool.
_program = st.lists(
    st.tuples(st.integers(0, 5), st.integers(1, 6), st.booleans(), st.booleans()), min_size=1, max_size=60
)


@settings(max_examples=150, deadline=None)
@given(_program)
def test_emitted_events_replay_into_exactly_the_pool_contents(program: list[tuple[int, int, bool, bool]]) -> None:
    pool = BlockPool(12)
    tree = RadixTree()
    next_id = 1
    live: list[tuple[list[int], int, bool]] = []
    for family, length, partial, release_first in program:
        if release_first and live:
            hashes, held, has_partial = live.pop(0)
            pool.release(hashes, held, partial=has_partial)
        # Chains of one family share their prefix: family f, block i -> the same hash in every chain.
        hashes, local = chain(family % 3, length)
        if pool.acquire(hashes, local, 0, length, partial=partial):
            live.append((hashes, length, partial))
        index_of(pool.ops, tree, next_id)
        next_id += len(pool.ops)
        pool.ops.clear()
        assert indexed_blocks(tree) == pool.full_blocks()
        assert pool.active_blocks + pool.cached_blocks <= pool.num_blocks
    for hashes, held, has_partial in live:
        pool.release(hashes, held, partial=has_partial)
    assert pool.active_blocks == 0

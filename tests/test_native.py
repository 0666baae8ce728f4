"""The indexer's C accelerator (`indexer._native`) gives the pure-Python code's answers bit for bit.

Both paths run in this process whatever ``KV_ROUTER_NO_NATIVE`` says: the C functions are called
directly, trees are built with ``native`` on and off. XXH3 is checked against the `xxhash` package on
every length class of the specification. The router's and the HTTP front's extensions have their own
tests (tests/test_native_router.py, tests/test_native_api.py).
"""

from __future__ import annotations

import random
from array import array
from typing import Any

import msgspec
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer.events import (
    KvStoredData,
    RouterEvent,
    StorageTier,
    StoredBlock,
    StoredEventEncoder,
    encode_router_events,
    stored_event,
)
from indexer.hashing import SEED, python_block_hashes, python_sequence_hashes, sequence_hash_tuple
from indexer.radix_tree import KvIndexError, RadixTree
from tests.event_streams import EventOp, QueryOp, WorkerOp, generate

native = pytest.importorskip("indexer._native", reason="the C accelerator is not built")

U64 = st.integers(0, 2**64 - 1)
SEEDS = st.sampled_from([0, SEED]) | U64
# XXH3's length classes (the specification's code paths): 0, 1-3, 4-8, 9-16, 17-128, 129-240, > 240.
LENGTH_CLASSES = [(0, 0), (1, 3), (4, 8), (9, 16), (17, 128), (129, 240), (241, 5000)]


@pytest.mark.parametrize(("shortest", "longest"), LENGTH_CLASSES)
@settings(max_examples=150, deadline=None)
@given(data=st.data(), seed=SEEDS)
def test_xxh3_matches_the_xxhash_package_on_every_length_class(
    shortest: int, longest: int, data: st.DataObject, seed: int
) -> None:
    payload = data.draw(st.binary(min_size=shortest, max_size=longest))
    assert native.xxh3_64(payload, seed) == xxhash.xxh3_64_intdigest(payload, seed)


@pytest.mark.parametrize("length", [240, 241, 1023, 1024, 1025, 2048, 4096, 4097, 65536 + 13])
def test_xxh3_matches_at_the_long_hash_stripe_and_block_boundaries(length: int) -> None:
    payload = random.Random(length).randbytes(length)
    for seed in (0, SEED, 2**64 - 1):
        assert native.xxh3_64(payload, seed) == xxhash.xxh3_64_intdigest(payload, seed)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=600),
    block_size=st.integers(1, 64),
    eagle=st.booleans(),
    seed=SEEDS,
)
def test_block_hashes_match_python(tokens: list[int], block_size: int, eagle: bool, seed: int) -> None:
    packed = memoryview(array("I", tokens)).cast("B")
    stride = 4 * block_size
    window = stride + 4 if eagle else stride
    assert native.block_hashes(packed, seed, stride, window) == python_block_hashes(packed, seed, stride, window)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1) | st.integers(-3, 2**70) | st.booleans() | st.floats(), max_size=50))
def test_token_lists_pack_as_array_packs_them(tokens: list[Any]) -> None:
    try:
        expected: bytes | None = array("I", tokens).tobytes()
    except (OverflowError, TypeError):
        expected = None  # the Python path raises, naming the id
    assert native.pack_u32(tokens) == expected


@settings(max_examples=300, deadline=None)
@given(st.lists(U64, max_size=300))
def test_sequence_hashes_match_python(local_hashes: list[int]) -> None:
    assert list(native.sequence_hashes(local_hashes, SEED)) == python_sequence_hashes(local_hashes)


@pytest.mark.parametrize("bad", [-1, 2**64, 1.0, "7"])
def test_a_bad_local_hash_is_reported_as_python_reports_it(bad: Any) -> None:
    hashes = [1, 2, bad, 4]
    with pytest.raises((OverflowError, TypeError)):
        native.sequence_hashes(hashes, SEED)
    with pytest.raises(ValueError) as from_python:
        python_sequence_hashes(hashes)
    with pytest.raises(ValueError) as dispatched:
        sequence_hash_tuple(hashes)
    assert str(dispatched.value) == str(from_python.value)


def _apply(tree: RadixTree, op: EventOp | WorkerOp, tier: StorageTier) -> str | None:
    try:
        if isinstance(op, WorkerOp):
            getattr(tree, op.kind)(op.worker_id)
        else:
            tree.apply_event(op.worker_id, op.event, tier)
    except KvIndexError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _same_answers(workers: int, dp_size: int, seed: int, requests: int) -> None:
    trees = RadixTree(native=True), RadixTree(native=False)
    rng = random.Random(seed)
    for op in generate(seed, workers=workers, dp_size=dp_size, requests=requests, capacity=96, groups=6):
        if isinstance(op, QueryOp):
            fast, slow = (tree.find_matches(op.local_hashes) for tree in trees)
            assert fast.scores == slow.scores
            assert list(fast.scores) == list(slow.scores)  # the same order, too
            assert fast.tier_hits == slow.tier_hits
            continue
        # Now and then the same event also lands on a lower tier, so matches walk both.
        tiers = [StorageTier.DEVICE] + ([StorageTier.HOST_PINNED] if rng.random() < 0.1 else [])
        for tier in tiers:
            assert _apply(trees[0], op, tier) == _apply(trees[1], op, tier)
    fast_stats, slow_stats = (tree.stats() for tree in trees)
    assert (fast_stats.blocks, fast_stats.nodes) == (slow_stats.blocks, slow_stats.nodes)
    # Branch dicts are counted alike too (the C removal collapses them as `_prune` does).
    entries = [sum(len(state.lookup) for state in tree._states.values()) for tree in trees]
    assert entries[0] == entries[1]
    assert fast_stats.estimated_bytes - slow_stats.estimated_bytes == fast_stats.nodes * (
        trees[0]._node_bytes - trees[1]._node_bytes
    ) + entries[0] * (trees[0]._lookup_entry_bytes - trees[1]._lookup_entry_bytes)
    assert trees[0].dump_events() == trees[1].dump_events()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32))
def test_native_and_python_trees_answer_alike(seed: int) -> None:
    _same_answers(workers=6, dp_size=2, seed=seed, requests=200)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32))
def test_native_and_python_trees_answer_alike_past_64_slots(seed: int) -> None:
    # Slots of 64 and more take the Python walks inside a native tree; their masks mix with the rest.
    _same_answers(workers=44, dp_size=2, seed=seed, requests=400)


def test_a_worker_reusing_a_hash_elsewhere_loses_the_old_block_alike() -> None:
    answers = []
    for native_tree in (True, False):
        tree = RadixTree(native=native_tree)
        tree.apply_event(8, stored_event(1, [(10, 1), (11, 2)]))
        tree.apply_event(7, stored_event(1, [(10, 1), (11, 2), (10, 3)]))  # hash 10 again, deeper
        tree.apply_event(7, stored_event(2, [(12, 4)], parent_hash=10))
        stats = tree.stats()
        queries = ([1, 2, 3, 4], [1, 2], [1])
        answers.append(([tree.find_matches(q).scores for q in queries], stats.blocks, stats.nodes))
    assert answers[0] == answers[1]
    assert answers[0][0][0] == {(8, 0): 2}  # worker 7 no longer holds its first block


def test_the_c_node_behaves_as_the_python_node() -> None:
    from indexer.radix_tree import _Node

    for cls in (native.Node, _Node):
        root = cls(0, 0, None, 0)
        child = cls(2**64 - 1, 5, root, 0b101)
        root.children = {5: child}
        assert (child.block_hash, child.local_hash, child.parent, child.owners) == (2**64 - 1, 5, root, 0b101)
        assert repr(child) == "_Node(block_hash=18446744073709551615, local_hash=5, owners=0x5)"
        child.owners |= 2
        assert child.owners == 7
        assert root.children == {5: child}
    with pytest.raises(OverflowError):
        native.Node(-1, 0, None, 0)
    with pytest.raises(TypeError):
        native.Node(0, 0, None, 0).owners = "x"  # type: ignore[assignment]


def test_the_u64_check_of_stored_blocks_matches_python() -> None:
    blocks = [StoredBlock(1, 2), StoredBlock(2**64 - 1, 0)]
    assert not native.has_wide_hash(blocks)
    for wide in (-1, 2**64, -(2**63)):
        block = StoredBlock(1, 2)
        block.tokens_hash = wide
        assert native.has_wide_hash([*blocks, block])
    stored = msgspec.json.decode(
        b'{"blocks":[{"block_hash":-1,"tokens_hash":3},{"block_hash":4,"tokens_hash":-2}]}', type=KvStoredData
    )
    assert [(b.block_hash, b.tokens_hash) for b in stored.blocks] == [(2**64 - 1, 3), (4, 2**64 - 2)]


EDGES = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63, 2**64 - 1]
EDGY_U64 = st.sampled_from(EDGES) | U64


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(EDGY_U64, EDGY_U64), max_size=70))
def test_stored_block_rows_are_the_bytes_msgspec_writes(pairs: list[tuple[int, int]]) -> None:
    row = msgspec.msgpack.encode(StoredBlock(2**64 - 1, 2**64 - 2))
    before, rest = row.split(msgspec.msgpack.encode(2**64 - 1))
    between, after = rest.split(msgspec.msgpack.encode(2**64 - 2))
    rows = native.msgpack_rows([b for b, _ in pairs], [t for _, t in pairs], before, between, after)
    assert rows == msgspec.msgpack.encode([StoredBlock(b, t) for b, t in pairs])


def test_stored_block_rows_refuse_what_is_not_u64() -> None:
    for bad in (-1, 2**64, "1"):
        assert native.msgpack_rows([1, bad], [2, 3], b"", b"", b"") is None
    with pytest.raises(ValueError, match="differ in length"):
        native.msgpack_rows([1, 2], [3], b"", b"", b"")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1]) | st.integers(0, 2**32 - 1)))
def test_msgpack_token_ids_pack_as_array_packs_them(tokens: list[int]) -> None:
    assert native.msgpack_u32s(msgspec.msgpack.encode(tokens)) == array("I", tokens).tobytes()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40) | st.builds(msgspec.msgpack.encode, st.lists(st.integers(-(2**63), 2**64 - 1))))
def test_msgpack_token_ids_are_packed_only_when_msgspec_reads_the_same_u32s(data: bytes) -> None:
    packed = native.msgpack_u32s(data)
    try:
        tokens: list[int] | None = msgspec.msgpack.decode(data, type=list[int])
    except msgspec.DecodeError:
        tokens = None
    if packed is not None:  # never an answer of its own: exactly msgspec's ints
        assert tokens is not None and array("I", packed).tolist() == tokens
    elif tokens is not None and all(0 <= token < 2**32 for token in tokens):
        # u32 ids in a form msgspec never writes for them (signed or 64-bit) are left to msgspec.
        assert any(byte in data for byte in b"\xcf\xd0\xd1\xd2\xd3")


@settings(max_examples=200, deadline=None)
@given(
    worker=st.sampled_from([0, 7, 2**64 - 1, 2**64 - 3]) | U64,
    event_id=st.integers(1, 2**64 - 1),
    dp_rank=st.integers(0, 2**32 - 1),
    tier=st.sampled_from(list(StorageTier)),
    parent=st.none() | EDGY_U64,
    pairs=st.lists(st.tuples(EDGY_U64, EDGY_U64), min_size=1, max_size=40),
)
def test_the_stored_event_encoder_writes_what_msgspec_writes(
    worker: int, event_id: int, dp_rank: int, tier: StorageTier, parent: int | None, pairs: list[tuple[int, int]]
) -> None:
    expected = encode_router_events(
        RouterEvent(worker, stored_event(event_id, pairs, parent_hash=parent, dp_rank=dp_rank), tier), msgpack=True
    )
    hashes, tokens = [b for b, _ in pairs], [t for _, t in pairs]
    for encoder in (StoredEventEncoder(worker, native=True), StoredEventEncoder(worker, native=False)):
        assert encoder.encode(event_id, dp_rank, tier, parent, hashes, tokens) == expected

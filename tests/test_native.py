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

from indexer import events as events_module
from indexer.errors import EventDecodeError
from indexer.events import (
    KvStoredData,
    RouterEvent,
    StorageTier,
    StoredBlock,
    StoredEventEncoder,
    cleared_event,
    decode_router_events,
    encode_router_events,
    removed_event,
    stored_event,
)
from indexer.hashing import SEED, python_block_hashes, python_sequence_hashes, sequence_hash_tuple
from indexer.radix_tree import KvIndexError, RadixTree
from tests.event_streams import EventOp, QueryOp, WorkerOp, generate

pytestmark = pytest.mark.both_paths

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


# ---------------------------------------------------------------------- RouterEvent JSON in C

# As indexer.events does when the accelerator is on.
assert native.bind_event_types(*events_module._NATIVE_WIRE_TEMPLATES)

WIRE_HASH = EDGY_U64 | st.integers(-(2**63), -1)
U32_EDGES = st.sampled_from([0, 1, 2**32 - 1]) | st.integers(0, 2**32 - 1)


def _msgspec_decode(payload: bytes) -> list[RouterEvent] | str:
    try:
        decoded = events_module._json_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        return f"error: {exc}"
    return decoded if isinstance(decoded, list) else [decoded]


def _assert_c_decode_agrees(payload: bytes) -> list[RouterEvent] | None:
    """The C decoder gives msgspec's events exactly, types included, or None (msgspec then decides)."""
    fast = native.router_events_json(payload)
    if fast is not None:
        slow = _msgspec_decode(payload)
        assert fast == slow
        assert msgspec.json.encode(fast) == msgspec.json.encode(slow)
        for ours, theirs in zip(fast, slow, strict=True):
            assert type(ours.event.data) is type(theirs.event.data)
            assert ours.storage_tier is theirs.storage_tier
    return fast


@st.composite
def router_events(draw: st.DrawFn) -> RouterEvent:
    kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
    event_id, dp_rank = draw(st.integers(0, 2**64 - 1)), draw(U32_EDGES)
    if kind == "stored":
        blocks = draw(st.lists(st.tuples(WIRE_HASH, WIRE_HASH), max_size=20))
        parent = draw(st.none() | WIRE_HASH)
        event = stored_event(event_id, [], parent_hash=None, dp_rank=dp_rank)
        assert event.stored is not None
        event.stored.blocks = [StoredBlock(b, t) for b, t in blocks]
        event.stored.parent_hash = parent
        event.stored.start_position = draw(st.none() | U32_EDGES)
    elif kind == "removed":
        event = removed_event(event_id, [], dp_rank=dp_rank)
        assert event.removed is not None
        event.removed.block_hashes = draw(st.lists(WIRE_HASH, max_size=20))
    else:
        event = cleared_event(event_id, dp_rank=dp_rank)
    tier = draw(st.sampled_from(list(StorageTier)))
    return RouterEvent(draw(st.integers(0, 2**64 - 1)), event, tier)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_router_event_json_decodes_in_c_as_msgspec_decodes_it(data: st.DataObject) -> None:
    batch = data.draw(st.lists(router_events(), max_size=4))
    single = data.draw(st.booleans()) and len(batch) == 1
    payload = msgspec.json.encode(batch[0] if single else batch)
    if data.draw(st.booleans()):  # whitespace where JSON allows it
        payload = payload.replace(b",", b" ,\n").replace(b":", b"\t: ").replace(b"{", b"{ ") + b"\r\n"
    fast = _assert_c_decode_agrees(payload)
    # The form publishers write (device tier, every hash a u64) never needs msgspec.
    common = all(
        event.storage_tier is StorageTier.DEVICE
        and b"-" not in msgspec.json.encode(event)  # no i64 hash to reinterpret
        for event in batch
    )
    assert (fast is not None) == common


@pytest.mark.parametrize(
    "payload",
    [
        b'{"worker_id":1,"event":{"event_id":2,"data":"cleared"}}',
        b'[{"worker_id":1,"event":{"event_id":2,"data":"cleared"}}]',
        b"[]",
        b" [ ] ",
        b'{"event":{"dp_rank":3,"data":{"removed":{"block_hashes":[]}},"event_id":0},"storage_tier":"device",'
        b'"worker_id":18446744073709551615}',
        b'{"worker_id":1,"event":{"event_id":2,"data":{"stored":{"start_position":4294967295,"blocks":'
        b'[{"tokens_hash":5,"block_hash":6}],"parent_hash":null}}}}',
    ],
)
def test_the_c_json_decoder_takes_every_key_order_and_optional_member(payload: bytes) -> None:
    assert _assert_c_decode_agrees(payload) is not None


@pytest.mark.parametrize(
    "payload",
    [
        b'{"worker_id":1,"event":{"event_id":2,"data":{"cleared":null}}}',  # canonicalised by __post_init__
        b'{"worker_id":-1,"event":{"event_id":2,"data":"cleared"}}',
        b'{"worker_id":18446744073709551616,"event":{"event_id":2,"data":"cleared"}}',
        b'{"worker_id":1.0,"event":{"event_id":2,"data":"cleared"}}',
        b'{"worker_id":1e3,"event":{"event_id":2,"data":"cleared"}}',
        b'{"worker_id":01,"event":{"event_id":2,"data":"cleared"}}',
        b'{"worker_id":1,"worker_id":2,"event":{"event_id":2,"data":"cleared"}}',
        b'{"worker_id":1,"event":{"event_id":2,"data":"cleared"},"extra":0}',
        b'{"worker\\u005fid":1,"event":{"event_id":2,"data":"cleared"}}',
        b'{"worker_id":1,"event":{"event_id":2,"data":"cleared"},"storage_tier":"disk"}',
        b'{"worker_id":1,"event":{"event_id":2,"data":"cleared","dp_rank":4294967296}}',
        b'{"worker_id":1,"event":{"event_id":2,"data":"cleared","dp_rank":null}}',
        b'{"worker_id":1,"event":{"event_id":2,"data":{"stored":{"blocks":[],"start_position":4294967296}}}}',
        b'{"worker_id":1,"event":{"event_id":2,"data":{"stored":{"blocks":[]},"removed":null}}}',
        b'{"worker_id":1,"event":{"event_id":2,"data":{"stored":{"blocks":[{"block_hash":1,"tokens_hash":2,'
        b'"mm_extra_info":{"mm_objects":[]}}]}}}}',
        b'{"worker_id":1,"event":{"event_id":2,"data":{"removed":{"block_hashes":[1,-2]}}}}',
        b'{"worker_id":1,"event":{"event_id":2,"data":{"removed":{"block_hashes":[1,]}}}}',
        b'{"worker_id":1,"event":{"event_id":2,"data":"cleared"}} x',
        b'{"worker_id":1,"event":{"event_id":2,"data":"cleared"}',
        b'{"worker_id":1}',
        b"",
        b"[{}]",
    ],
)
def test_the_c_json_decoder_leaves_every_other_form_to_msgspec(payload: bytes) -> None:
    assert native.router_events_json(payload) is None
    assert _msgspec_decode(payload) == _python_decode(payload)


def _python_decode(payload: bytes) -> list[RouterEvent] | str:
    try:
        return decode_router_events(payload)
    except EventDecodeError as exc:
        return f"error: {str(exc).removeprefix('invalid RouterEvent JSON: ')}"


@pytest.mark.parametrize("value", [0, 9, 10**15, 10**16 - 1, 10**16, 10**19 - 1, 10**19, 2**64 - 1, 2**64, 10**20])
def test_the_c_json_decoder_reads_every_digit_count(value: int) -> None:
    payload = b'{"worker_id":%d,"event":{"event_id":7,"data":"cleared"}}' % value
    fast = _assert_c_decode_agrees(payload)
    assert (fast is not None) == (value < 2**64)


# ---------------------------------------------------------------------- a rank's block map in C

MAP_OPERATIONS = st.sampled_from(["set", "setdefault", "pop", "get", "del"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(MAP_OPERATIONS, st.integers(0, 40)), max_size=400))
def test_the_block_map_answers_as_a_dict(operations: list[tuple[str, int]]) -> None:
    keys = [0, 1, 2**63, 2**64 - 1, *range(8, 40)]  # neighbours, so probe runs wrap and shift back
    fast, slow = native.BlockMap(), {}
    for step, (operation, index) in enumerate(operations):
        key = keys[index % len(keys)] if index < 40 else index
        if operation == "set":
            fast[key] = slow[key] = step
        elif operation == "setdefault":
            assert fast.setdefault(key, step) == slow.setdefault(key, step)
        elif operation == "pop":
            assert fast.pop(key, None) == slow.pop(key, None)
        elif operation == "get":
            assert fast.get(key) == slow.get(key)
        elif key in slow:
            del fast[key], slow[key]
        else:
            with pytest.raises(KeyError):
                del fast[key]
        assert len(fast) == len(slow)
        assert sorted(fast.values()) == sorted(slow.values())
    for absent in (-1, 2**64, "7"):
        assert fast.get(absent) is None
        assert fast.pop(absent, None) is None
    with pytest.raises(OverflowError):
        fast[2**64] = 1

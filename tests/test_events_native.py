"""The bridge's C step (`indexer._events_native`) gives the pure-Python decoder's and HeldBlocks' answers.

Every batch is decoded both ways: `decode_batch` in C and `python_decode_engine_batch` (msgspec and
Python). Where C takes a batch, the two must agree exactly (events, tokens hashes, tiers, rank, ts to
the bit, ignored groups) and Python must have found no error; where C declines (None), Python alone
decides, so no rule can be lost by the C path. Held blocks are stored and dropped through both paths
from the same random streams. Batches are drawn over every form of shared/reference/engine-events.md
and the vectors: tagged maps and arrays, both envelopes, int (signed, unsigned, wide) and bytes hashes,
token ids short, long, wide or absent, media, LoRA names, salts, groups, unknown and trailing fields.
"""

from __future__ import annotations

import gc
import json
import struct
from collections import deque
from itertools import repeat
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import indexer.held_blocks as held_blocks
from indexer.engine_events import (
    DecodedBatch,
    EngineDecodeError,
    EngineOffloaded,
    EngineStored,
    decode_engine_batch,
    fold_hash,
    python_decode_engine_batch,
)
from indexer.errors import KvIndexError
from indexer.events import StorageTier
from indexer.hashing import compute_block_hashes, salt_seed

pytestmark = pytest.mark.both_paths

# Both paths run whatever KV_ROUTER_NO_NATIVE says: the C functions are called directly.
events_native = pytest.importorskip("indexer._events_native", reason="the bridge's C step is not built")
pytest.importorskip("indexer._native", reason="the bridge's C step needs the indexer's accelerator")

BLOCK = 4
encode = msgspec.msgpack.encode


def _comparable(batch: DecodedBatch) -> tuple[Any, ...]:
    ts = struct.pack("<d", batch.ts)  # to the bit (NaN included)
    errors = [(error.reason, error.detail) for error in batch.errors]
    return ts, batch.dp_rank, batch.events, errors, batch.ignored


def _check(
    payload: bytes, block_size: int = BLOCK, namespace: str | None = None, salts: dict[int, str] | None = None
) -> bool:
    """Both decoders on one payload (each with its own copy of ``salts``); whether C took it. Where C
    declines, it must leave its salts as they were; where it takes the batch, as Python leaves them."""
    c_salts, python_salts = (None, None) if salts is None else (dict(salts), dict(salts))
    fast = events_native.decode_batch(payload, block_size, salt_seed(None, namespace), c_salts)
    try:
        python = python_decode_engine_batch(payload, block_size, cache_namespace=namespace, salts=python_salts)
    except EngineDecodeError:  # the envelope: C must not have taken it
        assert fast is None and c_salts == salts
        return False
    if fast is None:
        assert c_salts == salts
        return False
    ts, dp_rank, events, ignored = fast
    assert python.errors == [], [error.reason for error in python.errors]
    assert _comparable(DecodedBatch(ts, dp_rank, events, [], ignored)) == _comparable(python)
    assert all(type(event) is type(want) for event, want in zip(events, python.events, strict=True))
    assert c_salts == python_salts
    again = None if salts is None else dict(salts)
    assert _comparable(decode_engine_batch(payload, block_size, cache_namespace=namespace, salts=again)) == _comparable(
        python
    )
    return True


# ---------------------------------------------------------------------- strategies
U64 = st.integers(0, 2**64 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
HASHES = st.one_of(U64, I64, st.binary(min_size=0, max_size=33))
# Mostly plain ids; sometimes wide ones, negatives, floats or nested pairs (EAGLE), which C declines.
TOKEN = st.integers(0, 2**32 - 1)
ODD_TOKEN = st.one_of(st.integers(2**32, 2**40), st.integers(-5, -1), st.floats(allow_nan=False), st.just([1, 2]))
MEDIA = st.sampled_from([None, "GPU", "CPU", "DISK", "gpu", "Cpu_Pinned", "NVME", "STORAGE", "FS", "OBJ", "NEW"])
KINDS = st.sampled_from([None, "full_attention", "mla_attention", "sliding_window", "mamba", "sink_full_attention"])
ANY = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=4), st.binary(max_size=4)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=2),
    max_leaves=5,
)


@st.composite
def stored_fields(draw: st.DrawFn) -> dict[str, Any]:
    count = draw(st.integers(0, 5))
    distinct = draw(st.booleans())
    hashes = draw(st.lists(HASHES, min_size=count, max_size=count, unique=distinct))
    size = draw(st.sampled_from([BLOCK, BLOCK, BLOCK, None, 8]))
    per_block = size or BLOCK
    extra = draw(st.sampled_from([0, 0, 0, -1, 3]))
    length = max(0, count * per_block + extra)
    tokens: list[Any] = draw(st.lists(TOKEN, min_size=length, max_size=length))
    if tokens and draw(st.integers(0, 9)) == 0:
        tokens[draw(st.integers(0, len(tokens) - 1))] = draw(ODD_TOKEN)
    if draw(st.integers(0, 5)) == 0:  # vLLM's OffloadingConnector: no token ids, block size 0
        tokens, size = [], draw(st.sampled_from([0, size]))
    fields: dict[str, Any] = {
        "block_hashes": hashes,
        "parent_block_hash": draw(st.one_of(st.none(), HASHES, st.sampled_from(hashes) if hashes else st.none())),
        "token_ids": tokens,
        "block_size": size,
        "lora_id": draw(st.one_of(st.none(), st.integers(0, 9))),
        "medium": draw(MEDIA),
        "lora_name": draw(st.sampled_from([None, None, None, "my-adapter", ""])),
        # vLLM 0.32: one entry per block, a request's cache salt in its first block's keys.
        "extra_keys": draw(
            st.one_of(
                st.none(),
                ANY,
                st.just([None] * count),
                st.sampled_from([["tenant-X"], ["tenant-Y"], ["tenant-X"], ["my-adapter", "tenant-X"], [""]]).map(
                    lambda keys: [keys] + [None] * max(0, count - 1)
                ),
                st.just([["tenant-X"]] + [None] * max(0, count - 1)),
            )
        ),
        "group_idx": draw(st.one_of(st.none(), st.integers(0, 3))),
        "kv_cache_spec_kind": draw(KINDS),
    }
    return fields


@st.composite
def engine_event(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"]))
    as_map = draw(st.booleans())
    if kind == "BlockStored":
        fields = draw(stored_fields())
        order = list(fields)
    elif kind == "BlockRemoved":
        fields = {
            "block_hashes": draw(st.lists(HASHES, max_size=5)),
            "medium": draw(MEDIA),
            "group_idx": draw(st.one_of(st.none(), st.integers(0, 3))),
        }
        order = list(fields)
    else:
        fields, order = {}, []
    if as_map:
        event: dict[str, Any] = {"type": kind}
        for name in order:
            # Maps drop defaults (omit_defaults) and may carry SGLang's and Dynamo's extensions.
            if fields[name] is None and name not in ("parent_block_hash", "medium", "lora_id", "lora_name"):
                continue
            event[name] = fields[name]
        if kind == "BlockStored" and draw(st.integers(0, 5)) == 0:
            event["cache_salt"] = draw(st.sampled_from([None, "salt"]))
        if kind == "BlockStored" and draw(st.integers(0, 5)) == 0:
            event["block_mm_infos"] = draw(st.sampled_from([None, [], [None]]))
        if draw(st.integers(0, 4)) == 0:
            event[draw(st.sampled_from(["locality", "kv_cache_spec_sliding_window", "zzz"]))] = draw(ANY)
        return event
    # Arrays carry every declared field (or fewer: an older engine), sometimes more (a newer one).
    values = [fields[name] for name in order]
    keep = draw(st.integers(0, len(values))) if draw(st.integers(0, 3)) == 0 else len(values)
    values = values[:keep]
    if draw(st.integers(0, 4)) == 0:
        values += draw(st.lists(ANY, min_size=1, max_size=2))
    return [kind, *values]


@st.composite
def engine_batch(draw: st.DrawFn) -> bytes:
    events = draw(st.lists(engine_event(), max_size=4))
    ts = draw(st.one_of(st.floats(), st.integers(0, 2**31)))
    shape = draw(st.sampled_from(["three", "three", "two", "map"]))
    rank = draw(st.one_of(st.none(), st.integers(-2, 3), st.just(2**40)))
    if shape == "two":
        return encode([ts, events])
    if shape == "map":
        return encode({"ts": ts, "events": events, "data_parallel_rank": rank})
    return encode([ts, events, rank])


# ---------------------------------------------------------------------- decoding
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=engine_batch(), namespace=st.sampled_from([None, "tenant-a"]))
def test_c_and_python_decode_every_form_alike(payload: bytes, namespace: str | None) -> None:
    _check(payload, namespace=namespace)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=engine_batch(), data=st.data())
def test_c_and_python_follow_the_salts_of_salted_blocks_alike(payload: bytes, data: st.DataObject) -> None:
    # Salts held for some of the hashes the batch names (parents, stored and removed blocks), or none.
    named = []
    for event in _events_of(payload):
        for key in ("block_hashes", "parent_block_hash"):
            value = event.get(key) if isinstance(event, dict) else None
            values = value if isinstance(value, list) else [value]
            named += [fold_hash(v) for v in values if isinstance(v, int | bytes) and not isinstance(v, bool)]
    held = data.draw(st.lists(st.sampled_from(named), max_size=4) if named else st.just([]))
    salts = {block_hash: data.draw(st.sampled_from(["tenant-X", "tenant-Y"])) for block_hash in held}
    _check(payload, salts=salts)
    _check(payload, salts={})


def _events_of(payload: bytes) -> list[Any]:
    try:
        batch = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return []
    events = batch.get("events") if isinstance(batch, dict) else batch[1] if isinstance(batch, list) else None
    return events if isinstance(events, list) else []


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=engine_batch(), cut=st.integers(0, 64), flip=st.integers(0, 255))
def test_truncated_and_corrupted_batches_decode_alike(payload: bytes, cut: int, flip: int) -> None:
    if payload:
        _check(payload[: max(0, len(payload) - cut)])
        index = flip % len(payload)
        _check(payload[:index] + bytes([payload[index] ^ 0xFF]) + payload[index + 1 :])
    _check(payload + b"\x00")


@pytest.mark.parametrize("hashes", [[], [5, 6]])
@pytest.mark.parametrize("block_size", [0, BLOCK])
def test_a_token_less_lower_tier_store_is_left_by_c_to_python_which_reads_an_offload(
    hashes: list[int], block_size: int
) -> None:
    """vLLM's OffloadingConnector's stores (CPU, ``token_ids=[]``, block size 0): never a block size
    mismatch, nor an empty store in C (Python's `EngineOffloaded` is resolved by the receiver)."""
    stored = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": [],
              "block_size": block_size, "lora_id": None, "medium": "CPU", "lora_name": None}  # fmt: skip
    array = ["BlockStored", hashes, None, [], block_size, None, "CPU", None]
    for event in (stored, array):
        payload = encode([1.0, [event], 0])
        assert not _check(payload)
        decoded = python_decode_engine_batch(payload, BLOCK)
        assert decoded.events == [EngineOffloaded(hashes, StorageTier.HOST_PINNED, BLOCK)] and not decoded.errors


def test_every_vector_is_taken_by_c_or_named_by_python(shared_dir: Path) -> None:
    vectors = json.loads((shared_dir / "vectors" / "vllm_kv_events.json").read_text())["vectors"]
    taken = {vector["name"]: _check(bytes.fromhex(vector["payload_hex"])) for vector in vectors}
    # The plain shapes run in C; the bytes-hash vector names a LoRA adapter, whose salt Python computes.
    assert taken == {
        "vllm_current_map_events_int_hashes": True,
        "vllm_legacy_array_events_int_hashes": True,
        "vllm_v0_9_0_minimal": True,
        "vllm_current_map_events_bytes_hashes": False,
    }


def _plain_stored(hashes: list[Any], parent: Any = None, **extra: Any) -> dict[str, Any]:
    tokens = list(range(len(hashes) * BLOCK))
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None, **extra}  # fmt: skip


@pytest.mark.parametrize(
    "events",
    [
        [_plain_stored([1, 2**64 - 1, 3])],
        [_plain_stored([-1, -(2**63)], parent=b"\x01" * 32)],
        [_plain_stored([b"\xff" * 32, b"\x02"], kv_cache_spec_kind="full_attention")],
        [_plain_stored([5], kv_cache_spec_kind="sliding_window"), {"type": "AllBlocksCleared"}],
        [{"type": "BlockRemoved", "block_hashes": [7, -7, b"\x07"], "medium": "CPU"}],
        [["BlockStored", [1, 2], None, list(range(2 * BLOCK)), BLOCK, None, "DISK", None, None, None, None, None]],
        [["BlockRemoved", [1]], ["AllBlocksCleared"]],
        # vLLM 0.32's unsalted store: an extra_keys entry per block, all nil.
        [_plain_stored([1, 2], extra_keys=[None, None], group_idx=0, kv_cache_spec_kind="full_attention")],
    ],
)
def test_the_plain_shapes_run_in_c(events: list[Any]) -> None:
    assert _check(encode([1.5, events, 0]))


@pytest.mark.parametrize(
    ("events", "reason"),
    [
        ([_plain_stored([1, 1])], "repeated_hash"),
        ([_plain_stored([1, 2], parent=2)], "repeated_hash"),
        ([{**_plain_stored([1, 2]), "block_size": 8}], "block_size_mismatch"),
        ([{**_plain_stored([1, 2]), "token_ids": [0, 1, 2]}], "short_token_ids"),
        ([{**_plain_stored([1]), "token_ids": [[1, 2, 3]] * BLOCK}], "unsupported_token_ids"),
        ([{**_plain_stored([1]), "token_ids": [[1, 2]] * BLOCK}], "bad_token_ids"),  # bigrams that do not chain
        ([{**_plain_stored([1]), "token_ids": ["x"] * BLOCK}], "string_token_ids"),
        ([{**_plain_stored([1]), "block_hashes": [1.5]}], "bad_event"),
        ([{"type": "Nope"}], "unknown_event_type"),
    ],
)
def test_c_leaves_every_error_to_python_which_names_it(events: list[Any], reason: str) -> None:
    payload = encode([1.5, events, 0])
    assert not _check(payload)
    assert [error.reason for error in decode_engine_batch(payload, BLOCK).errors] == [reason]


# ---------------------------------------------------------------------- held blocks
WIDE_HASHES = st.sampled_from([2**63, 2**64 - 1, -1, True])  # the last two: not u64 ints
OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "store", "remove", "clear"]),
        st.integers(0, 1),  # dp rank
        st.sampled_from([StorageTier.DEVICE, StorageTier.HOST_PINNED]),
        st.one_of(st.none(), st.integers(0, 12), WIDE_HASHES),  # parent
        # Block hashes: short chains of a few values (parents found, repeats), and long ones past the
        # C step's 64 on its stack, with hashes outside u64 (left to the generic tests) among them.
        st.lists(st.integers(0, 12), max_size=4)
        | st.lists(st.integers(0, 12) | WIDE_HASHES, min_size=60, max_size=70)
        | st.lists(st.integers(0, 2**64 - 1), min_size=60, max_size=70, unique=True),
    ),
    max_size=40,
)


def _run(ops: list[Any], native: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ...]:
    monkeypatch.setattr(held_blocks, "NATIVE", native)
    held = held_blocks.HeldBlocks(7)
    outcomes: list[str | None] = []
    for op, rank, tier, parent, hashes in ops:
        if op == "store":
            try:
                held.store(rank, tier, parent, hashes, [(h * 31 + 1) % 2**64 for h in hashes])
                outcomes.append(None)
            except KvIndexError as exc:
                outcomes.append(f"{type(exc).__name__}: {exc}")
        elif op == "remove":
            held.remove(rank, tier, hashes)
        else:
            held.clear(rank, tier)
    dump = [(e.event.dp_rank, e.storage_tier, e.event.stored) for e in held.dump_events()]
    return outcomes, dict(held._held), dump


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_held_blocks_store_and_drop_alike_in_c_and_python(ops: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    assert _run(ops, True, monkeypatch) == _run(ops, False, monkeypatch)


def test_hold_chain_refuses_mismatched_columns_as_python_does() -> None:
    with pytest.raises(ValueError, match="2 block hashes but 1 tokens hashes"):
        held_blocks.HeldBlocks(1).store(0, StorageTier.DEVICE, None, [1, 2], [3])
    stored = decode_engine_batch(encode([1.5, [_plain_stored([9])], 0]), BLOCK).events[0]
    assert isinstance(stored, EngineStored) and stored.tier is StorageTier.DEVICE


class _Key:
    """A block hash of a chosen hash, equal only to itself."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __hash__(self) -> int:
        return self.value

    def __eq__(self, other: object) -> bool:
        return self is other


class _Emptying(_Key):
    """A held key whose comparison (on a hash collision) empties the lists of the call under way."""

    lists: ClassVar[list[list[Any]]] = []

    __hash__ = _Key.__hash__

    def __eq__(self, other: object) -> bool:
        for emptied in self.lists:
            emptied.clear()
        gc.collect()
        return False


def test_drop_blocks_reads_hashes_that_a_key_empties_as_python_pops_them() -> None:
    """The C loop read the list's items after a key's `__eq__` freed them (a crash, or pops of freed
    objects); now it stops where the list ends, as Python's `map(held.pop, ...)` does."""

    def case() -> tuple[dict[Any, Any], list[Any]]:
        hashes = [_Key(1000 + i) for i in range(40)]
        trap = _Emptying(1005)
        _Emptying.lists = [hashes]
        held: dict[Any, Any] = {trap: (None, 0), **{key: (None, 1) for key in hashes[:3]}, hashes[20]: (None, 2)}
        return held, hashes

    held, hashes = case()
    events_native.drop_blocks(held, hashes)
    python_held, python_hashes = case()
    deque(map(python_held.pop, python_hashes, repeat(None, len(python_hashes))), maxlen=0)
    assert len(held) == len(python_held) == 2 and hashes == python_hashes == []


def test_hold_chain_keeps_the_chain_it_was_given_when_a_key_empties_its_lists() -> None:
    """A held key's `__eq__` emptying the lists while the chain is recorded: the C code read past the
    emptied lists (a crash); it now records the chain as it was given."""
    hashes = [_Key(1000 + i) for i in range(40)]
    tokens = list(range(40))
    given = list(hashes)
    held: dict[Any, Any] = {_Emptying(1005): (None, 0)}
    _Emptying.lists = [hashes, tokens]
    assert events_native.hold_chain(held, None, hashes, tokens, False) == 0
    assert hashes == tokens == []
    assert [held[key] for key in given] == [(None if i == 0 else given[i - 1], i) for i in range(40)]


def _capture(shared_dir: Path, name: str) -> bytes:
    frames = json.loads((shared_dir / "vectors" / "real-engines" / name).read_text())["frames_hex"]
    return bytes.fromhex(frames[-1])


def test_real_vllm_captures_run_in_c_and_a_salted_one_is_salted_by_python(shared_dir: Path) -> None:
    for name in ("5557_BlockStored.json", "5567_BlockStored.json", "5557_BlockRemoved.json"):
        assert _check(_capture(shared_dir, name), block_size=32)
    # vLLM 0.32 carries a request's cache_salt in extra_keys of its first block: both decoders hash the
    # blocks in the salt's namespace, as a request with that cache_salt is hashed.
    salted = _capture(shared_dir, "5557_BlockStored_cache_salt.json")
    assert _check(salted, block_size=32) and _check(salted, block_size=32, salts={})
    salts: dict[int, str] = {}
    (_, stored) = python_decode_engine_batch(salted, 32, salts=salts).events
    assert isinstance(stored, EngineStored)
    tokens = msgspec.msgpack.decode(salted)[1][1]["token_ids"]
    assert stored.tokens_hashes == compute_block_hashes(tokens, 32, cache_namespace="tenant-X")
    assert stored.tokens_hashes != compute_block_hashes(tokens, 32)
    assert salts == dict.fromkeys(stored.block_hashes, "tenant-X")
    # A later store under a salted block (its keys nil: vLLM names the salt on the first block only)
    # is salted alike, by the salts the stream keeps.
    child = {**_plain_stored([77], parent=stored.block_hashes[-1]), "extra_keys": [None]}
    payload = encode([1.5, [child], 0])
    assert _check(payload, salts=salts)
    (continued,) = decode_engine_batch(payload, BLOCK, salts=salts).events
    assert isinstance(continued, EngineStored)
    assert continued.tokens_hashes == compute_block_hashes(list(range(BLOCK)), BLOCK, cache_namespace="tenant-X")
    assert salts[77] == "tenant-X"
    removal = {"type": "BlockRemoved", "block_hashes": [77, *stored.block_hashes], "medium": "GPU"}
    assert _check(encode([1.5, [removal], 0]), salts=salts)
    decode_engine_batch(encode([1.5, [removal], 0]), BLOCK, salts=salts)
    # Kept: the engine may hold another copy; the stream forgets them with the last (test_engine_direct).
    assert set(salts) == {77, *stored.block_hashes}


def test_a_lone_string_in_the_keys_of_a_block_under_a_parent_is_no_salt() -> None:
    # vLLM salts a request's first block only (no parent); under one, a lone string is a multimodal
    # identifier (an image in a later block): the block is hashed as its parent's, unsalted here.
    image = {**_plain_stored([78], parent=500), "extra_keys": [["image-sha256-0f3a"]]}
    payload = encode([1.5, [image], 0])
    salts: dict[int, str] = {}
    assert _check(payload, salts=salts)
    (stored,) = decode_engine_batch(payload, BLOCK, salts=salts).events
    assert isinstance(stored, EngineStored)
    assert stored.tokens_hashes == compute_block_hashes(list(range(BLOCK)), BLOCK)
    assert salts == {}


def _salted(hashes: list[int], parent: int | None = None, salt: str | None = "tenant-X") -> dict[str, Any]:
    keys: list[Any] = [None] * len(hashes)
    if salt is not None:
        keys[0] = [salt]
    return _plain_stored(hashes, parent=parent, extra_keys=keys)


_REMOVE_P = {"type": "BlockRemoved", "block_hashes": [500], "medium": "GPU"}


@pytest.mark.parametrize(
    ("events", "taken_by_c"),
    [
        ([_salted([1], parent=500, salt=None), _REMOVE_P, _salted([2], parent=500, salt=None)], True),
        ([_REMOVE_P, _salted([1], parent=500, salt=None)], True),
        ([{"type": "AllBlocksCleared"}, _salted([1], parent=500, salt=None)], True),
        ([_salted([1, 2], salt="tenant-Y"), _salted([3], parent=2, salt=None)], True),
        ([_salted([3], parent=1, salt=None), _salted([1], salt="tenant-Y")], True),
        ([_salted([1], salt="tenant-Y"), _REMOVE_P, _plain_stored([9], lora_name="adapter")], False),
        ([_salted([1], salt="")], False),
        ([_plain_stored([1], extra_keys=[["adapter", "tenant-X"]])], False),
    ],
)
def test_salts_change_in_batch_order_and_only_when_c_takes_the_batch(events: list[Any], taken_by_c: bool) -> None:
    # Block 500 is held salted before the batch; what each event sees is what the ones before it left.
    assert _check(encode([1.5, events, 0]), salts={500: "tenant-X", 7: "tenant-Y"}) is taken_by_c


POOL = st.integers(1, 12)  # few hashes: parents, removals and salts meet


@st.composite
def vllm_032_batch(draw: st.DrawFn) -> bytes:
    """vLLM 0.32's plain batches with salted requests: stores (salted or not) under blocks of the pool,
    removals and clears, in any order."""
    events: list[Any] = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["store", "store", "store", "remove", "clear"]))
        if kind == "store":
            hashes = draw(st.lists(POOL, min_size=1, max_size=3, unique=True))
            parent = draw(st.one_of(st.none(), st.sampled_from([h for h in range(1, 13) if h not in hashes])))
            events.append(_salted(hashes, parent=parent, salt=draw(st.sampled_from([None, None, "tenant-X", "b"]))))
        elif kind == "remove":
            events.append({"type": "BlockRemoved", "block_hashes": draw(st.lists(POOL, max_size=3)), "medium": "GPU"})
        else:
            events.append({"type": "AllBlocksCleared"})
    return encode([1.5, events, 0])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=vllm_032_batch(), held=st.dictionaries(POOL, st.sampled_from(["tenant-X", "b"]), max_size=6))
def test_c_takes_vllm_salted_batches_and_follows_their_salts_as_python_does(
    payload: bytes, held: dict[int, str]
) -> None:
    assert _check(payload, salts=held)
    assert _check(payload)

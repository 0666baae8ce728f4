"""The engine decoder on the exact payloads of shared/vectors/vllm_kv_events.json, and on garbage; the
bridge's template encoding of the removals it publishes."""

from __future__ import annotations

import contextlib
import itertools
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.engine_events import (
    EngineCleared,
    EngineDecodeError,
    EngineRemoved,
    EngineStored,
    decode_engine_batch,
    fold_hash,
    python_decode_engine_batch,
    storage_tier,
)
from indexer.events import RemovedEventEncoder, RouterEvent, StorageTier, encode_router_events, removed_event
from indexer.hashing import compute_block_hashes

encode = msgspec.msgpack.encode


def _vectors(shared_dir: Path) -> list[dict[str, Any]]:
    vectors: list[dict[str, Any]] = json.loads((shared_dir / "vectors" / "vllm_kv_events.json").read_text())["vectors"]
    return vectors


def _expected(vector: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for routed in vector["dynamo_router_events_derived"]:
        data = routed["event"]["data"]
        if data == "cleared":
            out.append(EngineCleared())
        elif "removed" in data:
            out.append(EngineRemoved(data["removed"]["block_hashes"], StorageTier.DEVICE))
        else:
            stored = data["stored"]
            hashes = [b["block_hash"] for b in stored["blocks"]]
            tokens_hashes = [b["tokens_hash"] for b in stored["blocks"]]
            out.append(EngineStored(stored["parent_hash"], hashes, tokens_hashes, StorageTier.DEVICE, 4))
    return out


def test_every_vector_form_decodes_to_dynamos_router_events(shared_dir: Path) -> None:
    vectors = {v["name"]: v for v in _vectors(shared_dir)}
    assert len(vectors) == 4
    for name in ("vllm_current_map_events_int_hashes", "vllm_legacy_array_events_int_hashes", "vllm_v0_9_0_minimal"):
        vector = vectors[name]
        batch = decode_engine_batch(bytes.fromhex(vector["payload_hex"]), 4)
        assert batch.errors == [] and batch.ignored == 0
        assert batch.events == _expected(vector), name
        assert batch.ts == 1700000000.5
    assert decode_engine_batch(bytes.fromhex(vectors["vllm_v0_9_0_minimal"]["payload_hex"]), 4).dp_rank is None
    assert (
        decode_engine_batch(bytes.fromhex(vectors["vllm_current_map_events_int_hashes"]["payload_hex"]), 4).dp_rank == 0
    )


def test_byte_hashes_fold_to_their_last_8_bytes_and_lora_salts_the_tokens_hash(shared_dir: Path) -> None:
    vector = next(v for v in _vectors(shared_dir) if v["name"] == "vllm_current_map_events_bytes_hashes")
    batch = decode_engine_batch(bytes.fromhex(vector["payload_hex"]), 4)
    assert batch.dp_rank == 1
    stored, removed, cleared = batch.events
    assert isinstance(stored, EngineStored) and isinstance(removed, EngineRemoved)
    assert stored.block_hashes == vector["u64_block_hashes"][0]
    assert stored.parent_hash == vector["dynamo_router_events_derived"][0]["event"]["data"]["stored"]["parent_hash"]
    assert removed.block_hashes == vector["u64_block_hashes"][1]
    assert cleared == EngineCleared()
    # The event names lora_name "my-adapter": its blocks hash as a request naming that adapter does
    # (the vector's derived tokens_hash leaves the LoRA salt out; Dynamo's convert.rs salts it).
    tokens = vector["decoded_msgpack_tree"][1][0]["token_ids"]
    assert stored.tokens_hashes == compute_block_hashes(tokens, 4, lora_name="my-adapter")
    assert stored.tokens_hashes != compute_block_hashes(tokens, 4)


@given(st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1))
def test_int_hashes_fold_bitwise(value: int) -> None:
    folded = fold_hash(value)
    assert 0 <= folded < 1 << 64
    assert folded.to_bytes(8, "big") == (value % (1 << 64)).to_bytes(8, "big")


@given(st.binary(min_size=1, max_size=40))
def test_byte_hashes_fold_as_vllm_converts_them(digest: bytes) -> None:
    assert fold_hash(digest) == int.from_bytes(digest, "big") & ((1 << 64) - 1)


def test_media_map_to_tiers_and_unknown_media_are_never_gpu() -> None:
    assert storage_tier(None) is StorageTier.DEVICE
    assert storage_tier("GPU") is StorageTier.DEVICE
    assert storage_tier("cpu") is StorageTier.HOST_PINNED
    assert storage_tier("DISK") is StorageTier.DISK
    assert storage_tier("STORAGE") is StorageTier.DISK
    assert storage_tier("REMOTE") is StorageTier.EXTERNAL
    assert storage_tier("LMCACHE_SOMETHING") is StorageTier.EXTERNAL


def _stored(**fields: Any) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                             "token_ids": list(range(8)), "block_size": 4}  # fmt: skip
    event.update(fields)
    return event


def _bigrams(tokens: list[int]) -> list[list[int]]:
    """SGLang's EAGLE cache keys: each token paired with the next."""
    return [[first, second] for first, second in itertools.pairwise(tokens)]


def test_eagle_bigram_stores_hash_as_dynamo_hashes_eagle_blocks(shared_dir: Path) -> None:
    """SGLang with EAGLE speculative decoding sends bigram token ids; each block's hash window then spans
    the first token of the next block: Dynamo's hashes of the same tokens with ``is_eagle``."""
    cases = json.loads((shared_dir / "vectors" / "dynamo_hash_vectors.json").read_text())["cases"]
    eagle = [case for case in cases if case["is_eagle"]]
    assert len(eagle) >= 4
    for case in eagle:
        size, expected = case["kv_block_size"], case["block_hashes"]
        hashes = [-(index + 1) for index in range(len(expected))]  # SGLang's signed i64 hashes
        event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "block_size": size,
                 "token_ids": _bigrams(case["tokens"]), "lora_name": case["lora_name"]}  # fmt: skip
        (stored,) = decode_engine_batch(encode([0.0, [event], 0]), size).events
        assert isinstance(stored, EngineStored)
        assert stored.tokens_hashes == expected, case["name"]
        assert stored.block_hashes == [hash_ & (2**64 - 1) for hash_ in hashes]


def test_sglang_salt_namespace_and_mm_infos_enter_the_tokens_hash() -> None:
    tokens = list(range(8))
    # SGLang 0.5.18: a {"cache_salt"} map in the array's lora_name slot.
    array = ["BlockStored", [1, 2], None, tokens, 4, None, "GPU", {"cache_salt": "tenant-a"}]
    (salted,) = decode_engine_batch(encode([0.0, [array], 0]), 4).events
    assert isinstance(salted, EngineStored)
    assert salted.tokens_hashes == compute_block_hashes(tokens, 4, cache_namespace="tenant-a")
    (mapped,) = decode_engine_batch(encode([0.0, [_stored(cache_salt="tenant-a")], 0]), 4).events
    assert mapped == salted
    (spaced,) = decode_engine_batch(encode([0.0, [_stored()], 0]), 4, cache_namespace="tenant-a").events
    assert spaced == salted
    infos = [{"mm_objects": [{"mm_hash": 99, "offsets": [[0, 2]]}]}, None]
    (mm,) = decode_engine_batch(encode([0.0, [_stored(block_mm_infos=infos)], 0]), 4).events
    assert isinstance(mm, EngineStored)
    assert mm.tokens_hashes == compute_block_hashes(tokens, 4, block_mm_infos=infos)


def test_non_attention_groups_are_ignored_and_a_map_envelope_is_accepted() -> None:
    payload = encode({"ts": 1.0, "events": [_stored(kv_cache_spec_kind="sliding_window"), _stored()],
                      "data_parallel_rank": 3})  # fmt: skip
    batch = decode_engine_batch(payload, 4)
    assert batch.ignored == 1 and len(batch.events) == 1 and batch.dp_rank == 3


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        ({"type": "BlockUpdated", "block_hashes": [1]}, "unknown_event_type"),
        (["Mystery", 1], "unknown_event_type"),
        (_stored(block_size=16), "block_size_mismatch"),
        (_stored(token_ids=[1, 2, 3]), "short_token_ids"),
        (_stored(token_ids=[[1, 2, 3]] * 8), "unsupported_token_ids"),
        (_stored(token_ids=[[1, 2]] * 8), "bad_token_ids"),  # bigrams that do not chain
        (_stored(token_ids=[[t, t + 1] for t in range(7)]), "short_token_ids"),  # EAGLE: 2 blocks need 9 ids
        (_stored(token_ids=[-1] * 8), "bad_token_ids"),
        (_stored(token_ids=[1, 2, "<image>", 4, 5, 6, 7, 8]), "string_token_ids"),  # TensorRT-LLM's int | str
        (_stored(block_hashes=[1, 1]), "repeated_hash"),
        (_stored(parent_block_hash=2), "repeated_hash"),
        (_stored(block_hashes="nope"), "bad_event"),
        (7, "bad_event"),
    ],
)
def test_a_bad_event_is_skipped_with_its_reason_and_the_others_kept(event: Any, reason: str) -> None:
    batch = decode_engine_batch(encode([0.0, [event, {"type": "AllBlocksCleared"}], 0]), 4)
    assert [error.reason for error in batch.errors] == [reason]
    assert batch.events == [EngineCleared()]


@pytest.mark.parametrize(
    ("payload", "reason"),
    [(b"", "empty_payload"), (b"\xc1", "bad_envelope"), (encode([1.0]), "bad_envelope"),
     (encode("hello"), "bad_envelope"), (encode({"events": []}), "bad_envelope")],
)  # fmt: skip
def test_a_bad_envelope_raises_one_typed_error(payload: bytes, reason: str) -> None:
    with pytest.raises(EngineDecodeError) as caught:
        decode_engine_batch(payload, 4)
    assert caught.value.reason == reason


@pytest.mark.parametrize("rank", [-1, 2**32, 2**40])
def test_a_dp_rank_outside_u32_is_a_bad_envelope_on_both_paths(rank: int) -> None:
    # Passed through, it would make routers refuse the whole NATS message it is joined into.
    payload = encode([0.0, [{"type": "AllBlocksCleared"}], rank])
    for decode in (decode_engine_batch, python_decode_engine_batch):
        with pytest.raises(EngineDecodeError) as caught:
            decode(payload, 4)
        assert caught.value.reason == "bad_envelope"
    assert decode_engine_batch(encode([0.0, [], 2**32 - 1]), 4).dp_rank == 2**32 - 1


# Nesting past msgspec's depth, where the envelope is read, inside an event and inside its token ids.
_TS = b"\xcb" + bytes(8)
_DEEP = b"\x91" * 100_000
_STORED_HEAD = b"\x83\xa4type\xabBlockStored\xacblock_hashes\x91\x01\xa9token_ids"


@pytest.mark.parametrize(
    ("payload", "reasons"),
    [
        (b"\x93" + _TS + _DEEP, {"bad_envelope"}),
        (b"\x81\xa1x" * 50_000, {"bad_envelope"}),
        (b"\x93" + _TS + b"\x91" + _DEEP, {"bad_envelope", "bad_event"}),
        (b"\x92" + _TS + b"\x91" + _STORED_HEAD + _DEEP, {"bad_envelope", "bad_event"}),
    ],
    ids=["envelope", "map-envelope", "event", "token-ids"],
)
def test_nesting_past_msgspecs_depth_is_a_decode_error_not_a_recursion_error(payload: bytes, reasons: set[str]) -> None:
    for decode in (decode_engine_batch, python_decode_engine_batch):
        try:
            batch = decode(payload, 4)
        except EngineDecodeError as exc:
            assert exc.reason in reasons and "recursion" in exc.detail
        else:
            assert [error.reason for error in batch.errors] == ["bad_event"] and not batch.events


@given(st.binary(max_size=200))
def test_garbage_never_escapes_as_anything_but_a_decode_error(payload: bytes) -> None:
    with contextlib.suppress(EngineDecodeError):
        decode_engine_batch(payload, 4)


_TOKEN = st.integers(0, 2**32 - 1)
_EVENTS = st.one_of(
    st.builds(
        lambda hashes, tokens, medium, salt: _stored(
            block_hashes=hashes, token_ids=tokens, medium=medium, **({"cache_salt": salt} if salt else {})
        ),
        st.lists(st.integers(0, 2**64 - 1) | st.integers(-(2**63), -1), min_size=1, max_size=3, unique=True),
        st.lists(_TOKEN, min_size=8, max_size=13) | st.lists(st.lists(_TOKEN, max_size=2), max_size=8),
        st.sampled_from([None, "GPU", "cpu", "disk"]),
        st.sampled_from([None, "tenant-a"]),
    ),
    st.builds(lambda hashes: {"type": "BlockRemoved", "block_hashes": hashes}, st.lists(st.integers(0, 2**64 - 1))),
    st.just({"type": "AllBlocksCleared"}),
    st.just({"type": "Nonsense"}),
    st.builds(lambda tokens: _stored(token_ids=tokens), st.lists(st.integers(-5, 2**33), min_size=8, max_size=8)),
)


@given(st.lists(_EVENTS, max_size=6), st.none() | st.integers(0, 3))
def test_the_one_decode_of_a_whole_batch_reads_what_the_event_by_event_decode_reads(
    events: list[dict[str, Any]], dp_rank: int | None
) -> None:
    # An array envelope of map events is decoded in one go when it can be, a map envelope event by
    # event: the answers, errors included, are the same.
    whole = decode_engine_batch(encode([1.5, events, dp_rank]), 4)
    one_by_one = decode_engine_batch(encode({"ts": 1.5, "events": events, "data_parallel_rank": dp_rank}), 4)
    assert whole.events == one_by_one.events
    assert [(e.reason, e.detail) for e in whole.errors] == [(e.reason, e.detail) for e in one_by_one.errors]
    assert (whole.ts, whole.dp_rank, whole.ignored) == (one_by_one.ts, one_by_one.dp_rank, one_by_one.ignored)


U64_EDGES = st.sampled_from([0, 1, 127, 128, 255, 256, 2**16 - 1, 2**16, 2**32 - 1, 2**32, 2**63, 2**64 - 1])


@settings(max_examples=300, deadline=None)
@given(
    worker=st.sampled_from([0, 7, 2**64 - 1, 2**64 - 2, 2**64 - 3]) | st.integers(0, 2**64 - 1),
    event_id=U64_EDGES | st.integers(1, 2**64 - 1) | st.integers(2**64, 2**65),
    dp_rank=st.sampled_from([0, 1, 2**32 - 1]) | st.integers(0, 2**32 - 1),
    tier=st.sampled_from(list(StorageTier)),
    hashes=st.lists(U64_EDGES | st.integers(0, 2**64 - 1), max_size=40),
)
def test_the_removed_event_encoder_writes_what_msgspec_writes(
    worker: int, event_id: int, dp_rank: int, tier: StorageTier, hashes: list[int]
) -> None:
    encoder = RemovedEventEncoder(worker)
    try:
        expected = encode_router_events(
            RouterEvent(worker, removed_event(event_id, hashes, dp_rank=dp_rank), tier), msgpack=True
        )
    except ValueError:
        with pytest.raises(ValueError):
            encoder.encode(event_id, dp_rank, tier, hashes)
        return
    assert encoder.encode(event_id, dp_rank, tier, hashes) == expected
    assert encoder.encode(event_id, dp_rank, tier, hashes) == expected  # from the template kept

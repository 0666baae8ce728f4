"""Engine KV events (vLLM, SGLang, TensorRT-LLM over ZMQ) decoded into our events' terms.

An engine publishes one msgpack batch per scheduler step (``shared/reference/engine-events.md``):
``[ts, events, data_parallel_rank]`` (vLLM 0.9: ``[ts, events]``; a map envelope is accepted too).
Each event is a *tagged map* (current vLLM, SGLang after #37482, TRT-LLM) or a *tagged array* (vLLM
<= 0.23, older SGLang); the two cannot share one msgspec union, so every event is kept raw and
dispatched on its first byte.

What comes out, per event, is what our ``RouterEvent``s carry:

- block hashes folded to u64: ints modulo 2^64 (SGLang's signed i64 and vLLM 0.9's negative
  ``hash()`` reinterpreted bitwise), byte digests by their last 8 bytes big-endian (vLLM's own
  ``maybe_convert_block_hash``);
- ``tokens_hash`` recomputed from ``token_ids`` with our block hashing (`indexer.hashing`): the
  LoRA name and the cache salt salt it (the salt is our cache namespace, as a request's
  ``cache_salt`` is), Dynamo's ``block_mm_infos`` add multimodal hashes. SGLang names the salt in
  every event; vLLM (0.32) only in ``extra_keys`` of a request's first block, so the blocks stored
  later under a salted block are salted alike: the caller passes, per engine stream, a ``salts`` dict
  (block hash -> salt of the salted blocks the engine holds) that decoding adds to and a clear
  empties; a removal leaves it to the caller (vLLM evicts each copy of a block alone: the salt goes
  with the last one, which only the caller's count of copies tells);
- ``medium`` mapped to a `StorageTier` as Dynamo maps it, except that an unknown medium counts as the
  lowest tier rather than as GPU memory;
- ``AllBlocksCleared`` as `EngineCleared`.

Bad input never raises out of `decode_engine_batch`: an envelope that does not decode is one
`EngineDecodeError`, an event that does not is skipped and reported beside the others, each with a
``reason`` that callers count.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import msgspec

from indexer.errors import UNDECODABLE, EventDecodeError
from indexer.events import U32, U64_MAX, KvCacheEvent, StorageTier, cleared_event, removed_event, stored_event
from indexer.events_native import ENABLED as EVENTS_NATIVE
from indexer.events_native import accel as events_accel
from indexer.hashing import compute_block_hashes, salt_seed
from indexer.native import ENABLED as NATIVE
from indexer.native import accel, declined

__all__ = [
    "DecodedBatch",
    "EngineCleared",
    "EngineDecodeError",
    "EngineEvent",
    "EngineOffloaded",
    "EngineRemoved",
    "EngineStored",
    "decode_engine_batch",
    "event_tier",
    "fold_hash",
    "python_decode_engine_batch",
    "resolve_offloaded",
    "storage_tier",
    "stored_block_size",
    "to_kv_event",
]


class EngineDecodeError(EventDecodeError):
    """An engine payload or one of its events that could not be used; ``reason`` labels it in metrics."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class EngineStored(NamedTuple):
    """Blocks stored under ``parent_hash``: the engine's block hashes and our tokens hashes, one each
    per block in two lists (no object per block on the bridge's path)."""

    parent_hash: int | None
    block_hashes: list[int]
    tokens_hashes: list[int]
    tier: StorageTier
    block_size: int


class EngineRemoved(NamedTuple):
    block_hashes: list[int]
    tier: StorageTier


class EngineCleared(NamedTuple):
    pass


class EngineOffloaded(NamedTuple):
    """Blocks copied to a lower tier without their token ids (vLLM's OffloadingConnector stores
    ``token_ids=[]``, ``block_size`` 0): blocks the rank stored with their tokens before, whose tokens
    hashes the receiver resolves from what the rank holds on the device tier (`resolve_offloaded`)."""

    block_hashes: list[int]
    tier: StorageTier
    block_size: int


EngineEvent = EngineStored | EngineRemoved | EngineCleared | EngineOffloaded


class DecodedBatch(NamedTuple):
    ts: float
    dp_rank: int | None  # None: the engine did not say (vLLM 0.9); the transport's rank applies
    events: list[EngineEvent]
    errors: list[EngineDecodeError]  # events skipped, in order
    ignored: int  # events of non-attention KV groups (hybrid models), dropped as Dynamo drops them
    eagle_stores: int = 0  # stores among ``events`` whose token ids came as EAGLE bigrams


def to_kv_event(event: EngineStored | EngineRemoved | EngineCleared, event_id: int, dp_rank: int) -> KvCacheEvent:
    """The numbered event of one rank's stream that ``event`` becomes (an offload once resolved)."""
    if isinstance(event, EngineStored):
        blocks = zip(event.block_hashes, event.tokens_hashes, strict=True)
        return stored_event(event_id, blocks, parent_hash=event.parent_hash, dp_rank=dp_rank)
    if isinstance(event, EngineRemoved):
        return removed_event(event_id, event.block_hashes, dp_rank=dp_rank)
    return cleared_event(event_id, dp_rank=dp_rank)


def event_tier(event: EngineEvent) -> StorageTier:
    return StorageTier.DEVICE if isinstance(event, EngineCleared) else event.tier


def resolve_offloaded(
    event: EngineOffloaded, held: Callable[[int], tuple[int | None, int] | None]
) -> tuple[list[EngineStored], list[int]]:
    """The stores in the offload's tier that its hashes become, given ``held``: a device block's
    ``(parent hash, tokens hash)`` on the rank (None: not held). A lower tier keeps continuation edges
    from a device parent, so each block goes under its device parent, one store per run that chains;
    the hashes not held are returned (skipped: no tokens hash to key them by)."""
    stores: list[EngineStored] = []
    unresolved: list[int] = []
    for block_hash in event.block_hashes:
        found = held(block_hash)
        if found is None:
            unresolved.append(block_hash)
            continue
        parent, tokens_hash = found
        if stores and stores[-1].block_hashes[-1] == parent:
            stores[-1].block_hashes.append(block_hash)
            stores[-1].tokens_hashes.append(tokens_hash)
        else:
            stores.append(EngineStored(parent, [block_hash], [tokens_hash], event.tier, event.block_size))
    return stores, unresolved


# ---------------------------------------------------------------------- wire shapes
Hash = int | bytes
# Kept raw: the C accelerator packs a plain array of u32 ids straight to bytes for hashing, without
# an int object per token (they were most of the decoding); otherwise `_token_ids` decodes them.
TokenIds = msgspec.Raw
_NO_TOKENS = msgspec.Raw(b"\x90")  # []
_token_ids = msgspec.msgpack.Decoder(list[int])
# SGLang with EAGLE speculative decoding keys its cache by bigrams: token i paired with token i + 1.
_bigram_ids = msgspec.msgpack.Decoder(list[tuple[int, int]])


class _ArrayBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: U32 | None = None  # a rank past u32 would make routers refuse whole messages


class _MapBatch(msgspec.Struct):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: U32 | None = None


class _StoredMap(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None = None
    token_ids: TokenIds = _NO_TOKENS
    block_size: int | None = None
    lora_id: Any = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Any = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    cache_salt: str | None = None  # SGLang (map era)
    block_mm_infos: list[Any] | None = None  # Dynamo's ZMQ extension


class _RemovedMap(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None


class _ClearedMap(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class _StoredArray(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None = None
    token_ids: TokenIds = _NO_TOKENS
    block_size: int | None = None
    lora_id: Any = None
    medium: str | None = None
    lora_name: Any = None  # SGLang 0.5.18 puts a {"cache_salt": ...} map in this slot
    extra_keys: Any = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _RemovedArray(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None


class _ClearedArray(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class _TypedArrayBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_StoredMap | _RemovedMap | _ClearedMap]
    data_parallel_rank: U32 | None = None


_CLEARED = (_ClearedMap, _ClearedArray)
_REMOVED = (_RemovedMap, _RemovedArray)
_array_batch = msgspec.msgpack.Decoder(_ArrayBatch)
_typed_array_batch = msgspec.msgpack.Decoder(_TypedArrayBatch)
_map_batch = msgspec.msgpack.Decoder(_MapBatch)
_map_event = msgspec.msgpack.Decoder(_StoredMap | _RemovedMap | _ClearedMap)
_array_event = msgspec.msgpack.Decoder(_StoredArray | _RemovedArray | _ClearedArray)

# Dynamo's StorageTier::from_kv_medium, upper-cased medium -> tier.
_TIERS: dict[str, StorageTier] = {
    "GPU": StorageTier.DEVICE,
    "DEVICE": StorageTier.DEVICE,
    "CPU": StorageTier.HOST_PINNED,
    "CPU_PINNED": StorageTier.HOST_PINNED,
    "CPU_TIER1": StorageTier.HOST_PINNED,
    "CPU_TIER2": StorageTier.DISK,
    "DISK": StorageTier.DISK,
    "NVME": StorageTier.DISK,
    "STORAGE": StorageTier.DISK,
    "FS": StorageTier.DISK,
    "OBJ": StorageTier.DISK,
    "EXTERNAL": StorageTier.EXTERNAL,
    "NETWORK": StorageTier.EXTERNAL,
    "REMOTE": StorageTier.EXTERNAL,
    "SHARED": StorageTier.EXTERNAL,
}
# Groups that hold full attention KV; others (sliding window, mamba, ...) do not answer prefix queries.
_MAIN_ATTENTION = frozenset({"full_attention", "mla_attention", "sink_full_attention"})


if events_accel is not None and accel is not None:  # built: configured even when switched off, for the tests
    events_accel.configure(
        EngineStored,
        EngineRemoved,
        EngineCleared(),
        {medium.encode(): tier for medium, tier in _TIERS.items()},
        StorageTier.DEVICE,
        accel.msgpack_u32s,
        accel.block_hashes,
        lambda salt: namespace_seed(salt),  # a salted store's seed: its salt is its namespace (defined below)
    )
_seeds: dict[str | None, int] = {}  # cache namespace -> the seed of its tokens hashes (few namespaces)


def namespace_seed(cache_namespace: str | None) -> int:
    """The seed the C step hashes a namespace's token blocks with (`salt_seed` of no LoRA)."""
    seed = _seeds.get(cache_namespace)
    if seed is None:
        seed = _seeds[cache_namespace] = salt_seed(None, cache_namespace)
    return seed


def storage_tier(medium: str | None) -> StorageTier:
    """The tier of an engine ``medium``; absent is GPU memory, unknown the lowest tier (never GPU)."""
    if medium is None:
        return StorageTier.DEVICE
    return _TIERS.get(medium.upper(), StorageTier.EXTERNAL)


def _fold_all(values: list[Hash]) -> list[int]:
    if values:
        try:
            if min(values) >= 0:  # type: ignore[operator]
                return values  # type: ignore[return-value]  # u64 ints already: msgspec bounds them
        except TypeError:  # byte digests among them
            pass
    return [fold_hash(value) for value in values]


def fold_hash(value: Hash) -> int:
    """An engine block hash as u64: ints modulo 2^64 (bitwise for negatives), bytes by their last 8 bytes BE."""
    if isinstance(value, int):
        return value & U64_MAX
    return int.from_bytes(value[-8:], "big")


# ---------------------------------------------------------------------- decoding
def decode_engine_batch(
    payload: bytes | memoryview,
    block_size: int,
    *,
    cache_namespace: str | None = None,
    salts: dict[int, str] | None = None,
    side_groups: set[int] | None = None,
) -> DecodedBatch:
    """Decode one engine batch for a router of ``block_size``; raises `EngineDecodeError` only for the envelope.

    ``cache_namespace`` salts every block's hash the way requests naming that namespace are hashed.
    ``salts``: the cache salt of each salted block the engine holds (block hash -> salt), one dict per
    engine stream, read and added to here, emptied by a clear, its removed blocks' forgotten by the
    caller (None: salts are not followed past their first block).
    ``side_groups``: the KV-cache groups of a hybrid model (``group_idx``) whose stores are not main
    attention (sliding window, mamba, ...), one set per engine stream, learnt here from their stores:
    their removals are ignored as their stores are (each group evicts its own copy of a block under the
    same hash; the sliding window's all the time). None: removals are applied whatever their group.
    """
    if EVENTS_NATIVE and not side_groups:
        # (A stream of a hybrid model is decoded below: the C step declines a side group's store.)
        # The plain shapes in one C call, vLLM's salts included (read, followed and kept as below);
        # anything else (and every error) is left to the code below.
        fast = events_accel.decode_batch(payload, block_size, namespace_seed(cache_namespace), salts)
        if fast is not None:
            ts, dp_rank, events, ignored = fast
            return DecodedBatch(ts, dp_rank, events, [], ignored)
        declined("indexer._events_native", "engine_batch_form")
    return python_decode_engine_batch(
        payload, block_size, cache_namespace=cache_namespace, salts=salts, side_groups=side_groups
    )


def python_decode_engine_batch(
    payload: bytes | memoryview,
    block_size: int,
    *,
    cache_namespace: str | None = None,
    salts: dict[int, str] | None = None,
    side_groups: set[int] | None = None,
) -> DecodedBatch:
    """`decode_engine_batch` in msgspec and Python: every shape, every error named (the C step's twin)."""
    data = bytes(payload)
    if not data:
        raise EngineDecodeError("empty_payload", "the payload frame is empty")
    head = data[0]
    if not _is_map(head):
        # The common shape (an array envelope of map events) in one typed decode; anything else,
        # a bad event included, is decoded event by event below so each error is named.
        try:
            typed = _typed_array_batch.decode(data)
        except UNDECODABLE:
            pass
        else:
            return _converted(
                typed.ts, typed.data_parallel_rank, typed.events, block_size, cache_namespace, salts, side_groups
            )
    try:
        batch: _ArrayBatch | _MapBatch = _map_batch.decode(data) if _is_map(head) else _array_batch.decode(data)
    except UNDECODABLE as exc:
        raise EngineDecodeError("bad_envelope", str(exc)) from None
    return _converted(batch.ts, batch.data_parallel_rank, batch.events, block_size, cache_namespace, salts, side_groups)


def _converted(
    ts: float,
    dp_rank: int | None,
    raw_events: Sequence[Any],
    block_size: int,
    cache_namespace: str | None,
    salts: dict[int, str] | None,
    side_groups: set[int] | None,
) -> DecodedBatch:
    events: list[EngineEvent] = []
    errors: list[EngineDecodeError] = []
    ignored = eagle = 0
    for position, raw in enumerate(raw_events):
        try:
            decoded = _decode_event(raw) if isinstance(raw, msgspec.Raw) else raw
            event, bigrams = _engine_event(decoded, block_size, cache_namespace, salts, side_groups)
        except EngineDecodeError as exc:
            errors.append(EngineDecodeError(exc.reason, f"event {position}: {exc.detail}"))
            continue
        if event is None:
            ignored += 1
        else:
            events.append(event)
            eagle += bigrams
    return DecodedBatch(ts, dp_rank, events, errors, ignored, eagle)


def _is_map(head: int) -> bool:
    return 0x80 <= head <= 0x8F or head in (0xDE, 0xDF)


def _is_array(head: int) -> bool:
    return 0x90 <= head <= 0x9F or head in (0xDC, 0xDD)


def _decode_event(raw: msgspec.Raw) -> Any:
    view = memoryview(raw)
    if not view:
        raise EngineDecodeError("bad_event", "empty event")
    head = view[0]
    try:
        if _is_map(head):
            event: Any = _map_event.decode(view)
        elif _is_array(head):
            event = _array_event.decode(view)
        else:
            raise EngineDecodeError("bad_event", f"an event must be a map or an array, got msgpack byte {head:#04x}")
    except msgspec.ValidationError as exc:
        text = str(exc)
        # msgspec names the tag's location when the tag itself is not one of ours.
        if text.startswith("Invalid value") and text.endswith(("`$.type`", "`$[0]`")):
            raise EngineDecodeError("unknown_event_type", text) from None
        raise EngineDecodeError("bad_event", text) from None
    except UNDECODABLE as exc:
        raise EngineDecodeError("bad_event", str(exc)) from None
    return event


def _engine_event(
    event: Any,
    block_size: int,
    cache_namespace: str | None,
    salts: dict[int, str] | None,
    side_groups: set[int] | None,
) -> tuple[EngineEvent | None, bool]:
    """The event (None: ignored) and whether it is a store whose token ids came as EAGLE bigrams."""
    if isinstance(event, _CLEARED):
        if salts:
            salts.clear()
        return EngineCleared(), False
    if isinstance(event, _REMOVED):
        if side_groups and event.group_idx in side_groups:
            return None, False  # a side group's copy evicted: main attention still holds the block
        # Salts stay: the engine may hold another copy of the block (the caller forgets them).
        return EngineRemoved(_fold_all(event.block_hashes), storage_tier(event.medium)), False
    kind = event.kv_cache_spec_kind
    if kind is not None and kind not in _MAIN_ATTENTION:
        if side_groups is not None and event.group_idx is not None:
            side_groups.add(event.group_idx)
        return None, False
    return _stored(event, block_size, cache_namespace, salts)


def _stored(
    event: _StoredMap | _StoredArray, block_size: int, cache_namespace: str | None, salts: dict[int, str] | None
) -> tuple[EngineStored | EngineOffloaded, bool]:
    hashes = _fold_all(event.block_hashes)
    tier = storage_tier(event.medium)
    if tier is not StorageTier.DEVICE and event.token_ids == _NO_TOKENS:
        # Its block size (0, or the connector's) says nothing of the device blocks it names.
        return EngineOffloaded(hashes, tier, block_size), False
    engine_block_size = event.block_size if event.block_size is not None else block_size
    if engine_block_size != block_size:
        raise EngineDecodeError(
            "block_size_mismatch", f"the engine's block size is {engine_block_size}, the router's {block_size}"
        )
    tokens, eagle = _token_list(event.token_ids)
    count = len(tokens) // 4 if isinstance(tokens, bytes) else len(tokens)
    # An EAGLE block's hash window spans the first token of the next block, as its bigrams do (Dynamo's).
    needed = len(hashes) * block_size + eagle
    if count < needed:
        text = f"{len(hashes)} blocks of {block_size} tokens need {needed} token ids"
        raise EngineDecodeError("short_token_ids", text)
    if count > needed:
        tokens = tokens[: needed * 4] if isinstance(tokens, bytes) else tokens[:needed]
    lora_name, salt = _lora_and_salt(event)
    parent = None if event.parent_block_hash is None else fold_hash(event.parent_block_hash)
    if salt is None and parent is not None and salts:
        salt = salts.get(parent)  # vLLM: a salted request's later blocks, under its salted first one
    namespace = salt if salt is not None else cache_namespace
    mm_infos = event.block_mm_infos if isinstance(event, _StoredMap) else None
    try:
        locals_ = compute_block_hashes(
            tokens,
            block_size,
            lora_name=lora_name,
            cache_namespace=namespace,
            block_mm_infos=mm_infos,
            is_eagle=eagle,
        )
    except ValueError as exc:
        raise EngineDecodeError("bad_token_ids", str(exc)) from None
    if parent in hashes or len(set(hashes)) != len(hashes):
        raise EngineDecodeError("repeated_hash", "a store repeats a block hash (or its parent's)")
    if salt is not None and salts is not None:
        salts.update(dict.fromkeys(hashes, salt))
    return EngineStored(parent, hashes, locals_, tier, block_size), eagle


def stored_block_size(payload: bytes | memoryview) -> int | None:
    """The block size a batch's first stored event of attention KV names (vLLM names it in every one);
    None when no store names one or the batch does not decode. For a router that adopts its engines'."""
    data = bytes(payload)
    try:
        batch: _ArrayBatch | _MapBatch = (
            _map_batch.decode(data) if data and _is_map(data[0]) else _array_batch.decode(data)
        )
    except UNDECODABLE:
        return None
    for raw in batch.events:
        try:
            event = _decode_event(raw)
        except EngineDecodeError:
            continue
        if isinstance(event, _StoredMap | _StoredArray) and isinstance(event.block_size, int) and event.block_size > 0:
            kind = event.kv_cache_spec_kind
            offload = event.token_ids == _NO_TOKENS and storage_tier(event.medium) is not StorageTier.DEVICE
            if (kind is None or kind in _MAIN_ATTENTION) and not offload:
                return event.block_size
    return None


def _token_list(raw: msgspec.Raw) -> tuple[bytes | list[int], bool]:
    """An event's token ids, packed u32 bytes (C) or ints, and whether they came as EAGLE bigrams;
    raises `EngineDecodeError` for others. Bigrams ``[(t0, t1), (t1, t2), ... (tn-1, tn)]`` are read as
    ``t0 .. tn``: the firsts, then the last pair's second (as Dynamo reads them)."""
    if NATIVE:
        packed = accel.msgpack_u32s(raw)
        if packed is not None:
            return packed, False
        declined("indexer._native", "token_ids")
    try:
        return _token_ids.decode(raw), False
    except msgspec.ValidationError as exc:
        if "got `str`" in str(exc):  # TensorRT-LLM's type is `int | str`: a block that cannot be hashed as ids
            raise EngineDecodeError("string_token_ids", f"token_ids: a string among the ids: {exc}") from None
        if "got `array`" not in str(exc):
            raise EngineDecodeError("bad_event", f"token_ids: {exc}") from None
    except UNDECODABLE as exc:
        raise EngineDecodeError("bad_event", f"token_ids: {exc}") from None
    try:
        pairs = _bigram_ids.decode(raw)
    except (msgspec.ValidationError, *UNDECODABLE) as exc:
        raise EngineDecodeError("unsupported_token_ids", f"token_ids: neither ids nor bigram pairs: {exc}") from None
    if any(left[1] != right[0] for left, right in itertools.pairwise(pairs)):
        raise EngineDecodeError("bad_token_ids", "token_ids: EAGLE bigrams must chain")
    return [first for first, _ in pairs] + [pairs[-1][1]] if pairs else [], True


def _lora_and_salt(event: _StoredMap | _StoredArray) -> tuple[str | None, str | None]:
    if isinstance(event, _StoredMap):
        lora_name, salt = event.lora_name, event.cache_salt
    else:
        slot: Sequence[Any] | Any = event.lora_name
        if isinstance(slot, dict):
            found = slot.get("cache_salt")
            lora_name, salt = None, found if isinstance(found, str) else None
        else:
            lora_name, salt = (slot if isinstance(slot, str) else None), None
    if salt is None and event.parent_block_hash is None:
        # vLLM salts a request's first block only, which has no parent: under one, a lone string in
        # the keys is a multimodal identifier.
        salt = vllm_cache_salt(event.extra_keys, lora_name)
    return lora_name, salt or None  # an empty salt is no salt (vLLM: ``if request.cache_salt``)


def vllm_cache_salt(extra_keys: Any, lora_name: str | None) -> str | None:
    """The ``cache_salt`` vLLM (0.32) hashed a store's first block with, from its ``extra_keys``.

    ``extra_keys`` has one entry per block: None, or the keys vLLM added to that block's hash, in its
    order: the LoRA name, multimodal identifiers, then the request's cache salt on the request's first
    block only (``[["tenant-X"], None, ...]``). A first block whose keys, past the LoRA name, are one
    string carries a salt; multimodal keys (not covered) leave it undecided: None.
    """
    if not isinstance(extra_keys, list) or not extra_keys or not isinstance(extra_keys[0], list):
        return None
    keys = extra_keys[0]
    if lora_name is not None and keys and keys[0] == lora_name:
        keys = keys[1:]
    if len(keys) == 1 and isinstance(keys[0], str):
        return keys[0]
    return None

"""Block and sequence hashing, bit-exact with NVIDIA Dynamo 1.6.1.

A block's *local* hash is XXH3-64 over its tokens as little-endian u32 (plus the sorted multimodal
hashes of that block as little-endian u64), seeded with 1337 salted by the LoRA name and the cache
namespace. The *sequence* hash chains local hashes: ``seq[0] = local[0]`` and
``seq[i] = XXH3-64(le64(seq[i-1]) || le64(local[i]), seed=1337)``; the chain seed is never salted.

Tokens may be given as a sequence of ints or, on hot paths, as packed little-endian u32 bytes, which
are hashed without creating one Python int per token. With the C accelerator (`indexer.native`) the
per-block loops run in one C call each; the Python loops below are the fallback and give the same
values.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

from indexer.events import U32_MAX, U64_MAX
from indexer.native import ENABLED as NATIVE
from indexer.native import accel, declined

__all__ = [
    "SEED",
    "TokenInput",
    "compute_block_hashes",
    "compute_sequence_hashes",
    "pack_tokens",
    "python_block_hashes",
    "python_sequence_hashes",
    "salt_seed",
    "sequence_hash_tuple",
]

SEED = 1337

TokenInput = Sequence[int] | bytes | bytearray | memoryview

_xxh3 = xxhash.xxh3_64_intdigest
_pack_u64 = struct.Struct("<Q").pack
_pack_pair = struct.Struct("<QQ").pack


def salt_seed(lora_name: str | None = None, cache_namespace: str | None = None) -> int:
    """The XXH3 seed for local block hashes; empty names count as absent."""
    seed = SEED
    if lora_name:
        seed = (seed + _xxh3(lora_name.encode(), 0)) & U64_MAX
    if cache_namespace:
        seed = (seed + _xxh3(cache_namespace.encode(), 1)) & U64_MAX
    return seed


def pack_tokens(tokens: TokenInput) -> memoryview:
    """Tokens as a read-only view of packed little-endian u32, validating ids on the way.

    Byte input is taken as already packed and must be a multiple of 4 bytes long.
    """
    if isinstance(tokens, bytes | bytearray | memoryview):
        view = memoryview(tokens).cast("B")
        if len(view) % 4:
            raise ValueError(f"packed tokens must be a multiple of 4 bytes long, got {len(view)} bytes")
        return view
    if NATIVE:
        fast = accel.pack_u32(tokens)
        if fast is not None:
            return memoryview(fast)
        # not all u32 ints: the Python code below names the bad id
        declined("indexer._native", "token_list")
    try:
        packed = array("I", tokens)
    except OverflowError:
        bad = next(t for t in tokens if not 0 <= t <= U32_MAX)
        raise ValueError(f"token id {bad} is outside the u32 range [0, {U32_MAX}]") from None
    except TypeError as exc:
        raise ValueError(f"token ids must be integers: {exc}") from None
    if packed.itemsize != 4:  # pragma: no cover - every platform CPython supports has a 4-byte C int
        raise RuntimeError("array('I') is not 4 bytes wide on this platform")
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return memoryview(packed).cast("B")


def unpack_tokens(packed: bytes) -> list[int]:
    """The ids of packed little-endian u32 (`pack_tokens`' output) as a list."""
    return list(struct.unpack(f"<{len(packed) // 4}I", packed))


def _mm_suffix(info: Any, block_index: int) -> bytes:
    """The sorted multimodal hashes of one block as little-endian u64 bytes ("" when none)."""
    if info is None:
        return b""
    where = f"block_mm_infos[{block_index}]"
    if not isinstance(info, Mapping):
        raise ValueError(f"{where} must be an object with 'mm_objects' or null, got {type(info).__name__}")
    objects = info.get("mm_objects")
    if not isinstance(objects, Sequence) or isinstance(objects, str | bytes):
        raise ValueError(f"{where}.mm_objects must be a list")
    hashes: list[int] = []
    for j, obj in enumerate(objects):
        mm_hash = obj.get("mm_hash") if isinstance(obj, Mapping) else None
        if type(mm_hash) is not int or not 0 <= mm_hash <= U64_MAX:
            raise ValueError(f"{where}.mm_objects[{j}].mm_hash must be a u64 integer, got {mm_hash!r}")
        hashes.append(mm_hash)
    hashes.sort()
    return b"".join(_pack_u64(h) for h in hashes)


def compute_block_hashes(
    tokens: TokenInput,
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_namespace: str | None = None,
    block_mm_infos: Sequence[Mapping[str, Any] | None] | None = None,
    is_eagle: bool = False,
) -> list[int]:
    """Local hashes of every complete block of ``tokens`` (a trailing partial block is ignored).

    With ``is_eagle`` each window also covers the first token of the next block, as Dynamo does for
    EAGLE speculative decoding, so ``(n - 1) // block_size`` blocks are produced.
    """
    if type(block_size) is not int or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    if block_mm_infos is not None and (
        not isinstance(block_mm_infos, Sequence) or isinstance(block_mm_infos, str | bytes)
    ):
        raise ValueError("block_mm_infos must be a list with one entry (or null) per block")
    data = pack_tokens(tokens)
    seed = salt_seed(lora_name, cache_namespace)
    stride = block_size * 4
    window = stride + 4 if is_eagle else stride
    if not block_mm_infos:
        if NATIVE:
            return accel.block_hashes(data, seed, stride, window)
        return python_block_hashes(data, seed, stride, window)
    hashes = []
    for index, start in enumerate(range(0, len(data) - window + 1, stride)):
        chunk = data[start : start + window]
        if index < len(block_mm_infos):
            suffix = _mm_suffix(block_mm_infos[index], index)
            if suffix:
                chunk = bytes(chunk) + suffix  # type: ignore[assignment]
        hashes.append(_xxh3(chunk, seed))
    return hashes


def python_block_hashes(data: memoryview, seed: int, stride: int, window: int) -> list[int]:
    """XXH3-64 of every full ``window`` bytes of ``data``, one per ``stride``: the pure-Python twin of
    `indexer._native.block_hashes`."""
    return [_xxh3(data[start : start + window], seed) for start in range(0, len(data) - window + 1, stride)]


def compute_sequence_hashes(block_hashes: Sequence[int]) -> list[int]:
    """Dynamo's rolling sequence hashes of a list of local block hashes."""
    return list(sequence_hash_tuple(block_hashes))


def sequence_hash_tuple(block_hashes: Sequence[int]) -> tuple[int, ...]:
    """`compute_sequence_hashes` as a tuple: what the router books, built without a copy in C."""
    if NATIVE:
        try:
            return accel.sequence_hashes(block_hashes, SEED)
        except (OverflowError, TypeError):
            pass  # the Python loop names the bad value
    return tuple(python_sequence_hashes(block_hashes))


def python_sequence_hashes(block_hashes: Sequence[int]) -> list[int]:
    """The pure-Python twin of `indexer._native.sequence_hashes`."""
    out: list[int] = []
    if not block_hashes:
        return out
    previous = block_hashes[0]
    out.append(previous)
    try:
        for local in block_hashes[1:]:
            previous = _xxh3(_pack_pair(previous, local), SEED)
            out.append(previous)
    except struct.error:
        bad = next(h for h in block_hashes if type(h) is not int or not 0 <= h <= U64_MAX)
        raise ValueError(f"block hash {bad!r} is not a u64 integer") from None
    return out

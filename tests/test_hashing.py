"""Block and sequence hashes are bit-exact with Dynamo 1.6.1."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from indexer.hashing import compute_block_hashes, compute_sequence_hashes, pack_tokens, salt_seed


def _vectors(shared_dir: Path) -> dict[str, Any]:
    return json.loads((shared_dir / "vectors" / "dynamo_hash_vectors.json").read_text())


def test_every_dynamo_vector_case_matches(shared_dir: Path) -> None:
    cases = _vectors(shared_dir)["cases"]
    assert len(cases) == 26
    for case in cases:
        blocks = compute_block_hashes(
            case["tokens"],
            case["kv_block_size"],
            lora_name=case["lora_name"],
            cache_namespace=case["cache_namespace"],
            block_mm_infos=case["block_mm_infos"],
            is_eagle=bool(case["is_eagle"]),
        )
        assert blocks == case["block_hashes"], case["name"]
        assert compute_sequence_hashes(blocks) == case["sequence_hashes"], case["name"]
        assert salt_seed(case["lora_name"], case["cache_namespace"]) == case["salt_seed"], case["name"]


def test_dynamo_chain_examples(shared_dir: Path) -> None:
    for example in _vectors(shared_dir)["chain_examples"]:
        assert compute_sequence_hashes(example["block_hashes"]) == example["sequence_hashes"]


def test_published_reference_values() -> None:
    assert xxhash.xxh3_64_intdigest(b"test data", 1337) == 13226331709069118873
    assert compute_sequence_hashes([11, 22, 33]) == [11, 750553365844651409, 3257565445809651757]
    assert compute_block_hashes(list(range(32)), 32) == [5756925433886871916]
    # device 2 + mm on block 1 only: mm hashes are sorted before they enter the hash.
    mm = [None, {"mm_objects": [{"mm_hash": 7, "offsets": [[4, 6]]}, {"mm_hash": 3, "offsets": [[6, 8]]}]}]
    assert compute_block_hashes(list(range(8)), 4, block_mm_infos=mm) == [9143094415614847814, 16753210160377275510]


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.integers(1, 64))
def test_packed_bytes_hash_like_int_lists(tokens: list[int], block_size: int) -> None:
    packed = struct.pack(f"<{len(tokens)}I", *tokens)
    assert compute_block_hashes(packed, block_size) == compute_block_hashes(tokens, block_size)
    assert len(compute_block_hashes(tokens, block_size)) == len(tokens) // block_size


@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=120), st.integers(1, 16))
def test_eagle_windows_overlap_by_one_token(tokens: list[int], block_size: int) -> None:
    hashes = compute_block_hashes(tokens, block_size, is_eagle=True)
    assert len(hashes) == (len(tokens) - 1) // block_size
    for i, value in enumerate(hashes):
        window = tokens[i * block_size : (i + 1) * block_size + 1]
        assert value == xxhash.xxh3_64_intdigest(struct.pack(f"<{len(window)}I", *window), 1337)


@pytest.mark.parametrize("block_size", [0, -16, 1.5, "16"])
def test_bad_block_size_is_a_value_error(block_size: Any) -> None:
    with pytest.raises(ValueError, match="block_size"):
        compute_block_hashes([1, 2, 3], block_size)


@pytest.mark.parametrize("token", [-1, 2**32, 2**40])
def test_token_outside_u32_is_a_value_error(token: int) -> None:
    with pytest.raises(ValueError, match=f"token id {token} is outside the u32 range"):
        compute_block_hashes([1, token, 3], 2)


def test_packed_bytes_must_be_whole_u32s() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_tokens(b"\x01\x00\x00")


@pytest.mark.parametrize(
    ("mm", "message"),
    [
        ([{"mm_objects": [{"mm_hash": -1}]}], r"block_mm_infos\[0\]\.mm_objects\[0\]\.mm_hash"),
        ([{"mm_objects": [{"offsets": [[0, 1]]}]}], r"mm_hash must be a u64"),
        ([{"objects": []}], r"mm_objects must be a list"),
        (["not an object"], r"block_mm_infos\[0\] must be an object"),
        ("nope", "block_mm_infos must be a list"),
    ],
)
def test_malformed_mm_infos_are_value_errors(mm: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        compute_block_hashes([1, 2, 3, 4], 4, block_mm_infos=mm)


def test_sequence_hash_rejects_non_u64() -> None:
    with pytest.raises(ValueError, match="not a u64"):
        compute_sequence_hashes([1, -2])

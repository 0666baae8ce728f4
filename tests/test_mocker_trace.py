"""Mooncake traces: loading options, and token ids that keep the prefix structure at any block size."""

from __future__ import annotations

import re
from array import array
from pathlib import Path

import msgspec
import pytest

from indexer.hashing import compute_block_hashes
from mocker.tokens import BlockTokens
from mocker.trace import TraceError, TraceOptions, build_trace, load_trace


def tokens_of(packed: bytes) -> list[int]:
    return array("I", packed).tolist()


def write_trace(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_bytes(b"".join(msgspec.json.encode(row) + b"\n" for row in rows))
    return path


def test_every_trace_block_has_tokens_no_other_block_shares() -> None:
    tokens = BlockTokens(512)
    blocks = [tokens_of(tokens.block(d)) for d in (0, 1, 2, 77, 8_388_607)]
    assert all(len(b) == 512 for b in blocks)
    seen = [t for b in blocks for t in b]
    assert len(set(seen)) == len(seen)
    assert tokens.block(5) == tokens.block(5)
    with pytest.raises(ValueError, match="u32 token ids"):
        tokens.block(8_388_608)


def test_a_partial_last_block_is_a_prefix_of_that_block() -> None:
    tokens = BlockTokens(512)
    whole = tokens.prompt([3, 4], 1024)
    assert tokens.prompt([3, 4], 700) == whole[: 700 * 4]
    with pytest.raises(ValueError, match="cannot hold"):
        tokens.prompt([3], 513)


@pytest.mark.parametrize("block_size", [1, 16, 64, 100, 512, 1024])
def test_prompts_share_exactly_their_common_trace_prefix_at_any_block_size(block_size: int) -> None:
    tokens = BlockTokens(512)
    # Two prompts sharing their first three trace blocks, then diverging.
    a = compute_block_hashes(tokens.prompt([0, 1, 2, 3, 4], 2500), block_size)
    b = compute_block_hashes(tokens.prompt([0, 1, 2, 9, 10], 2400), block_size)
    shared = 3 * 512 // block_size  # router blocks entirely inside the shared trace blocks
    assert a[:shared] == b[:shared]
    assert all(x != y for x, y in zip(a[shared:], b[shared:], strict=False))


def test_non_power_of_two_trace_blocks() -> None:
    tokens = BlockTokens(300)
    first = tokens_of(tokens.prompt([0, 1], 600))
    assert len(set(first)) == 600
    assert tokens_of(tokens.block(1)) == first[300:]


ROWS = [
    {"timestamp": 3000, "input_length": 1000, "output_length": 10, "hash_ids": [70, 71]},
    {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [70, 72]},
    {"timestamp": 3000, "input_length": 5000, "output_length": 3, "hash_ids": [80, 81, 82, 83, 84, 85, 86, 87, 88, 89]},
    {"timestamp": 6000, "input_length": 1200, "output_length": 1, "hash_ids": [70]},
]


AS_WRITTEN = TraceOptions(jitter_ms=0.0)  # ROWS' timestamps are quantised: without it they are jittered


def test_loading_renumbers_ids_densely_in_order_of_first_appearance(tmp_path: Path) -> None:
    trace = load_trace(write_trace(tmp_path / "t.jsonl", ROWS), AS_WRITTEN)
    assert [r.index for r in trace] == [1, 0, 2, 3]  # sorted by arrival, stable
    assert [r.arrival_ms for r in trace] == [0.0, 3000.0, 3000.0, 6000.0]
    by_index = {r.index: r for r in trace}
    assert by_index[0].blocks == (0, 1)
    assert by_index[1].blocks == (0, 2)
    assert by_index[2].blocks == tuple(range(3, 13))
    # 1200 tokens but one id: the two blocks it lacks are its own.
    assert by_index[3].blocks == (0, 13, 14)
    assert len(trace.prompt(by_index[3])) == 1200 * 4
    assert trace.prompt(by_index[0])[:2048] == trace.prompt(by_index[1])[:2048]


def test_limit_speedup_and_length_policies(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", ROWS)
    assert len(load_trace(path, TraceOptions(limit=2))) == 2
    fast = load_trace(path, TraceOptions(speedup=3.0, jitter_ms=0.0))
    assert [r.arrival_ms for r in fast] == [0.0, 1000.0, 1000.0, 2000.0]
    clipped = load_trace(path, TraceOptions(max_input_length=1024))
    assert clipped.clipped == 2
    assert max(r.input_length for r in clipped) == 1024
    assert {r.index: len(r.blocks) for r in clipped}[2] == 2
    dropped = load_trace(path, TraceOptions(max_input_length=1024, length_policy="drop"))
    assert (len(dropped), dropped.dropped) == (2, 2)


def test_jitter_spreads_arrivals_within_the_quantum_reproducibly(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", ROWS)
    one = load_trace(path, TraceOptions(jitter_ms=3000.0, seed=1))
    again = load_trace(path, TraceOptions(jitter_ms=3000.0, seed=1))
    other = load_trace(path, TraceOptions(jitter_ms=3000.0, seed=2))
    assert [(r.index, r.arrival_ms) for r in one] == [(r.index, r.arrival_ms) for r in again]
    assert [r.arrival_ms for r in one] != [r.arrival_ms for r in other]
    base = {0: 3000.0, 1: 0.0, 2: 3000.0, 3: 6000.0}
    assert all(base[r.index] <= r.arrival_ms < base[r.index] + 3000.0 for r in one)
    assert [r.arrival_ms for r in one] == sorted(r.arrival_ms for r in one)


def test_quantised_timestamps_are_spread_within_their_quantum_unless_told(tmp_path: Path) -> None:
    """ROWS share timestamps 3 s apart, as the real Mooncake traces do: by default each arrival is
    spread within the 3 s quantum (seeded), so that a slower replay does not keep them at one instant.
    Timestamps at 1 ms resolution (the synthetic and generated traces), or not shared, are kept as
    written; ``jitter_ms=0`` keeps quantised ones too."""
    path = write_trace(tmp_path / "t.jsonl", ROWS)
    spread = load_trace(path, TraceOptions(seed=1))
    assert spread.jitter_ms == 3000.0
    assert [(r.index, r.arrival_ms) for r in spread] == [
        (r.index, r.arrival_ms) for r in load_trace(path, TraceOptions(jitter_ms=3000.0, seed=1))
    ]
    slower = load_trace(path, TraceOptions(seed=1, speedup=0.25))
    assert [r.arrival_ms for r in slower] == [r.arrival_ms * 4 for r in spread]  # spread, then scaled
    fine = [dict(row, timestamp=stamp) for row, stamp in zip(ROWS, (5, 0, 5, 9), strict=True)]
    assert load_trace(write_trace(tmp_path / "fine.jsonl", fine)).jitter_ms == 0.0
    distinct = [dict(row, timestamp=stamp) for row, stamp in zip(ROWS, (3000, 0, 6000, 9000), strict=True)]
    assert load_trace(write_trace(tmp_path / "distinct.jsonl", distinct)).jitter_ms == 0.0
    assert load_trace(path, AS_WRITTEN).jitter_ms == 0.0


def test_bad_lines_and_options_are_reported(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1}\n')
    with pytest.raises(TraceError, match=r"bad\.jsonl:2"):
        load_trace(path)
    with pytest.raises(ValueError, match="speedup"):
        TraceOptions(speedup=0)
    assert len(build_trace([], TraceOptions(), "empty")) == 0


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("input_length", 10**11, "Expected `int` <= 10000000 - at `$.input_length`"),  # took all memory
        ("output_length", 10**11, "Expected `int` <= 10000000 - at `$.output_length`"),
        ("timestamp", 1e308, "Expected `float` <= 10000000000000.0 - at `$.timestamp`"),  # a stalled simulation
    ],
)
def test_lengths_and_timestamps_past_any_real_request_are_refused_naming_the_line(
    tmp_path: Path, field: str, value: float, says: str
) -> None:
    row = {"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}
    path = write_trace(tmp_path / "far.jsonl", [row, dict(row, **{field: value})])
    with pytest.raises(TraceError, match=re.escape(f"far.jsonl:2: not a Mooncake trace line: {says}")):
        load_trace(path)


def test_the_shared_traces_load_whole(shared_dir: Path) -> None:
    trace = load_trace(shared_dir / "traces" / "mooncake_trace_1000.jsonl")
    assert len(trace) == 1000
    assert (trace.clipped, trace.dropped) == (0, 0)
    assert all(len(r.blocks) == -(-r.input_length // 512) for r in trace)

"""Real SGLang 0.5.23 KV events (shared/vectors/real-engines/sglang/: its two ZMQ formats, default and
dynamo, on ports 5577 and 5587, in two runs) decoded by both decoders, the pure-Python one
(`indexer.engine_events.python_decode_engine_batch`) and the C one (`indexer._events_native`), each to
the events the capture's decoded form says: stored blocks with their signed SHA-256 hashes as u64 and
our tokens hashes of their token ids, removals, the clear; the batch's timestamp and rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from indexer.engine_events import (
    DecodedBatch,
    EngineCleared,
    EngineEvent,
    EngineRemoved,
    EngineStored,
    decode_engine_batch,
    python_decode_engine_batch,
)
from indexer.events import StorageTier
from indexer.hashing import compute_block_hashes, salt_seed

BLOCK = 32  # SGLang's --page-size in the captures
CAPTURES = [
    (run, port, kind)
    for run in (".", "run2")
    for port in (5577, 5587)
    for kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared")
]


def _capture(shared_dir: Path, run: str, port: int, kind: str) -> dict[str, Any]:
    path = shared_dir / "vectors" / "real-engines" / "sglang" / run / f"{port}_{kind}.json"
    capture: dict[str, Any] = json.loads(path.read_text())
    return capture


def _expected(decoded: list[Any]) -> DecodedBatch:
    """What the capture's decoded form must become (SGLang's hashes are signed 64-bit: taken as u64)."""
    ts, raw_events, dp_rank = decoded
    events: list[EngineEvent] = []
    for raw in raw_events:
        hashes = [value & (2**64 - 1) for value in raw.get("block_hashes", [])]
        if raw["type"] == "BlockStored":
            assert raw["block_size"] == BLOCK and raw["parent_block_hash"] is None
            tokens_hashes = compute_block_hashes(raw["token_ids"], BLOCK)
            events.append(EngineStored(None, hashes, tokens_hashes, StorageTier.DEVICE, BLOCK))
        elif raw["type"] == "BlockRemoved":
            events.append(EngineRemoved(hashes, StorageTier.DEVICE))
        else:
            assert raw["type"] == "AllBlocksCleared"
            events.append(EngineCleared())
    return DecodedBatch(ts, dp_rank, events, [], 0)


@pytest.mark.parametrize(("run", "port", "kind"), CAPTURES)
def test_both_decoders_give_the_captured_sglang_events(shared_dir: Path, run: str, port: int, kind: str) -> None:
    capture = _capture(shared_dir, run, port, kind)
    topic, seq, payload = (bytes.fromhex(frame) for frame in capture["frames_hex"])
    assert topic == b"kv-events" and int.from_bytes(seq, "big") == capture["seq"]
    assert payload == bytes.fromhex(capture["payload_hex"])
    expected = _expected(capture["decoded"])
    assert [type(event).__name__ for event in expected.events] == [
        {"BlockStored": "EngineStored", "BlockRemoved": "EngineRemoved", "AllBlocksCleared": "EngineCleared"}[name]
        for name in capture["event_types_in_batch"]
    ]
    assert python_decode_engine_batch(payload, BLOCK) == expected
    assert decode_engine_batch(payload, BLOCK) == expected  # the C step where it is built and enabled
    events_native = pytest.importorskip("indexer._events_native", reason="the bridge's C step is not built")
    decoded = events_native.decode_batch(payload, BLOCK, salt_seed(None, None))
    assert decoded is not None, "the C step declined a real SGLang batch"
    ts, dp_rank, events, ignored = decoded
    assert DecodedBatch(ts, dp_rank, events, [], ignored) == expected


def test_the_captured_streams_are_stored_then_removed_then_cleared(shared_dir: Path) -> None:
    """Each capture's whole stream, as its JSONL lists it: one store per prompt, a removal of blocks
    the first store made, a clear; seq from 0 with no gap; the same blocks on both formats."""
    stored: dict[tuple[str, int], list[int]] = {}
    for run in (".", "run2"):
        for port in (5577, 5587):
            path = shared_dir / "vectors" / "real-engines" / "sglang" / run / f"all_{port}.jsonl"
            lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            assert [line["seq"] for line in lines] == list(range(len(lines)))
            assert [line["types"] for line in lines] == [
                ["BlockStored"], ["BlockStored"], ["BlockRemoved"], ["AllBlocksCleared"]
            ]  # fmt: skip
            first = python_decode_engine_batch(
                bytes.fromhex(_capture(shared_dir, run, port, "BlockStored")["payload_hex"]), BLOCK
            )
            removed = python_decode_engine_batch(
                bytes.fromhex(_capture(shared_dir, run, port, "BlockRemoved")["payload_hex"]), BLOCK
            )
            store, removal = first.events[0], removed.events[0]
            assert isinstance(store, EngineStored) and isinstance(removal, EngineRemoved)
            assert set(removal.block_hashes) <= set(store.block_hashes)
            stored[run, port] = store.block_hashes
    assert len({tuple(hashes) for hashes in stored.values()}) == 1  # same prompt, same hashes everywhere

"""Our radix tree gives Dynamo 1.6.1's answers on its recorded event stream."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from indexer.events import KvCacheEvent
from indexer.radix_tree import KvIndexError, RadixTree


def test_recorded_dynamo_stream_every_query_matches(shared_dir: Path) -> None:
    stream = json.loads((shared_dir / "vectors" / "radix_oracle_seed0.json").read_text())
    tree = RadixTree()
    queries = rejected = 0
    for op in stream["ops"]:
        kind = op["op"]
        if kind == "event":
            event = msgspec.convert(op["event"], KvCacheEvent)
            try:
                tree.apply_event(op["worker_id"], event)
            except KvIndexError:
                rejected += 1
        elif kind == "remove_worker":
            tree.remove_worker(op["worker_id"])
        elif kind == "clear_all_blocks":
            tree.clear_all_blocks(op["worker_id"])
        else:
            assert kind == "query"
            got = {f"{w}:{r}": score for (w, r), score in tree.find_matches(op["seq"]).scores.items()}
            assert got == op["expected"], f"query {op['id']}"
            queries += 1
    assert queries == 1000
    assert rejected == stream["meta"]["dynamo_errors"] == 0

"""Differential test: our RadixTree and Dynamo 1.6.1's own RadixTree, side by side, lock-step."""

from __future__ import annotations

import os

import msgspec
import pytest

from indexer.radix_tree import KvIndexError, RadixTree
from tests.event_streams import EventOp, QueryOp, WorkerOp, generate

os.environ.setdefault("DYN_LOG", "error")  # Dynamo logs a warning for every rejected event
dynamo_core = pytest.importorskip("dynamo._core", reason="needs ai-dynamo-runtime==1.6.1 (the oracle extra)")

pytestmark = pytest.mark.oracle


@pytest.mark.parametrize(
    ("seed", "workers", "dp_size", "requests"),
    [
        (1, 8, 2, 6000),
        (2, 8, 2, 6000),
        (3, 8, 2, 6000),
        (4, 64, 4, 8000),
        (5, 64, 4, 8000),
        (6, 64, 4, 8000),
    ],
)
def test_same_answers_as_dynamo(seed: int, workers: int, dp_size: int, requests: int) -> None:
    ours = RadixTree()
    theirs = dynamo_core.RadixTree()
    encode = msgspec.json.encode
    queries = nonzero = events = 0
    for op in generate(seed, workers=workers, dp_size=dp_size, requests=requests, capacity=512):
        if isinstance(op, EventOp):
            events += 1
            their_error = our_error = None
            try:
                theirs.apply_event(op.worker_id, encode(op.event))
            except (RuntimeError, ValueError) as exc:
                their_error = exc
            try:
                ours.apply_event(op.worker_id, op.event)
            except KvIndexError as exc:
                our_error = exc
            assert (their_error is None) == (our_error is None), (op, their_error, our_error)
        elif isinstance(op, WorkerOp):
            getattr(theirs, op.kind)(op.worker_id)
            getattr(ours, op.kind)(op.worker_id)
        else:
            assert isinstance(op, QueryOp)
            expected = theirs.find_matches(op.local_hashes, False).scores
            got = ours.find_matches(op.local_hashes).scores
            assert got == expected, f"query {queries} of seed {seed}"
            queries += 1
            nonzero += bool(expected)
    assert queries >= requests // 4
    assert nonzero > queries // 2, "the stream should exercise real matches"
    assert events > requests

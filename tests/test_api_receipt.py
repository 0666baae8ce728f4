"""The decision receipt on ``/v1/new`` replies, and the discount of untrusted streams' overlap."""

from __future__ import annotations

from typing import Any

import pytest

from indexer.events import RouterEvent, stored_event
from indexer.hashing import compute_block_hashes, compute_sequence_hashes
from router.config import RouterConfig
from router.kv_router import KvRouter
from router.types import RouteRequest, WorkerConfig
from tests.test_api_support import BLOCK_SIZE, prompt, serve
from tests.test_api_support import stored_event as stored_json

pytestmark = pytest.mark.anyio

TOKENS = prompt(3, 4 * BLOCK_SIZE)


def post_events(client: Any, *events: dict[str, Any]) -> None:
    assert client.post("/v1/events", json=list(events)).status_code == 200


def test_every_new_reply_carries_the_receipt_and_v1_router_keeps_dynamos_shape() -> None:
    with serve() as client:
        for worker_id in (1, 2):
            client.post("/v1/workers", json={"worker_id": worker_id})
        post_events(client, stored_json(2, TOKENS, event_id=1, blocks=3))
        body = client.post("/v1/new", json={"tokens": TOKENS}).json()
        receipt = body["receipt"]
        assert body["worker_id"] == 2
        assert 0.0 <= receipt.pop("newest_event_age_s") < 60.0
        assert receipt == {
            "device_blocks": 3, "host_pinned_blocks": 0, "disk_blocks": 0, "credited_blocks": 3.0,
            "stream_trusted": True, "reason": "lowest_cost", "candidates": 2,
        }  # fmt: skip
        dynamo = client.post("/v1/router", json={"method": "new", "tokens": TOKENS}).json()
        assert set(dynamo) == {"method", "worker_id", "dp_rank", "overlap_blocks"}
        # A worker without events: no age, not trusted; equal costs are a tie.
        client.post("/v1/workers", json={"worker_id": 3})
        cold = client.post("/v1/new", json={"tokens": prompt(9, 2 * BLOCK_SIZE)}).json()["receipt"]
        assert cold["reason"] == "tie" and cold["device_blocks"] == 0


def test_an_untrusted_stream_shows_in_the_receipt_and_is_discounted_except_under_dynamo() -> None:
    # Worker 1 joined mid-stream (first id 5; nobody can be asked over HTTP): untrusted. Worker 2 is
    # trusted. Both hold the same 3 blocks.
    events = (stored_json(1, TOKENS, event_id=5, blocks=3), stored_json(2, TOKENS, event_id=1, blocks=3))
    for policy, weight, expected in (("dynamo", 0.5, {1, 2}), ("cache_affinity", 0.5, {2}),
                                     ("cache_affinity", 1.0, {1, 2})):  # fmt: skip
        with serve(policy=policy, untrusted_overlap_weight=weight) as client:
            for worker_id in (1, 2):
                client.post("/v1/workers", json={"worker_id": worker_id})
            post_events(client, *events)
            chosen: set[int] = set()
            for _ in range(40):
                reply = client.post("/v1/new", json={"tokens": TOKENS}).json()
                chosen.add(reply["worker_id"])
                client.post("/v1/mark_free", json={"request_id": reply["request_id"]})
                receipt = reply["receipt"]
                assert receipt["stream_trusted"] is (reply["worker_id"] == 2)
                assert receipt["device_blocks"] == 3
            assert chosen == expected, (policy, weight)


async def test_pinned_and_threshold_reasons() -> None:
    router = KvRouter(RouterConfig(block_size=BLOCK_SIZE, active_decode_blocks_threshold=0.5))
    for worker_id in (1, 2):
        router.register_worker(WorkerConfig(worker_id=worker_id, total_kv_blocks=100))
    local = compute_block_hashes(TOKENS, BLOCK_SIZE)
    router.sequencer.ingest([RouterEvent(1, stored_event(1, zip(compute_sequence_hashes(local), local, strict=True)))])
    pinned = await router.new(RouteRequest(tokens=TOKENS), pinned_worker=(2, 0))
    assert pinned.receipt is not None and (pinned.worker_id, pinned.receipt.reason) == (2, "pinned")
    router.update_kv_used_blocks(1, 0, 90)  # worker 1 is busy
    decision = await router.new(RouteRequest(tokens=TOKENS))
    assert decision.receipt is not None and (decision.worker_id, decision.receipt.reason) == (2, "threshold")

"""``/metrics`` moves as the router's state and traffic do."""

from __future__ import annotations

from tests.test_api_support import BLOCK_SIZE, metric, prompt, serve, stored_event


def test_request_and_decision_metrics_move() -> None:
    with serve() as client:
        client.post("/v1/workers", json={"worker_id": 1})
        tokens = prompt(0, 64)
        client.post("/v1/events", json=stored_event(1, tokens, blocks=2))
        assert metric(client, "kv_router_requests_total", method="new", outcome="ok") == 0
        client.post("/v1/new", json={"tokens": tokens, "request_id": "a"})
        client.post("/v1/router", json={"method": "new", "tokens": prompt(1, 32), "request_id": "b"})
        assert metric(client, "kv_router_requests_total", method="new", outcome="ok") == 2
        for phase in ("hashing", "matching", "scheduling", "request"):
            assert metric(client, "kv_router_decision_duration_seconds_count", phase=phase) == 2
            assert metric(client, "kv_router_decision_duration_seconds_sum", phase=phase) > 0
        # The HTTP call includes the decision's phases.
        phases = sum(
            metric(client, "kv_router_decision_duration_seconds_sum", phase=p)
            for p in ("hashing", "matching", "scheduling")
        )
        assert metric(client, "kv_router_decision_duration_seconds_sum", phase="request") >= phases
        # Sub-millisecond buckets exist and catch short decisions.
        assert metric(client, "kv_router_decision_duration_seconds_bucket", phase="hashing", le="0.001") >= 1
        # Overlap: 2 blocks for the first request, 0 for the second; hit ratio 32/64 and 0.
        assert metric(client, "kv_router_overlap_blocks_sum") == 2
        assert metric(client, "kv_router_overlap_blocks_bucket", le="0.0") == 1
        assert metric(client, "kv_router_predicted_cache_hit_ratio_sum") == 2 * BLOCK_SIZE / 64
        client.post("/v1/mark_prefill", json={"request_id": "a"})
        client.post("/v1/mark_free", json={"request_id": "a"})
        client.post("/v1/potential_loads", json={"tokens": tokens})
        client.post("/v1/overlap", json={"tokens": tokens})
        for method in ("mark_prefill", "mark_free", "potential_loads", "overlap", "events"):
            assert metric(client, "kv_router_requests_total", method=method, outcome="ok") == 1


def test_per_rank_load_gauges_follow_bookings() -> None:
    with serve() as client:
        client.post("/v1/workers", json={"worker_id": 4, "dp_size": 2})
        rank = {"worker_id": "4", "dp_rank": "0"}
        client.post("/v1/new", json={"tokens": prompt(2, 70), "request_id": "x"})
        owner = client.get("/v1/workers/4").json()["ranks"]
        booked = next(r for r in owner if r["active_requests"])
        rank["dp_rank"] = str(booked["dp_rank"])
        assert metric(client, "kv_router_worker_active_prefill_tokens", **rank) == 70
        assert metric(client, "kv_router_worker_active_decode_blocks", **rank) == 4
        assert metric(client, "kv_router_worker_active_requests", **rank) == 1
        client.post("/v1/mark_prefill", json={"request_id": "x"})
        assert metric(client, "kv_router_worker_active_prefill_tokens", **rank) == 0
        assert metric(client, "kv_router_worker_active_decode_blocks", **rank) == 4
        client.post("/v1/mark_free", json={"request_id": "x"})
        assert metric(client, "kv_router_worker_active_decode_blocks", **rank) == 0
        assert metric(client, "kv_router_worker_active_requests", **rank) == 0


def test_index_event_and_worker_gauges() -> None:
    with serve() as client:
        assert metric(client, "kv_router_workers_registered") == 0
        client.post("/v1/workers", json={"worker_id": 1})
        client.post("/v1/workers", json={"worker_id": 2})
        assert metric(client, "kv_router_workers_registered") == 2
        assert metric(client, "kv_router_index_nodes") == 0
        tokens = prompt(3, 80)
        client.post("/v1/events", json=[stored_event(1, tokens), stored_event(2, tokens, blocks=3)])
        assert metric(client, "kv_router_index_nodes") == 5
        assert metric(client, "kv_router_index_estimated_bytes") > 0
        assert metric(client, "kv_router_worker_indexed_blocks", worker_id="1", dp_rank="0") == 5
        assert metric(client, "kv_router_worker_indexed_blocks", worker_id="2", dp_rank="0") == 3
        assert metric(client, "kv_router_events_applied_total", event_type="stored", status="ok") == 2
        removal = {"worker_id": 2, "event": {"event_id": 2, "data": {"removed": {"block_hashes": [1, 2]}}}}
        cleared = {"worker_id": 1, "event": {"event_id": 3, "data": "cleared"}}
        client.post("/v1/events", json=[removal, cleared])
        assert metric(client, "kv_router_events_applied_total", event_type="removed", status="block_not_found") == 1
        assert metric(client, "kv_router_events_applied_total", event_type="cleared", status="ok") == 1
        assert metric(client, "kv_router_worker_indexed_blocks", worker_id="1", dp_rank="0") == 0
        client.delete("/v1/workers/2")
        assert metric(client, "kv_router_workers_registered") == 1
        assert metric(client, "kv_router_index_nodes") == 0


def test_each_app_has_its_own_registry() -> None:
    with serve() as first, serve() as second:
        first.post("/v1/workers", json={"worker_id": 1})
        first.post("/v1/new", json={"tokens": prompt(4, 16)})
        assert metric(first, "kv_router_requests_total", method="new", outcome="ok") == 1
        assert metric(second, "kv_router_requests_total", method="new", outcome="ok") == 0

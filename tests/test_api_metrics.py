"""``/metrics`` moves as the router's state and traffic do."""

from __future__ import annotations

import random
import re

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from api.metrics import LATENCY_BUCKETS, METHODS, OVERLAP_BLOCK_BUCKETS, PREFIX, RATIO_BUCKETS, ApiMetrics
from indexer import native as indexer_native
from indexer.native import SWITCHED_OFF
from router.types import DecisionTiming, DisaggregationPath, DisaggregationReceipt, RouteDecision
from tests.test_api_support import BLOCK_SIZE, metric, prompt, serve, stored_event
from tests.waiting import until


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


def test_the_computed_prompt_credit_is_a_per_rank_gauge_while_it_lasts() -> None:
    # Three seconds: room for a slow machine between the mark and the first read, which must see it.
    with serve(policy="latency", computed_prompt_credit_secs=3.0) as client:
        client.post("/v1/workers", json={"worker_id": 4})
        rank = {"worker_id": "4", "dp_rank": "0"}
        client.post("/v1/new", json={"tokens": prompt(2, 4 * BLOCK_SIZE), "request_id": "x"})
        assert metric(client, "kv_router_worker_credited_blocks", **rank) is None  # not computed yet
        client.post("/v1/mark_prefill", json={"request_id": "x"})
        client.post("/v1/mark_free", json={"request_id": "x"})
        assert metric(client, "kv_router_worker_credited_blocks", **rank) == 4
        until(lambda: metric(client, "kv_router_worker_credited_blocks", **rank) is None, 10, "the credit ends")


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


def test_histograms_expose_exactly_what_prometheus_client_would() -> None:
    """The lock-free histograms and dict-tally counters of `ApiMetrics` against prometheus-client's
    own `Histogram` and `Counter` fed the same observations, bucket edges included: the same
    families, samples and values."""
    ours = CollectorRegistry()
    metrics = ApiMetrics(ours)
    theirs = CollectorRegistry()
    families = {family.name: family for family in ours.collect()}
    requests = Counter(f"{PREFIX}_requests", families[f"{PREFIX}_requests"].documentation, ["method", "outcome"],
                       registry=theirs)  # fmt: skip
    for method in METHODS:
        requests.labels(method, "ok")
    name = f"{PREFIX}_decision_duration_seconds"
    decision = Histogram(name, families[name].documentation, ["phase"], buckets=LATENCY_BUCKETS, registry=theirs)
    phases = {phase: decision.labels(phase) for phase in ("hashing", "matching", "scheduling", "queued", "request")}
    name = f"{PREFIX}_overlap_blocks"
    overlap = Histogram(name, families[name].documentation, buckets=OVERLAP_BLOCK_BUCKETS, registry=theirs)
    name = f"{PREFIX}_predicted_cache_hit_ratio"
    hit_ratio = Histogram(name, families[name].documentation, buckets=RATIO_BUCKETS, registry=theirs)
    name = f"{PREFIX}_decisions"
    decisions = Counter(name, families[name].documentation, ["worker_id", "dp_rank"], registry=theirs)
    name = f"{PREFIX}_disaggregated_decisions"
    disaggregated = Counter(name, families[name].documentation, ["path"], registry=theirs)

    rng = random.Random(1)
    edges = [*LATENCY_BUCKETS, 0.0, 2.0]
    for i in range(3000):
        times = [rng.choice(edges) if rng.random() < 0.3 else rng.random() ** 4 for _ in range(4)]
        queued = times[3] if i % 3 == 0 else 0.0
        blocks = rng.choice([*OVERLAP_BLOCK_BUCKETS, 3, 5000, 9000])
        tokens = rng.randint(1, 20_000)
        cached = min(tokens, rng.choice([0, tokens // 10, tokens // 2, tokens, rng.randint(0, tokens)]))
        timing = DecisionTiming(hashing_s=times[0], matching_s=times[1], scheduling_s=times[2], queued_s=queued)
        worker_id, dp_rank = rng.choice([(1, 0), (1, 1), (2**64 - 1, 0)])
        path: DisaggregationPath = "local_prefill" if i % 3 else "remote_prefill"
        how = DisaggregationReceipt(path=path, reason="", decode_uncached_tokens=0, threshold_tokens=256)
        routed = RouteDecision(worker_id=worker_id, dp_rank=dp_rank, overlap_blocks=blocks, cached_tokens=cached,
                               request_id="r", timing=timing, disaggregation=how if i % 5 == 0 else None)  # fmt: skip
        if i % 5 == 0:
            disaggregated.labels(path).inc()
        metrics.decision(routed, tokens, times[0] + times[2])
        decisions.labels(str(worker_id), str(dp_rank)).inc()
        for phase, value in zip(("hashing", "matching", "scheduling"), times, strict=False):
            phases[phase].observe(value)
        if queued:
            phases["queued"].observe(queued)
        phases["request"].observe(times[0] + times[2])
        overlap.observe(blocks)
        hit_ratio.observe(min(1.0, cached / tokens))
        method, outcome = rng.choice([("new", "ok"), ("mark_free", "ok"), ("mark_free", "unknown_request_id")])
        metrics.count(method, outcome)
        requests.labels(method, outcome).inc()

    def exposition(registry: CollectorRegistry) -> str:
        return re.sub(r"(_created\{?[^ ]*) \S+", r"\1 T", generate_latest(registry).decode())

    assert "_bucket" in exposition(ours)
    assert exposition(ours) == exposition(theirs)


def test_decisions_per_rank_kv_usage_and_build_info() -> None:
    with serve(policy="least_loaded", active_decode_blocks_threshold=0.5) as client:
        client.post("/v1/workers", json={"worker_id": 3, "dp_size": 2, "total_kv_blocks": 8})
        client.post("/v1/workers", json={"worker_id": 5})
        for i in range(6):
            client.post("/v1/new", json={"tokens": prompt(10 + i, 32), "request_id": f"r{i}"})
        per_rank = {
            (worker, rank): metric(client, "kv_router_decisions_total", worker_id=worker, dp_rank=rank)
            for worker, rank in (("3", "0"), ("3", "1"), ("5", "0"))
        }
        # least_loaded spreads the six bookings over the three ranks, two each.
        assert per_rank == {("3", "0"): 2, ("3", "1"): 2, ("5", "0"): 2}
        assert metric(client, "kv_router_worker_kv_total_blocks", worker_id="3", dp_rank="1") == 8
        # Worker 5 declared no capacity and reports no usage (it has no NATS load stream): no series.
        text = client.get("/metrics").text
        assert 'kv_router_worker_kv_total_blocks{dp_rank="0",worker_id="5"}' not in text
        assert "kv_router_worker_kv_used_blocks{" not in text
        # Two prompts of 2 blocks each on a rank of 8 blocks: over the 0.5 decode threshold, busy.
        assert metric(client, "kv_router_worker_busy", worker_id="3", dp_rank="0") == 0
        client.post("/v1/new", json={"tokens": prompt(20, 64), "request_id": "big"})
        busy = [metric(client, "kv_router_worker_busy", worker_id="3", dp_rank=r) for r in ("0", "1")]
        assert busy.count(1.0) == 1
        version = client.get("/openapi.json").json()["info"]["version"]
        # Which C accelerators run is visible, in /v1/info and the metric: all four where they were
        # built (CI's first pass), none under KV_ROUTER_NO_NATIVE=1 (its second pass).
        native = [] if SWITCHED_OFF or indexer_native.accel is None else ["indexer", "events", "router", "api"]
        assert client.get("/v1/info").json()["native"] == native
        labels = {"version": version, "policy": "least_loaded", "native": ",".join(native) or "none"}
        assert metric(client, "kv_router_build_info", **labels) == 1


def test_a_c_path_handing_its_input_to_python_is_counted() -> None:
    """An i64 block hash is a form the C JSON decoder does not take: msgspec decodes it, and the hand-over
    shows in ``kv_router_native_declines_total`` (with the accelerator off nothing is handed over)."""
    series = {"module": "indexer._native", "reason": "json_event_form"}
    with serve() as client:
        client.post("/v1/workers", json={"worker_id": 1})
        # The counter is the process's: a series nobody declined into yet is not exported.
        before = metric(client, "kv_router_native_declines_total", **series) or 0
        plain = stored_event(1, prompt(4, 32))
        assert client.post("/v1/events", json=plain).status_code == 200
        assert (metric(client, "kv_router_native_declines_total", **series) or 0) == before
        wide = {
            "worker_id": 1,
            "event": {
                "event_id": 2,
                "data": {"stored": {"parent_hash": None, "blocks": [{"block_hash": -5, "tokens_hash": 7}]}},
            },
        }
        assert client.post("/v1/events", json=wide).status_code == 200
        assert metric(client, "kv_router_events_applied_total", event_type="stored", status="ok") == 2
        declined = 1 if indexer_native.ENABLED else 0
        assert (metric(client, "kv_router_native_declines_total", **series) or 0) == before + declined

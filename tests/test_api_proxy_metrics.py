"""The proxy's calibration metrics: predicted against engine-reported cached tokens, per worker, over a window."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from api.proxy.metrics import ProxyMetrics
from router.event_plane.embedded_server import EmbeddedNats
from tests.metrics import sample, total
from tests.proxy_fleet import MODEL, fleet


def test_the_calibration_gauge_covers_each_workers_last_window_of_reports() -> None:
    registry = CollectorRegistry()
    metrics = ProxyMetrics(registry, window=2, registered=lambda worker_id: True)
    metrics.cached_tokens(1, predicted=640, actual=0)  # the index promised what the engine had lost
    metrics.cached_tokens(1, predicted=640, actual=640)
    metrics.cached_tokens(1, predicted=320, actual=320)  # the first report leaves the window
    metrics.cached_tokens(2, predicted=0, actual=64)  # nothing predicted: no ratio yet
    text = generate_latest(registry).decode()
    assert sample(text, "kv_router_proxy_cache_calibration", worker_id="1") == 1.0
    assert sample(text, "kv_router_proxy_cache_calibration", worker_id="2") is None
    assert sample(text, "kv_router_proxy_calibration_samples", worker_id="1") == 2
    assert sample(text, "kv_router_proxy_calibration_samples", worker_id="2") == 1
    # The error histogram keeps every report: -640 once, 0 twice, +64 once.
    assert sample(text, "kv_router_proxy_cached_tokens_error_bucket", le="-1024.0") == 0
    assert sample(text, "kv_router_proxy_cached_tokens_error_bucket", le="-256.0") == 1
    assert sample(text, "kv_router_proxy_cached_tokens_error_bucket", le="0.0") == 3
    assert sample(text, "kv_router_proxy_cached_tokens_error_bucket", le="64.0") == 4
    # With negative buckets a Prometheus histogram has no _sum or _count: +Inf is the count.
    assert sample(text, "kv_router_proxy_cached_tokens_error_bucket", le="+Inf") == 4
    assert sample(text, "kv_router_proxy_cached_tokens_error_count") is None
    metrics.cached_tokens(1, predicted=640, actual=320)
    text = generate_latest(registry).decode()
    assert sample(text, "kv_router_proxy_cache_calibration", worker_id="1") == (320 + 320) / (320 + 640)


def test_a_worker_that_left_takes_its_calibration_series_with_it() -> None:
    """Before, a removed worker's calibration and samples were exported for the process's life, and a
    late report of one made its window anew."""
    registry = CollectorRegistry()
    registered = {1, 2}
    metrics = ProxyMetrics(registry, window=4, registered=registered.__contains__)
    metrics.cached_tokens(1, predicted=64, actual=64)
    metrics.cached_tokens(2, predicted=64, actual=0)
    text = generate_latest(registry).decode()
    assert sample(text, "kv_router_proxy_calibration_samples", worker_id="2") == 1
    registered.discard(2)
    text = generate_latest(registry).decode()
    assert sample(text, "kv_router_proxy_cache_calibration", worker_id="2") is None
    assert sample(text, "kv_router_proxy_calibration_samples", worker_id="2") is None
    assert sample(text, "kv_router_proxy_cache_calibration", worker_id="1") == 1.0
    metrics.cached_tokens(2, predicted=64, actual=64)  # a request still on it when it left, answered since
    registered.add(2)  # back under its id: it starts afresh
    text = generate_latest(registry).decode()
    assert sample(text, "kv_router_proxy_calibration_samples", worker_id="2") is None
    assert sample(text, "kv_router_proxy_cached_tokens_error_bucket", le="+Inf") == 3  # every report still counted


def test_workers_coming_and_going_with_no_scrape_leave_a_bounded_number_of_calibration_windows() -> None:
    """Windows of workers that left were dropped at scrape time only: with no scrape, each worker that
    came, was answered and left kept its window for the process's life. A report now looks for them
    once the windows held have doubled: those of the workers that stay are kept."""
    registry = CollectorRegistry()
    staying = {1, 2, 3}
    registered = set(staying)
    metrics = ProxyMetrics(registry, window=4, registered=registered.__contains__)
    passing = range(100, 5100)
    for worker_id in passing:
        registered.add(worker_id)
        metrics.cached_tokens(worker_id, predicted=64, actual=32)
        registered.discard(worker_id)
        metrics.cached_tokens(1 + worker_id % 3, predicted=64, actual=64)
    held = [worker_id for worker_id in passing if metrics.calibration(worker_id) is not None]
    assert len(held) <= 64
    assert [metrics.calibration(worker_id) for worker_id in sorted(staying)] == [1.0, 1.0, 1.0]


@pytest.mark.anyio
async def test_a_proxy_only_fleet_counts_its_decisions_in_the_decision_metrics(nats_server: EmbeddedNats) -> None:
    """The dashboards' decision panels and alerts read ``kv_router_decisions_total``, the phases'
    histogram, overlap and predicted hits: a fleet that only proxies must move them, one decision per
    request (streamed or not), without counting a call of the decision API it never had."""
    async with fleet(nats_server.url) as proxied:
        tokens = list(range(1, 4 * 64 + 1))
        for stream in (False, True, False):
            answer = await proxied.client.completions.create(model=MODEL, prompt=tokens, max_tokens=2, stream=stream)
            if stream:
                async for _ in answer:  # type: ignore[union-attr]
                    pass
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"{proxied.url}/metrics")).text
    assert total(text, "kv_router_decisions_total") == 3
    assert sample(text, "kv_router_decision_duration_seconds_count", phase="request") == 3
    assert sample(text, "kv_router_decision_duration_seconds_count", phase="scheduling") == 3
    assert sample(text, "kv_router_overlap_blocks_count") == 3
    assert sample(text, "kv_router_predicted_cache_hit_ratio_count") == 3
    assert total(text, "kv_router_requests_total", method="new") == 0

"""The proxy's calibration metrics: predicted against engine-reported cached tokens, per worker, over a window."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from api.proxy.metrics import ProxyMetrics
from tests.metrics import sample


def test_the_calibration_gauge_covers_each_workers_last_window_of_reports() -> None:
    registry = CollectorRegistry()
    metrics = ProxyMetrics(registry, window=2)
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

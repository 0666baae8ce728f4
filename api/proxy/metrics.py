"""The proxy's metrics, ``kv_router_proxy_*``: outcomes, retries, and how far the index can be trusted.

When the engine reports ``usage.prompt_tokens_details.cached_tokens``, the router's prediction for
the request (the cached tokens of the chosen worker at the decision) is compared with it:

* ``kv_router_proxy_cached_tokens_error``: histogram of actual minus predicted, in tokens (negative:
  the index promised more than the engine had; with negative buckets Prometheus exposes no ``_sum``
  or ``_count``, the ``+Inf`` bucket is the count);
* ``kv_router_proxy_cache_calibration{worker_id}``: over each worker's last ``window`` reports, the
  engine's cached tokens over the predicted ones (1: the index is right about this worker; below 1:
  it over-promises, e.g. lost events; above 1: the worker has cache the index does not know of).

And ``kv_router_proxy_added_seconds``, the proxy's own share of a streamed request's time to first
token: from its body in to its request written to the worker (body decode, tokens, the decision, a
pooled connection), plus from the read of the worker's first events to their write to the client.
What it leaves out is the network hop and the wait for the loop before a read is handled.

Per request this costs a few additions; the gauges are computed at scrape time. The windows of workers
that left are dropped at a scrape, and at a report once the windows held have doubled since the last
look (bounded with no scrape too, however workers come and go).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from api.metrics import PREFIX, _HistogramCollector, histogram_series
from api.proxy.segments import SegmentCache

__all__ = ["ProxyMetrics"]

ERROR_BUCKETS = (
    -16384, -4096, -1024, -256, -64, -16, -1, 0, 16, 64, 256, 1024, 4096, 16384,
)  # fmt: skip
ADDED_BUCKETS = (
    0.00005, 0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5,
)  # fmt: skip
# The proxy's POST routes (`api.proxy.wire.ROUTES`).
ROUTE_LABELS = ("completions", "chat_completions", "embeddings", "rerank", "responses")
# Where a prompt's routing tokens came from (`api.proxy.service`, `api.proxy.tokens`).
PROMPT_SOURCES = ("ids", "bytes", "local", "engine")
# Windows held before a report looks for those of workers that left (then at twice as many as it kept): a
# sweep per as many new windows as it kept, so that with no scrape, however workers come and go, the
# windows held stay bounded and a report costs O(1) amortised.
_SWEEP_AT_LEAST = 64
OUTCOMES = (
    "ok", "bad_request", "no_worker", "queue_rejected", "upstream_error", "upstream_status",
    "client_disconnected", "tokenize_failed", "unauthorized", "instance_query", "internal_error",
)  # fmt: skip


class _Window:
    """A worker's last ``size`` (predicted, actual) pairs with their running sums."""

    __slots__ = ("actual", "pairs", "predicted")

    def __init__(self, size: int) -> None:
        self.pairs: deque[tuple[int, int]] = deque(maxlen=size)
        self.predicted = 0
        self.actual = 0

    def add(self, predicted: int, actual: int) -> None:
        pairs = self.pairs
        if len(pairs) == pairs.maxlen:
            old_predicted, old_actual = pairs[0]
            self.predicted -= old_predicted
            self.actual -= old_actual
        pairs.append((predicted, actual))
        self.predicted += predicted
        self.actual += actual


class ProxyMetrics(Collector):
    def __init__(self, registry: CollectorRegistry, window: int, registered: Callable[[int], bool]) -> None:
        """``registered``: whether a worker id is registered now (only those have a calibration window)."""
        self._requests = Counter(
            f"{PREFIX}_proxy_requests",
            "Proxied OpenAI requests by route (completions, chat_completions, embeddings, rerank, responses) and "
            "outcome (ok, bad_request, "
            "no_worker, queue_rejected, upstream_error: no worker answered or a stream broke, upstream_status: "
            "the worker's own 4xx, or its 429 / 503 once retries ran out, client_disconnected, tokenize_failed, "
            "unauthorized: no or a wrong API token, instance_query: Dynamo's query_instance_id answered with the "
            "decision, internal_error: a defect of the proxy, logged with its traceback).",
            ["route", "outcome"],
            registry=registry,
        )
        self._counts = {
            (route, outcome): self._requests.labels(route, outcome) for route in ROUTE_LABELS for outcome in OUTCOMES
        }
        sources = Counter(
            f"{PREFIX}_proxy_prompts",
            "Prompts by where their routing tokens came from: ids (given as token ids), bytes (routed by their "
            "bytes: no worker of the model sends KV events), local (the model's own tokenizer files), engine (a "
            "worker's /tokenize: a round trip before routing).",
            ["source"],
            registry=registry,
        )
        self._sources = {source: sources.labels(source) for source in PROMPT_SOURCES}
        self._retries = Counter(
            f"{PREFIX}_proxy_upstream_failures",
            "Workers that refused a connection, timed out or answered 5xx before their first byte (each one then "
            "told to its circuit breaker and the request sent to the next best worker, within the retry bound).",
            registry=registry,
        )
        self._retried = Counter(
            f"{PREFIX}_proxy_retries",
            "Requests tried again after a worker failed them before their first byte, by why: upstream_error "
            "(refused, reset, timed out, 5xx) or overloaded (the engine's 429 or 503), after the backoff; a "
            "disaggregated request's last attempt on its decode worker alone, its prefill legs failed, is an "
            "upstream_error one.",
            ["reason"],
            registry=registry,
        )
        for reason in ("upstream_error", "overloaded"):  # present from the start: a first retry is an increase
            self._retried.labels(reason)
        self.error = histogram_series(ERROR_BUCKETS)
        registry.register(
            _HistogramCollector(
                f"{PREFIX}_proxy_cached_tokens_error",
                "Engine-reported cached prompt tokens minus the router's prediction, per request that reported them.",
                (),
                {(): self.error},
            )
        )
        self.added = histogram_series(ADDED_BUCKETS)
        registry.register(
            _HistogramCollector(
                f"{PREFIX}_proxy_added_seconds",
                "The proxy's own share of a streamed request's time to first token: body in to request written "
                "to the worker, plus the worker's first events read to their write to the client (seconds).",
                (),
                {(): self.added},
            )
        )
        self._window = window
        self._registered = registered
        self._registry = registry
        self._windows: dict[int, _Window] = {}
        self._sweep_at = _SWEEP_AT_LEAST
        registry.register(self)

    def count(self, route: str, outcome: str) -> None:
        self._counts[route, outcome].inc()

    def prompt(self, source: str) -> None:
        """One prompt's routing tokens came from ``source`` (one of `PROMPT_SOURCES`)."""
        self._sources[source].inc()

    def upstream_failure(self) -> None:
        self._retries.inc()

    def watch_admission(self, in_flight: Callable[[], float], waiting: Callable[[], float]) -> None:
        """The concurrency cap's gauges, read at scrape time."""
        Gauge(
            f"{PREFIX}_proxy_requests_in_flight",
            "Requests holding a slot under proxy_max_concurrent_requests (0 without a cap).",
            registry=self._registry,
        ).set_function(in_flight)
        Gauge(
            f"{PREFIX}_proxy_requests_waiting",
            "Requests waiting for a slot under proxy_max_concurrent_requests.",
            registry=self._registry,
        ).set_function(waiting)

    def watch_tokenizer_caches(self, caches: dict[str, SegmentCache]) -> None:
        """Each model's tokenizer cache (`api.proxy.segments`), read at scrape time."""
        if caches:
            self._registry.register(_TokenizerCacheCollector(caches))

    def retried(self, reason: str) -> None:
        self._retried.labels(reason).inc()

    def cached_tokens(self, worker_id: int, predicted: int, actual: int) -> None:
        self.error.observe(actual - predicted)
        window = self._windows.get(worker_id)
        if window is None:
            if not self._registered(worker_id):  # an answer come after its worker left
                return
            if len(self._windows) >= self._sweep_at:
                self._drop_departed()
            window = self._windows[worker_id] = _Window(self._window)
        window.add(predicted, actual)

    def calibration(self, worker_id: int) -> float | None:
        """The worker's actual over predicted cached tokens in its window; None before any prediction."""
        window = self._windows.get(worker_id)
        if window is None or window.predicted == 0:
            return None
        return window.actual / window.predicted

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        calibration, samples = families = self._families()
        self._drop_departed()
        for worker_id, window in sorted(self._windows.items()):
            ratio = self.calibration(worker_id)
            if ratio is not None:
                calibration.add_metric([str(worker_id)], ratio)
            samples.add_metric([str(worker_id)], len(window.pairs))
        yield from families

    def _drop_departed(self) -> None:
        """A worker that left takes its window with it: its series end, as its circuit's do."""
        for worker_id in [worker_id for worker_id in self._windows if not self._registered(worker_id)]:
            del self._windows[worker_id]
        self._sweep_at = max(_SWEEP_AT_LEAST, 2 * len(self._windows))

    def _families(self) -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily(
                f"{PREFIX}_proxy_cache_calibration",
                f"Engine-reported over predicted cached tokens across the worker's last {self._window} reports "
                "(1: the index is right about it; absent until something was predicted cached).",
                labels=["worker_id"],
            ),
            GaugeMetricFamily(
                f"{PREFIX}_proxy_calibration_samples",
                "Reports in the worker's calibration window.",
                labels=["worker_id"],
            ),
        ]


class _TokenizerCacheCollector(Collector):
    """``kv_router_proxy_tokenizer_cache_{hits,misses}_total{model}`` (text pieces found or encoded) and
    ``kv_router_proxy_tokenizer_cache_tokens{model}`` (what it holds, each piece counting 16 more)."""

    def __init__(self, caches: dict[str, SegmentCache]) -> None:
        self._caches = caches

    def collect(self) -> Iterator[Metric]:
        hits = CounterMetricFamily(
            f"{PREFIX}_proxy_tokenizer_cache_hits", "Text pieces whose ids the tokenizer cache had.", labels=["model"]
        )
        misses = CounterMetricFamily(
            f"{PREFIX}_proxy_tokenizer_cache_misses", "Text pieces encoded (not in the tokenizer cache).",
            labels=["model"],
        )  # fmt: skip
        held = GaugeMetricFamily(
            f"{PREFIX}_proxy_tokenizer_cache_tokens", "Tokens the tokenizer cache holds (each piece 16 more).",
            labels=["model"],
        )  # fmt: skip
        for model, cache in self._caches.items():
            hits.add_metric([model], cache.hits)
            misses.add_metric([model], cache.misses)
            held.add_metric([model], cache.tokens)
        yield from (hits, misses, held)

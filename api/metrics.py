"""Prometheus metrics of the service, named ``kv_router_*``, on a registry the app is given.

Two kinds, by cost:

* Counters and histograms that move with requests (`ApiMetrics`): counts by method and outcome and
  decisions per (worker, dp_rank) are plain dict increments, exposed as counters at scrape time.
  The histograms are `_Histogram`s (or their C twin, `histogram_series`), not prometheus-client's
  (a lock and a bucket loop, about 1.3 µs an observation, six per decision): a bisect and two
  additions, read into the same families at scrape time. They have one writer, the event loop,
  which also serves the scrapes.
* State and counts kept elsewhere, read when ``/metrics`` is scraped, so keeping them costs the
  request path nothing: per-(worker, dp_rank) load, KV usage, indexed blocks, queue, workers, index
  size (`RouterStateCollector`); the event door's counts and stream states (`EventStreamCollector`);
  the NATS plane's control messages and connection (`EventPlaneCollector`); the embedded
  nats-server's restarts (`EmbeddedNatsCollector`); how often each C path
  handed its input to the Python twin (`NativeDeclinesCollector`).
* ``kv_router_build_info{version,policy,native}``: constant 1, for joining version and policy onto panels;
  ``native`` lists the C accelerators running (``indexer,events,router,api``, or ``none``).

Each app gets its own `CollectorRegistry` (tests build many apps in one process).
"""

from __future__ import annotations

import os
import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from api.native import ENABLED as NATIVE
from api.native import accel
from api.plane_lifecycle import PlaneLifecycle
from indexer.native import DECLINES
from indexer.sequencer import EventSequencer
from router.doctor import ConfigDoctor
from router.engines.direct import DirectEngine
from router.engines.zmq_stream import ZmqEngineStream
from router.event_plane.embedded_server import ServerKeeper
from router.kv_router import KvRouter
from router.types import RouteDecision
from router.worker_health import STATE_VALUES

__all__ = [
    "ApiMetrics",
    "EmbeddedNatsCollector",
    "EventPlaneCollector",
    "EventStreamCollector",
    "NativeDeclinesCollector",
    "RouterStateCollector",
    "register_build_info",
]

PREFIX = "kv_router"

# Decisions take tens of microseconds to a few milliseconds: sub-millisecond resolution where the
# mass is, and a tail to a second for queued requests.
LATENCY_BUCKETS = (
    10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6,
    1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 1.0,
)  # fmt: skip
OVERLAP_BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# The hot routes' methods, counted from the start (their "ok" series exist at 0).
METHODS = ("new", "potential_loads", "mark_prefill", "mark_free", "record_output", "events", "overlap", "route")
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class ApiMetrics:
    """Request-driven metrics: counts by method and outcome, decision latency, overlap, events."""

    def __init__(self, registry: CollectorRegistry) -> None:
        # (method, outcome) -> calls, a plain dict increment per request (prometheus-client's Counter
        # takes a lock and three calls); the ok ones exist (at 0) from the start.
        self._counts: dict[tuple[str, str], int] = {}
        self._counts_created: dict[tuple[str, str], float] = {}
        for method in METHODS:
            self.count(method, "ok", 0)
        registry.register(
            _TallyCollector(
                f"{PREFIX}_requests",
                "Router API calls by method (new, potential_loads, mark_prefill, mark_free, record_output, events, "
                "overlap, route, router for bodies whose method could not be read) and outcome (ok or the error type).",
                ("method", "outcome"),
                self._counts,
                self._counts_created,
            )
        )
        phases = ("hashing", "matching", "scheduling", "queued", "request")
        self._phase = {phase: histogram_series(LATENCY_BUCKETS) for phase in phases}
        self._overlap = histogram_series(OVERLAP_BLOCK_BUCKETS)
        self._hit_ratio = histogram_series(RATIO_BUCKETS)
        histograms: tuple[tuple[str, str, tuple[str, ...], dict[tuple[str, ...], HistogramSeries]], ...] = (
            (
                f"{PREFIX}_decision_duration_seconds",
                "Time of one routing decision by phase: hashing the prompt, matching it in the index, "
                "scheduling (load, cost, pick, booking), waiting in the queue, and the whole HTTP call "
                "from body received to reply encoded (phase=request).",
                ("phase",),
                {(phase,): histogram for phase, histogram in self._phase.items()},
            ),
            (
                f"{PREFIX}_overlap_blocks",
                "Prompt blocks predicted cached on the chosen worker (Dynamo's overlap_blocks).",
                (),
                {(): self._overlap},
            ),
            (
                f"{PREFIX}_predicted_cache_hit_ratio",
                "Share of the prompt's tokens predicted cached on the chosen worker.",
                (),
                {(): self._hit_ratio},
            ),
        )
        for name, documentation, labels, series in histograms:
            registry.register(_HistogramCollector(name, documentation, labels, series))
        # (worker_id, dp_rank) -> decisions routed there, and when its series appeared.
        self._decisions: dict[tuple[int, int], int] = {}
        self._decisions_created: dict[tuple[int, int], float] = {}
        registry.register(
            _TallyCollector(
                f"{PREFIX}_decisions",
                "Routing decisions by the (worker, dp_rank) chosen.",
                ("worker_id", "dp_rank"),
                self._decisions,
                self._decisions_created,
            )
        )
        # (path,) -> decisions on a disaggregated fleet by how the prompt was prefilled.
        self._disaggregated: dict[tuple[str], int] = {}
        self._disaggregated_created: dict[tuple[str], float] = {}
        registry.register(
            _TallyCollector(
                f"{PREFIX}_disaggregated_decisions",
                "Decisions on a disaggregated fleet by path: remote_prefill (a prefill worker, then the decode "
                "worker) or local_prefill (the decode worker alone: little uncached, or no prefill worker).",
                ("path",),
                self._disaggregated,
                self._disaggregated_created,
            )
        )

    def count(self, method: str, outcome: str = "ok", calls: int = 1) -> None:
        key = (method, outcome)
        counts = self._counts
        count = counts.get(key)
        if count is None:
            self._counts_created[key] = time.time()
            count = 0
        counts[key] = count + calls

    def decision(self, decision: RouteDecision, prompt_tokens: int, request_s: float) -> None:
        phase = self._phase
        timing = decision.timing
        phase["hashing"].observe(timing.hashing_s)
        phase["matching"].observe(timing.matching_s)
        phase["scheduling"].observe(timing.scheduling_s)
        if timing.queued_s:
            phase["queued"].observe(timing.queued_s)
        phase["request"].observe(request_s)
        rank = (decision.worker_id, decision.dp_rank)
        count = self._decisions.get(rank)
        if count is None:
            self._decisions_created[rank] = time.time()
            count = 0
        self._decisions[rank] = count + 1
        if decision.disaggregation is not None:
            path = (decision.disaggregation.path,)
            if path not in self._disaggregated:
                self._disaggregated_created[path] = time.time()
            self._disaggregated[path] = self._disaggregated.get(path, 0) + 1
        self._overlap.observe(decision.overlap_blocks)
        if prompt_tokens:
            self._hit_ratio.observe(min(1.0, decision.cached_tokens / prompt_tokens))


def register_build_info(registry: CollectorRegistry, *, version: str, policy: str, native: list[str]) -> None:
    Info(
        f"{PREFIX}_build",
        "The running kv-router: package version, selection policy and the C accelerators it runs.",
        registry=registry,
    ).info({"version": version, "policy": policy, "native": ",".join(native) or "none"})


class _TallyCollector(Collector):
    """A counter family from a dict of label values -> count kept by `ApiMetrics` (a plain dict
    increment per event), each series with the time it appeared, as prometheus-client exposes a
    labelled ``Counter``."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labels: Sequence[str],
        counts: dict[tuple[Any, ...], int],
        created: dict[tuple[Any, ...], float],
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labels = list(labels)
        self._counts = counts
        self._created = created

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self._name, self._documentation, labels=self._labels)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._documentation, labels=self._labels)
        for label_values, count in self._counts.items():
            created = self._created[label_values] if _CREATED else None
            family.add_metric([str(value) for value in label_values], count, created=created)
        yield family


class _Histogram:
    """One histogram series: per-bucket counts (not cumulative; the last is +Inf) and the sum."""

    __slots__ = ("bounds", "counts", "created", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(bound) for bound in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        # Bucket ``le=b`` counts values <= b: the first bound not below the value (as prometheus-client).
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value


class HistogramSeries(Protocol):
    """What a histogram collector reads of a series: `_Histogram`, or its C twin `api._native.Histogram`."""

    @property
    def bounds(self) -> tuple[float, ...]: ...

    @property
    def counts(self) -> list[int]: ...

    @property
    def total(self) -> float: ...

    @property
    def created(self) -> float: ...

    def observe(self, value: float) -> None: ...


def histogram_series(bounds: Sequence[float]) -> HistogramSeries:
    """A series for ``bounds``: in C with the accelerator (an observation without a Python frame; the
    six per decision were 5-6% of its instructions), else `_Histogram`; the same counts and sums."""
    if not NATIVE:
        return _Histogram(bounds)
    series = accel.Histogram(bounds)
    series.created = time.time()
    return series


# prometheus-client's switch for the ``_created`` series, honoured here as its own histograms do.
_CREATED = os.environ.get("PROMETHEUS_DISABLE_CREATED_SERIES", "False").lower() not in ("true", "1", "t")


class _HistogramCollector(Collector):
    """`_Histogram` series as one histogram family, sample for sample as prometheus-client's
    ``Histogram`` exposes them (buckets, count, sum, created)."""

    def __init__(
        self, name: str, documentation: str, labels: Sequence[str], series: dict[tuple[str, ...], HistogramSeries]
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labels = list(labels)
        self._series = series
        first = next(iter(series.values()))
        self._le = [floatToGoString(bound) for bound in first.bounds] + ["+Inf"]  # type: ignore[no-untyped-call]

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self._name, self._documentation, labels=self._labels)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labels)
        for label_values, histogram in self._series.items():
            cumulative = 0.0
            buckets = []
            for le, count in zip(self._le, histogram.counts, strict=True):
                cumulative += count
                buckets.append((le, cumulative))
            family.add_metric(list(label_values), buckets, histogram.total)
            if _CREATED:
                family.add_sample(
                    f"{self._name}_created", dict(zip(self._labels, label_values, strict=True)), histogram.created
                )
        yield family


class RouterStateCollector(Collector):
    """Gauges read from the router when ``/metrics`` is scraped."""

    def __init__(self, router: KvRouter) -> None:
        self._router = router

    def describe(self) -> Iterator[Metric]:
        # Returning the families without samples keeps registration from calling collect().
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        router = self._router
        families = self._families()
        (prefill, decode, active, busy, kv_used, kv_total, indexed, queue_req, queue_isl, workers, nodes, index_bytes,
         predicted, credited, engine_waiting, engine_running, roles, circuit, opened, checked, kv_events,
         removed) = families  # fmt: skip
        capacity = {worker.worker_id: worker.total_kv_blocks for worker in router.workers()}
        for worker in router.workers():
            worker_label = [str(worker.worker_id)]
            roles.add_metric([*worker_label, worker.role], 1.0)
            kv_events.add_metric(worker_label, 1.0 if router.expects_events(worker) else 0.0)
            availability = router.health.availability(worker.worker_id)
            circuit.add_metric(worker_label, STATE_VALUES[availability.circuit])
            opened.add_metric(worker_label, availability.circuit_opened)
            if availability.health_check != "unknown":
                checked.add_metric(worker_label, 1.0 if availability.health_check == "passing" else 0.0)
        for load in router.rank_loads():
            labels = [str(load.worker_id), str(load.dp_rank)]
            prefill.add_metric(labels, load.active_prefill_tokens)
            decode.add_metric(labels, load.active_decode_blocks)
            active.add_metric(labels, load.active_requests)
            busy.add_metric(labels, 1.0 if load.busy else 0.0)
            if load.kv_used_blocks is not None:
                kv_used.add_metric(labels, load.kv_used_blocks)
            if load.engine_requests_waiting is not None:
                engine_waiting.add_metric(labels, load.engine_requests_waiting)
            if load.engine_requests_running is not None:
                engine_running.add_metric(labels, load.engine_requests_running)
            total = capacity.get(load.worker_id)
            if total is not None:
                kv_total.add_metric(labels, total)
        stats = router.tree.stats()
        for (worker_id, dp_rank), blocks in stats.blocks.items():
            indexed.add_metric([str(worker_id), str(dp_rank)], blocks)
        queue = router.queue_stats()
        queue_req.add_metric([], queue.pending_count)
        queue_isl.add_metric([], queue.pending_isl_tokens)
        workers.add_metric([], len(router.workers()))
        nodes.add_metric([], stats.nodes)
        index_bytes.add_metric([], stats.estimated_bytes)
        if router.predictions is not None:
            for (worker_id, dp_rank), blocks in router.predictions.blocks().items():
                predicted.add_metric([str(worker_id), str(dp_rank)], blocks)
        if router.computed_prompts is not None:
            for (worker_id, dp_rank), blocks in router.computed_prompts.credited_blocks().items():
                credited.add_metric([str(worker_id), str(dp_rank)], blocks)
        for reason, count in router.removals.items():
            removed.add_metric([reason], count)
        yield from families

    @staticmethod
    def _families() -> list[GaugeMetricFamily | CounterMetricFamily]:
        rank = ["worker_id", "dp_rank"]
        return [
            GaugeMetricFamily(
                f"{PREFIX}_worker_active_prefill_tokens", "Prefill tokens booked and not yet done.", labels=rank
            ),
            GaugeMetricFamily(
                f"{PREFIX}_worker_active_decode_blocks",
                "Distinct prompt blocks of the active requests (shared prefixes count once).",
                labels=rank,
            ),
            GaugeMetricFamily(f"{PREFIX}_worker_active_requests", "Requests booked and not freed.", labels=rank),
            GaugeMetricFamily(
                f"{PREFIX}_worker_busy",
                "1 while the rank is over a busy threshold (a worker whose ranks all are is skipped).",
                labels=rank,
            ),
            GaugeMetricFamily(
                f"{PREFIX}_worker_kv_used_blocks",
                "KV blocks in use as the worker last reported them (ranks that report load over NATS).",
                labels=rank,
            ),
            GaugeMetricFamily(
                f"{PREFIX}_worker_kv_total_blocks",
                "KV blocks of the rank's cache, from the worker's registration (ranks that declared it).",
                labels=rank,
            ),
            GaugeMetricFamily(
                f"{PREFIX}_worker_indexed_blocks", "Device-tier blocks the index holds for this rank.", labels=rank
            ),
            GaugeMetricFamily(f"{PREFIX}_queue_pending_requests", "Requests waiting in the queue for capacity."),
            GaugeMetricFamily(f"{PREFIX}_queue_pending_isl_tokens", "Prompt tokens of the requests waiting."),
            GaugeMetricFamily(f"{PREFIX}_workers_registered", "Workers registered with the router."),
            GaugeMetricFamily(f"{PREFIX}_index_nodes", "Nodes of the KV index's radix tree."),
            GaugeMetricFamily(f"{PREFIX}_index_estimated_bytes", "Estimated memory held by the KV index."),
            GaugeMetricFamily(
                f"{PREFIX}_worker_predicted_blocks",
                "Blocks approximate mode predicts on this rank from routing (the worker sends no KV events).",
                labels=rank,
            ),
            GaugeMetricFamily(
                f"{PREFIX}_worker_credited_blocks",
                "Blocks of prompts the rank computed in the last computed_prompt_credit_secs, counted as cached "
                "there until its engine's KV events tell (the computed-prompt credit); absent while none are.",
                labels=rank,
            ),
            GaugeMetricFamily(
                f"{PREFIX}_worker_engine_requests_waiting",
                "Requests the engine reports queued (ranks whose bridge scrapes the engine's metrics).",
                labels=rank,
            ),
            GaugeMetricFamily(
                f"{PREFIX}_worker_engine_requests_running",
                "Requests the engine reports running (ranks whose bridge scrapes the engine's metrics).",
                labels=rank,
            ),
            GaugeMetricFamily(
                f"{PREFIX}_worker_role",
                "1 per registered worker, labelled with its role (prefill, decode or both): join on worker_id "
                "to split the per-rank series by pool.",
                labels=["worker_id", "role"],
            ),
            GaugeMetricFamily(
                f"{PREFIX}_worker_circuit_state",
                "The worker's circuit breaker: 0 closed (routed to), 1 half-open (probe requests), 2 open (out of "
                "routing after worker_breaker_failures failures in a row).",
                labels=["worker_id"],
            ),
            CounterMetricFamily(
                f"{PREFIX}_worker_circuit_opened",
                "Times the worker's circuit breaker opened (since it registered).",
                labels=["worker_id"],
            ),
            GaugeMetricFamily(
                f"{PREFIX}_worker_health_check_passing",
                "1 while the worker passes its active /health check, 0 while it fails it (out of routing); absent "
                "for workers not checked.",
                labels=["worker_id"],
            ),
            GaugeMetricFamily(
                f"{PREFIX}_worker_kv_events",
                "1 when the index follows the worker's cache from its KV events, 0 when approximate mode predicts "
                "it from routing (the worker sends none).",
                labels=["worker_id"],
            ),
            CounterMetricFamily(
                f"{PREFIX}_workers_removed",
                "Workers removed from routing, by reason: api (DELETE /v1/workers), deregistered (its registry "
                "entry deleted: a bridge withdrawing an engine that stopped answering, a publisher stopping), "
                "lease_expired (silent past its heartbeat lease), engine_unhealthy (a direct-mode engine stopped "
                "answering).",
                labels=["reason"],
            ),
        ]


class NativeDeclinesCollector(Collector):
    """How often each C path handed its input to the Python twin (`indexer.native.DECLINES`, every
    layer's count in this process), read at scrape time: a path that starts declining what it used to
    take shows here before it shows as lost speed."""

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for (module, reason), count in sorted(DECLINES.items()):
            family.add_metric([module, reason], count)
        yield family

    @staticmethod
    def _family() -> CounterMetricFamily:
        return CounterMetricFamily(
            f"{PREFIX}_native_declines",
            "Inputs a C accelerator handed to its Python twin, by extension module and reason (a form it "
            "does not take, a refusal the Python code names, a tree past 64 ranks).",
            labels=["module", "reason"],
        )


class EventStreamCollector(Collector):
    """The one event door's counters and stream states (every transport), read at scrape time."""

    def __init__(self, sequencer: EventSequencer) -> None:
        self._sequencer = sequencer

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        sequencer = self._sequencer
        applied, outcomes, trusted, held = families = self._families()
        for (event_type, status), count in sorted(sequencer.applied.items()):
            applied.add_metric([event_type, status], count)
        for outcome, count in sorted(sequencer.outcomes.items()):
            outcomes.add_metric([outcome], count)
        for stream in sequencer.status():
            labels = [str(stream.worker_id), str(stream.dp_rank)]
            trusted.add_metric(labels, 1.0 if stream.trusted else 0.0)
            held.add_metric(labels, stream.unreconciled_events)
        yield from families

    @staticmethod
    def _families() -> list[CounterMetricFamily | GaugeMetricFamily]:
        rank = ["worker_id", "dp_rank"]
        return [
            CounterMetricFamily(
                f"{PREFIX}_events_applied",
                "KV events that reached the index, by event type (stored, removed, cleared) and status (ok, or "
                "Dynamo's label for why the index rejected it).",
                labels=["event_type", "status"],
            ),
            CounterMetricFamily(
                f"{PREFIX}_stream_events",
                "KV events by sequencing outcome, whatever carried them: applied, duplicate, held, gap, resync_*, "
                "rejected_<reason>.",
                labels=["outcome"],
            ),
            GaugeMetricFamily(
                f"{PREFIX}_worker_stream_trusted",
                "1 while a rank's event stream is known complete; 0 after a gap, an unanswered resync or a NATS "
                "reconnect, until a resync verifies it (its live events are routed on meanwhile).",
                labels=rank,
            ),
            GaugeMetricFamily(
                f"{PREFIX}_worker_stream_unreconciled_events",
                "Live events applied while a resync is in flight (or ahead of a hole), kept to apply again when "
                "the answer comes.",
                labels=rank,
            ),
        ]


class EventPlaneCollector(Collector):
    """The NATS event plane's connection state and control counters, read when ``/metrics`` is scraped."""

    def __init__(self, lifecycle: PlaneLifecycle) -> None:
        self._lifecycle = lifecycle

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        lifecycle = self._lifecycle
        plane = lifecycle.plane
        control, resyncs, connected, state, disconnects, owed = families = self._families()
        if plane is not None:
            for outcome, count in sorted(plane.outcomes.items()):
                control.add_metric([outcome], count)
        owed.add_metric([], plane.registry_writes_owed if plane is not None else 0)
        resyncs.add_metric([], plane.subscriber.resyncs_in_flight if plane is not None else 0)
        connected.add_metric([], 1.0 if lifecycle.state == "connected" else 0.0)
        for name in ("connecting", "connected", "disconnected"):
            state.add_metric([name], 1.0 if lifecycle.state == name else 0.0)
        disconnects.add_metric([], lifecycle.disconnects)
        yield from families

    @staticmethod
    def _families() -> list[CounterMetricFamily | GaugeMetricFamily]:
        return [
            CounterMetricFamily(
                f"{PREFIX}_nats_control_messages",
                "Registry, heartbeat and load messages by outcome (registered, updated, removed, expired, "
                "reconnects, rejected_<reason>, ...), and events_dropped: KV events messages NATS dropped because "
                "this router fell behind (a slow consumer; the worker is resynced).",
                labels=["outcome"],
            ),
            GaugeMetricFamily(f"{PREFIX}_nats_resyncs_in_flight", "Resync requests awaiting a worker's answer."),
            GaugeMetricFamily(f"{PREFIX}_nats_connected", "1 while connected to the NATS server."),
            GaugeMetricFamily(
                f"{PREFIX}_event_plane_state",
                "1 for the event plane's current state: connecting (never started yet; /readyz 503), connected, "
                "disconnected (routing on the index it has).",
                labels=["state"],
            ),
            CounterMetricFamily(f"{PREFIX}_nats_disconnects", "Times the NATS connection was lost after it started."),
            GaugeMetricFamily(
                f"{PREFIX}_registry_writes_owed",
                "Workers whose registration or removal is applied here and not yet written to the shared "
                "registry (NATS or JetStream out of reach; retried every second).",
            ),
        ]


class EmbeddedNatsCollector(Collector):
    """The embedded nats-server's restarts (`ServerKeeper`), read when ``/metrics`` is scraped."""

    def __init__(self, keeper: ServerKeeper) -> None:
        self._keeper = keeper

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        family.add_metric([], self._keeper.restarts)
        yield family

    @staticmethod
    def _family() -> CounterMetricFamily:
        return CounterMetricFamily(
            f"{PREFIX}_embedded_nats_restarts",
            "Times the embedded nats-server exited unexpectedly and was started again on its port.",
        )


class EngineStreamCollector(Collector):
    """Engine ZMQ streams heard directly (``--engine``): messages by outcome, backlog; and, given the
    engines, whether each is up."""

    def __init__(self, streams: Sequence[ZmqEngineStream], engines: Sequence[DirectEngine] = ()) -> None:
        self._streams = streams
        self._engines = engines

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        outcomes, backlog, *up = families = self._families()
        for stream in self._streams:
            for outcome, count in sorted(stream.stats.items()):
                outcomes.add_metric([stream.endpoint, outcome], count)
            backlog.add_metric([stream.endpoint], stream.backlog)
        for engine in self._engines:
            up[0].add_metric([str(engine.worker_id)], float(engine.trouble() is None))
        yield from families

    def _families(self) -> list[CounterMetricFamily | GaugeMetricFamily]:
        families: list[CounterMetricFamily | GaugeMetricFamily] = [
            CounterMetricFamily(
                f"{PREFIX}_engine_stream_messages",
                "Engine ZMQ batches by outcome: messages, applied, duplicate, dropped_queue_full, gap, replayed, "
                "replay_failed, missing_history, restarts, rebuilds, unverified, tail_checks, tail_check_failed, "
                "tail_recovered, rejected_<reason>; events, ignored_events; connections (handshakes with the engine's "
                "PUB socket: one per engine start); reconnects (connections made afresh after one ended without "
                "libzmq connecting again).",
                labels=["endpoint", "outcome"],
            ),
            GaugeMetricFamily(
                f"{PREFIX}_engine_stream_backlog", "Engine batches waiting to be applied.", labels=["endpoint"]
            ),
        ]
        if self._engines:  # the bridge's streams come without theirs
            families.append(
                GaugeMetricFamily(
                    f"{PREFIX}_engine_up",
                    "Engines heard directly (--engine): 1 while up, 0 while down (with url=: its server not "
                    "answering or not yet routable; without: an event socket with no connection; GET /v1/doctor "
                    "says why).",
                    labels=["worker_id"],
                )
            )
        return families


class DoctorCollector(Collector):
    """``kv_router_config_problems{kind}``: the configuration doctor's current problems, every kind listed."""

    def __init__(self, doctor: ConfigDoctor) -> None:
        self._doctor = doctor

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for kind, count in self._doctor.counts().items():
            family.add_metric([kind], count)
        yield family

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            f"{PREFIX}_config_problems",
            "Configuration problems the doctor sees now, by kind (details: GET /v1/doctor).",
            labels=["kind"],
        )

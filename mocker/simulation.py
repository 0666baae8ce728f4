"""Offline replay: a router and simulated engines in one process, in simulated time (ms).

A discrete-event simulation. Its events are request arrivals (from the trace) and the ends of the
workers' forward passes. A worker runs a pass with `MockEngine.step` as soon as it has work: the pass
is decided (admissions, allocations) when it starts, and what it produced (first tokens, completions,
KV events) is delivered when it ends: KV events to the router's index, optionally ``event_delay_ms``
later to model the event plane's latency, first tokens and completions as ``mark_prefill`` /
``mark_free``, and a request's output progress (``record_output``) each time its output opens a new
block (a gateway streaming the tokens could tell it more often; the router is at most a block behind).
The router therefore knows at each decision what a real one would: the events published so far, its
own bookings and the output progress. At equal times pass ends come before arrivals, and every
arrival at one instant is routed before any worker starts a pass, as in Dynamo's replay harness.

On a disaggregated fleet (``roles``) a request the router sends to a prefill worker runs there first
with one output token; when that leg ends the router is told (``prefill_done``) and its KV travels to
the decode worker for `KvTransfer.ms` of the blocks the decode worker lacks; then the request enters
the decode worker with its prompt's KV loaded (`MockEngine.submit` ``kv_loaded``), where its first
token, as the client sees it, comes after one pass. A request sent to a decode worker alone prefills
there as on an aggregated worker.

The simulation is deterministic for a given trace, router and seed (routers draw only from the
`random.Random` they are given; generated tokens are seeded per request).
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from bisect import bisect_right
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from indexer.events import RouterEvent
from mocker.block_pool import KvOp, kv_cache_event
from mocker.config import EngineConfig
from mocker.engine import CacheStats, MockEngine, PassResult, SeqState, Sequence
from mocker.fleet import DisaggregatedFleetRouter, FleetRouter, RoutedRequest, RouteResult, RouterRejected
from mocker.report import ReplayRecord, blank_records
from mocker.trace import Trace, TraceRequest
from router.types import WorkerRole

__all__ = ["KvTransfer", "SimulationResult", "simulate"]

ProgressCallback = Callable[[int, int], None]

_PASS_END = 0
_QUIET_RUN_END = 1
_DELAYED_EVENTS = 2
_TRANSFER_DONE = 3

# The engine-side id of a request's prefill leg (its own sequence on the prefill worker).
_PREFILL_LEG = "#prefill"


@dataclass(frozen=True, slots=True)
class KvTransfer:
    """How long a prompt's KV takes to move from a prefill worker to a decode worker: its bytes over the
    link's bandwidth. The defaults are Llama-3-8B's KV in bf16 (32 layers x 8 KV heads x 128 dims x 2
    tensors x 2 bytes = 128 KiB per token) over a 25 GB/s link (a 200 Gb/s RDMA NIC)."""

    kv_bytes_per_token: int = 131_072
    bandwidth_gb_per_s: float = 25.0

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token < 1:
            raise ValueError(f"KV bytes per token must be >= 1, got {self.kv_bytes_per_token}")
        if not (math.isfinite(self.bandwidth_gb_per_s) and self.bandwidth_gb_per_s > 0):
            raise ValueError(f"transfer bandwidth must be > 0 GB/s, got {self.bandwidth_gb_per_s}")

    def ms(self, blocks: int, block_size: int) -> float:
        return blocks * block_size * self.kv_bytes_per_token / (self.bandwidth_gb_per_s * 1e9) * 1000.0


class _QuietRun:
    """Consecutive passes of one worker in which it only generates tokens (`MockEngine.quiet_passes`),
    simulated as one event; cut short at the pass in progress when a request reaches the worker."""

    __slots__ = ("ends",)

    def __init__(self, ends: list[float]) -> None:
        self.ends = ends


@dataclass(slots=True)
class SimulationResult:
    router: str
    workers: int
    engine: EngineConfig
    records: list[ReplayRecord]
    engine_stats: list[CacheStats]
    duration_ms: float
    wall_s: float
    rejected_events: int = 0


class _Simulation:
    def __init__(
        self,
        trace: Trace,
        fleet_router: FleetRouter,
        engine: EngineConfig,
        workers: int,
        *,
        event_delay_ms: float,
        seed: int,
        progress: ProgressCallback | None,
        roles: Seq[WorkerRole] | None = None,
        transfer: KvTransfer | None = None,
    ) -> None:
        self.trace = trace
        self.fleet_router = fleet_router
        self.engine_config = engine
        self.engines = [MockEngine(engine, seed=seed * 1_000_003 + w) for w in range(workers)]
        if roles is None:
            for w in range(workers):
                fleet_router.add_worker(w, engine)
        else:
            assert isinstance(fleet_router, DisaggregatedFleetRouter)
            for w, role in enumerate(roles):
                fleet_router.add_pool_worker(w, engine, role)
        self.transfer = transfer or KvTransfer()
        # Prefill legs running, by their engine-side id: (record, request, prompt, decode worker).
        self._prefill_legs: dict[str, tuple[ReplayRecord, TraceRequest, bytes, int]] = {}
        self._prefill_seqs: dict[int, Sequence] = {}  # record index -> its prefill leg
        self._transfers: dict[int, tuple[ReplayRecord, TraceRequest, bytes, int]] = {}
        self.event_delay_ms = event_delay_ms
        self.progress = progress
        self.records = blank_records(trace.requests)
        self._sequences: list[tuple[ReplayRecord, Sequence]] = []
        self._heap: list[tuple[float, int, int, int]] = []
        self._counter = 0
        self._in_flight: list[PassResult | _QuietRun | None] = [None] * workers
        self._live_entry = [0] * workers  # the counter of each worker's current heap entry
        self._delayed: dict[int, list[RouterEvent]] = {}
        self._event_ids = [0] * workers
        self._pending: list[tuple[asyncio.Task[RouteResult], TraceRequest, bytes]] = []
        self._routed = 0
        self._next_scrape = 0.0

    async def run(self) -> SimulationResult:
        started = time.perf_counter()
        requests = self.trace.requests
        total = len(requests)
        heap = self._heap
        i = 0
        while i < total or heap or self._pending:
            next_arrival = requests[i].arrival_ms if i < total else math.inf
            if heap and heap[0][0] <= next_arrival:
                at, counter, kind, key = heapq.heappop(heap)
                if kind == _DELAYED_EVENTS:
                    self._deliver(self._delayed.pop(key), at)
                elif kind == _TRANSFER_DONE:
                    self._transfer_done(key, at)
                elif counter != self._live_entry[key]:
                    continue  # a quiet run that was cut short
                elif kind == _PASS_END:
                    self._end_pass(key, at)
                else:
                    self._end_quiet_run(key, at)
                if self._pending:
                    await self._collect_queued(at)
                continue
            if next_arrival == math.inf:  # only queued requests left, and nothing will free them
                break
            self._scrape(next_arrival)
            touched: set[int] = set()
            while i < total and requests[i].arrival_ms == next_arrival:
                await self._route(requests[i], next_arrival, touched)
                i += 1
            self._start_idle(touched, next_arrival)
        for task, _, _ in self._pending:
            task.cancel()
        return self._result(time.perf_counter() - started)

    # ------------------------------------------------------------------ routing
    async def _route(self, request: TraceRequest, now: float, touched: set[int]) -> None:
        prompt = self.trace.prompt(request)
        routed = RoutedRequest(request.request_id, prompt, request.input_length, request.output_length)
        task = asyncio.ensure_future(self.fleet_router.route(routed, now))
        await asyncio.sleep(0)  # the routing runs now; it stays pending only if the router queues it
        if task.done():
            self._dispatch(task, request, prompt, now, touched)
        else:
            self._pending.append((task, request, prompt))

    async def _collect_queued(self, now: float) -> None:
        await asyncio.sleep(0)
        touched: set[int] = set()
        still = []
        for task, request, prompt in self._pending:
            if task.done():
                self._dispatch(task, request, prompt, now, touched)
            else:
                still.append((task, request, prompt))
        self._pending = still
        self._start_idle(touched, now)

    def _dispatch(
        self, task: asyncio.Task[RouteResult], request: TraceRequest, prompt: bytes, now: float, touched: set[int]
    ) -> None:
        record = self.records[request.index]
        self._routed += 1
        if self.progress is not None:
            self.progress(self._routed, len(self.records))
        try:
            result = task.result()
        except RouterRejected:
            record.status = "rejected_by_router"
            return
        worker = result.worker_id
        record.worker_id = worker
        record.routed_ms = now
        record.queued_in_router = result.queued
        record.predicted_cached_tokens = min(result.predicted_cached_tokens, request.input_length)
        prefill = result.prefill_worker_id
        if prefill is not None:
            record.prefill_worker_id = prefill
            leg_id = request.request_id + _PREFILL_LEG
            leg = self.engines[prefill].submit(leg_id, prompt, 1, now)
            if leg.state is SeqState.REJECTED:
                record.status = "rejected_by_engine"
                self.fleet_router.finished(request.request_id, now)
                return
            self._prefill_legs[leg_id] = (record, request, prompt, worker)
            self._prefill_seqs[record.index] = leg
            self._wake(prefill, now, touched)
            return
        self._submit(record, request, prompt, worker, now, touched, kv_loaded=False)

    def _submit(
        self,
        record: ReplayRecord,
        request: TraceRequest,
        prompt: bytes,
        worker: int,
        now: float,
        touched: set[int],
        *,
        kv_loaded: bool,
    ) -> None:
        seq = self.engines[worker].submit(request.request_id, prompt, request.output_length, now, kv_loaded=kv_loaded)
        if seq.state is SeqState.REJECTED:
            record.status = "rejected_by_engine"
            self.fleet_router.finished(request.request_id, now)
            return
        self._sequences.append((record, seq))
        self._wake(worker, now, touched)

    def _wake(self, worker: int, now: float, touched: set[int]) -> None:
        in_flight = self._in_flight[worker]
        if isinstance(in_flight, _QuietRun):
            self._cut_quiet_run(worker, in_flight, now)
        touched.add(worker)

    def _prefill_leg_done(self, leg_id: str, now: float) -> None:
        """A prefill leg ended: the router hears of it, and the KV the decode worker lacks starts moving."""
        record, request, prompt, decode_worker = self._prefill_legs.pop(leg_id)
        assert isinstance(self.fleet_router, DisaggregatedFleetRouter)
        self.fleet_router.prefill_done(request.request_id, now)
        engine = self.engines[decode_worker]
        missing = -(-request.input_length // engine.block_size) - engine.cached_prefix_blocks(prompt)
        record.transfer_ms = self.transfer.ms(max(missing, 0), engine.block_size)
        self._counter += 1
        self._transfers[self._counter] = (record, request, prompt, decode_worker)
        heapq.heappush(self._heap, (now + record.transfer_ms, self._counter, _TRANSFER_DONE, self._counter))

    def _transfer_done(self, key: int, now: float) -> None:
        record, request, prompt, decode_worker = self._transfers.pop(key)
        touched: set[int] = set()
        self._submit(record, request, prompt, decode_worker, now, touched, kv_loaded=True)
        self._start_idle(touched, now)

    def _scrape(self, now: float) -> None:
        interval = self.fleet_router.scrape_interval_ms
        if interval is None or now < self._next_scrape:
            return
        self.fleet_router.scraped({w: engine.metrics() for w, engine in enumerate(self.engines)}, now)
        self._next_scrape = (now // interval + 1) * interval

    # ------------------------------------------------------------------ passes
    def _start_idle(self, workers: set[int], now: float) -> None:
        for worker in sorted(workers):
            if self._in_flight[worker] is None and self.engines[worker].has_work():
                self._start_pass(worker, now)

    def _start_pass(self, worker: int, now: float) -> None:
        engine = self.engines[worker]
        quiet = engine.quiet_passes(now)
        if quiet:
            self._in_flight[worker] = _QuietRun(quiet)
            self._push(worker, quiet[-1], _QUIET_RUN_END)
            return
        result = engine.step(now)
        if result.end_ms <= now:
            raise RuntimeError(f"worker {worker} made no progress at {now} ms")
        self._in_flight[worker] = result
        self._push(worker, result.end_ms, _PASS_END)

    def _push(self, worker: int, at: float, kind: int) -> None:
        self._counter += 1
        self._live_entry[worker] = self._counter
        heapq.heappush(self._heap, (at, self._counter, kind, worker))

    def _cut_quiet_run(self, worker: int, run: _QuietRun, now: float) -> None:
        """A request reached the worker: its quiet run stops after the pass in progress at ``now``."""
        last = bisect_right(run.ends, now)  # passes ending exactly now are over before it arrives
        if last < len(run.ends) - 1:
            del run.ends[last + 1 :]
            self._push(worker, run.ends[-1], _QUIET_RUN_END)

    def _end_quiet_run(self, worker: int, now: float) -> None:
        run = self._in_flight[worker]
        assert isinstance(run, _QuietRun)
        self._in_flight[worker] = None
        engine = self.engines[worker]
        engine.skip_quiet(len(run.ends))
        if engine.has_work():
            self._start_pass(worker, now)

    def _end_pass(self, worker: int, now: float) -> None:
        result = self._in_flight[worker]
        assert isinstance(result, PassResult)
        self._in_flight[worker] = None
        if result.ops:
            events = self._router_events(worker, result.ops)
            if self.event_delay_ms > 0:
                self._counter += 1
                self._delayed[self._counter] = events
                heapq.heappush(self._heap, (now + self.event_delay_ms, self._counter, _DELAYED_EVENTS, self._counter))
            else:
                self._deliver(events, now)
        fleet_router = self.fleet_router
        legs = self._prefill_legs
        for seq in result.first_tokens:
            if seq.request_id not in legs:
                fleet_router.first_token(seq.request_id, now)
        engine = self.engines[worker]
        for seq in result.opened_blocks:
            if seq.request_id not in legs:
                fleet_router.output(seq.request_id, engine.generated(seq), now)
        for seq in result.finished:
            if seq.request_id in legs:
                self._prefill_leg_done(seq.request_id, now)
            else:
                fleet_router.finished(seq.request_id, now)
        if engine.has_work():
            self._start_pass(worker, now)

    def _router_events(self, worker: int, ops: list[KvOp]) -> list[RouterEvent]:
        events = []
        event_id = self._event_ids[worker]
        for op in ops:
            event_id += 1
            events.append(RouterEvent(worker, kv_cache_event(op, event_id)))
        self._event_ids[worker] = event_id
        return events

    def _deliver(self, events: list[RouterEvent], now: float) -> None:
        kv_event = self.fleet_router.kv_event
        for event in events:
            kv_event(event, now)

    # ------------------------------------------------------------------ results
    def _result(self, wall_s: float) -> SimulationResult:
        for record, seq in self._sequences:
            record.cached_tokens = max(seq.cached_tokens, 0)
            record.cached_blocks = seq.cached_blocks
            record.prompt_blocks = seq.prompt_blocks
            record.queued_in_engine = seq.queued
            record.first_token_ms = seq.first_token_ms
            record.finished_ms = seq.finished_ms
            record.preemptions = seq.preemptions
            leg = self._prefill_seqs.get(record.index)
            if leg is not None:  # the prompt was computed there: its cache hit is the request's
                record.cached_tokens = max(leg.cached_tokens, 0)
                record.cached_blocks = leg.cached_blocks
                record.queued_in_engine = record.queued_in_engine or leg.queued
                record.preemptions += leg.preemptions
            if seq.state is SeqState.FINISHED:
                record.status = "completed"
        duration = max((r.finished_ms for r in self.records), default=0.0)
        return SimulationResult(
            router=self.fleet_router.name,
            workers=len(self.engines),
            engine=self.engine_config,
            records=self.records,
            engine_stats=[engine.stats for engine in self.engines],
            duration_ms=duration,
            wall_s=wall_s,
            rejected_events=self.fleet_router.rejected_events,
        )


async def simulate(
    trace: Trace,
    fleet_router: FleetRouter,
    engine: EngineConfig,
    workers: int,
    *,
    event_delay_ms: float = 0.0,
    seed: int = 0,
    progress: ProgressCallback | None = None,
    roles: Seq[WorkerRole] | None = None,
    transfer: KvTransfer | None = None,
) -> SimulationResult:
    """Replay ``trace`` through ``fleet_router`` onto ``workers`` simulated engines; see the module doc.
    ``roles`` (one per worker) makes the fleet disaggregated: ``fleet_router`` must then be a
    `DisaggregatedFleetRouter`; ``transfer`` times the KV hand-off (`KvTransfer` defaults)."""
    if workers < 1:
        raise ValueError(f"need at least one worker, got {workers}")
    if roles is not None:
        if len(roles) != workers:
            raise ValueError(f"need one role per worker: {len(roles)} roles for {workers} workers")
        if not isinstance(fleet_router, DisaggregatedFleetRouter):
            raise ValueError(f"router {fleet_router.name} cannot route a disaggregated fleet")
    if event_delay_ms < 0:
        raise ValueError(f"event delay must be >= 0 ms, got {event_delay_ms}")
    simulation = _Simulation(
        trace,
        fleet_router,
        engine,
        workers,
        event_delay_ms=event_delay_ms,
        seed=seed,
        progress=progress,
        roles=roles,
        transfer=transfer,
    )
    return await simulation.run()

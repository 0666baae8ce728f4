"""Trace replay, end to end: load a trace, run it through every router asked for, report.

Offline (`replay_offline`): each router in turn drives its own fleet of simulated engines through the
whole trace in simulated time (`mocker.simulation`); the same seed gives every router the same trace,
jitter and generated tokens. Online (`replay_online_report`): the trace goes to a running router over
HTTP and mock workers over NATS (`mocker.online`). Either way the runs are summarized per router
(`mocker.report`) and `write_outputs` writes report.json, report.md, the plots and, on request, the
per-request records.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from mocker.config import EngineConfig
from mocker.fleet import FleetRouter
from mocker.pd_routers import AGGREGATED, PD_ROUTERS, PEER_PD_ROUTERS, make_pd_router
from mocker.plots import MATPLOTLIB_MISSING, workload_caption, write_plots
from mocker.progress import ProgressBar
from mocker.report import ReplayRecord, RouterReport, renumber_workers, rescale_times, summarize, write_reports
from mocker.routers import make_router, router_names
from mocker.simulation import KvTransfer, simulate
from mocker.trace import Trace, TraceRequest
from router.config import RouterConfig
from router.types import WorkerRole

if TYPE_CHECKING:
    from router.event_plane.connection import NatsOptions
    from router.event_plane.first_connection import LocalToolConnection

__all__ = [
    "ReplayRun",
    "ReplaySetup",
    "replay_offline",
    "replay_online_report",
    "replay_router",
    "unservable_requests",
    "write_outputs",
]


@dataclass(frozen=True, slots=True)
class ReplaySetup:
    """Everything but the trace that decides a replay's outcome."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    workers: int = 8
    routers: tuple[str, ...] = ()  # empty: every router `router_names` lists
    router_config: RouterConfig | None = None  # block size defaults to the engine's
    # The settings of ``router_config`` its author gave (`--router-option`): kept as given where the replay
    # would adapt the default to the simulation (`effective_router_config`).
    router_settings_given: frozenset[str] = frozenset()
    event_delay_ms: float = 0.0
    seed: int = 0
    window_s: float = 60.0
    # A disaggregated fleet (any prefill or decode worker, or with the router's disagg_among_both_workers
    # two or more both workers): ``workers`` is ignored; `mocker.pd_routers` names the routers,
    # ``aggregated`` running on as many workers, all of role both. ``both_workers`` join the pools of
    # either leg (a mixed fleet: the peers' PD modes take separate pools only).
    prefill_workers: int = 0
    decode_workers: int = 0
    both_workers: int = 0
    transfer: KvTransfer = field(default_factory=KvTransfer)

    def __post_init__(self) -> None:
        counts = (self.prefill_workers, self.decode_workers, self.both_workers)
        if min(counts) < 0:
            raise ValueError(f"worker counts cannot be negative, got {counts}")
        among_both = self.router_config is not None and self.router_config.disagg_among_both_workers
        if among_both and self.prefill_workers + self.decode_workers == 0 and self.both_workers < 2:
            # Else the flag would disaggregate a replay reported as aggregated, or label rows that cannot.
            raise ValueError(
                "disagg_among_both_workers disaggregates among --both-workers N (2 or more; --workers is the "
                f"aggregated fleet), got {self.both_workers}"
            )
        if self.both_workers and not self.disaggregated:
            raise ValueError(
                "--both-workers joins a disaggregated fleet: give prefill or decode workers too, or route it as "
                "one (--router-option disagg_among_both_workers=true)"
            )
        if self.disaggregated and not (
            self.prefill_workers + self.both_workers and self.decode_workers + self.both_workers
        ):
            raise ValueError(
                f"a disaggregated fleet needs both prefill and decode workers (or workers of role both), got "
                f"{self.prefill_workers} prefill, {self.decode_workers} decode and {self.both_workers} both"
            )

    @property
    def disaggregated(self) -> bool:
        among_both = self.router_config is not None and self.router_config.disagg_among_both_workers
        return self.prefill_workers + self.decode_workers > 0 or (among_both and self.both_workers > 0)

    @property
    def total_workers(self) -> int:
        if self.disaggregated:
            return self.prefill_workers + self.decode_workers + self.both_workers
        return self.workers

    def roles(self) -> list[WorkerRole]:
        """One role per worker of a disaggregated fleet: prefill, then decode, then both."""
        prefill: list[WorkerRole] = ["prefill"]
        decode: list[WorkerRole] = ["decode"]
        both: list[WorkerRole] = ["both"]
        return prefill * self.prefill_workers + decode * self.decode_workers + both * self.both_workers

    def routers_to_run(self) -> list[str]:
        if self.routers:
            return list(self.routers)
        if self.disaggregated:
            mixed = self.both_workers > 0
            return [AGGREGATED, *(name for name in PD_ROUTERS if not (mixed and name in PEER_PD_ROUTERS))]
        return router_names()

    def effective_router_config(self) -> RouterConfig:
        config = self.router_config
        if config is None:
            config = RouterConfig(block_size=self.engine.block_size)
        if not self.event_delay_ms and "computed_prompt_credit_secs" not in self.router_settings_given:
            # The simulated engines' events reach the router as they happen: no lag for the credit to bridge.
            config = msgspec.structs.replace(config, computed_prompt_credit_secs=0.0)
        return config

    def describe(self, trace: Trace) -> dict[str, Any]:
        """The settings a report is reproducible from."""
        options = trace.options
        return {
            "trace": trace.path,
            "requests": len(trace),
            "clipped": trace.clipped,
            "dropped": trace.dropped,
            "trace_options": msgspec.to_builtins(options),
            "jitter_ms": trace.jitter_ms,
            "workers": self.workers,
            "engine": msgspec.to_builtins(self.engine),
            "router_config": msgspec.to_builtins(self.effective_router_config()),
            "event_delay_ms": self.event_delay_ms,
            "seed": self.seed,
            "window_s": self.window_s,
        } | (
            {
                "prefill_workers": self.prefill_workers,
                "decode_workers": self.decode_workers,
                "both_workers": self.both_workers,
                "kv_bytes_per_token": self.transfer.kv_bytes_per_token,
                "transfer_gb_per_s": self.transfer.bandwidth_gb_per_s,
            }
            if self.disaggregated
            else {}
        )


def unservable_requests(trace: Trace, engine: EngineConfig) -> list[TraceRequest]:
    """The requests no worker's KV pool can hold (prompt and output, `EngineConfig.fits`): every engine
    rejects them, whatever the load and the router."""
    return [r for r in trace if not engine.fits(r.input_length, r.output_length)]


@dataclass(slots=True)
class ReplayRun:
    report: RouterReport
    records: list[ReplayRecord]


async def replay_offline(trace: Trace, setup: ReplaySetup, *, show_progress: bool = True) -> list[ReplayRun]:
    """Simulate ``trace`` once per router of ``setup``; one `ReplayRun` each, in order."""
    runs = []
    for spec in setup.routers_to_run():
        bar = ProgressBar(spec, enabled=show_progress)
        runs.append(await replay_router(trace, setup, spec, progress=bar))
        bar.close()
    return runs


async def replay_router(
    trace: Trace, setup: ReplaySetup, spec: str, *, progress: ProgressBar | None = None
) -> ReplayRun:
    """Simulate ``trace`` through the router ``spec`` names on the fleet of ``setup``: a fresh router and
    fleet, seeded by ``setup.seed``, so the run depends on nothing but its arguments. On a disaggregated
    fleet, ``aggregated`` is our policy on as many workers, each prefilling and decoding."""
    config = setup.effective_router_config()
    rng = random.Random(setup.seed)
    fleet_router: FleetRouter
    if not setup.disaggregated:
        fleet_router = make_router(spec, config, rng)
    elif spec == AGGREGATED:  # every request on one worker, however the fleet's other routers split it
        fleet_router = make_router(config.policy, msgspec.structs.replace(config, disagg_among_both_workers=False), rng)
        fleet_router.name = AGGREGATED
    else:
        fleet_router = make_pd_router(spec, config, rng)
    total = setup.total_workers
    result = await simulate(
        trace,
        fleet_router,
        setup.engine,
        total,
        event_delay_ms=setup.event_delay_ms,
        seed=setup.seed,
        progress=progress,
        roles=setup.roles() if setup.disaggregated and spec != AGGREGATED else None,
        transfer=setup.transfer,
    )
    report = summarize(fleet_router.name, result.records, total, wall_s=result.wall_s, window_s=setup.window_s)
    return ReplayRun(report, result.records)


async def replay_online_report(
    trace: Trace,
    *,
    label: str,
    router_url: str,
    nats: NatsOptions | LocalToolConnection,
    namespace: str = "default",
    workers: int = 1,
    time_scale: float = 1.0,
    window_s: float = 60.0,
    timeout_s: float = 300.0,
    show_progress: bool = True,
) -> ReplayRun:
    """Replay ``trace`` against a running router and ``workers`` mock workers (`mocker.online`), their
    caches reset first; a request whose worker sends nothing for ``timeout_s`` (wall clock) ends unfinished.

    ``time_scale`` runs the replay that many times faster than the trace: arrivals come sooner and the
    measured times are scaled back. The workers must run their engines that much faster too
    (``speedup_ratio``), so the whole system is time-compressed rather than overloaded.
    """
    from mocker.online import replay_online
    from router.event_plane.connection import close_connection, connect
    from router.event_plane.first_connection import LocalToolConnection

    # A local tool's connection waits for a router started just before; plain options connect now.
    nc = (await nats.connect())[0] if isinstance(nats, LocalToolConnection) else await connect(nats)
    bar = ProgressBar(label, enabled=show_progress)
    started = time.perf_counter()
    try:
        records = await replay_online(
            trace.time_scaled(time_scale),
            router_url,
            nc,
            namespace=namespace,
            expect_workers=workers,
            timeout_s=timeout_s,
            progress=bar,
        )
    finally:
        bar.close()
        await close_connection(nc)
    wall_s = time.perf_counter() - started
    rescale_times(records, time_scale)
    seen = renumber_workers(records)
    report = summarize(label, records, max(workers, seen), wall_s=wall_s, window_s=window_s)
    return ReplayRun(report, records)


def write_outputs(
    runs: Sequence[ReplayRun],
    settings: dict[str, Any],
    out_dir: Path,
    *,
    plots: bool = True,
    per_request: bool = False,
) -> tuple[list[Path], str | None]:
    """Write the reports (and plots, and per-request JSONL); returns the paths and a note, if any."""
    reports = [run.report for run in runs]
    paths = write_reports(reports, settings, out_dir)
    note = None
    if plots:
        drawn = write_plots(reports, out_dir, workload_caption(settings))
        if drawn is None:
            note = MATPLOTLIB_MISSING
        else:
            paths += drawn
    if per_request:
        encoder = msgspec.json.Encoder()
        for run in runs:
            path = out_dir / f"requests-{_file_safe(run.report.router)}.jsonl"
            with path.open("wb") as sink:
                for record in run.records:
                    sink.write(encoder.encode(record) + b"\n")
            paths.append(path)
    return paths, note


def _file_safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)

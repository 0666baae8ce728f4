"""Fleet capacity at a latency SLO: how much traffic the same workers carry while users get their latency.

A router's **capacity** on a trace is the highest arrival-rate multiplier (the trace's arrivals divided by
it, as ``--speedup`` does) at which the fleet still meets the SLO: TTFT p90, ITL p90 and optionally E2E p90
under their bounds, every request served that a worker can hold at all (one no worker's KV pool can hold,
its prompt and output together, is rejected by the engines whatever the load: counted as rejected, left out
of the SLO, so that capacity measures load). It is found per router by bisection on the multiplier:

- coarse: from 1x, doubling while the SLO holds (halving while it does not) until a bracket
  ``[lo, hi]`` has lo meeting it and hi not, within ``[MIN_MULTIPLIER, MAX_MULTIPLIER]``;
- fine: bisection in log space until ``hi / lo <= 1 + tolerance`` (5 % by default, so routers whose
  capacities differ by 10 % are told apart); the capacity is ``lo``.

The SLO is given, or derived per trace from a lightly loaded run (every router at ``light_multiplier``,
a quarter of the trace's load): ``ttft_factor`` (3) times the lowest TTFT p90 and ``itl_factor`` (1.5)
times the lowest ITL p90 among the routers, each the best router's on that metric; or, with
``slo_from``, both from one router's run (what a fleet it serves meets today: aggregated serving's
SLO, say, when asking what disaggregating the fleet would carry). Bounds from p90s, not
p50s, so long-prompt traces keep a feasible load.

Every point evaluated is kept (a router's runs are cached by multiplier, the light run included), so the
report also gives the **goodput** (requests per second meeting the SLO, request by request: TTFT, ITL
and E2E under the bounds) at fixed multipliers, the usual figures at the capacity point, and the SLO
attainment (the fraction of requests meeting it) against load that ``capacity.png`` plots.

The search runs through an `Evaluate` callable, so the same code measures the offline simulation
(`offline_evaluator`, deterministic for a seed) and a live fleet (`mocker.replay.online_evaluator`).
The search assumes attainment falls as load rises; where a router's runs are not monotone the bracket
found is still a multiplier meeting the SLO next to one missing it.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from mocker.replay import ReplaySetup, replay_router
from mocker.report import ReplayRecord, RouterReport
from mocker.trace import Trace

if TYPE_CHECKING:
    from router.event_plane.connection import NatsOptions
    from router.event_plane.first_connection import LocalToolConnection

__all__ = [
    "MAX_MULTIPLIER",
    "MIN_MULTIPLIER",
    "CapacityResult",
    "CapacitySearch",
    "Evaluate",
    "LoadPoint",
    "Slo",
    "derive_slo",
    "find_capacity",
    "measure_capacity",
    "offline_evaluator",
    "online_evaluator",
    "render_capacity_markdown",
    "render_capacity_table",
    "write_capacity_report",
]

MIN_MULTIPLIER = 1 / 64
MAX_MULTIPLIER = 64.0


@dataclass(frozen=True, slots=True)
class Slo:
    """Bounds on the fleet's p90s (ms); ``e2e_p90_ms`` None leaves end-to-end latency free."""

    ttft_p90_ms: float
    itl_p90_ms: float
    e2e_p90_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_p90_ms", "itl_p90_ms", "e2e_p90_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"SLO bound {name} must be > 0 ms, got {value}")

    def met_by(self, report: RouterReport) -> bool:
        """The fleet meets it: every request served but those the engines reject whatever the load (see
        the module doc), each p90 within its bound."""
        if report.completed < report.requests - report.rejected_by_engine:
            return False
        if not (report.ttft_ms.p90 <= self.ttft_p90_ms and _within(report.itl_ms.p90, self.itl_p90_ms)):
            return False
        return self.e2e_p90_ms is None or report.e2e_ms.p90 <= self.e2e_p90_ms

    def met_by_request(self, record: ReplayRecord) -> bool:
        """One request got its latency: served, its TTFT, mean ITL and E2E within the bounds."""
        if record.status != "completed" or record.ttft_ms > self.ttft_p90_ms:
            return False
        itl = record.itl_ms
        if itl is not None and itl > self.itl_p90_ms:
            return False
        return self.e2e_p90_ms is None or record.e2e_ms <= self.e2e_p90_ms


def _within(value: float, bound: float) -> bool:
    # A run whose requests all have one output token has no ITL: nothing to bound.
    return math.isnan(value) or value <= bound


@dataclass(slots=True)
class LoadPoint:
    """One router's run at one multiplier, as the report keeps it."""

    multiplier: float
    meets_slo: bool
    attainment: float  # fraction of the requests meeting the SLO one by one
    goodput_per_s: float  # of those, per second of the run
    requests_per_s: float
    hit_rate: float
    ttft_p90_ms: float
    itl_p90_ms: float
    e2e_p90_ms: float
    completed: int
    requests: int
    rejected: int  # by the engines whatever the load (no worker's pool holds them): not in the attainment


def load_point(multiplier: float, report: RouterReport, records: Sequence[ReplayRecord], slo: Slo) -> LoadPoint:
    good = sum(slo.met_by_request(r) for r in records)
    servable = len(records) - report.rejected_by_engine
    return LoadPoint(
        multiplier=multiplier,
        meets_slo=slo.met_by(report),
        attainment=good / servable if servable > 0 else 0.0,
        goodput_per_s=good / report.duration_s,
        requests_per_s=report.requests_per_s,
        hit_rate=report.hit_rate_tokens,
        ttft_p90_ms=report.ttft_ms.p90,
        itl_p90_ms=report.itl_ms.p90,
        e2e_p90_ms=report.e2e_ms.p90,
        completed=report.completed,
        requests=report.requests,
        rejected=report.rejected_by_engine,
    )


# A run of one router at one multiplier: its report and per-request records.
Evaluate = Callable[[str, float], Awaitable[tuple[RouterReport, list[ReplayRecord]]]]


@dataclass(frozen=True, slots=True)
class CapacitySearch:
    """How the search runs; the defaults are the issue's (quarter load, 3x TTFT, 1.5x ITL, 5 % grid)."""

    tolerance: float = 0.05
    light_multiplier: float = 0.25
    ttft_factor: float = 3.0
    itl_factor: float = 1.5
    goodput_multipliers: tuple[float, ...] = (0.5, 1.0, 2.0)
    start: float = 1.0
    # Runs per router at most, the light run and the goodput points included: the search stops early
    # enough to leave room for the goodput points it has not run (see `find_capacity`).
    max_points: int = 24
    # The router whose light run alone sets the derived SLO (the SLO a fleet served by it meets today);
    # None: each bound from the best router on that metric.
    slo_from: str | None = None

    def __post_init__(self) -> None:
        if not 0 < self.tolerance < 1:
            raise ValueError(f"capacity tolerance must be in (0, 1), got {self.tolerance}")
        for name in ("light_multiplier", "ttft_factor", "itl_factor", "start"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if any(not m > 0 for m in self.goodput_multipliers):
            raise ValueError(f"goodput multipliers must be > 0, got {self.goodput_multipliers}")
        if self.max_points < 2:
            raise ValueError(f"max points must be >= 2, got {self.max_points}")

    def fixed_runs(self, *, derive: bool) -> int:
        """The runs of a router the search does not choose: the goodput points and, for a derived SLO,
        the light run."""
        return len({*self.goodput_multipliers, *((self.light_multiplier,) if derive else ())})


@dataclass(slots=True)
class CapacityResult:
    router: str
    capacity: float  # 0.0: the SLO is missed even at MIN_MULTIPLIER (resolved) or at every multiplier run
    bracket: tuple[float, float]  # (highest multiplier meeting the SLO, lowest above it missing it)
    at_capacity: LoadPoint | None
    points: list[LoadPoint] = field(default_factory=list)  # by multiplier
    # False: the run budget stopped the search before the bracket was within the tolerance (or at a
    # bound of the multiplier range): the capacity is in the bracket, at least its lo.
    resolved: bool = True

    def curve(self) -> tuple[str, float, list[tuple[float, float, bool]]]:
        """What ``capacity.png`` draws of it (`mocker.plots.write_capacity_plot`)."""
        return self.router, self.capacity, [(p.multiplier, p.attainment, p.meets_slo) for p in self.points]

    def goodput_at(self, multiplier: float) -> float | None:
        return next((p.goodput_per_s for p in self.points if p.multiplier == multiplier), None)


class _Runs:
    """One router's runs, cached by multiplier."""

    def __init__(self, router: str, evaluate: Evaluate, slo: Slo | None) -> None:
        self.router = router
        self.evaluate = evaluate
        self.slo = slo
        self.runs: dict[float, tuple[RouterReport, list[ReplayRecord]]] = {}

    async def run(self, multiplier: float) -> tuple[RouterReport, list[ReplayRecord]]:
        if multiplier not in self.runs:
            self.runs[multiplier] = await self.evaluate(self.router, multiplier)
        return self.runs[multiplier]

    async def meets(self, multiplier: float) -> bool:
        assert self.slo is not None
        report, _ = await self.run(multiplier)
        return self.slo.met_by(report)

    def points(self) -> list[LoadPoint]:
        assert self.slo is not None
        return [load_point(m, *self.runs[m], self.slo) for m in sorted(self.runs)]

    def tighten(self, lo: float, hi: float) -> tuple[float, float]:
        """The bracket ``(lo, hi)`` narrowed by every run made: lo up to the highest multiplier run that
        met the SLO below hi, then hi down to the lowest above lo that missed it."""
        assert self.slo is not None
        met = {m: self.slo.met_by(report) for m, (report, _) in self.runs.items()}
        lo = max([m for m, ok in met.items() if ok and m < hi], default=lo)
        hi = min([m for m, ok in met.items() if not ok and m > lo], default=hi)
        return lo, hi


def derive_slo(light: Sequence[RouterReport], search: CapacitySearch, e2e_factor: float | None = None) -> Slo:
    """The default SLO from every router's lightly loaded run: each bound a factor of the best p90."""
    if not light:
        raise ValueError("deriving an SLO needs at least one lightly loaded run")
    ttft = min(r.ttft_ms.p90 for r in light)
    itls = [r.itl_ms.p90 for r in light if not math.isnan(r.itl_ms.p90)]
    itl = min(itls) if itls else math.inf
    e2e = None if e2e_factor is None else e2e_factor * min(r.e2e_ms.p90 for r in light)
    if not (math.isfinite(ttft) and ttft > 0):
        raise ValueError("the lightly loaded runs served no request: no SLO to derive")
    return Slo(search.ttft_factor * ttft, search.itl_factor * itl, e2e)


async def find_capacity(runs: _Runs, search: CapacitySearch) -> tuple[float, float, bool]:
    """The bracket (lo meeting the SLO, hi missing it) of ``runs``' router and whether the search resolved
    it; lo 0 when nothing run below hi meets it, hi inf when everything run up to MAX_MULTIPLIER does.

    Resolved: within the tolerance, or lo 0 with hi at MIN_MULTIPLIER, or lo at MAX_MULTIPLIER with hi
    inf. When the run budget stops the search first the bracket is what the runs made so far show: lo the
    highest multiplier run (the light run, say) that met the SLO below hi, hi the lowest above lo that
    missed it."""
    goodput = set(search.goodput_multipliers)

    def affordable(multiplier: float) -> bool:
        # The budget counts every run, the goodput points still to run after the search reserved. A
        # multiplier already run (the light run) answers without a run; a goodput point is paid for.
        if multiplier in runs.runs:
            return True
        reserved = len(goodput - runs.runs.keys())
        return len(runs.runs) + reserved + (multiplier not in goodput) <= search.max_points

    start = min(max(search.start, MIN_MULTIPLIER), MAX_MULTIPLIER)
    lo, hi = 0.0, math.inf
    probe = start
    # Coarse: double up or halve down from the start until the SLO flips.
    while affordable(probe):
        if await runs.meets(probe):
            lo = probe
            if hi < math.inf or probe >= MAX_MULTIPLIER:
                break
            probe = min(probe * 2, MAX_MULTIPLIER)
        else:
            hi = probe
            if lo > 0 or probe <= MIN_MULTIPLIER:
                break
            probe = max(probe / 2, MIN_MULTIPLIER)
    lo, hi = runs.tighten(lo, hi)
    # Fine: bisect in log space until the bracket is within the tolerance.
    while lo > 0 and hi < math.inf and hi / lo > 1 + search.tolerance:
        middle = math.sqrt(lo * hi)
        if not affordable(middle):
            break
        if await runs.meets(middle):
            lo = middle
        else:
            hi = middle
    lo, hi = runs.tighten(lo, hi)
    return lo, hi, _resolved(lo, hi, search)


def _resolved(lo: float, hi: float, search: CapacitySearch) -> bool:
    return (
        (lo == 0 and hi <= MIN_MULTIPLIER)
        or (lo >= MAX_MULTIPLIER and math.isinf(hi))
        or (lo > 0 and hi / lo <= 1 + search.tolerance)
    )


async def measure_capacity(
    routers: Sequence[str],
    evaluate: Evaluate,
    search: CapacitySearch,
    *,
    slo: Slo | None = None,
    e2e_factor: float | None = None,
) -> tuple[Slo, list[CapacityResult], dict[str, Any]]:
    """Every router's capacity; returns the SLO used, the results in router order, and where the SLO came
    from. Without ``slo`` it is derived from the lightly loaded runs (`derive_slo`; ``e2e_factor`` adds an
    E2E bound that many times the best E2E p90)."""
    # The run budget covers the light run and the goodput points: the search gets what is left.
    needed = search.fixed_runs(derive=slo is None)
    if needed > search.max_points:
        raise ValueError(
            f"a budget of {search.max_points} runs per router is less than the {needed} runs the light run and "
            "the goodput points take: raise the run budget or ask for fewer goodput points"
        )
    all_runs = [_Runs(router, evaluate, slo) for router in routers]
    if slo is None:
        if search.slo_from is not None and search.slo_from not in routers:
            raise ValueError(f"the SLO is to come from router {search.slo_from!r}, which is not among {list(routers)}")
        light = [(await runs.run(search.light_multiplier))[0] for runs in all_runs]
        basis = [r for router, r in zip(routers, light, strict=True) if search.slo_from in (None, router)]
        slo = derive_slo(basis, search, e2e_factor)
        origin: dict[str, Any] = {
            "derived": True,
            "light_multiplier": search.light_multiplier,
            "ttft_factor": search.ttft_factor,
            "itl_factor": search.itl_factor,
            "e2e_factor": e2e_factor,
            "slo_from": search.slo_from,
        }
        if search.slo_from is None:
            origin["best_ttft_router"] = min(light, key=lambda r: r.ttft_ms.p90).router
        for runs in all_runs:
            runs.slo = slo
    else:
        origin = {"derived": False}
    results = []
    for runs in all_runs:
        lo, hi, _ = await find_capacity(runs, search)
        for multiplier in search.goodput_multipliers:
            await runs.run(multiplier)
        # A goodput point inside the bracket narrows it as a bisection step would.
        lo, hi = runs.tighten(lo, hi)
        resolved = _resolved(lo, hi, search)
        points = runs.points()
        at_capacity = next((p for p in points if p.multiplier == lo), None)
        results.append(CapacityResult(runs.router, lo, (lo, hi), at_capacity, points, resolved))
    return slo, results, origin


def offline_evaluator(trace: Trace, setup: ReplaySetup) -> Evaluate:
    """Simulates a router of ``setup`` on ``trace`` with its arrivals ``multiplier`` times denser
    (`mocker.replay.replay_router`: deterministic for a seed; the fleet aggregated or disaggregated)."""

    async def evaluate(router: str, multiplier: float) -> tuple[RouterReport, list[ReplayRecord]]:
        run = await replay_router(trace.time_scaled(multiplier), setup, router)
        return run.report, run.records

    return evaluate


def online_evaluator(
    trace: Trace,
    *,
    router_url: str,
    nats: NatsOptions | LocalToolConnection,
    namespace: str = "default",
    workers: int = 1,
    time_scale: float = 1.0,
    window_s: float = 60.0,
    timeout_s: float = 300.0,
) -> Evaluate:
    """Replays ``trace`` against a running router and its mock workers (`replay_online_report`) with its
    arrivals ``multiplier`` times denser. Each run starts, as every online replay does, with every worker's
    prefix cache reset and the router's index empty (`mocker.online.reset_fleet`), so a point does not
    inherit the previous one's cache (the router's name is the label of the run)."""
    from mocker.replay import replay_online_report

    async def evaluate(router: str, multiplier: float) -> tuple[RouterReport, list[ReplayRecord]]:
        run = await replay_online_report(
            trace.time_scaled(multiplier),
            label=router,
            router_url=router_url,
            nats=nats,
            namespace=namespace,
            workers=workers,
            time_scale=time_scale,
            window_s=window_s,
            timeout_s=timeout_s,
            show_progress=False,
        )
        return run.report, run.records

    return evaluate


# ---------------------------------------------------------------------- reporting
def _multiplier(value: float) -> str:
    if value == 0:
        return "< " + f"{MIN_MULTIPLIER:g}"
    if math.isinf(value):
        return "inf"
    return f"{value:.3g}"


def _capacity_cell(result: CapacityResult) -> str:
    lo, hi = result.bracket
    if not result.resolved and lo == 0:
        # Nothing run below hi met the SLO, but the search stopped above MIN_MULTIPLIER.
        return "?" if math.isinf(hi) else f"< {_multiplier(hi)}"
    if math.isinf(hi):
        return f">= {_multiplier(lo)}"
    return _multiplier(result.capacity)


def render_capacity_table(slo: Slo, results: Sequence[CapacityResult], goodput: Sequence[float]) -> str:
    """Plain text: one router per row, its capacity and bracket (highest multiplier meeting the SLO, lowest
    above it missing it: the search's resolution), goodput at the fixed multipliers, the figures at capacity."""
    header = [
        "router",
        "capacity x",
        "bracket",
        *(f"goodput@{m:g}x r/s" for m in goodput),
        "hit",
        "TTFT p90",
        "ITL p90",
        "E2E p90",
        "runs",
    ]
    rows = [header]
    for result in results:
        at = result.at_capacity
        rows.append(
            [
                result.router,
                _capacity_cell(result),
                _bracket_cell(result),
                *(_goodput_cell(result.goodput_at(m)) for m in goodput),
                f"{at.hit_rate:.3f}" if at else "-",
                f"{at.ttft_p90_ms:.0f}" if at else "-",
                f"{at.itl_p90_ms:.1f}" if at else "-",
                f"{at.e2e_p90_ms:.0f}" if at else "-",
                str(len(result.points)),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    bounds = f"SLO: TTFT p90 <= {slo.ttft_p90_ms:.0f} ms, ITL p90 <= {slo.itl_p90_ms:.1f} ms"
    if slo.e2e_p90_ms is not None:
        bounds += f", E2E p90 <= {slo.e2e_p90_ms:.0f} ms"
    bounds += " (figures at the capacity point; times in ms)"
    rejected = max((p.rejected for result in results for p in result.points), default=0)
    if rejected:
        bounds += (
            f"\n{rejected} request{'s' if rejected > 1 else ''} rejected by the engines at every load (larger than a "
            "worker's KV pool): left out of the SLO"
        )
    return bounds + "\n" + "\n".join(lines)


def _bracket_cell(result: CapacityResult) -> str:
    # The search's resolution: the capacity meets the SLO, the bracket's top misses it.
    # A search the run budget stopped says so, its bracket as far as it got.
    lo, hi = result.bracket
    if not result.resolved:
        return f"{'0' if lo == 0 else _multiplier(lo)}-{_multiplier(hi)} (run budget)"
    return f"{_multiplier(lo)}-{_multiplier(hi)}" if lo > 0 and not math.isinf(hi) else "-"


def _goodput_cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def render_capacity_markdown(
    slo: Slo, results: Sequence[CapacityResult], goodput: Sequence[float], settings: dict[str, Any]
) -> str:
    lines = ["# Capacity report", ""]
    lines += [f"- {key}: `{value}`" for key, value in settings.items()]
    lines += ["", "```", render_capacity_table(slo, results, goodput), "```", "", "## Every run", ""]
    lines += ["| router | multiplier | meets SLO | attainment | goodput r/s | hit | TTFT p90 | ITL p90 | E2E p90 |"]
    lines.append("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for result in results:
        for p in result.points:
            lines.append(
                f"| {result.router} | {p.multiplier:.4g} | {'yes' if p.meets_slo else 'no'} | {p.attainment:.3f} | "
                f"{p.goodput_per_s:.2f} | {p.hit_rate:.3f} | {p.ttft_p90_ms:.0f} | {p.itl_p90_ms:.1f} | "
                f"{p.e2e_p90_ms:.0f} |"
            )
    return "\n".join(lines) + "\n"


def capacity_json(
    slo: Slo,
    origin: dict[str, Any],
    results: Sequence[CapacityResult],
    search: CapacitySearch,
    settings: dict[str, Any],
) -> dict[str, Any]:
    return {
        "settings": settings,
        "slo": {**msgspec.to_builtins(_SloJson(slo.ttft_p90_ms, slo.itl_p90_ms, slo.e2e_p90_ms)), "origin": origin},
        "search": {
            "tolerance": search.tolerance,
            "start": search.start,
            "max_points": search.max_points,
            "goodput_multipliers": list(search.goodput_multipliers),
            "min_multiplier": MIN_MULTIPLIER,
            "max_multiplier": MAX_MULTIPLIER,
        },
        "results": [
            {
                "router": r.router,
                "capacity": r.capacity,
                "bracket": [r.bracket[0], None if math.isinf(r.bracket[1]) else r.bracket[1]],
                "resolved": r.resolved,
                "goodput_per_s": {f"{m:g}": r.goodput_at(m) for m in search.goodput_multipliers},
                "at_capacity": None if r.at_capacity is None else msgspec.to_builtins(_point_json(r.at_capacity)),
                "points": [msgspec.to_builtins(_point_json(p)) for p in r.points],
            }
            for r in results
        ],
    }


class _SloJson(msgspec.Struct):
    ttft_p90_ms: float
    itl_p90_ms: float
    e2e_p90_ms: float | None


def _point_json(point: LoadPoint) -> dict[str, Any]:
    data = {name: getattr(point, name) for name in LoadPoint.__dataclass_fields__}
    # JSON has no NaN: a run without an ITL (one-token outputs) says null.
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in data.items()}


def write_capacity_report(
    slo: Slo,
    origin: dict[str, Any],
    results: Sequence[CapacityResult],
    search: CapacitySearch,
    settings: dict[str, Any],
    out_dir: Path,
) -> list[Path]:
    """capacity.json and capacity.md into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    body = capacity_json(slo, origin, results, search, settings)
    json_path = out_dir / "capacity.json"
    json_path.write_bytes(msgspec.json.format(msgspec.json.encode(body), indent=1) + b"\n")
    md_path = out_dir / "capacity.md"
    md_path.write_text(render_capacity_markdown(slo, results, search.goodput_multipliers, settings))
    return [json_path, md_path]

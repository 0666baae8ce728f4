"""`kv-router replay --capacity`: the bisection, the SLO it derives, determinism, the report, and the
same search against a live fleet (a real nats-server, the router service, `kv-router mock-worker`
processes)."""

from __future__ import annotations

import asyncio
import importlib.util
import math
import subprocess
from pathlib import Path

import msgspec
import pytest

from api.cli import main as kv_router_main
from mocker.capacity import (
    CapacityResult,
    CapacitySearch,
    Slo,
    capacity_json,
    derive_slo,
    measure_capacity,
    offline_evaluator,
    render_capacity_table,
)
from mocker.config import EngineConfig
from mocker.replay import ReplaySetup
from mocker.report import ReplayRecord, RouterReport, summarize
from mocker.service import serve_router
from mocker.trace import Row, Trace, TraceOptions, build_trace, load_trace
from mocker.workload import shared_prefix_rows
from router.config import RouterConfig
from router.event_plane.embedded_server import EmbeddedNats
from router.policies import Selection, SelectionContext, SelectionPolicy
from tests.router_processes import ROOT, kv_router_command
from tests.test_mocker_online import TIME_SCALE, start_worker

ENGINE = EngineConfig(num_gpu_blocks=512)
SETUP = ReplaySetup(engine=ENGINE, workers=4)


def tiny_trace(requests: int = 80) -> Trace:
    rows = shared_prefix_rows(requests=requests, groups=8, rate_per_s=8.0, output_tokens=64, seed=2)
    return build_trace(rows, TraceOptions(seed=2), "generated")


class FirstCandidate(SelectionPolicy):
    """Every request on the first worker: strictly worse than spreading them."""

    name = "first"

    def __init__(self, config: RouterConfig, rng: object) -> None:
        pass

    def select(self, context: SelectionContext) -> Selection:
        return Selection(0, "always the first")


def report_with(router: str, ttft_ms: float, itl_ms: float, requests: int = 10) -> RouterReport:
    """A run whose every request had this TTFT and mean ITL (11 output tokens, arrivals 1 s apart)."""
    records = [
        ReplayRecord(
            i,
            1000.0 * i,
            100,
            11,
            worker_id=0,
            routed_ms=1000.0 * i,
            first_token_ms=1000.0 * i + ttft_ms,
            finished_ms=1000.0 * i + ttft_ms + 10 * itl_ms,
            status="completed",
        )
        for i in range(requests)
    ]
    return summarize(router, records, 1, wall_s=0.0)


def threshold_evaluator(capacities: dict[str, float], calls: list[tuple[str, float]]):  # type: ignore[no-untyped-def]
    """A fleet whose TTFT p90 is 100 ms up to the router's capacity and 1000 ms beyond it."""

    async def evaluate(router: str, multiplier: float) -> tuple[RouterReport, list[ReplayRecord]]:
        calls.append((router, multiplier))
        ttft = 100.0 if multiplier <= capacities[router] else 1000.0
        report = report_with(router, ttft, 5.0)
        return report, []

    return evaluate


# ---------------------------------------------------------------------- the search
@pytest.mark.parametrize("capacity", [0.05, 0.3, 1.0, 1.7, 9.5])
def test_bisection_brackets_the_capacity_within_the_tolerance(capacity: float) -> None:
    calls: list[tuple[str, float]] = []
    search = CapacitySearch(tolerance=0.05, goodput_multipliers=(1.0,))
    slo = Slo(ttft_p90_ms=300.0, itl_p90_ms=10.0)
    _, (result,), origin = asyncio.run(
        measure_capacity(["r"], threshold_evaluator({"r": capacity}, calls), search, slo=slo)
    )
    lo, hi = result.bracket
    assert lo <= capacity < hi and hi / lo <= 1.05
    assert result.capacity == lo and origin == {"derived": False} and result.resolved
    assert result.at_capacity is not None and result.at_capacity.multiplier == lo and result.at_capacity.meets_slo
    assert len(calls) == len(set(calls)) <= search.max_points  # no multiplier run twice
    assert [p.multiplier for p in result.points] == sorted(m for _, m in calls)


def test_a_router_missing_the_slo_at_any_load_has_no_capacity_and_one_meeting_it_everywhere_is_open() -> None:
    calls: list[tuple[str, float]] = []
    slo = Slo(ttft_p90_ms=300.0, itl_p90_ms=10.0)
    _, (never, always), _ = asyncio.run(
        measure_capacity(
            ["never", "always"],
            threshold_evaluator({"never": 0.0, "always": math.inf}, calls),
            CapacitySearch(),
            slo=slo,
        )
    )
    assert never.capacity == 0.0 and never.at_capacity is None and never.bracket[1] == pytest.approx(1 / 64)
    assert always.capacity == 64.0 and math.isinf(always.bracket[1])
    assert never.resolved and always.resolved


def test_a_search_the_run_budget_stops_keeps_the_runs_meeting_the_slo_and_says_it_stopped() -> None:
    """Two runs: the light run (0.25x, met) and 1x (missed). The budget is spent halving down from 1x, yet
    the light run met the SLO: the capacity is at least 0.25, not "below the least multiplier"."""
    calls: list[tuple[str, float]] = []
    search = CapacitySearch(goodput_multipliers=(1.0,), max_points=2)
    slo, (result,), _ = asyncio.run(measure_capacity(["r"], threshold_evaluator({"r": 0.3}, calls), search))
    assert calls == [("r", 0.25), ("r", 1.0)]
    assert result.capacity == 0.25 and result.bracket == (0.25, 1.0) and not result.resolved
    assert result.at_capacity is not None and result.at_capacity.multiplier == 0.25
    row = render_capacity_table(slo, [result], (1.0,)).splitlines()[-1]
    assert row.split()[:2] == ["r", "0.25"] and " 0.25-1 (run budget) " in row
    assert capacity_json(slo, {}, [result], search, {})["results"][0]["resolved"] is False
    # No run met it, but the search stopped at 0.5x, far above 1/64: not "< 1/64", unresolved below 0.5.
    given = Slo(ttft_p90_ms=300.0, itl_p90_ms=10.0)
    _, (stopped,), _ = asyncio.run(measure_capacity(["r"], threshold_evaluator({"r": 0.3}, []), search, slo=given))
    assert stopped.capacity == 0.0 and stopped.bracket == (0.0, 0.5) and not stopped.resolved
    row = render_capacity_table(given, [stopped], (1.0,)).splitlines()[-1]
    assert row.split()[:3] == ["r", "<", "0.5"] and " 0-0.5 (run budget) " in row


def test_the_run_budget_caps_every_run_the_goodput_points_included() -> None:
    """Eight runs: the search stops early enough for the goodput point it did not reach (0.5x), where it
    used to run all eight and then 0.5x besides; the points it reaches on its way (1x, 2x) cost nothing extra."""
    calls: list[tuple[str, float]] = []
    search = CapacitySearch(max_points=8)  # goodput at 0.5x, 1x, 2x
    slo = Slo(ttft_p90_ms=300.0, itl_p90_ms=10.0)
    _, (result,), _ = asyncio.run(measure_capacity(["r"], threshold_evaluator({"r": 60.0}, calls), search, slo=slo))
    assert len(calls) == len(set(calls)) == 8
    assert all(result.goodput_at(m) is not None for m in search.goodput_multipliers)
    assert result.bracket == (32.0, 64.0) and not result.resolved
    # A budget the fixed runs alone exceed is refused, not overrun.
    with pytest.raises(ValueError, match="budget of 3 runs per router is less than the 4 runs"):
        asyncio.run(measure_capacity(["r"], threshold_evaluator({"r": 1.0}, []), CapacitySearch(max_points=3)))


@pytest.mark.parametrize(
    ("capacity", "bracket", "resolved"),
    # 2.2: runs 1, 2, 4 and 1.5, below the bracket: it stays (2-4), the budget spent before 2.83.
    [(1.7, (1.5, 2.0), False), (1.45, (1.414, 1.5), True), (2.2, (2.0, 4.0), False)],
)
def test_goodput_points_inside_the_bracket_tighten_it(
    capacity: float, bracket: tuple[float, float], resolved: bool
) -> None:
    """`--online --capacity --goodput-at 1.5,2 --max-runs 4`: runs 1, 2, 1.414 and 1.5. A goodput point
    meeting the SLO inside the bracket raises its lo, one missing it lowers its hi (before: the capacity
    and bracket came from the search alone, 1.41 (1.41-2) however 1.5 did)."""
    calls: list[tuple[str, float]] = []
    search = CapacitySearch(tolerance=0.25, goodput_multipliers=(1.5, 2.0), max_points=4)
    slo = Slo(ttft_p90_ms=300.0, itl_p90_ms=10.0)
    _, (result,), _ = asyncio.run(measure_capacity(["r"], threshold_evaluator({"r": capacity}, calls), search, slo=slo))
    assert len(calls) <= 4
    assert tuple(round(m, 3) for m in result.bracket) == bracket and result.resolved is resolved
    assert result.capacity == result.bracket[0]
    assert result.at_capacity is not None and result.at_capacity.multiplier == result.capacity


def test_a_strictly_better_router_gets_a_strictly_higher_capacity() -> None:
    """On a real simulation: spreading requests over four workers carries more than piling them on one."""
    trace = tiny_trace()
    first = f"{__name__}:FirstCandidate"
    search = CapacitySearch(goodput_multipliers=(1.0,))
    _, results, origin = asyncio.run(
        measure_capacity(["least_loaded", "dynamo", first], offline_evaluator(trace, SETUP), search)
    )
    capacity = {r.router: r.capacity for r in results}
    assert capacity[first] > 0
    assert capacity["least_loaded"] > 1.5 * capacity[first]
    assert capacity["dynamo"] > 1.5 * capacity[first]
    assert origin["derived"] and origin["light_multiplier"] == 0.25
    for result in results:
        lo, hi = result.bracket
        assert hi / lo <= 1.05
        met = {p.multiplier: p.meets_slo for p in result.points}
        assert met[lo] and not met[hi]


def test_capacity_is_deterministic_for_a_seed() -> None:
    trace = tiny_trace()
    search = CapacitySearch(goodput_multipliers=(0.5, 2.0))

    def measure() -> object:
        slo, results, origin = asyncio.run(
            measure_capacity(["dynamo", "sglang"], offline_evaluator(trace, SETUP), search)
        )
        return msgspec.to_builtins((slo, origin, [(r.router, r.capacity, r.bracket, r.points) for r in results]))

    assert measure() == measure()


# ---------------------------------------------------------------------- the SLO
def test_the_derived_slo_is_three_times_the_best_ttft_p90_and_one_and_a_half_its_best_itl_p90() -> None:
    light = [report_with("a", 200.0, 8.0), report_with("b", 120.0, 12.0)]
    slo = derive_slo(light, CapacitySearch())
    assert (slo.ttft_p90_ms, slo.itl_p90_ms, slo.e2e_p90_ms) == (360.0, 12.0, None)
    with_e2e = derive_slo(light, CapacitySearch(ttft_factor=2.0, itl_factor=1.25), e2e_factor=2.0)
    best_e2e = min(r.e2e_ms.p90 for r in light)
    assert (with_e2e.ttft_p90_ms, with_e2e.itl_p90_ms, with_e2e.e2e_p90_ms) == (240.0, 10.0, 2 * best_e2e)


def test_the_slo_is_derived_from_the_light_runs_which_the_search_reuses() -> None:
    calls: list[tuple[str, float]] = []

    async def evaluate(router: str, multiplier: float) -> tuple[RouterReport, list[ReplayRecord]]:
        calls.append((router, multiplier))
        # TTFT grows with load; the better router's is half the other's.
        scale = 1.0 if router == "good" else 2.0
        return report_with(router, 100.0 * scale * max(multiplier, 0.25) * 4, 5.0 * scale), []

    slo, results, origin = asyncio.run(measure_capacity(["good", "bad"], evaluate, CapacitySearch()))
    assert (slo.ttft_p90_ms, slo.itl_p90_ms) == (300.0, 7.5)  # 3 x 100 ms and 1.5 x 5 ms at 0.25x
    assert origin["best_ttft_router"] == "good"
    assert calls[:2] == [("good", 0.25), ("bad", 0.25)] and calls.count(("good", 0.25)) == 1
    good, bad = results
    assert good.capacity == pytest.approx(0.75, rel=0.05) and good.capacity <= 0.75
    assert bad.capacity == 0.0  # its ITL p90 (10 ms) misses 7.5 ms even at the lightest load


def test_the_slo_can_come_from_one_routers_light_run() -> None:
    """``slo_from``: both bounds from that router's run, however much better another router is."""

    async def evaluate(router: str, multiplier: float) -> tuple[RouterReport, list[ReplayRecord]]:
        scale = 1.0 if router == "good" else 2.0
        return report_with(router, 100.0 * scale * max(multiplier, 0.25) * 4, 5.0 * scale), []

    search = CapacitySearch(slo_from="bad")
    slo, results, origin = asyncio.run(measure_capacity(["good", "bad"], evaluate, search))
    assert (slo.ttft_p90_ms, slo.itl_p90_ms) == (600.0, 15.0)  # 3 x 200 ms and 1.5 x 10 ms: bad's own
    assert origin["slo_from"] == "bad" and "best_ttft_router" not in origin
    good, bad = results
    assert bad.capacity == pytest.approx(0.75, rel=0.05) and good.capacity == pytest.approx(1.5, rel=0.05)
    with pytest.raises(ValueError, match="router 'other', which is not among"):
        asyncio.run(measure_capacity(["good", "bad"], evaluate, CapacitySearch(slo_from="other")))


def test_slo_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="itl_p90_ms must be > 0"):
        Slo(100.0, 0.0)
    with pytest.raises(ValueError, match="tolerance"):
        CapacitySearch(tolerance=0.0)


def test_unserved_requests_break_the_slo_but_those_no_worker_can_hold_do_not() -> None:
    report = report_with("r", 10.0, 1.0)
    assert Slo(100.0, 5.0).met_by(report)
    report.completed -= 1
    assert not Slo(100.0, 5.0).met_by(report)
    # Rejected by the engines (larger than a worker's KV pool): so at any load, not the fleet's shortfall.
    report.rejected_by_engine = 1
    assert Slo(100.0, 5.0).met_by(report)


def test_a_request_larger_than_a_workers_pool_leaves_the_capacity_what_the_load_makes_it() -> None:
    """One request of 40,000 tokens on pools of 512 blocks of 64 (32,768 tokens): every engine rejects it
    at every multiplier. It used to fail every run's SLO, the capacity "< 1/64" while goodput looked
    healthy; now it is counted as rejected and the capacity is the trace's without it."""
    rows = shared_prefix_rows(requests=80, groups=8, rate_per_s=8.0, output_tokens=64, seed=2)
    huge = (rows[40][0], 40_000, 8, [])
    search = CapacitySearch(goodput_multipliers=(1.0,))

    def capacity(trace_rows: list[Row]) -> CapacityResult:
        trace = build_trace(sorted(trace_rows, key=lambda row: row[0]), TraceOptions(seed=2), "generated")
        _, (result,), _ = asyncio.run(measure_capacity(["dynamo"], offline_evaluator(trace, SETUP), search))
        return result

    with_huge, without = capacity([*rows, huge]), capacity(rows)
    assert with_huge.capacity == without.capacity > 0.25
    assert all(p.rejected == 1 and p.requests == 81 for p in with_huge.points)
    assert all(p.attainment == 1.0 for p in with_huge.points if p.multiplier <= 0.25)


# ---------------------------------------------------------------------- the command
def write_trace(path: Path, requests: int = 60) -> Path:
    rows = shared_prefix_rows(requests=requests, groups=6, rate_per_s=8.0, output_tokens=64)
    path.write_bytes(
        b"".join(
            msgspec.json.encode({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": ids}) + b"\n"
            for t, n, o, ids in rows
        )
    )
    return path


def test_replay_capacity_writes_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "trace.jsonl")
    out = tmp_path / "out"
    argv = ["replay", str(trace), "--capacity", "--workers", "2", "--routers", "dynamo,round_robin"]
    assert kv_router_main([*argv, "--num-gpu-blocks", "512", "--goodput-at", "1,3", "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("SLO: TTFT p90 <= ") and "goodput@3x r/s" in printed
    header, _, *rows = printed.splitlines()[1:]
    assert header.split()[:3] == ["router", "capacity", "x"] and "bracket" in header
    report = msgspec.json.decode((out / "capacity.json").read_bytes())
    assert set(report) == {"settings", "slo", "search", "results"}
    assert report["settings"]["mode"] == "offline" and report["settings"]["workers"] == 2
    assert set(report["slo"]) == {"ttft_p90_ms", "itl_p90_ms", "e2e_p90_ms", "origin"}
    assert report["slo"]["origin"]["derived"] is True and report["slo"]["e2e_p90_ms"] is None
    assert report["search"]["tolerance"] == 0.05 and report["search"]["goodput_multipliers"] == [1.0, 3.0]
    assert [r["router"] for r in report["results"]] == ["dynamo", "round_robin"]
    for row, result in zip(rows, report["results"], strict=True):
        lo, hi = result["bracket"]
        assert row.split()[:3] == [result["router"], f"{lo:.3g}", f"{lo:.3g}-{hi:.3g}" if hi else "-"]
    for result in report["results"]:
        assert set(result) == {
            "router", "capacity", "bracket", "resolved", "goodput_per_s", "at_capacity", "points",
        }  # fmt: skip
        assert result["resolved"] is True
        assert set(result["goodput_per_s"]) == {"1", "3"}
        assert result["bracket"][0] == result["capacity"]
        assert set(result["at_capacity"]) == {
            "multiplier", "meets_slo", "attainment", "goodput_per_s", "requests_per_s", "hit_rate",
            "ttft_p90_ms", "itl_p90_ms", "e2e_p90_ms", "completed", "requests", "rejected",
        }  # fmt: skip
        assert result["at_capacity"]["multiplier"] == result["capacity"]
        multipliers = [p["multiplier"] for p in result["points"]]
        assert multipliers == sorted(multipliers) and {0.25, 1.0, 3.0} <= set(multipliers)
    assert (out / "capacity.md").read_text().startswith("# Capacity report")
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "capacity.png").stat().st_size > 0


def test_replay_capacity_takes_a_given_slo_and_refuses_half_of_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(tmp_path / "trace.jsonl", requests=30)
    out = tmp_path / "out"
    argv = ["replay", str(trace), "--capacity", "--workers", "2", "--routers", "dynamo", "--out", str(out), "--quiet"]
    assert kv_router_main([*argv, "--slo-ttft-ms", "5000", "--slo-itl-ms", "200", "--slo-e2e-ms", "60000"]) == 0
    report = msgspec.json.decode((out / "capacity.json").read_bytes())
    assert report["slo"] == {
        "ttft_p90_ms": 5000.0,
        "itl_p90_ms": 200.0,
        "e2e_p90_ms": 60000.0,
        "origin": {"derived": False},
    }
    assert 0.25 not in [p["multiplier"] for p in report["results"][0]["points"]]  # no light run needed
    assert kv_router_main([*argv, "--slo-ttft-ms", "5000"]) == 2
    assert "give both --slo-ttft-ms and --slo-itl-ms" in capsys.readouterr().err
    assert kv_router_main([*argv, "--slo-ttft-ms", "5000", "--slo-itl-ms", "200", "--slo-from", "dynamo"]) == 2
    assert "--slo-from derives the SLO" in capsys.readouterr().err
    assert kv_router_main([*argv, "--slo-from", "nobody"]) == 2
    assert "router 'nobody', which is not among ['dynamo']" in capsys.readouterr().err
    assert kv_router_main([*argv, "--max-runs", "3"]) == 2  # the light run and 0.5x, 1x, 2x: four
    assert "--max-runs 3 is less than the 4 runs the light run and the goodput points" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--light-load", "0"], "error: argument --light-load: must be > 0, got 0"),
        (["--goodput-at", "1,x"], "error: argument --goodput-at: not a number: 'x'"),
        (["--goodput-at", "1,inf"], "error: argument --goodput-at: must be > 0, got inf"),
        (["--max-runs", "1"], "error: argument --max-runs: must be >= 2, got 1"),
        (["--capacity-tolerance", "2"], "error: argument --capacity-tolerance: must be in (0, 1), got 2"),
        (["--slo-ttft-ms", "nan", "--slo-itl-ms", "100"], "error: argument --slo-ttft-ms: must be > 0, got nan"),
        (["--slo-ttft-ms", "100"], "give both --slo-ttft-ms and --slo-itl-ms, or neither (derived)"),
        (["--max-runs", "3"], "--max-runs 3 is less than the 4 runs the light run and the goodput points"),
    ],
)
def test_capacity_flags_are_refused_in_one_line_before_the_trace_loads(
    flags: list[str], says: str, tmp_path: Path
) -> None:
    """They used to exit 1 (a SystemExit of the message), and only once the trace had loaded: here a
    trace that does not exist would have been the error."""
    argv = ["replay", str(tmp_path / "missing.jsonl"), "--capacity", "--quiet", *flags]
    done = subprocess.run([*kv_router_command(), *argv], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1 and says in done.stderr, done.stderr


# ---------------------------------------------------------------------- online
@pytest.mark.anyio
@pytest.mark.slow
async def test_online_capacity_runs_each_point_on_a_fresh_fleet_and_agrees_with_the_simulation(tmp_path: Path) -> None:
    trace_path = write_trace(tmp_path / "trace.jsonl")
    out = tmp_path / "online"
    workers = 2
    with EmbeddedNats() as nats:
        async with serve_router(nats.url, RouterConfig(block_size=ENGINE.block_size)) as url:
            processes = [start_worker(tmp_path, nats.url, 300 + i) for i in range(workers)]
            try:
                argv = [
                    "replay", str(trace_path), "--online", "--capacity", "--url", url, "--nats-url", nats.url,
                    "--workers", str(workers), "--time-scale", str(TIME_SCALE), "--label", "online",
                    "--slo-ttft-ms", "1500", "--slo-itl-ms", "40", "--capacity-tolerance", "0.5",
                    "--max-runs", "4", "--out", str(out), "--quiet", "--no-plots",
                ]  # fmt: skip
                # `kv-router replay` runs its own event loop: in a thread, beside the router's.
                assert await asyncio.to_thread(kv_router_main, argv) == 0
            finally:
                for process in processes:
                    assert process.stop() == 0  # a clean exit on SIGTERM
    report = msgspec.json.decode((out / "capacity.json").read_bytes())
    assert report["settings"]["mode"] == "online" and report["search"]["goodput_multipliers"] == [1.0]
    (online,) = report["results"]
    assert online["router"] == "online" and "1" in online["goodput_per_s"]
    points = online["points"]
    assert 2 <= len(points) <= 4
    for point in points:
        assert point["completed"] == point["requests"] == 60
    # Each point starts from empty caches: the same trace finds about the same hits at every load, where a
    # warm fleet would serve the second run's every shared prefix from cache.
    hits = [p["hit_rate"] for p in points]
    assert max(hits) - min(hits) < 0.1
    # The simulated fleet, routed by the service's policy, finds the same hits at the same multipliers.
    slo = Slo(ttft_p90_ms=1500.0, itl_p90_ms=40.0)
    search = CapacitySearch(tolerance=0.5, goodput_multipliers=(1.0,), max_points=4)
    setup = ReplaySetup(engine=ENGINE, workers=workers)
    _, (offline,), _ = await measure_capacity(
        [RouterConfig().policy], offline_evaluator(load_trace(trace_path), setup), search, slo=slo
    )
    simulated = {p.multiplier: p for p in offline.points}
    for point in points:
        if point["multiplier"] in simulated:
            assert point["hit_rate"] == pytest.approx(simulated[point["multiplier"]].hit_rate, abs=0.08)

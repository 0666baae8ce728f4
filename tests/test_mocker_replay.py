"""Offline replay: determinism, the peer baselines, external routers, the report and the command."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import random
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from api.cli import main as kv_router_main
from indexer.events import RouterEvent, stored_event
from indexer.hashing import compute_block_hashes, compute_sequence_hashes
from mocker import plots
from mocker.baselines import LlmdScorers, SglangCacheAware
from mocker.config import EngineConfig
from mocker.engine import EngineMetrics
from mocker.fleet import FleetRouter, RoutedRequest, RouteResult
from mocker.replay import ReplaySetup, replay_offline, write_outputs
from mocker.report import Latency, ReplayRecord, render_table, render_worker_table, summarize
from mocker.routers import KvFleetRouter, make_router, router_names
from mocker.simulation import simulate
from mocker.tokens import BlockTokens
from mocker.trace import Trace, TraceOptions, build_trace
from mocker.workload import shared_prefix_rows
from router.config import RouterConfig
from router.policies import Selection, SelectionContext, SelectionPolicy
from tests.router_processes import ROOT, kv_router_command

# Small KV pools, so that routing decides what stays cached.
ENGINE = EngineConfig(num_gpu_blocks=512)


def workload(requests: int = 160, seed: int = 0) -> Trace:
    rows = shared_prefix_rows(requests=requests, groups=12, rate_per_s=8.0, seed=seed)
    return build_trace(rows, TraceOptions(seed=seed), "generated")


def replay(trace: Trace, router: str, *, seed: int = 0, workers: int = 4, **kwargs: Any) -> list[ReplayRecord]:
    made = make_router(router, RouterConfig(block_size=ENGINE.block_size), random.Random(seed))
    result = asyncio.run(simulate(trace, made, ENGINE, workers, seed=seed, **kwargs))
    return result.records


def fate(records: list[ReplayRecord]) -> list[tuple[Any, ...]]:
    return [dataclasses.astuple(r) for r in records]


@pytest.mark.parametrize("router", router_names())
def test_an_offline_replay_is_deterministic_for_a_seed(router: str) -> None:
    trace = workload()
    first = replay(trace, router, seed=5)
    assert fate(first) == fate(replay(trace, router, seed=5))
    assert all(r.status == "completed" for r in first)
    assert all(0 <= r.cached_tokens < r.input_length for r in first)


def test_records_follow_their_requests_when_jitter_reorders_arrivals() -> None:
    rows = shared_prefix_rows(requests=80, groups=6, rate_per_s=20.0)
    trace = build_trace(rows, TraceOptions(jitter_ms=2000.0, seed=1), "generated")
    assert [r.index for r in trace] != sorted(r.index for r in trace)
    records = replay(trace, "dynamo")
    arrivals = {r.index: r.arrival_ms for r in trace}
    for record in records:
        assert record.arrival_ms == arrivals[record.index]
        assert record.routed_ms == record.arrival_ms  # no router queue: routed on arrival
        assert record.arrival_ms < record.first_token_ms <= record.finished_ms


def test_requests_wait_in_the_router_queue_and_are_rejected_when_it_is_full() -> None:
    rows = shared_prefix_rows(requests=120, groups=6, rate_per_s=60.0, output_tokens=200)
    trace = build_trace(rows, TraceOptions(), "burst")
    config = RouterConfig(block_size=64, router_queue_threshold=0.2, router_queue_request_limit_per_worker=4)
    router = KvFleetRouter(config, random.Random(0))
    records = asyncio.run(simulate(trace, router, ENGINE, 2)).records
    queued = [r for r in records if r.queued_in_router]
    rejected = [r for r in records if r.status == "rejected_by_router"]
    assert queued and rejected
    assert all(r.status == "completed" for r in records if r not in rejected)
    assert all(r.routed_ms > r.arrival_ms for r in queued)  # dispatched when a mark freed capacity
    assert all(r.worker_id == -1 for r in rejected)


def test_seeds_change_random_choices() -> None:
    trace = workload()
    assert [r.worker_id for r in replay(trace, "random", seed=1)] != [
        r.worker_id for r in replay(trace, "random", seed=2)
    ]


def test_cache_aware_routing_beats_cache_blind_routing_on_shared_prefixes() -> None:
    trace = workload(240)
    reports = {
        name: summarize(name, replay(trace, name), 4, wall_s=0.0)
        for name in ("dynamo", "round_robin", "sglang", "llmd")
    }
    blind = reports["round_robin"].hit_rate_tokens
    for name in ("dynamo", "sglang", "llmd"):
        assert reports[name].hit_rate_tokens > blind + 0.1, render_table(list(reports.values()))
    # The router's own prediction tracks what the engines found (events are exact, nothing is stale).
    dynamo = reports["dynamo"]
    assert dynamo.predicted_hit_rate == pytest.approx(dynamo.hit_rate_tokens, abs=0.05)


def test_late_kv_events_reach_the_router_after_the_decisions_that_needed_them() -> None:
    trace = workload()
    prompt_now = summarize("now", replay(trace, "dynamo"), 4, wall_s=0.0)
    late = summarize("late", replay(trace, "dynamo", event_delay_ms=5000.0), 4, wall_s=0.0)
    assert late.completed == prompt_now.completed
    assert late.predicted_hit_rate < prompt_now.predicted_hit_rate


def test_the_computed_prompt_credit_is_off_with_events_on_time_unless_an_option_sets_it(tmp_path: Path) -> None:
    """Without --event-delay-ms the replay turns the credit off (no lag for it to bridge); a value the user
    set used to be turned off too, silently."""
    argv = ["replay", "--workload", "agentic", "--limit", "4", "--routers", "dynamo", "--quiet", "--no-plots"]

    def credit(*options: str) -> float:
        out = tmp_path / str(len(options))
        assert kv_router_main([*argv, "--out", str(out), *options]) == 0
        settings = msgspec.json.decode((out / "report.json").read_bytes())["settings"]
        credit_secs: float = settings["router_config"]["computed_prompt_credit_secs"]
        return credit_secs

    assert credit() == 0.0
    assert credit("--router-option", "computed_prompt_credit_secs=3") == 3.0
    assert credit("--event-delay-ms", "200") == RouterConfig().computed_prompt_credit_secs > 0


# ---------------------------------------------------------------------- baselines
def routed(tokens: BlockTokens, blocks: list[int], length: int, request_id: str = "r") -> RoutedRequest:
    return RoutedRequest(request_id, tokens.prompt(blocks, length), length, 10)


def test_sglang_follows_its_own_tree_until_loads_are_imbalanced() -> None:
    tokens = BlockTokens(512)
    router = SglangCacheAware(RouterConfig(block_size=64), random.Random(0), balance_abs_threshold=2)
    for worker in range(3):
        router.add_worker(worker, ENGINE)

    def route(blocks: list[int], request_id: str) -> RouteResult:
        return asyncio.run(router.route(routed(tokens, blocks, 1024, request_id), 0.0))

    first = route([1, 2], "a")
    assert first.predicted_cached_tokens == 0
    again = route([1, 2], "b")  # matches its own tree above the threshold
    assert (again.worker_id, again.predicted_cached_tokens) == (first.worker_id, 1024)
    other = route([5, 6], "c")  # no match: the smallest tree
    assert other.worker_id != first.worker_id
    route([1, 2], "d")  # 3 in flight on one worker, 1 on another, 0 on the third: imbalanced
    balanced = route([1, 2], "e")
    assert balanced.worker_id not in (first.worker_id, other.worker_id)
    for request_id in "abcde":
        router.finished(request_id, 1.0)
    assert route([1, 2], "f").worker_id in (first.worker_id, balanced.worker_id)


def test_sglang_trims_its_tree_least_recently_used_first() -> None:
    tokens = BlockTokens(512)
    router = SglangCacheAware(
        RouterConfig(block_size=64), random.Random(0), max_tree_size=1024, eviction_interval_ms=100.0
    )
    router.add_worker(0, ENGINE)
    asyncio.run(router.route(routed(tokens, [1, 2], 1024, "old"), 0.0))
    asyncio.run(router.route(routed(tokens, [3, 4], 1024, "new"), 50.0))
    result = asyncio.run(router.route(routed(tokens, [1, 2], 1024, "probe"), 150.0))
    assert result.predicted_cached_tokens == 0  # the older prompt was evicted at 100 ms
    result = asyncio.run(router.route(routed(tokens, [3, 4], 1024, "probe2"), 160.0))
    assert result.predicted_cached_tokens == 1024


def test_llmd_weighs_prefix_twice_as_much_as_queue_and_kv_usage() -> None:
    tokens = BlockTokens(512)
    router = LlmdScorers(RouterConfig(block_size=64), random.Random(0))
    for worker in range(2):
        router.add_worker(worker, ENGINE)
    request = routed(tokens, [1, 2], 1024)
    # Worker 1 holds the whole prompt, as its KV events said.
    local = compute_block_hashes(request.tokens, 64)
    blocks = list(zip(compute_sequence_hashes(local), local, strict=True))
    router.kv_event(RouterEvent(1, stored_event(1, blocks)), 0.0)

    def metrics(waiting: int, usage: float) -> EngineMetrics:
        return EngineMetrics(waiting, 0, 0, usage, 0)

    router.scraped({0: metrics(0, 0.0), 1: metrics(0, 0.0)}, 0.0)
    chosen = asyncio.run(router.route(request, 0.0))
    assert (chosen.worker_id, chosen.predicted_cached_tokens) == (1, 1024)
    # The queue and KV usage scorers weigh 1 each, the prefix 2: a full prefix outweighs a long queue
    # and a fuller cache, but not both at their worst against half a prefix.
    router.scraped({0: metrics(0, 0.0), 1: metrics(9, 0.6)}, 1.0)
    assert asyncio.run(router.route(request, 1.0)).worker_id == 1
    router.scraped({0: metrics(0, 0.0), 1: metrics(9, 1.0)}, 2.0)
    partial = routed(tokens, [1, 7], 1024)  # only half the prompt is cached on worker 1
    assert asyncio.run(router.route(partial, 2.0)).worker_id == 0


# ---------------------------------------------------------------------- external routers
class FirstCandidate(SelectionPolicy):
    """A selection policy for `KvRouter`, plugged in by import path."""

    name = "first"

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        pass

    def select(self, context: SelectionContext) -> Selection:
        return Selection(0, "always the first")


class AlwaysWorker:
    """A whole router of its own, plugged in by import path."""

    name = "always-1"
    scrape_interval_ms: float | None = None
    rejected_events = 0

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        self.events = 0

    def add_worker(self, worker_id: int, engine: EngineConfig) -> None:
        pass

    async def route(self, request: RoutedRequest, now_ms: float) -> RouteResult:
        return RouteResult(1, 0)

    def kv_event(self, event: RouterEvent, now_ms: float) -> None:
        self.events += 1

    def first_token(self, request_id: str, now_ms: float) -> None:
        pass

    def output(self, request_id: str, generated_tokens: int, now_ms: float) -> None:
        pass

    def finished(self, request_id: str, now_ms: float) -> None:
        pass

    def scraped(self, metrics: dict[int, EngineMetrics], now_ms: float) -> None:
        pass


def test_external_policies_and_routers_plug_in_by_import_path() -> None:
    trace = workload(40)
    policy = make_router(f"{__name__}:FirstCandidate", RouterConfig(block_size=64), random.Random(0))
    assert isinstance(policy, KvFleetRouter)
    assert {r.worker_id for r in replay(trace, f"{__name__}:FirstCandidate")} == {0}
    router = make_router(f"{__name__}:AlwaysWorker", RouterConfig(block_size=64), random.Random(0))
    assert isinstance(router, FleetRouter)
    assert {r.worker_id for r in replay(trace, f"{__name__}:AlwaysWorker")} == {1}
    with pytest.raises(ValueError, match="cannot import"):
        make_router("no_such_module:factory", RouterConfig(), random.Random(0))
    with pytest.raises(ValueError, match="unknown router"):
        make_router("nonsense", RouterConfig(), random.Random(0))


class ProgressRecorder(KvFleetRouter):
    """Our router, with every output progress the replay tells it kept."""

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        super().__init__(config, rng)
        self.told: dict[str, list[int]] = {}

    def output(self, request_id: str, generated_tokens: int, now_ms: float) -> None:
        assert self.router.booking(request_id) is not None, "progress told after the request ended"
        self.told.setdefault(request_id, []).append(generated_tokens)
        super().output(request_id, generated_tokens, now_ms)


def test_the_replay_tells_output_progress_each_time_an_output_opens_a_block() -> None:
    engine = EngineConfig()  # room for everything: no preemption recomputes a block
    trace = build_trace(
        shared_prefix_rows(requests=60, groups=4, rate_per_s=20.0, seed=1, output_tokens=300),
        TraceOptions(seed=1),
        "generated",
    )
    fleet = ProgressRecorder(RouterConfig(block_size=engine.block_size, policy="latency"), random.Random(0))
    records = asyncio.run(simulate(trace, fleet, engine, 2)).records
    assert all(r.status == "completed" and not r.preemptions for r in records)
    block = engine.block_size
    for request, r in zip(trace.requests, records, strict=True):
        # The token making the context one longer than a whole number of blocks opens a block; the
        # last token opens none (the request ends with it).
        opened = [g for g in range(1, r.output_length) if (r.input_length + g) % block == 1]
        assert fleet.told.get(request.request_id, []) == opened
    assert sum(map(len, fleet.told.values())) > 100


# ---------------------------------------------------------------------- report
def record(worker: int, cached: int, ttft: float, *, routed_ms: float = 0.0, status: str = "completed") -> ReplayRecord:
    return ReplayRecord(
        index=0,
        arrival_ms=routed_ms,
        input_length=1000,
        output_length=10,
        worker_id=worker,
        routed_ms=routed_ms,
        predicted_cached_tokens=cached // 2,
        cached_tokens=cached,
        cached_blocks=cached // 100,
        prompt_blocks=10,
        first_token_ms=routed_ms + ttft,
        finished_ms=routed_ms + ttft + 100,
        status=status,
    )


def test_summary_figures() -> None:
    records = [
        record(0, 800, 10.0),
        record(1, 0, 30.0),
        record(0, 500, 20.0, routed_ms=61_000.0),
        record(1, 0, 40.0, status="rejected_by_router"),
    ]
    report = summarize("x", records, 2, wall_s=1.0)
    assert (report.completed, report.rejected_by_router) == (3, 1)
    assert report.hit_rate_tokens == pytest.approx(1300 / 3000)
    assert report.hit_rate_blocks == pytest.approx(13 / 30)
    assert report.predicted_hit_rate == pytest.approx(650 / 3000)
    assert report.ttft_ms == Latency(20.0, 30.0, 30.0, 20.0)
    # Ten output tokens 100 ms after the first: nine gaps of 100 / 9 ms.
    assert report.itl_ms.p90 == pytest.approx(100 / 9)
    assert [(w.requests, w.ttft_ms.p90, w.e2e_ms.p50) for w in report.per_worker] == [
        (2, 20.0, 110.0),
        (1, 30.0, 130.0),
    ]
    assert [w.hit_rate_tokens for w in report.per_worker] == [pytest.approx(1300 / 2000), 0.0]
    # Uncached work: worker 0 did 200 + 500, worker 1 did 1000 -> max/mean = 1000 / 850.
    assert report.imbalance == pytest.approx(1000 / 850)
    # First window: 200 vs 1000 (ratio 1000/600, work 1200); second: 500 vs 0 (ratio 2, work 500).
    assert report.imbalance_window_worst == pytest.approx(2.0)
    assert report.imbalance_window_mean == pytest.approx((1000 / 600 * 1200 + 2 * 500) / 1700)
    assert [w["prefill_tokens"] for w in report.windows] == [[200, 1000], [500, 0]]
    assert "x" in render_table([report])
    assert render_worker_table([report]).splitlines()[2].split() == [
        "x",
        "0",
        "2",
        "0.650",
        "10/20",
        "11.1/11.1",
        "110/120",
    ]


# ---------------------------------------------------------------------- the command
def test_replay_command_writes_the_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = shared_prefix_rows(requests=60, groups=6)
    trace.write_bytes(
        b"".join(
            msgspec.json.encode({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": ids}) + b"\n"
            for t, n, o, ids in rows
        )
    )
    out = tmp_path / "out"
    argv = ["replay", str(trace), "--workers", "2", "--routers", "dynamo,sglang", "--out", str(out), "--quiet"]
    # Through `kv-router replay` itself: the command the service's CLI registers.
    assert kv_router_main([*argv, "--per-request", "--router-option", "prefill_load_scale=2"]) == 0
    table = capsys.readouterr().out
    assert "dynamo" in table and "sglang" in table
    report = msgspec.json.decode((out / "report.json").read_bytes())
    assert [r["router"] for r in report["results"]] == ["dynamo", "sglang"]
    assert report["settings"]["router_config"]["prefill_load_scale"] == 2
    assert (out / "report.md").read_text().startswith("# Replay report")
    assert len((out / "requests-dynamo.jsonl").read_text().splitlines()) == 60
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "ttft_cdf.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("command", "flag", "value"),
    [
        ("replay", "--max-num-seqs", "0"),
        ("replay", "--engine-speedup", "0"),
        ("replay", "--engine-speedup", "-1"),
        ("replay", "--engine-speedup", "inf"),
        ("replay", "--num-gpu-blocks", "0"),
        ("tune", "--max-num-batched-tokens", "0"),
        ("mock-worker", "--block-size", "-64"),
    ],
)
def test_a_bad_engine_setting_is_one_line_naming_its_flag(
    command: str, flag: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The engine's bounds (positive counts, a positive speedup) hold on the command line: one line, code
    2, for the three commands that share the engine flags; not a traceback, nor a report of NaNs."""
    if command == "mock-worker":
        argv = [command, "--nats-url", "nats://127.0.0.1:1", "--nats-wait-secs", "0"]
    else:
        argv = [command, "--workload", "agentic", "--limit", "5", "--out", str(tmp_path / "out"), "--quiet"]
        argv += ["--budget", "1", "--jobs", "1"] if command == "tune" else ["--routers", "dynamo", "--no-plots"]
    with pytest.raises(SystemExit) as exited:
        kv_router_main([*argv, flag, value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kv-router {command}: {flag} ") and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("flag", ["--time-scale", "--window-s"])
@pytest.mark.parametrize("value", ["0", "-2", "nan", "inf"])
def test_time_scales_and_windows_not_above_zero_are_refused_at_parsing(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--time-scale divides the trace's times, --window-s the run's (0: a ZeroDivisionError; negative:
    windows of nonsense); argparse refuses them in one line."""
    with pytest.raises(SystemExit) as exited:
        # Online to nowhere, fast: were the value taken, the replay would fail on connecting.
        online = [
            "--online",
            "--url",
            "http://127.0.0.1:1",
            "--nats-url",
            "nats://127.0.0.1:1",
            "--nats-wait-secs",
            "0",
        ]
        kv_router_main(["replay", "--workload", "agentic", "--limit", "4", *online, flag, value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: must be > 0" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    ("command", "flag", "value", "says"),
    [
        ("replay", "--jitter-ms", "nan", "must be >= 0, got nan"),  # hung for ever
        ("replay", "--jitter-ms", "inf", "must be >= 0, got inf"),  # a report of NaNs, exit 0
        ("replay", "--event-delay-ms", "nan", "must be >= 0, got nan"),
        ("replay", "--speedup", "inf", "must be > 0, got inf"),
        ("replay", "--workers", "0", "must be >= 1, got 0"),
        ("tune", "--budget", "-1", "must be >= 0, got -1"),  # every grid point but one: 5,183 replays
        ("tune", "--jobs", "-1", "must be >= 0, got -1"),
        ("tune", "--workers", "0", "must be >= 1, got 0"),
        ("tune", "--workers", "two", "not an integer: 'two'"),
        ("replay", "--routers", ",", "no router named: ','"),  # ran every router
        ("replay", "--goodput-at", ",,", "no multiplier given: ',,'"),  # no goodput point, exit 0
        ("demo", "--speedup", "0", "must be > 0, got 0"),  # a ZeroDivisionError
        ("demo", "--workers", "0", "must be >= 1, got 0"),  # an HTTP 503's traceback
        ("demo", "--requests", "0", "must be >= 1, got 0"),  # tables of NaN, exit 0
        ("demo", "--num-gpu-blocks", "0", "must be >= 1, got 0"),
    ],
)
def test_times_counts_and_budgets_out_of_bounds_are_refused_at_parsing(
    command: str, flag: str, value: str, says: str, tmp_path: Path
) -> None:
    argv = [command, "--workload", "agentic", "--limit", "4", "--out", str(tmp_path / "out"), "--quiet", "--no-plots"]
    if command == "demo":
        argv = [command, "--quiet"]
    done = subprocess.run(
        [*kv_router_command(), *argv, flag, value], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 2
    assert done.stderr.startswith(f"kv-router {command}: error: argument {flag}: {says}"), done.stderr
    assert len(done.stderr.splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["replay", "tune"])
def test_an_out_that_cannot_be_a_directory_is_refused_before_the_run(command: str, tmp_path: Path) -> None:
    """Found at the end, it lost the whole run's figures in a traceback (FileExistsError,
    NotADirectoryError)."""
    taken = tmp_path / "a-file"
    taken.write_text("x")
    for out, says in ((taken, "not a directory"), (taken / "sub", "cannot make the directory: Not a directory")):
        argv = [command, "--workload", "agentic", "--limit", "4", "--out", str(out), "--quiet", "--no-plots"]
        done = subprocess.run([*kv_router_command(), *argv], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert done.returncode == 2, done.stderr
        assert done.stderr.splitlines()[-1] == f"kv-router {command}: --out {out}: {says}", done.stderr


@pytest.mark.parametrize(
    ("option", "says"),
    [
        ("prefil_load_scale=2", "--router-option prefil_load_scale=2: 'prefil_load_scale' is not a router setting; "
         "did you mean prefill_load_scale?"),
        ("foo=1", f"--router-option foo=1: 'foo' is not a router setting; the settings: "
         f"{', '.join(RouterConfig.__struct_fields__)}"),
        ("router_temperature=hot", "--router-option router_temperature: expected a number, got 'hot'"),
        ("block_size=0", "--router-option block_size: must be a positive integer, got 0"),
        ("prefill_load_scale", "--router-option takes KEY=VALUE, got 'prefill_load_scale'"),
    ],
    ids=["misspelt", "unknown", "bad-type", "bad-value", "no-value"],
)  # fmt: skip
def test_a_bad_router_option_is_a_usage_error_naming_it(option: str, says: str, tmp_path: Path) -> None:
    argv = ["replay", "--workload", "agentic", "--limit", "4", "--routers", "dynamo", "--out", str(tmp_path / "out")]
    done = subprocess.run(
        [*kv_router_command(), *argv, "--quiet", "--no-plots", "--router-option", option],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr == f"kv-router replay: {says}\n"
    assert not (tmp_path / "out").exists()


def test_requests_no_worker_can_hold_are_warned_of_rejected_and_the_rest_replayed(tmp_path: Path) -> None:
    """Pools of 100 blocks of 64 (6,400 tokens): a prompt of 6,300 tokens fits but not with its 500 output
    tokens (the run used to end in "worker 0 made no progress"), nor does a prompt of 7,000; both are
    named up front and rejected by the engine, the other requests served."""
    trace = tmp_path / "trace.jsonl"
    lines = [(0, 6300, 500, list(range(13))), (450, 7000, 10, [])]
    lines += [(100 * i, 600, 10, [0, i]) for i in range(1, 5)]
    trace.write_bytes(
        b"".join(
            msgspec.json.encode({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": ids}) + b"\n"
            for t, n, o, ids in lines
        )
    )
    out = tmp_path / "out"
    argv = [str(trace), "--workers", "1", "--num-gpu-blocks", "100", "--routers", "dynamo", "--out", str(out)]
    done = subprocess.run(
        [*kv_router_command(), "replay", *argv, "--quiet", "--no-plots"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (
        "kv-router replay: warning: 2 requests larger than a worker's KV pool (100 blocks of 64 tokens; the largest: "
        "7000 prompt + 10 output tokens): every engine rejects them whatever the load" in done.stderr
    )
    [result] = msgspec.json.decode((out / "report.json").read_bytes())["results"]
    assert (result["requests"], result["completed"], result["rejected_by_engine"]) == (6, 4, 2)


def test_a_trace_without_requests_is_refused_and_so_is_a_missing_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty trace used to replay to a report of NaNs, exit 0; no trace at all was "not both"."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    options = ["--routers", "dynamo", "--out", str(tmp_path / "out"), "--quiet", "--no-plots"]
    assert kv_router_main(["replay", str(empty), *options]) == 2
    assert capsys.readouterr().err.splitlines() == [f"kv-router replay: {empty}: the trace has no requests"]
    assert not (tmp_path / "out").exists()
    assert kv_router_main(["replay", *options]) == 2
    assert capsys.readouterr().err.splitlines() == ["kv-router replay: give a trace file or --workload"]


def test_plots_are_skipped_with_a_message_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_import: Callable[[str], Any] = importlib.import_module

    def no_matplotlib(name: str, package: str | None = None) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name)

    monkeypatch.setattr(importlib, "import_module", no_matplotlib)
    trace = workload(30)
    runs = asyncio.run(
        replay_offline(trace, ReplaySetup(engine=ENGINE, workers=2, routers=("dynamo",)), show_progress=False)
    )
    paths, note = write_outputs(runs, {}, tmp_path)
    assert note == plots.MATPLOTLIB_MISSING
    assert sorted(p.name for p in paths) == ["report.json", "report.md"]


def test_plots_name_the_workload_and_show_routers_with_identical_curves() -> None:
    generated = {"trace": "workload:agentic", "seed": 3, "requests": 200, "workers": 4}
    assert plots.workload_caption(generated) == "agentic workload, seed 3: 200 requests, 4 workers"
    traced = {"trace": "/data/traces/conversation.jsonl", "seed": 0, "requests": 12031, "workers": 8}
    assert plots.workload_caption(traced) == "conversation.jsonl: 12031 requests, 8 workers"
    # Identical curves (a policy that made the same choices) would hide one another: one line, both names.
    merged = plots.coinciding([("dynamo", [1.0, 2.0]), ("latency", [1.0, 3.0]), ("cache_affinity", [1.0, 2.0])])
    assert merged == [("dynamo = cache_affinity", [1.0, 2.0]), ("latency", [1.0, 3.0])]


def test_an_online_replay_that_sent_its_requests_late_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """The replayer's own lateness (a request sent after its arrival) is inside the TTFT it measures:
    a p90 of a tenth of the TTFT p90 or more (and 10 ms or more) is a WARNING naming it; less is not. Times rescale with
    the rest (a run at --time-scale 4 sent 10 ms late was 40 ms late in trace time)."""
    from mocker.cli import _warn_late
    from mocker.replay import ReplayRun
    from mocker.report import rescale_times, send_lateness

    def run(late_ms: float) -> ReplayRun:
        records = [
            ReplayRecord(index=i, arrival_ms=100.0 * i, input_length=64, output_length=4, status="completed")
            for i in range(20)
        ]
        for record in records:
            record.sent_ms = record.arrival_ms + late_ms
            record.first_token_ms = record.sent_ms + 50.0  # the fleet's own TTFT: 50 ms
            record.finished_ms = record.first_token_ms + 30.0
        rescale_times(records, 4.0)
        return ReplayRun(summarize("online", records, 1, wall_s=1.0), records)

    late = run(10.0)
    assert send_lateness(late.records).p90 == pytest.approx(40.0)
    _warn_late(late)
    warned = capsys.readouterr().err
    assert "WARNING: requests were sent late: p90 40 ms, p99 40 ms after their arrivals (trace time)" in warned
    assert "inside the TTFT p90 of 240 ms" in warned
    _warn_late(run(2.0))  # 8 ms of a 208 ms TTFT p90
    assert capsys.readouterr().err == ""
    fast = run(0.5)  # 2 ms of a 202 ms TTFT p90, the fleet's TTFT made 5 ms: a tenth of it, yet only 2 ms
    for record in fast.records:
        record.first_token_ms = record.sent_ms + 3.0
    _warn_late(ReplayRun(summarize("online", fast.records, 1, wall_s=1.0), fast.records))
    assert capsys.readouterr().err == ""

"""`kv-router tune` and the generated workloads it and `kv-router replay --workload` run on."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import multiprocessing
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from api.cli import main as kv_router_main
from api.config import load_settings
from mocker import tune
from mocker.config import EngineConfig
from mocker.replay import ReplaySetup
from mocker.trace import Trace, TraceOptions, build_trace
from mocker.tune import (
    SEARCH_SPACE,
    ReplayFailed,
    SearchInterrupted,
    TuneResult,
    TuneSetup,
    candidates,
    pareto_front,
    pick,
    result_key,
    write_config,
)
from mocker.workload import WORKLOADS, agentic_rows, bursty_rows, rag_rows
from router.config import RouterConfig
from tests.router_processes import ROOT, kv_router_command, running
from tests.waiting import until


# ---------------------------------------------------------------------- workloads
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_a_workload_is_the_same_for_a_seed_and_another_for_another(name: str) -> None:
    generate = WORKLOADS[name]
    first = generate(seed=3)
    assert first == generate(seed=3)
    assert first != generate(seed=4)
    assert [row[0] for row in first] == sorted(row[0] for row in first)
    # Mooncake's format: one id per 512-token block, the last possibly partial.
    assert all(len(ids) == -(-length // 512) and output >= 1 for _, length, output, ids in first)


def test_agentic_sessions_resend_their_growing_context_after_a_shared_system_prompt() -> None:
    rows = agentic_rows(seed=0)
    by_first_block: dict[int, int] = {}
    for _, _, _, ids in rows:
        by_first_block[ids[0]] = by_first_block.get(ids[0], 0) + 1
    assert len(by_first_block) <= 24  # every prompt starts with one of the tenants' system prompts
    assert max(by_first_block.values()) > 4 * min(by_first_block.values())  # popular tenants
    # Some prompt extends an earlier one: the next turn of its session.
    seen = {tuple(ids) for _, _, _, ids in rows}
    assert any(tuple(ids[:-3]) in seen for _, _, _, ids in rows if len(ids) > 30)
    assert max(length for _, length, _, _ in rows) > 30_000


def test_rag_prompts_share_hot_documents_in_retrieval_order() -> None:
    rows = rag_rows(seed=0)
    instructions = rows[0][3][:2]
    assert all(ids[:2] == instructions for _, _, _, ids in rows)
    third = [ids[2] for _, _, _, ids in rows]  # the first block of the most relevant document
    hottest = max(set(third), key=third.count)
    assert third.count(hottest) > len(rows) / 20


def test_bursty_has_batch_bursts_over_a_steady_background() -> None:
    rows = bursty_rows(seed=0)
    arrivals = [row[0] for row in rows]
    densest = max(sum(1 for t in arrivals if start <= t < start + 5000) for start in arrivals)
    assert densest >= 60  # a batch job: dozens of requests within seconds
    short = [row for row in rows if row[1] < 512 and row[2] < 200]
    assert len(short) > len(rows) / 5


def test_replay_runs_a_generated_workload_and_reports_inter_token_latency(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["replay", "--workload", "rag", "--limit", "60", "--workers", "2", "--routers", "latency,dynamo"]
    assert kv_router_main([*argv, "--out", str(out), "--quiet", "--no-plots", "--per-worker"]) == 0
    report = msgspec.json.decode((out / "report.json").read_bytes())
    assert report["settings"]["trace"] == "workload:rag"
    for result in report["results"]:
        assert result["completed"] == 60
        assert 0 < result["itl_ms"]["p50"] <= result["itl_ms"]["p90"]
        assert [worker["worker"] for worker in result["per_worker"]] == [0, 1]
        assert sum(worker["requests"] for worker in result["per_worker"]) == 60
    assert "## Per worker" in (out / "report.md").read_text()


def test_replay_wants_a_trace_or_a_workload(capsys: pytest.CaptureFixture[str]) -> None:
    assert kv_router_main(["replay", "--quiet"]) == 2
    assert "--workload" in capsys.readouterr().err


# ---------------------------------------------------------------------- the search
def result(ttft: float, e2e: float, hit: float, **knobs: float) -> TuneResult:
    return TuneResult("latency", knobs, hit, ttft, e2e, 10.0)


def test_the_front_keeps_what_nothing_beats_on_every_axis() -> None:
    a, b, c = result(100, 1000, 0.5), result(90, 1100, 0.5), result(80, 900, 0.6)
    dominated = result(100, 1000, 0.4)
    twin = result(80, 900, 0.6)
    front = pareto_front([a, b, c, dominated, twin])
    assert front == [c, twin]
    assert pareto_front([a, b]) == [a, b]
    assert pick([a, b], "ttft") is b and pick([a, b], "e2e") is a
    assert pick([result(100, 1000, 0.5), result(101, 1001, 0.9)], "hit").hit_rate == 0.9
    # A setting no request completed under (NaN latencies) measured nothing: NaN compares false, so
    # nothing beat it and it stood on the front.
    unmeasured = result(math.nan, math.nan, 0.0)
    assert pareto_front([a, unmeasured]) == [a]
    assert pareto_front([unmeasured]) == []


def test_candidates_are_seeded_and_start_with_the_defaults() -> None:
    first = candidates(5, seed=1)
    assert first == candidates(5, seed=1)
    defaults = RouterConfig()
    assert first[0] == {name: getattr(defaults, name) for name in SEARCH_SPACE}
    assert len({json.dumps(point, sort_keys=True) for point in first}) == 6


def test_tune_writes_the_front_and_a_config_serve_reads_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tune"
    argv = ["tune", "--workload", "agentic", "--limit", "80", "--workers", "2", "--budget", "2", "--jobs", "2"]
    argv += ["--out", str(out), "--quiet"]
    assert kv_router_main(argv) == 0
    table = capsys.readouterr().out
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "pareto.png").stat().st_size > 0
    assert "ref" in table and "dynamo" in table and "*" in table
    cache = out / "tune-results.jsonl"
    lines = cache.read_text().splitlines()
    assert len(lines) == 4  # dynamo, the defaults and two more settings

    settings = load_settings(config_file=out / "kv-router.toml")
    assert settings.router.policy == "latency"
    assert settings.router.block_size == 64
    chosen = [json.loads(line)["result"] for line in lines]
    # Every knob, the switch included (TOML's true / false), reads back as the setting chosen.
    assert {name: getattr(settings.router, name) for name in SEARCH_SPACE} in [entry["knobs"] for entry in chosen]

    # Interrupted after three results, with a line cut short: the rerun replays only what is missing.
    cache.write_text("\n".join(lines[:3]) + "\n" + lines[3][:20])
    assert kv_router_main(argv) == 0
    assert capsys.readouterr().out == table
    assert sorted(cache.read_text().splitlines()[:3]) == sorted(lines[:3])
    valid = []
    for line in cache.read_text().splitlines():
        with contextlib.suppress(ValueError):  # the line cut short stays cut short
            valid.append(json.loads(line)["key"])
    assert sorted(valid) == sorted(json.loads(line)["key"] for line in lines)


def test_a_cached_result_is_replayed_after_an_upgrade_of_the_code_or_of_a_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The key used to hold the searched knobs alone: a new version, or a new default of a setting not
    searched, reused the results measured before it, silently."""
    trace = build_trace(agentic_rows(seed=0)[:4], TraceOptions(), "workload:agentic")
    knobs = candidates(0, 0)[0]

    def key() -> str:
        return result_key("digest", trace, TuneSetup(), "latency", knobs)

    before = key()
    assert key() == before
    monkeypatch.setattr(tune, "package_version", lambda: "99.0")
    upgraded = key()
    assert upgraded != before
    monkeypatch.setattr(tune, "RouterConfig", lambda **settings: RouterConfig(**settings, latency_itl_stall_weight=0.5))
    assert key() not in {before, upgraded}


def test_a_written_config_reads_back_every_knob_switches_included(tmp_path: Path) -> None:
    """Each grid point's knobs, written as ``kv-router serve --config`` reads them, give that setting
    back (a switch as TOML's true / false, not Python's True)."""
    for knobs in ({name: values[-1] for name, values in SEARCH_SPACE.items()}, candidates(0, 0)[0]):
        path = tmp_path / "kv-router.toml"
        write_config(path, TuneResult("latency", knobs, 0.5, 100.0, 200.0, 10.0), EngineConfig(), "a note")
        settings = load_settings(config_file=path)
        assert {name: getattr(settings.router, name) for name in SEARCH_SPACE} == knobs
    assert SEARCH_SPACE["latency_decode_per_token"] == (False, True)


def test_tune_help_describes_its_workers_without_replay_s_online_mode() -> None:
    # tune has no --online: its --workers is the simulated fleet of each replay it runs.
    done = subprocess.run(
        [*kv_router_command(), "tune", "--help"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert done.returncode == 0
    assert "  --workers WORKERS     simulated workers in each replay of the search [8]\n" in done.stdout
    assert "online" not in done.stdout


# ---------------------------------------------------------------------- what tune refuses, and how it stops
TUNE = ["tune", "--workload", "agentic", "--workers", "2", "--quiet", "--no-plots"]


def write_trace(path: Path, rows: list[tuple[float, int, int, list[int]]]) -> bytes:
    lines = [json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": h}) for t, i, o, h in rows]
    path.write_text("\n".join(lines) + "\n")
    return path.read_bytes()


def test_a_trace_read_from_a_pipe_is_not_taken_for_another_read_from_a_pipe(tmp_path: Path) -> None:
    """The cache key hashed the trace file read again: a pipe (``<(cat trace.jsonl)``) is empty the
    second time, so every piped trace of a length had one key, and the second reused the first's results."""
    out = tmp_path / "out"
    tables = []
    for name, rows in (("agentic", agentic_rows(seed=0)[:20]), ("rag", rag_rows(seed=0)[:20])):
        piped = write_trace(tmp_path / f"{name}.jsonl", rows)
        done = subprocess.run(
            [*kv_router_command(), "tune", "/dev/stdin", "--workers", "2", "--budget", "0", "--jobs", "1",
             "--out", str(out), "--quiet", "--no-plots"],
            input=piped, capture_output=True, timeout=120, cwd=ROOT,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr.decode()
        tables.append(done.stdout)
    assert tables[0] != tables[1]
    assert len((out / "tune-results.jsonl").read_text().splitlines()) == 4  # dynamo and the defaults, twice


def test_tune_refuses_a_trace_no_worker_can_hold_and_warns_of_the_requests_none_can(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No request fitting a worker's KV pool, every setting measured NaN, each one stood on the front, and
    a config was written for one picked among them, exit 0."""
    out = tmp_path / "out"
    argv = [*TUNE, "--limit", "20", "--budget", "1", "--jobs", "1", "--out", str(out)]
    assert kv_router_main([*argv, "--num-gpu-blocks", "10"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "kv-router tune: every request is larger than a worker's KV pool (10 blocks of 64 tokens): no replay would "
        "complete one (--num-gpu-blocks)\n"
    )
    assert not out.exists()
    # One request too large (19,024 + 234 tokens, 301 blocks): said, as replay says it; the others tuned on.
    assert kv_router_main([*argv, "--num-gpu-blocks", "300"]) == 0
    err = capsys.readouterr().err
    assert "kv-router tune: warning: 1 request larger than a worker's KV pool (300 blocks of 64 tokens" in err
    assert (out / "kv-router.toml").exists()


def pool_processes(pid: int) -> list[int]:
    """The processes ``pid`` started (tune's: its pool)."""
    listed = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, timeout=10)
    return [int(child) for child in listed.stdout.split()]


def start_search(out: Path) -> tuple[subprocess.Popen[bytes], list[int]]:
    """A search of 22 replays over two processes, once its first result is cached: it and its pool."""
    argv = [*kv_router_command(), *TUNE, "--limit", "2000", "--budget", "20", "--jobs", "2", "--out", str(out)]
    with (out.parent / "tune.err").open("wb") as err:
        search = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL, cwd=ROOT)
    cache = out / "tune-results.jsonl"
    until(lambda: (cache.exists() and cache.stat().st_size > 0) or search.poll() is not None, 60, "a first result")
    assert search.poll() is None, "the search ended before its first result was seen"
    pool = pool_processes(search.pid)
    assert len(pool) == 2
    return search, pool


def end_all(search: subprocess.Popen[bytes], pool: list[int]) -> None:
    """After a failed test, nothing left behind (the old tune leaked its pool)."""
    if search.poll() is None:
        search.kill()
        search.wait(10)
    for pid in pool:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_the_search_at_once_keeping_the_results_and_ending_the_pool(
    tmp_path: Path, signum: signal.Signals
) -> None:
    """SIGTERM killed tune and left its pool processes running forever (re-parented, blocked on their
    pipe, each holding the trace); Ctrl-C waited for the whole queue, then ended in a traceback."""
    out = tmp_path / "out"
    search, pool = start_search(out)
    try:
        search.send_signal(signum)
        assert search.wait(30) == 128 + signum
        until(lambda: not any(running(pid) for pid in pool), 10, "the pool's end")
        cached = len((out / "tune-results.jsonl").read_text().splitlines())
        assert 1 <= cached < 22
        err = (tmp_path / "tune.err").read_text()
        assert err.splitlines()[-1] == (
            f"kv-router tune: interrupted: {cached}/22 results cached in {out}; rerun to continue"
        )
        assert "Traceback" not in err
    finally:
        end_all(search, pool)


def test_a_signal_before_the_replays_begin_ends_the_search_in_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM while the trace's digest was taken (the search's first step, longer with the trace) ended
    in a KeyboardInterrupt traceback and exit code 130, not the line and 143."""
    digest = tune.trace_digest

    def signalled(trace: Trace) -> str:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler tune installed raises at the next bytecode
        return digest(trace)

    monkeypatch.setattr(tune, "trace_digest", signalled)
    out = tmp_path / "out"
    assert kv_router_main([*TUNE, "--limit", "80", "--budget", "2", "--out", str(out)]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"kv-router tune: interrupted: no new result cached in {out}; rerun to continue"
    )
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handed back


def test_the_pool_dies_with_a_search_killed(tmp_path: Path) -> None:
    search, pool = start_search(tmp_path / "out")
    try:
        search.kill()
        search.wait(10)
        until(lambda: not any(running(pid) for pid in pool), 10, "the pool's end")
    finally:
        end_all(search, pool)


def test_a_failing_replay_stops_the_search_in_one_line_keeping_what_finished(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One candidate raising ran the whole queue left, then discarded those results in a traceback."""
    failing = candidates(4, seed=0)[1]
    replay = tune.replay_offline

    async def replay_or_fail(trace: Trace, setup: ReplaySetup, **options: Any) -> Any:
        config = setup.router_config
        if setup.routers == ("latency",) and all(getattr(config, name) == v for name, v in failing.items()):
            raise RuntimeError("simulated engine crash")
        return await replay(trace, setup, **options)

    monkeypatch.setattr(tune, "replay_offline", replay_or_fail)  # the pool's processes fork after it
    out = tmp_path / "out"
    argv = [*TUNE, "--limit", "200", "--budget", "4", "--jobs", "1", "--out", str(out)]
    assert kv_router_main(argv) == 2
    [line] = capsys.readouterr().err.splitlines()[1:]  # after the trace's line
    assert line.startswith("kv-router tune: the replay of latency (latency_miss_weight=")
    assert line.endswith("failed: RuntimeError: simulated engine crash")
    # One process, the points in order: dynamo and the defaults were done; the three after, never run.
    cache = out / "tune-results.jsonl"
    assert [json.loads(entry)["result"]["router"] for entry in cache.read_text().splitlines()] == ["dynamo", "latency"]
    assert not (out / "kv-router.toml").exists()
    monkeypatch.setattr(tune, "replay_offline", replay)
    assert kv_router_main(argv) == 0
    assert len(cache.read_text().splitlines()) == 6


def test_lines_of_the_cache_that_are_not_results_are_skipped_and_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """JSON that is not an object, or bytes that are not UTF-8, ended tune in a traceback."""
    out = tmp_path / "out"
    out.mkdir()
    cache = out / "tune-results.jsonl"
    cache.write_bytes(b'5\n[1,2]\n"str"\n\xff\xfe\n\n')
    assert kv_router_main([*TUNE, "--limit", "20", "--budget", "0", "--jobs", "1", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"kv-router tune: warning: {cache}: 4 lines not a tune result, skipped\n" in err
    assert len(cache.read_bytes().splitlines()) == 5 + 2


@pytest.mark.parametrize("name", ["tune-results.jsonl", "kv-router.toml", "pareto.png"])
def test_an_output_file_that_cannot_be_written_is_refused_before_the_search(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """A directory in the place of the config (or the plot) was found after the whole search, in a
    traceback; in the place of the cache, in a traceback before it."""
    out = tmp_path / "out"
    (out / name).mkdir(parents=True)
    argv = ["tune", "--workload", "agentic", "--workers", "2", "--quiet", "--limit", "20", "--budget", "0"]
    assert kv_router_main([*argv, "--jobs", "1", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"kv-router tune: {out / name}: a directory is in the way of the file written there\n"
    )
    assert sorted(path.name for path in out.iterdir()) == [name]  # nothing replayed


# ---------------------------------------------------------------------- the search's own processes
def small_trace() -> Trace:
    return build_trace(agentic_rows(seed=0)[:20], TraceOptions(), "workload:agentic")


def fail_for(monkeypatch: pytest.MonkeyPatch, knobs: dict[str, Any], failure: Callable[[], object]) -> None:
    """The replay of the `latency` candidate ``knobs`` calls ``failure`` (in the process replaying it:
    forked after this patch) instead of replaying."""
    replay = tune.replay_offline

    async def replay_or_fail(trace: Trace, setup: ReplaySetup, **options: Any) -> Any:
        config = setup.router_config
        if setup.routers == ("latency",) and all(getattr(config, name) == v for name, v in knobs.items()):
            failure()
        return await replay(trace, setup, **options)

    monkeypatch.setattr(tune, "replay_offline", replay_or_fail)


def test_one_job_per_core_counts_the_cores_this_process_may_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--jobs 0 started one process per core of the machine, not of the process's CPU affinity (a
    container's cpuset, taskset)."""
    alive: list[int] = []
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    setup = TuneSetup(workers=2, budget=2, jobs=0)
    # Four replays to do: one process per core of the machine would be four, all running at the first result.
    tune.run_tune(
        small_trace(),
        setup,
        tmp_path / "cache.jsonl",
        {},
        progress=lambda done, total: alive.append(len(multiprocessing.active_children())),
    )
    assert alive[1:] == [1, 1, 1, 1]


def test_a_replay_process_that_dies_stops_the_search_naming_its_candidate_leaving_no_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process of the pool dying (killed, out of memory, os._exit) broke the whole `ProcessPoolExecutor`:
    every pending replay failed with BrokenProcessPool, and the candidate named was any of them."""
    dying = candidates(3, seed=0)[2]
    fail_for(monkeypatch, dying, lambda: os._exit(3))
    seen: set[int] = set()

    def progress(done: int, total: int) -> None:
        seen.update(child.pid for child in multiprocessing.active_children() if child.pid is not None)

    started = time.monotonic()
    with pytest.raises(ReplayFailed) as failed:
        tune.run_tune(
            small_trace(), TuneSetup(workers=2, budget=3, jobs=2), tmp_path / "cache.jsonl", {}, progress=progress
        )
    assert time.monotonic() - started < 60
    assert str(failed.value) == str(ReplayFailed("latency", dying, RuntimeError("its process died (exit code 3)")))
    # Both processes were seen at a result, and both are gone: the one dead, the other ended mid-replay.
    assert len(seen) == 2
    assert multiprocessing.active_children() == []
    assert not any(running(pid) for pid in seen)
    # Dynamo and the defaults, replayed before the candidate that died, are kept.
    assert len((tmp_path / "cache.jsonl").read_text().splitlines()) >= 2


class TwoArguments(Exception):
    """Pickled with its message alone (its args), which its ``__init__`` does not take: it does not unpickle."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what}: {why}")


def local_error() -> Exception:
    class Local(Exception):  # pickled by its name, which does not find it
        pass

    return Local("simulated engine crash")


@pytest.mark.parametrize(
    ("error", "shown"),
    [
        (local_error(), "Local('simulated engine crash')"),
        (TwoArguments("engine", "crashed"), "TwoArguments('engine: crashed')"),
    ],
)
def test_an_exception_that_does_not_come_through_pickling_comes_back_as_its_repr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception, shown: str
) -> None:
    """One that does not pickle, or does not unpickle: the search still stops in `ReplayFailed`, naming it."""

    def fail() -> None:
        raise error

    fail_for(monkeypatch, candidates(0, seed=0)[0], fail)
    with pytest.raises(ReplayFailed) as failed:
        tune.run_tune(small_trace(), TuneSetup(workers=2, budget=0, jobs=1), tmp_path / "cache.jsonl", {})
    assert str(failed.value).endswith(f"failed: RuntimeError: {shown}")
    assert multiprocessing.active_children() == []


def test_ctrl_c_as_a_result_is_written_ends_every_process(tmp_path: Path) -> None:
    """Ctrl-C in the search's loop, not in the replays' generator: that is closed, and ends its processes."""

    def progress(done: int, total: int) -> None:
        if done == 1:
            raise KeyboardInterrupt

    with pytest.raises(SearchInterrupted) as interrupted:
        tune.run_tune(
            small_trace(), TuneSetup(workers=2, budget=3, jobs=2), tmp_path / "cache.jsonl", {}, progress=progress
        )
    assert (interrupted.value.done, interrupted.value.total) == (1, 5)
    assert multiprocessing.active_children() == []

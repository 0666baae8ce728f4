"""`kv-router replay --online` when the fleet fails under it: real `kv-router serve`, `kv-router mock-worker`
and `kv-router replay` processes on loopback, a worker, every worker or the router killed mid-run, the
replay interrupted. Each wait is bounded, each process stopped by its PID."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import pytest

from router.event_plane.embedded_server import EmbeddedNats
from tests.metrics import total
from tests.router_processes import RouterProcess, ToolProcess, kv_router_command
from tests.test_mocker_online import start_worker
from tests.waiting import until

WORKERS = 2


def write_trace(path: Path, *, requests: int, rate_per_s: float, output_tokens: int) -> Path:
    """A shared-prefix trace, every request long enough to be running on its worker for a while."""
    from mocker.workload import shared_prefix_rows

    rows = shared_prefix_rows(
        requests=requests, groups=4, prefix_tokens=1024, rate_per_s=rate_per_s, output_tokens=output_tokens, seed=5
    )
    path.write_bytes(
        b"".join(
            msgspec.json.encode({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": ids}) + b"\n"
            for t, n, o, ids in rows
        )
    )
    return path


@contextmanager
def live_fleet(tmp_path: Path) -> Iterator[tuple[EmbeddedNats, RouterProcess, list[ToolProcess]]]:
    """A nats-server, `kv-router serve` on it (workers 3 s silent are dropped: six heartbeats missed, never
    a busy machine's late one) and two mock workers."""
    with EmbeddedNats() as nats:
        router = RouterProcess(
            tmp_path, "--block-size", "64", "--nats-url", nats.url, "--worker-lease-secs", "3", "--log-level", "warning"
        ).start()
        workers = [start_worker(tmp_path, nats.url, 500 + i) for i in range(WORKERS)]
        try:
            until(lambda: len(router.get("/v1/workers")["workers"]) == WORKERS, 30, "both workers registered")
            yield nats, router, workers
        finally:
            for worker in workers:
                worker.stop()
            router.stop()


def start_replay(tmp_path: Path, trace: Path, nats: EmbeddedNats, router: RouterProcess, *flags: str) -> ToolProcess:
    return ToolProcess(
        tmp_path, None, command="replay",
        argv=[
            *kv_router_command(), "replay", str(trace), "--jitter-ms", "0", "--online", "--workers", str(WORKERS),
            "--url", f"http://127.0.0.1:{router.port}", "--nats-url", nats.url, "--quiet", "--no-plots",
            "--out", str(tmp_path / f"out-{time.monotonic_ns()}"), *flags,
        ],
    )  # fmt: skip


def routed(router: RouterProcess, count: int) -> bool:
    return total(router.metrics(), "kv_router_requests_total", method="new", outcome="ok") >= count


def ended_within(replay: ToolProcess, timeout_s: float) -> int:
    """The replay's exit status, once it has ended (within ``timeout_s``: else the test fails)."""
    try:
        return replay.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        replay.stop()
        raise AssertionError(f"the replay had not ended {timeout_s} s on: {replay.log()[-2000:]}") from None


def no_traceback(output: str) -> None:
    assert "Traceback" not in output and "never retrieved" not in output, output[-3000:]


def booked(router: RouterProcess) -> int:
    return sum(rank["active_requests"] for w in router.get("/v1/workers")["workers"] for rank in w["ranks"])


@pytest.mark.slow
def test_a_worker_killed_mid_run_ends_its_requests_unfinished_at_once_and_the_replay_says_so(tmp_path: Path) -> None:
    """Before: its requests waited out a fixed 300 s each, the run then exited 0 and only report.md
    showed them unfinished. Now the router dropping the worker ends them (the replay polls its worker
    list), the table has an unfinished column, a WARNING says how many, and the exit status is 3."""
    trace = write_trace(tmp_path / "trace.jsonl", requests=16, rate_per_s=8.0, output_tokens=3000)
    with live_fleet(tmp_path) as (nats, router, workers):
        replay = start_replay(tmp_path, trace, nats, router, "--request-timeout-secs", "120")
        until(lambda: routed(router, 4) or replay.ended(), 60, "the replay routed its first requests")
        workers[1].kill9()
        code = ended_within(replay, 60)
    output = replay.log()
    no_traceback(output)
    assert code == 3, output
    header = next(line for line in output.splitlines() if line.startswith("router "))
    assert header.split()[-1] == "unfin"
    warning = [line for line in output.splitlines() if "WARNING" in line]
    assert len(warning) == 1 and "requests unfinished" in warning[0] and warning[0].endswith("exit 3"), output


@pytest.mark.slow
def test_the_whole_fleet_gone_mid_run_is_one_error_not_router_rejections(tmp_path: Path) -> None:
    """Every worker stopped: the router answers 503 workers_unavailable, which the replay used to count
    as the router's rejections (and waited 300 s on each request the workers held). Now it is one line
    and exit 2."""
    trace = write_trace(tmp_path / "trace.jsonl", requests=24, rate_per_s=4.0, output_tokens=3000)
    with live_fleet(tmp_path) as (nats, router, workers):
        replay = start_replay(tmp_path, trace, nats, router)
        until(lambda: routed(router, 2) or replay.ended(), 60, "the replay routed its first requests")
        for worker in workers:
            worker.stop()
        code = ended_within(replay, 30)
        until(lambda: booked(router) == 0, 10, "the replay's bookings freed")
    output = replay.log()
    no_traceback(output)
    assert code == 2, output
    # workers_unavailable or no_eligible_worker, as the router tells a fleet with no worker to route to.
    assert output.splitlines()[-1].startswith(
        "kv-router replay: the router has no worker left to route to (POST /v1/new answered "
    ), output


@pytest.mark.slow
def test_the_router_killed_mid_run_ends_the_replay_at_once_in_one_line(tmp_path: Path) -> None:
    """Before: the replay noticed only once it had scheduled the whole trace (here 12 s), then printed a
    traceback per request ("Task exception was never retrieved")."""
    trace = write_trace(tmp_path / "trace.jsonl", requests=24, rate_per_s=2.0, output_tokens=3000)
    with live_fleet(tmp_path) as (nats, router, _):
        replay = start_replay(tmp_path, trace, nats, router)
        until(lambda: routed(router, 2) or replay.ended(), 60, "the replay routed its first requests")
        router.kill9()
        code = ended_within(replay, 20)  # its schedule: 12 s
    output = replay.log()
    no_traceback(output)
    assert code == 2, output
    assert output.splitlines()[-1].startswith(f"kv-router replay: the router at http://127.0.0.1:{router.port}: ")


@pytest.mark.slow
def test_ctrl_c_frees_the_bookings_and_a_capacity_run_right_after_waits_for_the_busy_workers(tmp_path: Path) -> None:
    """Before: a traceback, the requests left booked in the router until their expiry, and a capacity
    run started right after failed at once: "worker ... refused a prefix-cache reset: b'busy'"."""
    trace = write_trace(tmp_path / "trace.jsonl", requests=16, rate_per_s=8.0, output_tokens=3000)
    with live_fleet(tmp_path) as (nats, router, _):
        replay = start_replay(tmp_path, trace, nats, router)
        until(lambda: routed(router, 6) or replay.ended(), 60, "the replay routed its first requests")
        replay.process.send_signal(signal.SIGINT)
        code = ended_within(replay, 20)
        output = replay.log()
        no_traceback(output)
        assert code == 130 and output.splitlines()[-1] == "kv-router replay: interrupted", output
        assert booked(router) == 0  # marked free before it exited
        tiny = write_trace(tmp_path / "tiny.jsonl", requests=4, rate_per_s=8.0, output_tokens=16)
        capacity = start_replay(
            tmp_path, tiny, nats, router,
            "--capacity", "--slo-ttft-ms", "60000", "--slo-itl-ms", "1000", "--goodput-at", "1", "--max-runs", "2",
        )  # fmt: skip
        code = ended_within(capacity, 60)
    assert code == 0, capacity.log()

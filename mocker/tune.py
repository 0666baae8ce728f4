"""`kv-router tune TRACE`: search the `latency` policy's knobs on a user's own trace, in simulated time.

Every candidate setting (a seeded sample of `SEARCH_SPACE`, the defaults always among them) replays the
trace offline exactly as `kv-router replay` does, one candidate at a time per process over the cores. Each
result is appended to a JSONL cache as soon as it is known, keyed by everything that decides it (the
package's version, the trace's requests as loaded, the trace options, the engine, the fleet, the seed, the router's
whole effective config, the knobs and the defaults of every other setting), so an interrupted or
repeated run continues where it stopped and a wider search reuses what was measured. ``dynamo`` is
replayed too, as the yardstick. A replay that fails (or its process dies), or Ctrl-C, stops the search at
once (what has not started is never sent, the replays running are ended); the processes die with the search's.

What it reports: the Pareto front over (TTFT p90, E2E p90, engine hit rate), lower latencies and
higher hit rate being better, and one point of the front, the one a config is written for (`pick`):
``balanced`` minimizes ``TTFT p90 / best TTFT p90 + E2E p90 / best E2E p90 - hit / best hit`` over the
front; ``ttft``, ``e2e`` and ``hit`` take the front's best on that axis. The config is a TOML file that
``kv-router serve --config`` reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import pickle
import random
import signal
import sys
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Literal

import msgspec

from api.version import package_version
from mocker.config import EngineConfig
from mocker.replay import ReplaySetup, replay_offline
from mocker.trace import Trace
from router.config import RouterConfig
from router.event_plane.embedded_server import die_with_parent

__all__ = [
    "SEARCH_SPACE",
    "CachedResults",
    "Objective",
    "ReplayFailed",
    "SearchInterrupted",
    "TuneResult",
    "TuneSetup",
    "axes",
    "candidates",
    "pareto_front",
    "pick",
    "read_cache",
    "render_front",
    "result_key",
    "run_tune",
    "trace_digest",
    "usable_cores",
    "write_config",
]

# A knob's value: a weight, or a switch (`latency_decode_per_token`).
Knob = float | bool
# The knobs searched and the values tried for each (RouterConfig fields of the `latency` policy); the
# defaults (the best capacity setting in docs/routing-quality.md) are among them.
SEARCH_SPACE: dict[str, tuple[Knob, ...]] = {
    "latency_miss_weight": (2.0, 3.0, 4.0, 5.0, 6.0, 8.0),
    "latency_stall_weight": (0.0, 0.05, 0.2),
    "latency_decode_weight": (0.0, 0.0002, 0.0004, 0.0005, 0.001, 0.0012),
    "latency_hit_margin": (0.0, 0.05, 0.1),
    "latency_decode_others_weight": (0.0, 1.0),
    "latency_decode_per_token": (False, True),
    "latency_pass_base_tokens": (0.0, 1000.0, 2000.0, 3000.0),
}

POLICY = "latency"
REFERENCE = "dynamo"
Objective = Literal["balanced", "ttft", "e2e", "hit"]


@dataclass(frozen=True, slots=True)
class TuneSetup:
    """What the search replays: the engine and fleet, the seed, the sample size and the parallelism."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    workers: int = 8
    seed: int = 0
    budget: int = 24  # candidate settings besides the defaults
    jobs: int = 0  # processes; 0: one per core this process may run on (`usable_cores`)


@dataclass(frozen=True, slots=True)
class TuneResult:
    """One replayed setting: the router (``latency`` or the reference), its knobs, what it measured."""

    router: str
    knobs: dict[str, Knob]
    hit_rate: float
    ttft_p90_ms: float
    e2e_p90_ms: float
    itl_p90_ms: float


def candidates(budget: int, seed: int) -> list[dict[str, Knob]]:
    """The defaults, then ``budget`` other grid points drawn without replacement (seeded)."""
    defaults = RouterConfig()
    default: dict[str, Knob] = {name: getattr(defaults, name) for name in SEARCH_SPACE}
    grid = [dict(zip(SEARCH_SPACE, values, strict=True)) for values in itertools.product(*SEARCH_SPACE.values())]
    others = [point for point in grid if point != default]
    random.Random(seed).shuffle(others)
    return [default, *others[:budget]]


def pareto_front(results: Iterable[TuneResult]) -> list[TuneResult]:
    """The results no other one beats on every axis (TTFT p90 and E2E p90 lower, hit rate higher),
    by E2E p90. A result without latencies (no request completed: NaN) measured nothing and is left out
    (NaN compares false, so nothing would beat it)."""
    pool = [r for r in results if not (math.isnan(r.ttft_p90_ms) or math.isnan(r.e2e_p90_ms))]

    def dominated(a: TuneResult) -> bool:
        return any(
            b.ttft_p90_ms <= a.ttft_p90_ms
            and b.e2e_p90_ms <= a.e2e_p90_ms
            and b.hit_rate >= a.hit_rate
            and (b.ttft_p90_ms, b.e2e_p90_ms, -b.hit_rate) != (a.ttft_p90_ms, a.e2e_p90_ms, -a.hit_rate)
            for b in pool
        )

    return sorted((a for a in pool if not dominated(a)), key=lambda r: (r.e2e_p90_ms, r.ttft_p90_ms))


def pick(front: Sequence[TuneResult], objective: Objective = "balanced") -> TuneResult:
    """The point of the front a config is written for (see the module doc)."""
    if not front:
        raise ValueError("an empty front has no pick")
    if objective == "ttft":
        return min(front, key=lambda r: (r.ttft_p90_ms, r.e2e_p90_ms))
    if objective == "e2e":
        return min(front, key=lambda r: (r.e2e_p90_ms, r.ttft_p90_ms))
    if objective == "hit":
        return max(front, key=lambda r: (r.hit_rate, -r.e2e_p90_ms))
    best_ttft = min(r.ttft_p90_ms for r in front) or 1.0
    best_e2e = min(r.e2e_p90_ms for r in front) or 1.0
    best_hit = max(r.hit_rate for r in front) or 1.0
    return min(front, key=lambda r: r.ttft_p90_ms / best_ttft + r.e2e_p90_ms / best_e2e - r.hit_rate / best_hit)


# ---------------------------------------------------------------------- running
class ReplayFailed(Exception):
    """One candidate's replay raised, or its process died: the search stopped there (the results before it
    are cached)."""

    def __init__(self, router: str, knobs: Mapping[str, Knob], error: BaseException) -> None:
        shown = ", ".join(f"{name}={_toml(value)}" for name, value in knobs.items()) or "its defaults"
        super().__init__(f"the replay of {router} ({shown}) failed: {type(error).__name__}: {error}")


class SearchInterrupted(Exception):
    """Ctrl-C during the search: ``done`` of the ``total`` results are in the cache."""

    def __init__(self, done: int, total: int) -> None:
        super().__init__(f"{done}/{total} results cached")
        self.done = done
        self.total = total


@dataclass(frozen=True, slots=True)
class CachedResults:
    """What a results cache holds: the results by key, and how many lines were not results (cut short
    by a killed run, or not written by tune): those are skipped, their points replayed."""

    results: dict[str, TuneResult]
    skipped: int


_trace: Trace | None = None


def _start_worker(trace: Trace, search_pid: int) -> None:
    """A replay process's start: it keeps the trace, dies with the search's process (even one killed,
    which never ends its processes: blocked on its pipe, the process would live on), leaves Ctrl-C
    to the search (which ends it) and dies at SIGTERM rather than run a handler it inherited."""
    global _trace
    _trace = trace
    die_with_parent(search_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _replay_setup(setup: TuneSetup, router: str, knobs: Mapping[str, Knob]) -> ReplaySetup:
    """The replay of one candidate: ``router`` with ``knobs`` over the defaults."""
    config = msgspec.structs.replace(RouterConfig(block_size=setup.engine.block_size), **knobs)
    return ReplaySetup(
        engine=setup.engine, workers=setup.workers, routers=(router,), router_config=config, seed=setup.seed
    )


def _replay_one(router: str, knobs: dict[str, Knob], setup: TuneSetup) -> TuneResult:
    assert _trace is not None, "_start_worker keeps the trace"
    [run] = asyncio.run(replay_offline(_trace, _replay_setup(setup, router, knobs), show_progress=False))
    report = run.report
    return TuneResult(router, knobs, report.hit_rate_tokens, report.ttft_ms.p90, report.e2e_ms.p90, report.itl_ms.p90)


def result_key(trace_digest: str, trace: Trace, setup: TuneSetup, router: str, knobs: Mapping[str, Knob]) -> str:
    """Everything that decides a result, hashed: the cache key. The package's version and the router's
    whole effective config, so that an upgrade (new code, new defaults) replays rather than reuses."""
    identity = {
        "version": package_version(),
        "router_config": msgspec.to_builtins(_replay_setup(setup, router, knobs).effective_router_config()),
        "trace": trace_digest,
        "options": msgspec.to_builtins(trace.options),
        "requests": len(trace),
        "engine": msgspec.to_builtins(setup.engine),
        "workers": setup.workers,
        "seed": setup.seed,
        "router": router,
        "knobs": dict(sorted(knobs.items())),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def read_cache(path: Path) -> CachedResults:
    """The results cached at ``path`` (none when there is no file yet); `ValueError` (one line) when the
    file cannot be read."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return CachedResults({}, 0)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the results cache: {exc.strerror or exc}") from None
    results: dict[str, TuneResult] = {}
    skipped = 0
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            entry = json.loads(line)  # bytes that are not UTF-8: UnicodeDecodeError, a ValueError
            results[entry["key"]] = msgspec.convert(entry["result"], TuneResult)
        except (ValueError, KeyError, TypeError, msgspec.ValidationError):
            skipped += 1
    return CachedResults(results, skipped)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or taskset's), not the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def run_tune(
    trace: Trace,
    setup: TuneSetup,
    cache: Path,
    cached: Mapping[str, TuneResult],
    *,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[TuneResult], TuneResult]:
    """Replay every candidate not among ``cached`` (read from ``cache``: `read_cache`) in parallel and
    append each result to ``cache`` as it comes. Returns the `latency` results and the reference's.
    A replay that raises, or whose process dies, stops the search (`ReplayFailed`), so does Ctrl-C
    (`SearchInterrupted`)."""
    digest = trace_digest(trace)
    points: list[tuple[str, dict[str, Knob]]] = [(REFERENCE, {})]
    points += [(POLICY, knobs) for knobs in candidates(setup.budget, setup.seed)]
    keys = [result_key(digest, trace, setup, router, knobs) for router, knobs in points]
    found = dict(cached)
    todo = [(key, router, knobs) for key, (router, knobs) in zip(keys, points, strict=True) if key not in found]
    done = len(points) - len(todo)
    if progress is not None:
        progress(done, len(points))
    if todo:
        cache.parent.mkdir(parents=True, exist_ok=True)
        jobs = min(setup.jobs or usable_cores(), len(todo))
        try:
            # Closed, the generator ends its processes even when this loop's body raises (Ctrl-C mid-write).
            with cache.open("a+") as sink, contextlib.closing(_replayed(trace, setup, todo, jobs)) as replayed:
                sink.seek(0, os.SEEK_END)
                if sink.tell():
                    sink.seek(sink.tell() - 1)
                    if sink.read(1) != "\n":
                        sink.write("\n")  # after a line an interrupted run cut short
                for key, result in replayed:
                    found[key] = result
                    sink.write(json.dumps({"key": key, "result": msgspec.to_builtins(result)}) + "\n")
                    sink.flush()
                    done += 1
                    if progress is not None:
                        progress(done, len(points))
        except KeyboardInterrupt:  # counted in the file: it may have come mid-line
            kept = read_cache(cache).results
            raise SearchInterrupted(sum(key in kept for key in keys), len(points)) from None
    results = [found[key] for key in keys]
    return results[1:], results[0]


def _pool_context() -> multiprocessing.context.DefaultContext | multiprocessing.context.ForkContext:
    """On Linux, fork, so that a replay process's parent is the search's process (`die_with_parent` checks
    it; a forkserver's would be another); elsewhere, the platform's default."""
    return multiprocessing.get_context("fork") if sys.platform == "linux" else multiprocessing.get_context()


def _replayed(
    trace: Trace, setup: TuneSetup, todo: Sequence[tuple[str, str, dict[str, Knob]]], jobs: int
) -> Generator[tuple[str, TuneResult], None, None]:
    """Replay each (key, router, knobs) of ``todo`` over ``jobs`` processes, yielding each key and result as
    it comes; a replay that raises, or a process that dies (killed, out of memory), raises `ReplayFailed`
    for the candidate it was running. The processes are this generator's own, not a `ProcessPoolExecutor`'s,
    whose running replays a stopped search could end only through its private state (no public handle
    before Python 3.14). Each is sent one candidate at a time over a pipe of its own (`_serve`); a
    busy process whose pipe closes or whose sentinel is ready died. However it ends (done, an exception,
    Ctrl-C, closed), every process is killed (a running replay is not waited for) and reaped."""
    context = _pool_context()
    tasks = iter(todo)
    started: list[tuple[BaseProcess, Connection[Any, Any]]] = []
    running: dict[Connection[Any, Any], tuple[BaseProcess, str, str, dict[str, Knob]]] = {}

    def send_next(process: BaseProcess, conn: Connection[Any, Any]) -> None:
        task = next(tasks, None)
        if task is not None:
            running[conn] = (process, *task)
        # A process dead already (EPIPE): with a task, its sentinel tells next; with None, it was done.
        with contextlib.suppress(OSError):
            conn.send(None if task is None else (task[1], task[2], setup))

    try:
        for _ in range(jobs):
            ours, theirs = context.Pipe()
            process: BaseProcess = context.Process(target=_serve, args=(theirs, trace, os.getpid()))
            process.start()
            started.append((process, ours))
            theirs.close()  # the process's end is its alone: its death closes the pipe
            send_next(process, ours)
        while running:
            ready = wait([*running, *(process.sentinel for process, *_ in running.values())])
            for conn, (process, key, router, knobs) in list(running.items()):
                if conn in ready or process.sentinel in ready:
                    del running[conn]
                    outcome = _outcome(process, conn)
                    if isinstance(outcome, Exception):
                        raise ReplayFailed(router, knobs, outcome) from outcome
                    yield key, outcome
                    send_next(process, conn)
    finally:
        for process, _ in started:
            process.kill()  # not terminate: one just forked still has the search's SIGTERM handler
        for process, conn in started:
            process.join()
            process.close()
            conn.close()


def _serve(conn: Connection[Any, Any], trace: Trace, search_pid: int) -> None:
    """A replay process: `_start_worker`, then each (router, knobs, setup) received replayed and its result,
    or the exception it raised, sent back, until None. An exception that would not come through pickling
    both ways (an attribute that does not pickle, an ``__init__`` its args do not fit) goes back as a
    RuntimeError with its repr."""
    _start_worker(trace, search_pid)
    while (task := conn.recv()) is not None:
        outcome: TuneResult | Exception
        try:
            outcome = _replay_one(*task)
        except Exception as exc:
            outcome = exc
            try:
                pickle.loads(pickle.dumps(exc))
            except Exception:
                outcome = RuntimeError(repr(exc))
        conn.send(outcome)


def _outcome(process: BaseProcess, conn: Connection[Any, Any]) -> TuneResult | Exception:
    """What a busy process sent back, or, when it died with nothing sent, its death as an exception."""
    try:
        sent: TuneResult | Exception = conn.recv()  # at once: the process sent, or died and closed its end
        return sent
    except (EOFError, OSError):  # OSError: ECONNRESET, a task it never read in its pipe
        process.join()
    code = process.exitcode
    if code is not None and code < 0:
        return RuntimeError(f"its process was killed by signal {-code} ({signal.strsignal(-code)})")
    return RuntimeError(f"its process died (exit code {code})")


# ---------------------------------------------------------------------- output
def axes(result: TuneResult) -> tuple[float, float, float]:
    """(TTFT p90, E2E p90, hit rate): a result as a point of the plot."""
    return result.ttft_p90_ms, result.e2e_p90_ms, result.hit_rate


def render_front(front: Sequence[TuneResult], chosen: TuneResult, reference: TuneResult) -> str:
    """The front as a table, the pick marked, the reference last."""
    names = [name.removeprefix("latency_") for name in SEARCH_SPACE]
    header = ["", *names, "hit", "TTFT p90 ms", "E2E p90 ms", "ITL p90 ms"]
    rows = [header]
    for result in [*front, reference]:
        mark = "*" if result is chosen else ("ref" if result is reference else "")
        knobs = [_shown(result.knobs[name]) if name in result.knobs else result.router for name in SEARCH_SPACE]
        rows.append(
            [
                mark,
                *knobs,
                f"{result.hit_rate:.3f}",
                f"{result.ttft_p90_ms:.0f}",
                f"{result.e2e_p90_ms:.0f}",
                f"{result.itl_p90_ms:.1f}",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def write_config(path: Path, chosen: TuneResult, engine: EngineConfig, note: str) -> None:
    """The TOML file `kv-router serve --config` reads: the policy, its knobs, the engines' block size."""
    lines = [f"# {line}" for line in note.splitlines()]
    lines += [f'policy = "{POLICY}"', f"block_size = {engine.block_size}"]
    lines += [f"{name} = {_toml(value)}" for name, value in chosen.knobs.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def _shown(value: Knob) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else f"{value:g}"


def _toml(value: Knob) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else repr(value)


def trace_digest(trace: Trace) -> str:
    """The trace's identity for the cache: its requests as loaded, what every replay sees. Never the
    file read again: a pipe (``<(cat trace.jsonl)``) is empty the second time."""
    return hashlib.sha256(msgspec.msgpack.encode(trace.requests)).hexdigest()

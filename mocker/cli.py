"""The ``kv-router replay``, ``kv-router tune``, ``kv-router mock-worker`` and ``kv-router demo`` commands.

The ``kv-router`` CLI finds them through the ``kv_router.commands`` entry points (pyproject.toml), so
the service never imports the simulator; ``python -m mocker.cli`` offers the same commands on
their own. What a command needs is imported when it runs, so that ``kv-router --help`` stays fast.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from mocker.config import EngineConfig
from mocker.trace import Trace, TraceError, TraceOptions, build_trace, load_trace
from mocker.workload import WORKLOADS
from router.config import RouterConfig
from router.errors import ConfigError

if TYPE_CHECKING:
    from mocker.capacity import CapacitySearch, Slo
    from mocker.replay import ReplayRun, ReplaySetup
    from router.event_plane.first_connection import LocalToolConnection

__all__ = ["DEMO", "MOCK_WORKER", "REPLAY", "TUNE", "SimulatorCommand", "main"]

_ENGINE_DEFAULTS = EngineConfig()
# `kv-router replay --online`: the run completed and reported, but some requests never finished.
EXIT_UNFINISHED = 3
# The online replay's send lateness (trace time) it warns of, at the least (`_warn_late`).
LATE_WARNING_MS = 10.0


@dataclass(frozen=True, slots=True)
class SimulatorCommand:
    """One ``kv-router`` subcommand, found by the CLI through the ``kv_router.commands`` entry points."""

    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    body: Callable[[argparse.Namespace], int]
    description: str | None = None

    def run(self, args: argparse.Namespace) -> int:
        try:
            return self.body(args)
        except ModuleNotFoundError as exc:  # the optional dependency (matplotlib) is absent
            print(f"kv-router {args.command}: needs {exc.name}: pip install 'kv-router[replay]'", file=sys.stderr)
            return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mocker.cli", description="Mock workers and trace replay.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in _COMMANDS.items():
        command.configure(commands.add_parser(name, help=command.help, description=command.description))
    args = parser.parse_args(argv)
    return _COMMANDS[args.command].run(args)


# ---------------------------------------------------------------------- shared flags
def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("simulated engine (defaults: Dynamo's mocker)")
    d = _ENGINE_DEFAULTS
    group.add_argument(
        "--num-gpu-blocks", type=int, default=d.num_gpu_blocks, help="KV blocks per worker [%(default)s]"
    )
    group.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block [%(default)s]")
    group.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="running sequences [%(default)s]")
    group.add_argument(
        "--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens, help="tokens per pass [%(default)s]"
    )
    group.add_argument(
        "--engine-speedup", type=float, default=d.speedup_ratio, help="passes run this much faster [%(default)s]"
    )
    group.add_argument(
        "--prefill-form",
        choices=["attention", "dynamo"],
        default=d.timing.prefill_form,
        help="prefill timing: ours (attends cached context) or Dynamo 1.6.1's [%(default)s]",
    )


# Each engine setting's flag, for the one line a bad value gets.
_ENGINE_FLAGS = {
    "num_gpu_blocks": "--num-gpu-blocks",
    "block_size": "--block-size",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "speedup_ratio": "--engine-speedup",
    "timing.prefill_form": "--prefill-form",
}


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine the flags describe, validated (its bounds: a positive count of blocks, sequences and
    tokens, a positive speedup); a bad value exits with one line naming its flag, code 2."""
    fields: dict[str, Any] = {
        "num_gpu_blocks": args.num_gpu_blocks,
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "speedup_ratio": args.engine_speedup,
        "timing": {"prefill_form": args.prefill_form},
    }
    try:
        # convert, not the constructor: a Struct's constructor checks no constraint.
        return msgspec.convert(fields, EngineConfig)
    except msgspec.ValidationError as exc:
        reason, _, where = str(exc).partition(" - at `$.")
        path = where.rstrip("`")
        value: Any = fields
        for key in path.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        flag = _ENGINE_FLAGS.get(path, path)
        print(
            f"kv-router {getattr(args, 'command', 'engine')}: {flag} {value}: {reason[:1].lower()}{reason[1:]}",
            file=sys.stderr,
        )
        raise SystemExit(2) from None


def _router_config(options: list[str], engine: EngineConfig) -> tuple[RouterConfig, frozenset[str]]:
    """``KEY=VALUE`` router settings (values parsed as JSON when they are JSON) over the defaults, and the
    names of the settings given; the block size follows the engines' unless set. `ValueError` (one line)
    for an option without ``=``, a key that is no setting (naming the one likely meant, else them all) or a
    value the setting refuses."""
    from api.config import _plain, closest_name

    settings = RouterConfig.__struct_fields__
    fields: dict[str, Any] = {"block_size": engine.block_size}
    given: set[str] = set()
    for option in options:
        key, sep, value = option.partition("=")
        name = key.strip().replace("-", "_")
        if not sep:
            raise ValueError(f"--router-option takes KEY=VALUE, got {option!r}")
        if name not in settings:
            close = closest_name(name, settings)
            known = f"did you mean {close}?" if close else f"the settings: {', '.join(settings)}"
            raise ValueError(f"--router-option {option}: {key.strip()!r} is not a router setting; {known}")
        try:
            fields[name] = msgspec.json.decode(value)
        except msgspec.DecodeError:
            fields[name] = value
        given.add(name)
    try:
        return msgspec.convert(fields, RouterConfig, strict=False), frozenset(given)
    except msgspec.ValidationError as exc:
        raise ValueError(f"--router-option {_plain(str(exc), fields)}") from None
    except ConfigError as exc:
        raise ValueError(f"--router-option {exc}") from None


def _add_transfer_flags(group: argparse._ActionsContainer) -> None:
    group.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=131_072,
        help="KV bytes per token moved from prefill to decode worker [%(default)s: Llama-3-8B, bf16]",
    )
    group.add_argument(
        "--transfer-gb-per-s", type=float, default=25.0, help="KV transfer bandwidth, GB/s [%(default)s]"
    )


def _add_trace_flags(parser: argparse.ArgumentParser, workers_help: str) -> None:
    """The trace (or generated workload), the options it is loaded with, and the fleet's size."""
    parser.add_argument("trace", type=Path, nargs="?", help="Mooncake JSONL trace (or --workload)")
    parser.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default=None,
        help="replay a generated workload instead of a trace, seeded by --seed (see mocker/workload.py)",
    )
    parser.add_argument("--workers", type=_int_at_least(1), default=8, help=workers_help)
    trace = parser.add_argument_group("trace")
    trace.add_argument(
        "--speedup", type=_positive_float, default=1.0, help="divide arrival times by this [%(default)s]"
    )
    trace.add_argument("--limit", type=int, default=None, help="only the first N requests")
    trace.add_argument("--max-input-length", type=int, default=None, help="longest prompt replayed")
    trace.add_argument(
        "--length-policy", choices=["clip", "drop"], default="clip", help="longer prompts: clip or drop [%(default)s]"
    )
    trace.add_argument(
        "--jitter-ms",
        type=_non_negative_float,
        default=None,
        help="spread arrivals uniformly over this many ms [default: the trace's timestamp quantum when its timestamps "
        "are quantised (some shared, none closer than 100 ms: the real Mooncake traces', ~3 s), else 0]",
    )
    trace.add_argument("--trace-block-size", type=int, default=512, help="tokens per hash id [%(default)s]")
    trace.add_argument("--seed", type=int, default=0, help="seeds jitter, routers and generated tokens [%(default)s]")


def _finite_float(bound: str, accepts: Callable[[float], bool]) -> Callable[[str], float]:
    """An argparse type: a finite number within ``bound`` (NaN or infinity in a time or a multiplier
    hangs a replay or fills its report with NaNs), else argparse's one-line usage error, code 2."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (math.isfinite(value) and accepts(value)):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    return parse


_positive_float = _finite_float("> 0", lambda value: value > 0)
_non_negative_float = _finite_float(">= 0", lambda value: value >= 0)
_fraction = _finite_float("in (0, 1)", lambda value: 0 < value < 1)


def _int_at_least(least: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``least``, else argparse's one-line usage error, code 2."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {text}")
        return value

    return parse


def _multipliers(text: str) -> tuple[float, ...]:
    """Comma-separated multipliers, each a finite number > 0; at least one."""
    given = tuple(_positive_float(m) for m in text.split(",") if m)
    if not given:
        raise argparse.ArgumentTypeError(f"no multiplier given: {text!r}")
    return given


def _router_names(text: str) -> str:
    """``--routers``: comma-separated names, at least one (``all`` is one)."""
    if not any(name.strip() for name in text.split(",")):
        raise argparse.ArgumentTypeError(f"no router named: {text!r}")
    return text


def _output_directory(path: Path, flag: str = "--out") -> None:
    """Make the report directory now, or say why not (`ValueError`): found unusable only at the end,
    the whole run's figures were lost in a traceback."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path}: not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot make the directory: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: cannot write there")


def _output_file(path: Path) -> None:
    """Say now (`ValueError`) why a file of the report could not be written at the end."""
    if path.is_dir():
        raise ValueError(f"{path}: a directory is in the way of the file written there")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{path}: cannot write there")


def _trace_options(args: argparse.Namespace) -> TraceOptions:
    return TraceOptions(
        speedup=args.speedup,
        limit=args.limit,
        max_input_length=args.max_input_length,
        length_policy=args.length_policy,
        jitter_ms=args.jitter_ms,
        seed=args.seed,
        trace_block_size=args.trace_block_size,
    )


# ---------------------------------------------------------------------- replay
def _add_replay(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Replay a Mooncake-format trace (JSONL: timestamp ms, input_length, output_length, hash_ids). Offline "
        "(default): every router drives its own simulated fleet in simulated time. Online (--online): the trace "
        "goes to a running kv-router over HTTP and to kv-router mock-worker processes over NATS, in real time."
    )
    _add_trace_flags(parser, "simulated workers (online: workers to wait for) [%(default)s]")
    parser.add_argument(
        "--routers",
        type=_router_names,
        default="all",
        help="comma-separated routers: our registered policies (dynamo, round_robin, random, least_loaded, ...), "
        "the peer emulations sglang and llmd, or module:factory [all: every registered policy, sglang and llmd]",
    )
    _add_engine_flags(parser)
    sim = parser.add_argument_group("offline simulation and routers")
    sim.add_argument(
        "--event-delay-ms",
        type=_non_negative_float,
        default=0.0,
        help="KV events reach the router this late [%(default)s]",
    )
    sim.add_argument(
        "--router-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a RouterConfig setting for our policies, e.g. prefill_load_scale=2 (repeatable)",
    )
    pd = parser.add_argument_group(
        "disaggregated fleet (offline): routers aggregated (our policy on N + M workers that prefill and decode), "
        "disagg-always, disagg-conditional, disagg-load-aware, disagg-estimated, vllm-router-pd, sglang-pd "
        "[all of them by default]"
    )
    pd.add_argument(
        "--prefill-workers", type=int, default=0, help="prefill-only workers (with --decode-workers or --both-workers)"
    )
    pd.add_argument(
        "--decode-workers", type=int, default=0, help="decode-only workers (with --prefill-workers or --both-workers)"
    )
    pd.add_argument(
        "--both-workers",
        type=int,
        default=0,
        help="workers that serve either leg, beside the prefill and decode ones, or alone with --router-option "
        "disagg_among_both_workers=true (our routers only) [%(default)s]",
    )
    _add_transfer_flags(pd)
    online = parser.add_argument_group("online replay")
    online.add_argument("--online", action="store_true", help="replay against a running router and mock workers")
    online.add_argument("--url", default="http://127.0.0.1:8000", help="the router's base URL [%(default)s]")
    _add_nats_flags(online, "where the mock workers are")
    online.add_argument("--namespace", default="default", help="NATS namespace of the workers [%(default)s]")
    online.add_argument(
        "--time-scale",
        type=_positive_float,
        default=1.0,
        help="run this many times faster than the trace and scale times back; start the workers with "
        "--engine-speedup equal to it [%(default)s]",
    )
    online.add_argument(
        "--request-timeout-secs",
        type=_positive_float,
        default=300.0,
        help="a request whose worker sends nothing this long (wall clock) ends unfinished [%(default)s]",
    )
    online.add_argument("--label", default="online", help="the router's name in the report [%(default)s]")
    _add_capacity_flags(parser)
    output = parser.add_argument_group("output")
    output.add_argument("--out", type=Path, default=Path("replay-report"), help="report directory [%(default)s]")
    output.add_argument(
        "--window-s", type=_positive_float, default=60.0, help="window of the per-window figures, s [%(default)s]"
    )
    output.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    output.add_argument("--per-request", action="store_true", help="also write one JSONL record per request")
    output.add_argument("--per-worker", action="store_true", help="also print every worker's latencies")
    output.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_capacity_flags(parser: argparse.ArgumentParser) -> None:
    capacity = parser.add_argument_group(
        "capacity (--capacity)",
        "Per router, the highest arrival-rate multiplier (times --speedup) at which the fleet meets the SLO, by "
        "bisection; the SLO is derived from every router's run at --light-load unless --slo-ttft-ms and "
        "--slo-itl-ms give it. Online: the one router behind --url, with a coarser, shorter search.",
    )
    capacity.add_argument("--capacity", action="store_true", help="measure capacity at an SLO instead of one replay")
    capacity.add_argument(
        "--slo-ttft-ms", type=_positive_float, default=None, help="TTFT p90 bound [3x the best at light load]"
    )
    capacity.add_argument(
        "--slo-itl-ms", type=_positive_float, default=None, help="ITL p90 bound [1.5x the best at light load]"
    )
    capacity.add_argument("--slo-e2e-ms", type=_positive_float, default=None, help="E2E p90 bound [none]")
    capacity.add_argument(
        "--slo-e2e-factor",
        type=_positive_float,
        default=None,
        help="derive an E2E p90 bound: this times the best [none]",
    )
    capacity.add_argument(
        "--light-load", type=_positive_float, default=0.25, help="multiplier of the SLO-deriving runs [%(default)s]"
    )
    capacity.add_argument(
        "--slo-from",
        default=None,
        metavar="ROUTER",
        help="derive both SLO bounds from this router's light run alone [each from the best router]",
    )
    capacity.add_argument(
        "--capacity-tolerance",
        type=_fraction,
        default=None,
        help="stop bisecting when hi/lo <= 1 + this [0.05 offline, 0.25 online]",
    )
    capacity.add_argument(
        "--goodput-at",
        type=_multipliers,
        default=None,
        help="comma-separated multipliers to report goodput at [0.5,1,2 offline; 1 online]",
    )
    capacity.add_argument(
        "--max-runs",
        type=_int_at_least(2),
        default=None,
        help="runs per router at most, the light run and the --goodput-at points included: the search stops "
        "early enough to leave room for them [24 offline, 5 online]",
    )


def _capacity_plan(args: argparse.Namespace) -> tuple[CapacitySearch, Slo | None]:
    """The search and the SLO given (None: derived) the capacity flags describe; `ValueError` (one line)
    for flags that contradict one another, so that they are refused before the trace loads. Each flag's
    own bounds are its argparse type's."""
    from mocker.capacity import CapacitySearch, Slo

    online = args.online
    default_goodput = (1.0,) if online else (0.5, 1.0, 2.0)
    search = CapacitySearch(
        tolerance=args.capacity_tolerance if args.capacity_tolerance is not None else (0.25 if online else 0.05),
        light_multiplier=args.light_load,
        goodput_multipliers=args.goodput_at if args.goodput_at is not None else default_goodput,
        max_points=args.max_runs if args.max_runs is not None else (5 if online else 24),
        slo_from=args.slo_from,
    )
    slo = None
    if args.slo_ttft_ms is None and args.slo_itl_ms is None:
        if args.slo_e2e_ms is not None:
            raise ValueError("--slo-e2e-ms needs --slo-ttft-ms and --slo-itl-ms")
    elif args.slo_ttft_ms is None or args.slo_itl_ms is None:
        raise ValueError("give both --slo-ttft-ms and --slo-itl-ms, or neither (derived)")
    elif args.slo_from is not None:
        raise ValueError("--slo-from derives the SLO that --slo-ttft-ms and --slo-itl-ms give")
    else:
        slo = Slo(args.slo_ttft_ms, args.slo_itl_ms, args.slo_e2e_ms)
    needed = search.fixed_runs(derive=slo is None)
    if needed > search.max_points:
        light = "the light run and " if slo is None else ""
        raise ValueError(
            f"--max-runs {search.max_points} is less than the {needed} runs {light}the goodput points (--goodput-at) "
            "take"
        )
    return search, slo


def _run_capacity(
    args: argparse.Namespace,
    trace: Trace,
    setup: ReplaySetup,
    settings: dict[str, Any],
    plan: tuple[CapacitySearch, Slo | None],
) -> int:
    import asyncio

    from mocker.capacity import (
        measure_capacity,
        offline_evaluator,
        online_evaluator,
        render_capacity_table,
        write_capacity_report,
    )
    from mocker.plots import MATPLOTLIB_MISSING, write_capacity_plot

    search, slo = plan
    if args.online:
        settings.update(mode="online", url=args.url, time_scale=args.time_scale)
        evaluate = online_evaluator(
            trace,
            router_url=args.url,
            nats=_nats_connection(args, "kv-router replay", "kv-router-replay"),
            namespace=args.namespace,
            workers=args.workers,
            time_scale=args.time_scale,
            window_s=args.window_s,
            timeout_s=args.request_timeout_secs,
        )
        routers = [args.label]
    else:
        settings["mode"] = "offline"
        evaluate = offline_evaluator(trace, setup)
        routers = setup.routers_to_run()
    used, results, origin = asyncio.run(
        measure_capacity(routers, evaluate, search, slo=slo, e2e_factor=args.slo_e2e_factor)
    )
    print(render_capacity_table(used, results, search.goodput_multipliers))
    paths = write_capacity_report(used, origin, results, search, settings, args.out)
    if not args.no_plots:
        plot = write_capacity_plot([r.curve() for r in results], args.out)
        if plot is None:
            print(MATPLOTLIB_MISSING, file=sys.stderr)
        else:
            paths.append(plot)
    print("wrote " + ", ".join(str(path) for path in paths), file=sys.stderr)
    return 0


def _run_replay(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    import httpx

    from mocker.online import OnlineReplayError
    from mocker.replay import ReplaySetup, replay_offline, replay_online_report, write_outputs
    from mocker.report import render_table, render_worker_table
    from mocker.simulation import KvTransfer
    from router.event_plane.connection_file import ConnectionFileError
    from router.event_plane.first_connection import FirstConnectionError

    engine = _engine_config(args)
    try:
        capacity_plan = _capacity_plan(args) if args.capacity else None
        trace = _load_replay_trace(args, _trace_options(args))
    except (OSError, TraceError, ValueError) as exc:
        print(f"kv-router replay: {exc}", file=sys.stderr)
        return 2
    routers = tuple(name for name in args.routers.split(",") if name and name != "all")
    try:
        router_config, router_settings_given = _router_config(args.router_option, engine)
        setup = ReplaySetup(
            engine=engine,
            workers=args.workers,
            routers=routers,
            router_config=router_config,
            router_settings_given=router_settings_given,
            event_delay_ms=args.event_delay_ms,
            seed=args.seed,
            window_s=args.window_s,
            prefill_workers=args.prefill_workers,
            decode_workers=args.decode_workers,
            both_workers=args.both_workers,
            transfer=KvTransfer(args.kv_bytes_per_token, args.transfer_gb_per_s),
        )
    except ValueError as exc:
        print(f"kv-router replay: {exc}", file=sys.stderr)
        return 2
    if setup.disaggregated and args.online:
        print("kv-router replay: a disaggregated fleet replays offline only", file=sys.stderr)
        return 2
    try:  # the last check, so that a refused command leaves no directory behind
        _output_directory(args.out)
    except ValueError as exc:
        print(f"kv-router replay: {exc}", file=sys.stderr)
        return 2
    settings = setup.describe(trace)
    print(
        f"{trace.path}: {len(trace)} requests over {trace.span_ms / 1000:.0f} s"
        + (f" ({trace.clipped} clipped, {trace.dropped} dropped)" if trace.clipped or trace.dropped else "")
        + (f"; arrivals spread over {trace.jitter_ms / trace.options.speedup:g} ms each" if trace.jitter_ms else ""),
        file=sys.stderr,
    )
    if not args.online:  # online, the workers' own pools decide
        _warn_unservable("replay", trace, engine)
    try:
        if capacity_plan is not None:
            return _run_capacity(args, trace, setup, settings, capacity_plan)
        if args.online:
            settings.update(mode="online", url=args.url, time_scale=args.time_scale)
            run = asyncio.run(
                replay_online_report(
                    trace,
                    label=args.label,
                    router_url=args.url,
                    nats=_nats_connection(args, "kv-router replay", "kv-router-replay"),
                    namespace=args.namespace,
                    workers=args.workers,
                    time_scale=args.time_scale,
                    window_s=args.window_s,
                    timeout_s=args.request_timeout_secs,
                    show_progress=not args.quiet,
                )
            )
            runs = [run]
        else:
            settings["mode"] = "offline"
            runs = asyncio.run(replay_offline(trace, setup, show_progress=not args.quiet))
    except (ValueError, ConnectionFileError, FirstConnectionError, OnlineReplayError) as exc:
        print(f"kv-router replay: {exc}", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:  # the router at --url unreachable, or gone mid-replay
        print(f"kv-router replay: the router at {args.url}: {exc or type(exc).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # an online run has marked free what the router still booked for it
        print("kv-router replay: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    print(render_table([run.report for run in runs]))
    if args.per_worker:
        print(render_worker_table([run.report for run in runs]))
    paths, note = write_outputs(runs, settings, args.out, plots=not args.no_plots, per_request=args.per_request)
    if note:
        print(note, file=sys.stderr)
    print("wrote " + ", ".join(str(path) for path in paths), file=sys.stderr)
    if args.online:
        _warn_late(runs[0])
    unfinished = sum(run.report.unfinished for run in runs)
    if unfinished:
        requests = sum(run.report.requests for run in runs)
        print(
            f"kv-router replay: WARNING: {unfinished} of {requests} requests unfinished (their worker left the "
            f"router, or sent nothing for --request-timeout-secs): exit {EXIT_UNFINISHED}",
            file=sys.stderr,
        )
        return EXIT_UNFINISHED
    return 0


def _warn_late(run: ReplayRun) -> None:
    """The replayer could not send every request at its arrival (this host too slow for the trace at
    this --time-scale, say): its lateness is inside the TTFT measured, and a p90 of a tenth of the TTFT
    p90 or more, and of `LATE_WARNING_MS` or more, is said (a millisecond or two is the event loop's)."""
    from mocker.report import send_lateness

    late, ttft = send_lateness(run.records), run.report.ttft_ms
    if late.p90 >= max(0.1 * ttft.p90, LATE_WARNING_MS):
        print(
            f"kv-router replay: WARNING: requests were sent late: p90 {late.p90:.0f} ms, p99 {late.p99:.0f} ms "
            f"after their arrivals (trace time), inside the TTFT p90 of {ttft.p90:.0f} ms; a lower --time-scale (with "
            "the workers' --engine-speedup) or a quieter host measures the fleet rather than the replayer",
            file=sys.stderr,
        )


def _warn_unservable(command: str, trace: Trace, engine: EngineConfig) -> None:
    """Say up front which requests no simulated worker can hold: the engines reject them at any load."""
    from mocker.replay import unservable_requests

    unservable = unservable_requests(trace, engine)
    if not unservable:
        return
    largest = max(unservable, key=lambda r: r.input_length + r.output_length)
    count, them = (f"{len(unservable)} requests", "them") if len(unservable) > 1 else ("1 request", "it")
    print(
        f"kv-router {command}: warning: {count} larger than a worker's KV pool ({engine.num_gpu_blocks} blocks of "
        f"{engine.block_size} tokens; the largest: {largest.input_length} prompt + {largest.output_length} output "
        f"tokens): every engine rejects {them} whatever the load (counted as rejected; a capacity search leaves "
        f"{them} out of its SLO)",
        file=sys.stderr,
    )


def _load_replay_trace(args: argparse.Namespace, options: TraceOptions) -> Trace:
    """The trace file, or the generated workload ``--workload`` names (seeded by ``--seed``); a trace
    without requests (an empty file, --limit 0, every request dropped) is refused."""
    if args.trace is not None and args.workload is not None:
        raise ValueError("give a trace file or --workload, not both")
    if args.trace is None and args.workload is None:
        raise ValueError("give a trace file or --workload")
    if args.trace is not None:
        trace = load_trace(args.trace, options)
    else:
        rows = WORKLOADS[args.workload](seed=args.seed, trace_block_size=options.trace_block_size)
        trace = build_trace(rows[: options.limit], options, f"workload:{args.workload}")
    if not trace.requests:
        dropped = f" ({trace.dropped} dropped as longer than --max-input-length)" if trace.dropped else ""
        raise ValueError(f"{trace.path}: the trace has no requests{dropped}")
    return trace


# ---------------------------------------------------------------------- tune
def _add_tune(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Search the latency policy's knobs on a trace of your own, in simulated time and in parallel over the "
        "cores; print the Pareto front (TTFT p90, E2E p90, hit rate) and write the config file to start "
        "kv-router serve --config with. Results are cached in the output directory: a rerun continues."
    )
    _add_trace_flags(parser, "simulated workers in each replay of the search [%(default)s]")
    _add_engine_flags(parser)
    search = parser.add_argument_group("search")
    search.add_argument(
        "--budget", type=_int_at_least(0), default=24, help="settings tried besides the defaults [%(default)s]"
    )
    search.add_argument(
        "--jobs", type=_int_at_least(0), default=0, help="parallel replays [0: one per core this process may use]"
    )
    search.add_argument(
        "--objective",
        choices=["balanced", "ttft", "e2e", "hit"],
        default="balanced",
        help="which point of the front the config is written for [%(default)s]",
    )
    output = parser.add_argument_group("output")
    output.add_argument("--out", type=Path, default=Path("tune-report"), help="output directory [%(default)s]")
    output.add_argument("--no-plots", action="store_true", help="skip pareto.png")
    output.add_argument("--quiet", action="store_true", help="no progress bar")


def _run_tune(args: argparse.Namespace) -> int:
    import signal

    from mocker.plots import MATPLOTLIB_MISSING, write_pareto_plot
    from mocker.progress import ProgressBar
    from mocker.replay import unservable_requests
    from mocker.tune import (
        ReplayFailed,
        SearchInterrupted,
        TuneSetup,
        axes,
        pareto_front,
        pick,
        read_cache,
        render_front,
        run_tune,
        write_config,
    )

    engine = _engine_config(args)
    cache = args.out / "tune-results.jsonl"
    config_path = args.out / "kv-router.toml"
    try:
        trace = _load_replay_trace(args, _trace_options(args))
        setup = TuneSetup(engine=engine, workers=args.workers, seed=args.seed, budget=args.budget, jobs=args.jobs)
        if len(unservable_requests(trace, engine)) == len(trace):
            raise ValueError(
                f"every request is larger than a worker's KV pool ({engine.num_gpu_blocks} blocks of "
                f"{engine.block_size} tokens): no replay would complete one (--num-gpu-blocks)"
            )
        # After it only what fails in a directory already there, so that a refused command leaves none behind.
        _output_directory(args.out)
        # Found unwritable at the end, the whole search's output was lost in a traceback.
        for target in [cache, config_path] + ([] if args.no_plots else [args.out / "pareto.png"]):
            _output_file(target)
        cached = read_cache(cache)
    except (OSError, TraceError, ValueError) as exc:
        print(f"kv-router tune: {exc}", file=sys.stderr)
        return 2
    print(f"{trace.path}: {len(trace)} requests over {trace.span_ms / 1000:.0f} s", file=sys.stderr)
    _warn_unservable("tune", trace, engine)
    if cached.skipped:
        lines = f"{cached.skipped} lines" if cached.skipped > 1 else "1 line"
        print(f"kv-router tune: warning: {cache}: {lines} not a tune result, skipped", file=sys.stderr)
    stopped_by: list[int] = []

    def stop(signum: int, frame: object) -> None:
        if not stopped_by:  # a second signal would break off the stopping itself
            stopped_by.append(signum)
            raise KeyboardInterrupt

    # SIGTERM ends the search as Ctrl-C does: the pool stopped, the results so far kept.
    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    bar = ProgressBar("tune", enabled=not args.quiet)
    try:
        results, reference = run_tune(trace, setup, cache, cached.results, progress=bar)
    except ReplayFailed as exc:
        print(f"kv-router tune: {exc}", file=sys.stderr)
        return 2
    except (SearchInterrupted, KeyboardInterrupt) as exc:  # the latter before the replays began
        so_far = f"{exc.done}/{exc.total} results" if isinstance(exc, SearchInterrupted) else "no new result"
        print(f"kv-router tune: interrupted: {so_far} cached in {args.out}; rerun to continue", file=sys.stderr)
        return 128 + (stopped_by[0] if stopped_by else signal.SIGINT)
    finally:
        bar.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    front = pareto_front(results)
    if not front:
        print("kv-router tune: no setting completed a request: no config written", file=sys.stderr)
        return 2
    chosen = pick(front, args.objective)
    print(render_front(front, chosen, reference))
    note = (
        f"kv-router serve --config {config_path}\n"
        f"tuned by kv-router tune on {trace.path} ({len(trace)} requests, {args.workers} workers, "
        f"objective {args.objective}):\n"
        f"hit {chosen.hit_rate:.3f}, TTFT p90 {chosen.ttft_p90_ms:.0f} ms, E2E p90 {chosen.e2e_p90_ms:.0f} ms "
        f"(dynamo: {reference.hit_rate:.3f}, {reference.ttft_p90_ms:.0f} ms, {reference.e2e_p90_ms:.0f} ms)"
    )
    write_config(config_path, chosen, engine, note)
    written = [config_path]
    if not args.no_plots:
        plot = write_pareto_plot(
            [axes(r) for r in results], [axes(r) for r in front], axes(chosen), axes(reference), args.out
        )
        if plot is None:
            print(MATPLOTLIB_MISSING, file=sys.stderr)
        else:
            written.append(plot)
    print("wrote " + ", ".join(str(path) for path in written), file=sys.stderr)
    return 0


# ---------------------------------------------------------------------- mock-worker
_WORKER_HELP = (
    "Run one simulated vLLM-like engine: it registers with the routers on NATS, heartbeats, publishes its KV "
    "events and load, and serves the requests an online replay sends it, in real time divided by --engine-speedup; "
    "with --http-port, also the OpenAI HTTP API (its URL registered, for kv-router serve --proxy)."
)


def _add_nats_flags(group: argparse._ActionsContainer, what: str) -> None:
    group.add_argument(
        "--nats-url",
        default=None,
        help=f"{what}, as kv-router serve logs it and GET /v1/info returns it [the embedded NATS of a kv-router "
        "serve on this host, found with its token in its connection file; else nats://127.0.0.1:4222]",
    )
    group.add_argument(
        "--nats-creds-file", default=None, help="NATS credentials file (.creds: user JWT and nkey seed) [none]"
    )
    group.add_argument(
        "--nats-connection-file",
        default=None,
        help="the connection file kv-router serve wrote for its embedded NATS [env KV_ROUTER_NATS_CONNECTION_FILE; "
        "default: $XDG_RUNTIME_DIR/kv-router/ or ~/.cache/kv-router/]",
    )
    group.add_argument(
        "--nats-wait-secs",
        type=float,
        default=30.0,
        help="how long the first connection is retried (a kv-router serve started just before is still "
        "starting its NATS) [%(default)s]",
    )


def _nats_connection(args: argparse.Namespace, tool: str, name: str) -> LocalToolConnection:
    """How ``tool`` reaches NATS from ``args``: completed by a local router's connection file at
    each attempt (`ValueError` when a credentials file given cannot be used)."""
    from router.event_plane.connection import NatsOptions, check_creds_file, check_nats_url
    from router.event_plane.connection_file import DEFAULT_URL
    from router.event_plane.first_connection import LocalToolConnection

    if args.nats_url is not None:
        check_nats_url(args.nats_url)
    if args.nats_creds_file is not None:
        check_creds_file(args.nats_creds_file)
    options = NatsOptions(args.nats_url or DEFAULT_URL, creds_file=args.nats_creds_file, name=name)
    return LocalToolConnection(
        tool, args.nats_url, options, connection_file=args.nats_connection_file, wait_s=args.nats_wait_secs
    )


def _add_mock_worker(parser: argparse.ArgumentParser) -> None:
    _add_nats_flags(parser, "the router's NATS server")
    parser.add_argument("--namespace", default="default", help="deployment namespace [%(default)s]")
    parser.add_argument("--worker-id", type=int, default=None, help="worker id [random]")
    parser.add_argument("--seed", type=int, default=0, help="seeds generated tokens [%(default)s]")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds between heartbeats")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--zmq-endpoint",
        default=None,
        help="publish KV events in vLLM's ZMQ format on this PUB address (e.g. tcp://127.0.0.1:5557) instead "
        "of NATS, for kv-router bridge; requests still come over NATS",
    )
    parser.add_argument(
        "--no-kv-events",
        dest="kv_events",
        action="store_false",
        help="publish no KV events, registered as a worker without them (an engine run without "
        "--kv-events-config): the router predicts its cache, the proxy routes its prompts by their bytes",
    )
    parser.add_argument(
        "--replay-endpoint",
        default=None,
        help="with --zmq-endpoint: vLLM's replay ROUTER address (e.g. tcp://127.0.0.1:5558)",
    )
    parser.add_argument(
        "--http-port", type=int, default=None, help="also serve the OpenAI HTTP API on this port (0: a free one)"
    )
    parser.add_argument("--http-host", default="127.0.0.1", help="address of the HTTP API [%(default)s]")
    parser.add_argument(
        "--http-url",
        default=None,
        help="the URL routers reach the HTTP API at, registered for them (with --http-host 0.0.0.0 in a "
        "container: http://SERVICE:PORT) [http://HTTP_HOST:HTTP_PORT]",
    )
    parser.add_argument("--model", default="mock-model", help="model name the HTTP API serves [%(default)s]")
    pd = parser.add_argument_group("disaggregated prefill and decode (over the HTTP API)")
    pd.add_argument(
        "--role", choices=["prefill", "decode", "both"], default="both", help="the worker's role [%(default)s]"
    )
    pd.add_argument(
        "--handoff",
        choices=["kv_transfer_params", "bootstrap"],
        default="kv_transfer_params",
        help="with --role prefill: the hand-off the proxy runs, vLLM's kv_transfer_params or SGLang's bootstrap "
        "(the bootstrap server is the HTTP API's port) [%(default)s]",
    )
    _add_transfer_flags(pd)
    _add_engine_flags(parser)


def _run_mock_worker(args: argparse.Namespace) -> int:
    import asyncio
    import contextlib
    import logging
    import secrets
    import signal

    from api.listen import AddressFlags, ListenError, listening_socket
    from mocker.openai_api import serve_openai
    from mocker.simulation import KvTransfer
    from mocker.worker import MockWorker
    from mocker.zmq_engine import EndpointBindError, VllmZmqPublisher
    from router.engines.engine_spec import check_zmq_endpoint
    from router.engines.openai_server import openai_base
    from router.event_plane.connection import close_connection
    from router.event_plane.connection_file import ConnectionFileError
    from router.event_plane.embedded_server import free_port
    from router.event_plane.first_connection import FirstConnectionError
    from router.event_plane.jetstream import JetStreamUnavailable
    from router.event_plane.urls import redact_nats_url

    engine = _engine_config(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    worker_id = args.worker_id if args.worker_id is not None else secrets.randbelow(1 << 53)
    try:
        transfer = KvTransfer(args.kv_bytes_per_token, args.transfer_gb_per_s)
    except ValueError as exc:
        print(f"kv-router mock-worker: {exc}", file=sys.stderr)
        return 2

    if not args.kv_events and args.zmq_endpoint is not None:
        print("kv-router mock-worker: --no-kv-events publishes nothing: leave out --zmq-endpoint", file=sys.stderr)
        return 2
    for flag, endpoint, what in (("--zmq-endpoint", args.zmq_endpoint, "event"),
                                 ("--replay-endpoint", args.replay_endpoint, "replay")):  # fmt: skip
        try:
            if endpoint is not None:
                check_zmq_endpoint(endpoint, what, bind=True)
        except ValueError as exc:
            print(f"kv-router mock-worker: {flag}: {exc}", file=sys.stderr)
            return 2
    port = args.http_port
    if port == 0:
        port = free_port()
    url = f"http://{args.http_host}:{port}" if port is not None else None
    if args.http_url is not None:
        if port is None:
            print("kv-router mock-worker: --http-url needs --http-port (where the API listens)", file=sys.stderr)
            return 2
        try:
            url = openai_base(args.http_url)
        except ValueError as exc:
            print(f"kv-router mock-worker: --http-url: {exc}", file=sys.stderr)
            return 2

    try:
        connection = _nats_connection(args, "kv-router mock-worker", f"mock-worker-{worker_id}")
    except ValueError as exc:
        print(f"kv-router mock-worker: {exc}", file=sys.stderr)
        return 2
    http_socket = None
    if port is not None:
        # The address first, as kv-router serve does: a port in use is one line, before NATS or a registration.
        http_flags = AddressFlags(host="--http-host", port="--http-port", usual_holder="kv-router mock-worker")
        try:
            http_socket = listening_socket(args.http_host, port, flags=http_flags)
        except ListenError as exc:
            print(f"kv-router mock-worker: {exc}", file=sys.stderr)
            return 1

    async def serve() -> int:
        async with contextlib.AsyncExitStack() as stack:
            zmq = None
            if args.zmq_endpoint is not None:
                # Bound before NATS and the start-up line: an endpoint in use is one line, nothing started.
                zmq = VllmZmqPublisher(args.zmq_endpoint, replay_endpoint=args.replay_endpoint)
                try:
                    await zmq.start()
                except EndpointBindError as exc:
                    flag = "--replay-endpoint" if exc.replay else "--zmq-endpoint"
                    reason = f"the port is in use ({flag} picks another)" if exc.in_use else exc.reason.lower()
                    print(f"kv-router mock-worker: cannot bind {flag} {exc.endpoint}: {reason}", file=sys.stderr)
                    return 1
                stack.push_async_callback(zmq.stop)
            try:
                nc, options = await connection.connect()
            except (ConnectionFileError, FirstConnectionError) as exc:
                print(f"kv-router mock-worker: {exc}", file=sys.stderr)
                return 2
            stack.push_async_callback(close_connection, nc)
            worker = MockWorker(
                nc,
                worker_id,
                engine,
                namespace=args.namespace,
                seed=args.seed,
                heartbeat_interval_s=args.heartbeat_interval,
                zmq=zmq,
                url=url,
                models=frozenset({args.model}) if url else frozenset(),
                role=args.role,
                handoff=args.handoff,
                # Its bootstrap rooms are served by its HTTP API.
                bootstrap_port=port if args.handoff == "bootstrap" and args.role == "prefill" else None,
                kv_events=args.kv_events,
            )
            if port is not None:
                api = serve_openai(worker, args.model, args.http_host, port, transfer=transfer, sock=http_socket)
                await stack.enter_async_context(api)
            task = asyncio.create_task(worker.run())
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, task.cancel)
            http = f", OpenAI API at {url} (model {args.model})" if url else ""
            shown = redact_nats_url(options.url)
            print(
                f"mock worker {worker_id} on {shown} (namespace {args.namespace}, role {args.role}){http}", flush=True
            )
            # A router that refuses this worker (another block size) says so: serving on would be a lie.
            refused = asyncio.create_task(worker.publisher.refused.wait())
            await asyncio.wait({task, refused}, return_when=asyncio.FIRST_COMPLETED)
            refused.cancel()
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except JetStreamUnavailable as exc:
                print(f"kv-router mock-worker: NATS at {shown}: {exc}", file=sys.stderr)
                return 2
        refusal = worker.publisher.refusal
        if refusal is not None:
            print(
                f"kv-router mock-worker: the router refused this worker: {refusal.reason}. Start it with --block-size "
                f"{refusal.router_block_size} (or the router with --block-size {engine.block_size})",
                file=sys.stderr,
            )
            return 2
        return 0

    return asyncio.run(serve())


# ---------------------------------------------------------------------- demo
def _add_demo(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Start an embedded NATS, the router and mock workers in this process, replay a generated shared-prefix "
        "workload through them over HTTP, then simulate the same workload with every router; print both tables."
    )
    parser.add_argument("--workers", type=_int_at_least(1), default=4, help="mock workers [%(default)s]")
    parser.add_argument("--requests", type=_int_at_least(1), default=300, help="requests in the workload [%(default)s]")
    parser.add_argument(
        "--speedup", type=_positive_float, default=10.0, help="run this much faster than real [%(default)s]"
    )
    parser.add_argument(
        "--num-gpu-blocks", type=_int_at_least(1), default=1024, help="KV blocks per worker [%(default)s]"
    )
    parser.add_argument("--seed", type=int, default=0, help="[%(default)s]")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _run_demo(args: argparse.Namespace) -> int:
    import asyncio

    from mocker.demo import DemoOptions, run_demo

    options = DemoOptions(
        workers=args.workers,
        requests=args.requests,
        speedup=args.speedup,
        num_gpu_blocks=args.num_gpu_blocks,
        seed=args.seed,
        show_progress=not args.quiet,
    )
    asyncio.run(run_demo(options))
    return 0


REPLAY = SimulatorCommand(
    help="replay a Mooncake trace through routers and simulated engines", configure=_add_replay, body=_run_replay
)
MOCK_WORKER = SimulatorCommand(
    help="run one simulated engine worker on NATS",
    configure=_add_mock_worker,
    body=_run_mock_worker,
    description=_WORKER_HELP,
)
TUNE = SimulatorCommand(
    help="search the latency policy's knobs on your trace; write the config", configure=_add_tune, body=_run_tune
)
DEMO = SimulatorCommand(
    help="NATS, the router and mock workers at work, in one command", configure=_add_demo, body=_run_demo
)
_COMMANDS = {"replay": REPLAY, "tune": TUNE, "mock-worker": MOCK_WORKER, "demo": DEMO}


if __name__ == "__main__":
    sys.exit(main())

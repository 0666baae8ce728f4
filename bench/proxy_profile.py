"""Where ``kv-router serve --proxy`` spends its CPU per request (issue 25): one cell of
``bench/gateway_bench.py`` (the same stub backends and bodies) run against the proxy under cProfile,
the profile taken over the measured requests only, printed per layer and per function, per request.

    python bench/proxy_profile.py                                   # c=64, JSON, text prompts
    python bench/proxy_profile.py --concurrency 1 --form sse --prompt ids --top 40

cProfile slows every Python call about twofold, times C functions it cannot see (uvloop's transport
writes) inside their caller, and reads the wall clock (run it on a quiet machine), so the absolute
microseconds are not the proxy's: read the shares and the calls per request, and compare two trees
with the same command. The
layers: ``api/proxy`` (the proxy's own work), ``api (HTTP)`` (our protocol, stream routes, eager
runner), ``router`` and ``indexer`` (the decision, bookings, prediction), ``event loop`` (asyncio and
uvloop), ``metrics`` (prometheus_client), ``other``. ``gateway_bench.py`` measures the CPU of the same
cell from ``/proc``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import random
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gateway_bench import (
    Cell,
    gateway_command,
    register_backends,
    request_bodies,
    run_cell,
    stub_backends,
    wait_answering,
    wait_for_port,
)
from bench.proxy_bench import stop_process
from mocker.openai_api import write_model_files
from router.event_plane.embedded_server import free_port

ROOT = Path(__file__).resolve().parents[1]
LAYERS = (
    ("api/proxy/", "api/proxy"),
    ("api/", "api (HTTP)"),
    ("router/", "router"),
    ("indexer/", "indexer"),
    ("asyncio/", "event loop"),
    ("uvloop", "event loop"),
    ("prometheus_client", "metrics"),
)


def serve_profiled(out: str, argv: list[str]) -> None:
    """``kv-router ARGV`` under cProfile: SIGUSR2 starts the profile, SIGUSR1 writes it to ``out``."""
    profile = cProfile.Profile()

    def dump(*_: object) -> None:
        profile.disable()
        profile.dump_stats(out)

    signal.signal(signal.SIGUSR2, lambda *_: profile.enable())
    signal.signal(signal.SIGUSR1, dump)
    sys.argv = ["kv-router", *argv]
    runpy.run_module("api.cli", run_name="__main__")


def layer(path: str) -> str:
    path = path.replace(str(ROOT) + "/", "")
    return next((name for marker, name in LAYERS if marker in path), "other")


def report(profile: str, requests: int, top: int) -> str:
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    per_layer: Counter[str] = Counter()
    rows = []
    for (path, line, name), (_, calls, own_s, _, callers) in stats.items():
        if path == "~":  # a builtin: its time goes to the layer of whoever called it
            for (caller_path, _, _), caller_stats in callers.items():
                per_layer[layer(caller_path)] += caller_stats[2]
        else:
            per_layer[layer(path)] += own_s
        where = f"{path.replace(str(ROOT) + '/', '')}:{line}" if path != "~" else "builtin"
        rows.append((own_s, calls, f"{name} ({where})"))
    total = sum(per_layer.values())
    calls = sum(row[1] for row in rows) / requests
    lines = [f"{total / requests * 1e6:.0f} µs of profiled CPU a request, {calls:.0f} calls"]
    lines += [f"  {share / total:6.1%}  {name}" for name, share in per_layer.most_common()]
    lines.append(f"top {top} functions by own time (µs a request under cProfile, calls a request):")
    for own_s, calls, name in sorted(rows, reverse=True)[:top]:
        lines.append(f"  {own_s / requests * 1e6:7.2f}  {calls / requests:6.2f}  {name}")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "profiled-serve":  # the child: profiled-serve OUT ARGS...
        serve_profiled(sys.argv[2], sys.argv[3:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--form", choices=("json", "sse"), default="json")
    parser.add_argument("--prompt", choices=("text", "ids"), default="text")
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--save", metavar="FILE", help="keep the profile (pstats) there, for callers and callees")
    args = parser.parse_args()
    cell = Cell(concurrency=args.concurrency, stream=args.form == "sse", prompt=args.prompt)
    bodies = request_bodies(cell, args.requests, args.prompt_tokens, 16, random.Random(0))
    with tempfile.TemporaryDirectory() as scratch, stub_backends() as (backends, _):
        model_dir = write_model_files(Path(scratch) / "stub-model")
        out = str(Path(scratch) / "proxy.prof")
        port = free_port()
        command = gateway_command("kv-router", port, backends, Path(scratch), model_dir)
        at = command.index("-m")
        command = [command[0], __file__, "profiled-serve", out, *command[at + 2 :]]  # after "-m api.cli"
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for_port(url, process)
            register_backends(url, backends)
            wait_answering(url, process)
            asyncio.run(run_cell(url, cell, bodies[:500], lambda: (0.0, 0.0), 600))  # warm-up, not profiled
            time.sleep(1.5)  # the workers' health probes start (each builds its TLS context once), unprofiled
            process.send_signal(signal.SIGUSR2)
            time.sleep(0.5)
            result = asyncio.run(run_cell(url, cell, bodies, lambda: (0.0, 0.0), 600))
            process.send_signal(signal.SIGUSR1)
            for _ in range(100):
                if os.path.exists(out):
                    break
                time.sleep(0.1)
            time.sleep(0.5)  # written whole
            requests = len(result.latencies_s) + max(cell.concurrency, 32)  # with run_cell's warm-up round
            print(f"kv-router --proxy, {cell}, {requests} requests profiled")
            print(report(out, requests, args.top))
            if args.save:
                shutil.copyfile(out, args.save)
        finally:
            stop_process(process)
    return 0


if __name__ == "__main__":
    sys.exit(main())

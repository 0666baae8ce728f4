"""Calibration: our offline replay against Dynamo 1.6.1's own (`run_mocker_trace_replay`), side by side.

For each trace, both simulators replay it with Dynamo's default engine parameters (16,384 blocks of 64
tokens, 256 sequences, 8,192 tokens per pass) and the same number of workers, once with a KV router
(Dynamo's ``kv_router``, our ``dynamo`` policy) and once round robin, and the engine-side hit rates
(reused prompt tokens / prompt tokens) and TTFT are printed next to each other. Ours runs twice: with
our timing model (prefill attends to the cached context) and with ``prefill_form="dynamo"``, Dynamo's
own timing, which isolates what the timing model changes from what the rest of the simulator does.

Dynamo's KV-router replay is not bit-deterministic (random tie-breaks); ``--repeat`` reruns it.

    python bench/replay_calibration.py                      # the three traces (about 3 minutes here)
    python bench/replay_calibration.py --traces mooncake    # the quick one
    python bench/replay_calibration.py --json-out calibration.json

Needs the oracle extra: ``pip install 'kv-router[oracle]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec

from mocker.config import EngineConfig, TimingConfig
from mocker.report import summarize
from mocker.routers import make_router
from mocker.simulation import simulate
from mocker.trace import TraceOptions, load_trace
from router.config import RouterConfig

os.environ.setdefault("DYN_LOG", "warn")  # Dynamo's KV selector logs one INFO line per request

SHARED = Path(os.environ.get("KV_ROUTER_SHARED", Path(__file__).resolve().parents[2] / "shared"))

# name -> (file, workers, Dynamo's figures as published in reference/oracle.md §5: kv_router, round robin)
TRACES: dict[str, tuple[str, int, str, str]] = {
    "conversation": ("conversation_trace.jsonl", 8, "0.201", "0.082"),
    "synthetic": ("synthetic_trace.jsonl", 8, "0.508", "0.112"),
    "mooncake": ("mooncake_trace_1000.jsonl", 4, "0.34-0.36", "0.314"),
}
MODES = (("kv_router", "dynamo"), ("round_robin", "round_robin"))


@dataclass
class Row:
    trace: str
    workers: int
    router: str
    published: str
    dynamo_hit: list[float]
    dynamo_ttft_p50: float
    dynamo_ttft_p99: float
    ours_hit: float
    ours_ttft_p50: float
    ours_ttft_p99: float
    ours_dynamo_timing_hit: float
    ours_dynamo_timing_ttft_p50: float
    ours_dynamo_timing_ttft_p99: float
    ours_wall_s: float


def run_dynamo(path: Path, workers: int, mode: str, engine: EngineConfig) -> tuple[float, float, float]:
    from dynamo._core import run_mocker_trace_replay

    args = {
        "engine": {
            "block_size": engine.block_size,
            "num_gpu_blocks": engine.num_gpu_blocks,
            "max_num_seqs": engine.max_num_seqs,
            "max_num_batched_tokens": engine.max_num_batched_tokens,
            "enable_prefix_caching": True,
            "enable_chunked_prefill": True,
        },
        "dp_size": 1,
    }
    result = run_mocker_trace_replay(
        [str(path)],
        extra_engine_args=args,
        num_workers=workers,
        router_mode=mode,
        trace_block_size=512,
        trace_format="mooncake",
        capture_per_request=True,
    )
    done = [r for r in result.per_request or [] if r.get("terminal_status") == "completed"]
    hit = sum(r.get("reused_input_tokens") or 0 for r in done) / sum(r["input_length"] for r in done)
    ttft = sorted(r["ttft_ms"] for r in done if r.get("ttft_ms") is not None)
    return hit, _rank(ttft, 50), _rank(ttft, 99)


def run_ours(path: Path, workers: int, policy: str, engine: EngineConfig) -> tuple[float, float, float, float]:
    trace = load_trace(path, TraceOptions())
    fleet_router = make_router(policy, RouterConfig(block_size=engine.block_size), random.Random(0))
    result = asyncio.run(simulate(trace, fleet_router, engine, workers))
    report = summarize(policy, result.records, workers, wall_s=result.wall_s)
    return report.hit_rate_tokens, report.ttft_ms.p50, report.ttft_ms.p99, result.wall_s


def _rank(ordered: list[float], percent: float) -> float:
    return ordered[min(len(ordered) - 1, round(percent / 100 * (len(ordered) - 1)))] if ordered else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", default=",".join(TRACES), help="comma-separated, of: " + ", ".join(TRACES))
    parser.add_argument("--repeat", type=int, default=1, help="runs of Dynamo's kv_router replay [%(default)s]")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    try:
        import dynamo._core  # noqa: F401
    except ImportError:
        print("Dynamo's bindings are missing: pip install 'kv-router[oracle]'", file=sys.stderr)
        return 1
    engine = EngineConfig()
    dynamo_timing = msgspec.structs.replace(engine, timing=TimingConfig(prefill_form="dynamo", decode_per_seq_ms=0.0))
    rows = []
    for name in args.traces.split(","):
        file, workers, published_kv, published_rr = TRACES[name]
        path = SHARED / "traces" / file
        for mode, policy in MODES:
            started = time.perf_counter()
            runs = [run_dynamo(path, workers, mode, engine) for _ in range(args.repeat if mode == "kv_router" else 1)]
            ours = run_ours(path, workers, policy, engine)
            ours_dt = run_ours(path, workers, policy, dynamo_timing)
            row = Row(
                trace=name,
                workers=workers,
                router=policy,
                published=published_kv if mode == "kv_router" else published_rr,
                dynamo_hit=[hit for hit, _, _ in runs],
                dynamo_ttft_p50=statistics.fmean(p50 for _, p50, _ in runs),
                dynamo_ttft_p99=statistics.fmean(p99 for _, _, p99 in runs),
                ours_hit=ours[0],
                ours_ttft_p50=ours[1],
                ours_ttft_p99=ours[2],
                ours_dynamo_timing_hit=ours_dt[0],
                ours_dynamo_timing_ttft_p50=ours_dt[1],
                ours_dynamo_timing_ttft_p99=ours_dt[2],
                ours_wall_s=ours[3],
            )
            rows.append(row)
            print(f"{name} {policy}: done in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    print(render(rows))
    if args.json_out:
        args.json_out.write_text(json.dumps([asdict(row) for row in rows], indent=1) + "\n")
    return 0


def render(rows: list[Row]) -> str:
    """A markdown table: hit rates first (Δ against Dynamo's run here), then TTFT p50/p99 in ms."""
    lines = [
        "| trace | workers | router | Dynamo published | Dynamo here | ours | Δ | ours, Dynamo timing | Δ "
        "| TTFT p50/p99 Dynamo | ours | ours, Dynamo timing | ours wall s |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        here = statistics.fmean(r.dynamo_hit)
        spread = f" ({min(r.dynamo_hit):.3f}-{max(r.dynamo_hit):.3f})" if len(r.dynamo_hit) > 1 else ""
        lines.append(
            f"| {r.trace} | {r.workers} | {r.router} | {r.published} | {here:.3f}{spread} | {r.ours_hit:.3f} | "
            f"{r.ours_hit - here:+.3f} | {r.ours_dynamo_timing_hit:.3f} | {r.ours_dynamo_timing_hit - here:+.3f} | "
            f"{r.dynamo_ttft_p50:.0f}/{r.dynamo_ttft_p99:.0f} | {r.ours_ttft_p50:.0f}/{r.ours_ttft_p99:.0f} | "
            f"{r.ours_dynamo_timing_ttft_p50:.0f}/{r.ours_dynamo_timing_ttft_p99:.0f} | {r.ours_wall_s:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

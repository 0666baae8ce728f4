"""In-process decision latency: kv-router's `KvRouter.new` beside Dynamo 1.6.1's `KvRouter.best_worker`.

    python bench/decision_bench.py                  # every cell, 5 repetitions
    taskset -c 0 python bench/decision_bench.py     # pinned to one core (Dynamo's thread handoff is cheap)
    python bench/decision_bench.py --quick          # 1k and 4k prompts only, fewer decisions

One decision is hash + match + load projection + cost + pick + book. Ours: ``await router.new(request)``
with a request id. Dynamo's: ``await router.best_worker(tokens, request_id=...)``, which books too. Each
booked request is freed right after, untimed, so both routers keep the same state throughout.

State per cell (W workers, block size 16, prompts of L tokens): 32 documents of L tokens; a warm-up
routes 4W requests (a document prefix of random length plus a unique tail) through Dynamo, which records
each in its approximate index, and mirrors each on ours (same rank, same booking, same stored blocks);
the last 2W of them stay active, so both routers carry the same booked load. Queries are drawn the same
way. Ours and Dynamo's calls alternate, one query each; the garbage collector runs before each
repetition, not during warm-up's aftermath. Reported: p50 and p99 in microseconds, the median over
repetitions with [min-max], and Dynamo / ours (> 1: kv-router is faster). A last column times ours
again with the tokens packed as little-endian u32 bytes, the form the HTTP layer hands over (Dynamo's
binding takes only a list).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router import KvRouter, RouterConfig, RouteRequest, WorkerConfig
from tests.dynamo_fleet import DynamoFleet, prompt_stored_event

BLOCK_SIZE = 16
DOCUMENTS = 32
TARGETS_P99_US = {(4096, 8): 1000.0, (16384, 64): 3000.0}


class Cell:
    def __init__(self, prompt_tokens: int, workers: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.workers = workers
        self.ours: list[tuple[float, float]] = []  # (p50, p99) per repetition, seconds
        self.ours_packed: list[tuple[float, float]] = []
        self.dynamo: list[tuple[float, float]] = []
        self.phases: list[tuple[float, float, float]] = []  # our hashing, matching, scheduling medians


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Workload:
    """Seeded prompts: a prefix of one of the documents plus a unique tail, always L tokens long."""

    def __init__(self, seed: int, prompt_tokens: int) -> None:
        self._rng = random.Random(seed)
        self._length = prompt_tokens
        self._documents = [[self._rng.randrange(1, 100_000) for _ in range(prompt_tokens)] for _ in range(DOCUMENTS)]

    def prompt(self) -> list[int]:
        document = self._rng.choice(self._documents)
        shared = self._rng.randrange(0, self._length + 1)
        return document[:shared] + [self._rng.randrange(100_000, 150_000) for _ in range(self._length - shared)]


async def run_cell(cell: Cell, decisions: int, repetitions: int, seed: int, policy: str) -> None:
    fleet = DynamoFleet(tempfile.mkdtemp(prefix="decision-bench-"), BLOCK_SIZE)
    try:
        ranks = await fleet.start([1] * cell.workers)
        ours = KvRouter(RouterConfig(block_size=BLOCK_SIZE, policy=policy), rng=random.Random(seed))
        for worker_id in ranks:
            ours.register_worker(WorkerConfig(worker_id=worker_id))
        workload = Workload(seed, cell.prompt_tokens)
        warm_up = 4 * cell.workers
        for index in range(warm_up):
            tokens = workload.prompt()
            request_id = f"warm-{index}"
            worker_id, dp_rank, _ = await fleet.router.best_worker(tokens, request_id=request_id, update_indexer=True)
            await ours.new(RouteRequest(tokens=tokens, request_id=request_id), pinned_worker=(worker_id, dp_rank))
            ours.apply_event(prompt_stored_event(worker_id, tokens, BLOCK_SIZE, event_id=index + 1))
            await fleet.wait_indexed(tokens, (worker_id, dp_rank))
            if index < warm_up - 2 * cell.workers:
                ours.mark_free(request_id)
                await fleet.router.free(request_id)
        for repetition in range(repetitions):
            # Start each repetition with the warm-up's garbage gone: collections triggered by the
            # decisions themselves still land in the measurement.
            gc.collect()
            ours_s: list[float] = []
            packed_s: list[float] = []
            dynamo_s: list[float] = []
            phases: list[tuple[float, float, float]] = []
            for index in range(decisions):
                tokens = workload.prompt()
                request_id = f"r{repetition}-{index}"
                request = RouteRequest(tokens=tokens, request_id=request_id)
                started = time.perf_counter()
                decision = await ours.new(request)
                ours_s.append(time.perf_counter() - started)
                ours.mark_free(request_id)
                timing = decision.timing
                phases.append((timing.hashing_s, timing.matching_s, timing.scheduling_s))
                packed = RouteRequest(tokens=array("I", tokens).tobytes(), request_id=f"{request_id}-packed")
                started = time.perf_counter()
                await ours.new(packed)
                packed_s.append(time.perf_counter() - started)
                ours.mark_free(f"{request_id}-packed")
                started = time.perf_counter()
                await fleet.router.best_worker(tokens, request_id=request_id)
                dynamo_s.append(time.perf_counter() - started)
                await fleet.router.free(request_id)
            cell.ours.append((percentile(ours_s, 0.5), percentile(ours_s, 0.99)))
            cell.ours_packed.append((percentile(packed_s, 0.5), percentile(packed_s, 0.99)))
            cell.dynamo.append((percentile(dynamo_s, 0.5), percentile(dynamo_s, 0.99)))
            hashing, matching, scheduling = (statistics.median(column) for column in zip(*phases, strict=True))
            cell.phases.append((hashing, matching, scheduling))
    finally:
        await fleet.stop()


def spread(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e6:7.0f} [{min(values) * 1e6:.0f}-{max(values) * 1e6:.0f}]"


def report(cells: list[Cell], pinned: str) -> None:
    print(f"\nDecision latency, microseconds: median over repetitions [min-max]; CPU affinity: {pinned}")
    print(
        f"{'prompt':>7} {'workers':>7} | {'ours p50':>20} {'ours p99':>20} | {'Dynamo p50':>20} {'Dynamo p99':>20}"
        f" | {'p50 x':>6} {'p99 x':>6} | ours hash/match/sched p50 | packed tokens p50 / p99"
    )
    for cell in cells:
        ours_p50 = [p50 for p50, _ in cell.ours]
        ours_p99 = [p99 for _, p99 in cell.ours]
        dyn_p50 = [p50 for p50, _ in cell.dynamo]
        dyn_p99 = [p99 for _, p99 in cell.dynamo]
        ratio_p50 = statistics.median(dyn_p50) / statistics.median(ours_p50)
        ratio_p99 = statistics.median(dyn_p99) / statistics.median(ours_p99)
        phases = "/".join(f"{statistics.median(phase[i] for phase in cell.phases) * 1e6:.0f}" for i in range(3))
        packed = " / ".join(f"{statistics.median(column) * 1e6:.0f}" for column in zip(*cell.ours_packed, strict=True))
        print(
            f"{cell.prompt_tokens:>7} {cell.workers:>7} | {spread(ours_p50):>20} {spread(ours_p99):>20} |"
            f" {spread(dyn_p50):>20} {spread(dyn_p99):>20} | {ratio_p50:6.2f} {ratio_p99:6.2f} | {phases:>25} |"
            f" {packed}"
        )
    for (prompt_tokens, workers), target in TARGETS_P99_US.items():
        for cell in cells:
            if (cell.prompt_tokens, cell.workers) == (prompt_tokens, workers):
                p99 = statistics.median(p99 for _, p99 in cell.ours) * 1e6
                verdict = "met" if p99 < target else "MISSED"
                where = f"{prompt_tokens} tokens x {workers} workers"
                print(f"target p99 < {target:.0f} us at {where}: {p99:.0f} us, {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1k and 4k prompts, 100 decisions, 3 repetitions")
    parser.add_argument("--decisions", type=int, default=200, help="decisions per repetition (default 200)")
    parser.add_argument("--repetitions", type=int, default=5, help="repetitions per cell (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", default="dynamo", help="our selection policy to time (default dynamo)")
    args = parser.parse_args()
    os.environ.setdefault("DYN_LOG", "off")
    prompts = [1024, 4096] if args.quick else [1024, 4096, 16384]
    decisions = 100 if args.quick else args.decisions
    repetitions = 3 if args.quick else args.repetitions
    cells = [Cell(prompt_tokens, workers) for workers in (8, 64) for prompt_tokens in prompts]
    for cell in cells:
        print(f"cell {cell.prompt_tokens} tokens x {cell.workers} workers ...", file=sys.stderr, flush=True)
        asyncio.run(run_cell(cell, decisions, repetitions, args.seed, args.policy))
    affinity = sorted(os.sched_getaffinity(0))
    report(cells, ",".join(map(str, affinity)))


if __name__ == "__main__":
    main()

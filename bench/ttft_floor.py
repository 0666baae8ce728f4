"""How low TTFT p90 can go on a trace, whatever the router: prefill compute alone, no queueing.

    python bench/ttft_floor.py ../shared/traces/conversation_trace.jsonl [--workers 8]

For every request, the prefill time of its uncached part on an idle simulated worker (the replay's
timing model, `mocker.timing`, chunked at max_num_batched_tokens), where "cached" is what an ideal
cache would hold: (a) one infinite cache (every prefix ever seen), (b) one LRU cache with the pooled
capacity of all workers (the usual ceiling for a router over per-worker LRU caches), (c) nothing.
No router can beat (b) by much: it cannot enlarge the caches, and spreading prefixes over workers
only duplicates them. Compare the printed p90s with a policy's TTFT p90 from `kv-router replay`.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import OrderedDict
from pathlib import Path

from mocker.config import EngineConfig
from mocker.timing import PassTimer


def prefill_ms(timer: PassTimer, engine: EngineConfig, input_length: int, cached: int) -> float:
    """Prefill on an idle worker: chunks of at most max_num_batched_tokens attending to all before."""
    cached = min(cached, input_length - 1)  # the last token is always computed
    total, context, left = 0.0, cached, input_length - cached
    while left > 0:
        chunk = min(engine.max_num_batched_tokens, left)
        total += timer.prefill_ms(chunk, chunk * (chunk + 2 * context))
        context += chunk
        left -= chunk
    return total


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--trace-block-size", type=int, default=512)
    args = parser.parse_args()
    engine = EngineConfig()
    timer = PassTimer(engine)
    pooled_capacity = args.workers * engine.num_gpu_blocks * engine.block_size // args.trace_block_size
    seen: set[tuple[int, ...]] = set()
    lru: OrderedDict[tuple[int, ...], None] = OrderedDict()
    floors: dict[str, list[float]] = {"infinite cache": [], "pooled LRU cache": [], "no cache": []}
    hits = {"infinite cache": 0, "pooled LRU cache": 0}
    blocks = 0
    for line in args.trace.read_text().splitlines():
        row = json.loads(line)
        prefixes = [tuple(row["hash_ids"][: i + 1]) for i in range(len(row["hash_ids"]))]
        blocks += len(prefixes)
        for name, held in (("infinite cache", seen), ("pooled LRU cache", lru)):
            depth = 0
            while depth < len(prefixes) and prefixes[depth] in held:
                depth += 1
            hits[name] += depth
            cached = min(depth * args.trace_block_size, row["input_length"]) // engine.block_size * engine.block_size
            floors[name].append(prefill_ms(timer, engine, row["input_length"], cached))
        floors["no cache"].append(prefill_ms(timer, engine, row["input_length"], 0))
        seen.update(prefixes)
        for prefix in prefixes:
            lru[prefix] = None
            lru.move_to_end(prefix)
        while len(lru) > pooled_capacity:
            lru.popitem(last=False)
    print(f"{args.trace.name}: {len(floors['no cache'])} requests, {args.workers} workers' pooled capacity")
    for name, values in floors.items():
        hit = f"hit rate {hits[name] / blocks:.3f}, " if name in hits else ""
        print(f"  {name:<17} {hit}prefill-only TTFT p50 {statistics.median(values):.0f} ms, "
              f"p90 {percentile(values, 0.9):.0f} ms")  # fmt: skip


if __name__ == "__main__":
    main()

"""How high the bursty workload's hit rate can go when each batch job is spread over k workers.

    python bench/bursty_hit_ceiling.py --seed 1 [--workers 8] [--target 0.7687]

The engines share no KV with one another, so every worker a batch job's requests go to computes the
job's template once. Everything else is taken at its best: every prefix ever seen stays cached (one
infinite cache per worker), every chat turn goes to the worker holding its history, and the chat system
prompt is computed once per worker (a fleet whose chats avoid some workers saves up to 512 tokens for each,
0.0003 of hit rate in all on eight workers). What is left is the price of the copies: the hit rate falls by one
template per job for each worker past the first. `--target` prints how many workers a job may use, on
average, for the hit rate to reach it; compare with the copies a policy makes (`kv-router replay
--per-request`, docs/history/routing-quality-rounds.md, fifth and sixth rounds).

A batch job is a group of requests sharing their first trace block whose common prefix is two trace
blocks or more (templates are 1,024-6,144 tokens; the chat system prompt, the chats' only shared
prefix, is one block of 512).
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Sequence

from mocker.config import EngineConfig
from mocker.workload import bursty_rows

TRACE_BLOCK = 512


def engine_blocks(input_length: int, hash_ids: Sequence[int], block_size: int) -> list[tuple[tuple[int, ...], int]]:
    """The prompt's full engine blocks that can be cached, each named by its trace-block prefix and offset."""
    keys: list[tuple[tuple[int, ...], int]] = []
    prefix: tuple[int, ...] = ()
    for index in range((input_length - 1) // block_size):  # the last token is always computed
        offset = index * block_size % TRACE_BLOCK
        if offset == 0:
            prefix = (*prefix, hash_ids[index * block_size // TRACE_BLOCK])
        keys.append((prefix, offset))
    return keys


def common_prefix(rows: Sequence[Sequence[int]]) -> int:
    """How many leading hash ids all the rows share."""
    first = rows[0]
    shared = len(first)
    for other in rows[1:]:
        shared = min(shared, len(other))
        while shared and first[:shared] != other[:shared]:
            shared -= 1
    return shared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--target", type=float, help="a hit rate: how many workers a job may use to reach it")
    args = parser.parse_args()
    block_size = EngineConfig().block_size
    rows = bursty_rows(seed=args.seed)

    seen: set[tuple[tuple[int, ...], int]] = set()
    cached = prompt = 0
    groups: defaultdict[int, list[Sequence[int]]] = defaultdict(list)
    for _, input_length, _, hash_ids in rows:
        keys = engine_blocks(input_length, hash_ids, block_size)
        hit = next((i for i, key in enumerate(keys) if key not in seen), len(keys))
        cached += hit * block_size
        prompt += input_length
        seen.update(keys)
        groups[hash_ids[0]].append(hash_ids)
    templates = [common_prefix(g) * TRACE_BLOCK for g in groups.values() if len(g) > 1 and common_prefix(g) >= 2]
    # One infinite cache for the whole fleet, less the chat system prompt on every other worker.
    pooled = cached - (args.workers - 1) * TRACE_BLOCK

    print(f"bursty seed {args.seed}: {len(rows)} requests, {len(templates)} batch jobs, {prompt} prompt tokens")
    print("workers per job | hit-rate ceiling")
    for workers in range(1, args.workers + 1):
        print(f"{workers:15d} | {(pooled - (workers - 1) * sum(templates)) / prompt:.4f}")
    if args.target is not None:
        allowed = 1 + (pooled - args.target * prompt) / sum(templates)
        print(f"hit rate {args.target:.4f} needs at most {allowed:.2f} workers per job on average")


if __name__ == "__main__":
    main()

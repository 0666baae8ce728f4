"""A small generated workload with shared prefixes, in Mooncake's row format (for the demo and tests).

``groups`` long prefixes (system prompts, documents) are shared by requests whose group is drawn with
popularity ∝ 1 / rank, each adding a question of its own; arrivals are Poisson at ``rate_per_s``. Like
SGLang's generated-shared-prefix benchmark, but with skewed popularity, which is what makes affinity
and balance pull against each other.
"""

from __future__ import annotations

import random

from mocker.trace import Row

__all__ = ["shared_prefix_rows"]


def shared_prefix_rows(
    *,
    requests: int = 300,
    groups: int = 24,
    prefix_tokens: int = 4096,
    question_tokens: int = 384,
    output_tokens: int = 64,
    rate_per_s: float = 6.0,
    trace_block_size: int = 512,
    seed: int = 0,
) -> list[Row]:
    rng = random.Random(seed)
    prefix_blocks = -(-prefix_tokens // trace_block_size)
    question_blocks = -(-question_tokens // trace_block_size)
    weights = [1.0 / (rank + 1) for rank in range(groups)]
    next_id = groups * prefix_blocks
    rows: list[Row] = []
    now_ms = 0.0
    for _ in range(requests):
        group = rng.choices(range(groups), weights)[0]
        ids = [group * prefix_blocks + k for k in range(prefix_blocks)]
        # The question starts after the prefix's last (possibly partial) block: fresh blocks of its own.
        ids += range(next_id, next_id + question_blocks)
        next_id += question_blocks
        length = prefix_blocks * trace_block_size + question_tokens
        rows.append((round(now_ms), length, output_tokens, ids))
        now_ms += rng.expovariate(rate_per_s) * 1000.0
    return rows

"""Busy thresholds: when a dp rank is too loaded to be picked (§4.6) or to admit without queueing (§4.7).

Both checks read the load the router itself booked (`RankState`) plus, for decode, the KV usage the
worker reports. Pure functions of the config and those numbers; nothing here mutates state.
"""

from __future__ import annotations

from collections.abc import Iterable

from router.config import RouterConfig
from router.sequences import RankState
from router.types import WorkerConfig

__all__ = [
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "all_queue_busy",
    "busy_thresholds_configured",
    "rank_is_busy",
    "rank_is_queue_busy",
]

# Dynamo's stand-in when a worker does not report max_num_batched_tokens: large enough that the
# fractional checks never fire (`DEFAULT_MAX_TOKENS` in worker_monitor.rs, `DEFAULT_MAX_BATCHED_TOKENS`
# in scheduling/queue.rs).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 10_000_000


def busy_thresholds_configured(config: RouterConfig) -> bool:
    return (
        config.active_decode_blocks_threshold is not None
        or config.active_prefill_tokens_threshold is not None
        or config.active_prefill_tokens_threshold_frac is not None
    )


def rank_is_busy(config: RouterConfig, worker: WorkerConfig, rank: RankState, kv_used_blocks: int | None) -> bool:
    """§4.6: any configured threshold exceeded. A worker is overloaded only when all its ranks are."""
    prefill = rank.prefill_tokens
    absolute = config.active_prefill_tokens_threshold
    if absolute is not None and prefill > absolute:
        return True
    fraction = config.active_prefill_tokens_threshold_frac
    if fraction is not None:
        max_batched = worker.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        # Dynamo truncates the product to an integer token count before comparing.
        if prefill > int(fraction * max_batched):
            return True
    decode = config.active_decode_blocks_threshold
    total = worker.total_kv_blocks
    if decode is not None and total:
        # Dynamo keeps a latch per signal and clears it only when both signals are back under; as
        # each signal keeps its own latest value, the latch equals "either latest value is over".
        limit = decode * total
        return rank.decode_blocks > limit or (kv_used_blocks is not None and kv_used_blocks > limit)
    return False


def rank_is_queue_busy(config: RouterConfig, worker: WorkerConfig, rank: RankState) -> bool:
    """§4.7: the rank's pending prefill exceeds ``router_queue_threshold * max_num_batched_tokens``."""
    threshold = config.router_queue_threshold
    if threshold is None:
        return False
    max_batched = worker.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
    return rank.prefill_tokens > threshold * max_batched


def all_queue_busy(config: RouterConfig, pairs: Iterable[tuple[WorkerConfig, RankState]]) -> bool:
    """True when there is at least one rank and every one is queue-busy (none: not busy, so the
    request falls through to the no-eligible-worker error instead of waiting)."""
    checked = False
    for worker, rank in pairs:
        if not rank_is_queue_busy(config, worker, rank):
            return False
        checked = True
    return checked

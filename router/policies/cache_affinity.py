"""The `cache_affinity` policy: the rank where this prompt's prefill would start and finish soonest,
with cache misses priced above queueing.

Every term is in prefill tokens, a proxy for time on a homogeneous fleet::

    cost(w) = A_p(w)                                  queued prefill: booked, not yet marked prefilled
            + m * max(isl - cached(w), 0)             this prompt's uncached tokens, weighted by m
            + g * bs * D(w)                           active decode context slowing w's passes

``cached(w)`` is the effective cached prefix (device blocks plus weighted lower-tier blocks, as for
`dynamo`) and, with ``affinity_predict_inflight``, at least the prefix of this prompt that requests
already booked on w hold: those blocks will be in w's cache by the time this prompt's prefill runs
there, though the engine has not reported them yet. The lowest cost wins; ties are broken uniformly
at random.

Why not Dynamo's cost: Dynamo adds every active block of the rank (D) at full weight to a prefill
term that is at most a prompt's length, so on long-context traffic a rank holding one active request
looks as busy as a whole uncached prompt and conversations lose their cache to balancing. Here the
decode term only prices the slowdown of w's passes, and a miss costs ``m`` times its tokens because
a miss also spends cache space a repeat of the prompt would have used. Measured in
docs/routing-quality.md (m = 3, g = 0.05): on the Mooncake conversation trace with 8 workers the engine
hit rate rises from 0.192 to 0.258 and TTFT p90 falls by 8%.
"""

from __future__ import annotations

import random

from router.config import RouterConfig
from router.overlap import NO_OVERLAP
from router.policies.base import Selection, SelectionContext, SelectionPolicy
from router.policies.dynamo import lowest_cost_selection, with_taint_multipliers

__all__ = ["CacheAffinityPolicy"]


class CacheAffinityPolicy(SelectionPolicy):
    name = "cache_affinity"

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        self._miss_weight = config.affinity_miss_weight
        self._decode_tokens = config.affinity_decode_weight * config.block_size
        self._predict_inflight = config.affinity_predict_inflight
        self._rng = rng

    def costs(self, context: SelectionContext) -> list[float]:
        """Every candidate's cost in prefill tokens, in candidate order. O(candidates)."""
        isl = context.isl_tokens
        block_size = context.block_size
        overlaps = context.overlaps
        depths = context.depths if self._predict_inflight else {}
        miss_weight = self._miss_weight
        decode_tokens = self._decode_tokens
        costs = []
        for rank in context.ranks:
            cached = overlaps.get(rank.key, NO_OVERLAP).cached_tokens
            inflight = depths.get(rank, 0) * block_size
            if inflight > cached:
                cached = inflight
            costs.append(rank.prefill_tokens + miss_weight * max(isl - cached, 0) + decode_tokens * rank.decode_blocks)
        return with_taint_multipliers(costs, context)

    def select(self, context: SelectionContext) -> Selection:
        return lowest_cost_selection(self.costs(context), self._rng, "soonest prefill", "tokens")

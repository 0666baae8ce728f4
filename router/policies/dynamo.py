"""The `dynamo` policy: NVIDIA Dynamo 1.6.1's default worker selector, exactly (§4.2, §4.3).

For each candidate w (all quantities in blocks of ``block_size`` tokens)::

    raw_prefill(w) = (A_p(w) + max(isl - cached(w), 0) + cached(w)) / bs     (0 without prefill tracking)
    decay(w)       = 1 / (1 + d * ((A_p(w) - min_v A_p(v)) / bs) / ceil(isl / bs))   (1 when d = 0)
    credit(w)      = c * decay(w) * device(w) + w_host * host(w) + w_disk * disk(w)
    cost(w)        = s * max(0, raw_prefill(w) - credit(w)) + D(w) + r * R(w)
    cost(w)       *= exp(-tanh(sum of matching preferred-taint weights))      (if the request prefers any)

with c = overlap_score_credit, d = overlap_score_credit_decay, s = prefill_load_scale,
r = decode_active_request_weight, D = potential decode blocks, R = active requests. At temperature 0
the lowest cost wins, ties uniformly at random; above 0 a softmax over range-normalized costs draws the
winner. Float operations follow `scheduling/selector/default.rs` in order, so costs are bit-identical.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from router.config import RouterConfig
from router.native import ENABLED as NATIVE
from router.native import accel
from router.overlap import NO_OVERLAP
from router.policies.base import Selection, SelectionContext, SelectionPolicy
from router.sequences import RankState

__all__ = [
    "DynamoPolicy",
    "lowest_cost_index",
    "lowest_cost_selection",
    "python_costs",
    "softmax_probabilities",
    "softmax_sample_index",
    "with_taint_multipliers",
]


class DynamoPolicy(SelectionPolicy):
    name = "dynamo"

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        self._rng = rng

    def costs(self, context: SelectionContext) -> list[float]:
        """Every candidate's cost, in candidate order. O(candidates); one C call with the accelerator."""
        if NATIVE and isinstance(context.overlaps, dict) and isinstance(context.depths, dict):
            config = context.config
            costs = accel.dynamo_costs(
                context.ranks,
                context.overlaps,
                context.depths,
                context.isl_tokens,
                context.block_size,
                context.booked_blocks,
                context.track_prefill_tokens,
                config.overlap_score_credit,
                config.overlap_score_credit_decay,
                config.host_cache_hit_weight,
                config.disk_cache_hit_weight,
                config.prefill_load_scale,
                config.decode_active_request_weight,
                context.taint_multipliers,
            )
            if costs is not None:
                return costs
        return python_costs(context)

    def select(self, context: SelectionContext) -> Selection:
        costs = self.costs(context)
        temperature = context.config.router_temperature
        if temperature == 0.0:
            index, ties = lowest_cost_index(costs, self._rng)
            reason = f"lowest cost {costs[index]:.3f}"
            if ties > 1:
                reason += f", tied with {ties - 1} other(s); picked uniformly at random"
            return Selection(index, reason, costs)
        probabilities = softmax_probabilities(costs, temperature)
        index = softmax_sample_index(probabilities, self._rng.random())
        reason = f"softmax at temperature {temperature} drew cost {costs[index]:.3f} (p={probabilities[index]:.3f})"
        return Selection(index, reason, costs, probabilities)


def python_costs(context: SelectionContext) -> list[float]:
    """The dynamo policy's costs in Python: the twin of `router._native.dynamo_costs`."""
    config = context.config
    block_size = context.block_size
    isl = context.isl_tokens
    track_prefill = context.track_prefill_tokens
    ranks = context.ranks
    overlaps = context.overlaps
    depths = context.depths
    booked = context.booked_blocks
    multipliers = context.taint_multipliers
    credit = config.overlap_score_credit
    decay_rate = config.overlap_score_credit_decay
    host_weight = config.host_cache_hit_weight
    disk_weight = config.disk_cache_hit_weight
    scale = config.prefill_load_scale
    request_weight = config.decode_active_request_weight
    decays = track_prefill and decay_rate > 0.0
    floor_tokens = min(rank.prefill_tokens for rank in ranks) if decays else 0
    request_blocks = -(-isl // block_size)

    def cost(index: int, rank: RankState) -> float:
        overlap = overlaps.get(rank.key, NO_OVERLAP)
        if track_prefill:
            cached = overlap.cached_tokens
            raw_prefill = (rank.prefill_tokens + max(isl - cached, 0) + cached) / block_size
        else:
            raw_prefill = 0.0
        device_credit = credit
        if decays:
            backlog = (rank.prefill_tokens - floor_tokens) / block_size / request_blocks
            device_credit = credit * (1.0 / (1.0 + decay_rate * backlog))
        overlap_credit = (
            device_credit * overlap.device_blocks
            + host_weight * overlap.host_blocks
            + disk_weight * overlap.disk_blocks
        )
        value = (
            scale * max(raw_prefill - overlap_credit, 0.0)
            + float(rank.decode_blocks + booked - depths.get(rank, 0))
            + request_weight * rank.requests
        )
        return value if multipliers is None else value * multipliers[index]

    if not track_prefill or multipliers is not None:
        return [cost(index, rank) for index, rank in enumerate(ranks)]
    # Most ranks of a fleet hold no prefix of the prompt, cached or active. For them the formula is
    # s * (A_p + isl) / bs + (D + booked) + r * R through the same float operations (the credit is
    # 0.0), so they are scored in one comprehension and the others patched in.
    costs = [
        scale * ((rank.prefill_tokens + isl) / block_size)
        + float(rank.decode_blocks + booked)
        + request_weight * rank.requests
        for rank in ranks
    ]
    if overlaps or depths:
        for index, rank in enumerate(ranks):
            if rank.key in overlaps or rank in depths:
                costs[index] = cost(index, rank)
    return costs


def lowest_cost_index(costs: Sequence[float], rng: random.Random) -> tuple[int, int]:
    """The lowest cost's index and how many candidates share it; each tied candidate wins with
    probability 1/ties, as with Dynamo's reservoir sampling in `minimum_cost_index`."""
    if NATIVE and type(costs) is list:
        found = accel.lowest_cost(costs)
        if found is not None and found[1] == 1:
            return found
    lowest = min(costs)
    ties = [index for index, cost in enumerate(costs) if cost == lowest]
    return (ties[0] if len(ties) == 1 else ties[rng.randrange(len(ties))]), len(ties)


def with_taint_multipliers(costs: list[float], context: SelectionContext) -> list[float]:
    """The costs scaled by the request's preferred-taint multipliers, when it has any (§4.4)."""
    if context.taint_multipliers is None:
        return costs
    return [cost * multiplier for cost, multiplier in zip(costs, context.taint_multipliers, strict=True)]


def lowest_cost_selection(costs: list[float], rng: random.Random, what: str, unit: str) -> Selection:
    """Pick the lowest cost (ties uniformly at random), explained as ``"<what>: cost N <unit>"``."""
    index, ties = lowest_cost_index(costs, rng)
    reason = f"{what}: cost {costs[index]:.0f} {unit}"
    if ties > 1:
        reason += f", tied with {ties - 1} other(s); picked uniformly at random"
    return Selection(index, reason, costs)


def softmax_probabilities(costs: Sequence[float], temperature: float) -> list[float]:
    """``p ∝ exp(-(cost - min) / ((max - min) * T))``, uniform when all costs are equal (§4.3)."""
    low = min(costs)
    high = max(costs)
    if low == high:
        return [1.0 / len(costs)] * len(costs)
    # Dynamo rescales by the largest magnitude when the range overflows to infinity.
    magnitude = 1.0 if math.isfinite(high - low) else max(abs(low), abs(high))
    low_normalized = low / magnitude
    scale = -1.0 / ((high / magnitude - low_normalized) * temperature)
    offset = low_normalized * scale
    weights = [math.exp(cost / magnitude * scale - offset) for cost in costs]
    total = sum(weights)
    return [weight / total for weight in weights]


def softmax_sample_index(probabilities: Sequence[float], sample: float) -> int:
    """The first index whose cumulative probability reaches ``sample`` in [0, 1)."""
    cumulative = 0.0
    for index, probability in enumerate(probabilities):
        cumulative += probability
        if sample <= cumulative:
            return index
    return len(probabilities) - 1

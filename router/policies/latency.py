"""The `latency` policy: the rank where the request's whole response, first token to last, costs the
fleet least time, counting what it does to the requests already there.

Every term is in prefill tokens, a proxy for time on a homogeneous fleet::

    cost(w) = p * (A_p(w) + m(w) * miss(w)     its time to first token: queued prefill, then its own
            + s * miss(w) * R(w)               its prefill stalls the R(w) requests decoding on w
            + u * miss(w) * S(w)               ... and the more so those with short answers (u 0: off)
            + b * (N(w) + n(w) * (s * R(w) + u * S(w))))  a pass's fixed time: to it, each pass until
                                               its prefill is done; to each request decoding on w, each
                                               pass its prefill adds to w's queue
            + d * osl * (K(w) + e * isl * R(w))  each of its output tokens slowed by w's context in
                                               flight, and each of theirs by its own (e 0: off)

    d       = d0 + d_load * mean R             the fleet's load raises the decode weight (d_load 0: fixed)

    m(w)    = 1 + (m - 1) * fill(w)            a miss costs more than its time only when storing it evicts

    N(w)    = ceil((A_p(w) + max(miss(w), 1)) / P(w)),   n(w) = N(w) - ceil(A_p(w) / P(w))
                                               with P(w) w's pass budget (``max_num_batched_tokens``);
                                               where w did not say it, the mean of the candidates'
                                               that did; where none did, one pass: N(w) = 1, and
                                               n(w) = 1 when nothing is queued there (else 0)

Dynamo's cost knobs weigh the same parts here, so that a request's `RouterConfigOverride`, the proxy's
pooling requests and the disaggregated decode pool without overlap credit work under either policy:
``p`` (``prefill_load_scale``, 1) weighs the prefill lines against the decode line (0: decode load
alone); ``overlap_score_credit`` (1) scales what counts as cached, every tier and prefixes in flight
(unlike Dynamo, which credits device blocks only), and at 0 the cache counts for nothing, neither its
hits nor the eviction a miss causes (m(w) = 1); without ``router_track_prefill_tokens`` the queued
prefill ``A_p(w)`` is not counted (the bookings carry none). A disaggregated request's prefill leg
decodes nothing where it is placed, so it is priced by the first line alone: queued prefill, its
misses and the passes it waits for (the prefill pool as Dynamo prices it with `router_track_active_blocks`
off, and the passes).

``miss(w) = max(isl - cached(w), 0)`` with ``cached(w)`` the effective cached prefix, or what requests
already booked on w hold of the prompt when that is longer and w has at least a pass
(``max_num_batched_tokens``) of prefill queued (or no candidate said a pass budget). The engine would reuse
a prefix in flight even sooner (it shares the blocks a pass allocates with requests admitted in that pass
or later); pricing it as a miss while its holder has less than a pass queued is a choice of when a
burst is spread, see below;
``K(w)`` the context of w's active requests, prompt and the tokens generated so far (told by
`KvRouter.record_output`), each counted in full (a decode step reads every sequence's context);
``osl`` the request's expected output tokens, or ``latency_default_output_tokens`` when it carries none;
``fill(w)`` the fraction of w's KV blocks (``total_kv_blocks``) its cache holds by the index (for a
worker that did not say how many it has, the mean of the candidates that did; 1 when none did).
Lowest cost wins (a near-tie to the rank holding more of the prompt, below), exact ties uniformly at
random.

Why these terms: an engine pass runs the scheduled prefill chunks and one decode step for every running
sequence, so each prefill token placed on w delays each of w's running requests by about one prefill
token's time (``s`` = 1 is that cost); and a decode step's duration grows with the KV it reads, so each
output token of a request on w costs in proportion to w's context (``d`` = 0.0034 is the ratio of the
per-context-token decode cost to the per-token prefill cost for an engine whose step grows by 54 ms over
a 1 M-token pool and which prefills a token in 0.015 ms, Dynamo's mocker fit). A pass that runs prefill
also costs a fixed time beside its tokens' (``b`` = 1,087 tokens is Dynamo's mocker fit, 16.5 ms at
0.0152 ms a token): a request waits for it in every pass until its prefill is done, and each pass it
adds to w's queue stalls every request decoding on w once more, while one whose prefill fits in the
passes already queued there adds none (a full hit still computes its last token). Pricing it gathers the
prefills that arrive together, a burst above all, into fewer passes on fewer ranks, where spreading them
would stall the decoders of every rank once each. The router cannot tell a pass under way from the
next one: it counts all queued prefill as joinable, which holds for requests that arrive together (a
burst routed before the engine starts its pass) and overstates the sharing for one that arrives while a
pass runs (counting the first pass's worth as under way lost the bursty workload's whole gain: seed 1's
capacity 1.50 against 1.79, docs/routing-quality.md). On a full cache a miss costs ``m`` > 1 times its
tokens because storing it evicts blocks a repeat of some prompt would have reused; on a cache with room
it costs only its time, so a hot prefix is copied to another rank rather than queued behind its holder.

The defaults are m = 6, s = 0.2, d = 0.0012, e = 1, b = 2,000 (above its fit, chosen as the others were)
and the decode side per token (below), s and d well below those physical ratios: the physical weights
minimize the total latency of the requests in flight now, but a request sent away from its cached prefix
also stores that prefix a second time and evicts what later requests would have reused, which the p90s
of a whole run pay for. They were chosen by the traffic a fleet carries at a TTFT and ITL bound, on the
shared traces and the generated workloads (docs/routing-quality.md; `kv-router tune` searches on a trace
of your own). Counting a prefix in flight only behind a pass of queued prefill spreads a burst sharing a
short template over the fleet in the burst's first pass, while a copy of the template costs no waiting;
counted at once, the burst's first requests queue behind the template's holder and the copies are made
later anyway, as its queue grows. Counting it only behind a pass: the same hit rate and a TTFT p90 15 %, 15 % and 10 %
lower (bursty workload, seeds 0, 1 and 3), an E2E p90 3 % lower on mooncake_trace_1000.
Near-ties go to the hit rate: a rank within ``latency_hit_margin`` (5 %) of the least cost wins when it
holds more of the prompt (computed or in flight), since two costs that close are the same latency for
this request but a copy of the prefix is cache space later requests pay for (SGLang GSP's TTFT and E2E
p90, RAG's E2E p90 and mooncake_trace_1000's hit rate on the tuning runs).
``S(w)`` counts the requests decoding on w (prefill done), each ``latency_default_output_tokens`` over its
own expected output length (one without a length counts 1, a single-token one 0): a stall of t ms adds
t / length to a request's mean inter-token latency, so short answers are the ones an ITL bound catches.
With ``latency_decode_per_token`` ``osl`` is ``latency_default_output_tokens`` for every request: the
decode side priced per output token, as an ITL bound sees it, rather than per response (which sends short
answers, the ones a stall pushes over an ITL bound, to the ranks with the most context).
``e`` (``latency_decode_others_weight``) prices the other side of the decode term: this request's context
``isl`` is read by every decode step of the R(w) requests on w for as long as it runs; 1 prices both sides
alike, which spreads long contexts over ranks with few requests (the capacity table in
docs/routing-quality.md).
With ``latency_decode_load_weight`` (``d_load``) the decode weight grows with the requests in flight per
candidate rank: at light load the policy keeps the hits, near saturation, where a decode step's length
(the ITL bound of a capacity SLO) binds first, it spreads context as `dynamo` does. Off by default.
`cache_affinity` is the first line alone (without the pass term) with a small decode term: it piles hot
prefixes onto few ranks, whose decoding then slows every token of every request there.
"""

from __future__ import annotations

import random
from typing import NamedTuple

from router.config import RouterConfig
from router.native import ENABLED as NATIVE
from router.native import accel
from router.overlap import NO_OVERLAP, round_half_away
from router.policies.base import Selection, SelectionContext, SelectionPolicy
from router.policies.dynamo import lowest_cost_selection, with_taint_multipliers

__all__ = ["CostWeights", "LatencyPolicy", "python_costs_and_held"]


class CostWeights(NamedTuple):
    """A request's weights of the cost (module doc); C's `latency_costs` takes them in this order."""

    credit: float  # overlap_score_credit
    prefill_scale: float  # p
    extra_miss_weight: float  # m - 1 (0 without credit: the cache counts for nothing)
    stall_weight: float  # s
    itl_stall_weight: float  # u
    decode_weight: float  # d * osl
    others_weight: float  # e
    pass_base: float  # b


def _passes(tokens: int, budget: int) -> int:
    """The engine passes ``tokens`` of prefill take at ``budget`` tokens a pass."""
    return -(-tokens // budget)


def python_costs_and_held(
    context: SelectionContext, weights: CostWeights, default_output: int
) -> tuple[list[float], list[int]]:
    """The costs before taint multipliers, and per candidate the tokens of the prompt it holds, computed
    or in flight: the spec of C's `latency_costs` (the same float operations in the same order)."""
    (
        credit,
        prefill_scale,
        extra_miss_weight,
        stall_weight,
        itl_stall_weight,
        decode_weight,
        others_weight,
        pass_base,
    ) = weights
    isl = context.isl_tokens
    block_size = context.block_size
    overlaps = context.overlaps
    depths = context.depths
    track_prefill = context.track_prefill_tokens
    fills = context.cache_fill
    pass_tokens = context.pass_tokens or {}
    costs = []
    held = []
    for rank in context.ranks:
        cached = overlaps.get(rank.key, NO_OVERLAP).cached_tokens
        inflight = depths.get(rank, 0) * block_size
        if credit != 1.0:
            cached = round_half_away(credit * cached)
            inflight = round_half_away(credit * inflight)
        held.append(max(cached, inflight))
        queued = rank.prefill_tokens if track_prefill else 0
        budget = pass_tokens.get(rank.key, 0)
        if inflight > cached and queued >= budget:
            # The prefix is booked there but not computed yet. Behind a pass of queued prefill the
            # request waits anyway and reuses it; with less, a copy elsewhere costs no waiting, and
            # pricing it as a miss spreads a burst in its first pass (module doc).
            cached = inflight
        miss = max(isl - cached, 0)
        fill = 1.0 if fills is None else fills.get(rank.key, 0.0)
        stalled = stall_weight * rank.requests
        if itl_stall_weight:
            # Each decoding request counts default / its own output length: a short one's ITL pays more of it.
            short = default_output * rank.decoding_inverse_output + rank.decoding_untold
            stalled += itl_stall_weight * short
        waited = added = 0
        if pass_base:
            if budget > 0:
                # The passes until its prefill is done, and those it adds to w's queue (a full hit still
                # computes a token).
                waited = _passes(queued + max(miss, 1), budget)
                added = waited - _passes(queued, budget)
            else:
                # No budget said: what is queued there is one pass, which it joins or starts.
                waited = 1
                added = 0 if queued > 0 else 1
        costs.append(
            prefill_scale
            * (queued + (1.0 + extra_miss_weight * fill + stalled) * miss + pass_base * (waited + added * stalled))
            + decode_weight * (rank.context_tokens + others_weight * isl * rank.requests)
        )
    return costs, held


class LatencyPolicy(SelectionPolicy):
    name = "latency"
    uses_cache_fill = True
    uses_context_in_flight = True

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        self._miss_weight = config.latency_miss_weight
        self._stall_weight = config.latency_stall_weight
        self._decode_weight = config.latency_decode_weight
        self._decode_load_weight = config.latency_decode_load_weight
        self._decode_others_weight = config.latency_decode_others_weight
        self._decode_per_token = config.latency_decode_per_token
        self._itl_stall_weight = config.latency_itl_stall_weight
        self._pass_base = float(config.latency_pass_base_tokens)  # an int would send C back to Python
        self._default_output = config.latency_default_output_tokens
        self._hit_margin = config.latency_hit_margin
        self._rng = rng

    def costs(self, context: SelectionContext) -> list[float]:
        """Every candidate's cost in prefill tokens, in candidate order. O(candidates)."""
        return self._costs_and_held(context)[0]

    def _costs_and_held(self, context: SelectionContext) -> tuple[list[float], list[int]]:
        """The costs, and per candidate the tokens of the prompt it holds, computed or in flight."""
        weights = self._weights(context)
        overlaps, depths, fills = context.overlaps, context.depths, context.cache_fill
        pass_tokens = context.pass_tokens or {}
        computed = None
        if NATIVE:  # None for what C was not written for (a dict subclass, an unbounded int): Python's answer
            computed = accel.latency_costs(
                context.ranks,
                overlaps,
                depths,
                fills,
                pass_tokens,
                context.isl_tokens,
                context.block_size,
                context.track_prefill_tokens,
                self._default_output,
                *weights,
            )
        if computed is None:
            computed = python_costs_and_held(context, weights, self._default_output)
        costs, held = computed
        return with_taint_multipliers(costs, context), held

    def _weights(self, context: SelectionContext) -> CostWeights:
        """The request's weights: its config's credit and prefill scale, the decode weight for its output
        and the fleet's load, the prefill leg's decode side off."""
        expected = context.expected_output_tokens
        per_token = self._decode_weight
        if self._decode_load_weight:
            ranks = context.ranks
            per_token += self._decode_load_weight * sum(rank.requests for rank in ranks) / len(ranks)
        # Per response the decode side is this request's whole output; per token, every request counts the
        # default length: what an ITL bound sees, the same for a short answer as for a long one.
        output = expected if expected is not None and not self._decode_per_token else self._default_output
        decode_weight = per_token * output
        stall_weight = self._stall_weight
        itl_stall_weight = self._itl_stall_weight
        if context.prefill_leg:
            stall_weight = decode_weight = itl_stall_weight = 0.0
        credit = context.config.overlap_score_credit
        return CostWeights(
            credit,
            context.config.prefill_load_scale,
            self._miss_weight - 1.0 if credit else 0.0,
            stall_weight,
            itl_stall_weight,
            decode_weight,
            self._decode_others_weight,
            self._pass_base,
        )

    def select(self, context: SelectionContext) -> Selection:
        costs, held = self._costs_and_held(context)
        low = min(costs)
        within = low * (1.0 + self._hit_margin)
        deepest = -1
        for index, cost in enumerate(costs):
            if cost <= within and (deepest < 0 or (held[index], -cost) > (held[deepest], -costs[deepest])):
                deepest = index
        least_held = max(held[index] for index, cost in enumerate(costs) if cost == low)
        if held[deepest] > least_held:
            reason = (
                f"deepest holder within {self._hit_margin:.0%} of the least latency: cost {costs[deepest]:.0f} "
                f"prefill tokens (least {low:.0f})"
            )
            return Selection(deepest, reason, costs)
        return lowest_cost_selection(costs, self._rng, "least latency", "prefill tokens")

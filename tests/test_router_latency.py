"""The `latency` policy (exact costs, the decode side, its knobs) and the load-model features it reads
or sits beside: per-request overrides, the prefill load model, the minimum workers at start."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mocker.config import EngineConfig
from mocker.report import summarize
from mocker.routers import make_router
from mocker.simulation import simulate
from mocker.trace import TraceOptions, build_trace
from mocker.workload import WORKLOADS
from router import KvRouter, RouteDecision, RouterConfig, RouteRequest, WorkerConfig
from router.errors import ConfigError, InvalidRequest
from router.types import RouterConfigOverride
from tests.dynamo_fleet import prompt_stored_event

BS = 16
X, Y = 11, 22
QUERY = list(range(1000, 1128))  # 8 blocks


def router_with(policy: str = "latency", clock: list[float] | None = None, **overrides: object) -> KvRouter:
    config = RouterConfig(block_size=BS, policy=policy, **overrides)  # type: ignore[arg-type]
    now = clock if clock is not None else [0.0]
    router = KvRouter(config, rng=random.Random(0), clock=lambda: now[0])
    router.register_worker(WorkerConfig(worker_id=X))
    router.register_worker(WorkerConfig(worker_id=Y))
    return router


def route(router: KvRouter, tokens: list[int], **fields: object) -> RouteDecision:
    return asyncio.run(router.new(RouteRequest(tokens=tokens, **fields), explain=True))  # type: ignore[arg-type]


def book_on(router: KvRouter, worker: int, request_id: str, tokens: list[int], **fields: object) -> None:
    request = RouteRequest(tokens=tokens, request_id=request_id, **fields)  # type: ignore[arg-type]
    asyncio.run(router.new(request, pinned_worker=(worker, 0)))


def costs(decision: RouteDecision) -> dict[int, float | None]:
    assert decision.explanation is not None
    return {candidate.worker_id: candidate.cost for candidate in decision.explanation.candidates}


# Round weights for costs worked out by hand, in the policy's first form: the decode side per response
# and for this request's own tokens only (the tests of the two other forms turn each on).
KNOBS = {
    "latency_miss_weight": 2.0,
    "latency_stall_weight": 0.5,
    "latency_decode_weight": 0.01,
    "latency_decode_others_weight": 0.0,
    "latency_decode_per_token": False,
    "latency_pass_base_tokens": 0.0,  # its own test below
}


def test_costs_price_the_prefill_its_stall_and_the_decode_side() -> None:
    router = router_with(**KNOBS)
    router.apply_event(prompt_stored_event(X, QUERY, BS, blocks=4))
    book_on(router, X, "busy", list(range(5000, 5064)))  # 64 queued prefill tokens, 64 context, 1 request
    decision = route(router, QUERY, expected_output_tokens=10)
    # X: queued 64 + (2 + 0.5 * 1 request) * 64 missed + 0.01 * 10 * 64 context in flight.
    # Y: 2 * 128 missed, nothing in flight. The workers did not say their capacity: caches count as full.
    assert costs(decision) == {X: pytest.approx(64 + 2.5 * 64 + 0.1 * 64), Y: 2.0 * 128}
    assert decision.worker_id == X


def test_the_decode_weight_grows_with_the_requests_in_flight_per_rank() -> None:
    router = router_with(**{**KNOBS, "latency_decode_load_weight": 0.002})
    router.apply_event(prompt_stored_event(X, QUERY, BS, blocks=4))
    book_on(router, X, "busy", list(range(5000, 5064)))  # 64 queued prefill tokens, 64 context, 1 request
    # One request over two ranks: d = 0.01 + 0.002 * 0.5, times 10 output tokens, times X's 64 of context.
    decision = route(router, QUERY, expected_output_tokens=10)
    assert costs(decision) == {X: pytest.approx(64 + 2.5 * 64 + 0.11 * 64), Y: 2.0 * 128}
    book_on(router, Y, "other", list(range(7000, 7032)))  # 32 queued, 32 context, 1 request
    # Two requests over two ranks: d = 0.01 + 0.002 * 1.0; Y now queues 32 and stalls its request too.
    decision = route(router, QUERY, expected_output_tokens=10)
    assert costs(decision) == {
        X: pytest.approx(64 + 2.5 * 64 + 0.12 * 64),
        Y: pytest.approx(32 + 2.5 * 128 + 0.12 * 32),
    }


def test_its_context_slowing_the_requests_already_there_is_priced_too() -> None:
    router = router_with(**{**KNOBS, "latency_decode_others_weight": 1.0})
    book_on(router, X, "busy", list(range(5000, 5064)))  # 64 tokens of context, 1 request, prefill done
    assert router.mark_prefill("busy")
    decision = route(router, QUERY, expected_output_tokens=10)
    # X: (2 + 0.5 * 1 request) * 128 missed + 0.01 * 10 * (64 of context + 1.0 * this prompt's 128 * 1 request).
    assert costs(decision) == {X: pytest.approx(2.5 * 128 + 0.1 * (64 + 128)), Y: 2.0 * 128}
    book_on(router, Y, "a", list(range(6000, 6016)))  # Y: 2 requests of 16 tokens each, prefill done
    book_on(router, Y, "b", list(range(7000, 7016)))
    assert router.mark_prefill("a") and router.mark_prefill("b")
    decision = route(router, QUERY, expected_output_tokens=10)
    # Y has less context (32 against 64) but two requests to slow: the term sends the prompt to X.
    assert costs(decision) == {
        X: pytest.approx(2.5 * 128 + 0.1 * (64 + 128)),
        Y: pytest.approx(3.0 * 128 + 0.1 * (32 + 2 * 128)),
    }
    assert decision.worker_id == X
    without = router_with(**KNOBS)
    for worker, request_id, start, length in ((X, "busy", 5000, 64), (Y, "a", 6000, 16), (Y, "b", 7000, 16)):
        book_on(without, worker, request_id, list(range(start, start + length)))
        assert without.mark_prefill(request_id)
    assert costs(route(without, QUERY, expected_output_tokens=10)) == {
        X: pytest.approx(2.5 * 128 + 0.1 * 64),
        Y: pytest.approx(3.0 * 128 + 0.1 * 32),
    }


def test_per_token_the_decode_side_is_the_same_for_a_short_answer_as_for_a_long_one() -> None:
    def fleet(**overrides: object) -> KvRouter:
        router = router_with(**{**KNOBS, **overrides})
        router.apply_event(prompt_stored_event(X, QUERY, BS, blocks=4))  # X holds half the prompt
        book_on(router, X, "busy", list(range(5000, 5064)))  # and 64 tokens of context in flight
        assert router.mark_prefill("busy")
        return router

    # Per response, a 10-token answer weighs X's context 0.01 * 10 and stays with the cached half.
    decision = route(fleet(), QUERY, expected_output_tokens=10)
    assert costs(decision) == {X: pytest.approx(2.5 * 64 + 0.1 * 64), Y: 2.0 * 128}
    assert decision.worker_id == X
    # Per token, every answer weighs it 0.01 * 200 (the default length), a short one as a long one.
    router = fleet(latency_decode_per_token=True, latency_default_output_tokens=200)
    for expected in (10, 4000):
        decision = route(router, QUERY, expected_output_tokens=expected)
        assert costs(decision) == {X: pytest.approx(2.5 * 64 + 2.0 * 64), Y: 2.0 * 128}
        assert decision.worker_id == Y


def test_a_stall_weighs_on_each_decoding_request_by_how_short_its_answer_is() -> None:
    router = router_with(**{**KNOBS, "latency_itl_stall_weight": 1.0, "latency_default_output_tokens": 128})
    book_on(router, X, "short", list(range(5000, 5064)), expected_output_tokens=32)
    book_on(router, Y, "long", list(range(6000, 6064)), expected_output_tokens=512)
    # Both still prefilling: nobody decodes yet, so only the stall per request counts.
    assert costs(route(router, QUERY, expected_output_tokens=10)) == {
        X: pytest.approx(64 + 2.5 * 128 + 0.1 * 64),
        Y: pytest.approx(64 + 2.5 * 128 + 0.1 * 64),
    }
    assert router.mark_prefill("short") and router.mark_prefill("long")
    decision = route(router, QUERY, expected_output_tokens=10)
    # Decoding: X's request counts 128 / 32 = 4, Y's 128 / 512 = 0.25.
    assert costs(decision) == {X: pytest.approx((2.5 + 4) * 128 + 6.4), Y: pytest.approx((2.5 + 0.25) * 128 + 6.4)}
    assert decision.worker_id == Y
    # A request that gave no length counts as one of the default length; a single-token one (a
    # disaggregated prefill) as none.
    book_on(router, Y, "untold", list(range(7000, 7064)))
    book_on(router, Y, "prefill-only", list(range(8000, 8064)), expected_output_tokens=1)
    assert router.mark_prefill("untold") and router.mark_prefill("prefill-only")
    assert costs(route(router, QUERY, expected_output_tokens=10))[Y] == pytest.approx(
        (2 + 0.5 * 3 + 0.25 + 1) * 128 + 0.1 * 192
    )
    assert router.mark_free("short")
    assert costs(route(router, QUERY, expected_output_tokens=10))[X] == 2.0 * 128  # X idle again


def latency_fleet(*workers: WorkerConfig) -> KvRouter:
    """A `latency` router with the round `KNOBS`, and these workers."""
    router = KvRouter(RouterConfig(block_size=BS, policy="latency", **KNOBS), rng=random.Random(0))  # type: ignore[arg-type]
    for worker in workers:
        router.register_worker(worker)
    return router


def test_a_miss_costs_its_time_on_an_empty_cache_and_more_as_the_cache_fills() -> None:
    router = latency_fleet(WorkerConfig(worker_id=X, total_kv_blocks=16), WorkerConfig(worker_id=Y, total_kv_blocks=16))
    router.apply_event(prompt_stored_event(X, QUERY, BS, blocks=4))  # X's cache is a quarter full
    decision = route(router, QUERY, expected_output_tokens=10)
    assert costs(decision) == {X: (1 + 1.0 * 0.25) * 64, Y: 1.0 * 128}
    router.apply_event(prompt_stored_event(Y, list(range(9000, 9256)), BS, event_id=2))  # Y's is full
    assert costs(route(router, QUERY, expected_output_tokens=10)) == {X: (1 + 1.0 * 0.25) * 64, Y: 2.0 * 128}


def test_a_worker_of_unknown_capacity_is_as_full_as_those_that_said_theirs() -> None:
    router = latency_fleet(WorkerConfig(worker_id=X, total_kv_blocks=16), WorkerConfig(worker_id=Y))  # Y did not say
    router.apply_event(prompt_stored_event(X, QUERY, BS, blocks=4))  # X's cache is a quarter full
    # Y is priced a quarter full too: 128 missed at (1 + 1.0 * 0.25), not at a full cache's 2.
    assert costs(route(router, QUERY, expected_output_tokens=10)) == {X: (1 + 1.0 * 0.25) * 64, Y: 1.25 * 128}
    lone = latency_fleet(WorkerConfig(worker_id=Y))
    assert costs(route(lone, QUERY, expected_output_tokens=10)) == {Y: 2.0 * 128}  # nobody said: full


def fleet_with_pass_budget(tokens: int) -> KvRouter:
    return latency_fleet(*(WorkerConfig(worker_id=worker, max_num_batched_tokens=tokens) for worker in (X, Y)))


def test_a_prefix_in_flight_counts_only_behind_a_pass_of_queued_prefill() -> None:
    # The holder's 64 tokens are all X has queued, less than a pass (128): the prefix in flight is
    # priced as a miss, so that a burst spreads in its first pass.
    router = fleet_with_pass_budget(128)
    book_on(router, X, "holder", QUERY[:64])
    assert costs(route(router, QUERY, expected_output_tokens=10)) == {
        X: pytest.approx(64 + 2.5 * 128 + 0.1 * 64),
        Y: 2.0 * 128,
    }
    # A full pass queued on X: the request is admitted after the holder's prefix is computed.
    router = fleet_with_pass_budget(128)
    book_on(router, X, "holder", QUERY[:64])
    book_on(router, X, "other", list(range(7000, 7064)))
    assert costs(route(router, QUERY, expected_output_tokens=10)) == {
        X: pytest.approx(128 + (2 + 0.5 * 2) * 64 + 0.1 * 128),
        Y: 2.0 * 128,
    }
    # A worker that does not say its pass budget: the prefix in flight counts as cached.
    router = router_with(**KNOBS)
    book_on(router, X, "holder", QUERY[:64])
    assert costs(route(router, QUERY, expected_output_tokens=10))[X] == pytest.approx(64 + 2.5 * 64 + 0.1 * 64)


def test_a_prefill_pass_costs_its_fixed_time_to_the_request_and_each_pass_it_adds_to_the_decoders_there() -> None:
    def fleet(base: float) -> KvRouter:
        router = KvRouter(
            RouterConfig(block_size=BS, policy="latency", **{**KNOBS, "latency_pass_base_tokens": base}),  # type: ignore[arg-type]
            rng=random.Random(0),
        )
        for worker in (X, Y):
            router.register_worker(WorkerConfig(worker_id=worker, max_num_batched_tokens=256))
        book_on(router, X, "prefilling", list(range(5000, 5064)))  # 64 tokens queued: a pass under way
        book_on(router, Y, "decoding", list(range(7000, 7064)))
        assert router.mark_prefill("decoding")  # Y runs decode steps only
        return router

    # X: QUERY's 128 tokens fit in the pass X runs anyway: one pass waited for, none added.
    # Y: a pass of its own, waited for by QUERY and stalling Y's decoding request (stall weight 0.5).
    decision = route(fleet(200.0), QUERY, expected_output_tokens=10)
    assert costs(decision) == {
        X: pytest.approx(64 + 2.5 * 128 + 200.0 * 1 + 0.1 * 64),
        Y: pytest.approx(2.5 * 128 + 200.0 * (1 + 1 * 0.5) + 0.1 * 64),
    }
    assert decision.worker_id == X
    # Without the pass term Y, with nothing queued, is cheaper.
    assert route(fleet(0.0), QUERY, expected_output_tokens=10).worker_id == Y
    # A queue that fills its pass: QUERY waits for two passes on X and adds one.
    router = fleet(200.0)
    book_on(router, X, "more", list(range(6000, 6192)))
    assert costs(route(router, QUERY, expected_output_tokens=10))[X] == pytest.approx(
        256 + (2 + 0.5 * 2) * 128 + 200.0 * (2 + 1 * 0.5 * 2) + 0.1 * 256
    )
    # A full hit still computes a token: one pass of its own on Y, which holds the whole prompt.
    router = fleet(200.0)
    router.apply_event(prompt_stored_event(Y, QUERY, BS, blocks=8))
    assert costs(route(router, QUERY, expected_output_tokens=10))[Y] == pytest.approx(200.0 * 1.5 + 0.1 * 64)


def test_a_worker_that_does_not_say_its_pass_budget_is_priced_with_the_others_mean() -> None:
    """No discount over the workers that said theirs: its passes counted with their mean budget, or,
    when none said one, its queue taken for one pass, which the request joins or starts."""

    def fleet(*budgets: int | None) -> KvRouter:
        router = KvRouter(
            RouterConfig(block_size=BS, policy="latency", **{**KNOBS, "latency_pass_base_tokens": 200.0}),  # type: ignore[arg-type]
            rng=random.Random(0),
        )
        for worker, budget in zip((X, Y), budgets, strict=True):
            router.register_worker(WorkerConfig(worker_id=worker, max_num_batched_tokens=budget))
        return router

    # Y did not say: priced with X's 64 tokens a pass, QUERY's 128 take two passes on either.
    router = fleet(64, None)
    assert costs(route(router, QUERY, expected_output_tokens=10)) == {X: 2.0 * 128 + 400.0, Y: 2.0 * 128 + 400.0}
    for worker in (X, Y):
        book_on(router, worker, f"queued-{worker}", list(range(5000 + worker * 100, 5000 + worker * 100 + 96)))
    # 96 queued on each (two passes of 64, the second with room for 32): QUERY waits for four passes and
    # adds two, stalling the queued request on each.
    queued = costs(route(router, QUERY, expected_output_tokens=10))
    assert queued == {worker: pytest.approx(96 + 2.5 * 128 + 200.0 * (4 + 2 * 0.5) + 0.1 * 96) for worker in (X, Y)}
    # Nobody said: one pass each, joined where something is queued.
    router = fleet(None, None)
    book_on(router, Y, "prefilling", list(range(5000, 5064)))
    assert costs(route(router, QUERY, expected_output_tokens=10)) == {
        X: 2.0 * 128 + 200.0,
        Y: pytest.approx(64 + 2.5 * 128 + 200.0 + 0.1 * 64),
    }


@pytest.mark.parametrize(("busy_tokens", "margin", "chosen"), [(96, 0.05, X), (96, 0.0, Y), (112, 0.05, Y)])
def test_a_near_tie_goes_to_the_rank_holding_more_of_the_prompt(busy_tokens: int, margin: float, chosen: int) -> None:
    router = router_with(latency_hit_margin=margin, **KNOBS)
    router.apply_event(prompt_stored_event(X, QUERY, BS, blocks=4))
    book_on(router, X, "busy", list(range(5000, 5000 + busy_tokens)))
    decision = route(router, QUERY, expected_output_tokens=10)
    # X: queued + 2.5 * 64 missed + 0.1 * context; Y: 2 * 128 missed. X is 3.75 % (96) or 10.6 % (112) dearer.
    assert costs(decision) == {X: pytest.approx(1.1 * busy_tokens + 160), Y: 256.0}
    assert decision.worker_id == chosen


def test_per_response_long_outputs_leave_a_rank_full_of_context_short_ones_stay() -> None:
    router = router_with(
        latency_stall_weight=0.05, latency_decode_weight=0.0004, latency_decode_others_weight=0.0,
        latency_decode_per_token=False,
    )  # fmt: skip
    router.apply_event(prompt_stored_event(X, QUERY, BS))
    for i in range(4):  # 4 requests, 32k tokens of context in flight on X, their prefill done
        book_on(router, X, f"ctx{i}", list(range(10_000 * (i + 1), 10_000 * (i + 1) + 8192)))
        assert router.mark_prefill(f"ctx{i}")
    assert route(router, QUERY, expected_output_tokens=16).worker_id == X
    assert route(router, QUERY, expected_output_tokens=4000).worker_id == Y


def test_generated_tokens_join_the_context_in_flight_the_decode_term_prices() -> None:
    router = router_with(**KNOBS)  # output blocks not tracked: Dynamo's load stays as it was
    book_on(router, X, "long", list(range(5000, 5064)))  # 64 tokens of context in flight on X
    book_on(router, Y, "short", list(range(6000, 6128)))  # 128 on Y
    assert router.mark_prefill("long") and router.mark_prefill("short")
    assert router.tracks_output
    loads = router.rank_loads()
    # Each: (2 + 0.5 * 1 request) * 128 missed + 0.01 * 10 * context in flight.
    assert costs(route(router, QUERY, expected_output_tokens=10)) == {
        X: pytest.approx(2.5 * 128 + 0.1 * 64),
        Y: pytest.approx(2.5 * 128 + 0.1 * 128),
    }
    assert router.record_output("long", 200)
    assert router.record_output("long", 150)  # an older count changes nothing
    decision = route(router, QUERY, expected_output_tokens=10)
    assert costs(decision) == {X: pytest.approx(2.5 * 128 + 0.1 * 264), Y: pytest.approx(2.5 * 128 + 0.1 * 128)}
    assert decision.worker_id == Y
    assert router.rank_loads() == loads  # no output blocks, the same decode blocks: dynamo is unchanged
    assert router.mark_free("long")
    assert costs(route(router, QUERY, expected_output_tokens=10))[X] == 2.0 * 128  # nothing left in flight
    assert not router.record_output("long", 300)


@pytest.mark.parametrize(
    ("policy", "track_output_blocks", "tracks"),
    [("latency", False, True), ("dynamo", False, False), ("dynamo", True, True), ("cache_affinity", False, False)],
)
def test_output_progress_is_wanted_when_a_policy_or_the_load_reads_it(
    policy: str, track_output_blocks: bool, tracks: bool
) -> None:
    assert router_with(policy, router_track_output_blocks=track_output_blocks).tracks_output is tracks


def test_a_request_without_expected_output_uses_the_default_length() -> None:
    router = router_with(latency_default_output_tokens=500, **KNOBS)
    book_on(router, X, "busy", list(range(5000, 5064)))
    assert router.mark_prefill("busy")
    assert costs(route(router, QUERY)) == costs(route(router, QUERY, expected_output_tokens=500))


@settings(max_examples=30, deadline=None)
@given(
    miss=st.sampled_from([1.0, 2.0, 3.0]),
    bookings=st.lists(st.tuples(st.sampled_from([X, Y]), st.integers(1, 12), st.booleans()), max_size=6),
)
def test_without_the_decode_side_and_the_pass_term_it_is_cache_affinity_without_its_decode_term(
    miss: float, bookings: list[tuple[int, int, bool]]
) -> None:
    ours = router_with(
        latency_miss_weight=miss, latency_stall_weight=0.0, latency_decode_weight=0.0, latency_pass_base_tokens=0.0
    )
    theirs = router_with("cache_affinity", affinity_miss_weight=miss, affinity_decode_weight=0.0)
    for router in (ours, theirs):
        router.apply_event(prompt_stored_event(X, QUERY, BS, blocks=3))
        for i, (worker, blocks, prefilled) in enumerate(bookings):
            book_on(router, worker, f"b{i}", QUERY[: blocks * BS])
            if prefilled:
                router.mark_prefill(f"b{i}")
    assert costs(route(ours, QUERY)) == costs(route(theirs, QUERY))


@pytest.mark.parametrize(
    "field",
    [
        "latency_miss_weight",
        "latency_stall_weight",
        "latency_decode_weight",
        "latency_decode_load_weight",
        "latency_decode_others_weight",
        "latency_itl_stall_weight",
        "latency_pass_base_tokens",
        "latency_default_output_tokens",
        "latency_hit_margin",
    ],
)
def test_knobs_are_validated_by_name(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        RouterConfig(**{field: -1})  # type: ignore[arg-type]


# ---------------------------------------------------------------------- RouterConfigOverride
def test_dynamos_cache_credit_and_prefill_scale_mean_the_same_in_latency() -> None:
    router = router_with(**KNOBS)
    router.apply_event(prompt_stored_event(X, QUERY, BS, blocks=4))  # X holds 64 of the 128 tokens
    book_on(router, X, "busy", list(range(5000, 5064)))  # 64 queued prefill tokens, 64 context, 1 request

    def with_override(**fields: float) -> RouteDecision:
        return route(router, QUERY, expected_output_tokens=10, router_config_override=RouterConfigOverride(**fields))

    # The whole credit: X queued 64 + (2 + 0.5 * 1 request) * 64 missed + 0.01 * 10 * 64; Y 2 * 128 missed.
    assert costs(with_override(overlap_score_credit=1.0)) == {X: pytest.approx(64 + 2.5 * 64 + 6.4), Y: 256.0}
    # Half: 32 of X's tokens count as cached. None: the cache counts for nothing, neither X's hits nor
    # the eviction a miss causes on a full cache (the miss weight 1, not 2): by load alone Y, idle, wins.
    assert costs(with_override(overlap_score_credit=0.5)) == {X: pytest.approx(64 + 2.5 * 96 + 6.4), Y: 256.0}
    decision = with_override(overlap_score_credit=0.0)
    assert costs(decision) == {X: pytest.approx(64 + 1.5 * 128 + 6.4), Y: 128.0}
    assert decision.worker_id == Y
    # The prefill lines at half weight, then none: the decode line alone, which only X pays.
    assert costs(with_override(prefill_load_scale=0.5)) == {X: pytest.approx(0.5 * (64 + 2.5 * 64) + 6.4), Y: 128.0}
    decision = with_override(prefill_load_scale=0.0, overlap_score_credit=0.0)
    assert costs(decision) == {X: pytest.approx(6.4), Y: 0.0}
    assert decision.worker_id == Y


@pytest.mark.parametrize("policy", ["dynamo", "latency"])
@settings(max_examples=25, deadline=None)
@given(
    credit=st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0]),
    scale=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    track_prefill=st.booleans(),
    cached_blocks=st.integers(0, 8),
)
def test_an_override_scores_as_a_router_configured_with_it(
    policy: str, credit: float, scale: float, track_prefill: bool, cached_blocks: int
) -> None:
    """Dynamo's cost with these settings is checked against Dynamo itself (test_router_oracle.py); a
    request overriding them must be scored exactly as that router scores it, under either policy."""
    configured = router_with(
        policy, overlap_score_credit=credit, prefill_load_scale=scale, router_track_prefill_tokens=track_prefill
    )
    overridden, plain = router_with(policy), router_with(policy)
    override = RouterConfigOverride(
        overlap_score_credit=credit, prefill_load_scale=scale, track_prefill_tokens=track_prefill
    )
    for router in (configured, overridden, plain):
        if cached_blocks:
            router.apply_event(prompt_stored_event(X, QUERY, BS, blocks=cached_blocks))
        book_on(router, X, "busy", list(range(5000, 5064)))
    assert costs(route(overridden, QUERY, router_config_override=override)) == costs(route(configured, QUERY))
    # The router's own config is untouched for the next request.
    assert costs(route(overridden, QUERY)) == costs(route(plain, QUERY))


def test_overlap_score_weight_is_the_deprecated_scale_and_zero_drops_the_credit() -> None:
    config = RouterConfig()
    assert config.with_override(RouterConfigOverride(overlap_score_weight=2.0)).prefill_load_scale == 2.0
    zero = config.with_override(RouterConfigOverride(overlap_score_weight=0.0))
    assert (zero.prefill_load_scale, zero.overlap_score_credit) == (0.0, 0.0)
    assert config.with_override(RouterConfigOverride()) is config


def test_an_override_with_a_bad_value_is_an_invalid_request() -> None:
    router = router_with("dynamo")
    with pytest.raises(InvalidRequest, match="router_temperature"):
        route(router, QUERY, router_config_override=RouterConfigOverride(router_temperature=-1.0))


def test_a_temperature_override_samples() -> None:
    router = router_with("dynamo")
    decision = route(router, QUERY, router_config_override=RouterConfigOverride(router_temperature=1.0))
    assert decision.explanation is not None
    assert all(candidate.probability is not None for candidate in decision.explanation.candidates)
    assert "softmax" in decision.explanation.reason


# ---------------------------------------------------------------------- prefill load model
def test_the_oldest_prefill_decays_as_it_runs_then_the_next_one() -> None:
    clock = [0.0]
    router = router_with("dynamo", clock, router_prefill_load_model="linear", router_prefill_tokens_per_s=1000.0)
    book_on(router, X, "a", list(range(5000, 6000)))  # 1,000 tokens: expected to take 1 s
    clock[0] = 0.25
    book_on(router, X, "b", list(range(7000, 7500)))  # 500 tokens, waiting behind a

    def prefill() -> int:
        return next(load.active_prefill_tokens for load in router.rank_loads() if load.worker_id == X)

    assert prefill() == 750 + 500
    clock[0] = 0.6
    assert prefill() == 400 + 500
    clock[0] = 5.0
    assert prefill() == 0 + 500  # a overran its expected time: it counts for nothing, b in full
    assert router.mark_prefill("a")
    assert prefill() == 500  # b's clock starts at this read
    clock[0] = 5.25
    assert prefill() == 250
    assert router.mark_free("b")
    assert prefill() == 0


def test_without_the_model_a_booked_prefill_counts_in_full() -> None:
    clock = [0.0]
    router = router_with("dynamo", clock)
    book_on(router, X, "a", list(range(5000, 6000)))
    clock[0] = 100.0
    assert next(load.active_prefill_tokens for load in router.rank_loads() if load.worker_id == X) == 1000


@pytest.mark.parametrize(
    "fields",
    [{"router_track_prefill_tokens": False}, {"router_queue_threshold": 1.0, "router_queue_policy": "wspt"}],
)
def test_the_prefill_load_model_needs_prompt_tracking_and_fcfs(fields: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="router_prefill_load_model"):
        RouterConfig(router_prefill_load_model="linear", **fields)  # type: ignore[arg-type]


def test_output_blocks_need_active_blocks() -> None:
    with pytest.raises(ConfigError, match="router_track_output_blocks"):
        RouterConfig(router_track_output_blocks=True, router_track_active_blocks=False)


# ---------------------------------------------------------------------- minimum workers at start
def test_routing_waits_for_the_minimum_workers_then_never_again() -> None:
    async def scenario() -> None:
        router = KvRouter(RouterConfig(block_size=BS, router_min_initial_workers=2))
        router.register_worker(WorkerConfig(worker_id=X))
        waiting = asyncio.ensure_future(router.new(RouteRequest(tokens=QUERY, request_id="early")))
        for _ in range(5):  # turns of the loop in which it could wrongly finish
            await asyncio.sleep(0)
        assert not waiting.done()
        router.register_worker(WorkerConfig(worker_id=Y))
        decision = await asyncio.wait_for(waiting, 1.0)
        assert decision.worker_id in (X, Y)
        router.remove_worker(Y)  # fewer than the minimum later: routing goes on
        assert (await router.new(RouteRequest(tokens=QUERY))).worker_id == X

    asyncio.run(scenario())


def test_a_negative_minimum_is_refused() -> None:
    with pytest.raises(ConfigError, match="router_min_initial_workers"):
        RouterConfig(router_min_initial_workers=-1)


# ---------------------------------------------------------------------- on a workload
def test_on_agentic_sessions_it_beats_dynamo_everywhere_and_cache_affinity_on_decode() -> None:
    """700 requests of the generated multi-tenant agentic workload on 4 simulated workers (about 4 s),
    the default knobs: more hits than dynamo and lower TTFT, ITL and E2E p90s; against cache_affinity,
    which keeps more hits by piling sessions up, a far lower ITL and E2E p90."""
    trace = build_trace(WORKLOADS["agentic"](seed=0)[:700], TraceOptions(), "workload:agentic")
    engine = EngineConfig()
    reports = {}
    for policy in ("latency", "cache_affinity", "dynamo"):
        fleet = make_router(policy, RouterConfig(block_size=engine.block_size), random.Random(0))
        result = asyncio.run(simulate(trace, fleet, engine, 4, seed=0))
        reports[policy] = summarize(policy, result.records, 4, wall_s=0.0)
    ours, affinity, dynamo = reports["latency"], reports["cache_affinity"], reports["dynamo"]
    assert ours.e2e_ms.p90 <= 0.9 * affinity.e2e_ms.p90
    assert ours.itl_ms.p90 <= 0.7 * affinity.itl_ms.p90
    assert ours.hit_rate_tokens >= dynamo.hit_rate_tokens + 0.04
    assert ours.ttft_ms.p90 <= 0.9 * dynamo.ttft_ms.p90
    assert ours.itl_ms.p90 <= 0.9 * dynamo.itl_ms.p90
    assert ours.e2e_ms.p90 < dynamo.e2e_ms.p90

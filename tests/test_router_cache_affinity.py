"""The `cache_affinity` policy: exact costs and picks, its knobs, and in-flight prefix prediction."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from mocker.config import EngineConfig
from mocker.report import summarize
from mocker.routers import make_router
from mocker.simulation import simulate
from mocker.trace import load_trace
from router import KvRouter, RouteDecision, RouterConfig, RouteRequest, RoutingConstraints, WorkerConfig
from router.errors import ConfigError
from tests.dynamo_fleet import prompt_stored_event

BS = 16
X, Y = 11, 22
QUERY = list(range(1000, 1128))  # 8 blocks; the first 4 are cached on X in most cases below


def router_with(**overrides: object) -> KvRouter:
    config = RouterConfig(block_size=BS, policy="cache_affinity", **overrides)  # type: ignore[arg-type]
    router = KvRouter(config, rng=random.Random(0))
    router.register_worker(WorkerConfig(worker_id=X, taints=frozenset({"zone=a"})))
    router.register_worker(WorkerConfig(worker_id=Y))
    return router


def route(router: KvRouter, tokens: list[int], **fields: object) -> RouteDecision:
    return asyncio.run(router.new(RouteRequest(tokens=tokens, **fields), explain=True))  # type: ignore[arg-type]


def book_on_x(router: KvRouter, request_id: str, tokens: list[int]) -> None:
    asyncio.run(router.new(RouteRequest(tokens=tokens, request_id=request_id), pinned_worker=(X, 0)))


def costs(decision: RouteDecision) -> dict[int, float | None]:
    assert decision.explanation is not None
    assert decision.explanation.policy == "cache_affinity"
    return {candidate.worker_id: candidate.cost for candidate in decision.explanation.candidates}


def test_idle_fleet_prices_only_the_weighted_misses() -> None:
    router = router_with()
    router.apply_event(prompt_stored_event(X, QUERY, BS, blocks=4))
    decision = route(router, QUERY)
    assert costs(decision) == {X: 3.0 * 64, Y: 3.0 * 128}
    assert (decision.worker_id, decision.cached_tokens) == (X, 64)


def test_a_modest_queue_does_not_break_affinity_a_long_one_does() -> None:
    router = router_with()
    router.apply_event(prompt_stored_event(X, QUERY, BS, blocks=4))
    book_on_x(router, "short", list(range(5000, 5064)))  # 64 queued prefill tokens, 4 active blocks
    decision = route(router, QUERY)
    assert costs(decision) == {X: 64 + 3.0 * 64 + 0.05 * BS * 4, Y: 3.0 * 128}
    assert decision.worker_id == X
    book_on_x(router, "long", list(range(6000, 6512)))  # 512 more queued tokens, 32 more blocks
    decision = route(router, QUERY)
    assert costs(decision) == {X: 576 + 3.0 * 64 + 0.05 * BS * 36, Y: 3.0 * 128}
    assert decision.worker_id == Y


def test_miss_weight_one_is_plain_time_to_prefill() -> None:
    router = router_with(affinity_miss_weight=1.0)
    router.apply_event(prompt_stored_event(X, QUERY, BS, blocks=4))
    book_on_x(router, "short", list(range(5000, 5064)))
    decision = route(router, QUERY)
    assert costs(decision) == {X: 64 + 64 + 0.05 * BS * 4, Y: 128.0}
    assert decision.worker_id == Y


@pytest.mark.parametrize(
    ("predict", "winner", "cost_x"), [(True, X, 3.0 * 32 + 0.05 * BS * 6), (False, Y, 3.0 * 128 + 4.8)]
)
def test_prefix_booked_in_flight_counts_as_cached(predict: bool, winner: int, cost_x: float) -> None:
    # Without the credit of a computed prompt, which counts the prefix as cached from its first token on.
    router = router_with(affinity_predict_inflight=predict, computed_prompt_credit_secs=0.0)
    book_on_x(router, "first", QUERY[:96])  # the engine has not reported these 6 blocks stored yet
    assert router.mark_prefill("first")
    decision = route(router, QUERY)
    assert costs(decision) == {X: cost_x, Y: 3.0 * 128}
    assert decision.worker_id == winner


def test_preferred_taints_multiply_the_cost() -> None:
    router = router_with()
    constraints = RoutingConstraints(preferred_taints={"zone=a": -2.0})  # repel X
    decision = route(router, QUERY, routing_constraints=constraints)
    assert decision.worker_id == Y
    penalty = costs(decision)[X]
    assert penalty is not None and penalty > 3.0 * 128


def test_ties_are_broken_at_random() -> None:
    picks = {route(router_with(), QUERY).worker_id for _ in range(1)}
    router = router_with()
    picks |= {route(router, list(range(seed * 200, seed * 200 + 128))).worker_id for seed in range(40)}
    assert picks == {X, Y}


@pytest.mark.parametrize("field", ["affinity_miss_weight", "affinity_decode_weight"])
def test_knobs_are_validated_by_name(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        RouterConfig(**{field: -1.0})  # type: ignore[arg-type]


def test_on_a_production_trace_it_caches_more_and_answers_sooner_than_dynamo(shared_dir: Path) -> None:
    """The first 1,000 requests of Mooncake's tool-agent trace on 8 simulated workers (Dynamo's mocker
    defaults): the policy's reason to exist, checked on every run (about 5 s)."""
    trace = load_trace(shared_dir / "traces" / "mooncake_trace_1000.jsonl")
    engine = EngineConfig()
    reports = {}
    for policy in ("dynamo", "cache_affinity"):
        fleet = make_router(policy, RouterConfig(block_size=engine.block_size), random.Random(0))
        result = asyncio.run(simulate(trace, fleet, engine, 8, seed=0))
        reports[policy] = summarize(policy, result.records, 8, wall_s=0.0)
    ours, theirs = reports["cache_affinity"], reports["dynamo"]
    assert ours.hit_rate_tokens >= theirs.hit_rate_tokens + 0.02
    assert ours.ttft_ms.p90 <= theirs.ttft_ms.p90

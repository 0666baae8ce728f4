"""The `dynamo` policy's cost and pick (reference/dynamo-router.md §4.2-§4.4), through `KvRouter`."""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter

import msgspec
import pytest

from indexer.events import StorageTier
from router import KvRouter, RouteDecision, RouterConfig, RouteRequest, RoutingConstraints, WorkerConfig
from router.policies.dynamo import softmax_probabilities, softmax_sample_index
from tests.dynamo_fleet import prompt_stored_event

BS = 16
X, Y = 11, 22
QUERY = list(range(1000, 1128))  # 128 tokens = 8 blocks; the first 4 are cached on X
LONG = list(range(5000, 5064))  # request "L": 64 uncached tokens booked on X


def route(router: KvRouter, tokens: list[int], **fields: object) -> RouteDecision:
    request = RouteRequest(tokens=tokens, **fields)  # type: ignore[arg-type]
    return asyncio.run(router.new(request, explain=True))


def costs_of(decision: RouteDecision) -> dict[int, float | None]:
    assert decision.explanation is not None
    return {candidate.worker_id: candidate.cost for candidate in decision.explanation.candidates}


def table_router(config: RouterConfig, *, prefill_pending: bool, seed: int = 0) -> KvRouter:
    """The §4.2 verification setup: two workers, Q's first 64 tokens cached on X, L booked on X."""
    router = KvRouter(config, rng=random.Random(seed))
    for worker_id in (X, Y):
        router.register_worker(WorkerConfig(worker_id=worker_id))
    router.apply_event(prompt_stored_event(X, QUERY, BS, blocks=4))
    asyncio.run(router.new(RouteRequest(tokens=LONG, request_id="L"), pinned_worker=(X, 0)))
    if not prefill_pending:
        assert router.mark_prefill("L")
    return router


# (config overrides, L prefill pending, predicted cost X, predicted cost Y, winner or None for a tie)
VERIFICATION_TABLE = [
    pytest.param({}, True, 20.0, 16.0, Y, id="defaults-pending"),
    pytest.param({"overlap_score_credit": 2.0}, True, 16.0, 16.0, None, id="credit2-pending"),
    pytest.param({"overlap_score_credit": 3.0}, True, 12.0, 16.0, X, id="credit3-pending"),
    pytest.param({"prefill_load_scale": 0.0}, True, 12.0, 8.0, Y, id="scale0-pending"),
    pytest.param({}, False, 16.0, 16.0, None, id="defaults-done"),
    pytest.param({"prefill_load_scale": 2.0}, False, 20.0, 24.0, X, id="scale2-done"),
    pytest.param({"prefill_load_scale": 0.5}, False, 14.0, 12.0, Y, id="scale0.5-done"),
    pytest.param({"decode_active_request_weight": 4.0}, False, 20.0, 16.0, Y, id="request-weight4-done"),
]


@pytest.mark.parametrize(("overrides", "pending", "cost_x", "cost_y", "winner"), VERIFICATION_TABLE)
def test_verification_table(
    overrides: dict[str, float], pending: bool, cost_x: float, cost_y: float, winner: int | None
) -> None:
    router = table_router(RouterConfig(block_size=BS, policy="dynamo", **overrides), prefill_pending=pending)
    picks: Counter[int] = Counter()
    for _ in range(30):
        decision = route(router, QUERY)
        assert costs_of(decision) == {X: cost_x, Y: cost_y}
        picks[decision.worker_id] += 1
    if winner is not None:
        assert picks == {winner: 30}
    else:
        # A tie is broken uniformly: P(one side gets fewer than 5 of 30) is about 1e-4.
        assert picks[X] >= 5 and picks[Y] >= 5, picks


def test_decision_reports_the_winners_overlap() -> None:
    router = table_router(RouterConfig(block_size=BS, policy="dynamo", overlap_score_credit=3.0), prefill_pending=True)
    decision = route(router, QUERY, request_id="q")
    assert (decision.worker_id, decision.overlap_blocks, decision.cached_tokens) == (X, 4, 64)
    assert decision.request_id == "q"


def test_ties_are_uniform_over_many_candidates() -> None:
    router = KvRouter(RouterConfig(block_size=BS, policy="dynamo"), rng=random.Random(7))
    for worker_id in range(6):
        router.register_worker(WorkerConfig(worker_id=worker_id))
    picks = Counter(route(router, QUERY).worker_id for _ in range(1200))
    # 200 expected per worker; 5 sigma of a binomial(1200, 1/6) is about 65.
    assert set(picks) == set(range(6))
    assert all(abs(count - 200) < 65 for count in picks.values()), picks


def test_lower_tier_hits_earn_weighted_credit() -> None:
    """§3.5: device 2, host 1, disk 2 blocks at bs 16 → 3.25 effective blocks, 52 cached tokens."""
    router = KvRouter(RouterConfig(block_size=BS, policy="dynamo"), rng=random.Random(0))
    router.register_worker(WorkerConfig(worker_id=X))
    router.register_worker(WorkerConfig(worker_id=Y))
    tokens = list(range(80))
    router.apply_event(prompt_stored_event(X, tokens, BS, blocks=2))
    host = prompt_stored_event(X, tokens, BS, blocks=3, event_id=2, storage_tier=StorageTier.HOST_PINNED)
    disk = prompt_stored_event(X, tokens, BS, blocks=5, event_id=3, storage_tier=StorageTier.DISK)
    router.apply_event(host)
    router.apply_event(disk)
    decision = route(router, tokens)
    assert decision.explanation is not None
    x = next(c for c in decision.explanation.candidates if c.worker_id == X)
    assert (x.device_overlap_blocks, x.effective_overlap_blocks) == (2, 3.25)
    # raw prefill 80/16 = 5 blocks, credit 2 + 0.75 + 0.5 = 3.25, decode 5 new blocks.
    assert costs_of(decision) == {X: 5 - 3.25 + 5, Y: 5.0 + 5}
    assert (decision.worker_id, decision.overlap_blocks, decision.cached_tokens) == (X, 3, 52)
    report = router.overlap(tokens)
    row = next(row for row in report.workers if row.worker_id == X)
    assert (row.device_blocks, row.host_pinned_blocks, row.disk_blocks) == (2, 3, 5)
    assert (row.host_pinned_extension_blocks, row.disk_extension_blocks, row.router_credit_blocks) == (1, 2, 3.25)


def test_credit_decays_with_prefill_backlog_above_the_least_loaded() -> None:
    """decay = 1 / (1 + d * ((A_p - min A_p) / bs) / ceil(isl / bs))."""
    router = KvRouter(
        RouterConfig(block_size=BS, policy="dynamo", overlap_score_credit_decay=1.0), rng=random.Random(0)
    )
    for worker_id in (X, Y):
        router.register_worker(WorkerConfig(worker_id=worker_id))
    router.apply_event(prompt_stored_event(X, QUERY, BS, blocks=4))
    asyncio.run(router.new(RouteRequest(tokens=LONG, request_id="L"), pinned_worker=(X, 0)))
    # X: backlog 64 tokens = 4 blocks over Y's 0, over 8 request blocks → decay 1 / 1.5.
    credit = 4 / 1.5
    assert costs_of(route(router, QUERY)) == {X: (64 + 128) / 16 - credit + 12, Y: 16.0}


def test_preferred_taints_scale_the_cost() -> None:
    router = KvRouter(RouterConfig(block_size=BS, policy="dynamo"), rng=random.Random(0))
    router.register_worker(WorkerConfig(worker_id=X, taints=frozenset({"zone=a", "spot"})))
    router.register_worker(WorkerConfig(worker_id=Y, taints=frozenset({"zone=b"})))
    constraints = RoutingConstraints(preferred_taints={"zone=a": 1.0, "spot": -0.5, "zone=b": 0.25})
    decision = route(router, QUERY, routing_constraints=constraints)
    base = 128 / 16 + 8
    assert costs_of(decision) == {X: base * math.exp(-math.tanh(0.5)), Y: base * math.exp(-math.tanh(0.25))}
    assert decision.worker_id == X


def test_required_taints_filter_hard() -> None:
    router = KvRouter(RouterConfig(block_size=BS, policy="dynamo"), rng=random.Random(0))
    router.register_worker(WorkerConfig(worker_id=X, taints=frozenset({"gpu=h200"})))
    router.register_worker(WorkerConfig(worker_id=Y))
    router.apply_event(prompt_stored_event(Y, QUERY, BS))
    decision = route(router, QUERY, routing_constraints=RoutingConstraints(required_taints=["gpu=h200"]))
    assert decision.worker_id == X
    assert decision.explanation is not None
    assert [c.worker_id for c in decision.explanation.candidates] == [X]


def test_all_ranks_of_a_worker_are_candidates() -> None:
    router = KvRouter(RouterConfig(block_size=BS, policy="dynamo"), rng=random.Random(0))
    router.register_worker(WorkerConfig(worker_id=X, dp_start_rank=2, dp_size=3))
    router.apply_event(prompt_stored_event(X, QUERY, BS, dp_rank=3))
    decision = route(router, QUERY)
    assert decision.explanation is not None
    assert [(c.worker_id, c.dp_rank) for c in decision.explanation.candidates] == [(X, 2), (X, 3), (X, 4)]
    assert (decision.dp_rank, decision.overlap_blocks) == (3, 8)


def test_softmax_probabilities_match_the_formula() -> None:
    """§4.3: costs 12 vs 16 at T = 1 give P(X) = 1 / (1 + e^-1)."""
    p_x, p_y = softmax_probabilities([12.0, 16.0], 1.0)
    assert p_x == pytest.approx(1 / (1 + math.exp(-1)))
    assert p_x + p_y == pytest.approx(1.0)
    assert softmax_probabilities([3.0, 3.0, 3.0], 0.5) == [1 / 3] * 3
    # Costs spanning more than the float range still order correctly.
    assert softmax_sample_index(softmax_probabilities([-1e308, 1e308], 1.0), 0.6) == 0


def test_softmax_sampling_frequency() -> None:
    """The §4.3 observation: credit 3 makes X cost 12 and Y 16; at T = 1 X wins 73.1% of picks."""
    config = RouterConfig(block_size=BS, policy="dynamo", overlap_score_credit=3.0, router_temperature=1.0)
    router = table_router(config, prefill_pending=True, seed=3)
    draws = 2000
    decisions = [route(router, QUERY) for _ in range(draws)]
    assert decisions[0].explanation is not None
    probabilities = {c.worker_id: c.probability for c in decisions[0].explanation.candidates}
    assert probabilities[X] == pytest.approx(0.7310585786)
    share = sum(d.worker_id == X for d in decisions) / draws
    # 5 standard deviations of a binomial(2000, 0.731) share is 0.05.
    assert abs(share - 0.7310585786) < 0.05


def test_explanation_round_trips_through_json() -> None:
    router = table_router(RouterConfig(block_size=BS, policy="dynamo"), prefill_pending=True)
    decision = route(router, QUERY)
    assert msgspec.json.decode(msgspec.json.encode(decision), type=RouteDecision) == decision

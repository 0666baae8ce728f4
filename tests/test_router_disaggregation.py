"""Disaggregated prefill and decode in `KvRouter` (issue 27): roles, the two legs, the conditional path,
booking and freeing of both legs."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.bridge_command import load_bridge_config
from router import KvRouter, RouteDecision, RouterConfig, RouteRequest, WorkerConfig
from router.disaggregation import PendingPrefill, choose_path, prefill_booking_id
from router.engines.bridge_config import BridgeConfig
from router.errors import ConfigError, InvalidRequest, NoEligibleWorker
from tests.dynamo_fleet import prompt_stored_event

BS = 16
P1, P2, D1, D2 = 1, 2, 3, 4
PROMPT = list(range(1000, 1000 + 40 * BS))  # 640 tokens, 40 blocks


def fleet(**config: object) -> KvRouter:
    """Two prefill and two decode workers; the costs in these tests are worked out in `dynamo`'s terms."""
    settings = {"block_size": BS, "policy": "dynamo", **config}
    router = KvRouter(RouterConfig(**settings), rng=random.Random(0))  # type: ignore[arg-type]
    for worker_id in (P1, P2):
        router.register_worker(WorkerConfig(worker_id=worker_id, role="prefill"))
    for worker_id in (D1, D2):
        router.register_worker(WorkerConfig(worker_id=worker_id, role="decode"))
    return router


def route(router: KvRouter, tokens: list[int], request_id: str | None = "r", **kwargs: object) -> RouteDecision:
    return asyncio.run(router.new(RouteRequest(tokens=tokens, request_id=request_id), **kwargs))  # type: ignore[arg-type]


def loads(router: KvRouter) -> dict[int, tuple[int, int, int]]:
    return {
        load.worker_id: (load.active_prefill_tokens, load.active_decode_blocks, load.active_requests)
        for load in router.rank_loads()
    }


def test_role_defaults_to_both_and_is_checked_on_the_wire() -> None:
    assert WorkerConfig(worker_id=1).role == "both"
    decoded = msgspec.json.decode(b'{"worker_id": 1, "role": "decode"}', type=WorkerConfig)
    assert decoded.role == "decode" and decoded.serves("decode") and not decoded.serves("prefill")
    with pytest.raises(msgspec.ValidationError, match="role"):
        msgspec.json.decode(b'{"worker_id": 1, "role": "encode"}', type=WorkerConfig)
    assert (
        BridgeConfig(worker_id=5, zmq_endpoint="tcp://127.0.0.1:5557", role="prefill").registration().role == "prefill"
    )


def test_a_held_request_keeps_its_remote_prefill_leg_past_the_expiry() -> None:
    """The proxy holds its requests to the answer's end (`KvRouter.hold`): a remote prefill behind a long
    queue may outlast request_expiry_secs, and its leg, expired then, left its prefill worker's load while
    it computed."""
    now = [0.0]
    router = KvRouter(RouterConfig(block_size=BS, policy="dynamo"), rng=random.Random(0), clock=lambda: now[0])
    for worker_id, role in ((P1, "prefill"), (P2, "prefill"), (D1, "decode")):
        router.register_worker(WorkerConfig(worker_id=worker_id, role=role))  # type: ignore[arg-type]
    decision = route(router, PROMPT)
    assert decision.disaggregation is not None and decision.disaggregation.path == "remote_prefill"
    route(router, PROMPT[::-1], "forgotten")  # a decision API caller's, never freed
    assert router.hold("r")
    now[0] += router.config.request_expiry_secs + 1
    assert router.expire_stale() == ["forgotten#prefill", "forgotten"]
    assert router.booking("r") is not None and router.booking(prefill_booking_id("r")) is not None
    assert router.mark_prefill("r") and router.mark_free("r")


def test_aggregated_fleet_has_no_disaggregation_receipt() -> None:
    router = KvRouter(RouterConfig(block_size=BS))
    router.register_worker(WorkerConfig(worker_id=1))
    decision = route(router, PROMPT)
    assert decision.disaggregation is None
    with pytest.raises(InvalidRequest, match="role prefill or decode"):
        route(router, PROMPT, "s", pinned_prefill=(1, 0))


def test_long_uncached_prompt_is_prefilled_remotely_where_its_prefix_is_cached() -> None:
    router = fleet()
    router.apply_event(prompt_stored_event(P2, PROMPT, BS, blocks=30))  # the prefill pool's own view
    decision = route(router, PROMPT)
    receipt = decision.disaggregation
    assert receipt is not None and receipt.path == "remote_prefill"
    assert decision.worker_id in (D1, D2) and receipt.decode_uncached_tokens == len(PROMPT)
    assert receipt.prefill is not None and receipt.prefill.worker_id == P2
    assert (receipt.prefill.overlap_blocks, receipt.prefill.cached_tokens) == (30, 30 * BS)
    assert receipt.prefill.booking_id == "r#prefill" and receipt.threshold_tokens == 256
    assert "at or above the 256-token threshold" in receipt.reason
    # The prefill leg books the uncached prefill on P2 (no blocks: it decodes nothing); the decode leg
    # books blocks, no prefill.
    booked = loads(router)
    assert booked[P2] == (len(PROMPT) - 30 * BS, 0, 1)
    assert booked[decision.worker_id] == (0, 40, 1)
    assert router.mark_prefill("r")  # the prefill leg ended: its booking goes, the decode one stays
    booked = loads(router)
    assert booked[P2] == (0, 0, 0) and booked[decision.worker_id] == (0, 40, 1)
    assert router.mark_free("r")
    assert all(load == (0, 0, 0) for load in loads(router).values())


def test_under_latency_a_prefill_leg_is_priced_by_queued_prefill_and_misses_alone() -> None:
    """A prefill leg decodes nothing where it goes: the decode side and the stall it would cause the
    requests there are not its cost. P1 holds the whole prompt and runs four legs of 8,192-token
    prompts with 64 tokens left to prefill each; P2 is idle with nothing cached. P1 costs its queued
    256 tokens; P2 six times the prompt's 640 (capacity unknown: a full cache). Priced as a request that
    decodes, P1 would cost 0.0012 x 256 x (4 x 8,192 + 640 x 4) = 10,853 more, and lose."""
    router = fleet(policy="latency", disagg_local_prefill_below_tokens=0)
    router.apply_event(prompt_stored_event(P1, PROMPT, BS))
    for n in range(4):
        ballast = list(range(100_000 * (n + 1), 100_000 * (n + 1) + 8192))
        router.apply_event(prompt_stored_event(P1, ballast, BS, event_id=n + 2, blocks=508))
        route(router, ballast, f"ballast{n}", pinned_prefill=(P1, 0), pinned_worker=(D1, 0))
    assert loads(router)[P1] == (4 * 64, 0, 4)
    decision = route(router, PROMPT, "r")
    assert decision.disaggregation is not None and decision.disaggregation.prefill is not None
    assert decision.disaggregation.prefill.worker_id == P1


def test_prefill_leg_is_priced_by_pending_prefill_not_decode_blocks() -> None:
    """The hot prefix stays on the prefill worker holding it while a short prefill runs there. P2 holds
    30 of PROMPT's 40 blocks and is prefilling the last 5 blocks (80 tokens) of another 40-block prompt.
    Dynamo's cost, prefill-only (the default): P2 (80 + 640) / 16 - 30 = 15 against P1's 640 / 16 = 40.
    With the leg's blocks priced as decode load (disagg_prefill_track_active_blocks), P2 adds its 40
    booked blocks and the prompt's own 40 (95) against P1's 40 + 40 (80): the prefix goes to P1."""
    other = list(range(50_000, 50_000 + 40 * BS))
    for track, expected, cached, p2_blocks in ((False, P2, 30 * BS, 0), (True, P1, 0, 40)):
        router = fleet(disagg_prefill_track_active_blocks=track)
        router.apply_event(prompt_stored_event(P2, PROMPT, BS, blocks=30))
        router.apply_event(prompt_stored_event(P2, other, BS, event_id=2, blocks=35))
        busy = route(router, other, "busy", pinned_prefill=(P2, 0))
        assert busy.disaggregation is not None and busy.disaggregation.path == "remote_prefill"
        assert loads(router)[P2] == (5 * BS, p2_blocks, 1)
        receipt = route(router, PROMPT).disaggregation
        assert receipt is not None and receipt.prefill is not None
        assert (receipt.prefill.worker_id, receipt.prefill.cached_tokens) == (expected, cached)
        assert router.mark_prefill("busy") and router.mark_prefill("r")
        assert loads(router)[P1] == loads(router)[P2] == (0, 0, 0)  # both legs' bookings end with the prefill


def test_prefill_policy_places_the_prefill_legs_and_only_them() -> None:
    """disagg_prefill_policy round_robin: the prefill legs take P1, P2, P1 in turn, P2's cached prefix
    notwithstanding (dynamo would pick P2 each time: 640 / 16 - 30 = 10 against 40), while the decode
    legs stay with the dynamo policy (the same decode workers as without the setting, same seed)."""
    decode_workers = []
    for prefill_policy, expected in ((None, [P2, P2, P2]), ("dynamo", [P2, P2, P2]), ("round_robin", [P1, P2, P1])):
        router = fleet(disagg_prefill_policy=prefill_policy)
        router.apply_event(prompt_stored_event(P2, PROMPT, BS, blocks=30))
        legs = []
        for n in range(3):
            decision = route(router, PROMPT, f"r{n}", explain=True)
            receipt = decision.disaggregation
            assert receipt is not None and receipt.prefill is not None and receipt.path == "remote_prefill"
            assert decision.explanation is not None and decision.explanation.policy == "dynamo"
            legs.append((receipt.prefill.worker_id, decision.worker_id))
        assert [prefill for prefill, _ in legs] == expected, prefill_policy
        decode_workers.append([decode for _, decode in legs])
    assert decode_workers[0] == decode_workers[1] == decode_workers[2]


def test_prefill_policy_must_be_registered() -> None:
    with pytest.raises(ConfigError, match="disagg_prefill_policy: unknown policy 'fastest'"):
        fleet(disagg_prefill_policy="fastest")
    with pytest.raises(ConfigError, match="disagg_prefill_policy"):
        RouterConfig(disagg_prefill_policy="")


def test_mark_free_releases_both_legs() -> None:
    router = fleet()
    decision = route(router, PROMPT)
    assert decision.disaggregation is not None and decision.disaggregation.prefill is not None
    assert router.mark_free("r")
    assert all(load == (0, 0, 0) for load in loads(router).values())
    assert router.booking("r#prefill") is None


def test_the_decode_worker_removed_takes_the_prefill_leg_with_its_booking() -> None:
    """Its decode booking dropped with the worker, the request's remote prefill leg goes too: nothing is
    left booked on the prefill worker, and the request's free finds nothing (the leg stayed booked until
    that free, which freed it and still answered 404)."""
    router = fleet()
    decision = route(router, PROMPT)
    assert decision.disaggregation is not None and decision.disaggregation.prefill is not None
    router.remove_worker(decision.worker_id)
    assert all(load == (0, 0, 0) for load in loads(router).values())
    assert router.booking("r#prefill") is None
    assert not router.mark_free("r")


def test_decode_worker_holding_the_prompt_prefills_it_locally() -> None:
    router = fleet()
    router.apply_event(prompt_stored_event(D2, PROMPT, BS, blocks=30))  # 160 tokens left uncached on D2
    decision = route(router, PROMPT)
    receipt = decision.disaggregation
    assert receipt is not None and receipt.path == "local_prefill" and receipt.prefill is None
    assert decision.worker_id == D2 and receipt.decode_uncached_tokens == 160
    assert "below the 256-token threshold" in receipt.reason
    assert loads(router)[D2] == (160, 40, 1)  # the decode worker books the prefill it does
    assert loads(router)[P1] == loads(router)[P2] == (0, 0, 0)


@pytest.mark.parametrize("policy", ["dynamo", "latency"])
def test_decode_overlap_credit_off_picks_by_decode_load(policy: str) -> None:
    router = fleet(disagg_decode_overlap_credit=False, policy=policy)
    router.apply_event(prompt_stored_event(D2, PROMPT, BS, blocks=30))
    route(router, list(range(9000, 9000 + 4 * BS)), "busy", pinned_worker=(D2, 0))  # load on D2
    decision = route(router, PROMPT)
    assert decision.worker_id == D1  # its cache is not credited: the lighter decode worker wins
    assert decision.disaggregation is not None and decision.disaggregation.path == "remote_prefill"


@settings(max_examples=40, deadline=None)
@given(cached_blocks=st.integers(0, 40), threshold=st.integers(0, 700))
def test_local_path_exactly_when_uncached_is_below_threshold(cached_blocks: int, threshold: int) -> None:
    router = fleet(disagg_local_prefill_below_tokens=threshold)
    if cached_blocks:
        router.apply_event(prompt_stored_event(D1, PROMPT, BS, blocks=cached_blocks))
    decision = route(router, PROMPT)
    receipt = decision.disaggregation
    assert receipt is not None
    uncached = len(PROMPT) - (cached_blocks * BS if decision.worker_id == D1 else 0)
    assert receipt.decode_uncached_tokens == uncached
    assert (receipt.path == "local_prefill") == (uncached < threshold)
    assert (receipt.prefill is None) == (uncached < threshold)


def test_no_prefill_worker_falls_back_to_local_prefill() -> None:
    router = KvRouter(RouterConfig(block_size=BS))
    router.register_worker(WorkerConfig(worker_id=D1, role="decode"))
    decision = route(router, PROMPT)
    assert decision.disaggregation is not None and decision.disaggregation.path == "local_prefill"
    assert "no prefill worker" in decision.disaggregation.reason


def test_a_reason_to_prefill_locally_keeps_the_prefill_on_the_decode_worker() -> None:
    """The proxy's last attempt once its prefill legs failed: no prefill leg booked, the reason in the receipt."""
    router = fleet()
    decision = route(router, PROMPT, local_prefill_reason="its prefill legs failed")
    receipt = decision.disaggregation
    assert receipt is not None and receipt.path == "local_prefill" and receipt.prefill is None
    assert receipt.reason == f"its prefill legs failed: prefilled on decode worker {decision.worker_id}"
    assert loads(router)[P1] == loads(router)[P2] == (0, 0, 0)
    assert loads(router)[decision.worker_id][0] == len(PROMPT)  # the decode worker books the prefill itself


def test_both_workers_serve_either_leg_and_pins_are_checked_against_roles() -> None:
    router = fleet()
    router.register_worker(WorkerConfig(worker_id=9))  # role both
    decision = route(router, PROMPT, pinned_worker=(9, 0), pinned_prefill=(P2, 0))
    assert decision.worker_id == 9
    assert decision.disaggregation is not None and decision.disaggregation.prefill is not None
    assert decision.disaggregation.prefill.worker_id == P2
    decision = route(router, PROMPT, "w", pinned_prefill=(9, 0))  # a both worker runs a prefill leg
    assert decision.disaggregation is not None and decision.disaggregation.prefill is not None
    assert decision.disaggregation.prefill.worker_id == 9 and decision.worker_id in (D1, D2)
    with pytest.raises(InvalidRequest, match="role prefill: it cannot run the decode leg"):
        route(router, PROMPT, "x", pinned_worker=(P1, 0))
    with pytest.raises(InvalidRequest, match="role decode: it cannot run the prefill leg"):
        route(router, PROMPT, "y", pinned_prefill=(D1, 0))
    with pytest.raises(NoEligibleWorker):
        route(router, PROMPT, "z", pinned_prefill=(77, 0))
    assert router.booking("x") is None and router.booking("y#prefill") is None  # nothing booked


def test_decode_pool_without_workers_is_no_eligible_worker() -> None:
    router = KvRouter(RouterConfig(block_size=BS))
    router.register_worker(WorkerConfig(worker_id=P1, role="prefill"))
    with pytest.raises(NoEligibleWorker):
        route(router, PROMPT)


def test_a_saturated_prefill_pool_sends_prefill_to_the_decode_worker() -> None:
    router = KvRouter(RouterConfig(block_size=BS, disagg_prefill_queue_limit_tokens=1000), rng=random.Random(0))
    router.register_worker(WorkerConfig(worker_id=P1, role="prefill"))
    router.register_worker(WorkerConfig(worker_id=D1, role="decode"))
    first = route(router, PROMPT, "a")  # 640 tokens pending on P1: under the limit
    assert first.disaggregation is not None and first.disaggregation.path == "remote_prefill"
    second = route(router, list(range(20_000, 20_000 + 40 * BS)), "b")  # 1280 pending on P1 now
    assert second.disaggregation is not None and second.disaggregation.path == "remote_prefill"
    third = route(router, list(range(40_000, 40_000 + 40 * BS)), "c")
    receipt = third.disaggregation
    assert receipt is not None and receipt.path == "local_prefill" and receipt.prefill is None
    assert (
        "has 1280 prefill tokens pending, over the 1000-token queue limit and more than decode worker 3 would have "
        "with this prompt (640)" in receipt.reason
    )
    assert loads(router)[D1] == (640, 120, 3)  # c's prefill booked where it runs
    assert router.mark_prefill("a") and router.mark_prefill("b")  # the prefill legs end: the pool drains
    fourth = route(router, list(range(60_000, 60_000 + 40 * BS)), "d")
    assert fourth.disaggregation is not None and fourth.disaggregation.path == "remote_prefill"


def test_load_aware_local_prefill_when_the_prefill_worker_is_the_longer_wait() -> None:
    config = RouterConfig(block_size=BS, disagg_local_prefill_sooner_below_tokens=1000)
    router = KvRouter(config, rng=random.Random(0))
    router.register_worker(WorkerConfig(worker_id=P1, role="prefill"))
    router.register_worker(WorkerConfig(worker_id=D1, role="decode"))
    prompts = [list(range(start, start + 40 * BS)) for start in range(20_000, 140_000, 20_000)]  # 640 tokens
    paths = [route(router, tokens, f"r{i}").disaggregation for i, tokens in enumerate(prompts[:4])]
    # 2 x (0 + 640) weighted tokens on D1 against 0, 640, 1280 (not below), then 1920 pending on P1.
    assert [receipt.path for receipt in paths if receipt is not None] == ["remote_prefill"] * 3 + ["local_prefill"]
    local = paths[3]
    assert local is not None and local.prefill is None
    assert local.reason == (
        "640 uncached tokens on decode worker 3, below the 1000-token load-aware threshold, and prefilling there is "
        "the shorter wait (1280 weighted tokens with its 0 pending, against 1920 pending on prefill worker 1): "
        "prefilled there"
    )
    assert loads(router)[D1][0] == 640 and loads(router)[P1][0] == 1920  # r3's prefill booked where it runs
    fifth = route(router, prompts[4], "r4")  # 2 x (640 + 640) = 2560 is not below 1920: D1's own queue counts
    assert fifth.disaggregation is not None and fifth.disaggregation.path == "remote_prefill"
    assert router.mark_prefill("r3")  # D1's prefill done: 1280 weighted tokens against 2560 on P1
    sixth = route(router, prompts[5], "r5")
    assert sixth.disaggregation is not None and sixth.disaggregation.path == "local_prefill"


@pytest.mark.parametrize(
    ("uncached", "on_prefill", "on_decode", "factor", "path"),
    [
        (999, 2000, 0, 2.0, "local_prefill"),  # 1998 < 2000
        (1000, 5000, 0, 2.0, "remote_prefill"),  # not below the 1000-token load-aware threshold
        (999, 1998, 0, 2.0, "remote_prefill"),  # a tie is not shorter
        (500, 1200, 100, 2.0, "remote_prefill"),  # 2 x (100 + 500) = 1200
        (500, 1201, 100, 2.0, "local_prefill"),
        (500, 601, 100, 1.0, "local_prefill"),
        (500, 1, 0, 0.0, "local_prefill"),  # factor 0: whenever the prefill worker has anything pending
        (500, 0, 0, 0.0, "remote_prefill"),
    ],
)
def test_load_aware_local_prefill_decision(
    uncached: int, on_prefill: int, on_decode: int, factor: float, path: str
) -> None:
    config = RouterConfig(
        disagg_local_prefill_below_tokens=256,
        disagg_local_prefill_sooner_below_tokens=1000,
        disagg_local_prefill_cost_factor=factor,
    )
    assert choose_path(uncached, config, D1, PendingPrefill(P1, on_prefill, on_decode, uncached, 0))[0] == path


@given(uncached=st.integers(0, 5000), on_prefill=st.integers(0, 50_000), on_decode=st.integers(0, 50_000))
def test_load_aware_rule_off_by_default_and_only_ever_adds_local_prefill(
    uncached: int, on_prefill: int, on_decode: int
) -> None:
    pending = PendingPrefill(P1, on_prefill, on_decode, uncached, 0)
    default = choose_path(uncached, RouterConfig(), D1, pending)[0]
    assert default == ("local_prefill" if uncached < 256 else "remote_prefill")
    aware = RouterConfig(disagg_local_prefill_sooner_below_tokens=4096)
    chosen = choose_path(uncached, aware, D1, pending)[0]
    sooner = uncached < 4096 and 2.0 * (on_decode + uncached) < on_prefill
    assert chosen == ("local_prefill" if default == "local_prefill" or sooner else "remote_prefill")


def estimated_fleet() -> KvRouter:
    config = RouterConfig(block_size=BS, disagg_local_prefill_stall_weight=0.5, disagg_transfer_cost_per_token=0.25)
    router = KvRouter(config, rng=random.Random(0))
    router.register_worker(WorkerConfig(worker_id=P1, role="prefill"))
    router.register_worker(WorkerConfig(worker_id=D1, role="decode"))
    return router


def test_estimated_rule_takes_the_sooner_path_with_the_routers_load_view() -> None:
    router = estimated_fleet()
    prompts = [list(range(start, start + 40 * BS)) for start in range(20_000, 120_000, 20_000)]  # 640 tokens
    first = route(router, prompts[0], "r0").disaggregation
    # Nobody decodes on D1 yet: 640 there against 640 + 160 (transfer) on P1.
    assert first is not None and first.path == "local_prefill" and first.prefill is None
    assert first.reason == (
        "estimated 640 tokens on decode worker 3 (0 pending + 640 uncached x 1 for the 0 requests it stalls) "
        "against 800 on prefill worker 1 (0 pending + 640 uncached + 160 for the KV transfer): prefilled on the "
        "decode worker, the sooner"
    )
    assert loads(router)[D1] == (640, 40, 1) and loads(router)[P1] == (0, 0, 0)
    second = route(router, prompts[1], "r1").disaggregation  # 640 + 640 x 1.5 = 1600 against 800
    assert second is not None and second.path == "remote_prefill"
    assert second.reason == (
        "estimated 1600 tokens on decode worker 3 (640 pending + 640 uncached x 1.5 for the 1 requests it stalls) "
        "against 800 on prefill worker 1 (0 pending + 640 uncached + 160 for the KV transfer): prefilled "
        "remotely, the sooner"
    )
    assert second.prefill is not None and second.prefill.booking_id == "r1#prefill"
    assert loads(router)[P1] == (640, 0, 1) and loads(router)[D1] == (640, 80, 2)  # r1's decode leg: no prefill
    third = route(router, prompts[2], "r2").disaggregation  # 640 + 640 x 2 = 1920 against 640 + 800 = 1440
    assert third is not None and third.path == "remote_prefill"
    assert router.mark_prefill("r0")  # D1's queue drains: 640 x 2.5 = 1600 against 1280 + 800 = 2080
    fourth = route(router, prompts[3], "r3").disaggregation
    assert fourth is not None and fourth.path == "local_prefill"
    assert loads(router)[D1] == (640, 160, 4) and loads(router)[P1] == (1280, 0, 2)
    for request_id in ("r0", "r1", "r2", "r3"):
        assert router.mark_free(request_id)
    assert all(load == (0, 0, 0) for load in loads(router).values())


def test_estimated_rule_counts_the_prefix_the_prefill_worker_holds() -> None:
    router = estimated_fleet()
    router.apply_event(prompt_stored_event(P1, PROMPT, BS, blocks=36))  # 64 uncached tokens on P1
    receipt = route(router, PROMPT).disaggregation  # 640 on D1 against 0 + 64 + 160 on P1
    assert receipt is not None and receipt.path == "remote_prefill"
    assert receipt.prefill is not None and receipt.prefill.cached_tokens == 36 * BS
    assert "against 224 on prefill worker 1 (0 pending + 64 uncached + 160 for the KV transfer)" in receipt.reason


@pytest.mark.parametrize(
    ("uncached", "on_prefill", "prefill_uncached", "on_decode", "requests", "stall", "transfer", "path"),
    [
        (1000, 0, 1000, 0, 0, 0.25, 0.0, "remote_prefill"),  # 1000 = 1000: a tie goes remote
        (1000, 1, 1000, 0, 0, 0.25, 0.0, "local_prefill"),  # 1000 < 1001
        (1000, 0, 1000, 0, 0, 0.25, 0.35, "local_prefill"),  # 1000 < 1350: the transfer tips it
        (1000, 0, 1000, 0, 4, 0.25, 0.35, "remote_prefill"),  # 1000 x 2 = 2000 > 1350: four decoding
        (1000, 650, 1000, 0, 4, 0.25, 0.35, "remote_prefill"),  # 2000 = 2000
        (1000, 651, 1000, 0, 4, 0.25, 0.35, "local_prefill"),
        (1000, 651, 1000, 1, 4, 0.25, 0.35, "remote_prefill"),  # 2001: the decode worker's own queue counts
        (1000, 5000, 0, 0, 4, 0.25, 0.35, "local_prefill"),  # 2000 < 5350
        (1000, 1000, 0, 0, 4, 0.25, 0.35, "remote_prefill"),  # the prefill worker holds it: 1350 < 2000
        (1000, 10_000, 1000, 0, 100, 0.25, 0.35, "remote_prefill"),  # 26,000: a large batch is not stalled
        (255, 0, 255, 0, 100, 0.25, 0.35, "local_prefill"),  # below the 256-token threshold first
    ],
)
def test_estimated_rule_decision_at_each_boundary(
    uncached: int,
    on_prefill: int,
    prefill_uncached: int,
    on_decode: int,
    requests: int,
    stall: float,
    transfer: float,
    path: str,
) -> None:
    config = RouterConfig(disagg_local_prefill_stall_weight=stall, disagg_transfer_cost_per_token=transfer)
    pending = PendingPrefill(P1, on_prefill, on_decode, prefill_uncached, requests)
    assert choose_path(uncached, config, D1, pending)[0] == path


@given(
    uncached=st.integers(256, 50_000),
    on_prefill=st.integers(0, 100_000),
    prefill_uncached=st.integers(0, 50_000),
    on_decode=st.integers(0, 100_000),
    requests=st.integers(0, 300),
    prefill_worker_requests=st.integers(0, 300),
)
def test_estimated_rule_is_off_by_default_and_local_never_costs_more(
    uncached: int, on_prefill: int, prefill_uncached: int, on_decode: int, requests: int, prefill_worker_requests: int
) -> None:
    pending = PendingPrefill(P1, on_prefill, on_decode, prefill_uncached, requests, prefill_worker_requests)
    assert choose_path(uncached, RouterConfig(), D1, pending)[0] == "remote_prefill"
    config = RouterConfig(disagg_local_prefill_stall_weight=0.25)
    local = on_decode + uncached * (1 + 0.25 * requests)
    # A prefill worker of role both stalls its own decoding requests alike.
    remote = on_prefill + prefill_uncached * (1 + 0.25 * prefill_worker_requests) + 0.35 * uncached
    chosen = choose_path(uncached, config, D1, pending)[0]
    assert chosen == ("local_prefill" if local < remote else "remote_prefill")


def mixed_fleet(**config: object) -> KvRouter:
    """One prefill worker (P1) and two workers of role both (D1, D2): a mixed fleet."""
    settings = {"block_size": BS, "policy": "dynamo", **config}
    router = KvRouter(RouterConfig(**settings), rng=random.Random(0))  # type: ignore[arg-type]
    router.register_worker(WorkerConfig(worker_id=P1, role="prefill"))
    for worker_id in (D1, D2):
        router.register_worker(WorkerConfig(worker_id=worker_id))
    return router


def test_a_decode_worker_of_role_both_is_never_its_own_remote_prefill_worker() -> None:
    """Its prefix cached on D1 alone, the decode leg goes to D1; the prefill leg, were D1 a candidate,
    would go there too (a 'remote' prefill and KV transfer to itself). It goes to P1 or D2."""
    router = mixed_fleet()
    router.apply_event(prompt_stored_event(D1, PROMPT[: 10 * BS], BS, blocks=10))
    decision = route(router, PROMPT)
    receipt = decision.disaggregation
    assert decision.worker_id == D1 and receipt is not None and receipt.path == "remote_prefill"
    assert receipt.prefill is not None and receipt.prefill.worker_id in (P1, D2)
    # Pinned to the decode worker itself, the prefill is the local path.
    pinned = route(router, PROMPT, "s", pinned_worker=(D1, 0), pinned_prefill=(D1, 0))
    assert pinned.disaggregation is not None and pinned.disaggregation.path == "local_prefill"
    assert pinned.disaggregation.reason == f"the prefill leg pinned to decode worker {D1} itself: prefilled there"


def test_the_estimated_rule_charges_a_both_prefill_worker_for_the_requests_it_stalls() -> None:
    """D1 decodes one request, D2 (role both; P1 is busy) three. Compared by pending
    prefill alone, a remote prefill on D2 (640 tokens) beats a local one on D1 (640 x 2 for the request it
    stalls); charged for the three requests it stalls on D2 (640 x 4), it does not."""
    router = mixed_fleet(disagg_local_prefill_stall_weight=1.0, disagg_transfer_cost_per_token=0.0)
    # P1 busy prefilling 2,000 tokens for D1's one request: the prefill leg below goes to D2.
    route(router, list(range(20_000, 22_000)), "busy", pinned_worker=(D1, 0), pinned_prefill=(P1, 0))
    for index in range(3):  # decoding on D2, their prefill done
        short = list(range(5000 + index * 100, 5000 + index * 100 + BS))
        route(router, short, f"d{index}", pinned_worker=(D2, 0))
        router.mark_prefill(f"d{index}")
    decision = route(router, PROMPT, "long", pinned_worker=(D1, 0))
    receipt = decision.disaggregation
    assert receipt is not None and receipt.path == "local_prefill", receipt
    assert receipt.reason.startswith(
        f"estimated 1280 tokens on decode worker {D1} (0 pending + 640 uncached x 2 for the 1 requests it stalls) "
        f"against 2560 on prefill worker {D2} (0 pending + 640 uncached x 4 for the 3 requests it stalls + 0 for "
        "the KV transfer)"
    )


@pytest.mark.parametrize("among_both", [False, True])
def test_workers_of_role_both_hand_prefill_to_each_other_only_when_asked(among_both: bool) -> None:
    """Two workers of role both are an aggregated fleet, unless ``disagg_among_both_workers``: then the
    decode leg goes where the prompt's prefix is cached and its long uncached rest is prefilled on the
    other worker. One worker left cannot hand over: aggregated again."""
    router = KvRouter(RouterConfig(block_size=BS, policy="dynamo", disagg_among_both_workers=among_both))
    for worker_id in (D1, D2):
        router.register_worker(WorkerConfig(worker_id=worker_id))
    router.apply_event(prompt_stored_event(D1, PROMPT[: 5 * BS], BS, blocks=5))
    decision = route(router, PROMPT)
    assert decision.worker_id == D1 and router.disaggregated is among_both
    receipt = decision.disaggregation
    if not among_both:
        assert receipt is None
        return
    assert receipt is not None and receipt.path == "remote_prefill"
    assert receipt.decode_uncached_tokens == len(PROMPT) - 5 * BS
    assert receipt.prefill is not None and receipt.prefill.worker_id == D2
    router.remove_worker(D2)
    assert not router.disaggregated and route(router, PROMPT, "alone").disaggregation is None


@pytest.mark.parametrize("among_both", [False, True])
def test_a_request_among_workers_of_role_both_is_one_leg_beside_another_models_prefill_and_decode_workers(
    among_both: bool,
) -> None:
    """Workers 5 and 6 (role both) serve one model, P1 and D1 another: a request among 5 and 6 is split
    only with ``disagg_among_both_workers``, whatever the rest of the fleet; among P1 and D1 it is."""
    router = KvRouter(RouterConfig(block_size=BS, policy="dynamo", disagg_among_both_workers=among_both))
    router.register_worker(WorkerConfig(worker_id=P1, role="prefill"))
    router.register_worker(WorkerConfig(worker_id=D1, role="decode"))
    for worker_id in (5, 6):
        router.register_worker(WorkerConfig(worker_id=worker_id))
    assert router.disaggregated and router.two_legs() and router.two_legs({P1, D1})
    assert router.two_legs({5, 6}) is among_both and not router.two_legs({5})
    decision = route(router, PROMPT, "a", among={5, 6})
    assert decision.worker_id in (5, 6)
    assert sorted(booking for booking, _ in router.bookings()) == (["a", "a#prefill"] if among_both else ["a"])
    if among_both:
        assert decision.disaggregation is not None and decision.disaggregation.path == "remote_prefill"
    else:
        assert decision.disaggregation is None
        with pytest.raises(InvalidRequest, match="routed as one leg: none of its workers has role prefill"):
            route(router, PROMPT, "pinned", among={5, 6}, pinned_prefill=(5, 0))
    split = route(router, PROMPT, "b", among={P1, D1})
    assert split.worker_id == D1 and split.disaggregation is not None and split.disaggregation.prefill is not None


def test_a_request_routed_as_one_leg_on_a_disaggregated_fleet_books_one_worker() -> None:
    """A request with no KV to hand over (the proxy's pooling routes) goes to one worker of either
    role, booked there alone; a prefill pin then has no leg to pin."""
    router = fleet()
    decision = route(router, PROMPT, "embed", one_leg=True)
    assert decision.disaggregation is None
    assert [booking for booking, _ in router.bookings()] == ["embed"]
    with pytest.raises(InvalidRequest, match="routed as one leg: it has no KV to hand over"):
        route(router, PROMPT, "pinned", one_leg=True, pinned_prefill=(P1, 0))
    assert router.mark_free("embed") and all(load == (0, 0, 0) for load in loads(router).values())


def test_a_remote_prefill_booking_is_freed_after_the_fleet_stopped_being_disaggregated() -> None:
    """Split between two workers of role both, then the decode worker leaves: the fleet is whole again,
    and the request's end still frees its prefill leg (it would have held its load until it expired)."""
    router = KvRouter(RouterConfig(block_size=BS, policy="dynamo", disagg_among_both_workers=True))
    for worker_id in (D1, D2):
        router.register_worker(WorkerConfig(worker_id=worker_id))
    router.apply_event(prompt_stored_event(D1, PROMPT[: 5 * BS], BS, blocks=5))
    decision = route(router, PROMPT, "a")
    assert decision.worker_id == D1 and decision.disaggregation is not None
    assert router.booking("a#prefill") is not None
    router.remove_worker(D1)
    assert not router.disaggregated
    router.mark_free("a")
    assert router.booking("a#prefill") is None and all(load == (0, 0, 0) for load in loads(router).values())


def test_a_request_id_ending_in_the_prefill_legs_suffix_is_refused() -> None:
    """``<id>#prefill`` is a remote prefill's booking: a caller's request under that id would have its
    booking freed by another request's prefill mark (and make that request a duplicate)."""
    router = fleet()
    with pytest.raises(InvalidRequest, match="request_id must not end in '#prefill'"):
        route(router, PROMPT, "job#prefill")
    assert list(router.bookings()) == []


def test_the_bridge_takes_its_role_from_a_flag_or_the_environment() -> None:
    required = {"worker_id": 4, "zmq_endpoint": "tcp://127.0.0.1:5557"}
    from_env = load_bridge_config(required, {"KV_ROUTER_BRIDGE_ROLE": "decode"})
    assert from_env.registration().role == "decode"
    assert load_bridge_config({**required, "role": "prefill"}, {"KV_ROUTER_BRIDGE_ROLE": "decode"}).role == "prefill"
    with pytest.raises(ConfigError, match="role"):
        load_bridge_config({**required, "role": "encode"}, {})

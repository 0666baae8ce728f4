"""Disaggregated decisions in the router's queue (§4.7, issue 27): a request waits while the pools its
decision would use are queue-busy (the decode pool for every path, the prefill pool for a remote
prefill), in the queue's order and limits, and is placed on both legs when capacity frees."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router import (
    DuplicateRequestId,
    KvRouter,
    QueueRejected,
    QueueRejection,
    QueueStats,
    RouteDecision,
    RouterConfig,
    RouteRequest,
)
from router.types import WorkerConfig, WorkerRole

BS = 16
P1, P2, D1, D2 = 1, 2, 3, 4
LONG = 640  # 40 blocks: over the 256-token local-prefill threshold
SHORT = 200  # under it, and over the 100 pending prefill tokens that make a rank queue-busy


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def fleet(roles: dict[int, WorkerRole], clock: Clock | None = None, **config: object) -> KvRouter:
    """Every rank queue-busy above 100 pending prefill tokens."""
    settings = RouterConfig(block_size=BS, router_queue_threshold=1.0, **config)  # type: ignore[arg-type]
    router = KvRouter(settings, rng=random.Random(0), clock=clock or Clock())
    for worker_id, role in roles.items():
        router.register_worker(WorkerConfig(worker_id=worker_id, role=role, max_num_batched_tokens=100))
    return router


TWO_BY_TWO: dict[int, WorkerRole] = {P1: "prefill", P2: "prefill", D1: "decode", D2: "decode"}
ONE_BY_ONE: dict[int, WorkerRole] = {P1: "prefill", D1: "decode"}


def prompt(name: str, size: int = LONG) -> list[int]:
    start = 10_000 * (sum(ord(c) for c in name) % 97 + 1)
    return list(range(start, start + size))


def request(name: str, size: int = LONG, **fields: object) -> RouteRequest:
    return RouteRequest(tokens=prompt(name, size), request_id=name, **fields)  # type: ignore[arg-type]


def loads(router: KvRouter) -> dict[int, tuple[int, int, int]]:
    return {
        load.worker_id: (load.active_prefill_tokens, load.active_decode_blocks, load.active_requests)
        for load in router.rank_loads()
    }


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())  # type: ignore[arg-type]


def path_of(decision: RouteDecision) -> tuple[str, int, int | None]:
    receipt = decision.disaggregation
    assert receipt is not None
    return receipt.path, decision.worker_id, receipt.prefill.worker_id if receipt.prefill else None


async def saturate_prefill_pool(router: KvRouter, *prefill_workers: int) -> None:
    """Remote prefills pinned on each prefill worker: 640 pending prefill tokens there, none on the
    decode workers (their legs book the prompt's blocks only)."""
    for worker_id in prefill_workers:
        decision = await router.new(request(f"ballast{worker_id}"), pinned_prefill=(worker_id, 0))
        assert path_of(decision)[0] == "remote_prefill"


def test_a_remote_prefill_waits_for_the_prefill_pool_and_is_placed_on_both_legs() -> None:
    clock = Clock()
    router = fleet(TWO_BY_TWO, clock)

    async def scenario() -> None:
        await saturate_prefill_pool(router, P1, P2)
        waiting = asyncio.ensure_future(router.new(request("r")))
        await settle()
        assert not waiting.done()
        assert router.queue_stats() == QueueStats(pending_count=1, pending_isl_tokens=LONG)
        assert router.booking("r") is None and router.booking("r#prefill") is None
        clock.now += 3.0
        assert router.mark_prefill("ballast2")  # P2's prefill leg is done: its pending prefill goes
        await settle()
        decision = waiting.result()
        assert path_of(decision)[::2] == ("remote_prefill", P2)
        assert decision.timing.queued_s == 3.0
        receipt = decision.disaggregation
        assert receipt is not None and receipt.prefill is not None
        assert receipt.prefill.booking_id == "r#prefill" and receipt.decode_uncached_tokens == LONG
        # Both legs booked: the prompt's prefill on P2, its blocks (no prefill) on the decode worker.
        booking = router.booking("r#prefill")
        assert booking is not None and booking.key == (P2, 0) and booking.prefill_tokens == LONG
        decode = router.booking("r")
        assert decode is not None and decode.key == (decision.worker_id, 0) and decode.prefill_tokens == 0
        assert loads(router)[P2] == (LONG, 0, 1)  # a prefill leg books no blocks
        assert router.queue_stats() == QueueStats(pending_count=0, pending_isl_tokens=0)
        assert router.mark_free("r")
        assert router.booking("r#prefill") is None

    run(scenario)


def test_a_local_path_needs_only_the_decode_pool_and_newcomers_wait_behind_a_backlog() -> None:
    router = fleet(TWO_BY_TWO)

    async def scenario() -> None:
        await saturate_prefill_pool(router, P1, P2)
        # Under the threshold: prefilled on a decode worker, which is free, so it goes at once.
        local = await router.new(request("short", 100))
        assert path_of(local) == ("local_prefill", local.worker_id, None)
        remote = asyncio.ensure_future(router.new(request("long")))
        await settle()
        # Behind the waiting remote prefill, even a short prompt waits (Dynamo's anti-bypass).
        behind = asyncio.ensure_future(router.new(request("short2", 100)))
        await settle()
        assert router.queue_stats() == QueueStats(pending_count=2, pending_isl_tokens=LONG + 100)
        assert router.mark_free("ballast1")  # both legs of the ballast on P1 freed
        await settle()
        assert path_of(remote.result())[::2] == ("remote_prefill", P1)
        assert path_of(behind.result())[0] == "local_prefill"
        assert router.queue_stats().pending_count == 0

    run(scenario)


def test_the_decode_pool_gates_every_path() -> None:
    router = fleet(TWO_BY_TWO)

    async def scenario() -> None:
        # Local prefills of 200 tokens pinned on each decode worker: both over 100 pending.
        for worker_id in (D1, D2):
            ballast = await router.new(request(f"local{worker_id}", SHORT), pinned_worker=(worker_id, 0))
            assert path_of(ballast) == ("local_prefill", worker_id, None)
        assert loads(router)[P1] == loads(router)[P2] == (0, 0, 0)  # the prefill pool is idle
        remote = asyncio.ensure_future(router.new(request("long")))
        await settle()
        assert router.queue_stats().pending_count == 1
        assert loads(router)[P1] == loads(router)[P2] == (0, 0, 0)  # nothing booked for it
        assert router.mark_prefill(f"local{D2}")
        await settle()
        receipt = remote.result().disaggregation
        assert receipt is not None and receipt.path == "remote_prefill" and remote.result().worker_id == D2

    run(scenario)


def test_a_pinned_prefill_worker_that_is_busy_holds_its_request() -> None:
    router = fleet(TWO_BY_TWO)

    async def scenario() -> None:
        await saturate_prefill_pool(router, P1)  # P2 is free
        free = await router.new(request("free"))
        assert path_of(free)[::2] == ("remote_prefill", P2)
        assert router.mark_prefill("free")
        pinned = asyncio.ensure_future(router.new(request("pinned"), pinned_prefill=(P1, 0)))
        await settle()
        assert router.queue_stats().pending_count == 1
        assert router.mark_prefill("ballast1")
        await settle()
        assert path_of(pinned.result())[::2] == ("remote_prefill", P1)

    run(scenario)


async def dispatch_order(router: KvRouter, requests: list[RouteRequest], before_each: Callable[[], None]) -> list[str]:
    """Saturate the one prefill worker, queue ``requests`` (each a remote prefill that saturates it
    again), then end one prefill leg at a time: exactly one request is dispatched per release."""
    await saturate_prefill_pool(router, P1)
    tasks = []
    for item in requests:
        before_each()
        tasks.append(asyncio.ensure_future(router.new(item)))
        await settle()
    assert router.queue_stats().pending_count == len(requests)
    order: list[str] = []
    running = f"ballast{P1}"
    for _ in requests:
        assert router.mark_prefill(running)
        await settle()
        done = [task.result() for task in tasks if task.done() and task.result().request_id not in order]
        assert len(done) == 1, "exactly one request is dispatched per release"
        assert path_of(done[0])[::2] == ("remote_prefill", P1)
        running = done[0].request_id or ""
        order.append(running)
    return order


@pytest.mark.parametrize("policy", ["fcfs", "wspt", "lcfs"])
def test_strict_priority_and_priority_jump_order_disaggregated_requests(policy: str) -> None:
    clock = Clock()

    def tick() -> None:
        clock.now += 1.0

    router = fleet(ONE_BY_ONE, clock, router_queue_policy=policy)
    requests = [request("a"), request("b", strict_priority=2), request("c", strict_priority=1), request("d")]
    orders = {
        # d's jump of 0 and a's head start: a first among the unprioritised; lcfs serves the newest.
        "fcfs": ["b", "c", "a", "d"],
        "wspt": ["b", "c", "a", "d"],
        "lcfs": ["b", "c", "d", "a"],
    }
    order: list[str] = []

    async def scenario() -> None:
        order.extend(await dispatch_order(router, requests, tick))

    run(scenario)
    assert order == orders[policy]


def test_priority_jump_moves_a_disaggregated_request_ahead() -> None:
    clock = Clock()

    def tick() -> None:
        clock.now += 1.0

    router = fleet(ONE_BY_ONE, clock)
    requests = [request("a"), request("b"), request("c", priority_jump=1.5), request("d")]
    order: list[str] = []

    async def scenario() -> None:
        order.extend(await dispatch_order(router, requests, tick))

    run(scenario)
    # c arrived 2 s after a but jumps 1.5 s: it passes b (1 s after a) but not a.
    assert order == ["a", "c", "b", "d"]


def test_a_full_queue_rejects_disaggregated_requests_as_aggregated_ones() -> None:
    # Limits scale with every registered worker, both pools: 1 x 2 here.
    router = fleet(ONE_BY_ONE, router_queue_request_limit_per_worker=1)

    async def scenario() -> None:
        await saturate_prefill_pool(router, P1)
        waiting = [asyncio.ensure_future(router.new(request(name))) for name in "ab"]
        await settle()
        with pytest.raises(QueueRejected) as caught:
            await router.new(request("z"))
        assert caught.value.rejection == QueueRejection(
            policy_class="default", limit_kind="requests", current=2, limit=2
        )
        assert router.booking("z") is None and router.booking("z#prefill") is None
        for task in waiting:
            task.cancel()
        await settle()
        # Cancelled while waiting: nothing booked for them, the queue empty.
        assert router.queue_stats() == QueueStats(pending_count=0, pending_isl_tokens=0)
        assert router.mark_free(f"ballast{P1}")
        assert all(load == (0, 0, 0) for load in loads(router).values())

    run(scenario)


def test_without_a_queue_both_legs_are_placed_at_once() -> None:
    router = KvRouter(RouterConfig(block_size=BS), rng=random.Random(0))
    for worker_id, role in ONE_BY_ONE.items():
        router.register_worker(WorkerConfig(worker_id=worker_id, role=role, max_num_batched_tokens=100))

    async def scenario() -> None:
        for name in "abc":
            assert path_of(await router.new(request(name)))[::2] == ("remote_prefill", P1)
        assert loads(router)[P1] == (3 * LONG, 0, 3)

    run(scenario)


def test_an_id_booked_while_its_twin_waited_is_refused_without_a_stray_prefill_leg() -> None:
    router = fleet(TWO_BY_TWO)

    async def scenario() -> None:
        for worker_id in (D1, D2):
            await router.new(request(f"local{worker_id}", SHORT), pinned_worker=(worker_id, 0))
        # Neither is booked yet, so both are accepted: the first takes the local path, the second
        # would be a remote prefill under the same id.
        first = asyncio.ensure_future(router.new(RouteRequest(tokens=prompt("x", 100), request_id="r")))
        twin = asyncio.ensure_future(router.new(RouteRequest(tokens=prompt("y"), request_id="r")))
        await settle()
        assert router.queue_stats().pending_count == 2
        assert router.mark_free(f"local{D2}")
        await settle()
        assert path_of(first.result()) == ("local_prefill", D2, None)
        with pytest.raises(DuplicateRequestId):
            twin.result()
        assert router.booking("r#prefill") is None
        assert loads(router)[P1] == loads(router)[P2] == (0, 0, 0)

    run(scenario)


@settings(max_examples=60, deadline=None)
@given(busy=st.frozensets(st.sampled_from([P1, P2, D1, D2])), long_prompt=st.booleans())
def test_a_request_waits_exactly_when_a_pool_its_path_uses_is_saturated(
    busy: frozenset[int], long_prompt: bool
) -> None:
    router = fleet(TWO_BY_TWO)

    async def book_ballast() -> None:
        # Prefill workers first: a remote prefill's decode leg needs a decode rank that is not busy.
        for worker_id in sorted(busy & {P1, P2}):
            await router.new(request(f"ballast{worker_id}"), pinned_prefill=(worker_id, 0))
        for worker_id in sorted(busy & {D1, D2}):
            await router.new(request(f"local{worker_id}", SHORT), pinned_worker=(worker_id, 0))

    run(book_ballast)
    decision = router.decide(request("r", LONG if long_prompt else 100))
    decode_saturated = {D1, D2} <= busy
    prefill_saturated = {P1, P2} <= busy
    expected_wait = decode_saturated or (long_prompt and prefill_saturated)
    if isinstance(decision, RouteDecision):
        assert not expected_wait
        assert path_of(decision)[0] == ("remote_prefill" if long_prompt else "local_prefill")
        # (Queue-busy ranks are not excluded, as for an aggregated request: the policy weighs their load.)
    else:
        decision.close()  # the wait, not awaited: nothing was booked for it
        assert expected_wait
        assert router.booking("r") is None and router.booking("r#prefill") is None

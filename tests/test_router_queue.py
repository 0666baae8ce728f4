"""Busy thresholds (reference/dynamo-router.md §4.6) and the queue (§4.7): filtering, waiting, order,
release by mark_prefill / mark_free / expiry, rejection and cancellation."""

from __future__ import annotations

import asyncio
import gc
import random
import tracemalloc
from collections.abc import Awaitable, Callable

import pytest

from router import (
    AllWorkersOverloaded,
    KvRouter,
    NoEligibleWorker,
    QueueRejected,
    QueueRejection,
    QueueStats,
    RouteDecision,
    RouterConfig,
    RouteRequest,
    RoutingConstraints,
    WorkerConfig,
)
from router.policies import Selection, SelectionContext, SelectionPolicy, register_policy, registry
from router.types import RouterConfigOverride
from tests.dynamo_fleet import prompt_stored_event

BS = 16
W = 5


def tokens(count: int, start: int = 0) -> list[int]:
    return list(range(start, start + count))


def route(router: KvRouter, prompt: list[int], request_id: str | None = None, **kw: object) -> RouteDecision:
    return asyncio.run(router.new(RouteRequest(tokens=prompt, request_id=request_id), explain=True, **kw))  # type: ignore[arg-type]


# ---------------------------------------------------------------------- busy thresholds (§4.6)
def test_absolute_prefill_threshold_skips_a_busy_worker() -> None:
    router = KvRouter(RouterConfig(block_size=BS, active_prefill_tokens_threshold=100), rng=random.Random(0))
    for worker_id in (1, 2):
        router.register_worker(WorkerConfig(worker_id=worker_id))
    route(router, tokens(101), "big", pinned_worker=(1, 0))
    assert [load.busy for load in router.rank_loads()] == [True, False]
    for _ in range(5):
        decision = route(router, tokens(16, 500))
        assert decision.worker_id == 2
        assert decision.explanation is not None
        assert [c.worker_id for c in decision.explanation.candidates] == [2]


def test_a_worker_is_skipped_only_when_all_its_ranks_are_busy() -> None:
    router = KvRouter(RouterConfig(block_size=BS, active_prefill_tokens_threshold=100), rng=random.Random(0))
    router.register_worker(WorkerConfig(worker_id=1, dp_size=2))
    route(router, tokens(101), "big", pinned_worker=(1, 0))
    decision = route(router, tokens(16, 500))
    assert decision.explanation is not None
    assert [(c.worker_id, c.dp_rank) for c in decision.explanation.candidates] == [(1, 0), (1, 1)]
    route(router, tokens(101, 900), "big2", pinned_worker=(1, 1))
    with pytest.raises(AllWorkersOverloaded, match="all 1 eligible workers are overloaded"):
        route(router, tokens(16, 500))


def test_fractional_prefill_threshold_uses_the_truncated_token_count() -> None:
    config = RouterConfig(block_size=BS, active_prefill_tokens_threshold_frac=0.0505)
    router = KvRouter(config, rng=random.Random(0))
    router.register_worker(WorkerConfig(worker_id=W, max_num_batched_tokens=1000))  # limit int(50.5) = 50
    route(router, tokens(50), "a")
    assert not router.rank_loads()[0].busy
    route(router, tokens(1, 900), "b")
    assert router.rank_loads()[0].busy
    with pytest.raises(AllWorkersOverloaded):
        route(router, tokens(5, 700))
    router.mark_prefill("b")
    route(router, tokens(5, 700))


def test_decode_threshold_reads_booked_blocks_and_reported_kv_usage() -> None:
    router = KvRouter(RouterConfig(block_size=BS, active_decode_blocks_threshold=0.5), rng=random.Random(0))
    router.register_worker(WorkerConfig(worker_id=W, total_kv_blocks=10))
    route(router, tokens(5 * BS), "five")  # 5 blocks: not over 0.5 * 10
    assert not router.rank_loads()[0].busy
    router.update_kv_used_blocks(W, 0, 6)  # the engine reports more than the router booked
    assert router.rank_loads()[0].busy
    router.update_kv_used_blocks(W, 0, 5)
    assert not router.rank_loads()[0].busy
    route(router, tokens(BS, 900), "sixth")
    assert router.rank_loads()[0].busy


def test_no_threshold_no_filtering() -> None:
    router = KvRouter(RouterConfig(block_size=BS), rng=random.Random(0))
    router.register_worker(WorkerConfig(worker_id=W, total_kv_blocks=1, max_num_batched_tokens=1))
    route(router, tokens(1000), "huge")
    assert not router.rank_loads()[0].busy
    route(router, tokens(16, 5000))


def test_no_eligible_worker() -> None:
    router = KvRouter(RouterConfig(block_size=BS), rng=random.Random(0))
    with pytest.raises(NoEligibleWorker):
        route(router, tokens(16))
    router.register_worker(WorkerConfig(worker_id=W))
    with pytest.raises(NoEligibleWorker, match="no worker available with taints"):
        constraints = RoutingConstraints(required_taints=["x"])
        asyncio.run(router.new(RouteRequest(tokens=tokens(16), routing_constraints=constraints)))
    with pytest.raises(NoEligibleWorker):
        route(router, tokens(16), pinned_worker=(W, 1))


# ---------------------------------------------------------------------- queue (§4.7)
class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def queued_router(clock: Clock | None = None, **config: object) -> KvRouter:
    """One worker whose rank is queue-busy above 100 pending prefill tokens."""
    settings = RouterConfig(block_size=BS, router_queue_threshold=1.0, **config)  # type: ignore[arg-type]
    router = KvRouter(settings, rng=random.Random(0), clock=clock or Clock())
    router.register_worker(WorkerConfig(worker_id=W, max_num_batched_tokens=100))
    return router


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def dispatch_order(
    router: KvRouter, requests: list[RouteRequest], before_each: Callable[[], None] | None = None
) -> list[str | None]:
    """Saturate the worker, queue ``requests``, then free one booking at a time; each queued request
    books more than the threshold, so exactly one is dispatched per release."""
    await router.new(RouteRequest(tokens=tokens(101, 90_000), request_id="saturate"))
    tasks = []
    for request in requests:
        if before_each is not None:
            before_each()
        tasks.append(asyncio.ensure_future(router.new(request)))
        await settle()
    assert router.queue_stats().pending_count == len(requests)
    order: list[str | None] = []
    running = "saturate"
    for _ in requests:
        assert router.mark_free(running)
        await settle()
        done = [task for task in tasks if task.done() and task.result().request_id not in order]
        assert len(done) == 1, "exactly one request is dispatched per release"
        running = done[0].result().request_id or ""
        order.append(running)
    return order


def queued(request_id: str, size: int = 101, **fields: object) -> RouteRequest:
    start = 1000 * (ord(request_id[0]) - ord("a") + 1)
    return RouteRequest(tokens=tokens(size, start), request_id=request_id, **fields)  # type: ignore[arg-type]


def run(scenario: Callable[[], Awaitable[object]]) -> object:
    return asyncio.run(scenario())  # type: ignore[arg-type]


def test_fcfs_dispatches_in_arrival_order_and_priority_jump_moves_ahead() -> None:
    clock = Clock()

    def tick() -> None:
        clock.now += 1.0

    router = queued_router(clock)
    requests = [queued("a"), queued("b"), queued("c", priority_jump=1.5), queued("d")]
    # c arrived 2 s after a but jumps 1.5 s: it passes b (1 s after a) but not a.
    assert run(lambda: dispatch_order(router, requests, tick)) == ["a", "c", "b", "d"]


def test_strict_priority_comes_first_in_every_policy() -> None:
    for policy in ("fcfs", "wspt", "lcfs"):
        router = queued_router(router_queue_policy=policy)
        requests = [queued("a"), queued("b", strict_priority=2), queued("c", strict_priority=1)]
        order = run(lambda router=router, requests=requests: dispatch_order(router, requests))  # type: ignore[misc]
        assert order == ["b", "c", "a"], policy


def test_wspt_prefers_the_least_uncached_work() -> None:
    router = queued_router(router_queue_policy="wspt")
    requests = [queued("a", 300), queued("b", 200), queued("c", 101), queued("d", 101, priority_jump=2.0)]
    # Scores (1 + jump) / isl: d 3/101, c 1/101, b 1/200, a 1/300.
    assert run(lambda: dispatch_order(router, requests)) == ["d", "c", "b", "a"]


def test_lcfs_serves_the_newest_first() -> None:
    clock = Clock()

    def tick() -> None:
        clock.now += 1.0

    router = queued_router(clock, router_queue_policy="lcfs")
    assert run(lambda: dispatch_order(router, [queued("a"), queued("b"), queued("c")], tick)) == ["c", "b", "a"]


def test_mark_prefill_and_expiry_release_the_queue() -> None:
    clock = Clock()
    router = queued_router(clock, request_expiry_secs=300.0)

    async def scenario() -> None:
        await router.new(RouteRequest(tokens=tokens(101, 90_000), request_id="saturate"))
        first = asyncio.ensure_future(router.new(queued("a")))
        second = asyncio.ensure_future(router.new(queued("b", 50)))
        await settle()
        assert router.queue_stats() == QueueStats(pending_count=2, pending_isl_tokens=151)
        clock.now += 2.0
        assert router.mark_prefill("saturate")
        await settle()
        decision = first.result()
        assert (decision.worker_id, decision.timing.queued_s) == (W, 2.0)
        assert not second.done()
        clock.now += 301.0  # every booking is now stale
        assert sorted(router.expire_stale()) == ["a", "saturate"]
        await settle()
        assert second.result().request_id == "b"
        assert router.queue_stats() == QueueStats(pending_count=0, pending_isl_tokens=0)

    run(scenario)


def test_queue_limits_reject_beyond_the_bound() -> None:
    async def scenario(router: KvRouter, sizes: list[int]) -> QueueRejection:
        await router.new(RouteRequest(tokens=tokens(101, 90_000), request_id="saturate"))
        waiting = []
        for index, size in enumerate(sizes[:-1]):
            waiting.append(asyncio.ensure_future(router.new(queued("abcdefg"[index], size))))
            await settle()
        with pytest.raises(QueueRejected) as caught:
            await router.new(queued("z", sizes[-1]))
        for task in waiting:
            task.cancel()
        return caught.value.rejection

    by_requests = queued_router(router_queue_request_limit_per_worker=2)
    assert run(lambda: scenario(by_requests, [10, 10, 10])) == QueueRejection(
        policy_class="default", limit_kind="requests", current=2, limit=2
    )
    # The request that crosses the token limit is accepted; the next is refused.
    by_tokens = queued_router(router_queue_isl_token_limit_per_worker=200)
    assert run(lambda: scenario(by_tokens, [101, 101, 10])) == QueueRejection(
        policy_class="default", limit_kind="raw_isl_tokens", current=202, limit=200
    )


def test_a_cancelled_waiter_leaves_the_queue_unbooked() -> None:
    router = queued_router()

    async def scenario() -> None:
        await router.new(RouteRequest(tokens=tokens(101, 90_000), request_id="saturate"))
        task = asyncio.ensure_future(router.new(queued("a")))
        await settle()
        task.cancel()
        await settle()
        assert task.cancelled()
        assert router.queue_stats().pending_count == 0
        router.mark_free("saturate")
        await settle()
        assert router.rank_loads()[0].active_requests == 0
        assert router.mark_free("a") is False

    run(scenario)


def test_waiters_fail_when_their_workers_go_away() -> None:
    router = queued_router()

    async def scenario() -> None:
        await router.new(RouteRequest(tokens=tokens(101, 90_000), request_id="saturate"))
        task = asyncio.ensure_future(router.new(queued("a")))
        await settle()
        router.remove_worker(W)
        await settle()
        with pytest.raises(NoEligibleWorker):
            task.result()

    run(scenario)


def test_without_a_queue_saturation_does_not_wait() -> None:
    router = KvRouter(RouterConfig(block_size=BS), rng=random.Random(0))
    router.register_worker(WorkerConfig(worker_id=W, max_num_batched_tokens=100))
    route(router, tokens(1000), "a")
    assert route(router, tokens(1000, 5000), "b").worker_id == W
    assert router.queue_stats() == QueueStats(pending_count=0, pending_isl_tokens=0)


def test_wspt_counts_the_best_eligible_cached_prefix() -> None:
    router = queued_router(router_queue_policy="wspt")
    longer = queued("a", 400)  # 16 of its 25 blocks cached: 144 uncached tokens
    assert isinstance(longer.tokens, list)
    router.apply_event(prompt_stored_event(W, longer.tokens, BS, blocks=16))
    # Scores 1/144 for a and 1/150 for b: the longer prompt has less left to compute.
    assert run(lambda: dispatch_order(router, [queued("b", 150), longer])) == ["a", "b"]


def test_cancel_waiting_releases_every_waiter_for_shutdown() -> None:
    router = queued_router()

    async def scenario() -> None:
        await router.new(RouteRequest(tokens=tokens(101, 90_000), request_id="saturate"))
        waiters = [asyncio.ensure_future(router.new(queued(name))) for name in "ab"]
        await settle()
        assert router.cancel_waiting() == 2
        await settle()
        assert all(task.cancelled() for task in waiters)
        assert router.queue_stats() == QueueStats(pending_count=0, pending_isl_tokens=0)

    run(scenario)


def test_an_overloaded_pinned_rank_is_refused() -> None:
    router = KvRouter(RouterConfig(block_size=BS, active_prefill_tokens_threshold=100), rng=random.Random(0))
    router.register_worker(WorkerConfig(worker_id=W))
    router.register_worker(WorkerConfig(worker_id=W + 1))
    route(router, tokens(101), "big", pinned_worker=(W, 0))
    with pytest.raises(AllWorkersOverloaded):
        route(router, tokens(16, 500), pinned_worker=(W, 0))
    assert route(router, tokens(16, 500)).worker_id == W + 1


def test_the_head_leaving_dispatches_those_behind_it() -> None:
    """The head waits for a busy worker; the request behind it could go to an idle one but waits behind
    it (anti-bypass). When the head's client leaves, the one behind goes at once, with no other event."""
    router = KvRouter(RouterConfig(block_size=BS, router_queue_threshold=0.0), rng=random.Random(0))
    router.register_worker(WorkerConfig(worker_id=W, taints=frozenset({"a"})))
    router.register_worker(WorkerConfig(worker_id=W + 1))
    only_a = RoutingConstraints(required_taints=["a"])

    async def scenario() -> None:
        await router.new(RouteRequest(tokens=tokens(40), request_id="a", routing_constraints=only_a))
        head = asyncio.ensure_future(
            router.new(RouteRequest(tokens=tokens(40, 100), request_id="b", routing_constraints=only_a))
        )
        await settle()
        behind = asyncio.ensure_future(router.new(RouteRequest(tokens=tokens(40, 200), request_id="c")))
        await settle()
        assert router.queue_stats().pending_count == 2
        head.cancel()
        await settle()
        assert behind.done() and behind.result().worker_id == W + 1
        assert router.queue_stats().pending_count == 0

    run(scenario)


def test_the_periodic_sweep_dispatches_a_head_the_load_model_freed() -> None:
    """With the linear prefill load model a rank's pending prefill decays with time alone, no call
    freeing anything: the sweep (`expire_stale`, nothing expired) dispatches the head then."""
    clock = Clock()
    router = queued_router(clock, router_prefill_load_model="linear", router_prefill_tokens_per_s=1000.0)

    async def scenario() -> None:
        await router.new(RouteRequest(tokens=tokens(101, 90_000), request_id="saturate"))
        waiting = asyncio.ensure_future(router.new(queued("a")))
        await settle()
        assert not waiting.done()
        clock.now += 1.0  # the 101 tokens took 0.1 s: nothing pending any more
        assert router.expire_stale() == []
        await settle()
        assert waiting.result().request_id == "a"

    run(scenario)


def test_a_waiter_whose_scheduling_raises_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A defect in one queued request's scheduling is raised to its own caller: the mark that
    dispatched it succeeds, and the request behind it is dispatched (it used to raise out of every mark
    and decision, 500s all round, leaving newcomers queued with nobody to free them once booked)."""
    monkeypatch.setattr(registry, "_POLICIES", dict(registry._POLICIES))  # no later test lists it

    class Defective(SelectionPolicy):
        """Picks the first candidate, but overflows for a request crediting its cache 7 times."""

        name = "defective"

        def __init__(self, config: RouterConfig, rng: random.Random) -> None:
            pass

        def select(self, context: SelectionContext) -> Selection:
            if context.config.overlap_score_credit == 7.0:
                raise OverflowError("cannot convert float infinity to integer")
            return Selection(0, "the first")

    register_policy("defective", Defective)
    router = queued_router(policy="defective")
    poisoned = RouteRequest(
        tokens=tokens(101, 5000),
        request_id="poisoned",
        router_config_override=RouterConfigOverride(overlap_score_credit=7.0),
    )

    async def scenario() -> None:
        await router.new(RouteRequest(tokens=tokens(101, 90_000), request_id="saturate"))
        head = asyncio.ensure_future(router.new(poisoned))
        await settle()
        behind = asyncio.ensure_future(router.new(queued("b")))
        await settle()
        assert router.queue_stats().pending_count == 2
        assert router.mark_free("saturate")
        await settle()
        with pytest.raises(OverflowError):
            head.result()
        assert behind.result().request_id == "b"
        assert router.queue_stats().pending_count == 0
        assert [load.active_requests for load in router.rank_loads()] == [1]
        assert router.booking("poisoned") is None

    run(scenario)


def test_requests_cancelled_while_the_queue_is_stuck_leave_nothing_behind() -> None:
    """Callers that give up while the queue's head cannot move (a client disconnecting, a gateway's
    timeout): their requests go, prompts included. Cancelled places stayed in the queue until the head
    moved, so a stuck queue kept every abandoned request."""

    async def scenario() -> tuple[int, int]:
        router = queued_router()
        await router.new(RouteRequest(tokens=tokens(101, 90_000), request_id="saturate"))
        head = asyncio.ensure_future(router.new(queued("a")))  # waits at the head throughout
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for round_ in range(10):
                tasks = [
                    asyncio.ensure_future(
                        router.new(RouteRequest(tokens=tokens(2048, 5000), request_id=f"{round_}-{i}"))
                    )
                    for i in range(50)
                ]
                await settle()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            del tasks
            await asyncio.sleep(0)
            gc.collect()
            retained = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        pending = router.queue_stats().pending_count
        router.mark_free("saturate")
        assert (await head).request_id == "a"
        return retained, pending

    retained, pending = run(scenario)  # type: ignore[misc]
    # 500 prompts of 2,048 tokens: about 30 MB kept before; the 64 cancelled places a queue may hold
    # beyond twice its waiting ones keep under 5.
    assert pending == 1
    assert retained < 5_000_000, retained

"""A request's computed prompt counts as cached on its worker until the engine's KV events can have told
it (`computed_prompt_credit_secs`): events trail an engine's answer, and a prompt sent again at once must
find its blocks where they are."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.events import RouterEvent, cleared_event, removed_event, stored_event
from indexer.hashing import compute_block_hashes, compute_sequence_hashes
from indexer.slots import WorkerRank
from router.computed_prompts import ComputedPrompts
from router.config import RouterConfig
from router.kv_router import KvRouter
from router.types import RouteRequest, WorkerConfig

pytestmark = pytest.mark.anyio
BLOCK = 4
PROMPT = list(range(100, 100 + 3 * BLOCK))  # three whole blocks


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def _router(clock: Clock, **config: object) -> KvRouter:
    router = KvRouter(RouterConfig(block_size=BLOCK, **config), rng=random.Random(0), clock=clock)  # type: ignore[arg-type]
    for worker_id in (1, 2):
        router.register_worker(WorkerConfig(worker_id=worker_id, leased=False))
    return router


async def _computed_and_ended(router: KvRouter, request_id: str, pinned: int | None = None) -> int:
    """Routes the prompt, marks its first token and frees it, as the proxy does; the worker it went to."""
    pin = None if pinned is None else (pinned, 0)
    decision = await router.new(RouteRequest(tokens=PROMPT, request_id=request_id), pinned_worker=pin)
    assert decision.overlap_blocks == 0 or pinned is not None
    router.mark_prefill(request_id)
    router.mark_free(request_id)
    return decision.worker_id


@pytest.mark.parametrize("policy", ["latency", "cache_affinity"])
async def test_a_prompt_sent_again_before_its_events_arrive_goes_where_it_was_computed(policy: str) -> None:
    clock = Clock()
    router = _router(clock, policy=policy)
    worker = await _computed_and_ended(router, "a")
    clock.now += 0.05
    again = await router.new(RouteRequest(tokens=PROMPT, request_id="b"))
    assert (again.worker_id, again.overlap_blocks, again.cached_tokens) == (worker, 3, 3 * BLOCK)
    assert [w.device_blocks for w in router.overlap(PROMPT).workers] == [3 if w == worker else 0 for w in (1, 2)]


async def test_the_credit_ends_after_its_seconds_and_events_then_tell_the_truth() -> None:
    clock = Clock()
    router = _router(clock, computed_prompt_credit_secs=0.5)
    worker = await _computed_and_ended(router, "a")
    clock.now += 0.49
    assert router.overlap(PROMPT).workers[worker - 1].device_blocks == 3
    clock.now += 0.02  # gone at once, not at the next sweep
    assert router.overlap(PROMPT).workers[worker - 1].device_blocks == 0
    # The engine's events, when they come, are the index's as ever: two blocks stored, one evicted.
    local = compute_block_hashes(PROMPT, BLOCK)
    sequence = compute_sequence_hashes(local)
    router.apply_event(RouterEvent(worker_id=worker, event=stored_event(1, zip(sequence[:2], local[:2], strict=True))))
    router.apply_event(RouterEvent(worker_id=worker, event=removed_event(2, sequence[1:2])))
    assert router.overlap(PROMPT).workers[worker - 1].device_blocks == 1


@pytest.mark.parametrize("how", ["cleared", "removed", "removed_directly"])
async def test_blocks_leaving_the_workers_index_end_its_credit(how: str) -> None:
    """An engine whose cache was reset (or that evicted, or restarted) may have lost the prompt too: a
    clear or a removal applied on the rank ends its credits, whichever way the event came."""
    clock = Clock()
    router = _router(clock)
    worker = await _computed_and_ended(router, "a")
    other = 3 - worker
    await _computed_and_ended(router, "b", pinned=other)
    evicted = stored_event(1, [(777, 888)])  # another prompt's block, stored and then evicted
    if how == "cleared":
        events = [RouterEvent(worker_id=worker, event=cleared_event(1))]
    else:
        events = [RouterEvent(worker_id=worker, event=e) for e in (evicted, removed_event(2, [777]))]
    if how == "removed_directly":
        for event in events:
            router.apply_event(event)
    else:
        router.sequencer.ingest(events)
    assert [w.device_blocks for w in router.overlap(PROMPT).workers] == [0 if w == worker else 3 for w in (1, 2)]


async def test_a_request_that_ends_before_its_first_token_is_credited_nothing() -> None:
    """A worker that failed the request, or a client that left, computed nothing to reuse."""
    clock = Clock()
    router = _router(clock)
    await router.new(RouteRequest(tokens=PROMPT, request_id="a"))
    router.mark_free("a")
    assert [w.device_blocks for w in router.overlap(PROMPT).workers] == [0, 0]


@pytest.mark.parametrize(("policy", "seconds"), [("dynamo", 1.0), ("latency", 0.0)])
async def test_no_credit_under_the_dynamo_policy_or_when_turned_off(policy: str, seconds: float) -> None:
    router = _router(Clock(), policy=policy, computed_prompt_credit_secs=seconds)
    await _computed_and_ended(router, "a")
    again = await router.new(RouteRequest(tokens=PROMPT, request_id="b"))
    assert again.overlap_blocks == 0
    assert [w.device_blocks for w in router.overlap(PROMPT).workers] == [0, 0]


@pytest.mark.parametrize("events_off", ["router", "worker"])
async def test_a_worker_without_kv_events_is_credited_nothing_its_prompts_are_predicted_at_routing(
    events_off: str,
) -> None:
    """Approximate mode records a prompt's blocks on its worker when it is routed, for minutes: a credit
    would repeat it."""
    clock = Clock()
    router = _router(clock, kv_events=events_off != "router")
    if events_off == "worker":
        for worker_id in (1, 2):
            router.register_worker(WorkerConfig(worker_id=worker_id, leased=False, kv_events=False))
    worker = await _computed_and_ended(router, "a")
    assert router.computed_prompts is not None and router.computed_prompts.credited_blocks() == {}
    clock.now += 5.0  # past the credit, well within router_ttl_secs
    again = await router.new(RouteRequest(tokens=PROMPT, request_id="b"))
    assert (again.worker_id, again.overlap_blocks) == (worker, 3)


async def test_a_worker_that_leaves_takes_its_credit_and_its_booked_prompts_with_it() -> None:
    clock = Clock()
    router = _router(clock)
    worker = await _computed_and_ended(router, "a")
    await router.new(RouteRequest(tokens=PROMPT, request_id="b"))  # booked there, not yet computed
    router.remove_worker(worker)
    router.register_worker(WorkerConfig(worker_id=worker, leased=False))
    router.mark_prefill("b")  # unknown now: nothing is credited for it
    assert [w.device_blocks for w in router.overlap(PROMPT).workers] == [0, 0]


async def test_a_peers_booking_is_credited_alike_so_replicas_agree() -> None:
    """Replica sync hands a peer's booking and its first token to every router: each credits it."""
    clock = Clock()
    router, peer = _router(clock), _router(clock)
    worker = await _computed_and_ended(router, "a")
    decision = await router.new(RouteRequest(tokens=PROMPT, request_id="b"))
    booking = router.booking("b")
    assert booking is not None
    peer.book_replicated("b", booking)
    router.mark_prefill("b")
    peer.mark_prefill("b", replicated=True)
    assert decision.worker_id == worker
    for each in (router, peer):
        assert [w.device_blocks for w in each.overlap(PROMPT).workers] == [3 if w == worker else 0 for w in (1, 2)]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(1, 3), st.integers(0, 1), st.integers(0, 5), st.integers(1, 6)),
            st.tuples(st.just("wait"), st.floats(0.0, 0.6)),
            st.tuples(st.just("forget"), st.integers(1, 3), st.sampled_from([0, 1, None])),
        ),
        max_size=40,
    )
)
def test_the_credited_depths_are_the_unexpired_prompts_longest_common_prefix(steps: list[tuple[Any, ...]]) -> None:
    """Against a plain list of credits: per rank, the longest prefix of the query that some unexpired
    prompt credited there shares (sequence hashes name their whole prefix, so shared blocks are leading)."""
    clock = Clock()
    credits = ComputedPrompts(1.0, clock)
    model: list[tuple[float, WorkerRank, tuple[int, ...]]] = []
    # Six prompts of six blocks: all share the first, pairs the second, each its own after.
    prompts = [
        compute_sequence_hashes(
            compute_block_hashes([0] * BLOCK + [1 + seed // 2] * BLOCK + [9 + seed] * 4 * BLOCK, BLOCK)
        )
        for seed in range(6)
    ]
    for step in steps:
        if step[0] == "add":
            _, worker, rank, seed, blocks = step
            hashes = tuple(prompts[seed][:blocks])
            credits.add((worker, rank), hashes)
            model.append((clock.now + 1.0, (worker, rank), hashes))
        elif step[0] == "wait":
            clock.now += step[1]
        else:
            _, worker, rank = step
            credits.forget(worker, rank)
            model = [entry for entry in model if entry[1][0] != worker or rank not in (None, entry[1][1])]
        for query in prompts:
            expected: dict[WorkerRank, int] = {}
            for expiry, key, hashes in model:
                if expiry > clock.now and hashes[0] == query[0]:
                    shared = next(
                        (i for i, (a, b) in enumerate(zip(hashes, query, strict=False)) if a != b),
                        min(len(hashes), len(query)),
                    )
                    expected[key] = max(expected.get(key, 0), shared)
            assert credits.depths(query) == expected


@pytest.mark.parametrize("first_token", [True, False])
async def test_a_remote_prefill_is_credited_on_its_prefill_worker_once_the_decode_leg_answers(
    first_token: bool,
) -> None:
    """The decode leg's first token means the prefill leg's prompt was computed on the prefill worker;
    a request that ends before it (the hand-off failed) credits neither worker."""
    router = KvRouter(RouterConfig(block_size=BLOCK), rng=random.Random(0))
    router.register_worker(WorkerConfig(worker_id=1, leased=False, role="prefill"))
    router.register_worker(WorkerConfig(worker_id=2, leased=False, role="decode"))
    long_prompt = list(range(500, 500 + 100 * BLOCK))  # above the 256 tokens kept on the decode worker
    decision = await router.new(RouteRequest(tokens=long_prompt, request_id="r"))
    assert decision.disaggregation is not None and decision.disaggregation.prefill is not None
    assert router.booking("r#prefill") is not None
    if first_token:
        router.mark_prefill("r")
    router.mark_free("r")
    assert router.booking("r#prefill") is None
    credited = [w.device_blocks for w in router.overlap(long_prompt).workers]
    assert credited == ([100, 100] if first_token else [0, 0])

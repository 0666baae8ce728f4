"""Active-sequence load tracking (reference/dynamo-router.md §4.5): potential loads, booking,
mark_prefill / mark_free, expiry, duplicate and unknown ids."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from indexer.events import RouterEvent, stored_event
from indexer.hashing import compute_block_hashes, compute_sequence_hashes
from router import DuplicateRequestId, InvalidRequest, KvRouter, PotentialLoad, RouterConfig, RouteRequest, WorkerConfig
from router.sequences import ActiveSequences
from tests.dynamo_fleet import prompt_stored_event

BS = 16
W = 7


class Clock:
    """A settable monotonic clock."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def one_worker_router(clock: Clock | None = None, **config: object) -> KvRouter:
    router = KvRouter(RouterConfig(block_size=BS, **config), rng=random.Random(0), clock=clock or Clock())  # type: ignore[arg-type]
    router.register_worker(WorkerConfig(worker_id=W))
    return router


def book(router: KvRouter, tokens: list[int], request_id: str) -> None:
    asyncio.run(router.new(RouteRequest(tokens=tokens, request_id=request_id)))


def load(router: KvRouter, tokens: list[int]) -> tuple[int, int, int]:
    (only,) = router.potential_loads(tokens)
    return only.potential_prefill_tokens, only.potential_decode_blocks, only.active_requests


PROMPT = list(range(100, 170))  # 70 tokens: 4 complete blocks and a partial one


def test_potential_loads_of_an_empty_worker() -> None:
    router = one_worker_router()
    assert router.potential_loads(PROMPT) == [
        PotentialLoad(worker_id=W, dp_rank=0, potential_prefill_tokens=70, potential_decode_blocks=4, active_requests=0)
    ]


def test_potential_loads_after_booking_the_same_prompt() -> None:
    """§4.5 [verified 1.6.1]: (70, 4) → book it, its 4 blocks get cached → (76, 4); a 10-token prompt → (80, 4)."""
    router = one_worker_router()
    book(router, PROMPT, "a")
    router.apply_event(prompt_stored_event(W, PROMPT, BS))
    assert load(router, PROMPT) == (76, 4, 1)
    assert load(router, list(range(9000, 9010))) == (80, 4, 1)


def test_potential_loads_without_kv_reuse() -> None:
    """§4.5: with router_assume_kv_reuse=false a booked 64-token prompt shares nothing → (128, 8)."""
    router = one_worker_router(router_assume_kv_reuse=False)
    prompt = PROMPT[:64]
    book(router, prompt, "a")
    assert load(router, prompt) == (128, 8, 1)


def test_potential_loads_without_prefill_tracking() -> None:
    router = one_worker_router(router_track_prefill_tokens=False)
    book(router, PROMPT, "a")
    assert load(router, PROMPT) == (0, 4, 1)


def test_potential_loads_without_block_tracking() -> None:
    router = one_worker_router(router_track_active_blocks=False)
    book(router, PROMPT, "a")
    assert load(router, PROMPT) == (140, 0, 1)


def test_shared_prefixes_count_once() -> None:
    router = one_worker_router()
    shared = list(range(64))
    book(router, shared + list(range(500, 532)), "a")  # 6 blocks
    book(router, shared + list(range(700, 764)), "b")  # 4 shared + 4 new
    (rank,) = router.rank_loads()
    assert (rank.active_decode_blocks, rank.active_requests) == (10, 2)
    # A third prompt on the same prefix adds only its own tail.
    assert load(router, [*shared, *range(900, 916)])[1] == 10 + 1


def test_mark_prefill_then_free() -> None:
    router = one_worker_router()
    book(router, PROMPT, "a")
    assert load(router, [1]) == (71, 4, 1)
    assert router.mark_prefill("a")
    assert router.mark_prefill("a")  # idempotent
    assert load(router, [1]) == (1, 4, 1)
    assert router.mark_free("a")
    assert load(router, [1]) == (1, 0, 0)


def test_unknown_request_ids_return_false() -> None:
    router = one_worker_router()
    assert router.mark_prefill("nope") is False
    assert router.mark_free("nope") is False
    book(router, PROMPT, "a")
    assert router.mark_free("a") is True
    assert router.mark_free("a") is False


def test_duplicate_active_request_id_is_refused_and_not_booked_twice() -> None:
    router = one_worker_router()
    book(router, PROMPT, "a")
    with pytest.raises(DuplicateRequestId, match="'a' already exists") as caught:
        book(router, list(range(10_000, 10_200)), "a")
    assert (caught.value.worker_id, caught.value.dp_rank) == (W, 0)
    (rank,) = router.rank_loads()
    assert (rank.active_prefill_tokens, rank.active_requests) == (70, 1)
    router.mark_free("a")
    book(router, PROMPT, "a")  # free again once released


def test_a_request_without_id_books_nothing() -> None:
    router = one_worker_router()
    asyncio.run(router.new(RouteRequest(tokens=PROMPT)))
    assert load(router, PROMPT) == (70, 4, 0)


def test_stale_requests_expire() -> None:
    clock = Clock()
    router = one_worker_router(clock, request_expiry_secs=300.0)
    book(router, PROMPT, "old")
    clock.now += 200
    book(router, list(range(3000, 3032)), "young")
    clock.now += 100  # "old" is exactly 300 s old: not yet stale
    assert router.expire_stale() == []
    clock.now += 0.5
    book(router, [5], "trigger")  # expiry also runs on every new
    assert router.mark_free("old") is False
    assert router.mark_free("young") is True


def test_a_held_booking_is_never_expired_and_does_not_stop_the_others_expiring() -> None:
    """A booking its caller frees on every path (the proxy's) outlives request_expiry_secs: a generation
    longer than that (300 s by default) was freed while still decoding, its worker looking idle."""
    clock = Clock()
    router = one_worker_router(clock, request_expiry_secs=300.0)
    book(router, PROMPT, "streaming")
    assert router.hold("streaming") and not router.hold("unknown")
    book(router, list(range(3000, 3032)), "forgotten")
    clock.now += 1000
    assert router.expire_stale() == ["forgotten"]
    book(router, [5], "trigger")
    assert router.mark_free("streaming") is True


def test_empty_and_malformed_prompts_are_invalid_requests() -> None:
    router = one_worker_router()
    with pytest.raises(InvalidRequest):
        book(router, [], "a")
    with pytest.raises(InvalidRequest):
        router.potential_loads(b"\x01\x02\x03")
    with pytest.raises(InvalidRequest):
        router.potential_loads([-1])


def test_packed_tokens_route_like_lists() -> None:
    router = one_worker_router()
    packed = b"".join(token.to_bytes(4, "little") for token in PROMPT)
    assert router.potential_loads(packed) == router.potential_loads(PROMPT)


def test_removing_a_worker_drops_its_requests() -> None:
    router = one_worker_router()
    book(router, PROMPT, "a")
    router.remove_worker(W)
    assert router.mark_free("a") is False
    assert router.rank_loads() == []


def test_shrinking_dp_ranks_drops_their_requests() -> None:
    router = KvRouter(RouterConfig(block_size=BS), rng=random.Random(0))
    router.register_worker(WorkerConfig(worker_id=W, dp_size=2))
    asyncio.run(router.new(RouteRequest(tokens=PROMPT, request_id="r1"), pinned_worker=(W, 1)))
    asyncio.run(router.new(RouteRequest(tokens=PROMPT, request_id="r0"), pinned_worker=(W, 0)))
    router.register_worker(WorkerConfig(worker_id=W, dp_size=1))
    assert [(rank.dp_rank, rank.active_requests) for rank in router.rank_loads()] == [(0, 1)]
    assert router.mark_free("r1") is False
    assert router.mark_free("r0") is True


def test_a_dp_rank_dropped_and_added_again_starts_a_fresh_untrusted_stream() -> None:
    router = KvRouter(RouterConfig(block_size=BS), rng=random.Random(0))
    router.register_worker(WorkerConfig(worker_id=W, dp_size=2))
    router.sequencer.ingest([RouterEvent(W, stored_event(1, [(11, 11)], dp_rank=1))])
    assert router.sequencer.freshness((W, 1))[0]
    router.register_worker(WorkerConfig(worker_id=W, dp_size=1))  # rank 1 and its blocks go
    router.register_worker(WorkerConfig(worker_id=W, dp_size=2))
    router.sequencer.ingest([RouterEvent(W, stored_event(2, [(12, 12)], parent_hash=11, dp_rank=1))])
    [status] = [status for status in router.sequencer.status() if status.dp_rank == 1]
    assert not status.trusted  # event 1's block is not in the index: not a whole stream
    assert (W, 1) in router.sequencer.untrusted


# ---------------------------------------------------------------------- model-based check
PREFIXES = [list(range(base, base + 64)) for base in (0, 10_000, 20_000)]


def naive_depth(active: set[int], hashes: list[int]) -> int:
    depth = 0
    while depth < len(hashes) and hashes[depth] in active:
        depth += 1
    return depth


class SequencesMachine(RuleBasedStateMachine):
    """Random bookings on a few ranks; invariants and prefix depths checked against a naive model."""

    @initialize()
    def setup(self) -> None:
        self.sequences = ActiveSequences()
        self.keys = [(1, 0), (1, 1), (2, 0)]
        for key in self.keys:
            self.sequences.add_rank(key)
        self.booked: dict[str, tuple[tuple[int, int], list[int]]] = {}
        self.started: dict[str, float] = {}
        self.held: set[str] = set()
        self.counter = 0
        self.now = 0.0

    def prompt_hashes(self, prefix: int, prefix_blocks: int, tail: int) -> list[int]:
        tokens = PREFIXES[prefix][: prefix_blocks * BS] + [50_000 + tail + i for i in range(BS)]
        return compute_sequence_hashes(compute_block_hashes(tokens, BS))

    @rule(
        rank=st.integers(0, 2),
        prefix=st.integers(0, 2),
        prefix_blocks=st.integers(0, 4),
        tail=st.integers(0, 3),
        prefill=st.integers(0, 500),
        output=st.sampled_from([None, 1, 3, 256]),  # no length, a disaggregated prefill's, two lengths
    )
    def add(self, rank: int, prefix: int, prefix_blocks: int, tail: int, prefill: int, output: int | None) -> None:
        self.counter += 1
        self.now += 1.0
        request_id = f"r{self.counter}"
        hashes = self.prompt_hashes(prefix, prefix_blocks, tail)
        key = self.keys[rank]
        self.sequences.add(
            request_id,
            key,
            hashes=hashes,
            private_blocks=0,
            prefill_tokens=prefill,
            now=self.now,
            expected_output_tokens=output,
        )
        self.booked[request_id] = (key, hashes)
        self.started[request_id] = self.now

    @precondition(lambda self: self.booked)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.booked)))
        assert self.sequences.free(request_id)
        del self.booked[request_id]
        self.held.discard(request_id)

    @precondition(lambda self: self.booked)
    @rule(data=st.data())
    def hold(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.booked)))
        assert self.sequences.hold(request_id)
        self.held.add(request_id)

    @precondition(lambda self: self.booked)
    @rule(data=st.data())
    def mark_prefill(self, data: st.DataObject) -> None:
        assert self.sequences.mark_prefill(data.draw(st.sampled_from(sorted(self.booked))))

    @rule(age=st.floats(0, 10))
    def expire(self, age: float) -> None:
        cutoff = self.now - age
        stale = {r for r in self.booked if self.started[r] < cutoff and r not in self.held}
        assert self.sequences.started_before(cutoff) == bool(stale)
        assert set(self.sequences.expire(cutoff)) == stale  # every stale one, and no held one
        for request_id in stale:
            del self.booked[request_id]

    @rule(prefix=st.integers(0, 2), prefix_blocks=st.integers(0, 4), tail=st.integers(0, 3))
    def query(self, prefix: int, prefix_blocks: int, tail: int) -> None:
        hashes = self.prompt_hashes(prefix, prefix_blocks, tail)
        got = {rank.key: depth for rank, depth in self.sequences.prefix_depths(hashes).items()}
        for key in self.keys:
            active = {h for owner, booked in self.booked.values() if owner == key for h in booked}
            assert got.get(key, 0) == naive_depth(active, hashes), key

    @invariant()
    def consistent(self) -> None:
        self.sequences._check()
        assert len(self.sequences) == len(self.booked)


TestSequencesMachine = SequencesMachine.TestCase
TestSequencesMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_prefix_depths_follow_each_ranks_longest_active_prefix() -> None:
    def chain(tokens: list[int]) -> list[int]:
        return compute_sequence_hashes(compute_block_hashes(tokens, BS))

    sequences = ActiveSequences()
    for key in [(1, 0), (2, 0), (3, 0), (4, 0)]:
        sequences.add_rank(key)
    base = list(range(8 * BS))
    query = chain(base)
    sequences.add("long", (1, 0), hashes=query[:7], private_blocks=0, prefill_tokens=0, now=0.0)
    sequences.add("mid", (2, 0), hashes=query[:3], private_blocks=0, prefill_tokens=0, now=1.0)
    sequences.add("short", (3, 0), hashes=query[:1], private_blocks=0, prefill_tokens=0, now=2.0)
    other = chain([*base[: 2 * BS], *range(9000, 9000 + 2 * BS)])  # shares 2 blocks, then diverges
    sequences.add("fork", (4, 0), hashes=other, private_blocks=0, prefill_tokens=0, now=3.0)
    sequences._check()
    depths = {rank.key: depth for rank, depth in sequences.prefix_depths(query).items()}
    assert depths == {(1, 0): 7, (2, 0): 3, (3, 0): 1, (4, 0): 2}
    assert sequences.prefix_depths([]) == {}
    assert sequences.prefix_depths(chain(list(range(7000, 7016)))) == {}

"""Approximate mode: workers without KV events are routed by the cache their routed prompts predict."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import msgspec
import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from api.app import create_app
from api.config import EventPlaneConfig, Settings
from indexer.events import RouterEvent, stored_event
from indexer.hashing import compute_block_hashes, compute_sequence_hashes
from indexer.radix_tree import RadixTree
from indexer.sequencer import EventSequencer
from indexer.slots import WorkerRank
from router.approximate import SWEEP_EVERY_S, PredictedCache
from router.config import RouterConfig
from router.kv_router import KvRouter
from router.types import RouteRequest, WorkerConfig

pytestmark = pytest.mark.anyio
BLOCK = 4


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def _prompt(seed: int, blocks: int = 3) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(blocks * BLOCK)]


def _router(clock: Clock, *workers: WorkerConfig, **config: object) -> KvRouter:
    router = KvRouter(RouterConfig(block_size=BLOCK, **config), rng=random.Random(0), clock=clock)  # type: ignore[arg-type]
    for worker in workers:
        router.register_worker(worker)
    return router


def _worker(worker_id: int, **fields: object) -> WorkerConfig:
    return WorkerConfig(worker_id=worker_id, leased=False, kv_events=False, **fields)  # type: ignore[arg-type]


async def test_a_routed_prompt_is_predicted_cached_on_its_worker_until_its_ttl() -> None:
    clock = Clock()
    router = _router(clock, _worker(1), _worker(2))
    first = await router.new(RouteRequest(tokens=_prompt(1), request_id="a"))
    router.mark_free("a")
    again = await router.new(RouteRequest(tokens=_prompt(1), request_id="b"))
    assert (again.worker_id, again.overlap_blocks) == (first.worker_id, 3)
    router.mark_free("b")
    clock.now += 119
    assert router.overlap(_prompt(1)).workers[first.worker_id - 1].device_blocks == 3  # refreshed at "b"
    clock.now += 121
    await router.new(RouteRequest(tokens=_prompt(2)))  # any decision sweeps what expired
    assert router.overlap(_prompt(1)).workers[first.worker_id - 1].device_blocks == 0


async def test_predictions_are_bounded_by_the_workers_kv_blocks_tail_first() -> None:
    router = _router(Clock(), _worker(1, total_kv_blocks=4))
    await router.new(RouteRequest(tokens=_prompt(1)))
    await router.new(RouteRequest(tokens=_prompt(2)))
    assert router.predictions is not None and router.predictions.blocks() == {(1, 0): 4}
    # The newer prompt is whole; the older kept its head block only (its tail went first).
    assert router.overlap(_prompt(2)).workers[0].device_blocks == 3
    assert router.overlap(_prompt(1)).workers[0].device_blocks == 1


async def test_real_events_replace_the_predictions() -> None:
    router = _router(Clock(), _worker(1))
    await router.new(RouteRequest(tokens=_prompt(1)))
    local = compute_block_hashes(_prompt(2), BLOCK)
    router.sequencer.ingest([RouterEvent(1, stored_event(1, zip(compute_sequence_hashes(local), local, strict=True)))])
    await router.new(RouteRequest(tokens=_prompt(3)))  # the first decision after the event sees it
    assert router.predictions is not None and router.predictions.blocks() == {}
    assert router.overlap(_prompt(1)).workers[0].device_blocks == 0
    assert router.overlap(_prompt(2)).workers[0].device_blocks == 3


async def test_workers_with_events_are_not_predicted_unless_the_router_has_kv_events_off() -> None:
    router = _router(Clock(), WorkerConfig(worker_id=1, leased=False))
    await router.new(RouteRequest(tokens=_prompt(1)))
    assert router.predictions is None
    everyone = _router(Clock(), WorkerConfig(worker_id=1, leased=False), kv_events=False)
    await everyone.new(RouteRequest(tokens=_prompt(1)))
    assert everyone.predictions is not None and everyone.predictions.blocks() == {(1, 0): 3}


async def test_a_prompt_its_worker_failed_is_forgotten_there_but_what_it_found_cached_stays() -> None:
    """`forget_uncomputed_predictions` (the proxy's, on a worker failing the request before its first
    token): the blocks the booking added go; those an earlier prompt predicted, or a computed one, stay."""
    clock = Clock()
    router = _router(clock, _worker(1))
    head, tail = _prompt(1), _prompt(2)
    await router.new(RouteRequest(tokens=head, request_id="a"))
    router.mark_prefill("a")  # computed: its prediction stands whatever happens to "a" now
    router.forget_uncomputed_predictions("a")
    router.mark_free("a")
    clock.now += 1
    await router.new(RouteRequest(tokens=head + tail, request_id="b"))
    assert router.overlap(head + tail).workers[0].device_blocks == 6
    router.forget_uncomputed_predictions("b")
    router.mark_free("b")
    assert router.overlap(head + tail).workers[0].device_blocks == 3  # the head, predicted before "b"
    assert router.predictions is not None and router.predictions.blocks() == {(1, 0): 3}


@pytest.fixture
def client() -> Iterator[TestClient]:
    settings = Settings(router=RouterConfig(block_size=BLOCK), event_plane=EventPlaneConfig(embedded_nats=False))
    app = create_app(settings, registry=CollectorRegistry(), rng=random.Random(0))
    with TestClient(app, base_url="http://127.0.0.1") as test_client:
        yield test_client


def test_predicted_blocks_are_marked_in_the_dump_and_the_metrics(client: TestClient) -> None:
    assert client.post("/v1/workers", json={"worker_id": 9, "kv_events": False}).status_code == 201
    assert client.post("/v1/new", json={"tokens": _prompt(1)}).status_code == 200
    (event,) = client.get("/v1/dump").json()
    assert event["predicted"] is True and event["worker_id"] == 9
    assert len(event["event"]["data"]["stored"]["blocks"]) == 3
    assert 'kv_router_worker_predicted_blocks{dp_rank="0",worker_id="9"} 3.0' in client.get("/metrics").text


class _TwoPassPredictions(PredictedCache):
    """The recording as it was before its fast path (a loop over every block, a removal per block):
    the oracle."""

    def _expire(self, rank: WorkerRank, held: OrderedDict[int, float], now: float) -> None:
        while held:
            block_hash, expiry = next(iter(held.items()))
            if expiry > now:
                return
            del held[block_hash]
            self._remove(rank, [block_hash])

    def record(self, rank: WorkerRank, local_hashes: list[int], sequence: Sequence[int] | None = None) -> None:
        if rank in self._replaced or self._sequencer.heard_from(*rank):
            raise AssertionError("not exercised here")
        capacity = self._capacity(rank[0])
        now = self._clock()
        held = self._ranks.setdefault(rank, OrderedDict())
        self._expire(rank, held, now)
        sequence = compute_sequence_hashes(local_hashes)
        run: list[tuple[int, int]] = []
        parent: int | None = None
        for position, (block_hash, local_hash) in enumerate(zip(sequence, local_hashes, strict=True)):
            if block_hash in held:
                if run:
                    self._store(rank, parent, run)
                run = []
                continue
            if not run:
                parent = sequence[position - 1] if position else None
            run.append((block_hash, local_hash))
        if run:
            self._store(rank, parent, run)
        expiry = now + self._ttl_s
        for block_hash in reversed(sequence):
            held[block_hash] = expiry
            held.move_to_end(block_hash)
        while len(held) > capacity:  # one removal a block: the batched one must leave the same index
            self._remove(rank, [held.popitem(last=False)[0]])
        if now - self._swept >= SWEEP_EVERY_S:
            self.sweep(now)


_record_steps = st.lists(
    st.tuples(
        st.integers(1, 2),  # the worker
        st.integers(0, 3),  # the shared prefix's blocks
        st.integers(0, 5),  # the prompt's own blocks
        st.integers(0, 3),  # which of a few suffixes
        st.sampled_from([0.0, 0.5, 30.0, 130.0]),  # the clock's step before it
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(_record_steps, st.sampled_from([None, 6, 12]))
def test_recording_keeps_exactly_the_loop_s_predictions(
    steps: list[tuple[int, int, int, int, float]], kv_blocks: int | None
) -> None:
    clock = Clock()
    workers = {worker_id: _worker(worker_id, total_kv_blocks=kv_blocks) for worker_id in (1, 2)}
    caches = [
        kind(120.0, EventSequencer(RadixTree()), workers.get, clock=clock)
        for kind in (PredictedCache, _TwoPassPredictions)
    ]
    shared = list(range(1000, 1004))
    for worker_id, prefix, own, suffix, step in steps:
        clock.now += step
        local_hashes = shared[:prefix] + [suffix * 100 + block for block in range(own)]
        fast, oracle = caches
        fast.record((worker_id, 0), local_hashes, compute_sequence_hashes(local_hashes) if own % 2 else None)
        oracle.record((worker_id, 0), local_hashes)
        assert {rank: list(held.items()) for rank, held in fast._ranks.items()} == {
            rank: list(held.items()) for rank, held in oracle._ranks.items()
        }
        assert msgspec.json.encode(fast.dump_events()) == msgspec.json.encode(oracle.dump_events())

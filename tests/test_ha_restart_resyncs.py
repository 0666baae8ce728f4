"""A durable restart (``--durable-events``) asks no worker for anything it restored, on a real nats-server.

The event plane reads the worker registry after the snapshot is restored and before the stream is
replayed: every registration is new to it. A (worker, rank) whose trusted stream the snapshot restored
under the same publisher epoch, or that the replay brings from its first event, is not asked for a full
dump (a worker that would not answer kept its trust; before, every worker was asked, and one that did
not answer lost it). A worker the index never heard from, or registered under a new epoch (its
publisher restarted while the router was down), is still asked, and nothing the snapshot held of it
stays, even when the start is tried again; nor of a worker that left while the router was down.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from api.config import EventPlaneConfig, HaConfig
from api.plane_lifecycle import PlaneLifecycle
from indexer.hashing import compute_block_hashes, compute_sequence_hashes
from router.config import RouterConfig
from router.event_plane.embedded_server import EmbeddedNats
from router.event_plane.publisher import KvEventPublisher
from router.event_plane.subjects import Subjects
from router.kv_router import KvRouter
from router.types import WorkerConfig
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

BLOCK = 16


def pairs(seed: int, blocks: int) -> list[tuple[int, int]]:
    local = compute_block_hashes([seed * 100_000 + i for i in range(BLOCK * blocks)], BLOCK)
    return list(zip(compute_sequence_hashes(local), local, strict=True))


class Lifecycle:
    """A router's event plane with durable events, run as `kv-router serve` runs it."""

    def __init__(self, url: str) -> None:
        self.router = KvRouter(RouterConfig(block_size=BLOCK))
        ha = HaConfig(durable_events=True, router_name="r", snapshot_every_events=10**9, snapshot_every_secs=3600.0)
        self.life = PlaneLifecycle(self.router, EventPlaneConfig(nats_url=url, resync_timeout_secs=0.5), ha)
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Lifecycle:
        self.task = asyncio.create_task(self.life.run())
        await asyncio.wait_for(self.life.started(), 60)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.task is not None
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.life.stop()

    def trusted(self, worker_id: int) -> bool:
        streams = [s for s in self.router.sequencer.status() if s.worker_id == worker_id]
        return bool(streams) and all(s.trusted for s in streams)


@pytest.fixture
async def asked(client: Client) -> AsyncIterator[Counter[int]]:
    """Worker -> resync requests sent to it (seen beside the workers' own responders)."""
    counts: Counter[int] = Counter()

    async def seen(message: Msg) -> None:
        counts[int(message.subject.rsplit(".", 1)[1])] += 1

    subscription = await client.subscribe(f"kv.{Subjects().namespace}.resync.*", cb=seen)
    yield counts
    await subscription.unsubscribe()


async def test_a_restart_asks_no_worker_it_restored_and_asks_the_new_and_the_restarted(
    nats_server: EmbeddedNats, client: Client, asked: Counter[int]
) -> None:
    url = nats_server.url
    in_snapshot = KvEventPublisher(client, WorkerConfig(worker_id=61, block_size=BLOCK))
    replayed = KvEventPublisher(client, WorkerConfig(worker_id=62, block_size=BLOCK))
    restarting = KvEventPublisher(client, WorkerConfig(worker_id=63, block_size=BLOCK))
    async with Lifecycle(url) as first:
        for publisher in (in_snapshot, restarting):
            await publisher.start(heartbeat=False)
        await eventually(lambda: all(first.router.has_worker(w) for w in (61, 63)))
        await in_snapshot.stored(pairs(1, 4))
        await restarting.stored(pairs(2, 4))
        await eventually(lambda: first.trusted(61) and first.trusted(63))
        durable = first.life.durable
        assert durable is not None
        await eventually(lambda: durable.applied_seq >= 2)
        assert await durable.write_snapshot()
        # After the snapshot: more of 61's events, and worker 62's first ones, only in the stream.
        await in_snapshot.stored(pairs(3, 2))
        await replayed.start(heartbeat=False)
        await eventually(lambda: first.router.has_worker(62))
        await replayed.stored(pairs(4, 3))
        await eventually(lambda: durable.applied_seq >= 4 and first.trusted(62))
    # While the router is down: worker 63's publisher restarts (a new epoch), worker 64 registers (it
    # has sent no event yet), and no worker answers a resync any more.
    for publisher in (in_snapshot, replayed, restarting):
        await publisher.stop()
    restarted = KvEventPublisher(client, WorkerConfig(worker_id=63, block_size=BLOCK))
    await restarted.start(heartbeat=False)
    await restarted.stop()  # registered under its new epoch, and silent too
    new = KvEventPublisher(client, WorkerConfig(worker_id=64, block_size=BLOCK))
    await new.start(heartbeat=False)
    await new.stop()
    asked.clear()

    async with Lifecycle(url) as again:
        await eventually(lambda: {61, 62, 63, 64} <= {w.worker_id for w in again.router.workers()})
        await asyncio.sleep(1.5)  # past the resync timeout: an unanswered ask has given up by now
        assert asked[61] == 0 and asked[62] == 0, f"restored workers were asked: {dict(asked)}"
        assert again.trusted(61) and again.trusted(62)
        assert again.router.tree.dump_events(), "the index came back"
        # a worker registered under a new epoch, and one new to the index, are asked
        await eventually(lambda: asked[63] >= 1 and asked[64] >= 1, what=f"workers 63 and 64 asked: {dict(asked)}")
        assert again.life.plane is not None and again.life.plane.outcomes["join_resync_skipped"] == 2


async def first_life_with_a_snapshot(
    url: str, publisher: KvEventPublisher, seed: int, *, then_in_the_stream_only: list[tuple[int, int]] | None = None
) -> None:
    """A router's first life: ``publisher``'s worker stores 4 blocks (``pairs(seed, 4)``) and a snapshot
    is written; then ``then_in_the_stream_only`` is stored, after the snapshot."""
    worker_id = publisher.worker_id
    async with Lifecycle(url) as first:
        await publisher.start(heartbeat=False)
        await eventually(lambda: first.router.has_worker(worker_id))
        await publisher.stored(pairs(seed, 4))
        durable = first.life.durable
        assert durable is not None
        await eventually(lambda: durable.applied_seq >= 1 and first.trusted(worker_id))
        assert await durable.write_snapshot()
        if then_in_the_stream_only is not None:
            await publisher.stored(then_in_the_stream_only)
            await eventually(lambda: durable.applied_seq >= 2)


def fail_start_once(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on the durable start fails once (its snapshot's fetch timed out) after the event plane
    registered the workers; the list holds the number of attempts made."""
    from router.replicas.durable import DurableEvents

    start = DurableEvents.start
    attempts = [0]

    async def failing_once(self: DurableEvents) -> None:
        attempts[0] += 1
        if attempts[0] == 1:
            raise TimeoutError("the snapshot's fetch timed out")
        await start(self)

    monkeypatch.setattr(DurableEvents, "start", failing_once)
    return attempts


async def registered_while_down(client: Client, worker_id: int) -> None:
    """A publisher of the worker (a new process: a new epoch) registers it and stops, silent."""
    publisher = KvEventPublisher(client, WorkerConfig(worker_id=worker_id, block_size=BLOCK))
    await publisher.start(heartbeat=False)
    await publisher.stop()


async def started_after_one_failure(url: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Lifecycle, list[int]]:
    """A router whose durable start fails once, run as the supervisor runs it (again after a failure),
    once started; and the list holding its number of attempts."""
    attempts = fail_start_once(monkeypatch)
    lifecycle = Lifecycle(url)

    async def supervised() -> None:
        for _ in range(3):
            try:
                await lifecycle.life.run()
            except TimeoutError:
                continue

    lifecycle.task = asyncio.create_task(supervised())
    await asyncio.wait_for(lifecycle.life.started(), 60)
    return lifecycle, attempts


async def test_a_start_tried_again_still_asks_the_worker_new_to_the_index(
    nats_server: EmbeddedNats, client: Client, asked: Counter[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The supervisor runs a failed start again: the workers the failed attempt registered are echoes to
    the next one, and their held joins are held again, so a worker the index never heard from is still
    asked for its dump."""
    url = nats_server.url
    in_snapshot = KvEventPublisher(client, WorkerConfig(worker_id=61, block_size=BLOCK))
    await first_life_with_a_snapshot(url, in_snapshot, 1)
    await in_snapshot.stop()
    await registered_while_down(client, 64)  # no event sent yet
    asked.clear()

    again, attempts = await started_after_one_failure(url, monkeypatch)
    try:
        await eventually(lambda: asked[64] >= 1)
        assert asked[61] == 0 and attempts[0] == 2
        assert again.life.plane is not None and again.life.plane.outcomes["join_resync_skipped"] == 1
    finally:
        await again.__aexit__()


async def test_a_start_tried_again_keeps_nothing_of_a_worker_that_restarted(
    nats_server: EmbeddedNats, client: Client, asked: Counter[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker 63's publisher restarts while the router is down. The first attempt registers it under its
    new epoch and drops what the snapshot held of it; the attempt then fails, and the retry restores
    the snapshot again: the new epoch still wins. Before, the retry brought back the old process's
    blocks and epoch, trusted, replayed its later events, and a prompt of them went to worker 63 for a
    cache its engine no longer held."""
    url = nats_server.url
    old = KvEventPublisher(client, WorkerConfig(worker_id=63, block_size=BLOCK))
    await first_life_with_a_snapshot(url, old, 2, then_in_the_stream_only=pairs(3, 2))
    await old.stop()
    await registered_while_down(client, 63)  # under its new epoch, silent
    asked.clear()

    again, attempts = await started_after_one_failure(url, monkeypatch)
    try:
        assert attempts[0] == 2
        registered = again.router.worker(63)
        assert registered is not None
        assert again.router.sequencer.epochs().get(63) == registered.epoch
        assert not [e for e in again.router.tree.dump_events() if e.worker_id == 63], "the old process's blocks"
        await eventually(lambda: asked[63] >= 1, what="the restarted worker asked for its state")
        assert not again.trusted(63)
    finally:
        await again.__aexit__()


async def test_readiness_says_why_the_last_start_failed_while_nats_is_connected(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    from router.replicas.durable import DurableEvents

    async def failing(self: DurableEvents) -> None:
        raise TimeoutError("the snapshot's fetch timed out")

    monkeypatch.setattr(DurableEvents, "start", failing)
    router = Lifecycle(nats_server.url)
    with pytest.raises(TimeoutError):
        await router.life.run()
    try:
        assert router.life.not_ready_reason() == (
            f"event plane starting: NATS at {nats_server.url} connected; "
            "the last attempt failed: TimeoutError: the snapshot's fetch timed out"
        )
    finally:
        await router.life.stop()


async def test_a_worker_that_left_while_the_router_was_down_leaves_nothing_in_the_index(
    nats_server: EmbeddedNats, client: Client
) -> None:
    """Worker 65 is in the snapshot and deregisters while the router is down: the restart restores its
    blocks, then the registry says it left, and they go (before, nothing removed them: every later
    snapshot carried them again, and a new process of worker 65 inherited them)."""
    url = nats_server.url
    staying = KvEventPublisher(client, WorkerConfig(worker_id=61, block_size=BLOCK))
    leaving = KvEventPublisher(client, WorkerConfig(worker_id=65, block_size=BLOCK))
    async with Lifecycle(url) as first:
        for publisher in (staying, leaving):
            await publisher.start(heartbeat=False)
        await eventually(lambda: first.router.has_worker(61) and first.router.has_worker(65))
        await staying.stored(pairs(1, 3))
        await leaving.stored(pairs(2, 5))
        durable = first.life.durable
        assert durable is not None
        await eventually(lambda: durable.applied_seq >= 2)
        assert await durable.write_snapshot()
    await leaving.stop(deregister=True)

    async with Lifecycle(url) as again:
        await eventually(lambda: again.router.has_worker(61))
        await eventually(
            lambda: not [e for e in again.router.tree.dump_events() if e.worker_id == 65],
            what="worker 65's restored blocks dropped",
        )
        assert not again.router.has_worker(65)
        assert [e for e in again.router.tree.dump_events() if e.worker_id == 61], "the worker that stayed kept"
        assert not [s for s in again.router.sequencer.status() if s.worker_id == 65]
    await staying.stop()

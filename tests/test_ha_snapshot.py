"""Index snapshots and restarts of ``--durable-events``, in process on a real nats-server with a file store.

Writing a snapshot never holds the event loop for long: while the snapshot of a large index is written,
decisions keep answering and no single loop stall comes near the cost of reading the dump in one step;
stream events that arrive meanwhile wait and are applied after; the snapshot and the stream restore
exactly the index the router has. Changes that do not wait for the dump (an event over HTTP) interrupt
it, and it is taken again.

Restarts: the stream is never purged past a peer's snapshot, even when one listing of the cursors
misses it; a restart whose snapshot was purged while it loaded, or after that until its replay read
past it, whose own snapshot cannot be fetched, or whose own is older than a stream purged to its end
loads a usable one instead, and no worker is asked for anything; a snapshot no restart can use any
more is deleted; a worker's publisher epoch survives the restart, so a worker restarted meanwhile is
told from a replay of its old ids. A stream with nothing left to replay ends the replay at once; while
one runs, readiness says how far it is.

The store: the chunks a put killed with SIGKILL leaves, which no object names, are purged once they are
older than the grace, and the bucket's stream is back to what it held before; a slow put under way for
longer than the grace loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import ObjectMeta
from nats.js.errors import NotFoundError

from api import plane_lifecycle
from api.config import EventPlaneConfig, HaConfig
from api.ha_metrics import HaCollector
from indexer.events import RouterEvent, encode_router_events, stored_event
from router.config import RouterConfig
from router.event_plane.connection import NatsOptions, connect
from router.event_plane.embedded_server import EmbeddedNats
from router.event_plane.jetstream import object_chunk_subject, object_stream
from router.event_plane.subjects import EPOCH_HEADER, Subjects
from router.kv_router import KvRouter
from router.replicas import durable
from router.replicas.durable import DurableEvents
from router.types import RouteRequest, WorkerConfig
from tests.partial_put import content
from tests.router_processes import ToolProcess
from tests.test_api_support import prompt
from tests.test_ha_durable import canonical
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

WORKERS = (1, 2, 3, 4)


class Workers:
    """Stored events for each worker, numbered per stream from 1: root chains and chains under them."""

    def __init__(self, seed: int = 7) -> None:
        self.rng = random.Random(seed)
        self.next_id = dict.fromkeys(WORKERS, 1)
        self.tips: dict[int, list[int]] = {w: [] for w in WORKERS}

    def event(self, worker_id: int, blocks: int) -> RouterEvent:
        tips = self.tips[worker_id]
        parent = tips.pop(self.rng.randrange(len(tips))) if tips and self.rng.random() < 0.5 else None
        pairs = [(self.rng.getrandbits(63), self.rng.getrandbits(63)) for _ in range(blocks)]
        tips.append(pairs[-1][0])
        event_id = self.next_id[worker_id]
        self.next_id[worker_id] += 1
        return RouterEvent(worker_id=worker_id, event=stored_event(event_id, pairs, parent_hash=parent))

    def events(self, blocks: int, per_event: int = 64) -> Iterator[RouterEvent]:
        for index in range(blocks // per_event):
            yield self.event(WORKERS[index % len(WORKERS)], per_event)


def new_router() -> KvRouter:
    router = KvRouter(RouterConfig(block_size=16))
    for worker_id in WORKERS:
        router.register_worker(WorkerConfig(worker_id=worker_id))
    return router


def index_of(router: KvRouter) -> set[tuple[Any, ...]]:
    return canonical(msgspec.to_builtins(router.tree.dump_events()))


@pytest.fixture
async def nats_on_disk(tmp_path: Path) -> AsyncIterator[EmbeddedNats]:
    store = tmp_path / "jetstream"
    store.mkdir()
    server = EmbeddedNats(store_dir=str(store)).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def nc(nats_on_disk: EmbeddedNats) -> AsyncIterator[Client]:
    client = await connect(NatsOptions(nats_on_disk.url))
    try:
        yield client
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def restarted(
    nc: Client, name: str = "r", kind: type[DurableEvents] = DurableEvents
) -> AsyncIterator[tuple[KvRouter, DurableEvents]]:
    """A router started afresh as ``name`` (its index from the snapshot and the stream), stopped on the
    way out; a restart that does not come back within a minute fails rather than hangs."""
    router = new_router()
    events = await asyncio.wait_for(started(router, nc, name, kind), 60)
    try:
        yield router, events
    finally:
        await events.stop()


async def started(
    router: KvRouter, nc: Client, name: str = "r", kind: type[DurableEvents] = DurableEvents
) -> DurableEvents:
    # Snapshots only when the test writes them.
    events = kind(router, nc, router_name=name, snapshot_every_events=10**9, snapshot_every_s=3600.0)
    await events.restore()
    await events.start()
    return events


async def publish(nc: Client, events: list[RouterEvent]) -> None:
    subjects = Subjects()
    async with stored_in_the_stream(nc, len(events)):
        for event in events:
            await nc.publish(subjects.events(event.worker_id), encode_router_events(event, msgpack=True))
            await asyncio.sleep(0.001)  # the behaviour under test: events keep arriving while the dump is written


@contextlib.asynccontextmanager
async def stored_in_the_stream(nc: Client, count: int) -> AsyncIterator[None]:
    """Until the events stream holds the ``count`` messages published inside: the server took them at
    the flush, but the stream stores them a moment later, and a stream_info read before that sees the
    old last sequence (`applied_all` then waits for too little)."""

    async def last_seq() -> int:
        return (await nc.jetstream().stream_info(Subjects().events_stream)).state.last_seq

    before = await last_seq()
    yield
    await nc.flush()

    async def all_stored() -> bool:
        return await last_seq() >= before + count

    await eventually(all_stored, what=f"{count} messages stored in the stream")


async def applied_all(events: DurableEvents, nc: Client, timeout: float = 30.0) -> None:
    last = (await nc.jetstream().stream_info(Subjects().events_stream)).state.last_seq
    await eventually(lambda: events.applied_seq >= last, timeout, f"{last} stream messages applied")


async def test_a_large_snapshot_is_written_in_slices_while_decisions_answer_and_restores_exactly(nc: Client) -> None:
    router = new_router()
    workers = Workers()
    router.sequencer.ingest(workers.events(200_000))
    live = await started(router, nc)
    try:
        # What the loop would wait for if the dump were read and encoded in one step, in CPU time
        # (the machine is shared: wall time would count other processes).
        one_step = time.process_time()
        msgspec.msgpack.encode(router.tree.dump_events())
        one_step = time.process_time() - one_step

        writing = True
        stalls: list[float] = []
        decisions = 0

        async def ticker() -> None:
            last = time.process_time()
            while writing:
                await asyncio.sleep(0)
                now = time.process_time()
                stalls.append(now - last)
                last = now

        async def decide() -> None:
            nonlocal decisions
            tokens = prompt(3, 256)
            while writing:
                await router.new(RouteRequest(tokens=tokens))
                decisions += 1
                await asyncio.sleep(0)

        # Stream events published during the write wait for the dump, then apply.
        later = [workers.event(WORKERS[i % len(WORKERS)], 16) for i in range(40)]
        background = [asyncio.create_task(ticker()), asyncio.create_task(decide())]
        flowing = asyncio.create_task(publish(nc, later))
        try:
            await eventually(lambda: decisions >= 3, what="ticking and deciding before the write starts")
            assert await live.write_snapshot()
        finally:
            writing = False
            await asyncio.gather(*background)
        await flowing
        assert len(stalls) > 100, "the write yielded to the loop often"
        assert decisions > 10, "decisions answered while the snapshot was written"
        assert max(stalls) < one_step / 8, f"longest stall {max(stalls):.4f} s CPU, one-step dump {one_step:.3f} s"
        await applied_all(live, nc)
        assert live.snapshot_seq < live.applied_seq, "some published events came after the snapshot's sequence"

        async with restarted(nc) as (restored, again):
            assert again.outcomes["restored_events"] > 0
            assert index_of(restored) == index_of(router)
            assert [s.last_event_id for s in restored.sequencer.status()] == [
                s.last_event_id for s in router.sequencer.status()
            ]
    finally:
        await live.stop()


async def test_a_change_that_does_not_wait_interrupts_the_dump_and_it_is_taken_again(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(durable, "SNAPSHOT_SLICE_S", 0.0)  # yield after every dumped event
    router = new_router()
    workers = Workers(seed=8)
    router.sequencer.ingest(workers.events(4_000))
    live = await started(router, nc)
    try:
        for attempt in range(durable.MAX_INTERRUPTED + 1):
            writing = asyncio.create_task(live.write_snapshot())
            for _ in range(5):
                await asyncio.sleep(0)
            # As POST /v1/events does: straight to the sequencer, not through the stream.
            router.sequencer.ingest([workers.event(WORKERS[attempt % len(WORKERS)], 8)])
            written = await writing
            if attempt < durable.MAX_INTERRUPTED:
                assert not written
                assert live.outcomes["snapshot_interrupted"] == attempt + 1
            else:
                assert written, "after MAX_INTERRUPTED in a row the dump is read in one step"
        router.sequencer.ingest([workers.event(1, 8)])
        assert await live.write_snapshot(), "with nothing changing meanwhile a sliced dump completes"
        assert live.outcomes["snapshot_interrupted"] == durable.MAX_INTERRUPTED

        async with restarted(nc) as (restored, _):
            assert index_of(restored) == index_of(router)
    finally:
        await live.stop()


async def stream_first_seq(nc: Client) -> int:
    return int((await nc.jetstream().stream_info(Subjects().events_stream)).state.first_seq)


async def test_a_peer_cursor_missing_from_one_listing_still_holds_the_purge_floor(nc: Client) -> None:
    workers = Workers(seed=9)
    router_a, router_b = new_router(), new_router()
    a = await started(router_a, nc, "a")
    b = await started(router_b, nc, "b")
    try:
        await publish(nc, list(workers.events(10 * 64)))
        await applied_all(a, nc)
        await applied_all(b, nc)
        assert await b.write_snapshot() and b.snapshot_seq == 10
        assert await a.write_snapshot()
        assert await stream_first_seq(nc) == 11, "nothing b's snapshot does not cover is purged"

        await publish(nc, list(workers.events(20 * 64)))
        await applied_all(a, nc)
        # b's cursor drops out of a's next listing (as a key being rewritten can, for a moment).
        await (await nc.jetstream().key_value(Subjects().router_cursor_bucket)).purge("b")
        assert await a.write_snapshot() and a.snapshot_seq == 30
        assert await stream_first_seq(nc) == 11, "b's snapshot at 10 still holds the floor"

        # So b, killed now, comes back from its own snapshot and the stream after it.
        await b.stop()
        async with restarted(nc, "b") as (again_router, again):
            assert again.outcomes.get("stream_behind_snapshot", 0) == 0
            assert index_of(again_router) == index_of(router_a)
    finally:
        await a.stop()
        await b.stop()


@contextlib.asynccontextmanager
async def a_peer_ahead_of_b(nc: Client, workers: Workers) -> AsyncIterator[tuple[KvRouter, DurableEvents]]:
    """Router b snapshots at stream sequence 10 and stops; router a, running until the way out, goes on
    to 30 and snapshots there."""
    router_a, router_b = new_router(), new_router()
    a = await started(router_a, nc, "a")
    try:
        b = await started(router_b, nc, "b")
        try:
            await publish(nc, list(workers.events(10 * 64)))
            await applied_all(b, nc)
            assert await b.write_snapshot() and b.snapshot_seq == 10
        finally:
            await b.stop()
        await publish(nc, list(workers.events(20 * 64)))
        await applied_all(a, nc)
        assert await a.write_snapshot() and a.snapshot_seq == 30
        yield router_a, a
    finally:
        await a.stop()


async def test_a_snapshot_purged_from_under_a_restart_is_replaced_by_a_usable_one(nc: Client) -> None:
    workers = Workers(seed=10)
    async with a_peer_ahead_of_b(nc, workers) as (router_a, a):
        await publish(nc, list(workers.events(10 * 64)))
        await applied_all(a, nc)

        class PurgedWhileLoading(DurableEvents):
            """A restart during which the peer purges the stream up to its own snapshot, past the
            one just loaded, before this router's cursor is recorded."""

            async def _load_snapshot(self) -> durable.IndexSnapshot | None:
                snapshot = await super()._load_snapshot()
                if snapshot is not None and snapshot.router_name == "b":
                    await self._js.purge_stream(self.subjects.events_stream, seq=a.snapshot_seq + 1)
                return snapshot

        async with restarted(nc, "b", kind=PurgedWhileLoading) as (again_router, again):
            assert again.outcomes["snapshot_purged_while_loading"] == 1
            assert again.outcomes.get("stream_behind_snapshot", 0) == 0, "no worker had to be asked"
            await applied_all(again, nc)
            assert index_of(again_router) == index_of(router_a)


def no_worker_asked(router: KvRouter) -> bool:
    outcomes = router.sequencer.outcomes
    return outcomes["resync_full"] == 0 and outcomes["resync_range"] == 0


async def test_a_purge_that_lands_after_a_restart_checked_the_stream_is_met_by_loading_again(nc: Client) -> None:
    workers = Workers(seed=19)
    async with a_peer_ahead_of_b(nc, workers) as (router_a, a):
        await publish(nc, list(workers.events(10 * 64)))
        await applied_all(a, nc)
        again_router = new_router()
        again = DurableEvents(again_router, nc, router_name="b", snapshot_every_events=10**9, snapshot_every_s=3600.0)
        try:
            await again.restore()
            assert again.snapshot_seq == 10, "b's own snapshot, which the stream still reached back to"
            # a purges up to its own snapshot on a listing of the cursors taken before b recorded its own:
            # the purge lands after b's restore checked the stream.
            await nc.jetstream().purge_stream(Subjects().events_stream, seq=a.snapshot_seq + 1)
            await asyncio.wait_for(again.start(), 60)
            assert again.outcomes["snapshot_purged_while_loading"] == 1
            assert again.outcomes.get("stream_behind_snapshot", 0) == 0 and no_worker_asked(again_router)
            assert again.snapshot_seq == 30, "a's snapshot, loaded instead"
            await applied_all(again, nc)
            assert index_of(again_router) == index_of(router_a)
        finally:
            await again.stop()


@pytest.mark.parametrize("events_after_the_peers_snapshot", [0, 10 * 64], ids=["purged-to-the-end", "purged-midway"])
async def test_a_purge_that_lands_while_a_restart_replays_is_met_by_loading_again(
    nc: Client, events_after_the_peers_snapshot: int
) -> None:
    workers = Workers(seed=20)
    async with a_peer_ahead_of_b(nc, workers) as (router_a, a):
        await publish(nc, list(workers.events(events_after_the_peers_snapshot)))
        await applied_all(a, nc)

        class PurgedBeforeTheReplayReads(DurableEvents):
            """A restart whose stream a purges up to a's snapshot, on a listing of the cursors taken before
            b recorded its own, just as b's replay sets out from b's own snapshot: the replay's consumer
            reads on from what is left. Purged to the stream's end, no later message shows the gap."""

            async def _follow(self, start: int) -> None:
                if start == 11:
                    await self._js.purge_stream(self.subjects.events_stream, seq=a.snapshot_seq + 1)
                await super()._follow(start)

        async with restarted(nc, "b", kind=PurgedBeforeTheReplayReads) as (again_router, again):
            assert again.outcomes["snapshot_purged_while_loading"] == 1
            assert again.outcomes.get("stream_behind_snapshot", 0) == 0 and no_worker_asked(again_router)
            assert again.snapshot_seq == 30, "a's snapshot, loaded instead"
            await applied_all(again, nc)
            assert index_of(again_router) == index_of(router_a)


async def test_a_snapshot_whose_fetch_never_ends_is_given_up_for_a_peers(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with a_peer_ahead_of_b(nc, Workers(seed=11)) as (router_a, _):
        # b's object keeps its description but loses its chunks, as a fetch finds an object its
        # owner replaced meanwhile: nats-py's fetch then waits forever.
        bucket = Subjects().snapshot_bucket
        js = nc.jetstream()
        info = await (await js.object_store(bucket)).get_info("b")
        await js.purge_stream(f"OBJ_{bucket}", subject=f"$O.{bucket}.C.{info.nuid}")
        monkeypatch.setattr(durable, "SNAPSHOT_FETCH_MIN_S", 1.0)

        async with restarted(nc, "b") as (again_router, again):
            assert again.outcomes["snapshot_unreadable"] == 1
            assert again.snapshot_seq == 30, "the peer's snapshot, the next usable one"
            await applied_all(again, nc)
            assert index_of(again_router) == index_of(router_a)


async def test_on_a_stream_purged_to_its_end_a_stale_snapshot_gives_way_to_a_complete_one(nc: Client) -> None:
    workers = Workers(seed=12)
    router_b = new_router()
    b = await started(router_b, nc, "b")
    await publish(nc, list(workers.events(10 * 64)))
    await applied_all(b, nc)
    assert await b.write_snapshot() and b.snapshot_seq == 10
    await b.stop()
    store = await nc.jetstream().object_store(Subjects().snapshot_bucket)
    stale = (await store.get("b")).data
    # b stays down past its cursor's TTL; a router that never saw it then purges the whole stream.
    await (await nc.jetstream().key_value(Subjects().router_cursor_bucket)).purge("b")
    await publish(nc, list(workers.events(20 * 64)))
    router_a = new_router()
    a = await started(router_a, nc, "a")
    try:
        await applied_all(a, nc)
        assert await a.write_snapshot() and a.snapshot_seq == 30
        state = (await nc.jetstream().stream_info(Subjects().events_stream)).state
        assert (state.messages, state.first_seq) == (0, 31)
        # b's snapshot is of no use to any restart now: deleted with the purge.
        assert a.outcomes["stale_snapshots_deleted"] == 1
        assert [entry.name for entry in await store.list() if not entry.deleted] == ["a"]
        # Put back, as a router that could not delete it would leave it: a restart must not take it.
        await store.put("b", stale, meta=ObjectMeta(description="10"))

        async with restarted(nc, "b") as (again_router, again):
            assert again.snapshot_seq == 30, "a's snapshot: b's own at 10 misses 11-30"
            assert again.outcomes.get("stream_behind_snapshot", 0) == 0
            assert index_of(again_router) == index_of(router_a)
            # What a failed start leaves is undone before it is tried again.
            again.discard()
            assert index_of(again_router) == set() and again_router.sequencer.status() == []
    finally:
        await a.stop()


async def test_after_a_reconnect_nothing_is_purged_until_every_router_could_record_its_cursor(nc: Client) -> None:
    # Every cursor may have expired while NATS was out of reach (the plane calls this on a reconnect).
    workers = Workers(seed=15)
    a = await started(new_router(), nc, "a")
    try:
        await publish(nc, list(workers.events(10 * 64)))
        await applied_all(a, nc)
        a.on_reconnected()
        assert await a.write_snapshot() and a.snapshot_seq == 10
        assert a.outcomes["purge_deferred"] == 1
        assert await stream_first_seq(nc) == 1, "nothing purged yet"
    finally:
        await a.stop()


# The tests' grace for chunks no object names (the service's is ten minutes) and the chunks they put.
ORPHAN_GRACE_S = 3.0
CHUNK_BYTES = 64 * 1024


def partial_put(tmp_path: Path, url: str, name: str, *flags: str) -> ToolProcess:
    """A client process putting ``name`` into the snapshot bucket slowly (`tests.partial_put`)."""
    argv = [sys.executable, "-m", "tests.partial_put", url, Subjects().snapshot_bucket, name, *flags]
    return ToolProcess(tmp_path, None, command="partial-put", argv=[*argv, "--chunk-bytes", str(CHUNK_BYTES)])


async def unnamed_chunks(nc: Client) -> dict[str, int]:
    """The snapshot bucket's chunk subjects no object names, with the chunks each holds."""
    js = nc.jetstream()
    bucket = Subjects().snapshot_bucket
    try:
        named = {entry.nuid for entry in await (await js.object_store(bucket)).list() if not entry.deleted}
    except NotFoundError:  # an empty store
        named = set()
    chunks = object_chunk_subject(bucket, "*")
    listed = (await js.stream_info(object_stream(bucket), subjects_filter=chunks)).state.subjects or {}
    return {subject: count for subject, count in listed.items() if subject.rpartition(".")[2] not in named}


async def snapshot_stream_state(nc: Client) -> tuple[int, int]:
    """The snapshot bucket's stream: (messages, bytes)."""
    state = (await nc.jetstream().stream_info(object_stream(Subjects().snapshot_bucket))).state
    return state.messages, state.bytes


async def test_the_chunks_a_put_killed_midway_leaves_are_purged_once_older_than_the_grace(
    nc: Client, nats_on_disk: EmbeddedNats, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(durable, "ORPHAN_CHUNKS_GRACE_S", ORPHAN_GRACE_S)
    workers = Workers(seed=17)
    router = new_router()
    a = await started(router, nc, "a")
    try:
        await publish(nc, list(workers.events(10 * 64)))
        await applied_all(a, nc)
        assert await a.write_snapshot()
        messages, size = await snapshot_stream_state(nc)

        # A real put, killed with SIGKILL between its chunks and its meta.
        with partial_put(tmp_path, nats_on_disk.url, "killed", "--chunks", "3", "--hang") as killed:

            async def chunks_written() -> bool:
                return list((await unnamed_chunks(nc)).values()) == [3]

            await eventually(chunks_written, what="the killed put's 3 chunks in the stream")
            killed.kill9()
        (orphan,) = await unnamed_chunks(nc)
        with_orphan = await snapshot_stream_state(nc)
        assert with_orphan[0] == messages + 3 and with_orphan[1] > size + 3 * CHUNK_BYTES

        # Younger than the grace, they may be a put still under way: left alone.
        assert await a.write_snapshot()
        assert await unnamed_chunks(nc) == {orphan: 3}
        assert a.outcomes.get("orphan_chunks_purged", 0) == 0

        await asyncio.sleep(ORPHAN_GRACE_S)  # the chunks' age is what this waits for
        assert await a.write_snapshot()
        assert await unnamed_chunks(nc) == {}
        assert a.outcomes["orphan_chunks_purged"] == 3
        # Back to what the stream held before the put: the same messages, and a's snapshot rewritten
        # with the same index is within a few bytes of the one it replaced.
        after = await snapshot_stream_state(nc)
        assert after[0] == messages and abs(after[1] - size) < CHUNK_BYTES, (messages, size, after)
    finally:
        await a.stop()

    async with restarted(nc, "a") as (again_router, again):
        assert again.outcomes["restored_events"] > 0
        assert index_of(again_router) == index_of(router)


async def test_a_put_under_way_for_longer_than_the_grace_loses_no_chunk_to_the_snapshots_meanwhile(
    nc: Client, nats_on_disk: EmbeddedNats, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(durable, "ORPHAN_CHUNKS_GRACE_S", ORPHAN_GRACE_S)
    workers = Workers(seed=18)
    a = await started(new_router(), nc, "a")
    chunks = 20
    every_s = ORPHAN_GRACE_S / 12  # a chunk much more often than the grace, for longer than it in all
    try:
        await publish(nc, list(workers.events(4 * 64)))
        await applied_all(a, nc)
        with partial_put(tmp_path, nats_on_disk.url, "slow", "--chunks", str(chunks), "--every", str(every_s)) as slow:
            loop = asyncio.get_running_loop()
            began = loop.time()
            deadline = began + 60
            seen: dict[str, int] = {}  # the put's chunk subject -> chunks seen there so far
            while not slow.ended():
                assert loop.time() < deadline, "the slow put did not end"
                assert await a.write_snapshot()
                for subject, count in (await unnamed_chunks(nc)).items():
                    assert count >= seen.get(subject, 0), f"{subject}: chunks purged from a put under way"
                    seen[subject] = count
                await asyncio.sleep(every_s / 2)  # snapshots at about the put's pace, not flat out
            assert slow.stop() == 0, slow.log()
        assert loop.time() - began > ORPHAN_GRACE_S, "the put lasted longer than the grace"
        # All of its chunks may be seen unnamed: between the last chunk's ack and the meta naming them.
        assert len(seen) == 1 and 0 < max(seen.values()) <= chunks, "snapshots were tidied while it ran"
        assert a.outcomes.get("orphan_chunks_purged", 0) == 0
        # nats-py checks the object's digest as it reads it back.
        store = await nc.jetstream().object_store(Subjects().snapshot_bucket)
        assert (await store.get("slow")).data == content(chunks, CHUNK_BYTES)
        assert await unnamed_chunks(nc) == {}
    finally:
        await a.stop()


async def publish_as(nc: Client, epoch: str, events: list[RouterEvent]) -> None:
    """As a worker's publisher does: its epoch in a header beside each message."""
    subjects = Subjects()
    async with stored_in_the_stream(nc, len(events)):
        for event in events:
            payload = encode_router_events(event, msgpack=True)
            await nc.publish(subjects.events(event.worker_id), payload, headers={EPOCH_HEADER: epoch})


async def test_a_worker_restarted_while_the_router_was_down_is_told_by_its_epoch(nc: Client) -> None:
    before, after = Workers(seed=13), Workers(seed=14)  # the restarted worker numbers from 1 again
    router_a, router_b = new_router(), new_router()
    a = await started(router_a, nc, "a")
    b = await started(router_b, nc, "b")
    try:
        await publish_as(nc, "first", [before.event(1, 8) for _ in range(10)])
        await applied_all(b, nc)
        assert await b.write_snapshot()
        await b.stop()
        await publish_as(nc, "second", [after.event(1, 8) for _ in range(4)])
        await applied_all(a, nc)
        assert index_of(router_a) and all(row[0] == 1 for row in index_of(router_a))

        async with restarted(nc, "b") as (again_router, again):
            await applied_all(again, nc)
            # The second epoch's ids 1-4 are new events, not repeats of the first's 1-10.
            assert index_of(again_router) == index_of(router_a)
            assert again_router.sequencer.outcomes["publisher_restarts"] == 1
    finally:
        await a.stop()


@given(
    pieces=st.lists(st.binary(min_size=0, max_size=300), max_size=12),
    read_size=st.integers(min_value=1, max_value=700),
)
def test_the_snapshot_pieces_read_back_in_order_whatever_the_chunk_size(pieces: list[bytes], read_size: int) -> None:
    # As ObjectStore.put reads it: readinto a chunk buffer until it returns 0.
    reader = durable._PiecesReader([bytearray(piece) for piece in pieces])
    chunk = bytearray(read_size)
    read = bytearray()
    while count := reader.readinto(chunk):
        assert count == read_size or not reader.readinto(bytearray(1)), "only the last chunk is short"
        read += chunk[:count]
    assert read == b"".join(pieces)


@pytest.mark.parametrize("purged_as_the_replay_sets_out", [False, True], ids=["plain-replay", "reloaded"])
async def test_a_worker_restarted_while_the_router_was_down_keeps_nothing_of_its_old_process(
    nc: Client, purged_as_the_replay_sets_out: bool
) -> None:
    """Worker 1's publisher restarted (a new epoch, nothing published yet) while b was down; the event
    plane registers it between b's restore and its replay. Its old process's blocks must go, whether
    the replay runs through or a peer's purge makes b load a snapshot again after that registration
    (which restored the snapshot's old epoch: the old blocks stayed until the worker's next event)."""
    workers = Workers(seed=13)
    router_a, router_b = new_router(), new_router()
    a, b = await started(router_a, nc, "a"), await started(router_b, nc, "b")
    try:
        await publish_as(nc, "first", [workers.event(1, 8) for _ in range(10)])
        await applied_all(b, nc)
        await applied_all(a, nc)
        assert await b.write_snapshot()
        await b.stop()
        await publish_as(nc, "first", [workers.event(1, 8) for _ in range(5)])
        await applied_all(a, nc)
        assert await a.write_snapshot()

        class PurgedAsTheReplaySetsOut(DurableEvents):
            async def _follow(self, start: int) -> None:
                if purged_as_the_replay_sets_out and start == 11:
                    await self._js.purge_stream(self.subjects.events_stream, seq=a.snapshot_seq + 1)
                await super()._follow(start)

        router = new_router()
        again = PurgedAsTheReplaySetsOut(router, nc, router_name="b", snapshot_every_events=10**9,
                                         snapshot_every_s=3600.0)  # fmt: skip
        await again.restore()
        router.register_worker(WorkerConfig(worker_id=1, epoch="second"))  # the event plane's start
        try:
            await asyncio.wait_for(again.start(), 60)
            await applied_all(again, nc)
            assert again.outcomes.get("snapshot_purged_while_loading", 0) == int(purged_as_the_replay_sets_out)
            assert router.sequencer.epochs().get(1) == "second"
            assert not [row for row in index_of(router) if row[0] == 1]
        finally:
            await again.stop()
    finally:
        await a.stop()


async def test_nats_out_of_reach_while_a_restart_replays_holds_the_restart_until_the_replay_is_done(
    nats_on_disk: EmbeddedNats, nc: Client
) -> None:
    """NATS goes away just as the replay from the snapshot sets out, for a few seconds: the replay's
    stall check cannot ask the stream, and waits (before: the failed ask ended the replay at once,
    the router ready with its index behind and the gap check off)."""
    workers = Workers(seed=5)
    router_b = new_router()
    b = await started(router_b, nc, "b")
    await publish(nc, list(workers.events(10 * 64)))
    await applied_all(b, nc)
    assert await b.write_snapshot()
    subjects = Subjects()
    async with stored_in_the_stream(nc, 1500):  # all of it, or the replay's target below is short
        for event in workers.events(1500 * 8, per_event=8):
            await nc.publish(subjects.events(event.worker_id), encode_router_events(event, msgpack=True))
    await applied_all(b, nc)
    await b.stop()
    target = (await nc.jetstream().stream_info(subjects.events_stream)).state.last_seq

    class NatsGoneAsTheReplaySetsOut(DurableEvents):
        async def _follow(self, start: int) -> None:
            await super()._follow(start)
            await asyncio.to_thread(nats_on_disk.stop)

    router = new_router()
    again = NatsGoneAsTheReplaySetsOut(router, nc, router_name="b", snapshot_every_events=10**9,
                                       snapshot_every_s=3600.0)  # fmt: skip
    await again.restore()
    starting = asyncio.ensure_future(again.start())
    applied_when_ready: list[int] = []
    starting.add_done_callback(lambda _: applied_when_ready.append(again.applied_seq))
    try:
        await asyncio.sleep(8.0)  # past a JetStream request's timeout (5 s), which the stall check's ask meets
        await asyncio.to_thread(nats_on_disk.start)
        await asyncio.wait_for(starting, 60)
        assert applied_when_ready[0] >= target, "the restart said it was ready with its replay unfinished"
        assert again.outcomes.get("snapshot_purged_while_loading", 0) == 0
    finally:
        starting.cancel()
        await again.stop()


async def test_an_unreadable_snapshot_over_a_stream_purged_to_its_end_is_done_at_once(nc: Client) -> None:
    """The snapshot unreadable and the stream holding no message (all purged, first_seq past last_seq):
    every worker is asked for its state and the replay, with nothing to read, is done at once (before:
    it waited for the last sequence, which never comes, for the whole catch-up timeout, unready)."""
    workers = Workers(seed=21)
    b = await started(new_router(), nc, "b")
    try:
        await publish(nc, list(workers.events(10 * 64)))
        await applied_all(b, nc)
        assert await b.write_snapshot()
    finally:
        await b.stop()
    subjects = Subjects()
    js = nc.jetstream()
    await js.purge_stream(subjects.events_stream)
    state = (await js.stream_info(subjects.events_stream)).state
    assert state.first_seq > state.last_seq == 10
    store = await js.object_store(subjects.snapshot_bucket)
    await store.put("b", b"\x85\xa5hello" + bytes(1000), meta=ObjectMeta(name="b", description="10"))

    again = DurableEvents(new_router(), nc, router_name="b", snapshot_every_events=10**9, snapshot_every_s=3600.0)
    try:
        await again.restore()
        assert again.outcomes["snapshot_unreadable"] == 1 and again.snapshot_seq == 0
        begun = time.monotonic()
        await asyncio.wait_for(again.start(), 30)  # the catch-up timeout is 120 s
        assert time.monotonic() - begun < 5
        assert again.outcomes["stream_behind_snapshot"] == 1
        assert again.replay_progress() is None
    finally:
        await again.stop()


async def test_readiness_says_the_stream_is_replaying_while_it_is(
    nats_on_disk: EmbeddedNats, nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a restart replays the stream, NATS connected, /readyz's reason says so and how far it is
    (before: "event plane not started: NATS at ... not connected yet")."""
    workers = Workers(seed=22)
    b = await started(new_router(), nc, "b")
    try:
        await publish(nc, list(workers.events(20 * 64)))
        await applied_all(b, nc)
    finally:
        await b.stop()
    gate = asyncio.Event()

    class Gated(DurableEvents):
        async def _on_message(self, message: Msg) -> None:
            await gate.wait()
            await super()._on_message(message)

    monkeypatch.setattr(plane_lifecycle, "DurableEvents", Gated)
    ha = HaConfig(durable_events=True, router_name="b", snapshot_every_secs=3600.0)
    life = plane_lifecycle.PlaneLifecycle(new_router(), EventPlaneConfig(nats_url=nats_on_disk.url), ha)
    task = asyncio.create_task(life.run())
    try:
        await eventually(lambda: life.not_ready_reason() == "replaying the event stream: at 0 of 20", 30)
        assert not life.ready
        gate.set()
        await eventually(lambda: life.ready, 30)
    finally:
        gate.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await life.stop()


async def test_the_snapshot_size_and_the_purge_floor_are_gauges_not_outcomes_of_the_counter(nc: Client) -> None:
    """``kv_router_durable_events_total`` is a counter family: only counts belong in it. The newest
    snapshot's size and the purge floor are gauges of their own (before: outcomes of the counter, which
    Prometheus' rate() and counter-reset handling read wrong)."""
    router = new_router()
    events = await started(router, nc, "g")
    try:
        await publish(nc, list(Workers(seed=23).events(10 * 64)))
        await applied_all(events, nc)
        assert await events.write_snapshot()
        lifecycle: Any = SimpleNamespace(replicas=None, durable=events)  # what the collector reads of one
        families = {family.name: family for family in HaCollector(lifecycle).collect()}
        counter = families["kv_router_durable_events"]
        assert counter.type == "counter"
        outcomes = {sample.labels["outcome"] for sample in counter.samples}
        assert "snapshots" in outcomes and not outcomes & {"last_snapshot_bytes", "purged_below"}
        [size] = families["kv_router_durable_last_snapshot_bytes"].samples
        [floor] = families["kv_router_durable_purged_below_sequence"].samples
        assert families["kv_router_durable_last_snapshot_bytes"].type == "gauge" and size.value > 1000
        assert families["kv_router_durable_purged_below_sequence"].type == "gauge" and floor.value == 11
    finally:
        await events.stop()

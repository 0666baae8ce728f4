"""`PlaneLifecycle` on a real nats-server: a start that fails part way leaves nothing of itself running,
so the supervisor's next attempt starts from nothing; KV events NATS drops for a router that fell behind
(a slow consumer, provoked for real: a flood into a subscription that holds one message) get the
worker resynced."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from nats.aio.msg import Msg

import api.plane_lifecycle
from api.config import EventPlaneConfig, HaConfig
from api.errors import EventPlaneUnavailable, EventTooLarge
from api.plane_lifecycle import PlaneLifecycle
from indexer.events import ResyncRequest, RouterEvent, encode_router_events
from router.config import RouterConfig
from router.event_plane.connection import NatsOptions, connect
from router.event_plane.embedded_server import EmbeddedNats
from router.event_plane.plane import RouterEventPlane
from router.event_plane.publisher import KvEventPublisher
from router.kv_router import KvRouter
from router.types import WorkerConfig
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

# Task names of the parts a start runs (`Supervisor` names its tasks "{owner}:{what}").
PARTS = ("event-plane:", "event-subscriber:", "replica-sync:", "durable-events:")
BLOCK = 16
# Events one worker publishes at once, one message each: what overflows a router that reads one at a time.
FLOOD = 200


def running_parts() -> list[str]:
    return sorted(name for task in asyncio.all_tasks() if (name := task.get_name()).startswith(PARTS))


@pytest.mark.parametrize("failing", ["sync connection", "registration"])
async def test_a_failed_start_stops_what_it_started(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    router = KvRouter(RouterConfig(block_size=16))
    lifecycle = PlaneLifecycle(router, EventPlaneConfig(nats_url=nats_server.url), HaConfig(replica_sync=True))
    await lifecycle.register(WorkerConfig(worker_id=1))  # over HTTP before the plane: written when it starts
    failures = [OSError("NATS blinked")]
    connect, register = api.plane_lifecycle.connect, RouterEventPlane.register

    async def flaky_connect(*args: Any, **kwargs: Any) -> Any:
        if failing == "sync connection" and failures:
            raise failures.pop()
        return await connect(*args, **kwargs)

    async def flaky_register(plane: RouterEventPlane, config: WorkerConfig) -> None:
        if failing == "registration" and failures:
            raise failures.pop()
        await register(plane, config)

    monkeypatch.setattr(api.plane_lifecycle, "connect", flaky_connect)
    monkeypatch.setattr(RouterEventPlane, "register", flaky_register)
    with pytest.raises(OSError, match="NATS blinked"):
        await lifecycle.run()
    assert not lifecycle.ready and running_parts() == []
    # The connection is kept for the next attempt, with no subscription left but nats-py's own inbox
    # for requests' replies.
    assert lifecycle._nc is not None
    assert [sub.subject for sub in lifecycle._nc._subs.values() if not sub.subject.endswith(".*")] == []
    task = asyncio.create_task(lifecycle.run())  # the supervisor's next attempt
    try:
        await eventually(lambda: lifecycle.ready, 30, "the next attempt starts")
        assert router.has_worker(1)
        assert {name.split(":")[0] for name in running_parts()} == {"event-plane", "event-subscriber", "replica-sync"}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await lifecycle.stop()
    assert running_parts() == []


@contextlib.asynccontextmanager
async def slow_router(nats_url: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[RouterEventPlane]:
    """A router's running event plane whose events subscription holds one message for it to read: a
    burst of events overflows it, and NATS drops the rest (a slow consumer)."""
    monkeypatch.setattr(
        api.plane_lifecycle, "RouterEventPlane", functools.partial(RouterEventPlane, events_pending_limit=1)
    )
    lifecycle = PlaneLifecycle(KvRouter(RouterConfig(block_size=BLOCK)), EventPlaneConfig(nats_url=nats_url))
    task = asyncio.create_task(lifecycle.run())
    try:
        yield await asyncio.wait_for(lifecycle.started(), 30)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await lifecycle.stop()


async def flood(publisher: KvEventPublisher) -> None:
    """`FLOOD` one-block stores (each block a root), each its own message, then flushed to NATS."""
    for i in range(FLOOD):
        await publisher.stored([(i + 1, 10_000 + i)])
    await publisher.nc.flush()


def synced(plane: RouterEventPlane, worker_id: int) -> bool:
    """Whether the router's index holds the worker's `FLOOD` blocks and its stream is trusted."""
    status = [(s.worker_id, s.trusted) for s in plane.sequencer.status()]
    return plane.router.tree.blocks_per_rank() == {(worker_id, 0): FLOOD} and status == [(worker_id, True)]


async def test_events_nats_drops_for_a_slow_router_are_resynced_though_the_worker_goes_quiet(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker floods a router that falls behind: NATS drops most of the burst, its end too, and the
    worker then goes quiet, so no later event shows a gap. The drops untrust the worker's stream and a
    full dump is asked for: the index ends with the worker's real state, trusted again."""
    async with slow_router(nats_server.url, monkeypatch) as plane:
        worker_nc = await connect(NatsOptions(nats_server.url))
        try:
            publisher = KvEventPublisher(worker_nc, WorkerConfig(worker_id=7, block_size=BLOCK))
            await publisher.start()
            await eventually(lambda: plane.sequencer.outcomes["resync_dump_applied"] == 1, 30, "the join dump")
            await flood(publisher)
            await eventually(lambda: synced(plane, 7), 10, "the worker's blocks, trusted")
            assert plane.outcomes["events_dropped"] > 0
            assert plane.sequencer.outcomes["resync_dump_applied"] >= 2
            # Untrusted once per loss a dump must answer, not once per message dropped.
            assert plane.sequencer.outcomes["marked_untrusted"] * 4 < plane.outcomes["events_dropped"]
            await publisher.stop()
        finally:
            await worker_nc.close()


async def test_events_dropped_while_a_dump_is_in_flight_are_asked_for_again(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's dump in flight when NATS drops its events may predate them (here: taken before the
    flood, sent after it): once it is applied, another is asked for, and that one holds them."""
    async with slow_router(nats_server.url, monkeypatch) as plane:
        worker_nc = await connect(NatsOptions(nats_server.url))
        try:
            publisher = KvEventPublisher(worker_nc, WorkerConfig(worker_id=8, block_size=BLOCK))
            asked, flooded = asyncio.Event(), asyncio.Event()

            async def answer_late_once(message: Msg) -> None:
                """The worker's own answer, the first one held till after the flood (a slow worker's)."""
                response = publisher.answer_resync(msgspec.json.decode(message.data, type=ResyncRequest))
                if not asked.is_set():
                    asked.set()
                    await flooded.wait()
                await worker_nc.publish(message.reply, msgspec.msgpack.encode(response))

            await worker_nc.subscribe(plane.subjects.resync(8), cb=answer_late_once)
            await publisher.register()
            publisher.start_heartbeat()
            await eventually(asked.is_set, 30, "the join resync")
            await flood(publisher)
            await eventually(lambda: plane.outcomes["events_dropped"] > 0, 10, "a drop")
            flooded.set()
            await eventually(lambda: synced(plane, 8), 10, "the worker's blocks, trusted")
            assert plane.sequencer.outcomes["resync_dump_applied"] >= 2
            await publisher.stop()
        finally:
            await worker_nc.close()


async def test_events_dropped_for_an_unregistered_worker_are_counted_and_logged_only(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Events of a worker no router knows are refused when read; dropped unread, there is nothing to resync."""
    async with slow_router(nats_server.url, monkeypatch) as plane:
        sender = await connect(NatsOptions(nats_server.url))
        try:
            for _ in range(FLOOD):
                await sender.publish(
                    plane.subjects.events(99), b'{"worker_id":99,"event":{"event_id":1,"data":"cleared"}}'
                )
            await sender.flush()
            sequencer = plane.sequencer
            await eventually(
                lambda: sequencer.outcomes["rejected_unknown_worker"] + plane.outcomes["events_dropped"] == FLOOD,
                10,
                "each message read or dropped",
            )
            assert plane.outcomes["events_dropped"] > 0
            assert (sequencer.status(), sequencer.outcomes["resync_full"]) == ([], 0)
            assert (
                "kv.default.events.99: this router fell behind (slow consumer); worker 99 is not registered"
                in caplog.text
            )
        finally:
            await sender.close()


@contextlib.asynccontextmanager
async def relaying(server: EmbeddedNats) -> AsyncIterator[tuple[KvRouter, PlaneLifecycle]]:
    """A router with replica sync on ``server``, worker 1 registered over HTTP, its plane started."""
    router = KvRouter(RouterConfig(block_size=BLOCK))
    lifecycle = PlaneLifecycle(router, EventPlaneConfig(nats_url=server.url), HaConfig(replica_sync=True))
    await lifecycle.register(WorkerConfig(worker_id=1))
    task = asyncio.create_task(lifecycle.run())
    try:
        await eventually(lambda: lifecycle.ready, 30, "the plane starts")
        yield router, lifecycle
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await lifecycle.stop()


def stored(event_id: int, hashes: range) -> RouterEvent:
    """Worker 1's store of ``hashes`` (each its own tokens hash), from the root."""
    blocks = [{"block_hash": h, "tokens_hash": h} for h in hashes]
    return msgspec.convert({"worker_id": 1, "event": {"event_id": event_id, "data": {"stored": {"blocks": blocks}}}},
                           RouterEvent)  # fmt: skip


async def test_events_relayed_to_the_replicas_are_split_under_max_payload_and_one_too_large_is_refused() -> None:
    """A batch posted over HTTP larger than the server's max_payload goes out in parts that each fit
    (every event applied); one event past it alone is refused (`EventTooLarge`, a 413) before any of
    its batch goes out."""
    with EmbeddedNats(max_payload=4096) as server:
        async with relaying(server) as (router, lifecycle):
            batch = [stored(i, range(1000 * i, 1000 * i + 10)) for i in range(1, 101)]
            assert len(encode_router_events(batch)) > 4096
            assert await lifecycle.relay_events(batch) == 100
            await eventually(lambda: router.sequencer.outcomes["applied"] == 100, 30, "every part applied")
            with pytest.raises(EventTooLarge, match="max_payload of 4096"):
                await lifecycle.relay_events([stored(101, range(500_000, 500_004)), stored(102, range(1, 400))])
            await asyncio.sleep(0.2)  # nothing of that batch arrives (a wait for an absence)
            assert router.sequencer.outcomes["applied"] == 100


async def test_events_posted_while_nats_is_out_of_reach_are_refused_to_be_sent_again() -> None:
    """NATS gone under a replica: events posted over HTTP cannot reach the others, and are refused (a
    503 the client retries; a repeated event is a duplicate everywhere), not buffered for a reconnection
    the client cannot see nor applied here alone."""
    server = EmbeddedNats().start()
    try:
        async with relaying(server) as (router, lifecycle):
            server.stop()
            nc = lifecycle._nc
            assert nc is not None
            await eventually(lambda: not nc.is_connected, 30, "the client sees NATS gone")
            with pytest.raises(EventPlaneUnavailable, match="is out of reach"):
                await lifecycle.relay_events([stored(1, range(5, 6))])
            assert router.sequencer.outcomes["applied"] == 0
    finally:
        server.stop()

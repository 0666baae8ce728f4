"""Issue 11 with a real nats-server: events are routable at once, whatever the resync path does.

Dynamo-style publishers (plain RouterEvent JSON on kv.<ns>.events.<id>, no resync responder), gaps
with and without a responder, a kill -9 and restart of nats-server under a running event plane, and
restarted publishers (new epoch in the header or only in the registration).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator
from typing import NamedTuple

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from api.config import EventPlaneConfig
from api.plane_lifecycle import PlaneLifecycle
from indexer.events import ResyncRequest, RouterEvent, encode_router_events, stored_event
from indexer.hashing import compute_block_hashes, compute_sequence_hashes
from router.config import RouterConfig
from router.event_plane.connection import NatsOptions, connect
from router.event_plane.embedded_server import EmbeddedNats
from router.event_plane.messages import ActiveLoad
from router.event_plane.plane import RouterEventPlane
from router.event_plane.publisher import KvEventPublisher, open_registry
from router.event_plane.subjects import Subjects
from router.kv_router import KvRouter
from router.types import RouteRequest, WorkerConfig
from tests.test_nats_events import messages_lost, same_state
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

BLOCK = 16


def tokens(seed: int, blocks: int) -> list[int]:
    return [seed * 100_000 + i for i in range(blocks * BLOCK)]


def pairs(seed: int, blocks: int) -> list[tuple[int, int]]:
    local = compute_block_hashes(tokens(seed, blocks), BLOCK)
    return list(zip(compute_sequence_hashes(local), local, strict=True))


def cached(router: KvRouter, seed: int, blocks: int) -> dict[int, int]:
    return {w.worker_id: w.device_blocks for w in router.overlap(tokens(seed, blocks)).workers if w.device_blocks}


def reported_kv_used(router: KvRouter, worker_id: int) -> int | None:
    """The KV blocks in use the worker's engine last reported (None: no report taken as current)."""
    (load,) = [load for load in router.rank_loads() if load.worker_id == worker_id]
    return load.kv_used_blocks


def dynamo_event(worker_id: int, event_id: int, seed: int, blocks: int) -> bytes:
    """A Dynamo-shaped RouterEvent as JSON, as a custom engine or a Dynamo publisher sends it."""
    return encode_router_events(RouterEvent(worker_id, stored_event(event_id, pairs(seed, blocks))))


async def router_plane(nc: Client) -> RouterEventPlane:
    # 5 s bounds an unanswered resync only: the slow responder's test holds one open while it checks
    # the stream meanwhile, which three attempts of 0.5 s gave a loaded machine 1.5 s to do.
    plane = RouterEventPlane(KvRouter(RouterConfig(block_size=BLOCK)), nc, resync_timeout_s=5.0)
    await plane.start()
    return plane


async def test_a_publisher_without_a_responder_is_routable_at_once_from_id_1_and_after_a_gap(client: Client) -> None:
    plane = await router_plane(client)
    await plane.register(WorkerConfig(worker_id=70, block_size=BLOCK))
    await client.publish("kv.default.events.70", dynamo_event(70, 1, seed=1, blocks=4))
    await eventually(lambda: cached(plane.router, 1, 4) == {70: 4})
    [stream] = plane.sequencer.status()
    assert stream.trusted and plane.sequencer.outcomes["resync_full"] == 0  # id 1: nothing to ask for
    # Events 2-4 are lost; nobody answers kv.default.resync.70.
    await client.publish("kv.default.events.70", dynamo_event(70, 5, seed=2, blocks=3))
    await eventually(lambda: cached(plane.router, 2, 3) == {70: 3})  # routable, not held
    await eventually(lambda: plane.sequencer.outcomes["resync_failed"] == 1)
    assert plane.sequencer.outcomes["resync_no_responders"] == 1  # an answer, not six timeouts
    [stream] = plane.sequencer.status()
    assert (stream.trusted, stream.resyncing, stream.last_event_id) == (False, False, 5)
    decision = await plane.router.new(RouteRequest(tokens=tokens(2, 3)))
    assert decision.worker_id == 70 and decision.receipt is not None
    assert (decision.receipt.device_blocks, decision.receipt.stream_trusted) == (3, False)
    await client.publish("kv.default.events.70", dynamo_event(70, 6, seed=3, blocks=2))
    await eventually(lambda: cached(plane.router, 3, 2) == {70: 2})
    await plane.stop()


async def test_a_gap_with_a_slow_responder_keeps_live_events_routable_and_converges(client: Client) -> None:
    plane = await router_plane(client)
    publisher = KvEventPublisher(client, WorkerConfig(worker_id=71, block_size=BLOCK))
    await publisher.register()
    await eventually(lambda: plane.router.has_worker(71))
    answer_now = asyncio.Event()
    hold = False

    async def slow_responder(message: Msg) -> None:
        if hold:
            await answer_now.wait()  # the gap's resync is in flight until the test says so
        request = msgspec.json.decode(message.data, type=ResyncRequest)
        await client.publish(message.reply, msgspec.msgpack.encode(publisher.answer_resync(request)))

    await client.subscribe(Subjects().resync(71), cb=slow_responder)
    before = pairs(10, 4)
    await publisher.stored(before)
    # The join's resync, asked again once this responder is up, answered at once: the stream trusted.
    await eventually(lambda: cached(plane.router, 10, 4) == {71: 4} and plane.sequencer.status()[0].trusted)
    hold = True
    lost = pairs(11, 3)
    with messages_lost(publisher):
        await publisher.stored(lost)
    await publisher.removed([before[3][0]])  # the gap shows here: applied at once
    after = pairs(12, 2)
    await publisher.stored(after)
    await eventually(lambda: cached(plane.router, 12, 2) == {71: 2} and cached(plane.router, 10, 4) == {71: 3})
    [stream] = plane.sequencer.status()
    assert stream.resyncing and not stream.trusted and stream.unreconciled_events == 2
    assert cached(plane.router, 11, 3) == {}
    answer_now.set()
    await eventually(lambda: plane.sequencer.status()[0].trusted)
    assert cached(plane.router, 11, 3) == {71: 3}
    assert cached(plane.router, 10, 4) == {71: 3}  # the removal still wins over the replay
    assert same_state(plane.router.tree, publisher)
    await plane.stop()


class _OneWorkerFleet(NamedTuple):
    router: KvRouter
    lifecycle: PlaneLifecycle
    worker_nc: Client
    publisher: KvEventPublisher


@contextlib.asynccontextmanager
async def one_worker_then_nats_killed(
    nats_server: EmbeddedNats,
    worker_id: int,
    seed: int,
    resync_timeout_s: float,
    config: RouterConfig | None = None,
    kv_used_blocks: int | None = None,
) -> AsyncIterator[_OneWorkerFleet]:
    """A router's event plane and one publishing worker of 100 KV blocks (five blocks of ``seed``
    indexed; its engine's ``kv_used_blocks`` reported and seen, if given, beside worker id + 1 heard as
    an engine directly, 7 blocks in use), then the nats-server killed
    (-9); everything stopped on the way out."""
    router = KvRouter(config or RouterConfig(block_size=BLOCK))
    lifecycle = PlaneLifecycle(router, EventPlaneConfig(nats_url=nats_server.url, resync_timeout_secs=resync_timeout_s))
    task = asyncio.create_task(lifecycle.run())
    await eventually(lambda: lifecycle.ready)
    worker_nc = await connect(NatsOptions(nats_server.url))
    worker = WorkerConfig(worker_id=worker_id, block_size=BLOCK, total_kv_blocks=100)
    publisher = KvEventPublisher(worker_nc, worker, heartbeat_interval=0.2)
    try:
        await publisher.start()
        await eventually(lambda: router.has_worker(worker_id))
        await publisher.stored(pairs(seed, 5))
        await eventually(lambda: cached(router, seed, 5) == {worker_id: 5})
        if kv_used_blocks is not None:
            await publisher.publish_load(ActiveLoad(worker_id=worker_id, kv_used_blocks=kv_used_blocks))
            await eventually(lambda: reported_kv_used(router, worker_id) == kv_used_blocks)
            # And an engine heard directly (`router.engines.direct`), not over NATS: worker id + 1.
            router.register_worker(WorkerConfig(worker_id=worker_id + 1, block_size=BLOCK, total_kv_blocks=100))
            router.update_engine_load(worker_id + 1, 0, 7, None, None)
        assert nats_server.pid is not None
        os.kill(nats_server.pid, signal.SIGKILL)
        await eventually(lambda: lifecycle.state == "disconnected" and not worker_nc.is_connected)
        yield _OneWorkerFleet(router, lifecycle, worker_nc, publisher)
    finally:
        await publisher.stop()
        await worker_nc.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await lifecycle.stop()


async def test_kill_9_and_restart_of_nats_keeps_routing_and_converges(
    nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="api.plane_lifecycle")
    async with one_worker_then_nats_killed(nats_server, 72, 20, 0.5) as (router, lifecycle, worker_nc, publisher):
        # NATS is gone: the router still routes on the index it has.
        decision = await router.new(RouteRequest(tokens=tokens(20, 5)))
        assert (decision.worker_id, decision.overlap_blocks) == (72, 5)
        assert lifecycle.health().state == "disconnected"
        nats_server.restart()
        await eventually(lambda: lifecycle.state == "connected" and worker_nc.is_connected, timeout=30)
        await publisher.stored(pairs(21, 2))  # published after the restart: routable without waiting for resyncs
        await eventually(lambda: cached(router, 21, 2) == {72: 2})
        await eventually(lambda: all(stream.trusted for stream in router.sequencer.status()))
        assert same_state(router.tree, publisher)
        warnings = [
            r for r in caplog.records if r.levelno == logging.WARNING and "lost the NATS connection" in r.message
        ]
        infos = [r for r in caplog.records if r.levelno == logging.INFO and "reconnected to NATS" in r.message]
        assert (len(warnings), len(infos), lifecycle.disconnects) == (1, 1, 1)


async def test_engine_load_reported_before_an_outage_is_not_taken_as_current_through_it(
    nats_server: EmbeddedNats,
) -> None:
    """An engine's last report before NATS went away (its KV 90 % used: over the busy threshold) is
    dropped with the connection: through the outage the router routes by its own bookings, where the
    stale report had every worker overloaded and every request refused (503) until NATS was back. Once
    back, the engine's reports count again; and the connection's last error goes with the outage.
    What reaches the router otherwise (an engine heard directly, here worker 78) is kept."""
    config = RouterConfig(block_size=BLOCK, active_decode_blocks_threshold=0.5)
    request = RouteRequest(tokens=tokens(22, 5), request_id="through-the-outage")
    async with one_worker_then_nats_killed(nats_server, 77, 22, 0.5, config, kv_used_blocks=90) as fleet:
        router, lifecycle, worker_nc, publisher = fleet
        assert reported_kv_used(router, 77) is None
        assert reported_kv_used(router, 78) == 7
        decision = await router.new(request)
        assert (decision.worker_id, decision.overlap_blocks) == (77, 5)
        assert router.mark_free(decision.request_id)
        nats_server.restart()
        await eventually(lambda: lifecycle.state == "connected" and worker_nc.is_connected, timeout=30)
        assert lifecycle.last_error is None
        await publisher.publish_load(ActiveLoad(worker_id=77, kv_used_blocks=90))
        await eventually(lambda: reported_kv_used(router, 77) == 90)
        # 77 busy again by its report: the prompt cached there goes to the other worker.
        assert (await router.new(request)).worker_id == 78


async def test_events_published_while_nats_is_gone_past_the_connections_buffer_reach_the_router(
    nats_server: EmbeddedNats,
) -> None:
    """NATS killed while a worker stores far more than the client's outbound buffer holds (2 MiB): the
    publisher does not fail (the batches it could not send are counted), and once NATS is back the
    router has every block, replayed or resynced from the publisher."""
    async with one_worker_then_nats_killed(nats_server, 75, 80, 2.0) as (router, lifecycle, worker_nc, publisher):
        seed = 1000
        while publisher.unsent_batches < 3 and seed < 3000:  # ~4 KiB a batch: the buffer is full after ~500
            await publisher.stored(pairs(seed, 200))
            seed += 1
        assert publisher.unsent_batches >= 3
        nats_server.restart()
        await eventually(lambda: lifecycle.state == "connected" and worker_nc.is_connected, timeout=30)
        await publisher.stored(pairs(seed, 2))  # the next event shows the router its gap
        await eventually(lambda: cached(router, seed, 2) == {75: 2}, timeout=30)
        await eventually(lambda: all(stream.trusted for stream in router.sequencer.status()), timeout=30)
        assert same_state(router.tree, publisher)


async def test_a_restarted_publisher_is_a_new_epoch_and_its_old_blocks_go(client: Client) -> None:
    plane = await router_plane(client)
    first = KvEventPublisher(client, WorkerConfig(worker_id=73, block_size=BLOCK))
    await first.start(heartbeat=False)
    await eventually(lambda: plane.router.has_worker(73))
    for seed in range(30, 35):  # ids 1-5
        await first.stored(pairs(seed, 2))
    await eventually(lambda: cached(plane.router, 34, 2) == {73: 2})
    await first.stop()
    restarted = KvEventPublisher(client, WorkerConfig(worker_id=73, block_size=BLOCK))  # a new process
    await restarted.start(heartbeat=False)
    await restarted.stored(pairs(40, 3))  # id 1 again
    await eventually(lambda: cached(plane.router, 40, 3) == {73: 3})
    assert cached(plane.router, 30, 2) == {}  # the old process's blocks are gone, not left stale
    assert plane.sequencer.outcomes["publisher_restarts"] == 1
    assert plane.sequencer.status()[0].trusted
    await restarted.stop()
    await plane.stop()


async def test_ids_that_go_down_without_an_epoch_restart_the_stream_once_the_registration_says_so(
    client: Client,
) -> None:
    plane = await router_plane(client)
    registry = await open_registry(client, Subjects())
    await registry.put("74", msgspec.json.encode(WorkerConfig(worker_id=74, block_size=BLOCK, epoch="boot-1")))
    await eventually(lambda: plane.router.has_worker(74))
    for event_id in (1, 2, 3):
        await client.publish("kv.default.events.74", dynamo_event(74, event_id, seed=50 + event_id, blocks=2))
    await eventually(lambda: cached(plane.router, 53, 2) == {74: 2})
    # The engine restarts: its events count from 1 again, without any epoch on them ...
    await client.publish("kv.default.events.74", dynamo_event(74, 1, seed=60, blocks=2))
    await client.flush()
    await eventually(lambda: plane.sequencer.outcomes["duplicate"] == 1)
    assert cached(plane.router, 60, 2) == {}
    # ... and its registration says it restarted.
    await registry.put("74", msgspec.json.encode(WorkerConfig(worker_id=74, block_size=BLOCK, epoch="boot-2")))
    await eventually(lambda: cached(plane.router, 60, 2) == {74: 2})
    assert cached(plane.router, 53, 2) == {}
    await client.publish("kv.default.events.74", dynamo_event(74, 2, seed=61, blocks=1))
    await eventually(lambda: cached(plane.router, 61, 1) == {74: 1})
    assert plane.sequencer.status()[0].trusted
    await plane.stop()


async def test_connecting_retries_with_a_doubling_backoff_up_to_its_cap() -> None:
    from router.event_plane.connection import connect_when_available
    from router.event_plane.embedded_server import free_port

    waits: list[float] = []
    errors: list[Exception] = []

    def failed(attempt: int, backoff_s: float, error: Exception) -> None:
        waits.append(backoff_s)
        errors.append(error)
        if attempt == 5:
            raise asyncio.CancelledError  # enough: stop trying

    with pytest.raises(asyncio.CancelledError):
        await connect_when_available(
            NatsOptions(f"nats://127.0.0.1:{free_port()}"), on_attempt_failed=failed, first_backoff_s=0.01,
            max_backoff_s=0.04,
        )  # fmt: skip
    assert waits == [0.01, 0.02, 0.04, 0.04, 0.04]
    assert all(isinstance(error, ConnectionRefusedError) for error in errors)


async def test_a_worker_registered_while_the_plane_shares_the_earlier_ones_is_shared_too(
    nats_server: EmbeddedNats, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers registered over HTTP before the plane started are written to the registry when it
    starts; one registered while that is under way (each write awaits NATS) is written too, and the
    plane starts (it used to crash: the dict changed size while it was walked)."""
    router = KvRouter(RouterConfig(block_size=BLOCK))
    lifecycle = PlaneLifecycle(router, EventPlaneConfig(nats_url=nats_server.url))
    await lifecycle.register(WorkerConfig(worker_id=81, block_size=BLOCK))
    write = RouterEventPlane.register

    async def write_then_another_arrives(plane: RouterEventPlane, config: WorkerConfig) -> None:
        await write(plane, config)
        if config.worker_id == 81:  # an HTTP registration landing while the plane writes the first
            await lifecycle.register(WorkerConfig(worker_id=82, block_size=BLOCK))

    monkeypatch.setattr(RouterEventPlane, "register", write_then_another_arrives)
    task = asyncio.create_task(lifecycle.run())
    await eventually(lambda: lifecycle.ready)
    other = await router_plane(client)  # another router learns both from the registry
    await eventually(lambda: other.router.has_worker(81) and other.router.has_worker(82))
    assert lifecycle.plane is not None and lifecycle.last_error is None
    await other.stop()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await lifecycle.stop()

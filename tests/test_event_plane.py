"""The router's NATS event plane end to end: real nats-server, real publishers, a real KvRouter."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from indexer.events import (
    ResyncBatch,
    ResyncRequest,
    ResyncResponse,
    RouterEvent,
    encode_router_events,
    removed_event,
    stored_event,
)
from indexer.hashing import compute_block_hashes, compute_sequence_hashes
from router.config import RouterConfig
from router.errors import AllWorkersOverloaded
from router.event_plane.connection import NatsOptions, connect
from router.event_plane.embedded_server import EmbeddedNats
from router.event_plane.messages import ActiveLoad, Heartbeat
from router.event_plane.parts import MAX_PARTS_BYTES
from router.event_plane.plane import RouterEventPlane
from router.event_plane.publisher import KvEventPublisher, open_registry
from router.event_plane.subjects import EPOCH_HEADER, Subjects
from router.event_plane.subscriber import NO_RESPONDERS_RETRY_S
from router.kv_router import KvRouter, RemovalReason
from router.types import RouteRequest, WorkerConfig
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

BLOCK = 16
PROMPT = list(range(1000, 1000 + 8 * BLOCK))


def cached(router: KvRouter, tokens: list[int]) -> dict[tuple[int, int], int]:
    """Device blocks of ``tokens`` each rank holds, as the router's overlap query reports them."""
    return {(w.worker_id, w.dp_rank): w.device_blocks for w in router.overlap(tokens).workers if w.device_blocks}


def prompt_blocks(tokens: list[int]) -> list[tuple[int, int]]:
    local = compute_block_hashes(tokens, BLOCK)
    return list(zip(compute_sequence_hashes(local), local, strict=True))


async def worker(client: Client, worker_id: int, **registration: object) -> KvEventPublisher:
    publisher = KvEventPublisher(
        client, WorkerConfig(worker_id=worker_id, block_size=BLOCK, **registration), heartbeat_interval=0.1
    )
    await publisher.start()
    return publisher


async def plane_for(client: Client, config: RouterConfig, lease_s: float = 10.0) -> RouterEventPlane:
    # A resync answered late on a loaded machine is still a resync (the tests below need its dump).
    plane = RouterEventPlane(KvRouter(config), client, lease_s=lease_s, resync_timeout_s=5.0)
    await plane.start()
    return plane


async def test_published_prefix_attracts_the_request(client: Client) -> None:
    plane = await plane_for(client, RouterConfig(block_size=BLOCK))
    holder, other = await worker(client, 2**64 - 1), await worker(client, 5)
    await eventually(lambda: {w.worker_id for w in plane.router.workers()} == {2**64 - 1, 5})
    blocks = prompt_blocks(PROMPT)
    await holder.stored(blocks[:6])
    await other.stored(prompt_blocks(list(range(9000, 9000 + 4 * BLOCK))))
    await eventually(lambda: cached(plane.router, PROMPT).get((2**64 - 1, 0)) == 6)
    decision = await plane.router.new(RouteRequest(tokens=PROMPT, request_id="r1"))
    assert (decision.worker_id, decision.overlap_blocks, decision.cached_tokens) == (2**64 - 1, 6, 6 * BLOCK)
    for publisher in (holder, other):
        await publisher.stop()
    await plane.stop()


async def test_router_started_after_the_workers_learns_their_caches(client: Client) -> None:
    holder = await worker(client, 21)
    await holder.stored(prompt_blocks(PROMPT))
    plane = await plane_for(client, RouterConfig(block_size=BLOCK))
    assert [w.worker_id for w in plane.router.workers()] == [21]  # from the registry bucket
    await holder.stored(prompt_blocks(list(range(5000, 5000 + BLOCK))))
    await eventually(lambda: cached(plane.router, PROMPT).get((21, 0)) == 8)
    assert plane.sequencer.outcomes["resync_dump_applied"] == 1
    await holder.stop()
    await plane.stop()


async def test_a_cache_larger_than_a_nats_message_reaches_a_router_started_after_it() -> None:
    """A worker holding more than the server's max_payload (64 KiB here; nats-server's default is 1 MiB,
    about 20k blocks) answers a late router's full resync in parts: one chain of 6,000 blocks (cut into
    stores) and 300 short prompts, every block indexed. An asker that reads one reply is refused, as it
    was before parts."""
    with EmbeddedNats(max_payload=64 * 1024) as server:
        nc = await connect(NatsOptions(server.url))
        try:
            holder = await worker(nc, 31)
            chain = [(10_000 + i, 20_000 + i) for i in range(6000)]
            parent = None
            for start in range(0, len(chain), 200):  # live, each store within a message
                await holder.stored(chain[start : start + 200], parent_hash=parent)
                parent = chain[start + 199][0]
            for i in range(300):
                await holder.stored([(100_000 + 2 * i, 200_000 + 2 * i), (100_001 + 2 * i, 200_001 + 2 * i)])
            plane = await plane_for(nc, RouterConfig(block_size=BLOCK))
            await eventually(lambda: plane.sequencer.outcomes["resync_dump_applied"] == 1)
            assert plane.router.tree.blocks_per_rank() == {(31, 0): 6600}
            assert plane.sequencer.outcomes["resync_refused"] == 0
            old_asker = msgspec.json.encode(ResyncRequest(worker_id=31))
            reply = await nc.request(plane.subjects.resync(31), old_asker, timeout=5)
            refusal = msgspec.msgpack.decode(reply.data, type=ResyncResponse).error
            assert refusal is not None and "exceeds the server's max_payload of 65536" in refusal
            await holder.stop()
            await plane.stop()
        finally:
            await nc.close()


async def test_silent_worker_is_removed_within_the_lease_and_comes_back(client: Client) -> None:
    plane = await plane_for(client, RouterConfig(block_size=BLOCK), lease_s=1.0)
    publisher = await worker(client, 31)
    await publisher.stored(prompt_blocks(PROMPT))
    await eventually(lambda: cached(plane.router, PROMPT).get((31, 0)) == 8)
    publisher.stop_heartbeat()
    loop = asyncio.get_running_loop()
    silent_since = loop.time()
    await eventually(lambda: not plane.router.workers(), 30)
    assert loop.time() - silent_since < 1.0 + 1.0 + 1.0  # lease + 1 s check (+ a loaded machine's slack)
    assert cached(plane.router, PROMPT) == {}  # its index entries went with it
    publisher.start_heartbeat()
    await eventually(lambda: [w.worker_id for w in plane.router.workers()] == [31])
    await publisher.stored(prompt_blocks(list(range(7000, 7000 + BLOCK))))
    await eventually(lambda: cached(plane.router, PROMPT).get((31, 0)) == 8)  # relearned by resync
    decision = await plane.router.new(RouteRequest(tokens=PROMPT))
    assert decision.worker_id == 31
    assert plane.outcomes["expired"] == 1
    assert plane.router.removals["lease_expired"] == 1
    await publisher.stop()
    await plane.stop()


async def test_reported_load_feeds_the_busy_threshold(client: Client) -> None:
    config = RouterConfig(block_size=BLOCK, active_decode_blocks_threshold=0.5)
    plane = await plane_for(client, config)
    publisher = await worker(client, 41, total_kv_blocks=100)
    await eventually(lambda: bool(plane.router.workers()))
    await publisher.publish_load(ActiveLoad(worker_id=41, kv_used_blocks=90))
    await eventually(lambda: plane.outcomes["loads"] == 1)
    with pytest.raises(AllWorkersOverloaded):
        await plane.router.new(RouteRequest(tokens=PROMPT))
    await publisher.publish_load(ActiveLoad(worker_id=41, kv_used_blocks=10))
    await eventually(lambda: plane.outcomes["loads"] == 2)
    assert (await plane.router.new(RouteRequest(tokens=PROMPT))).worker_id == 41
    await publisher.stop()
    await plane.stop()


async def test_static_registration_through_the_registry_and_bad_input(client: Client) -> None:
    plane = await plane_for(client, RouterConfig(block_size=BLOCK), lease_s=0.5)
    await plane.register(WorkerConfig(worker_id=51, total_kv_blocks=10))
    other = await plane_for(client, RouterConfig(block_size=BLOCK))  # a second router sees it too
    assert [w.worker_id for w in other.router.workers()] == [51]
    await client.publish("kv.default.load.51", b"nonsense")
    await client.publish("kv.default.heartbeat.51", b"[1,2]")
    deep = b'{"x":' * 50_000  # nested past msgspec's depth: a RecursionError inside msgspec
    await client.publish("kv.default.load.51", deep)
    await client.publish("kv.default.heartbeat.51", deep)
    await client.publish("kv.default.events.99", b'{"worker_id":99,"event":{"event_id":1,"data":"cleared"}}')
    await eventually(lambda: plane.outcomes["rejected_bad_load"] == 2 and plane.outcomes["rejected_bad_heartbeat"] == 2)
    await eventually(lambda: plane.sequencer.outcomes["rejected_unknown_worker"] == 1)
    # A registration whose url is an endpoint's, not the engine's server root, is refused as HTTP's is.
    registry = await open_registry(client, Subjects())
    await registry.put("53", b'{"worker_id": 53, "url": "http://h:8000/v1/completions"}')
    await eventually(lambda: plane.outcomes["rejected_bad_registration"] == 1)
    await asyncio.sleep(0.8)  # the behaviour under test: past the 0.5 s lease (static workers have none)
    assert [w.worker_id for w in plane.router.workers()] == [51]
    await registry.delete("53")
    mismatched = KvEventPublisher(client, WorkerConfig(worker_id=52, block_size=64))
    await mismatched.start(heartbeat=False)
    await eventually(lambda: plane.outcomes["rejected_block_size_mismatch"] == 1)
    assert [w.worker_id for w in plane.router.workers()] == [51]
    await plane.deregister(51)
    await eventually(lambda: not other.router.workers())
    await mismatched.stop()
    await other.stop()
    await plane.stop()


@pytest.mark.slow
async def test_nats_restart_keeps_registry_watch_heartbeats_and_events(nats_server: EmbeddedNats) -> None:
    router_nc = await connect(NatsOptions(nats_server.url))
    plane_holder: list[RouterEventPlane] = []

    async def on_reconnect() -> None:
        await plane_holder[0].on_reconnected()

    router_nc._reconnected_cb = on_reconnect
    plane = await plane_for(router_nc, RouterConfig(block_size=BLOCK), lease_s=3.0)
    plane_holder.append(plane)
    worker_nc = await connect(NatsOptions(nats_server.url))
    first = await worker(worker_nc, 61)
    await first.stored(prompt_blocks(PROMPT))
    await eventually(lambda: cached(plane.router, PROMPT).get((61, 0)) == 8)
    nats_server.restart()
    await eventually(lambda: router_nc.is_connected and worker_nc.is_connected, timeout=30)
    await eventually(lambda: plane.outcomes["reconnects"] == 1)
    # Events lost in the outage are recovered by the full resync after the reconnect ...
    await first.removed([prompt_blocks(PROMPT)[7][0]])
    await eventually(lambda: cached(plane.router, PROMPT).get((61, 0)) == 7)
    # ... a worker registering after the restart is seen through the registry watch ...
    second = await worker(worker_nc, 62)
    await eventually(lambda: plane.router.has_worker(62))
    await second.stored(prompt_blocks(PROMPT[: 2 * BLOCK]))
    await eventually(lambda: cached(plane.router, PROMPT).get((62, 0)) == 2)
    # ... and heartbeats still keep workers alive past the lease.
    await asyncio.sleep(3.5)  # the behaviour under test: past the 3 s lease
    assert plane.router.has_worker(61) and plane.router.has_worker(62)
    for publisher in (first, second):
        await publisher.stop()
    await plane.stop()
    await router_nc.close()
    await worker_nc.close()


@pytest.mark.slow
async def test_a_nats_outage_longer_than_the_lease_keeps_the_workers_and_the_index(tmp_path: Path) -> None:
    store = tmp_path / "jetstream"
    store.mkdir()
    server = EmbeddedNats(store_dir=str(store)).start()  # its own store: the registry outlives a stop
    try:
        router_nc = await connect(NatsOptions(server.url))
        worker_nc = await connect(NatsOptions(server.url))
        # A lease of 2 s: the worker's client reconnects up to a second after the router's (the reconnect
        # wait, jittered), and the leases restart with the router's.
        plane = await plane_for(router_nc, RouterConfig(block_size=BLOCK), lease_s=2.0)
        keeper, leaver = await worker(worker_nc, 71), await worker(worker_nc, 72)
        await keeper.stored(prompt_blocks(PROMPT))
        await leaver.stored(prompt_blocks(PROMPT[: 2 * BLOCK]))
        await eventually(lambda: cached(plane.router, PROMPT) == {(71, 0): 8, (72, 0): 2})
        server.stop()
        await eventually(lambda: not router_nc.is_connected)
        leaver.stop_heartbeat()  # silent from the outage on, and after it
        await asyncio.sleep(5.0)  # the behaviour under test: two leases and a half without NATS
        assert cached(plane.router, PROMPT) == {(71, 0): 8, (72, 0): 2}
        server.start()
        await eventually(lambda: router_nc.is_connected and worker_nc.is_connected, timeout=30)
        assert cached(plane.router, PROMPT) == {(71, 0): 8, (72, 0): 2}  # leases restarted, not expired
        await eventually(lambda: not plane.router.has_worker(72), timeout=30)  # silent past its new lease
        await asyncio.sleep(2.5)  # past the lease again: heartbeats keep the other one
        assert cached(plane.router, PROMPT) == {(71, 0): 8}
        assert plane.router.removals["lease_expired"] == 1 and plane.outcomes["expired"] == 1
        for publisher in (keeper, leaver):
            await publisher.stop()
        await plane.stop()
        await router_nc.close()
        await worker_nc.close()
    finally:
        server.stop()


async def test_lease_expiry_survives_a_crash_and_still_removes_the_silent_worker(client: Client) -> None:
    plane = await plane_for(client, RouterConfig(block_size=BLOCK), lease_s=0.5)
    publisher = await worker(client, 41)
    await eventually(lambda: [w.worker_id for w in plane.router.workers()] == [41])
    real_deregister = plane.deregister
    calls = 0

    async def deregister_failing_once(worker_id: int, reason: RemovalReason = "api") -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("registry bucket unavailable")
        await real_deregister(worker_id, reason)

    plane.deregister = deregister_failing_once  # type: ignore[method-assign]
    publisher.stop_heartbeat()
    await eventually(lambda: not plane.router.workers(), timeout=30)  # lease, failed pass, backoff, pass
    assert plane._background.restarts["lease-expiry"] == 1
    assert plane.router.removals["lease_expired"] == 1
    await publisher.stop()
    await plane.stop()


async def test_roles_travel_with_the_registration_and_each_pool_reads_its_own_events(client: Client) -> None:
    plane = await plane_for(client, RouterConfig(block_size=BLOCK, disagg_local_prefill_below_tokens=3 * BLOCK))
    prefill, decode = await worker(client, 61, role="prefill"), await worker(client, 62, role="decode")
    await eventually(
        lambda: {(w.worker_id, w.role) for w in plane.router.workers()} == {(61, "prefill"), (62, "decode")}
    )
    await prefill.stored(prompt_blocks(PROMPT)[:6])  # the prefill pool's cache
    await eventually(lambda: cached(plane.router, PROMPT).get((61, 0)) == 6)
    first = await plane.router.new(RouteRequest(tokens=PROMPT, request_id="a"))
    assert first.worker_id == 62 and first.disaggregation is not None
    assert first.disaggregation.path == "remote_prefill" and first.disaggregation.decode_uncached_tokens == 8 * BLOCK
    assert first.disaggregation.prefill is not None
    assert (first.disaggregation.prefill.worker_id, first.disaggregation.prefill.overlap_blocks) == (61, 6)
    await decode.stored(prompt_blocks(PROMPT))  # the KV reached the decode worker, which says so
    await eventually(lambda: cached(plane.router, PROMPT).get((62, 0)) == 8)
    second = await plane.router.new(RouteRequest(tokens=[*PROMPT, 1, 2], request_id="b"))
    assert second.disaggregation is not None and second.disaggregation.path == "local_prefill"
    assert (second.worker_id, second.disaggregation.decode_uncached_tokens) == (62, 2)
    beats = plane.outcomes["heartbeats"]
    await eventually(lambda: plane.outcomes["heartbeats"] >= beats + 4)  # heartbeats keep the role
    assert {w.worker_id: w.role for w in plane.router.workers()} == {61: "prefill", 62: "decode"}
    for publisher in (prefill, decode):
        await publisher.stop()
    await plane.stop()


async def test_a_worker_that_publishes_at_once_and_leaves_is_indexed(client: Client) -> None:
    """README's "Workers over NATS" script: start, store, stop. The registry's watch reaches the router
    a JetStream hop after the put, so without the registration sent ahead on plain NATS the first
    events could overtake it, be dropped as an unknown worker's, and the resync find nobody."""
    plane = await plane_for(client, RouterConfig(block_size=BLOCK))
    blocks = prompt_blocks(PROMPT)
    for worker_id in range(100, 120):
        publisher = await worker(client, worker_id)
        await publisher.stored(blocks[:3])
        await publisher.stop()
    expected = {(worker_id, 0): 3 for worker_id in range(100, 120)}
    await eventually(lambda: cached(plane.router, PROMPT) == expected)
    assert plane.sequencer.unknown_worker_events == {}


async def test_a_heartbeat_speaks_only_for_the_worker_its_subject_names(client: Client) -> None:
    """A beat on worker 62's subject carrying worker 61's registration with a new epoch, or worker 61's
    beat on 62's subject, would restart worker 61's streams and drop its blocks: refused and counted."""
    plane = await plane_for(client, RouterConfig(block_size=BLOCK))
    victim, other = await worker(client, 61), await worker(client, 62)
    await eventually(lambda: {w.worker_id for w in plane.router.workers()} == {61, 62})
    await victim.stored(prompt_blocks(PROMPT)[:3])
    await eventually(lambda: cached(plane.router, PROMPT) == {(61, 0): 3})
    forged = WorkerConfig(worker_id=61, block_size=BLOCK, epoch="forged")
    beats = (
        Heartbeat(worker_id=62, registration=forged),  # on 62's subject, 61's registration
        Heartbeat(worker_id=61, registration=forged),  # 61's beat on 62's subject
    )
    for beat in beats:
        await client.publish("kv.default.heartbeat.62", msgspec.json.encode(beat))
    await eventually(lambda: plane.outcomes["rejected_bad_heartbeat"] == 2)
    await asyncio.sleep(0.3)  # the real heartbeats keep coming meanwhile
    assert cached(plane.router, PROMPT) == {(61, 0): 3}
    assert plane.sequencer.outcomes["publisher_restarts"] == 0
    await victim.stop()
    await other.stop()
    await plane.stop()


async def test_events_speak_only_for_the_worker_their_subject_names(client: Client) -> None:
    """On worker 62's subject, under 62's publisher epoch, an event of worker 61 (its blocks removed) would
    restart 61's streams (its index wiped, its real events then refused as a stale epoch's) or rewrite
    its blocks: refused, counted and logged; 62's own events in the same message are applied."""
    plane = await plane_for(client, RouterConfig(block_size=BLOCK))
    victim, other = await worker(client, 61), await worker(client, 62)
    await eventually(lambda: {w.worker_id for w in plane.router.workers()} == {61, 62})
    blocks = prompt_blocks(PROMPT)
    await victim.stored(blocks[:3])
    await eventually(lambda: cached(plane.router, PROMPT) == {(61, 0): 3})
    forged = RouterEvent(61, removed_event(99, [blocks[0][0]]))
    own = RouterEvent(62, stored_event(1, blocks[:2]))
    headers = {EPOCH_HEADER: other.registration.epoch or ""}
    await client.publish(Subjects().events(62), encode_router_events([forged, own]), headers=headers)
    await eventually(lambda: plane.sequencer.outcomes["rejected_foreign"] == 1)
    await eventually(lambda: cached(plane.router, PROMPT) == {(61, 0): 3, (62, 0): 2})
    await victim.stored(blocks[3:5], parent_hash=blocks[2][0])  # 61's own events still count
    await eventually(lambda: cached(plane.router, PROMPT) == {(61, 0): 5, (62, 0): 2})
    assert plane.sequencer.outcomes["publisher_restarts"] == 0
    await victim.stop()
    await other.stop()
    await plane.stop()


async def test_every_router_started_finds_the_registered_workers_and_stops_cleanly(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """Sixty routers started and stopped in turn beside three registered workers: each knows all three
    when its `start` returns (nats-py's end-of-contents marker can come before an entry the server has
    already sent, so the plane reads the bucket's last revision instead), and each `stop` ends its
    registry watch (a `wait_for` on Python 3.11 swallows a cancellation that lands as an entry arrives;
    the supervisor then logs the task it had to leave behind)."""
    holders = [await worker(client, worker_id) for worker_id in (41, 42, 43)]
    for _ in range(60):
        plane = await plane_for(client, RouterConfig(block_size=BLOCK))
        found = sorted(w.worker_id for w in plane.router.workers())
        await plane.stop()
        assert found == [41, 42, 43]
    assert [r.getMessage() for r in caplog.records if "ignored cancellation" in r.getMessage()] == []
    for holder in holders:
        await holder.stop()


async def test_a_resync_nobody_serves_yet_is_asked_again_until_the_workers_responder_is_up(client: Client) -> None:
    """A join (or reconnection) resync answered "no responders" (the worker's publisher or bridge not yet
    subscribed, as after NATS came back) is asked again within seconds, not at the sequencer's retry
    15 s later: the dump is applied and the stream trusted once the worker serves resyncs."""
    plane = await plane_for(client, RouterConfig(block_size=BLOCK))
    await plane.register(WorkerConfig(worker_id=51, block_size=BLOCK), leased=True)  # nobody serves 51 yet
    holder = await worker(client, 51)
    await holder.stored(prompt_blocks(PROMPT))
    await eventually(lambda: plane.sequencer.outcomes["resync_dump_applied"] == 1, 5)
    assert plane.sequencer.outcomes["resync_no_responders"] == 0
    assert [(s.worker_id, s.trusted) for s in plane.router.sequencer.status()] == [(51, True)]
    await eventually(lambda: cached(plane.router, PROMPT).get((51, 0)) == 8)
    await holder.stop()
    await plane.stop()


async def test_a_router_starts_on_a_registry_whose_last_revision_was_compacted_away() -> None:
    """The bucket's last revision is gone (a delete marker purged, as `nats kv compact` does): the
    router still knows when it has read the bucket, starts at once and knows the worker left in it."""
    with EmbeddedNats() as server:
        nc = await connect(NatsOptions(server.url))
        try:
            registry = await open_registry(nc, Subjects())
            for worker_id in (1, 2):
                await registry.put(
                    str(worker_id), msgspec.json.encode(WorkerConfig(worker_id=worker_id, block_size=BLOCK))
                )
            await registry.delete("2")
            await registry.purge_deletes(olderthan=-1)

            async def compacted() -> bool:  # the server may apply the purge a moment after answering it
                state = (await registry.status()).stream_info.state
                return (state.messages, state.last_seq) == (1, 3)  # revision 3, the delete marker, is no more

            await eventually(compacted, 5, "the delete marker purged")
            plane = await plane_for(nc, RouterConfig(block_size=BLOCK))
            assert [w.worker_id for w in plane.router.workers()] == [1]
            await plane.stop()
        finally:
            await nc.close()


async def test_a_resync_replaced_while_it_waits_to_ask_again_is_not_asked_again() -> None:
    """A registration's ask that nobody served waits to ask again; a reconnection's ask replaces it
    meanwhile. Once the worker serves resyncs it is asked once: no dump comes back for a stale request."""
    with EmbeddedNats() as server:
        nc = await connect(NatsOptions(server.url))
        try:
            plane = await plane_for(nc, RouterConfig(block_size=BLOCK))
            await plane.register(WorkerConfig(worker_id=53, block_size=BLOCK), leased=True)  # nobody serves 53
            await plane.on_reconnected()  # asks anew, replacing the registration's ask
            holder = await worker(nc, 53)
            await eventually(lambda: plane.sequencer.outcomes["resync_dump_applied"] == 1, 5)
            await asyncio.sleep(sum(NO_RESPONDERS_RETRY_S))  # past every retry the first ask had
            assert plane.sequencer.outcomes["resync_stale"] == 0
            assert plane.sequencer.outcomes["resync_dump_applied"] == 1
            await holder.stop()
            await plane.stop()
        finally:
            await nc.close()


async def test_with_events_from_jetstream_an_unverified_stream_is_still_asked_again() -> None:
    """A plane that takes its events from elsewhere (``--durable-events``: the JetStream stream) still
    retries the full resync of a stream left unverified, once its retry interval has passed."""
    with EmbeddedNats() as server:
        nc = await connect(NatsOptions(server.url))
        try:
            plane = RouterEventPlane(KvRouter(RouterConfig(block_size=BLOCK)), nc, subscribe_events=False)
            plane.sequencer.retry_interval_s = 0.2
            await plane.start()
            await plane.register(WorkerConfig(worker_id=55, block_size=BLOCK), leased=True)  # nobody serves 55
            await eventually(lambda: plane.sequencer.outcomes["resync_no_responders"] == 1, 10)
            holder = await worker(nc, 55)
            await eventually(lambda: plane.sequencer.outcomes["resync_dump_applied"] == 1, 10)
            assert [(s.worker_id, s.trusted) for s in plane.router.sequencer.status()] == [(55, True)]
            await holder.stop()
            await plane.stop()
        finally:
            await nc.close()


async def test_a_resync_answer_that_goes_on_past_its_bound_is_abandoned_and_asked_again(
    nats_server: EmbeddedNats, client: Client
) -> None:
    """A worker whose first answer says ``more`` part after part, past `MAX_PARTS_BYTES` (its parts padded
    to 8 MiB: decoding that many real events would cost the test what the bound spares the router), has
    that answer abandoned as an unanswered resync: counted (``rejected_oversized_resync``), the stream
    untrusted, and asked again at the sequencer's retry. Answered well then, the dump lands, trusted."""
    plane = await plane_for(client, RouterConfig(block_size=BLOCK))
    plane.sequencer.retry_interval_s = 0.2
    worker_nc = await connect(NatsOptions(nats_server.url))
    holder = KvEventPublisher(worker_nc, WorkerConfig(worker_id=57, block_size=BLOCK), heartbeat_interval=0.1)
    endless = msgspec.msgpack.encode(
        ResyncResponse(events=ResyncBatch(events=[], last_event_id=0, more=True), error="x" * (8 << 20))
    )
    answers = 0
    refused = plane.sequencer.outcomes

    def read_past(read: int) -> bool:
        """Whether the router's connection has read a part more than ``read`` bytes, or refused the answer."""
        return client.stats["in_bytes"] >= read + len(endless) or refused["rejected_oversized_resync"] > 0

    async def answer(message: Msg) -> None:
        """The first answer never ends (as many parts as go past the bound); the next, the worker's own."""
        nonlocal answers
        answers += 1
        if answers > 1:
            response = holder.answer_resync(msgspec.json.decode(message.data, type=ResyncRequest))
            await worker_nc.publish(message.reply, msgspec.msgpack.encode(response))
            return
        # Each part once the router's connection has read the one before (64 MiB at once would pass what
        # nats-server holds for one client: a slow consumer of its own), until the router refuses them.
        for _ in range(MAX_PARTS_BYTES // len(endless) + 2):
            read = client.stats["in_bytes"]
            await worker_nc.publish(message.reply, endless)
            await eventually(functools.partial(read_past, read))
            if refused["rejected_oversized_resync"]:
                return

    try:
        await worker_nc.subscribe(plane.subjects.resync(57), cb=answer)
        await holder.stored(prompt_blocks(PROMPT))  # before it registers: its dump alone brings them
        await holder.register()
        holder.start_heartbeat()
        await eventually(lambda: plane.sequencer.outcomes["rejected_oversized_resync"] == 1, 30, "the refused answer")
        assert [(s.worker_id, s.trusted) for s in plane.sequencer.status()] == [(57, False)]
        assert plane.sequencer.outcomes["resync_failed"] == 1
        await eventually(lambda: plane.sequencer.outcomes["resync_dump_applied"] == 1, 30, "the dump asked again")
        assert [(s.worker_id, s.trusted) for s in plane.sequencer.status()] == [(57, True)]
        assert cached(plane.router, PROMPT) == {(57, 0): 8} and answers == 2
        await holder.stop()
        await plane.stop()
    finally:
        await worker_nc.close()

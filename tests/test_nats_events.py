"""Publisher -> real nats-server -> subscriber -> index: resyncs converge to the worker's state."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import msgspec
import pytest
from nats.aio.client import Client

from indexer.events import RouterEvent, StorageTier
from indexer.hashing import compute_block_hashes, compute_sequence_hashes
from indexer.radix_tree import RadixTree
from indexer.sequencer import EventSequencer
from router.event_plane.connection import NatsOptions, connect
from router.event_plane.embedded_server import EmbeddedNats
from router.event_plane.publisher import KvEventPublisher
from router.event_plane.subscriber import KvEventSubscriber
from router.types import WorkerConfig
from tests.waiting import eventually

pytestmark = pytest.mark.anyio


def chain(prompt_seed: int, blocks: int) -> list[tuple[int, int]]:
    tokens = [prompt_seed * 100_000 + i for i in range(blocks * 16)]
    local = compute_block_hashes(tokens, 16)
    return list(zip(compute_sequence_hashes(local), local, strict=True))


def scores_of(tree: RadixTree, pairs: list[tuple[int, int]]) -> dict[tuple[int, int], int]:
    return tree.find_matches([local for _, local in pairs]).scores


def same_state(router_tree: RadixTree, publisher: KvEventPublisher) -> bool:
    """Compare the router's view of the worker with the worker's own, through their dumps."""

    def normalised(events: list[RouterEvent]) -> list[bytes]:
        restored = RadixTree()
        for event in events:
            if event.worker_id == publisher.worker_id:
                restored.apply_router_event(event)
        return sorted(msgspec.json.encode(e.event.data) for e in restored.dump_events())

    return normalised(router_tree.dump_events()) == normalised(publisher.dump_events())


async def start_router(nc: Client) -> tuple[RadixTree, EventSequencer, KvEventSubscriber]:
    tree = RadixTree()
    sequencer = EventSequencer(tree)
    # 5 s bounds an unanswered resync only: at 0.5 s a stalled loop could give up on an answered one.
    subscriber = KvEventSubscriber(nc, sequencer, resync_timeout_s=5.0, resync_backoff_s=0.05)
    await subscriber.start()
    await nc.flush()
    return tree, sequencer, subscriber


async def test_router_started_late_learns_earlier_state_and_follows_live(client: Client) -> None:
    publisher = KvEventPublisher(client, WorkerConfig(worker_id=2**64 - 3, block_size=16))
    await publisher.start(heartbeat=False)
    early = chain(1, 6)
    await publisher.stored(early[:4])
    await publisher.stored(early[4:], parent_hash=early[3][0])
    tree, sequencer, subscriber = await start_router(client)
    late = chain(2, 3)
    await publisher.stored(late)
    await eventually(lambda: scores_of(tree, late) == {(publisher.worker_id, 0): 3})
    assert scores_of(tree, early) == {(publisher.worker_id, 0): 6}
    assert sequencer.outcomes["resync_dump_applied"] == 1
    await publisher.removed([early[5][0]])
    await eventually(lambda: scores_of(tree, early) == {(publisher.worker_id, 0): 5})
    assert same_state(tree, publisher)
    await subscriber.stop()
    await publisher.stop()


async def test_dropped_messages_are_detected_and_repaired(client: Client) -> None:
    publisher = KvEventPublisher(client, WorkerConfig(worker_id=7, block_size=16), msgpack=False)
    await publisher.start(heartbeat=False)
    tree, sequencer, subscriber = await start_router(client)
    first = chain(3, 4)
    await publisher.stored(first)
    await eventually(lambda: scores_of(tree, first) == {(7, 0): 4})
    lost = chain(4, 5)
    with messages_lost(publisher):  # three events numbered but never delivered
        await publisher.stored(lost[:2])
        await publisher.stored(lost[2:], parent_hash=lost[1][0])
        await publisher.removed([first[3][0]])
    after = chain(5, 2)
    await publisher.stored(after, dp_rank=0)
    await eventually(lambda: scores_of(tree, lost) == {(7, 0): 5})
    assert scores_of(tree, first) == {(7, 0): 3}
    assert scores_of(tree, after) == {(7, 0): 2}
    assert sequencer.outcomes["gap"] == 1
    assert sequencer.outcomes["resync_events_applied"] == 1
    await eventually(lambda: all(status.trusted for status in sequencer.status()))
    assert same_state(tree, publisher)
    await subscriber.stop()
    await publisher.stop()


async def _drop(events: list[RouterEvent]) -> None:
    return None


@contextlib.contextmanager
def messages_lost(publisher: KvEventPublisher) -> Iterator[None]:
    """Inside, the publisher numbers and records its events but none reaches NATS."""
    real_send = publisher._send
    publisher._send = _drop  # type: ignore[method-assign]
    try:
        yield
    finally:
        publisher._send = real_send  # type: ignore[method-assign]


async def test_gap_older_than_the_ring_is_repaired_with_a_full_dump(client: Client) -> None:
    publisher = KvEventPublisher(client, WorkerConfig(worker_id=8), ring_size=4)
    await publisher.start(heartbeat=False)
    tree, sequencer, subscriber = await start_router(client)
    kept = chain(6, 2)
    await publisher.stored(kept)
    await eventually(lambda: scores_of(tree, kept) == {(8, 0): 2})
    with messages_lost(publisher):  # more than the ring of 4 holds
        for seed in range(10, 20):
            await publisher.stored(chain(seed, 1), storage_tier=StorageTier.HOST_PINNED)
        await publisher.removed([kept[1][0]])
    await publisher.stored(chain(30, 1))
    await eventually(lambda: sequencer.outcomes["resync_dump_applied"] == 1)
    await eventually(lambda: tree.find_matches([chain(30, 1)[0][1]]).scores == {(8, 0): 1})
    assert scores_of(tree, kept) == {(8, 0): 1}
    assert tree.find_matches([chain(15, 1)[0][1]]).tier_hits == {StorageTier.HOST_PINNED: {(8, 0): 1}}
    assert same_state(tree, publisher)
    await subscriber.stop()
    await publisher.stop()


async def test_garbage_on_the_events_subject_is_counted_and_ignored(client: Client) -> None:
    tree, sequencer, subscriber = await start_router(client)
    await client.publish("kv.default.events.1", b"{not json")
    await client.publish("kv.default.events.1", b'{"worker_id": -4, "event": {}}')
    await client.publish("kv.default.events.1", b"\x93\x01\x02")
    publisher = KvEventPublisher(client, WorkerConfig(worker_id=9))
    await publisher.start(heartbeat=False)
    good = chain(40, 2)
    await publisher.stored(good)
    await eventually(lambda: scores_of(tree, good) == {(9, 0): 2})
    assert sequencer.outcomes["rejected_undecodable"] == 3
    await subscriber.stop()
    await publisher.stop()


async def test_events_dynamo_refuses_are_counted_and_ignored(client: Client) -> None:
    """A data map with a second key (null or unknown) or a multimodal object without offsets: a counted,
    logged rejection, as for any undecodable event; the index is untouched."""
    tree, sequencer, subscriber = await start_router(client)
    block = {"block_hash": 1, "tokens_hash": 2}
    stored = {"stored": {"parent_hash": None, "blocks": [block]}}
    for data in (
        {**stored, "removed": None},
        {**stored, "bogus": 1},
        {"stored": {"blocks": [{**block, "mm_extra_info": {"mm_objects": [{"mm_hash": 3}]}}]}},
        {"stored": {"blocks": [{**block, "mm_extra_info": {"mm_objects": [{"mm_hash": 3, "offsets": [[-1, 2]]}]}}]}},
    ):
        event = {"worker_id": 9, "event": {"event_id": 1, "dp_rank": 0, "data": data}}
        await client.publish("kv.default.events.9", msgspec.json.encode(event))
    await eventually(lambda: sequencer.outcomes["rejected_undecodable"] == 4)
    assert tree.find_matches([2]).scores == {}
    await subscriber.stop()


async def test_router_reconnects_after_a_nats_restart_and_converges(nats_server: EmbeddedNats) -> None:
    router_nc = await connect(NatsOptions(nats_server.url))
    worker_nc = await connect(NatsOptions(nats_server.url))
    reconnected = asyncio.Event()
    tree, _, subscriber = await start_router(router_nc)

    async def on_reconnect() -> None:
        subscriber.resync_all()
        reconnected.set()

    router_nc._reconnected_cb = on_reconnect
    publisher = KvEventPublisher(worker_nc, WorkerConfig(worker_id=11))
    await publisher.start(heartbeat=False)
    before = chain(50, 3)
    await publisher.stored(before)
    await eventually(lambda: scores_of(tree, before) == {(11, 0): 3})
    nats_server.restart()
    await asyncio.wait_for(reconnected.wait(), 15)
    await eventually(lambda: worker_nc.is_connected)
    after = chain(51, 2)
    await publisher.removed([before[2][0]])
    await publisher.stored(after)
    await eventually(lambda: scores_of(tree, after) == {(11, 0): 2} and scores_of(tree, before) == {(11, 0): 2})
    await eventually(lambda: same_state(tree, publisher))
    await subscriber.stop()
    await publisher.stop()
    await router_nc.close()
    await worker_nc.close()

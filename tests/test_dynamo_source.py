"""Dynamo 1.6.1 workers on NATS feed kv-router unchanged (``serve --dynamo-endpoint NS.COMPONENT.ENDPOINT``).

Dynamo's own Python `KvEventPublisher` and `WorkerMetricsPublisher` (the oracle extra; DistributedRuntime
with in-memory discovery and ``DYN_EVENT_PLANE=nats``) publish on a real nats-server; the router's index
then answers as Dynamo's `RadixTree` fed the very messages those publishers sent. Gaps in the envelope's
sequence distrust the rank, a new publisher clears it, an unknown worker is learned.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from api.app import create_app
from api.config import EngineSourcesConfig, EventPlaneConfig, Settings
from indexer.hashing import compute_block_hashes
from router.config import RouterConfig
from router.engines.dynamo_source import DynamoEndpoint
from router.event_plane.connection import NatsOptions, connect
from router.event_plane.embedded_server import EmbeddedNats
from tests.engine_fakes import SideLoop
from tests.waiting import until

BLOCK = 4
ENDPOINT = "dyn.backend.generate"
SUBJECT = DynamoEndpoint.parse(ENDPOINT).subject("kv-events")


@pytest.fixture
def router(nats_server: EmbeddedNats) -> Iterator[TestClient]:
    settings = Settings(
        router=RouterConfig(block_size=BLOCK),
        event_plane=EventPlaneConfig(nats_url=nats_server.url),
        engines=EngineSourcesConfig(dynamo_endpoint=[ENDPOINT]),
    )
    app = create_app(settings, registry=CollectorRegistry(), rng=random.Random(0))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        yield client


def _envelope(publisher_id: int, sequence: int, events: list[dict[str, Any]]) -> bytes:
    # The observed 1.6.1 shape (reference/dynamo-router.md §5.3): named msgpack map, payload as bin.
    return msgspec.msgpack.encode({"publisher_id": publisher_id, "sequence": sequence, "published_at": 1796026726001,
                                   "topic": "kv-events", "payload": msgspec.msgpack.encode(events)})  # fmt: skip


def _stored(worker_id: int, event_id: int, blocks: list[tuple[int, int]], parent: int | None = None) -> dict[str, Any]:
    wire_blocks = [{"block_hash": b, "tokens_hash": t, "mm_extra_info": None} for b, t in blocks]
    stored = {"parent_hash": parent, "start_position": None, "blocks": wire_blocks}
    return {"worker_id": worker_id, "storage_tier": "device", "residency_domain": "worker",
            "event": {"event_id": event_id, "dp_rank": 0, "data": {"stored": stored}}}  # fmt: skip


def _streams(client: TestClient, worker_id: int) -> list[dict[str, Any]]:
    reply = client.get(f"/v1/workers/{worker_id}")
    return reply.json()["event_streams"] if reply.status_code == 200 else []


def test_observed_envelopes_gaps_and_a_new_publisher(router: TestClient, nats_server: EmbeddedNats) -> None:
    async def publish(*messages: bytes) -> None:
        nc = await connect(NatsOptions(nats_server.url))
        for message in messages:
            await nc.publish(SUBJECT, message)
        await nc.flush()
        await nc.close()

    worker = 2243053257420644916
    asyncio.run(publish(_envelope(81, 0, [_stored(worker, 1, [(111, 9143094415614847814)])]),
                        _envelope(81, 1, [_stored(worker, 2, [(222, 12124091508212882195)], parent=111)])))  # fmt: skip

    def dumped_blocks() -> list[int]:
        return [
            block["block_hash"]
            for row in router.get("/v1/dump").json()
            for block in row["event"]["data"]["stored"]["blocks"]
        ]

    until(lambda: dumped_blocks() == [111, 222], what="both events applied")  # the second may come a moment later
    assert len(router.get("/v1/dump").json()) == 1
    config = router.get(f"/v1/workers/{worker}").json()["config"]
    assert (config["worker_id"], config["block_size"], config["total_kv_blocks"]) == (worker, BLOCK, None)
    assert [s["trusted"] for s in _streams(router, worker)] == [True]

    asyncio.run(publish(_envelope(81, 5, [_stored(worker, 6, [(333, 5)], parent=222)]), b"\x93garbage"))
    until(lambda: [s["trusted"] for s in _streams(router, worker)] == [False])

    # A new publisher on the rank: the worker restarted; what the old one stored is gone.
    asyncio.run(publish(_envelope(82, 0, [_stored(worker, 0, [(444, 6)])])))
    until(lambda: [[b["block_hash"] for b in e["event"]["data"]["stored"]["blocks"]]
                   for e in router.get("/v1/dump").json()] == [[444]])  # fmt: skip
    assert [s["trusted"] for s in _streams(router, worker)] == [True]


@pytest.mark.oracle
def test_dynamos_own_publishers_feed_the_router_as_dynamos_radix_tree_says(
    router: TestClient, nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    dynamo_core = pytest.importorskip("dynamo._core", reason="needs ai-dynamo-runtime==1.6.1 (the oracle extra)")
    monkeypatch.setenv("DYN_EVENT_PLANE", "nats")
    monkeypatch.setenv("NATS_SERVER", nats_server.url)
    monkeypatch.setenv("DYN_LOG", "error")
    side = SideLoop()
    theirs = dynamo_core.RadixTree()
    captured: list[bytes] = []
    rng = random.Random(4)
    prompts = [[rng.randrange(50_000) for _ in range(rng.randint(1, 5) * BLOCK)] for _ in range(12)]
    try:

        async def capture() -> Any:
            nc = await connect(NatsOptions(nats_server.url))

            async def on_message(message: Any) -> None:
                captured.append(message.data)

            await nc.subscribe(SUBJECT, cb=on_message)
            await nc.flush()
            return nc

        listener = side.call(capture())

        async def run_dynamo() -> Any:
            runtime = dynamo_core.DistributedRuntime(asyncio.get_running_loop(), "mem", "tcp")
            endpoint = runtime.endpoint(ENDPOINT)
            publisher = dynamo_core.KvEventPublisher(endpoint, kv_block_size=BLOCK)
            hashes: list[list[int]] = []
            for i, tokens in enumerate(prompts):
                blocks = [(i << 8) + j + 1 for j in range(len(tokens) // BLOCK)]
                hashes.append(blocks)
                publisher.publish_stored(tokens, [BLOCK] * len(blocks), blocks, None)
            for blocks in hashes[::3]:
                publisher.publish_removed(blocks[-1:])
            metrics = dynamo_core.WorkerMetricsPublisher()
            await metrics.create_endpoint(endpoint)
            metrics.publish(0, 5, 7)
            return runtime, publisher, metrics  # alive until the test ends: dropped, they stop publishing

        runtime, *_publishers = side.call(run_dynamo())

        def events_sent() -> int:  # the publisher may put several events in one message
            return sum(len(msgspec.msgpack.decode(msgspec.msgpack.decode(m)["payload"])) for m in list(captured))

        until(lambda: events_sent() == len(prompts) + 4, timeout=20)
        worker_ids = set()
        for message in captured:
            envelope = msgspec.msgpack.decode(message)
            for event in msgspec.msgpack.decode(envelope["payload"]):
                worker_ids.add(event["worker_id"])
                theirs.apply_event(event["worker_id"], msgspec.json.encode(event["event"]))
        (worker_id,) = worker_ids

        def agrees() -> bool:
            for tokens in prompts:
                expected = theirs.find_matches(compute_block_hashes(tokens, BLOCK), False).scores
                rows = router.post("/v1/overlap", json={"tokens": tokens}).json()["workers"]
                got = {(r["worker_id"], r["dp_rank"]): r["device_blocks"] for r in rows if r["device_blocks"]}
                if got != dict(expected):
                    return False
            return True

        until(agrees, timeout=20)
        worker = router.get(f"/v1/workers/{worker_id}").json()
        assert [s["trusted"] for s in worker["event_streams"]] == [True]
        until(lambda: router.get(f"/v1/workers/{worker_id}").json()["ranks"][0]["kv_used_blocks"] == 7)
        side.call(listener.close())
        runtime.shutdown()
    finally:
        time.sleep(0.1)  # the Rust runtime's shutdown posts onto the side loop and shows no sign of its end
        side.close()


@pytest.mark.oracle
def test_a_dynamo_worker_with_two_dp_ranks_is_routed_and_loaded_per_rank_through_a_restart_of_another(
    router: TestClient, nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dynamo's own publishers for dp ranks 0 and 1 of one worker and its metrics publisher: rank 1 is
    learned, routed to, shown with its own load, and stays routable when another worker restarts."""
    dynamo_core = pytest.importorskip("dynamo._core", reason="needs ai-dynamo-runtime==1.6.1 (the oracle extra)")
    monkeypatch.setenv("DYN_EVENT_PLANE", "nats")
    monkeypatch.setenv("NATS_SERVER", nats_server.url)
    monkeypatch.setenv("DYN_LOG", "error")
    side = SideLoop()
    rng = random.Random(26)
    on_rank = {rank: [rng.randrange(50_000) for _ in range(4 * BLOCK)] for rank in (0, 1)}
    other_before, other_after = ([rng.randrange(50_000) for _ in range(3 * BLOCK)] for _ in range(2))
    other_id = 77
    kept: list[Any] = []
    try:

        async def start_worker() -> Any:
            runtime = dynamo_core.DistributedRuntime(asyncio.get_running_loop(), "mem", "tcp")
            endpoint = runtime.endpoint(ENDPOINT)
            for rank, tokens in on_rank.items():
                publisher = dynamo_core.KvEventPublisher(endpoint, kv_block_size=BLOCK, dp_rank=rank)
                publisher.publish_stored(tokens, [BLOCK] * 4, [(rank + 1) * 100 + j for j in range(4)], None)
                kept.append(publisher)
            other = dynamo_core.KvEventPublisher(endpoint, worker_id=other_id, kv_block_size=BLOCK)
            other.publish_stored(other_before, [BLOCK] * 3, [901, 902, 903], None)
            metrics = dynamo_core.WorkerMetricsPublisher()
            await metrics.create_endpoint(endpoint)
            metrics.publish(0, 5, 7)
            metrics.publish(1, 6, 9)
            kept.extend([metrics, other, endpoint])
            return runtime

        runtime = side.call(start_worker())

        def learned() -> set[int]:
            return {w["config"]["worker_id"] for w in router.get("/v1/workers").json()["workers"]} - {other_id}

        until(lambda: len(learned()) == 1, timeout=20)
        (worker_id,) = learned()

        def route(tokens: list[int]) -> tuple[int, int]:
            """The choice, freed at once: polled until the events are in, bookings would pile up (more
            the slower the machine) until load outweighs the overlap under test."""
            decision = router.post("/v1/new", json={"tokens": tokens}).json()
            assert router.post("/v1/mark_free", json={"request_id": decision["request_id"]}).status_code == 200
            return decision["worker_id"], decision["dp_rank"]

        def ranks() -> dict[int, int | None]:
            reply = router.get(f"/v1/workers/{worker_id}")
            rows = reply.json()["ranks"] if reply.status_code == 200 else []
            return {row["dp_rank"]: row["kv_used_blocks"] for row in rows}

        until(lambda: ranks() == {0: 7, 1: 9}, timeout=20)
        until(lambda: route(on_rank[1]) == (worker_id, 1) and route(on_rank[0]) == (worker_id, 0), timeout=20)
        overlap = router.post("/v1/overlap", json={"tokens": on_rank[1]}).json()["workers"]
        assert {(r["worker_id"], r["dp_rank"]): r["device_blocks"] for r in overlap}[(worker_id, 1)] == 4
        until(lambda: route(other_before) == (other_id, 0), timeout=20)

        async def restart_other() -> None:  # a new process of worker 77: a new publisher for its rank
            endpoint = kept.pop()
            kept.pop()
            restarted = dynamo_core.KvEventPublisher(endpoint, worker_id=other_id, kv_block_size=BLOCK)
            restarted.publish_stored(other_after, [BLOCK] * 3, [904, 905, 906], None)
            kept.append(restarted)

        side.call(restart_other())
        until(lambda: route(other_after) == (other_id, 0), timeout=20)
        dumped = {(e["worker_id"], e["event"]["dp_rank"]) for e in router.get("/v1/dump").json()}
        assert dumped == {(worker_id, 0), (worker_id, 1), (other_id, 0)}
        assert route(on_rank[1]) == (worker_id, 1)
        assert ranks() == {0: 7, 1: 9}
        runtime.shutdown()
    finally:
        kept.clear()
        time.sleep(0.1)  # the Rust runtime's shutdown posts onto the side loop and shows no sign of its end
        side.close()


def test_ranks_are_learned_only_for_learned_workers_and_only_as_far_as_a_registration_goes() -> None:
    from typing import cast

    from nats.aio.client import Client

    from router.engines.dynamo_source import DynamoNatsSource, EventEnvelope
    from router.kv_router import KvRouter
    from router.types import WorkerConfig
    from tests.dynamo_fleet import prompt_stored_event

    router = KvRouter(RouterConfig(block_size=BLOCK), rng=random.Random(0))
    router.register_worker(WorkerConfig(worker_id=5, block_size=BLOCK))  # the operator's: rank 0 only
    source = DynamoNatsSource(cast(Client, None), router, ENDPOINT)
    tokens = list(range(2 * BLOCK))
    ranks = [(9, 3), (9, 1), (9, 5000), (5, 1)]
    events = [prompt_stored_event(worker, tokens, BLOCK, dp_rank=rank) for worker, rank in ranks]
    for sequence, event in enumerate(events):
        source.take(EventEnvelope(publisher_id=sequence, sequence=0, payload=b""), [event])
    learned, configured = router.worker(9), router.worker(5)
    assert learned is not None and list(learned.dp_ranks) == [1, 2, 3]
    assert configured is not None and list(configured.dp_ranks) == [0]
    assert source.stats["rejected_bad_dp_rank"] == 1
    assert {(row.worker_id, row.dp_rank) for row in router.rank_loads()} == {(5, 0), (9, 1), (9, 2), (9, 3)}


def test_a_new_publisher_clears_every_storage_tier_of_the_rank() -> None:
    from typing import cast

    from nats.aio.client import Client

    from indexer.events import RouterEvent, StorageTier, stored_event
    from router.engines.dynamo_source import DynamoNatsSource, EventEnvelope
    from router.kv_router import KvRouter
    from router.types import WorkerConfig

    router = KvRouter(RouterConfig(block_size=BLOCK), rng=random.Random(0))
    router.register_worker(WorkerConfig(worker_id=5, block_size=BLOCK))
    source = DynamoNatsSource(cast(Client, None), router, ENDPOINT)  # driven through take(): no NATS read
    host = StorageTier.HOST_PINNED
    old = [RouterEvent(5, stored_event(0, [(1, 1)])), RouterEvent(5, stored_event(1, [(2, 2)]), host)]
    source.take(EventEnvelope(publisher_id=1, sequence=0, payload=b""), old)
    assert router.tree.find_matches([2]).tier_hits == {host: {(5, 0): 1}}
    source.take(EventEnvelope(publisher_id=2, sequence=0, payload=b""), [RouterEvent(5, stored_event(0, [(3, 3)]))])
    assert router.tree.find_matches([2]).tier_hits == {}  # the old process's host blocks are gone
    assert router.tree.find_matches([1]).scores == {} and router.tree.find_matches([3]).scores == {(5, 0): 1}
    assert source.stats["restarts"] == 1 and router.sequencer.freshness((5, 0))[0]

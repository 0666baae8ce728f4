"""The worker registry through NATS outages, over HTTP with a real nats-server: registrations and
removals made while NATS is down answer at once and reach the bucket once it is back; a server back
with an empty JetStream store gets the bucket again, with this router's registrations, and the router
learns every entry of the new bucket, whatever its revision."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec
from fastapi.testclient import TestClient
from nats.js.errors import BucketNotFoundError, NoKeysError

from router.event_plane.connection import NatsOptions, connect
from router.event_plane.embedded_server import EmbeddedNats
from router.event_plane.publisher import open_registry
from router.event_plane.subjects import Subjects
from router.types import WorkerConfig
from tests.metrics import sample
from tests.nats_proxy import LossyNatsProxy
from tests.test_api_event_plane import service
from tests.waiting import until

BLOCK = 16
# Well under the 5 s a JetStream request waits before it times out.
PROMPT_S = 2.0


def plane_state(client: TestClient) -> str:
    return str(client.get("/readyz").json()["event_plane"]["state"])


def known(client: TestClient) -> dict[int, str | None]:
    """The workers the router knows: id -> url."""
    return {w["config"]["worker_id"]: w["config"].get("url") for w in client.get("/v1/workers").json()["workers"]}


def registry(url: str) -> dict[int, str | None] | None:
    """The registry bucket as another process reads it (id -> url), None when it does not exist."""

    async def read() -> dict[int, str | None] | None:
        nc = await connect(NatsOptions(url))
        try:
            try:
                bucket = await nc.jetstream().key_value(Subjects().registry_bucket)
            except BucketNotFoundError:
                return None
            try:
                keys = await bucket.keys()
            except NoKeysError:
                return {}
            entries = {}
            for key in keys:
                entry = await bucket.get(key)
                entries[int(key)] = msgspec.json.decode(entry.value or b"", type=WorkerConfig).url
            return entries
        finally:
            await nc.close()

    return asyncio.run(read())


def put_elsewhere(url: str, worker_id: int) -> None:
    """Register ``worker_id`` as another router or a worker would: straight into the bucket (made
    when it does not exist)."""

    async def put() -> None:
        nc = await connect(NatsOptions(url))
        try:
            bucket = await open_registry(nc, Subjects())
            registration = WorkerConfig(worker_id=worker_id, block_size=BLOCK, url=f"http://elsewhere/{worker_id}")
            await bucket.put(str(worker_id), msgspec.json.encode(registration))
        finally:
            await nc.close()

    asyncio.run(put())


def timed(call: Callable[[], httpx.Response]) -> tuple[int, float]:
    """The status ``call`` answered, and how long it took."""
    started = time.monotonic()
    status = call().status_code
    return status, time.monotonic() - started


def test_workers_registered_and_removed_while_nats_is_down_answer_at_once_and_reach_the_registry_once_it_is_back(
    tmp_path: Path,
) -> None:
    """They used to answer a plain-text 500 after 5 s (a JetStream timeout), applied here all the same,
    and the nats client sent the write at the reconnection anyway."""
    server = EmbeddedNats(store_dir=str(tmp_path / "jetstream")).start()  # its store outlives a stop
    try:
        with service(server.url) as client:
            for worker_id in (1, 2):
                assert client.post("/v1/workers", json={"worker_id": worker_id}).status_code == 201
            assert registry(server.url) == {1: None, 2: None}
            server.stop()
            until(lambda: plane_state(client) == "disconnected", 10, "the router sees NATS gone")

            answers = [
                timed(lambda: client.post("/v1/workers", json={"worker_id": 3})),
                timed(lambda: client.delete("/v1/workers/1")),
                # A later write of worker 3 replaces the one still owed.
                timed(lambda: client.post("/v1/workers", json={"worker_id": 3, "url": "http://w3"})),
            ]
            assert [status for status, _ in answers] == [201, 200, 200]
            assert max(took for _, took in answers) < PROMPT_S, answers
            assert known(client) == {2: None, 3: "http://w3"}  # routing goes on with them meanwhile
            # What waits for NATS is said: two workers' writes (3's second replaced its first).
            assert client.get("/readyz").json()["event_plane"]["registry_writes_owed"] == 2
            assert sample(client.get("/metrics").text, "kv_router_registry_writes_owed") == 2.0

            server.start()
            until(lambda: registry(server.url) == {2: None, 3: "http://w3"}, 10, "the registry has the writes")
            assert plane_state(client) == "connected"
            until(lambda: client.get("/readyz").json()["event_plane"]["registry_writes_owed"] == 0, 10, "none owed")
            assert sample(client.get("/metrics").text, "kv_router_registry_writes_owed") == 0.0
            assert known(client) == {2: None, 3: "http://w3"}
    finally:
        server.stop()


def test_a_nats_server_back_with_an_empty_store_gets_the_registry_again_and_every_entry_of_it_is_learned() -> None:
    """The bucket used to be gone for good (registrations failing at once with a 500); once another
    process made it again, the router's watch went on at its old revision + 1, skipping every entry
    of the new bucket below it."""
    with EmbeddedNats() as server, LossyNatsProxy(server.port) as proxy, service(proxy.url) as client:
        for worker_id in (1, 2):
            assert client.post("/v1/workers", json={"worker_id": worker_id}).status_code == 201
        for worker_id in (7, 8):  # learned, not owned: put back by whoever owns them
            put_elsewhere(server.url, worker_id)
        until(lambda: set(known(client)) == {1, 2, 7, 8}, 10, "the router learns 7 and 8")

        server.stop()  # its store goes with it: JetStream starts empty
        until(lambda: plane_state(client) == "disconnected", 10, "the router sees NATS gone")
        server.start()
        until(lambda: registry(server.url) == {1: None, 2: None}, 10, "the router made the bucket again")
        assert client.post("/v1/workers", json={"worker_id": 3}).status_code == 201
        put_elsewhere(server.url, 51)  # revision 4 of the new bucket: not past the 4 the router had seen
        until(lambda: 51 in known(client), 10, "the router learns a registration made after")
        assert registry(server.url) == {1: None, 2: None, 3: None, 51: "http://elsewhere/51"}

        # Again, and another process makes the bucket and registers a worker before the router is back.
        proxy.refusing = True
        server.stop()
        until(lambda: plane_state(client) == "disconnected", 10, "the router sees NATS gone")
        server.start()
        put_elsewhere(server.url, 60)  # revision 1
        put_elsewhere(server.url, 2)  # worker 2 registered anew elsewhere: newer than this router's copy
        proxy.refusing = False
        until(lambda: 60 in known(client), 10, "the router learns a registration made before it was back")
        expected = {60: "http://elsewhere/60", 2: "http://elsewhere/2", 1: None, 3: None}
        until(lambda: registry(server.url) == expected, 10, "the router's registrations are put back")
        # Put back only where the bucket had none: the newer registration of worker 2 stands, here too.
        until(lambda: known(client).get(2) == "http://elsewhere/2", 10, "the router learns the newer worker 2")
        assert set(known(client)) == {1, 2, 3, 7, 8, 51, 60}

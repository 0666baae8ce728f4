"""The HTTP service with its NATS event plane: workers publish, the service routes by what they hold."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from api.app import create_app
from api.config import EventPlaneConfig, ServiceConfig, Settings
from indexer.hashing import compute_block_hashes, compute_sequence_hashes
from router.config import RouterConfig
from router.event_plane.connection import NatsOptions, connect
from router.event_plane.embedded_server import EmbeddedNats, free_port
from router.event_plane.publisher import KvEventPublisher, open_registry
from router.event_plane.subjects import Subjects
from router.types import WorkerConfig
from tests.router_processes import RouterProcess
from tests.test_api_support import metric
from tests.waiting import accepting, until

T = TypeVar("T")
BLOCK = 16


def blocks_of(tokens: list[int]) -> list[tuple[int, int]]:
    local = compute_block_hashes(tokens, BLOCK)
    return list(zip(compute_sequence_hashes(local), local, strict=True))


class Workers:
    """Worker publishers living on their own event loop in a thread, as engine processes would,
    so they answer the service's resync requests while the test talks HTTP."""

    def __init__(self, url: str, token: str | None = None) -> None:
        self.url = url
        self.token = token
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.publishers: list[KvEventPublisher] = []

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)

    def start(self, worker_id: int, tokens: list[int], **registration: Any) -> None:
        async def run() -> None:
            nc = await connect(NatsOptions(self.url, token=self.token))
            publisher = KvEventPublisher(nc, WorkerConfig(worker_id=worker_id, block_size=BLOCK, **registration))
            await publisher.start()
            await publisher.stored(blocks_of(tokens))
            self.publishers.append(publisher)

        self.call(run())

    def close(self) -> None:
        async def run() -> None:
            for publisher in self.publishers:
                await publisher.stop()
                await publisher.nc.close()

        self.call(run())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture
def workers(nats_url: str) -> Iterator[Workers]:
    pool = Workers(nats_url)
    yield pool
    pool.close()


def registry_keys(url: str) -> set[str]:
    async def run() -> set[str]:
        nc = await connect(NatsOptions(url))
        try:
            registry = await open_registry(nc, Subjects())
            try:
                return set(await registry.keys())
            except Exception:  # nats-py raises NoKeysError for an empty bucket
                return set()
        finally:
            await nc.close()

    return asyncio.run(run())


@pytest.fixture
def nats_url(nats_server: EmbeddedNats) -> str:
    return nats_server.url


@contextmanager
def service(nats_url: str) -> Iterator[TestClient]:
    """The HTTP service on ``nats_url``, once its event plane (connecting in the background) has started."""
    settings = Settings(
        service=ServiceConfig(),
        router=RouterConfig(block_size=BLOCK),
        event_plane=EventPlaneConfig(nats_url=nats_url, worker_lease_secs=30),
    )
    app = create_app(settings, registry=CollectorRegistry(), rng=random.Random(0))
    with TestClient(app, base_url="http://127.0.0.1") as test_client:
        until(lambda: test_client.get("/readyz").status_code == 200, 20, "the event plane starts")
        yield test_client


@pytest.fixture
def client(nats_url: str) -> Iterator[TestClient]:
    with service(nats_url) as test_client:
        yield test_client


def test_published_prefix_routes_the_request_over_http(client: TestClient, workers: Workers) -> None:
    rng = random.Random(3)
    prompt = [rng.randrange(50_000) for _ in range(10 * BLOCK)]
    workers.start(2**64 - 9, prompt[: 7 * BLOCK])
    workers.start(12, [rng.randrange(50_000) for _ in range(4 * BLOCK)])

    def streams_trusted() -> bool:
        workers = client.get("/v1/workers").json()["workers"]
        return len(workers) == 2 and all(s["trusted"] for w in workers for s in w["event_streams"])

    until(streams_trusted)
    reply = client.post("/v1/new", json={"tokens": prompt, "request_id": "r-1"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert (body["worker_id"], body["overlap_blocks"], body["cached_tokens"]) == (2**64 - 9, 7, 7 * BLOCK)
    worker = client.get(f"/v1/workers/{2**64 - 9}").json()
    [stream] = worker["event_streams"]
    assert 0 <= stream.pop("last_event_age_s") < 60
    assert stream == {"worker_id": 2**64 - 9, "dp_rank": 0, "last_event_id": 1, "trusted": True, "resyncing": False,
                      "unreconciled_events": 0}  # fmt: skip
    metrics = client.get("/metrics").text
    assert f'kv_router_worker_stream_trusted{{dp_rank="0",worker_id="{2**64 - 9}"}} 1.0' in metrics
    assert 'kv_router_nats_control_messages_total{outcome="registered"}' in metrics
    assert "kv_router_nats_connected 1.0" in metrics


def test_a_worker_registered_without_kv_events_is_predicted_from_what_is_routed_to_it(
    client: TestClient, nats_url: str, workers: Workers
) -> None:
    async def register() -> None:
        nc = await connect(NatsOptions(nats_url))
        publisher = KvEventPublisher(nc, WorkerConfig(worker_id=5, block_size=BLOCK, kv_events=False))
        await publisher.start()  # registered and leased, and no event ever
        workers.publishers.append(publisher)

    workers.call(register())
    until(lambda: len(client.get("/v1/workers").json()["workers"]) == 1)
    prompt = list(range(4 * BLOCK))
    assert client.post("/v1/new", json={"tokens": prompt}).json()["overlap_blocks"] == 0
    again = client.post("/v1/new", json={"tokens": prompt}).json()
    assert (again["worker_id"], again["overlap_blocks"], again["cached_tokens"]) == (5, 4, 4 * BLOCK)
    assert client.get("/v1/workers/5").json()["event_streams"] == []  # nothing waits for its events
    assert 'kv_router_worker_predicted_blocks{dp_rank="0",worker_id="5"} 4.0' in client.get("/metrics").text


def test_http_registration_goes_through_the_shared_registry(
    client: TestClient, nats_url: str, workers: Workers, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="router.kv_router")
    assert client.post("/v1/workers", json={"worker_id": 77, "total_kv_blocks": 100}).status_code == 201
    assert registry_keys(nats_url) == {"77"}
    # A worker registering over NATS after it: the registry watch is ordered, so once 78 is known the
    # bucket's echo of 77's HTTP registration has been seen too, and must not count a second time.
    workers.start(78, [])
    until(lambda: len(client.get("/v1/workers").json()["workers"]) == 2)
    assert metric(client, "kv_router_nats_control_messages_total", outcome="registered") == 2
    assert client.post("/v1/workers", json={"worker_id": 77, "total_kv_blocks": 200}).status_code == 200
    until(lambda: metric(client, "kv_router_nats_control_messages_total", outcome="updated") == 1)
    assert [w["config"]["worker_id"] for w in client.get("/v1/workers").json()["workers"]] == [77, 78]
    assert client.delete("/v1/workers/77").status_code == 200
    assert registry_keys(nats_url) == {"78"}
    assert [w["config"]["worker_id"] for w in client.get("/v1/workers").json()["workers"]] == [78]
    assert metric(client, "kv_router_nats_control_messages_total", outcome="registered") == 2
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "router.kv_router"]
    assert ("INFO", "worker 77 joined: dp ranks 0..0, 100 KV blocks per rank") in lines
    assert ("INFO", "worker 78 joined: dp ranks 0..0, unknown KV blocks per rank") in lines
    assert ("INFO", "worker 77 reconfigured") in lines
    assert ("INFO", "worker 77 left: 0 active requests dropped") in lines
    assert sum(message.startswith("worker 77 joined") for _, message in lines) == 1


def test_a_registration_refused_on_the_event_plane_is_a_doctor_problem(client: TestClient, nats_url: str) -> None:
    async def register_with_another_block_size() -> None:
        nc = await connect(NatsOptions(nats_url))
        publisher = KvEventPublisher(nc, WorkerConfig(worker_id=41, block_size=4 * BLOCK))
        await publisher.start()
        await asyncio.wait_for(publisher.refused.wait(), timeout=30)
        await publisher.stop()
        await nc.close()

    asyncio.run(register_with_another_block_size())
    [problem] = client.get("/v1/doctor").json()
    assert (problem["kind"], problem["worker_id"]) == ("block_size_mismatch", 41)
    assert problem["evidence"] == "registration refused: worker 41 uses block size 64, router 16"


def test_the_resync_retry_setting_reaches_the_sequencer(nats_url: str) -> None:
    settings = Settings(event_plane=EventPlaneConfig(nats_url=nats_url, resync_retry_secs=7.0))
    app = create_app(settings, registry=CollectorRegistry())
    assert app.kv_router.sequencer.retry_interval_s == 7.0


def test_garbage_events_are_counted_not_fatal(client: TestClient, nats_url: str) -> None:
    async def garbage() -> None:
        nc = await connect(NatsOptions(nats_url))
        await nc.publish("kv.default.events.5", b"\x00\x01 not an event")
        await nc.flush()
        await nc.close()

    asyncio.run(garbage())
    until(lambda: 'kv_router_stream_events_total{outcome="rejected_undecodable"} 1.0' in client.get("/metrics").text)
    assert client.get("/healthz").status_code == 200


def test_serve_without_a_nats_url_brings_its_own_server(tmp_path: Path) -> None:
    nats_port = free_port()
    connection = tmp_path / "kv-router" / f"nats-{nats_port}.json"
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}  # where it leaves the token for local workers
    with RouterProcess(
        tmp_path, "--embedded-nats-port", str(nats_port), "--block-size", str(BLOCK), env=env
    ) as service:
        until(lambda: accepting(nats_port) and connection.exists(), 30, "the embedded NATS and its connection file")
        rng = random.Random(5)
        prompt = [rng.randrange(50_000) for _ in range(4 * BLOCK)]
        pool = Workers(f"nats://127.0.0.1:{nats_port}", json.loads(connection.read_text())["token"])
        pool.start(31, prompt)

        def routed() -> bool:
            request = json.dumps({"tokens": prompt}).encode()
            reply = _http(service.port, "/v1/new", request)
            return reply.get("overlap_blocks") == 4

        until(routed, timeout=20)
        assert _http(service.port, "/v1/new", json.dumps({"tokens": prompt}).encode())["worker_id"] == 31
        pool.close()
    assert f"nats://127.0.0.1:{nats_port}" in service.log()  # the URL workers should use is printed
    assert not accepting(nats_port)  # and the private server is gone with the service


def _http(port: int, path: str, body: bytes) -> dict[str, Any]:
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", body, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return dict(msgspec.json.decode(reply.read()))
    except urllib.error.HTTPError as error:
        return dict(msgspec.json.decode(error.read()))


def test_http_registration_of_another_block_size_is_refused_before_the_registry(
    client: TestClient, nats_url: str
) -> None:
    """With NATS, a registration naming another block size is a 409, not a 201 then a silent refusal:
    nothing reaches the shared registry or the router, for a new worker or a registered one."""
    refused = client.post("/v1/workers", json={"worker_id": 5, "block_size": 2 * BLOCK})
    assert refused.status_code == 409 and refused.json()["error"]["type"] == "block_size_mismatch"
    assert refused.json()["error"]["detail"]["router_block_size"] == BLOCK
    assert registry_keys(nats_url) == set()
    assert client.get("/v1/workers").json()["workers"] == []
    assert client.post("/v1/workers", json={"worker_id": 6}).status_code == 201
    assert client.post("/v1/workers", json={"worker_id": 6, "block_size": 2 * BLOCK}).status_code == 409
    [worker] = client.get("/v1/workers").json()["workers"]
    assert worker["config"]["block_size"] == BLOCK


def test_http_registration_of_another_block_size_is_refused_while_nats_connects() -> None:
    """While the event plane is still connecting, a registration is kept for the registry: one of
    another block size is refused (409) rather than registered with the wrong size."""
    settings = Settings(
        service=ServiceConfig(),
        router=RouterConfig(block_size=BLOCK),
        event_plane=EventPlaneConfig(nats_url=f"nats://127.0.0.1:{free_port()}"),
    )
    app = create_app(settings, registry=CollectorRegistry(), rng=random.Random(0))
    with TestClient(app, base_url="http://127.0.0.1") as test_client:
        assert test_client.get("/readyz").json()["event_plane"]["state"] == "connecting"
        refused = test_client.post("/v1/workers", json={"worker_id": 5, "block_size": 2 * BLOCK})
        assert refused.status_code == 409 and refused.json()["error"]["type"] == "block_size_mismatch"
        assert test_client.get("/v1/workers").json()["workers"] == []
        assert test_client.post("/v1/workers", json={"worker_id": 5, "block_size": BLOCK}).status_code == 201


def test_an_event_after_a_gap_refused_for_now_is_counted_held_with_its_reason(client: TestClient) -> None:
    """With NATS the resync of a gap is asked of the worker: an event after the gap that the index
    refuses is held (not applied, rejected or duplicate), with a reason, so the counts add up to
    ``received``; when nobody answers the resync it is counted rejected."""
    assert client.post("/v1/workers", json={"worker_id": 2}).status_code == 201

    def removal(event_id: int) -> dict[str, Any]:
        return {"worker_id": 2, "event": {"event_id": event_id, "data": {"removed": {"block_hashes": [1]}}}}

    in_order = client.post("/v1/events", json=removal(1)).json()
    assert (in_order["received"], in_order["rejected"], in_order["held"]) == (1, 1, 0)
    rejected = metric(client, "kv_router_stream_events_total", outcome="rejected_block_not_found")
    after_gap = client.post("/v1/events", json=removal(50)).json()
    counts = [after_gap[name] for name in ("applied", "rejected", "duplicate", "held")]
    assert (after_gap["received"], counts) == (1, [0, 0, 0, 1])
    [reason] = after_gap["errors"]
    assert reason.startswith("worker 2 event 50: held: ") and "hole" in reason
    # Nobody serves worker 2's resyncs: the stream gives up on the gap and the held event is rejected.
    until(lambda: metric(client, "kv_router_stream_events_total", outcome="rejected_block_not_found") == rejected + 1)


def test_a_worker_registered_while_nats_connects_reaches_the_registry_at_the_block_size_adopted_since(
    nats_url: str,
) -> None:
    """--block-size auto: a worker registered over HTTP while NATS is unreachable, then the engines'
    block size adopted: when NATS comes, the plane starts and the registry holds the worker at the
    adopted size (the registration kept from before used to be refused, and the plane's start with it,
    again and again)."""
    from api.plane_lifecycle import PlaneLifecycle
    from router.engines.direct import AdoptedBlockSize
    from router.kv_router import KvRouter

    async def scenario() -> tuple[bool, list[tuple[int, int | None]], WorkerConfig]:
        router = KvRouter(RouterConfig(block_size=BLOCK))
        adopting = AdoptedBlockSize(router)
        life = PlaneLifecycle(router, EventPlaneConfig(nats_url=nats_url))
        await life.register(WorkerConfig(worker_id=2, block_size=BLOCK))
        adopting.for_engine("tcp://127.0.0.1:5557")(2 * BLOCK)  # the first engine's stored event
        running = asyncio.ensure_future(life.run())
        started = asyncio.ensure_future(life.started())
        try:
            await asyncio.wait({running, started}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
            if running.done():
                running.result()  # what stopped the plane's start
            assert started.done(), "the plane did not start within 10 s"
            nc = await connect(NatsOptions(url=nats_url))
            registry = await open_registry(nc, Subjects("default"))
            shared = msgspec.json.decode((await registry.get("2")).value, type=WorkerConfig)
            await nc.close()
            ready = life.ready
        finally:
            running.cancel()
            started.cancel()
            await asyncio.gather(running, started, return_exceptions=True)
            await life.stop()
        return ready, [(w.worker_id, w.block_size) for w in router.workers()], shared

    ready, held, shared = asyncio.run(scenario())
    assert ready and held == [(2, 2 * BLOCK)]
    assert shared.block_size == 2 * BLOCK


def test_under_block_size_auto_an_adoption_refused_is_tried_again_by_the_next_engine() -> None:
    """Blocks indexed at the placeholder (events posted over HTTP) refuse the first engine's size; once
    they are gone the next engine's first store decides (the refused engine used to be recorded as the
    deciding one, so the router stayed on the placeholder for good). Requests booked meanwhile do not
    refuse it: they free whole after."""
    from router.engines.direct import AdoptedBlockSize
    from router.kv_router import KvRouter
    from router.types import RouteRequest
    from tests.dynamo_fleet import prompt_stored_event

    router = KvRouter(RouterConfig(block_size=BLOCK))  # the placeholder
    adopting = AdoptedBlockSize(router)
    router.register_worker(WorkerConfig(worker_id=1))
    router.register_worker(WorkerConfig(worker_id=2))
    router.apply_event(prompt_stored_event(1, list(range(64)), BLOCK))
    asyncio.run(router.new(RouteRequest(tokens=list(range(100, 200)), request_id="booked"), among={2}))
    assert adopting.for_engine("tcp://127.0.0.1:5557")(2 * BLOCK) == BLOCK  # blocks indexed at 16
    router.remove_worker(1)
    assert adopting.for_engine("tcp://127.0.0.1:5567")(2 * BLOCK) == 2 * BLOCK
    assert (router.config.block_size, adopting.decided_by) == (2 * BLOCK, "tcp://127.0.0.1:5567")
    assert router.mark_free("booked")
    assert [load.active_requests for load in router.rank_loads()] == [0]


def test_under_block_size_auto_a_worker_takes_the_adopted_size_and_one_naming_another_is_refused() -> None:
    """Until the engines' block size is adopted the router's is a placeholder, checked as the registry's
    watch checks it: a worker naming none or that one is registered and takes the adopted size; one
    naming another is refused before and after (a worker refused over HTTP but written to the registry
    was lost for good)."""
    from router.engines.direct import AdoptedBlockSize
    from router.errors import BlockSizeMismatch
    from router.kv_router import KvRouter

    router = KvRouter(RouterConfig(block_size=BLOCK))  # the placeholder
    adopting = AdoptedBlockSize(router)
    router.register_worker(WorkerConfig(worker_id=1, block_size=BLOCK))
    router.register_worker(WorkerConfig(worker_id=2))
    with pytest.raises(BlockSizeMismatch):
        router.register_worker(WorkerConfig(worker_id=3, block_size=2 * BLOCK))
    adopting.for_engine("tcp://127.0.0.1:5557")(2 * BLOCK)
    assert router.config.block_size == 2 * BLOCK
    assert [(w.worker_id, w.block_size) for w in router.workers()] == [(1, 2 * BLOCK), (2, None)]
    with pytest.raises(BlockSizeMismatch):
        router.register_worker(WorkerConfig(worker_id=3, block_size=BLOCK))

"""The whole chain over real sockets: fake vLLM engine (ZMQ PUB + replay ROUTER) -> `kv-router bridge`
-> real nats-server -> the router service; and mock engine -> bridge -> NATS -> router as processes.

After gaps, engine restarts, clears, garbage and a bridge restart, the router's ``/v1/dump`` equals
what the engine holds; a gap nobody can replay leaves the rank untrusted in ``/v1/workers``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import pytest
import zmq
from fastapi.testclient import TestClient
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from api.app import create_app
from api.bridge_command import load_bridge_config
from api.bridge_metrics import bridge_registry, serve_metrics
from api.config import EventPlaneConfig, Settings
from indexer.events import RouterEvent
from mocker.wire import GenerateRequest, GenerateUpdate, generate_subject
from router.config import RouterConfig
from router.engines.bridge import Bridge
from router.engines.bridge_config import BridgeConfig
from router.engines.engine_spec import rank_endpoint
from router.engines.openai_server import ENGINE_FAILURES_TO_DOWN
from router.errors import ConfigError
from router.event_plane.connection import NatsOptions, connect
from router.event_plane.embedded_server import EmbeddedNats, free_port
from router.event_plane.jetstream import JetStreamUnavailable
from tests.engine_fakes import (
    BLOCK,
    EngineHttp,
    FakeEngine,
    SideLoop,
    canonical,
    free_port_run,
    loopback_endpoints,
    offloaded_batch,
)
from tests.metrics import label_names, sample, total
from tests.router_processes import ToolProcess, kv_router_command
from tests.test_deploy_observability import BRIDGE_PREFIX, TARGET_LABELS, alert_rules, dashboard_queries, selectors
from tests.waiting import until

WORKER = 41
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def side() -> Iterator[SideLoop]:
    loop = SideLoop()
    yield loop
    loop.close()


@pytest.fixture
def router(nats_server: EmbeddedNats) -> Iterator[TestClient]:
    settings = Settings(
        router=RouterConfig(block_size=BLOCK),
        event_plane=EventPlaneConfig(nats_url=nats_server.url, worker_lease_secs=30, resync_timeout_secs=5),
    )
    app = create_app(settings, registry=CollectorRegistry(), rng=random.Random(0))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        yield client


def _dump(client: TestClient) -> list[Any]:
    events = msgspec.json.decode(client.get("/v1/dump").content, type=list[RouterEvent])
    return canonical(events)


def _worker(client: TestClient) -> dict[str, Any]:
    reply = client.get(f"/v1/workers/{WORKER}")
    return reply.json() if reply.status_code == 200 else {"config": {}, "ranks": [{}]}


def _streams(client: TestClient) -> list[dict[str, Any]]:
    reply = client.get(f"/v1/workers/{WORKER}")
    return reply.json()["event_streams"] if reply.status_code == 200 else []


class Chain:
    def __init__(self, side: SideLoop, nats_url: str, *, replay: bool = True) -> None:
        self.side = side
        self.nats_url = nats_url
        self.endpoint, self.replay = loopback_endpoints(replay)
        self.engine = FakeEngine(WORKER, self.endpoint, self.replay, seed=21)
        self.bridge: Bridge | None = None
        self.metrics_server: asyncio.Server | None = None
        side.call(self.engine.start())

    def start_bridge(self, **settings: Any) -> None:
        async def run() -> Bridge:
            nc = await connect(NatsOptions(self.nats_url))
            config = BridgeConfig(worker_id=WORKER, zmq_endpoint=self.endpoint, replay_endpoint=self.replay,
                                  heartbeat_interval_secs=0.2,
                                  **{"block_size": BLOCK, "total_kv_blocks": 1000, **settings})  # fmt: skip
            bridge = Bridge(config, nc)
            await bridge.start()
            return bridge

        self.bridge = self.side.call(run())
        self.metrics_server = self.side.call(serve_metrics(bridge_registry(self.bridge), "127.0.0.1", 0))

    def metrics(self) -> str:
        """The bridge's /metrics, scraped over HTTP as Prometheus does."""
        assert self.metrics_server is not None
        port = self.metrics_server.sockets[0].getsockname()[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            return str(reply.read().decode())

    def stop_bridge(self, *, deregister: bool = True) -> None:
        bridge, self.bridge = self.bridge, None
        server, self.metrics_server = self.metrics_server, None

        async def run() -> None:  # on the bridge's loop: an asyncio server is not closed from another thread
            if server is not None:
                server.close()
                await server.wait_closed()
            if bridge is not None:
                await bridge.stop(deregister=deregister)
                await bridge.nc.close()

        self.side.call(run())

    def steps(self, count: int, *, drop_every: int = 0) -> None:
        for i in range(count):
            self.side.call(self.engine.step(publish=not drop_every or i % drop_every != drop_every - 1))
            time.sleep(0.002)  # an engine's steps come over time (the bridge's stream shows no applied seq to wait on)

    def close(self) -> None:
        self.stop_bridge()
        self.side.call(self.engine.stop())


def _converged(client: TestClient, chain: Chain) -> None:
    until(lambda: _dump(client) == chain.engine.dump() and all(s["trusted"] for s in _streams(client)), timeout=20)


def test_gaps_restarts_clears_and_a_bridge_restart_leave_the_router_holding_what_the_engine_holds(
    router: TestClient, side: SideLoop, nats_server: EmbeddedNats
) -> None:
    chain = Chain(side, nats_server.url)
    try:
        chain.start_bridge()
        until(lambda: router.get(f"/v1/workers/{WORKER}").status_code == 200)
        config = router.get(f"/v1/workers/{WORKER}").json()["config"]
        assert (config["block_size"], config["total_kv_blocks"]) == (BLOCK, 1000)
        chain.steps(40, drop_every=6)  # batches lost on the PUB socket: replayed
        side.call(chain.engine.send_raw(b"\x93garbage"))
        chain.steps(5)
        _converged(router, chain)
        assert chain.engine.dump()
        stats = chain.bridge.streams[0].stats if chain.bridge else None
        assert stats is not None and stats["replayed"] >= 6 and stats["rejected_bad_envelope"] == 1

        chain.engine.restart()  # a new engine process: seq 0 again, empty cache
        chain.steps(20)
        _converged(router, chain)
        assert chain.bridge is not None and chain.bridge.streams[0].stats["restarts"] == 1

        side.call(chain.engine.send([chain.engine.cleared()]))
        chain.steps(10)
        _converged(router, chain)

        # The bridge dies without deregistering (as on kill -9) while the engine goes on; a new one
        # replays the engine's buffer and routers resync from it.
        chain.stop_bridge(deregister=False)
        chain.steps(10)
        chain.start_bridge()
        chain.steps(5)
        _converged(router, chain)
    finally:
        chain.close()


def test_an_engine_restarted_on_the_same_ports_and_quiet_reaches_the_router_through_the_bridge(
    router: TestClient, side: SideLoop, nats_server: EmbeddedNats
) -> None:
    """The new process's first batches go out before the bridge's SUB socket reconnects (ZMQ drops
    them) and nothing follows: the bridge's tail check after the reconnection finds the restart in the
    replay socket, and the router ends up with exactly the new process's blocks."""
    chain = Chain(side, nats_server.url)
    try:
        chain.start_bridge()
        chain.steps(10)
        _converged(router, chain)
        assert chain.engine.dump()
        side.call(chain.engine.stop())  # the process ends: its PUB and replay sockets close
        chain.engine = FakeEngine(WORKER, chain.endpoint, chain.replay, seed=22)
        side.call(chain.engine.start())
        chain.steps(2)  # published at once, before the SUB socket reconnected
        _converged(router, chain)
        assert chain.bridge is not None and chain.bridge.streams[0].stats["restarts"] == 1
    finally:
        chain.close()


def test_a_gap_without_replay_leaves_the_rank_untrusted_until_the_engine_clears(
    router: TestClient, side: SideLoop, nats_server: EmbeddedNats
) -> None:
    chain = Chain(side, nats_server.url, replay=False)
    try:
        chain.start_bridge()
        until(lambda: router.get(f"/v1/workers/{WORKER}").status_code == 200)
        # Past the slow-joiner window: a PUB socket shows no subscriber to wait on, so clears (which
        # change nothing the engine holds) go out until the bridge applies one. One lost before the
        # bridge joined is a gap with no replay; the clear it then applies makes the rank trusted again.
        stream = chain.bridge.streams[0] if chain.bridge else None
        assert stream is not None

        def heard() -> bool:
            side.call(chain.engine.send([chain.engine.cleared()]))
            return stream.stats["applied"] > 0

        until(heard, 30, "the bridge hears the engine")
        chain.steps(5)
        _converged(router, chain)
        side.call(chain.engine.step(publish=False))
        chain.steps(3)
        until(lambda: _streams(router) and not _streams(router)[0]["trusted"], timeout=20)
        metrics = router.get("/metrics").text
        assert f'kv_router_worker_stream_trusted{{dp_rank="0",worker_id="{WORKER}"}} 0.0' in metrics
        # The bridge says so on its own /metrics: the rank it could not verify, the gap it counted.
        bridge_metrics = chain.metrics()
        assert sample(bridge_metrics, "kv_router_bridge_rank_unverified", dp_rank="0") == 1
        for outcome in ("gap", "unverified"):
            assert total(bridge_metrics, "kv_router_engine_stream_messages_total", outcome=outcome) >= 1
        side.call(chain.engine.send([chain.engine.cleared()]))
        chain.steps(3)
        _converged(router, chain)
        assert sample(chain.metrics(), "kv_router_bridge_rank_unverified", dp_rank="0") == 0
    finally:
        chain.close()


def test_bridge_settings_come_from_flags_environment_and_file(tmp_path: Path) -> None:
    file = tmp_path / "bridge.toml"
    file.write_text('worker_id = 3\nzmq_endpoint = "tcp://127.0.0.1:5557"\nblock_size = 32\ndp_size = 2\n')
    env = {"KV_ROUTER_BRIDGE_BLOCK_SIZE": "64", "KV_ROUTER_BRIDGE_TAINTS": "gpu-a100,spot", "OTHER": "x"}
    config = load_bridge_config({"namespace": "prod"}, env, file)
    assert (config.worker_id, config.block_size, config.dp_size, config.namespace) == (3, 64, 2, "prod")
    assert config.registration().taints == frozenset({"gpu-a100", "spot"})
    assert config.registration().dp_ranks == range(2)
    assert rank_endpoint("tcp://127.0.0.1:5557", 1) == "tcp://127.0.0.1:5558"
    with pytest.raises(ConfigError, match="block_size"):
        load_bridge_config({"block_size": 0}, {}, file)
    with pytest.raises(ConfigError, match="overlap"):  # rank 1's events on the replay port
        load_bridge_config({"replay_endpoint": "tcp://127.0.0.1:5558"}, {}, file)
    with pytest.raises(ConfigError, match="unknown setting"):
        (tmp_path / "bad.json").write_text('{"worker": 1}')
        load_bridge_config({}, {}, tmp_path / "bad.json")


def test_the_bridge_openai_url_is_the_engine_server_root_behind_a_prefix_or_not_never_an_endpoint() -> None:
    """``--openai-url`` is the engine's server root, with or without /v1, behind an ingress's path prefix
    or not; an endpoint's URL is refused naming the option (it was taken, and registered as the worker's
    URL: the proxy posted to /v1/completions/v1/completions)."""
    base = {"worker_id": 3, "zmq_endpoint": "tcp://127.0.0.1:5557"}
    for url in ("http://gw/engine-a/v1", "http://gw/engine-a", "http://gw/engine-a/v1/"):
        config = load_bridge_config({**base, "openai_url": url}, {})
        assert config.openai_base == config.registration().url == "http://gw/engine-a"
        assert config.health_url == "http://gw/engine-a/health"
    for url in ("http://127.0.0.1:8000/v1/completions", "http://gw/engine-a/v1/chat/completions"):
        with pytest.raises(ConfigError) as refused:
            load_bridge_config({**base, "openai_url": url}, {})
        assert refused.value.field == "openai_url"
        message = str(refused.value)
        assert message.startswith("openai_url: ") and message.endswith("(from flag --openai-url)")
        assert "goes on past /v1" in message and "give the engine's OpenAI server root" in message
        assert "with or without /v1" in message
    with pytest.raises(ConfigError, match=r"openai_url: .*goes on past /v1 .*\(from environment variable "):
        load_bridge_config(base, {"KV_ROUTER_BRIDGE_OPENAI_URL": "http://h:8000/v1/models"})


@pytest.mark.slow
def test_mock_engine_to_bridge_to_nats_to_router_as_processes(
    router: TestClient, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    zmq, replay = loopback_endpoints(replay=True)
    assert replay is not None
    worker = ToolProcess(tmp_path, None, "--nats-url", nats_server.url, "--worker-id", str(WORKER),
                         "--zmq-endpoint", zmq, "--replay-endpoint", replay, "--block-size", str(BLOCK),
                         "--engine-speedup", "100")  # fmt: skip
    bridge = ToolProcess(tmp_path, None, "--worker-id", str(WORKER), "--zmq-endpoint", zmq,
                         "--replay-endpoint", replay, "--block-size", str(BLOCK), "--nats-url", nats_server.url,
                         "--metrics-port", "0", command="bridge")  # fmt: skip
    try:
        until(lambda: router.get(f"/v1/workers/{WORKER}").status_code == 200, timeout=30)
        prompt = [random.Random(1).randrange(50_000) for _ in range(12 * BLOCK)]

        async def generate() -> GenerateUpdate:
            nc = await connect(NatsOptions(nats_server.url))
            try:
                inbox = nc.new_inbox()
                done: asyncio.Future[GenerateUpdate] = asyncio.get_running_loop().create_future()

                async def on_update(message: Any) -> None:
                    update = msgspec.msgpack.decode(message.data, type=GenerateUpdate)
                    if update.kind == "done" and not done.done():
                        done.set_result(update)

                await nc.subscribe(inbox, cb=on_update)
                # The bridge may register the worker before the mock engine listens: ask until it answers.
                for attempt in range(20):
                    request = GenerateRequest(
                        request_id=f"r-{attempt}", tokens=array("I", prompt).tobytes(), max_tokens=4, reply=inbox
                    )
                    await nc.publish(generate_subject("default", WORKER), msgspec.msgpack.encode(request))
                    with contextlib.suppress(TimeoutError):
                        return await asyncio.wait_for(asyncio.shield(done), timeout=1.5)
                raise AssertionError("the mock engine never answered")
            finally:
                await nc.close()

        asyncio.run(generate())

        def prompt_cached() -> bool:
            rows = router.post("/v1/overlap", json={"tokens": prompt}).json()["workers"]
            return any(row["worker_id"] == WORKER and row["device_blocks"] == 12 for row in rows)

        until(prompt_cached, timeout=20)
        assert all(s["trusted"] for s in _streams(router))

        # The bridge's own /metrics (the port it printed): what it published is what the router applied.
        url = re.search(r"metrics on (http://\S+/metrics)", bridge.log())
        assert url is not None, bridge.log()

        def scrape(target: str = url.group(1)) -> str:
            with urllib.request.urlopen(target, timeout=5) as reply:
                assert reply.headers["content-type"] == CONTENT_TYPE_LATEST
                return str(reply.read().decode())

        until(lambda: sample(scrape(), "kv_router_bridge_last_event_id", dp_rank="0") == _streams(router)[0][
            "last_event_id"], 20, "the router applied every event the bridge published")  # fmt: skip
        metrics = scrape()
        assert sample(metrics, "kv_router_bridge_nats_connected") == 1
        assert sample(metrics, "kv_router_bridge_engine_up") is None  # no health URL: nothing probed, no 1
        assert total(metrics, "kv_router_engine_stream_messages_total", endpoint=zmq, outcome="applied") >= 1
        with pytest.raises(urllib.error.HTTPError, match="404"):
            scrape(url.group(1).removesuffix("/metrics") + "/v1/workers")
        assert bridge.stop() == 0, bridge.log()  # SIGTERM: the metrics port closes with the bridge
    finally:
        bridge.stop()
        worker.stop()


def test_a_bridge_whose_metrics_port_is_taken_says_so_and_exits_2(nats_server: EmbeddedNats) -> None:
    zmq, _ = loopback_endpoints(replay=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([*kv_router_command(), "bridge", "--worker-id", str(WORKER), "--zmq-endpoint", zmq,
                               "--nats-url", nats_server.url, "--metrics-port", str(port)],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2, done.stderr
    said = f"--metrics-port: [Errno 98] error while attempting to bind on address ('127.0.0.1', {port})"
    assert f"kv-router bridge: {said}" in done.stderr


@contextlib.contextmanager
def _probed_bridge(
    router: TestClient, side: SideLoop, nats_server: EmbeddedNats, steps: int
) -> Iterator[tuple[EngineHttp, Chain]]:
    """A bridge probing its engine's metrics every 0.1 s, registered and converged after ``steps``."""
    http = side.call(EngineHttp().start())
    chain = Chain(side, nats_server.url)
    try:
        chain.start_bridge(engine_metrics_url=f"{http.url}/metrics", engine_health_interval_secs=0.1)
        until(lambda: router.get(f"/v1/workers/{WORKER}").status_code == 200)
        chain.steps(steps)
        _converged(router, chain)
        yield http, chain
    finally:
        chain.close()
        side.call(http.stop())


def test_a_bridge_withdraws_its_worker_while_the_engine_metrics_do_not_answer_and_rebuilds_it_after(
    router: TestClient, side: SideLoop, nats_server: EmbeddedNats
) -> None:
    with _probed_bridge(router, side, nats_server, 20) as (http, chain):
        assert chain.engine.dump()

        assert sample(chain.metrics(), "kv_router_bridge_engine_up") == 1
        http.healthy = False  # its metrics endpoint answers 503: the bridge takes the worker out
        until(lambda: router.get(f"/v1/workers/{WORKER}").status_code == 404, 30, "the worker is withdrawn")
        assert _dump(router) == []
        withdrawn = chain.metrics()
        assert sample(withdrawn, "kv_router_bridge_engine_up") == 0
        assert total(withdrawn, "kv_router_bridge_engine_probes_total", outcome="failed") >= ENGINE_FAILURES_TO_DOWN
        chain.steps(5)  # published meanwhile, to no router
        # The behaviour under test: no heartbeat brings it back, over ten more of the bridge's probes
        # (1 s of its clock, five heartbeat intervals), counted rather than slept.
        probes = http.asked["/metrics"]
        until(lambda: http.asked["/metrics"] >= probes + 10, 30, "ten more probes of the engine")
        assert router.get(f"/v1/workers/{WORKER}").status_code == 404

        http.healthy = True  # the same engine process: what it holds comes back, from its replay buffer
        until(lambda: router.get(f"/v1/workers/{WORKER}").status_code == 200)
        _converged(router, chain)
        assert chain.bridge is not None and chain.bridge.streams[0].stats["rebuilds"] == 1
        assert sample(chain.metrics(), "kv_router_bridge_engine_up") == 1


def test_host_tier_stores_without_token_ids_reach_the_router_through_the_bridge_on_the_blocks_they_name(
    router: TestClient, side: SideLoop, nats_server: EmbeddedNats
) -> None:
    """vLLM's OffloadingConnector's token-less CPU stores: the bridge publishes the host tier for the
    device blocks the rank holds, counts the hash it never stored, and refuses nothing else."""
    chain = Chain(side, nats_server.url)
    try:
        chain.start_bridge()
        until(lambda: router.get(f"/v1/workers/{WORKER}").status_code == 200)
        chain.steps(3)
        tokens = list(range(1, 2 * BLOCK + 1))
        side.call(chain.engine.send_raw(offloaded_batch([11, 12], tokens, [11, 12, 99])))
        _converged(router, chain)
        host = [edge for edge in _dump(router) if edge[2] == "host_pinned"]
        assert {(parent, block) for _, _, _, parent, block, _ in host} == {(None, 11), (11, 12)}
        metrics = chain.metrics()
        assert total(metrics, "kv_router_bridge_events_refused_total") == 1
        assert sample(metrics, "kv_router_bridge_events_refused_total", reason="offloaded_unresolved") == 1
    finally:
        chain.close()


def test_a_bridge_whose_engine_stamps_a_rank_its_worker_lacks_says_so_once(
    router: TestClient, side: SideLoop, nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM run with --data-parallel-rank 1 stamps rank 1; a bridge of one rank registers rank 0, so
    routers refuse every event: the bridge's log says why at the rank's first batch, once."""
    chain = Chain(side, nats_server.url)
    try:
        chain.start_bridge()
        until(lambda: router.get(f"/v1/workers/{WORKER}").status_code == 200)
        stored = {"type": "BlockStored", "block_hashes": [41], "parent_block_hash": None, "medium": "GPU",
                  "token_ids": list(range(BLOCK)), "block_size": BLOCK, "lora_id": None}  # fmt: skip
        for block_hash in (41, 42):
            side.call(
                chain.engine.send_raw(msgspec.msgpack.encode([1.0, [{**stored, "block_hashes": [block_hash]}], 1]))
            )

        def said() -> list[str]:
            return [r.getMessage() for r in caplog.records if "under dp rank 1" in r.getMessage()]

        until(lambda: chain.bridge is not None and chain.bridge.publisher.last_event_ids().get(1) == 2)
        assert len(said()) == 1 and "registered with ranks 0..0" in said()[0] and "dp_start_rank" in said()[0]
        assert _dump(router) == []
    finally:
        chain.close()


def test_a_bridge_whose_registration_fails_as_its_engine_comes_back_registers_at_the_next_probe(
    router: TestClient, side: SideLoop, nats_server: EmbeddedNats
) -> None:
    """The engine answers again while NATS is having a hiccup: the registration times out. The bridge
    tries again at its next probe rather than leaving the worker withdrawn until the engine fails
    once more."""
    with _probed_bridge(router, side, nats_server, 10) as (http, chain):
        bridge = chain.bridge
        assert bridge is not None

        http.healthy = False
        until(lambda: router.get(f"/v1/workers/{WORKER}").status_code == 404, 30, "the worker is withdrawn")
        register = bridge.publisher.register
        attempts = []

        async def register_in_a_hiccup() -> None:  # what nats-py raises for a put that got no answer
            attempts.append(time.monotonic())
            if len(attempts) == 1:
                raise nats.errors.TimeoutError
            await register()

        bridge.publisher.register = register_in_a_hiccup  # type: ignore[method-assign]
        http.healthy = True
        until(lambda: router.get(f"/v1/workers/{WORKER}").status_code == 200, 30, "the worker registered again")
        _converged(router, chain)
        assert len(attempts) == 2
        assert sample(chain.metrics(), "kv_router_bridge_engine_up") == 1


def test_a_refused_worker_and_refused_events_show_on_the_bridges_metrics_as_its_alerts_read_them(
    router: TestClient, side: SideLoop, nats_server: EmbeddedNats
) -> None:
    """A bridge whose block size the routers refuse, and a store under a parent its engine never stored:
    only the bridge sees either (the router never routes to the worker, never hears the store), so its
    /metrics says both, under the names and labels deploy/prometheus/alerts.yaml's bridge rules read."""
    http = side.call(EngineHttp().start())
    chain = Chain(side, nats_server.url)
    try:
        chain.start_bridge(block_size=2 * BLOCK, engine_metrics_url=f"{http.url}/metrics")
        assert chain.bridge is not None
        side.call(asyncio.wait_for(chain.bridge.publisher.refused.wait(), 30))
        orphan = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": 99, "medium": "GPU",
                  "token_ids": list(range(2 * BLOCK)), "block_size": 2 * BLOCK, "lora_id": None}  # fmt: skip
        side.call(chain.engine.send_raw(msgspec.msgpack.encode([1700000000.5, [orphan], 0])))

        def events_refused() -> float:
            return total(chain.metrics(), "kv_router_bridge_events_refused_total")

        until(lambda: events_refused() == 1, 20, "the orphan store refused")
        metrics = chain.metrics()
        assert router.get(f"/v1/workers/{WORKER}").status_code == 404
        assert sample(metrics, "kv_router_bridge_worker_refused", router_block_size=str(BLOCK)) == 1
        assert sample(metrics, "kv_router_bridge_engine_up") == 1
        assert sample(metrics, "kv_router_bridge_nats_connected") == 1
        exposed = label_names(metrics)
        bridge_rules = [rule["expr"] for rule in alert_rules() if rule["alert"].startswith("KvRouterBridge")]
        assert len(bridge_rules) == 4
        read = set()
        for query in bridge_rules + dashboard_queries():
            for name, labels in selectors(query):
                if name.startswith(BRIDGE_PREFIX):
                    read.add(name)
                    assert name in exposed, f"{name} (in {query!r}) is not in the bridge's /metrics"
                    assert labels - TARGET_LABELS <= exposed[name], query
        assert read == {name for name in exposed if name.startswith(BRIDGE_PREFIX)}, "a bridge series nothing reads"
    finally:
        chain.close()
        side.call(http.stop())


def test_a_bridge_without_total_kv_blocks_registers_the_capacity_its_engine_states(
    router: TestClient, side: SideLoop, nats_server: EmbeddedNats
) -> None:
    """No ``--total-kv-blocks``: the bridge registers the KV blocks vLLM states on its /metrics, and
    publishes its usage in blocks of them."""
    http = side.call(EngineHttp(kv_blocks=640, kv_usage=0.5).start())
    chain = Chain(side, nats_server.url)
    try:
        chain.start_bridge(engine_metrics_url=f"{http.url}/metrics", total_kv_blocks=None)
        until(lambda: router.get(f"/v1/workers/{WORKER}").status_code == 200)
        until(lambda: _worker(router)["config"].get("total_kv_blocks") == 640, 20, "the stated capacity")
        until(lambda: _worker(router)["ranks"][0].get("kv_used_blocks") == 320, 20, "its usage in blocks")
    finally:
        chain.close()
        side.call(http.stop())


@contextlib.contextmanager
def _dp_bridge(
    router: TestClient, side: SideLoop, nats_url: str, *, silent_replay_rank: int | None = None
) -> Iterator[tuple[list[FakeEngine], Bridge]]:
    """An engine of two dp ranks (rank r on the event port + r and the replay port + r, as vLLM lays
    them out) and one bridge hearing both; ``silent_replay_rank``'s replay socket takes requests and
    never answers. Registered and joined on both ranks."""
    events, replay = free_port_run(2), free_port_run(2)
    engines = [
        FakeEngine(WORKER, f"tcp://127.0.0.1:{events + rank}",
                   None if rank == silent_replay_rank else f"tcp://127.0.0.1:{replay + rank}", seed=rank, dp_rank=rank)
        for rank in range(2)
    ]  # fmt: skip
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    if silent_replay_rank is not None:
        silent.bind(f"tcp://127.0.0.1:{replay + silent_replay_rank}")
    bridge = None
    try:
        for engine in engines:
            side.call(engine.start())

        async def start() -> Bridge:
            nc = await connect(NatsOptions(nats_url))
            config = BridgeConfig(worker_id=WORKER, zmq_endpoint=f"tcp://127.0.0.1:{events}",
                                  replay_endpoint=f"tcp://127.0.0.1:{replay}", dp_size=2, block_size=BLOCK,
                                  heartbeat_interval_secs=0.2)  # fmt: skip
            started = Bridge(config, nc)
            await started.start()
            return started

        bridge = side.call(start())
        until(lambda: router.get(f"/v1/workers/{WORKER}").status_code == 200)
        assert all(side.call(stream.joined(10.0)) for stream in bridge.streams)
        yield engines, bridge
    finally:
        if bridge is not None:
            side.call(bridge.stop())
            side.call(bridge.nc.close())
        for engine in engines:
            side.call(engine.stop())
        silent.close()


def test_both_dp_ranks_repairing_gaps_at_once_leave_the_router_holding_what_each_rank_holds(
    router: TestClient, side: SideLoop, nats_server: EmbeddedNats
) -> None:
    """Both ranks lose the same step's batch (a bridge behind both PUB sockets at once): both streams
    replay at the same time. Each rank's events are batched on their own, so neither stream's batch is
    closed under the other (the old shared batch crashed one rank's loop, its events never sent, and
    routers trusted a rank missing blocks)."""
    with _dp_bridge(router, side, nats_server.url) as (engines, bridge):

        async def both_ranks_lose_a_batch() -> None:
            for publish in (True, False, True):  # the third batch shows the gap on both ranks
                for engine in engines:
                    await engine.step(publish=publish)

        for _ in range(5):
            side.call(both_ranks_lose_a_batch())
            until(lambda: all(stream.backlog == 0 for stream in bridge.streams))
        truth = sorted(engines[0].dump() + engines[1].dump(), key=repr)
        assert {edge[1] for edge in truth} == {0, 1}

        def holds_what_both_ranks_hold() -> bool:
            streams = _streams(router)
            return (
                _dump(router) == truth
                and len(streams) == 2
                and all(s["trusted"] for s in streams)
                and {s["dp_rank"]: s["last_event_id"] for s in streams} == bridge.publisher.last_event_ids()
            )

        until(holds_what_both_ranks_hold, 20, "the router holds both ranks' blocks, trusted")
        # Every lost batch came by replay (one replay may bring the next round's too).
        assert all(stream.stats["replayed"] >= 5 and stream.stats["replay_failed"] == 0 for stream in bridge.streams)


def test_a_rank_waiting_on_its_replay_holds_back_no_other_ranks_events(
    router: TestClient, side: SideLoop, nats_server: EmbeddedNats
) -> None:
    """Rank 1 has a gap and its replay socket does not answer (the stream waits out its 2 s timeout):
    rank 0's batches reach the router meanwhile, not once rank 1 gives up."""
    with _dp_bridge(router, side, nats_server.url, silent_replay_rank=1) as (engines, bridge):
        waiting = bridge.streams[1]
        side.call(engines[1].step(publish=False))
        side.call(engines[1].step())  # seq 1 heard, seq 0 missing: a gap whose replay gets no answer
        until(lambda: waiting.stats["gap"] >= 1, 20, "rank 1's gap")
        for _ in range(5):
            side.call(engines[0].step())
        rank_0 = engines[0].dump()
        until(lambda: [edge for edge in _dump(router) if edge[1] == 0] == rank_0, 20, "rank 0's blocks")
        assert waiting.stats["replay_failed"] == 0, "rank 0's events waited for rank 1's replay to fail"


def _peak_rss_mib(pid: int) -> int:
    """The process's peak resident memory (``VmHWM``), in MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) // 1024


@pytest.mark.slow
def test_engine_frames_past_the_bound_never_reach_the_bridges_memory(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    """A peer on the engine's PUB port sending 64 MiB frames (garbage, or hostile): libzmq drops the
    connection at each frame's header (`MAX_ENGINE_FRAME_BYTES`), so the bridge's peak memory stays
    where it was; before, it read all twelve into its queue, 884 MiB. The engine's batches after them
    are heard as ever."""
    port = free_port()
    context = zmq.Context()
    engine = context.socket(zmq.XPUB)  # an XPUB: it hears the bridge's subscription arrive
    engine.setsockopt(zmq.LINGER, 0)
    engine.setsockopt(zmq.SNDHWM, 0)
    engine.bind(f"tcp://127.0.0.1:{port}")
    bridge = ToolProcess(tmp_path, None, "--worker-id", str(WORKER), "--zmq-endpoint", f"tcp://127.0.0.1:{port}",
                         "--block-size", str(BLOCK), "--nats-url", nats_server.url, "--metrics-port", "0",
                         command="bridge")  # fmt: skip
    try:
        assert engine.poll(30_000), bridge.log()  # the bridge's subscription
        engine.recv()
        url = None
        until(lambda: re.search(r"metrics on (http://\S+/metrics)", bridge.log()) is not None, 30, "the metrics URL")
        url = re.search(r"metrics on (http://\S+/metrics)", bridge.log())
        assert url is not None
        started_at = _peak_rss_mib(bridge.pid)
        garbage = b"\xc1" * (64 << 20)  # 0xc1 is never msgpack
        for seq in range(12):
            engine.send_multipart([b"", seq.to_bytes(8, "big"), garbage], copy=False)
        stored = {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None, "medium": "GPU",
                  "token_ids": list(range(BLOCK)), "block_size": BLOCK, "lora_id": None}  # fmt: skip
        batch = msgspec.msgpack.encode([1.0, [stored], 0])

        def heard_after_the_garbage() -> bool:  # sent until heard: each dropped connection loses what follows it
            engine.send_multipart([b"", (12).to_bytes(8, "big"), batch])
            with urllib.request.urlopen(url.group(1), timeout=5) as reply:
                metrics = reply.read().decode()
            return total(metrics, "kv_router_engine_stream_messages_total", outcome="applied") >= 1

        until(heard_after_the_garbage, 60, "the engine's batch after the garbage")
        assert _peak_rss_mib(bridge.pid) < started_at + 100, bridge.log()[-2000:]
        assert bridge.stop() == 0
    finally:
        bridge.stop()
        engine.close()
        context.term()


@pytest.mark.slow
def test_a_bridge_against_nats_without_jetstream_says_so_in_one_line_and_exits_2(plain_nats_url: str) -> None:
    """An operator's plain NATS (no ``-js``): the worker registry is a JetStream bucket, so the bridge
    cannot run; it says which server and what to do, where it printed a traceback and exited 1."""
    done = subprocess.run([*kv_router_command(), "bridge", "--worker-id", str(WORKER), "--zmq-endpoint",
                           f"tcp://127.0.0.1:{free_port()}", "--nats-url", plain_nats_url],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("kv-router bridge:")]
    unavailable = JetStreamUnavailable("bucket kv_router_workers_default")
    assert said == [f"kv-router bridge: NATS at {plain_nats_url}: {unavailable}"]
    assert "start nats-server with -js" in said[0]


def test_a_bridge_says_when_it_loses_nats_and_reaches_it_again_and_stops_without_it(tmp_path: Path) -> None:
    """NATS going away under a running bridge is a WARNING in its log, its return an INFO (before, the
    log said nothing: an operator could not tell its events had waited); SIGTERM while NATS is out of
    reach stops it at once, exit 0, saying the worker was not deregistered (before: five seconds, a
    traceback and exit 1)."""
    zmq_endpoint, _ = loopback_endpoints(replay=False)
    with EmbeddedNats() as server:
        bridge = ToolProcess(tmp_path, None, "--worker-id", str(WORKER), "--zmq-endpoint", zmq_endpoint,
                             "--block-size", str(BLOCK), "--nats-url", server.url, command="bridge")  # fmt: skip
        try:
            # Its start done (the worker registered): a start cut short by SIGTERM deregisters nothing.
            until(lambda: " -> NATS 127.0.0.1:" in bridge.log(), 30, "the bridge started")
            server.stop()
            until(lambda: "lost NATS at" in bridge.log(), 15, "the loss said")
            server.start()  # the same port, a fresh store
            until(lambda: "reached NATS at" in bridge.log(), 30, "the return said")
            server.stop()
            until(lambda: bridge.log().count("lost NATS at") == 2, 15, "the second loss said")
            time.sleep(1.0)  # an outage, not the moment after a reconnection
            started = time.monotonic()
            assert bridge.stop() == 0, bridge.log()
            assert time.monotonic() - started < 10
            log = bridge.log()
            assert f"worker {WORKER} stopping without NATS" in log and "routers drop it" in log, log
            assert "Traceback" not in log, log
        finally:
            bridge.stop()


@pytest.mark.parametrize("stuck_on", ["nats", "engine_models"])
def test_a_bridge_stopped_before_its_start_completed_says_what_it_waited_for_and_exits_2(
    tmp_path: Path, stuck_on: str
) -> None:
    """SIGTERM while the start waits (no NATS listens at its URL; or NATS does, and the engine's OpenAI
    server does not answer yet) stops the bridge at once, exit 2, with one line saying so and what it
    waited for (before: killed by the signal without a word, or exit 0 as if it had run)."""
    zmq_endpoint, _ = loopback_endpoints(replay=False)
    with contextlib.ExitStack() as stack:
        if stuck_on == "nats":
            nats_url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
            waiting, waited_for = "waiting for NATS at", f"NATS at {nats_url}"
            flags: tuple[str, ...] = ()
        else:
            nats_url = stack.enter_context(EmbeddedNats()).url
            engine = f"http://127.0.0.1:{free_port()}"  # nothing listens there
            waiting, waited_for = "does not list its models yet", f"the engine's models at {engine}/v1/models"
            flags = ("--openai-url", engine)
        bridge = ToolProcess(tmp_path, None, "--worker-id", str(WORKER), "--zmq-endpoint", zmq_endpoint,
                             "--nats-url", nats_url, *flags, command="bridge")  # fmt: skip
        stack.callback(bridge.stop)
        until(lambda: waiting in bridge.log(), 30, "the start waiting")
        started = time.monotonic()
        assert bridge.stop() == 2, bridge.log()
        assert time.monotonic() - started < 5
        said = [line for line in bridge.log().splitlines() if "before its start completed" in line]
        assert said == [
            f"kv-router bridge: stopped by SIGTERM before its start completed (still waiting for {waited_for})"
        ], bridge.log()
        assert "Traceback" not in bridge.log()

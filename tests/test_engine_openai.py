"""Engines with their OpenAI servers, as real processes: direct mode (``--engine ...,url=``) and the
bridge (``--openai-url``) register the worker's URL and models for the proxy, and follow the engine's
health: killed, the worker leaves routing within 3 s with its blocks; restarted, it is routed again.

The engines are ``kv-router mock-worker`` processes (vLLM's ZMQ events on a bound PUB socket and a
replay socket, and an OpenAI HTTP server with ``/health``, ``/v1/models`` and ``/tokenize``); the
routers are ``kv-router serve`` processes; the OpenAI client is the real one.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from router.event_plane.embedded_server import EmbeddedNats, free_port
from tests.metrics import sample
from tests.router_processes import ROOT, RouterProcess, ToolProcess, kv_router_command
from tests.waiting import until

MODEL = "tiny-model"


class EngineProcess:
    """A mock vLLM engine: ZMQ events (PUB + replay) and an OpenAI server, on fixed loopback ports so that
    a restart comes back where it was."""

    def __init__(self, log_dir: Path, nats_url: str, worker_id: int) -> None:
        self.log_dir = log_dir
        self.nats_url = nats_url
        self.worker_id = worker_id
        self.pub, self.replay, self.http = free_port(), free_port(), free_port()
        self.tool: ToolProcess | None = None

    @property
    def zmq_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.pub}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    def start(self) -> EngineProcess:
        # Its own NATS worker id: the routers under test hear this engine over ZMQ only.
        self.tool = ToolProcess(
            self.log_dir, None, "--nats-url", self.nats_url, "--namespace", "engine-side",
            "--worker-id", str(900 + self.worker_id), "--zmq-endpoint", f"tcp://*:{self.pub}",
            "--replay-endpoint", f"tcp://*:{self.replay}", "--http-port", str(self.http), "--model", MODEL,
            "--block-size", "16", "--engine-speedup", "50",
        )  # fmt: skip
        until(self.healthy, timeout=60)
        return self

    def healthy(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as reply:
                return reply.status == 200
        except OSError:
            return False

    def kill9(self) -> None:
        assert self.tool is not None
        self.tool.kill9()

    def stop(self) -> None:
        if self.tool is not None:
            self.tool.stop()


def _blocks_of(router: RouterProcess, worker_id: int) -> int:
    return sum(
        len(event["event"]["data"]["stored"]["blocks"])
        for event in router.get("/v1/dump")
        if event["worker_id"] == worker_id
    )


def _worker(router: RouterProcess, worker_id: int) -> dict[str, Any] | None:
    workers = router.get("/v1/workers")["workers"]
    return next((w for w in workers if w["config"]["worker_id"] == worker_id), None)


def _heartbeats_heard(router: RouterProcess) -> float:
    return sample(router.metrics(), "kv_router_nats_control_messages_total", outcome="heartbeats") or 0.0


def _complete(router: RouterProcess, prompt: str) -> tuple[str, int]:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{router.port}/v1", api_key="unused", max_retries=0)
    try:
        reply = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=4)
        return reply.headers["x-kv-router-worker"], int(reply.headers["x-kv-router-cached-tokens"])
    finally:
        client.close()


PROMPT = "a shared system prompt that is long enough to fill a few blocks of sixteen tokens " * 3


@pytest.mark.slow
def test_direct_mode_registers_the_engine_url_and_follows_its_health(tmp_path: Path) -> None:
    with EmbeddedNats() as nats:
        engine = EngineProcess(tmp_path, nats.url, 1).start()
        spec = f"1={engine.zmq_endpoint},replay={engine.replay_endpoint},url={engine.url}/v1"
        router = RouterProcess(tmp_path, "--no-embedded-nats", "--proxy", "--engine", spec,
                               "--engine-health-interval-secs", "0.5")  # fmt: skip
        try:
            router.start()
            until(lambda: _worker(router, 1) is not None, timeout=30)
            worker = _worker(router, 1)
            assert worker is not None
            # Its URL (without the /v1 it was given) and the models its /v1/models lists.
            assert (worker["config"]["url"], worker["config"]["models"]) == (engine.url, [MODEL])
            # A text prompt is tokenized by the engine (/tokenize at its root, not /v1/v1/tokenize).
            assert _complete(router, PROMPT) == ("1", 0)
            until(lambda: _blocks_of(router, 1) > 0)
            assert _complete(router, PROMPT)[1] > 0  # its blocks are in the index and predicted
            # Its capacity given over HTTP: the URL and models stay.
            assert router.post("/v1/workers", {"worker_id": 1, "total_kv_blocks": 512})[0] == 200
            config = router.get("/v1/workers/1")["config"]
            assert (config["url"], config["models"], config["total_kv_blocks"]) == (engine.url, [MODEL], 512)

            engine.kill9()
            killed = time.monotonic()
            until(lambda: _worker(router, 1) is None, timeout=10)
            assert time.monotonic() - killed < 3.0
            assert _blocks_of(router, 1) == 0
            # Counted as a failure for the alerts (KvRouterWorkerDropped), not as a deliberate removal.
            removed = sample(router.metrics(), "kv_router_workers_removed_total", reason="engine_unhealthy")
            assert removed == 1.0
            assert sample(router.metrics(), "kv_router_workers_removed_total", reason="api") == 0.0

            engine.start()
            until(lambda: _worker(router, 1) is not None, timeout=30)
            assert _blocks_of(router, 1) == 0  # back, empty
            # Its first events may go out before the subscriber has reconnected (ZMQ's slow joiner):
            # the tail check after the reconnection replays them.
            assert _complete(router, PROMPT) == ("1", 0)
            until(lambda: _blocks_of(router, 1) > 0)
            assert _complete(router, PROMPT)[1] > 0
            assert "stopped answering" in router.log()
        finally:
            router.stop()
            engine.stop()


def bridge_process(log_dir: Path, engine: EngineProcess, nats_url: str, *args: str) -> ToolProcess:
    """``kv-router bridge`` beside one engine."""
    return ToolProcess(
        log_dir, None, "--worker-id", str(engine.worker_id), "--zmq-endpoint", engine.zmq_endpoint,
        "--replay-endpoint", engine.replay_endpoint, "--block-size", "16", "--nats-url", nats_url,
        "--heartbeat-interval-secs", "0.3", *args, command="bridge",
    )  # fmt: skip


@pytest.mark.slow
def test_the_bridge_registers_the_engine_url_and_withdraws_the_worker_while_its_engine_is_down(
    tmp_path: Path,
) -> None:
    from tests.engine_fakes import EngineHttp, SideLoop

    side = SideLoop()
    down: EngineHttp | None = None
    with EmbeddedNats() as nats:
        engine = EngineProcess(tmp_path, nats.url, 1).start()
        router = RouterProcess(tmp_path, "--no-embedded-nats", "--nats-url", nats.url, "--proxy")
        bridge = bridge_process(tmp_path, engine, nats.url, "--openai-url", engine.url + "/v1/",
                               "--engine-health-interval-secs", "0.5")  # fmt: skip
        try:
            router.start()
            until(lambda: _worker(router, 1) is not None, timeout=30)
            worker = _worker(router, 1)
            assert worker is not None
            assert (worker["config"]["url"], worker["config"]["models"]) == (engine.url, [MODEL])
            assert _complete(router, PROMPT) == ("1", 0)
            until(lambda: _blocks_of(router, 1) > 0)
            assert _complete(router, PROMPT)[1] > 0

            engine.kill9()
            killed = time.monotonic()
            until(lambda: _worker(router, 1) is None, timeout=10)
            assert time.monotonic() - killed < 3.0
            assert _blocks_of(router, 1) == 0
            # A bridge's withdrawal deletes the registry entry, as a clean stop does: "deregistered".
            assert sample(router.metrics(), "kv_router_workers_removed_total", reason="deregistered") == 1.0
            # The behaviour under test: no heartbeat brings it back while its engine is down. The window
            # is counted, not slept: an engine answering 503 on the dead one's port counts the bridge's
            # probes; four of them (1.5 s of the bridge's clock) span five of its heartbeat intervals.
            down = side.call(EngineHttp(models=(MODEL,), port=engine.http).start())
            down.healthy = False
            until(lambda: down.asked["/health"] >= 4, 30, "four probes of the engine while it is down")
            assert _worker(router, 1) is None
            side.call(down.stop())
            down = None

            engine.start()
            until(lambda: _worker(router, 1) is not None, timeout=30)
            assert _blocks_of(router, 1) == 0  # back, empty
            # Its first events may go out before the subscriber has reconnected (ZMQ's slow joiner):
            # the tail check after the reconnection replays them.
            assert _complete(router, PROMPT) == ("1", 0)
            until(lambda: _blocks_of(router, 1) > 0)
            assert _complete(router, PROMPT)[1] > 0
            assert "withdrawn from the routers" in bridge.log()
        finally:
            bridge.stop()
            router.stop()
            engine.stop()
            if down is not None:
                side.call(down.stop())
            side.close()


@pytest.mark.slow
def test_an_http_registration_keeps_its_url_and_models_through_the_bridge_heartbeats(tmp_path: Path) -> None:
    with EmbeddedNats() as nats:
        engine = EngineProcess(tmp_path, nats.url, 2).start()
        router = RouterProcess(tmp_path, "--no-embedded-nats", "--nats-url", nats.url, "--proxy")
        bridge = bridge_process(tmp_path, engine, nats.url)  # no --openai-url: the URL comes over HTTP
        try:
            router.start()
            until(lambda: _worker(router, 2) is not None, timeout=30)
            status, _ = router.post("/v1/workers", {"worker_id": 2, "url": engine.url + "/v1", "models": [MODEL],
                                                    "total_kv_blocks": 512})  # fmt: skip
            assert status == 200
            # The behaviour under test: five heartbeats of the bridge, each with its registration, as the
            # router counts them (not 1.5 s slept: a loaded machine may send fewer in that time).
            beats = _heartbeats_heard(router)
            until(lambda: _heartbeats_heard(router) >= beats + 5, 30, "five more heartbeats heard")
            worker = _worker(router, 2)
            assert worker is not None
            config = worker["config"]
            assert (config["url"], config["models"], config["total_kv_blocks"]) == (engine.url + "/v1", [MODEL], 512)
            assert config["leased"] and config["epoch"]  # still the bridge's: it expires if the bridge dies
            assert "restarted" not in router.log()
            # The /v1 URL works for the proxy: it tokenizes at the root.
            assert _complete(router, PROMPT) == ("2", 0)
        finally:
            bridge.stop()
            router.stop()
            engine.stop()


def test_a_bad_engine_spec_is_one_line_and_exit_code_2() -> None:
    for spec in ("x=tcp://127.0.0.1:1", "1=tcp://127.0.0.1:1,url=ftp://h", "1=tcp://127.0.0.1:1,colour=blue"):
        for flag in ("--engine", "--engine-zmq"):
            done = subprocess.run(
                [*kv_router_command(), "serve", flag, spec], capture_output=True, text=True, timeout=60, cwd=ROOT
            )
            assert done.returncode == 2, done
            assert len(done.stderr.strip().splitlines()) == 1 and "engine" in done.stderr, done.stderr
    env = {**os.environ, "KV_ROUTER_ENGINE": '["1=tcp://127.0.0.1:1,models=a"]'}
    done = subprocess.run(
        [*kv_router_command(), "serve"], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env
    )
    assert done.returncode == 2 and "models= needs url=" in done.stderr, done.stderr
    assert "KV_ROUTER_ENGINE" in done.stderr  # where it came from


@pytest.fixture(autouse=True)
def _no_stray_local_nats(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Local tools look for a running service's connection file: keep this test's processes apart.
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))


def test_a_salted_prefix_is_predicted_only_for_requests_with_the_same_cache_salt(
    tmp_path: Path, shared_dir: Path
) -> None:
    import json

    import zmq

    from tests.engine_fakes import EngineHttp, SideLoop

    # What a real vLLM 0.32 published for a request with cache_salt "tenant-X": 3 blocks of 32 tokens.
    capture = json.loads((shared_dir / "vectors" / "real-engines" / "5557_BlockStored_cache_salt.json").read_text())
    topic, _, payload = (bytes.fromhex(frame) for frame in capture["frames_hex"])
    tokens = capture["decoded"][1][1]["token_ids"]
    side = SideLoop()
    http = side.call(EngineHttp(models=(MODEL,)).start())
    port = free_port()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    router = RouterProcess(tmp_path, "--no-embedded-nats", "--proxy", "--block-size", "32",
                           "--engine", f"1=tcp://127.0.0.1:{port},url={http.url}")  # fmt: skip
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{router.port}/v1", api_key="unused", max_retries=0)

    def predicted(**body: Any) -> int:
        reply = client.completions.with_raw_response.create(
            model=MODEL, prompt=tokens, max_tokens=1, extra_body=body or None
        )
        return int(reply.headers["x-kv-router-cached-tokens"])

    try:
        router.start()
        until(lambda: _worker(router, 1) is not None, timeout=30)

        def stored() -> bool:
            pub.send_multipart([topic, (0).to_bytes(8, "big"), payload])  # the slow joiner may miss it
            return _blocks_of(router, 1) == 3

        until(stored)
        assert predicted(cache_salt="tenant-X") == 96
        assert predicted() == 0  # the same tokens unsalted: the engine hashed them apart
        assert predicted(cache_salt="tenant-Y") == 0
        assert [p["kind"] for p in router.get("/v1/doctor")] == []  # no tokens_hash_mismatch
    finally:
        client.close()
        router.stop()
        pub.close()
        side.call(http.stop())
        side.close()


def test_block_size_auto_adopts_the_first_engines_and_refuses_an_engine_that_differs(
    tmp_path: Path, shared_dir: Path
) -> None:
    import json

    import msgspec
    import zmq

    # A real vLLM 0.32 store of 4 blocks of 32 tokens; a second engine started with --block-size 64.
    capture = json.loads((shared_dir / "vectors" / "real-engines" / "5557_BlockStored.json").read_text())
    topic, _, payload = (bytes.fromhex(frame) for frame in capture["frames_hex"])
    ts, (event,), rank = msgspec.msgpack.decode(payload)
    other = msgspec.msgpack.encode([ts, [{**event, "block_size": 64, "block_hashes": event["block_hashes"][:2]}], rank])
    ports = free_port(), free_port()
    pubs = []
    for port in ports:
        pub = zmq.Context.instance().socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(f"tcp://127.0.0.1:{port}")
        pubs.append(pub)
    engines = ["--engine", f"1=tcp://127.0.0.1:{ports[0]}", "--engine-zmq", f"2=tcp://127.0.0.1:{ports[1]}"]
    router = RouterProcess(tmp_path, "--no-embedded-nats", "--block-size", "auto", *engines)
    try:
        router.start()
        assert router.get("/v1/info")["block_size"] == 16  # the placeholder until an engine tells

        def first_stored() -> bool:
            pubs[0].send_multipart([topic, (0).to_bytes(8, "big"), payload])  # the slow joiner may miss it
            return _blocks_of(router, 1) == 4

        until(first_stored)
        assert router.get("/v1/info")["block_size"] == 32

        def refused() -> bool:
            pubs[1].send_multipart([topic, (0).to_bytes(8, "big"), other])
            return any(p["kind"] == "block_size_mismatch" for p in router.get("/v1/doctor"))

        until(refused)
        (problem,) = router.get("/v1/doctor")
        assert problem["worker_id"] == 2 and "the engine's block size is 64, the router's 32" in problem["evidence"]
        assert _blocks_of(router, 2) == 0
        assert "uses 64 tokens per block" in router.log()
    finally:
        router.stop()
        for pub in pubs:
            pub.close()


def test_block_size_auto_adopts_with_a_request_booked_before_the_first_store(tmp_path: Path, shared_dir: Path) -> None:
    """The usual order: the first request routed to an engine is booked before the engine has stored
    anything (serving it makes the first stores). The engine's size is adopted all the same and its
    blocks indexed; the request booked at the placeholder frees whole (the router stayed on 16 and
    refused every store of the 32-token engine until a restart)."""
    import json

    import zmq

    capture = json.loads((shared_dir / "vectors" / "real-engines" / "5557_BlockStored.json").read_text())
    topic, _, payload = (bytes.fromhex(frame) for frame in capture["frames_hex"])
    port = free_port()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    router = RouterProcess(
        tmp_path, "--no-embedded-nats", "--block-size", "auto", "--engine", f"1=tcp://127.0.0.1:{port}"
    )
    try:
        router.start()
        assert router.post("/v1/workers", {"worker_id": 1})[0] in (200, 201)
        status, decision = router.post("/v1/new", {"tokens": list(range(1, 200)), "request_id": "first"})
        assert (status, decision["worker_id"]) == (200, 1)

        def stored() -> bool:
            pub.send_multipart([topic, (0).to_bytes(8, "big"), payload])  # the slow joiner may miss it
            return _blocks_of(router, 1) == 4

        until(stored)
        assert router.get("/v1/info")["block_size"] == 32
        assert router.post("/v1/mark_free", {"request_id": "first"})[0] == 200
        loads = router.post("/v1/potential_loads", {"tokens": list(range(1, 200))})[1]["loads"]
        # Nothing left booked: the prompt's own 6 full blocks of 32 are all the decode load it would see.
        assert [(load["active_requests"], load["potential_decode_blocks"]) for load in loads] == [(0, 6)]
    finally:
        router.stop()
        pub.close()


# Engine watchers (direct mode's, the bridge's) probe every ENGINE_PROBE_S; the proxy's active checks
# of static workers are set ten times as frequent, so that any of them on an engine shows at once.
ENGINE_PROBE_S = 0.5
PROXY_CHECK_S = 0.05


def _probed_by_one_watcher(http: Any) -> None:
    """The engine's ``/health`` is asked at one watcher's pace: in any stretch of t seconds one prober
    (it sleeps its interval between two asks) asks at most t / ENGINE_PROBE_S + 1 times."""
    start, before = time.monotonic(), http.asked["/health"]
    until(lambda: http.asked["/health"] >= before + 4, 30, "four more health probes")
    asked, elapsed = http.asked["/health"] - before, time.monotonic() - start
    assert asked <= elapsed / ENGINE_PROBE_S + 2, f"{asked} health probes in {elapsed:.2f} s"


def _routed_to(router: RouterProcess) -> str:
    """The worker a completion of token ids (the fake engine has no ``/tokenize``) went to."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{router.port}/v1", api_key="unused", max_retries=0)
    try:
        reply = client.completions.with_raw_response.create(model=MODEL, prompt=list(range(64)), max_tokens=1)
        return reply.headers["x-kv-router-worker"]
    finally:
        client.close()


@pytest.mark.slow
def test_a_direct_mode_engine_behind_the_proxy_is_probed_once(tmp_path: Path) -> None:
    from tests.engine_fakes import EngineHttp, SideLoop

    side = SideLoop()
    http = side.call(EngineHttp(models=(MODEL,)).start())
    router = RouterProcess(tmp_path, "--no-embedded-nats", "--proxy",
                           "--engine", f"1=tcp://127.0.0.1:{free_port()},url={http.url}",
                           "--engine-health-interval-secs", str(ENGINE_PROBE_S),
                           "--proxy-health-check-interval-secs", str(PROXY_CHECK_S))  # fmt: skip
    try:
        router.start()
        until(lambda: _worker(router, 1) is not None, 30, "the engine's worker is registered")
        _probed_by_one_watcher(http)
        worker = _worker(router, 1)
        assert worker is not None and worker["availability"]["health_check"] == "passing"
        assert _routed_to(router) == "1"
    finally:
        router.stop()
        side.call(http.stop())
        side.close()


def test_a_bridge_fed_worker_behind_the_proxy_is_probed_once(tmp_path: Path) -> None:
    from tests.engine_fakes import EngineHttp, SideLoop

    side = SideLoop()
    http = side.call(EngineHttp(models=(MODEL,)).start())
    with EmbeddedNats() as nats:
        router = RouterProcess(tmp_path, "--no-embedded-nats", "--nats-url", nats.url, "--proxy",
                               "--proxy-health-check-interval-secs", str(PROXY_CHECK_S))  # fmt: skip
        bridge = ToolProcess(
            tmp_path, None, "--worker-id", "1", "--zmq-endpoint", f"tcp://127.0.0.1:{free_port()}",
            "--block-size", "16", "--nats-url", nats.url, "--heartbeat-interval-secs", "0.3",
            "--openai-url", http.url, "--engine-health-interval-secs", str(ENGINE_PROBE_S), command="bridge",
        )  # fmt: skip
        try:
            router.start()
            until(lambda: _worker(router, 1) is not None, 30, "the bridge's worker is registered")
            _probed_by_one_watcher(http)
            assert _routed_to(router) == "1"
        finally:
            bridge.stop()
            router.stop()
            side.call(http.stop())
            side.close()

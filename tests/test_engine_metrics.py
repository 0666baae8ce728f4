"""The bridge's engine load: an engine's Prometheus text, scraped over real HTTP, published over a real
nats-server, reaches the router's load view (`rank_loads`, the ``/metrics`` gauges)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import msgspec
import pytest
from nats.aio.client import Client

from api.metrics import RouterStateCollector
from router.config import RouterConfig
from router.engines.bridge_config import BridgeConfig
from router.engines.engine_metrics import EngineLoad, EngineMetricsScraper, read_engine_metrics
from router.event_plane.messages import ActiveLoad
from router.event_plane.plane import RouterEventPlane
from router.event_plane.publisher import KvEventPublisher
from router.kv_router import KvRouter
from router.types import WorkerConfig
from tests.engine_fakes import VLLM_CACHE_CONFIG_INFO
from tests.waiting import eventually

# What vLLM 0.11 serves on /metrics with two data-parallel ranks (abridged).
VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage (before 0.10).
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.9
"""
SGLANG = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",model_name="m"} 2.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",model_name="m"} 5.0
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="0",model_name="m"} 0.125
"""


def test_each_engine_names_its_load_its_own_way() -> None:
    vllm = {
        0: EngineLoad(kv_usage=0.25, waiting=7, running=3),  # the newer usage metric wins
        1: EngineLoad(kv_usage=0.5, waiting=0, running=1),
    }
    assert read_engine_metrics(VLLM, "vllm") == (vllm, {})
    assert read_engine_metrics(SGLANG, "sglang").loads == {0: EngineLoad(kv_usage=0.125, waiting=5, running=2)}
    trtllm = "trtllm:kv_cache_utilization 0.5\n"
    assert read_engine_metrics(trtllm, "trtllm").loads == {0: EngineLoad(kv_usage=0.5)}
    # Direct mode does not know the engine's kind, nor a bridge told none: whichever names it serves are
    # read (a bridge in front of SGLang once read vLLM's names only, and so no load at all).
    assert read_engine_metrics(VLLM, "auto").loads == vllm
    assert read_engine_metrics(SGLANG, "auto").loads == read_engine_metrics(SGLANG, "sglang").loads
    assert read_engine_metrics(SGLANG, BridgeConfig(worker_id=1, zmq_endpoint="tcp://h:1").engine).loads


def test_vllm_states_its_kv_blocks_per_rank_in_its_cache_config() -> None:
    """vLLM 0.32's own line (the lane's engines: 160 blocks); each data-parallel engine states its own."""
    assert read_engine_metrics(VLLM_CACHE_CONFIG_INFO + "\n", "vllm").kv_blocks == {0: 160}
    second = VLLM_CACHE_CONFIG_INFO.replace('engine="0"', 'engine="1"').replace('"160"', '"96"')
    assert read_engine_metrics(f"{VLLM_CACHE_CONFIG_INFO}\n{second}\n", "auto").kv_blocks == {0: 160, 1: 96}
    unresolved = VLLM_CACHE_CONFIG_INFO.replace('num_gpu_blocks="160"', 'num_gpu_blocks="None"')
    assert read_engine_metrics(unresolved + "\n", "vllm").kv_blocks == {}  # before profiling: none stated
    assert read_engine_metrics(VLLM_CACHE_CONFIG_INFO + "\n", "sglang").kv_blocks == {}


class _Published:
    """The scraper's loads published as the bridge publishes them; a stated capacity is not expected."""

    def __init__(self, publisher: KvEventPublisher) -> None:
        self.publisher = publisher

    async def publish_load(self, load: ActiveLoad) -> None:
        await self.publisher.publish_load(load)

    async def capacity_learned(self, kv_blocks: int) -> None:
        raise AssertionError(f"the capacity was given: {kv_blocks} learned")


@pytest.fixture
def engine_metrics() -> Iterator[str]:
    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = VLLM.encode()
            self.send_response(200)
            self.send_header("content-type", "text/plain; version=0.0.4")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


@pytest.mark.anyio
async def test_scraped_engine_load_reaches_the_routers_load_view(client: Client, engine_metrics: str) -> None:
    router = KvRouter(RouterConfig(block_size=16))
    plane = RouterEventPlane(router, client, lease_s=30)
    await plane.start()
    registration = WorkerConfig(worker_id=9, block_size=16, dp_size=2, total_kv_blocks=1000)
    publisher = KvEventPublisher(client, registration)
    await publisher.start()
    scraper = EngineMetricsScraper(
        engine_metrics, _Published(publisher), worker_id=9, engine="vllm", total_kv_blocks=1000
    )
    try:
        await eventually(lambda: bool(router.workers()))
        async with httpx.AsyncClient() as http:
            await scraper.scrape_once(http)
        await eventually(lambda: plane.outcomes["loads"] == 2)
        loads = {(load.dp_rank): load for load in router.rank_loads()}
        assert (loads[0].kv_used_blocks, loads[0].engine_requests_waiting, loads[0].engine_requests_running) == (
            250,
            7,
            3,
        )
        assert (loads[1].kv_used_blocks, loads[1].engine_requests_waiting, loads[1].engine_requests_running) == (
            500,
            0,
            1,
        )
        gauges = {
            (sample.name, sample.labels["dp_rank"]): sample.value
            for family in RouterStateCollector(router).collect()
            for sample in family.samples
            if sample.name.endswith(("engine_requests_waiting", "engine_requests_running"))
        }
        assert gauges == {
            ("kv_router_worker_engine_requests_waiting", "0"): 7,
            ("kv_router_worker_engine_requests_waiting", "1"): 0,
            ("kv_router_worker_engine_requests_running", "0"): 3,
            ("kv_router_worker_engine_requests_running", "1"): 1,
        }
    finally:
        await publisher.stop()
        await plane.stop()


def test_the_load_message_stays_dynamos_for_dynamos_fields() -> None:
    # Dynamo 1.6.1's kv_metrics bytes (shared/reference/dynamo-router.md §5.3) decode, and ours carry
    # every one of its keys with the engine's counts beside them.
    dynamo = b'{"worker_id":2243053257420644916,"dp_rank":0,"active_decode_blocks":5,"active_prefill_tokens":null,"kv_used_blocks":7}'  # noqa: E501
    load = msgspec.json.decode(dynamo, type=ActiveLoad)
    assert (load.worker_id, load.active_decode_blocks, load.kv_used_blocks, load.num_requests_waiting) == (
        2243053257420644916,
        5,
        7,
        None,
    )
    ours = msgspec.json.decode(msgspec.json.encode(ActiveLoad(worker_id=1, num_requests_waiting=4)))
    assert set(msgspec.json.decode(dynamo)) <= set(ours)
    assert ours["num_requests_waiting"] == 4

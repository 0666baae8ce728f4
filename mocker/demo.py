"""``kv-router demo``: the router at work, in one command and one process.

It starts an embedded nats-server (only clients with its token may join), the router service (HTTP +
event plane, its default policy, its OpenAI proxy on), and ``workers`` mock workers on NATS that also
serve the OpenAI API, then replays a generated shared-prefix workload online: requests go through
``/v1/new``, the workers publish real KV events, the router learns where prefixes live. Then the
whole chain runs with an HTTP client speaking the OpenAI API to the proxy (`mocker.demo_proxy`).
Last, the same workload is simulated offline with every router for comparison; the tables are printed.

The online part runs ``speedup`` times faster than real time (arrivals and engines alike) and its
times are scaled back, so both tables are in the same units. The workers get a small KV pool
(``num_gpu_blocks``), so that where a prefix is cached matters.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass

import msgspec

from mocker.config import EngineConfig
from mocker.demo_proxy import run_through_proxy
from mocker.openai_api import serve_openai
from mocker.replay import ReplayRun, ReplaySetup, replay_offline, replay_online_report
from mocker.report import render_table
from mocker.service import serve_router
from mocker.trace import Row, TraceOptions, build_trace
from mocker.worker import MockWorker
from mocker.workload import shared_prefix_rows
from router.config import RouterConfig
from router.event_plane.connection import close_connection, connect
from router.event_plane.embedded_server import EmbeddedNats, free_port

__all__ = ["DemoOptions", "run_demo"]

MODEL = "mock-model"


@dataclass(frozen=True, slots=True)
class DemoOptions:
    workers: int = 4
    requests: int = 300
    speedup: float = 10.0
    num_gpu_blocks: int = 1024
    seed: int = 0
    show_progress: bool = True


async def run_demo(options: DemoOptions) -> tuple[ReplayRun, list[ReplayRun]]:
    """Run the demo; returns the online run and the offline comparison (and prints both tables)."""
    rows = shared_prefix_rows(requests=options.requests, seed=options.seed)
    engine = EngineConfig(num_gpu_blocks=options.num_gpu_blocks)
    print(
        f"workload: {options.requests} requests, 24 shared 4k-token prefixes (popularity 1/rank), "
        f"{options.workers} workers of {engine.num_gpu_blocks} x {engine.block_size}-token KV blocks"
    )
    config = RouterConfig(block_size=engine.block_size)
    online = await _online(rows, engine, config, options)
    print(f"\nonline: NATS + router service ({config.policy} policy) + mock workers, over HTTP")
    print(render_table([online.report]))
    print(
        f"(times scaled back from {options.speedup:g}x speed; the HTTP and NATS round trips are scaled with them, "
        "hence the longer TTFT)"
    )
    trace = build_trace(rows, TraceOptions(seed=options.seed), "<generated shared-prefix workload>")
    setup = ReplaySetup(engine=engine, workers=options.workers, router_config=config, seed=options.seed)
    offline = await replay_offline(trace, setup, show_progress=options.show_progress)
    print("\noffline: the same workload simulated with every router")
    print(render_table([run.report for run in offline]))
    return online, offline


async def _online(rows: list[Row], engine: EngineConfig, config: RouterConfig, options: DemoOptions) -> ReplayRun:
    trace = build_trace(rows, TraceOptions(seed=options.seed), "<generated shared-prefix workload>")
    fast_engine = msgspec.structs.replace(engine, speedup_ratio=options.speedup)
    rng = random.Random(options.seed)
    with EmbeddedNats(require_token=True) as nats:
        async with (
            serve_router(nats.url, config, nats_token=nats.token, proxy=True) as url,
            contextlib.AsyncExitStack() as stack,
        ):
            print(f"router at {url}, NATS at {nats.url}")
            connections = [await connect(nats.client_options(name=f"mock-worker-{i}")) for i in range(options.workers)]
            ports = [free_port() for _ in connections]
            workers = [
                MockWorker(
                    nc,
                    rng.randrange(1, 1 << 53),
                    fast_engine,
                    seed=options.seed + i,
                    url=f"http://127.0.0.1:{port}",
                    models=frozenset({MODEL}),
                )
                for i, (nc, port) in enumerate(zip(connections, ports, strict=True))
            ]
            for worker, port in zip(workers, ports, strict=True):
                await stack.enter_async_context(serve_openai(worker, MODEL, "127.0.0.1", port))
            tasks = [asyncio.create_task(worker.run()) for worker in workers]
            try:
                online = await replay_online_report(
                    trace,
                    label=f"{config.policy} (online)",
                    router_url=url,
                    nats=nats.client_options(name="kv-router-replay"),
                    workers=options.workers,
                    time_scale=options.speedup,
                    show_progress=options.show_progress,
                )
                proxied = await run_through_proxy(url, MODEL, seed=options.seed)
                print(
                    f"\nthrough the OpenAI proxy ({url}/v1/completions, streamed): {proxied.requests} requests, "
                    f"{len(proxied.workers_used)} workers used; cached prompt tokens predicted by the router "
                    f"{proxied.predicted_cached}, reported by the engines {proxied.engine_cached} of "
                    f"{proxied.prompt_tokens}; bookings left: {'none' if proxied.idle_after else 'SOME'}"
                )
                return online
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                for nc in connections:
                    await close_connection(nc)

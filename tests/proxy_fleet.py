"""A proxying router and mock workers speaking the OpenAI API, in this process, on loopback."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import openai
import uvicorn

from api.app import RouterApp
from api.config import EventPlaneConfig, ProxyConfig, SecurityConfig, ServiceConfig, Settings
from api.server import uvicorn_config
from mocker.config import EngineConfig
from mocker.openai_api import MockOpenAI, serve_openai
from mocker.worker import MockWorker
from router.config import RouterConfig
from router.event_plane.connection import NatsOptions, connect
from router.event_plane.embedded_server import free_port
from router.kv_router import KvRouter
from router.types import HandoffStyle, WorkerRole
from tests.waiting import eventually

__all__ = ["MODEL", "SSE_HEAD", "Fleet", "fleet", "idle", "raw_worker", "sse_chunk"]

MODEL = "mock-model"
# What a misbehaving worker written by hand sends: the head of a chunked SSE answer, then chunks.
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
ENGINE = EngineConfig(num_gpu_blocks=512, speedup_ratio=20.0)


@dataclass
class Fleet:
    url: str
    app: RouterApp
    workers: dict[int, MockWorker] = field(default_factory=dict)
    apis: dict[int, MockOpenAI] = field(default_factory=dict)
    client: openai.AsyncOpenAI = field(init=False)

    def __post_init__(self) -> None:
        # The real OpenAI client, as a user would point it at the proxy.
        self.client = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    @property
    def router(self) -> KvRouter:
        return self.app.kv_router


def idle(router: KvRouter) -> bool:
    """Nothing booked anywhere: every rank's potential load is back to zero."""
    return all(
        load.active_requests == 0 and load.active_prefill_tokens == 0 and load.active_decode_blocks == 0
        for load in router.rank_loads()
    )


@contextlib.asynccontextmanager
async def fleet(
    nats_url: str,
    worker_ids: tuple[int, ...] = (1, 2),
    *,
    engine: EngineConfig = ENGINE,
    router: dict[str, Any] | None = None,
    proxy: dict[str, Any] | None = None,
    service: dict[str, Any] | None = None,
    security: dict[str, Any] | None = None,
    lease_secs: float = 10.0,
    roles: dict[int, WorkerRole] | None = None,
    handoff: HandoffStyle = "kv_transfer_params",
    kv_events: bool = True,
) -> AsyncIterator[Fleet]:
    """``roles``: a worker's role (default both); its prefill workers hand off in the ``handoff`` style
    (bootstrap: their bootstrap server is their HTTP API); ``kv_events`` off: the workers send none."""
    port = free_port()
    settings = Settings(
        router=RouterConfig(block_size=engine.block_size, **(router or {})),
        service=ServiceConfig(port=port, log_level="warning", **(service or {})),
        event_plane=EventPlaneConfig(nats_url=nats_url, worker_lease_secs=lease_secs),
        proxy=ProxyConfig(proxy=True, **(proxy or {})),
        security=SecurityConfig(**(security or {})),
    )
    config = uvicorn_config(settings)
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    tasks: list[asyncio.Task[None]] = []
    async with contextlib.AsyncExitStack() as stack:
        try:
            await eventually(lambda: server.started or serving.done())
            app = config.app
            assert isinstance(app, RouterApp)
            result = Fleet(f"http://127.0.0.1:{port}", app)
            stack.push_async_callback(result.client.close)
            for worker_id in worker_ids:
                nc = await connect(NatsOptions(nats_url))
                stack.push_async_callback(nc.close)
                http_port = free_port()
                role = (roles or {}).get(worker_id, "both")
                bootstrap_port = http_port if role == "prefill" and handoff == "bootstrap" else None
                worker = MockWorker(
                    nc, worker_id, engine, heartbeat_interval_s=0.3, url=f"http://127.0.0.1:{http_port}",
                    models=frozenset({MODEL}), role=role, handoff=handoff, bootstrap_port=bootstrap_port,
                    kv_events=kv_events,
                )  # fmt: skip
                result.workers[worker_id] = worker
                result.apis[worker_id] = await stack.enter_async_context(
                    serve_openai(worker, MODEL, "127.0.0.1", http_port)
                )
                tasks.append(asyncio.create_task(worker.run()))
            await eventually(lambda: len(result.router.workers()) == len(worker_ids))
            yield result
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            server.should_exit = True
            await serving


def sse_chunk(text: str) -> bytes:
    """One completion token event as one HTTP chunk."""
    event = b'data: {"choices": [{"index": 0, "text": "%b"}], "object": "text_completion"}\n\n' % text.encode()
    return b"%x\r\n%b\r\n" % (len(event), event)


@contextlib.asynccontextmanager
async def raw_worker(
    serve: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[str]:
    """A worker whose every connection is ``serve``d by hand, on a free loopback port; yields its URL."""
    port = free_port()
    server = await asyncio.start_server(serve, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()

"""The router service inside this process: the HTTP app (`api.app`) with its NATS event plane.

What ``kv-router serve --nats-url`` runs, started here on a free loopback port so the demo and the online tests
can stand up a whole fleet (NATS, router, mock workers) in one process, on one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import uvicorn

from api.app import RouterApp
from api.config import EventPlaneConfig, ProxyConfig, ServiceConfig, Settings
from api.server import uvicorn_config
from router.config import RouterConfig
from router.event_plane.embedded_server import free_port

__all__ = ["serve_router"]


@contextlib.asynccontextmanager
async def serve_router(
    nats_url: str,
    config: RouterConfig,
    *,
    nats_token: str | None = None,
    namespace: str = "default",
    proxy: bool = False,
    startup_timeout_s: float = 10.0,
) -> AsyncIterator[str]:
    """Serve a router on loopback, its event plane on ``nats_url`` (with ``nats_token`` if that server
    requires one; and, with ``proxy``, its OpenAI proxy), for the duration of the block; yields its base URL once the
    event plane has started too."""
    port = free_port()
    settings = Settings(
        router=config,
        service=ServiceConfig(port=port, log_level="warning"),
        event_plane=EventPlaneConfig(nats_url=nats_url, nats_token=nats_token, nats_namespace=namespace),
        proxy=ProxyConfig(proxy=proxy),
    )
    served = uvicorn_config(settings)
    server = uvicorn.Server(served)
    serving = asyncio.create_task(server.serve(), name="kv-router-http")
    app = served.app
    assert isinstance(app, RouterApp)
    lifecycle = app.event_plane  # the event plane connects in the background: wait for it
    assert lifecycle is not None  # settings with a NATS URL
    try:
        async with asyncio.timeout(startup_timeout_s):
            while not (server.started and lifecycle.ready):
                if serving.done():
                    serving.result()  # raises what stopped it
                    raise RuntimeError("the router's HTTP server stopped while starting")
                await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await serving

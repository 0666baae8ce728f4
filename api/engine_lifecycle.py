"""Engines the service hears itself, for the app's lifetime: ``--engine`` (direct mode) and
``--dynamo-endpoint`` (Dynamo workers on the event plane's NATS)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from api.config import EngineSourcesConfig
from router.engines.direct import AdoptedBlockSize, DirectEngine
from router.engines.dynamo_source import DynamoNatsSource
from router.event_plane.plane import RouterEventPlane
from router.kv_router import KvRouter

__all__ = ["running_dynamo_sources", "running_engines"]

logger = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def running_engines(router: KvRouter, config: EngineSourcesConfig) -> AsyncIterator[list[DirectEngine]]:
    block_sizes = AdoptedBlockSize(router) if config.block_size_auto else None
    engines = [
        DirectEngine(
            router,
            spec,
            topic=config.engine_zmq_topic,
            health_interval_s=config.engine_health_interval_secs,
            health_timeout_s=config.engine_health_timeout_secs,
            block_sizes=block_sizes,
        )
        for spec in config.engine_specs()
    ]
    if any(engine.url is not None for engine in engines):
        # httpx logs every request at INFO: one line per health probe, every second, per engine.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    started: list[DirectEngine] = []
    try:
        for engine in engines:
            await engine.start()
            started.append(engine)
            logger.info(
                "direct mode: worker %d's KV events from %s%s",
                engine.worker_id,
                ", ".join(stream.endpoint for stream in engine.streams),
                f", its OpenAI server at {engine.url}" if engine.url else "",
            )
        yield engines
    finally:
        for engine in started:
            await engine.stop()


@contextlib.asynccontextmanager
async def running_dynamo_sources(
    router: KvRouter, config: EngineSourcesConfig, plane: RouterEventPlane | None
) -> AsyncIterator[list[DynamoNatsSource]]:
    if config.dynamo_endpoint and plane is None:
        raise RuntimeError("--dynamo-endpoint needs the NATS event plane (--nats-url, or the embedded server)")
    sources = [] if plane is None else [DynamoNatsSource(plane.nc, router, spec) for spec in config.dynamo_endpoint]
    try:
        for source in sources:
            await source.start()
            logger.info("Dynamo workers of %s on NATS", source.endpoint.subject("*"))
        yield sources
    finally:
        for source in sources:
            await source.stop()

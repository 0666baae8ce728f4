"""Direct mode for the service: the ``--engine-zmq`` engines heard for the app's lifetime."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from api.config import EngineSourcesConfig
from router.engines.direct import DirectEngine
from router.kv_router import KvRouter

__all__ = ["running_engines"]

logger = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def running_engines(router: KvRouter, config: EngineSourcesConfig) -> AsyncIterator[list[DirectEngine]]:
    engines = [DirectEngine(router, spec, topic=config.engine_zmq_topic) for spec in config.engine_zmq]
    started: list[DirectEngine] = []
    try:
        for engine in engines:
            await engine.start()
            started.append(engine)
            logger.info("direct mode: worker %d's KV events from %s", engine.worker_id, engine.stream.endpoint)
        yield engines
    finally:
        for engine in started:
            await engine.stop()

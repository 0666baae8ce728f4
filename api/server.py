"""Run the app under uvicorn: uvloop event loop, httptools parser, graceful shutdown on SIGTERM.

uvicorn owns the signals: on SIGTERM (or SIGINT) it stops accepting connections, closes idle
keep-alive connections, lets requests in flight finish for up to ``shutdown_timeout_secs``, then
runs the app's lifespan shutdown and exits 0.
"""

from __future__ import annotations

import logging.config

import uvicorn

from api.app import create_app
from api.config import Settings
from api.logs import log_config

__all__ = ["serve", "uvicorn_config"]


def uvicorn_config(settings: Settings) -> uvicorn.Config:
    service = settings.service
    return uvicorn.Config(
        create_app(settings),
        host=service.host,
        port=service.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=service.access_log,
        log_config=log_config(service.log_level, service.log_format),
        timeout_graceful_shutdown=service.shutdown_timeout_secs,
        # Clients are gateways calling for a decision; no address from X-Forwarded-For is used.
        proxy_headers=False,
        # Routing decisions are small and answered in well under a millisecond; the server header
        # and date stamp are bytes on every reply that no client of this API reads.
        server_header=False,
        date_header=False,
    )


def serve(settings: Settings) -> None:
    """Serve until SIGTERM / SIGINT; returns once the last in-flight request has been answered."""
    logging.config.dictConfig(log_config(settings.service.log_level, settings.service.log_format))
    uvicorn.Server(uvicorn_config(settings)).run()

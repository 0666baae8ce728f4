"""CORS: which browser origins may call the service (off unless ``cors_allow_origins`` is set).

FastAPI's routes get Starlette's `CORSMiddleware` (it answers the preflight ``OPTIONS`` of every path,
the proxy's included, which reach FastAPI since only ``POST`` is answered before it). The proxy's
``POST`` routes are answered before FastAPI, so they add the same answer headers themselves
(`Cors.answer_headers`). The decision API's hot routes are not meant for browsers and get none.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from api.config import ServiceConfig
from api.http_stream import Headers

__all__ = ["EXPOSED_HEADERS", "Cors"]

# What a browser script may read of the proxy's answers, besides the request id (its header is a setting).
EXPOSED_HEADERS = ("x-kv-router-worker", "x-kv-router-dp-rank", "x-kv-router-cached-tokens", "retry-after")


class Cors:
    """The service's CORS settings (`ServiceConfig.cors_*`); ``request_id_header``: the proxy's
    (`ProxyConfig.proxy_request_id_header`), which every answer carries, exposed too."""

    def __init__(self, config: ServiceConfig, request_id_header: str) -> None:
        self.origins = list(config.cors_allow_origins)
        self._any = "*" in self.origins
        self._allowed = frozenset(origin.encode("latin-1") for origin in self.origins)
        self._credentials = config.cors_allow_credentials
        self._config = config
        self._exposed = (*EXPOSED_HEADERS, request_id_header.lower())
        self._expose_line = ", ".join(self._exposed).encode()

    @property
    def enabled(self) -> bool:
        return bool(self.origins)

    def install(self, app: FastAPI) -> None:
        if self.enabled:
            config = self._config
            app.add_middleware(
                CORSMiddleware,
                allow_origins=self.origins,
                allow_methods=config.cors_allow_methods,
                allow_headers=config.cors_allow_headers,
                allow_credentials=config.cors_allow_credentials,
                expose_headers=list(self._exposed),
                max_age=config.cors_max_age_secs,
            )

    def answer_headers(self, origin: bytes | None) -> Headers:
        """The CORS headers of an answer to a request from ``origin`` (none for a request without an
        Origin, or from an origin not allowed), as the middleware gives them."""
        if not self.enabled or origin is None or not (self._any or origin in self._allowed):
            return []
        if self._any and not self._credentials:
            headers = [(b"access-control-allow-origin", b"*")]
        else:  # the origin itself: a credentialed answer may not say "*"
            headers = [(b"access-control-allow-origin", origin), (b"vary", b"origin")]
            if self._credentials:
                headers.append((b"access-control-allow-credentials", b"true"))
        headers.append((b"access-control-expose-headers", self._expose_line))
        return headers

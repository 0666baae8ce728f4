"""The HTTP client to the workers: one aiohttp session, pooled keep-alive connections, timeouts.

aiohttp's client rather than httpx's: streaming 300 completions of 64 tokens straight from a mock
worker, aiohttp's used 370-470 µs of CPU per request on this VM and httpx's 6.8-8.2 ms, about 18
times more (``bench/proxy_bench.py --clients aiohttp,httpx``, docs/performance.md). Responses are
not decompressed and chunks are handed on as they arrive (`aiohttp.StreamReader.iter_any`), so the
proxy never parses a stream it only forwards.
"""

from __future__ import annotations

import aiohttp

from api.config import ProxyConfig
from router.types import WorkerConfig

__all__ = ["UPSTREAM_ERRORS", "Upstream", "endpoint"]

# Failures of a worker, as opposed to the proxy's own bugs: refused or reset connections, timeouts,
# broken or malformed responses.
UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError)


class Upstream:
    """The session, created on the running loop (`start`) and closed with the app (`stop`)."""

    def __init__(self, config: ProxyConfig) -> None:
        self._config = config
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        config = self._config
        connector = aiohttp.TCPConnector(
            limit=0,
            limit_per_host=config.proxy_connections_per_worker,
            ttl_dns_cache=None,
            keepalive_timeout=30.0,
        )
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=config.proxy_connect_timeout_secs, sock_read=config.proxy_read_timeout_secs
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            raise_for_status=False,
        )

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the proxy's upstream session is not started")
        return self._session


def endpoint(worker: WorkerConfig, path: str) -> str:
    """The URL of ``path`` on a worker (only workers with a URL are proxied to)."""
    assert worker.url is not None
    return worker.url.rstrip("/") + path

#!/usr/bin/env python3
"""The least a Python gateway does per request, as a reference for ``bench/gateway_bench.py``: how much of
kv-router's CPU per request any proxy on uvloop and httptools pays, how much the router's decision adds,
and what is left for the proxy's own work.

``python bench/python_floor.py --port N BACKEND_URL...`` forwards each ``POST`` to a backend over a
keep-alive connection and hands the backend's bytes back unchanged (head, body, SSE chunks as they come),
round robin; nothing more: no JSON, no retries, no headers of its own, no metrics.

``--route`` adds what kv-router's router does for each request of the benchmark's fleet, through its
public API: the body decoded (``api.proxy.wire``), a text prompt routed by its bytes
(``api.proxy.prompt_bytes``; token ids as given), `KvRouter.new` among the backends registered without KV
events (approximate mode, 64-token blocks, as ``gateway_bench`` runs ``kv-router serve --proxy``), the
booking's prefill marked at the answer's first bytes and freed at its end.

Loopback only; not part of the service.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import re
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import cast
from urllib.parse import urlsplit

import httptools
import msgspec
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from api.proxy.prompt_bytes import text_bytes
from api.proxy.wire import CompletionBody, TokenIdsBody, prompt_token_ids
from indexer.hashing import pack_tokens
from router.config import RouterConfig
from router.kv_router import KvRouter
from router.request_ids import new_request_id
from router.types import RouteRequest, WorkerConfig

_IDS_PROMPT = re.compile(rb'"prompt"\s*:\s*\[\s*\d')
_EMPTY = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


class _Backend(asyncio.Protocol):
    """One keep-alive connection to a backend; the answer's bytes go to ``client`` as they come."""

    def __init__(self, idle: list[_Backend]) -> None:
        self._idle = idle
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self.client: asyncio.Transport | None = None
        self.on_first: Callable[[], object] | None = None
        self.on_end: Callable[[], object] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def send(self, request: bytes, client: asyncio.Transport) -> None:
        self.client = client
        assert self._transport is not None
        self._transport.write(request)

    def data_received(self, data: bytes) -> None:
        assert self.client is not None
        if self.on_first is not None:
            first, self.on_first = self.on_first, None
            first()
        self.client.write(data)
        self._parser.feed_data(data)

    def on_message_complete(self) -> None:
        end, self.on_end = self.on_end, None
        if end is not None:
            end()
        self.client = None
        self._idle.append(self)


class _Client(asyncio.Protocol):
    def __init__(self, floor: Floor) -> None:
        self._floor = floor
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._body: list[bytes] = []
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self._url = url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self._body)
        self._body = []
        assert self._transport is not None
        if not body:  # a probe (GET /health, /v1/models)
            self._transport.write(_EMPTY)
            return
        asyncio.get_running_loop().create_task(self._floor.forward(self._url, body, self._transport))


class Floor:
    def __init__(self, backends: list[str], route: bool) -> None:
        self._backends = [(str(urlsplit(url).hostname), int(urlsplit(url).port or 80)) for url in backends]
        self._idle: list[list[_Backend]] = [[] for _ in backends]
        self._turns = itertools.cycle(range(len(backends)))
        self._router: KvRouter | None = None
        self._decode = msgspec.json.Decoder(CompletionBody).decode
        self._decode_ids = msgspec.json.Decoder(TokenIdsBody).decode  # ids range-checked by msgspec, in C
        if route:
            self._router = KvRouter(RouterConfig(block_size=64, kv_events=False))
            for worker_id, url in enumerate(backends):
                self._router.register_worker(WorkerConfig(worker_id=worker_id, url=url, kv_events=False, leased=False))

    async def forward(self, url: bytes, body: bytes, client: asyncio.Transport) -> None:
        router = self._router
        if router is None:
            backend = await self._connection(next(self._turns))
        else:
            if _IDS_PROMPT.search(body):
                tokens = bytes(pack_tokens(self._decode_ids(body).prompt))
            else:
                prompt = prompt_token_ids(self._decode(body).prompt)
                tokens = text_bytes(prompt) if isinstance(prompt, str) else bytes(pack_tokens(prompt))
            request_id = new_request_id()
            decision = await router.new(RouteRequest(tokens=tokens, request_id=request_id))
            backend = await self._connection(decision.worker_id)
            backend.on_first = partial(router.mark_prefill, request_id)
            backend.on_end = partial(router.mark_free, request_id)
        head = b"POST %s HTTP/1.1\r\nhost: backend\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        backend.send(head % (url, len(body)) + body, client)

    async def _connection(self, index: int) -> _Backend:
        idle = self._idle[index]
        if idle:
            return idle.pop()
        host, port = self._backends[index]
        loop = asyncio.get_running_loop()
        _, backend = await loop.create_connection(lambda: _Backend(idle), host, port)
        return backend


async def serve(port: int, backends: list[str], route: bool) -> None:
    floor = Floor(backends, route)
    gc.freeze()  # as the service does once started
    server = await asyncio.get_running_loop().create_server(lambda: _Client(floor), "127.0.0.1", port)
    await server.serve_forever()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--route", action="store_true", help="route each request with kv-router's KvRouter")
    parser.add_argument("backends", nargs="+")
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.backends, args.route))
    return 0


if __name__ == "__main__":
    sys.exit(main())

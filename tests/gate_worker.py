"""A worker written by hand for the proxy's failure tests: it answers a status (an overloaded engine's
429 or 503, with a Retry-After) to its first requests, then a completion; served by uvicorn on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import uvicorn

from router.event_plane.embedded_server import free_port
from router.types import WorkerConfig
from tests.proxy_fleet import MODEL, Fleet
from tests.waiting import eventually

__all__ = ["COMPLETION", "Gate", "register", "served"]

COMPLETION = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 0,
    "model": MODEL,
    "choices": [{"index": 0, "text": " fine", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}


@dataclass
class Gate:
    """A worker that answers ``status`` (with ``retry_after``, if any) to its first ``refusals`` requests,
    then a completion; it notes when each request came (monotonic seconds). ``GET /health`` is
    answered 200 and counted apart (``health_checks``)."""

    refusals: int
    status: int = 429
    retry_after: str | None = None
    arrivals: list[float] = field(default_factory=list)
    health_checks: int = 0
    hold: asyncio.Event | None = None  # set: requests are answered only once it is set

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        while (await receive()).get("more_body"):
            pass
        if scope["method"] == "GET" and scope["path"] == "/health":
            self.health_checks += 1
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        self.arrivals.append(time.monotonic())
        if self.hold is not None:
            await self.hold.wait()
        if len(self.arrivals) <= self.refusals:
            status, body = self.status, b'{"error": {"message": "engine busy", "type": "overloaded", "code": 0}}'
            headers = [(b"content-type", b"application/json")]
            if self.retry_after is not None:
                headers.append((b"retry-after", self.retry_after.encode()))
        else:
            status, body, headers = 200, msgspec.json.encode(COMPLETION), [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def served(app: Gate, port: int | None = None) -> AsyncIterator[str]:
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning"))
    serving = asyncio.create_task(server.serve())
    await eventually(lambda: server.started or serving.done())
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await serving


async def register(f: Fleet, worker_id: int, url: str) -> None:
    worker = WorkerConfig(worker_id=worker_id, block_size=64, url=url, models=frozenset({MODEL}))
    async with httpx.AsyncClient(base_url=f.url) as http:
        assert (await http.post("/v1/workers", content=msgspec.json.encode(worker))).status_code == 201

"""Online replay: the trace against a running router over HTTP and mock workers over NATS, in real time.

The replayer plays the gateway. At each request's arrival it calls the router's ``POST /v1/new``
(msgpack, packed tokens, and the trace's output length as ``expected_output_tokens``, the hint the proxy
passes on from ``nvext.agent_hints.osl``), sends the request to the chosen worker (`mocker.wire`), calls
``POST /v1/mark_prefill`` when the worker reports the first token, ``POST /v1/record_output`` each time
it reports that the output opened a new KV block (as the offline replay tells the simulated router) and
``POST /v1/mark_free`` when it is done. Arrival times are the trace's (already divided by the trace
speedup); to run a trace faster than real time, compress arrivals with the speedup and start the workers
with the same engine ``speedup_ratio``: the replay then behaves like the original at that many times the
speed, and its latencies are that many times shorter. Records come out in the same shape as the offline
simulation's.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import httpx
import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from mocker.report import ReplayRecord, blank_records
from mocker.trace import Trace, TraceRequest
from mocker.wire import GenerateRequest, GenerateUpdate, generate_subject, reply_prefix

__all__ = ["OnlineReplayError", "replay_online", "wait_for_workers"]

_MSGPACK = "application/msgpack"
_encode = msgspec.msgpack.Encoder().encode
_decode_update = msgspec.msgpack.Decoder(GenerateUpdate).decode


class _Decision(msgspec.Struct):
    worker_id: int
    cached_tokens: int = 0


class _WorkersReply(msgspec.Struct):
    workers: list[msgspec.Raw]


_decode_decision = msgspec.msgpack.Decoder(_Decision).decode


class OnlineReplayError(RuntimeError):
    """The router or the workers failed in a way the replay cannot count as a rejection."""


async def wait_for_workers(http: httpx.AsyncClient, count: int, timeout_s: float = 30.0) -> None:
    """Wait until the router lists at least ``count`` workers."""
    deadline = time.monotonic() + timeout_s
    seen = 0
    while time.monotonic() < deadline:
        reply = await http.get("/v1/workers")
        if reply.status_code == 200:
            seen = len(msgspec.json.decode(reply.content, type=_WorkersReply).workers)
            if seen >= count:
                return
        await asyncio.sleep(0.1)
    raise OnlineReplayError(f"the router lists {seen} workers after {timeout_s:.0f} s; expected {count}")


class _Replayer:
    def __init__(self, trace: Trace, http: httpx.AsyncClient, nc: Client, namespace: str, timeout_s: float) -> None:
        self.trace = trace
        self.http = http
        self.nc = nc
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.records = blank_records(trace.requests)
        self.prefix = reply_prefix(namespace, uuid.uuid4().hex[:12])
        # Each update with when it arrived: the router calls made for earlier ones must not delay its time.
        self._updates: dict[str, asyncio.Queue[tuple[GenerateUpdate, float]]] = {}
        self._started = 0.0

    def now_ms(self) -> float:
        return (time.monotonic() - self._started) * 1000.0

    async def _on_update(self, message: Msg) -> None:
        update = _decode_update(message.data)
        queue = self._updates.get(update.request_id)
        if queue is not None:
            queue.put_nowait((update, self.now_ms()))

    async def run(self, progress: Callable[[int, int], None] | None) -> list[ReplayRecord]:
        subscription = await self.nc.subscribe(f"{self.prefix}.*", cb=self._on_update)
        try:
            self._started = time.monotonic()
            tasks = []
            total = len(self.trace.requests)
            for request in self.trace:
                delay = request.arrival_ms / 1000.0 - (time.monotonic() - self._started)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(self._one(request)))
            for done, task in enumerate(asyncio.as_completed(tasks), 1):
                await task
                if progress is not None:
                    progress(done, total)
        finally:
            await subscription.unsubscribe()
        return self.records

    async def _one(self, request: TraceRequest) -> None:
        record = self.records[request.index]
        request_id = f"{self.prefix.rsplit('.', 1)[-1]}-{request.request_id}"
        prompt = self.trace.prompt(request)
        reply = await self.http.post(
            "/v1/new",
            content=_encode(
                {"tokens": prompt, "request_id": request_id, "expected_output_tokens": request.output_length}
            ),
            headers={"content-type": _MSGPACK, "accept": _MSGPACK},
        )
        if reply.status_code in (429, 503):
            record.status = "rejected_by_router"
            return
        if reply.status_code != 200:
            raise OnlineReplayError(f"POST /v1/new answered {reply.status_code}: {reply.text[:200]}")
        decision = _decode_decision(reply.content)
        record.worker_id = decision.worker_id
        record.routed_ms = self.now_ms()
        record.predicted_cached_tokens = min(decision.cached_tokens, request.input_length)
        updates: asyncio.Queue[tuple[GenerateUpdate, float]] = asyncio.Queue()
        self._updates[request_id] = updates
        subject = generate_subject(self.namespace, decision.worker_id)
        message = GenerateRequest(
            request_id=request_id,
            tokens=prompt,
            max_tokens=request.output_length,
            reply=f"{self.prefix}.{request.index}",
        )
        try:
            await self.nc.publish(subject, _encode(message))
            while True:
                update, received_ms = await asyncio.wait_for(updates.get(), self.timeout_s)
                if update.kind == "first_token":
                    record.first_token_ms = received_ms
                    await self._mark("/v1/mark_prefill", request_id)
                    continue
                if update.kind == "output":
                    await self._mark("/v1/record_output", request_id, generated_tokens=update.generated_tokens)
                    continue
                record.cached_tokens = update.cached_tokens
                record.cached_blocks = update.cached_blocks
                record.prompt_blocks = update.prompt_blocks
                record.queued_in_engine = update.queued
                record.preemptions = update.preemptions
                if update.kind == "rejected":
                    record.status = "rejected_by_engine"
                else:
                    record.finished_ms = received_ms
                    record.status = "completed"
                await self._mark("/v1/mark_free", request_id)
                return
        except TimeoutError:
            record.status = "unfinished"
            await self._mark("/v1/mark_free", request_id)
        finally:
            del self._updates[request_id]

    async def _mark(self, path: str, request_id: str, **fields: int) -> None:
        body = {"request_id": request_id, **fields}
        await self.http.post(path, content=_encode(body), headers={"content-type": _MSGPACK})


async def replay_online(
    trace: Trace,
    router_url: str,
    nc: Client,
    *,
    namespace: str = "default",
    expect_workers: int = 1,
    timeout_s: float = 300.0,
    progress: Callable[[int, int], None] | None = None,
) -> list[ReplayRecord]:
    """Replay ``trace`` against the router at ``router_url`` and the mock workers on ``nc``.

    Waits first until the router lists ``expect_workers`` workers; a request with no answer from its
    worker for ``timeout_s`` is recorded as unfinished.
    """
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=router_url, timeout=timeout_s, limits=limits) as http:
        await wait_for_workers(http, expect_workers)
        return await _Replayer(trace, http, nc, namespace, timeout_s).run(progress)

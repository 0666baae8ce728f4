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

Every replay starts from the state each point of a capacity search starts from (`reset_fleet`): every
worker's prefix cache reset and the router's index empty, so a replay never measures the previous one's
warm caches. A request ends unfinished when its worker sends nothing for ``timeout_s`` or leaves the
router's worker list (its bookings dropped with it: the list is polled every `WORKER_POLL_S`). A
refusal by the router's queue or of a fleet all overloaded (429 ``queue_rejected``, 503
``all_workers_overloaded``) is a rejection; any other error (no worker left to route to, the router
gone) ends the run at once with `OnlineReplayError` or httpx's error, the requests still running
cancelled and, as when the run is cancelled (Ctrl-C), those the router still books marked free.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable

import httpx
import msgspec
from nats import errors as nats_errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from mocker.report import ReplayRecord, blank_records
from mocker.trace import Trace, TraceRequest
from mocker.wire import GenerateRequest, GenerateUpdate, generate_subject, reply_prefix, reset_subject

__all__ = ["WORKER_POLL_S", "OnlineReplayError", "listed_workers", "replay_online", "reset_fleet", "wait_for_workers"]

_MSGPACK = "application/msgpack"
_encode = msgspec.msgpack.Encoder().encode
_decode_update = msgspec.msgpack.Decoder(GenerateUpdate).decode

# How often the replay asks the router which workers it lists (a worker gone ends its requests).
WORKER_POLL_S = 0.5
# How long an ended run (an error, Ctrl-C) spends marking free the requests the router still books.
FREE_DEADLINE_S = 5.0
# /v1/new may park in the router's queue: its calls get a pool of their own, the marks that unpark them another.
_POOL = httpx.Limits(max_connections=256, max_keepalive_connections=256)
# The router's answers that refuse one request, not the run: its queue full, every worker overloaded.
_REJECTIONS = frozenset({"queue_rejected", "all_workers_overloaded"})
# ... and those that say it has no fleet to route to.
_NO_WORKERS = frozenset({"workers_unavailable", "no_eligible_worker"})


class _Timing(msgspec.Struct):
    queued_s: float = 0.0


class _Decision(msgspec.Struct):
    worker_id: int
    cached_tokens: int = 0
    timing: _Timing = msgspec.field(default_factory=_Timing)


class _ErrorBody(msgspec.Struct):
    type: str
    message: str = ""


class _ErrorReply(msgspec.Struct):
    error: _ErrorBody


class _WorkerId(msgspec.Struct):
    worker_id: int


class _WorkerStatus(msgspec.Struct):
    config: _WorkerId


class _Workers(msgspec.Struct):
    workers: list[_WorkerStatus]


class _DumpEntry(msgspec.Struct):
    predicted: bool = False  # approximate mode's, for a worker without KV events


_decode_decision = msgspec.msgpack.Decoder(_Decision).decode
_decode_dump = msgspec.json.Decoder(list[_DumpEntry]).decode
_decode_error = msgspec.json.Decoder(_ErrorReply).decode
_decode_workers = msgspec.json.Decoder(_Workers).decode


class OnlineReplayError(RuntimeError):
    """The router or the workers failed in a way the replay cannot count as a rejection."""


async def _ok(answer: Awaitable[httpx.Response]) -> httpx.Response:
    """The router's answer if it is a 200; any other (a 401 from a router guarding its reads) is an error."""
    reply = await answer
    if reply.status_code != 200:
        raise OnlineReplayError(
            f"{reply.request.method} {reply.request.url.path} answered {reply.status_code}: {reply.text[:200]}"
        )
    return reply


async def listed_workers(http: httpx.AsyncClient) -> list[int]:
    """The ids of the workers the router lists (``GET /v1/workers``)."""
    return [status.config.worker_id for status in _decode_workers((await _ok(http.get("/v1/workers"))).content).workers]


async def wait_for_workers(http: httpx.AsyncClient, count: int, timeout_s: float = 30.0) -> None:
    """Wait until the router lists at least ``count`` workers."""
    deadline = time.monotonic() + timeout_s
    seen = 0
    while time.monotonic() < deadline:
        reply = await http.get("/v1/workers")
        if reply.status_code == 200:
            seen = len(_decode_workers(reply.content).workers)
            if seen >= count:
                return
        await asyncio.sleep(0.1)
    raise OnlineReplayError(f"the router lists {seen} workers after {timeout_s:.0f} s; expected {count}")


async def reset_fleet(
    http: httpx.AsyncClient,
    nc: Client,
    namespace: str,
    *,
    settle_timeout_s: float = 10.0,
    busy_timeout_s: float = 30.0,
) -> None:
    """Reset the prefix cache of every worker the router lists and wait until the router's index holds
    nothing the workers reported: the clean state each replay starts from. (The blocks the router
    predicts for workers that publish no KV events stay: no event tells it of their reset.) A worker
    still running requests (a previous run's, interrupted) answers ``busy``: it is asked again until
    ``busy_timeout_s`` has passed."""
    for worker_id in await listed_workers(http):
        deadline = time.monotonic() + busy_timeout_s
        while True:
            try:
                reply = await nc.request(reset_subject(namespace, worker_id), b"", timeout=5)
            except nats_errors.Error as exc:  # no responder, a timeout: the worker is gone or stuck
                raise OnlineReplayError(
                    f"worker {worker_id} did not answer a prefix-cache reset: {type(exc).__name__}: {exc}"
                ) from exc
            if reply.data == b"ok":
                break
            if reply.data != b"busy" or time.monotonic() > deadline:
                raise OnlineReplayError(
                    f"worker {worker_id} refused a prefix-cache reset: {reply.data!r}"
                    + (f" for {busy_timeout_s:.0f} s" if reply.data == b"busy" else "")
                )
            await asyncio.sleep(0.2)
    deadline = time.monotonic() + settle_timeout_s
    while any(not entry.predicted for entry in _decode_dump((await _ok(http.get("/v1/dump"))).content)):
        if time.monotonic() > deadline:
            raise OnlineReplayError(f"the router still indexes blocks {settle_timeout_s:.0f} s after the resets")
        await asyncio.sleep(0.05)


_UNROUTED = -1  # a booked request's worker while its /v1/new is unanswered

# An update with when it arrived; None: the request's worker has left the router.
_Update = tuple[GenerateUpdate, float] | None


class _Replayer:
    def __init__(
        self,
        trace: Trace,
        http: httpx.AsyncClient,
        control: httpx.AsyncClient,
        nc: Client,
        namespace: str,
        timeout_s: float,
    ) -> None:
        self.trace = trace
        self.http = http  # /v1/new
        self.control = control  # the marks and the worker list: never queued behind a parked /v1/new
        self.nc = nc
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.records = blank_records(trace.requests)
        self.prefix = reply_prefix(namespace, uuid.uuid4().hex[:12])
        # Each update with when it arrived: the router calls made for earlier ones must not delay its time.
        self._updates: dict[str, asyncio.Queue[_Update]] = {}
        self._booked: dict[str, int] = {}  # request id -> its worker, until marked free
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
            await self._play(progress)
        except BaseExceptionGroup as failed:
            # The first failure says what ended the run; the others are its echoes (the router gone
            # fails every call in flight).
            raise _first(failed) from None
        finally:
            if self._booked:  # an error or a cancellation ended the run
                await self._free_booked()
            await subscription.unsubscribe()
        return self.records

    async def _play(self, progress: Callable[[int, int], None] | None) -> None:
        """Every request at its arrival, as a task of one group: the first to fail cancels the others."""
        total = len(self.trace.requests)
        done = 0

        def finished(task: asyncio.Task[None]) -> None:
            nonlocal done
            if progress is not None and not task.cancelled() and task.exception() is None:
                done += 1
                progress(done, total)

        self._started = time.monotonic()
        async with asyncio.TaskGroup() as group:
            watcher = group.create_task(self._watch_workers())
            requests = []
            for request in self.trace:
                delay = request.arrival_ms / 1000.0 - (time.monotonic() - self._started)
                if delay > 0:
                    await asyncio.sleep(delay)
                task = group.create_task(self._one(request))
                task.add_done_callback(finished)
                requests.append(task)
            if requests:
                await asyncio.wait(requests)
            watcher.cancel()

    async def _watch_workers(self) -> None:
        """End the requests whose worker the router no longer lists: it dropped their bookings, and no
        answer will come."""
        while True:
            await asyncio.sleep(WORKER_POLL_S)
            # Those routed before asking: a worker registered since is not taken for gone.
            routed = {request_id: worker for request_id, worker in self._booked.items() if worker != _UNROUTED}
            listed = set(await listed_workers(self.control))
            for request_id, worker_id in routed.items():
                queue = self._updates.get(request_id)
                if worker_id not in listed and queue is not None:
                    queue.put_nowait(None)

    async def _one(self, request: TraceRequest) -> None:
        record = self.records[request.index]
        request_id = f"{self.prefix.rsplit('.', 1)[-1]}-{request.request_id}"
        prompt = self.trace.prompt(request)
        self._booked[request_id] = _UNROUTED  # freed at an interruption even if the answer never arrives
        record.sent_ms = self.now_ms()
        reply = await self.http.post(
            "/v1/new",
            content=_encode(
                {"tokens": prompt, "request_id": request_id, "expected_output_tokens": request.output_length}
            ),
            headers={"content-type": _MSGPACK, "accept": _MSGPACK},
        )
        if reply.status_code != 200:
            del self._booked[request_id]
            if _refused(reply):
                record.status = "rejected_by_router"
                return
            raise _error(reply)
        decision = _decode_decision(reply.content)
        self._booked[request_id] = decision.worker_id
        record.worker_id = decision.worker_id
        record.routed_ms = self.now_ms()
        record.queued_in_router = decision.timing.queued_s > 0
        record.predicted_cached_tokens = min(decision.cached_tokens, request.input_length)
        updates: asyncio.Queue[_Update] = asyncio.Queue()
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
                try:
                    received = await asyncio.wait_for(updates.get(), self.timeout_s)
                except TimeoutError:
                    received = None
                if received is None:  # no answer in time, or the worker left: unfinished
                    break
                update, received_ms = received
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
                break
            await self._mark("/v1/mark_free", request_id)
            del self._booked[request_id]
        finally:
            del self._updates[request_id]

    async def _mark(self, path: str, request_id: str, **fields: int) -> None:
        body = {"request_id": request_id, **fields}
        await self.control.post(path, content=_encode(body), headers={"content-type": _MSGPACK})

    async def _free_booked(self) -> None:
        """Mark free every request the router still books for this run, within `FREE_DEADLINE_S` (the
        router may be the reason the run ended)."""
        with contextlib.suppress(TimeoutError, httpx.HTTPError):
            async with asyncio.timeout(FREE_DEADLINE_S):
                # Each tried whatever the others meet (one connection refused must not abandon the rest).
                await asyncio.gather(
                    *(self._mark("/v1/mark_free", request_id) for request_id in self._booked), return_exceptions=True
                )
        self._booked.clear()


def _refused(reply: httpx.Response) -> bool:
    return _error_type(reply) in _REJECTIONS


def _error_type(reply: httpx.Response) -> str | None:
    try:
        return _decode_error(reply.content).error.type
    except msgspec.DecodeError:
        return None


def _error(reply: httpx.Response) -> OnlineReplayError:
    kind = _error_type(reply)
    if kind in _NO_WORKERS:
        return OnlineReplayError(f"the router has no worker left to route to (POST /v1/new answered {kind})")
    return OnlineReplayError(f"POST /v1/new answered {reply.status_code}: {reply.text[:200]}")


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first(first) if isinstance(first, BaseExceptionGroup) else first


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

    Waits first until the router lists ``expect_workers`` workers and resets the fleet (`reset_fleet`); a
    request with no answer from its worker for ``timeout_s``, or whose worker leaves the router, is
    recorded as unfinished.
    """
    async with (
        httpx.AsyncClient(base_url=router_url, timeout=timeout_s, limits=_POOL) as http,
        httpx.AsyncClient(base_url=router_url, timeout=timeout_s, limits=_POOL) as control,
    ):
        await wait_for_workers(control, expect_workers)
        await reset_fleet(control, nc, namespace)
        return await _Replayer(trace, http, control, nc, namespace, timeout_s).run(progress)

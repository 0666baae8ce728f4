"""`MockWorker`: one `MockEngine` serving requests over NATS in real time, like an engine would.

It registers in the router's worker registry, heartbeats and answers resyncs through the worker-side
`KvEventPublisher`; publishes the engine's KV events after every pass (one NATS message per pass) and
its load (``ActiveLoad``) every ``load_interval_s``; takes requests on its generate subject and
prefix-cache resets (published as a ``cleared`` event) on its reset subject (`mocker.wire`).
Between passes it sleeps for the pass's simulated duration, so the engine's ``speedup_ratio`` is how
much faster than real time it runs.

With ``zmq`` (a `VllmZmqPublisher`, started and stopped by its owner: ``kv-router mock-worker`` binds
its endpoints before anything else starts) the KV events go out over ZMQ in vLLM's format instead, token
ids included, for ``kv-router bridge`` to carry to NATS: the bridge then registers, heartbeats and answers
resyncs, and this worker only serves requests.
Requests may also come over HTTP (`mocker.openai_api`, ``--http-port``): `open_stream` submits one
and, after every pass, its `TokenStream` receives the tokens the pass generated for it; the worker's
URL and model are then part of its registration, so a proxying router can forward to it.

``kv-router mock-worker`` runs one in its own process (`mocker.cli`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from mocker.block_pool import KvOp, Removed, Stored
from mocker.config import EngineConfig
from mocker.engine import MockEngine, PassResult, SeqState, Sequence
from mocker.wire import GenerateRequest, GenerateUpdate, UpdateKind, generate_subject, reset_subject
from mocker.zmq_engine import VllmZmqPublisher, vllm_batch
from router.event_plane.messages import ActiveLoad
from router.event_plane.publisher import KvEventPublisher
from router.types import HandoffStyle, WorkerConfig, WorkerRole

__all__ = ["MockWorker", "TokenStream"]

log = logging.getLogger(__name__)

# How far behind the wall clock a busy engine's timeline may run before it stops catching up.
_MAX_CATCH_UP_MS = 50.0

_decode_request = msgspec.msgpack.Decoder(GenerateRequest).decode
_encode = msgspec.msgpack.Encoder().encode


def _request_problem(request: GenerateRequest, in_flight: Mapping[str, str]) -> str | None:
    """Why a decoded generate request cannot be served, or None."""
    reply = request.reply
    # A subject to publish to: dot-separated tokens, none empty, no whitespace, no wildcards.
    if not reply or any(c.isspace() for c in reply) or "" in reply.split(".") or "*" in reply or ">" in reply:
        return f"reply {reply!r} is not a subject to publish to"
    if len(request.tokens) % 4:
        return f"tokens are {len(request.tokens)} bytes, not packed u32"
    if request.request_id in in_flight:
        return "a request of that id is in flight"
    return None


class WorkerStopped(Exception):
    """The worker's engine loop has ended: it takes no more requests."""


class TokenStream:
    """One HTTP request inside the engine: how many tokens it has, and a wake-up when that changes."""

    __slots__ = ("changed", "done", "seq", "tokens")

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        # As of the last pass whose end has come: the engine runs a pass ahead of the wall clock.
        self.tokens = 0
        self.done = False
        self.changed = asyncio.Event()


class MockWorker:
    def __init__(
        self,
        nc: Client,
        worker_id: int,
        engine: EngineConfig,
        *,
        namespace: str = "default",
        seed: int = 0,
        heartbeat_interval_s: float = 1.0,
        load_interval_s: float = 0.1,
        zmq: VllmZmqPublisher | None = None,
        url: str | None = None,
        models: frozenset[str] = frozenset(),
        role: WorkerRole = "both",
        handoff: HandoffStyle = "kv_transfer_params",
        bootstrap_port: int | None = None,
        kv_events: bool = True,
    ) -> None:
        """``kv_events`` off: registered so, and its engine's KV events are published nowhere (an engine
        run without them, whose cache the router predicts)."""
        self.nc = nc
        self.worker_id = worker_id
        self.namespace = namespace
        self.engine = MockEngine(engine, seed=seed)
        registration = WorkerConfig(
            worker_id=worker_id,
            block_size=engine.block_size,
            total_kv_blocks=engine.num_gpu_blocks,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            url=url,
            models=models,
            role=role,
            handoff=handoff,
            bootstrap_port=bootstrap_port,
            kv_events=kv_events,
        )
        self.role = role
        self.kv_events = kv_events
        self.publisher = KvEventPublisher(
            nc, registration, namespace=namespace, heartbeat_interval=heartbeat_interval_s
        )
        self._load_interval_s = load_interval_s
        self._replies: dict[str, str] = {}
        self._streams: dict[str, TokenStream] = {}
        self.stopped = False  # its engine loop has ended (`run` returned or was cancelled)
        self._work = asyncio.Event()
        self._subscriptions: list[Subscription] = []
        self._started = time.monotonic()
        self._last_load = -1.0
        self.zmq = zmq
        if zmq is not None:
            # Enough to cover every block the pool can hold plus those in flight.
            self.engine.record_block_tokens(4 * engine.num_gpu_blocks)

    def _now_ms(self) -> float:
        return (time.monotonic() - self._started) * 1000.0

    async def run(self) -> None:
        """Serve until cancelled; deregisters on the way out so routers drop this worker at once."""
        if self.zmq is None:
            await self.publisher.start()
        generate = generate_subject(self.namespace, self.worker_id)
        self._subscriptions = [
            await self.nc.subscribe(generate, cb=self._on_request),
            await self.nc.subscribe(reset_subject(self.namespace, self.worker_id), cb=self._on_reset),
        ]
        log.info("mock worker %d serving on %s", self.worker_id, generate)
        try:
            await self._serve()
        finally:
            # The engine runs no more: HTTP requests waiting on it end now (their clients told so)
            # rather than hold the worker's shutdown for ever; new ones are refused (`open_stream`).
            self.stopped = True
            for stream in self._streams.values():
                stream.changed.set()
            for subscription in self._subscriptions:
                await subscription.unsubscribe()
            if self.zmq is None:
                await self.publisher.stop(deregister=True)

    async def _serve(self) -> None:
        engine = self.engine
        busy_until = 0.0
        while True:
            if not engine.has_work():
                self._work.clear()
                await self._work.wait()
                busy_until = 0.0
            # While busy, a pass starts when the previous one ended on the engine's own timeline, even
            # if this loop woke up late, so publishing and scheduling overheads do not pile up into
            # drift; but never before a request it may admit arrived.
            newest = max((seq.arrival_ms for seq in engine.waiting), default=0.0)
            result = engine.step(max(busy_until, newest, self._now_ms() - _MAX_CATCH_UP_MS))
            busy_until = result.end_ms
            remaining_s = (result.end_ms - self._now_ms()) / 1000.0
            if remaining_s > 0:
                await asyncio.sleep(remaining_s)
            await self._publish(result)
            if not engine.has_work():
                await self._publish_load(force=True)  # the router sees it idle at once

    async def _on_request(self, message: Msg) -> None:
        try:
            request = _decode_request(message.data)
        except msgspec.DecodeError as exc:
            log.warning("undecodable generate request on %s: %s", message.subject, exc)
            return
        problem = _request_problem(request, self._replies)
        if problem is not None:
            # Refused on arrival: a reply subject NATS refuses would have been met in the engine loop,
            # raising there and ending the worker.
            log.warning("generate request %r on %s refused: %s", request.request_id, message.subject, problem)
            return
        seq = self.engine.submit(request.request_id, request.tokens, request.max_tokens, self._now_ms())
        if seq.state is SeqState.REJECTED:
            await self._reply(request.reply, seq, "rejected")
            return
        self._replies[request.request_id] = request.reply
        self._work.set()

    def open_stream(
        self, request_id: str, tokens: list[int], max_tokens: int, *, kv_loaded: bool = False
    ) -> TokenStream | None:
        """Submit an HTTP request; None if its prompt and output can never fit the pool. ``kv_loaded``: its
        prompt's KV came from a prefill worker (`MockEngine.submit`). Raises `WorkerStopped` once the
        engine loop has ended."""
        if self.stopped:
            raise WorkerStopped(f"mock worker {self.worker_id} is stopping")
        seq = self.engine.submit(request_id, tokens, max_tokens, self._now_ms(), kv_loaded=kv_loaded)
        if seq.state is SeqState.REJECTED:
            return None
        stream = self._streams[request_id] = TokenStream(seq)
        self._work.set()
        return stream

    def close_stream(self, request_id: str) -> None:
        """The HTTP request is over; if its client left early, the engine aborts it."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.done:
            self.engine.abort(stream.seq, self._now_ms())

    def _feed_streams(self) -> None:
        generated = self.engine.generated
        for request_id, stream in list(self._streams.items()):
            tokens = generated(stream.seq)
            done = stream.seq.state is SeqState.FINISHED
            if tokens != stream.tokens or done:
                stream.tokens = tokens
                stream.done = done
                stream.changed.set()
            if done:
                del self._streams[request_id]

    async def _on_reset(self, message: Msg) -> None:
        ops = self.engine.reset_prefix_cache()
        if ops is not None:
            await self._publish_ops(ops)
        if message.reply:
            await self.nc.publish(message.reply, b"ok" if ops is not None else b"busy")

    async def _publish_ops(self, ops: list[KvOp]) -> None:
        if not self.kv_events:
            return
        if self.zmq is not None:
            tokens = self.engine.block_tokens
            assert tokens is not None
            await self.zmq.send(vllm_batch(ops, tokens.__getitem__, self.engine.block_size))
            return
        publisher = self.publisher
        async with publisher.batch():
            for op in ops:
                if isinstance(op, Stored):
                    await publisher.stored(op.blocks, parent_hash=op.parent_hash)
                elif isinstance(op, Removed):
                    await publisher.removed(op.block_hashes)
                else:
                    await publisher.cleared()

    async def _publish(self, result: PassResult) -> None:
        if result.ops:
            await self._publish_ops(result.ops)
        for seq in result.first_tokens:
            await self._reply(self._replies.get(seq.request_id), seq, "first_token")
        for seq in result.opened_blocks:
            await self._reply(self._replies.get(seq.request_id), seq, "output")
        for seq in result.finished:
            await self._reply(self._replies.pop(seq.request_id, None), seq, "done")
        if self._streams:
            self._feed_streams()
        await self._publish_load()

    async def _reply(self, subject: str | None, seq: Sequence, kind: UpdateKind) -> None:
        if subject is None:
            return
        update = GenerateUpdate(
            request_id=seq.request_id,
            kind=kind,
            cached_tokens=max(seq.cached_tokens, 0),
            cached_blocks=seq.cached_blocks,
            prompt_blocks=seq.prompt_blocks,
            queued=seq.queued,
            preemptions=seq.preemptions,
            generated_tokens=self.engine.generated(seq),
        )
        await self.nc.publish(subject, _encode(update))

    async def _publish_load(self, *, force: bool = False) -> None:
        if self.zmq is not None:
            return  # an engine on ZMQ reports load through its own metrics, not the event plane
        now = time.monotonic()
        if not force and now - self._last_load < self._load_interval_s:
            return
        self._last_load = now
        metrics = self.engine.metrics()
        await self.publisher.publish_load(
            ActiveLoad(
                worker_id=self.worker_id,
                kv_used_blocks=metrics.active_blocks,
                active_prefill_tokens=metrics.prefill_tokens_pending,
            )
        )

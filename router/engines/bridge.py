"""`kv-router bridge`: a sidecar that hears one engine over ZMQ and speaks our NATS event plane.

Per dp rank one `ZmqEngineStream` (vLLM lays ranks out on consecutive ports: PUB ``port + rank``,
replay ``port + rank``) decodes the engine's batches; its own `PublisherSink` publishes them through
the one `KvEventPublisher`, which numbers each rank's events, registers the worker, heartbeats and answers
the routers' resyncs from what it holds. One NATS message per engine batch, or per run of batches
that were already queued when the stream got to them.

Rules carried over from the stream: an engine restart clears the rank (a ``cleared`` per storage tier
it used) and rebuilds it from what follows; a gap nobody can replay marks the rank unverified (the
publisher skips an event id, so routers see a gap, and refuses their resyncs of that rank until it
clears: the rank stays untrusted in every router's ``/v1/workers`` and metrics).

A bridge that starts drops the worker's registry entry before registering it again: routers forget
the worker's streams and resync it in full from this bridge, whose event ids start from 1 again.

With the engine's OpenAI URL (``--openai-url``) the registration carries it and the models the engine
serves (``--served-model``, or its ``/v1/models``), so ``kv-router serve --proxy`` can forward to the
worker. The engine's ``/health`` on that server (else its metrics endpoint) is probed: while it does
not answer the bridge stops heartbeating and deletes the worker's registry entry (every router drops
it and its blocks at once); when it answers again its ranks are cleared and replayed, and it registers.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections import Counter
from collections.abc import AsyncIterator

import msgspec
from nats.aio.client import Client

from indexer.engine_events import EngineEvent, EngineOffloaded, decode_engine_batch, namespace_seed
from indexer.errors import BlockNotFound
from indexer.events import StorageTier
from router.engines.bridge_config import BridgeConfig
from router.engines.engine_metrics import EngineMetricsScraper
from router.engines.engine_spec import EndpointRefused, rank_endpoint
from router.engines.hash_check import TokensHashCheck
from router.engines.openai_server import ENGINE_FAILURES_TO_DOWN, HealthProbe, wait_for_models
from router.engines.zmq_stream import PayloadApplied, ZmqEngineStream
from router.event_plane.messages import ActiveLoad
from router.event_plane.publisher import KvEventPublisher, open_registry

__all__ = ["Bridge", "PublisherSink"]

log = logging.getLogger(__name__)


def _netloc(nc: Client) -> str:
    """The server the client is connected to (its URL without credentials)."""
    url = nc.connected_url
    return "?" if url is None else f"{url.hostname}:{url.port}"


class PublisherSink:
    """Engine events of one stream (one dp rank's socket) into its worker's `KvEventPublisher`, one NATS
    message per stream batch. Each stream has a sink of its own: its batch is its own
    (`KvEventPublisher.engine_batch`), so one rank's batch never holds back, nor takes in, another's."""

    def __init__(self, publisher: KvEventPublisher) -> None:
        self.publisher = publisher
        self.stats: Counter[str] = Counter()
        self._open: list[bytes] | None = None  # the open batch's events, None outside `batch`

    @contextlib.asynccontextmanager
    async def batch(self) -> AsyncIterator[None]:
        if self._open is not None:  # within the stream's own open batch (a restart inside a tail check)
            yield
            return
        async with self.publisher.engine_batch() as events:
            self._open = events
            try:
                yield
            finally:
                self._open = None

    def _events(self) -> list[bytes]:
        events = self._open
        assert events is not None, "the stream applies inside its batch()"
        return events

    def apply(self, dp_rank: int, events: list[EngineEvent]) -> None:
        # A store under a parent the engine never stored is refused and never sent; so is each hash of
        # an offload naming a block the rank does not hold (counted per hash: a tier not added for it).
        for event, refusal in self.publisher.emit_engine_events(dp_rank, events, self._events()):
            if isinstance(event, EngineOffloaded) and isinstance(refusal, BlockNotFound):
                self.stats["rejected_offloaded_unresolved"] += len(refusal.missing)
            else:
                self.stats[f"rejected_{refusal.label}"] += 1

    def apply_payload(
        self, payload: bytes, block_size: int, cache_namespace: str | None, default_rank: int, check: TokensHashCheck
    ) -> PayloadApplied | None:
        """The stream's decode, hash check and `apply` of one engine payload, in one C call when it
        takes the batch (None: the stream runs its Python path)."""
        records = (check.by_content, check.by_hash, check.max_recorded)
        seed = namespace_seed(cache_namespace)
        taken = self.publisher.emit_engine_payload(payload, block_size, seed, default_rank, records, self._events())
        if taken is None:
            return None
        dp_rank, applied, count, ignored, contradictions = taken
        if applied < count:  # a refused store: the rest as `apply` does it (the C step took this batch)
            rest = decode_engine_batch(payload, block_size, cache_namespace=cache_namespace).events[applied:]
            self.apply(dp_rank, rest)
        return PayloadApplied(dp_rank, count, ignored, contradictions)

    def holds(self, dp_rank: int, block_hash: int) -> bool:
        return self.publisher.holds(dp_rank, block_hash)

    async def restarted(self, dp_rank: int) -> None:
        async with self.batch():
            tiers = sorted(self.publisher.held_tiers(dp_rank) | {StorageTier.DEVICE})
            self.publisher.emit_cleared(dp_rank, tiers, self._events())

    def unverified(self, dp_rank: int, reason: str) -> None:
        self.publisher.mark_unverified(dp_rank)


class Bridge:
    def __init__(self, config: BridgeConfig, nc: Client) -> None:
        self.config = config
        self.nc = nc
        self.publisher = KvEventPublisher(
            nc,
            config.registration(),
            namespace=config.namespace,
            heartbeat_interval=config.heartbeat_interval_secs,
        )
        self.sinks = [PublisherSink(self.publisher) for _ in range(config.dp_size)]
        self.streams = [
            ZmqEngineStream(
                self.sinks[rank],
                rank_endpoint(config.zmq_endpoint, rank),
                block_size=config.block_size,
                dp_rank=rank,
                topic=config.zmq_topic,
                replay_endpoint=None if config.replay_endpoint is None else rank_endpoint(config.replay_endpoint, rank),
                queue_size=config.queue_size,
                queue_bytes=config.queue_bytes,
                batch_window_s=config.batch_window_secs,
            )
            for rank in range(config.dp_size)
        ]
        self.health = (
            None
            if config.health_url is None
            else HealthProbe(
                config.health_url,
                on_up=self._up,
                on_down=self._down,
                interval_s=config.engine_health_interval_secs,
                timeout_s=config.engine_health_timeout_secs,
                failures_to_down=ENGINE_FAILURES_TO_DOWN,
                down_when_refused=True,
            )
        )
        # What `start` waits on without end (the engine's models, the worker registry), None once the
        # registry is reached: a signal before cuts the start short and says it; after, the start
        # completes (each step bounded) and the stop deregisters.
        self.waiting_for: str | None = "its start"
        self.withdrawn = False  # the engine stopped answering: the worker is out of the routers' registry
        self.scraper = (
            None
            if config.engine_metrics_url is None
            else EngineMetricsScraper(
                config.engine_metrics_url,
                self,
                worker_id=config.worker_id,
                engine=config.engine,
                total_kv_blocks=config.total_kv_blocks,
                interval_s=config.engine_metrics_interval_secs,
            )
        )

    def refused_events(self) -> Counter[str]:
        """Engine events the publisher refused, by reason (``rejected_<reason>``), over every rank's sink."""
        return sum((sink.stats for sink in self.sinks), Counter())

    async def start(self) -> None:
        base = self.config.openai_base
        if base is not None:
            self.waiting_for = f"the engine's models at {base}/v1/models"
            models = self.config.served_model or await wait_for_models(base)
            self.publisher.registration = msgspec.structs.replace(
                self.publisher.registration, url=base, models=frozenset(models)
            )
        self.waiting_for = f"the worker registry on NATS {_netloc(self.nc)}"
        # Routers forget what an earlier bridge of this worker numbered; they resync from this one.
        registry = await open_registry(self.nc, self.publisher.subjects)
        # Reached: from here a stop waits for the start's end, then deregisters (cut short while the
        # worker's entry is being put, it stayed in the registry until its lease ran out).
        self.waiting_for = None
        with contextlib.suppress(Exception):  # nothing to delete on a first start
            await registry.delete(str(self.config.worker_id))
        await self.publisher.start()
        try:
            for stream in self.streams:
                await stream.start()
        except EndpointRefused:
            await self.stop()  # the worker deregistered: it would never publish
            raise
        if self.scraper is not None:
            self.scraper.start()
        if self.health is not None:
            self.health.start()
        log.info(
            "bridge for worker %d: %s -> NATS %s (namespace %s)",
            self.config.worker_id,
            self.config.zmq_endpoint,
            _netloc(self.nc),
            self.config.namespace,
        )

    async def stop(self, *, deregister: bool = True) -> None:
        if self.health is not None:
            await self.health.stop()
        if self.scraper is not None:
            await self.scraper.stop()
        for stream in self.streams:
            await stream.stop()
        await self.publisher.stop(deregister=deregister)

    # ------------------------------------------------------------------ the scraper's sink
    async def publish_load(self, load: ActiveLoad) -> None:
        await self.publisher.publish_load(load)

    async def capacity_learned(self, kv_blocks: int) -> None:
        """The engine stated its KV blocks (no ``--total-kv-blocks`` was given): registered with them,
        so that routers know its capacity (the busy thresholds, the latency policy's cache fill)."""
        self.publisher.registration = msgspec.structs.replace(self.publisher.registration, total_kv_blocks=kv_blocks)
        if not self.withdrawn:
            await self.publisher.register()

    async def _down(self, problem: str) -> None:
        """The engine stopped answering: no more heartbeats, and the worker's registry entry deleted, so
        every router drops it (its blocks, streams and requests) at once rather than after its lease."""
        if self.withdrawn:
            return
        self.withdrawn = True
        log.warning(
            "engine of worker %d stopped answering %s (%s): withdrawn from the routers until it answers again",
            self.config.worker_id,
            self.config.health_url,
            problem,
        )
        await self.publisher.withdraw()

    async def _up(self) -> None:
        """The engine answers again: what it holds now is taken afresh (its ranks cleared, its replay
        buffer replayed), then the worker registers and heartbeats again; routers resync it from here."""
        if not self.withdrawn:
            return
        for stream in self.streams:
            await stream.rebuild()
        await self.publisher.register()
        self.publisher.start_heartbeat()
        self.withdrawn = False
        log.info("engine of worker %d answers again: registered", self.config.worker_id)

    async def start_service(self) -> None:
        """`start` as the bridge's process runs it (`run_until`, and the throughput bench, which
        measures what the service runs)."""
        await self.start()
        # What the process holds once started (its modules, the clients) lives as long as it does:
        # frozen, the collector never walks it again. A full collection of it stopped the bridge for
        # 45-55 ms every few seconds at 100k blocks/s, the lag's tail (docs/performance.md).
        gc.freeze()

    async def run_until(self, stopping: asyncio.Event) -> None:
        """The bridge as its process's one job (`kv-router bridge`), until ``stopping`` is set."""
        await self.start_service()
        try:
            await stopping.wait()
        finally:
            await self.stop()

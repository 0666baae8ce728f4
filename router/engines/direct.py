"""Direct mode: the router hears an engine's ZMQ events itself, without NATS or a bridge.

`SequencerSink` numbers each rank's events from 1, as a publisher would, and hands them to the
router's one door (``router.events.ingest``). An engine restart becomes a ``cleared`` barrier per
storage tier the rank used; an unrepairable gap marks the stream untrusted in the sequencer (shown
in ``/v1/workers`` and ``kv_router_worker_stream_trusted``) until the engine clears or restarts.

A worker the router does not know yet is registered with default capacity and a WARNING, so its
first events are not refused; ``POST /v1/workers`` can then give its real settings (the index is kept).
"""

from __future__ import annotations

import contextlib
import logging

from indexer.engine_events import EngineEvent, event_tier, to_kv_event
from indexer.events import RouterEvent, StorageTier, cleared_event
from router.engines.zmq_stream import ZmqEngineStream
from router.kv_router import KvRouter
from router.types import WorkerConfig

__all__ = ["DirectEngine", "SequencerSink", "ensure_registered", "parse_engine_zmq"]

log = logging.getLogger(__name__)


def ensure_registered(router: KvRouter, worker_id: int, source: str) -> None:
    """Register a worker first heard from its events, with default capacity and a WARNING."""
    if not router.has_worker(worker_id):
        log.warning(
            "%s events from worker %d, which is not registered: registering it with default capacity "
            "(POST /v1/workers or the config file to set its capacity and taints)",
            source,
            worker_id,
        )
        router.register_worker(WorkerConfig(worker_id=worker_id, block_size=router.config.block_size, leased=False))


class SequencerSink:
    def __init__(self, router: KvRouter, worker_id: int) -> None:
        self.router = router
        self.worker_id = worker_id
        self._last_id: dict[int, int] = {}
        self._tiers: dict[int, set[StorageTier]] = {}

    def _ensure_registered(self) -> None:
        ensure_registered(self.router, self.worker_id, "engine")

    def _next_id(self, dp_rank: int) -> int:
        event_id = self._last_id.get(dp_rank, 0) + 1
        self._last_id[dp_rank] = event_id
        return event_id

    def batch(self) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()  # each batch reaches the sequencer as it is applied

    def apply(self, dp_rank: int, events: list[EngineEvent]) -> None:
        self._ensure_registered()
        tiers = self._tiers.setdefault(dp_rank, set())
        batch = []
        for event in events:
            tier = event_tier(event)
            tiers.add(tier)
            batch.append(RouterEvent(self.worker_id, to_kv_event(event, self._next_id(dp_rank), dp_rank), tier))
        self.router.events.ingest(batch)

    async def restarted(self, dp_rank: int) -> None:
        self._ensure_registered()
        tiers = self._tiers.get(dp_rank) or {StorageTier.DEVICE}
        self.router.events.ingest(
            RouterEvent(self.worker_id, cleared_event(self._next_id(dp_rank), dp_rank=dp_rank), tier)
            for tier in sorted(tiers | {StorageTier.DEVICE})
        )

    def unverified(self, dp_rank: int, reason: str) -> None:
        self.router.events.mark_untrusted(self.worker_id, dp_rank)


def parse_engine_zmq(spec: str) -> tuple[int, str, str | None]:
    """``WORKER_ID=tcp://HOST:PORT[,replay=tcp://HOST:PORT]`` -> (worker id, endpoint, replay endpoint)."""
    worker, sep, rest = spec.partition("=")
    try:
        worker_id = int(worker.strip())
    except ValueError:
        raise ValueError(f"engine_zmq {spec!r}: expected WORKER_ID=tcp://HOST:PORT[,replay=tcp://HOST:PORT]") from None
    parts = [part.strip() for part in rest.split(",")]
    if not sep or not parts[0]:
        raise ValueError(f"engine_zmq {spec!r}: no endpoint after {worker!r}=")
    replay = None
    for option in parts[1:]:
        key, _, value = option.partition("=")
        if key != "replay" or not value:
            raise ValueError(f"engine_zmq {spec!r}: unknown option {option!r} (only replay=tcp://HOST:PORT)")
        replay = value
    return worker_id, parts[0], replay


class DirectEngine:
    """One ``--engine-zmq`` source feeding the router's sequencer."""

    def __init__(self, router: KvRouter, spec: str, *, topic: str = "") -> None:
        worker_id, endpoint, replay = parse_engine_zmq(spec)
        self.worker_id = worker_id
        self.stream = ZmqEngineStream(
            SequencerSink(router, worker_id),
            endpoint,
            block_size=router.config.block_size,
            replay_endpoint=replay,
            topic=topic,
        )

    async def start(self) -> None:
        await self.stream.start()

    async def stop(self) -> None:
        await self.stream.stop()

"""Direct mode: the router hears an engine's ZMQ events itself, without NATS or a bridge.

`SequencerSink` numbers each rank's events from 1, as a publisher would, and hands them to the
router's one door (``router.events.ingest``). An engine restart becomes a ``cleared`` barrier per
storage tier the rank used; an unrepairable gap marks the stream untrusted in the sequencer (shown
in ``/v1/workers`` and ``kv_router_worker_stream_trusted``) until the engine clears or restarts.

A worker the router does not know yet is registered with default capacity and a WARNING, so its
first events are not refused, with every dp rank its events show (`LearnedWorkers`); ``POST
/v1/workers`` can then give its real settings (the index is kept).
"""

from __future__ import annotations

import contextlib
import logging

import msgspec

from indexer.engine_events import EngineEvent, event_tier, to_kv_event
from indexer.events import RouterEvent, StorageTier, cleared_event
from router.engines.zmq_stream import ZmqEngineStream
from router.kv_router import KvRouter
from router.types import WorkerConfig

__all__ = ["DirectEngine", "LearnedWorkers", "SequencerSink", "parse_engine_zmq"]

log = logging.getLogger(__name__)


class LearnedWorkers:
    """Workers a source registered itself because it heard their events first, with every dp rank seen.

    A worker first heard from gets default capacity and a WARNING, so its first events are not refused;
    each dp rank that then appears in its events or load reports widens its registration to cover it
    (an engine's dp ranks are contiguous, so the range from the lowest to the highest rank seen). A
    worker someone else registered (``POST /v1/workers``, the config file, the registry) keeps the
    ranks it was given: its configuration is theirs to change.
    """

    def __init__(self, router: KvRouter, source: str) -> None:
        self.router = router
        self.source = source
        self._registered: dict[int, WorkerConfig] = {}

    def ensure(self, worker_id: int, dp_rank: int) -> None:
        """Make ``(worker_id, dp_rank)`` routable if this source learned the worker; raises
        `ValueError` for a rank no registration can hold (beyond u32 or ``MAX_DP_SIZE`` ranks)."""
        router = self.router
        worker = router.worker(worker_id)
        if worker is None:
            log.warning(
                "%s events from worker %d, which is not registered: registering it with default capacity "
                "(POST /v1/workers or the config file to set its capacity and taints)",
                self.source,
                worker_id,
            )
            config = WorkerConfig(
                worker_id=worker_id, dp_start_rank=dp_rank, block_size=router.config.block_size, leased=False
            )
        elif dp_rank in worker.dp_ranks or self._registered.get(worker_id) != worker:
            return
        else:
            start = min(worker.dp_start_rank, dp_rank)
            end = max(worker.dp_ranks[-1], dp_rank)
            config = msgspec.structs.replace(worker, dp_start_rank=start, dp_size=end - start + 1)
            log.info(
                "%s worker %d: dp rank %d heard, routing to ranks %d..%d", self.source, worker_id, dp_rank, start, end
            )
        router.register_worker(config)
        self._registered[worker_id] = config


class SequencerSink:
    def __init__(self, router: KvRouter, worker_id: int) -> None:
        self.router = router
        self.worker_id = worker_id
        self._learned = LearnedWorkers(router, "engine")
        self._last_id: dict[int, int] = {}
        self._tiers: dict[int, set[StorageTier]] = {}

    def _ensure_registered(self, dp_rank: int) -> None:
        self._learned.ensure(self.worker_id, dp_rank)

    def _next_id(self, dp_rank: int) -> int:
        event_id = self._last_id.get(dp_rank, 0) + 1
        self._last_id[dp_rank] = event_id
        return event_id

    def batch(self) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()  # each batch reaches the sequencer as it is applied

    def apply(self, dp_rank: int, events: list[EngineEvent]) -> None:
        try:
            self._ensure_registered(dp_rank)
        except ValueError as exc:  # a rank no registration can hold: the batch cannot be routed to
            log.warning("engine worker %d: batch for dp rank %d dropped: %s", self.worker_id, dp_rank, exc)
            return
        tiers = self._tiers.setdefault(dp_rank, set())
        batch = []
        for event in events:
            tier = event_tier(event)
            tiers.add(tier)
            batch.append(RouterEvent(self.worker_id, to_kv_event(event, self._next_id(dp_rank), dp_rank), tier))
        self.router.events.ingest(batch)

    async def restarted(self, dp_rank: int) -> None:
        self._ensure_registered(dp_rank)
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

"""NVIDIA Dynamo workers on NATS (``DYN_EVENT_PLANE=nats``) as they are: their own subjects and envelope.

A Dynamo 1.6.1 worker publishes on ``namespace.<ns>.component.<comp>.endpoint.<ep>.kv-events`` a
msgpack ``EventEnvelope`` with named fields ``topic, publisher_id, sequence, published_at, payload``
whose ``payload`` (msgpack bin) is a list of ``RouterEvent``s, and its load (``ActiveLoad``) the same
way on ``...kv_metrics`` (``shared/reference/dynamo-router.md`` §5.3). `DynamoNatsSource` subscribes
to both for one ``NS.COMPONENT.ENDPOINT``:

- ``sequence`` counts each publisher's messages: a jump is a gap, and the ranks that publisher feeds
  are marked untrusted (Dynamo workers serve no resync on our subjects);
- Dynamo runs one publisher per (worker, dp rank): a new ``publisher_id`` on a rank is a restart,
  and the rank is cleared (every storage tier) before the new publisher's events apply;
- events are renumbered per rank from 1 (Dynamo's own ids start at 0) and enter through the router's
  one door, ``router.sequencer.ingest``;
- a worker that is not registered is learned from its events with a WARNING and default capacity,
  with every dp rank its events or load reports show (`LearnedWorkers`: each rank routable with its
  own load; Dynamo runs one publisher per rank and one metrics publisher for all of them).
"""

from __future__ import annotations

import logging
from collections import Counter

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from indexer.errors import UNDECODABLE, EventDecodeError
from indexer.events import RouterEvent, StorageTier, cleared_event, decode_router_events
from indexer.slots import WorkerRank
from router.engines.learned_workers import LearnedWorkers
from router.errors import UnknownWorker
from router.event_plane.messages import ActiveLoad
from router.event_plane.ratelimited_log import RateLimitedLog
from router.kv_router import KvRouter

__all__ = ["DynamoEndpoint", "DynamoNatsSource", "EventEnvelope"]

log = logging.getLogger(__name__)


class EventEnvelope(msgspec.Struct, kw_only=True):
    """Dynamo's event-plane envelope (``rmp_serde::to_vec_named``)."""

    publisher_id: int
    sequence: int
    payload: bytes
    topic: str = ""
    published_at: int = 0


class DynamoEndpoint(msgspec.Struct, frozen=True):
    namespace: str
    component: str
    endpoint: str

    @classmethod
    def parse(cls, spec: str) -> DynamoEndpoint:
        parts = spec.split(".")
        if len(parts) != 3 or not all(parts):
            raise ValueError(f"dynamo_endpoint {spec!r}: expected NAMESPACE.COMPONENT.ENDPOINT")
        return cls(*parts)

    def subject(self, topic: str) -> str:
        return f"namespace.{self.namespace}.component.{self.component}.endpoint.{self.endpoint}.{topic}"


_envelope = msgspec.msgpack.Decoder(EventEnvelope)
_load = msgspec.msgpack.Decoder(ActiveLoad)


class DynamoNatsSource:
    def __init__(self, nc: Client, router: KvRouter, endpoint: str) -> None:
        self.nc = nc
        self.router = router
        self.endpoint = DynamoEndpoint.parse(endpoint)
        self.stats: Counter[str] = Counter()
        self._last_sequence: dict[int, int] = {}  # publisher id -> its last sequence
        self._publisher_ranks: dict[int, set[WorkerRank]] = {}
        self._rank_publisher: dict[WorkerRank, int] = {}
        self._last_id: dict[WorkerRank, int] = {}
        self._subscriptions: list[Subscription] = []
        self._bad_input = RateLimitedLog(log)
        self._learned = LearnedWorkers(router, "Dynamo")

    async def start(self) -> None:
        self._subscriptions = [
            await self.nc.subscribe(self.endpoint.subject("kv-events"), cb=self._on_events),
            await self.nc.subscribe(self.endpoint.subject("kv_metrics"), cb=self._on_load),
        ]

    async def stop(self) -> None:
        for subscription in self._subscriptions:
            await subscription.unsubscribe()
        self._subscriptions = []

    # ------------------------------------------------------------------ events
    async def _on_events(self, message: Msg) -> None:
        try:
            envelope = _envelope.decode(message.data)
            events = decode_router_events(envelope.payload, msgpack=None)
        except (*UNDECODABLE, EventDecodeError) as exc:
            self._reject("undecodable", f"on {message.subject}: {exc}")
            return
        self.take(envelope, events)

    def take(self, envelope: EventEnvelope, events: list[RouterEvent]) -> None:
        """One envelope's events (public for tests that drive the order)."""
        publisher = envelope.publisher_id
        last = self._last_sequence.get(publisher)
        self._last_sequence[publisher] = envelope.sequence
        if last is not None and envelope.sequence > last + 1:
            self.stats["gaps"] += 1
            log.warning("Dynamo publisher %d skipped %d messages", publisher, envelope.sequence - last - 1)
            for worker_id, dp_rank in sorted(self._publisher_ranks.get(publisher, ())):
                self.router.sequencer.mark_untrusted(worker_id, dp_rank)
        batch: list[RouterEvent] = []
        for event in events:
            rank = (event.worker_id, event.event.dp_rank)
            try:
                self._learned.ensure(*rank)
            except ValueError as exc:
                self._reject("bad_dp_rank", f"worker {rank[0]} dp_rank {rank[1]}: {exc}")
                continue
            previous = self._rank_publisher.get(rank)
            if previous != publisher:
                self._rank_publisher[rank] = publisher
                self._publisher_ranks.setdefault(publisher, set()).add(rank)
                if previous is not None:
                    self.stats["restarts"] += 1
                    log.warning("worker %d dp_rank %d has a new publisher: clearing the rank", *rank)
                    for tier in StorageTier:  # the old process's host, disk and external blocks went too
                        clear = cleared_event(self._next_id(rank), dp_rank=rank[1])
                        batch.append(RouterEvent(rank[0], clear, tier))
            renumbered = msgspec.structs.replace(event.event, event_id=self._next_id(rank))
            batch.append(RouterEvent(event.worker_id, renumbered, event.storage_tier))
        self.stats["messages"] += 1
        self.stats["events"] += len(events)
        self.router.sequencer.ingest(batch)

    def _next_id(self, rank: WorkerRank) -> int:
        event_id = self._last_id.get(rank, 0) + 1
        self._last_id[rank] = event_id
        return event_id

    # ------------------------------------------------------------------ load
    async def _on_load(self, message: Msg) -> None:
        try:
            load = _load.decode(_envelope.decode(message.data).payload)
        except UNDECODABLE as exc:
            self._reject("undecodable_load", f"on {message.subject}: {exc}")
            return
        if load.kv_used_blocks is None:
            return
        try:
            self._learned.ensure(load.worker_id, load.dp_rank)
            self.router.update_kv_used_blocks(load.worker_id, load.dp_rank, load.kv_used_blocks)
        except (UnknownWorker, KeyError, ValueError) as exc:
            self._reject("load_for_unknown_rank", str(exc))
            return
        self.stats["loads"] += 1

    def _reject(self, reason: str, message: str) -> None:
        self.stats[f"rejected_{reason}"] += 1
        self._bad_input.warning(f"Dynamo {reason}", message)

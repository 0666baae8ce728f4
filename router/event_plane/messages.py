"""Control-plane wire types that travel beside the KV events over NATS (see design.md, NATS layout).

- ``WorkerConfig`` (from `router.types`): a worker's entry in the registry bucket ``kv_router_workers_{ns}``.
- ``Heartbeat``: liveness on ``kv.{ns}.heartbeat.{worker_id}``.
- ``ActiveLoad``: load on ``kv.{ns}.load.{worker_id}``, Dynamo's ``kv_metrics`` shape.
- ``Refusal``: a router telling a worker on ``kv.{ns}.refused.{worker_id}`` that it refused its
  registration (a block size that is not the router's), so the worker can say so itself.
- ``ResyncRequest`` / ``ResyncResponse`` (from `indexer.events`, since the sequencer speaks them):
  request/reply on ``kv.{ns}.resync.{worker_id}``.
"""

from __future__ import annotations

import msgspec

from indexer.events import U32, U64, NonNegative
from router.types import WorkerConfig

__all__ = [
    "ActiveLoad",
    "Heartbeat",
    "Refusal",
]


class Heartbeat(msgspec.Struct, kw_only=True, frozen=True):
    """Liveness; carries the registration so a worker a router expired rejoins by beating again."""

    worker_id: U64
    sent_at_ms: NonNegative = 0
    registration: WorkerConfig | None = None


class ActiveLoad(msgspec.Struct, kw_only=True, frozen=True):
    """A (worker, dp_rank)'s load as the worker sees it; unset fields are unknown.

    The first five fields are Dynamo 1.6.1's ``ActiveLoad``. The engine's own request counts
    (``num_requests_waiting`` / ``num_requests_running``, scraped from its Prometheus endpoint by
    `kv-router bridge`) are ours: Dynamo's decoder ignores keys it does not know, and ours read
    Dynamo's messages without them."""

    worker_id: U64
    dp_rank: U32 = 0
    kv_used_blocks: NonNegative | None = None
    active_decode_blocks: NonNegative | None = None
    active_prefill_tokens: NonNegative | None = None
    num_requests_waiting: NonNegative | None = None
    num_requests_running: NonNegative | None = None


class Refusal(msgspec.Struct, kw_only=True, frozen=True):
    """A router refused this worker's registration; it is not routed until it registers again."""

    worker_id: U64
    reason: str
    router_block_size: int

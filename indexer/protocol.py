"""Control-plane wire types that travel beside the KV events over NATS (see design.md, NATS layout).

- ``WorkerRegistration``: a worker's entry in the registry bucket ``kv_router_workers_{ns}``.
- ``Heartbeat``: liveness on ``kv.{ns}.heartbeat.{worker_id}``.
- ``ActiveLoad``: load on ``kv.{ns}.load.{worker_id}``, Dynamo's ``kv_metrics`` shape.
- ``ResyncRequest`` / ``ResyncResponse``: request/reply on ``kv.{ns}.resync.{worker_id}``, Dynamo's
  ``WorkerKvQueryRequest`` / ``WorkerKvQueryResponse`` (externally tagged) plus the dp rank.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from indexer.events import U32, U64, RouterEvent

__all__ = [
    "ActiveLoad",
    "Heartbeat",
    "ResyncBatch",
    "ResyncRequest",
    "ResyncResponse",
    "ResyncTooNew",
    "WorkerRegistration",
]

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class WorkerRegistration(msgspec.Struct, kw_only=True, frozen=True):
    """How a worker describes itself to routers: dp ranks, cache geometry, capacity and taints."""

    worker_id: U64
    dp_start_rank: U32 = 0
    dp_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    block_size: Annotated[int, msgspec.Meta(ge=1)] | None = None
    total_kv_blocks: NonNegative | None = None
    max_num_batched_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    taints: list[str] = []
    # Leased workers must heartbeat to stay routable; static ones (e.g. registered over HTTP) need not.
    leased: bool = True


class Heartbeat(msgspec.Struct, kw_only=True, frozen=True):
    """Liveness; carries the registration so a worker a router expired rejoins by beating again."""

    worker_id: U64
    sent_at_ms: NonNegative = 0
    registration: WorkerRegistration | None = None


class ActiveLoad(msgspec.Struct, kw_only=True, frozen=True):
    """A (worker, dp_rank)'s load as the worker sees it; unset fields are unknown."""

    worker_id: U64
    dp_rank: U32 = 0
    kv_used_blocks: NonNegative | None = None
    active_decode_blocks: NonNegative | None = None
    active_prefill_tokens: NonNegative | None = None


class ResyncRequest(msgspec.Struct, kw_only=True, frozen=True):
    """Ask a worker for events ``start_event_id..end_event_id`` of one rank; no start = full dump."""

    worker_id: U64
    dp_rank: U32 = 0
    start_event_id: U64 | None = None
    end_event_id: U64 | None = None


class ResyncBatch(msgspec.Struct, kw_only=True, frozen=True):
    events: list[RouterEvent]
    last_event_id: NonNegative


class ResyncTooNew(msgspec.Struct, kw_only=True, frozen=True):
    requested_start: NonNegative
    requested_end: NonNegative | None
    newest_available: NonNegative


class ResyncResponse(
    msgspec.Struct,
    kw_only=True,
    frozen=True,
    omit_defaults=True,
    rename={"events": "Events", "tree_dump": "TreeDump", "too_new": "TooNew", "error": "Error"},
):
    """Exactly one of: the missing events, a full dump replacing the rank's state, or why not."""

    events: ResyncBatch | None = None
    tree_dump: ResyncBatch | None = None
    too_new: ResyncTooNew | None = None
    error: str | None = None

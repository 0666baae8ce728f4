"""The HTTP API's request and response bodies, built on the router's own structs.

``POST /v1/router`` speaks Dynamo 1.6.1's ``RouterRequest`` / ``RouterResponse``
(`reference/dynamo-router.md` §5.1): both are tagged by ``"method"``, and the request variants are
the router's `RouteRequest` and friends with a tag added, not copies of their fields. The separate
routes (``/v1/new``, ...) take the same bodies without ``"method"``.

Prompts: ``tokens`` is a list of u32 token ids or, in msgpack, one bin of packed little-endian u32
(in JSON the same bytes may come base64-encoded). Ids are range-checked when the router packs them
for hashing, its first step, before it reads or changes any state: a range constraint here would
check the 16k ids of a long prompt a second time (about 15% of decoding them).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from indexer.events import RouterEvent
from indexer.sequencer import StreamStatus
from router.types import BlockMmInfos, PotentialLoad, QueueRejection, RankLoad, RouteRequest, Tokens, WorkerConfig

__all__ = [
    "EventPlaneHealth",
    "EventsReply",
    "MarkReply",
    "MarkRequest",
    "NewRequest",
    "OutputProgress",
    "PotentialLoadsReply",
    "PotentialLoadsRequest",
    "RequestId",
    "RouterFreeMarked",
    "RouterMarkFree",
    "RouterMarkPrefill",
    "RouterNew",
    "RouterNewResponse",
    "RouterPotentialLoads",
    "RouterPotentialLoadsResponse",
    "RouterPrefillMarked",
    "RouterQueueRejected",
    "RouterRequest",
    "RouterResponse",
    "ServiceInfo",
    "WorkerStatus",
    "WorkersReply",
]

# Request ids travel back in the X-Request-Id header, so they must be valid header text: visible
# ASCII, no spaces, bounded length.
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")]


# ---------------------------------------------------------------- requests
class NewRequest(RouteRequest, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/new``: a `RouteRequest`; ``explain`` adds the per-candidate explanation."""

    request_id: RequestId | None = None
    explain: bool = False


class PotentialLoadsRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/potential_loads`` and ``POST /v1/overlap``: a prompt and its hash salts."""

    tokens: Tokens
    block_mm_infos: BlockMmInfos | None = None
    lora_name: str | None = None
    cache_namespace: str | None = None


class MarkRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/mark_prefill`` and ``/v1/mark_free``; the id may come as ``X-Request-Id`` instead."""

    request_id: RequestId | None = None


class OutputProgress(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/record_output``: how many tokens the request has generated so far (its total, not an
    increment); the id may come as ``X-Request-Id`` instead."""

    request_id: RequestId | None = None
    generated_tokens: Annotated[int, msgspec.Meta(ge=0)]


class RouterNew(RouteRequest, tag="new", tag_field="method", kw_only=True, forbid_unknown_fields=True):
    request_id: RequestId | None = None


class RouterPotentialLoads(PotentialLoadsRequest, tag="potential_loads", tag_field="method"):
    pass


class RouterMarkPrefill(MarkRequest, tag="mark_prefill", tag_field="method"):
    pass


class RouterMarkFree(MarkRequest, tag="mark_free", tag_field="method"):
    pass


RouterRequest = RouterNew | RouterPotentialLoads | RouterMarkPrefill | RouterMarkFree


# ---------------------------------------------------------------- responses
class RouterNewResponse(msgspec.Struct, kw_only=True, tag="new", tag_field="method"):
    worker_id: int
    dp_rank: int
    overlap_blocks: int


class RouterQueueRejected(msgspec.Struct, kw_only=True, tag="queue_rejected", tag_field="method"):
    rejection: QueueRejection


class RouterPrefillMarked(msgspec.Struct, kw_only=True, tag="prefill_marked", tag_field="method"):
    success: bool


class RouterFreeMarked(msgspec.Struct, kw_only=True, tag="free_marked", tag_field="method"):
    success: bool


class PotentialLoadsReply(msgspec.Struct, kw_only=True):
    """Every (worker, dp_rank)'s load if the prompt went there, and the queue (§4.5, §4.7)."""

    loads: list[PotentialLoad]
    pending_count: int
    pending_isl_tokens: int


class RouterPotentialLoadsResponse(PotentialLoadsReply, tag="potential_loads", tag_field="method"):
    pass


RouterResponse = (
    RouterNewResponse | RouterQueueRejected | RouterPrefillMarked | RouterFreeMarked | RouterPotentialLoadsResponse
)


class MarkReply(msgspec.Struct, kw_only=True):
    request_id: str
    success: bool


class WorkerStatus(msgspec.Struct, kw_only=True):
    config: WorkerConfig
    ranks: list[RankLoad]
    # Per dp rank, the state of its NATS event stream (empty without an event plane): the last
    # applied event id, and whether it is trusted (no gap since the last sync).
    event_streams: list[StreamStatus] = []


class WorkersReply(msgspec.Struct, kw_only=True):
    workers: list[WorkerStatus]


class EventsReply(msgspec.Struct, kw_only=True):
    """What became of a batch of events: the counts by outcome, and the last rejections' reasons.

    Events pass the same sequencer as those from NATS: ``duplicate`` ones (an id already applied for
    that worker and dp rank) are dropped; ``applied`` counts every event that reached the index during
    the call, including events held earlier that this call released.
    """

    received: int
    applied: int
    rejected: int
    duplicate: int = 0
    errors: list[str] = []


# Re-exported for the dump route's schema.
DumpReply = list[RouterEvent]


class PredictedRouterEvent(RouterEvent, kw_only=True):
    """A block in ``/v1/dump`` that approximate mode predicted from routing (the worker sends no events)."""

    predicted: bool = True


# ---------------------------------------------------------------- operations
class EventPlaneHealth(msgspec.Struct, kw_only=True, frozen=True):
    """The NATS event plane in ``/healthz`` and ``/readyz``: ``connecting`` until it first starts, then
    ``connected`` or ``disconnected`` (routing goes on with the index it has), for ``state_for_s``."""

    state: str
    nats_url: str
    state_for_s: float
    disconnects: int
    last_error: str | None = None


class ServiceInfo(msgspec.Struct, kw_only=True, frozen=True):
    """``GET /v1/info``: what a worker or an operator needs to join this router."""

    version: str
    nats_url: str | None
    nats_namespace: str
    block_size: int
    policy: str
    native: list[str]  # the C accelerators running, by layer; empty: the pure-Python code runs

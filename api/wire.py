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

import re
import uuid
from typing import Annotated, Any

import msgspec

from indexer.events import U32, U64, U64_MAX, NonNegative, RouterEvent
from indexer.sequencer import StreamStatus
from router.types import (
    BlockMmInfos,
    DecisionExplanation,
    DecisionReceipt,
    DisaggregationReceipt,
    Finite,
    PotentialLoad,
    QueueRejection,
    RankLoad,
    RouteDecision,
    RouterConfigOverride,
    RouteRequest,
    RoutingConstraints,
    Tokens,
    WorkerAvailability,
    WorkerConfig,
)

__all__ = [
    "MAX_REQUEST_ID",
    "QUERY_INSTANCE_ID",
    "AgentHints",
    "BlockExtraInfo",
    "BlockMmObjectInfo",
    "BootstrapInfo",
    "EventPlaneHealth",
    "EventsReply",
    "MarkReply",
    "MarkRequest",
    "MmRoutingInfo",
    "NewRequest",
    "NvExt",
    "NvExtResponse",
    "OutputProgress",
    "PotentialLoadsReply",
    "PotentialLoadsRequest",
    "PrefillResult",
    "PreprocessedRequest",
    "RequestId",
    "RouteBody",
    "RouteReply",
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
    "RouterRoute",
    "RouterRouteResponse",
    "RoutingHints",
    "ServiceInfo",
    "TraceLink",
    "WorkerIdInfo",
    "WorkerRegistration",
    "WorkerStatus",
    "WorkersReply",
    "is_request_id",
    "queries_instance",
]

# Request ids travel back in the X-Request-Id header, so they must be valid header text: visible
# ASCII, no spaces, bounded length.
_ID_CHAR = r"[\x21-\x7e]"
MAX_REQUEST_ID = 256
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQUEST_ID, pattern=f"^{_ID_CHAR}+$")]
# The same rule for a text outside a body (X-Request-Id), checked per request: a compiled match, not a
# msgspec.convert (which looks the annotated type up again on every call).
is_request_id = re.compile(f"{_ID_CHAR}{{1,{MAX_REQUEST_ID}}}").fullmatch


# ---------------------------------------------------------------- Dynamo's PreprocessedRequest
# dynamo-llm 1.6's request to its router and engines (shared/reference/seeds/
# dynamo-llm-preprocessed-request.rs.txt), with the seed's names and serde attributes: renames as
# msgspec field names, skip-if-none as omit_defaults. What routing reads is declared with its type;
# every other field the seed names (sampling, stop conditions, bootstrap info, engine-only extras) is
# declared too, with the seed's shape (an object, a string, a bool, u16 / u32 / u64 widths, required
# members) but opaque inside where its content does not matter to routing, so a body Dynamo's serde
# would fail to deserialize is refused (422 naming the field) rather than booked and handed back.
# Fields the seed does not name are ignored, as serde ignores them; everything travels on untouched
# when the request is handed back (the reply copies the body as it came, not these structs).

# A Rust struct the router does not read (StopConditions, SamplingOptions, ...): serde takes an object,
# or a sequence of its fields in order.
OpaqueStruct = dict[str, Any] | list[Any]
U16 = Annotated[int, msgspec.Meta(ge=0, le=2**16 - 1)]

# `annotations` entry with which a caller (Dynamo's Gateway API endpoint picker) asks which worker
# the router would choose, and the token data, without routing anything there.
QUERY_INSTANCE_ID = "query_instance_id"


def queries_instance(annotations: list[str]) -> bool:
    """Whether the annotations ask for the decision only: Dynamo 1.6's ``query_instance_id:<phase>``
    (its `get_annotation_value`; the gateway's first stage sends an empty phase), or the bare
    ``query_instance_id`` of earlier Dynamo releases."""
    return any(a == QUERY_INSTANCE_ID or a.startswith(QUERY_INSTANCE_ID + ":") for a in annotations)


class BlockMmObjectInfo(msgspec.Struct, kw_only=True):
    """One multimodal object in a block: its hash and its placeholder ranges within the block."""

    mm_hash: U64
    offsets: list[tuple[NonNegative, NonNegative]]  # Dynamo's Vec<(usize, usize)>


class BlockExtraInfo(msgspec.Struct, kw_only=True):
    """A block's multimodal objects (Dynamo's `BlockExtraInfo`)."""

    mm_objects: list[BlockMmObjectInfo]


class MmRoutingInfo(msgspec.Struct, kw_only=True):
    """Routing-only multimodal data: overlap is computed on ``routing_token_ids`` with
    ``block_mm_infos`` (one entry per block, null for a block without objects); the prompt length
    for load is ``expanded_prompt_len`` when set (the seed's `block_mm_routing_info` and
    `expanded_prompt_token_count`)."""

    routing_token_ids: list[U32]
    block_mm_infos: list[BlockExtraInfo | None]
    expanded_prompt_len: Annotated[int, msgspec.Meta(ge=0)] = 0


# The worker-id hints, u64 in Dynamo: msgspec cannot bound an integer above i64 in the type, so the
# structs holding them check the ceiling after decoding, and a body Dynamo fails to deserialize is a
# 422 naming the field (not a 404 for a worker that cannot exist, nor an allowed id silently dropped).
_WORKER_ID_HINTS = ("backend_instance_id", "prefill_worker_id", "decode_worker_id")


def _check_worker_ids(hints: RoutingHints | NvExt) -> None:
    for name in _WORKER_ID_HINTS:
        value = getattr(hints, name)
        if value is not None and value > U64_MAX:
            raise ValueError(f"{name}: {value} does not fit in u64")
    allowed = getattr(hints, "allowed_worker_ids", None)
    if allowed and max(allowed) > U64_MAX:
        raise ValueError(f"allowed_worker_ids: {max(allowed)} does not fit in u64")


class RoutingHints(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Dynamo's `RoutingHints`: every field optional and skipped when absent; ``cache_namespace`` is
    ``cache_salt`` on the wire. ``priority`` is the engine's scheduling priority, forwarded to it and
    not read by the router."""

    backend_instance_id: U64 | None = None
    prefill_worker_id: U64 | None = None
    decode_worker_id: U64 | None = None
    dp_rank: U32 | None = None
    prefill_dp_rank: U32 | None = None
    expected_output_tokens: U32 | None = None
    lora_name: str | None = None
    cache_namespace: str | None = msgspec.field(default=None, name="cache_salt")
    priority_jump: Finite | None = None
    strict_priority: U32 | None = None
    priority: Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)] | None = None
    allowed_worker_ids: frozenset[U64] | None = None
    routing_constraints: RoutingConstraints | None = None

    def __post_init__(self) -> None:
        _check_worker_ids(self)


class BootstrapInfo(msgspec.Struct, kw_only=True):
    """Dynamo's `BootstrapInfo` (disaggregated serving's KV-transfer rendezvous), checked, not read:
    ``handoff_id`` is a UUID, text in any form the uuid crate parses or 16 bytes in msgpack, kept as sent."""

    bootstrap_host: str
    bootstrap_port: U16
    bootstrap_room: U64
    handoff_id: Any = None

    def __post_init__(self) -> None:
        if self.bootstrap_room > U64_MAX:
            raise ValueError(f"bootstrap_room: {self.bootstrap_room} does not fit in u64")
        handoff = self.handoff_id
        if isinstance(handoff, str):
            try:
                uuid.UUID(handoff)
            except ValueError:
                raise ValueError(f"handoff_id: {handoff!r} is not a UUID") from None
        elif handoff is not None and not (isinstance(handoff, bytes) and len(handoff) == 16):
            raise ValueError("handoff_id: expected a UUID, as text or 16 bytes")


class TraceLink(msgspec.Struct, kw_only=True):
    """Dynamo's `TraceLink` (``migration_link``): the predecessor span, both ids required."""

    trace_id: str
    span_id: str


class PrefillResult(msgspec.Struct, kw_only=True):
    """Dynamo's `PrefillResult`: ``disaggregated_params`` is engine-owned JSON, any value but required."""

    disaggregated_params: Any
    prompt_tokens_details: OpaqueStruct | None = None


class PreprocessedRequest(msgspec.Struct, kw_only=True):
    """Dynamo's `PreprocessedRequest`, routing's fields typed and the others checked for shape (see
    above). ``token_ids`` is a sequence of u32 or, in msgpack, one bin of packed little-endian int32
    (``DYN_TOKEN_IDS_AS_BYTES``); ``model`` may be absent (Dynamo's health-check canaries);
    ``is_probe`` is ``_HEALTH_CHECK`` on the wire."""

    model: str = ""
    token_ids: list[U32] | bytes
    mm_routing_info: MmRoutingInfo | None = None
    annotations: list[str] = []
    routing: RoutingHints | None = None
    router_config_override: RouterConfigOverride | None = None
    is_probe: bool = msgspec.field(default=False, name="_HEALTH_CHECK")
    # Not read by routing: the seed's shapes, checked so that what Dynamo refuses is refused here.
    prompt_embeds: str | None = None
    multi_modal_data: dict[str, list[Any]] | None = None
    multi_modal_uuids: dict[str, list[str | None]] | None = None
    stop_conditions: OpaqueStruct = {}
    sampling_options: OpaqueStruct = {}
    output_options: OpaqueStruct = {}
    eos_token_ids: list[U32] = []
    mdc_sum: str | None = None
    prefill_result: PrefillResult | None = None
    encoder_result: dict[str, Any] | None = None  # object-only, as the seed's deserialize_optional_object
    migration_link: TraceLink | None = None
    bootstrap_info: BootstrapInfo | None = None
    extra_args: Any = None
    kv_hint: Any = None
    require_reasoning: bool = False
    router: OpaqueStruct | None = None
    agent_context: OpaqueStruct | None = None
    image_cache_scope: str | None = None
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None
    request_timestamp_ms: float | None = None


class RouteBody(PreprocessedRequest, kw_only=True):
    """``POST /v1/route``: a `PreprocessedRequest`, plus ours: the id to book it under (else
    ``X-Request-Id``, else generated) and whether to hand the request back with its routing filled in."""

    request_id: RequestId | None = None
    return_request: bool = False


class AgentHints(msgspec.Struct, kw_only=True):
    """Dynamo's ``nvext.agent_hints``: ``osl`` the expected output tokens, ``priority`` (else
    ``latency_sensitivity``) the queue's priority jump in seconds, ``strict_priority`` its tier."""

    osl: Annotated[int, msgspec.Meta(ge=1)] | None = None
    priority: Finite | None = None
    latency_sensitivity: Finite | None = None
    strict_priority: U32 | None = None


class NvExt(msgspec.Struct, kw_only=True):
    """Dynamo's OpenAI request extension, the fields that become `RoutingHints` and annotations."""

    backend_instance_id: U64 | None = None
    dp_rank: U32 | None = None
    prefill_worker_id: U64 | None = None
    decode_worker_id: U64 | None = None
    priority: Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)] | None = None
    annotations: list[str] = []
    agent_hints: AgentHints | None = None

    def __post_init__(self) -> None:
        _check_worker_ids(self)

    def routing_hints(self, cache_salt: str | None = None) -> RoutingHints:
        """The hints Dynamo's frontend puts on the `PreprocessedRequest` it makes of this request."""
        hints = self.agent_hints or AgentHints()
        jump = hints.priority if hints.priority is not None else hints.latency_sensitivity
        return RoutingHints(
            backend_instance_id=self.backend_instance_id,
            prefill_worker_id=self.prefill_worker_id,
            decode_worker_id=self.decode_worker_id,
            dp_rank=self.dp_rank,
            expected_output_tokens=hints.osl,
            cache_namespace=cache_salt,
            priority_jump=max(jump, 0.0) if jump is not None else None,
            strict_priority=hints.strict_priority,
            priority=self.priority,
        )


# ---------------------------------------------------------------- requests
class WorkerRegistration(WorkerConfig, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """``POST /v1/workers``: a `WorkerConfig` in which a misspelt field is an error (422), not a default
    silently kept (the NATS registry stays lenient: a newer worker may carry fields we lack)."""


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
    # Bounded as expected_output_tokens is: unbounded, one call made its rank's load past any other's
    # (and past u64 in the replicas' sync) until the request was freed.
    generated_tokens: U32


# ``/v1/router``'s variants ignore fields they do not name, as Dynamo's `RouterRequest` does (serde,
# tagged by "method", without deny_unknown_fields): a newer Dynamo client's added fields are not
# refused. Our own separate routes above stay strict, a misspelt field there being a 422.
class RouterNew(RouteRequest, tag="new", tag_field="method", kw_only=True):
    request_id: RequestId | None = None


class RouterPotentialLoads(
    PotentialLoadsRequest, tag="potential_loads", tag_field="method", forbid_unknown_fields=False
):
    pass


class RouterMarkPrefill(MarkRequest, tag="mark_prefill", tag_field="method", forbid_unknown_fields=False):
    pass


class RouterMarkFree(MarkRequest, tag="mark_free", tag_field="method", forbid_unknown_fields=False):
    pass


class RouterRoute(RouteBody, tag="route", tag_field="method", kw_only=True):
    """``{"method": "route", ...}`` on ``/v1/router``: a `RouteBody`, answered as ``/v1/route`` does."""


RouterRequest = RouterNew | RouterPotentialLoads | RouterMarkPrefill | RouterMarkFree | RouterRoute


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


class WorkerIdInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Dynamo's `WorkerIdInfo`: who prefills and who decodes, each field skipped when absent."""

    prefill_worker_id: int | None = None
    prefill_dp_rank: int | None = None
    decode_worker_id: int | None = None
    decode_dp_rank: int | None = None

    @classmethod
    def of(cls, decision: RouteDecision) -> WorkerIdInfo:
        """Who would prefill and who would decode the decided request. On an aggregated fleet one
        worker runs both phases and is named for both, as Dynamo records an aggregated request; on a
        disaggregated fleet the prefill leg and the decode worker; when the decode worker prefills the
        prompt itself (no prefill leg), only the decode fields, so that a gateway's second call pins no
        prefill worker."""
        how = decision.disaggregation
        decode = {"decode_worker_id": decision.worker_id, "decode_dp_rank": decision.dp_rank}
        if how is None:
            return cls(prefill_worker_id=decision.worker_id, prefill_dp_rank=decision.dp_rank, **decode)
        if how.prefill is None:
            return cls(**decode)
        return cls(prefill_worker_id=how.prefill.worker_id, prefill_dp_rank=how.prefill.dp_rank, **decode)


class NvExtResponse(msgspec.Struct, kw_only=True):
    """Dynamo's response ``nvext`` as its frontend fills it for ``query_instance_id``: the workers
    chosen, and the prompt's token ids for the gateway's second call (``nvext.token_data``). The
    proxy's answer and ``/v1/route``'s carry the same one."""

    worker_id: WorkerIdInfo
    token_ids: list[int]


class RouteReply(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``POST /v1/route``: the decision. ``request_id`` is the id it is booked under, absent when
    nothing was booked (``query_instance_id``: then ``nvext``, the workers and the prompt's token ids
    as Dynamo 1.6's frontend answers that annotation). ``unused_hints`` names hints accepted and validated
    but not acted on (prefill / decode worker ids on a fleet without prefill or decode workers).
    ``disaggregation``: on a disaggregated fleet, the path and the prefill leg (`DisaggregationReceipt`).
    ``request``: the request as received with ``routing.backend_instance_id`` / ``dp_rank`` set, when
    ``return_request`` asked for it."""

    worker_id: int
    dp_rank: int
    overlap_blocks: int
    cached_tokens: int
    request_id: str | None = None
    receipt: DecisionReceipt | None = None
    explanation: DecisionExplanation | None = None  # with ?explain=true
    disaggregation: DisaggregationReceipt | None = None
    nvext: NvExtResponse | None = None
    unused_hints: list[str] = []
    request: dict[str, Any] | None = None


class RouterRouteResponse(RouteReply, tag="route", tag_field="method", kw_only=True):
    pass


RouterResponse = (
    RouterNewResponse
    | RouterQueueRejected
    | RouterPrefillMarked
    | RouterFreeMarked
    | RouterPotentialLoadsResponse
    | RouterRouteResponse
)


class MarkReply(msgspec.Struct, kw_only=True, omit_defaults=True):
    request_id: str
    success: bool
    # Not booked here, passed to the replicas (a 202): a peer may hold it, its booking not here yet;
    # the mark applies wherever the booking is or arrives (router/replicas/README.md).
    passed_to_replicas: bool = False


class WorkerStatus(msgspec.Struct, kw_only=True):
    config: WorkerConfig
    ranks: list[RankLoad]
    # Per dp rank, the state of its NATS event stream (empty without an event plane): the last
    # applied event id, and whether it is trusted (no gap since the last sync).
    event_streams: list[StreamStatus] = []
    # In routing or not: its circuit breaker and its active health check (`router.worker_health`).
    availability: WorkerAvailability | None = None


class WorkersReply(msgspec.Struct, kw_only=True):
    workers: list[WorkerStatus]


class EventsReply(msgspec.Struct, kw_only=True):
    """What became of a batch of events: each received event in exactly one count
    (``received = applied + rejected + duplicate + held + relayed``), and the reasons of the last
    rejected and held ones.

    With replica sync (``--processes N``, replicas) events are ``relayed``: published on their workers'
    events subjects, where every replica, this one too, takes them in the order the NATS server did
    (what became of each is then in ``kv_router_stream_events`` of each replica).

    Events pass the same sequencer as those from NATS: ``applied`` ones reached the index;
    ``duplicate`` ones (an id at or below the last one taken for that worker and dp rank: seen
    before, or a missing event arriving after those past it, which only the resync fills) are dropped; ``rejected``
    ones were refused (an unknown worker or rank, a block the index does not know, ...); ``held``
    ones came after a gap in their stream's event ids (or a first id other than 1) and the index
    refused them for now, since the missing events may hold what they need (a parent block): the
    router asks the worker for the missing events, applies them again once it has them, and counts
    them as rejected (``kv_router_stream_events{outcome="rejected_<reason>"}``) if the gap cannot be filled.
    """

    received: int
    applied: int
    rejected: int
    duplicate: int = 0
    held: int = 0
    relayed: int = 0
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
    # Workers whose registration or removal is applied here and waits for NATS (or JetStream) to reach
    # the shared registry.
    registry_writes_owed: int = 0


class ServiceInfo(msgspec.Struct, kw_only=True, frozen=True):
    """``GET /v1/info``: what a worker or an operator needs to join this router."""

    version: str
    nats_url: str | None
    nats_namespace: str
    block_size: int
    policy: str
    native: list[str]  # the C accelerators running, by layer; empty: the pure-Python code runs

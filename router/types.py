"""The router package's library and wire types, and its typed errors, in one place.

Field names follow Dynamo 1.6.1's `RouterRequest::New` / `PotentialLoad` / `QueueRejection`
(`reference/dynamo-router.md` §5.1, §4.7) so the HTTP layer can subclass or encode them as they are.
Everything here is plain data: no behaviour beyond validation of its own fields.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = [
    "AllWorkersOverloaded",
    "BlockMmInfos",
    "CandidateExplanation",
    "DecisionExplanation",
    "DecisionTiming",
    "DuplicateRequestId",
    "InvalidRequest",
    "KvRouterError",
    "LimitKind",
    "NoEligibleWorker",
    "OverlapReport",
    "PotentialLoad",
    "QueueRejected",
    "QueueRejection",
    "QueueStats",
    "RankKey",
    "RankLoad",
    "RouteDecision",
    "RouteRequest",
    "RoutingConstraints",
    "UnknownWorker",
    "WorkerConfig",
    "WorkerOverlap",
]

_U64_MAX = (1 << 64) - 1

# A (worker_id, dp_rank) pair: every load and index structure is keyed by it.
RankKey = tuple[int, int]

# One entry per prompt block (or null): {"mm_objects": [{"mm_hash": u64, "offsets": [[s, e]]}]}.
# Kept as plain mappings because `indexer.hashing.compute_block_hashes` reads exactly this shape.
BlockMmInfos = list[dict[str, Any] | None]


class RoutingConstraints(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Taint constraints of one request (§4.4): hard filter and soft, weighted preferences."""

    required_taints: list[str] = []
    preferred_taints: dict[str, float] = {}


class RouteRequest(msgspec.Struct, kw_only=True):
    """A request to route: the fields of Dynamo's `RouterRequest::New`, plus our request id.

    ``tokens`` is either a list of token ids or the same ids packed as little-endian u32 bytes,
    which is what a fast HTTP decoder can hand over without building one Python int per token.
    """

    tokens: list[int] | bytes
    block_mm_infos: BlockMmInfos | None = None
    routing_constraints: RoutingConstraints | None = None
    priority_jump: float = 0.0
    strict_priority: int = 0
    lora_name: str | None = None
    cache_namespace: str | None = None
    # Not in Dynamo's payload (Dynamo takes it from the request-plane context): the id that
    # mark_prefill / mark_free refer to. None routes without booking any load.
    request_id: str | None = None
    expected_output_tokens: int | None = None


class WorkerConfig(msgspec.Struct, kw_only=True, frozen=True):
    """What the router knows about one worker: its dp ranks, capacity and taints (§4.3, §4.6)."""

    worker_id: int
    dp_start_rank: int = 0
    dp_size: int = 1
    total_kv_blocks: int | None = None
    max_num_batched_tokens: int | None = None
    taints: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not 0 <= self.worker_id <= _U64_MAX:
            raise ValueError(f"worker_id must be a u64, got {self.worker_id}")
        if self.dp_start_rank < 0 or self.dp_size < 1:
            raise ValueError(
                f"dp ranks must be dp_start_rank >= 0 and dp_size >= 1, got {self.dp_start_rank}, {self.dp_size}"
            )
        if self.total_kv_blocks is not None and self.total_kv_blocks < 0:
            raise ValueError(f"total_kv_blocks must be >= 0, got {self.total_kv_blocks}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")

    @property
    def dp_ranks(self) -> range:
        return range(self.dp_start_rank, self.dp_start_rank + self.dp_size)


class CandidateExplanation(msgspec.Struct, kw_only=True, frozen=True):
    """One scored (worker, dp_rank): what the policy saw and what it made of it."""

    worker_id: int
    dp_rank: int
    device_overlap_blocks: int
    effective_overlap_blocks: float
    potential_prefill_tokens: int
    potential_decode_blocks: int
    active_requests: int
    # None for policies that do not score (round_robin, random).
    cost: float | None = None
    # Softmax pick probability when the policy samples (router_temperature > 0), else None.
    probability: float | None = None


class DecisionExplanation(msgspec.Struct, kw_only=True, frozen=True):
    """Why the winner won: the policy, a one-line reason and every candidate considered."""

    policy: str
    reason: str
    candidates: list[CandidateExplanation]


class DecisionTiming(msgspec.Struct, kw_only=True, frozen=True):
    """Wall time of one decision's phases, in seconds (queue wait excluded from the others)."""

    hashing_s: float
    matching_s: float
    scheduling_s: float
    queued_s: float = 0.0


class RouteDecision(msgspec.Struct, kw_only=True, frozen=True):
    """The chosen (worker, dp_rank); ``overlap_blocks`` is Dynamo's rounded effective overlap."""

    worker_id: int
    dp_rank: int
    overlap_blocks: int
    cached_tokens: int
    request_id: str | None
    timing: DecisionTiming
    explanation: DecisionExplanation | None = None


class PotentialLoad(msgspec.Struct, kw_only=True, frozen=True):
    """The load a (worker, dp_rank) would carry if a prompt were routed to it (§4.5)."""

    worker_id: int
    dp_rank: int
    potential_prefill_tokens: int
    potential_decode_blocks: int
    active_requests: int


class WorkerOverlap(msgspec.Struct, kw_only=True, frozen=True):
    """One (worker, dp_rank)'s cached prefix of a prompt per storage tier, as Dynamo's
    `get_overlap_scores` reports it: ``*_blocks`` are cumulative (device, +host, +disk/external),
    ``*_extension_blocks`` what each lower tier adds beyond the previous one."""

    worker_id: int
    dp_rank: int
    device_blocks: int
    host_pinned_blocks: int
    disk_blocks: int
    host_pinned_extension_blocks: int
    disk_extension_blocks: int
    # The overlap credit the cost function grants (§4.2 without decay) and the cached tokens it
    # implies: round(effective_overlap_blocks * block_size) (§3.5).
    router_credit_blocks: float
    cached_tokens: int


class OverlapReport(msgspec.Struct, kw_only=True, frozen=True):
    """A prompt's overlap with every registered (worker, dp_rank), sorted by (worker_id, dp_rank)."""

    block_size: int
    num_blocks: int
    workers: list[WorkerOverlap]


class RankLoad(msgspec.Struct, kw_only=True, frozen=True):
    """The live load of one (worker, dp_rank), for listings and metrics."""

    worker_id: int
    dp_rank: int
    active_prefill_tokens: int
    active_decode_blocks: int
    active_requests: int
    kv_used_blocks: int | None
    busy: bool


class QueueStats(msgspec.Struct, kw_only=True, frozen=True):
    """Requests waiting for capacity and the prompt tokens they carry (Dynamo's pending_* fields)."""

    pending_count: int
    pending_isl_tokens: int


LimitKind = Literal["requests", "raw_isl_tokens", "cached_tokens"]


class QueueRejection(msgspec.Struct, kw_only=True, frozen=True):
    """Why a request was refused a place in the queue (Dynamo's `QueueRejection`, §4.7)."""

    policy_class: str
    limit_kind: LimitKind
    current: int
    limit: int


class KvRouterError(Exception):
    """Base of every error the router raises to its callers."""


class InvalidRequest(KvRouterError, ValueError):
    """A request the router cannot route as given (no tokens, malformed tokens or multimodal info)."""


class NoEligibleWorker(KvRouterError):
    """No registered worker satisfies the request's required taints (Dynamo's `NoEndpoints`)."""

    def __init__(self, required_taints: list[str] | None = None) -> None:
        self.required_taints = list(required_taints or [])
        detail = f" with taints {sorted(self.required_taints)}" if self.required_taints else ""
        super().__init__(f"no worker available{detail} to route work")


class AllWorkersOverloaded(KvRouterError):
    """Eligible workers exist but every one has all its dp ranks over a busy threshold (§4.6)."""

    def __init__(self, eligible_workers: int) -> None:
        self.eligible_workers = eligible_workers
        super().__init__(f"all {eligible_workers} eligible workers are overloaded")


class DuplicateRequestId(KvRouterError):
    """A request id is still active; Dynamo 1.6.1 refuses to book it twice (§4.5)."""

    def __init__(self, request_id: str, worker_id: int, dp_rank: int) -> None:
        self.request_id = request_id
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        super().__init__(f"request {request_id!r} already exists (assigned to worker {worker_id} dp_rank {dp_rank})")


class QueueRejected(KvRouterError):
    """The queue is full for this request; carries Dynamo's `QueueRejection` payload."""

    def __init__(self, rejection: QueueRejection) -> None:
        self.rejection = rejection
        super().__init__(
            f"queue full for class {rejection.policy_class!r}: "
            f"{rejection.limit_kind} at {rejection.current} of limit {rejection.limit}"
        )


class UnknownWorker(KvRouterError):
    """An operation named a worker id that is not registered."""

    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        super().__init__(f"worker {worker_id} is not registered")

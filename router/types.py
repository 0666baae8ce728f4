"""The router package's library and wire types, and its typed errors, in one place.

Field names follow Dynamo 1.6.1's `RouterRequest::New` / `PotentialLoad` / `QueueRejection`
(`reference/dynamo-router.md` §5.1, §4.7) so the HTTP layer can subclass or encode them as they are.
Everything here is plain data: no behaviour beyond validation of its own fields. The errors are in
`router.errors`.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec

from indexer.events import U32, U32_MAX, U64, U64_MAX

__all__ = [
    "MAX_DP_SIZE",
    "BlockMmInfos",
    "CandidateExplanation",
    "DecisionExplanation",
    "DecisionReceipt",
    "DecisionTiming",
    "DisaggregatedLeg",
    "DisaggregationPath",
    "DisaggregationReceipt",
    "Finite",
    "HandoffStyle",
    "LimitKind",
    "OverlapReport",
    "PickReason",
    "PotentialLoad",
    "QueueRejection",
    "QueueStats",
    "RankLoad",
    "RouteDecision",
    "RouteRequest",
    "RouterConfigOverride",
    "RoutingConstraints",
    "Tokens",
    "WorkerAvailability",
    "WorkerConfig",
    "WorkerOverlap",
    "WorkerRole",
    "engine_url_problem",
    "url_problem",
]

# A finite float: NaN and the infinities refused (msgpack carries them; a NaN queue priority orders nothing).
Finite = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]

# A prompt as it travels: token ids, or the same ids packed as little-endian u32 bytes.
Tokens = list[int] | bytes

# One entry per prompt block (or null): {"mm_objects": [{"mm_hash": u64, "offsets": [[s, e]]}]}.
# Kept as plain mappings because `indexer.hashing.compute_block_hashes` reads exactly this shape.
BlockMmInfos = list[dict[str, Any] | None]


class RoutingConstraints(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Taint constraints of one request (§4.4): hard filter and soft, weighted preferences."""

    required_taints: list[str] = []
    preferred_taints: dict[str, Finite] = {}


class RouterConfigOverride(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """Per-request changes to the router's cost and load tracking: Dynamo's `RouterConfigOverride`
    (§4.8), same field names; an absent field keeps the router's value.

    ``overlap_score_weight`` is Dynamo's deprecated alias of ``prefill_load_scale`` (0 also zeroes the
    credit); ``shared_cache_multiplier`` weighs shared-cache hits, which need a shared cache this
    router does not have, so it is accepted and changes nothing (as in Dynamo without one).
    """

    overlap_score_credit: float | None = None
    prefill_load_scale: float | None = None
    overlap_score_weight: float | None = None
    router_temperature: float | None = None
    assume_kv_reuse: bool | None = None
    track_prefill_tokens: bool | None = None
    shared_cache_multiplier: Finite | None = None


class RouteRequest(msgspec.Struct, kw_only=True):
    """A request to route: the fields of Dynamo's `RouterRequest::New`, plus our request id.

    ``tokens`` is either a list of token ids or the same ids packed as little-endian u32 bytes,
    which is what a fast HTTP decoder can hand over without building one Python int per token.
    """

    tokens: Tokens
    block_mm_infos: BlockMmInfos | None = None
    routing_constraints: RoutingConstraints | None = None
    priority_jump: Finite = 0.0
    strict_priority: U32 = 0  # u32 in Dynamo
    lora_name: str | None = None
    cache_namespace: str | None = None
    # Not in Dynamo's payload (Dynamo takes it from the request-plane context): the id that
    # mark_prefill / mark_free refer to. None routes without booking any load.
    request_id: str | None = None
    # Dynamo's `agent_hints.osl`: how many tokens the request is expected to generate.
    expected_output_tokens: U32 | None = None
    router_config_override: RouterConfigOverride | None = None


# What a worker does in a disaggregated fleet: only prefill (its KV is handed to a decode worker), only
# decode (it receives prefilled KV, or prefills short prompts itself), or both (an aggregated worker).
WorkerRole = Literal["prefill", "decode", "both"]

# How a disaggregated request's prompt KV goes from its prefill worker to its decode worker, as the
# engine's connector expects the gateway to run the two legs: ``kv_transfer_params`` (vLLM's NIXL and
# other v1 connectors: the prefill leg first, its returned params handed to the decode leg),
# ``bootstrap`` (SGLang: both legs at once, meeting at the prefill worker's bootstrap server) or
# ``sequential`` (connectors that hand the KV over through a store keyed by the prompt, such as vLLM's
# ExampleConnector: the prefill leg first, then the client's body unchanged to the decode worker).
HandoffStyle = Literal["kv_transfer_params", "bootstrap", "sequential"]


def url_problem(url: str) -> str | None:
    """What keeps ``url`` from being an engine's OpenAI server URL (``http(s)://host[:port][/path]``,
    which the proxy and the health checks connect to), or None."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        return "its scheme is not http or https"
    if not parts.hostname:
        return "it has no host"
    try:
        parts.hostname.encode("idna")  # as the proxy's Host header is
    except UnicodeError:
        return "its host is not a valid name"
    try:
        port = parts.port  # raises for one that is no number or above 65535
    except ValueError:
        port = 0
    if port == 0:
        return "its port is not a number in 1-65535"
    if parts.query or parts.fragment:
        return "it has a query or fragment"
    return None


def engine_url_problem(url: str) -> str | None:
    """What keeps ``url`` from being an engine's OpenAI server root, given with or without ``/v1``
    (``http(s)://host[:port][/prefix][/v1]``), or None: `url_problem`, or a path that goes on past a
    ``/v1`` segment, an endpoint's (``/v1/completions``), to which the proxy would add its own paths.

    Every engine URL is checked here: a worker's (`WorkerConfig.url`: ``POST /v1/workers``, the NATS
    registry) and, through `router.engines.openai_server.openai_base`, ``--engine``'s ``url=`` and the
    bridge's ``--openai-url``. Not `url_problem` itself: other URLs take it too (an OTLP collector's
    ``/v1/traces``)."""
    problem = url_problem(url)
    if problem is not None:
        return problem
    path = urlsplit(url.strip()).path.rstrip("/")
    if "v1" in path.split("/")[:-1]:
        return (
            f"its path {path!r} goes on past /v1 (an endpoint's path): give the engine's OpenAI server root, "
            "http(s)://HOST[:PORT][/PREFIX], with or without /v1"
        )
    return None


# Data-parallel ranks one worker may have: far above any engine's (tens), low enough that registering
# the largest costs milliseconds.
MAX_DP_SIZE = 1024


class WorkerConfig(msgspec.Struct, kw_only=True, frozen=True):
    """One worker as routers know it: dp ranks, cache geometry, capacity and taints (§4.3, §4.6).

    The same struct is the worker's entry in the NATS registry bucket and the body of
    ``POST /v1/workers``. ``block_size`` is the engine's (a router refuses a worker whose block
    size differs from its own); ``leased`` workers must heartbeat to stay routable, static ones
    (registered over HTTP or in the config file) need not. ``url`` is the server root of the worker's
    OpenAI-compatible HTTP API, with or without ``/v1`` (`engine_url_problem`; the proxy forwards only
    to workers that have one) and ``models`` the model names it serves there (none: any model).
    """

    worker_id: U64
    dp_start_rank: U32 = 0
    # Each rank gets its own load and index state when the worker registers: an unbounded size let
    # one registration stall the router for minutes (found by tests/test_fuzz.py).
    dp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_DP_SIZE)] = 1
    block_size: Annotated[int, msgspec.Meta(ge=1)] | None = None
    total_kv_blocks: Annotated[int, msgspec.Meta(ge=0)] | None = None
    max_num_batched_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    taints: frozenset[str] = frozenset()
    leased: bool = True
    # False: the worker publishes no KV events; the router predicts its cache from what it routes there
    # (approximate mode, Dynamo's use_kv_events=false).
    kv_events: bool = True
    url: str | None = None
    models: frozenset[str] = frozenset()
    # Ours: the publisher's start nonce. A registration (or heartbeat) with another epoch than the
    # router knows means the worker restarted: its index state is dropped and its ids start afresh.
    epoch: str | None = None
    # Prefill candidates are "prefill" and "both" workers, decode candidates "decode" and "both" ones.
    role: WorkerRole = "both"
    # The hand-off the proxy runs when this worker prefills a request remotely (the prefill worker's
    # setting decides) and, for ``bootstrap``, the port of its bootstrap server (SGLang's
    # --disaggregation-bootstrap-port; its host is the one of ``url``).
    handoff: HandoffStyle = "kv_transfer_params"
    bootstrap_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None

    def serves(self, leg: Literal["prefill", "decode"]) -> bool:
        """Whether this worker may run that leg of a disaggregated request."""
        return self.role == "both" or self.role == leg

    def keeping(self, known: WorkerConfig | None) -> WorkerConfig:
        """This registration of a worker registered as ``known``, with what it does not say kept from
        there: one without an epoch (over HTTP) keeps the publisher's epoch and lease, one without a
        ``url`` or ``models`` (a publisher's, a heartbeat's) keeps those given before. A worker's URL
        and models thus go only with the worker (deregistered, or its publisher restarted afresh)."""
        if known is None:
            return self
        kept: dict[str, object] = {}
        if self.url is None and known.url is not None:
            kept["url"] = known.url
        if not self.models and known.models:
            kept["models"] = known.models
        if self.epoch is None and known.epoch is not None:
            kept["epoch"] = known.epoch
            kept["leased"] = known.leased
        return msgspec.structs.replace(self, **kept) if kept else self

    def __post_init__(self) -> None:
        # Decoding checks the bounds above; direct construction (tests, config files) must too.
        if not 0 <= self.worker_id <= U64_MAX:
            raise ValueError(f"worker_id must be a u64, got {self.worker_id}")
        if self.dp_start_rank < 0 or not 1 <= self.dp_size <= MAX_DP_SIZE:
            raise ValueError(
                f"dp ranks must be dp_start_rank >= 0 and 1 <= dp_size <= {MAX_DP_SIZE}, "
                f"got {self.dp_start_rank}, {self.dp_size}"
            )
        if self.dp_start_rank + self.dp_size - 1 > U32_MAX:  # every rank a u32, as on the wire
            raise ValueError(f"dp ranks {self.dp_start_rank}..{self.dp_start_rank + self.dp_size - 1} exceed u32")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.total_kv_blocks is not None and self.total_kv_blocks < 0:
            raise ValueError(f"total_kv_blocks must be >= 0, got {self.total_kv_blocks}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.url is not None and (problem := engine_url_problem(self.url)) is not None:
            raise ValueError(f"url must be an engine's http(s) URL, got {self.url!r}: {problem}")
        if self.bootstrap_port is not None and not 1 <= self.bootstrap_port <= 65535:
            raise ValueError(f"bootstrap_port must be a TCP port, got {self.bootstrap_port}")

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


PickReason = Literal["lowest_cost", "tie", "pinned", "threshold", "sampled", "policy"]


class DecisionReceipt(msgspec.Struct, kw_only=True, frozen=True):
    """Ours, on every ``/v1/new`` reply (not in Dynamo's ``/v1/router`` one): what the decision rested on.

    The chosen rank's cached prefix per storage tier (device blocks, then the host and disk/external
    blocks beyond it) and the overlap credit the cost used (after any untrusted-stream discount); how
    old the newest event applied for that rank was and whether its stream was trusted (known complete);
    and why it won: ``lowest_cost``, ``tie`` (lowest cost shared, drawn at random), ``pinned`` (the
    caller's choice), ``threshold`` (busy thresholds left it among fewer workers), ``sampled``
    (softmax at a temperature above 0) or ``policy`` (a policy that does not score).
    """

    device_blocks: int
    host_pinned_blocks: int
    disk_blocks: int
    credited_blocks: float
    newest_event_age_s: float | None
    stream_trusted: bool
    reason: PickReason
    candidates: int


DisaggregationPath = Literal["remote_prefill", "local_prefill"]


class DisaggregatedLeg(msgspec.Struct, kw_only=True, frozen=True):
    """The prefill leg of a disaggregated request: where it prefills and what it has cached there. Its
    booking is ``booking_id``, freed when the leg ends (``mark_prefill`` of the request) or with it."""

    worker_id: int
    dp_rank: int
    overlap_blocks: int
    cached_tokens: int
    booking_id: str | None
    receipt: DecisionReceipt


class DisaggregationReceipt(msgspec.Struct, kw_only=True, frozen=True):
    """Ours: how a request was placed on a disaggregated fleet (one with prefill or decode workers).

    The decision's own worker is the decode worker (the one whose stream reaches the client). ``path``
    is ``remote_prefill`` (``prefill`` names the prefill leg; the KV moves to the decode worker) or
    ``local_prefill`` (the decode worker prefills the prompt itself: its uncached part,
    ``decode_uncached_tokens``, is below ``threshold_tokens``, or no prefill worker could take it);
    ``reason`` says which in a sentence."""

    path: DisaggregationPath
    reason: str
    decode_uncached_tokens: int
    threshold_tokens: int
    prefill: DisaggregatedLeg | None = None


class RouteDecision(msgspec.Struct, kw_only=True, frozen=True):
    """The chosen (worker, dp_rank); ``overlap_blocks`` is Dynamo's rounded effective overlap. On a
    disaggregated fleet it is the decode worker and ``disaggregation`` says how the prompt is prefilled."""

    worker_id: int
    dp_rank: int
    overlap_blocks: int
    cached_tokens: int
    request_id: str | None
    timing: DecisionTiming
    explanation: DecisionExplanation | None = None
    receipt: DecisionReceipt | None = None
    disaggregation: DisaggregationReceipt | None = None


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
    # What the engine itself reports (kv-router bridge --engine-metrics-url); None: not reported.
    engine_requests_waiting: int | None = None
    engine_requests_running: int | None = None


class WorkerAvailability(msgspec.Struct, kw_only=True, frozen=True):
    """Whether a worker is in routing (`router.worker_health`), for listings: its circuit breaker, its
    active health check, and its engine's own pacing."""

    routable: bool
    circuit: Literal["closed", "open", "half_open"]
    consecutive_failures: int
    circuit_opened: int  # times its circuit opened
    half_open_in_secs: float | None  # an open circuit: seconds until it lets a probe through
    last_failure: str | None
    health_check: Literal["unknown", "passing", "failing"]
    paced_for_secs: float | None = None  # seconds left of its engine's Retry-After (a 429 or 503): out of routing


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

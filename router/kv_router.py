"""`KvRouter`: the router as a library. It ties the KV index to the scheduler and the queue.

One decision (§4.1): hash the prompt, match it against the index, expire stale requests, filter the
workers, wait in the queue if every eligible rank is saturated, score and pick, book. The whole
decision runs synchronously on the caller's event loop (no await between reading the load and booking
it); only a queued request awaits, and it is dispatched by whichever call frees capacity
(`mark_prefill`, `mark_free`, expiry, worker changes). `KvRouter` is the only place that books.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Literal, Protocol, get_args

import msgspec

from indexer.events import RouterEvent
from indexer.hashing import TokenInput
from indexer.radix_tree import RadixTree
from indexer.sequencer import RETRY_INTERVAL_S, EventSequencer
from indexer.slots import WorkerRank
from router.approximate import PredictedCache
from router.computed_prompts import ComputedPrompts
from router.config import RouterConfig
from router.disaggregation import (
    PREFILL_BOOKING_SUFFIX,
    PendingPrefill,
    choose_path,
    decode_config,
    is_disaggregated,
    leg_workers,
    prefill_booking_id,
    request_of_prefill_booking,
)
from router.errors import (
    AllWorkersOverloaded,
    BlockSizeMismatch,
    ConfigError,
    DuplicateRequestId,
    InvalidRequest,
    NoEligibleWorker,
    QueueRejected,
    WorkersUnavailable,
)
from router.overlap import NO_OVERLAP, RankOverlap, rank_overlaps, round_half_away
from router.policies import SelectionPolicy, create_policy, policy_names
from router.prompt import Prompt, prepare_prompt
from router.queue import PendingQueue
from router.scheduler import Choice, Scheduler
from router.sequences import Booking
from router.types import (
    DecisionReceipt,
    DecisionTiming,
    DisaggregatedLeg,
    DisaggregationPath,
    DisaggregationReceipt,
    OverlapReport,
    PotentialLoad,
    QueueStats,
    RankLoad,
    RouteDecision,
    RouteRequest,
    WorkerConfig,
    WorkerOverlap,
)
from router.worker_health import WorkerHealth

__all__ = ["OVERLAP_REFRESH_AFTER_SECS", "REMOVAL_REASONS", "BookingListener", "KvRouter", "RemovalReason"]

logger = logging.getLogger(__name__)

# A request that waited this long in the queue is matched against the index again before it is
# scheduled (Dynamo's DYN_ROUTER_OVERLAP_REFRESH_AFTER_SECS default, §4.7).
OVERLAP_REFRESH_AFTER_SECS = 10.0

MmInfos = Sequence[Mapping[str, Any] | None] | None
# Why a worker left: asked over the API; its registry entry deleted (a bridge withdrawing an engine that
# stopped answering, a publisher stopping, a DELETE relayed through the registry); silent past its
# lease; its direct-mode engine stopped answering.
RemovalReason = Literal["api", "deregistered", "lease_expired", "engine_unhealthy"]
REMOVAL_REASONS: tuple[RemovalReason, ...] = get_args(RemovalReason)


class BookingListener(Protocol):
    """Told synchronously of every booking change made through this router (not of replicated ones)."""

    def booked(self, request_id: str, booking: Booking, predicted: Sequence[int] | None) -> None:
        """``predicted``: the prompt's block hashes when the rank's cache is predicted from what is routed
        to it (a worker without KV events): peers predict it from them too."""

    def prefill_marked(self, request_id: str) -> None: ...

    def freed(self, request_id: str) -> None: ...

    def marked_unknown(self, request_id: str, *, free: bool) -> bool:
        """A mark (``free``, else the prefill's) for an id not booked here, whose booking may be on its way
        from a peer: kept for it and passed on; whether it was (False: an id freed here lately)."""
        ...


class _Routing:
    """One `new` call between matching and booking: what its scheduling needs, now or once dequeued."""

    __slots__ = (
        "among",
        "config",
        "explain",
        "hashing_s",
        "local_prefill_reason",
        "matching_s",
        "one_leg",
        "overlaps",
        "pinned",
        "pinned_prefill",
        "prompt",
        "request",
    )

    def __init__(
        self,
        request: RouteRequest,
        config: RouterConfig,
        prompt: Prompt,
        overlaps: dict[WorkerRank, RankOverlap],
        pinned: WorkerRank | None,
        among: AbstractSet[int] | None,
        explain: bool,
        hashing_s: float,
        matching_s: float,
        pinned_prefill: WorkerRank | None = None,
        one_leg: bool = False,
        local_prefill_reason: str | None = None,
    ) -> None:
        self.request = request
        # The router's config with the request's override applied.
        self.config = config
        self.prompt = prompt
        self.overlaps = overlaps
        self.pinned = pinned
        # The prefill leg's pinned rank, on a disaggregated fleet.
        self.pinned_prefill = pinned_prefill
        self.among = among
        self.explain = explain
        self.hashing_s = hashing_s
        self.matching_s = matching_s
        # Routed as one leg on a disaggregated fleet too (`KvRouter.new`).
        self.one_leg = one_leg
        # Why the prefill stays on the decode worker whatever the rules say (`KvRouter.new`).
        self.local_prefill_reason = local_prefill_reason

    def leg(
        self, request: RouteRequest, config: RouterConfig, pinned: WorkerRank | None, prompt: Prompt | None = None
    ) -> _Routing:
        """The same match (and prompt, unless given), routed as one leg of a disaggregated request."""
        return _Routing(
            request,
            config,
            self.prompt if prompt is None else prompt,
            self.overlaps,
            pinned,
            self.among,
            self.explain,
            self.hashing_s,
            self.matching_s,
        )


class _Waiter:
    """A `new` call parked in the queue."""

    __slots__ = ("enqueued_at", "future", "routing")

    def __init__(self, routing: _Routing, enqueued_at: float, future: asyncio.Future[RouteDecision]) -> None:
        self.routing = routing
        self.enqueued_at = enqueued_at
        self.future = future


class KvRouter:
    """KV-cache-aware routing over registered workers.

    ``tree`` (the index) defaults to a fresh `RadixTree`; ``rng`` (seed it for reproducible ties and sampling)
    drives every random choice; ``clock`` (monotonic seconds) times request expiry and queue order;
    ``resync_retry_s``: how often the sequencer offers an unverified event stream a full resync again.
    """

    def __init__(
        self,
        config: RouterConfig,
        tree: RadixTree | None = None,
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        resync_retry_s: float = RETRY_INTERVAL_S,
    ) -> None:
        self.config = config
        self.tree = tree if tree is not None else RadixTree()
        # The one door into the index for live events, whatever carries them.
        self.sequencer = EventSequencer(self.tree, retry_interval_s=resync_retry_s, worker_ranks=self._worker_ranks)
        self._clock = clock
        # Called after each decision with the chosen rank and the prompt's local hashes (the doctor
        # samples them, approximate mode records them).
        self.routed_observers: list[Callable[[WorkerRank, list[int]], None]] = []
        # Approximate mode: the predicted cache of workers without KV events, made when the first is seen.
        self.predictions: PredictedCache | None = None
        self._rng = rng if rng is not None else random.Random()
        self._scheduler = Scheduler(config, *self._create_policies(config))
        # Told synchronously of each worker that leaves routing as gone or unreachable, with why
        # (`_left_routing`): the proxy fails the exchanges still open with it.
        self.left_routing_observers: list[Callable[[int, str], None]] = []
        # Circuit breakers and health-check verdicts: who is out of routing, for every policy.
        self.health = WorkerHealth(
            config, clock, self.has_worker, lambda worker_id: self._left_routing(worker_id, "its health checks fail")
        )
        # Until router_min_initial_workers have registered once, `new` waits (Dynamo's startup wait).
        self._started = config.router_min_initial_workers <= len(self._scheduler.workers)
        self._workers_ready: asyncio.Event | None = None
        self._queue: PendingQueue[_Waiter] | None = None
        if config.router_queue_threshold is not None:
            self._queue = PendingQueue(
                config.router_queue_policy,
                started_at=clock(),
                request_limit_per_worker=config.router_queue_request_limit_per_worker,
                isl_token_limit_per_worker=config.router_queue_isl_token_limit_per_worker,
            )
        if not config.kv_events:
            self._predict()
        # Prompts computed lately, credited on their rank while their engine's events may be on their way.
        self.computed_prompts: ComputedPrompts | None = None
        if config.computed_prompt_credit_secs > 0 and config.policy != "dynamo":
            self.computed_prompts = ComputedPrompts(config.computed_prompt_credit_secs, clock)
            self.sequencer.on_blocks_left = self.computed_prompts.forget
        # Replica sync (`router.replicas`) publishes what this router books; None: a lone router.
        self.booking_listener: BookingListener | None = None
        # Whether any worker is prefill- or decode-only (then every request is routed as two legs).
        self._disaggregated = False
        # Workers removed, by why: every reason present from the start (a counter first seen at 1 reads
        # as no increase to Prometheus).
        self.removals: Counter[RemovalReason] = Counter(dict.fromkeys(REMOVAL_REASONS, 0))

    # ------------------------------------------------------------------ workers and events
    def _predict(self) -> PredictedCache:
        if self.predictions is None:
            self.predictions = PredictedCache(
                self.config.router_ttl_secs, self.sequencer, self._scheduler.workers.get, clock=self._clock
            )
        return self.predictions

    def check_block_size(self, worker: WorkerConfig) -> None:
        """Raise `BlockSizeMismatch` when ``worker`` names a block size other than the router's (None
        means the router's). Under ``--block-size auto`` the router's is its placeholder until the engines'
        is adopted (the registry's watch refuses by the same rule): workers registered meanwhile name none
        or that one, and take the adopted one (`adopt_block_size`)."""
        if worker.block_size is not None and worker.block_size != self.config.block_size:
            raise BlockSizeMismatch(worker.worker_id, worker.block_size, self.config.block_size)

    def register_worker(self, worker: WorkerConfig) -> None:
        """Add a worker, or update one (its KV index is kept; ranks it no longer has are dropped).
        Raises `BlockSizeMismatch` for a worker whose block size differs from the router's, before
        anything changes."""
        self.check_block_size(worker)
        if not self.expects_events(worker):
            self._predict()
        previous = self._scheduler.workers.get(worker.worker_id)
        dropped = self._scheduler.register_worker(worker)
        self._refresh_disaggregated()
        if previous is None:
            logger.info(
                "worker %d joined: dp ranks %d..%d, %s KV blocks per rank",
                worker.worker_id,
                worker.dp_start_rank,
                worker.dp_start_rank + worker.dp_size - 1,
                worker.total_kv_blocks if worker.total_kv_blocks is not None else "unknown",
                extra={"worker_id": worker.worker_id, "dp_size": worker.dp_size},
            )
        self._observe_epoch(worker)
        if previous is not None:
            if previous != worker:
                logger.info("worker %d reconfigured", worker.worker_id, extra={"worker_id": worker.worker_id})
            for dp_rank in set(previous.dp_ranks) - set(worker.dp_ranks):
                self.tree.remove_worker_dp_rank(worker.worker_id, dp_rank)
                self.sequencer.forget_stream(worker.worker_id, dp_rank)  # a trusted stream over nothing
                if self.computed_prompts is not None:
                    self.computed_prompts.forget(worker.worker_id, dp_rank)
        if dropped:
            # Once the fleet is as it now is: freeing their prefill legs dispatches the queue.
            self._ended(dropped)
            logger.warning("worker %d lost dp ranks; dropped %d active requests", worker.worker_id, len(dropped))
        if not self._started and len(self._scheduler.workers) >= self.config.router_min_initial_workers:
            self._started = True
            logger.info("%d workers registered: routing starts", len(self._scheduler.workers))
            if self._workers_ready is not None:
                self._workers_ready.set()
        self._dispatch_waiting()

    def _create_policies(self, config: RouterConfig) -> tuple[SelectionPolicy, SelectionPolicy]:
        """The policy and the prefill legs' (`disagg_prefill_policy`, else the same one)."""
        policy = create_policy(config, self._rng)
        name = config.disagg_prefill_policy
        if name is None or name == config.policy:
            return policy, policy
        if name not in policy_names():
            raise ConfigError(
                "disagg_prefill_policy", f"unknown policy {name!r}; registered: {', '.join(policy_names())}"
            )
        return policy, create_policy(msgspec.structs.replace(config, policy=name), self._rng)

    def adopt_block_size(self, block_size: int) -> None:
        """``--block-size auto``: take the engines' block size, told by the first engine's stored event,
        before any block is indexed. Workers registered meanwhile (with the placeholder) take it too;
        the policy is made afresh for it. Raises `ConfigError` once blocks are indexed at the old one.

        Requests booked meanwhile are the usual case (the first request routed to an engine makes its
        first stores) and stay as booked: each holds its own sequence hashes and releases exactly those,
        so the accounting stays whole; until they end their blocks count at the old size and share no
        prefix with bookings at the new one."""
        if block_size == self.config.block_size:
            return
        if any(self.tree.stats().blocks.values()):
            raise ConfigError("block_size", "cannot change once blocks are indexed")
        self.config = msgspec.structs.replace(self.config, block_size=block_size)
        self._scheduler.adopt_config(self.config, *self._create_policies(self.config))
        for worker in self.workers():
            if worker.block_size is not None and worker.block_size != block_size:
                self._scheduler.register_worker(msgspec.structs.replace(worker, block_size=block_size))
        logger.info("block size %d adopted from the engines", block_size)

    def remove_worker(self, worker_id: int, reason: RemovalReason = "api") -> None:
        """Forget a worker: its index entries, event streams and active requests, counting why in
        `removals`. Raises `UnknownWorker`."""
        dropped = self._scheduler.remove_worker(worker_id)
        self.removals[reason] += 1
        self._refresh_disaggregated()
        self.health.forget(worker_id)
        self.forget_cache_of(worker_id)
        self._ended(dropped)  # once the fleet is as it now is: freeing their prefill legs dispatches the queue
        logger.info(
            "worker %d left: %d active requests dropped",
            worker_id,
            len(dropped),
            extra={"worker_id": worker_id, "dropped_requests": len(dropped)},
        )
        self._left_routing(worker_id, f"removed ({reason})")
        self._dispatch_waiting()

    def _left_routing(self, worker_id: int, why: str) -> None:
        """The worker is out of routing as gone or unreachable (`in_routing` turned False): removed, for
        whatever reason (its requests' bookings are dropped with it: nothing accounts for them any
        more; an engine that stopped answering, a lease expired, a registry entry deleted or an
        operator's DELETE say it is no longer in the fleet), or failing its health check (its engine
        does not answer it). Not a circuit breaker opening nor an engine pacing: those keep new requests
        away from a worker that still answers (some failures, a 429), and its open requests may well
        end fine."""
        for observer in self.left_routing_observers:
            observer(worker_id, why)

    def _ended(self, request_ids: list[str]) -> None:
        """Bookings gone without `mark_free` (expired, or dropped with their ranks): their remote prefill
        legs go with them (the request's `mark_free` finds nothing to free any more, and left the leg
        booked until its expiry)."""
        for request_id in request_ids:
            self._prediction_stands(request_id)
            self._free_prefill_leg(request_id, replicated=False)

    def forget_cache_of(self, worker_id: int) -> None:
        """Forget what the index, event streams and predictions hold of a worker, registered or not (one a
        snapshot restored may never register in this router's life). Its streams start afresh if it
        comes back."""
        self.tree.remove_worker(worker_id)
        self.sequencer.forget_worker(worker_id)
        if self.predictions is not None:
            self.predictions.forget_worker(worker_id)
        if self.computed_prompts is not None:
            self.computed_prompts.forget(worker_id)

    def _refresh_disaggregated(self) -> None:
        self._disaggregated = is_disaggregated(
            self._scheduler.workers, among_both=self.config.disagg_among_both_workers
        )

    @property
    def disaggregated(self) -> bool:
        """Whether any worker is prefill- or decode-only (or, with ``disagg_among_both_workers``, two
        workers of role both are registered): decisions among such workers are two legs (`two_legs`)."""
        return self._disaggregated

    def two_legs(self, among: AbstractSet[int] | None = None) -> bool:
        """Whether a request among these workers (None: any) is routed as two legs: its workers, not
        the fleet, decide (another model's prefill workers do not split a request for aggregated ones).
        O(1) on a fleet that is not disaggregated, else O(len(among))."""
        if not self._disaggregated or among is None:
            return self._disaggregated
        known = self._scheduler.workers.get
        return is_disaggregated(
            (worker for worker in map(known, among) if worker is not None),
            among_both=self.config.disagg_among_both_workers,
        )

    def _observe_epoch(self, worker: WorkerConfig) -> None:
        if worker.epoch is not None:
            # A new epoch is a restarted publisher: its old index state goes, its ids start afresh.
            self.sequencer.observe_epoch(worker.worker_id, worker.epoch)

    def observe_registered_epochs(self) -> None:
        """Every registered worker's publisher epoch observed again, as its registration did: for index
        state restored after the registrations (a snapshot loaded again), whose epochs may be older."""
        for worker in self._scheduler.workers:
            self._observe_epoch(worker)

    def workers(self) -> list[WorkerConfig]:
        return list(self._scheduler.workers)

    def worker(self, worker_id: int) -> WorkerConfig | None:
        """The worker's registered configuration, or None."""
        return self._scheduler.workers.get(worker_id)

    def has_worker(self, worker_id: int) -> bool:
        """Whether the worker is registered (events of unregistered workers may be dropped upstream)."""
        return self._scheduler.workers.get(worker_id) is not None

    def in_routing(self, worker_id: int) -> bool:
        """Registered and not failing its health checks (a lease, a probe): a silent worker worth waiting for."""
        return self.has_worker(worker_id) and not self.health.failing_checks(worker_id)

    def _worker_ranks(self, worker_id: int) -> range | None:
        """The registered worker's dp ranks, or None (the sequencer's check of each event)."""
        worker = self._scheduler.workers.get(worker_id)
        return None if worker is None else worker.dp_ranks

    def expects_events(self, worker: WorkerConfig) -> bool:
        """Whether the worker's cache is known from its KV events (not predicted: approximate mode)."""
        return self.config.kv_events and worker.kv_events

    def predicts_only(self, worker: WorkerConfig) -> bool:
        """Whether the worker's cache is known only from what was routed to it: no KV events expected and
        none arrived from any of its ranks (events that do replace the predictions)."""
        if self.expects_events(worker):
            return False
        heard_from = self.sequencer.heard_from
        return not any(heard_from(worker.worker_id, rank) for rank in worker.dp_ranks)

    def update_kv_used_blocks(self, worker_id: int, dp_rank: int, kv_used_blocks: int) -> None:
        """Record the KV blocks a worker reports in use on one rank (the decode busy check, §4.6)."""
        self._scheduler.workers.set_kv_used_blocks(worker_id, dp_rank, kv_used_blocks)
        self._dispatch_waiting()

    def update_engine_load(
        self, worker_id: int, dp_rank: int, kv_used_blocks: int | None, waiting: int | None, running: int | None
    ) -> None:
        """Record what a worker's engine reports of one rank (an ``ActiveLoad``, over NATS or scraped in
        direct mode): its requests waiting and running (the load view) when it names either, its KV blocks
        in use (the decode busy check, §4.6) when it names them."""
        if waiting is not None or running is not None:
            self._scheduler.workers.set_engine_requests(worker_id, dp_rank, waiting, running)
        if kv_used_blocks is not None:
            self.update_kv_used_blocks(worker_id, dp_rank, kv_used_blocks)

    def forget_engine_load(self, ranks: Iterable[WorkerRank]) -> None:
        """These ranks' engine reports can no longer arrive (the event plane lost NATS): the last ones
        are not taken as current, or an engine busy when they stopped would stay busy, and refused, for
        the whole outage. Their load is the router's own bookings until their engines report again; the
        queue is dispatched on that view."""
        self._scheduler.workers.forget_engine_reports(ranks)
        self._dispatch_waiting()

    def apply_event(self, event: RouterEvent) -> None:
        """Apply one KV event to the index; raises the indexer's `KvIndexError` for a rejected one."""
        if self.computed_prompts is not None and event.event.stored is None:  # a removal or a clear
            self.computed_prompts.forget(event.worker_id, event.event.dp_rank)
        self.tree.apply_router_event(event)

    async def wait_for_workers(self) -> None:
        """Return once ``router_min_initial_workers`` workers have registered; at once ever after
        (workers leaving later do not stop routing again)."""
        if self._started:
            return
        if self._workers_ready is None:
            self._workers_ready = asyncio.Event()
        await self._workers_ready.wait()

    # ------------------------------------------------------------------ routing
    async def new(
        self,
        request: RouteRequest,
        *,
        pinned_worker: WorkerRank | None = None,
        pinned_prefill: WorkerRank | None = None,
        among: AbstractSet[int] | None = None,
        explain: bool = False,
        isl_tokens: int | None = None,
        one_leg: bool = False,
        local_prefill_reason: str | None = None,
    ) -> RouteDecision:
        """Pick a (worker, dp_rank) for the request and, if it has a ``request_id``, book it there.

        ``pinned_worker`` routes to that exact rank if it is eligible and not overloaded; ``among``
        limits the candidates to those worker ids (a proxy's workers serving the model);
        ``isl_tokens`` is the prompt length for load when the tokens are not the prompt itself
        (Dynamo's multimodal routing tokens and their ``expanded_prompt_len``). When the request's
        workers are disaggregated (`two_legs`) the decision is the decode worker, ``pinned_worker`` pins
        it and ``pinned_prefill`` the prefill leg (`_route_disaggregated`); ``one_leg`` routes it as one
        leg among them all the same (a request with no KV to hand over: a pooling model's);
        ``local_prefill_reason`` keeps a two-leg request's prefill on its decode worker, the receipt's
        reason saying why (the proxy's last attempt once its prefill legs failed). Raises
        `InvalidRequest`, `DuplicateRequestId`, `NoEligibleWorker`, `AllWorkersOverloaded` or
        `QueueRejected`. Awaits only while queued (when the queue is enabled and saturated: on a
        disaggregated fleet, the pools the decision would use) and, at start, until
        ``router_min_initial_workers`` workers have registered.
        """
        if not self._started:
            await self.wait_for_workers()
        decision = self.decide(
            request,
            pinned_worker=pinned_worker,
            pinned_prefill=pinned_prefill,
            among=among,
            explain=explain,
            isl_tokens=isl_tokens,
            one_leg=one_leg,
            local_prefill_reason=local_prefill_reason,
        )
        return decision if isinstance(decision, RouteDecision) else await decision

    def decide(
        self,
        request: RouteRequest,
        *,
        pinned_worker: WorkerRank | None = None,
        pinned_prefill: WorkerRank | None = None,
        among: AbstractSet[int] | None = None,
        explain: bool = False,
        isl_tokens: int | None = None,
        one_leg: bool = False,
        local_prefill_reason: str | None = None,
    ) -> RouteDecision | Coroutine[Any, Any, RouteDecision]:
        """`new` on the caller's stack: the decision itself when it need not wait (the usual case: no
        coroutine made, none run), else the coroutine to await for it (the start-up wait or the
        queue). Raises what `new` raises, before changing anything."""
        if not self._started:
            return self.new(
                request,
                pinned_worker=pinned_worker,
                pinned_prefill=pinned_prefill,
                among=among,
                explain=explain,
                isl_tokens=isl_tokens,
                one_leg=one_leg,
                local_prefill_reason=local_prefill_reason,
            )
        request_id = request.request_id
        if request_id is not None and request_id.endswith(PREFILL_BOOKING_SUFFIX):
            # Reserved for a remote prefill's booking: another request's leg would be freed by this one.
            raise InvalidRequest(f"request_id must not end in {PREFILL_BOOKING_SUFFIX!r}: {request_id!r}")
        started = time.perf_counter()
        config = self.config if request.router_config_override is None else self._request_config(request)
        prompt = prepare_prompt(
            request.tokens,
            config,
            lora_name=request.lora_name,
            cache_namespace=request.cache_namespace,
            block_mm_infos=request.block_mm_infos,
            isl_tokens=isl_tokens,
        )
        hashed = time.perf_counter()
        overlaps = self._routing_overlaps(prompt)
        routing = _Routing(
            request,
            config,
            prompt,
            overlaps,
            pinned_worker,
            among,
            explain,
            hashed - started,
            time.perf_counter() - hashed,
            pinned_prefill,
            one_leg,
            local_prefill_reason,
        )
        sequences = self._scheduler.sequences
        now = self._clock()
        if sequences.started_before(now - self.config.request_expiry_secs):
            self.expire_stale()
        sequences.decay(now)
        if request_id is not None:
            owner = sequences.owner(request_id)
            if owner is not None:
                raise DuplicateRequestId(request_id, *owner)
        self._check_prefill_pin(routing)
        workers = self._eligible(routing)
        queue = self._queue
        # Once anything waits, newcomers wait behind it (Dynamo's backlog anti-bypass).
        if queue is not None and len(queue):
            return self._wait_in_queue(queue, routing, workers)
        decision = self._route_unless_blocked(routing, workers, queued_s=0.0)
        if decision is None:
            assert queue is not None  # only the queue holds a decision back
            return self._wait_in_queue(queue, routing, workers)
        return decision

    def _check_prefill_pin(self, routing: _Routing) -> None:
        if routing.pinned_prefill is not None and (routing.one_leg or not self.two_legs(routing.among)):
            why = "it has no KV to hand over" if routing.one_leg else "none of its workers has role prefill or decode"
            raise InvalidRequest(f"a prefill worker was pinned but the request is routed as one leg: {why}")

    def _route_unless_blocked(
        self, routing: _Routing, workers: list[WorkerConfig], *, queued_s: float, rematch: bool = False
    ) -> RouteDecision | None:
        """The decision, booked; None (nothing booked) when the queue must hold it: every rank that
        would take it is queue-busy (§4.7). On a disaggregated fleet that is the decode pool, and on
        the remote-prefill path also the prefill pool (`_route_disaggregated`). ``rematch``: match
        the prompt against the index again before scheduling it (a long wait); a disaggregated
        request's path depends on the match, so it is matched again before its pools are checked."""
        if not routing.one_leg and self.two_legs(routing.among):
            if rematch:
                routing.overlaps = self._routing_overlaps(routing.prompt)
            return self._route_disaggregated(routing, workers, queued_s=queued_s)
        if self._queue is not None and self._scheduler.queue_blocked(workers, routing.pinned):
            return None
        if rematch:
            routing.overlaps = self._routing_overlaps(routing.prompt)
        return self._route(routing, workers, queued_s=queued_s)

    def _eligible(self, routing: _Routing) -> list[WorkerConfig]:
        constraints = routing.request.routing_constraints
        workers = self._scheduler.eligible_workers(constraints, routing.pinned)
        among = routing.among
        if among is not None:
            workers = [worker for worker in workers if worker.worker_id in among]
            if not workers:
                raise NoEligibleWorker(constraints.required_taints if constraints is not None else None)
        usable = self.health.usable(workers)
        if not usable:
            out = [worker.worker_id for worker in workers]
            raise WorkersUnavailable(out, self.health.reopens_in(out))
        return usable

    def _route(self, routing: _Routing, workers: list[WorkerConfig], *, queued_s: float) -> RouteDecision:
        """Select, book and report; raises the scheduler's errors."""
        started = time.perf_counter()
        return self._commit(routing, self._select(routing, workers), started, queued_s)

    def _select(self, routing: _Routing, workers: list[WorkerConfig], *, prefill_leg: bool = False) -> Choice:
        request = routing.request
        return self._scheduler.select(
            routing.prompt,
            routing.overlaps,
            workers,
            request.routing_constraints,
            pinned=routing.pinned,
            explain=routing.explain,
            config=routing.config,
            expected_output_tokens=request.expected_output_tokens,
            cached_blocks=self.tree.blocks_per_rank() if self._scheduler.uses_cache_fill else None,
            prefill_leg=prefill_leg,
        )

    def _commit(self, routing: _Routing, choice: Choice, started: float, queued_s: float) -> RouteDecision:
        """Book the choice (if the request has an id) and report it."""
        request = routing.request
        if request.request_id is not None:
            # Booked, so sent (its answer tells the breaker); a decision only asked for sends nothing,
            # and would hold a half-open worker's probe place until it expired.
            self.health.routed(choice.key[0])
            self._scheduler.book(
                request.request_id,
                choice,
                routing.prompt,
                self._clock(),
                routing.config,
                request.expected_output_tokens,
            )
        prompt = routing.prompt
        predicted = self._record_prediction(
            choice.key, prompt.local_hashes, prompt.shared_hashes, booking_id=request.request_id
        )
        if request.request_id is not None and self.booking_listener is not None:
            booking = self._scheduler.sequences.booking(request.request_id)
            assert booking is not None
            self.booking_listener.booked(request.request_id, booking, prompt.local_hashes if predicted else None)
        for observer in self.routed_observers:
            observer(choice.key, routing.prompt.local_hashes)
        worker_id, dp_rank = choice.key
        trusted, age = self.sequencer.freshness(choice.key)
        overlap = choice.overlap
        receipt = DecisionReceipt(
            device_blocks=overlap.device_blocks,
            host_pinned_blocks=overlap.host_blocks,
            disk_blocks=overlap.disk_blocks,
            credited_blocks=overlap.effective_blocks,
            newest_event_age_s=age,
            stream_trusted=trusted,
            reason=choice.reason,
            candidates=choice.candidates,
        )
        return RouteDecision(
            worker_id=worker_id,
            dp_rank=dp_rank,
            overlap_blocks=choice.overlap_blocks,
            cached_tokens=choice.overlap.cached_tokens,
            request_id=request.request_id,
            timing=DecisionTiming(
                hashing_s=routing.hashing_s,
                matching_s=routing.matching_s,
                scheduling_s=time.perf_counter() - started,
                queued_s=queued_s,
            ),
            explanation=choice.explanation,
            receipt=receipt,
        )

    def _route_disaggregated(
        self, routing: _Routing, workers: list[WorkerConfig], *, queued_s: float
    ) -> RouteDecision | None:
        """Two legs on a disaggregated fleet: the decode worker first (decode load, and with
        ``disagg_decode_overlap_credit`` the prefill it would do, credited with its cache), then, when
        its uncached prompt is at least ``disagg_local_prefill_below_tokens``, a prefill worker by the
        policy as it is. The decode leg is booked under the request's id (without prefill tokens when
        the prefill is remote), the prefill leg under `prefill_booking_id`, freed by `mark_prefill`
        or `mark_free` of the request. Raises the scheduler's errors before booking anything.

        With the queue on, None (nothing booked) when the pools the decision would use are saturated
        by the queue's busy rule: every eligible decode rank (whichever the path: the decode leg runs
        there), or, on the remote-prefill path, every eligible prefill rank. A local path needs only
        the decode pool: the request then goes, whatever the prefill pool's load."""
        started = time.perf_counter()
        request, config, pinned_prefill = routing.request, routing.config, routing.pinned_prefill
        self._check_leg_pin(routing.pinned, "decode")
        self._check_leg_pin(pinned_prefill, "prefill")
        decode_workers = leg_workers(workers, "decode")
        if not decode_workers:
            raise NoEligibleWorker(request.routing_constraints.required_taints if request.routing_constraints else None)
        queued = self._queue is not None
        if queued and self._scheduler.queue_blocked(decode_workers, routing.pinned):
            return None
        if request.request_id is not None:
            # Checked here too: a request with the same id may have been booked while this one waited,
            # and the prefill leg is booked before the decode leg.
            owner = self._scheduler.sequences.owner(request.request_id)
            if owner is not None:
                raise DuplicateRequestId(request.request_id, *owner)
        decode_choice = self._select(routing.leg(request, decode_config(config), routing.pinned), decode_workers)
        uncached = max(routing.prompt.isl_tokens - decode_choice.overlap.cached_tokens, 0)
        threshold = config.disagg_local_prefill_below_tokens
        prefill_choice: Choice | None = None
        prefill_routing: _Routing | None = None
        prefill_workers: list[WorkerConfig] = []
        if uncached >= threshold and routing.local_prefill_reason is None:
            prefill_id = None if request.request_id is None else prefill_booking_id(request.request_id)
            if prefill_id is not None:
                owner = self._scheduler.sequences.owner(prefill_id)
                if owner is not None:
                    raise DuplicateRequestId(prefill_id, *owner)
            prefill_request = msgspec.structs.replace(request, request_id=prefill_id, expected_output_tokens=1)
            # Without disagg_prefill_track_active_blocks the leg books no blocks and none are priced.
            prefill_prompt = None if config.disagg_prefill_track_active_blocks else routing.prompt.unbooked()
            prefill_routing = routing.leg(prefill_request, config, pinned_prefill, prefill_prompt)
            try:
                # A decode worker of role both prefilling for itself is the local path, not a remote leg.
                prefill_workers = [
                    worker
                    for worker in leg_workers(self._eligible(prefill_routing), "prefill")
                    if worker.worker_id != decode_choice.key[0]
                ]
                if prefill_workers:
                    prefill_choice = self._select(prefill_routing, prefill_workers, prefill_leg=True)
            except (NoEligibleWorker, AllWorkersOverloaded):
                if pinned_prefill is not None:
                    raise
        pending = None
        if prefill_choice is not None:
            pending = PendingPrefill(
                prefill_choice.key[0],
                self._pending_prefill_tokens(prefill_choice.key),
                self._pending_prefill_tokens(decode_choice.key),
                max(routing.prompt.isl_tokens - prefill_choice.overlap.cached_tokens, 0),
                self._active_requests(decode_choice.key),
                self._decoding_requests(prefill_choice.key),
            )
        path: DisaggregationPath
        if pinned_prefill is not None and pinned_prefill[0] == decode_choice.key[0]:
            path = "local_prefill"
            reason = f"the prefill leg pinned to decode worker {pinned_prefill[0]} itself: prefilled there"
        elif routing.local_prefill_reason is not None:
            path = "local_prefill"
            reason = f"{routing.local_prefill_reason}: prefilled on decode worker {decode_choice.key[0]}"
        else:
            path, reason = choose_path(uncached, config, decode_choice.key[0], pending)
        remote = path == "remote_prefill"
        if remote and queued and self._scheduler.queue_blocked(prefill_workers, pinned_prefill):
            return None
        prefill_leg: DisaggregatedLeg | None = None
        decode_leg_config = config
        if remote and prefill_choice is not None and prefill_routing is not None:
            prefill = self._commit(prefill_routing, prefill_choice, started, queued_s)
            assert prefill.receipt is not None
            prefill_leg = DisaggregatedLeg(
                worker_id=prefill.worker_id,
                dp_rank=prefill.dp_rank,
                overlap_blocks=prefill.overlap_blocks,
                cached_tokens=prefill.cached_tokens,
                booking_id=prefill.request_id,
                receipt=prefill.receipt,
            )
            # The KV arrives prefilled: the decode worker books the prompt's blocks, not its prefill.
            decode_leg_config = msgspec.structs.replace(config, router_track_prefill_tokens=False)
        decision = self._commit(
            routing.leg(request, decode_leg_config, routing.pinned), decode_choice, started, queued_s
        )
        receipt = DisaggregationReceipt(
            path=path,
            reason=reason,
            decode_uncached_tokens=uncached,
            threshold_tokens=threshold,
            prefill=prefill_leg,
        )
        return msgspec.structs.replace(decision, disaggregation=receipt)

    def _pending_prefill_tokens(self, key: WorkerRank) -> int:
        rank = self._scheduler.sequences.rank(key)
        return 0 if rank is None else rank.prefill_tokens

    def _active_requests(self, key: WorkerRank) -> int:
        rank = self._scheduler.sequences.rank(key)
        return 0 if rank is None else rank.requests

    def _decoding_requests(self, key: WorkerRank) -> int:
        """Requests a prefill on ``key`` would stall when it decodes too (role both): those booked there,
        counted as the local path counts its decode worker's (prefill legs and prefilling requests too)."""
        worker = self._scheduler.workers.get(key[0])
        return self._active_requests(key) if worker is not None and worker.role == "both" else 0

    def _check_leg_pin(self, pinned: WorkerRank | None, leg: Literal["prefill", "decode"]) -> None:
        if pinned is None:
            return
        worker = self._scheduler.workers.get(pinned[0])
        if worker is not None and not worker.serves(leg):
            raise InvalidRequest(f"worker {pinned[0]} has role {worker.role}: it cannot run the {leg} leg")

    async def _wait_in_queue(
        self, queue: PendingQueue[_Waiter], routing: _Routing, workers: list[WorkerConfig]
    ) -> RouteDecision:
        rejection = queue.rejection(len(self._scheduler.workers))
        if rejection is not None:
            raise QueueRejected(rejection)
        request = routing.request
        future: asyncio.Future[RouteDecision] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(routing, self._clock(), future)
        ticket = queue.push(
            waiter,
            strict_priority=request.strict_priority,
            priority_jump=request.priority_jump,
            isl_tokens=routing.prompt.isl_tokens,
            cached_tokens=self._best_cached_tokens(routing.overlaps, workers, routing.pinned),
            now=waiter.enqueued_at,
        )
        # With strict priorities a newcomer can become the head while a rank is free.
        self._dispatch_waiting()
        try:
            return await future
        except asyncio.CancelledError:
            # Cancelled while waiting: leave the queue. Cancelled after being scheduled but before
            # resuming: undo the booking, as Dynamo frees a cancelled queued request.
            if queue.cancel(ticket):
                # Those behind it may go now (it may have been the head): dispatched once this
                # cancellation has unwound, not from inside it.
                asyncio.get_running_loop().call_soon(self._dispatch_waiting)
            elif future.done() and not future.cancelled() and future.exception() is None and request.request_id:
                self.mark_free(request.request_id)  # scheduled, then cancelled before it resumed
            raise

    def _best_cached_tokens(
        self, overlaps: Mapping[WorkerRank, RankOverlap], workers: list[WorkerConfig], pinned: WorkerRank | None
    ) -> int:
        """The cached tokens `wspt` orders by: the pinned rank's, else the best eligible rank's."""
        if pinned is not None:
            return overlaps.get(pinned, NO_OVERLAP).cached_tokens
        eligible = {worker.worker_id for worker in workers}
        return max((overlap.cached_tokens for key, overlap in overlaps.items() if key[0] in eligible), default=0)

    def _dispatch_waiting(self) -> None:
        """Schedule queued requests in order while the head can go (head-of-line, as Dynamo)."""
        queue = self._queue
        if queue is None:
            return
        scheduler = self._scheduler
        scheduler.sequences.decay(self._clock())
        while (waiter := queue.head()) is not None:
            if waiter.future.done():  # its caller gave up
                queue.pop_head()
                continue
            routing = waiter.routing
            waited = self._clock() - waiter.enqueued_at
            try:
                workers = self._eligible(routing)
                self._check_prefill_pin(routing)
                decision = self._route_unless_blocked(
                    routing, workers, queued_s=waited, rematch=waited >= OVERLAP_REFRESH_AFTER_SECS
                )
            except Exception as exc:
                # The waiter fails alone, its caller raising it (a defect is logged there): never the mark or
                # decision that dispatched it, nor the waiters behind (a head raising at every dispatch
                # wedged the queue and made every mark a 500).
                queue.pop_head()
                waiter.future.set_exception(exc)
                continue
            if decision is None:
                return
            queue.pop_head()
            waiter.future.set_result(decision)

    def mark_prefill(self, request_id: str, *, replicated: bool = False) -> bool:
        """The request's first token is out: its prefill no longer loads its rank. False if unknown.

        ``replicated``: a peer router's change, not told to the booking listener."""
        self._free_prefill_leg(request_id, replicated, computed=True)  # a remote prefill ends with the first token
        self._prediction_stands(request_id)  # its prompt is computed
        marked = self._scheduler.sequences.mark_prefill(request_id)
        self._credit_computed_prompt(request_id)
        if marked:
            if not replicated and self.booking_listener is not None:
                self.booking_listener.prefill_marked(request_id)
            self._dispatch_waiting()
        return marked

    def record_output(self, request_id: str, generated_tokens: int) -> bool:
        """The request has generated ``generated_tokens`` tokens so far: they join its rank's context
        in flight (what the decode term of `latency` prices). With ``router_track_output_blocks`` its
        output blocks also count on its rank (decayed by its expected output length when it gave one),
        as in Dynamo. False if the id is unknown."""
        return self._scheduler.sequences.record_output(
            request_id, generated_tokens, self.config.block_size, count_blocks=self.config.router_track_output_blocks
        )

    @property
    def tracks_output(self) -> bool:
        """Whether output progress (`record_output`) changes what routing reads: output blocks are
        tracked, or the policy prices the context in flight."""
        return self.config.router_track_output_blocks or self._scheduler.uses_context_in_flight

    def mark_free(self, request_id: str, *, replicated: bool = False) -> bool:
        """The request finished or was cancelled: release its load. False if unknown (Dynamo 1.6.1).

        ``replicated``: a peer router's change, not told to the booking listener."""
        self._free_prefill_leg(request_id, replicated)
        self._prediction_stands(request_id)
        freed = self._scheduler.sequences.free(request_id)
        if freed:
            if not replicated and self.booking_listener is not None:
                self.booking_listener.freed(request_id)
            self._dispatch_waiting()
        return freed

    def pass_mark_to_replicas(self, request_id: str, *, free: bool) -> bool:
        """A mark (``free``: `mark_free`, else `mark_prefill`) for an id not booked here. With replica sync a
        peer may hold it, its booking not here yet (~1-3 ms): the mark is kept for the booking should it
        arrive and passed to the peers, the one holding it applying it, with a free of its remote prefill
        leg (the replica holding a request frees the leg only when told of the request itself). True when
        passed; False without replica sync or for an id freed here lately (a repeated mark)."""
        listener = self.booking_listener
        if listener is None or not listener.marked_unknown(request_id, free=free):
            return False
        listener.marked_unknown(prefill_booking_id(request_id), free=True)
        return True

    def _credit_computed_prompt(self, request_id: str) -> None:
        """The request's prompt is computed (its first token is out), so its engine holds the prompt's
        blocks, but its events about them may still be on their way: its booked blocks count as cached on
        its rank for ``computed_prompt_credit_secs``, unless blocks leave the rank meanwhile (an eviction,
        a cleared cache: `ComputedPrompts.forget`). A request that ends before its first token (a failed
        worker, a cancelled request) is credited nothing, nor one on a worker without KV events: its
        prompt's blocks were predicted there when it was routed (`PredictedCache`)."""
        if self.computed_prompts is None:
            return
        sequences = self._scheduler.sequences
        booking = sequences.booking(request_id)
        if booking is None:
            return
        worker = self._scheduler.workers.get(booking.key[0])
        if worker is None or not self.expects_events(worker):
            return
        hashes = booking.hashes
        whole_id = request_of_prefill_booking(request_id)
        if not hashes and whole_id is not None:
            # A prefill leg books no blocks unless disagg_prefill_track_active_blocks: its request's are the prompt.
            whole = sequences.booking(whole_id)
            hashes = whole.hashes if whole is not None else None
        if hashes:
            self.computed_prompts.add(booking.key, hashes)

    def _free_prefill_leg(self, request_id: str, replicated: bool, *, computed: bool = False) -> None:
        """Free the request's remote prefill booking, if it has one (``computed``: its prompt was, the
        decode leg's first token is out). Found by its id, not remembered: a replica holding the booking
        (`router.replicas`) may be the one told, and frees it alike. A peer's change is left to the peer,
        which frees the leg itself and says so; each replica credits the leg's computed prompt itself.
        Looked for whether or not the fleet is disaggregated now: a worker leaving may have made it whole."""
        leg = prefill_booking_id(request_id)
        if self._scheduler.sequences.owner(leg) is not None:
            if computed:  # on every replica the request's mark reaches, while it holds the leg
                self._credit_computed_prompt(leg)
            if not replicated:
                self.mark_free(leg)

    def book_replicated(self, request_id: str, booking: Booking, predicted: Sequence[int] | None = None) -> None:
        """Book what a peer router booked (replica sync); raises `DuplicateRequestId`, `UnknownWorker`.
        ``predicted``: the prompt's block hashes, when the peer predicts the rank's cache from it. It never
        expires here: the peer frees or expires it (and publishes that), or its bookings go with it when it
        leaves or falls silent; expired here, the expiry would be published and free the peer's booking,
        one it may hold (`hold`) for a stream outlasting ``request_expiry_secs``."""
        self._scheduler.sequences.add(
            request_id,
            booking.key,
            hashes=booking.hashes,
            private_blocks=booking.private_blocks,
            prefill_tokens=booking.prefill_tokens,
            now=self._clock(),
            context_tokens=booking.context_tokens,
            expected_output_tokens=booking.expected_output_tokens,
            expires=False,
        )
        if predicted is not None:  # each replica predicts from every prompt routed, not its own alone
            self._record_prediction(booking.key, list(predicted), None)

    def _record_prediction(
        self, key: WorkerRank, local_hashes: list[int], sequence: Sequence[int] | None, booking_id: str | None = None
    ) -> bool:
        """Record that this prompt went to ``key`` if its cache is predicted (a worker without KV events);
        whether it was. What it added is kept under ``booking_id`` until the booking's prompt is computed
        or the booking ends (`_prediction_stands`), or withdrawn (`forget_uncomputed_predictions`)."""
        predictions = self.predictions
        if predictions is None:
            return False
        worker = self._scheduler.workers.get(key[0])
        if worker is None or self.expects_events(worker):
            return False
        predictions.record(key, local_hashes, sequence, booking_id)
        return True

    def _prediction_stands(self, booking_id: str) -> None:
        """The booking's prompt was computed, or the booking ended: nothing of its prediction is withdrawn."""
        if self.predictions is not None:
            self.predictions.computed(booking_id)

    def forget_uncomputed_predictions(self, request_id: str) -> None:
        """The request's worker failed it before its prompt was computed (the proxy books it again
        elsewhere): the blocks its booking, and its remote prefill leg's while still booked, added to
        their ranks' predicted caches go, as nothing computed them there. Call it before `mark_free`. A
        peer router (`router.replicas`) keeps what it predicted from the booking."""
        if self.predictions is None:
            return
        for booking_id in (request_id, prefill_booking_id(request_id)):
            self.predictions.withdraw(booking_id)

    def booking(self, request_id: str) -> Booking | None:
        return self._scheduler.sequences.booking(request_id)

    def bookings(self) -> Iterator[tuple[str, Booking]]:
        """Every active request and what it books, in start order."""
        return self._scheduler.sequences.bookings()

    def hold(self, request_id: str) -> bool:
        """Its caller frees the booking on every path (the OpenAI proxy, which holds its requests from
        the decision to the answer's end): it is never expired as stale. `request_expiry_secs` is for
        callers of the decision API that may never free theirs; a generation may outlast it (a
        reasoning model's tens of thousands of tokens), and freed then it would leave its worker's load
        while still decoding there. Its remote prefill leg, if booked, is held too (a prefill may
        outlast it behind a long queue). False when the id is not booked. Replicas need not be told: a
        booking expires only where it was booked (`book_replicated`)."""
        sequences = self._scheduler.sequences
        sequences.hold(prefill_booking_id(request_id))
        return sequences.hold(request_id)

    def expire_stale(self) -> list[str]:
        """Free requests active longer than ``request_expiry_secs`` (§4.5), then dispatch the queue's
        head if it can go; returns the ids expired.

        Runs on every `new`; O(1) when nothing is stale. Call it periodically to also expire while idle
        and to re-check the queue: a head can become dispatchable with no call freeing anything (the
        prefill load model's decay) or be missed by one (a defect).
        """
        expired = self._scheduler.sequences.expire(self._clock() - self.config.request_expiry_secs)
        self._ended(expired)
        if expired:
            logger.warning("expiring %d stale requests, e.g. %s", len(expired), expired[0])
            if self.booking_listener is not None:
                for request_id in expired:
                    self.booking_listener.freed(request_id)
        self._dispatch_waiting()
        return expired

    def cancel_waiting(self) -> int:
        """Cancel every queued request (their `new` raises `CancelledError`); for shutdown."""
        if self._queue is None:
            return 0
        waiters = self._queue.take_all()
        for waiter in waiters:
            waiter.future.cancel()
        return len(waiters)

    # ------------------------------------------------------------------ queries
    def potential_loads(
        self,
        tokens: TokenInput,
        lora_name: str | None = None,
        cache_namespace: str | None = None,
        block_mm_infos: MmInfos = None,
    ) -> list[PotentialLoad]:
        """Every rank's load if this prompt were routed there (§4.5); books nothing."""
        prompt = self._prompt(tokens, lora_name, cache_namespace, block_mm_infos)
        self._scheduler.sequences.decay(self._clock())
        return self._scheduler.potential_loads(prompt, self._match(prompt))

    def overlap(
        self,
        tokens: TokenInput,
        lora_name: str | None = None,
        cache_namespace: str | None = None,
        block_mm_infos: MmInfos = None,
    ) -> OverlapReport:
        """The prompt's cached prefix on every registered rank and any rank the index matched."""
        prompt = self._prompt(tokens, lora_name, cache_namespace, block_mm_infos)
        overlaps = self._match(prompt)
        keys = set(overlaps)
        for worker in self._scheduler.workers:
            keys.update((worker.worker_id, dp_rank) for dp_rank in worker.dp_ranks)
        config = self.config
        rows = []
        for worker_id, dp_rank in sorted(keys):
            overlap = overlaps.get((worker_id, dp_rank), NO_OVERLAP)
            device, host, disk = overlap.device_blocks, overlap.host_blocks, overlap.disk_blocks
            rows.append(
                WorkerOverlap(
                    worker_id=worker_id,
                    dp_rank=dp_rank,
                    device_blocks=device,
                    host_pinned_blocks=device + host,
                    disk_blocks=device + host + disk,
                    host_pinned_extension_blocks=host,
                    disk_extension_blocks=disk,
                    router_credit_blocks=config.overlap_score_credit * device
                    + config.host_cache_hit_weight * host
                    + config.disk_cache_hit_weight * disk,
                    cached_tokens=overlap.cached_tokens,
                )
            )
        return OverlapReport(block_size=config.block_size, num_blocks=len(prompt.local_hashes), workers=rows)

    def rank_loads(self) -> list[RankLoad]:
        """Live load of every (worker, dp_rank), in registration order."""
        self._scheduler.sequences.decay(self._clock())
        return self._scheduler.rank_loads()

    def queue_stats(self) -> QueueStats:
        """Requests waiting in the queue and their prompt tokens (zeros when queueing is off)."""
        return self._queue.stats() if self._queue is not None else QueueStats(pending_count=0, pending_isl_tokens=0)

    # ------------------------------------------------------------------ helpers
    def _request_config(self, request: RouteRequest) -> RouterConfig:
        """The router's config with the request's `RouterConfigOverride` applied; raises
        `InvalidRequest` for an override value the config refuses."""
        override = request.router_config_override
        if override is None:
            return self.config
        try:
            return self.config.with_override(override)
        except ConfigError as exc:
            raise InvalidRequest(f"router_config_override: {exc}") from None

    def _prompt(
        self,
        tokens: TokenInput,
        lora_name: str | None,
        cache_namespace: str | None,
        block_mm_infos: MmInfos,
        config: RouterConfig | None = None,
    ) -> Prompt:
        return prepare_prompt(
            tokens,
            config or self.config,
            lora_name=lora_name,
            cache_namespace=cache_namespace,
            block_mm_infos=block_mm_infos,
        )

    def _match(self, prompt: Prompt) -> dict[WorkerRank, RankOverlap]:
        matches = self.tree.find_matches(prompt.local_hashes)
        # Per rank the larger of what its events say, what was predicted from routing, and what was
        # computed there lately (its events perhaps still on their way).
        if self.predictions is not None:
            _raise_to(matches.scores, self.predictions.tree.find_matches(prompt.local_hashes).scores)
        if self.computed_prompts is not None and prompt.shared_hashes:
            _raise_to(matches.scores, self.computed_prompts.depths(prompt.shared_hashes))
        return rank_overlaps(matches, self.config)

    def _routing_overlaps(self, prompt: Prompt) -> dict[WorkerRank, RankOverlap]:
        """The match as routing credits it: the overlap of ranks whose stream is untrusted discounted
        by ``untrusted_overlap_weight`` (never under the dynamo policy, whose decisions are Dynamo's)."""
        overlaps = self._match(prompt)
        weight = self.config.untrusted_overlap_weight
        untrusted = self.sequencer.untrusted
        if weight == 1.0 or not untrusted or self.config.policy == "dynamo":
            return overlaps
        for key in untrusted & overlaps.keys():
            o = overlaps[key]
            effective = o.effective_blocks * weight
            cached = round_half_away(o.cached_tokens * weight)
            overlaps[key] = RankOverlap(o.device_blocks, o.host_blocks, o.disk_blocks, effective, cached)
        return overlaps


def _raise_to(scores: dict[WorkerRank, int], other: Mapping[WorkerRank, int]) -> None:
    """Each rank's score raised to ``other``'s where that is larger."""
    for rank, blocks in other.items():
        if blocks > scores.get(rank, 0):
            scores[rank] = blocks

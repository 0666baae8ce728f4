"""The scheduler: from a hashed prompt and its overlap to one booked (worker, dp_rank) (§4.1 steps 3-5).

It owns the load side of the router: the worker registry, the active sequences and the selection
policy. It filters workers by required taints (§4.4) and busy thresholds (§4.6), projects each
candidate's load for the prompt (§4.5), asks the policy to pick, and books the pick. It knows nothing
of hashing, the index or the queue; `KvRouter` brings those.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping

from indexer.slots import WorkerRank
from router.config import RouterConfig
from router.errors import AllWorkersOverloaded, NoEligibleWorker
from router.overlap import NO_OVERLAP, RankOverlap, round_half_away
from router.policies import Selection, SelectionContext, SelectionPolicy
from router.prompt import Prompt
from router.sequences import ActiveSequences, RankState
from router.thresholds import all_queue_busy, busy_thresholds_configured, rank_is_busy
from router.types import (
    CandidateExplanation,
    DecisionExplanation,
    PickReason,
    PotentialLoad,
    RankLoad,
    RoutingConstraints,
    WorkerConfig,
)
from router.workers import WorkerRegistry

__all__ = ["Choice", "Scheduler"]

logger = logging.getLogger(__name__)

_NO_CONSTRAINTS = RoutingConstraints()


class Choice:
    """The selected rank, its overlap with the prompt, why it won (in one word, and optionally in full)
    and among how many candidates."""

    __slots__ = ("candidates", "explanation", "key", "overlap", "reason")

    def __init__(
        self,
        key: WorkerRank,
        overlap: RankOverlap,
        explanation: DecisionExplanation | None,
        reason: PickReason,
        candidates: int,
    ) -> None:
        self.key = key
        self.overlap = overlap
        self.explanation = explanation
        self.reason: PickReason = reason
        self.candidates = candidates

    @property
    def overlap_blocks(self) -> int:
        """Dynamo's reported overlap: the effective (tier-weighted) overlap, rounded."""
        return round_half_away(self.overlap.effective_blocks)


class Scheduler:
    """Workers, their booked load and the policy that picks among them."""

    def __init__(self, config: RouterConfig, policy: SelectionPolicy, prefill_policy: SelectionPolicy) -> None:
        self._config = config
        self._policy = policy
        # The prefill legs' policy on a disaggregated fleet (`disagg_prefill_policy`; else ``policy``).
        self._prefill_policy = prefill_policy
        # Fixed for the scheduler's life (the config and policies are): read once, not per decision.
        self._thresholds = busy_thresholds_configured(config)
        self.uses_cache_fill = policy.uses_cache_fill or prefill_policy.uses_cache_fill
        self.uses_context_in_flight = policy.uses_context_in_flight or prefill_policy.uses_context_in_flight
        self.workers = WorkerRegistry()
        linear = config.router_prefill_load_model == "linear"
        self.sequences = ActiveSequences(config.router_prefill_tokens_per_s if linear else None)
        self._ranks_of: dict[int, tuple[RankState, ...]] = {}
        # Every rank in registration order: the candidate list when no worker is filtered out.
        self._all_ranks: list[RankState] = []
        # Per rank its worker's (total_kv_blocks, max_num_batched_tokens), fixed between registrations and
        # read by every decision of a policy that uses the cache fill; the rows of `_all_ranks`, and their
        # pass budgets, made once for the decisions that have every rank as a candidate (shared by every
        # such decision's SelectionContext: read-only, as policies are pure).
        self._capacity_of: dict[WorkerRank, tuple[int | None, int | None]] = {}
        self._all_capacities: list[tuple[WorkerRank, int | None, int | None]] = []
        self._all_pass_tokens: dict[WorkerRank, int] = {}

    def adopt_config(self, config: RouterConfig, policy: SelectionPolicy, prefill_policy: SelectionPolicy) -> None:
        """Another config of the same thresholds and policy kinds (the block size adopted from the
        engines, `KvRouter.adopt_block_size`); bookings made under the old one keep their own hashes."""
        self._config = config
        self._policy = policy
        self._prefill_policy = prefill_policy

    # ------------------------------------------------------------------ topology
    def register_worker(self, config: WorkerConfig) -> list[str]:
        """Add or update a worker; returns the ids of requests dropped with ranks it no longer has."""
        added, removed = self.workers.register(config)
        dropped = [request_id for key in removed for request_id in self.sequences.remove_rank(key)]
        for key in added:
            self.sequences.add_rank(key)
        ranks = (self.sequences.rank((config.worker_id, dp_rank)) for dp_rank in config.dp_ranks)
        self._ranks_of[config.worker_id] = tuple(rank for rank in ranks if rank is not None)
        self._list_ranks()
        return dropped

    def remove_worker(self, worker_id: int) -> list[str]:
        """Forget a worker and its booked requests (returned); raises `UnknownWorker` if unknown."""
        keys = self.workers.remove(worker_id)
        del self._ranks_of[worker_id]
        self._list_ranks()
        return [request_id for key in keys for request_id in self.sequences.remove_rank(key)]

    def _list_ranks(self) -> None:
        self._all_ranks = [rank for worker in self.workers for rank in self._ranks_of[worker.worker_id]]
        self._capacity_of = {
            rank.key: (worker.total_kv_blocks, worker.max_num_batched_tokens)
            for worker in self.workers
            for rank in self._ranks_of[worker.worker_id]
        }
        self._all_capacities = [(rank.key, *self._capacity_of[rank.key]) for rank in self._all_ranks]
        self._all_pass_tokens = _pass_budgets(self._all_capacities)

    # ------------------------------------------------------------------ eligibility
    def eligible_workers(
        self, constraints: RoutingConstraints | None, pinned: WorkerRank | None = None
    ) -> list[WorkerConfig]:
        """Workers a request may use: registered, carrying its required taints, and holding the pinned
        rank if one is given. Raises `NoEligibleWorker` when there is none."""
        required = (constraints or _NO_CONSTRAINTS).required_taints
        if pinned is None:
            workers = self.workers.eligible(required)
        else:
            worker = self.workers.get(pinned[0])
            has_rank = worker is not None and pinned[1] in worker.dp_ranks
            workers = [worker] if worker is not None and has_rank and set(required) <= worker.taints else []
        if not workers:
            raise NoEligibleWorker(required)
        return workers

    def _rank_pairs(
        self, workers: list[WorkerConfig], pinned: WorkerRank | None
    ) -> Iterator[tuple[WorkerConfig, RankState]]:
        for worker in workers:
            for rank in self._ranks_of[worker.worker_id]:
                if pinned is None or rank.key == pinned:
                    yield worker, rank

    def queue_blocked(self, workers: list[WorkerConfig], pinned: WorkerRank | None = None) -> bool:
        """§4.7: every eligible rank (only the pinned one, if pinned) is over the queue threshold."""
        return all_queue_busy(self._config, self._rank_pairs(workers, pinned))

    def _is_overloaded(self, worker: WorkerConfig) -> bool:
        kv_used = self.workers.kv_used_blocks
        return all(
            rank_is_busy(self._config, worker, rank, kv_used(rank.key)) for rank in self._ranks_of[worker.worker_id]
        )

    # ------------------------------------------------------------------ selection and booking
    def select(
        self,
        prompt: Prompt,
        overlaps: Mapping[WorkerRank, RankOverlap],
        workers: list[WorkerConfig],
        constraints: RoutingConstraints | None,
        *,
        pinned: WorkerRank | None = None,
        explain: bool = False,
        config: RouterConfig | None = None,
        expected_output_tokens: int | None = None,
        cached_blocks: Mapping[WorkerRank, int] | None = None,
        prefill_leg: bool = False,
    ) -> Choice:
        """Pick a rank among ``workers`` (from `eligible_workers`). Books nothing. ``config`` is the
        request's own (the router's with its override applied), the router's by default;
        ``cached_blocks`` the index's blocks per rank, for a policy that `uses_cache_fill` (it is then
        also given each rank's pass budget); ``prefill_leg``: a disaggregated request's prefill leg,
        placed by the prefill policy.

        Raises `AllWorkersOverloaded` when every one of them has all its ranks busy. O(ranks + prompt
        blocks touched by `ActiveSequences.prefix_depths`).
        """
        thresholded = False
        if self._thresholds:
            available = [worker for worker in workers if not self._is_overloaded(worker)]
            if not available:
                raise AllWorkersOverloaded(len(workers))
            thresholded = len(available) < len(workers)
            workers = available
        preferred = (constraints or _NO_CONSTRAINTS).preferred_taints
        ranks: list[RankState] = []
        multipliers: list[float] | None = [] if preferred else None
        if pinned is None and multipliers is None and len(workers) == len(self.workers):
            ranks = self._all_ranks  # eligible workers are a subset of the registered ones: all of them
        else:
            for worker in workers:
                worker_ranks = self._ranks_of[worker.worker_id]
                if pinned is not None:
                    worker_ranks = tuple(rank for rank in worker_ranks if rank.key == pinned)
                ranks.extend(worker_ranks)
                if multipliers is not None:
                    multipliers.extend([_taint_multiplier(preferred, worker.taints)] * len(worker_ranks))
        fills, pass_tokens = (None, None) if cached_blocks is None else self._capacities(ranks, cached_blocks)
        context = SelectionContext(
            isl_tokens=prompt.isl_tokens,
            config=config or self._config,
            ranks=ranks,
            overlaps=overlaps,
            depths=self.sequences.prefix_depths(prompt.shared_hashes) if prompt.shared_hashes else {},
            booked_blocks=prompt.booked_blocks,
            taint_multipliers=multipliers,
            expected_output_tokens=expected_output_tokens,
            cache_fill=fills,
            pass_tokens=pass_tokens,
            prefill_leg=prefill_leg,
        )
        # A pinned rank is the caller's choice; it is still reported with its load.
        policy = self._prefill_policy if prefill_leg else self._policy
        selection = policy.select(context) if pinned is None else Selection(0, "pinned by the caller")
        key = ranks[selection.index].key
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "%s picked worker %d dp_rank %d: %s (%d candidates)",
                policy.name,
                key[0],
                key[1],
                selection.reason,
                len(ranks),
            )
        explanation = _explain(policy.name, context, selection) if explain else None
        reason: PickReason
        if pinned is not None:
            reason = "pinned"
        elif thresholded:
            reason = "threshold"
        elif selection.probabilities is not None:
            reason = "sampled"
        elif selection.costs is not None:
            costs = selection.costs
            reason = "tie" if costs.count(min(costs)) > 1 else "lowest_cost"
        else:
            reason = "policy"
        return Choice(key, overlaps.get(key, NO_OVERLAP), explanation, reason, len(ranks))

    def _capacities(
        self, ranks: list[RankState], cached_blocks: Mapping[WorkerRank, int]
    ) -> tuple[dict[WorkerRank, float], dict[WorkerRank, int]]:
        """Per rank, the fraction of its KV blocks its cache holds, and its worker's
        ``max_num_batched_tokens``. A worker of unknown capacity is as full as the candidates that said
        theirs, on average, so that it is not shunned beside them; as full as can be when none did.
        Likewise its pass budget is their mean (absent when none said one)."""
        if ranks is self._all_ranks:
            rows = self._all_capacities
            pass_tokens = self._all_pass_tokens
        else:
            capacity_of = self._capacity_of
            rows = [(rank.key, *capacity_of[rank.key]) for rank in ranks]
            pass_tokens = _pass_budgets(rows)
        fills = {}
        unknown = []
        for key, total, _ in rows:
            if total:
                fill = cached_blocks.get(key, 0) / total
                fills[key] = fill if fill <= 1.0 else 1.0
            else:
                unknown.append(key)
        if unknown:
            fill = sum(fills.values()) / len(fills) if fills else 1.0
            fills.update(dict.fromkeys(unknown, fill))
        return fills, pass_tokens

    def book(
        self,
        request_id: str,
        choice: Choice,
        prompt: Prompt,
        now: float,
        config: RouterConfig | None = None,
        expected_output_tokens: int | None = None,
    ) -> None:
        """Book the request on the chosen rank: its prompt blocks and its uncached prefill (§4.5).
        ``config`` is the request's own, as for `select`."""
        prefill_tokens = 0
        if (config or self._config).router_track_prefill_tokens:
            prefill_tokens = max(prompt.isl_tokens - choice.overlap.cached_tokens, 0)
        self.sequences.add(
            request_id,
            choice.key,
            hashes=prompt.shared_hashes,
            private_blocks=prompt.private_blocks,
            prefill_tokens=prefill_tokens,
            now=now,
            context_tokens=prompt.isl_tokens,
            expected_output_tokens=expected_output_tokens,
        )

    # ------------------------------------------------------------------ reads
    def potential_loads(self, prompt: Prompt, overlaps: Mapping[WorkerRank, RankOverlap]) -> list[PotentialLoad]:
        """Every rank's load if the prompt went there, in registration order (§4.5). Books nothing."""
        depths = self.sequences.prefix_depths(prompt.shared_hashes) if prompt.shared_hashes else {}
        booked_blocks = prompt.booked_blocks
        isl = prompt.isl_tokens
        track_prefill = self._config.router_track_prefill_tokens
        loads = []
        for ranks in self._ranks_of.values():
            for rank in ranks:
                added_tokens = max(isl - overlaps.get(rank.key, NO_OVERLAP).cached_tokens, 0) if track_prefill else 0
                loads.append(
                    PotentialLoad(
                        worker_id=rank.worker_id,
                        dp_rank=rank.dp_rank,
                        potential_prefill_tokens=rank.prefill_tokens + added_tokens,
                        potential_decode_blocks=rank.decode_blocks + booked_blocks - depths.get(rank, 0),
                        active_requests=rank.requests,
                    )
                )
        return loads

    def rank_loads(self) -> list[RankLoad]:
        """Every rank's live load and whether it is busy (§4.6), in registration order."""
        loads = []
        for worker in self.workers:
            for rank in self._ranks_of[worker.worker_id]:
                kv_used = self.workers.kv_used_blocks(rank.key)
                waiting, running = self.workers.engine_requests(rank.key)
                loads.append(
                    RankLoad(
                        worker_id=rank.worker_id,
                        dp_rank=rank.dp_rank,
                        active_prefill_tokens=rank.prefill_tokens,
                        active_decode_blocks=rank.decode_blocks,
                        active_requests=rank.requests,
                        kv_used_blocks=kv_used,
                        busy=rank_is_busy(self._config, worker, rank, kv_used),
                        engine_requests_waiting=waiting,
                        engine_requests_running=running,
                    )
                )
        return loads


def _pass_budgets(rows: list[tuple[WorkerRank, int | None, int | None]]) -> dict[WorkerRank, int]:
    """Per rank (key, total blocks, pass budget) its pass budget; a rank of unknown budget gets the mean
    of those that said theirs (none when no rank did), so that the `latency` policy prices its passes
    alike instead of giving it a discount beside them."""
    said = {key: budget for key, _, budget in rows if budget}
    if said and len(said) < len(rows):
        mean = round(sum(said.values()) / len(said))
        said.update({key: mean for key, _, budget in rows if not budget})
    return said


def _taint_multiplier(preferred: Mapping[str, float], taints: frozenset[str]) -> float:
    """§4.4: exp(-tanh(sum of the weights of the preferred taints the worker has)), in [1/e, e]."""
    return math.exp(-math.tanh(sum(weight for taint, weight in preferred.items() if taint in taints)))


def _explain(policy: str, context: SelectionContext, selection: Selection) -> DecisionExplanation:
    costs = selection.costs
    probabilities = selection.probabilities
    candidates = [context.candidate(index) for index in range(len(context))]
    return DecisionExplanation(
        policy=policy,
        reason=selection.reason,
        candidates=[
            CandidateExplanation(
                worker_id=candidate.worker_id,
                dp_rank=candidate.dp_rank,
                device_overlap_blocks=candidate.device_blocks,
                effective_overlap_blocks=candidate.effective_overlap_blocks,
                potential_prefill_tokens=context.potential_prefill_tokens(candidate),
                potential_decode_blocks=candidate.potential_decode_blocks,
                active_requests=candidate.active_requests,
                cost=None if costs is None else costs[index],
                probability=None if probabilities is None else probabilities[index],
            )
            for index, candidate in enumerate(candidates)
        ],
    )

"""What every selection policy sees and returns, and the contract it keeps.

A policy is handed the eligible, not-overloaded (worker, dp_rank) candidates of one request, with
their cached prefix and their live and projected load, and returns the index of its pick with the reason.
Policies are pure with respect to router state: they never book, queue or touch the index; the only
state they may keep is their own (a round-robin cursor, an RNG).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from indexer.slots import WorkerRank
from router.config import RouterConfig
from router.overlap import NO_OVERLAP, RankOverlap
from router.sequences import RankState

__all__ = ["Candidate", "PolicyFactory", "Selection", "SelectionContext", "SelectionPolicy"]


class Candidate:
    """One (worker, dp_rank) a request may go to."""

    __slots__ = (
        "active_decode_blocks",
        "active_prefill_tokens",
        "active_requests",
        "cached_tokens",
        "device_blocks",
        "disk_blocks",
        "dp_rank",
        "effective_overlap_blocks",
        "host_blocks",
        "new_blocks",
        "taint_multiplier",
        "worker_id",
    )

    def __init__(
        self,
        worker_id: int,
        dp_rank: int,
        *,
        device_blocks: int,
        host_blocks: int,
        disk_blocks: int,
        effective_overlap_blocks: float,
        cached_tokens: int,
        active_prefill_tokens: int,
        active_decode_blocks: int,
        new_blocks: int,
        active_requests: int,
        taint_multiplier: float | None,
    ) -> None:
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        # Cached prefix: device blocks, then host and disk(+external) extension blocks beyond it.
        self.device_blocks = device_blocks
        self.host_blocks = host_blocks
        self.disk_blocks = disk_blocks
        self.effective_overlap_blocks = effective_overlap_blocks
        self.cached_tokens = cached_tokens
        # Live load, and the prompt blocks not yet active on this rank.
        self.active_prefill_tokens = active_prefill_tokens
        self.active_decode_blocks = active_decode_blocks
        self.new_blocks = new_blocks
        self.active_requests = active_requests
        # exp(-tanh(sum of matching preferred-taint weights)); None when the request prefers none.
        self.taint_multiplier = taint_multiplier

    @property
    def potential_decode_blocks(self) -> int:
        return self.active_decode_blocks + self.new_blocks

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"Candidate({fields})"


class SelectionContext:
    """One request's candidates, column by column: scoring 64 ranks must not build 64 objects.

        ``ranks`` are the candidate ranks in registration order; ``overlaps`` and ``depths`` are sparse
        (a rank absent from them has no cached prefix / no active prefix of the prompt);
        ``taint_multipliers`` is per candidate when the request prefers taints, else None; ``config`` is the
    router's config with the request's `RouterConfigOverride` applied. All of them are
        the scheduler's and read-only here. `candidate` gives one rank as a `Candidate` for policies and
        explanations that want the detail.
    """

    __slots__ = (
        "block_size",
        "booked_blocks",
        "cache_fill",
        "config",
        "depths",
        "expected_output_tokens",
        "isl_tokens",
        "overlaps",
        "pass_tokens",
        "prefill_leg",
        "ranks",
        "taint_multipliers",
        "track_prefill_tokens",
    )

    def __init__(
        self,
        *,
        isl_tokens: int,
        config: RouterConfig,
        ranks: Sequence[RankState],
        overlaps: Mapping[WorkerRank, RankOverlap],
        depths: Mapping[RankState, int],
        booked_blocks: int,
        taint_multipliers: Sequence[float] | None,
        expected_output_tokens: int | None = None,
        cache_fill: Mapping[WorkerRank, float] | None = None,
        pass_tokens: Mapping[WorkerRank, int] | None = None,
        prefill_leg: bool = False,
    ) -> None:
        self.isl_tokens = isl_tokens
        # A disaggregated request's prefill leg: it computes the prompt's KV and decodes nothing there.
        self.prefill_leg = prefill_leg
        # The config in force for this request: the router's, with the request's override applied.
        self.config = config
        self.block_size = config.block_size
        self.track_prefill_tokens = config.router_track_prefill_tokens
        self.expected_output_tokens = expected_output_tokens
        # Per rank, the fraction of its KV blocks its cache holds, and its worker's max_num_batched_tokens
        # where known (both for policies with ``uses_cache_fill``).
        self.cache_fill = cache_fill
        self.pass_tokens = pass_tokens
        self.ranks = ranks
        self.overlaps = overlaps
        self.depths = depths
        self.booked_blocks = booked_blocks
        self.taint_multipliers = taint_multipliers

    def __len__(self) -> int:
        return len(self.ranks)

    def candidate(self, index: int) -> Candidate:
        rank = self.ranks[index]
        overlap = self.overlaps.get(rank.key, NO_OVERLAP)
        return Candidate(
            rank.worker_id,
            rank.dp_rank,
            device_blocks=overlap.device_blocks,
            host_blocks=overlap.host_blocks,
            disk_blocks=overlap.disk_blocks,
            effective_overlap_blocks=overlap.effective_blocks,
            cached_tokens=overlap.cached_tokens,
            active_prefill_tokens=rank.prefill_tokens,
            active_decode_blocks=rank.decode_blocks,
            new_blocks=self.booked_blocks - self.depths.get(rank, 0),
            active_requests=rank.requests,
            taint_multiplier=None if self.taint_multipliers is None else self.taint_multipliers[index],
        )

    def potential_prefill_tokens(self, candidate: Candidate) -> int:
        """The candidate's prefill backlog if the request went there (§4.5)."""
        if not self.track_prefill_tokens:
            return candidate.active_prefill_tokens
        return candidate.active_prefill_tokens + max(self.isl_tokens - candidate.cached_tokens, 0)


@dataclass(frozen=True, slots=True)
class Selection:
    """The pick: an index into the candidates, why, and the scores behind it when the policy scores."""

    index: int
    reason: str
    costs: list[float] | None = None
    probabilities: list[float] | None = None


class SelectionPolicy(Protocol):
    """Picks one candidate; the context is never empty. A policy subclassing this protocol inherits
    the two ``uses_*`` defaults; one that only has its shape declares them itself."""

    name: str
    # What the policy reads beyond loads and overlaps, gathered for it alone: each rank's cache fill
    # (a pass over the index's ranks), and each rank's context in flight, which output progress
    # (`KvRouter.record_output`) grows.
    uses_cache_fill: bool = False
    uses_context_in_flight: bool = False

    def select(self, context: SelectionContext) -> Selection: ...


# How the registry builds a policy: from the router config and the router's seeded RNG.
PolicyFactory = Callable[[RouterConfig, random.Random], SelectionPolicy]

"""What every selection policy sees and returns, and the contract it keeps.

A policy is handed the eligible, not-overloaded (worker, dp_rank) candidates of one request, each with
its cached prefix and its live and projected load, and returns the index of its pick with the reason.
Policies are pure with respect to router state: they never book, queue or touch the index; the only
state they may keep is their own (a round-robin cursor, an RNG).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from router.config import RouterConfig

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


class SelectionContext(NamedTuple):
    """One request's view: its length and its candidates, in registration order."""

    isl_tokens: int
    block_size: int
    track_prefill_tokens: bool
    candidates: Sequence[Candidate]

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
    """Picks one candidate; `candidates` is never empty."""

    name: str

    def select(self, context: SelectionContext) -> Selection: ...


# How the registry builds a policy: from the router config and the router's seeded RNG.
PolicyFactory = Callable[[RouterConfig, random.Random], SelectionPolicy]

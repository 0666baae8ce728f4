"""Cache-blind baselines: `round_robin`, `random` and `least_loaded`.

They ignore the prompt's cached prefix, which makes them the yardsticks KV-aware routing is judged
against (the peers' "round robin" and "least request" modes).
"""

from __future__ import annotations

import random

from router.config import RouterConfig
from router.policies.base import Selection, SelectionContext, SelectionPolicy

__all__ = ["LeastLoadedPolicy", "RandomPolicy", "RoundRobinPolicy"]


class RoundRobinPolicy(SelectionPolicy):
    """Each request takes the next candidate in turn (a cursor over the candidate list)."""

    name = "round_robin"

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        self._turn = 0

    def select(self, context: SelectionContext) -> Selection:
        index = self._turn % len(context)
        self._turn += 1
        return Selection(index, "round robin")


class RandomPolicy(SelectionPolicy):
    """A uniformly random candidate."""

    name = "random"

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        self._rng = rng

    def select(self, context: SelectionContext) -> Selection:
        return Selection(self._rng.randrange(len(context)), "uniformly at random")


class LeastLoadedPolicy(SelectionPolicy):
    """The fewest active requests, then the fewest pending prefill tokens, then the fewest active
    blocks; remaining ties uniformly at random. The cost reported is the active request count."""

    name = "least_loaded"

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        self._rng = rng

    def select(self, context: SelectionContext) -> Selection:
        best = 0
        best_key: tuple[int, int, int] | None = None
        ties = 0
        for index, rank in enumerate(context.ranks):
            key = (rank.requests, rank.prefill_tokens, rank.decode_blocks)
            if best_key is None or key < best_key:
                best, best_key, ties = index, key, 1
            elif key == best_key:
                ties += 1
                if self._rng.randrange(ties) == 0:
                    best = index
        assert best_key is not None
        costs = [float(rank.requests) for rank in context.ranks]
        reason = f"least loaded: {best_key[0]} active requests, {best_key[1]} prefill tokens, {best_key[2]} blocks"
        if ties > 1:
            reason += f", tied with {ties - 1} other(s); picked uniformly at random"
        return Selection(best, reason, costs)

"""Emulations of two peer routers, as `FleetRouter`s, so the replay can compare against them.

Each uses only what the real router knows. Sources: ../shared/reference/peers.md (SGLang router
family, llm-d) and the defaults of the peers' own code.

``sglang``: SGLang's ``cache_aware`` policy (sgl-router / sgl-model-gateway), with its current defaults.
  It never sees engine events: it keeps an approximate prefix tree of *its own* decisions, one tenant
  per worker, and a router-local count of requests in flight per worker. Per request:

  - if the loads are imbalanced, ``max - min > balance_abs_threshold`` (64) and
    ``max > min * balance_rel_threshold`` (1.5), the least-loaded worker;
  - else, if the longest prefix any worker's tree holds covers more than ``cache_threshold`` (0.3) of
    the prompt, a worker that holds it (SGLang takes the first its concurrent map yields: any of them);
  - else the worker with the smallest tree;

  and the prompt is inserted into the chosen worker's tree. Every ``eviction_interval`` (120 s) each
  worker's tree is trimmed, least recently used first, to ``max_tree_size`` (2^26) tokens. SGLang's
  tree is exact to the character or token; this one is exact to the block (``RouterConfig.block_size``),
  so a match can be shorter by less than one block.

``llmd``: llm-d's precise prefix-cache scheduling profile: weighted scorers summed, highest total wins
  (random tie-break). ``prefix-cache-scorer`` (weight 2) is the fraction of the prompt's blocks held by
  the worker, from an index fed by the engines' KV events; ``queue-scorer`` (weight 1) is the waiting
  queue min-max normalised over the workers (shortest 1, longest 0); ``kv-cache-utilization-scorer``
  (weight 1) is ``1 - kv usage``. Queue and usage come from engine metrics scraped every 50 ms (the
  endpoint picker's refresh period), so within that period every decision sees the same load.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

from indexer.errors import KvIndexError
from indexer.events import RouterEvent
from indexer.hashing import compute_block_hashes, compute_sequence_hashes
from indexer.radix_tree import RadixTree
from mocker.config import EngineConfig
from mocker.engine import EngineMetrics
from mocker.fleet import FleetRouter, RoutedRequest, RouteResult
from router.config import RouterConfig

__all__ = ["BASELINES", "LlmdScorers", "SglangCacheAware"]


class SglangCacheAware:
    """SGLang's ``cache_aware`` routing over an approximate, decision-fed prefix tree."""

    name = "sglang"
    rejected_events = 0  # it reads no KV events
    scrape_interval_ms: float | None = None

    def __init__(
        self,
        config: RouterConfig,
        rng: random.Random,
        *,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        eviction_interval_ms: float = 120_000.0,
        max_tree_size: int = 2**26,
    ) -> None:
        self.block_size = config.block_size
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.eviction_interval_ms = eviction_interval_ms
        self.max_tree_size = max_tree_size
        self._rng = rng
        self._workers: list[int] = []
        self._in_flight: list[int] = []  # per worker slot
        self._owner_of: dict[str, int] = {}  # request id -> worker slot
        # The tree: prefix (sequence hash of its last block) -> bitmask of the worker slots holding it.
        # A worker holding a prefix holds all its ancestors, as in a radix tree.
        self._holders: dict[int, int] = {}
        # Per worker slot, its prefixes least recently used first (a prefix's descendants before it).
        self._recency: list[dict[int, None]] = []
        self._next_eviction = eviction_interval_ms

    def add_worker(self, worker_id: int, engine: EngineConfig) -> None:
        self._workers.append(worker_id)
        self._in_flight.append(0)
        self._recency.append({})

    async def route(self, request: RoutedRequest, now_ms: float) -> RouteResult:
        if now_ms >= self._next_eviction:
            self._evict()
            self._next_eviction = (now_ms // self.eviction_interval_ms + 1) * self.eviction_interval_ms
        prefixes = compute_sequence_hashes(compute_block_hashes(request.tokens, self.block_size))
        loads = self._in_flight
        slots = range(len(self._workers))
        most, least = max(loads), min(loads)
        if most - least > self.balance_abs_threshold and most > least * self.balance_rel_threshold:
            slot = min(slots, key=loads.__getitem__)
        else:
            depth, holders = self._longest_match(prefixes)
            if holders and depth * self.block_size / request.input_length > self.cache_threshold:
                # SGLang takes whichever holder its concurrent map yields first: in effect any of them.
                slot = self._rng.choice([s for s in slots if holders >> s & 1])
            else:
                slot = min(slots, key=lambda s: len(self._recency[s]))  # the smallest tree
        predicted = self._held_by(prefixes, slot) * self.block_size
        self._insert(prefixes, slot)
        loads[slot] += 1
        self._owner_of[request.request_id] = slot
        return RouteResult(self._workers[slot], min(predicted, request.input_length))

    def kv_event(self, event: RouterEvent, now_ms: float) -> None:
        return None  # cache_aware in its approximate modes never sees engine events

    def first_token(self, request_id: str, now_ms: float) -> None:
        return None

    def output(self, request_id: str, generated_tokens: int, now_ms: float) -> None:
        return None  # the gateway counts requests in flight, not their tokens

    def finished(self, request_id: str, now_ms: float) -> None:
        slot = self._owner_of.pop(request_id, None)
        if slot is not None:
            self._in_flight[slot] -= 1

    def scraped(self, metrics: dict[int, EngineMetrics], now_ms: float) -> None:
        return None

    # ------------------------------------------------------------------ the approximate tree
    def _longest_match(self, prefixes: list[int]) -> tuple[int, int]:
        """The longest prefix any worker holds, in blocks, and the bitmask of its holders."""
        tree = self._holders
        depth = holders = 0
        for prefix in prefixes:
            found = tree.get(prefix, 0)
            if not found:
                break
            depth += 1
            holders = found
        return depth, holders

    def _held_by(self, prefixes: list[int], slot: int) -> int:
        tree = self._holders
        held = 0
        for prefix in prefixes:
            if not tree.get(prefix, 0) >> slot & 1:
                break
            held += 1
        return held

    def _insert(self, prefixes: list[int], slot: int) -> None:
        tree = self._holders
        bit = 1 << slot
        recency = self._recency[slot]
        # Leaf first, so that within one prompt the root is the most recent and evicted last.
        for prefix in reversed(prefixes):
            tree[prefix] = tree.get(prefix, 0) | bit
            recency.pop(prefix, None)
            recency[prefix] = None

    def _evict(self) -> None:
        """Trim each worker's tree to ``max_tree_size`` tokens, least recently used first."""
        limit = self.max_tree_size // self.block_size
        tree = self._holders
        for slot, recency in enumerate(self._recency):
            excess = len(recency) - limit
            if excess <= 0:
                continue
            clear = ~(1 << slot)
            for prefix in list(itertools.islice(recency, excess)):
                del recency[prefix]
                holders = tree[prefix] & clear
                if holders:
                    tree[prefix] = holders
                else:
                    del tree[prefix]


class LlmdScorers:
    """llm-d's weighted scorers: precise prefix (KV events) 2, queue 1, KV utilisation 1."""

    name = "llmd"

    def __init__(
        self,
        config: RouterConfig,
        rng: random.Random,
        *,
        prefix_weight: float = 2.0,
        queue_weight: float = 1.0,
        kv_usage_weight: float = 1.0,
        scrape_interval_ms: float = 50.0,
    ) -> None:
        self.block_size = config.block_size
        self.prefix_weight = prefix_weight
        self.queue_weight = queue_weight
        self.kv_usage_weight = kv_usage_weight
        self.scrape_interval_ms: float | None = scrape_interval_ms
        self._rng = rng
        self._index = RadixTree()
        self._workers: list[int] = []
        self._metrics: dict[int, EngineMetrics] = {}
        self.rejected_events = 0

    def add_worker(self, worker_id: int, engine: EngineConfig) -> None:
        self._workers.append(worker_id)

    async def route(self, request: RoutedRequest, now_ms: float) -> RouteResult:
        local_hashes = compute_block_hashes(request.tokens, self.block_size)
        matched = self._index.find_matches(local_hashes).scores
        blocks = len(local_hashes)
        queues = [self._metrics[w].waiting if w in self._metrics else 0 for w in self._workers]
        shortest, longest = min(queues), max(queues)
        best: list[int] = []
        best_score = -1.0
        for worker, queue in zip(self._workers, queues, strict=True):
            prefix = matched.get((worker, 0), 0) / blocks if blocks else 0.0
            queue_score = 1.0 if longest == shortest else (longest - queue) / (longest - shortest)
            usage = self._metrics[worker].kv_usage if worker in self._metrics else 0.0
            score = self.prefix_weight * prefix + self.queue_weight * queue_score + self.kv_usage_weight * (1 - usage)
            if score > best_score:
                best, best_score = [worker], score
            elif score == best_score:
                best.append(worker)
        worker = best[0] if len(best) == 1 else self._rng.choice(best)
        predicted = matched.get((worker, 0), 0) * self.block_size
        return RouteResult(worker, min(predicted, request.input_length))

    def kv_event(self, event: RouterEvent, now_ms: float) -> None:
        try:
            self._index.apply_router_event(event)
        except KvIndexError:
            self.rejected_events += 1

    def first_token(self, request_id: str, now_ms: float) -> None:
        return None

    def output(self, request_id: str, generated_tokens: int, now_ms: float) -> None:
        return None  # its load comes from the scraped engine metrics

    def finished(self, request_id: str, now_ms: float) -> None:
        return None

    def scraped(self, metrics: dict[int, EngineMetrics], now_ms: float) -> None:
        self._metrics = dict(metrics)


BASELINES: dict[str, Callable[[RouterConfig, random.Random], FleetRouter]] = {
    SglangCacheAware.name: SglangCacheAware,
    LlmdScorers.name: LlmdScorers,
}

"""The routers a disaggregated replay compares (`kv-router replay --prefill-workers N --decode-workers M`).

- ``aggregated``: our router (``RouterConfig.policy``) on N + M workers that each prefill and decode;
- ``disagg-always``: our router on the disaggregated fleet, every request prefilled remotely
  (``disagg_local_prefill_below_tokens=0``);
- ``disagg-conditional``: our router, prefilled on the decode worker when little of the prompt is
  uncached there (``disagg_local_prefill_below_tokens``, 256 by default);
- ``disagg-load-aware``: disagg-conditional, and also prefilled on the decode worker when fewer than 3,072
  prompt tokens are uncached there and its queue, weighted, is the shorter wait
  (``disagg_local_prefill_sooner_below_tokens``, ``disagg_local_prefill_cost_factor``: 2);
- ``disagg-estimated``: disagg-conditional, and also prefilled on the decode worker whenever the router's
  estimate of the first token is sooner there, its prefill charged for the decode batch it stalls
  (``disagg_local_prefill_stall_weight``: 0.25, ``disagg_transfer_cost_per_token``: 0.35);
- ``vllm-router-pd``: vllm-router's PD mode (peers.md §2.5): prefill and decode URL lists, each with its
  own policy, every request disaggregated (the uncached-token bypass is an open proposal, PR #130). The
  prefill pool runs ``kv_aware`` (the longest cached prefix from the engines' KV events, the least
  loaded worker on a tie or a miss: its "fair fallback"), the decode pool ``power_of_two`` (the one of
  two random workers with fewer requests in flight);
- ``sglang-pd``: SGLang's gateway in PD mode (peers.md §2.1): separate prefill and decode policies,
  both ``cache_aware`` by default (`mocker.baselines.SglangCacheAware`, its approximate tree and
  imbalance gate, one instance per pool), every request disaggregated (bootstrap injection sends both
  legs at once; the decode leg waits for the KV, which times the same as sending it after the prefill).

The peers' in-flight counts go down as theirs do: a prefill worker's when its leg ends, a decode
worker's when the request finishes.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import msgspec

from indexer.errors import KvIndexError
from indexer.events import RouterEvent
from indexer.hashing import compute_block_hashes
from indexer.radix_tree import RadixTree
from mocker.baselines import SglangCacheAware
from mocker.config import EngineConfig
from mocker.engine import EngineMetrics
from mocker.fleet import DisaggregatedFleetRouter, FleetRouter, RoutedRequest, RouteResult
from mocker.routers import KvFleetRouter
from router.config import RouterConfig
from router.types import WorkerRole

__all__ = [
    "AGGREGATED",
    "ESTIMATED_STALL_WEIGHT",
    "LOAD_AWARE_SOONER_BELOW_TOKENS",
    "PD_ROUTERS",
    "PEER_PD_ROUTERS",
    "PdPair",
    "PowerOfTwo",
    "VllmKvAware",
    "make_pd_router",
]

AGGREGATED = "aggregated"
# disagg-load-aware's size limit on the local path when it is the shorter wait (docs/disaggregation.md).
LOAD_AWARE_SOONER_BELOW_TOKENS = 3072
# disagg-estimated's stall weight (docs/disaggregation.md: swept on mooncake_trace_1000, seeds 0 and 1).
ESTIMATED_STALL_WEIGHT = 0.25


class _InFlight:
    """Router-local requests in flight per worker, as the peers count them."""

    def __init__(self) -> None:
        self.workers: list[int] = []
        self.counts: dict[int, int] = {}
        self._owner: dict[str, int] = {}

    def add_worker(self, worker_id: int) -> None:
        self.workers.append(worker_id)
        self.counts[worker_id] = 0

    def start(self, request_id: str, worker_id: int) -> None:
        self._owner[request_id] = worker_id
        self.counts[worker_id] += 1

    def end(self, request_id: str) -> None:
        worker = self._owner.pop(request_id, None)
        if worker is not None:
            self.counts[worker] -= 1


class _InFlightPeer:
    """What both peer policies share: the workers and their requests in flight, ended when the
    request finishes; no use for first tokens, output progress or scrapes."""

    scrape_interval_ms: float | None = None
    rejected_events = 0  # PowerOfTwo reads no KV events; VllmKvAware counts its index's refusals

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        self._rng = rng
        self._in_flight = _InFlight()

    def add_worker(self, worker_id: int, engine: EngineConfig) -> None:
        self._in_flight.add_worker(worker_id)

    def kv_event(self, event: RouterEvent, now_ms: float) -> None:
        return None

    def first_token(self, request_id: str, now_ms: float) -> None:
        return None

    def output(self, request_id: str, generated_tokens: int, now_ms: float) -> None:
        return None

    def finished(self, request_id: str, now_ms: float) -> None:
        self._in_flight.end(request_id)

    def scraped(self, metrics: dict[int, EngineMetrics], now_ms: float) -> None:
        return None


class VllmKvAware(_InFlightPeer):
    """vllm-router's ``kv_aware``: the longest prefix of complete blocks a worker's KV events say it holds;
    on a tie (a miss included) the worker with the fewest requests in flight, then a random one."""

    name = "vllm-kv-aware"

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        super().__init__(config, rng)
        self.block_size = config.block_size
        self._index = RadixTree()

    async def route(self, request: RoutedRequest, now_ms: float) -> RouteResult:
        matched = self._index.find_matches(compute_block_hashes(request.tokens, self.block_size)).scores
        counts = self._in_flight.counts
        ranked = [(-matched.get((w, 0), 0), counts[w]) for w in self._in_flight.workers]
        best = min(ranked)
        tied = [w for w, key in zip(self._in_flight.workers, ranked, strict=True) if key == best]
        worker = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        self._in_flight.start(request.request_id, worker)
        return RouteResult(worker, min(-best[0] * self.block_size, request.input_length))

    def kv_event(self, event: RouterEvent, now_ms: float) -> None:
        try:
            self._index.apply_router_event(event)
        except KvIndexError:
            self.rejected_events += 1


class PowerOfTwo(_InFlightPeer):
    """``power_of_two``: of two distinct random workers, the one with fewer requests in flight."""

    name = "power-of-two"

    async def route(self, request: RoutedRequest, now_ms: float) -> RouteResult:
        workers = self._in_flight.workers
        drawn = self._rng.sample(workers, 2) if len(workers) > 1 else workers
        worker = min(drawn, key=self._in_flight.counts.__getitem__)
        self._in_flight.start(request.request_id, worker)
        return RouteResult(worker, 0)


class PdPair:
    """A peer's PD mode: one router per pool, every request disaggregated. Each pool's router sees only
    its own workers and their KV events; the prefill router's request ends with its leg."""

    scrape_interval_ms: float | None = None

    def __init__(self, name: str, prefill: FleetRouter, decode: FleetRouter) -> None:
        self.name = name
        self.prefill = prefill
        self.decode = decode
        self._pool_of: dict[int, FleetRouter] = {}

    @property
    def rejected_events(self) -> int:
        return self.prefill.rejected_events + self.decode.rejected_events

    def add_worker(self, worker_id: int, engine: EngineConfig) -> None:
        raise ValueError(f"{self.name} routes a disaggregated fleet only: give each worker a role")

    def add_pool_worker(self, worker_id: int, engine: EngineConfig, role: WorkerRole) -> None:
        if role == "both":
            raise ValueError(f"{self.name} takes separate prefill and decode workers, not role both")
        pool = self.prefill if role == "prefill" else self.decode
        pool.add_worker(worker_id, engine)
        self._pool_of[worker_id] = pool

    async def route(self, request: RoutedRequest, now_ms: float) -> RouteResult:
        decode = await self.decode.route(request, now_ms)
        prefill = await self.prefill.route(request, now_ms)
        return RouteResult(decode.worker_id, prefill.predicted_cached_tokens, False, prefill.worker_id)

    def kv_event(self, event: RouterEvent, now_ms: float) -> None:
        self._pool_of[event.worker_id].kv_event(event, now_ms)

    def prefill_done(self, request_id: str, now_ms: float) -> None:
        self.prefill.first_token(request_id, now_ms)
        self.prefill.finished(request_id, now_ms)

    def first_token(self, request_id: str, now_ms: float) -> None:
        self.decode.first_token(request_id, now_ms)

    def output(self, request_id: str, generated_tokens: int, now_ms: float) -> None:
        self.decode.output(request_id, generated_tokens, now_ms)

    def finished(self, request_id: str, now_ms: float) -> None:
        self.decode.finished(request_id, now_ms)

    def scraped(self, metrics: dict[int, EngineMetrics], now_ms: float) -> None:
        return None


def _ours(name: str, **settings: object) -> Callable[[RouterConfig, random.Random], DisaggregatedFleetRouter]:
    def make(config: RouterConfig, rng: random.Random) -> DisaggregatedFleetRouter:
        return KvFleetRouter(msgspec.structs.replace(config, **settings), rng, name=name)

    return make


PD_ROUTERS: dict[str, Callable[[RouterConfig, random.Random], DisaggregatedFleetRouter]] = {
    "disagg-always": _ours(
        "disagg-always",
        disagg_local_prefill_below_tokens=0,
        disagg_local_prefill_sooner_below_tokens=None,
        disagg_local_prefill_stall_weight=None,
    ),
    "disagg-conditional": _ours("disagg-conditional"),
    "disagg-load-aware": _ours(
        "disagg-load-aware", disagg_local_prefill_sooner_below_tokens=LOAD_AWARE_SOONER_BELOW_TOKENS
    ),
    "disagg-estimated": _ours("disagg-estimated", disagg_local_prefill_stall_weight=ESTIMATED_STALL_WEIGHT),
    "vllm-router-pd": lambda config, rng: PdPair("vllm-router-pd", VllmKvAware(config, rng), PowerOfTwo(config, rng)),
    "sglang-pd": lambda config, rng: PdPair("sglang-pd", SglangCacheAware(config, rng), SglangCacheAware(config, rng)),
}


# The peers' emulated PD modes: separate prefill and decode pools only (no worker of role both).
PEER_PD_ROUTERS = ("vllm-router-pd", "sglang-pd")


def make_pd_router(spec: str, config: RouterConfig, rng: random.Random) -> DisaggregatedFleetRouter:
    """A disaggregated fleet's router by name (`PD_ROUTERS`)."""
    factory = PD_ROUTERS.get(spec)
    if factory is None:
        known = ", ".join([AGGREGATED, *PD_ROUTERS])
        raise ValueError(f"unknown router {spec!r} for a disaggregated fleet; known: {known}")
    return factory(config, rng)

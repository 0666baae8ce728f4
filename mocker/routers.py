"""The routers a replay can measure, each behind the `mocker.fleet.FleetRouter` interface.

`make_router` builds one from a name:

- a registered `router.policies` name (``dynamo``, ``round_robin``, ``random``, ``least_loaded``, ...):
  our `KvRouter` with that selection policy (`KvFleetRouter`);
- ``sglang`` or ``llmd``: the peer emulations of `mocker.baselines`;
- ``module:factory``: anything importable. The factory is called with ``(RouterConfig, random.Random)``
  like a registry `PolicyFactory`; if it returns a `SelectionPolicy` (it has ``select``), it runs inside
  `KvRouter` like the built-in policies; if it returns a `FleetRouter` (it has ``route``), it is used
  as it is, so any other router can be measured in the same simulator.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable

import msgspec

from indexer.errors import KvIndexError
from indexer.events import RouterEvent
from mocker.config import EngineConfig
from mocker.engine import EngineMetrics
from mocker.fleet import FleetRouter, RoutedRequest, RouteResult, RouterRejected
from router.config import RouterConfig
from router.errors import KvRouterError
from router.kv_router import KvRouter
from router.policies import policy_names, register_policy
from router.types import RouteRequest, WorkerConfig, WorkerRole

__all__ = ["KvFleetRouter", "make_router", "router_names"]


class KvFleetRouter:
    """Our `KvRouter` (any registered selection policy) in the replay's `FleetRouter` shape."""

    scrape_interval_ms: float | None = None

    def __init__(self, config: RouterConfig, rng: random.Random, *, name: str | None = None) -> None:
        self.name = name or config.policy
        self._now_s = 0.0
        self.router = KvRouter(config, rng=rng, clock=lambda: self._now_s)
        self.rejected_events = 0

    def add_worker(self, worker_id: int, engine: EngineConfig) -> None:
        self.add_pool_worker(worker_id, engine, "both")

    def add_pool_worker(self, worker_id: int, engine: EngineConfig, role: WorkerRole) -> None:
        self.router.register_worker(
            WorkerConfig(
                worker_id=worker_id,
                total_kv_blocks=engine.num_gpu_blocks,
                max_num_batched_tokens=engine.max_num_batched_tokens,
                role=role,
            )
        )

    async def route(self, request: RoutedRequest, now_ms: float) -> RouteResult:
        self._now_s = now_ms / 1000.0
        route_request = RouteRequest(
            tokens=request.tokens, request_id=request.request_id, expected_output_tokens=request.output_length
        )
        try:
            decision = await self.router.new(route_request)
        except KvRouterError as exc:
            raise RouterRejected(str(exc)) from exc
        how = decision.disaggregation
        if how is not None and how.prefill is not None:
            # What the prefill worker holds is what the prompt's computation saves.
            return RouteResult(decision.worker_id, how.prefill.cached_tokens, False, how.prefill.worker_id)
        return RouteResult(decision.worker_id, decision.cached_tokens, decision.timing.queued_s > 0)

    def kv_event(self, event: RouterEvent, now_ms: float) -> None:
        self._now_s = now_ms / 1000.0
        try:
            self.router.apply_event(event)
        except KvIndexError:
            self.rejected_events += 1

    def first_token(self, request_id: str, now_ms: float) -> None:
        self._now_s = now_ms / 1000.0
        self.router.mark_prefill(request_id)

    def prefill_done(self, request_id: str, now_ms: float) -> None:
        self.first_token(request_id, now_ms)  # frees the prefill leg's booking

    def output(self, request_id: str, generated_tokens: int, now_ms: float) -> None:
        self._now_s = now_ms / 1000.0
        self.router.record_output(request_id, generated_tokens)

    def finished(self, request_id: str, now_ms: float) -> None:
        self._now_s = now_ms / 1000.0
        self.router.mark_free(request_id)

    def scraped(self, metrics: dict[int, EngineMetrics], now_ms: float) -> None:
        return None


RouterFactory = Callable[[RouterConfig, random.Random], FleetRouter]


def router_names() -> list[str]:
    """Every router `make_router` knows by name: our policies, then the peer baselines."""
    from mocker.baselines import BASELINES

    return policy_names() + sorted(BASELINES)


def make_router(spec: str, config: RouterConfig, rng: random.Random) -> FleetRouter:
    """The router ``spec`` names, configured by ``config`` (block size, cost knobs) and seeded by ``rng``."""
    from mocker.baselines import BASELINES

    if spec in BASELINES:
        return BASELINES[spec](config, rng)
    if ":" not in spec:
        if spec not in policy_names():
            raise ValueError(f"unknown router {spec!r}; known: {', '.join(router_names())}, or module:factory")
        return KvFleetRouter(msgspec.structs.replace(config, policy=spec), rng)
    module_name, _, attribute = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import router factory {spec!r}: {exc}") from None
    made = factory(config, rng)
    if hasattr(made, "route"):
        if not isinstance(made, FleetRouter):
            raise ValueError(f"{spec} returned {type(made).__name__}, which lacks part of the FleetRouter interface")
        return made
    if not hasattr(made, "select"):
        raise ValueError(f"{spec} returned {type(made).__name__}: neither a SelectionPolicy nor a FleetRouter")
    if spec not in policy_names():
        register_policy(spec, factory)
    return KvFleetRouter(msgspec.structs.replace(config, policy=spec), rng, name=spec)

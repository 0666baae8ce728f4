"""The one small interface a replay drives every router through (`FleetRouter`).

A replay drives a router the way a gateway and an engine fleet would: it asks for a worker for each
request (`route`), forwards every KV event the workers publish (`kv_event`), says when a request's
first token came out (`first_token`), how many tokens it has generated each time its output opens a
new block (`output`, as a gateway streaming the tokens would tell it) and when it finished
(`finished`). Routers that scrape engine metrics, as llm-d does, also receive them every
``scrape_interval_ms`` (`scraped`). Every call carries the simulated time in ms, so a router needs no
clock of its own. A variable holding one is a ``fleet_router``; across the tree a ``router`` is a
`KvRouter` (ours runs inside `mocker.routers.KvFleetRouter`), and a router's name is a plain string.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

from indexer.events import RouterEvent
from mocker.config import EngineConfig
from mocker.engine import EngineMetrics
from router.types import WorkerRole

__all__ = ["DisaggregatedFleetRouter", "FleetRouter", "RouteResult", "RoutedRequest", "RouterRejected"]


class RoutedRequest(NamedTuple):
    request_id: str
    tokens: bytes  # packed little-endian u32
    input_length: int
    output_length: int


class RouteResult(NamedTuple):
    worker_id: int
    # What the router expects the worker to have cached of this prompt (its own prediction).
    predicted_cached_tokens: int
    # Whether the request waited in the router's queue before being routed.
    queued: bool = False
    # Disaggregated fleets: the prefill worker, whose KV then moves to ``worker_id`` (the decode
    # worker); None: ``worker_id`` prefills the prompt itself.
    prefill_worker_id: int | None = None


class RouterRejected(Exception):
    """The router refused the request (queue full, every worker overloaded, no eligible worker)."""


@runtime_checkable
class FleetRouter(Protocol):
    name: str
    # When set, `scraped` receives every worker's engine metrics at this period.
    scrape_interval_ms: float | None

    @property
    def rejected_events(self) -> int:
        """KV events its index refused (0 for a router that reads none): the report's rejected events."""
        ...

    def add_worker(self, worker_id: int, engine: EngineConfig) -> None: ...

    async def route(self, request: RoutedRequest, now_ms: float) -> RouteResult: ...

    def kv_event(self, event: RouterEvent, now_ms: float) -> None: ...

    def first_token(self, request_id: str, now_ms: float) -> None: ...

    def output(self, request_id: str, generated_tokens: int, now_ms: float) -> None: ...

    def finished(self, request_id: str, now_ms: float) -> None: ...

    def scraped(self, metrics: dict[int, EngineMetrics], now_ms: float) -> None: ...


@runtime_checkable
class DisaggregatedFleetRouter(FleetRouter, Protocol):
    """A router of a disaggregated fleet: told each worker's role, and when a request's prefill leg
    ended on its prefill worker (the leg's 1-token reply came back; its KV transfer starts). The other
    calls are about the request as the client sees it, on its decode worker."""

    def add_pool_worker(self, worker_id: int, engine: EngineConfig, role: WorkerRole) -> None: ...

    def prefill_done(self, request_id: str, now_ms: float) -> None: ...

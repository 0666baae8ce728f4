"""The scheduler core: workers, booked load, selection policies, busy thresholds and the queue.

Knows nothing of HTTP. `KvRouter` is the entry point; see README.md for the module map.
"""

from router.config import RouterConfig
from router.errors import (
    AllWorkersOverloaded,
    ConfigError,
    DuplicateRequestId,
    InvalidRequest,
    KvRouterError,
    NoEligibleWorker,
    QueueRejected,
    UnknownWorker,
    WorkersUnavailable,
)
from router.kv_router import KvRouter
from router.types import (
    CandidateExplanation,
    DecisionExplanation,
    DecisionTiming,
    OverlapReport,
    PotentialLoad,
    QueueRejection,
    QueueStats,
    RankLoad,
    RouteDecision,
    RouteRequest,
    RoutingConstraints,
    WorkerConfig,
    WorkerOverlap,
)

__all__ = [
    "AllWorkersOverloaded",
    "CandidateExplanation",
    "ConfigError",
    "DecisionExplanation",
    "DecisionTiming",
    "DuplicateRequestId",
    "InvalidRequest",
    "KvRouter",
    "KvRouterError",
    "NoEligibleWorker",
    "OverlapReport",
    "PotentialLoad",
    "QueueRejected",
    "QueueRejection",
    "QueueStats",
    "RankLoad",
    "RouteDecision",
    "RouteRequest",
    "RouterConfig",
    "RoutingConstraints",
    "UnknownWorker",
    "WorkerConfig",
    "WorkerOverlap",
    "WorkersUnavailable",
]

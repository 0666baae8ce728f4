"""The scheduler core: workers, booked load, selection policies, busy thresholds and the queue.

Knows nothing of HTTP. `KvRouter` is the entry point; see README.md for the module map.
"""

from router.config import ConfigError, RouterConfig
from router.kv_router import KvRouter
from router.types import (
    AllWorkersOverloaded,
    CandidateExplanation,
    DecisionExplanation,
    DecisionTiming,
    DuplicateRequestId,
    InvalidRequest,
    KvRouterError,
    NoEligibleWorker,
    OverlapReport,
    PotentialLoad,
    QueueRejected,
    QueueRejection,
    QueueStats,
    RankLoad,
    RouteDecision,
    RouteRequest,
    RoutingConstraints,
    UnknownWorker,
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
]

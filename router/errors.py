"""Every error the router package raises, in one place.

``KvRouterError`` and its subclasses are what a caller of `KvRouter` handles (the HTTP layer maps
each to a status code); ``ConfigError`` is an invalid setting, raised before anything runs.
"""

from __future__ import annotations

from router.types import QueueRejection

__all__ = [
    "AllWorkersOverloaded",
    "BlockSizeMismatch",
    "ConfigError",
    "DuplicateRequestId",
    "InvalidRequest",
    "KvRouterError",
    "NoEligibleWorker",
    "QueueRejected",
    "UnknownWorker",
    "WorkersUnavailable",
]


class ConfigError(ValueError):
    """An invalid `RouterConfig` value or combination; ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class KvRouterError(Exception):
    """Base of every error the router raises to its callers."""


class InvalidRequest(KvRouterError, ValueError):
    """A request the router cannot route as given (no tokens, malformed tokens or multimodal info)."""


class NoEligibleWorker(KvRouterError):
    """No registered worker satisfies the request's required taints (Dynamo's `NoEndpoints`)."""

    def __init__(self, required_taints: list[str] | None = None, *, model: str | None = None) -> None:
        self.required_taints = list(required_taints or [])
        detail = f" with taints {sorted(self.required_taints)}" if self.required_taints else ""
        if model is not None:
            detail += f" serving model {model!r}"
        super().__init__(f"no worker available{detail} to route work")


class WorkersUnavailable(NoEligibleWorker):
    """Workers exist for the request, but every one is out of routing: its circuit open after failures
    (or half-open, its probe places taken), its health check failing, or its engine pacing us
    (`router.worker_health`)."""

    def __init__(self, worker_ids: list[int], retry_after_secs: float | None = None) -> None:
        super().__init__()
        self.worker_ids = worker_ids
        self.retry_after_secs = retry_after_secs  # until the first of them may be routed to again
        self.args = (
            f"no worker available to route work: workers {worker_ids} are out of routing (circuit open "
            "after failures, failing their health check, or paced by their engine's Retry-After)",
        )


class AllWorkersOverloaded(KvRouterError):
    """Eligible workers exist but every one has all its dp ranks over a busy threshold (§4.6)."""

    def __init__(self, eligible_workers: int) -> None:
        self.eligible_workers = eligible_workers
        super().__init__(f"all {eligible_workers} eligible workers are overloaded")


class DuplicateRequestId(KvRouterError):
    """A request id is still active; Dynamo 1.6.1 refuses to book it twice (§4.5)."""

    def __init__(self, request_id: str, worker_id: int, dp_rank: int) -> None:
        self.request_id = request_id
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        super().__init__(f"request {request_id!r} already exists (assigned to worker {worker_id} dp_rank {dp_rank})")


class QueueRejected(KvRouterError):
    """The queue is full for this request; carries Dynamo's `QueueRejection` payload."""

    def __init__(self, rejection: QueueRejection) -> None:
        self.rejection = rejection
        super().__init__(
            f"queue full for class {rejection.policy_class!r}: "
            f"{rejection.limit_kind} at {rejection.current} of limit {rejection.limit}"
        )


class BlockSizeMismatch(KvRouterError):
    """A worker registration whose block size differs from the router's: its blocks would hash to
    other keys than the router's, so the router refuses it rather than route to it blind."""

    def __init__(self, worker_id: int, worker_block_size: int, router_block_size: int) -> None:
        self.worker_id = worker_id
        self.worker_block_size = worker_block_size
        self.router_block_size = router_block_size
        super().__init__(
            f"worker {worker_id} uses block size {worker_block_size}, router {router_block_size}: "
            "a worker whose block size differs from the router's is refused"
        )


class UnknownWorker(KvRouterError):
    """An operation named a worker id that is not registered."""

    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        super().__init__(f"worker {worker_id} is not registered")

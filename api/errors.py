"""Every error the API answers with, as ``{"error": {"type", "message"}}`` and a status code.

Problems with the HTTP request itself are `ApiError`s raised in `api/`; the router's and the
indexer's typed errors are mapped by one table, `ROUTER_ERRORS`, so the status for a router
outcome is decided here and nowhere else.
"""

from __future__ import annotations

from typing import Any

import msgspec

from indexer.errors import EventDecodeError
from router.errors import (
    AllWorkersOverloaded,
    BlockSizeMismatch,
    DuplicateRequestId,
    InvalidRequest,
    KvRouterError,
    NoEligibleWorker,
    QueueRejected,
    UnknownWorker,
    WorkersUnavailable,
)

__all__ = [
    "ROUTER_ERRORS",
    "ApiError",
    "BodyTooLarge",
    "ClientDisconnected",
    "InvalidBody",
    "MalformedBody",
    "NotFound",
    "PromptTooLong",
    "UnknownRequestId",
    "UnknownRoutingTarget",
    "error_reply",
    "prompt_too_long",
]


class ApiError(Exception):
    """A request the API refuses: an HTTP status, a stable snake_case type and a message."""

    status = 400
    type = "bad_request"
    headers: tuple[tuple[str, str], ...] = ()  # sent with the error reply

    def __init__(self, message: str, **detail: Any) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail


class MalformedBody(ApiError):
    """The body is not JSON / msgpack at all, or packed token bytes have a ragged length."""

    status = 400
    type = "malformed_body"


class InvalidBody(ApiError):
    """The body parses but does not fit the schema: wrong types, unknown fields or method, ids out of range."""

    status = 422
    type = "invalid_request"


class BodyTooLarge(ApiError):
    status = 413
    type = "body_too_large"


class EventTooLarge(ApiError):
    """An event posted over HTTP too large for the NATS server to relay to the other replicas."""

    status = 413
    type = "event_too_large"


class EventPlaneUnavailable(ApiError):
    """Events posted over HTTP could not be relayed to the other replicas: NATS is out of reach."""

    status = 503
    type = "event_plane_unavailable"


class PromptTooLong(ApiError):
    status = 413
    type = "prompt_too_long"


def prompt_too_long(count: int, limit: int, field: str = "") -> PromptTooLong:
    """The refusal of a prompt of ``count`` tokens over ``limit`` (``max_prompt_tokens``), on every
    route that takes a prompt, the proxy's included; ``field`` names where it came from. (The caller
    compares, so that a prompt within the limit costs no call.)"""
    where = f"{field}: " if field else ""
    return PromptTooLong(f"{where}prompt has {count} tokens; the limit is {limit}")


class NotFound(ApiError):
    status = 404
    type = "not_found"


class ClientDisconnected(ApiError):
    """The client went away while its request waited in the queue (nginx's 499); nobody reads it."""

    status = 499
    type = "client_disconnected"


class UnknownRequestId(ApiError):
    """mark_prefill / mark_free on their own routes for an id the router is not tracking."""

    status = 404
    type = "unknown_request_id"


class UnknownRoutingTarget(ApiError):
    """A routing hint names a worker or dp rank that is not registered (the field in ``detail``)."""

    status = 404
    type = "unknown_worker"


# Router and indexer outcome -> (status, type). Looked up along the exception's MRO, so a new
# subclass inherits its parent's row until it gets its own.
ROUTER_ERRORS: dict[type[Exception], tuple[int, str]] = {
    DuplicateRequestId: (409, "duplicate_request_id"),
    BlockSizeMismatch: (409, "block_size_mismatch"),
    QueueRejected: (429, "queue_rejected"),
    WorkersUnavailable: (503, "workers_unavailable"),
    NoEligibleWorker: (503, "no_eligible_worker"),
    AllWorkersOverloaded: (503, "all_workers_overloaded"),
    UnknownWorker: (404, "unknown_worker"),
    EventDecodeError: (400, "invalid_events"),
    InvalidRequest: (422, "invalid_request"),
    KvRouterError: (500, "router_error"),
}


class _ErrorBody(msgspec.Struct, omit_defaults=True):
    type: str
    message: str
    detail: dict[str, Any] = {}


class _Error(msgspec.Struct):
    error: _ErrorBody


_encode = msgspec.json.Encoder().encode


def _detail(exc: Exception) -> dict[str, Any]:
    if isinstance(exc, ApiError):
        return exc.detail
    if isinstance(exc, QueueRejected):
        return {"rejection": exc.rejection}
    if isinstance(exc, BlockSizeMismatch):
        return {
            "worker_id": exc.worker_id,
            "worker_block_size": exc.worker_block_size,
            "router_block_size": exc.router_block_size,
        }
    return {}


def error_reply(exc: Exception) -> tuple[int, str, bytes] | None:
    """(status, type, JSON body) for an error the API knows; None for anything else (a bug: 500)."""
    if isinstance(exc, ApiError):
        status, kind = exc.status, exc.type
    else:
        for cls in type(exc).__mro__:
            row = ROUTER_ERRORS.get(cls)
            if row is not None:
                status, kind = row
                break
        else:
            return None
    return status, kind, _encode(_Error(_ErrorBody(kind, str(exc), _detail(exc))))

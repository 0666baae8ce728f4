"""The data plane's handler contract, shared by its two adapters (kv-router's HTTP protocol,
`api.http_protocol`, and the FastAPI app's routes, `api.routes` and `api.asgi`).

A hot route takes a parsed `Call` and gives its `Reply` (`HotHandler`); a stream route
(`api.http_stream.StreamRoute`) takes a `StreamCall` and writes its answer to it. `HotRoutes` is
what the protocol serves itself, and the body limit every request is held to.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from api.codec import Call, Reply
from api.errors import BodyTooLarge, error_reply
from api.http_stream import StreamRoute

__all__ = ["HotHandler", "HotOutcome", "HotRoutes", "answered", "body_too_large", "too_large_reply"]

# A hot route's answer: the reply itself when it never had to wait (the usual case: no coroutine is
# made), else a coroutine for it (a `new` waiting in the router's queue).
HotOutcome = Reply | Coroutine[Any, Any, Reply]
HotHandler = Callable[[Call], HotOutcome]


async def answered(outcome: HotOutcome) -> Reply:
    """The reply of a hot route's `HotOutcome`, awaited if it has to be."""
    return outcome if isinstance(outcome, Reply) else await outcome


@dataclass(frozen=True, slots=True)
class HotRoutes:
    """What the HTTP protocol answers before ASGI: ``POST`` path -> hot handler, ``POST`` path ->
    stream route; and the limits every request is held to: its body's size, the time its head may
    take from its first byte, the time its body may go without a byte, the time its client may read
    nothing of its answer (a stream route's own: `api.http_stream.StreamRoute.write_timeout_secs`)."""

    routes: Mapping[str, HotHandler]
    max_body_bytes: int
    streams: Mapping[str, StreamRoute] = field(default_factory=dict)
    head_timeout_secs: float = field(kw_only=True)
    body_timeout_secs: float = field(kw_only=True)
    write_timeout_secs: float = field(kw_only=True)


def body_too_large(limit: int) -> BodyTooLarge:
    return BodyTooLarge(f"request body exceeds the limit of {limit} bytes")


def too_large_reply(limit: int) -> Reply:
    """The 413 for a body over ``limit`` bytes."""
    mapped = error_reply(body_too_large(limit))
    assert mapped is not None
    return Reply(mapped[0], mapped[2])

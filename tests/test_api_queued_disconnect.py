"""A decision waiting in the router's queue for a client that leaves (`api.handlers`): its place is
given back, and so is a booking made in the very turn the client left."""

from __future__ import annotations

import asyncio
import random

import pytest

from api.eager import Suspended, start
from api.errors import ClientDisconnected
from api.handlers import _unless_disconnected
from router.config import RouterConfig
from router.kv_router import KvRouter
from router.types import RouteRequest, WorkerConfig

pytestmark = pytest.mark.anyio

PROMPT = list(range(1, 65))


async def parked() -> tuple[KvRouter, Suspended[object], asyncio.Event]:
    """A router whose one worker is queue-busy with "busy", a decision for "parked" waiting in its queue,
    and the event that says the parked request's client left."""
    router = KvRouter(RouterConfig(block_size=16, router_queue_threshold=0.5), rng=random.Random(0))
    router.register_worker(WorkerConfig(worker_id=1, max_num_batched_tokens=16))
    await router.new(RouteRequest(tokens=PROMPT, request_id="busy"))
    waiting = start(router.new(RouteRequest(tokens=PROMPT, request_id="parked")))
    assert isinstance(waiting, Suspended) and router.queue_stats().pending_count == 1
    return router, waiting, asyncio.Event()


async def test_a_decision_made_in_the_turn_its_client_left_is_freed_not_kept() -> None:
    """The queue freed (another client's mark_free) in the same turn as the waiting client left: the
    decision was booked and returned to nobody, its load kept until request_expiry_secs (300 s)."""
    router, waiting, left = await parked()

    async def leave_as_the_queue_frees() -> None:
        await asyncio.sleep(0.01)
        assert router.mark_free("busy")  # dispatches "parked": booked now
        left.set()

    leaving = asyncio.ensure_future(leave_as_the_queue_frees())
    with pytest.raises(ClientDisconnected):
        await _unless_disconnected(waiting, left.wait, router.mark_free)  # type: ignore[arg-type]
    await leaving
    assert router.booking("parked") is None and router.booking("busy") is None


async def test_a_client_leaving_while_queued_gives_its_place_back() -> None:
    router, waiting, left = await parked()
    asyncio.get_running_loop().call_later(0.01, left.set)
    with pytest.raises(ClientDisconnected):
        await _unless_disconnected(waiting, left.wait, router.mark_free)  # type: ignore[arg-type]
    assert router.queue_stats().pending_count == 0
    assert router.mark_free("busy") and router.booking("parked") is None

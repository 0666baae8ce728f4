"""`PlaneLifecycle` starting on a real nats-server: a start that fails part way leaves nothing of itself
running, so the supervisor's next attempt starts from nothing."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import api.plane_lifecycle
from api.config import EventPlaneConfig, HaConfig
from api.plane_lifecycle import PlaneLifecycle
from router.config import RouterConfig
from router.event_plane.embedded_server import EmbeddedNats
from router.event_plane.plane import RouterEventPlane
from router.kv_router import KvRouter
from router.types import WorkerConfig
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

# Task names of the parts a start runs (`Supervisor` names its tasks "{owner}:{what}").
PARTS = ("event-plane:", "event-subscriber:", "replica-sync:", "durable-events:")


def running_parts() -> list[str]:
    return sorted(name for task in asyncio.all_tasks() if (name := task.get_name()).startswith(PARTS))


@pytest.mark.parametrize("failing", ["sync connection", "registration"])
async def test_a_failed_start_stops_what_it_started(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    router = KvRouter(RouterConfig(block_size=16))
    lifecycle = PlaneLifecycle(router, EventPlaneConfig(nats_url=nats_server.url), HaConfig(replica_sync=True))
    await lifecycle.register(WorkerConfig(worker_id=1))  # over HTTP before the plane: written when it starts
    failures = [OSError("NATS blinked")]
    connect, register = api.plane_lifecycle.connect, RouterEventPlane.register

    async def flaky_connect(*args: Any, **kwargs: Any) -> Any:
        if failing == "sync connection" and failures:
            raise failures.pop()
        return await connect(*args, **kwargs)

    async def flaky_register(plane: RouterEventPlane, config: WorkerConfig) -> None:
        if failing == "registration" and failures:
            raise failures.pop()
        await register(plane, config)

    monkeypatch.setattr(api.plane_lifecycle, "connect", flaky_connect)
    monkeypatch.setattr(RouterEventPlane, "register", flaky_register)
    with pytest.raises(OSError, match="NATS blinked"):
        await lifecycle.run()
    assert not lifecycle.ready and running_parts() == []
    # The connection is kept for the next attempt, with no subscription left but nats-py's own inbox
    # for requests' replies.
    assert lifecycle._nc is not None
    assert [sub.subject for sub in lifecycle._nc._subs.values() if not sub.subject.endswith(".*")] == []
    task = asyncio.create_task(lifecycle.run())  # the supervisor's next attempt
    try:
        await eventually(lambda: lifecycle.ready, 30, "the next attempt starts")
        assert router.has_worker(1)
        assert {name.split(":")[0] for name in running_parts()} == {"event-plane", "event-subscriber", "replica-sync"}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await lifecycle.stop()
    assert running_parts() == []

"""Active health checks of the workers the proxy forwards to: ``GET /health`` of each worker registered
over HTTP with a URL (static: no heartbeat lease tells the router it died), every
``proxy_health_check_interval_secs``.

A worker failing ``proxy_health_check_failures`` checks in a row leaves routing (its verdict goes to
`router.worker_health`, which every decision consults); once it passes ``proxy_health_check_successes``
in a row it is back, by itself. Each worker's checks are a `HealthProbe` (the one direct mode and the
bridge use for their engines); the set of probes follows the registrations, looked at every interval
(at most every second). Workers with a heartbeat lease are left to their lease (a bridge probes its
engine and withdraws the worker), and a direct-mode engine's to its own probe (`DirectEngine`, marked
by `WorkerHealth.set_engine_probed`): each engine's ``/health`` is asked by one prober. A worker no
longer probed here (registered again with a lease or without a URL) keeps no verdict of these checks.
"""

from __future__ import annotations

import asyncio
import logging

from api.config import ProxyConfig
from router.engines.openai_server import HealthProbe, health_url, openai_base
from router.kv_router import KvRouter
from router.supervision import Supervisor
from router.types import WorkerConfig

__all__ = ["WorkerHealthChecks"]

logger = logging.getLogger(__name__)


class WorkerHealthChecks:
    """The probes of the static workers with a URL, kept in step with the registrations."""

    def __init__(self, router: KvRouter, config: ProxyConfig) -> None:
        self._router = router
        self._config = config
        # Each probe with the registration it was started for: a worker registered otherwise, or whose
        # verdict the router forgot (removed and registered again), gets a new probe, whose first
        # result is reported; the same registration posted again keeps its probe and its count.
        self._probes: dict[int, tuple[HealthProbe, WorkerConfig]] = {}
        # Registrations no probe could be made for (logged once), not tried again until they change.
        self._unprobed: dict[int, WorkerConfig] = {}
        self._background = Supervisor("worker-health-checks")

    @property
    def enabled(self) -> bool:
        return self._config.proxy_health_check_interval_secs > 0

    def start(self) -> None:
        if self.enabled:
            self._background.keep_running("registrations", self._follow_registrations)

    async def stop(self) -> None:
        await self._background.stop()
        await asyncio.gather(*(probe.stop() for probe, _ in self._probes.values()))
        self._probes.clear()

    async def _follow_registrations(self) -> None:
        while True:
            await self.sync()
            await asyncio.sleep(min(self._config.proxy_health_check_interval_secs, 1.0))

    async def sync(self) -> None:
        """A probe for each static worker with a URL whose engine no other prober asks, none for the
        others (gone, now leased, or probed by their direct-mode engine)."""
        health = self._router.health
        wanted: dict[int, WorkerConfig] = {}
        for worker in self._router.workers():
            if health.engine_probed(worker.worker_id):
                continue  # its engine's own probe gives the verdict
            if _checked(worker):
                wanted[worker.worker_id] = worker
            else:  # leased or without a URL now: no verdict of ours keeps it out of routing
                health.unchecked(worker.worker_id)
        for worker_id, (probe, probed) in list(self._probes.items()):
            forgotten = probe.healthy is not None and health.availability(worker_id).health_check == "unknown"
            if wanted.get(worker_id) != probed or forgotten:
                del self._probes[worker_id]
                await probe.stop()
        self._unprobed = {
            worker_id: worker for worker_id, worker in self._unprobed.items() if wanted.get(worker_id) == worker
        }
        for worker_id, worker in wanted.items():
            if worker_id in self._probes or worker_id in self._unprobed:
                continue
            try:
                probe = self._probe(worker)
            except Exception:  # one worker's never stops the others' probes
                logger.exception("worker %d: no health check can be made for %r", worker_id, worker.url)
                self._unprobed[worker_id] = worker
                continue
            self._probes[worker_id] = (probe, worker)
            probe.start()

    def _probe(self, worker: WorkerConfig) -> HealthProbe:
        config = self._config
        worker_id = worker.worker_id
        health = self._router.health

        async def up() -> None:
            if health.set_health(worker_id, True):  # False too once the worker has left
                logger.info("worker %d passes its health checks: in routing", worker_id)

        async def down(problem: str) -> None:
            if health.set_health(worker_id, False):  # False too once the worker has left
                logger.warning("worker %d fails its health checks (%s): out of routing", worker_id, problem)

        return HealthProbe(
            _probe_url(worker),
            on_up=up,
            on_down=down,
            interval_s=config.proxy_health_check_interval_secs,
            timeout_s=config.proxy_health_check_timeout_secs,
            failures_to_down=config.proxy_health_check_failures,
            successes_to_up=config.proxy_health_check_successes,
        )


def _checked(worker: WorkerConfig) -> bool:
    return worker.url is not None and not worker.leased


def _probe_url(worker: WorkerConfig) -> str:
    assert worker.url is not None
    return health_url(openai_base(worker.url))

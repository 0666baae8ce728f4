"""Workers a source learns from their events: registered on first hearing, with every dp rank heard.

A Dynamo worker runs one KV event publisher per dp rank and one metrics publisher for all of them, and
nothing else tells the router its ranks: a worker registered with the first rank heard alone kept the
others' blocks in the index (their events are applied per rank) but never had them routed to, and
refused their load reports.
"""

from __future__ import annotations

import logging

import msgspec

from router.kv_router import KvRouter
from router.types import WorkerConfig

__all__ = ["LearnedWorkers"]

log = logging.getLogger(__name__)


class LearnedWorkers:
    """Workers a source registered itself because it heard their events first, with every dp rank seen.

    A worker first heard from gets default capacity and a WARNING, so its first events are not refused;
    each dp rank that then appears in its events or load reports widens its registration to cover it
    (an engine's dp ranks are contiguous, so the range from the lowest to the highest rank seen). A
    worker someone else registered (``POST /v1/workers``, the config file, the registry) keeps the
    ranks it was given: its configuration is theirs to change.
    """

    def __init__(self, router: KvRouter, source: str) -> None:
        self.router = router
        self.source = source
        self._registered: dict[int, WorkerConfig] = {}

    def ensure(self, worker_id: int, dp_rank: int) -> None:
        """Make ``(worker_id, dp_rank)`` routable if this source learned the worker; raises
        `ValueError` for a rank no registration can hold (beyond u32 or ``MAX_DP_SIZE`` ranks)."""
        router = self.router
        worker = router.worker(worker_id)
        if worker is None:
            log.warning(
                "%s events from worker %d, which is not registered: registering it with default capacity "
                "(POST /v1/workers or the config file to set its capacity and taints)",
                self.source,
                worker_id,
            )
            config = WorkerConfig(
                worker_id=worker_id, dp_start_rank=dp_rank, block_size=router.config.block_size, leased=False
            )
        elif dp_rank in worker.dp_ranks or self._registered.get(worker_id) != worker:
            return
        else:
            start = min(worker.dp_start_rank, dp_rank)
            end = max(worker.dp_ranks[-1], dp_rank)
            config = msgspec.structs.replace(worker, dp_start_rank=start, dp_size=end - start + 1)
            log.info(
                "%s worker %d: dp rank %d heard, routing to ranks %d..%d", self.source, worker_id, dp_rank, start, end
            )
        router.register_worker(config)
        self._registered[worker_id] = config

"""The worker registry: which workers the router may pick, their dp ranks, taints and capacities.

Workers keep their registration order, which is also the order candidates are scored in. Besides the
static `WorkerConfig`, the registry keeps what workers report about themselves: the KV blocks each dp
rank currently uses (`kv_used_blocks`, an input of the decode busy check of §4.6) and, when an engine's
metrics are scraped (`kv-router bridge --engine-metrics-url`), its waiting and running requests.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from indexer.slots import WorkerRank
from router.errors import UnknownWorker
from router.types import WorkerConfig

__all__ = ["WorkerConfig", "WorkerRegistry"]


class WorkerRegistry:
    """Registered workers by id, in registration order."""

    def __init__(self) -> None:
        self._workers: dict[int, WorkerConfig] = {}
        self._kv_used_blocks: dict[WorkerRank, int] = {}
        self._engine_requests: dict[WorkerRank, tuple[int | None, int | None]] = {}  # (waiting, running)

    def __len__(self) -> int:
        return len(self._workers)

    def __iter__(self) -> Iterator[WorkerConfig]:
        return iter(self._workers.values())

    def get(self, worker_id: int) -> WorkerConfig | None:
        return self._workers.get(worker_id)

    def register(self, config: WorkerConfig) -> tuple[list[WorkerRank], list[WorkerRank]]:
        """Add or replace a worker; returns the dp ranks that appeared and those that went away."""
        previous = self._workers.get(config.worker_id)
        self._workers[config.worker_id] = config
        old = set(previous.dp_ranks) if previous is not None else set()
        new = set(config.dp_ranks)
        removed = [(config.worker_id, rank) for rank in sorted(old - new)]
        for key in removed:
            self._forget_reports(key)
        return [(config.worker_id, rank) for rank in sorted(new - old)], removed

    def remove(self, worker_id: int) -> list[WorkerRank]:
        """Forget a worker; returns its dp ranks. Raises `UnknownWorker` if it is not registered."""
        config = self._workers.pop(worker_id, None)
        if config is None:
            raise UnknownWorker(worker_id)
        ranks = [(worker_id, rank) for rank in config.dp_ranks]
        for key in ranks:
            self._forget_reports(key)
        return ranks

    def forget_engine_reports(self, ranks: Iterable[WorkerRank]) -> None:
        """Drop these ranks' engine-reported KV usage and request counts (until each reports again)."""
        for key in ranks:
            self._forget_reports(key)

    def _forget_reports(self, key: WorkerRank) -> None:
        self._kv_used_blocks.pop(key, None)
        self._engine_requests.pop(key, None)

    def set_kv_used_blocks(self, worker_id: int, dp_rank: int, kv_used_blocks: int) -> None:
        """Record a worker-reported KV usage for one of its dp ranks."""
        self._check_rank(worker_id, dp_rank)
        if kv_used_blocks < 0:
            raise ValueError(f"kv_used_blocks must be >= 0, got {kv_used_blocks}")
        self._kv_used_blocks[(worker_id, dp_rank)] = kv_used_blocks

    def set_engine_requests(self, worker_id: int, dp_rank: int, waiting: int | None, running: int | None) -> None:
        """Record the requests an engine reports waiting and running on one of its dp ranks (None: unknown)."""
        self._check_rank(worker_id, dp_rank)
        if (waiting is not None and waiting < 0) or (running is not None and running < 0):
            raise ValueError(f"request counts must be >= 0, got waiting {waiting}, running {running}")
        self._engine_requests[(worker_id, dp_rank)] = (waiting, running)

    def _check_rank(self, worker_id: int, dp_rank: int) -> None:
        config = self._workers.get(worker_id)
        if config is None:
            raise UnknownWorker(worker_id)
        if dp_rank not in config.dp_ranks:
            raise ValueError(f"worker {worker_id} has no dp_rank {dp_rank} (ranks {config.dp_ranks})")

    def kv_used_blocks(self, key: WorkerRank) -> int | None:
        return self._kv_used_blocks.get(key)

    def engine_requests(self, key: WorkerRank) -> tuple[int | None, int | None]:
        """(waiting, running) as the engine last reported them; (None, None) before any report."""
        return self._engine_requests.get(key, (None, None))

    def eligible(self, required_taints: Iterable[str]) -> list[WorkerConfig]:
        """Workers carrying every required taint (§4.4), in registration order."""
        required = frozenset(required_taints)
        if not required:
            return list(self._workers.values())
        return [config for config in self._workers.values() if required <= config.taints]

"""An engine's Prometheus endpoint scraped into ``ActiveLoad`` per dp rank: KV usage and requests,
and the engine's KV capacity when it states it.

vLLM reports its KV usage as a fraction (``vllm:kv_cache_usage_perc``, ``vllm:gpu_cache_usage_perc``
before 0.10) labelled ``engine="<rank>"``, and its requests as ``vllm:num_requests_waiting`` /
``vllm:num_requests_running``; SGLang as ``sglang:token_usage``, ``sglang:num_queue_reqs`` and
``sglang:num_running_reqs`` labelled ``dp_rank``; TRT-LLM's serve its usage as
``trtllm:kv_cache_utilization`` (no request counts known here). ``auto`` reads whichever of them the
engine serves (direct mode, whose ``--engine`` does not say the engine's kind). vLLM also states its
capacity: ``vllm:cache_config_info`` (a gauge of 1) carries its cache config as labels, among them
``num_gpu_blocks``, the KV blocks of each engine (dp rank). ``kv_used_blocks`` is the usage fraction of
``total_kv_blocks``, given or else learned from that label (neither: only the request counts are
published). A scrape that fails is logged rate-limited and retried at the next interval; an engine
that serves no ``/metrics`` (404) is not asked again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import NamedTuple, Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

from router.event_plane.messages import ActiveLoad
from router.event_plane.ratelimited_log import RateLimitedLog
from router.supervision import Supervisor

__all__ = ["EngineLoad", "EngineMetrics", "EngineMetricsScraper", "LoadSink", "read_engine_metrics"]

log = logging.getLogger(__name__)


class _Names(NamedTuple):
    kv_usage: tuple[str, ...]
    waiting: tuple[str, ...]
    running: tuple[str, ...]


_METRICS = {
    "vllm": _Names(
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        ("vllm:num_requests_waiting",),
        ("vllm:num_requests_running",),
    ),
    "sglang": _Names(("sglang:token_usage",), ("sglang:num_queue_reqs",), ("sglang:num_running_reqs",)),
    "trtllm": _Names(("trtllm:kv_cache_utilization",), (), ()),
}
_METRICS["auto"] = _Names(*(tuple(name for names in _METRICS.values() for name in names[i]) for i in range(3)))
_RANK_LABELS = ("engine", "dp_rank", "data_parallel_rank")
# The sample and its label that state each rank's KV blocks (vLLM's cache config, as an info gauge).
_CAPACITY = {"vllm": ("vllm:cache_config_info", "num_gpu_blocks")}
_CAPACITY["auto"] = _CAPACITY["vllm"]


class EngineLoad(NamedTuple):
    """One rank's load in one scrape; None: the engine did not report it."""

    kv_usage: float | None = None  # fraction of the KV cache in use
    waiting: int | None = None
    running: int | None = None


class EngineMetrics(NamedTuple):
    """One scrape: each dp rank's load, and the KV blocks of each rank that stated them."""

    loads: dict[int, EngineLoad]
    kv_blocks: dict[int, int]


def _rank(labels: dict[str, str]) -> int | None:
    rank_label = next((labels[k] for k in _RANK_LABELS if k in labels), "0")
    return int(rank_label) if rank_label.isdigit() else None


def read_engine_metrics(text: str, engine: str) -> EngineMetrics:
    """Each dp rank's load (rank 0 when the sample names none) and stated KV blocks in one scrape."""
    names = _METRICS[engine]
    fields = {name: field for field, group in zip(EngineLoad._fields, names, strict=True) for name in group}
    capacity_sample, capacity_label = _CAPACITY.get(engine, ("", ""))
    seen: dict[int, dict[str, float]] = {}
    kv_blocks: dict[int, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == capacity_sample:
                rank, blocks = _rank(sample.labels), sample.labels.get(capacity_label, "")
                if rank is not None and blocks.isdigit() and int(blocks) > 0:
                    kv_blocks[rank] = int(blocks)
                continue
            field = fields.get(sample.name)
            if field is None:
                continue
            rank = _rank(sample.labels)
            if rank is not None:
                # The first name listed wins (the newer vLLM metric over the older one).
                seen.setdefault(rank, {}).setdefault(field, sample.value)
    loads = {
        rank: EngineLoad(
            kv_usage=values.get("kv_usage"),
            waiting=None if "waiting" not in values else max(0, round(values["waiting"])),
            running=None if "running" not in values else max(0, round(values["running"])),
        )
        for rank, values in seen.items()
    }
    return EngineMetrics(loads, kv_blocks)


class LoadSink(Protocol):
    """Where a scrape's findings go: the bridge publishes them on NATS, direct mode applies them to its
    router."""

    async def publish_load(self, load: ActiveLoad) -> None: ...

    async def capacity_learned(self, kv_blocks: int) -> None:
        """The engine stated its KV blocks per rank (the fewest of its ranks'), once per scraper."""
        ...


class EngineMetricsScraper:
    """Scrapes ``url`` every ``interval_s`` into ``sink``: each rank's load as an ``ActiveLoad`` of
    ``worker_id``, and once, when no ``total_kv_blocks`` was given, the capacity the engine states."""

    def __init__(
        self,
        url: str,
        sink: LoadSink,
        *,
        worker_id: int,
        engine: str,
        total_kv_blocks: int | None,
        interval_s: float = 1.0,
    ) -> None:
        self.url = url
        self.sink = sink
        self.worker_id = worker_id
        self.engine = engine
        self.total_kv_blocks = total_kv_blocks
        self.interval_s = interval_s
        self.scrapes = 0
        self.failures = 0
        self._background = Supervisor(f"engine-metrics-{url}")
        self._bad = RateLimitedLog(log)

    def start(self) -> None:
        self._background.keep_running("scrape", self._loop)

    async def stop(self) -> None:
        await self._background.stop()

    async def _loop(self) -> None:
        async with httpx.AsyncClient(timeout=self.interval_s * 2) as client:
            while await self.scrape_once(client):
                await asyncio.sleep(self.interval_s)
        await asyncio.Event().wait()  # no metrics served: idle until stopped (a supervised loop never returns)

    async def scrape_once(self, client: httpx.AsyncClient) -> bool:
        """One scrape into the sink; False when the engine serves no metrics (404): ask no more."""
        try:
            reply = await client.get(self.url)
            if reply.status_code == 404:
                log.info("engine at %s serves no metrics (404): its load is not scraped", self.url)
                return False
            reply.raise_for_status()
            metrics = read_engine_metrics(reply.text, self.engine)
        except (httpx.HTTPError, ValueError) as exc:
            self.failures += 1
            self._bad.warning("engine_metrics", f"scraping {self.url} failed: {exc!r}")
            return True
        self.scrapes += 1
        if self.total_kv_blocks is None and metrics.kv_blocks:
            self.total_kv_blocks = min(metrics.kv_blocks.values())
            log.info("engine at %s states %d KV blocks per rank", self.url, self.total_kv_blocks)
            await self.sink.capacity_learned(self.total_kv_blocks)
        for dp_rank, load in sorted(metrics.loads.items()):
            used = None
            if load.kv_usage is not None and self.total_kv_blocks is not None:
                used = round(max(0.0, min(1.0, load.kv_usage)) * self.total_kv_blocks)
            if used is None and load.waiting is None and load.running is None:
                continue
            await self.sink.publish_load(
                ActiveLoad(
                    worker_id=self.worker_id,
                    dp_rank=dp_rank,
                    kv_used_blocks=used,
                    num_requests_waiting=load.waiting,
                    num_requests_running=load.running,
                )
            )
        return True

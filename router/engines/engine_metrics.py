"""An engine's Prometheus endpoint scraped into ``ActiveLoad`` per dp rank: KV usage and requests.

vLLM reports its KV usage as a fraction (``vllm:kv_cache_usage_perc``, ``vllm:gpu_cache_usage_perc``
before 0.10) labelled ``engine="<rank>"``, and its requests as ``vllm:num_requests_waiting`` /
``vllm:num_requests_running``; SGLang as ``sglang:token_usage``, ``sglang:num_queue_reqs`` and
``sglang:num_running_reqs`` labelled ``dp_rank``; TRT-LLM's serve its usage as
``trtllm:kv_cache_utilization`` (no request counts known here). ``kv_used_blocks`` is the usage
fraction of the worker's ``total_kv_blocks`` (no capacity known: only the request counts are
published). A scrape that fails is logged rate-limited and retried at the next interval.
"""

from __future__ import annotations

import asyncio
import logging
from typing import NamedTuple

import httpx
from prometheus_client.parser import text_string_to_metric_families

from router.event_plane.messages import ActiveLoad
from router.event_plane.publisher import KvEventPublisher
from router.event_plane.ratelimited_log import RateLimitedLog
from router.supervision import Supervisor

__all__ = ["EngineLoad", "EngineMetricsScraper", "engine_load_by_rank"]

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
_RANK_LABELS = ("engine", "dp_rank", "data_parallel_rank")


class EngineLoad(NamedTuple):
    """One rank's load in one scrape; None: the engine did not report it."""

    kv_usage: float | None = None  # fraction of the KV cache in use
    waiting: int | None = None
    running: int | None = None


def engine_load_by_rank(text: str, engine: str) -> dict[int, EngineLoad]:
    """Each dp rank's load in one scrape (rank 0 when the sample names none)."""
    names = _METRICS[engine]
    fields = {name: field for field, group in zip(EngineLoad._fields, names, strict=True) for name in group}
    seen: dict[int, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field = fields.get(sample.name)
            if field is None:
                continue
            rank_label = next((sample.labels[k] for k in _RANK_LABELS if k in sample.labels), "0")
            if rank_label.isdigit():
                # The first name listed wins (the newer vLLM metric over the older one).
                seen.setdefault(int(rank_label), {}).setdefault(field, sample.value)
    return {
        rank: EngineLoad(
            kv_usage=values.get("kv_usage"),
            waiting=None if "waiting" not in values else max(0, round(values["waiting"])),
            running=None if "running" not in values else max(0, round(values["running"])),
        )
        for rank, values in seen.items()
    }


class EngineMetricsScraper:
    def __init__(
        self,
        url: str,
        publisher: KvEventPublisher,
        *,
        engine: str,
        total_kv_blocks: int | None,
        interval_s: float = 1.0,
    ) -> None:
        self.url = url
        self.publisher = publisher
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
            while True:
                await self.scrape_once(client)
                await asyncio.sleep(self.interval_s)

    async def scrape_once(self, client: httpx.AsyncClient) -> None:
        try:
            reply = await client.get(self.url)
            reply.raise_for_status()
            loads = engine_load_by_rank(reply.text, self.engine)
        except (httpx.HTTPError, ValueError) as exc:
            self.failures += 1
            self._bad.warning("engine_metrics", f"scraping {self.url} failed: {exc!r}")
            return
        self.scrapes += 1
        for dp_rank, load in sorted(loads.items()):
            used = None
            if load.kv_usage is not None and self.total_kv_blocks is not None:
                used = round(max(0.0, min(1.0, load.kv_usage)) * self.total_kv_blocks)
            if used is None and load.waiting is None and load.running is None:
                continue
            await self.publisher.publish_load(
                ActiveLoad(
                    worker_id=self.publisher.worker_id,
                    dp_rank=dp_rank,
                    kv_used_blocks=used,
                    num_requests_waiting=load.waiting,
                    num_requests_running=load.running,
                )
            )

"""An engine's Prometheus endpoint scraped into ``ActiveLoad`` (``kv_used_blocks``) per dp rank.

vLLM reports its KV usage as a fraction (``vllm:kv_cache_usage_perc``, ``vllm:gpu_cache_usage_perc``
before 0.10) labelled ``engine="<rank>"``; SGLang as ``sglang:token_usage`` labelled ``dp_rank``;
TRT-LLM's serve as ``trtllm:kv_cache_utilization``. ``kv_used_blocks`` is that fraction of the
worker's ``total_kv_blocks`` (no capacity known: nothing to publish). A scrape that fails is logged
rate-limited and retried at the next interval.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from prometheus_client.parser import text_string_to_metric_families

from router.event_plane.messages import ActiveLoad
from router.event_plane.publisher import KvEventPublisher
from router.event_plane.ratelimited_log import RateLimitedLog
from router.supervision import Supervisor

__all__ = ["EngineMetricsScraper", "kv_usage_by_rank"]

log = logging.getLogger(__name__)

_USAGE_METRICS = {
    "vllm": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "sglang": ("sglang:token_usage",),
    "trtllm": ("trtllm:kv_cache_utilization",),
}
_RANK_LABELS = ("engine", "dp_rank", "data_parallel_rank")


def kv_usage_by_rank(text: str, engine: str) -> dict[int, float]:
    """The KV usage fraction per dp rank in one scrape (rank 0 when the sample names none)."""
    names = _USAGE_METRICS[engine]
    usage: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name not in names:
                continue
            rank_label = next((sample.labels[k] for k in _RANK_LABELS if k in sample.labels), "0")
            if rank_label.isdigit():
                usage.setdefault(int(rank_label), sample.value)
    return usage


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
            usage = kv_usage_by_rank(reply.text, self.engine)
        except (httpx.HTTPError, ValueError) as exc:
            self.failures += 1
            self._bad.warning("engine_metrics", f"scraping {self.url} failed: {exc!r}")
            return
        self.scrapes += 1
        if self.total_kv_blocks is None:
            return
        for dp_rank, fraction in sorted(usage.items()):
            used = round(max(0.0, min(1.0, fraction)) * self.total_kv_blocks)
            await self.publisher.publish_load(
                ActiveLoad(worker_id=self.publisher.worker_id, dp_rank=dp_rank, kv_used_blocks=used)
            )

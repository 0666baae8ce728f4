"""Helpers for tests and benchmarks that drive a `KvRouter` without engines, and beside Dynamo's.

An engine that caches a prompt reports a ``stored`` event whose blocks carry the engine's block hash
and Dynamo's local hash; engines that hash like Dynamo use the sequence hash as the block hash, which
is what these helpers send, so prefixes shared between prompts are shared in the index too.

`DynamoFleet` runs NVIDIA Dynamo 1.6.1's own `KvRouter` in this process over dummy workers (the
``oracle`` extra, ``ai-dynamo-runtime==1.6.1``; see shared/oracle/dynamo_inproc.py), as a reference
for differential tests and benchmarks.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from indexer.events import RouterEvent, StorageTier, stored_event
from indexer.hashing import compute_block_hashes, compute_sequence_hashes
from tests.waiting import eventually

__all__ = ["DynamoFleet", "prompt_stored_event"]


def prompt_stored_event(
    worker_id: int,
    tokens: Sequence[int] | bytes,
    block_size: int,
    *,
    event_id: int = 1,
    dp_rank: int = 0,
    blocks: int | None = None,
    storage_tier: StorageTier = StorageTier.DEVICE,
    lora_name: str | None = None,
    cache_namespace: str | None = None,
) -> RouterEvent:
    """A root-anchored ``stored`` event for the first ``blocks`` complete blocks of a prompt (all of
    them by default), as the engine of ``(worker_id, dp_rank)`` would report it."""
    local = compute_block_hashes(tokens, block_size, lora_name=lora_name, cache_namespace=cache_namespace)
    if blocks is not None:
        local = local[:blocks]
    chain = compute_sequence_hashes(local)
    event = stored_event(event_id, zip(chain, local, strict=True), dp_rank=dp_rank)
    return RouterEvent(worker_id=worker_id, event=event, storage_tier=storage_tier)


# A worker's generate handler: the request dict, Dynamo's context, and a stream of response dicts.
WorkerHandler = Callable[..., AsyncIterator[dict[str, Any]]]


async def _never_called(request: Any, context: Any = None) -> AsyncIterator[dict[str, Any]]:
    yield {"token_ids": [0], "finish_reason": "stop"}


class DynamoFleet:
    """Dummy workers and a Dynamo `KvRouter` over them, in this process and on the running loop.

    Workers are discovered through files in ``discovery_dir`` (one directory per fleet) and Dynamo's
    router keeps an approximate index (``use_kv_events=False``): every request routed with
    ``update_indexer=True`` is recorded as stored on the chosen rank, under its sequence hashes.
    """

    ENDPOINT = "oracle.worker.generate"

    def __init__(self, discovery_dir: str, block_size: int, handler: WorkerHandler | None = None) -> None:
        self._discovery_dir = discovery_dir
        self._block_size = block_size
        # What the dummy workers answer the requests Dynamo's `KvRouter.generate` sends them.
        self._handler = handler or _never_called
        self._runtimes: list[Any] = []
        self._serving: list[asyncio.Future[Any]] = []
        self.router: Any = None

    async def start(self, dp_sizes: Sequence[int], **router_config: Any) -> dict[int, int]:
        """One worker per dp size and the router (``router_config``: `KvRouterConfig` arguments).
        Returns Dynamo's worker ids with their dp sizes once the router has discovered them all."""
        os.environ.setdefault("DYN_LOG", "off")
        os.environ["DYN_FILE_KV"] = self._discovery_dir
        from dynamo import _core as dynamo

        loop = asyncio.get_running_loop()
        for dp_size in dp_sizes:
            runtime = dynamo.DistributedRuntime(loop, "file", "tcp")
            self._runtimes.append(runtime)
            endpoint = runtime.endpoint(self.ENDPOINT)
            self._serving.append(asyncio.ensure_future(endpoint.serve_endpoint(self._handler)))
            runtime_config = dynamo.ModelRuntimeConfig()
            runtime_config.data_parallel_size = dp_size
            await dynamo.register_model(
                dynamo.ModelInput.Tokens,
                dynamo.ModelType.Chat,
                endpoint,
                "dummy",
                "dummy",
                worker_type=dynamo.WorkerType.Aggregated,
                kv_cache_block_size=self._block_size,
                skip_model_assets=True,
                runtime_config=runtime_config,
            )
        runtime = dynamo.DistributedRuntime(loop, "file", "tcp")
        self._runtimes.append(runtime)
        config = dynamo.KvRouterConfig(use_kv_events=False, **router_config)
        self.router = dynamo.KvRouter(runtime.endpoint(self.ENDPOINT), self._block_size, config)
        router = self.router
        loads: list[dict[str, Any]] = []

        async def discovered() -> bool:  # discovery is asynchronous
            nonlocal loads
            loads = await router.get_potential_loads([1])
            return len(loads) == sum(dp_sizes)

        await eventually(discovered, 10, f"Dynamo's router discovers {sum(dp_sizes)} ranks")
        ranks: dict[int, int] = {}
        for row in loads:
            ranks[row["worker_id"]] = ranks.get(row["worker_id"], 0) + 1
        return ranks

    async def wait_indexed(self, tokens: Sequence[int], worker: tuple[int, int]) -> None:
        """Wait until Dynamo's approximate index holds every block of ``tokens`` on ``worker``."""
        router = self.router

        async def indexed() -> bool:
            report = await router.get_overlap_scores(list(tokens))
            rows = {(row["worker_id"], row["dp_rank"]): row["device_blocks"] for row in report["workers"]}
            return bool(rows.get(worker, 0) >= len(tokens) // self._block_size)

        await eventually(indexed, 10, f"Dynamo indexes the routed prompt on {worker}")

    async def stop(self) -> None:
        for runtime in self._runtimes:
            runtime.shutdown()
        for task in self._serving:
            task.cancel()
        await asyncio.gather(*self._serving, return_exceptions=True)

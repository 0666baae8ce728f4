"""One piece of a Dynamo 1.6.1 fleet in a process of its own, for tests that need Dynamo to block:
``python -m tests.dynamo_process worker DIR`` registers a dummy worker in the file discovery directory
DIR and serves until stopped; ``python -m tests.dynamo_process router DIR`` builds Dynamo's `KvRouter`
over DIR, prints ``router ready`` once its constructor returns (with ``DYN_ROUTER_MIN_INITIAL_WORKERS``
set it waits for that many workers), then waits to be stopped.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from typing import Any

ENDPOINT = "oracle.worker.generate"


async def _answer(request: Any, context: Any = None) -> AsyncIterator[dict[str, Any]]:
    yield {"token_ids": [0], "finish_reason": "stop"}


async def _run(role: str) -> None:
    from dynamo import _core as dynamo

    runtime = dynamo.DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
    endpoint = runtime.endpoint(ENDPOINT)
    if role == "worker":
        serving = asyncio.ensure_future(endpoint.serve_endpoint(_answer))
        await dynamo.register_model(
            dynamo.ModelInput.Tokens,
            dynamo.ModelType.Chat,
            endpoint,
            "dummy",
            "dummy",
            worker_type=dynamo.WorkerType.Aggregated,
            kv_cache_block_size=16,
            skip_model_assets=True,
        )
        print("worker ready", flush=True)
        await serving
    else:
        dynamo.KvRouter(endpoint, 16, dynamo.KvRouterConfig(use_kv_events=False))
        print("router ready", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    role, directory = sys.argv[1], sys.argv[2]
    if role not in ("worker", "router"):
        sys.exit(f"unknown role {role!r}")
    os.environ.setdefault("DYN_LOG", "off")
    os.environ["DYN_FILE_KV"] = directory
    asyncio.run(_run(role))

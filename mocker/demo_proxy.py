"""The last stage of ``kv-router demo``: the whole chain with an HTTP client speaking the OpenAI API.

Requests go to the router's proxy (``/v1/completions``, streamed, with usage); the router tokenizes
nothing (the prompts are token ids), routes, forwards to the chosen mock worker's OpenAI API and books
the request until its stream ends. Each reply names the worker and the router's predicted cached
tokens; the stream's usage reports the tokens the worker's block pool really had cached.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import httpx
import msgspec

__all__ = ["ProxyRun", "run_through_proxy"]


@dataclass
class ProxyRun:
    requests: int
    prompt_tokens: int
    predicted_cached: int
    engine_cached: int
    workers_used: dict[str, int]
    idle_after: bool


class _Details(msgspec.Struct):
    cached_tokens: int = 0


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    prompt_tokens_details: _Details | None = None


class _Chunk(msgspec.Struct):
    usage: _Usage | None = None


class _Rank(msgspec.Struct):
    active_requests: int
    active_prefill_tokens: int


class _Worker(msgspec.Struct):
    ranks: list[_Rank]


class _Workers(msgspec.Struct):
    workers: list[_Worker]


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


async def run_through_proxy(
    url: str, model: str, *, requests: int = 48, groups: int = 6, prefix_tokens: int = 1024, seed: int = 0
) -> ProxyRun:
    """Send ``requests`` streamed completions sharing ``groups`` prefixes, 4 at a time."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 50_000) for _ in range(prefix_tokens)] for _ in range(groups)]
    run = ProxyRun(requests, 0, 0, 0, {}, False)
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as http:

        async def one(index: int) -> None:
            prompt = [*prefixes[rng.randrange(groups)], *(rng.randrange(1, 50_000) for _ in range(32))]
            body = {"model": model, "prompt": prompt, "max_tokens": 8, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            async with http.stream("POST", "/v1/completions", json=body) as reply:
                reply.raise_for_status()
                worker = reply.headers["x-kv-router-worker"]
                run.workers_used[worker] = run.workers_used.get(worker, 0) + 1
                run.predicted_cached += int(reply.headers["x-kv-router-cached-tokens"])
                async for line in reply.aiter_lines():
                    if line.startswith("data: {") and '"usage"' in line:
                        usage = _decode_chunk(line[6:]).usage
                        if usage is not None:
                            run.prompt_tokens += usage.prompt_tokens
                            if usage.prompt_tokens_details is not None:
                                run.engine_cached += usage.prompt_tokens_details.cached_tokens

        for start in range(0, requests, 4):
            await asyncio.gather(*(one(i) for i in range(start, min(start + 4, requests))))
            await asyncio.sleep(0.05)  # the workers' KV events reach the router meanwhile
        workers = msgspec.json.decode((await http.get("/v1/workers")).content, type=_Workers)
        run.idle_after = all(
            rank.active_requests == 0 and rank.active_prefill_tokens == 0
            for worker in workers.workers
            for rank in worker.ranks
        )
    return run

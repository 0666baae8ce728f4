"""``POST /v1/route`` against NVIDIA Dynamo 1.6.1's own `KvRouter.generate_from_request`, which takes
the same `PreprocessedRequest` (the oracle extra).

Dynamo's router runs in this process over dummy workers (`tests.dynamo_fleet.DynamoFleet`: file
discovery, TCP request plane, ``use_kv_events=False`` so its approximate index records each routed
request). Both routers get the same seeded requests with routing hints: none, ``allowed_worker_ids``,
a pinned ``backend_instance_id`` with its ``dp_rank``. Ours is asked with ``query_instance_id``
(nothing booked); Dynamo routes the request to a worker, which answers at once, and its answer names
the worker and rank Dynamo picked. Whenever our costs have a unique
minimum, Dynamo must have picked that rank. The prompt is then stored on Dynamo's pick on both sides,
so the two indexes stay equal. Some requests are held (booked on Dynamo's pick on both sides, freed
later), so the loads weigh too; they are equal on both sides before every request.

Not compared: ``router_config_override``. Dynamo's binding accepts it on this path and decides
without it: over three seeds of 300 requests, each of the 17 overrides that moved our pick
(``overlap_score_credit`` 0 or 4, ``prefill_load_scale`` 0, ``overlap_score_weight`` 3) left
Dynamo's on its un-overridden choice (reference/dynamo-router.md §4.2 saw the same of
``best_worker``). The override of ``/v1/route`` is the one of ``/v1/new`` (tests/test_api_route.py),
whose cost terms are checked against Dynamo's router configured with the same values in
tests/test_router_oracle.py.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
from fastapi.testclient import TestClient

from tests.dynamo_fleet import DynamoFleet, prompt_stored_event
from tests.test_api_support import BLOCK_SIZE, serve
from tests.waiting import eventually

os.environ.setdefault("DYN_LOG", "off")
pytest.importorskip("dynamo._core")

pytestmark = pytest.mark.oracle


def _unique_minimum(reply: dict[str, Any]) -> tuple[int, int] | None:
    if reply["receipt"]["reason"] == "pinned":
        return reply["worker_id"], reply["dp_rank"]
    costs = [(c["cost"], c["worker_id"], c["dp_rank"]) for c in reply["explanation"]["candidates"]]
    lowest = min(cost for cost, _, _ in costs)
    winners = [(worker_id, dp_rank) for cost, worker_id, dp_rank in costs if cost == lowest]
    return winners[0] if len(winners) == 1 else None


def _loads(rows: list[dict[str, int]]) -> list[tuple[int, ...]]:
    keys = ("worker_id", "dp_rank", "potential_prefill_tokens", "potential_decode_blocks", "active_requests")
    return sorted(tuple(row[k] for k in keys) for row in rows)


def _hints(rng: random.Random, ranks: dict[int, int]) -> dict[str, Any]:
    """The routing hints of one request."""
    roll = rng.random()
    workers = sorted(ranks)
    if roll < 0.35:
        return {}
    if roll < 0.7:
        return {"allowed_worker_ids": rng.sample(workers, rng.randint(1, len(workers) - 1))}
    worker = rng.choice(workers)
    return {"backend_instance_id": worker, "dp_rank": rng.randrange(ranks[worker])}


async def _store(
    client: TestClient,
    fleet: DynamoFleet,
    event_ids: dict[tuple[int, int], int],
    tokens: list[int],
    rank: tuple[int, int],
) -> None:
    """The prompt on ``rank`` in our index (an engine's stored event), once Dynamo's approximate
    index has recorded it there from its own routing."""
    event_ids[rank] = event_ids.get(rank, 0) + 1
    event = prompt_stored_event(rank[0], tokens, BLOCK_SIZE, event_id=event_ids[rank], dp_rank=rank[1])
    client.post("/v1/events", content=msgspec.json.encode(event), headers={"content-type": "application/json"})
    await fleet.wait_indexed(tokens, rank)


def _kind(routing: dict[str, Any]) -> str:
    return next(iter(routing), "none")


async def _scenario(seed: int, steps: int, client: TestClient, discovery_dir: Path) -> Counter[str]:
    """Decisions compared, by kind of hint."""
    rng = random.Random(seed)
    fleet = DynamoFleet(str(discovery_dir), BLOCK_SIZE)
    event_ids: dict[tuple[int, int], int] = {}
    compared: Counter[str] = Counter()
    try:
        ranks = await fleet.start([2, 2, 1])
        for worker_id, dp_size in ranks.items():
            client.post("/v1/workers", json={"worker_id": worker_id, "dp_size": dp_size})
        prefixes = [[rng.randrange(1, 50_000) for _ in range(6 * BLOCK_SIZE)] for _ in range(3)]
        held: list[str] = []
        for step in range(steps):
            prefix = rng.choice(prefixes)[: rng.randrange(0, 6 * BLOCK_SIZE)]
            tokens = prefix + [rng.randrange(50_000, 60_000) for _ in range(rng.randrange(1, 3 * BLOCK_SIZE))]
            roll = rng.random()
            if held and roll < 0.15:  # a held request ends on both sides
                request_id = held.pop(rng.randrange(len(held)))
                await fleet.router.free(request_id)
                assert client.post("/v1/mark_free", json={"request_id": request_id}).status_code == 200
                continue
            routing = _hints(rng, ranks)
            request: dict[str, Any] = {"model": "dummy", "token_ids": tokens, "routing": routing}

            async def loads_alike(tokens: list[int] = tokens) -> bool:
                ours = client.post("/v1/potential_loads", json={"tokens": tokens}).json()["loads"]
                return _loads(await fleet.router.get_potential_loads(tokens)) == _loads(ours)

            # Dynamo frees the previous request as its stream ends.
            await eventually(loads_alike, what=f"step {step}: the same loads")
            if roll < 0.4:  # a request held on Dynamo's pick, booked there on ours too: load to weigh
                request_id = f"held-{step}"
                worker_id, dp_rank, _ = await fleet.router.best_worker(
                    tokens, request_id=request_id, update_indexer=True
                )
                theirs = (worker_id, dp_rank)
                pin = {"backend_instance_id": worker_id, "dp_rank": dp_rank}
                booked = client.post("/v1/route", json={"token_ids": tokens, "routing": pin, "request_id": request_id})
                assert booked.status_code == 200, booked.text
                held.append(request_id)
                await _store(client, fleet, event_ids, tokens, theirs)
                continue
            ours = client.post("/v1/route?explain=true", json={**request, "annotations": ["query_instance_id"]})
            assert ours.status_code == 200, ours.text
            stream = await fleet.router.generate_from_request(
                {**request, "stop_conditions": {}, "sampling_options": {}, "output_options": {}}
            )
            answers = [answer async for answer in stream]
            picked = answers[0]["routing_data"]["worker_id"]
            theirs = (picked["decode_worker_id"], picked["decode_dp_rank"])
            expected = _unique_minimum(ours.json())
            if expected is not None:
                compared[_kind(routing)] += 1
                assert theirs == expected, f"step {step} {routing}: Dynamo picked {theirs}"
            await _store(client, fleet, event_ids, tokens, theirs)
        return compared
    finally:
        await fleet.stop()


def test_route_decides_as_dynamos_router_for_the_same_preprocessed_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DYN_FILE_KV", "")  # restored afterwards; the fleet sets its own directory
    with serve() as client:
        compared = asyncio.run(_scenario(3, 160, client, tmp_path))
    # Every kind of hint decided enough times with a unique answer.
    assert min(compared[kind] for kind in ("none", "allowed_worker_ids", "backend_instance_id")) >= 10, compared

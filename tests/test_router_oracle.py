"""Differential test against NVIDIA Dynamo 1.6.1's own `KvRouter`, run in-process.

Dynamo's router is built as in shared/oracle/dynamo_inproc.py (file discovery in a temporary directory,
TCP request plane, dummy workers, `use_kv_events=False` so its approximate index records every routed
request). Both routers see the same seeded scenario: workers (some with two dp ranks), prompts sharing
prefixes, bookings, mark_prefill and free. Before each routing decision the potential loads of every
rank must be identical; when our costs have a unique minimum, Dynamo must pick that same rank. Each
request is then booked on Dynamo's pick on both sides, and the blocks Dynamo's approximate index records
are stored in ours, so the two states stay equal.
"""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import msgspec
import pytest

from router import KvRouter, RouteDecision, RouterConfig, RouteRequest, WorkerConfig
from tests.dynamo_fleet import DynamoFleet, prompt_stored_event

os.environ.setdefault("DYN_LOG", "off")
pytest.importorskip("dynamo._core")

pytestmark = pytest.mark.oracle

BS = 16


def unique_minimum(decision: RouteDecision) -> tuple[int, int] | None:
    assert decision.explanation is not None
    costs = [(c.cost, c.worker_id, c.dp_rank) for c in decision.explanation.candidates]
    lowest = min(cost for cost, _, _ in costs)
    winners = [(worker_id, dp_rank) for cost, worker_id, dp_rank in costs if cost == lowest]
    return winners[0] if len(winners) == 1 else None


def loads_by_rank(rows: list[dict[str, int]]) -> list[tuple[int, int, int, int, int]]:
    return sorted(
        (
            r["worker_id"],
            r["dp_rank"],
            r["potential_prefill_tokens"],
            r["potential_decode_blocks"],
            r["active_requests"],
        )
        for r in rows
    )


async def run_scenario(seed: int, config: dict[str, float], steps: int, discovery_dir: Path) -> tuple[int, int]:
    """Returns (decisions compared, decisions routed)."""
    rng = random.Random(seed)
    fleet = DynamoFleet(str(discovery_dir), BS)
    try:
        ranks = await fleet.start([rng.choice([1, 1, 2]) for _ in range(rng.randint(2, 4))], **config)
        ours = KvRouter(RouterConfig(block_size=BS, policy="dynamo", **config), rng=random.Random(seed))  # type: ignore[arg-type]
        for worker_id, dp_size in ranks.items():
            ours.register_worker(WorkerConfig(worker_id=worker_id, dp_size=dp_size))
        prefixes = [[rng.randrange(1, 50_000) for _ in range(8 * BS)] for _ in range(4)]
        active: list[str] = []
        compared = routed = 0
        for step in range(steps):
            roll = rng.random()
            if active and roll < 0.15:
                request_id = active[rng.randrange(len(active))]
                assert ours.mark_prefill(request_id)
                await fleet.router.mark_prefill_complete(request_id)
                continue
            if active and roll < 0.3:
                request_id = active.pop(rng.randrange(len(active)))
                assert ours.mark_free(request_id)
                await fleet.router.free(request_id)
                continue
            prefix = rng.choice(prefixes)[: rng.randrange(0, 8 * BS)]
            tokens = prefix + [rng.randrange(50_000, 60_000) for _ in range(rng.randrange(1, 5 * BS))]
            our_loads = [msgspec.structs.asdict(load) for load in ours.potential_loads(tokens)]
            dynamo_loads = await fleet.router.get_potential_loads(tokens)
            assert loads_by_rank(dynamo_loads) == loads_by_rank(our_loads), f"potential loads differ at step {step}"
            probe = await ours.new(RouteRequest(tokens=tokens), explain=True)
            request_id = f"s{seed}-{step}"
            worker_id, dp_rank, overlap_blocks = await fleet.router.best_worker(
                tokens, request_id=request_id, update_indexer=True
            )
            routed += 1
            expected = unique_minimum(probe)
            if expected is not None:
                compared += 1
                assert (worker_id, dp_rank) == expected, f"step {step}: Dynamo picked {(worker_id, dp_rank)}"
            booked = await ours.new(
                RouteRequest(tokens=tokens, request_id=request_id), pinned_worker=(worker_id, dp_rank)
            )
            assert booked.overlap_blocks == overlap_blocks
            ours.apply_event(prompt_stored_event(worker_id, tokens, BS, event_id=step, dp_rank=dp_rank))
            await fleet.wait_indexed(tokens, (worker_id, dp_rank))
            active.append(request_id)
        return compared, routed
    finally:
        await fleet.stop()


CONFIGS = [
    pytest.param({}, id="defaults"),
    pytest.param({"overlap_score_credit": 2.0, "prefill_load_scale": 0.5}, id="credit2-scale0.5"),
    pytest.param({"decode_active_request_weight": 3.0, "overlap_score_credit_decay": 1.0}, id="request-weight-decay"),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_same_choices_and_loads_as_dynamo(
    config: dict[str, float], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DYN_FILE_KV", "")  # restored afterwards; each fleet sets its own directory
    compared = routed = 0
    for seed in (1, 2):
        scenario_compared, scenario_routed = asyncio.run(run_scenario(seed, config, 60, tmp_path / f"seed{seed}"))
        compared += scenario_compared
        routed += scenario_routed
    # Ties are frequent on an idle fleet; enough decisions must still have a unique answer.
    assert compared >= routed // 3, (compared, routed)

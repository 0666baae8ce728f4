"""The disaggregated replay (issue 27): prefill legs, the KV transfer, the conditional path, the peers'
PD modes, determinism and the command."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest

from api.cli import main as kv_router_main
from indexer.events import RouterEvent, stored_event
from mocker.capacity import CapacitySearch, measure_capacity, offline_evaluator
from mocker.config import EngineConfig
from mocker.pd_routers import AGGREGATED, PD_ROUTERS, PEER_PD_ROUTERS, make_pd_router
from mocker.replay import ReplaySetup, replay_offline, replay_router
from mocker.report import ReplayRecord
from mocker.simulation import KvTransfer, simulate
from mocker.trace import Row, Trace, TraceOptions, build_trace
from mocker.workload import shared_prefix_rows
from router.config import RouterConfig
from router.types import WorkerRole

ENGINE = EngineConfig(num_gpu_blocks=512)
BS = ENGINE.block_size
ROLES: list[WorkerRole] = ["prefill", "prefill", "decode", "decode"]


def trace_of(rows: list[Row]) -> Trace:
    return build_trace(rows, TraceOptions(), "test")


def run(
    trace: Trace, router: str, *, seed: int = 0, transfer: KvTransfer | None = None, **config: Any
) -> list[ReplayRecord]:
    made = make_pd_router(router, RouterConfig(block_size=BS, **config), random.Random(seed))
    return asyncio.run(simulate(trace, made, ENGINE, len(ROLES), seed=seed, roles=ROLES, transfer=transfer)).records


@pytest.mark.parametrize("router", sorted(PD_ROUTERS))
def test_a_disaggregated_replay_is_deterministic_and_completes(router: str) -> None:
    trace = trace_of(shared_prefix_rows(requests=80, groups=6, rate_per_s=8.0, seed=3))
    first = run(trace, router, seed=7)
    assert [dataclasses.astuple(r) for r in first] == [dataclasses.astuple(r) for r in run(trace, router, seed=7)]
    assert all(r.status == "completed" for r in first)
    assert all(r.worker_id in (2, 3) for r in first)  # the client's stream is always a decode worker's
    remote = [r for r in first if r.prefill_worker_id >= 0]
    assert all(r.prefill_worker_id in (0, 1) and r.transfer_ms > 0 for r in remote)
    if router not in ("disagg-conditional", "disagg-load-aware", "disagg-estimated"):
        assert len(remote) == len(first)  # the peers and disagg-always never skip the remote prefill


def test_transfer_time_is_the_missing_blocks_over_the_bandwidth() -> None:
    trace = trace_of([(0, 2048, 16, [1, 2, 3, 4])])
    slow = run(trace, "disagg-always", transfer=KvTransfer(bandwidth_gb_per_s=10.0))[0]
    fast = run(trace, "disagg-always", transfer=KvTransfer(bandwidth_gb_per_s=20.0))[0]
    blocks = 2048 // BS
    assert slow.transfer_ms == pytest.approx(blocks * BS * 131_072 / 10e9 * 1000)
    assert fast.transfer_ms == pytest.approx(slow.transfer_ms / 2)
    # Nothing else differs: the first token comes exactly the transfer's difference later.
    assert slow.ttft_ms - fast.ttft_ms == pytest.approx(slow.transfer_ms - fast.transfer_ms)
    assert slow.e2e_ms - fast.e2e_ms == pytest.approx(slow.transfer_ms - fast.transfer_ms)


# A conversation's second turn: the first turn's 2048 tokens and 100 more, on the decode worker that
# received the first turn's KV.
SECOND_TURN = [(0, 2048, 8, [1, 2, 3, 4]), (20_000, 2148, 8, [1, 2, 3, 4, 5])]


@pytest.mark.parametrize(("threshold", "local"), [(256, True), (101, True), (100, False), (0, False)])
def test_the_second_turn_is_prefilled_on_its_decode_worker_exactly_below_the_threshold(
    threshold: int, local: bool
) -> None:
    first, second = run(trace_of(SECOND_TURN), "disagg-conditional", disagg_local_prefill_below_tokens=threshold)
    assert first.prefill_worker_id >= 0 and first.transfer_ms > 0  # 2048 uncached tokens: remote
    assert second.worker_id == first.worker_id  # its own cache credited: the decode worker holding the turn
    if local:
        assert (second.prefill_worker_id, second.transfer_ms) == (-1, 0.0)
        assert second.cached_tokens == 2048  # computed on the decode worker, from its cache
    else:
        assert second.prefill_worker_id >= 0 and second.transfer_ms > 0


def test_replay_compares_aggregated_and_disaggregated_at_equal_workers() -> None:
    trace = trace_of(shared_prefix_rows(requests=40, groups=4, rate_per_s=8.0, seed=1))
    setup = ReplaySetup(engine=ENGINE, prefill_workers=1, decode_workers=2)
    runs = asyncio.run(replay_offline(trace, setup, show_progress=False))
    assert [run.report.router for run in runs] == [AGGREGATED, *PD_ROUTERS]
    aggregated = runs[0].records
    assert {r.worker_id for r in aggregated} <= {0, 1, 2} and all(r.prefill_worker_id == -1 for r in aggregated)
    assert all(run.report.completed == 40 for run in runs)
    with pytest.raises(ValueError, match="both prefill and decode workers"):
        ReplaySetup(prefill_workers=2)


def test_a_mixed_fleet_replays_with_our_routers_and_no_worker_prefills_for_itself() -> None:
    """One decode worker and two of role both: our routers only (the peers' PD modes take separate
    pools), every request completes, and a remote prefill leg never runs on its own decode worker."""
    trace = trace_of(shared_prefix_rows(requests=40, groups=4, rate_per_s=8.0, seed=1))
    setup = ReplaySetup(engine=ENGINE, decode_workers=1, both_workers=2)
    assert setup.roles() == ["decode", "both", "both"] and setup.total_workers == 3
    runs = asyncio.run(replay_offline(trace, setup, show_progress=False))
    assert [run.report.router for run in runs] == [AGGREGATED, *(n for n in PD_ROUTERS if n not in PEER_PD_ROUTERS)]
    for run in runs[1:]:
        assert run.report.completed == 40
        remote = [r for r in run.records if r.prefill_worker_id >= 0]
        assert all(r.prefill_worker_id in (1, 2) and r.prefill_worker_id != r.worker_id for r in remote)
    assert any(r.prefill_worker_id >= 0 for r in runs[1].records)  # disagg-always: every one remote
    with pytest.raises(ValueError, match=r"joins a disaggregated fleet.*disagg_among_both_workers=true"):
        ReplaySetup(both_workers=2)
    with pytest.raises(ValueError, match="takes separate prefill and decode workers"):
        asyncio.run(replay_offline(trace, dataclasses.replace(setup, routers=("sglang-pd",)), show_progress=False))


def test_a_fleet_of_both_workers_replays_disaggregated_when_routed_as_one() -> None:
    """``disagg_among_both_workers``: three workers of role both, our routers handing prefill legs
    between them; aggregated, on the same fleet, never does."""
    trace = trace_of(shared_prefix_rows(requests=40, groups=4, rate_per_s=8.0, seed=1))
    config = RouterConfig(block_size=BS, disagg_among_both_workers=True)
    setup = ReplaySetup(engine=ENGINE, both_workers=3, router_config=config)
    assert setup.disaggregated and setup.roles() == ["both"] * 3
    runs = asyncio.run(replay_offline(trace, setup, show_progress=False))
    assert [run.report.router for run in runs] == [AGGREGATED, *(n for n in PD_ROUTERS if n not in PEER_PD_ROUTERS)]
    assert all(run.report.completed == 40 for run in runs)
    assert all(r.prefill_worker_id == -1 for r in runs[0].records)
    always = runs[1].records  # disagg-always
    assert all(0 <= r.prefill_worker_id != r.worker_id and r.transfer_ms > 0 for r in always)
    # The flag on an aggregated fleet (--workers), or on one worker of role both: refused, not a replay
    # reported as aggregated but routed in two legs, or disaggregated rows that cannot disaggregate.
    for fleet in ({"workers": 3}, {"both_workers": 1}):
        with pytest.raises(ValueError, match="disaggregates among --both-workers N"):
            ReplaySetup(engine=ENGINE, router_config=config, **fleet)  # type: ignore[arg-type]


def test_replay_command_runs_a_disaggregated_fleet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 2048, "output_length": 8, "hash_ids": [1, 2, 3, 4]}\n')
    argv = ["replay", str(path), "--prefill-workers", "1", "--decode-workers", "1", "--quiet", "--no-plots"]
    assert kv_router_main([*argv, "--routers", "disagg-conditional,sglang-pd", "--out", str(tmp_path / "out")]) == 0
    table = capsys.readouterr().out
    assert "disagg-conditional" in table and "sglang-pd" in table
    assert kv_router_main([*argv[:2], "--prefill-workers", "1", "--quiet"]) == 2
    assert "both prefill and decode workers" in capsys.readouterr().err


def test_capacity_searches_the_disaggregated_fleet_itself(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--capacity` on a disaggregated fleet runs each router on that fleet (aggregated on as many workers
    of role both): every point the search kept is the replay of that router at that load, to the digit."""
    trace = trace_of(shared_prefix_rows(requests=60, groups=4, rate_per_s=6.0, output_tokens=32, seed=1))
    setup = ReplaySetup(engine=ENGINE, prefill_workers=1, decode_workers=2)
    routers = [AGGREGATED, "disagg-always"]
    _, results, _ = asyncio.run(
        measure_capacity(routers, offline_evaluator(trace, setup), CapacitySearch(goodput_multipliers=(1.0,)))
    )
    assert [result.router for result in results] == routers
    for result in results:
        assert result.capacity > 0 and result.at_capacity is not None
        replayed = asyncio.run(replay_router(trace.time_scaled(result.capacity), setup, result.router))
        assert result.at_capacity.ttft_p90_ms == replayed.report.ttft_ms.p90
        assert result.at_capacity.itl_p90_ms == replayed.report.itl_ms.p90
        remote = {r.prefill_worker_id for r in replayed.records}
        assert remote == ({-1} if result.router == AGGREGATED else {0})  # the prefill worker's legs, or none

    path = tmp_path / "trace.jsonl"
    path.write_text(
        "".join(
            f'{{"timestamp": {i * 500}, "input_length": 1024, "output_length": 16, "hash_ids": [1, 2]}}\n'
            for i in range(8)
        )
    )
    out = tmp_path / "out"
    argv = ["replay", str(path), "--prefill-workers", "1", "--decode-workers", "1", "--capacity", "--quiet"]
    assert kv_router_main([*argv, "--routers", ",".join(routers), "--no-plots", "--out", str(out)]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[3:]] == routers
    report = msgspec.json.decode((out / "capacity.json").read_bytes())
    assert (report["settings"]["prefill_workers"], report["settings"]["decode_workers"]) == (1, 1)


def test_load_aware_prefills_a_short_prompt_on_its_decode_worker_while_the_prefill_pool_is_busy() -> None:
    # Three 8,192-token prompts queue on the two prefill workers, then a 1,024-token prompt arrives.
    long_prompts: list[Row] = [(0, 8192, 8, list(range(100 * i, 100 * i + 16))) for i in range(3)]
    rows = [*long_prompts, (1, 1024, 8, [900, 901])]
    conditional = run(trace_of(rows), "disagg-conditional")[-1]
    load_aware = run(trace_of(rows), "disagg-load-aware")[-1]
    assert conditional.prefill_worker_id >= 0  # 1,024 uncached tokens: over the 256-token threshold
    assert (load_aware.prefill_worker_id, load_aware.transfer_ms) == (-1, 0.0)  # 2 x 1,024 < 8,192 pending
    assert load_aware.ttft_ms < conditional.ttft_ms / 2  # no wait behind a long prefill, no transfer


def test_estimated_rule_prefills_where_the_first_token_comes_sooner() -> None:
    # Six 8,192-token prompts at once on two prefill and two decode workers, then a 1,024-token prompt.
    long_prompts: list[Row] = [(0, 8192, 8, list(range(100 * i, 100 * i + 16))) for i in range(6)]
    rows = [*long_prompts, (1, 1024, 8, [900, 901])]
    conditional = run(trace_of(rows), "disagg-conditional")
    estimated = run(trace_of(rows), "disagg-estimated")
    assert all(record.prefill_worker_id >= 0 for record in conditional)  # all over the 256-token threshold
    # Nobody decodes on either decode worker yet: the first two are prefilled there (no transfer); the
    # next four would stall a decoding request and queue behind a local prefill: remote.
    local = [record.prefill_worker_id == -1 for record in estimated]
    assert local == [True, True, False, False, False, False, True]
    # The short prompt: both prefill workers hold two long prefills, its decode worker only decodes.
    assert estimated[-1].transfer_ms == 0.0 and estimated[-1].ttft_ms < conditional[-1].ttft_ms / 2
    assert max(r.ttft_ms for r in estimated) < max(r.ttft_ms for r in conditional)


def test_a_peer_pd_pair_reports_the_events_either_pool_refused() -> None:
    """vllm-router-pd's prefill pool indexes KV events: a store whose parent it never heard of is refused
    and counted in the pair's (the report's) rejected events; the decode pool reads none."""
    pair = make_pd_router("vllm-router-pd", RouterConfig(block_size=64), random.Random(0))
    pair.add_pool_worker(1, ENGINE, "prefill")
    pair.add_pool_worker(2, ENGINE, "decode")
    pair.kv_event(RouterEvent(1, stored_event(1, [(11, 12)])), 0.0)
    assert pair.rejected_events == 0
    pair.kv_event(RouterEvent(1, stored_event(2, [(21, 22)], parent_hash=999)), 0.0)
    pair.kv_event(RouterEvent(2, stored_event(1, [(31, 32)], parent_hash=999)), 0.0)
    assert pair.rejected_events == 1

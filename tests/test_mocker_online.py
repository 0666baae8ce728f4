"""Online replay with a real nats-server, the router service and `kv-router mock-worker` processes:
its engine-side hit rate matches the offline simulation of the same trace."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from nats.aio.msg import Msg

from api.cli import main as kv_router_main
from mocker import online as online_module
from mocker.config import EngineConfig
from mocker.demo import DemoOptions, run_demo
from mocker.online import OnlineReplayError, wait_for_workers
from mocker.replay import ReplayRun, ReplaySetup, replay_offline, replay_online_report
from mocker.service import serve_router
from mocker.trace import Trace, TraceOptions, build_trace
from mocker.wire import GenerateRequest, GenerateUpdate, generate_subject, reset_subject
from mocker.workload import shared_prefix_rows
from router.config import RouterConfig
from router.event_plane.connection import NatsOptions, connect
from router.event_plane.embedded_server import EmbeddedNats, free_port
from tests.metrics import total
from tests.router_processes import ToolProcess
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

WORKERS = 2
TIME_SCALE = 8.0
ENGINE = EngineConfig(num_gpu_blocks=512)


@pytest.fixture
def nats_server() -> Iterator[EmbeddedNats]:
    with EmbeddedNats() as server:
        yield server


@pytest.fixture
async def router_url(nats_server: EmbeddedNats) -> AsyncIterator[str]:
    async with serve_router(nats_server.url, RouterConfig(block_size=ENGINE.block_size)) as url:
        yield url


def start_worker(log_dir: Path, nats_url: str, worker_id: int, *flags: str) -> ToolProcess:
    return ToolProcess(
        log_dir, None, "--nats-url", nats_url, "--worker-id", str(worker_id),
        "--num-gpu-blocks", str(ENGINE.num_gpu_blocks), "--engine-speedup", str(TIME_SCALE),
        "--heartbeat-interval", "0.5", "--log-level", "warning", *flags,
    )  # fmt: skip


async def replayed(trace: Trace, router_url: str, nats_server: EmbeddedNats) -> ReplayRun:
    """``trace`` replayed online against the router at ``router_url`` and its `WORKERS` mock workers."""
    return await replay_online_report(
        trace,
        label="online",
        router_url=router_url,
        nats=NatsOptions(nats_server.url),
        workers=WORKERS,
        time_scale=TIME_SCALE,
        show_progress=False,
    )


@pytest.mark.slow
async def test_online_replay_finds_the_cache_hits_the_offline_simulation_predicts(
    nats_server: EmbeddedNats, router_url: str, tmp_path: Path
) -> None:
    rows = shared_prefix_rows(requests=120, groups=12, rate_per_s=8.0, seed=3)
    trace = build_trace(rows, TraceOptions(seed=3), "generated")
    workers = [start_worker(tmp_path, nats_server.url, 100 + i) for i in range(WORKERS)]
    try:
        online = await replayed(trace, router_url, nats_server)
        async with httpx.AsyncClient(base_url=router_url) as http:
            assert msgspec.json.decode((await http.get("/v1/dump")).content)  # the router indexed their blocks
            # The replayer told the router every output block opened, as the proxy would, each for an
            # active request: a block opens at the token after a whole block, the last token opens none.
            metrics = (await http.get("/metrics")).text
            opened = sum(
                sum(1 for g in range(1, r.output_length) if (r.input_length + g) % ENGINE.block_size == 1)
                for r in trace.requests
            )
            assert opened >= len(trace)
            recorded = [line for line in metrics.splitlines() if 'method="record_output"' in line]
            assert f'kv_router_requests_total{{method="record_output",outcome="ok"}} {opened}.0' in recorded, (
                recorded,
                online.report,
            )
            assert 'method="record_output",outcome="unknown' not in metrics
            # A prefix-cache reset reaches the router as a `cleared` event: it forgets those blocks.
            nc = await connect(NatsOptions(nats_server.url))
            for i in range(WORKERS):
                assert (await nc.request(reset_subject("default", 100 + i), b"", timeout=5)).data == b"ok"
            await nc.close()
            await eventually(lambda: dump_is_empty(http), 30, "the index is emptied")
    finally:
        for process in workers:
            assert process.stop() == 0  # a clean exit on SIGTERM
    (offline,) = await replay_offline(
        trace, ReplaySetup(engine=ENGINE, workers=WORKERS, routers=(RouterConfig().policy,)), show_progress=False
    )
    report = online.report
    assert report.completed == len(trace)
    assert sorted(report.requests_per_worker) != [0, len(trace)]  # both workers served
    assert report.hit_rate_tokens > 0.3
    assert report.hit_rate_tokens == pytest.approx(offline.report.hit_rate_tokens, abs=0.06)
    # The router learned the workers' caches from their KV events: its predictions held.
    assert report.predicted_hit_rate == pytest.approx(report.hit_rate_tokens, abs=0.06)
    # Stopped workers deregister, and the router drops them.
    async with httpx.AsyncClient(base_url=router_url) as http:

        async def no_workers() -> bool:
            return not msgspec.json.decode((await http.get("/v1/workers")).content)["workers"]

        await eventually(no_workers, 30, "no worker is listed")


async def dump_is_empty(http: httpx.AsyncClient) -> bool:
    return msgspec.json.decode((await http.get("/v1/dump")).content, type=list[Any]) == []


async def test_waiting_for_workers_gives_up_with_a_clear_error(router_url: str) -> None:
    async with httpx.AsyncClient(base_url=router_url) as http:
        with pytest.raises(OnlineReplayError, match="lists 0 workers"):
            await wait_for_workers(http, 1, timeout_s=0.3)


def tiny_trace_file(path: Path) -> Path:
    rows = shared_prefix_rows(requests=4, groups=2, rate_per_s=8.0, seed=3)
    path.write_bytes(
        b"".join(
            msgspec.json.encode({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": ids}) + b"\n"
            for t, n, o, ids in rows
        )
    )
    return path


@pytest.mark.parametrize("capacity", [False, True], ids=["replay", "capacity"])
async def test_online_failures_are_one_line_not_a_traceback(
    nats_server: EmbeddedNats,
    router_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    capacity: bool,
) -> None:
    """No router at --url (httpx's error), a router no worker registered with (OnlineReplayError): each
    `kv-router replay --online` says so in one line and exits 2, with and without --capacity."""
    monkeypatch.setattr(online_module.wait_for_workers, "__defaults__", (0.3,))  # not 30 s of waiting
    argv = [
        "replay", str(tiny_trace_file(tmp_path / "trace.jsonl")), "--online", "--nats-url", nats_server.url,
        "--nats-wait-secs", "1", "--slo-ttft-ms", "1000", "--slo-itl-ms", "100", "--max-runs", "2",
        "--quiet", "--no-plots", "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    if capacity:
        argv.append("--capacity")
    nobody = f"http://127.0.0.1:{free_port()}"
    for url, expected in ((nobody, f"the router at {nobody}: "), (router_url, "the router lists 0 workers")):
        capsys.readouterr()
        # `kv-router replay` runs its own event loop: in a thread, beside the router's.
        assert await asyncio.to_thread(kv_router_main, [*argv, "--url", url]) == 2
        err = capsys.readouterr().err.splitlines()
        assert err[-1].startswith("kv-router replay: ") and expected in err[-1], err
        assert not any("Traceback" in line for line in err)


@pytest.mark.slow
async def test_the_demo_runs_the_whole_fleet_in_one_process(capsys: pytest.CaptureFixture[str]) -> None:
    online, offline = await run_demo(DemoOptions(workers=2, requests=60, show_progress=False))
    printed = capsys.readouterr().out
    assert "online: NATS + router service" in printed and "offline: the same workload" in printed
    # The whole chain with an OpenAI-speaking client through the proxy: cache hits, nothing left booked.
    proxied = next(line for line in printed.splitlines() if line.startswith("through the OpenAI proxy"))
    assert "48 requests, 2 workers used" in proxied and proxied.endswith("bookings left: none")
    assert "reported by the engines 0 " not in proxied
    assert online.report.completed == 60
    # The online fleet runs in wall-clock time on a shared machine, so its decisions see events at other
    # moments than the simulation's (CI under load measured 0.56 against the simulated dynamo's 0.47):
    # its hit rate lies among the simulated routers', not on one of them.
    simulated = [run.report.hit_rate_tokens for run in offline]
    assert min(simulated) - 0.05 <= online.report.hit_rate_tokens <= max(simulated) + 0.05
    assert {run.report.router for run in offline} >= {"dynamo", "round_robin", "sglang", "llmd"}


async def test_an_online_replay_whose_nats_dies_under_it_still_reports(
    nats_server: EmbeddedNats, router_url: str
) -> None:
    """NATS killed while the replay waits on its workers' answers: its requests end unfinished and the
    replay reports them (before: closing its connection raised the lost transport's error, and the
    replay ended in a traceback with no report)."""
    rows = shared_prefix_rows(requests=4, groups=2, rate_per_s=8.0, seed=3)
    trace = build_trace(rows, TraceOptions(seed=3), "generated")
    nc = await connect(NatsOptions(nats_server.url))
    async with httpx.AsyncClient(base_url=router_url) as http:
        # Registered over HTTP: listed, routed to, and never answering (no engine behind it) but the
        # prefix-cache reset the replay starts with.
        assert (await http.post("/v1/workers", json={"worker_id": 100})).status_code == 201
        await nc.subscribe(reset_subject("default", 100), cb=reset_ok)
        replay = asyncio.create_task(
            replay_online_report(
                trace,
                label="online",
                router_url=router_url,
                nats=NatsOptions(nats_server.url),
                timeout_s=2.0,  # not 300 s per request
                show_progress=False,
            )
        )

        async def routed() -> bool:  # the replay has subscribed to its answers and sent its first request
            return total((await http.get("/metrics")).text, "kv_router_requests_total", method="new") > 0

        await eventually(routed, 30, "the replay's first request routed")
        nats_server.stop()
        run = await asyncio.wait_for(replay, 60)
    await nc.close()
    assert run.report.completed == 0 and [record.status for record in run.records] == ["unfinished"] * len(trace)


async def reset_ok(message: Msg) -> None:
    await message.respond(b"ok")


async def test_a_worker_refuses_generate_requests_it_cannot_answer_and_serves_on(
    nats_server: EmbeddedNats, router_url: str, tmp_path: Path
) -> None:
    """Garbage on a worker's generate subject: a reply subject NATS refuses (the engine loop raised on
    its first update and the worker died), tokens that are not packed u32 (a ValueError, no reply), an
    id already in flight (its replies went to the newer request). Each is a WARNING, and the worker
    answers the next request."""
    worker = start_worker(tmp_path, nats_server.url, 300)
    nc = await connect(NatsOptions(nats_server.url))
    try:
        async with httpx.AsyncClient(base_url=router_url) as http:
            await wait_for_workers(http, 1)
        subject = generate_subject("default", 300)
        inbox = nc.new_inbox()
        updates = await nc.subscribe(inbox)
        prompt = bytes(range(64))
        long_one = GenerateRequest(request_id="long", tokens=prompt, max_tokens=400, reply=inbox)
        await nc.publish(subject, msgspec.msgpack.encode(long_one))
        for request in (
            GenerateRequest(request_id="empty-reply", tokens=prompt, max_tokens=2, reply=""),
            GenerateRequest(request_id="spaced-reply", tokens=prompt, max_tokens=2, reply="a b"),
            GenerateRequest(request_id="wildcard-reply", tokens=prompt, max_tokens=2, reply="a.*"),
            GenerateRequest(request_id="odd-tokens", tokens=b"12345", max_tokens=2, reply=inbox),
            GenerateRequest(request_id="long", tokens=prompt, max_tokens=2, reply=inbox + ".other"),
        ):
            await nc.publish(subject, msgspec.msgpack.encode(request))
        good = GenerateRequest(request_id="good", tokens=prompt, max_tokens=2, reply=inbox)
        await nc.publish(subject, msgspec.msgpack.encode(good))
        done: set[str] = set()
        while done != {"good", "long"}:
            update = msgspec.msgpack.decode((await updates.next_msg(timeout=30)).data, type=GenerateUpdate)
            if update.kind == "done":
                done.add(update.request_id)
        assert not worker.ended()
        refusals = [line for line in worker.log().splitlines() if "refused:" in line]
        assert [line.split("generate request ")[1] for line in refusals] == [
            f"'empty-reply' on {subject} refused: reply '' is not a subject to publish to",
            f"'spaced-reply' on {subject} refused: reply 'a b' is not a subject to publish to",
            f"'wildcard-reply' on {subject} refused: reply 'a.*' is not a subject to publish to",
            f"'odd-tokens' on {subject} refused: tokens are 5 bytes, not packed u32",
            f"'long' on {subject} refused: a request of that id is in flight",
        ]
    finally:
        await nc.close()
        assert worker.stop() == 0


@pytest.mark.slow
async def test_a_repeated_online_replay_starts_from_cold_caches(
    nats_server: EmbeddedNats, router_url: str, tmp_path: Path
) -> None:
    """Before: the second replay on the same fleet found the first one's prefixes still cached (hit
    rate 0.16, then 1.0). Now every replay resets the fleet first, as each capacity point does."""
    rows = shared_prefix_rows(requests=24, groups=4, rate_per_s=8.0, seed=4)
    trace = build_trace(rows, TraceOptions(seed=4), "generated")
    workers = [start_worker(tmp_path, nats_server.url, 400 + i) for i in range(WORKERS)]
    try:
        hits = [(await replayed(trace, router_url, nats_server)).report.hit_rate_tokens for _ in range(2)]
    finally:
        for process in workers:
            assert process.stop() == 0
    assert hits[0] < 0.9 and hits[1] == pytest.approx(hits[0], abs=0.1)


async def test_a_repeated_online_replay_runs_on_workers_without_kv_events(
    nats_server: EmbeddedNats, router_url: str, tmp_path: Path
) -> None:
    """Workers that publish no KV events: the router predicts their caches from what it routed, and
    no reset of theirs can clear those predictions. The replay's fleet reset waits for the indexed
    blocks alone (it waited for the predicted ones too, and failed every run after the first)."""
    rows = shared_prefix_rows(requests=12, groups=3, rate_per_s=8.0, seed=5)
    trace = build_trace(rows, TraceOptions(seed=5), "generated")
    workers = [start_worker(tmp_path, nats_server.url, 410 + i, "--no-kv-events") for i in range(WORKERS)]
    try:
        for _ in range(2):
            done = await replayed(trace, router_url, nats_server)
            assert [record.status for record in done.records] == ["completed"] * len(trace.requests)
            # When each was sent, for the replayer's own lateness (`mocker.report.send_lateness`).
            assert all(0 <= record.sent_ms - record.arrival_ms < record.ttft_ms for record in done.records)
    finally:
        for process in workers:
            assert process.stop() == 0


async def test_parked_requests_never_hold_the_connections_their_marks_need(
    nats_server: EmbeddedNats, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The router's queue on: requests park in /v1/new until marks free room. Before, one pool of
    connections served both, and parked calls filling it left no connection for the marks that would
    unpark them (a deadlock; here with a pool of 4 rather than 256 requests). Each request the router
    queued is counted (its answer's timing.queued_s; before, always 0)."""
    monkeypatch.setattr(online_module, "_POOL", httpx.Limits(max_connections=4, max_keepalive_connections=4))
    rows = shared_prefix_rows(requests=16, groups=2, rate_per_s=1000.0, output_tokens=32, seed=3)
    trace = build_trace(rows, TraceOptions(seed=3, jitter_ms=0), "generated")
    config = RouterConfig(block_size=ENGINE.block_size, router_queue_threshold=0.01)
    async with serve_router(nats_server.url, config) as url:
        worker = start_worker(tmp_path, nats_server.url, 600)
        try:
            run = await asyncio.wait_for(
                replay_online_report(
                    trace,
                    label="online",
                    router_url=url,
                    nats=NatsOptions(nats_server.url),
                    time_scale=TIME_SCALE,
                    timeout_s=60.0,
                    show_progress=False,
                ),
                60,
            )
        finally:
            assert worker.stop() == 0
    assert run.report.completed == len(trace)
    assert run.report.queued_in_router > 0

"""The proxy in front of real `kv-router mock-worker --http-port` processes: one is killed with
SIGKILL (by its PID) while streams run; every stream ends (completed, or with an SSE error event),
new requests keep being served by the survivor, and no booking is left behind."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from router.event_plane.embedded_server import EmbeddedNats, free_port
from tests.metrics import sample
from tests.proxy_fleet import MODEL, fleet, idle
from tests.router_processes import ToolProcess
from tests.waiting import eventually

pytestmark = pytest.mark.anyio


def start_worker(log_dir: Path, nats_url: str, worker_id: int, http_port: int) -> ToolProcess:
    return ToolProcess(
        log_dir, None, "--nats-url", nats_url, "--worker-id", str(worker_id), "--http-port", str(http_port),
        "--model", MODEL, "--num-gpu-blocks", "512", "--engine-speedup", "2",
        "--heartbeat-interval", "0.3", "--log-level", "warning",
    )  # fmt: skip


@pytest.mark.slow
async def test_a_worker_killed_mid_run_loses_no_booking_and_the_proxy_keeps_serving(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with fleet(nats_server.url, (), lease_secs=3.0) as f:
        processes = {
            worker_id: start_worker(tmp_path, nats_server.url, worker_id, free_port()) for worker_id in (11, 12)
        }
        try:
            await eventually(lambda: len(f.router.workers()) == 2, timeout=30)
            api = f.client
            outcomes: list[str] = []
            placed: list[int] = []

            async def one(i: int) -> None:
                try:
                    raw = await api.completions.with_raw_response.create(
                        model=MODEL, prompt=list(range(i * 300, i * 300 + 256)), max_tokens=300, stream=True
                    )
                    placed.append(int(raw.headers["x-kv-router-worker"]))
                    text = "".join([chunk.choices[0].text async for chunk in raw.parse()])
                    outcomes.append("ok" if text.endswith(" w300") else "short")
                except openai.APIError as exc:  # the SSE error event of a stream whose worker died
                    outcomes.append("error" if "mid-stream" in str(exc) else f"other: {exc}")

            streams = [asyncio.ensure_future(one(i)) for i in range(12)]
            # Kill worker 11 once some of its streams have started (those not started yet are retried).
            await eventually(lambda: placed.count(11) >= 2, timeout=30)
            processes[11].kill9()
            await asyncio.wait_for(asyncio.gather(*streams), 120)
            assert len(outcomes) == 12 and set(outcomes) <= {"ok", "error"}, outcomes
            # The streams on the killed worker end with the SSE error event, the others complete.
            assert outcomes.count("error") == placed.count(11) > 0, (outcomes, placed)
            await eventually(lambda: idle(f.router))
            # New requests go to the survivor: worker 11's failures are told to its circuit breaker (a retry takes its
            # requests to 12 meanwhile), then its lease expires.
            for i in range(4):
                raw = await api.completions.with_raw_response.create(model=MODEL, prompt=[i + 1] * 100, max_tokens=2)
                assert raw.headers["x-kv-router-worker"] == "12"
            async with httpx.AsyncClient() as http:
                text = (await http.get(f"{f.url}/metrics")).text
            assert (sample(text, "kv_router_proxy_upstream_failures_total") or 0) >= 1
            await eventually(lambda: [w.worker_id for w in f.router.workers()] == [12], timeout=30)
            assert idle(f.router)
        finally:
            for process in processes.values():
                process.stop()


async def test_a_worker_registers_the_url_it_is_reached_at_and_the_proxy_uses_it(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """``--http-url``: the address routers reach the worker's API at, as in deploy/compose.yaml, where it
    listens on every interface and is reached by its service's name (here ``localhost``, not the
    ``127.0.0.1`` it listens on). A model of its own: workers of earlier tests may still be leased."""
    async with fleet(nats_server.url, ()) as f:
        port = free_port()
        worker = ToolProcess(
            tmp_path, None, "--nats-url", nats_server.url, "--worker-id", "21", "--http-port", str(port),
            "--http-url", f"http://localhost:{port}/v1", "--model", "reached-by-name", "--log-level", "warning",
        )  # fmt: skip
        try:
            registered = f"http://localhost:{port}"
            await eventually(lambda: any(w.worker_id == 21 and w.url == registered for w in f.router.workers()), 30)
            raw = await f.client.completions.with_raw_response.create(model="reached-by-name", prompt=[7] * 64,
                                                                      max_tokens=2)  # fmt: skip
            assert raw.headers["x-kv-router-worker"] == "21"
            assert raw.parse().usage.completion_tokens == 2
        finally:
            worker.stop()


async def test_a_worker_run_without_kv_events_is_predicted_and_its_text_routed_by_bytes(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """``--no-kv-events``: registered without them, it publishes none; the proxy routes its text by its
    bytes and predicts its cache, so a repeated prefix is credited on it. A model of its own, as above."""
    async with fleet(nats_server.url, ()) as f:
        port = free_port()
        worker = ToolProcess(
            tmp_path, None, "--nats-url", nats_server.url, "--worker-id", "31", "--http-port", str(port),
            "--model", "no-events", "--no-kv-events", "--log-level", "warning",
        )  # fmt: skip
        try:
            await eventually(lambda: any(w.worker_id == 31 for w in f.router.workers()), 30)
            (registered,) = [w for w in f.router.workers() if w.worker_id == 31]
            assert not registered.kv_events
            prompt = "a shared document. " * 60  # 1,140 bytes: 285 routing tokens, 4 blocks of 64
            for cached in ("0", "256"):
                raw = await f.client.completions.with_raw_response.create(model="no-events", prompt=prompt,
                                                                          max_tokens=2)  # fmt: skip
                assert raw.headers["x-kv-router-cached-tokens"] == cached
            assert f.router.predictions is not None and f.router.predictions.blocks() == {(31, 0): 4}
            assert not f.router.sequencer.heard_from(31, 0)  # no event came
            await eventually(lambda: idle(f.router))
        finally:
            worker.stop()

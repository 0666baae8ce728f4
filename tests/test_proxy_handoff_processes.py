"""The hand-off with real `kv-router mock-worker --role ...` processes behind the proxy, in both
styles, with the real `openai` client: a long prompt is prefilled on a prefill worker and streamed
by the decode worker; then the prefill worker holding the prompt's cache is killed with SIGKILL (by
its PID) and the next request with that prefix, routed there first, is prefilled by the survivor.
No booking is left behind. With the router's queue on, a remote prefill waits while the prefill
worker is held."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from router.disaggregation import prefill_booking_id
from router.event_plane.embedded_server import EmbeddedNats, free_port
from router.types import HandoffStyle, RouteRequest
from tests.metrics import sample
from tests.proxy_fleet import MODEL, Fleet, fleet, idle
from tests.router_processes import ToolProcess
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

PREFIX = list(range(2000, 2512))  # 8 blocks of 64


@contextmanager
def workers(
    log_dir: Path, nats_url: str, roles: dict[int, str], style: HandoffStyle
) -> Iterator[dict[int, ToolProcess]]:
    processes: dict[int, ToolProcess] = {}
    try:
        for worker_id, role in roles.items():
            processes[worker_id] = ToolProcess(
                log_dir, None, "--nats-url", nats_url, "--worker-id", str(worker_id), "--http-port", str(free_port()),
                "--model", MODEL, "--num-gpu-blocks", "512", "--engine-speedup", "10",
                "--heartbeat-interval", "0.3", "--log-level", "warning", "--role", role, "--handoff", style,
                "--transfer-gb-per-s", "5",
            )  # fmt: skip
        yield processes
    finally:
        for process in processes.values():
            process.stop()


def cached_blocks(f: Fleet, worker_id: int) -> int:
    return sum(blocks for (worker, _), blocks in f.router.tree.stats().blocks.items() if worker == worker_id)


@pytest.mark.parametrize("style", ["kv_transfer_params", "bootstrap"])
async def test_processes_hand_off_and_a_killed_prefill_worker_is_replaced(
    nats_server: EmbeddedNats, style: HandoffStyle, tmp_path: Path
) -> None:
    async with fleet(nats_server.url, (), lease_secs=10.0) as f:
        with workers(tmp_path, nats_server.url, {11: "prefill", 12: "prefill", 21: "decode"}, style) as processes:
            await eventually(lambda: len(f.router.workers()) == 3, timeout=30)
            assert {w.worker_id: w.role for w in f.router.workers()} == {11: "prefill", 12: "prefill", 21: "decode"}
            raw = await f.client.completions.with_raw_response.create(
                model=MODEL, prompt=PREFIX, max_tokens=5, stream=True
            )
            text = "".join([chunk.choices[0].text async for chunk in raw.parse()])
            assert text == " w1 w2 w3 w4 w5"
            assert raw.headers["x-kv-router-worker"] == "21"
            assert raw.headers["x-kv-router-disaggregation"] == "remote_prefill"
            first = int(raw.headers["x-kv-router-prefill-worker"])
            other = 23 - first  # 11 <-> 12
            # The prefill worker's and the decode worker's own KV events reach the index.
            await eventually(lambda: cached_blocks(f, first) >= 8 and cached_blocks(f, 21) >= 8, timeout=30)
            processes[first].kill9()
            # The same prefix and 512 new tokens: 512 uncached on the decode worker (remote prefill), and
            # the prefill worker with the prefix cached, now dead, comes first; its leg goes to the other.
            longer = PREFIX + list(range(3000, 3512))
            raw = await f.client.completions.with_raw_response.create(
                model=MODEL, prompt=longer, max_tokens=4, stream=True
            )
            text = "".join([chunk.choices[0].text async for chunk in raw.parse()])
            assert text == " w1 w2 w3 w4"
            assert raw.headers["x-kv-router-prefill-worker"] == str(other)
            assert raw.headers["x-kv-router-worker"] == "21"
            async with httpx.AsyncClient() as http:
                metrics = (await http.get(f"{f.url}/metrics")).text
            assert sample(metrics, "kv_router_proxy_handoffs_total", style=style, outcome="prefill_failed") == 1.0
            assert sample(metrics, "kv_router_proxy_handoffs_total", style=style, outcome="ok") == 2.0
            await eventually(lambda: idle(f.router))


async def test_processes_a_remote_prefill_waits_in_the_queue_until_the_prefill_worker_is_free(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """With the router's queue on (threshold 0: any pending prefill makes a rank queue-busy), a client's
    long prompt waits while the prefill worker is held by another request, and runs both legs on the
    mock-worker processes once that request's prefill leg is done."""
    router = {"router_queue_threshold": 0.0}
    async with fleet(nats_server.url, (), lease_secs=10.0, router=router) as f:
        with workers(tmp_path, nats_server.url, {11: "prefill", 21: "decode"}, "kv_transfer_params"):
            await eventually(lambda: len(f.router.workers()) == 2, timeout=30)
            held = await f.router.new(RouteRequest(tokens=list(range(50_000, 54_096)), request_id="elsewhere"))
            assert held.disaggregation is not None and held.disaggregation.path == "remote_prefill"
            waiting = asyncio.ensure_future(
                f.client.completions.with_raw_response.create(model=MODEL, prompt=PREFIX, max_tokens=3, stream=True)
            )
            await eventually(lambda: f.router.queue_stats().pending_count == 1)
            assert f.router.booking(prefill_booking_id("elsewhere")) is not None
            assert f.router.mark_prefill("elsewhere")
            raw = await waiting
            text = "".join([chunk.choices[0].text async for chunk in raw.parse()])
            assert text == " w1 w2 w3"
            assert raw.headers["x-kv-router-disaggregation"] == "remote_prefill"
            assert raw.headers["x-kv-router-prefill-worker"] == "11" and raw.headers["x-kv-router-worker"] == "21"
            assert f.router.mark_free("elsewhere")
            await eventually(lambda: idle(f.router))
            assert f.router.queue_stats().pending_count == 0

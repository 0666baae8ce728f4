"""bench/gateway_bench.py's parts that need no peer gateway: the stub backend's answers over real HTTP,
and the CPU of a process tree read from /proc (descendants started by any thread included)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.proxy_bench import MODEL, stop_process, tree_oncpu_s, tree_pids
from router.event_plane.embedded_server import free_port
from tests.waiting import until

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def stub() -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, str(ROOT / "bench" / "gateway_bench.py"), "stub", "--port", str(port)])
    url = f"http://127.0.0.1:{port}"

    def listening() -> bool:
        try:
            return httpx.get(f"{url}/health").status_code == 200
        except httpx.HTTPError:
            return False

    try:
        until(listening, 30, "the stub listening")
        yield url
    finally:
        stop_process(process)


def test_stub_answers_completions_and_chat_as_json_and_sse(stub: str) -> None:
    with httpx.Client(base_url=stub) as client:  # one connection: keep-alive across the requests
        assert client.get("/v1/models").json()["data"][0]["id"] == MODEL
        answer = client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 5}).json()
        assert answer["choices"][0]["text"] == "aaaaa"
        assert answer["usage"]["completion_tokens"] == 5
        chat = client.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        ).json()
        assert chat["object"] == "chat.completion"
        assert chat["choices"][0]["message"] == {"role": "assistant", "content": "a" * 8}
        with client.stream(
            "POST", "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}
        ) as response:
            assert response.headers["content-type"] == "text/event-stream"
            events = [line for line in response.iter_lines() if line]
        assert events[-1] == "data: [DONE]"
        assert [httpx.Response(200, content=e[6:]).json()["choices"][0]["text"] for e in events[:-1]] == ["a"] * 3
        assert client.post("/v1/completions", content=b"{not json").status_code == 400
        assert client.post("/v1/unknown", json={}).status_code == 404


def test_process_tree_cpu_counts_descendants_of_every_thread() -> None:
    # A parent whose second thread starts a child that burns CPU: the child is listed under that
    # thread's /proc/PID/task/TID/children, not the main thread's.
    script = (
        "import subprocess, sys, threading, time\n"
        "burn = 'import time\\nend = time.process_time() + 0.3\\nwhile time.process_time() < end: pass\\n"
        "time.sleep(60)'\n"
        "threading.Thread(target=lambda: subprocess.Popen([sys.executable, '-c', burn])).start()\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        until(lambda: len(tree_pids(parent.pid)) == 2, 30, "the child started")
        child = tree_pids(parent.pid)[1]
        until(lambda: tree_oncpu_s(child) >= 0.3, 30, "the child's burn")
        assert tree_oncpu_s(parent.pid) >= tree_oncpu_s(child) >= 0.3
        assert tree_oncpu_s(parent.pid) - tree_oncpu_s(child) < 0.3  # the parent itself mostly slept
    finally:
        for pid in reversed(tree_pids(parent.pid)):
            os.kill(pid, signal.SIGKILL)
        parent.wait()


def test_the_report_gives_medians_over_rounds_and_each_ratio_from_one_rounds_pair() -> None:
    from bench.gateway_bench import Cell, Result, report

    cell = Cell(1, False, "text")
    n = 100

    def measured(cpu_us: float, p50_ms: float) -> Result:
        return Result(latencies_s=[p50_ms / 1e3] * n, router_cpu_s=cpu_us * n / 1e6, backend_cpu_s=0.0, wall_s=1.0)

    # Round 2 is slow for both gateways (a noisy neighbour): the per-round ratio sees through it.
    results = {
        "direct": {cell: [measured(0, 0.25), measured(0, 0.30), measured(0, 0.25)]},
        "kv-router": {cell: [measured(300, 0.75), measured(600, 1.00), measured(330, 0.70)]},
        "sglang-router": {cell: [measured(300, 0.70), measured(600, 0.80), measured(300, 0.75)]},
    }
    args = argparse.Namespace(
        rounds=3, prompt_tokens=1024, distinct_prompts=0, max_tokens=8, requests=n, requests_concurrent=n,
        router_cpus="1", shared_cpus="0",
    )  # fmt: skip
    row = next(line for line in report(results, [cell], args).splitlines() if line.startswith("c=1 JSON text"))
    # CPU: medians 330 and 300 us; added p50: medians of 0.50, 0.70, 0.45 and 0.45, 0.50, 0.50 ms;
    # ratios per round 1.00, 1.00, 1.10.
    assert "330 (    0) [+0.500]" in row and "300 (    0) [+0.500]" in row
    assert row.rstrip().endswith("1.00x (1.00-1.10)")


@pytest.mark.parametrize("route", [False, True], ids=["python-floor", "python-floor-routed"])
def test_the_python_floor_hands_back_the_backends_answers_byte_for_byte(stub: str, route: bool) -> None:
    port = free_port()
    command = [sys.executable, str(ROOT / "bench" / "python_floor.py"), "--port", str(port), stub, stub]
    floor = subprocess.Popen(command + (["--route"] if route else []))
    url = f"http://127.0.0.1:{port}"
    bodies = [
        {"model": MODEL, "prompt": "a text prompt " * 40, "max_tokens": 4},
        {"model": MODEL, "prompt": list(range(300)), "max_tokens": 3},
        {"model": MODEL, "prompt": "streamed", "max_tokens": 5, "stream": True},
    ]
    try:

        def answering() -> bool:
            try:
                return httpx.post(f"{url}/v1/completions", json=bodies[0]).status_code == 200
            except httpx.HTTPError:
                return False

        until(answering, 30, "the floor forwarding")
        with httpx.Client(base_url=url) as through, httpx.Client(base_url=stub) as direct:
            for _ in range(3):  # the pooled connections carry the next requests
                for body in bodies:
                    theirs, ours = direct.post("/v1/completions", json=body), through.post("/v1/completions", json=body)
                    assert (ours.status_code, ours.headers["content-type"]) == (200, theirs.headers["content-type"])
                    assert ours.content == theirs.content
    finally:
        stop_process(floor)


def test_the_proxy_profile_splits_a_cells_cpu_by_layer() -> None:
    """bench/proxy_profile.py against the real proxy and stubs: every layer's share, summing to the whole."""
    command = [sys.executable, str(ROOT / "bench" / "proxy_profile.py"), "--requests", "300", "--concurrency", "8"]
    output = subprocess.run(command, capture_output=True, text=True, timeout=240, check=True).stdout
    shares = {line.split("%", 1)[1].strip(): float(line.split("%", 1)[0]) for line in output.splitlines()
              if line.startswith("  ") and "%" in line[:10]}  # fmt: skip
    assert {"api/proxy", "api (HTTP)", "router"} <= set(shares)
    assert abs(sum(shares.values()) - 100) < 1
    assert "kv-router --proxy, c=8 JSON text" in output and "send (api/proxy/upstream.py" in output

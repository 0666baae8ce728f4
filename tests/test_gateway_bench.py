"""bench/gateway_bench.py's parts that need no peer gateway: the stub backend's answers over real HTTP,
and the CPU of a process tree read from /proc (descendants started by any thread included)."""

from __future__ import annotations

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

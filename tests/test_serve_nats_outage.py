"""Real ``kv-router serve`` and ``kv-router mock-worker`` processes against NATS that is not there yet,
a busy embedded-NATS port, and signals while waiting. Every process is stopped by its PID."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from router.event_plane.embedded_server import EmbeddedNats, free_port
from tests.router_processes import RouterProcess, ToolProcess, kv_router_command
from tests.test_api_event_plane import Workers
from tests.test_api_server import ROOT, _get
from tests.waiting import accepting, until

BLOCK = 16


def serve(log_dir: Path, *flags: str, own_group: bool = False, env: dict[str, str] | None = None) -> RouterProcess:
    """``kv-router serve``, waited for on /healthz: HTTP answers whether NATS is there or not."""
    return RouterProcess(
        log_dir, "--block-size", str(BLOCK), *flags, ready_path="/healthz", own_group=own_group, env=env
    )


@pytest.mark.slow
def test_startup_without_nats_serves_http_reports_why_and_starts_the_plane_when_nats_arrives(tmp_path: Path) -> None:
    nats_port = free_port()
    url = f"nats://127.0.0.1:{nats_port}"
    with serve(tmp_path, "--nats-url", url) as served:  # HTTP is up although NATS is not
        process, port = served.process, served.port
        assert process is not None
        status, body = _get(port, "/readyz")
        readiness = json.loads(body)
        assert status == 503 and readiness["ready"] is False
        assert url in readiness["reason"] and "unreachable" in readiness["reason"]
        assert readiness["event_plane"]["state"] == "connecting"
        health = json.loads(_get(port, "/healthz")[1])
        assert health["status"] == "ok" and health["event_plane"]["state"] == "connecting"
        metrics = _get(port, "/metrics")[1].decode()
        assert 'kv_router_event_plane_state{state="connecting"} 1.0' in metrics
        # A few retries (four attempts take 3.5 s of back-off), however slowly a loaded machine runs them.
        until(lambda: served.log().count("unreachable") >= 4, timeout=30)
        with EmbeddedNats(port=nats_port) as nats:
            until(lambda: _get(port, "/readyz")[0] == 200, timeout=30)
            assert json.loads(_get(port, "/v1/info")[1])["nats_url"] == url
            pool = Workers(nats.url)
            tokens = list(range(7000, 7000 + 4 * BLOCK))
            pool.start(41, tokens)

            def routed() -> bool:
                from tests.test_api_event_plane import _http

                return _http(port, "/v1/new", json.dumps({"tokens": tokens}).encode()).get("overlap_blocks") == 4

            until(routed, timeout=30)
            pool.close()
            process.send_signal(signal.SIGTERM)
            process.wait(10)
    log = served.log()
    retries = [line for line in log.splitlines() if "unreachable" in line]
    assert len(retries) >= 4, log
    assert "Traceback" not in log
    waits = [float(m) for m in re.findall(r"retry \d+ in ([0-9.]+) s", log)]
    assert waits[:4] == [0.5, 1.0, 2.0, 4.0] and max(waits) <= 5.0  # doubling, capped at 5 s
    assert log.count(url) >= 1


def test_nats_without_jetstream_is_said_in_readiness_and_one_log_line_a_retry(
    tmp_path: Path, plain_nats_url: str
) -> None:
    """An operator's plain NATS (no ``-js``): HTTP serves, /readyz says what is missing and what to do,
    and each retry logs one line, where it logged nats-py's bare ServiceUnavailableError with two
    chained tracebacks every five seconds."""
    with serve(tmp_path, "--nats-url", plain_nats_url) as served:
        told = "JetStream did not answer for bucket kv_router_workers_default"

        def retried_twice() -> bool:
            return served.log().count(f"service: event-plane failed: {told}") >= 2

        until(retried_twice, 30, "two attempts logged")
        status, body = _get(served.port, "/readyz")
        reason = json.loads(body)["reason"]
        assert status == 503
        assert reason.startswith(f"event plane starting: NATS at {plain_nats_url} connected; the last attempt failed: "
                                 f"JetStreamUnavailable: {told}")  # fmt: skip
        assert "start nats-server with -js" in reason
        assert "Traceback" not in served.log()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_waiting_for_nats_ends_the_process(sig: signal.Signals, tmp_path: Path) -> None:
    with serve(tmp_path, "--nats-url", f"nats://127.0.0.1:{free_port()}") as served:
        process, port = served.process, served.port
        assert process is not None
        until(lambda: _get(port, "/readyz")[0] == 503)
        process.send_signal(sig)
        assert process.wait(10) in (0, -sig)  # within 10 s, or wait() raises
    assert "Traceback" not in served.log()


def test_ctrl_c_stops_the_service_before_its_embedded_nats(tmp_path: Path) -> None:
    """A terminal's Ctrl-C signals the whole foreground process group: the embedded nats-server must not
    die under the service, which would log a lost NATS connection on a clean shutdown."""
    nats_port = free_port()
    flags = ("--embedded-nats-port", str(nats_port))
    with serve(tmp_path, *flags, own_group=True, env={"XDG_RUNTIME_DIR": str(tmp_path)}) as served:
        process = served.process
        assert process is not None
        until(lambda: _get(served.port, "/readyz")[0] == 200, timeout=30)
        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(15) in (0, -signal.SIGINT)
    log = served.log()
    assert f"embedded nats-server started on port {nats_port}" in log
    assert "lost the NATS connection" not in log and "Traceback" not in log, log
    until(lambda: not accepting(nats_port), timeout=15)  # and the service stopped its server itself


def test_a_busy_embedded_port_is_named_with_the_port_chosen_and_info_returns_the_url(tmp_path: Path) -> None:
    with EmbeddedNats() as squatter, serve(tmp_path, "--embedded-nats-port", str(squatter.port)) as served:
        process, port = served.process, served.port
        assert process is not None
        until(lambda: _get(port, "/readyz")[0] == 200, timeout=30)
        info = json.loads(_get(port, "/v1/info")[1])
        chosen = info["nats_url"]
        assert chosen.startswith("nats://127.0.0.1:") and chosen != squatter.url
        process.send_signal(signal.SIGTERM)
        process.wait(10)
    log = served.log()
    [warning] = [line for line in log.splitlines() if "is taken" in line]
    assert "WARNING" in warning and f"port {squatter.port}" in warning
    assert f"port {chosen.rsplit(':', 1)[1]}" in warning
    assert log.count(chosen) == 1  # the URL in use, printed once


def test_mock_worker_says_clearly_when_it_cannot_connect() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    argv = [*kv_router_command(), "mock-worker", "--nats-url", url, "--nats-wait-secs", "1"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, timeout=30)
    assert done.returncode == 2
    message = done.stderr.decode()
    assert message.startswith(f"kv-router mock-worker: waiting for NATS at {url} (connection refused)")
    assert f"cannot connect to NATS at {url} after 1 s (connection refused)" in message and "--nats-url" in message
    assert "Traceback" not in message


@pytest.mark.slow
def test_a_local_tool_follows_a_restarted_service_to_its_embedded_servers_new_token(tmp_path: Path) -> None:
    """A mock worker and a bridge found the service through its connection file; the service restarts
    (its embedded nats-server with a new token) and both are back in its registry, where they were
    refused for ever with the old token (no log line said so)."""
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    env.pop("KV_ROUTER_NATS_CONNECTION_FILE", None)
    port, nats_port = free_port(), free_port()

    def service() -> RouterProcess:
        return RouterProcess(
            tmp_path, "--embedded-nats-port", str(nats_port), port=port, ready_path="/healthz", env=env
        )

    with service() as first:
        worker = ToolProcess(tmp_path, env, "--worker-id", "5", "--block-size", str(BLOCK), "--heartbeat-interval",
                             "0.5", "--log-level", "info")  # fmt: skip
        bridge = ToolProcess(tmp_path, env, "--worker-id", "6", "--block-size", str(BLOCK), "--zmq-endpoint",
                             f"tcp://127.0.0.1:{free_port()}", command="bridge")  # fmt: skip
        with worker, bridge:

            def registered() -> bool:
                workers = json.loads(_get(port, "/v1/workers")[1])["workers"]
                return sorted(w["config"]["worker_id"] for w in workers) == [5, 6]

            until(registered, 30, "both register")
            first.stop()
            with service():
                until(registered, 30, "both register again with the restarted service")
            for tool in (worker, bridge):
                assert "the service's connection file has a new NATS token: reconnecting with it" in tool.log()
                assert tool.stop() == 0

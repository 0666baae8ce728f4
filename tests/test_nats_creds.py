"""NATS decentralised auth (``--nats-creds-file``) for real: a nats-server in operator mode with a
memory resolver, trusting an operator, a JetStream-enabled account and its users minted here
(`tests.nats_jwt`). Two ``kv-router serve --replica-sync --durable-events`` processes and a
``kv-router mock-worker`` connect with ``.creds`` files; the worker's KV events are routed, bookings
are shared, and a router killed with SIGKILL comes back from its snapshot and the stream. Bad or
absent credentials are one clear line, never a traceback.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from nats.errors import Error as NatsError

from router.event_plane.connection import NatsOptions, connect, is_authorization_error
from router.event_plane.embedded_server import find_nats_server, free_port
from tests.nats_jwt import NatsOperator
from tests.router_processes import ROOT, RouterProcess, ToolProcess, kv_router_command
from tests.test_ha_durable import canonical
from tests.waiting import until

pytestmark = pytest.mark.slow

BLOCK = 64  # the mock workers' block size
PROMPT = list(range(1, 4 * BLOCK + 1))


@dataclass
class OperatorNats:
    url: str
    router_creds: Path
    worker_creds: Path
    foreign_creds: Path  # a user of an account this server does not trust


@pytest.fixture
def operator_nats(tmp_path: Path) -> Iterator[OperatorNats]:
    operator = NatsOperator()
    operator.account("KV")
    router_creds = operator.creds(tmp_path / "router.creds", "KV", "router")
    worker_creds = operator.creds(tmp_path / "worker.creds", "KV", "worker")
    stranger = NatsOperator("another-operator")
    stranger.account("KV")
    foreign_creds = stranger.creds(tmp_path / "foreign.creds", "KV", "intruder")
    port = free_port()
    config = tmp_path / "nats.conf"
    config.write_text(
        f'listen: "127.0.0.1:{port}"\njetstream {{ store_dir: "{tmp_path / "js"}" }}\n{operator.server_config()}'
    )
    log_path = tmp_path / "nats-server.log"
    with log_path.open("wb") as log:  # a file, not a pipe nobody drains
        server = subprocess.Popen([find_nats_server(), "-c", str(config)], stdout=subprocess.DEVNULL, stderr=log)
    try:
        until(lambda: b"Server is ready" in log_path.read_bytes() or server.poll() is not None, 30, "nats-server")
        assert server.poll() is None, log_path.read_text()[-2000:]
        yield OperatorNats(f"nats://127.0.0.1:{port}", router_creds, worker_creds, foreign_creds)
    finally:
        server.terminate()
        server.wait(10)


def _connects(options: NatsOptions) -> BaseException | None:
    """None if a client with ``options`` connects and uses JetStream (a KV bucket), else the error."""

    async def attempt() -> BaseException | None:
        try:
            nc = await connect(options)
        except (OSError, TimeoutError, NatsError) as exc:
            return exc
        try:
            bucket = await nc.jetstream().create_key_value(bucket="creds_check")
            await bucket.put("k", b"v")
            assert (await bucket.get("k")).value == b"v"
        finally:
            await nc.close()
        return None

    return asyncio.run(attempt())


# nats-py leaves a refused connection's socket to the garbage collector: the library's warning, not ours.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_the_operator_server_admits_only_its_users(operator_nats: OperatorNats) -> None:
    assert _connects(NatsOptions(operator_nats.url, creds_file=str(operator_nats.router_creds))) is None
    for refused in (
        _connects(NatsOptions(operator_nats.url)),
        _connects(NatsOptions(operator_nats.url, creds_file=str(operator_nats.foreign_creds))),
    ):
        assert refused is not None and is_authorization_error(refused), refused


def _completion(port: int, tokens: list[int]) -> dict[str, object]:
    body = json.dumps({"model": "mock-model", "prompt": tokens, "max_tokens": 2}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        return dict(json.loads(reply.read()))


def _overlap(router: RouterProcess) -> int:
    status, body = router.post("/v1/overlap", {"tokens": PROMPT})
    assert status == 200, body
    return max((worker["device_blocks"] for worker in body["workers"]), default=0)


def _active(router: RouterProcess) -> list[int]:
    return [load["active_requests"] for load in router.post("/v1/potential_loads", {"tokens": PROMPT})[1]["loads"]]


def test_replicas_and_durable_events_with_creds(operator_nats: OperatorNats, tmp_path: Path) -> None:
    flags = [
        "--block-size", str(BLOCK),
        "--nats-url", operator_nats.url, "--nats-creds-file", str(operator_nats.router_creds),
        "--replica-sync", "--durable-events", "--snapshot-every-secs", "0.5",
    ]  # fmt: skip
    a = RouterProcess(tmp_path, *flags, "--router-name", "a").start()
    b = RouterProcess(tmp_path, *flags, "--router-name", "b").start()
    http_port = free_port()
    worker = ToolProcess(tmp_path, dict(os.environ), "--nats-url", operator_nats.url, "--nats-creds-file",
                        str(operator_nats.worker_creds), "--worker-id", "7", "--http-port", str(http_port))  # fmt: skip
    try:
        for router in (a, b):
            until(lambda r=router: [w["config"]["worker_id"] for w in r.get("/v1/workers")["workers"]] == [7],
                  30, "the worker registers through the creds-authenticated registry")  # fmt: skip
        _completion(http_port, PROMPT)  # the engine stores the prompt's 4 blocks and publishes them
        for router in (a, b):
            until(lambda r=router: _overlap(r) == 4, 30, "the worker's events reach the router via the stream")
        status, decision = a.post("/v1/new", {"tokens": PROMPT, "request_id": "creds-1"})
        assert status == 200 and decision["worker_id"] == 7 and decision["overlap_blocks"] == 4
        until(lambda: _active(b) == [1], 30, "b sees a's booking through replica sync")
        assert b.post("/v1/mark_free", {"request_id": "creds-1"})[0] == 200
        until(lambda: _active(a) == [0], 30, "a sees b's mark_free")

        dump = canonical(b.get("/v1/dump"))
        assert len(dump) == 4
        until(a.snapshot_covers_applied, 30, "a writes a snapshot of the index it has applied")
        a.kill9()
        a = RouterProcess(tmp_path, *a.args[5:], port=a.port).start()
        assert canonical(a.get("/v1/dump")) == dump
        assert "loading index snapshot" in a.log()  # read from the object store with the router's creds
        assert _active(a) == [0]
    finally:
        worker.stop()
        a.stop()
        b.stop()
    for log in (a.log(), b.log(), worker.log()):
        assert "Traceback" not in log


def _run(*argv: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*kv_router_command(), *argv], cwd=ROOT, capture_output=True, timeout=60)


def test_absent_or_malformed_creds_are_one_line_and_exit_code_2(operator_nats: OperatorNats, tmp_path: Path) -> None:
    not_creds = tmp_path / "not.creds"
    not_creds.write_text("just some text\n")
    for path, reason in ((tmp_path / "missing.creds", "No such file"), (not_creds, "is not a NATS credentials file")):
        for command in ("serve", "mock-worker"):
            done = _run(command, "--nats-url", operator_nats.url, "--nats-creds-file", str(path))
            stderr = done.stderr.decode()
            assert done.returncode == 2, stderr
            assert reason in stderr and len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr


def test_creds_the_server_refuses_are_named(operator_nats: OperatorNats, tmp_path: Path) -> None:
    # Refused credentials are not waited out: waiting cannot change the server's answer (a wait longer
    # than _run's 60 s timeout would fail here).
    done = _run(
        "mock-worker", "--nats-url", operator_nats.url, "--nats-creds-file", str(operator_nats.foreign_creds),
        "--nats-wait-secs", "600",
    )  # fmt: skip
    stderr = done.stderr.decode()
    assert done.returncode == 2 and "refused the credentials" in stderr and "Traceback" not in stderr
    assert "after 600 s" not in stderr and len(stderr.strip().splitlines()) == 1, stderr

    # The service keeps HTTP up, not ready, and says on each retry that the credentials were refused.
    # Up is /healthz: never ready, it is not waited for on /readyz.
    router = RouterProcess(tmp_path, "--nats-url", operator_nats.url, "--nats-creds-file",
                           str(operator_nats.foreign_creds), ready_path="/healthz").start()  # fmt: skip
    try:
        until(lambda: router.log().count("refused the credentials") >= 2, 60, "two refused attempts are logged")
        with urllib.request.urlopen(f"http://127.0.0.1:{router.port}/healthz", timeout=5) as reply:
            assert reply.status == 200
        with pytest.raises(urllib.error.HTTPError) as not_ready:
            urllib.request.urlopen(f"http://127.0.0.1:{router.port}/readyz", timeout=5)
        assert not_ready.value.code == 503
        assert "Authorization Violation" in json.loads(not_ready.value.read())["event_plane"]["last_error"]
    finally:
        router.stop()
    log = router.log()
    assert "WARNING" in log and "Traceback" not in log

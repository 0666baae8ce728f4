"""The embedded nats-server of ``kv-router serve`` (no ``--nats-url``) is kept running: killed, it is
started again on its port with its token and JetStream store, and the router and its workers reconnect
by themselves; one that keeps dying is given up, said in an ERROR and in ``/readyz``; at shutdown it is
stopped, not started again. Real processes, loopback only, each stopped by its PID."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from api.app import create_app
from api.config import EventPlaneConfig, RouterConfig, Settings
from router.event_plane.connection import connect
from router.event_plane.embedded_server import EmbeddedNats, ServerKeeper, free_port
from tests.metrics import sample
from tests.router_processes import RouterProcess, ToolProcess, running
from tests.waiting import accepting, until

BLOCK = 16


def nats_server_children(parent: int) -> list[int]:
    """The PIDs of the live nats-server processes whose parent is ``parent``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            command = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[1]) == parent and command[0].endswith(b"nats-server"):
            found.append(int(entry))
    return found


def test_a_killed_embedded_nats_server_is_started_again_and_the_fleet_comes_back(tmp_path: Path) -> None:
    nats_port = free_port()
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}  # the connection file, read by the mock workers
    worker_env = {**os.environ, **env}

    def worker(worker_id: int) -> ToolProcess:
        flags = ["--worker-id", str(worker_id), "--block-size", str(BLOCK), "--heartbeat-interval", "0.5",
                 "--nats-wait-secs", "10", "--log-level", "warning"]  # fmt: skip
        return ToolProcess(tmp_path, worker_env, *flags)

    def workers() -> set[int]:
        return {int(w["config"]["worker_id"]) for w in service.get("/v1/workers")["workers"]}

    with RouterProcess(tmp_path, "--embedded-nats-port", str(nats_port), env=env) as service:
        [first] = nats_server_children(service.pid)
        connection_file = tmp_path / "kv-router" / f"nats-{nats_port}.json"
        written = connection_file.read_text()
        with worker(4) as before:
            until(lambda: workers() == {4}, 20, "worker 4")
            os.kill(first, signal.SIGKILL)

            def started_again() -> bool:
                return [pid for pid in nats_server_children(service.pid) if pid != first] != [] and accepting(nats_port)

            until(started_again, 20, "a new nats-server child on the same port")

            def plane_connected() -> bool:
                readiness = service.get("/readyz")
                return bool(readiness["ready"]) and readiness["event_plane"]["state"] == "connected"

            until(plane_connected, 20, "the router's event plane connected again")
            assert connection_file.read_text() == written  # the same URL and token
            with worker(5) as after:
                # The worker that reconnected is there still, and the one started since joins.
                until(lambda: workers() == {4, 5}, 20, "workers 4 and 5")
                assert before.stop() == 0 and not after.ended()
                until(lambda: workers() == {5}, 20, "worker 4 gone")
                status, decision = service.post("/v1/new", {"tokens": list(range(1, 2 * BLOCK + 1))})
                assert (status, decision["worker_id"]) == (200, 5)
        assert sample(service.metrics(), "kv_router_embedded_nats_restarts_total") == 1.0
    log = service.log()
    [exited] = [line for line in log.splitlines() if "exited unexpectedly" in line]
    assert "WARNING" in exited and f"pid {first}, port {nats_port}" in exited and "killed by SIGKILL" in exited
    assert "started again on port" in log and "Traceback" not in log
    assert not accepting(nats_port)  # stopped with the service, not started again


def test_the_keeper_stops_its_server_for_good_and_keeps_its_store_across_restarts() -> None:
    """A restart keeps the JetStream store (a key written before is read after, on the client's own
    reconnection); `stop` stops the server without starting it again."""
    server = EmbeddedNats(require_token=True).start()
    keeper = ServerKeeper(server).start()
    try:

        async def write_kill_read() -> bytes | None:
            nc = await connect(server.client_options())
            try:
                bucket = await nc.jetstream().create_key_value(bucket="kept")
                await bucket.put("worker", b"registered")
                killed = server.pid
                assert killed is not None
                os.kill(killed, signal.SIGKILL)
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 20
                while not (keeper.restarts == 1 and nc.is_connected) and loop.time() < deadline:
                    await asyncio.sleep(0.05)
                return (await bucket.get("worker")).value
            finally:
                await nc.close()

        assert asyncio.run(write_kill_read()) == b"registered"
    finally:
        keeper.stop()
    assert server.pid is None and not accepting(server.port) and keeper.restarts == 1 and keeper.failure is None


def squat(squatters: list[EmbeddedNats], port: int) -> bool:
    """Another program takes ``port``: a nats-server of its own, with a token the router does not have
    (its client is refused, as by any server there but its own), kept in ``squatters``; False while
    the kernel still refuses the port."""
    try:
        squatters.append(EmbeddedNats(port=port, require_token=True).start())
    except (RuntimeError, TimeoutError):
        return False
    return True


def test_a_server_that_cannot_be_started_again_is_given_up_and_the_service_is_not_ready(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Killed twice, its port then taken by another program: each start fails naming the taken port,
    and past the starts a window allows it is given up: an ERROR, and the service it serves answers
    /readyz 503 saying so. Nothing else is bound instead."""
    server = EmbeddedNats(require_token=True).start()
    # A backoff long enough for the port to be taken before the start after the second kill, however
    # loaded the machine (2 s was not, once: that start came first and succeeded).
    keeper = ServerKeeper(server, restarts_per_window=2, first_backoff_s=6.0).start()
    squatters: list[EmbeddedNats] = []
    try:
        first = server.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        until(lambda: keeper.restarts == 1, 20, "the first start again")
        second = server.pid
        assert second is not None
        os.kill(second, signal.SIGKILL)
        until(lambda: not running(second), 10, "the second server gone")
        # Within the backoff before the next start (as nats-server does: its clients' closed
        # connections may hold the port in TIME_WAIT, which a listen may still meet for a moment).
        until(lambda: squat(squatters, server.port), 4, "the port taken within the backoff")
        until(lambda: keeper.failure is not None, 20, "given up")
    finally:
        for squatter in squatters:
            squatter.stop()
        keeper.stop()
    # The service of that server (its client refused at the port now free: no server answers there).
    settings = Settings(
        router=RouterConfig(block_size=BLOCK),
        event_plane=EventPlaneConfig(nats_url=server.url, nats_token=server.token, embedded_nats=False),
    )
    with TestClient(create_app(settings, registry=CollectorRegistry(), embedded=keeper)) as client:
        readiness = client.get("/readyz")
        assert readiness.status_code == 503 and readiness.json()["reason"] == keeper.failure
        assert sample(client.get("/metrics").text, "kv_router_embedded_nats_restarts_total") == 1.0
    assert keeper.failure is not None
    assert f"port {server.port} was started again 2 times within 60 s" in keeper.failure
    assert "address already in use" in keeper.failure and "restart kv-router serve" in keeper.failure
    assert server.token is not None and server.token not in keeper.failure
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and r.name.startswith("router.")]
    assert errors == [keeper.failure]
    failed_starts = [r.getMessage() for r in caplog.records if "could not be started again" in r.getMessage()]
    assert len(failed_starts) == 1 and "address already in use" in failed_starts[0]

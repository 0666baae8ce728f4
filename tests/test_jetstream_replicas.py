"""``jetstream_replicas``: on a three-server NATS cluster, a router with three copies of the worker
registry (scaled up from the one copy a worker created first), the durable event stream, the snapshot
store and the cursor bucket keeps working when the server leading the registry is killed (SIGKILL):
a worker registers afterwards, the router routes to it, and every stream still has a leader."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import msgspec
import nats
import pytest
from nats.js import JetStreamContext

from router.event_plane.embedded_server import EmbeddedNats, find_nats_server, free_port
from router.event_plane.jetstream import kv_stream, object_stream
from router.event_plane.publisher import open_registry
from router.event_plane.subjects import Subjects
from router.types import WorkerConfig
from tests.router_processes import RouterProcess
from tests.waiting import eventually, until

pytestmark = pytest.mark.anyio

SERVERS = 3


class Cluster:
    """Three clustered nats-servers with JetStream on loopback, each stopped by its PID."""

    def __init__(self, directory: Path) -> None:
        self.ports = [free_port() for _ in range(SERVERS)]
        routes = [free_port() for _ in range(SERVERS)]
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []
        for index in range(SERVERS):
            name = f"n{index}"
            config = directory / f"{name}.conf"
            config.write_text(
                f"listen: 127.0.0.1:{self.ports[index]}\nserver_name: {name}\n"
                f"jetstream {{ store_dir: {directory / name} }}\n"
                f"cluster {{ name: kvr\n listen: 127.0.0.1:{routes[index]}\n"
                f" routes: [{', '.join(f'nats://127.0.0.1:{port}' for port in routes)}] }}\n"
            )
            log = (directory / f"{name}.log").open("wb")
            self._logs.append(log)
            self.processes[name] = subprocess.Popen([find_nats_server(), "-c", str(config)], stdout=log, stderr=log)

    def url(self, index: int) -> str:
        return f"nats://127.0.0.1:{self.ports[index]}"

    def kill(self, name: str) -> None:
        process = self.processes[name]
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(10)
        for log in self._logs:
            log.close()


@contextmanager
def cluster(directory: Path) -> Iterator[Cluster]:
    running = Cluster(directory)
    try:
        yield running
    finally:
        running.stop()


async def leaders(js: JetStreamContext, names: list[str]) -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in names:
        info = await js.stream_info(name)
        found[name] = info.cluster.leader if info.cluster is not None else None
    return found


async def all_current(js: JetStreamContext, names: list[str]) -> bool:
    """Every stream has a leader and two followers that have caught up (a scaled-up stream's new copies
    take a moment)."""
    for name in names:
        cluster = (await js.stream_info(name)).cluster
        if cluster is None or cluster.leader is None:
            return False
        followers = cluster.replicas or []
        if len(followers) != SERVERS - 1 or not all(peer.current for peer in followers):
            return False
    return True


@pytest.mark.slow
async def test_three_copies_survive_the_loss_of_the_server_leading_the_registry(tmp_path: Path) -> None:
    subjects = Subjects("default")
    streams = [
        kv_stream(subjects.registry_bucket),
        "KV_EVENTS_default",
        object_stream("kv_router_snapshots_default"),
        kv_stream("kv_router_cursors_default"),
    ]
    with cluster(tmp_path) as servers:

        async def meta_leader() -> bool:  # JetStream answers once the cluster has elected its meta leader
            try:
                nc = await nats.connect(servers.url(0), connect_timeout=1, max_reconnect_attempts=0)
            except Exception:
                return False
            try:
                await nc.jetstream().account_info()
                return True
            except Exception:
                return False
            finally:
                await nc.close()

        await eventually(meta_leader, 30, "the NATS cluster elects its JetStream leader")
        worker_nc = await nats.connect(servers.url(1))
        try:
            await open_registry(worker_nc, subjects)  # a worker first: the registry with one copy
            js = worker_nc.jetstream()
            assert (await js.stream_info(streams[0])).config.num_replicas == 1
            args = ("--nats-url", servers.url(0), "--durable-events", "--jetstream-replicas", "3")
            with RouterProcess(tmp_path, *args) as router:
                infos = {name: (await js.stream_info(name)).config.num_replicas for name in streams}
                assert infos == dict.fromkeys(streams, 3)

                async def registry_leader() -> str | None:
                    return (await leaders(js, streams[:1]))[streams[0]]

                await eventually(lambda: all_current(js, streams), 30, "every stream's three copies are current")
                # The registry's leader goes, as a drain or a crash would take it.
                victim = await registry_leader()
                assert victim is not None
                if victim == "n1":  # the worker's own server: keep the worker's connection
                    await worker_nc.close()
                    worker_nc = await nats.connect(servers.url(2))
                    js = worker_nc.jetstream()
                servers.kill(victim)

                async def led() -> bool:
                    try:
                        return all(leader not in (None, victim) for leader in (await leaders(js, streams)).values())
                    except Exception:
                        return False

                await eventually(led, 30, "every stream has a new leader")
                registry = await js.key_value(subjects.registry_bucket)
                worker = WorkerConfig(worker_id=42, block_size=16)
                await asyncio.wait_for(registry.put("42", msgspec.json.encode(worker)), 10)

                def routed_to_42() -> bool:
                    status, decision = router.post("/v1/new", {"tokens": list(range(64))})
                    return status == 200 and decision["worker_id"] == 42

                until(routed_to_42, 30, "the router routes to the worker registered after the loss")
                status, _ = router.post("/v1/new", {"tokens": list(range(64))})
                assert status == 200
                assert router.get("/readyz") is not None
        finally:
            await worker_nc.close()


async def test_on_a_single_server_more_copies_are_a_warning_and_the_service_runs(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """A NATS that is not clustered refuses more than one copy: the router creates each stream and
    bucket with one, says so in a WARNING, and gets ready (it restarted its event plane in a loop)."""
    args = ("--nats-url", nats_server.url, "--durable-events", "--jetstream-replicas", "3")
    with RouterProcess(tmp_path, *args) as router:
        assert router.get("/readyz")["ready"] is True
        assert "the NATS server is not clustered, so it keeps one copy" in router.log()
        assert "crashed" not in router.log()

"""Several ``kv-router serve`` of one user on one host, none with its embedded NATS on port 4222: a local
tool given no URL (``mock-worker``, ``bridge``, `connect_local`) cannot know which one is meant, and says
so at once, listing their URLs and asking for ``--nats-url``, instead of "no kv-router serve of this user
is running".

Real ``kv-router serve``, ``mock-worker`` and ``bridge`` processes on free loopback ports, each stopped by
its PID, with their own ``XDG_RUNTIME_DIR``.
"""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import pytest

from router.event_plane.connection_file import LocalServer, SeveralLocalServers, write_connection_file
from router.event_plane.embedded_server import free_port
from router.event_plane.first_connection import connect_local
from tests.router_processes import RouterProcess, ToolProcess
from tests.waiting import until

pytestmark = pytest.mark.slow


def test_connect_local_names_the_running_services_instead_of_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("KV_ROUTER_NATS_CONNECTION_FILE", raising=False)
    servers = []
    for port in (free_port(), free_port()):
        server = LocalServer(url=f"nats://127.0.0.1:{port}", token=f"t{port}", pid=os.getpid())  # a live PID
        write_connection_file(tmp_path / "kv-router" / f"nats-{port}.json", server)
        servers.append(server)
    with pytest.raises(SeveralLocalServers) as several:
        asyncio.run(connect_local(wait_s=0.5))
    assert sorted(several.value.servers, key=lambda s: s.url) == sorted(servers, key=lambda s: s.url)
    message = str(several.value)
    assert all(server.url in message for server in servers) and "--nats-url" in message
    assert all(server.token not in message for server in servers)


def test_tools_without_a_url_list_the_routers_running_and_ask_for_one(tmp_path: Path) -> None:
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    env.pop("KV_ROUTER_NATS_CONNECTION_FILE", None)
    ports = [free_port(), free_port()]  # neither 4222
    with (
        RouterProcess(tmp_path, "--embedded-nats-port", str(ports[0]), env=env),
        RouterProcess(tmp_path, "--embedded-nats-port", str(ports[1]), env=env),
    ):
        for command, flags in (
            ("mock-worker", ("--nats-wait-secs", "20")),
            ("bridge", ("--worker-id", "3", "--zmq-endpoint", f"tcp://127.0.0.1:{free_port()}",
                        "--nats-wait-secs", "20")),
        ):  # fmt: skip
            with ToolProcess(tmp_path, env, *flags, command=command) as tool:
                until(tool.ended, 15, f"{command} says which routers run, at once (not after its 20 s wait)")
                assert tool.process.returncode == 2, tool.log()
                log = tool.log()
            assert f"kv-router {command}: 2 kv-router serve of this user are running" in log, log
            assert all(f"nats://127.0.0.1:{port}" in log for port in ports), log
            assert "pass --nats-url" in log and "is running" not in log.replace("are running", ""), log
            assert not re.search(r"no kv-router serve", log), log

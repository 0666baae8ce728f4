"""The embedded nats-server demands a token made per start; the service and the local tools find it in
a 0600 connection file, so ``kv-router serve`` and ``kv-router mock-worker`` still need no flags, while a
client without the token is refused. The token is never on a command line nor in a log.

Real nats-server, real ``kv-router serve`` and ``kv-router mock-worker`` processes, each stopped by
its PID; every process started here gets its own ``XDG_RUNTIME_DIR`` so no test touches the user's.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from nats.errors import Error as NatsError

from api.config import EventPlaneConfig
from api.plane_lifecycle import embedded_nats
from router.event_plane.connection import NatsOptions, connect, is_authorization_error
from router.event_plane.connection_file import (
    DEFAULT_URL,
    ConnectionFileError,
    LocalServer,
    SeveralLocalServers,
    connection_file_path,
    find_local_server,
    with_local_credentials,
    write_connection_file,
)
from router.event_plane.embedded_server import EmbeddedNats, free_port
from tests.router_processes import RouterProcess, ToolProcess
from tests.waiting import until

pytestmark = pytest.mark.slow

MOCK_BLOCK = 64  # the mock workers' block size


def _refusal(options: NatsOptions) -> BaseException:
    async def attempt() -> BaseException:
        try:
            nc = await connect(options)
        except (OSError, TimeoutError, NatsError) as exc:
            return exc
        await nc.close()
        raise AssertionError(f"{options.url} admitted a client with token={options.token is not None}")

    return asyncio.run(attempt())


async def _round_trip(options: NatsOptions) -> bytes:
    nc = await connect(options)
    try:
        sub = await nc.subscribe("kv.test.echo")
        await nc.publish("kv.test.echo", b"hello")
        return (await sub.next_msg(timeout=5)).data
    finally:
        await nc.close()


# nats-py leaves a refused connection's socket to the garbage collector: the library's warning, not ours.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_the_embedded_server_refuses_clients_without_its_token() -> None:
    with EmbeddedNats(require_token=True) as server:
        assert server.token is not None and len(server.token) >= 40
        without = _refusal(NatsOptions(server.url))
        assert is_authorization_error(without), without
        assert "Authorization Violation" in str(without)
        wrong = _refusal(NatsOptions(server.url, token="not-" + server.token))
        assert is_authorization_error(wrong), wrong
        assert asyncio.run(_round_trip(server.client_options())) == b"hello"
        # The config that held the token is gone once the server has read it; the command line names it only.
        command = Path(f"/proc/{server.pid}/cmdline").read_bytes().split(b"\0")
        config = Path(command[command.index(b"-c") + 1].decode())
        assert not config.exists() and not config.parent.exists()
        assert server.token.encode() not in b" ".join(command)
    with EmbeddedNats(require_token=True) as other:
        assert other.token != server.token  # a new secret per server


def test_serve_writes_a_private_connection_file_and_removes_it(tmp_path: Path) -> None:
    connection_file = tmp_path / "runtime" / "kv-router" / "nats.json"
    config = EventPlaneConfig(embedded_nats_port=free_port(), nats_connection_file=str(connection_file))
    with embedded_nats(config) as (used, _):
        assert used.nats_url == f"nats://127.0.0.1:{config.embedded_nats_port}" and used.nats_token is not None
        assert stat.S_IMODE(connection_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(connection_file.parent.stat().st_mode) == 0o700
        local = msgspec.json.decode(connection_file.read_bytes(), type=LocalServer)
        assert (local.url, local.token, local.pid) == (used.nats_url, used.nats_token, os.getpid())
        assert repr(local).count(local.token) == 0 and local.token not in repr(used)
        assert asyncio.run(_round_trip(NatsOptions(local.url, token=local.token))) == b"hello"
    assert not connection_file.exists()


def _write(directory: Path, port: int, pid: int) -> LocalServer:
    server = LocalServer(url=f"nats://127.0.0.1:{port}", token=f"token-{port}", pid=pid)
    write_connection_file(directory / "kv-router" / f"nats-{port}.json", server)
    return server


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_local_tools_find_the_server_a_url_means(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("KV_ROUTER_NATS_CONNECTION_FILE", raising=False)
    assert find_local_server(None) is None
    assert with_local_credentials(None, NatsOptions(DEFAULT_URL)) == NatsOptions(DEFAULT_URL)

    dead = _write(tmp_path, 4300, _dead_pid())  # a service killed with SIGKILL left its file
    assert find_local_server(None) is None and find_local_server(dead.url) is None
    moved = _write(tmp_path, 4301, os.getpid())  # 4222 was taken: the only server running is chosen
    assert not (tmp_path / "kv-router" / "nats-4300.json").exists()  # the next service drops the dead one's
    assert find_local_server(None) == moved
    options = with_local_credentials(None, NatsOptions(DEFAULT_URL, name="w"))
    assert (options.url, options.token, options.name) == (moved.url, moved.token, "w")
    other = _write(tmp_path, 4302, os.getpid())
    with pytest.raises(SeveralLocalServers) as several:  # two and neither on 4222: the user must say which
        find_local_server(None)
    assert several.value.servers == [moved, other]
    default = _write(tmp_path, 4222, os.getpid())
    assert find_local_server(None) == default  # the default port wins
    assert find_local_server("nats://localhost:4301") == moved  # a URL means the server on its port
    assert find_local_server("127.0.0.1:4301") == moved
    assert find_local_server("nats://10.1.2.3:4301") is None  # not this host's
    # Credentials of one's own are never replaced.
    mine = NatsOptions("nats://127.0.0.1:4301", token="mine")
    assert with_local_credentials("nats://127.0.0.1:4301", mine) == mine
    creds = NatsOptions("nats://127.0.0.1:4301", creds_file="/x.creds")
    assert with_local_credentials("nats://127.0.0.1:4301", creds) == creds
    # A file another user owns could point the tools at that user's server: ignored.
    planted = tmp_path / "kv-router" / "nats-4222.json"
    os.chown(planted, 12345, 12345)
    with pytest.raises(SeveralLocalServers) as several:  # the planted one is not among them
        find_local_server(None)
    assert several.value.servers == [moved, other]
    # An explicit file is read as given, or is an error.
    assert find_local_server(None, str(tmp_path / "kv-router" / "nats-4301.json")) == moved
    with pytest.raises(ConnectionFileError, match="not a readable kv-router connection file"):
        find_local_server(None, str(tmp_path / "missing.json"))
    monkeypatch.setenv("KV_ROUTER_NATS_CONNECTION_FILE", str(tmp_path / "kv-router" / "nats-4302.json"))
    assert with_local_credentials(None, NatsOptions(DEFAULT_URL)).token == "token-4302"
    # A user without a home (in a container) and no runtime directory: no file anywhere, no /tmp fallback.
    monkeypatch.delenv("KV_ROUTER_NATS_CONNECTION_FILE")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("HOME", "/")
    assert connection_file_path(4222) is None and find_local_server(None) is None


def _command_lines() -> Iterator[tuple[int, bytes]]:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                yield int(entry), Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue


def _nats_server_pid(port: int) -> int:
    for pid, command in _command_lines():
        parts = command.split(b"\0")
        if parts[0].endswith(b"nats-server") and str(port).encode() in parts:
            return pid
    raise AssertionError(f"no nats-server on port {port}")


def _known(router: RouterProcess, worker_id: int) -> bool:
    return any(w["config"]["worker_id"] == worker_id for w in router.get("/v1/workers")["workers"])


def _routed_to(router: RouterProcess, worker_id: int) -> bool:
    status, body = router.post("/v1/new", {"tokens": list(range(1, 2 * MOCK_BLOCK + 1))})
    if status != 200:
        return False
    router.post("/v1/mark_free", {"request_id": body["request_id"]})
    return bool(body["worker_id"] == worker_id)


@pytest.fixture
def runtime_env(tmp_path: Path) -> dict[str, str]:
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    env.pop("KV_ROUTER_NATS_CONNECTION_FILE", None)
    return env


# nats-py leaves a refused connection's socket to the garbage collector: the library's warning, not ours.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_serve_and_a_mock_worker_without_flags_share_the_token_nobody_else_has(
    tmp_path: Path, runtime_env: dict[str, str]
) -> None:
    nats_port = free_port()  # not 4222: other tests and services on this host may hold it
    router = RouterProcess(tmp_path, "--block-size", str(MOCK_BLOCK), "--embedded-nats-port", str(nats_port),
                           env=runtime_env)  # fmt: skip
    router.start()
    worker: ToolProcess | None = None
    bridge: ToolProcess | None = None
    try:
        connection_file = Path(runtime_env["XDG_RUNTIME_DIR"]) / "kv-router" / f"nats-{nats_port}.json"
        local = msgspec.json.decode(connection_file.read_bytes(), type=LocalServer)
        assert stat.S_IMODE(connection_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(connection_file.parent.stat().st_mode) == 0o700
        assert local.pid == router.pid and local.url == f"nats://127.0.0.1:{nats_port}"
        assert router.get("/v1/info")["nats_url"] == local.url

        # No NATS flag at all: the worker finds the only router running and its token.
        worker = ToolProcess(tmp_path, runtime_env, "--worker-id", "77")
        until(lambda: _routed_to(router, 77), timeout=30)
        assert f"mock worker 77 on {local.url}" in worker.log()

        # The bridge, given the router's (loopback) URL, finds the token of the server on that port.
        bridge = ToolProcess(tmp_path, runtime_env, "--worker-id", "78", "--zmq-endpoint",
                            f"tcp://127.0.0.1:{free_port()}", "--block-size", str(MOCK_BLOCK), "--nats-url", local.url,
                            command="bridge")  # fmt: skip
        until(lambda: _known(router, 78), timeout=30)

        # A foreign process on the host, without the connection file: refused.
        refused = _refusal(NatsOptions(local.url, name="intruder"))
        assert is_authorization_error(refused), refused
        assert sorted(w["config"]["worker_id"] for w in router.get("/v1/workers")["workers"]) == [77, 78]

        token = local.token.encode()
        nats_pid = _nats_server_pid(nats_port)
        watched = {router.pid, worker.process.pid, bridge.process.pid, nats_pid}
        for pid, command in _command_lines():
            assert token not in command, f"the token is on the command line of process {pid}"
        assert watched <= {pid for pid, _ in _command_lines()}
    finally:
        for tool in (worker, bridge):
            if tool is not None:
                tool.stop()
        router.stop()
    assert not connection_file.exists()  # removed with the service
    for log in (router.log(), worker.log() if worker else "", bridge.log() if bridge else ""):
        assert local.token not in log and "Traceback" not in log
    assert str(connection_file) in router.log()  # says where the tools find it


def test_a_mock_worker_refused_by_the_embedded_server_says_why(tmp_path: Path, runtime_env: dict[str, str]) -> None:
    with EmbeddedNats(require_token=True) as server:
        worker = ToolProcess(tmp_path, runtime_env, "--nats-url", server.url, "--worker-id", "5",
                             "--nats-wait-secs", "1")  # fmt: skip
        try:
            assert worker.process.wait(30) == 2
        finally:
            worker.stop()
    log = worker.log()
    # While waiting: most likely a service still starting (its server listens before its token is written).
    waiting = f"waiting for NATS at {server.url} (it needs a token and no kv-router serve of this user has written"
    assert waiting in log, log
    # At the end: the whole cause.
    assert "Authorization Violation" in log and "no running kv-router serve of this user" in log, log
    assert "--nats-connection-file" in log and "Traceback" not in log


def test_a_remote_server_refusing_a_tool_is_not_taken_for_a_service_still_starting() -> None:
    from nats.errors import AuthorizationError

    from router.event_plane.first_connection import LocalToolConnection

    refused = AuthorizationError()
    remote_url = "nats://nats.example:4222"
    remote = LocalToolConnection("kv-router mock-worker", remote_url, NatsOptions(url=remote_url))
    assert remote._waiting_reason(NatsOptions(url=remote_url), refused) == "Authorization Violation"
    default = NatsOptions(url="nats://127.0.0.1:4222")
    local = LocalToolConnection("kv-router mock-worker", None, default)
    assert "no kv-router serve of this user has written" in local._waiting_reason(default, refused)
    with_token = NatsOptions(url=default.url, token="t")
    assert local._waiting_reason(with_token, refused) == "Authorization Violation"


def test_a_tool_with_nothing_to_connect_to_waits_then_names_the_cause(
    tmp_path: Path, runtime_env: dict[str, str]
) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    for command, flags in (("mock-worker", ["--nats-wait-secs", "1.5"]),
                           ("bridge", ["--worker-id", "3", "--zmq-endpoint", "tcp://127.0.0.1:1", "--nats-wait-secs",
                                       "1.5"])):  # fmt: skip
        tool = ToolProcess(tmp_path, runtime_env, "--nats-url", url, *flags, command=command)
        try:
            assert tool.process.wait(30) == 2
        finally:
            tool.stop()
        lines = tool.log().splitlines()
        assert f"kv-router {command}: waiting for NATS at {url} (connection refused)" in lines[0], lines
        assert f"cannot connect to NATS at {url} after 2 s (connection refused): nothing answers there" in lines[-1]
        assert "Traceback" not in tool.log()


# nats-py leaves a refused connection's socket to the garbage collector: the library's warning, not ours.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_tools_started_before_the_service_wait_and_find_its_moved_nats_without_flags(
    tmp_path: Path, runtime_env: dict[str, str]
) -> None:
    """README: `kv-router serve --proxy ... &` then at once `kv-router mock-worker ... &` (issue 30, fault 1);
    the service's NATS on another port than 4222 and the bridge given no --nats-url (issue 24, fault 9)."""
    nats_port = free_port()
    worker = ToolProcess(tmp_path, runtime_env, "--worker-id", "91")
    router = RouterProcess(tmp_path, "--block-size", str(MOCK_BLOCK), "--embedded-nats-port", str(nats_port),
                           "--access-log", env=runtime_env)  # fmt: skip
    bridge: ToolProcess | None = None
    try:
        scraped = f"http://127.0.0.1:{router.port}/metrics"
        bridge = ToolProcess(tmp_path, runtime_env, "--worker-id", "92", "--zmq-endpoint",
                             f"tcp://127.0.0.1:{free_port()}", "--block-size", str(MOCK_BLOCK),
                             "--engine-metrics-url", scraped, command="bridge")  # fmt: skip
        until(lambda: "waiting for NATS" in worker.log() and "waiting for NATS" in bridge.log(), timeout=30)
        router.start()
        until(lambda: _routed_to(router, 91), timeout=60)
        until(lambda: _known(router, 92), timeout=60)
        assert f"mock worker 91 on nats://127.0.0.1:{nats_port}" in worker.log()
        assert f"-> nats://127.0.0.1:{nats_port}" in bridge.log()
        # Quiet by default (issue 24, fault 10): no line per engine-metrics scrape. The bridge may have
        # said once that the engine (here the router's /metrics, up after the bridge) was not answering
        # yet: that is a state change, not a scrape, so count what three more scrapes add.
        mentions = bridge.log().count("/metrics")
        scrapes = router.log().count("GET /metrics")
        until(lambda: router.log().count("GET /metrics") >= scrapes + 3, timeout=30)
        assert "HTTP Request" not in bridge.log()
        assert bridge.log().count("/metrics") == mentions, bridge.log()
    finally:
        for tool in (worker, bridge):
            if tool is not None:
                tool.stop()
        router.stop()
    for log in (worker.log(), bridge.log() if bridge else ""):
        assert "Authorization Violation" not in log and "Traceback" not in log


def _control_count(router: RouterProcess, outcome: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{router.port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    line = f'kv_router_nats_control_messages_total{{outcome="{outcome}"}} '
    return sum(float(row[len(line) :]) for row in text.splitlines() if row.startswith(line))


def test_a_block_size_mismatch_is_said_once_by_the_router_and_loudly_by_the_worker(
    tmp_path: Path, runtime_env: dict[str, str]
) -> None:
    router = RouterProcess(tmp_path, "--embedded-nats-port", str(free_port()), env=runtime_env)  # block size 16
    router.start()
    worker: ToolProcess | None = None
    bridge: ToolProcess | None = None
    try:
        # The mock worker (64-token blocks) is refused: it exits, naming the router's block size.
        worker = ToolProcess(tmp_path, runtime_env, "--worker-id", "61")
        assert worker.process.wait(60) == 2, worker.log()
        assert (
            "the router refused this worker: worker 61 uses block size 64, router 16. Start it with --block-size 16"
        ) in worker.log()
        # A bridge keeps heartbeating its engine's registration: refused at every beat, said once on each side.
        bridge = ToolProcess(tmp_path, runtime_env, "--worker-id", "62", "--zmq-endpoint",
                             f"tcp://127.0.0.1:{free_port()}", "--block-size", "32", command="bridge")  # fmt: skip
        until(lambda: _control_count(router, "rejected_block_size_mismatch") >= 6, timeout=60)
        assert "a router refused worker 62: worker 62 uses block size 32, router 16" in bridge.log()
        assert bridge.log().count("a router refused worker 62") == 1
        assert router.get("/v1/workers")["workers"] == []
    finally:
        for tool in (worker, bridge):
            if tool is not None:
                tool.stop()
        router.stop()
    log = router.log()
    assert log.count("worker 61 uses block size 64, router 16: registration refused") == 1, log
    assert log.count("worker 62 uses block size 32, router 16: registration refused") == 1, log
    assert "registered from its heartbeat" not in log

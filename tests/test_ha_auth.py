"""Replica sync and durable events against a real nats-server that demands credentials: a token,
a user and password, and TLS with a CA made by openssl on loopback (skipped without openssl).

Per mode: two ``kv-router serve --replica-sync --durable-events`` processes share a booking, and one
killed with SIGKILL comes back with the other's index from snapshot and stream.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from indexer.hashing import compute_block_hashes, compute_sequence_hashes
from router.event_plane.connection import NatsOptions, connect
from router.event_plane.embedded_server import find_nats_server, free_port
from router.event_plane.publisher import KvEventPublisher
from router.types import WorkerConfig
from tests.router_processes import RouterProcess
from tests.test_ha_durable import canonical
from tests.waiting import until

pytestmark = pytest.mark.slow

PROMPT = list(range(1, 65))


@dataclass
class SecuredNats:
    url: str
    options: NatsOptions
    router_flags: list[str]


def _make_certs(directory: Path) -> tuple[Path, Path, Path]:
    ca_key, ca, key, csr, cert = (directory / n for n in ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem"))
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run = lambda *args: subprocess.run(["openssl", *args], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "1",
        "-subj", "/CN=kv-router test CA")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial", "-out", str(cert),
        "-days", "1", "-extfile", str(ext))  # fmt: skip
    return ca, cert, key


@pytest.fixture(params=["token", "user_password", "tls"])
def secured_nats(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SecuredNats]:
    port = free_port()
    store = tmp_path / "js"
    args = [find_nats_server(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)]
    url = f"nats://127.0.0.1:{port}"
    if request.param == "token":
        args += ["--auth", "s3cret-token"]
        options = NatsOptions(url, token="s3cret-token")
        flags = ["--nats-token", "s3cret-token"]
    elif request.param == "user_password":
        args += ["--user", "router", "--pass", "pa55word"]
        options = NatsOptions(url, user="router", password="pa55word")
        flags = ["--nats-user", "router", "--nats-password", "pa55word"]
    else:
        if shutil.which("openssl") is None:
            pytest.skip("openssl is needed to make the test certificates")
        ca, cert, key = _make_certs(tmp_path)
        args += ["--tls", "--tlscert", str(cert), "--tlskey", str(key)]
        url = f"tls://127.0.0.1:{port}"
        options = NatsOptions(url, tls_ca_file=str(ca))
        flags = ["--nats-tls-ca-file", str(ca)]
    log_path = tmp_path / "nats-server.log"
    with log_path.open("wb") as log:  # a file, not a pipe nobody drains
        server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log)
    try:
        until(lambda: b"Server is ready" in log_path.read_bytes(), 30, "nats-server is ready")
        yield SecuredNats(url, options, ["--nats-url", url, *flags])
    finally:
        server.terminate()
        server.wait(10)


async def _publish(options: NatsOptions) -> None:
    nc = await connect(options)
    publisher = KvEventPublisher(nc, WorkerConfig(worker_id=5, block_size=16))
    local = compute_block_hashes(PROMPT, 16)
    await publisher.stored(list(zip(compute_sequence_hashes(local), local, strict=True)))
    await nc.flush()
    await nc.close()


def active_requests(router: RouterProcess) -> list[int]:
    return [load["active_requests"] for load in router.post("/v1/potential_loads", {"tokens": PROMPT})[1]["loads"]]


def test_both_modes_work_with_nats_credentials(secured_nats: SecuredNats, tmp_path: Path) -> None:
    flags = [*secured_nats.router_flags, "--replica-sync", "--durable-events", "--snapshot-every-secs", "0.5"]
    a = RouterProcess(tmp_path, *flags, "--router-name", "a").start()
    b = RouterProcess(tmp_path, *flags, "--router-name", "b").start()
    try:
        assert a.post("/v1/workers", {"worker_id": 5})[0] == 201
        until(lambda: len(b.get("/v1/workers")["workers"]) == 1, 30, "the worker reaches b through the registry")
        asyncio.run(_publish(secured_nats.options))
        until(lambda: len(canonical(b.get("/v1/dump"))) == 4, 30, "b indexes the worker's blocks from the stream")
        assert a.post("/v1/new", {"tokens": PROMPT, "request_id": "shared"})[0] == 200
        until(lambda: active_requests(b) == [1], 30, "b sees a's booking")
        assert b.post("/v1/mark_free", {"request_id": "shared"})[0] == 200

        until(lambda: canonical(a.get("/v1/dump")) == canonical(b.get("/v1/dump")), 30, "a indexed the blocks too")
        until(a.snapshot_covers_applied, 30, "a writes a snapshot of the index it has applied")
        a.kill9()
        a = RouterProcess(tmp_path, *a.args[5:], port=a.port).start()
        assert canonical(a.get("/v1/dump")) == canonical(b.get("/v1/dump"))
        assert active_requests(a) == [0]
    finally:
        a.stop()
        b.stop()

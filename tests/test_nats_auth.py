"""The event plane's NATS credentials (user / password, token, TLS with a client certificate) against
a real nats-server started with that authentication, through the service's own connection path
(`api.plane_lifecycle.PlaneLifecycle`); and the embedded nats-server listening on loopback only.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import os
import re
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from api.config import EventPlaneConfig
from api.plane_lifecycle import PlaneLifecycle, embedded_nats
from mocker.wire import generate_subject, reply_prefix, reset_subject
from router.config import RouterConfig
from router.event_plane.connection import NatsOptions, connect
from router.event_plane.embedded_server import find_nats_server, free_port
from router.event_plane.publisher import KvEventPublisher, open_registry
from router.event_plane.subjects import Subjects
from router.kv_router import KvRouter
from router.types import WorkerConfig
from tests.waiting import accepting, eventually, until


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _certificates(directory: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, both signed by the CA."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kv-router test CA")])

    def build(subject: str, key: ec.EllipticCurvePrivateKey, issuer_key: ec.EllipticCurvePrivateKey, ca: bool) -> Any:
        builder = (
            x509.CertificateBuilder()
            .subject_name(ca_name if ca else x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
            )
        return builder.sign(issuer_key, hashes.SHA256())

    files: dict[str, Path] = {}
    files["ca"] = directory / "ca.crt"
    files["ca"].write_bytes(build("", ca_key, ca_key, True).public_bytes(serialization.Encoding.PEM))
    for name in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        files[name] = directory / f"{name}.crt"
        files[name].write_bytes(build(name, key, ca_key, False).public_bytes(serialization.Encoding.PEM))
        files[f"{name}_key"] = directory / f"{name}.key"
        files[f"{name}_key"].write_bytes(_pem_key(key))
    return files


@contextmanager
def nats_with(directory: Path, auth: str) -> Iterator[str]:
    """A real nats-server with JetStream on a free loopback port, configured with ``auth`` (config
    file syntax); yields its URL."""
    port = free_port()
    config = directory / "nats.conf"
    config.write_text(f'listen: "127.0.0.1:{port}"\njetstream {{ store_dir: "{directory / "js"}" }}\n{auth}\n')
    with subprocess.Popen([find_nats_server(), "-c", str(config)], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE) as process:  # fmt: skip
        try:
            until(lambda: accepting(port) or process.poll() is not None, timeout=30)
            assert process.poll() is None, process.communicate(timeout=5)[1].decode()[-1000:]
            yield f"nats://127.0.0.1:{port}"
        finally:
            process.terminate()
            process.wait(10)
            assert process.stderr is not None
            process.stderr.close()


async def _plane_round_trip(config: EventPlaneConfig) -> None:
    """The service's event plane connects with ``config``, opens the registry and registers a worker."""
    router = KvRouter(RouterConfig())
    lifecycle = PlaneLifecycle(router, config)
    running = asyncio.create_task(lifecycle.run())
    try:
        plane = await asyncio.wait_for(lifecycle.started(), 20)
        await plane.register(WorkerConfig(worker_id=41))
        assert router.has_worker(41)
        assert plane.nc.is_connected
        # Let the registry watch take the registration's echo first: stopping the plane while that
        # echo is being delivered can hang (nats-py's watcher under asyncio.wait_for loses the
        # cancellation; left to the event plane's owners). The watch is ordered: once it has applied
        # a put made after the registration, it has taken the echo (a slept 0.5 s may not be enough).
        registry = await open_registry(plane.nc, plane.subjects)
        await registry.put("42", msgspec.json.encode(WorkerConfig(worker_id=42)))
        await eventually(lambda: router.has_worker(42), 30, "the registry watch takes a later put")
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await lifecycle.stop()


def _refused(url: str, **credentials: str) -> None:
    """The server refuses a client with these credentials (none, or wrong ones): spoken in NATS's
    text protocol, since a refused nats-py client leaves its socket to the garbage collector."""
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        assert raw.recv(4096).startswith(b"INFO ")
        options = {"verbose": False, "pedantic": False, "protocol": 1, **credentials}
        raw.sendall(b"CONNECT " + json.dumps(options).encode() + b"\r\nPING\r\n")
        answer = raw.recv(4096)
    assert answer.startswith(b"-ERR 'Authorization Violation'"), answer


def _run(coroutine: Any) -> None:
    asyncio.run(coroutine)


def test_user_and_password(tmp_path: Path) -> None:
    with nats_with(tmp_path, 'authorization { user: "router", password: "pw-123" }') as url:
        _run(_plane_round_trip(EventPlaneConfig(nats_url=url, nats_user="router", nats_password="pw-123")))
        _refused(url)
        _refused(url, user="router", **{"pass": "wrong"})


def test_token(tmp_path: Path) -> None:
    with nats_with(tmp_path, 'authorization { token: "nats-token-9" }') as url:
        _run(_plane_round_trip(EventPlaneConfig(nats_url=url, nats_token="nats-token-9")))
        _refused(url)
        _refused(url, auth_token="other")


# nats-py upgrades a plain connection to TLS and leaves the plain transport for the garbage collector,
# which warns about it once the loop is closed: the library's, not the service's, so ignored here only.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_tls_with_a_client_certificate(tmp_path: Path) -> None:
    files = _certificates(tmp_path)
    tls = (f'tls {{ cert_file: "{files["server"]}", key_file: "{files["server_key"]}", '
           f'ca_file: "{files["ca"]}", verify: true }}')  # fmt: skip
    with nats_with(tmp_path, tls) as url:
        config = EventPlaneConfig(
            nats_url=url.replace("nats://", "tls://"),
            nats_tls_ca_file=str(files["ca"]),
            nats_tls_cert_file=str(files["client"]),
            nats_tls_key_file=str(files["client_key"]),
        )
        _run(_plane_round_trip(config))
        # The server demands TLS and a client certificate of everyone (a nats-py client without them
        # fails the handshake, and leaks its socket doing so: the INFO line says it instead).
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as plain:
            info = plain.recv(4096)
        assert b'"tls_required":true' in info and b'"tls_verify":true' in info


def _listening_addresses(pid: int) -> set[tuple[str, int]]:
    """The (address, port) of every TCP socket process ``pid`` listens on (IPv4 and IPv6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, size in (("tcp", 4), ("tcp6", 16)):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            address, port = local.split(":")
            raw = bytes.fromhex(address)
            # /proc prints each 32-bit word in host (little-endian) order.
            ordered = b"".join(raw[i : i + 4][::-1] for i in range(0, size, 4))
            found.add((str(ipaddress.ip_address(ordered)), int(port, 16)))
    return found


def _pid_listening_on(port: int) -> int:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            command = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if command and command[0].endswith(b"nats-server") and str(port).encode() in command:
            return int(entry)
    raise AssertionError(f"no nats-server process for port {port}")


def test_embedded_nats_listens_on_loopback_only(tmp_path: Path) -> None:
    port = free_port()
    config = EventPlaneConfig(embedded_nats_port=port, nats_connection_file=str(tmp_path / "nats.json"))
    with embedded_nats(config) as (used, _):
        assert used.nats_url == f"nats://127.0.0.1:{port}"
        addresses = _listening_addresses(_pid_listening_on(port))
    assert addresses == {("127.0.0.1", port)}  # no other interface, no monitoring or cluster port


SECURITY_MD = Path(__file__).resolve().parent.parent / "docs" / "security.md"


def _documented_worker_permissions() -> tuple[str, dict[str, set[str]], dict[str, set[str]]]:
    """docs/security.md's ``accounts`` block (its passwords filled in), and its worker's permissions
    there and in the nsc example (``publish`` / ``subscribe`` -> subjects)."""
    text = SECURITY_MD.read_text()
    block = text[text.index("# nats.conf:") :]
    block = block[: block.index("```")]
    accounts = block[block.index("accounts {") :]
    accounts = accounts.replace("$ROUTER_PASSWORD", '"router-pw"').replace("$WORKER_PASSWORD", '"worker-pw"')
    in_conf = {
        kind: set(json.loads("[" + re.search(kind + r": \[([^\]]*)\]", accounts, re.S)[1] + "]"))  # type: ignore[index]
        for kind in ("publish", "subscribe")
    }
    nsc = {
        kind: set(re.search(f"--allow-{flag} '([^']*)'", text)[1].split(","))  # type: ignore[index]
        for kind, flag in (("publish", "pub"), ("subscribe", "sub"))
    }
    return accounts, in_conf, nsc


def _allows(patterns: set[str], subject: str) -> bool:
    """Whether NATS's wildcards (``*`` one token, ``>`` the rest) in ``patterns`` match ``subject``."""

    def matches(pattern: str) -> bool:
        wanted, tokens = pattern.split("."), subject.split(".")
        for index, token in enumerate(wanted):
            if token == ">":
                return len(tokens) > index
            if index >= len(tokens) or token not in ("*", tokens[index]):
                return False
        return len(tokens) == len(wanted)

    return any(matches(pattern) for pattern in patterns)


def test_the_documented_worker_permissions_let_workers_hear_a_refusal_and_serve_mock_requests(tmp_path: Path) -> None:
    """docs/security.md's worker user: the nsc example grants what the config grants; a mock worker's
    subjects and a router's refusal are allowed; and, on a real nats-server with that config, a worker
    whose block size the router refuses hears why (a bridge's alert, a mock worker's exit, rest on it)."""
    accounts, in_conf, nsc = _documented_worker_permissions()
    assert nsc == in_conf
    subjects = Subjects()
    for subject in (
        subjects.resync(9),
        subjects.refused(9),
        generate_subject("default", 9),
        reset_subject("default", 9),
    ):
        assert _allows(in_conf["subscribe"], subject), subject
    for subject in (subjects.events(9), subjects.heartbeat(9), reply_prefix("default", "client") + ".1"):
        assert _allows(in_conf["publish"], subject), subject

    async def refused_worker(url: str) -> None:
        router = KvRouter(RouterConfig(block_size=16))
        lifecycle = PlaneLifecycle(
            router, EventPlaneConfig(nats_url=url, nats_user="router", nats_password="router-pw")
        )
        running = asyncio.create_task(lifecycle.run())
        try:
            await asyncio.wait_for(lifecycle.started(), 20)
            nc = await connect(NatsOptions(url, user="worker", password="worker-pw"))
            publisher = KvEventPublisher(nc, WorkerConfig(worker_id=9, block_size=64))
            try:
                await publisher.start()
                await asyncio.wait_for(publisher.refused.wait(), 20)
            finally:
                await publisher.stop()
                await nc.close()
            assert not router.has_worker(9)
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await lifecycle.stop()

    with nats_with(tmp_path, accounts) as url:
        _run(refused_worker(url))

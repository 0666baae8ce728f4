"""HTTPS (``--ssl-certfile`` / ``--ssl-keyfile``) on a real ``kv-router serve`` process, with a
self-signed certificate made here: the hot routes (answered inside the HTTP protocol, under TLS),
FastAPI's routes, the API token over TLS, and refusals of clients that do not trust it or speak
plain HTTP.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.router_processes import RouterProcess, kv_router_command
from tests.test_api_support import prompt, stored_event


def self_signed(directory: Path, name: str = "kv-router-test") -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, valid for a day, and its key (PEM files)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / f"{name}.crt", directory / f"{name}.key"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_file, key_file


def _https(
    context: ssl.SSLContext, port: int, path: str, body: object | None = None, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"https://127.0.0.1:{port}{path}", data, headers or {})
    if data is not None:
        request.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=5, context=context) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.mark.parametrize("fast_protocol", [True, False], ids=["protocol", "asgi"])
def test_https_serves_every_path_and_refuses_untrusting_clients(tmp_path: Path, fast_protocol: bool) -> None:
    cert, key = self_signed(tmp_path)
    trusting = ssl.create_default_context(cafile=str(cert))
    flags = ["--no-embedded-nats", "--log-level", "warning", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
             "--api-token", "tls-token", "--fast-protocol" if fast_protocol else "--no-fast-protocol"]  # fmt: skip
    with RouterProcess(tmp_path, *flags, ready_path="/healthz", ssl_context=trusting) as service:
        port = service.port
        auth = {"authorization": "Bearer tls-token"}
        tokens = prompt(7, 64)
        assert _https(trusting, port, "/v1/workers", {"worker_id": 3})[0] == 401
        assert _https(trusting, port, "/v1/workers", {"worker_id": 3}, auth)[0] == 201
        assert json.loads(_https(trusting, port, "/v1/events", stored_event(3, tokens), auth)[1])["applied"] == 1
        status, body = _https(trusting, port, "/v1/new", {"tokens": tokens, "request_id": "t1"})
        assert status == 200 and json.loads(body)["overlap_blocks"] == 4
        assert _https(trusting, port, "/v1/mark_free", {"request_id": "t1"})[0] == 200
        # A client that does not trust the certificate, and one that speaks plain HTTP, get nothing.
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            _https(ssl.create_default_context(), port, "/healthz")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as plain:
            plain.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answer = plain.recv(65536)
        assert b'{"status":"ok"}' not in answer


def test_tls_settings_are_checked_before_serving(tmp_path: Path) -> None:
    cert, _ = self_signed(tmp_path)
    for extra in (["--ssl-certfile", str(cert)], ["--ssl-certfile", str(cert), "--ssl-keyfile", str(tmp_path / "no")]):
        done = subprocess.run([*kv_router_command(), "serve", "--no-embedded-nats", *extra], capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.splitlines()) == 1 and "ssl_" in done.stderr


def test_a_certificate_and_key_that_are_not_a_pair_are_refused_at_start_naming_the_setting(tmp_path: Path) -> None:
    """Each was a traceback once serving started (uvicorn's SSLError, "PEM lib" or KEY_VALUES_MISMATCH,
    naming no setting) and, for NATS, an SSLError at every connection attempt, retried for ever; a key
    without its certificate was never read, and NATS went out without TLS."""
    cert, key = self_signed(tmp_path, "one")
    _, other_key = self_signed(tmp_path, "two")
    encrypted = tmp_path / "encrypted.key"
    loaded = serialization.load_pem_private_key(key.read_bytes(), None)
    encrypted.write_bytes(loaded.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.BestAvailableEncryption(b"secret")))  # fmt: skip
    nats = ["--nats-url", "nats://127.0.0.1:1"]
    cases = [
        (["--ssl-certfile", str(cert), "--ssl-keyfile", str(other_key)],
         f"ssl_certfile: {cert} and {other_key} are not a PEM certificate and its private key (KEY_VALUES_MISMATCH)"),
        (["--ssl-certfile", str(key), "--ssl-keyfile", str(cert)], f"ssl_certfile: {key} and {cert} are not a PEM"),
        (["--ssl-certfile", str(cert), "--ssl-keyfile", str(encrypted)],
         f"ssl_certfile: the private key in {encrypted} is encrypted: give an unencrypted one"),
        ([*nats, "--nats-tls-cert-file", str(cert)],
         f"nats_tls_cert_file: {cert} and its private key are not a PEM certificate and its private key"),
        ([*nats, "--nats-tls-key-file", str(key)],
         "nats_tls_key_file: is the key of a client certificate: give nats_tls_cert_file too"),
    ]  # fmt: skip
    for extra, says in cases:
        done = subprocess.run([*kv_router_command(), "serve", "--no-embedded-nats", *extra], capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.splitlines()) == 1 and says in done.stderr, done.stderr
    for extra, says in [
        (["--nats-tls-cert-file", str(cert)], f"kv-router bridge: nats_tls_cert_file: {cert} and its private key are"),
        (["--nats-tls-key-file", str(key)], "nats_tls_key_file is the key of a client certificate"),
    ]:
        bridge = [*kv_router_command(), "bridge", "--worker-id", "1", "--zmq-endpoint", "tcp://127.0.0.1:5557"]
        done = subprocess.run([*bridge, *nats, *extra], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.splitlines()) == 1 and says in done.stderr, done.stderr
    # A pair that is one still serves (here the certificate's file holds the key too).
    both = tmp_path / "both.pem"
    both.write_bytes(cert.read_bytes() + key.read_bytes())
    with RouterProcess(tmp_path, "--no-embedded-nats", "--ssl-certfile", str(both), "--ssl-keyfile", str(key),
                       ready_path="/healthz", ssl_context=ssl.create_default_context(cafile=str(cert))):  # fmt: skip
        pass

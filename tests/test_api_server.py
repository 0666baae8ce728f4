"""The service as a real process on loopback: ``kv-router serve`` under uvicorn, JSON logs, graceful
SIGTERM with a request in flight; the Dockerfile's structure (stages, layers, labels), and its
entrypoint and health check run outside a container. The image itself is built and run with podman
by `.ci/image_test.py` in CI.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

import pytest

from router.event_plane.embedded_server import EmbeddedNats, free_port
from tests.router_processes import ROOT, SCRIPT, RouterProcess
from tests.test_api_support import prompt, stored_event
from tests.waiting import until

# After its graceful shutdown uvicorn re-raises the signal it caught, so the parent sees "terminated
# by SIGTERM" as for any process that honours it; older uvicorn releases exit 0 instead.
_CLEAN_EXIT = (0, -signal.SIGTERM)


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _post(port: int, path: str, body: object) -> tuple[int, bytes]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=5) as reply:
        return reply.status, reply.read()


def test_serve_logs_json_and_finishes_in_flight_requests_on_sigterm(tmp_path: Path) -> None:
    with RouterProcess(tmp_path, "--log-format", "json", "--access-log", ready_path="/healthz") as service:
        port, process = service.port, service.process
        assert process is not None
        assert _post(port, "/v1/workers", {"worker_id": 1})[0] == 201
        assert _post(port, "/v1/new", {"tokens": prompt(0, 32)})[0] == 200  # answered inside the protocol
        tokens = prompt(0, 64)
        body = json.dumps(stored_event(1, tokens)).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            head = (
                f"POST /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            conn.sendall(head + body[:20])  # the request is in flight ...
            # A round trip on another connection: the server's loop has read what was sent before it.
            assert _get(port, "/healthz")[0] == 200
            process.send_signal(signal.SIGTERM)  # ... when the shutdown starts
            until(lambda: "Shutting down" in service.log(), what="the shutdown starts")
            conn.sendall(body[20:])
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                chunk = conn.recv(65536)
                if not chunk:
                    break
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 200"), reply
        assert b'"applied":1' in reply
        assert process.wait(30) in _CLEAN_EXIT
    records = [json.loads(line) for line in service.log().splitlines() if line.strip()]
    assert records, "no log records"
    assert all({"time", "level", "logger", "message"} <= set(record) for record in records)
    messages = [record["message"] for record in records]
    assert any("Shutting down" in message for message in messages)
    assert any("Finished server process" in message for message in messages)
    # uvicorn's ANSI-coloured copy of its messages stays out of the JSON.
    assert not any("color_message" in record or "\x1b" in record["message"] for record in records)
    joined = next(record for record in records if record["message"].startswith("worker 1 joined"))
    assert (joined["level"], joined["logger"], joined["worker_id"]) == ("info", "router.kv_router", 1)
    # Access lines, from uvicorn and from the in-protocol fast path alike, carry their parts as fields.
    access = {record["path"]: record for record in records if record["logger"] == "uvicorn.access"}
    for path in ("/v1/workers", "/v1/new", "/healthz"):
        assert {"client", "method", "http_version", "status"} <= set(access[path]), access.get(path)
    assert (access["/v1/workers"]["method"], access["/v1/workers"]["status"]) == ("POST", 201)
    assert (access["/v1/new"]["method"], access["/v1/new"]["status"]) == ("POST", 200)
    assert access["/healthz"]["client"].startswith("127.0.0.1:")


def _dockerfile() -> dict[str, list[str]]:
    """Instruction keyword -> its arguments, in order, over the whole file."""
    instructions: dict[str, list[str]] = {}
    for stage in _stages().values():
        for keyword, lines in stage.items():
            instructions.setdefault(keyword, []).extend(lines)
    return instructions


def _stages() -> dict[str, dict[str, list[str]]]:
    """Build stage name ("" before the first FROM) -> instruction keyword -> arguments, in order."""
    stages: dict[str, dict[str, list[str]]] = {"": {}}
    current = stages[""]
    logical = ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        logical += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            keyword, _, rest = logical.strip().partition(" ")
            if keyword.upper() == "FROM":
                current = stages.setdefault(rest.split()[-1], {})
            current.setdefault(keyword.upper(), []).append(rest.strip())
            logical = ""
    return stages


def _args(lines: list[str]) -> dict[str, str]:
    return dict(line.partition("=")[::2] for line in lines)


def _env_of(instructions: dict[str, list[str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in instructions["ENV"]:
        for pair in shlex.split(line):
            key, _, value = pair.partition("=")
            env[key] = value
    return env


def test_dockerfile_is_multistage_pinned_non_root_with_healthcheck() -> None:
    stages = _stages()
    # The base images are build arguments whose defaults are pinned slim images.
    bases = _args(stages[""]["ARG"])
    assert {"BASE_IMAGE", "BUILD_IMAGE"} <= set(bases)
    assert all("-slim" in bases[name] and re.search(r":\d+\.\d+\.\d+-", bases[name]) for name in bases)
    # The default target (the last stage) is the service alone, an unprivileged user, on the base.
    runtime = stages[list(stages)[-1]]
    assert list(stages)[-1] == "runtime" and runtime["FROM"] == ["base AS runtime"]
    assert runtime["USER"][-1] not in ("root", "0")
    assert stages["base"]["FROM"] == ["${BASE_IMAGE} AS base"] and stages["build"]["FROM"] == [
        "${BUILD_IMAGE} AS build"
    ]
    base = stages["base"]
    env = _env_of(base)
    assert base["EXPOSE"] == [env["KV_ROUTER_PORT"]]
    # Inside a container the embedded NATS would be on the container's loopback: an external one is the default.
    assert env["KV_ROUTER_NATS_URL"] == "nats://nats:4222"
    assert json.loads(base["ENTRYPOINT"][-1]) == ["kv-router", "serve"]
    assert "/healthz" in base["HEALTHCHECK"][-1]
    # The console script the entrypoint names is the one the package declares.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["kv-router"] == "api.cli:main"
    labels = " ".join(base["LABEL"])
    for key in ("title", "description", "version", "revision", "licenses", "base.name"):
        assert f"org.opencontainers.image.{key}=" in labels
    assert _args(base["ARG"])["VERSION"] == pyproject["project"]["version"]


def test_dockerfile_installs_dependencies_before_the_code_and_the_simulator_apart() -> None:
    """The dependency layer depends on pyproject.toml alone; the runtime image has the service's
    packages and not the simulator, which only the `simulator` target adds."""
    stages = _stages()
    build = stages["build"]
    copies = [line.split()[0] for line in build["COPY"]]
    assert copies[0] == "pyproject.toml"
    # First the compiler for the C accelerators (this stage only), then the dependencies.
    compiler, dependencies = build["RUN"][:2]
    assert "apt-get install" in compiler and " gcc " in compiler
    assert "--requirement" in dependencies and "['project']['dependencies']" in dependencies
    assert not any("gcc" in run for stage in ("base", "runtime", "simulator") for run in stages[stage].get("RUN", []))
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = {pattern.rstrip("*") for pattern in setup["include"]}
    assert set(copies[2:]) == packages - {"mocker"}
    assert [line.split()[0] for line in stages["build-simulator"]["COPY"]] == ["mocker"]
    assert stages["runtime"]["COPY"] == ["--from=build /opt/kv-router /opt/kv-router"]
    assert stages["simulator"]["COPY"] == ["--from=build-simulator /opt/kv-router /opt/kv-router"]
    allowed = {line.strip()[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip().startswith("!")}  # fmt: skip
    assert packages <= allowed, f".dockerignore keeps {sorted(packages - allowed)} out of the build context"


@pytest.mark.skipif(not SCRIPT.exists(), reason="the kv-router console script is not installed in this environment")
def test_dockerfile_entrypoint_and_healthcheck_work_outside_docker(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    """Without a container engine: the image's entrypoint, run with the image's environment (on
    loopback instead of 0.0.0.0, with the test's NATS for the image's external one), serves, and the
    image's HEALTHCHECK command passes. `.ci/image_test.py` runs the real image in CI."""
    docker = _stages()["base"]
    port = free_port()
    env = {**os.environ, **_env_of(docker), "KV_ROUTER_HOST": "127.0.0.1", "KV_ROUTER_PORT": str(port),
           "KV_ROUTER_NATS_URL": nats_server.url}  # fmt: skip
    entrypoint = json.loads(docker["ENTRYPOINT"][-1])
    healthcheck = docker["HEALTHCHECK"][-1]
    check = json.loads(healthcheck[healthcheck.index("CMD") + 3 :].strip())
    assert check[0] == "/opt/kv-router/bin/python"  # the image's virtualenv; here, this interpreter
    executable = str(SCRIPT.with_name(entrypoint[0]))
    with RouterProcess(
        tmp_path, port=port, env=env, argv=[executable, *entrypoint[1:]], ready_path="/healthz"
    ) as service:
        process = service.process
        assert process is not None
        assert subprocess.run([sys.executable, *check[1:]], env=env, timeout=30).returncode == 0
        assert _get(port, "/readyz")[0] == 200
        assert b"kv_router_nats_connected 1.0" in _get(port, "/metrics")[1]
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) in _CLEAN_EXIT
    # With nothing listening, the same health check fails.
    assert subprocess.run([sys.executable, *check[1:]], env=env, timeout=30, capture_output=True).returncode != 0

"""Build the repository's Dockerfile with podman and run the image as a deployment would.

What it checks, against an external nats-server on loopback (the image's default points at an
external NATS): the container starts and answers /healthz, registers a worker whose KV events arrive
over HTTP, routes one request to it, exposes its metrics, exits cleanly on SIGTERM; the image holds no
wheel, no pip and no simulator; an edit to the code reuses the cached dependency layer. It prints the
image size (recorded in docs/deploy.md).

No Docker engine or registry is reachable here, so the base image is made locally: Debian bookworm
with python3 by ``mmdebstrap --variant=minbase``, imported into podman (kept between local runs). The
build runs with ``--isolation chroot --network host`` and the host's CA certificates mounted read-only,
so that pip reaches the package index; the container runs under runc with a containers.conf that
works on this machine's hybrid cgroups (crun refuses them).

Usage: ``python .ci/image_test.py`` (needs root, podman, runc and mmdebstrap: ``.ci/run`` installs
them). Without podman it says so and exits 0, unless CI=true.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

from router.event_plane.embedded_server import free_port

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "localhost/kv-router:ci"
SIMULATOR_IMAGE = "localhost/kv-router-simulator:ci"
RUNTIME_BASE = "localhost/kv-router-ci-base:bookworm"
BUILD_BASE = "localhost/kv-router-ci-build-base:bookworm"
CONTAINERS_CONF = """\
[containers]
default_ulimits = []
[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
"""
# Documentation and translations are not needed in a service image (licences are kept).
DPKG_OPTIONS = [
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
]
# In the build base only: `python3 -m venv` needs them (ensurepip's pip and setuptools wheels).
BUILD_ONLY_PACKAGES = ["python3-venv", "python3.11-venv", "python3-pip-whl", "python3-setuptools-whl"]
BLOCK_SIZE = 16


def main() -> int:
    if shutil.which("podman") is None:
        if os.environ.get("CI") == "true":
            print("image test: podman is not installed (.ci/run installs it)", file=sys.stderr)
            return 1
        print("image test: skipped, podman is not installed (apt-get install podman runc mmdebstrap)")
        return 0
    with tempfile.TemporaryDirectory(prefix="kv-router-image-") as work_dir:
        work = Path(work_dir)
        (work / "containers.conf").write_text(CONTAINERS_CONF)
        os.environ["CONTAINERS_CONF"] = str(work / "containers.conf")
        started = time.monotonic()
        make_base_images(work)
        print(f"image test: base images ready in {time.monotonic() - started:.0f} s", flush=True)
        started = time.monotonic()
        build(ROOT, work)
        print(f"image test: image built in {time.monotonic() - started:.0f} s", flush=True)
        build(ROOT, work, target="simulator", tag=SIMULATOR_IMAGE)
        check_image_contents()
        check_dependency_layer_cached(work)
        run_against_external_nats(work)
        size = json.loads(podman("image", "inspect", IMAGE, capture=True))[0]["Size"]
        base = json.loads(podman("image", "inspect", RUNTIME_BASE, capture=True))[0]["Size"]
        # The untagged images this run's rebuilds left (the edited copy's stages), not kept.
        podman("image", "prune", "--force", capture=True)
        print(f"image test: passed; image size {size / 1e6:.1f} MB ({(size - base) / 1e6:.1f} MB over the base)")
    return 0


def podman(*args: str, capture: bool = False, check: bool = True) -> str:
    result = subprocess.run(["podman", *args], check=check, text=True, stdout=subprocess.PIPE if capture else None)
    return result.stdout if capture else ""


def make_base_images(work: Path) -> None:
    """Debian bookworm minbase with python3 (runtime) and with python3-venv too (build stage)."""
    if all(subprocess.run(["podman", "image", "exists", name]).returncode == 0 for name in (RUNTIME_BASE, BUILD_BASE)):
        return
    rootfs = work / "rootfs"
    options = [f"--dpkgopt={option}" for option in DPKG_OPTIONS]
    subprocess.run(
        ["mmdebstrap", "--variant=minbase", "--mode=root", "--include=python3,python3-venv", "--quiet", *options,
         "bookworm", str(rootfs)],
        check=True,
    )  # fmt: skip
    import_rootfs(rootfs, BUILD_BASE)
    subprocess.run(["chroot", str(rootfs), "dpkg", "--purge", *BUILD_ONLY_PACKAGES], check=True)
    import_rootfs(rootfs, RUNTIME_BASE)
    shutil.rmtree(rootfs)


def import_rootfs(rootfs: Path, name: str) -> None:
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    subprocess.run(["podman", "import", "--quiet", "-", name], stdin=tar.stdout, check=True, stdout=subprocess.DEVNULL)
    assert tar.wait() == 0


def build(context: Path, work: Path, *, target: str = "runtime", tag: str = IMAGE) -> str:
    """Build one target of the Dockerfile; returns podman's output (its tail is printed)."""
    pip_conf = work / "pip.conf"
    pip_conf.write_text("[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n")
    revision = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True, capture_output=True).stdout.strip()
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    result = subprocess.run(
        ["podman", "build", "--isolation", "chroot", "--network", "host", "--format", "docker",
         "--volume", "/etc/ssl/certs:/etc/ssl/certs:ro", "--volume", f"{pip_conf}:/etc/pip.conf:ro",
         "--build-arg", f"BASE_IMAGE={RUNTIME_BASE}", "--build-arg", f"BUILD_IMAGE={BUILD_BASE}",
         "--build-arg", f"VERSION={version}", "--build-arg", f"REVISION={revision or 'unknown'}",
         "--target", target, "--tag", tag, str(context)],
        text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    print(result.stdout[-3000:], flush=True)
    assert result.returncode == 0, "podman build failed"
    return result.stdout


def in_image(*command: str, user: str | None = None) -> subprocess.CompletedProcess[str]:
    as_user = ["--user", user] if user is not None else []
    return subprocess.run(
        ["podman", "--runtime", "runc", "run", "--rm", "--network", "none", "--no-healthcheck", *as_user,
         "--entrypoint", command[0], IMAGE, *command[1:]],
        text=True, capture_output=True,
    )  # fmt: skip


def check_image_contents() -> None:
    wheels = in_image("find", "/", "-xdev", "-name", "*.whl", user="0")
    assert wheels.returncode == 0 and wheels.stdout == "", f"wheels in the image: {wheels.stdout} {wheels.stderr}"
    probe = (
        "import importlib.util as u, shutil; "
        "print([m for m in ('mocker', 'pip', 'setuptools') if u.find_spec(m)] + [shutil.which('nats-server')])"
    )
    found = in_image("python", "-c", probe)
    assert found.stdout.strip() == "[None]", f"the image ships {found.stdout.strip()} {found.stderr}"
    # The build stage compiled the C accelerators; the runtime image runs them, without a compiler.
    native = in_image("python", "-c", "from api.native import active_accelerators; print(active_accelerators())")
    assert native.stdout.strip() == "['indexer', 'events', 'router', 'api']", f"accelerators: {native}"
    compilers = in_image("sh", "-c", "command -v gcc cc || true")
    assert compilers.stdout.strip() == "", f"a compiler in the runtime image: {compilers.stdout}"
    user = in_image("id", "-u")
    assert user.stdout.strip() == "10001", user
    labels = json.loads(podman("image", "inspect", IMAGE, capture=True))[0]["Labels"]
    for key in ("title", "version", "revision", "licenses", "base.name"):
        assert labels.get(f"org.opencontainers.image.{key}"), f"label org.opencontainers.image.{key} missing"


def check_dependency_layer_cached(work: Path) -> None:
    """A code edit rebuilds the service's layer only: the dependency install comes from the cache."""
    context = work / "edited"
    shutil.copytree(ROOT, context, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info"))
    with (context / "api" / "__init__.py").open("a") as init:
        init.write(f"# an edit made at {time.time_ns()}\n")  # new each run, never in the cache
    output = build(context, work, target="build", tag=f"{IMAGE}-build-stage")
    steps = output.split("STEP ")
    dependency_step = next(step for step in steps if "--requirement /tmp/requirements.txt" in step)
    service_step = next(step for step in steps if "install --no-deps ." in step)
    assert "Using cache" in dependency_step, "the dependency layer was rebuilt after a code edit"
    assert "Using cache" not in service_step, "the service layer was not rebuilt after a code edit"


def http(port: int, path: str, body: object | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def run_against_external_nats(work: Path) -> None:
    # The test helpers compute Dynamo's block hashes for the event (the repository's own venv).
    sys.path.insert(0, str(ROOT))
    from tests.test_api_support import prompt, stored_event

    nats_binary = Path(sys.executable).with_name("nats-server")
    nats_port, http_port = free_port(), free_port()
    nats = subprocess.Popen(
        [str(nats_binary), "-a", "127.0.0.1", "-p", str(nats_port), "-js", "-sd", str(work / "jetstream")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    name = f"kv-router-image-test-{os.getpid()}"
    worker = f"kv-router-image-test-worker-{os.getpid()}"
    try:
        podman(
            "--runtime", "runc", "run", "--detach", "--name", name, "--network", "host", "--read-only",
            "--env", "KV_ROUTER_HOST=127.0.0.1", "--env", f"KV_ROUTER_PORT={http_port}",
            "--env", f"KV_ROUTER_NATS_URL=nats://127.0.0.1:{nats_port}", "--env", f"KV_ROUTER_BLOCK_SIZE={BLOCK_SIZE}",
            "--env", "KV_ROUTER_PROXY=true",  # as deploy/compose.yaml runs it
            # podman runs health checks from systemd timers, absent here: the check is run below instead.
            "--no-healthcheck",
            IMAGE,
            capture=True,
        )  # fmt: skip
        wait_healthy(name, http_port)
        # The image's HEALTHCHECK command, run in the container as the engine would.
        health = json.loads(podman("image", "inspect", IMAGE, capture=True))[0]["Healthcheck"]["Test"]
        assert health[0] == "CMD", health
        podman("exec", name, *health[1:], capture=True)
        tokens = prompt(0, 4 * BLOCK_SIZE)
        assert http(http_port, "/v1/workers", {"worker_id": 7})[0] == 201
        assert http(http_port, "/v1/workers", {"worker_id": 8})[0] == 201
        status, body = http(http_port, "/v1/events", stored_event(8, tokens))
        assert status == 200 and json.loads(body)["applied"] == 1, body
        status, body = http(http_port, "/v1/new", {"tokens": tokens, "request_id": "image-test"})
        decision = json.loads(body)
        assert status == 200 and (decision["worker_id"], decision["overlap_blocks"]) == (8, 4), body
        metrics = http(http_port, "/metrics")[1].decode()
        assert "kv_router_nats_connected 1.0" in metrics, "the router is not connected to the external NATS"
        assert 'kv_router_decisions_total{dp_rank="0",worker_id="8"} 1.0' in metrics
        # A simulated engine from the simulator image joins over NATS with its OpenAI API registered
        # under the URL it is reached at, and the router's proxy sends it a completion, as in
        # deploy/compose.yaml (which names it by its service; ``localhost`` here, on the host network).
        worker_port = free_port()
        podman(
            "--runtime", "runc", "run", "--detach", "--name", worker, "--network", "host", "--no-healthcheck",
            "--entrypoint", "kv-router", SIMULATOR_IMAGE,
            "mock-worker", "--nats-url", f"nats://127.0.0.1:{nats_port}", "--worker-id", "5",
            "--block-size", str(BLOCK_SIZE), "--http-port", str(worker_port), "--http-host", "127.0.0.1",
            "--http-url", f"http://localhost:{worker_port}",
            capture=True,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while 5 not in [w["config"]["worker_id"] for w in json.loads(http(http_port, "/v1/workers")[1])["workers"]]:
            assert time.monotonic() < deadline, f"the mock worker did not join: {logs(worker)}"
            time.sleep(0.2)
        # Workers 7 and 8 have no URL: the proxy's one candidate is the mock worker.
        status, body = http(http_port, "/v1/completions", {"model": "mock-model", "prompt": tokens, "max_tokens": 2})
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2, (body, logs(worker))
        podman("kill", "--signal", "TERM", worker, capture=True)
        check_http_only()
        podman("kill", "--signal", "TERM", name, capture=True)
        code = int(podman("wait", name, capture=True).strip())
        # As PID 1 the re-raised SIGTERM finds no handler and the process exits 0; elsewhere 128 + 15.
        assert code in (0, 143), f"exit code {code} after SIGTERM: {logs(name)}"
        records = [json.loads(line) for line in logs(name).splitlines() if line.startswith("{")]
        messages = [record["message"] for record in records]
        assert any("Finished server process" in message for message in messages), messages
        assert not any(record["level"] in ("error", "critical") for record in records), records
        print(f"image test: /healthz, a decision over HTTP and SIGTERM (exit {code}) passed", flush=True)
    finally:
        podman("rm", "--force", "--ignore", name, worker, capture=True, check=False)
        nats.terminate()
        nats.wait(10)


def check_http_only() -> None:
    """Without NATS (events over HTTP only), as deploy/README.md documents for a one-container trial."""
    port = free_port()
    name = f"kv-router-image-test-http-{os.getpid()}"
    try:
        podman(
            "--runtime", "runc", "run", "--detach", "--name", name, "--network", "host", "--read-only",
            "--no-healthcheck", "--env", "KV_ROUTER_HOST=127.0.0.1", "--env", f"KV_ROUTER_PORT={port}",
            "--env", "KV_ROUTER_NATS_URL=none", "--env", "KV_ROUTER_EMBEDDED_NATS=false", IMAGE,
            capture=True,
        )  # fmt: skip
        wait_healthy(name, port)
        assert "kv_router_nats_connected" not in http(port, "/metrics")[1].decode()
    finally:
        podman("rm", "--force", "--ignore", name, capture=True, check=False)


def wait_healthy(name: str, port: int) -> None:
    """Until the container's /healthz answers 200; fails at once when the container stops."""
    deadline = time.monotonic() + 60
    while True:
        try:
            if http(port, "/healthz")[0] == 200:
                return
        except OSError:
            pass
        state = podman("inspect", "--format", "{{.State.Status}}", name, capture=True).strip()
        assert state == "running" and time.monotonic() < deadline, f"container {state}: {logs(name)}"
        time.sleep(0.2)


def logs(name: str) -> str:
    result = subprocess.run(["podman", "logs", name], text=True, capture_output=True)
    return result.stdout + result.stderr


if __name__ == "__main__":
    sys.exit(main())

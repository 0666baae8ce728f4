"""The README is tested: its shell and Python blocks run in order, as a new user would paste them, against
real processes (``kv-router serve``, ``kv-router mock-worker``, the real ``openai`` client), and the
outputs it quotes after ``->`` are checked.

Only ports and paths change: 8000, 4222, 9001 and 9002 become free loopback ports (the service's
defaults through ``KV_ROUTER_PORT`` / ``KV_ROUTER_EMBEDDED_NATS_PORT``, the same substitution for the
commands that leave them out), ``/tmp`` a temporary directory, ``XDG_RUNTIME_DIR`` a private one.
What the test's own installed checkout has already done is left out: creating the venv, activating
it, ``pip install`` and running this very suite. Blocks that need what CI's ordinary lane lacks are
marked in the README's source, ``<!-- readme-test: skip (why) -->`` before a block or
``<!-- readme-test: skip section (why) -->`` under a heading; the test prints them with their reasons.
A section marked ``<!-- readme-test: real-engines -->`` (its walkthrough starts real vLLM engines) is
left to the real-engine lane, which runs its blocks the same way
(``tests/real_engines/test_readme_walkthrough.py``); ``skip`` markers inside it still hold.

A quoted output (``#   -> LINE`` and ``#      LINE`` after it) must match lines of the command's
output in order; in a quoted line ``...`` stands for anything and ``<id>`` for a number, and a line of
only ``...`` for any number of lines. A Python block's line is quoted as printed: what follows the one
space after ``->``, leading spaces included. A server started in the background is waited for as a reader
would wait for it: the service until ``/readyz`` answers (and lists the workers of its ``--engine``
flags), a mock worker or a bridge until the service lists it, a vLLM engine until it serves its model.
A shell variable set by a block (``NAME=VALUE``) holds for the blocks after it, as in one terminal.
Every process is stopped by its PID (and what it started, by its process group).

The commands quoted in ``docs/`` that take under a minute (``DOCS_RUN``: the online replay walkthrough)
run the same way, from a temporary directory, with ``$TRACES`` the reference traces; the others are
listed with why they are not run (``DOCS_SKIP``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from router.event_plane.embedded_server import free_port
from tests.waiting import until

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

pytestmark = pytest.mark.slow

_SKIP = re.compile(r"<!--\s*readme-test:\s*skip(?P<section>\s+section)?\s*\((?P<why>[^)]*)\)\s*-->")
_REAL_ENGINES = re.compile(r"<!--\s*readme-test:\s*real-engines\s*-->")
REAL_ENGINES_LANE = (
    "starts real vLLM engines: run by the real-engine lane (tests/real_engines/test_readme_walkthrough.py)"
)
_FENCE = re.compile(r"^```(\w*)\s*$")
# What the installed checkout running this test has done already (and the suite itself).
_SETUP = re.compile(r"^(python3? -m venv \S+|\. \S+/bin/activate|pip install .*|python -m pytest.*)$")


@dataclass
class Block:
    language: str
    code: str
    line: int  # 1-based line of the fence in README.md
    heading: str
    skip: str | None = None
    real_engines: bool = False  # in a section left to the real-engine lane (and not skipped there)


@dataclass
class Command:
    text: str
    expected: list[str] = field(default_factory=list)


def readme_blocks(text: str) -> list[Block]:
    """The fenced shell and Python blocks of ``text`` in order, with their skip reasons."""
    blocks: list[Block] = []
    lines = text.splitlines()
    heading, section_skip, block_skip = "", None, None
    section_real_engines = False
    level = 0
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("#") and not line.startswith("#!"):
            hashes = len(line) - len(line.lstrip("#"))
            if (section_skip is None and not section_real_engines) or hashes <= level:
                heading, level, section_skip = line.lstrip("# ").strip(), hashes, None
                section_real_engines = False
        elif _REAL_ENGINES.search(line):
            section_real_engines = True
        elif marker := _SKIP.search(line):
            if marker.group("section"):
                section_skip = marker.group("why")
            else:
                block_skip = marker.group("why")
        elif fence := _FENCE.match(line.strip()):
            indent = len(line) - len(line.lstrip())
            start = index
            body: list[str] = []
            index += 1
            while index < len(lines) and lines[index].strip() != "```":
                body.append(lines[index][indent:])
                index += 1
            language = fence.group(1)
            if language in ("bash", "sh", "shell", "python", ""):
                skip = section_skip or block_skip
                lane = skip is None and section_real_engines
                kind = "python" if language == "python" else "bash" if language else "text"
                block = Block(kind, "\n".join(body), start + 1, heading, REAL_ENGINES_LANE if lane else skip, lane)
                blocks.append(block)
            block_skip = None
        index += 1
    return blocks


def shell_commands(code: str) -> list[Command]:
    """A shell block's commands (continuation lines joined), each with the output quoted after it."""
    commands: list[Command] = []
    pending = ""
    quoting = False
    for raw in code.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#"):
            quoted = re.match(r"#\s*->\s?(.*)$", stripped)
            if quoted and commands:
                commands[-1].expected.append(quoted.group(1).strip())
                quoting = True
            elif quoting and commands and re.match(r"#\s{4,}\S", stripped):
                commands[-1].expected.append(stripped[1:].strip())
            else:
                quoting = False
            continue
        quoting = False
        if not stripped:
            continue
        pending += raw.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        commands.append(Command(pending.strip()))
        pending = ""
    return commands


def python_expected(code: str) -> list[str]:
    """The output a Python block quotes (``#   -> ...`` lines at its end), each as printed: what follows
    the one space after ``->``, leading spaces included."""
    return [m.group(1).rstrip() for m in re.finditer(r"^#\s*->\s?(.*)$", code, re.MULTILINE)]


def output_matches(expected: list[str], output: str, *, leading_spaces: bool = False) -> bool:
    """Every quoted line matches an output line, in order (see the module); ``leading_spaces``: a quoted
    line's leading spaces must be the output line's (a Python block's, quoted as printed)."""
    lines = [line.rstrip("\r") for line in output.splitlines()]
    position = 0
    for pattern in expected:
        if pattern == "...":
            continue
        regex = re.compile(
            "".join(
                r".*?" if part == "..." else r"\w+" if part == "<id>" else re.escape(part)
                for part in re.split(r"(\.\.\.|<id>)", pattern)
            ),
            re.IGNORECASE,
        )
        while position < len(lines) and not regex.fullmatch(
            lines[position].rstrip() if leading_spaces else lines[position].strip()
        ):
            position += 1
        if position == len(lines):
            return False
        position += 1
    return True


def _strip_comment(command: str) -> str:
    """The command without a trailing ``# comment`` (a ``#`` after a space, outside quotes)."""
    quote = ""
    for index, char in enumerate(command):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and index > 0 and command[index - 1].isspace():
            return command[:index].rstrip()
    return command


class Walkthrough:
    """The processes and substitutions of one run of the README."""

    def __init__(
        self, tmp_path: Path, cwd: Path = ROOT, ports: tuple[int, ...] = (8000, 4222, 9001, 9002),
        bound_on_all: tuple[int, ...] = (), wait_for_events: bool = False,
    ) -> None:  # fmt: skip
        """``ports``: the README's ports, each replaced by a free one; ``bound_on_all``: those of them a
        server binds on every interface (vLLM's event sockets), free there. ``wait_for_events``: after a
        completion, wait for the engine's KV events to reach the index before the next command, as the
        seconds a reader takes between two pasted lines do (a real engine publishes them after it
        answered)."""
        self.cwd = cwd
        self.wait_for_events = wait_for_events
        self.ports = {port: free_port("0.0.0.0" if port in bound_on_all else "127.0.0.1") for port in ports}
        self.tmp = tmp_path
        runtime = tmp_path / "xdg"
        runtime.mkdir(mode=0o700)
        bin_dir = str(Path(sys.executable).parent)
        self.env = {
            **os.environ,
            "PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "XDG_RUNTIME_DIR": str(runtime),
            "KV_ROUTER_PORT": str(self.ports[8000]),
            "KV_ROUTER_EMBEDDED_NATS_PORT": str(self.ports[4222]),
        }
        for name in ("KV_ROUTER_NATS_CONNECTION_FILE", "KV_ROUTER_CONFIG", "KV_ROUTER_NATS_URL"):
            self.env.pop(name, None)
        self.processes: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        self.service: subprocess.Popen[bytes] | None = None
        self.starting: list[tuple[str, subprocess.Popen[bytes], Path]] = []  # not waited for yet
        self.ran: list[str] = []
        self.skipped: list[str] = []

    def substitute(self, text: str) -> str:
        # In one pass: one port after another, a free port drawn equal to a README port still to come
        # (5558 -> 5568, then 5568 -> 27645) sent two engines to one address.
        ports = re.compile(r"(?<![\d.])(" + "|".join(map(str, self.ports)) + r")(?!\d)")
        text = ports.sub(lambda found: str(self.ports[int(found.group(1))]), text)
        return re.sub(r"(?<![\w/])/tmp(?=/|\b)", str(self.tmp), text)

    # ------------------------------------------------------------------ processes
    def start(self, command: str) -> None:
        log = self.tmp / f"process-{len(self.processes)}.log"
        if command.startswith("kv-router serve") and self.service is not None:
            self.stop(self.service)  # the README: "instead of the plain `kv-router serve` above"
        assignments, program = re.fullmatch(r"((?:\w+=\S*\s+)*)(.*)", command, re.DOTALL).groups()  # type: ignore[union-attr]
        with log.open("wb") as out:  # its own process group: what it starts is stopped with it
            process = subprocess.Popen(["bash", "-c", f"{assignments}exec {program}"], env=self.env, cwd=self.cwd,
                                       stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True)  # fmt: skip
        self.processes.append((command, process, log))
        self.starting.append((command, process, log))
        if command.startswith("kv-router serve"):
            self.service = process

    def settle(self) -> None:
        """Wait for what was started in the background, as a reader does before the next command: the
        processes of a pasted block start back to back (a worker's NATS may not be up yet)."""
        for command, process, log in self.starting:
            if "vllm.entrypoints.openai.api_server" in command:
                port = int(re.search(r"--port (\d+)", command).group(1))  # type: ignore[union-attr]
                until(lambda: self._engine_serving(process, log, port), timeout=420)  # noqa: B023 - called at once
        for command, process, log in self.starting:
            if command.startswith("kv-router serve"):
                until(lambda: self._ready(process, log), timeout=90)  # noqa: B023 - called at once
                engines = {int(worker) for worker in re.findall(r"--engine (\d+)=", command)}
                until(lambda: self._proxied(process, log, engines), timeout=60)  # noqa: B023 - called at once
            elif command.startswith("kv-router mock-worker"):
                until(lambda: self._worker_listed(process, log), timeout=90)  # noqa: B023 - called at once
            elif command.startswith("kv-router bridge"):
                worker = int(re.search(r"--worker-id (\d+)", command).group(1))  # type: ignore[union-attr]
                until(lambda: self._proxied(process, log, {worker}), timeout=90)  # noqa: B023 - called at once
        self.starting = []

    def _engine_serving(self, process: subprocess.Popen[bytes], log: Path, port: int) -> bool:
        assert process.poll() is None, f"the engine exited: {log.read_text(errors='replace')[-3000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as reply:
                return bool(json.loads(reply.read())["data"])
        except OSError:
            return False

    def _proxied(self, process: subprocess.Popen[bytes], log: Path, workers: set[int]) -> bool:
        """The service lists ``workers`` with their OpenAI URL (the proxy can send to them)."""
        assert process.poll() is None, f"`{process.args}` exited: {log.read_text(errors='replace')[-3000:]}"
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ports[8000]}/v1/workers", timeout=5) as reply:
            listed = json.loads(reply.read())["workers"]
        return workers <= {worker["config"]["worker_id"] for worker in listed if worker["config"].get("url")}

    def _ready(self, process: subprocess.Popen[bytes], log: Path) -> bool:
        assert process.poll() is None, f"the service exited: {log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ports[8000]}/readyz", timeout=2) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def _worker_listed(self, process: subprocess.Popen[bytes], log: Path) -> bool:
        text = log.read_text(errors="replace")
        assert process.poll() is None, f"the mock worker exited: {text[-3000:]}"
        started = re.search(r"mock worker (\d+) on ", text)
        if started is None:
            return False
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ports[8000]}/v1/workers", timeout=5) as reply:
            workers = json.loads(reply.read())["workers"]
        return any(worker["config"]["worker_id"] == int(started.group(1)) for worker in workers)

    def stop(self, process: subprocess.Popen[bytes]) -> None:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        with contextlib.suppress(ProcessLookupError):  # what outlived it in its group (an engine's core)
            os.killpg(process.pid, signal.SIGKILL)

    def stop_all(self) -> None:
        for _, process, _ in reversed(self.processes):
            self.stop(process)

    def logs(self) -> str:
        return "\n".join(
            f"--- {command}\n{log.read_text(errors='replace')[-2000:]}" for command, _, log in self.processes
        )

    # ------------------------------------------------------------------ blocks
    def run_shell(self, block: Block) -> None:
        for command in shell_commands(block.code):
            text = self.substitute(command.text)
            parts = [part.strip() for part in _strip_comment(text).split("&&")]
            kept = [part for part in parts if not _SETUP.match(part)]
            if not kept:
                self.skipped.append(f"README.md:{block.line} `{command.text}`: set-up this checkout has done")
                continue
            line = " && ".join(kept)
            background = line.endswith("&") or line == "kv-router serve"
            if background:
                self.start(line.rstrip("&").strip())
                self.ran.append(command.text)
                continue
            if (assigned := re.match(r"(\w+)=", line)) and len(shlex.split(line)) == 1:  # kept, as a shell does
                self.env[assigned.group(1)] = self._evaluate(line, assigned.group(1))
                self.ran.append(command.text)
                continue
            self.settle()
            indexed = self._index_nodes() if self.wait_for_events and "/v1/completions" in line else None
            script = "set -o pipefail\n" + line
            done = subprocess.run(["bash", "-c", script], env=self.env, cwd=self.cwd, capture_output=True, text=True,
                                  timeout=60)  # fmt: skip
            assert done.returncode == 0, (
                f"README.md:{block.line} `{command.text}` exited {done.returncode}:\n{done.stdout}{done.stderr}\n"
                + self.logs()
            )
            if command.expected:
                assert output_matches(command.expected, done.stdout), (
                    f"README.md:{block.line} `{command.text}` printed:\n{done.stdout}\nnot what the README quotes:\n"
                    + "\n".join(command.expected)
                )
            if indexed is not None:
                self._wait_for_index_change(indexed)
            self.ran.append(command.text)
        self.settle()

    def _index_nodes(self) -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ports[8000]}/metrics", timeout=5) as reply:
            found = re.search(rb"^kv_router_index_nodes (\S+)$", reply.read(), re.MULTILINE)
        assert found is not None, "the service's /metrics has no kv_router_index_nodes"
        return int(float(found.group(1)))

    def _wait_for_index_change(self, before: int, timeout: float = 5.0) -> None:
        """Until the index's node count moves from ``before``, at most ``timeout`` seconds: a request
        whose blocks were all cached already stores nothing new, and then the wait runs out quietly."""
        deadline = time.monotonic() + timeout
        while self._index_nodes() == before and time.monotonic() < deadline:
            time.sleep(0.05)

    def _evaluate(self, assignment: str, name: str) -> str:
        done = subprocess.run(["bash", "-c", f'{assignment}\nprintf %s "${name}"'], env=self.env, cwd=self.cwd,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, f"`{assignment}` exited {done.returncode}:\n{done.stderr}"
        return done.stdout

    def run_python(self, block: Block) -> None:
        done = subprocess.run([sys.executable, "-"], input=self.substitute(block.code), env=self.env, cwd=self.cwd,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, f"README.md:{block.line}'s Python exited {done.returncode}:\n{done.stderr}"
        expected = python_expected(block.code)
        if expected:
            assert output_matches(expected, done.stdout, leading_spaces=True), (
                f"README.md:{block.line}'s Python printed:\n{done.stdout}\nnot:\n" + "\n".join(expected)
            )
        self.ran.append(f"README.md:{block.line} (Python)")


def test_the_readme_walkthroughs_work_as_written(tmp_path: Path) -> None:
    walk = Walkthrough(tmp_path)
    blocks = readme_blocks(README.read_text())
    try:
        for block in blocks:
            if block.skip is not None:
                walk.skipped.append(f"README.md:{block.line} ({block.heading}): {block.skip}")
                continue
            if block.language == "python":
                walk.run_python(block)
            elif block.language == "bash":
                walk.run_shell(block)
    finally:
        walk.stop_all()
    print("README blocks skipped, and why:\n  " + "\n  ".join(walk.skipped))
    for _, _, log in walk.processes:
        text = log.read_text(errors="replace")
        assert "Traceback" not in text, text[-3000:]
    # What must have run: the walkthroughs a newcomer starts with.
    ran = "\n".join(walk.ran)
    for needed in ("kv-router config show", "/v1/new", "kv-router serve --proxy", "mock-worker --http-port 9002",
                   "/v1/completions", "(Python)", "/v1/overlap"):  # fmt: skip
        assert needed in ran, needed
    assert all(reason.split(": ", 1)[1].strip() for reason in walk.skipped)


def test_skip_markers_need_a_reason_and_cover_only_what_ci_cannot_run() -> None:
    blocks = readme_blocks(README.read_text())
    skipped = [block for block in blocks if block.skip is not None]
    assert skipped and all(block.skip for block in skipped)
    assert {block.heading for block in skipped} <= {"Put kv-router in front of vLLM / SGLang", "Docker"}
    assert any(block.language == "python" and block.skip is None for block in blocks)
    # The vLLM walkthrough is left to the real-engine lane, and only it.
    lane = [block for block in blocks if block.real_engines]
    assert lane and {block.heading for block in lane} == {"Put kv-router in front of vLLM / SGLang"}
    assert all(block.skip == REAL_ENGINES_LANE for block in lane)


def test_ports_are_substituted_at_once_even_when_a_free_one_is_another_readme_port(tmp_path: Path) -> None:
    """A free port drawn equal to a README port still to be replaced must stay as drawn: replaced one
    after the other, 5558 -> 5568 -> 27645 once gave two engines one replay address."""
    walk = Walkthrough(tmp_path, ports=(8000, 4222, 5557, 5558, 5567, 5568))
    walk.ports = {8000: 21460, 4222: 4223, 5557: 2034, 5558: 5568, 5567: 8661, 5568: 27645}
    command = '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://127.0.0.1:5558"; tcp://*:5567 tcp://127.0.0.1:5568'
    assert walk.substitute(command) == (
        '"endpoint": "tcp://*:2034", "replay_endpoint": "tcp://127.0.0.1:5568"; tcp://*:8661 tcp://127.0.0.1:27645'
    )
    assert walk.substitute("port 15557, v1.5557 and /tmp/x") == f"port 15557, v1.5557 and {tmp_path}/x"


def test_quoted_output_matching() -> None:
    output = 'HTTP/1.1 200 OK\r\nx-kv-router-worker: 42\r\n\r\n{"a":1,"choices":[{"text":" w1"}]}\n'
    assert output_matches(["HTTP/1.1 200 OK", "...", "x-kv-router-worker: <id>", '{"a":1,...:" w1"}]}'], output)
    assert not output_matches(["x-kv-router-worker: <id>", "HTTP/1.1 200 OK"], output)  # order counts
    assert not output_matches(['{"a":2,...}'], output)
    # A Python block's output as printed: a leading space is part of it.
    assert python_expected('print(" w1 w2")\n#   ->  w1 w2\n') == [" w1 w2"]
    assert output_matches([" w1 w2"], " w1 w2\n", leading_spaces=True)
    assert not output_matches(["w1 w2"], " w1 w2\n", leading_spaces=True)


# Commands quoted in docs/ that take under a minute here, by the first line of their block; run as the
# README's are. The other blocks are configuration, formulas, or need what CI lacks (listed when skipped).
DOCS_RUN = {"kv-router serve --block-size 64 --port 8000 &          # with its embedded NATS"}
DOCS_SKIP = {  # the first key found in a block gives its reason
    "nsc ": "needs nsc and your NATS operator",
    "nats.conf": "a nats-server configuration, not a command",
    "--nats-url tls://nats.internal": "needs your NATS cluster with TLS and accounts",
    "kv-router replay": "replays whole traces with every router: minutes (the figures' own command)",
    "kv-router tune my_trace": "needs your trace",
    "cost(w)": "a formula",
    "prefill_ms": "a formula",
    "bench/replay_calibration.py": "a benchmark: minutes",
    "docker ": "needs Docker or podman and root: covered by .ci/image_test.py",
}


def test_docs_commands_under_a_minute_work_as_written(tmp_path: Path, shared_dir: Path) -> None:
    walk = Walkthrough(tmp_path, cwd=tmp_path)
    walk.env["TRACES"] = str(shared_dir / "traces")
    ran: list[str] = []
    try:
        for page in sorted((ROOT / "docs").glob("*.md")):
            for block in readme_blocks(page.read_text()):
                first = next((line for line in block.code.splitlines() if line.strip()), "")
                where = f"{page.relative_to(ROOT)}:{block.line}"
                if first.strip() in DOCS_RUN:
                    walk.run_shell(block)
                    ran.append(where)
                    continue
                why = next((why for key, why in DOCS_SKIP.items() if key in block.code), "not classified here")
                walk.skipped.append(f"{where} ({block.heading}): {why}")
    finally:
        walk.stop_all()
    print("docs blocks skipped, and why:\n  " + "\n  ".join(walk.skipped))
    assert ran, "no docs command ran"
    for report in ("reports/online", "reports/offline"):  # the online replay walkthrough's two reports
        assert any((tmp_path / report).iterdir()), report

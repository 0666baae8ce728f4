#!/usr/bin/env python3
"""kv-router's proxy side by side with the gateways teams would otherwise run (issue 25): router CPU per
request and the latency each adds, in one run, in front of the same stub backends.

Gateways: ``kv-router serve --proxy`` (this tree; the stubs registered over ``POST /v1/workers``, without
KV events: text routed by its bytes, as the proxy does for such a fleet), ``kv-router-tokenizing`` (the
same with ``--no-proxy-route-text-by-bytes``: text tokenized locally from the mock engine's
``tokenizer.json``, one token a character, as for a fleet with KV events), sglang-router and
vllm-router (Rust, installed from PyPI by this script into a venv of their own, ``--gateway-venv``,
reused when present), each with its ``cache_aware`` policy. Both Rust gateways try to fetch a tokenizer
from a model hub: they run with ``HF_HUB_OFFLINE=1`` and an unreachable ``HF_ENDPOINT``. Two references
(`bench/python_floor.py`), not gateways: ``python-floor``, the least a Python proxy on uvloop and httptools
does (forward, hand the answer's bytes back), and ``python-floor-routed``, that with kv-router's decision,
prefill mark and free per request; kv-router's ratio to them splits its CPU into what any Python proxy
pays, what routing adds, and what its own proxy work costs.

Backends: two stub OpenAI servers (``python bench/gateway_bench.py stub --port N``, a bare asyncio
HTTP/1.1 server) answering ``/v1/completions`` and ``/v1/chat/completions`` with a fixed completion of
``--max-tokens`` tokens, as JSON or as SSE (one event a token, each its own write, then ``[DONE]``),
plus ``/v1/models`` and ``/health``. Their CPU per request is printed beside the gateways': it is what a
request costs a backend directly, so it shows they are not the bottleneck, and it shows what each
gateway makes a backend do beyond that. Each gateway's turn (and each direct run) gets two stubs of its
own: on stubs vllm-router had used, the next gateway, whichever it was, cost 10-30 % more a request.

Cells: concurrency (``--concurrency``, default 1 and 64) x JSON / SSE x text prompts (``--prompt-tokens``
characters of random words) / token-id prompts (``--prompt-tokens`` ids), ``/v1/completions``, each
request's prompt its own (or drawn from ``--distinct-prompts`` of them: repeats, what a tokenizer cache
finds). Every
cell is run against a backend directly first (the floor), then through each gateway. A gateway that
refuses a cell (sglang-router answers token-id prompts with 422) is shown as refused.

Figures per cell: the gateway's CPU per request (from ``/proc``: the time on a CPU of every thread of
its process and of its descendants, over the measured requests), the backends' CPU per request, and at concurrency 1 the
p50 latency (to the last byte) minus the direct p50: the latency the gateway adds. Then kv-router's
CPU over each peer's, per cell (the target: at most 1.0x sglang-router's everywhere).

Rounds (``--rounds``, 3 by default): the whole set is measured that many times, the gateways' order
rotated each round, and every figure is the median over the rounds, a ratio the median of the rounds'
own ratios (each from one round's two measurements) with its range beside it. Two identically
configured gateways differ by up to half again on one cell of a single round on this 2-core VM; the
median of three is what the docs quote.

Placement (as ``bench/proxy_bench.py``): each gateway alone on ``--router-cpus`` (``taskset``), this load
generator and the stubs on ``--shared-cpus``.

    python bench/gateway_bench.py                                  # every gateway, every cell
    python bench/gateway_bench.py --gateways kv-router,sglang-router --concurrency 64 --rounds 1

Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.proxy_bench import MODEL, stop_process, tree_oncpu_s, tree_pids
from mocker.openai_api import write_model_files
from router.event_plane.embedded_server import free_port

PEERS = {"sglang-router": "0.3.2", "vllm-router": "0.1.17"}
OURS = {"kv-router": [], "kv-router-tokenizing": ["--no-proxy-route-text-by-bytes"]}
# References, not gateways: the least a Python proxy on uvloop and httptools does (`bench/python_floor.py`),
# and that with kv-router's decision, prefill mark and free per request.
FLOORS = {"python-floor": [], "python-floor-routed": ["--route"]}
GATEWAYS = (*OURS, *PEERS, *FLOORS)
DEFAULT_VENV = Path.home() / ".cache" / "kv-router" / "gateways"
# Where the Rust gateways would fetch a tokenizer from: nothing listens on port 9 (discard) here.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9", "TRANSFORMERS_OFFLINE": "1"}


# ---------------------------------------------------------------------------------------------------
# The stub backend


class StubRequest(msgspec.Struct):
    """The fields of a completion request the stub looks at (the rest is skipped unparsed)."""

    stream: bool = False
    max_tokens: int = 8


class StubReplies:
    """The stub's fixed answers, built once: the JSON completion and the SSE events for a path."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.models = msgspec.json.encode(
            {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "stub", "created": 0}]}
        )
        self._cache: dict[tuple[bool, int], tuple[bytes, list[bytes]]] = {}

    def completion(self, chat: bool, tokens: int) -> tuple[bytes, list[bytes]]:
        """The JSON body and the SSE events (each a complete ``data: ...`` frame, ``[DONE]`` last)."""
        key = (chat, tokens)
        if key not in self._cache:
            usage = {"prompt_tokens": 0, "completion_tokens": tokens, "total_tokens": tokens}
            if chat:
                choice: dict[str, object] = {
                    "index": 0,
                    "message": {"role": "assistant", "content": "a" * tokens},
                    "finish_reason": "length",
                }
                delta = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": "a" * tokens, "logprobs": None, "finish_reason": "length"}
                delta = "text_completion"
            kind = "chat.completion" if chat else "text_completion"
            body = msgspec.json.encode(
                {"id": "stub-1", "object": kind, "created": 0, "model": self.model, "choices": [choice], "usage": usage}
            )
            events = []
            for index in range(tokens):
                last = index == tokens - 1
                piece: dict[str, object] = (
                    {"index": 0, "delta": {"content": "a"}, "finish_reason": "length" if last else None}
                    if chat
                    else {"index": 0, "text": "a", "logprobs": None, "finish_reason": "length" if last else None}
                )
                chunk = {"id": "stub-1", "object": delta, "created": 0, "model": self.model, "choices": [piece]}
                events.append(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
            events.append(b"data: [DONE]\n\n")
            self._cache[key] = (body, events)
        return self._cache[key]


def chunk(payload: bytes) -> bytes:
    """One piece of an HTTP/1.1 chunked body."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


class StubProtocol(asyncio.Protocol):
    """HTTP/1.1 with keep-alive, bodies by Content-Length or chunked; answers as soon as a request is whole."""

    decoder = msgspec.json.Decoder(StubRequest)

    def __init__(self, replies: StubReplies) -> None:
        self.replies = replies
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (request := self._take_request()) is not None:
            self._answer(*request)

    def _take_request(self) -> tuple[str, str, bytes] | None:
        while self.buffer.startswith(b"\r\n"):  # empty lines before a request line (RFC 9112 2.2)
            del self.buffer[:2]
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return None
        head = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
        if head[0].count(" ") != 2 or head[0].startswith("PRI "):
            # Not HTTP/1.1 (a client trying HTTP/2 with prior knowledge): refused by closing, as a
            # server without HTTP/2 does.
            self.buffer.clear()
            assert self.transport is not None
            self.transport.close()
            return None
        method, target = head[0].split(" ")[:2]
        headers = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        start = end + 4
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = bytearray()
            at = start
            while True:
                size_end = self.buffer.find(b"\r\n", at)
                if size_end < 0:
                    return None
                size = int(bytes(self.buffer[at:size_end]).split(b";")[0], 16)
                if len(self.buffer) < size_end + 2 + size + 2:
                    return None
                body += self.buffer[size_end + 2 : size_end + 2 + size]
                at = size_end + 2 + size + 2
                if size == 0:
                    break
            del self.buffer[:at]
            return method, target, bytes(body)
        length = int(headers.get("content-length", "0"))
        if len(self.buffer) < start + length:
            return None
        body_bytes = bytes(self.buffer[start : start + length])
        del self.buffer[: start + length]
        return method, target, body_bytes

    def _answer(self, method: str, target: str, body: bytes) -> None:
        assert self.transport is not None
        path = target.split("?")[0]
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            try:
                request = self.decoder.decode(body)
            except msgspec.DecodeError as error:  # malformed or of the wrong shape
                self._send(400, msgspec.json.encode({"error": {"message": str(error)}}))
                return
            reply, events = self.replies.completion(path.endswith("chat/completions"), max(1, request.max_tokens))
            if not request.stream:
                self._send(200, reply)
                return
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            for event in events:  # each its own write (a segment of its own: asyncio sets TCP_NODELAY)
                self.transport.write(chunk(event))
            self.transport.write(b"0\r\n\r\n")
        elif method == "GET" and path == "/v1/models":
            self._send(200, self.replies.models)
        elif method == "GET":  # /health, /health_generate, /get_model_info, /get_server_info, ...
            self._send(200, b"{}")
        else:
            self._send(404, b'{"error":{"message":"not found"}}')

    def _send(self, status: int, body: bytes) -> None:
        assert self.transport is not None
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}[status]
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (status, reason.encode(), len(body), body)
        )


async def serve_stub(port: int, model: str) -> None:
    replies = StubReplies(model)
    server = await asyncio.get_running_loop().create_server(lambda: StubProtocol(replies), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


# ---------------------------------------------------------------------------------------------------
# The gateways


def gateway_venv(venv: Path) -> Path:
    """The venv holding the peers at their pinned versions, made (pip from PyPI) when missing or stale."""
    python = venv / "bin" / "python"
    wanted = [f"{name}=={version}" for name, version in PEERS.items()]
    if python.exists():
        listed = subprocess.run([str(python), "-m", "pip", "freeze"], capture_output=True, text=True).stdout
        if all(line in listed.splitlines() for line in wanted):
            return venv
    print(f"installing {', '.join(wanted)} into {venv}", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *wanted], check=True)
    return venv


def gateway_command(name: str, port: int, backends: list[str], venv: Path, model_dir: Path) -> list[str]:
    if name in OURS:
        # No KV events from the stubs: approximate mode (each routed prompt counts as cached on its worker).
        return [
            sys.executable, "-m", "api.cli", "serve", "--proxy", "--no-kv-events", "--no-embedded-nats",
            "--host", "127.0.0.1", "--port", str(port), "--block-size", "64", "--log-level", "warning",
            "--tokenizer", f"{MODEL}={model_dir}", *OURS[name],
        ]  # fmt: skip
    if name in FLOORS:
        floor = Path(__file__).with_name("python_floor.py")
        return [sys.executable, str(floor), "--port", str(port), *FLOORS[name], *backends]
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *backends, "--policy", "cache_aware"]
    if name == "sglang-router":
        return [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router", *common, "--log-level", "warn"]
    return [str(venv / "bin" / "vllm-router"), *common, "--log-level", "warning"]


def register_backends(url: str, backends: list[str]) -> None:
    """kv-router learns its workers over HTTP (the Rust gateways from ``--worker-urls``)."""
    import httpx

    for worker_id, backend in enumerate(backends, 1):
        worker = {"worker_id": worker_id, "block_size": 64, "leased": False, "url": backend, "models": [MODEL]}
        response = httpx.post(f"{url}/v1/workers", json=worker)
        assert response.status_code in (200, 201), (response.status_code, response.text)


def wait_answering(url: str, process: subprocess.Popen[bytes], timeout_s: float = 90.0) -> None:
    """Until a completion goes through ``url`` (the gateway is up and has found a backend)."""
    import httpx

    body = {"model": MODEL, "prompt": "warm up", "max_tokens": 1}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"process {process.pid} exited with {process.returncode} before answering")
        try:
            if httpx.post(f"{url}/v1/completions", json=body, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"no completion through {url} within {timeout_s:.0f} s")


@contextmanager
def started(command: list[str], cpus: str, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    pin = ["taskset", "-c", cpus] if cpus else []
    process = subprocess.Popen(
        [*pin, *command], stdout=subprocess.DEVNULL, env={**os.environ, **(env or {})}, cwd=Path(__file__).parents[1]
    )
    try:
        yield process
    finally:
        stop_process(process)


# ---------------------------------------------------------------------------------------------------
# The load


@dataclass(frozen=True)
class Cell:
    concurrency: int
    stream: bool
    prompt: str  # "text" or "ids"

    def __str__(self) -> str:
        return f"c={self.concurrency} {'SSE' if self.stream else 'JSON'} {self.prompt}"


@dataclass
class Result:
    latencies_s: list[float] = field(default_factory=list)
    router_cpu_s: float = 0.0
    backend_cpu_s: float = 0.0
    refused: str = ""
    wall_s: float = 0.0

    def p50(self) -> float:
        return statistics.median(self.latencies_s)


def request_bodies(
    cell: Cell, count: int, prompt_tokens: int, max_tokens: int, rng: random.Random, distinct: int = 0
) -> list[bytes]:
    """``distinct`` > 0: the prompts drawn from that many (repeated prompts: what a tokenizer cache finds)."""

    def prompt() -> object:
        if cell.prompt == "ids":
            return [rng.randrange(1, 50_000) for _ in range(prompt_tokens)]
        words: list[str] = []
        size = 0
        while size < prompt_tokens:
            words.append("".join(rng.choices(string.ascii_lowercase, k=rng.randrange(2, 9))))
            size += len(words[-1]) + 1
        return " ".join(words)[:prompt_tokens]

    pool = [prompt() for _ in range(distinct)]
    bodies = []
    for _ in range(count):
        fields = {"model": MODEL, "prompt": rng.choice(pool) if pool else prompt(), "max_tokens": max_tokens}
        bodies.append(msgspec.json.encode({**fields, "stream": cell.stream}))
    return bodies


async def run_cell(
    url: str, cell: Cell, bodies: list[bytes], cpu_of: Callable[[], tuple[float, float]], timeout_s: float
) -> Result:
    """``bodies`` through ``url``, ``cell.concurrency`` in flight; the CPU ``cpu_of`` reads (the gateway's,
    the backends') over the measured requests, after one warm-up request per connection."""
    import aiohttp

    result = Result()
    headers = {"content-type": "application/json"}
    target = f"{url}/v1/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False) as session:

        async def one(body: bytes, record: bool) -> None:
            begun = time.perf_counter()
            async with session.post(target, data=body, headers=headers) as response:
                payload = await response.read()
                if response.status != 200:
                    result.refused = f"{response.status} {payload[:120].decode(errors='replace')}"
                    return
            if cell.stream:
                assert payload.rstrip().endswith(b"data: [DONE]"), payload[-200:]
            if record:
                result.latencies_s.append(time.perf_counter() - begun)

        # One request per connection, and at least 32 in all (the first of a kind warms code paths up).
        for start in range(0, max(cell.concurrency, 32), cell.concurrency):
            await asyncio.gather(*(one(bodies[(start + i) % len(bodies)], False) for i in range(cell.concurrency)))
        if result.refused:
            return result
        queue = iter(bodies)

        async def worker() -> None:
            for body in queue:
                await one(body, True)
                if result.refused:
                    return

        before = cpu_of()
        begun = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(cell.concurrency))), timeout_s)
        after = cpu_of()
        result.wall_s = time.perf_counter() - begun
    result.router_cpu_s, result.backend_cpu_s = (a - b for a, b in zip(after, before, strict=True))
    return result


# ---------------------------------------------------------------------------------------------------
# The run


def main() -> int:
    if sys.argv[1:2] == ["stub"]:
        stub = argparse.ArgumentParser(prog="gateway_bench.py stub")
        stub.add_argument("--port", type=int, required=True)
        stub.add_argument("--model", default=MODEL)
        options = stub.parse_args(sys.argv[2:])
        asyncio.run(serve_stub(options.port, options.model))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateways", default=",".join(GATEWAYS), help=f"any of {', '.join(GATEWAYS)}")
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--forms", default="json,sse", help="json, sse")
    parser.add_argument("--prompts", default="text,ids", help="text, ids")
    parser.add_argument("--requests", type=int, default=400, help="measured requests per cell at concurrency 1")
    parser.add_argument("--requests-concurrent", type=int, default=2000, help="per cell above concurrency 1")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument(
        "--distinct-prompts", type=int, default=0, help="draw each cell's prompts from this many (0: all distinct)"
    )
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens of each answer (SSE: one event each)")
    parser.add_argument("--gateway-venv", type=Path, default=DEFAULT_VENV, help="the peers' venv (made if missing)")
    parser.add_argument("--router-cpus", default="1", help="taskset CPU list of each gateway ('' = no pinning)")
    parser.add_argument("--shared-cpus", default="0", help="CPUs of this generator and the stubs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--settle", type=float, default=3.0,
        help="seconds between a gateway's first answer and its first cell: its start-up work (first health "
        "probes, their lazy imports) stays out of the figures",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per cell")
    parser.add_argument(
        "--rounds", type=int, default=3,
        help="times the whole set is measured (the gateways' order rotated): figures are medians over them",
    )  # fmt: skip
    args = parser.parse_args()
    gateways = [name for name in args.gateways.split(",") if name]
    unknown = set(gateways) - set(GATEWAYS)
    if unknown:
        parser.error(f"unknown gateways: {', '.join(sorted(unknown))}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    cells = [
        Cell(int(c), form == "sse", prompt)
        for c in args.concurrency.split(",")
        for form in args.forms.split(",")
        for prompt in args.prompts.split(",")
    ]
    venv = gateway_venv(args.gateway_venv) if set(gateways) & set(PEERS) else args.gateway_venv
    if args.router_cpus:
        # Inherited by everything started from here but the gateways (their taskset sets their own).
        os.sched_setaffinity(0, {int(cpu) for cpu in args.shared_cpus.split(",")})
    rng = random.Random(args.seed)
    bodies = {
        cell: request_bodies(
            cell, args.requests if cell.concurrency == 1 else args.requests_concurrent, args.prompt_tokens,
            args.max_tokens, rng, args.distinct_prompts,
        )
        for cell in cells
    }  # fmt: skip
    names = ("direct", *gateways)
    results: dict[str, dict[Cell, list[Result]]] = {name: {cell: [] for cell in cells} for name in names}
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = write_model_files(Path(scratch) / "stub-model")
        for round_index in range(args.rounds):
            with stub_backends() as (backends, backends_cpu):
                for cell in cells:
                    results["direct"][cell].append(
                        asyncio.run(
                            run_cell(backends[0], cell, bodies[cell], lambda: (0.0, backends_cpu()), args.timeout)
                        )
                    )
            turn = round_index % len(gateways) if gateways else 0
            for name in gateways[turn:] + gateways[:turn]:  # no gateway always first, or last
                # Fresh backends for each gateway: one that leaves them worse off (vllm-router: the next
                # gateway's CPU per request 10-30 % higher, whichever it was) must not tax the next.
                with stub_backends() as (backends, backends_cpu):
                    port = free_port()
                    command = gateway_command(name, port, backends, venv, model_dir)
                    env = OFFLINE_ENV if name in PEERS else {}
                    with started(command, args.router_cpus, env) as gateway:
                        url = f"http://127.0.0.1:{port}"
                        if name in OURS:
                            wait_for_port(url, gateway)
                            register_backends(url, backends)
                        wait_answering(url, gateway)
                        time.sleep(args.settle)
                        pid = gateway.pid

                        def cpu(pid: int = pid, stubs_cpu: Callable[[], float] = backends_cpu) -> tuple[float, float]:
                            return tree_oncpu_s(pid), stubs_cpu()

                        for cell in cells:
                            measured = asyncio.run(run_cell(url, cell, bodies[cell], cpu, args.timeout))
                            results[name][cell].append(measured)
                        print(f"round {round_index + 1}: {name}: its process tree {tree_pids(pid)}", file=sys.stderr)
    print(report(results, cells, args))
    return 0


@contextmanager
def stub_backends() -> Iterator[tuple[list[str], Callable[[], float]]]:
    """Two stub backends started for one gateway's turn (or the direct run): their URLs, and their CPU so far."""
    with ExitStack() as stack:
        ports = [free_port(), free_port()]
        stubs = [
            stack.enter_context(started([sys.executable, __file__, "stub", "--port", str(port)], "")) for port in ports
        ]
        backends = [f"http://127.0.0.1:{port}" for port in ports]
        for stub_process, backend in zip(stubs, backends, strict=True):
            wait_answering(backend, stub_process)
        yield backends, lambda: sum(tree_oncpu_s(stub.pid) for stub in stubs)


def wait_for_port(url: str, process: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"process {process.pid} exited with {process.returncode}")
        try:
            httpx.get(f"{url}/healthz", timeout=2)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit(f"nothing listening at {url} within {timeout_s:.0f} s")


def _short(gateway: str) -> str:
    return {"kv-router-tokenizing": "tok", "python-floor": "floor", "python-floor-routed": "routed"}.get(
        gateway, gateway.split("-")[0]
    )


def _median_and_range(values: list[float], rounds: int, form: str, unit: str) -> str:
    """The median of ``values`` in ``unit``, then their range when there were several rounds."""
    text = format(statistics.median(values), form) + unit
    return text if rounds == 1 else f"{text} ({format(min(values), form)}-{format(max(values), form)})"


def report(results: dict[str, dict[Cell, list[Result]]], cells: list[Cell], args: argparse.Namespace) -> str:
    """Per cell, medians over the rounds: each gateway's CPU per request (and the backends' it caused), the
    latency it adds at concurrency 1 (against the direct run of the same round), kv-router's ratio to each
    peer (the median of the rounds' ratios, with their range)."""
    gateways = [name for name in results if name != "direct"]
    rounds = args.rounds
    lines = [
        f"/v1/completions, prompts of {args.prompt_tokens} tokens (text: as many characters, one token each for"
        f" kv-router-tokenizing's tokenizer, four a token routed by bytes"
        f"{f'; drawn from {args.distinct_prompts} distinct prompts' if args.distinct_prompts else ''}),"
        f" answers of {args.max_tokens} tokens; {args.requests} requests per c=1 cell,"
        f" {args.requests_concurrent} above; two stub backends; gateways on CPU {args.router_cpus or 'any'},"
        f" the rest on {args.shared_cpus}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores;"
        f" medians of {rounds} round{'s' if rounds > 1 else ''}{', ratios with their range' if rounds > 1 else ''}",
        "router CPU us/request (backend CPU us/request) [added p50 latency at c=1, ms]",
    ]
    width = 20 if rounds > 1 else 10
    header = f"{'cell':18} {'direct':>24}" + "".join(f" {name:>30}" for name in gateways)
    peers = [name for name in gateways if name != "kv-router"]  # kv-router-tokenizing among them
    if "kv-router" in gateways:
        header += "".join(f" {'kv/' + _short(name):>{width}}" for name in peers)
    lines.append(header)
    for cell in cells:
        direct = results["direct"][cell]
        backend = statistics.median(r.backend_cpu_s / len(r.latencies_s) for r in direct)
        row = f"{cell!s:18} {'':>5}({backend * 1e6:5.0f})"
        row += f" [p50 {statistics.median(r.p50() for r in direct) * 1e3:5.2f}]" if cell.concurrency == 1 else " " * 12
        per_round: dict[str, list[float]] = {}  # CPU per request, one per round
        for name in gateways:
            measured = results[name][cell]
            refused = next((r.refused for r in measured if r.refused), "")
            if refused:
                row += f" {'refused: ' + refused.split(' ')[0]:>30}"
                continue
            per_round[name] = [r.router_cpu_s / len(r.latencies_s) for r in measured]
            caused = statistics.median(r.backend_cpu_s / len(r.latencies_s) for r in measured)
            text = f"{statistics.median(per_round[name]) * 1e6:6.0f} ({caused * 1e6:5.0f})"
            if cell.concurrency == 1:
                added = statistics.median(r.p50() - d.p50() for r, d in zip(measured, direct, strict=True))
                text += f" [{added * 1e3:+6.3f}]"
            row += f" {text:>30}"
        if "kv-router" in per_round:
            ours = per_round["kv-router"]
            for name in peers:
                if name not in per_round:
                    row += f" {'-':>{width}}"
                    continue
                ratios = [a / b for a, b in zip(ours, per_round[name], strict=True)]
                row += f" {_median_and_range(ratios, rounds, '.2f', 'x'):>{width}}"
        lines.append(row)
    # Who was busy: a gateway near 100% of its CPU set the rate; the shared CPU holds generator and stubs.
    lines.append("requests/s (gateway's CPU busy over the cell, % of a core; stubs' busy)")
    for cell in cells:
        row = f"{cell!s:18}"
        for name in ("direct", *gateways):
            measured = [r for r in results[name][cell] if not r.refused and r.wall_s]
            if not measured:
                row += f" {'-':>26}"
                continue
            rate = statistics.median(len(r.latencies_s) / r.wall_s for r in measured)
            busy = "   -"
            if name != "direct":
                busy = f"{statistics.median(r.router_cpu_s / r.wall_s for r in measured):4.0%}"
            stubs = statistics.median(r.backend_cpu_s / r.wall_s for r in measured)
            row += f" {f'{rate:6.0f}/s ({busy}; {stubs:4.0%})':>26}"
        lines.append(row)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

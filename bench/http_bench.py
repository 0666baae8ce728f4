#!/usr/bin/env python3
"""HTTP routing decisions per second and latency: kv-router's service against NVIDIA Dynamo's
runtime-free selection service (``python -m dynamo.select_service``, ai-dynamo-runtime 1.6.1), in
the same run, on the same machine, fed the same workers, KV events and requests.

What one decision is, on each side (closed loop, ``c`` coroutines back to back, one keep-alive
connection each):

* kv-router (``--policy dynamo``, the cost function Dynamo's service runs, unless ``--policy`` names
  another): ``POST /v1/new`` (JSON ``tokens``; with ``--forms json,msgpack`` also msgpack with packed u32
  tokens), then ``POST /v1/mark_free``;
* Dynamo: ``POST /select_and_reserve`` (JSON ``token_ids``), then ``DELETE /reservations/{id}``.

Workload (seeded): 8 workers, block size 16, 32 shared documents held in full or in part by some
workers, filler chains up to ~50k cached blocks in all; each prompt's first half is a prefix of a
document (Zipf popularity), the rest is unique. kv-router learns the index from ``POST /v1/events``;
Dynamo only ingests KV events from engines over ZMQ, so fake engines publish the same blocks in
vLLM's wire format. Both indexes are checked against ground truth before measuring.

Measurement: each service runs alone on core 0 (``taskset``), this load generator on core 1. A cell
(prompt size x concurrency) ends after ``--cycles`` decisions or ``--seconds``, after a warm-up.
Each cell is run ``--repeat`` times alternating the services; the median is reported, with the
service's CPU time per decision read from ``/proc``. On a shared machine, each run of a cell first waits
(up to ``--quiet-wait`` s) until other processes use less than ``--quiet-cores``, and the CPU they used
during each cell is reported (the table's last column, the worst run of the row). Everything listens
on loopback only: Dynamo's service binds 0.0.0.0, so the whole run happens inside a private network
namespace (``unshare -n``) whose only interface is ``lo``.

    python bench/http_bench.py                       # the full grid, ~3 minutes
    python bench/http_bench.py --prompt-tokens 1024 --concurrency 8 --seconds 2
    git archive main | tar -x -C /tmp/base           # before / after in one run: main's service beside this one
    python bench/http_bench.py --forms json,msgpack,base:json,base:msgpack --baseline /tmp/base
    python bench/http_bench.py --forms json,json-p2 --concurrency 64   # also --processes 2 against --threads 2

Several cores: a ``-pN`` form is ``kv-router serve --processes N`` (N replicas on one port, synced over
a nats-server this run starts; each service its own NATS namespace; the KV events published on NATS so
every replica indexes them, each checked on fresh connections), measured against Dynamo's service with
``--threads N``; both on ``--multi-cpus`` (all of a 2-core machine, shared with this load generator),
the nats-server's CPU counted as kv-router's.

The table also gives the load generator's own CPU per cell (in cores): near 1.0 it, not the service,
would be the bottleneck.

Needs: ai-dynamo-runtime==1.6.1 and pyzmq in the same environment as kv-router.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec

from indexer.hashing import compute_block_hashes, compute_sequence_hashes
from router.event_plane.connection import connect as nats_connect
from router.event_plane.embedded_server import EmbeddedNats
from router.event_plane.subjects import Subjects

NETNS_MARK = "KV_ROUTER_HTTP_BENCH_NETNS"
BLOCK_SIZE = 16
# Fresh connections a service of several processes is checked on (the kernel spreads them: 16 in a
# row all on one of two children happens once in 32k starts).
VERIFY_CONNECTIONS = 16


def log(*parts: object) -> None:
    print(f"[http_bench {time.strftime('%H:%M:%S')}]", *parts, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- workload
@dataclass
class Chain:
    """A root-anchored run of full blocks: tokens, Dynamo local hashes, sequence (engine) hashes."""

    tokens: list[int]
    local: list[int]
    seq: list[int]

    @staticmethod
    def random(rng: random.Random, blocks: int, prefix: Chain | None = None, keep: int = 0) -> Chain:
        head = prefix.tokens[: keep * BLOCK_SIZE] if prefix else []
        tokens = head + [rng.randrange(1, 150_000) for _ in range(blocks * BLOCK_SIZE - len(head))]
        local = compute_block_hashes(tokens, BLOCK_SIZE)
        return Chain(tokens, local, compute_sequence_hashes(local))


@dataclass
class Prompt:
    tokens: list[int]
    best_overlap: int  # the most blocks any worker holds of it (ground truth)
    json_tokens: bytes = b""
    packed: bytes = b""


@dataclass
class Workload:
    workers: list[int]
    holdings: dict[int, list[tuple[Chain, int]]]  # worker -> (chain, blocks of it held)
    sentinels: dict[int, Chain]  # per worker, stored last: the index barrier
    prompts: dict[int, list[Prompt]]
    total_blocks: int = 0
    doc_holders: list[dict[int, int]] = field(default_factory=list)
    docs: list[Chain] = field(default_factory=list)


def build_workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)
    workers = [1000 + i for i in range(args.workers)]
    doc_blocks = max(args.prompt_tokens) // BLOCK_SIZE // 2
    holdings: dict[int, list[tuple[Chain, int]]] = {w: [] for w in workers}
    docs, doc_holders = [], []
    for _ in range(args.documents):
        doc = Chain.random(rng, doc_blocks)
        holders: dict[int, int] = {}
        order = rng.sample(workers, len(workers))
        full, partial = rng.choice((1, 2)), rng.choice((1, 2))
        for w in order[:full]:
            holders[w] = doc_blocks
        for w in order[full : full + partial]:
            holders[w] = rng.randint(max(1, doc_blocks // 32), max(1, doc_blocks // 2))
        for w, blocks in holders.items():
            holdings[w].append((doc, blocks))
        docs.append(doc)
        doc_holders.append(holders)
    sentinels = {}
    for w in workers:
        held = sum(blocks for _, blocks in holdings[w])
        while held < args.total_blocks // len(workers):
            n = min(args.total_blocks // len(workers) - held, rng.randint(64, 256))
            holdings[w].append((Chain.random(rng, n), n))
            held += n
        sentinels[w] = Chain.random(rng, 4)
        holdings[w].append((sentinels[w], 4))
    weights = [1.0 / (i + 1) for i in range(args.documents)]  # Zipf(1) popularity
    prompts: dict[int, list[Prompt]] = {}
    for size in args.prompt_tokens:
        blocks = size // BLOCK_SIZE
        keep = blocks // 2
        pool = []
        for _ in range(args.pool):
            g = rng.choices(range(args.documents), weights)[0]
            chain = Chain.random(rng, blocks, prefix=docs[g], keep=keep)
            best = max((min(k, keep) for k in doc_holders[g].values()), default=0)
            pool.append(
                Prompt(
                    chain.tokens,
                    best,
                    msgspec.json.encode(chain.tokens),
                    struct.pack(f"<{len(chain.tokens)}I", *chain.tokens),
                )
            )
        prompts[size] = pool
    total = sum(blocks for w in workers for _, blocks in holdings[w])
    return Workload(workers, holdings, sentinels, prompts, total, doc_holders, docs)


def stored_runs(chain: Chain, blocks: int, chunk: int) -> Iterator[tuple[int | None, slice]]:
    """The held blocks of a chain as parent-chained runs of ``chunk`` blocks."""
    for start in range(0, blocks, chunk):
        yield (chain.seq[start - 1] if start else None), slice(start, min(blocks, start + chunk))


# ----------------------------------------------------------------------------- HTTP client
def worker_events(workload: Workload, worker: int) -> list[dict[str, Any]]:
    """The RouterEvents (JSON-ready) that store what `worker` holds in `workload`, 64 blocks an event."""
    events: list[dict[str, Any]] = []
    for chain, held in workload.holdings[worker]:
        for parent, run in stored_runs(chain, held, 64):
            pairs = zip(chain.seq[run], chain.local[run], strict=True)
            blocks = [{"block_hash": s, "tokens_hash": t} for s, t in pairs]
            data = {"stored": {"parent_hash": parent, "blocks": blocks}}
            events.append({"worker_id": worker, "event": {"event_id": len(events) + 1, "data": data}})
    return events


class Connection:
    """One keep-alive HTTP/1.1 connection; Content-Length replies only (both services send them)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: bytes) -> None:
        self._reader, self._writer, self._host = reader, writer, host

    @staticmethod
    async def open(port: int) -> Connection:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return Connection(reader, writer, f"127.0.0.1:{port}".encode())

    async def request(
        self, method: bytes, path: bytes, body: bytes | None = None, content_type: bytes = b"application/json"
    ) -> tuple[int, bytes]:
        head = b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (method, path, self._host)
        if body is None:
            self._writer.write(head + b"\r\n")
        else:
            self._writer.write(head + b"Content-Type: %s\r\nContent-Length: %d\r\n\r\n" % (content_type, len(body)))
            self._writer.write(body)
        header = await self._reader.readuntil(b"\r\n\r\n")
        status = int(header[9:12])
        length = 0
        for line in header.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        return status, await self._reader.readexactly(length) if length else b""

    async def ok(
        self, method: bytes, path: bytes, body: bytes | None = None, content_type: bytes = b"application/json"
    ) -> bytes:
        status, reply = await self.request(method, path, body, content_type)
        if status >= 300:
            raise RuntimeError(f"{method.decode()} {path.decode()}: HTTP {status} {reply[:300]!r}")
        return reply

    def close(self) -> None:
        self._writer.close()


# ----------------------------------------------------------------------------- the two services
class Service:
    """A routing service under test: launch, feed, and one decision cycle."""

    name = ""
    form = "json"
    cwd: str | None = None  # the directory it is started in (another tree's code, for a baseline)
    cores = 1  # the processes (kv-router) or threads (Dynamo) it serves from
    peer_pids: tuple[int, ...] = ()  # other processes whose CPU is the service's (its nats-server)

    def __init__(self, port: int) -> None:
        self.port = port
        self.process: subprocess.Popen[bytes] | None = None

    def pids(self) -> list[int]:
        """Its processes: the one started, every descendant (``--processes`` children), its peers."""
        if self.process is None or self.process.poll() is not None:
            return list(self.peer_pids)
        pids = [self.process.pid]
        if self.cores > 1:
            pids += descendants(self.process.pid)
        return pids + list(self.peer_pids)

    def cpu_s(self) -> float:
        return sum(self.cpu_times())

    def cpu_times(self) -> tuple[float, float]:
        """User and system CPU seconds of its processes."""
        user = system = 0.0
        for pid in self.pids():
            with contextlib.suppress(OSError):
                pid_user, pid_system = process_times(pid)
                user += pid_user
                system += pid_system
        return user, system

    def command(self) -> tuple[list[str], dict[str, str]]:
        raise NotImplementedError

    async def health(self, conn: Connection) -> bool:
        raise NotImplementedError

    async def populate(self, conn: Connection, workload: Workload) -> None:
        raise NotImplementedError

    async def overlap(self, conn: Connection, tokens: list[int]) -> dict[int, int]:
        raise NotImplementedError

    async def select(self, conn: Connection, request_id: bytes, prompt: Prompt) -> tuple[int, int]:
        """Book a decision; returns (worker_id, overlap blocks on it)."""
        raise NotImplementedError

    async def free(self, conn: Connection, request_id: bytes) -> None:
        raise NotImplementedError


class KvRouterService(Service):
    name = "kv-router"

    def __init__(
        self, port: int, form: str, cwd: str | None = None, nats: EmbeddedNats | None = None, policy: str = "dynamo"
    ) -> None:
        super().__init__(port)
        self.form = form
        self.cwd = cwd
        self.policy = policy
        # "json" / "msgpack": the request bodies; "-asgi": the hot routes served by the ASGI fast path
        # (`--no-fast-protocol`) instead of inside uvicorn's HTTP protocol; "-pN": `--processes N`,
        # replicas synced over ``nats``; a "base:" prefix: the service of the --baseline tree.
        self.encoding, _, self.variant = form.rpartition(":")[2].partition("-")
        self.cores = processes_of(form)
        self.nats = nats
        self.namespace = f"http-bench-{port}"  # its own subjects and registry on the shared nats-server
        if self.cores > 1:
            assert nats is not None and nats.pid is not None
            self.peer_pids = (nats.pid,)

    def command(self) -> tuple[list[str], dict[str, str]]:
        # Dynamo's cost function on both sides by default: the same decisions, so the same work per decision.
        argv = [sys.executable, "-m", "api.cli", "serve", "--port", str(self.port), "--block-size", str(BLOCK_SIZE),
                "--policy", self.policy, "--log-level", "warning"]  # fmt: skip
        if self.cores > 1:
            assert self.nats is not None
            argv += ["--processes", str(self.cores), "--nats-url", self.nats.url, "--nats-namespace", self.namespace]
        else:
            argv.append("--no-embedded-nats")
        if self.variant == "asgi":
            argv.append("--no-fast-protocol")
        return argv, {}

    async def health(self, conn: Connection) -> bool:
        return (await conn.request(b"GET", b"/healthz"))[0] == 200

    async def populate(self, conn: Connection, workload: Workload) -> None:
        if self.cores > 1:
            await self._every_child_ready(0)  # each child's event plane has started
        for worker in workload.workers:
            await conn.ok(b"POST", b"/v1/workers", msgspec.json.encode({"worker_id": worker}))
        if self.cores > 1:
            # Each child has its own index: the events go over NATS, as engines publish them, once
            # every child knows the workers (registrations reach the others through the registry).
            await self._every_child_ready(len(workload.workers))
            assert self.nats is not None
            nc = await nats_connect(self.nats.client_options("http-bench"))
            try:
                for worker in workload.workers:
                    await nc.publish(
                        Subjects(self.namespace).events(worker), msgspec.json.encode(worker_events(workload, worker))
                    )
                await nc.flush()
            finally:
                await nc.close()
            return
        for worker in workload.workers:
            body = msgspec.json.encode(worker_events(workload, worker))
            reply = msgspec.json.decode(await conn.ok(b"POST", b"/v1/events", body))
            if reply["rejected"]:
                raise RuntimeError(f"kv-router rejected events of worker {worker}: {reply['errors']}")

    async def _every_child_ready(self, workers: int, timeout_s: float = 60.0) -> None:
        """Until every child listens on the port and ``VERIFY_CONNECTIONS`` fresh connections in a
        row (whichever child takes each) are ready and list ``workers`` workers.

        A child still starting (its event plane connecting, before uvicorn listens) takes no
        connection: the kernel hands every one to the children already listening, so without the
        count of listening sockets the check passes on one child alone and events published next
        miss the other."""
        deadline = time.monotonic() + timeout_s
        await asyncio.to_thread(wait_listening, self.port, self.cores, timeout_s)
        seen = 0
        while seen < VERIFY_CONNECTIONS:
            conn = await Connection.open(self.port)
            try:
                ready = (await conn.request(b"GET", b"/readyz"))[0] == 200
                listed = msgspec.json.decode(await conn.ok(b"GET", b"/v1/workers"))["workers"]
            finally:
                conn.close()
            seen = seen + 1 if ready and len(listed) == workers else 0
            if time.monotonic() > deadline:
                raise RuntimeError(f"kv-router/{self.form}: not every process ready with {workers} workers")
            if not seen:
                await asyncio.sleep(0.05)

    async def overlap(self, conn: Connection, tokens: list[int]) -> dict[int, int]:
        reply = msgspec.json.decode(
            await conn.ok(b"POST", b"/v1/overlap", b'{"tokens":%s}' % msgspec.json.encode(tokens))
        )
        return {row["worker_id"]: row["device_blocks"] for row in reply["workers"] if row["device_blocks"]}

    async def select(self, conn: Connection, request_id: bytes, prompt: Prompt) -> tuple[int, int]:
        if self.encoding == "msgpack":
            body = _MSGPACK.encode({"request_id": request_id.decode(), "tokens": prompt.packed})
            reply = await conn.ok(b"POST", b"/v1/new", body, b"application/msgpack")
        else:
            body = b'{"request_id":"%s","tokens":%s}' % (request_id, prompt.json_tokens)
            reply = await conn.ok(b"POST", b"/v1/new", body)
        decision = _OUR_DECISION.decode(reply)
        return decision.worker_id, decision.overlap_blocks

    async def free(self, conn: Connection, request_id: bytes) -> None:
        await conn.ok(b"POST", b"/v1/mark_free", b'{"request_id":"%s"}' % request_id)


class _OurDecision(msgspec.Struct):
    worker_id: int
    overlap_blocks: int


class _Overlap(msgspec.Struct):
    gpu: int = 0


class _DynamoSelection(msgspec.Struct):
    worker_id: int
    block_size: int
    overlap: _Overlap


_OUR_DECISION = msgspec.json.Decoder(_OurDecision)
_DYNAMO_SELECTION = msgspec.json.Decoder(_DynamoSelection)
_MSGPACK = msgspec.msgpack.Encoder()


class DynamoSelectService(Service):
    name = "dynamo-select"

    def __init__(self, port: int, threads: int = 1) -> None:
        super().__init__(port)
        self.cores = threads
        self.form = dynamo_form(threads)
        self._engines: dict[int, Any] = {}
        self._zmq: Any = None

    def command(self) -> tuple[list[str], dict[str, str]]:
        argv = [sys.executable, "-m", "dynamo.select_service", "--port", str(self.port), "--threads", str(self.cores)]
        return argv, {"DYN_LOG": "warn"}

    async def health(self, conn: Connection) -> bool:
        return (await conn.request(b"GET", b"/health"))[0] == 200

    async def populate(self, conn: Connection, workload: Workload) -> None:
        import zmq

        self._zmq = zmq.Context()
        for worker in workload.workers:
            # XPUB instead of PUB: the subscription is visible, so nothing is published before the
            # service's SUB is connected (no slow-joiner loss).
            engine = self._zmq.socket(zmq.XPUB)
            engine.setsockopt(zmq.SNDHWM, 0)
            engine.setsockopt(zmq.LINGER, 0)
            engine.bind("tcp://127.0.0.1:*")
            self._engines[worker] = engine
            body = {"worker_id": worker, "endpoint": f"http://worker-{worker}:8000", "block_size": BLOCK_SIZE,
                    "data_parallel_start_rank": 0, "data_parallel_size": 1,
                    "kv_events_endpoint": engine.getsockopt(zmq.LAST_ENDPOINT).decode(),
                    "total_kv_blocks": 1 << 20, "max_num_batched_tokens": 8192}  # fmt: skip
            await conn.ok(b"POST", b"/workers", msgspec.json.encode(body))
        deadline = time.monotonic() + 30
        for engine in self._engines.values():
            while not engine.poll(10, zmq.POLLIN):
                if time.monotonic() > deadline:
                    raise RuntimeError("select_service never subscribed to the fake engines")
                await asyncio.sleep(0.01)
            engine.recv()
        encoder = msgspec.msgpack.Encoder()
        for worker in workload.workers:
            events = []
            for chain, held in workload.holdings[worker]:
                for parent, run in stored_runs(chain, held, 64):
                    tokens = chain.tokens[run.start * BLOCK_SIZE : run.stop * BLOCK_SIZE]
                    events.append(
                        {"type": "BlockStored", "block_hashes": chain.seq[run], "parent_block_hash": parent,
                         "token_ids": tokens, "block_size": BLOCK_SIZE, "lora_id": None, "medium": "GPU",
                         "lora_name": None}
                    )  # fmt: skip
            # vLLM's ZmqEventPublisher frames: [topic, seq (u64 big-endian), msgpack([ts, events, dp_rank])].
            for seq, start in enumerate(range(0, len(events), 8)):
                payload = encoder.encode([time.time(), events[start : start + 8], 0])
                self._engines[worker].send_multipart([b"", seq.to_bytes(8, "big"), payload])

    async def overlap(self, conn: Connection, tokens: list[int]) -> dict[int, int]:
        body = b'{"token_ids":%s}' % msgspec.json.encode(tokens)
        reply = msgspec.json.decode(await conn.ok(b"POST", b"/overlap_scores", body))
        return {row["worker_id"]: row["device_blocks"] for row in reply["workers"] if row["device_blocks"]}

    async def select(self, conn: Connection, request_id: bytes, prompt: Prompt) -> tuple[int, int]:
        body = b'{"selection_id":"%s","token_ids":%s}' % (request_id, prompt.json_tokens)
        selection = _DYNAMO_SELECTION.decode(await conn.ok(b"POST", b"/select_and_reserve", body))
        return selection.worker_id, selection.overlap.gpu // selection.block_size

    async def free(self, conn: Connection, request_id: bytes) -> None:
        await conn.ok(b"DELETE", b"/reservations/%s" % request_id)

    def close(self) -> None:
        for engine in self._engines.values():
            engine.close(0)
        if self._zmq is not None:
            self._zmq.term()


# ----------------------------------------------------------------------------- running a service
def processes_of(form: str) -> int:
    """The processes a kv-router form serves from: N for a ``-pN`` form, else 1."""
    variant = form.rpartition(":")[2].partition("-")[2]
    return int(variant[1:]) if variant.startswith("p") else 1


def dynamo_form(threads: int) -> str:
    """Dynamo's row in the results: ``json`` with one thread (the usual peer), ``json-tN`` with N."""
    return "json" if threads == 1 else f"json-t{threads}"


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False)
    children = [int(line) for line in out.stdout.split()]
    return children + [grandchild for child in children for grandchild in descendants(child)]


def wait_listening(port: int, processes: int, timeout_s: float) -> None:
    """Until ``processes`` sockets listen on ``port`` (every child of a ``--processes`` service up)."""
    deadline = time.monotonic() + timeout_s
    while (listening := listening_sockets(port)) < processes:
        if time.monotonic() > deadline:
            raise RuntimeError(f"port {port}: {listening} of {processes} processes listening after {timeout_s:.0f} s")
        time.sleep(0.05)


def listening_sockets(port: int) -> int:
    """Sockets listening on IPv4 ``port`` in this network namespace (/proc/net/tcp, state 0A)."""
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return sum(1 for row in rows if row[1].endswith(f":{port:04X}") and row[3] == "0A")


def process_cpu_s(pid: int) -> float:
    return sum(process_times(pid))


def process_times(pid: int) -> tuple[float, float]:
    """A process's user and system CPU seconds (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy since boot (every core; /proc/stat)."""
    with open("/proc/stat") as stat:
        user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in stat.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class ForeignLoad:
    """CPU used by processes that are not this run's (other people's work on a shared machine), in
    cores: the machine's busy time less this load generator's and the services'."""

    def __init__(self, services: Sequence[Service]) -> None:
        self._services = services
        self._start = self._snapshot()

    def _snapshot(self) -> tuple[float, float, float]:
        own = process_cpu_s(os.getpid()) + sum(service.cpu_s() for service in self._services)
        return machine_busy_s(), own, time.perf_counter()

    def cores(self) -> float:
        """Foreign cores since this was created."""
        busy0, own0, t0 = self._start
        busy1, own1, t1 = self._snapshot()
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / max(t1 - t0, 1e-9)


async def wait_quiet(services: Sequence[Service], limit: float, timeout_s: float) -> float:
    """Wait (up to ``timeout_s``) until other processes use less than ``limit`` cores; returns the last
    reading."""
    deadline = time.perf_counter() + timeout_s
    while True:
        window = ForeignLoad(services)
        await asyncio.sleep(0.5)
        foreign = window.cores()
        if foreign < limit or time.perf_counter() >= deadline:
            return foreign


@contextmanager
def launched(service: Service, cpus: str | None) -> Iterator[subprocess.Popen[bytes]]:
    argv, env = service.command()
    if cpus is not None:
        argv = ["taskset", "-c", cpus, *argv]
    log_path = f"/tmp/http_bench_{service.name}_{service.port}.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log_file, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True, cwd=service.cwd)  # fmt: skip
    service.process = process
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


async def wait_healthy(service: Service, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert service.process is not None
        if service.process.poll() is not None:
            raise RuntimeError(f"{service.name} exited during start-up (see /tmp/http_bench_{service.name}_*.log)")
        try:
            conn = await Connection.open(service.port)
            try:
                if await service.health(conn):
                    return
            finally:
                conn.close()
        except (OSError, asyncio.IncompleteReadError):
            pass
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{service.name} not healthy after {timeout_s} s")


async def populate_and_verify(service: Service, workload: Workload) -> float:
    """Feed the index and check it against ground truth; a service of several processes is checked
    on ``VERIFY_CONNECTIONS`` fresh connections (the kernel hands each to one of them)."""
    conn = await Connection.open(service.port)
    started = time.perf_counter()
    try:
        await service.populate(conn, workload)
    finally:
        conn.close()
    for _ in range(VERIFY_CONNECTIONS if service.cores > 1 and service.name == "kv-router" else 1):
        conn = await Connection.open(service.port)
        try:
            pending = dict(workload.sentinels)
            while pending:
                for worker, chain in list(pending.items()):
                    if (await service.overlap(conn, chain.tokens)).get(worker, 0) >= 4:
                        del pending[worker]
                if time.perf_counter() - started > 120:
                    raise RuntimeError(f"{service.name}: index never showed the sentinels of {sorted(pending)}")
                await asyncio.sleep(0.01)
            for g, doc in enumerate(workload.docs[:8]):
                seen = await service.overlap(conn, doc.tokens)
                if seen != workload.doc_holders[g]:
                    raise RuntimeError(
                        f"{service.name}: document {g} held by {seen}, expected {workload.doc_holders[g]}"
                    )
        finally:
            conn.close()
    return time.perf_counter() - started


@dataclass
class Cell:
    service: str
    form: str
    prompt_tokens: int
    concurrency: int
    decisions: int
    seconds: float
    select_ms: list[float]
    service_cpu_s: float
    best_overlap: int
    errors: int
    client_cpu_s: float = 0.0  # this load generator's CPU time during the cell
    service_system_s: float = 0.0  # the part of service_cpu_s spent in the kernel
    foreign_cores: float = 0.0

    @property
    def per_s(self) -> float:
        return self.decisions / self.seconds

    def pct(self, q: float) -> float:
        ordered = sorted(self.select_ms)
        return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else float("nan")

    def slow_share(self, over_p50: float) -> float:
        """The share of decisions that took more than ``over_p50`` times this cell's median."""
        limit = self.pct(50) * over_p50
        return sum(ms > limit for ms in self.select_ms) / len(self.select_ms) if self.select_ms else float("nan")


async def run_cell(
    service: Service, prompts: Sequence[Prompt], concurrency: int, cycles: int, seconds: float, tag: str,
    settle: int = 0,
) -> Cell:  # fmt: skip
    conns = [await Connection.open(service.port) for _ in range(concurrency)]
    for n in range(settle):  # untimed: the first decisions after the other side's run wake caches, the scheduler
        request_id = b"%s-settle-%d" % (tag.encode(), n)
        await service.select(conns[0], request_id, prompts[n % len(prompts)])
        await service.free(conns[0], request_id)
    issued = errors = best = 0
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def loop(conn: Connection) -> None:
        nonlocal issued, errors, best
        while issued < cycles and time.perf_counter() < deadline:
            n = issued
            issued += 1
            prompt = prompts[n % len(prompts)]
            request_id = b"%s-%d" % (tag.encode(), n)
            started = time.perf_counter()
            try:
                _, overlap = await service.select(conn, request_id, prompt)
            except RuntimeError:
                errors += 1
                continue
            latencies.append((time.perf_counter() - started) * 1e3)
            best += overlap >= prompt.best_overlap
            await service.free(conn, request_id)

    user_before, system_before = service.cpu_times()
    client_before = process_cpu_s(os.getpid())
    started = time.perf_counter()
    await asyncio.gather(*(loop(conn) for conn in conns))
    elapsed = time.perf_counter() - started
    user_after, system_after = service.cpu_times()
    cpu = user_after - user_before + system_after - system_before
    client = process_cpu_s(os.getpid()) - client_before
    for conn in conns:
        conn.close()
    return Cell(service.name, service.form, len(prompts[0].tokens), concurrency, len(latencies), elapsed, latencies,
                cpu, best, errors, client, system_after - system_before)  # fmt: skip


# ----------------------------------------------------------------------------- main
def median_cell(cells: list[Cell]) -> dict[str, float]:
    p99s = [c.pct(99) for c in cells]
    return {
        "per_s": statistics.median(c.per_s for c in cells),
        "p50": statistics.median(c.pct(50) for c in cells),
        "p90": statistics.median(c.pct(90) for c in cells),
        "p99": statistics.median(p99s),
        # The spread of p99 over the runs, and how many decisions took over 5x the run's p50: a
        # decision that slow on an idle service was descheduled, so a p99 inside that share is the
        # scheduler's time slice, not the service's work.
        "p99_min": min(p99s),
        "p99_max": max(p99s),
        # p99 of every decision of every run: 5-10x the samples of one run, so one time slice moves it less.
        "p99_pooled": Cell("", "", 0, 0, 0, 0.0, [ms for c in cells for ms in c.select_ms], 0.0, 0, 0).pct(99),
        "slow_share": statistics.median(c.slow_share(5.0) for c in cells),
        "cpu_us": statistics.median(c.service_cpu_s / max(1, c.decisions) * 1e6 for c in cells),
        "system_us": statistics.median(c.service_system_s / max(1, c.decisions) * 1e6 for c in cells),
        "client_cores": statistics.median(c.client_cpu_s / c.seconds for c in cells),
        "best": statistics.median(c.best_overlap / max(1, c.decisions) for c in cells),
        "errors": sum(c.errors for c in cells),
        "foreign_cores": max(c.foreign_cores for c in cells),
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    workload = build_workload(args)
    log(f"workload: {len(workload.workers)} workers, {workload.total_blocks} cached blocks, "
        f"{args.pool} prompts per size")  # fmt: skip
    ports = iter(range(args.base_port, args.base_port + 100))
    counts = sorted({processes_of(form) for form in args.forms})
    services: list[Service] = [DynamoSelectService(next(ports), threads) for threads in counts]
    results: dict[tuple[str, str, int, int], list[Cell]] = {}
    with ExitStack() as stack:
        # Replicas of a --processes service sync over NATS: one server of this run's own.
        nats = stack.enter_context(EmbeddedNats()) if counts[-1] > 1 else None
        services += [
            KvRouterService(next(ports), form, args.baseline if form.startswith("base:") else None, nats, args.policy)
            for form in args.forms
        ]
        for service in services:
            stack.enter_context(launched(service, args.service_cpus if service.cores == 1 else args.multi_cpus))
            await wait_healthy(service)
            seconds = await populate_and_verify(service, workload)
            log(f"{service.name}/{service.form}: index ready in {seconds:.2f} s, ground truth checked")
            warm = await run_cell(service, workload.prompts[args.prompt_tokens[0]], 8, args.warmup, 30, "warm")
            if warm.errors:
                raise RuntimeError(f"{service.name}: {warm.errors} errors during warm-up")
        for size in args.prompt_tokens:
            for concurrency in args.concurrency:
                for repeat in range(args.repeat):
                    for service in services if repeat % 2 == 0 else services[::-1]:
                        tag = f"{service.form}-{size}-{concurrency}-{repeat}"
                        await wait_quiet(services, args.quiet_cores, args.quiet_wait)
                        foreign = ForeignLoad(services)
                        cell = await run_cell(
                            service, workload.prompts[size], concurrency, args.cycles, args.seconds, tag, args.settle
                        )
                        cell.foreign_cores = foreign.cores()
                        results.setdefault((service.name, service.form, size, concurrency), []).append(cell)
                summary = {key: median_cell(cells) for key, cells in results.items() if key[2:] == (size, concurrency)}
                line = "  ".join(
                    f"{k[0]}/{k[1]} {v['per_s']:,.0f}/s p50 {v['p50']:.2f} p90 {v['p90']:.2f} p99 {v['p99']:.2f} "
                    f"({v['p99_min']:.2f}-{v['p99_max']:.2f}, pooled {v['p99_pooled']:.2f}) ms, "
                    f"{v['slow_share']:.1%} over 5x p50, "
                    f"{v['cpu_us']:.0f} µs/dec of which kernel {v['system_us']:.0f}"
                    for k, v in summary.items()
                )
                log(f"{size:>6} tokens c={concurrency:<3} {line}")
        for service in services:
            if isinstance(service, DynamoSelectService):
                service.close()
    return {"results": {k: median_cell(v) for k, v in results.items()}, "workload_blocks": workload.total_blocks}


def report(args: argparse.Namespace, outcome: dict[str, Any]) -> str:
    """One table per core count: kv-router's forms of N processes against Dynamo with N threads."""
    lines: list[str] = []
    for count in sorted({processes_of(form) for form in args.forms}):
        forms = [form for form in args.forms if processes_of(form) == count]
        if lines:
            lines.append("")
        against = "" if count == 1 else f" against kv-router --processes {count}"
        lines.append(f"Dynamo with --threads {count}{against}:")
        lines += report_table(args, outcome["results"], forms, dynamo_form(count))
    best = {k: v["best"] for k, v in outcome["results"].items() if k[3] == 1}
    errors = sum(v["errors"] for v in outcome["results"].values())
    lines.append("")
    lines.append("Chosen worker holds the best cached prefix at c=1: "
                 + ", ".join(f"{k[0]}/{k[1]} {k[2] // 1024}k {v:.0%}" for k, v in sorted(best.items()))
                 + f". Errors: {errors}.")  # fmt: skip
    return "\n".join(lines)


def report_table(
    args: argparse.Namespace, results: dict[tuple[str, str, int, int], dict[str, float]], forms: list[str], peer: str
) -> list[str]:
    ours = " | ".join(f"kv-router {form} dec/s | p50 / p99 ms | x throughput | p99 ratio" for form in forms)
    cpu_columns = "".join(f", {form}" for form in forms)
    header = (
        f"| prompt | conc | Dynamo dec/s | Dynamo p50 / p99 ms | {ours} | svc µs/dec (Dynamo{cpu_columns}) "
        "| load generator cores (max) | foreign cores (max) |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for size in args.prompt_tokens:
        for concurrency in args.concurrency:
            theirs = results[("dynamo-select", peer, size, concurrency)]
            row = [
                f"{size // 1024}k",
                str(concurrency),
                f"{theirs['per_s']:,.0f}",
                f"{theirs['p50']:.2f} / {theirs['p99']:.2f}",
            ]
            cpu = [f"{theirs['cpu_us']:.0f}"]
            for form in forms:
                ours = results[("kv-router", form, size, concurrency)]
                row += [f"{ours['per_s']:,.0f}", f"{ours['p50']:.2f} / {ours['p99']:.2f}",
                        f"{ours['per_s'] / theirs['per_s']:.2f}", f"{ours['p99'] / theirs['p99']:.2f}"]  # fmt: skip
                cpu.append(f"{ours['cpu_us']:.0f}")
            row.append(" / ".join(cpu))
            client = max(v["client_cores"] for k, v in results.items() if k[2:] == (size, concurrency))
            row.append(f"{client:.2f}")
            foreign = max(v["foreign_cores"] for k, v in results.items() if k[2:] == (size, concurrency))
            row.append(f"{foreign:.2f}")
            lines.append("| " + " | ".join(row) + " |")
    return lines


def reexec_in_private_network(argv: list[str]) -> int | None:
    """Run this script again inside a network namespace whose only interface is loopback."""
    if os.environ.get(NETNS_MARK) == "1":
        return None
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    if not unshare or not ip or subprocess.run([unshare, "-n", "true"], capture_output=True).returncode != 0:
        raise SystemExit("needs `unshare -n` (root): Dynamo's select_service binds 0.0.0.0 and must not be reachable")
    command = [unshare, "-n", "sh", "-c", f'"{ip}" link set lo up && exec "$@"', "sh", sys.executable,
               os.path.abspath(__file__), *argv]  # fmt: skip
    return subprocess.run(command, env={**os.environ, NETNS_MARK: "1"}).returncode


def parse_args(argv: list[str]) -> argparse.Namespace:
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    parser.add_argument("--prompt-tokens", type=ints, default=[1024, 4096, 16384])
    parser.add_argument("--concurrency", type=ints, default=[1, 8, 64])
    parser.add_argument(
        "--forms",
        type=lambda s: s.split(","),
        default=["json", "msgpack"],
        help="kv-router variants: json (token list) and/or msgpack (packed u32 tokens) bodies; a -asgi suffix "
        "(json-asgi, msgpack-asgi) serves the hot routes from the ASGI fast path instead of inside the protocol; "
        "a -pN suffix (json-p2) serves from `--processes N` (replica sync over a nats-server of this run, its "
        "CPU counted as the service's) against Dynamo with `--threads N`, both on --multi-cpus; "
        "a base: prefix (base:json) runs the --baseline tree's service in the same run",
    )
    parser.add_argument("--baseline", default=None, help="a tree (e.g. an export of main) for the base: forms")
    parser.add_argument("--cycles", type=int, default=20_000, help="most decisions per cell")
    parser.add_argument("--seconds", type=float, default=3.0, help="longest time per cell")
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell, alternating services; median reported")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--settle", type=int, default=50, help="untimed decisions at the start of every run of a cell")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--documents", type=int, default=32)
    parser.add_argument("--total-blocks", type=int, default=50_000)
    parser.add_argument("--pool", type=int, default=64, help="distinct prompts per size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--policy",
        default="dynamo",
        choices=["dynamo", "latency"],
        help="kv-router's policy: dynamo (the cost function Dynamo's service runs) or latency (the service's own "
        "default)",
    )
    parser.add_argument("--service-cpus", default="0", help="taskset CPU list for the services ('' = no pinning)")
    parser.add_argument("--client-cpus", default="1", help="CPU list for this load generator ('' = no pinning)")
    parser.add_argument(
        "--multi-cpus",
        default="0,1",
        help="taskset CPU list for the services of several processes or threads (-pN forms, Dynamo's --threads N)",
    )
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=20.0,
        help="before each cell, wait up to this many seconds for other processes to go quiet",
    )
    parser.add_argument(
        "--quiet-cores",
        type=float,
        default=0.1,
        help="what counts as quiet: CPU used by processes not of this run, in cores",
    )
    parser.add_argument("--base-port", type=int, default=18080)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    args.service_cpus = args.service_cpus or None
    args.multi_cpus = args.multi_cpus or None
    if not all(re.fullmatch(r"(base:)?(json|msgpack)(-asgi|-p[1-9])?", form) for form in args.forms):
        parser.error("forms are json, msgpack, json-asgi, msgpack-asgi, json-pN, msgpack-pN, each optionally "
                     "prefixed with base:")  # fmt: skip
    if any(form.startswith("base:") for form in args.forms) and not args.baseline:
        parser.error("base: forms need --baseline DIR")
    if any(size % BLOCK_SIZE for size in args.prompt_tokens):
        parser.error(f"prompt sizes must be multiples of the block size {BLOCK_SIZE}")
    return args


def main() -> int:
    argv = sys.argv[1:]
    args = parse_args(argv)
    code = reexec_in_private_network(argv)
    if code is not None:
        return code
    if args.client_cpus:
        os.sched_setaffinity(0, {int(c) for c in args.client_cpus.split(",")})
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    outcome = asyncio.run(bench(args))
    table = report(args, outcome)
    print(f"\nkv-router vs Dynamo select_service, {outcome['workload_blocks']} cached blocks, "
          f"{args.repeat} runs per cell (median), python {sys.version.split()[0]}\n")  # fmt: skip
    print(table)
    if args.json_out:
        rows = [{"service": k[0], "form": k[1], "prompt_tokens": k[2], "concurrency": k[3], **v}
                for k, v in outcome["results"].items()]  # fmt: skip
        with open(args.json_out, "w") as out:
            json.dump({"argv": argv, "rows": rows}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

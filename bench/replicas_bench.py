#!/usr/bin/env python3
"""High availability figures (issue 14), with real ``kv-router serve`` processes on a real nats-server.

1. ``throughput``: decisions/s of 1 and of 2 ``--replica-sync`` replicas, driven by one load generator
   (``--concurrency`` keep-alive connections per replica, each a closed loop of ``POST /v1/new`` then
   ``POST /v1/mark_free`` with a request id unique per request). The generator is bench/loadgen.c
   (one thread, epoll; built with the machine's C compiler at the start of the run) when a compiler
   is found, else ``wrk`` with bench/replicas_wrk.lua (one thread per connection), else this process
   (``--generator`` chooses; the report says which). Reported as the ratio 2 replicas / 1 replica,
   measured in the same run, with the CPU the services, the generator and other processes on the
   machine used during each cell.
2. ``lag``: 2 replicas, a paced open loop of ``--lag-rate`` decisions/s (each then freed) on replica 0;
   the sync lag is what replica 1 reports in ``kv_router_replica_sync_lag_seconds`` (publish to applied,
   last 4,096 batches).
3. ``processes``: ``kv-router serve --processes 1`` against ``--processes 2`` (one port, the kernel
   spreads the same number of connections over the children), same load generator.
4. ``restart``: one ``--durable-events`` router indexes ``--blocks`` blocks published on NATS and
   snapshots them; while it writes the next snapshot (after 1% more blocks), one connection sends
   decisions back to back and their latency says how long the write holds the event loop; then it
   indexes 5% more (left in the stream only), is killed with SIGKILL and restarted; the figure is the
   time from the restart to ``/healthz`` answering, which comes only after snapshot load and stream
   replay, and the index is checked to hold every block again.
5. ``stall`` (in this process): a router of ``--blocks`` blocks writes its snapshot to the real
   nats-server while a task decides back to back; the longest loop stalls with the snapshot phase, the
   GC passes and the code (stack samples) they overlap (``--gc-freeze`` as the service does).
6. ``sync-cost``: the CPU (replicas + nats-server) per decision at a paced ``--lag-rate`` on 1 and on 2
   replicas; the difference is what replica sync costs per decision.

    python bench/replicas_bench.py                               # all four, ~3 minutes
    python bench/replicas_bench.py --parts throughput --seconds 5
    python bench/replicas_bench.py --parts processes --prompt-tokens 1024 --concurrency 32 --repeat 8   # c=64
    python bench/replicas_bench.py --parts sync-cost --lag-rate 1000   # what sync costs per decision
    python bench/replicas_bench.py --parts stall --gc-freeze           # loop stalls of a snapshot, in process

Loopback only. The machine is shared: the foreign CPU column says how much others used meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.http_bench import Connection, machine_busy_s, process_cpu_s, wait_listening
from indexer.events import RouterEvent, encode_router_events, stored_event
from router.config import RouterConfig
from router.event_plane.connection import NatsOptions, connect
from router.event_plane.embedded_server import EmbeddedNats
from router.event_plane.subjects import Subjects
from router.kv_router import KvRouter
from router.replicas.durable import DurableEvents
from router.types import RouteRequest, WorkerConfig
from tests.router_processes import RouterProcess

WORKERS = 8
BLOCK_SIZE = 16
WRK_SCRIPT = Path(__file__).resolve().parent / "replicas_wrk.lua"
LOADGEN_SOURCE = Path(__file__).resolve().parent / "loadgen.c"


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def metric(port: int, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    want = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
    for line in text.splitlines():
        if line.startswith(name + want + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def register_workers(service: RouterProcess, *others: RouterProcess, connections: int = 16,
                     timeout_s: float = 30.0) -> None:  # fmt: skip
    """Register the workers on ``service``, then wait until, on every port, ``connections`` fresh
    connections in a row (whichever ``--processes`` child takes each) are ready and know them all:
    registrations reach the other routers through the registry."""
    for worker_id in range(1, WORKERS + 1):
        service.post("/v1/workers", {"worker_id": worker_id, "total_kv_blocks": 1 << 20})
    deadline = time.monotonic() + timeout_s
    for replica in (service, *others):
        seen = 0
        while seen < connections:
            try:
                ready = urllib.request.urlopen(f"http://127.0.0.1:{replica.port}/readyz", timeout=10).status == 200
            except OSError:
                ready = False
            seen = seen + 1 if ready and len(replica.get("/v1/workers")["workers"]) == WORKERS else 0
            if time.monotonic() > deadline:
                raise RuntimeError(f"port {replica.port}: not every process knew the workers within {timeout_s} s")


def prompts(count: int, tokens: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    shared = [[rng.randrange(1 << 31) for _ in range(tokens // 2)] for _ in range(16)]
    bodies = []
    for _ in range(count):
        body = rng.choice(shared) + [rng.randrange(1 << 31) for _ in range(tokens - tokens // 2)]
        bodies.append(body)
    return [json.dumps(b).encode() for b in bodies]


async def decision_loop(port: int, bodies: list[bytes], until: float, tag: str, counts: list[int]) -> None:
    connection = await Connection.open(port)
    done = 0
    try:
        while time.perf_counter() < until:
            request_id = f"{tag}-{done}"
            tokens = bodies[done % len(bodies)]
            await connection.ok(b"POST", b"/v1/new", b'{"request_id":"%s","tokens":%s}' % (request_id.encode(), tokens))
            await connection.ok(b"POST", b"/v1/mark_free", b'{"request_id":"%s"}' % request_id.encode())
            done += 1
    finally:
        connection.close()
        counts.append(done)


async def python_load(ports: list[int], bodies: list[bytes], seconds: float, concurrency: int) -> tuple[float, float]:
    """This process as the generator: ``concurrency`` closed loops per port; (decisions/s, its CPU s)."""
    counts: list[int] = []
    cpu = process_cpu_s(os.getpid())
    started = time.perf_counter()
    tag = f"py-{time.time_ns()}"
    loops = [decision_loop(ports[i % len(ports)], bodies, started + seconds, f"c{i}-{tag}", counts)
             for i in range(concurrency * len(ports))]  # fmt: skip
    await asyncio.gather(*loops)
    return sum(counts) / (time.perf_counter() - started), process_cpu_s(os.getpid()) - cpu


def wrk_load(ports: list[int], bodies_file: Path, seconds: float, concurrency: int) -> tuple[float, float]:
    """``wrk`` as the generator (bench/replicas_wrk.lua): ``concurrency`` connections per port, one
    thread each (so each free follows its own booking on its connection, whichever ``--processes``
    child took it), the same closed loop; (decisions/s, wrk's CPU s)."""
    env = {**os.environ, "WRK_PORTS": ",".join(map(str, ports)), "WRK_BODIES": str(bodies_file),
           "WRK_TAG": f"wrk-{time.time_ns()}"}  # fmt: skip
    connections = str(concurrency * len(ports))
    command = ["wrk", "-t", connections, "-c", connections, "-d", f"{max(1, round(seconds))}s",
               "--timeout", "10s", "-s", str(WRK_SCRIPT), f"http://127.0.0.1:{ports[0]}/"]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stdout[-2000:]} {out.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if result["failures"] or result["socket_errors"]:
        raise RuntimeError(f"wrk: {result} {out.stdout[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return result["decisions"] / result["duration_s"], cpu


def build_loadgen(directory: Path) -> Path:
    """bench/loadgen.c compiled with the machine's C compiler into ``directory``."""
    binary = directory / "loadgen"
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("--generator c needs a C compiler (cc)")
    subprocess.run([compiler, "-O2", "-o", str(binary), str(LOADGEN_SOURCE)], check=True)
    return binary


def c_load(binary: Path, ports: list[int], bodies_file: Path, seconds: float, concurrency: int) -> dict[str, float]:
    """bench/loadgen.c as the generator: ``concurrency`` connections per port, one thread, the same
    closed loop; its JSON line (decisions, latency percentiles, its CPU s)."""
    command = [str(binary), ",".join(map(str, ports)), str(concurrency * len(ports)), str(seconds),
               str(bodies_file), f"c-{time.time_ns()}"]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"loadgen failed ({out.returncode}): {out.stdout[-2000:]} {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    if result["failures"] or result["unfinished"]:
        raise RuntimeError(f"loadgen: {result}")
    return result


def foreign_cores(pids: list[int], started: tuple[float, float, float], generator_cpu_s: float) -> float:
    busy0, own0, t0 = started
    busy1, own1, t1 = snapshot_cpu(pids)
    return max(0.0, (busy1 - busy0) - (own1 - own0) - generator_cpu_s) / max(t1 - t0, 1e-9)


def snapshot_cpu(pids: list[int]) -> tuple[float, float, float]:
    """The machine's busy CPU s, the services' CPU s (not the generator's), the time."""
    own = sum(process_cpu_s(pid) for pid in pids)
    return machine_busy_s(), own, time.perf_counter()


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False)
    children = [int(line) for line in out.stdout.split()]
    return children + [grandchild for child in children for grandchild in descendants(child)]


async def throughput_cell(
    replicas: list[RouterProcess], server_pid: int, args: argparse.Namespace, bodies: list[bytes]
) -> dict[str, float]:
    """Warm up for a second, then measure; the generator drives ``args.concurrency`` connections per
    entry of ``replicas`` (an entry may repeat: one port shared by ``--processes`` children)."""
    ports = [replica.port for replica in replicas]
    for seconds, measured in ((1.0, False), (args.seconds, True)):
        pids = [*dict.fromkeys(pid for r in replicas for pid in (r.pid, *descendants(r.pid))), server_pid]
        cpu = snapshot_cpu(pids)
        latency: dict[str, float] = {}
        if args.generator == "c":
            result = await asyncio.to_thread(c_load, args.loadgen, ports, args.bodies_file, seconds, args.concurrency)
            rate, generator_cpu = result["decisions"] / result["duration_s"], result["cpu_s"]
            latency = {"p50_ms": result["p50_ms"], "p99_ms": result["p99_ms"]}
        elif args.generator == "wrk":
            rate, generator_cpu = await asyncio.to_thread(wrk_load, ports, args.bodies_file, seconds, args.concurrency)
        else:
            rate, generator_cpu = await python_load(ports, bodies, seconds, args.concurrency)
        if measured:
            elapsed = time.perf_counter() - cpu[2]
            service_cores = (snapshot_cpu(pids)[1] - cpu[1]) / elapsed
            return {"decisions_per_s": rate, "foreign_cores": foreign_cores(pids, cpu, generator_cpu),
                    "generator_cores": generator_cpu / elapsed, "service_cores": service_cores,
                    "service_us_per_decision": service_cores / rate * 1e6,
                    "generator_us_per_decision": generator_cpu / elapsed / rate * 1e6, **latency}  # fmt: skip
    raise AssertionError("unreachable")


def cell_line(what: str, cell: dict[str, float]) -> str:
    return (f"{what}: {cell['decisions_per_s']:.0f} decisions/s; CPU in cores: services {cell['service_cores']:.2f}, "
            f"generator {cell['generator_cores']:.2f}, foreign {cell['foreign_cores']:.2f}")  # fmt: skip


async def part_throughput(server: EmbeddedNats, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    bodies = prompts(256, args.prompt_tokens)
    results: dict[str, list[dict[str, float]]] = {"1": [], "2": []}
    for repeat in range(args.repeat):
        for n in (1, 2) if repeat % 2 == 0 else (2, 1):
            replicas = [RouterProcess(work, "--nats-url", server.url, "--replica-sync").start() for _ in range(n)]
            try:
                register_workers(*replicas)
                cell = await throughput_cell(replicas, server.pid or 0, args, bodies)
                results[str(n)].append(cell)
                log(cell_line(f"throughput: {n} replica(s), run {repeat + 1}", cell))
            finally:
                for replica in replicas:
                    replica.stop()
    best = {n: max(cells, key=lambda c: c["decisions_per_s"]) for n, cells in results.items()}
    return {
        "one": best["1"],
        "two": best["2"],
        "ratio": best["2"]["decisions_per_s"] / best["1"]["decisions_per_s"],
        "runs": results,
    }


async def part_processes(server: EmbeddedNats, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``kv-router serve --processes N`` (one port, SO_REUSEPORT): 1 against 2 processes."""
    bodies = prompts(256, args.prompt_tokens)
    results: dict[str, list[dict[str, float]]] = {"1": [], "2": []}
    for repeat in range(args.repeat):
        for n in (1, 2) if repeat % 2 == 0 else (2, 1):
            service = RouterProcess(work, "--nats-url", server.url, "--processes", str(n)).start()
            try:
                # Every child listening: the port answers as soon as one is, and until the other
                # listens the kernel hands it no connection (a readiness check would see one child).
                wait_listening(service.port, n, timeout_s=60.0)
                register_workers(service)
                # As many connections as two replicas get in the replica cells, spread by the kernel.
                cell = await throughput_cell([service, service], server.pid or 0, args, bodies)
                results[str(n)].append(cell)
                log(cell_line(f"processes: {n}, run {repeat + 1}", cell))
            finally:
                service.stop()
    best = {n: max(cells, key=lambda c: c["decisions_per_s"]) for n, cells in results.items()}
    median = {n: statistics.median(c["decisions_per_s"] for c in cells) for n, cells in results.items()}
    return {"one": best["1"], "two": best["2"], "ratio": best["2"]["decisions_per_s"] / best["1"]["decisions_per_s"],
            "median_ratio": median["2"] / median["1"], "runs": results}  # fmt: skip


async def paced_load(port: int, bodies: list[bytes], rate: float, seconds: float, tag: str) -> float:
    """An open loop of ``rate`` decisions/s (each then freed) over 8 connections to ``port`` for
    ``seconds``; the rate reached."""
    connections = [await Connection.open(port) for _ in range(8)]
    locks = [asyncio.Lock() for _ in connections]
    interval = 1.0 / rate

    async def paced(index: int) -> None:
        async with locks[index % len(locks)]:
            connection = connections[index % len(connections)]
            request_id = f"{tag}-{index}".encode()
            body = b'{"request_id":"%s","tokens":%s}' % (request_id, bodies[index % len(bodies)])
            await connection.ok(b"POST", b"/v1/new", body)
            await connection.ok(b"POST", b"/v1/mark_free", b'{"request_id":"%s"}' % request_id)

    sent = 0
    tasks = []
    started = time.perf_counter()
    try:
        while (now := time.perf_counter()) - started < seconds:
            due = started + sent * interval
            if due > now:
                await asyncio.sleep(due - now)
            tasks.append(asyncio.create_task(paced(sent)))
            sent += 1
        await asyncio.gather(*tasks)
        return sent / (time.perf_counter() - started)
    finally:
        for connection in connections:
            connection.close()


async def part_lag(server: EmbeddedNats, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    bodies = prompts(256, args.prompt_tokens, seed=1)
    replicas = [RouterProcess(work, "--nats-url", server.url, "--replica-sync").start() for _ in range(2)]
    try:
        register_workers(*replicas)
        rate = await paced_load(replicas[0].port, bodies, args.lag_rate, args.seconds, "lag")
        await asyncio.sleep(0.2)
        peer = replicas[1].port
        lag = {q: metric(peer, "kv_router_replica_sync_lag_seconds", quantile=q) for q in ("0.5", "0.9", "0.99")}
        applied = metric(peer, "kv_router_replica_sync_changes_total", outcome="applied")
        return {"rate": rate, "lag_s": lag, "changes_applied": applied}
    finally:
        for replica in replicas:
            replica.stop()


async def part_sync_cost(server: EmbeddedNats, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """What replica sync costs per decision, at a pace that saturates nothing: ``--lag-rate``
    decisions/s on replica 0 of 1 and of 2 ``--replica-sync`` replicas; the CPU of every replica and
    the nats-server per decision (CPU time: what other processes take does not count, unlike in the
    saturated cells). The difference is what the second replica's view costs: replica 0 publishing,
    replica 1 receiving and applying, the server passing it on."""
    bodies = prompts(256, args.prompt_tokens, seed=6)
    runs: dict[str, list[float]] = {"1": [], "2": []}
    for repeat in range(args.repeat):
        for n in (1, 2) if repeat % 2 == 0 else (2, 1):
            replicas = [RouterProcess(work, "--nats-url", server.url, "--replica-sync").start() for _ in range(n)]
            try:
                register_workers(*replicas)
                tag = f"cost-{n}-{repeat}"
                await paced_load(replicas[0].port, bodies, args.lag_rate, 1.0, f"{tag}-warm")
                pids = [*(replica.pid for replica in replicas), server.pid or 0]
                cpu = sum(process_cpu_s(pid) for pid in pids)
                rate = await paced_load(replicas[0].port, bodies, args.lag_rate, args.seconds, tag)
                decisions = rate * args.seconds
                runs[str(n)].append((sum(process_cpu_s(pid) for pid in pids) - cpu) / decisions)
                log(f"sync cost: {n} replica(s), run {repeat + 1}: {runs[str(n)][-1] * 1e6:.0f} us of CPU per decision "
                    f"at {rate:.0f} decisions/s")  # fmt: skip
            finally:
                for replica in replicas:
                    replica.stop()
    best = {n: min(costs) for n, costs in runs.items()}
    return {"rate": args.lag_rate, "cpu_per_decision_s": best, "sync_s": best["2"] - best["1"], "runs": runs}


async def publish_blocks(url: str, blocks: int, first_event: int, per_event: int = 64, seed: int = 0) -> int:
    """Store ``blocks`` blocks spread over the workers as root chains of ``per_event`` blocks;
    returns the next event id (each worker's stream numbered alike)."""
    nc = await connect(NatsOptions(url))
    rng = random.Random(seed)
    subjects = Subjects()
    event_id = first_event
    remaining = blocks
    while remaining > 0:
        for worker_id in range(1, WORKERS + 1):
            count = min(per_event, remaining)
            if count <= 0:
                break
            pairs = [(rng.getrandbits(63), rng.getrandbits(63)) for _ in range(count)]
            event = RouterEvent(worker_id=worker_id, event=stored_event(event_id, pairs))
            await nc.publish(subjects.events(worker_id), encode_router_events(event, msgpack=True))
            remaining -= count
        event_id += 1
    await nc.flush()
    await nc.close()
    return event_id


def indexed_blocks(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kv_router_worker_indexed_blocks{"))  # fmt: skip


def stream_sequence(port: int, kind: str) -> float:
    return metric(port, "kv_router_durable_stream_sequence", kind=kind)


async def snapshot_caught_up(port: int) -> None:
    """Until the newest snapshot covers every stream message applied. The metrics are read in a
    thread: a blocking read here would hold this loop, and the latency probe on it would count that
    wait (each read waits for the router's loop, busy with the snapshot) as the router's."""

    def behind() -> bool:
        return stream_sequence(port, "snapshot") < stream_sequence(port, "applied")

    while await asyncio.to_thread(behind):
        await asyncio.sleep(0.2)


async def latency_probe(port: int, bodies: list[bytes], stop: asyncio.Event) -> list[float]:
    """Decisions back to back on one connection until ``stop``; their latencies in seconds."""
    connection = await Connection.open(port)
    latencies = []
    try:
        while not stop.is_set():
            started = time.perf_counter()
            await connection.ok(b"POST", b"/v1/new", b'{"tokens":%s}' % bodies[len(latencies) % len(bodies)])
            latencies.append(time.perf_counter() - started)
    finally:
        connection.close()
    return latencies


async def part_restart(server: EmbeddedNats, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--nats-url", server.url, "--durable-events", "--router-name", "bench",
             "--snapshot-every-events", "1000000", "--snapshot-every-secs", "2"]  # fmt: skip
    service = RouterProcess(work, *flags).start()
    try:
        register_workers(service)
        started = time.perf_counter()
        next_event = await publish_blocks(server.url, args.blocks, 1)
        while indexed_blocks(service.port) < args.blocks:
            await asyncio.sleep(0.5)
        ingest_s = time.perf_counter() - started
        await snapshot_caught_up(service.port)
        # A few more blocks, then decisions back to back while the next snapshot of the whole index is
        # written: their latency shows how long the snapshot holds the loop.
        snapshots = metric(service.port, "kv_router_durable_events_total", outcome="snapshots")
        stop = asyncio.Event()
        probe = asyncio.create_task(latency_probe(service.port, prompts(64, args.prompt_tokens, seed=2), stop))
        next_event = await publish_blocks(server.url, args.blocks // 100, next_event, seed=1)
        await asyncio.sleep(0.5)
        await snapshot_caught_up(service.port)
        stop.set()
        latencies = sorted(await probe)
        during = metric(service.port, "kv_router_durable_events_total", outcome="snapshots") - snapshots
        snapshot_bytes = metric(service.port, "kv_router_durable_last_snapshot_bytes")
        # More events after the snapshot: replayed from the stream on restart.
        tail = args.blocks // 20
        await publish_blocks(server.url, tail, next_event, seed=3)
        total = args.blocks + args.blocks // 100 + tail
        while indexed_blocks(service.port) < total:
            await asyncio.sleep(0.2)
        os.kill(service.pid, signal.SIGKILL)
        service.process.wait(10)  # type: ignore[union-attr]
        restart_started = time.perf_counter()
        service = RouterProcess(work, *flags, port=service.port).start(timeout=300)
        ready_s = time.perf_counter() - restart_started
        restored = indexed_blocks(service.port)
        return {"blocks": total, "ingest_s": ingest_s, "snapshot_mb": snapshot_bytes / 1e6, "ready_s": ready_s,
                "restored_blocks": restored, "tail_blocks": tail, "snapshots_during_probe": during,
                "probe_decisions": len(latencies), "probe_p50_ms": latencies[len(latencies) // 2] * 1e3,
                "probe_p99_ms": latencies[int(len(latencies) * 0.99)] * 1e3,
                "probe_max_ms": latencies[-1] * 1e3}  # fmt: skip
    finally:
        service.stop()


class LoopWatch:
    """The loop's turns, the cyclic GC's passes and named phases, each with its time, in this process:
    the longest gaps between two turns and what ran meanwhile. A thread samples the loop thread's
    stack once a turn is ``SAMPLE_AFTER_S`` late, so a stall names the code that held the loop."""

    SAMPLE_AFTER_S = 0.004

    def __init__(self) -> None:
        self.turns: list[tuple[float, float, float]] = []  # (at, wall gap, CPU gap)
        self.collections: list[tuple[float, float, int]] = []  # (start, end, generation)
        self.phases: list[tuple[float, float, str]] = []
        self.samples: list[tuple[float, str]] = []  # (at, innermost frames of the loop thread)
        self._collecting = 0.0
        self._running = False
        self._last_turn = time.perf_counter()
        self._loop_thread = threading.get_ident()

    def _sample(self) -> None:
        while self._running:
            time.sleep(0.001)
            if time.perf_counter() - self._last_turn > self.SAMPLE_AFTER_S:
                frame = sys._current_frames().get(self._loop_thread)
                if frame is not None:
                    stack = traceback.extract_stack(frame)[-3:]
                    where = " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(stack))
                    self.samples.append((time.perf_counter(), where))

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._collecting = now
        else:
            self.collections.append((self._collecting, now, info["generation"]))

    async def _tick(self) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        while self._running:
            await asyncio.sleep(0)
            now_wall, now_cpu = time.perf_counter(), time.process_time()
            self.turns.append((now_wall, now_wall - wall, now_cpu - cpu))
            wall, cpu = now_wall, now_cpu
            self._last_turn = now_wall

    def phase(self, owner: Any, method: str) -> None:
        """Time every call of the coroutine method ``owner.method`` as a phase of that name (until
        ``del owner.method``)."""
        wrapped = getattr(owner, method)

        async def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return await wrapped(*args, **kwargs)
            finally:
                self.phases.append((started, time.perf_counter(), method))

        setattr(owner, method, timed)

    def __enter__(self) -> LoopWatch:
        self._running = True
        self._ticker = asyncio.get_running_loop().create_task(self._tick())
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *_: object) -> None:
        self._running = False
        self._sampler.join()
        gc.callbacks.remove(self._on_gc)

    def longest(self, count: int = 5) -> list[dict[str, Any]]:
        """The ``count`` longest gaps (wall), each with its CPU share, the phase and the GC passes in it."""
        out = []
        for at, wall, cpu in sorted(self.turns, key=lambda turn: -turn[1])[:count]:
            since = at - wall
            gcs = [(end - start, gen) for start, end, gen in self.collections if start < at and end > since]
            phase = next((name for start, end, name in self.phases if start <= at <= end), "between")
            held_by = list(dict.fromkeys(where for sampled, where in self.samples if since < sampled <= at))
            out.append({"wall_ms": wall * 1e3, "cpu_ms": cpu * 1e3, "phase": phase,
                        "gc_ms": [f"gen{gen} {d * 1e3:.1f}" for d, gen in gcs], "held_by": held_by[:3]})  # fmt: skip
        return out


async def part_stall(server: EmbeddedNats, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """In this process: a router of ``--blocks`` blocks on the real nats-server writes its snapshot
    (encode, then the Object Store put, twice: the second also deletes the first's chunks) while a
    task decides back to back; the longest loop stalls, with the snapshot phase and the GC passes
    they overlap."""
    router = KvRouter(RouterConfig(block_size=BLOCK_SIZE))
    for worker_id in range(1, WORKERS + 1):
        router.register_worker(WorkerConfig(worker_id=worker_id, total_kv_blocks=1 << 20))
    rng = random.Random(4)
    per_event = 64
    for n in range(args.blocks // per_event):
        pairs = [(rng.getrandbits(63), rng.getrandbits(63)) for _ in range(per_event)]
        router.sequencer.ingest([RouterEvent(worker_id=1 + n % WORKERS, event=stored_event(1 + n // WORKERS, pairs))])
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    nc = await connect(NatsOptions(server.url))
    # Its own namespace: the restart part's stream and snapshots (same server) stay out of this index.
    durable = DurableEvents(router, nc, namespace="stall", router_name="stall", snapshot_every_events=1 << 40,
                            snapshot_every_s=1e9)  # fmt: skip
    results: dict[str, Any] = {"gc_frozen": args.gc_freeze, "gc_tracked": len(gc.get_objects())}
    try:
        await durable.restore()
        await durable.start()
        bodies = [json.loads(body) for body in prompts(64, args.prompt_tokens, seed=5)]
        running = True

        async def decide() -> int:
            done = 0
            while running:
                await router.new(RouteRequest(tokens=bodies[done % len(bodies)], request_id=f"stall-{done}"))
                router.mark_free(f"stall-{done}")
                done += 1
                await asyncio.sleep(0)
            return done

        store = durable._store
        assert store is not None
        for attempt in ("first", "replacing"):
            watch = LoopWatch()
            for owner, method in ((store, "put"), (durable, "encode_snapshot"), (durable, "_record_cursor"),
                                  (durable, "_purge")):  # fmt: skip
                watch.phase(owner, method)
            running = True
            with watch:
                deciding = asyncio.create_task(decide())
                started = time.perf_counter()
                assert await durable.write_snapshot()
                elapsed = time.perf_counter() - started
                running = False
                decisions = await deciding
            del store.put, durable.encode_snapshot, durable._record_cursor, durable._purge
            phases = {name: end - start for start, end, name in watch.phases}
            results[attempt] = {
                "write_s": elapsed, "encode_s": phases["encode_snapshot"], "put_s": phases["put"],
                "decisions": decisions,
                "max_wall_ms": max(t[1] for t in watch.turns) * 1e3, "max_cpu_ms": max(t[2] for t in watch.turns) * 1e3,
                "gc_passes": {f"gen{g}": sum(1 for c in watch.collections if c[2] == g) for g in (0, 1, 2)},
                "gc_max_ms": max((end - start for start, end, _ in watch.collections), default=0.0) * 1e3,
                "longest": watch.longest(),
            }  # fmt: skip
            log(f"stall ({attempt} snapshot): {json.dumps(results[attempt])}")
        results["snapshot_mb"] = durable.last_snapshot_bytes / 1e6
    finally:
        await durable.stop()
        await nc.close()
    return results


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    outcome: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="replicas-bench-") as tmp, EmbeddedNats(store_dir=tmp) as server:
        work = Path(tmp)
        args.bodies_file = work / "prompts.jsonl"
        args.bodies_file.write_bytes(b"\n".join(prompts(256, args.prompt_tokens)) + b"\n")
        outcome["generator"] = args.generator
        if args.generator == "c":
            args.loadgen = build_loadgen(work)
        if "throughput" in args.parts:
            outcome["throughput"] = await part_throughput(server, work, args)
        if "processes" in args.parts:
            outcome["processes"] = await part_processes(server, work, args)
        if "lag" in args.parts:
            outcome["lag"] = await part_lag(server, work, args)
        if "sync-cost" in args.parts:
            outcome["sync_cost"] = await part_sync_cost(server, work, args)
        if "restart" in args.parts:
            outcome["restart"] = await part_restart(server, work, args)
        if "stall" in args.parts:
            outcome["stall"] = await part_stall(server, work, args)
    return outcome


def throughput_table(what: str, part: dict[str, Any]) -> list[str]:
    lines = [f"| {what} | run | decisions/s | services (cores) | generator (cores) | foreign (cores) | "
             "services µs / decision | generator µs / decision |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for n, cells in part["runs"].items():
        for run, c in enumerate(cells, 1):
            lines.append(f"| {n} | {run} | {c['decisions_per_s']:.0f} | {c['service_cores']:.2f} | "
                         f"{c['generator_cores']:.2f} | {c['foreign_cores']:.2f} | "
                         f"{c['service_us_per_decision']:.0f} | {c['generator_us_per_decision']:.1f} |")  # fmt: skip
    for n, cells in part["runs"].items():
        rates = sorted(c["decisions_per_s"] for c in cells)
        costs = sorted(c["service_us_per_decision"] for c in cells)
        lines.append(f"\n{what} {n}: decisions/s min {rates[0]:.0f} / median {statistics.median(rates):.0f} / max "
                     f"{rates[-1]:.0f}; services µs per decision min {costs[0]:.0f} / median "
                     f"{statistics.median(costs):.0f} / max {costs[-1]:.0f} ({len(cells)} runs)")  # fmt: skip
    return lines


def report(outcome: dict[str, Any]) -> str:
    lines = [f"load generator: {outcome['generator']}\n"]
    if "throughput" in outcome:
        t = outcome["throughput"]
        lines.extend(throughput_table("replicas", t))
        lines.append(f"\n2 replicas / 1 replica: **{t['ratio']:.2f}x** (best run of each)\n")
    if "processes" in outcome:
        p = outcome["processes"]
        lines.extend(throughput_table("--processes", p))
        lines.append(f"\n--processes 2 / --processes 1: **{p['ratio']:.2f}x** (best run of each), "
                     f"**{p['median_ratio']:.2f}x** (median of each)\n")  # fmt: skip
    if "lag" in outcome:
        lag = outcome["lag"]
        lines.append(f"sync lag at {lag['rate']:.0f} decisions/s: p50 {lag['lag_s']['0.5'] * 1e3:.2f} ms, "
                     f"p90 {lag['lag_s']['0.9'] * 1e3:.2f} ms, p99 {lag['lag_s']['0.99'] * 1e3:.2f} ms "
                     f"({lag['changes_applied']:.0f} changes applied by the peer)\n")  # fmt: skip
    if "sync_cost" in outcome:
        c = outcome["sync_cost"]
        one, two = (c["cpu_per_decision_s"][n] * 1e6 for n in ("1", "2"))
        lines.append(f"CPU per decision at {c['rate']:.0f} decisions/s (replicas + nats-server, best run): "
                     f"1 replica {one:.0f} us, 2 replicas {two:.0f} us: replica sync costs **{two - one:.0f} us** "
                     "per decision\n")  # fmt: skip
    if "restart" in outcome:
        r = outcome["restart"]
        lines.append(
            f"decisions while {r['snapshots_during_probe']:.0f} snapshot(s) of the index were written "
            f"({r['snapshot_mb']:.1f} MB): {r['probe_decisions']} back to back, latency p50 "
            f"{r['probe_p50_ms']:.1f} ms, p99 {r['probe_p99_ms']:.1f} ms, max **{r['probe_max_ms']:.1f} ms**"
        )
        lines.append(f"restart to ready with {r['blocks']:,} indexed blocks (snapshot {r['snapshot_mb']:.1f} MB + "
                     f"{r['tail_blocks']:,} blocks only in the stream): **{r['ready_s']:.2f} s**; restored "
                     f"{r['restored_blocks']:,.0f} blocks; first ingest took {r['ingest_s']:.1f} s")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="throughput,processes,lag,restart")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8, help="connections per replica")
    parser.add_argument("--generator", choices=("auto", "c", "wrk", "python"), default="auto",
                        help="load generator of the throughput parts: c (bench/loadgen.c, a few µs per "
                        "decision), wrk (~110 µs), python (~150 µs); auto: c with a C compiler, else wrk")  # fmt: skip
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--lag-rate", type=float, default=1000.0)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=False,
                        help="stall part: gc.freeze() once the index is built, as the service does")  # fmt: skip
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.generator == "auto":
        compiler = shutil.which("cc") or shutil.which("gcc")
        args.generator = "c" if compiler else "wrk" if shutil.which("wrk") else "python"
    log(f"load generator: {args.generator}")
    outcome = asyncio.run(bench(args))
    print(json.dumps(outcome, indent=2) if args.json else report(outcome))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

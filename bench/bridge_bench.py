"""The engine path: a vLLM-format ZMQ publisher -> `kv-router bridge` -> NATS -> a router's index.

    python bench/bridge_bench.py throughput [--batches 20000] [--blocks 32]
    python bench/bridge_bench.py lag [--seconds 10] [--blocks-per-s 100000]

``throughput``: an engine process publishes ``--batches`` pre-encoded batches flat out (each stores
``--blocks`` new blocks with their token ids under the root, as two BlockStored events, and removes
the previous batch's blocks, so every index stays small); the bridge runs in this process on one
core, started as ``kv-router bridge`` starts it (`Bridge.start_service`), and its CPU time is measured
from its first batch to its last, flushed to NATS. Reported: blocks per CPU-second of the bridge (the
figure that matters on one core), per wall second, and the NATS messages it sent.

``lag``: engine, bridge (a ``kv-router bridge`` process) and router (this process: NATS subscriber ->
sequencer -> index) apart; the engine paces ``--blocks-per-s`` in 1 ms batches and encodes its send
time (µs) in each batch's first block hash, the router measures publish-to-applied for every batch.
Reported: p50 / p99 / max lag. All three share the machine (and one clock).

``path`` (``--batches 2000``, ``--generate-only`` for the count to subtract): the same payloads through
the stream and the sink in this process, without sockets, into a NATS client that drops them: the
path to count instructions of (``valgrind --tool=callgrind``), which timing noise cannot move.

``KV_ROUTER_BENCH_TREE=/path/to/checkout`` measures that checkout's bridge with this same bench (the
peer of a before / after comparison).
Targets (issue 12): throughput >= 500k blocks/s on one core; lag p99 < 20 ms at 100k blocks/s.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import cast

from nats.aio.client import Client

# The tree whose bridge is measured: this one, or a peer's (KV_ROUTER_BENCH_TREE) run by this same bench.
ROOT = Path(os.environ.get("KV_ROUTER_BENCH_TREE") or Path(__file__).resolve().parents[1]).resolve()
sys.path.insert(0, str(ROOT))

from indexer.events import RouterEvent  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.engines.bridge import Bridge, PublisherSink  # noqa: E402
from router.engines.bridge_config import BridgeConfig  # noqa: E402
from router.engines.zmq_stream import ZmqEngineStream  # noqa: E402
from router.event_plane.connection import NatsOptions, connect  # noqa: E402
from router.event_plane.embedded_server import EmbeddedNats, free_port  # noqa: E402
from router.event_plane.publisher import KvEventPublisher  # noqa: E402
from router.event_plane.subscriber import KvEventSubscriber  # noqa: E402
from router.kv_router import KvRouter  # noqa: E402
from router.types import WorkerConfig  # noqa: E402

BLOCK = 16
WORKER = 1

# The engine: its own process, so its CPU is not the bridge's. Reads argv (or ARGS, when `path` runs it in
# this process for its payloads only): endpoint mode batches blocks rate.
ENGINE = r"""
import sys, time, random, msgspec, zmq
args = globals().get("ARGS") or sys.argv
endpoint, mode, batches, blocks, rate = args[1], args[2], int(args[3]), int(args[4]), float(args[5])
BLOCK = 16
enc = msgspec.msgpack.Encoder().encode
rng = random.Random(0)
tokens = [rng.randrange(1 << 17) for _ in range(blocks * BLOCK)]
if mode != "path":
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB); pub.setsockopt(zmq.SNDHWM, 0); pub.bind(endpoint)
    time.sleep(1.5)  # let the bridge join (the bench waits as long)
def batch(i, first):
    half = blocks // 2
    tokens[0] = i & 0xFFFF  # each batch's prompt is another one, as its block hashes say
    hashes = [first] + [(i << 20) + j + 1 for j in range(1, blocks)]
    events = [
        {"type": "BlockStored", "block_hashes": hashes[:half], "parent_block_hash": None,
         "token_ids": tokens[: half * BLOCK], "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockStored", "block_hashes": hashes[half:], "parent_block_hash": hashes[half - 1],
         "token_ids": tokens[half * BLOCK :], "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None},
    ]
    if i:
        events.append({"type": "BlockRemoved", "block_hashes": previous[i % 2], "medium": "GPU"})
    previous[(i + 1) % 2] = hashes
    return enc([time.time(), events, 0])
previous = {0: [], 1: []}
if mode == "path":
    payloads = [batch(i, (i << 20)) for i in range(batches)]
elif mode == "throughput":
    payloads = [batch(i, (i << 20)) for i in range(batches)]
    for seq, payload in enumerate(payloads):
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
else:
    interval = blocks / rate
    start = time.perf_counter()
    for seq in range(batches):
        due = start + seq * interval
        wait = due - time.perf_counter()
        if wait > 0:
            time.sleep(wait)  # not a spin: the bridge and the router share the two cores
        first = (time.time_ns() // 1000) << 8  # the send time, in the first block hash
        pub.send_multipart([b"", seq.to_bytes(8, "big"), batch(seq, first)])
time.sleep(2)
"""


def _engine(
    endpoint: str, mode: str, batches: int, blocks: int, rate: float, *, own_session: bool = False
) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-c", ENGINE, endpoint, mode, str(batches), str(blocks), str(rate)]
    return subprocess.Popen(argv, start_new_session=own_session)


async def throughput(batches: int, blocks: int) -> None:
    with EmbeddedNats() as server:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        nc = await connect(NatsOptions(server.url))
        # Room for every batch (a peer tree from before the byte bound takes the count alone).
        room = {"queue_bytes": 1 << 40} if "queue_bytes" in BridgeConfig.__struct_fields__ else {}
        config = BridgeConfig(worker_id=WORKER, zmq_endpoint=endpoint, block_size=BLOCK, queue_size=batches + 1, **room)
        bridge = Bridge(config, nc)
        # Started as `kv-router bridge` starts it (gc.freeze() after start); a peer tree from before
        # `start_service` froze at the same point in its `run_until`. Before the engine: a start
        # slower than the engine's 1.5 s wait (under valgrind) would miss its batches.
        start_service = getattr(bridge, "start_service", None)
        if start_service is None:
            await bridge.start()
            gc.freeze()
        else:
            await start_service()
        engine = _engine(endpoint, "throughput", batches, blocks, 0)
        stream = bridge.streams[0]
        try:
            deadline = time.monotonic() + 120
            while stream.stats["applied"] == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.0005)
            cpu0, wall0 = time.process_time(), time.perf_counter()
            applied0, sent0 = stream.stats["applied"], nc.stats["out_msgs"]
            deadline = time.monotonic() + 120
            while stream.stats["applied"] < batches and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
            await nc.flush()
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            done, sent = stream.stats["applied"] - applied0, nc.stats["out_msgs"] - sent0
        finally:
            engine.wait(timeout=60)
            await bridge.stop()
            await nc.close()
    if not done:
        print("no batch reached the bridge")
        return
    stored = done * blocks
    print(f"bridge throughput: {done} batches x {blocks} stored blocks (+ as many removed)")
    print(f"  stored blocks per bridge CPU-second: {stored / cpu:,.0f}   per wall second: {stored / wall:,.0f}")
    dropped = stream.stats["dropped_queue_full"]
    print(f"  stored+removed blocks per CPU-second: {2 * stored / cpu:,.0f}   dropped: {dropped}")
    print(f"  NATS messages sent: {sent:,} ({done / max(sent, 1):.1f} engine batches each, heartbeats included)")


class _DroppingNats:
    """A NATS client that takes what it is given and sends nothing: the `path` mode's sink end."""

    max_payload = 1 << 20

    async def publish(self, subject: str, payload: bytes, headers: dict[str, str] | None = None) -> None:
        pass


async def path(batches: int, blocks: int, *, generate_only: bool) -> None:
    """The bridge's per-batch path without sockets, for instruction counts (callgrind): the engine's
    payloads through `ZmqEngineStream.take_live` and `PublisherSink`, one NATS message per batch."""
    scope: dict[str, object] = {"ARGS": ["", "", "path", str(batches), str(blocks), "0"]}
    exec(ENGINE, scope)
    payloads = cast(list[bytes], scope["payloads"])
    if generate_only:  # the count to subtract: the interpreter's start and the payloads' generation
        return
    publisher = KvEventPublisher(cast(Client, _DroppingNats()), WorkerConfig(worker_id=WORKER, block_size=BLOCK))
    sink = PublisherSink(publisher)
    stream = ZmqEngineStream(sink, "tcp://127.0.0.1:1", block_size=BLOCK)
    for seq, payload in enumerate(payloads):
        async with sink.batch():
            await stream.take_live(seq, payload)
    print(f"bridge path: {stream.stats['applied']} batches x {blocks} stored blocks applied")


async def lag(seconds: float, rate: float, blocks: int, *, own_sessions: bool = False) -> None:
    batches = int(seconds * rate / blocks)
    with EmbeddedNats() as server:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        router = KvRouter(RouterConfig(block_size=BLOCK))
        router.register_worker(WorkerConfig(worker_id=WORKER, block_size=BLOCK, leased=False))
        nc = await connect(NatsOptions(server.url))
        subscriber = KvEventSubscriber(nc, router.sequencer)
        lags: list[float] = []
        ingest = router.sequencer.ingest
        apply_cpu = [0.0]

        def timed(events: list[RouterEvent], *, epoch: str | None = None) -> None:
            started = time.thread_time()
            ingest(events, epoch=epoch)
            apply_cpu[0] += time.thread_time() - started
            now_us = time.time_ns() // 1000
            for event in events:
                stored = event.event.stored
                if stored is not None and stored.parent_hash is None:
                    lags.append((now_us - (stored.blocks[0].block_hash >> 8)) / 1000.0)

        router.sequencer.ingest = timed  # type: ignore[method-assign]
        await subscriber.start()
        beat = asyncio.Event()

        async def on_beat(_: object) -> None:
            beat.set()

        heartbeats = await nc.subscribe(f"kv.default.heartbeat.{WORKER}", cb=on_beat)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        bridge = subprocess.Popen(
            [sys.executable, "-m", "api.cli", "bridge", "--worker-id", str(WORKER), "--zmq-endpoint", endpoint,
             "--block-size", str(BLOCK), "--nats-url", server.url],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=own_sessions,
        )  # fmt: skip
        await asyncio.wait_for(beat.wait(), timeout=60)  # the bridge is up (it beats once started)
        await heartbeats.unsubscribe()
        engine = _engine(endpoint, "lag", batches, blocks, rate, own_session=own_sessions)
        try:
            await asyncio.sleep(1.5)  # the engine lets the bridge join before it sends
            bridge_cpu0, router_cpu0, wall0 = _cpu_seconds(bridge.pid), time.process_time(), time.perf_counter()
            deadline = time.monotonic() + seconds + 30
            while len(lags) < batches and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            wall = time.perf_counter() - wall0
            bridge_cpu, router_cpu = _cpu_seconds(bridge.pid) - bridge_cpu0, time.process_time() - router_cpu0
        finally:
            engine.wait(timeout=60)
            bridge.terminate()
            bridge.wait(timeout=10)
            await subscriber.stop()
            await nc.close()
    in_order = list(lags)
    lags.sort()
    if not lags:
        print("no batch reached the router")
        return

    def pct(q: float) -> float:
        return lags[min(len(lags) - 1, int(q * len(lags)))]

    print(f"engine-to-routable lag at {rate:,.0f} blocks/s ({blocks} blocks per batch), {len(lags)}/{batches} batches:")
    print(f"  p50 {pct(0.5):.2f} ms   p90 {pct(0.9):.2f} ms   p99 {pct(0.99):.2f} ms   max {lags[-1]:.2f} ms")
    tenth = max(1, len(in_order) // 10)
    worst = [max(in_order[start : start + tenth]) for start in range(0, len(in_order), tenth)]
    print("  worst lag per tenth of the run (ms): " + " ".join(f"{value:.0f}" for value in worst))
    per_batch = apply_cpu[0] / len(lags) * 1e6
    print(
        f"  share of one core: bridge {bridge_cpu / wall:.0%}, router process {router_cpu / wall:.0%} "
        f"(of which applying events {apply_cpu[0] / wall:.0%}: {per_batch:.0f} µs per engine batch)"
    )


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of another process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["throughput", "lag", "path"])
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--blocks", type=int, default=32, help="stored blocks per batch (throughput)")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--blocks-per-s", type=float, default=100_000)
    parser.add_argument("--lag-blocks", type=int, default=100, help="stored blocks per 1 ms batch (lag)")
    parser.add_argument(
        "--own-sessions",
        action="store_true",
        help="lag: the engine and the bridge each in a session of its own, as separate services are (the "
        "kernel's autogroups give each session an equal share; in the bench's they split one)",
    )
    parser.add_argument("--generate-only", action="store_true", help="path: only make the payloads")
    args = parser.parse_args()
    if args.mode == "throughput":
        asyncio.run(throughput(args.batches, args.blocks))
    elif args.mode == "path":
        asyncio.run(path(args.batches, args.blocks, generate_only=args.generate_only))
    else:
        asyncio.run(lag(args.seconds, args.blocks_per_s, args.lag_blocks, own_sessions=args.own_sessions))


if __name__ == "__main__":
    main()

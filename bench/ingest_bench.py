"""Event ingestion under load: a publisher process floods KV events through NATS while the router
makes 1,000 decisions per second.

    python bench/ingest_bench.py [--seconds 20] [--workers 8] [--decisions-per-s 1000]

It starts a private nats-server, a router (KvRouter + RouterEventPlane) in this process and a
publisher process with N KvEventPublishers that store 16-block chunks of new 64-block documents and
evict the oldest documents leaf-first once each worker holds --capacity blocks. Reported: blocks
applied per second (sustained, over the run), event lag p50/p99 (publish to applied, from both
processes' wall clocks sampled every 10 ms), and decision latency p50/p99 measured from each
decision's scheduled start (so time spent waiting behind event processing counts). The router is
pinned to CPU 0, the publisher and nats-server to CPU 1, so the two sides do not steal each other's
core (``--no-pin`` to let the OS decide).
Target: >= 100k blocks/s applied with decision p99 under 5 ms. ``--blocks-per-s 0`` publishes flat out
to find the ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from indexer.hashing import compute_sequence_hashes
from router.config import RouterConfig
from router.event_plane.connection import NatsOptions, connect
from router.event_plane.embedded_server import EmbeddedNats
from router.event_plane.plane import RouterEventPlane
from router.event_plane.publisher import KvEventPublisher
from router.kv_router import KvRouter
from router.types import RouteRequest, WorkerConfig

BLOCK_SIZE = 16
DOC_BLOCKS = 64
CHUNK_BLOCKS = 16


async def publish(
    url: str, workers: int, seconds: float, capacity: int, blocks_per_s: float, samples_path: str
) -> None:
    nc = await connect(NatsOptions(url, name="ingest-publisher"))
    rng = random.Random(7)
    publishers = []
    for index in range(workers):
        publisher = KvEventPublisher(nc, WorkerConfig(worker_id=1000 + index, block_size=BLOCK_SIZE))
        await publisher.start()
        publishers.append(publisher)
    await asyncio.sleep(1.0)  # let the router register everyone and finish its first resyncs
    held: list[deque[list[int]]] = [deque() for _ in publishers]
    published_blocks = 0
    samples: list[tuple[float, int]] = []
    started = time.time()
    deadline = started + seconds
    next_sample = 0.0
    while time.time() < deadline:
        if blocks_per_s:
            ahead = published_blocks / blocks_per_s - (time.time() - started)
            if ahead > 0:
                await asyncio.sleep(ahead)
        else:
            await nc.flush()  # flat out, but never beyond what the connection can carry
        for index, publisher in enumerate(publishers):
            local = [rng.getrandbits(64) for _ in range(DOC_BLOCKS)]
            seq = compute_sequence_hashes(local)
            async with publisher.batch():
                while len(held[index]) * DOC_BLOCKS >= capacity:
                    await publisher.removed(list(reversed(held[index].popleft())))
                    published_blocks += DOC_BLOCKS
                for start in range(0, DOC_BLOCKS, CHUNK_BLOCKS):
                    blocks = list(
                        zip(seq[start : start + CHUNK_BLOCKS], local[start : start + CHUNK_BLOCKS], strict=True)
                    )
                    await publisher.stored(blocks, parent_hash=seq[start - 1] if start else None)
                    published_blocks += CHUNK_BLOCKS
            held[index].append(seq)
        now = time.time()
        if now >= next_sample:
            samples.append((now, published_blocks))
            next_sample = now + 0.01
        await asyncio.sleep(0)
    await nc.flush()
    samples.append((time.time(), published_blocks))
    Path(samples_path).write_text(json.dumps(samples))
    for publisher in publishers:
        await publisher.stop()
    await nc.close()


async def route(url: str, args: argparse.Namespace) -> None:
    nc = await connect(NatsOptions(url, name="ingest-router"))
    router = KvRouter(RouterConfig(block_size=BLOCK_SIZE))
    plane = RouterEventPlane(router, nc)
    await plane.start()
    samples_path = Path(args.out_dir) / "publisher_samples.json"
    if args.pin:
        os.sched_setaffinity(0, {0})
    publisher = subprocess.Popen(
        [sys.executable, __file__, "--role", "publisher", "--url", url, "--seconds", str(args.seconds),
         "--workers", str(args.workers), "--capacity", str(args.capacity), "--samples", str(samples_path),
         "--blocks-per-s", str(args.blocks_per_s)]
    )  # fmt: skip
    if args.pin:
        os.sched_setaffinity(publisher.pid, {1})
    applied: list[tuple[float, int]] = []
    latencies_ms: list[float] = []
    service_ms: list[float] = []
    rng = random.Random(11)
    prompts = [[rng.randrange(32000) for _ in range(1024)] for _ in range(64)]

    async def sample_applied() -> None:
        while publisher.poll() is None:
            applied.append((time.time(), plane.sequencer.blocks_applied))
            await asyncio.sleep(0.01)

    async def decide() -> None:
        interval = 1.0 / args.decisions_per_s
        await asyncio.sleep(1.5)
        start = time.perf_counter()
        count = 0
        while publisher.poll() is None:
            scheduled = start + count * interval
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            began = time.perf_counter()
            decision = await router.new(RouteRequest(tokens=prompts[count % len(prompts)], request_id=f"r{count}"))
            done = time.perf_counter()
            router.mark_free(decision.request_id or "")
            latencies_ms.append((done - scheduled) * 1000)
            service_ms.append((done - began) * 1000)
            count += 1

    await asyncio.gather(sample_applied(), decide())
    await asyncio.sleep(0.5)
    applied.append((time.time(), plane.sequencer.blocks_applied))
    published = json.loads(samples_path.read_text())
    await plane.stop()
    await nc.close()
    report(published, applied, latencies_ms, service_ms, plane)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def report(
    published: list[list[float]], applied: list[tuple[float, int]], latencies: list[float], service: list[float],
    plane: RouterEventPlane,
) -> None:  # fmt: skip
    total = published[-1][1]
    first = next(t for t, n in applied if n > 0)
    last = next(t for t, n in applied if n >= total) if applied[-1][1] >= total else applied[-1][0]
    rate = applied[-1][1] / (last - first) if last > first else float("nan")
    pub_counts = [n for _, n in published]
    lags = []
    for t_applied, count in applied:
        index = bisect.bisect_left(pub_counts, count)
        if count and index < len(published):
            lags.append((t_applied - published[index][0]) * 1000)
    print(
        f"published blocks: {total:,}   applied: {applied[-1][1]:,}   "
        f"rejected: {sum(v for k, v in plane.sequencer.outcomes.items() if k.startswith('rejected'))}"
    )
    print(f"sustained apply rate: {rate:,.0f} blocks/s   (target >= 100,000)")
    print(f"event lag ms: p50 {statistics.median(lags):.1f}  p99 {_pct(lags, 0.99):.1f}")
    print(
        f"decisions: {len(latencies):,}   latency from schedule ms: p50 {statistics.median(latencies):.2f}  "
        f"p99 {_pct(latencies, 0.99):.2f}   service ms: p50 {statistics.median(service):.2f}  "
        f"p99 {_pct(service, 0.99):.2f}   (target p99 < 5)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["router", "publisher"], default="router")
    parser.add_argument("--url")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=16384, help="blocks each worker holds before evicting")
    parser.add_argument("--decisions-per-s", type=float, default=1000.0)
    parser.add_argument("--blocks-per-s", type=float, default=150_000, help="publisher's target rate; 0 = flat out")
    parser.add_argument("--samples")
    parser.add_argument(
        "--no-pin", dest="pin", action="store_false", help="do not pin the router to CPU 0 and the rest to CPU 1"
    )
    parser.add_argument("--out-dir", default="/tmp")
    args = parser.parse_args()
    if args.role == "publisher":
        asyncio.run(publish(args.url, args.workers, args.seconds, args.capacity, args.blocks_per_s, args.samples))
        return
    with EmbeddedNats() as server:
        if args.pin and server.pid is not None:
            os.sched_setaffinity(server.pid, {1})
        asyncio.run(route(server.url, args))


if __name__ == "__main__":
    main()

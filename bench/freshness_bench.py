"""Freshness: how long from a worker's publish until its event is routable, when the stream is new,
after a gap (with and without a resync responder), and after nats-server is killed and restarted.

    python bench/freshness_bench.py [--trials 50] [--restarts 5] [--background-events-per-s 1000]

A private nats-server, the service's event plane (`api.plane_lifecycle.PlaneLifecycle` driving a
`KvRouter`) and the publishers all run in this process, on one event loop, over real NATS
connections. Background traffic: four `KvEventPublisher` workers store and evict blocks at
``--background-events-per-s`` for the whole run. "Routable" means the router's index answers the
event's block for that worker (polled every 0.5 ms). The same-run peer is ``steady``: the next event
of a trusted stream, the transport's floor; each scenario is reported with its ratio to it.

Scenarios: ``new stream`` (a Dynamo-style publisher's first event, id 1, no responder), ``new stream
mid-way`` (first id 7: a dump is requested, nobody answers), ``gap, responder`` (a publisher that answers
resyncs loses one event; time for the next to be routable, and until the stream is verified again),
``gap, no responder``, and ``after kill -9`` (nats-server SIGKILLed and restarted on its port; time
from the restarted server being ready until an event published then is routable).
Targets (issue 11): new stream p99 < 50 ms; gap without responder p99 < 100 ms; after a restart < 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from api.config import EventPlaneConfig
from api.plane_lifecycle import PlaneLifecycle
from indexer.events import RouterEvent, encode_router_events, stored_event
from router.config import RouterConfig
from router.event_plane.connection import NatsOptions, connect
from router.event_plane.embedded_server import EmbeddedNats
from router.event_plane.publisher import KvEventPublisher
from router.kv_router import KvRouter
from router.types import WorkerConfig

BLOCK_SIZE = 16
POLL_S = 0.0005


def block(rng: random.Random) -> tuple[int, int]:
    value = rng.getrandbits(63)
    return value, value


async def routable(router: KvRouter, worker_id: int, tokens_hash: int, timeout: float = 30.0) -> float:
    """Wait until the index holds ``tokens_hash`` (as a root block) for ``worker_id``; returns when."""
    deadline = time.perf_counter() + timeout
    while (worker_id, 0) not in router.tree.find_matches([tokens_hash]).scores:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"worker {worker_id}: block never became routable")
        await asyncio.sleep(POLL_S)
    return time.perf_counter()


async def until(condition: Callable[[], bool], timeout: float = 30.0) -> float:
    deadline = time.perf_counter() + timeout
    while not condition():
        if time.perf_counter() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(POLL_S)
    return time.perf_counter()


async def background(url: str, events_per_s: float, stop: asyncio.Event) -> int:
    nc = await connect(NatsOptions(url, name="background"))
    rng = random.Random(1)
    publishers = [KvEventPublisher(nc, WorkerConfig(worker_id=900 + i, block_size=BLOCK_SIZE)) for i in range(4)]
    for publisher in publishers:
        await publisher.start()
    held: list[list[int]] = [[] for _ in publishers]
    sent = 0
    started = time.perf_counter()
    while not stop.is_set():
        index = sent % len(publishers)
        mine = held[index]
        try:
            if len(mine) > 256:
                await publishers[index].removed([mine.pop(0)])
            else:
                pair = block(rng)
                await publishers[index].stored([pair])
                mine.append(pair[0])
        except Exception:  # publishing while NATS restarts: nats-py buffers or refuses; carry on
            pass
        sent += 1
        delay = started + sent / events_per_s - time.perf_counter()
        await asyncio.sleep(max(delay, 0.0))
    for publisher in publishers:
        await publisher.stop()
    await nc.close()
    return sent


def summary(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return statistics.median(ordered), p99


async def run(args: argparse.Namespace) -> None:
    server = EmbeddedNats().start()
    router = KvRouter(RouterConfig(block_size=BLOCK_SIZE))
    lifecycle = PlaneLifecycle(router, EventPlaneConfig(nats_url=server.url, resync_timeout_secs=1.0))
    plane_task = asyncio.create_task(lifecycle.run())
    await until(lambda: lifecycle.ready)
    plane = lifecycle.plane
    assert plane is not None
    stop = asyncio.Event()
    traffic = asyncio.create_task(background(server.url, args.background_events_per_s, stop))
    nc = await connect(NatsOptions(server.url, name="bench-publisher"))
    rng = random.Random(2)
    results: dict[str, list[float]] = {}
    await asyncio.sleep(1.0)

    async def raw(worker_id: int, event_id: int) -> float:
        """Publish one Dynamo-shaped event (no epoch header, no responder); seconds until routable."""
        pair = block(rng)
        payload = encode_router_events(RouterEvent(worker_id, stored_event(event_id, [pair])))
        sent = time.perf_counter()
        await nc.publish(f"kv.default.events.{worker_id}", payload)
        return await routable(router, worker_id, pair[1]) - sent

    next_worker = 1
    for name, first_id in (("new stream", 1), ("new stream mid-way", 7)):
        for _ in range(args.trials):
            await plane.register(WorkerConfig(worker_id=next_worker, block_size=BLOCK_SIZE))
            results.setdefault(name, []).append(await raw(next_worker, first_id))
            next_worker += 1
    # Steady state and gaps without a responder, on one Dynamo-style stream.
    worker = next_worker
    await plane.register(WorkerConfig(worker_id=worker, block_size=BLOCK_SIZE))
    event_id = 1
    await raw(worker, event_id)
    for _ in range(args.trials):
        event_id += 1
        results.setdefault("steady", []).append(await raw(worker, event_id))
        event_id += 2  # one event lost
        results.setdefault("gap, no responder", []).append(await raw(worker, event_id))
        await asyncio.sleep(0.01)
    # Gaps with a responder: a real publisher loses one message.
    publisher = KvEventPublisher(nc, WorkerConfig(worker_id=worker + 1, block_size=BLOCK_SIZE))
    await publisher.start()
    await until(lambda: router.has_worker(publisher.worker_id))
    await publisher.stored([block(rng)])
    real_send = publisher._send
    verified: list[float] = []
    for _ in range(args.trials):

        async def drop(events: list[RouterEvent]) -> None:
            return None

        publisher._send = drop  # type: ignore[method-assign]
        await publisher.stored([block(rng)])
        publisher._send = real_send  # type: ignore[method-assign]
        pair = block(rng)
        sent = time.perf_counter()
        await publisher.stored([pair])
        results.setdefault("gap, responder", []).append(await routable(router, publisher.worker_id, pair[1]) - sent)
        verified.append(await until(lambda: (publisher.worker_id, 0) not in router.sequencer.untrusted) - sent)
    results["gap, responder: verified again"] = verified
    # kill -9 and restart of nats-server.
    after_restart: list[float] = []
    for _ in range(args.restarts):
        assert server.pid is not None
        os.kill(server.pid, signal.SIGKILL)
        await until(lambda: lifecycle.state == "disconnected", timeout=10)
        await asyncio.to_thread(server.restart)
        back = time.perf_counter()
        pair = block(rng)
        await publisher.stored([pair])  # buffered by the client until it has reconnected
        after_restart.append(await routable(router, publisher.worker_id, pair[1]) - back)
        await until(lambda: (publisher.worker_id, 0) not in router.sequencer.untrusted, timeout=30)
    results["after kill -9"] = after_restart
    stop.set()
    sent = await traffic
    await publisher.stop()
    await nc.close()
    plane_task.cancel()
    await asyncio.gather(plane_task, return_exceptions=True)
    await lifecycle.stop()
    server.stop()

    floor = statistics.median(results["steady"])
    print(f"background: {sent} events over the run (~{args.background_events_per_s:.0f}/s); load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")  # fmt: skip
    print(f"{'scenario':<32} {'n':>4} {'p50 ms':>9} {'p99 ms':>9} {'p50 / steady':>13}")
    for name, values in results.items():
        p50, p99 = summary(values)
        print(f"{name:<32} {len(values):>4} {p50 * 1e3:>9.2f} {p99 * 1e3:>9.2f} {p50 / floor:>13.1f}")


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--restarts", type=int, default=5)
    parser.add_argument("--background-events-per-s", type=float, default=1000.0)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()

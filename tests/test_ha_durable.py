"""``kv-router serve --durable-events`` as real processes on a real nats-server with a file store.

Workers here never answer resyncs (their publishers serve no resync subject), so whatever a router
knows after a crash comes from its snapshot and the JetStream stream alone. A router killed with
SIGKILL while events flow comes back with the same index as a router that never crashed; a nats-server
killed with SIGKILL and restarted on its store loses nothing either.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client

from indexer.events import RouterEvent
from indexer.hashing import compute_block_hashes, compute_sequence_hashes
from router.event_plane.connection import NatsOptions, connect
from router.event_plane.embedded_server import EmbeddedNats
from router.event_plane.publisher import KvEventPublisher
from router.event_plane.subjects import Subjects
from router.types import WorkerConfig
from tests.router_processes import RouterProcess
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

WORKER_IDS = (11, 12)
DURABLE = ("--durable-events", "--snapshot-every-events", "40", "--snapshot-every-secs", "0.5")


def canonical(events: list[Any]) -> set[tuple[Any, ...]]:
    """An index dump as the set of (worker, dp_rank, tier, parent, block, tokens hash) it stores:
    equal sets answer every query alike, whatever order the dump lists them in."""
    blocks = set()
    for event in msgspec.convert(events, list[RouterEvent]):
        stored = event.event.stored
        assert stored is not None, "a dump holds only stored events"
        parent = stored.parent_hash
        for block in stored.blocks:
            blocks.add((event.worker_id, event.event.dp_rank, str(event.storage_tier), parent, block.block_hash,
                        block.tokens_hash))  # fmt: skip
            parent = block.block_hash
    return blocks


def dump_of(router: RouterProcess) -> set[tuple[Any, ...]]:
    return canonical(router.get("/v1/dump"))


def truth(publishers: list[KvEventPublisher]) -> set[tuple[Any, ...]]:
    events = [msgspec.to_builtins(e) for p in publishers for e in p.dump_events()]
    return canonical(events)


class Workload:
    """Workers storing chains under their own blocks and removing leaves, numbered per stream."""

    def __init__(self, nc: Client) -> None:
        self.publishers = [KvEventPublisher(nc, WorkerConfig(worker_id=w, block_size=16)) for w in WORKER_IDS]
        self.rng = random.Random(3)
        self.leaves: dict[int, list[int]] = {w: [] for w in WORKER_IDS}
        self.sent = 0

    async def step(self) -> None:
        publisher = self.rng.choice(self.publishers)
        leaves = self.leaves[publisher.worker_id]
        if leaves and self.rng.random() < 0.3:
            await publisher.removed([leaves.pop(self.rng.randrange(len(leaves)))])
        else:
            parent = self.rng.choice(leaves) if leaves and self.rng.random() < 0.5 else None
            tokens = [self.rng.randrange(1 << 31) for _ in range(16 * self.rng.randint(1, 4))]
            local = compute_block_hashes(tokens, 16)
            chain = compute_sequence_hashes(local)
            chain = [(self.rng.randrange(1 << 62) if parent is not None else h) for h in chain]
            if parent is not None and parent in leaves:
                leaves.remove(parent)
            await publisher.stored(list(zip(chain, local, strict=True)), parent_hash=parent)
            leaves.append(chain[-1])
        self.sent += 1

    async def run(self, steps: int, pause_s: float = 0.002) -> None:
        for _ in range(steps):
            await self.step()
            await asyncio.sleep(pause_s)  # a flow over time, as from engines, not one burst


async def converged(routers: list[RouterProcess], workload: Workload, timeout: float = 30.0) -> None:
    expected = truth(workload.publishers)
    for router in routers:
        got: set[tuple[Any, ...]] = set()

        def same(router: RouterProcess = router) -> bool:
            nonlocal got
            got = dump_of(router)
            return got == expected

        try:
            await eventually(same, timeout, f"port {router.port}: the workers' index", in_thread=True, poll=0.1)
        except AssertionError as error:
            raise AssertionError(f"{error}: {len(got ^ expected)} blocks differ") from None


async def register(router: RouterProcess) -> None:
    for worker_id in WORKER_IDS:
        status, body = await asyncio.to_thread(router.post, "/v1/workers", {"worker_id": worker_id})
        assert status in (200, 201), body


async def start(router: RouterProcess) -> RouterProcess:
    return await asyncio.to_thread(router.start)


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    path = tmp_path / "jetstream"
    path.mkdir()
    return path


@pytest.fixture
async def nats_on_disk(store_dir: Path) -> AsyncIterator[EmbeddedNats]:
    server = EmbeddedNats(store_dir=str(store_dir)).start()
    try:
        yield server
    finally:
        server.stop()


async def test_a_router_killed_while_events_flow_comes_back_with_the_same_index(
    nats_on_disk: EmbeddedNats, tmp_path: Path
) -> None:
    url = nats_on_disk.url
    crashing = await start(RouterProcess(tmp_path, "--nats-url", url, *DURABLE, "--router-name", "crashing"))
    steady = await start(RouterProcess(tmp_path, "--nats-url", url, *DURABLE, "--router-name", "steady"))
    nc = await connect(NatsOptions(url))
    flowing: asyncio.Task[None] | None = None
    try:
        await register(steady)
        workload = Workload(nc)
        await workload.run(150)
        flowing = asyncio.create_task(workload.run(150))
        await eventually(lambda: workload.sent >= 150 + 40, what="events flowing")
        # A slow machine may not have written the crashing router's first snapshot yet; it would then
        # come back from its peer's, which is right but not what this test is about.
        await eventually(crashing.wrote_snapshot, 30, "the crashing router's first snapshot", in_thread=True)
        crashing.kill9()  # mid-flow, between snapshots
        await flowing
        await workload.run(30)  # while it is down
        restarted = await start(RouterProcess(tmp_path, *crashing.args[5:], port=crashing.port))
        await workload.run(30)
        await converged([steady, restarted], workload)
        assert await asyncio.to_thread(dump_of, restarted) == await asyncio.to_thread(dump_of, steady)
        assert "loading index snapshot crashing" in restarted.log()

        # Stream data every live router's snapshot covers is purged, nothing newer.
        js = nc.jetstream()
        info = await js.stream_info(Subjects().events_stream)
        assert info.state.first_seq > 1
        assert info.state.first_seq <= info.state.last_seq + 1
    finally:
        if flowing is not None:  # a failed wait above leaves it publishing into a closing connection
            flowing.cancel()
        for router in (crashing, steady):
            router.stop()
        if "restarted" in locals():
            restarted.stop()
        await nc.close()


async def test_nats_server_killed_and_restarted_on_its_store_loses_nothing(
    nats_on_disk: EmbeddedNats, tmp_path: Path
) -> None:
    url = nats_on_disk.url
    router = await start(RouterProcess(tmp_path, "--nats-url", url, *DURABLE, "--router-name", "r"))
    nc = await connect(NatsOptions(url))
    try:
        await register(router)
        workload = Workload(nc)
        await workload.run(100)
        await converged([router], workload)
        assert nats_on_disk.pid is not None
        os.kill(nats_on_disk.pid, signal.SIGKILL)
        await asyncio.to_thread(nats_on_disk.restart)
        await workload.run(100)
        await converged([router], workload)
        # And a router restarted now rebuilds the same index from snapshot and stream alone.
        router.kill9()
        router = await start(RouterProcess(tmp_path, *router.args[5:], port=router.port))
        await converged([router], workload)
    finally:
        router.stop()
        await nc.close()

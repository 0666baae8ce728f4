"""Dynamo 1.6.1's load-model features against its own in-process `KvRouter`: output blocks counted as a
response streams (with and without the expected output length), and the per-request
`RouterConfigOverride` of load tracking, and the minimum number of workers routing waits for.

The requests go through Dynamo's `KvRouter.generate` to dummy workers whose tokens the test releases
one at a time, so Dynamo's router sees the request start, its first token and every output token as
in production. Our router books the same request on the same rank, is told the same first token
(`mark_prefill`) and output progress (`record_output`), and both must report the same potential loads.
Dynamo updates its load tracker asynchronously, so its figure is polled until it matches (or time runs
out and the test fails showing both).
"""

from __future__ import annotations

import asyncio
import os
import select
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from router import KvRouter, RouterConfig, RouteRequest, WorkerConfig
from router.types import RouterConfigOverride
from tests.dynamo_fleet import DynamoFleet, prompt_stored_event
from tests.waiting import eventually

os.environ.setdefault("DYN_LOG", "off")
pytest.importorskip("dynamo._core")

pytestmark = pytest.mark.oracle

BS = 16


class StreamingWorkers:
    """The dummy workers' handler: a request's tokens come out only when the test releases them."""

    def __init__(self) -> None:
        self.releases: dict[tuple[int, ...], asyncio.Queue[int | None]] = {}

    async def __call__(self, request: Any, context: Any = None) -> AsyncIterator[dict[str, Any]]:
        release = self.releases[tuple(request["token_ids"])]
        while (count := await release.get()) is not None:
            for _ in range(count):
                yield {"token_ids": [7]}
        yield {"token_ids": [7], "finish_reason": "stop"}


class Fleet:
    """Dynamo's router over one streaming worker, and ours over the same worker id."""

    def __init__(self, discovery_dir: Path, **config: Any) -> None:
        self.workers = StreamingWorkers()
        self.dynamo = DynamoFleet(str(discovery_dir), BS, handler=self.workers)
        self.config = config
        self.ours: KvRouter | None = None
        self._streams: list[AsyncIterator[Any]] = []
        self._events = 0

    async def __aenter__(self) -> Fleet:
        ranks = await self.dynamo.start([1], **self.config)
        self.ours = KvRouter(RouterConfig(block_size=BS, policy="dynamo", **self.config))
        for worker_id in ranks:
            self.ours.register_worker(WorkerConfig(worker_id=worker_id))
        return self

    async def __aexit__(self, *exc: object) -> None:
        for release in self.workers.releases.values():
            release.put_nowait(None)
        for stream in self._streams:
            async for _ in stream:
                pass
        await self.dynamo.stop()

    async def start(self, request_id: str, tokens: list[int], **routing: Any) -> AsyncIterator[Any]:
        """Route ``tokens`` through both routers; Dynamo's with `generate` (``routing`` goes into the
        request's ``routing`` field, ``router_config_override`` to the request)."""
        assert self.ours is not None
        self.workers.releases[tuple(tokens)] = asyncio.Queue()
        override = routing.pop("router_config_override", None)
        request = {
            "token_ids": tokens,
            "model": "dummy",
            "stop_conditions": {},
            "sampling_options": {},
            "output_options": {},
            "eos_token_ids": [],
            "annotations": [],
            "routing": routing,
            "router_config_override": override,
        }
        stream = (await self.dynamo.router.generate_from_request(request)).__aiter__()
        self._streams.append(stream)
        decision = await self.ours.new(
            RouteRequest(
                tokens=tokens,
                request_id=request_id,
                expected_output_tokens=routing.get("expected_output_tokens"),
                router_config_override=None if override is None else msgspec.convert(override, RouterConfigOverride),
            )
        )
        # Dynamo's approximate index records the routed prompt on its worker; ours hears it as an event.
        rank = (decision.worker_id, decision.dp_rank)
        self._events += 1
        self.ours.apply_event(prompt_stored_event(rank[0], tokens, BS, event_id=self._events))
        await self.dynamo.wait_indexed(tokens, rank)
        return stream

    async def emit(self, tokens: list[int], stream: AsyncIterator[Any], count: int) -> None:
        """Release ``count`` more tokens of the request and wait until Dynamo's router has passed them on."""
        await self.workers.releases[tuple(tokens)].put(count)
        for _ in range(count):
            await stream.__anext__()

    async def same_loads(self, query: list[int], what: str) -> None:
        """Both routers report the same potential loads for ``query`` (Dynamo's polled for a while)."""
        assert self.ours is not None
        ours = [msgspec.structs.asdict(load) for load in self.ours.potential_loads(query)]
        expected = [{key: row[key] for key in row if key != "worker_id"} for row in ours]
        theirs: list[dict[str, int]] = []

        async def alike() -> bool:
            nonlocal theirs
            loads = await self.dynamo.router.get_potential_loads(query)
            theirs = [{key: row[key] for key in row if key != "worker_id"} for row in loads]
            return theirs == expected

        try:
            await eventually(alike, 30, what)
        except AssertionError as error:
            raise AssertionError(f"{error}: Dynamo reports {theirs}, we report {expected}") from None


PROMPT = list(range(1000, 1040))  # 40 tokens: 2 full blocks and a partial one
IDLE_QUERY = [1]  # no full block: its potential load is the rank's active load


@pytest.mark.parametrize(
    ("prompt_tokens", "expected_output_tokens"),
    [(40, None), (40, 20), (40, 45), (48, None), (48, 30)],
    ids=["no-osl", "osl20", "osl45", "whole-blocks", "whole-blocks-osl30"],
)
def test_output_blocks_grow_and_decay_as_dynamos(
    prompt_tokens: int, expected_output_tokens: int | None, tmp_path: Path
) -> None:
    prompt = list(range(1000, 1000 + prompt_tokens))

    async def scenario() -> None:
        async with Fleet(tmp_path, router_track_output_blocks=True) as fleet:
            assert fleet.ours is not None
            routing = {} if expected_output_tokens is None else {"expected_output_tokens": expected_output_tokens}
            stream = await fleet.start("r1", prompt, **routing)
            await fleet.same_loads(IDLE_QUERY, "booked")
            for generated in range(1, 41):
                await fleet.emit(prompt, stream, 1)
                if generated == 1:
                    fleet.ours.mark_prefill("r1")
                assert fleet.ours.record_output("r1", generated)
                await fleet.same_loads(IDLE_QUERY, f"after {generated} tokens")

    asyncio.run(scenario())


def test_only_exclusive_blocks_decay(tmp_path: Path) -> None:
    """Two requests share their first two blocks: the streaming one's decay spares them."""

    async def scenario() -> None:
        async with Fleet(tmp_path, router_track_output_blocks=True) as fleet:
            assert fleet.ours is not None
            other = PROMPT[:32] + list(range(5000, 5040))
            await fleet.start("holder", other)
            long_prompt = PROMPT + list(range(2000, 2040))  # 5 full blocks, the first 2 shared
            stream = await fleet.start("r1", long_prompt, expected_output_tokens=24)
            await fleet.same_loads(IDLE_QUERY, "booked")
            for generated in range(1, 30):
                await fleet.emit(long_prompt, stream, 1)
                if generated == 1:
                    fleet.ours.mark_prefill("r1")
                fleet.ours.record_output("r1", generated)
                await fleet.same_loads(IDLE_QUERY, f"after {generated} tokens")

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "override",
    [{}, {"track_prefill_tokens": False}, {"assume_kv_reuse": False}],
    ids=["none", "no-prefill-tracking", "no-kv-reuse"],
)
def test_load_tracking_overrides_book_as_dynamos(override: dict[str, bool], tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Fleet(tmp_path) as fleet:
            assert fleet.ours is not None
            stream = await fleet.start("r1", PROMPT, router_config_override=override)
            # Before the first token: the prefill is booked (or not), the blocks shared (or not).
            await fleet.same_loads(PROMPT, "booked")
            await fleet.same_loads(IDLE_QUERY, "booked, idle query")
            await fleet.emit(PROMPT, stream, 1)
            fleet.ours.mark_prefill("r1")
            await fleet.same_loads(PROMPT, "after the first token")

    asyncio.run(scenario())


# ---------------------------------------------------------------------- minimum workers at start
ROOT = Path(__file__).resolve().parent.parent


def _start(role: str, directory: Path, **env: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "tests.dynamo_process", role, str(directory)]
    environment = {**os.environ, "DYN_LOG": "off", **env}
    return subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.PIPE, text=True)


def _said(process: subprocess.Popen[str], line: str, within_s: float) -> bool:
    """Whether the process prints ``line`` within ``within_s`` seconds."""
    assert process.stdout is not None
    deadline = time.monotonic() + within_s
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([process.stdout], [], [], left)
        if ready:
            said = process.stdout.readline()
            if not said:
                return False  # it exited
            if said.strip() == line:
                return True
    return False


def test_routing_waits_for_the_minimum_workers_as_dynamos(tmp_path: Path) -> None:
    """With a minimum of two, Dynamo's router (``DYN_ROUTER_MIN_INITIAL_WORKERS``, in its own process:
    its constructor blocks) and ours (`router_min_initial_workers`: `new` waits) both hold routing while
    one worker is registered and start when the second registers."""
    processes: list[subprocess.Popen[str]] = []

    async def scenario() -> None:
        ours = KvRouter(RouterConfig(block_size=BS, policy="dynamo", router_min_initial_workers=2))
        processes.append(_start("worker", tmp_path))
        assert await asyncio.to_thread(_said, processes[0], "worker ready", 60.0)
        ours.register_worker(WorkerConfig(worker_id=1))
        processes.append(_start("router", tmp_path, DYN_ROUTER_MIN_INITIAL_WORKERS="2"))
        waiting = asyncio.ensure_future(ours.new(RouteRequest(tokens=PROMPT)))
        # One worker: neither routes (Dynamo's constructor takes well under this when it does not wait).
        assert not await asyncio.to_thread(_said, processes[1], "router ready", 5.0)
        assert not waiting.done()
        processes.append(_start("worker", tmp_path))
        assert await asyncio.to_thread(_said, processes[2], "worker ready", 60.0)
        ours.register_worker(WorkerConfig(worker_id=2))
        assert await asyncio.to_thread(_said, processes[1], "router ready", 60.0)
        assert (await asyncio.wait_for(waiting, 5.0)).worker_id in (1, 2)

    try:
        asyncio.run(scenario())
    finally:
        for process in processes:
            process.kill()
            process.wait()
            if process.stdout is not None:
                process.stdout.close()

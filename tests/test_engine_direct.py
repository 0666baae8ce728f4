"""Direct mode over real ZMQ sockets: a fake vLLM engine (PUB + replay ROUTER) feeds the router's sequencer.

After gaps (repaired by replay, in both of vLLM's reply layouts), engine restarts, clears, garbage and
a router that joins late, the router's index equals what the engine holds; without a replay socket a
gap leaves the rank untrusted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest

from indexer.events import StorageTier
from indexer.hashing import compute_block_hashes
from indexer.sequencer import StreamStatus
from router.config import RouterConfig
from router.doctor import ConfigDoctor
from router.engines import direct as direct_module
from router.engines import zmq_stream
from router.engines.direct import DirectEngine, SequencerSink
from router.engines.engine_spec import EngineSpec, parse_engine_spec
from router.engines.zmq_stream import QUIET_S, ZmqEngineStream, replay_batches
from router.event_plane.embedded_server import free_port
from router.kv_router import KvRouter
from router.types import WorkerConfig
from tests.engine_fakes import (
    BLOCK,
    EngineHttp,
    FakeEngine,
    SideLoop,
    canonical,
    direct_mode,
    encode,
    engine_spec,
    free_port_run,
    loopback_endpoints,
    offloaded_batch,
)
from tests.waiting import eventually

pytestmark = pytest.mark.anyio
WORKER = 7


def _router(dp_size: int = 1) -> KvRouter:
    router = KvRouter(RouterConfig(block_size=BLOCK))
    router.register_worker(WorkerConfig(worker_id=WORKER, block_size=BLOCK, dp_size=dp_size, leased=False))
    return router


def _stream(router: KvRouter, dp_rank: int = 0) -> StreamStatus:
    (status,) = [s for s in router.sequencer.status() if (s.worker_id, s.dp_rank) == (WORKER, dp_rank)]
    return status


def _stream_without_tail_checks(router: KvRouter, endpoint: str, replay: str | None, **options: Any) -> ZmqEngineStream:
    """A direct-mode stream whose handshake and quiet-spell tail checks are held off: the test orders
    the replays it sees. ``options``: more of `ZmqEngineStream`'s."""
    return ZmqEngineStream(
        SequencerSink(router, WORKER), endpoint, block_size=BLOCK, replay_endpoint=replay,
        tail_check_delay_s=600, quiet_s=600, **options,
    )  # fmt: skip


async def _converged(router: KvRouter, engine: FakeEngine, direct: DirectEngine) -> None:
    await eventually(lambda: direct.streams[0].backlog == 0 and canonical(router.tree.dump_events()) == engine.dump())


def test_engine_specs_parse() -> None:
    assert parse_engine_spec("7=tcp://h:1") == EngineSpec(7, "tcp://h:1")
    assert parse_engine_spec("7=tcp://h:1,replay=tcp://h:2") == EngineSpec(7, "tcp://h:1", "tcp://h:2")
    # The OpenAI URL with or without /v1 (and a trailing slash) is the server's root.
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"):
        spec = parse_engine_spec(f"7=tcp://h:1,url={url},replay=tcp://h:2")
        assert spec == EngineSpec(7, "tcp://h:1", "tcp://h:2", "http://h:8000")
    spec = parse_engine_spec("7=tcp://h:1,url=http://h:8000/v1,models=a+b")
    assert spec.models == ("a", "b") and str(spec) == "7=tcp://h:1,url=http://h:8000,models=a+b"
    # An engine behind an ingress path prefix: its root is the prefix (refused before as a path not /v1).
    for url in ("http://gw/engine-a", "http://gw/engine-a/", "http://gw/engine-a/v1", "http://gw/engine-a/v1/"):
        assert parse_engine_spec(f"7=tcp://h:1,url={url}").url == "http://gw/engine-a"
    for bad in ("x=tcp://h:1", "7", "7=", "7=tcp://h:1,other=1", "7=http://h:1", "7=tcp://h:1,url=ftp://h",
                "7=tcp://h:1,models=a", "7=tcp://h:1,replay=tcp://h:2,replay=tcp://h:3", "-1=tcp://h:1",
                "7=tcp://h:\u0661", "7=tcp://h:1,replay=tcp://h:1", "7=tcp://[::1:1", "7=tcp://h]:1"):  # fmt: skip
        with pytest.raises(ValueError):
            parse_engine_spec(bad)
    # An endpoint's path, under the root or under a prefix, is no root: the proxy would post to
    # /v1/completions/v1/completions and probe /v1/completions/health.
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models/", "/x/v1/models"):
        with pytest.raises(ValueError, match=rf"url: .*'{path.rstrip('/')}' goes on past /v1 .*give the engine's "
                           r"OpenAI server root, .* with or without /v1"):  # fmt: skip
            parse_engine_spec(f"7=tcp://h:1,url=http://h:8000{path}")


async def test_vector_payloads_and_garbage_reach_the_index_as_the_engine_meant(shared_dir: Path) -> None:
    router = _router(dp_size=2)  # one vector is a batch of dp rank 1
    async with direct_mode(router, WORKER, replay=True) as (engine, direct):
        await engine.step()  # the slow joiner may miss it: replay brings it
        vectors = json.loads((shared_dir / "vectors" / "vllm_kv_events.json").read_text())["vectors"]
        for vector in vectors:
            await engine.send_raw(bytes.fromhex(vector["payload_hex"]))
            await engine.step()
        await engine.send_raw(b"\xc1garbage")
        await engine.send_raw(b"")
        await engine.send_raw(b"\x93\xcb" + bytes(8) + b"\x91" * 100_000)  # nested past msgspec's depth
        for rank in (-1, 2**40):  # ranks no stream can have
            await engine.send_raw(encode([1.5, [{"type": "AllBlocksCleared"}], rank]))
        for _ in range(20):
            await engine.step()
        await _converged(router, engine, direct)
        stats = direct.streams[0].stats
        assert stats["rejected_bad_envelope"] == 4 and stats["rejected_empty_payload"] == 1
        assert engine.dump()  # the scenario leaves something cached
        assert _stream(router).trusted and _stream(router, dp_rank=1).trusted  # one vector is dp rank 1


async def test_a_worker_removed_while_its_engine_publishes_comes_back_whole_and_trusted() -> None:
    router = _router()
    async with direct_mode(router, WORKER, replay=True, seed=5) as (engine, direct):
        for _ in range(5):
            await engine.step()
        await _converged(router, engine, direct)
        router.remove_worker(WORKER)  # what DELETE /v1/workers/7 does
        assert router.tree.dump_events() == []
        for _ in range(3):
            await engine.step()
        await _converged(router, engine, direct)  # what it held before the removal too, from its replay
        await eventually(lambda: _stream(router).trusted)
        assert router.has_worker(WORKER) and direct.streams[0].stats["rebuilds"] == 1


async def test_a_worker_removed_while_its_engine_publishes_without_replay_is_trusted_once_it_clears() -> None:
    router = _router()
    async with direct_mode(router, WORKER, replay=False, seed=6) as (engine, direct):

        async def heard() -> bool:  # clears until one is heard past the slow-joiner window
            await engine.send([engine.cleared()])
            return direct.streams[0].stats["applied"] > 0

        await eventually(heard, what="the stream hears the engine")
        await engine.step()
        await eventually(lambda: _stream(router).trusted and bool(router.tree.dump_events()))
        router.remove_worker(WORKER)
        stats = direct.streams[0].stats
        applied, unverified = stats["applied"], stats["unverified"]
        await engine.step()  # the engine still holds what it held: the stream is not whole
        await eventually(lambda: stats["applied"] > applied and router.has_worker(WORKER))
        assert not _stream(router).trusted and stats["unverified"] == unverified + 1
        await engine.send([engine.cleared()])
        await eventually(lambda: _stream(router).trusted)


async def test_garbage_a_replay_rejected_is_a_duplicate_when_heard_live_after_it() -> None:
    """The SUB socket joins late (the slow joiner) and first hears garbage the engine published: the
    replay at start took the whole buffer, that garbage too (rejected), so its live copy, out of order
    (nothing heard live yet), is a duplicate as a batch that decodes would be, not rejected again."""
    router = _router()
    endpoint, replay = loopback_endpoints(replay=True)
    engine = FakeEngine(WORKER, endpoint, replay, seed=71)
    await engine.start()
    garbage = [b"\xc1garbage", b"", b"\x93\xcb" + bytes(8) + b"\x91" * 100_000]
    batches = [encode([1.5, engine.random_events(), 0]) for _ in range(3)]
    payloads = [*batches, *garbage, encode([1.5, engine.random_events(), 0])]
    for payload in payloads:
        await engine.send_raw(payload, publish=False)  # in the replay buffer: the stream's start brings them
    stream = _stream_without_tail_checks(router, endpoint, replay)
    await stream.start()
    try:
        await eventually(lambda: stream.stats["replayed"] == len(payloads), 10, "the replay at start")
        for seq, payload in enumerate(payloads[len(batches) :], len(batches)):  # heard live from the garbage on
            async with stream.sink.batch():
                await stream.take_live(seq, payload)
        stats = stream.stats
        assert (stats["rejected_bad_envelope"], stats["rejected_empty_payload"], stats["duplicate"]) == (2, 1, 4)
        assert (stats["restarts"], stats["gap"], stats["unverified"]) == (0, 0, 0)
        assert canonical(router.tree.dump_events()) == engine.dump()
        assert _stream(router).trusted
    finally:
        await stream.stop()
        await engine.stop()


@pytest.mark.parametrize("array_form", [False, True], ids=["map", "array"])
async def test_a_hybrid_models_sliding_window_evictions_leave_its_full_attention_blocks(array_form: bool) -> None:
    """Each KV-cache group of a hybrid model (gpt-oss, Gemma 3, Qwen3.5) stores and evicts its own copy
    of a block under the same hash; the sliding window evicts what falls out of its window all the
    time. Its stores are ignored, so its removals are too, once a store has named its group."""
    router = _router()

    def stored(hashes: list[int], group: int, kind: str) -> Any:
        tokens = list(range(len(hashes) * BLOCK))
        if array_form:
            return ["BlockStored", hashes, None, tokens, BLOCK, None, "GPU", None, None, group, kind, None]
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens,
                "block_size": BLOCK, "medium": "GPU", "group_idx": group, "kv_cache_spec_kind": kind}  # fmt: skip

    def removed(hashes: list[int], group: int) -> Any:
        if array_form:
            return ["BlockRemoved", hashes, "GPU", group]
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": group}

    def held() -> int:
        return sum(blocks for (worker, _), blocks in router.tree.stats().blocks.items() if worker == WORKER)

    async with direct_mode(router, WORKER, replay=True) as (engine, direct):
        await engine.send(
            [stored([11, 12, 13, 14], 0, "full_attention"), stored([11, 12, 13, 14], 1, "sliding_window")]
        )
        await eventually(lambda: held() == 4 and direct.streams[0].backlog == 0)
        await engine.send([removed([11, 12], 1)])  # out of the window: the full-attention copies stay
        await engine.send([removed([14], 0)])
        await eventually(lambda: held() == 3)
        assert direct.streams[0].side_groups == {1}
        assert direct.streams[0].stats["ignored_events"] == 2  # the side group's store and its removal
        assert _stream(router).trusted


@pytest.mark.parametrize("topic_in_replay", [True, False], ids=["vllm>=0.26", "vllm<0.26"])
@pytest.mark.parametrize("array_form", [False, True], ids=["map", "array"])
async def test_gaps_are_repaired_by_replay_in_both_reply_layouts(topic_in_replay: bool, array_form: bool) -> None:
    router = _router()
    async with direct_mode(
        router, WORKER, replay=True, topic_in_replay=topic_in_replay, array_form=array_form, seed=3
    ) as (engine, direct):
        for i in range(60):
            published = i % 7 != 3  # every 7th batch never reaches the SUB socket
            await engine.step(publish=published)
            if published:  # the router keeps up, so each loss is a gap of its own
                await _converged(router, engine, direct)
        await engine.step()
        await _converged(router, engine, direct)
        assert direct.streams[0].stats["gap"] >= 8 and direct.streams[0].stats["replayed"] >= 8
        assert direct.streams[0].stats["unverified"] == 0
        assert _stream(router).trusted


async def test_an_engine_restart_clears_the_rank_and_rebuilds_it() -> None:
    router = _router()
    async with direct_mode(router, WORKER, replay=True, seed=5) as (engine, direct):
        for _ in range(30):
            await engine.step()
        await _converged(router, engine, direct)
        # The fake keeps its PUB socket across the restart, so the subscriber hears the new process
        # from its first batch on (the old one's history came live or, if the SUB joined after it was
        # sent, by replay: either way the new seqs must read as a restart).
        engine.restart()
        await engine.step(publish=False)  # the new process's seq 0 is missed: replay from 0 finds it
        for _ in range(10):
            await engine.step()
        await _converged(router, engine, direct)
        assert direct.streams[0].stats["restarts"] == 1
        await engine.send([engine.cleared()])
        for _ in range(5):
            await engine.step()
        await _converged(router, engine, direct)
        assert _stream(router).trusted


async def test_garbage_under_a_lower_or_a_huge_seq_is_refused_not_taken_for_a_restart() -> None:
    """An undecodable message under seq 0 (or 2**64 - 1, which would make the next batch look lower)
    changes nothing: counted as a bad envelope, the engine's blocks kept, its next batches applied."""
    router = _router()
    async with direct_mode(router, WORKER, replay=True, seed=6) as (engine, direct):
        for _ in range(10):
            await engine.step()
        await _converged(router, engine, direct)
        stream = direct.streams[0]
        for seq in (0, 2**64 - 1):
            await engine.publisher.send_corrupted(seq, b"\xc1 not msgpack")
        await eventually(lambda: stream.stats["rejected_bad_envelope"] == 2)
        for _ in range(3):
            await engine.step()
        await _converged(router, engine, direct)
        assert stream.stats["restarts"] == 0 and stream.stats["gap"] == 0
        assert _stream(router).trusted


def _one_block_stored(block_hash: int) -> list[Any]:
    return [{"type": "BlockStored", "block_hashes": [block_hash], "parent_block_hash": None,
             "token_ids": list(range(BLOCK)), "block_size": BLOCK, "lora_id": None, "medium": "GPU",
             "lora_name": None}]  # fmt: skip


async def test_a_replay_past_the_streams_bound_fails_as_a_rejection_and_the_stream_goes_on() -> None:
    """A gap whose replay brings more batches than the stream takes (a runaway replay socket; here the
    engine's own buffer against a bound of 20) is abandoned unread: counted as a rejection
    (``rejected_oversized_replay``) and a failed replay, the rank unverified. The stream goes on: the
    live batch after the gap is applied, a gap whose replay fits is repaired, and the engine's next
    clear trusts the rank again, its index the engine's."""
    router = _router()
    endpoint, replay = loopback_endpoints(replay=True)
    engine = FakeEngine(WORKER, endpoint, replay, seed=83)
    await engine.start()
    stream = _stream_without_tail_checks(router, endpoint, replay, max_replay_batches=20)
    await stream.start()
    stats = stream.stats
    try:

        async def heard() -> bool:  # clears until one is heard past the slow-joiner window
            await engine.send([engine.cleared()])
            return stats["applied"] > 0

        await eventually(heard, what="the stream hears the engine")
        await engine.step()
        await eventually(lambda: stream.backlog == 0 and canonical(router.tree.dump_events()) == engine.dump())
        assert _stream(router).trusted and stats["rejected_oversized_replay"] == 0
        for _ in range(25):
            await engine.step(publish=False)  # buffered for replay only: a gap of 25
        applied = stats["applied"]
        await engine.step()
        await eventually(lambda: stats["replay_failed"] == 1 and stream.backlog == 0, 10, "the refused replay")
        assert (stats["rejected_oversized_replay"], stats["unverified"], stats["applied"]) == (1, 1, applied + 1)
        assert "oversized_replay" in stream.last_rejection and not _stream(router).trusted
        replayed = stats["replayed"]
        await engine.step(publish=False)
        await engine.step()
        await eventually(lambda: stats["replayed"] > replayed and stream.backlog == 0, 10, "a replay that fits")
        assert stats["replay_failed"] == 1
        await engine.send([engine.cleared()])
        await engine.step()
        await eventually(lambda: stream.backlog == 0 and canonical(router.tree.dump_events()) == engine.dump())
        assert _stream(router).trusted and stats["rejected_oversized_replay"] == 1
    finally:
        await stream.stop()
        await engine.stop()


async def test_a_replay_answering_garbage_under_the_applied_seq_fails_and_keeps_the_index() -> None:
    """A gap's replay whose batch under the seq applied last is garbage has failed (counted, the rank
    unverified): garbage proves no new process, so the engine's blocks are kept, not cleared."""
    router = _router()
    async with direct_mode(router, WORKER, replay=True, seed=7) as (engine, direct):
        for _ in range(10):
            await engine.step()
        await _converged(router, engine, direct)
        stream = direct.streams[0]
        held = set(canonical(router.tree.dump_events()))
        engine.publisher.corrupt_buffered(engine.publisher.next_seq - 1, b"\xc1\xc1\xc1")
        await engine.send(_one_block_stored(10**12 + 1), publish=False)  # lost: the next batch shows a gap
        await engine.send(_one_block_stored(10**12 + 2))
        await eventually(lambda: stream.stats["replay_failed"] == 1 and stream.backlog == 0)
        assert stream.stats["restarts"] == 0
        assert held <= set(canonical(router.tree.dump_events()))
        assert not _stream(router).trusted


async def test_the_last_batch_heard_twice_is_a_duplicate_not_a_restart() -> None:
    """The same frames again (same seq, same bytes; a new process's batch carries another time) are
    dropped as a duplicate: nothing cleared, the rank still trusted."""
    router = _router()
    async with direct_mode(router, WORKER, replay=False, seed=8) as (engine, direct):
        await _heard_without_replay(engine, direct)
        for _ in range(5):
            await engine.step()
        payload = encode([1700000000.5, _one_block_stored(10**12 + 3), 0])
        seq = await engine.send_raw(payload)
        await _converged(router, engine, direct)
        stream = direct.streams[0]
        duplicates = stream.stats["duplicate"]
        await engine.publisher.send_corrupted(seq, payload)  # the same frames, heard again
        await engine.step()
        await _converged(router, engine, direct)
        assert stream.stats["restarts"] == 0 and stream.stats["duplicate"] == duplicates + 1
        assert _stream(router).trusted


async def test_a_router_that_joins_late_replays_the_engine_history() -> None:
    router = _router()
    async with direct_mode(router, WORKER, replay=True, seed=9, history=40) as (engine, direct):
        await engine.step()
        await _converged(router, engine, direct)
        assert _stream(router).trusted


async def test_a_restart_is_seen_when_the_old_process_was_heard_only_by_replay() -> None:
    router = _router()
    # The first 30 batches are published before the router starts: it hears them only by replay.
    async with direct_mode(router, WORKER, replay=True, seed=19, history=30) as (engine, direct):
        await _converged(router, engine, direct)
        assert direct.streams[0].stats["messages"] == 0  # nothing live: no live seq to compare with
        engine.restart()  # seq 1.. of the new process are seqs the replay applied, other payloads
        await engine.step(publish=False)
        for _ in range(10):
            await engine.step()
        await _converged(router, engine, direct)
        assert direct.streams[0].stats["restarts"] == 1
        assert _stream(router).trusted


async def test_a_restart_heard_first_as_a_gap_is_a_restart() -> None:
    """The new process published past the last applied seq before the stream heard it: by seq a gap,
    but the replay's batch under the last applied seq is another one, so the rank is rebuilt from 0."""
    router = _router()
    async with direct_mode(router, WORKER, replay=True, seed=23) as (engine, direct):
        for _ in range(5):
            await engine.step()
        await _converged(router, engine, direct)
        await _settled(direct.streams[0].stats)  # no tail check pending: one would find the restart first
        engine.restart()
        for _ in range(8):
            await engine.step(publish=False)  # seqs 0-7 of the new process, never heard live
        await engine.step()  # seq 8: past the last applied seq 4
        await _converged(router, engine, direct)
        stats = direct.streams[0].stats
        assert (stats["restarts"], stats["gap"], stats["unverified"]) == (1, 1, 0)
        assert _stream(router).trusted


async def test_a_new_process_first_heard_at_the_next_seq_reads_as_the_old_one_going_on() -> None:
    """The one restart the seq rules cannot see (router/engines/README.md, "Not covered"), the fake
    keeping its PUB socket (no reconnection, so no check before the batch is applied): the new
    process's first seqs are lost and the next comes right after the old process's last applied seq.
    By seq that is the next batch, and vLLM's payload names no process, so it is applied as one: no
    restart, no gap, no replay asked, and the router keeps the old process's blocks beside the new
    ones (the rank stays trusted) until the engine clears."""
    router = _router()
    async with direct_mode(router, WORKER, replay=True, seed=29) as (engine, direct):
        await _heard(engine, direct)  # the batch after the connection is heard (and checked) before this
        while engine.publisher.next_seq < 5:
            await engine.step()
        await _converged(router, engine, direct)
        old_process, old_batches = engine.dump(), engine.publisher.next_seq
        assert old_process
        await _settled(direct.streams[0].stats)  # no tail check pending: one would find the restart
        before = dict(direct.streams[0].stats)  # the slow joiner's first batches may have come by replay
        engine.restart()
        while engine.publisher.next_seq < old_batches:
            await engine.step(publish=False)  # the new process's first seqs, never heard
        await engine.step()  # the next seq after the old process's last
        await eventually(
            lambda: direct.streams[0].stats["applied"] == old_batches + 1 and direct.streams[0].backlog == 0
        )
        changed = {key: direct.streams[0].stats[key] - before.get(key, 0) for key in ("restarts", "gap", "replayed")}
        assert changed == {"restarts": 0, "gap": 0, "replayed": 0} and direct.streams[0].stats["unverified"] == 0
        held = canonical(router.tree.dump_events())
        assert set(old_process) <= set(held) and held != engine.dump()
        assert _stream(router).trusted
        await engine.send([engine.cleared()])
        await engine.step()
        await _converged(router, engine, direct)


async def _heard_without_replay(engine: FakeEngine, direct: DirectEngine) -> None:
    """Past the slow-joiner window: a PUB socket shows no subscriber, so clears (which change nothing
    the engine holds) go out until the stream applies one. A slept 0.2 s was not always enough on a
    loaded machine: the steps then went out unheard, a gap with no replay. One lost before the stream
    joined is such a gap too, and the clear it then applies makes it trusted."""

    async def heard() -> bool:
        await engine.send([engine.cleared()])
        return direct.streams[0].stats["applied"] > 0

    await eventually(heard, what="the stream hears the engine")


async def test_without_replay_a_gap_leaves_the_rank_untrusted_until_it_clears() -> None:
    router = _router()
    async with direct_mode(router, WORKER, replay=False, seed=11) as (engine, direct):
        await _heard_without_replay(engine, direct)
        unverified = direct.streams[0].stats["unverified"]  # 1 if the first clear went out unheard
        for _ in range(5):
            await engine.step()
        await _converged(router, engine, direct)  # clears sent while it joined may still arrive: not counted
        assert _stream(router).trusted
        await engine.step(publish=False)
        await engine.step()
        await eventually(lambda: direct.streams[0].stats["unverified"] == unverified + 1)
        assert not _stream(router).trusted
        await engine.send([engine.cleared()])
        await eventually(lambda: _stream(router).trusted)


async def test_a_router_started_against_a_running_engine_without_replay_leaves_the_rank_untrusted() -> None:
    """The engine stored blocks before the router came, and has no replay socket: the first batch the
    router hears follows a gap nobody can repair. Its events are applied, but the rank is not trusted
    as if that batch were the stream's start (the blocks stored before are missing from the index)."""
    router = _router()
    async with direct_mode(router, WORKER, replay=False, seed=17, history=3) as (engine, direct):

        async def heard() -> bool:
            await engine.step()
            return direct.streams[0].stats["applied"] > 0

        await eventually(heard, what="the stream hears the engine")
        assert direct.streams[0].stats["unverified"] >= 1
        assert not _stream(router).trusted
        for _ in range(3):
            await engine.step()
        await eventually(lambda: direct.streams[0].backlog == 0)
        assert not _stream(router).trusted  # later batches in order do not make up for the loss
        await engine.send([engine.cleared()])
        await eventually(lambda: _stream(router).trusted)
        await engine.step()
        await _converged(router, engine, direct)


async def test_a_replay_buffer_with_a_hole_for_good_is_applied_and_the_rank_left_untrusted() -> None:
    """TensorRT-LLM numbers a batch, then may drop it on a full queue: its replay buffer answers every
    round without that seq. A router starting after it applies what the buffer holds (before: nothing,
    the whole replay refused, the rank trusted and empty) and leaves the rank untrusted until a clear."""
    router = _router()
    endpoint, replay_endpoint = loopback_endpoints(replay=True)
    engine = FakeEngine(WORKER, endpoint, replay_endpoint, seed=19)
    await engine.start()
    try:
        await engine.step(publish=False)
        await engine.send([engine.cleared()], publish=False)  # a clear ahead of the hole must not trust it
        lost = await engine.step(publish=False)
        engine.publisher.lose(lost)
        for _ in range(2):
            await engine.step(publish=False)
        direct = DirectEngine(router, engine_spec(WORKER, endpoint, replay_endpoint))
        await direct.start()
        try:
            await eventually(lambda: direct.streams[0].stats["replayed"] == 4)  # all the buffer holds
            assert direct.streams[0].stats["missing_history"] == 1
            assert not _stream(router).trusted
            await engine.send([engine.cleared()])
            await engine.step()
            await _converged(router, engine, direct)
            assert _stream(router).trusted
        finally:
            await direct.stop()
    finally:
        await engine.stop()


async def test_a_replay_buffer_that_lost_the_gap_leaves_the_rank_untrusted() -> None:
    router = _router()
    async with direct_mode(router, WORKER, replay=True, seed=13) as (engine, direct):

        async def heard() -> bool:  # a step sent before the SUB socket joined is lost: the next one's gap replays it
            await engine.step()
            return direct.streams[0].stats["applied"] > 0

        await eventually(heard, what="the stream hears the engine")
        await _converged(router, engine, direct)
        await _settled(direct.streams[0].stats)  # no tail check pending: the next batch's gap finds the loss
        for _ in range(5):
            await engine.step(publish=False)
        engine.publisher.forget_before(engine.publisher.next_seq - 2)
        await engine.step()
        await eventually(lambda: direct.streams[0].stats["missing_history"] == 1)
        assert not _stream(router).trusted


def test_serve_with_engine_zmq_flags_hears_the_engines_over_http(shared_dir: Path) -> None:
    import random

    import msgspec
    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry

    from api.app import create_app
    from api.cli import build_parser
    from api.config import load_settings
    from indexer.events import RouterEvent
    from tests.waiting import until

    side = SideLoop()
    call = side.call

    endpoint, replay = loopback_endpoints(replay=True)
    engine = FakeEngine(WORKER, endpoint, replay, seed=17)
    spec = engine_spec(WORKER, endpoint, replay)
    call(engine.start())
    try:
        for _ in range(10):
            call(engine.step())  # before the router starts: it replays them
        args = vars(build_parser().parse_args(
            ["serve", "--no-embedded-nats", "--block-size", str(BLOCK), "--engine-zmq", spec,
             "--engine-zmq", "8=tcp://127.0.0.1:1"]
        ))  # fmt: skip
        args.pop("command"), args.pop("config")
        settings = load_settings(flags=args, env={})
        assert settings.engines.engine_zmq == [spec, "8=tcp://127.0.0.1:1"]
        app = create_app(settings, registry=CollectorRegistry(), rng=random.Random(0))
        with TestClient(app, base_url="http://127.0.0.1") as client:

            def dump() -> list[Any]:
                return canonical(msgspec.json.decode(client.get("/v1/dump").content, type=list[RouterEvent]))

            for i in range(30):
                published = i % 5 != 2
                call(engine.step(publish=published))
                if published:  # the router keeps up, so each loss is a gap of its own
                    until(lambda: dump() == engine.dump())
            engine.restart()
            for _ in range(10):
                call(engine.step())
            until(lambda: dump() == engine.dump())
            worker = client.get(f"/v1/workers/{WORKER}").json()
            assert [s["trusted"] for s in worker["event_streams"]] == [True]
            metrics = client.get("/metrics").text
            assert f'kv_router_engine_stream_messages_total{{endpoint="{endpoint}",outcome="restarts"}} 1.0' in metrics
            tail_checks = f'kv_router_engine_stream_messages_total{{endpoint="{endpoint}",outcome="tail_checks"}}'
            until(lambda: tail_checks in client.get("/metrics").text)  # the connection's, at least
    finally:
        call(engine.stop())
        side.close()


async def test_an_engine_whose_health_fails_leaves_routing_and_comes_back_rebuilt_from_its_replay() -> None:
    router = KvRouter(RouterConfig(block_size=BLOCK))  # the worker is registered by its engine's health
    http = await EngineHttp(models=("m1", "m2")).start()
    endpoint, replay = loopback_endpoints(replay=True)
    engine = FakeEngine(WORKER, endpoint, replay, seed=3)
    await engine.start()
    direct = DirectEngine(router, f"{engine_spec(WORKER, endpoint, replay)},url={http.url}/v1/", health_interval_s=0.05)
    await direct.start()
    try:
        await eventually(lambda: router.has_worker(WORKER))
        worker = router.worker(WORKER)
        assert worker is not None and (worker.url, worker.models) == (http.url, frozenset({"m1", "m2"}))
        for _ in range(10):
            await engine.step()
        await _converged(router, engine, direct)
        assert router.tree.dump_events()

        http.healthy = False  # 503: alive but not serving
        await eventually(lambda: not router.has_worker(WORKER))
        assert router.tree.dump_events() == []
        for _ in range(5):
            await engine.step()  # heard while out of routing: dropped
        await eventually(lambda: direct.sink.dropped_events > 0)

        http.healthy = True  # the same process answers again: what it holds comes back by replay
        await eventually(lambda: router.has_worker(WORKER))
        await _converged(router, engine, direct)
        assert _stream(router).trusted and direct.streams[0].stats["rebuilds"] == 2  # at its first answer, and now
    finally:
        await direct.stop()
        await engine.stop()
        await http.stop()


async def test_an_engine_failing_a_health_check_or_two_keeps_its_index_and_one_refusing_leaves_at_once() -> None:
    """A slow or failing answer now and then is a busy engine, not a gone one: out of routing (its index
    dropped, rebuilt by replay) only after three in a row; a refused connection is a gone engine."""
    http = EngineHttp()
    endpoint, replay = loopback_endpoints(replay=True)
    engine = FakeEngine(WORKER, endpoint, replay, seed=4)
    await engine.start()
    async with _probed(http, endpoint, replay, engine) as (router, direct):
        await eventually(lambda: router.has_worker(WORKER))
        for _ in range(10):
            await engine.step()
        await _converged(router, engine, direct)
        probe = direct.health
        assert probe is not None and probe.failures_to_down == 3
        rebuilds = direct.streams[0].stats["rebuilds"]

        failed = probe.failures
        http.failing_checks = 2  # two 503s in a row, then 200s
        await eventually(lambda: probe.failures == failed + 2 and probe.healthy and http.failing_checks == 0)
        probes = probe.probes
        await eventually(lambda: probe.probes >= probes + 2)  # passed again
        assert router.has_worker(WORKER) and direct.streams[0].stats["rebuilds"] == rebuilds
        assert canonical(router.tree.dump_events()) == engine.dump()

        failed = probe.failures
        await http.stop()  # nothing listens: out of routing at the first refusal
        await eventually(lambda: not router.has_worker(WORKER), timeout=5)
        assert probe.failures - failed < 3, "out before three failures"


async def test_an_engine_answering_its_health_checks_late_stays_in_routing_with_its_index() -> None:
    """A loaded engine's server answers its /health late (its event loop busy with the streams it
    serves): within engine_health_timeout_secs (5 s) that is a pass. The probe's bound was its interval
    or 1 s: every answer past a second failed, and three took the worker out of routing with its index."""
    http = EngineHttp()
    http.health_delay_s = 1.2
    endpoint, replay = loopback_endpoints(replay=True)
    engine = FakeEngine(WORKER, endpoint, replay, seed=5)
    await engine.start()
    async with _probed(http, endpoint, replay, engine) as (router, direct):
        await eventually(lambda: router.has_worker(WORKER), timeout=10)
        for _ in range(5):
            await engine.step()
        await _converged(router, engine, direct)
        probe = direct.health
        assert probe is not None
        probes = probe.probes
        await eventually(lambda: probe.probes >= probes + 3, timeout=15)
        assert probe.failures == 0 and probe.healthy
        assert router.has_worker(WORKER) and canonical(router.tree.dump_events()) == engine.dump()

        probe.timeout_s = 0.3  # engine_health_timeout_secs below the engine's delay: three misses, out
        await eventually(lambda: not router.has_worker(WORKER), timeout=15)
        assert probe.failures >= 3 and probe.last_problem == "no whole answer within 0.3 s"


async def test_a_worker_removed_while_its_engine_answers_comes_back_with_its_url_and_models(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """DELETE /v1/workers of an engine given with url=: its next event registered it bare (no URL, no
    models), routable by the decision API yet never sent a proxied request, and its health probe, passing
    all along, never registered it again. It comes back as its engine's answer registers it: URL, models,
    the KV blocks its /metrics state, its health check passing, what it holds replayed."""
    http = EngineHttp(models=("m1", "m2"), kv_blocks=512)
    endpoint, replay = loopback_endpoints(replay=True)
    engine = FakeEngine(WORKER, endpoint, replay, seed=12)
    await engine.start()
    async with _probed(http, endpoint, replay, engine) as (router, direct):
        await eventually(lambda: (router.worker(WORKER) or WorkerConfig(worker_id=0)).total_kv_blocks == 512)
        for _ in range(5):
            await engine.step()
        await _converged(router, engine, direct)

        router.remove_worker(WORKER)  # what DELETE /v1/workers/7 does
        await engine.step()
        await eventually(lambda: router.has_worker(WORKER))
        worker = router.worker(WORKER)
        assert worker is not None
        assert (worker.url, worker.models, worker.total_kv_blocks) == (http.url, frozenset({"m1", "m2"}), 512)
        assert router.health.availability(WORKER).health_check == "passing"
        await _converged(router, engine, direct)
        await eventually(lambda: _stream(router).trusted)
        assert "registering it with default capacity" not in caplog.text
        assert f"worker {WORKER} was removed while its engine at {http.url} answers" in caplog.text


@asynccontextmanager
async def _probed(
    http: EngineHttp, endpoint: str, replay: str | None, *engines: FakeEngine, health_interval_s: float = 0.05
) -> AsyncIterator[tuple[KvRouter, DirectEngine]]:
    """A router hearing ``endpoint`` in direct mode, ``http`` (started here) its engine's OpenAI server,
    probed every ``health_interval_s``; the direct engine, ``http`` and ``engines`` stopped on the way out."""
    router = KvRouter(RouterConfig(block_size=BLOCK))
    await http.start()
    spec = f"{engine_spec(WORKER, endpoint, replay)},url={http.url}"
    direct = DirectEngine(router, spec, health_interval_s=health_interval_s)
    try:
        await direct.start()
        yield router, direct
    finally:
        await direct.stop()
        for engine in engines:
            await engine.stop()
        await http.stop()


async def test_an_engine_is_routable_only_once_its_event_socket_has_the_routers_subscription(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine routed to before its PUB socket had the router's subscription lost the prompt's events
    (ZMQ drops what it publishes meanwhile), so the prompt's repeat went anywhere: the README's
    walkthrough failed so, rarely, in the first second. Here the engine's HTTP answers first and its event
    sockets bind later; it is routable only after, and what it publishes then is heard live. (The join's
    wait is 30 s here: on a loaded machine the engine may bind after the default's 2 s.)"""
    monkeypatch.setattr(direct_module, "JOIN_TIMEOUT_S", 30.0)
    http = EngineHttp()
    endpoint, replay = loopback_endpoints(replay=True)
    engine = FakeEngine(WORKER, endpoint, replay, seed=5)
    async with _probed(http, endpoint, replay, engine) as (router, direct):
        await eventually(lambda: http.asked["/v1/models"] > 0)  # it answered: routable until now
        await asyncio.sleep(0.3)
        assert not router.has_worker(WORKER)
        await engine.start()
        await eventually(lambda: router.has_worker(WORKER))
        await engine.step()
        await _converged(router, engine, direct)
        assert direct.streams[0].stats["tail_recovered"] == 0 and direct.streams[0].stats["messages"] == 1


async def test_a_stalled_engine_is_routable_again_at_once_and_a_restarted_one_once_its_new_socket_has_us(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine whose HTTP stalls keeps its event socket's connection: routable again as soon as it
    answers. A restarted engine's new PUB socket is joined anew: routable once it has the router's
    subscription, without waiting out `JOIN_TIMEOUT_S` (30 s here, so that a wait that ran out shows)."""
    monkeypatch.setattr(direct_module, "JOIN_TIMEOUT_S", 30.0)
    http = EngineHttp()
    endpoint, replay = loopback_endpoints(replay=True)
    old = FakeEngine(WORKER, endpoint, replay, seed=8)
    new = FakeEngine(WORKER, endpoint, replay, seed=9)
    await old.start()
    loop = asyncio.get_running_loop()
    async with _probed(http, endpoint, replay, new, old) as (router, direct):
        await eventually(lambda: router.has_worker(WORKER))
        http.healthy = False  # a stall: the event socket stays connected
        await eventually(lambda: not router.has_worker(WORKER))
        began = loop.time()
        http.healthy = True
        await eventually(lambda: router.has_worker(WORKER))
        assert loop.time() - began < 10

        http.healthy = False
        await eventually(lambda: not router.has_worker(WORKER))
        await old.stop()  # the process ends: its sockets close, and a new one binds the same ports

        async def gone() -> bool:
            return not await direct.streams[0].joined(0.01)

        await eventually(gone, what="the stream sees the engine's socket close")
        await new.start()
        began = loop.time()
        http.healthy = True
        await eventually(lambda: router.has_worker(WORKER))
        assert loop.time() - began < 10
        messages = direct.streams[0].stats["messages"]
        await new.step()  # published the moment it is routable: heard live
        await eventually(lambda: canonical(router.tree.dump_events()) == new.dump())
        assert direct.streams[0].stats["messages"] == messages + 1


async def test_an_engine_whose_event_socket_never_connects_is_routable_after_the_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A PUB socket that never answers (vLLM given a host address connects instead of binding) must not
    keep a serving engine out of routing: it is routable after `JOIN_TIMEOUT_S`, and the doctor says why
    no event comes (`engine_events_silent`)."""
    monkeypatch.setattr(direct_module, "JOIN_TIMEOUT_S", 0.3)
    endpoint, replay = loopback_endpoints(replay=True)
    async with _probed(EngineHttp(), endpoint, replay) as (router, direct):
        await eventually(lambda: router.has_worker(WORKER))
        assert direct.streams[0].stats["connections"] == 0


async def test_an_engine_that_states_its_kv_blocks_gives_them_to_its_registration_and_its_load_to_routing() -> None:
    """vLLM states its KV blocks on its /metrics: the worker is registered with them (the latency policy's
    cache fill, the busy thresholds) and its KV usage and requests are applied as it serves. A capacity
    given over HTTP stands."""
    http = EngineHttp(kv_blocks=512, kv_usage=0.25, running=2)
    endpoint, replay = loopback_endpoints(replay=True)
    engine = FakeEngine(WORKER, endpoint, replay, seed=6)
    await engine.start()
    async with _probed(http, endpoint, replay, engine) as (router, direct):
        await eventually(lambda: (router.worker(WORKER) or WorkerConfig(worker_id=0)).total_kv_blocks == 512)
        await eventually(lambda: [(load.kv_used_blocks, load.engine_requests_running) for load in router.rank_loads()]
                         == [(128, 2)])  # fmt: skip
        http.kv_usage, http.running = 0.5, 3
        await eventually(lambda: [(load.kv_used_blocks, load.engine_requests_running) for load in router.rank_loads()]
                         == [(256, 3)])  # fmt: skip

        http.healthy = False  # down: out of routing, no more scraping
        await eventually(lambda: not router.has_worker(WORKER))
        assert direct.scraper is None
        router.register_worker(WorkerConfig(worker_id=WORKER, block_size=BLOCK, total_kv_blocks=64, leased=False))
        http.healthy = True
        await eventually(lambda: direct.up_at is not None and direct.scraper is not None)
        await eventually(lambda: direct.scraper is not None and direct.scraper.scrapes >= 2)
        worker = router.worker(WORKER)
        assert worker is not None and worker.total_kv_blocks == 64 and worker.url == http.url  # the operator's


# ---------------------------------------------------------------------------------------- tail checks
async def _heard(engine: FakeEngine, direct: DirectEngine) -> None:
    """Steps until one is heard live (those before the SUB socket joined come by replay)."""

    async def heard() -> bool:
        await engine.step()
        return direct.streams[0].stats["messages"] > 0

    await eventually(heard, what="the stream hears the engine")


async def _settled(stats: Any) -> None:
    """Until the stream's tail checks have stopped: the last quiet spell's check is past (its count
    still after twice the quiet time), so none is pending (bounded, as `eventually`)."""
    last = -1

    async def still() -> bool:
        nonlocal last
        before, last = last, stats["tail_checks"]
        if before != last:
            await asyncio.sleep(2 * QUIET_S)  # a window to see whether another check comes
            return stats["tail_checks"] == last
        return True

    await eventually(still, 30, "the stream's tail checks are over")


@asynccontextmanager
async def _quiet_stream(seed: int) -> AsyncIterator[tuple[KvRouter, FakeEngine, DirectEngine]]:
    """A direct-mode stream that has heard its engine and caught up, with no tail check pending."""
    router = _router()
    async with direct_mode(router, WORKER, replay=True, seed=seed) as (engine, direct):
        await _heard(engine, direct)
        await _converged(router, engine, direct)
        await _settled(direct.streams[0].stats)
        yield router, engine, direct


async def test_batches_lost_at_the_tail_are_applied_while_the_engine_stays_quiet() -> None:
    """A gap shows only when a later batch arrives: the last batches before a quiet spell, lost on
    the way, are asked for by the tail check the quiet spell brings."""
    # The connection's check and every quiet spell's are past: only the next spell's can find what
    # follows, the spell of a batch heard right before two lost ones.
    async with _quiet_stream(seed=31) as (router, engine, direct):
        stats = direct.streams[0].stats
        recovered, gaps = stats["tail_recovered"], stats["gap"]
        await engine.step()
        for _ in range(2):
            await engine.step(publish=False)  # into the replay buffer only: the SUB never gets them
        await eventually(lambda: canonical(router.tree.dump_events()) == engine.dump(), 10, "the lost tail is applied")
        assert stats["applied"] == engine.publisher.next_seq  # every batch once, none live since
        assert (stats["tail_recovered"] - recovered, stats["gap"] - gaps) == (2, 1)
        assert (stats["restarts"], stats["unverified"]) == (0, 0)
        assert _stream(router).trusted


async def test_a_batch_heard_live_while_a_tail_check_asks_is_not_counted_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A quiet spell's check and a new batch cross: the replay's answer holds the batch the SUB socket
    has just queued. It was not lost: no gap, nothing recovered, no duplicate; applied once, live."""
    async with _quiet_stream(seed=37) as (router, engine, direct):
        stats = direct.streams[0].stats
        before = dict(stats)
        asked = replay_batches
        crossed = asyncio.Event()

        async def crossing(*args: Any, **kwargs: Any) -> list[tuple[int, bytes]]:
            if not crossed.is_set():  # the next check: a batch is published and queued before it asks
                crossed.set()
                await engine.step()
                await eventually(lambda: direct.streams[0].backlog > 0, 10, "the new batch queued behind the check")
            return await asked(*args, **kwargs)

        monkeypatch.setattr(zmq_stream, "replay_batches", crossing)
        await engine.step()  # its quiet spell brings the check
        await eventually(crossed.is_set, 10, "the quiet spell's check")
        await _converged(router, engine, direct)
        await _settled(stats)
        assert stats["applied"] == before["applied"] + 2 == engine.publisher.next_seq
        counts = ("gap", "tail_recovered", "duplicate", "replayed", "restarts", "unverified")
        assert {key: stats[key] for key in counts} == {key: before.get(key, 0) for key in counts}
        assert _stream(router).trusted


async def test_an_engine_restarted_on_the_same_ports_and_quiet_is_seen_from_its_replay() -> None:
    """The new process publishes at once, before the SUB socket has reconnected (ZMQ drops those
    batches), then goes quiet: the tail check after the reconnection finds no batch of the old process
    under the last applied seq, so the rank is cleared and rebuilt from the new process's replay."""
    router = _router()
    endpoint, replay = loopback_endpoints(replay=True)
    old = FakeEngine(WORKER, endpoint, replay, seed=37)
    await old.start()
    direct = DirectEngine(router, engine_spec(WORKER, endpoint, replay))
    await direct.start()
    new = FakeEngine(WORKER, endpoint, replay, seed=41)
    try:
        for _ in range(5):
            await old.step()
        await _heard(old, direct)
        await _converged(router, old, direct)
        assert old.dump()
        # The connection's check, then every quiet spell's, are past: only the reconnection's can see it.
        stats = direct.streams[0].stats
        await old.step()
        await _converged(router, old, direct)
        await _settled(stats)
        await old.stop()  # the process ends: its PUB and replay sockets close
        await new.start()
        for _ in range(2):
            await new.step()  # seqs 0-1, published before the SUB socket reconnected
        await eventually(
            lambda: canonical(router.tree.dump_events()) == new.dump(), 10, "the new process's blocks, only"
        )
        assert (stats["restarts"], stats["unverified"], stats["missing_history"]) == (1, 0, 0)
        assert _stream(router).trusted
        await new.step()  # the new process goes on: heard live, applied after its replayed seqs
        await _converged(router, new, direct)
        assert (stats["restarts"], stats["unverified"]) == (1, 0)
    finally:
        await direct.stop()
        await new.stop()
        await old.stop()


async def test_host_tier_stores_without_token_ids_add_that_tier_to_the_device_blocks_they_name() -> None:
    """vLLM's OffloadingConnector publishes what it copies to CPU memory as a store without token ids
    (block size 0): the blocks the rank stored on the device are found on the host tier too, a hash it
    never stored is skipped and counted, and nothing is taken for a block size mismatch."""
    router = _router()
    async with direct_mode(router, WORKER, replay=True) as (engine, direct):
        await _heard(engine, direct)
        tokens = list(range(1, 3 * BLOCK + 1))
        await engine.send_raw(offloaded_batch([11, 12, 13], tokens, [11, 12, 99]))
        await _converged(router, engine, direct)
        host = [edge for edge in canonical(router.tree.dump_events()) if edge[2] == "host_pinned"]
        local = compute_block_hashes(tokens, BLOCK)
        assert host == sorted([(WORKER, 0, "host_pinned", None, 11, local[0]),
                               (WORKER, 0, "host_pinned", 11, 12, local[1])], key=repr)  # fmt: skip
        # Evicted from the device, the first two blocks are still found, on the host tier.
        evicted = {"type": "BlockRemoved", "block_hashes": [13, 12, 11], "medium": "GPU"}
        await engine.send_raw(encode([1.0, [evicted], 0]))
        await _converged(router, engine, direct)
        matches = router.tree.find_matches(local)
        assert matches.scores == {} and matches.tier_hits[StorageTier.HOST_PINNED] == {(WORKER, 0): 2}
        assert direct.sink.offloaded_unresolved == 1
        stats = direct.streams[0].stats
        assert not [key for key in stats if key.startswith("rejected_")]
        assert [p.kind for p in ConfigDoctor(router, engines=[direct]).check()] == []


async def test_a_block_stored_twice_leaves_the_index_only_with_its_last_copy() -> None:
    """vLLM shares no physical block: two requests computing one prefix at once store it twice, and
    each copy is evicted by its own removal. The index keeps the block (and what is stored under it)
    until the last copy goes."""
    router = _router()
    async with direct_mode(router, WORKER, replay=True) as (engine, direct):
        await _heard(engine, direct)
        tokens = list(range(1, 3 * BLOCK + 1))
        local = compute_block_hashes(tokens, BLOCK)
        prefix = {
            "type": "BlockStored",
            "block_hashes": [21, 22],
            "parent_block_hash": None,
            "token_ids": tokens[: 2 * BLOCK],
            "block_size": BLOCK,
            "lora_id": None,
            "medium": "GPU",
        }
        below = {
            "type": "BlockStored",
            "block_hashes": [23],
            "parent_block_hash": 22,
            "token_ids": tokens[2 * BLOCK :],
            "block_size": BLOCK,
            "lora_id": None,
            "medium": "GPU",
        }
        evicted = {"type": "BlockRemoved", "block_hashes": [22], "medium": "GPU"}  # fmt: skip
        stats = direct.streams[0].stats
        await _settled(stats)
        applied = stats["applied"]
        for events in ([prefix], [prefix, below], [evicted]):
            await engine.send_raw(encode([1.0, events, 0]))
        await eventually(lambda: stats["applied"] == applied + 3, 10, "the three batches applied")
        assert router.tree.find_matches(local).scores == {(WORKER, 0): 3}  # the other copy of 22 is held
        await engine.send_raw(encode([1.0, [evicted], 0]))
        await eventually(lambda: router.tree.find_matches(local).scores == {(WORKER, 0): 1}, 10, "22's last copy gone")
        assert _stream(router).trusted


async def test_a_salted_block_stored_twice_keeps_its_salt_for_what_is_stored_under_its_other_copy() -> None:
    """Two requests with one salted prompt store its blocks twice; one copy of B is evicted, and the
    second request goes on under its own copy of B: C is hashed in the salt's namespace, so a request
    with that salt matches all three blocks. The salt goes with B's last copy."""
    router = _router()
    async with direct_mode(router, WORKER, replay=True) as (engine, direct):
        await _heard(engine, direct)
        tokens = list(range(1, 3 * BLOCK + 1))
        salted = compute_block_hashes(tokens, BLOCK, cache_namespace="tenant-X")

        def stored(hashes: list[int], parent: int | None, ids: list[int], keys: list[Any]) -> dict[str, Any]:
            return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": ids,
                    "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": keys,
                    "group_idx": 0, "kv_cache_spec_kind": "full_attention"}  # fmt: skip

        prefix = stored([31, 32], None, tokens[: 2 * BLOCK], [["tenant-X"], None])
        evicted = {"type": "BlockRemoved", "block_hashes": [32], "medium": "GPU", "group_idx": 0}
        stats = direct.streams[0].stats
        await _settled(stats)
        applied = stats["applied"]
        for events in ([prefix], [prefix], [evicted], [stored([33], 32, tokens[2 * BLOCK :], [None])]):
            await engine.send_raw(encode([1.0, events, 0]))
        await eventually(lambda: stats["applied"] == applied + 4, 10, "the four batches applied")
        assert router.tree.find_matches(salted).scores == {(WORKER, 0): 3}
        await engine.send_raw(encode([1.0, [evicted, {**evicted, "block_hashes": [33]}], 0]))
        await eventually(lambda: router.tree.find_matches(salted).scores == {(WORKER, 0): 1}, 10, "B's last copy gone")
        assert direct.streams[0].salts == {31: "tenant-X"}


async def test_an_engine_stamping_another_dp_rank_is_named_by_the_doctor_and_heard_once_registered_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM run with external data parallelism (--data-parallel-rank 1) stamps rank 1 in every batch;
    heard as a worker of one rank (0), its events are refused. The log says so at the first batch, and
    the doctor names the stamped rank and the registration's, not "enable the engine's KV events";
    registered with dp_start_rank 1, as they advise, the worker's index follows the engine."""
    router = KvRouter(RouterConfig(block_size=BLOCK))
    clock = [1000.0]
    async with direct_mode(router, 8, replay=True, dp_rank=1) as (engine, direct):
        doctor = ConfigDoctor(router, engines=[direct], clock=lambda: clock[0])
        for _ in range(5):
            await engine.step()
        await eventually(lambda: router.sequencer.unknown_dp_rank_events[8, 1] > 0, 10, "rank 1's events refused")
        said = [r.getMessage() for r in caplog.records if "stamped with dp rank 1" in r.getMessage()]
        assert len(said) == 1 and "registered with ranks 0..0" in said[0] and "dp_start_rank 1" in said[0]
        doctor._on_routed((8, 0), [123])
        clock[0] += 120
        (problem,) = doctor.check()
        assert problem.kind == "events_not_wired"
        assert "stamped with dp rank 1" in problem.evidence and "registered with ranks 0..0" in problem.evidence
        assert "dp_start_rank 1" in problem.evidence and "--kv-events-config" not in problem.evidence

        worker = router.worker(8)
        assert worker is not None
        router.register_worker(msgspec.structs.replace(worker, dp_start_rank=1))
        direct.streams[0].request_rebuild()
        for _ in range(5):
            await engine.step()
        await _converged(router, engine, direct)
        assert engine.dump() and doctor.check() == []


class FreezingRelay:
    """A TCP relay standing for the engine's host at a fixed address: ``freeze`` makes the host vanish
    without a FIN or RST (its connections stay open and carry nothing: a crashed node, a partition);
    connections made after that reach ``target``, where a replacement engine listens."""

    def __init__(self, target: int) -> None:
        self.port = free_port()
        self.target = target
        self.connections = 0
        self._frozen: asyncio.Event = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    def freeze(self, new_target: int) -> None:
        self._frozen.set()
        self.target = new_target

    async def stop(self) -> None:
        for pipe in self._pipes:
            pipe.cancel()
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        frozen = None if self._frozen.is_set() else self._frozen  # only the old host's connections freeze
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        self._writers += [writer, up_writer]
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            pipe = asyncio.create_task(self._pipe(source, sink, frozen))
            self._pipes.add(pipe)
            pipe.add_done_callback(self._pipes.discard)

    @staticmethod
    async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter, frozen: asyncio.Event | None) -> None:
        with contextlib.suppress(OSError):
            while data := await source.read(65536):
                if frozen is not None and frozen.is_set():
                    await asyncio.Event().wait()  # nothing moves, nothing closes
                sink.write(data)
                await sink.drain()


async def test_an_engine_host_gone_without_a_word_is_left_and_its_replacement_at_its_address_heard() -> None:
    """The engine's host dies silently and a new engine comes up behind the same address: the SUB
    socket's heartbeats find the dead connection, it reconnects, and the new engine's blocks, and only
    they, reach the index (a restart: the rank cleared and rebuilt from the new engine's replay)."""
    router = _router()
    old_port, replay = free_port(), f"tcp://127.0.0.1:{free_port()}"
    relay = FreezingRelay(old_port)
    await relay.start()
    old = FakeEngine(WORKER, f"tcp://127.0.0.1:{old_port}", replay, seed=43)
    await old.start()
    stream = ZmqEngineStream(SequencerSink(router, WORKER), f"tcp://127.0.0.1:{relay.port}", block_size=BLOCK,
                             replay_endpoint=replay, heartbeat_s=0.2)  # fmt: skip
    await stream.start()
    new_port = free_port()
    new = FakeEngine(WORKER, f"tcp://127.0.0.1:{new_port}", replay, seed=47)
    try:
        for _ in range(5):
            await old.step()
        await eventually(lambda: canonical(router.tree.dump_events()) == old.dump(), 10, "the old engine's blocks")
        relay.freeze(new_port)
        await old.stop()
        await new.start()
        await eventually(lambda: stream.stats["connections"] == 2, 10, "a connection to the new engine")
        assert relay.connections == 2
        for _ in range(5):
            await new.step()
        await eventually(lambda: canonical(router.tree.dump_events()) == new.dump(), 10, "the new engine's blocks")
        assert stream.stats["restarts"] == 1
        assert _stream(router).trusted
    finally:
        await stream.stop()
        await new.stop()
        await old.stop()
        await relay.stop()


async def test_a_restart_first_heard_at_the_next_seq_after_a_reconnection_is_seen() -> None:
    """A restarted engine binds a new PUB socket, and the SUB reconnects. Its first seqs, published
    before the subscription reached it, are lost; the next comes right after the old process's last
    applied seq. It is applied at once, then checked against the replay from the batch before it: a
    restart, so the old process's blocks go and the new one's come from its replay. The handshake's and
    the quiet spells' tail checks are held off: only the check the reconnection's first batch asks
    for can see it."""
    router = _router()
    endpoint, replay = loopback_endpoints(replay=True)
    old = FakeEngine(WORKER, endpoint, replay, seed=53)
    new = FakeEngine(WORKER, endpoint, replay, seed=59)
    await old.start()
    stream = _stream_without_tail_checks(router, endpoint, replay)
    await stream.start()
    try:

        async def heard() -> bool:  # one heard live (one sent before the SUB joined: the next one's gap)
            await old.step()
            return stream.stats["messages"] > 0

        await eventually(heard, what="the stream hears the engine")
        while old.publisher.next_seq < 6:
            await old.step()
        await eventually(lambda: canonical(router.tree.dump_events()) == old.dump() and not stream.backlog)
        assert stream.stats["connections"] == 1
        await _settled(stream.stats)  # the first connection's first batch may have asked a check
        checks = stream.stats["tail_checks"]
        await old.stop()
        await new.start()
        while new.publisher.next_seq < old.publisher.next_seq:
            await new.step(publish=False)  # published before the SUB socket reconnected
        await eventually(lambda: stream.stats["connections"] == 2, 10, "the SUB socket reconnected")
        malformed = stream.stats["rejected_bad_frames"]

        async def subscribed() -> bool:
            await new.publisher.send_malformed()
            return stream.stats["rejected_bad_frames"] > malformed

        await eventually(subscribed, 10, "the subscription reached the new PUB socket")
        await new.step()  # the next seq after the old process's last
        await eventually(lambda: canonical(router.tree.dump_events()) == new.dump(), 10, "the new process only")
        assert (stream.stats["restarts"], stream.stats["tail_checks"] - checks, stream.stats["unverified"]) == (1, 1, 0)
        assert _stream(router).trusted
    finally:
        await stream.stop()
        await new.stop()
        await old.stop()


async def test_the_router_answers_while_a_long_replay_is_applied() -> None:
    """A replay buffer holds up to 10,000 batches (vLLM's default): applied in slices, the loop runs
    between them (the router's decisions share it), so others see the replay part-applied."""
    router = _router()
    async with direct_mode(router, WORKER, replay=True, seed=61, history=2000) as (engine, direct):
        seen: set[int] = set()

        async def watch() -> None:
            while True:
                seen.add(direct.streams[0].stats["applied"])
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        try:
            await eventually(lambda: direct.streams[0].stats["applied"] >= 2000, 30, "the replay applied")
        finally:
            watcher.cancel()
        assert any(0 < applied < 2000 for applied in seen)
        await _converged(router, engine, direct)


async def test_a_rebuild_whose_sink_fails_once_is_taken_again_and_returns() -> None:
    """The sink fails while a rebuild clears the ranks (the bridge's NATS publish in an outage): the
    supervisor restarts the apply loop, which takes the rebuild again; its caller (an engine's health
    probe coming back) is answered, not left waiting for ever."""

    class FailingOnce(SequencerSink):
        failures = 1

        async def restarted(self, dp_rank: int) -> None:
            if self.failures:
                self.failures -= 1
                raise ConnectionError("outbound buffer full")
            await super().restarted(dp_rank)

    router = _router()
    endpoint, replay = loopback_endpoints(replay=True)
    engine = FakeEngine(WORKER, endpoint, replay, seed=67)
    await engine.start()
    for _ in range(3):
        await engine.step(publish=False)  # in the replay buffer: the stream's start brings them
    stream = ZmqEngineStream(FailingOnce(router, WORKER), endpoint, block_size=BLOCK, replay_endpoint=replay)
    await stream.start()
    try:
        await eventually(lambda: canonical(router.tree.dump_events()) == engine.dump(), 10, "the engine's history")
        await asyncio.wait_for(stream.rebuild(), 10)
        assert stream.stats["rebuilds"] == 2  # the failed one, then the one that went through
        assert canonical(router.tree.dump_events()) == engine.dump()
    finally:
        await stream.stop()
        await engine.stop()


async def test_an_engine_restarted_on_the_same_ports_that_published_nothing_yet_is_cleared_and_trusted() -> None:
    """A new process that has cached nothing yet: its replay holds nothing, so the old process's blocks
    go (the rank is cleared, not left unverified), and its first batch is heard as the next one."""
    router = _router()
    endpoint, replay = loopback_endpoints(replay=True)
    old = FakeEngine(WORKER, endpoint, replay, seed=47)
    await old.start()
    direct = DirectEngine(router, engine_spec(WORKER, endpoint, replay))
    await direct.start()
    new = FakeEngine(WORKER, endpoint, replay, seed=53)
    try:
        await _heard(old, direct)
        await _converged(router, old, direct)
        await old.stop()
        await new.start()
        stats = direct.streams[0].stats
        await eventually(
            lambda: stats["restarts"] == 1 and router.tree.dump_events() == [], 10, "the old process's blocks go"
        )
        for _ in range(2):
            await new.step()  # heard live once the subscription is in place, or replayed by the gap
        await _converged(router, new, direct)  # so the check that saw the restart is over
        assert (stats["restarts"], stats["unverified"], stats["missing_history"], stats["replay_failed"]) == (
            1,
            0,
            0,
            0,
        )
        assert _stream(router).trusted
    finally:
        await direct.stop()
        await new.stop()
        await old.stop()


async def test_an_idle_streams_tail_checks_change_nothing_and_come_once_per_quiet_spell() -> None:
    router = _router()
    async with direct_mode(router, WORKER, replay=True, seed=43) as (engine, direct):
        stats = direct.streams[0].stats
        await _heard(engine, direct)
        for _ in range(3):
            await engine.step()
        await _converged(router, engine, direct)
        await _settled(stats)  # the connection's check and the quiet spells' are past
        assert stats["tail_checks"] > 0
        before = dict(stats)
        await asyncio.sleep(3 * QUIET_S)  # an idle spell: no effect awaited, none may happen
        assert stats["tail_checks"] == before["tail_checks"]  # an idle engine is not polled
        await engine.step()  # a new quiet spell: one more check, which finds nothing to do
        await eventually(lambda: stats["tail_checks"] == before["tail_checks"] + 1, 10, "the quiet spell's check")
        await _converged(router, engine, direct)
        await _settled(stats)
        assert stats["tail_checks"] == before["tail_checks"] + 1 and stats["applied"] == before["applied"] + 1
        unchanged = ("gap", "restarts", "unverified", "replayed", "tail_recovered", "missing_history")
        assert {key: stats[key] for key in unchanged} == {key: before.get(key, 0) for key in unchanged}
        assert stats["tail_check_failed"] == 0
        assert _stream(router).trusted


async def test_a_tail_check_that_finds_garbage_under_the_applied_seq_fails_and_keeps_the_index() -> None:
    """A quiet spell's check answered with garbage under the seq applied last is a failed check (counted),
    not a restart: the engine's blocks are kept and the rank stays trusted."""
    router = _router()
    async with direct_mode(router, WORKER, replay=True, seed=44) as (engine, direct):
        stats = direct.streams[0].stats
        await _heard(engine, direct)
        await _converged(router, engine, direct)
        await _settled(stats)
        checks = stats["tail_checks"]
        seq = await engine.step()
        engine.publisher.corrupt_buffered(seq, b"\xc1\xc1\xc1")  # before the quiet spell's check asks for it
        await eventually(lambda: stats["tail_check_failed"] == 1, 10, "the quiet spell's check")
        assert stats["tail_checks"] == checks + 1 and stats["restarts"] == 0
        await _converged(router, engine, direct)
        assert _stream(router).trusted


async def test_a_replay_socket_that_does_not_answer_a_tail_check_leaves_the_stream_trusted_and_working(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import msgspec
    import zmq
    import zmq.asyncio

    from router.engines.zmq_stream import ZmqEngineStream

    router = _router()
    endpoint, replay = loopback_endpoints(replay=True)
    assert replay is not None
    context = zmq.asyncio.Context()
    pub = context.socket(zmq.PUB)
    pub.bind(endpoint)
    mute = context.socket(zmq.ROUTER)  # takes the replay requests, never answers
    mute.bind(replay)
    stream = ZmqEngineStream(
        SequencerSink(router, WORKER), endpoint, block_size=BLOCK, replay_endpoint=replay, replay_timeout_s=0.3,
        context=context,
    )  # fmt: skip
    await stream.start()
    stats = stream.stats

    async def send(seq: int) -> None:
        stored = {"type": "BlockStored", "block_hashes": [seq + 1], "parent_block_hash": seq or None,
                  "token_ids": list(range(seq * BLOCK, (seq + 1) * BLOCK)), "block_size": BLOCK, "lora_id": None,
                  "medium": "GPU", "lora_name": None}  # fmt: skip
        await pub.send_multipart([b"kv", seq.to_bytes(8, "big"), msgspec.msgpack.encode([0.0, [stored], 0])])

    try:

        async def subscribed() -> bool:  # probes (counted as bad frames) until the subscription is in place
            await pub.send_multipart([b"probe"])
            return stats["rejected_bad_frames"] > 0

        await eventually(subscribed, what="the subscription reaches the PUB socket")
        for seq in range(2):
            await send(seq)
        await eventually(lambda: stats["applied"] == 2 and stats["tail_check_failed"] >= 1, 10, "a failed check")
        await send(2)
        await eventually(lambda: stats["applied"] == 3, 10, "a later live message is applied")
        await eventually(lambda: stats["tail_check_failed"] >= 2, 10, "its quiet spell's check fails too")
        assert len(canonical(router.tree.dump_events())) == 3  # its three blocks
        assert (stats["gap"], stats["unverified"], stats["restarts"], stats["replay_failed"]) == (0, 0, 0, 0)
        assert _stream(router).trusted
        failed = [r for r in caplog.records if "tail check failed" in r.getMessage()]
        assert len(failed) == 1  # rate-limited
    finally:
        await stream.stop()
        pub.close(linger=0)
        mute.close(linger=0)
        context.term()


def test_dp_engine_specs_parse() -> None:
    spec = parse_engine_spec("7=tcp://h:5557,replay=tcp://h:6557,dp=4")
    assert spec.dp_size == 4 and str(spec) == "7=tcp://h:5557,replay=tcp://h:6557,dp=4"
    assert spec.rank_endpoints()[3] == (3, "tcp://h:5560", "tcp://h:6560")
    assert parse_engine_spec("7=tcp://h:5557").dp_size == 1
    for bad, says in (
        ("7=tcp://h:5557,dp=0", "1 to 256"),
        ("7=tcp://h:5557,dp=two", "1 to 256"),
        ("7=tcp://h:5557,replay=tcp://h:5558,dp=2", "overlap"),  # rank 1's events on the replay port
        ("7=tcp://h:65535,dp=2", "pass 65535"),
        ("7=ipc:///tmp/e,dp=2", "tcp://HOST:PORT"),
    ):
        with pytest.raises(ValueError, match=says):
            parse_engine_spec(bad)


async def test_a_data_parallel_engine_is_heard_on_every_rank() -> None:
    """``dp=2``: rank r publishes on the event port + r and replays on the replay port + r (vLLM's
    layout); the worker is registered with both ranks, each rank's blocks indexed under its rank, and a
    gap on rank 1 is repaired from rank 1's replay socket."""
    router = KvRouter(RouterConfig(block_size=BLOCK))
    events, replay = free_port_run(2), free_port_run(2)
    ranks = [
        FakeEngine(
            WORKER, f"tcp://127.0.0.1:{events + rank}", f"tcp://127.0.0.1:{replay + rank}", seed=rank, dp_rank=rank
        )
        for rank in range(2)
    ]
    for engine in ranks:
        await engine.start()
    direct = DirectEngine(router, f"{WORKER}=tcp://127.0.0.1:{events},replay=tcp://127.0.0.1:{replay},dp=2")
    await direct.start()
    try:
        assert all([await stream.joined(5.0) for stream in direct.streams])
        for _ in range(4):
            for engine in ranks:
                await engine.step()
        await ranks[1].step(publish=False)  # lost on the way: rank 1's next batch shows the gap
        await ranks[1].step()
        truth = sorted(ranks[0].dump() + ranks[1].dump(), key=repr)
        await eventually(
            lambda: (
                all(stream.backlog == 0 for stream in direct.streams) and canonical(router.tree.dump_events()) == truth
            )
        )
        assert {edge[1] for edge in truth} == {0, 1}
        worker = router.worker(WORKER)
        assert worker is not None and list(worker.dp_ranks) == [0, 1]
        assert direct.streams[1].stats["gap"] >= 1 and direct.streams[1].stats["replayed"] >= 1
        assert _stream(router, 1).trusted and _stream(router, 0).trusted
    finally:
        await direct.stop()
        for engine in ranks:
            await engine.stop()


@pytest.mark.parametrize("enable_eagle", [True, False])
async def test_an_eagle_engines_bigram_stores_match_requests_only_with_enable_eagle(enable_eagle: bool) -> None:
    """SGLang with EAGLE keys its cache by bigrams and publishes them; the router hashes them with EAGLE
    windows (Dynamo's reading), which requests hashed with ``enable_eagle`` match block for block.
    Without it the same prompt matches nothing, and the doctor says why at once; with it, an engine
    storing plain token ids is the mismatch."""
    router = KvRouter(RouterConfig(block_size=BLOCK, enable_eagle=enable_eagle))
    router.register_worker(WorkerConfig(worker_id=WORKER, block_size=BLOCK, leased=False))
    prompt = list(range(100, 100 + 3 * BLOCK + 1))  # three EAGLE blocks: 3 * BLOCK + 1 tokens
    bigrams = [[first, second] for first, second in itertools.pairwise(prompt)]
    store = {"type": "BlockStored", "block_hashes": [-5, -6, -7], "parent_block_hash": None,
             "token_ids": bigrams, "block_size": BLOCK, "medium": "GPU"}  # fmt: skip
    async with direct_mode(router, WORKER, replay=True) as (engine, direct):
        doctor = ConfigDoctor(router, engines=[direct])
        await engine.send([store])
        await eventually(lambda: direct.streams[0].backlog == 0 and router.tree.dump_events())
        (row,) = router.overlap(prompt).workers
        assert row.device_blocks == (3 if enable_eagle else 0)
        assert _stream(router).trusted
        assert not any(key.startswith("rejected") and value for key, value in direct.streams[0].stats.items())
        kinds = [problem.kind for problem in doctor.check()]
        assert kinds == ([] if enable_eagle else ["eagle_mismatch"])
        if enable_eagle:  # a plain store (vLLM, or SGLang without EAGLE) behind an EAGLE router
            await engine.send([{**store, "block_hashes": [-8], "token_ids": list(range(BLOCK))}])
            await eventually(lambda: direct.sink.stores == 2)
            (problem,) = doctor.check()
            assert problem.kind == "eagle_mismatch" and "1 stored events" in problem.evidence


async def test_a_frame_past_the_size_limit_is_counted_and_logged_as_a_rejection_and_a_restart_is_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """libzmq drops the connection that brings a frame past MAXMSGSIZE and never makes it again: only the
    reconnect counter moved, with no word of why. It is a rejection (``rejected_oversized``, logged), the
    stream goes on on a new connection, and an engine that restarts is not taken for one."""
    import zmq
    import zmq.asyncio
    from prometheus_client.core import Metric

    from api.metrics import EngineStreamCollector
    from router.engines.engine_spec import MAX_ENGINE_FRAME_BYTES

    context = zmq.asyncio.Context.instance()
    endpoint = f"tcp://127.0.0.1:{free_port()}"

    async def engine_socket() -> zmq.asyncio.Socket:
        # libzmq lets the port go in its own thread once the old socket is closed: bound again, it may
        # still be in use for a moment.
        for _ in range(100):
            pub = context.socket(zmq.XPUB)  # an XPUB hears the subscription: what it sends then is delivered
            pub.setsockopt(zmq.LINGER, 0)
            try:
                pub.bind(endpoint)
                return pub
            except zmq.ZMQError as exc:
                pub.close()
                if exc.errno != zmq.EADDRINUSE:
                    raise
                await asyncio.sleep(0.05)
        raise AssertionError(f"{endpoint} stayed in use")

    async def subscribed(pub: zmq.asyncio.Socket) -> None:
        while (await asyncio.wait_for(pub.recv(), 10))[:1] != b"\x01":  # an unsubscription: the connection's end
            pass

    def outcome(name: str) -> float:
        metrics: list[Metric] = list(EngineStreamCollector([stream]).collect())
        samples = [s for m in metrics for s in m.samples if s.labels.get("outcome") == name]
        return samples[0].value if samples else 0.0

    router = _router()
    stream = ZmqEngineStream(SequencerSink(router, WORKER), endpoint, block_size=BLOCK)
    pub = await engine_socket()
    await stream.start()
    try:
        await subscribed(pub)
        await pub.send_multipart([b"kv", (0).to_bytes(8, "big"), encode([1.0, _one_block_stored(1), 0])])
        await eventually(lambda: stream.stats["applied"] == 1)
        await pub.send_multipart([b"kv", (1).to_bytes(8, "big"), bytes(MAX_ENGINE_FRAME_BYTES + 1)])
        await subscribed(pub)  # again: the stream connected afresh
        await pub.send_multipart([b"kv", (2).to_bytes(8, "big"), encode([1.0, _one_block_stored(2), 0])])
        await eventually(lambda: stream.stats["applied"] == 2, 5, str(stream.stats))
        assert outcome("rejected_oversized") == 1
        assert f"engine event oversized: from {endpoint}, a frame past {MAX_ENGINE_FRAME_BYTES} bytes" in caplog.text

        pub.close()  # the engine restarts: its connection ends, and libzmq makes it again
        await eventually(lambda: stream.stats["connections"] == 2)
        pub = await engine_socket()
        await subscribed(pub)
        await eventually(lambda: stream.stats["connections"] == 3)
        assert outcome("rejected_oversized") == 1
    finally:
        await stream.stop()
        pub.close()


# ------------------------------------------------------------------------------- an engine that is down
def _engine_up(direct: DirectEngine) -> float:
    """``kv_router_engine_up`` of the engine, as /metrics shows it."""
    from api.metrics import EngineStreamCollector

    (family,) = [m for m in EngineStreamCollector(direct.streams, [direct]).collect() if m.name.endswith("engine_up")]
    (sample,) = family.samples
    assert sample.labels == {"worker_id": str(WORKER)}
    return sample.value


@pytest.mark.parametrize("fault", ["refused", "not_found"])
async def test_an_engine_that_does_not_answer_is_told_every_while_by_warnings_the_doctor_and_its_gauge(
    fault: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine whose server never answered (nothing listens; or its /health is a 404: a wrong url=)
    was one INFO line, then silence: no worker, no problem, no metric. It is a WARNING naming its URL and
    the error every `DOWN_WARNING_EVERY_S` (0.2 s here) while it lasts, the doctor's engine_down and
    ``kv_router_engine_up`` 0, until it answers."""
    monkeypatch.setattr(direct_module, "DOWN_WARNING_EVERY_S", 0.2, raising=False)
    http = EngineHttp()
    endpoint, replay = loopback_endpoints(replay=True)
    url, error = {
        "refused": (http.url, "does not answer /health: ConnectError"),
        "not_found": (f"{http.url}/v1/completions",
                      "does not answer /health: HTTP 404 (nothing at /health: is url= the engine's OpenAI server?)"),
    }[fault]  # fmt: skip
    if fault == "not_found":
        await http.start()
    router = KvRouter(RouterConfig(block_size=BLOCK))
    direct = DirectEngine(router, EngineSpec(WORKER, endpoint, replay, url), health_interval_s=0.05)
    await direct.start()
    try:
        said = f"engine of worker {WORKER} down for "
        await eventually(lambda: caplog.text.count(said) >= 2, 10, "a WARNING, told again")
        assert f"its OpenAI server at {url} {error}" in caplog.text
        doctor = ConfigDoctor(router, engines=[direct], engine_down_after_s=0.2)
        (problem,) = doctor.check()
        assert (problem.kind, problem.worker_id) == ("engine_down", WORKER) and f"at {url} {error}" in problem.evidence
        assert doctor.counts()["engine_down"] == 1 and _engine_up(direct) == 0
        if fault == "refused":
            await http.start()  # it answers at last: routable, and nothing is wrong any more
            await eventually(lambda: router.has_worker(WORKER))
            assert doctor.check() == [] and _engine_up(direct) == 1
    finally:
        await direct.stop()
        await http.stop()


async def test_an_engine_without_a_url_whose_socket_has_no_connection_or_no_event_is_told(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Without url= and a replay socket, an event endpoint where nothing listens said nothing at all. It is
    the doctor's engine_down and a WARNING every while; once connected, an engine that sends no event is
    a WARNING, once."""
    import zmq
    import zmq.asyncio

    monkeypatch.setattr(direct_module, "DOWN_WARNING_EVERY_S", 0.2, raising=False)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    router = KvRouter(RouterConfig(block_size=BLOCK))
    direct = DirectEngine(router, f"{WORKER}={endpoint}")
    pub = zmq.asyncio.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    await direct.start()
    try:
        await eventually(lambda: caplog.text.count(f"engine of worker {WORKER} down for ") >= 2, 10, "WARNINGs")
        assert f"its event socket {endpoint} has no connection: nothing listens there" in caplog.text
        doctor = ConfigDoctor(router, engines=[direct], engine_down_after_s=0.2)
        (problem,) = doctor.check()
        assert (problem.kind, problem.worker_id) == ("engine_down", WORKER) and endpoint in problem.evidence
        assert _engine_up(direct) == 0

        pub.bind(endpoint)  # an engine that publishes nothing (its KV events off)
        await eventually(lambda: direct.streams[0].stats["connections"] == 1)
        assert doctor.check() == [] and _engine_up(direct) == 1
        silent = f"no KV event heard from the engine of worker {WORKER} at {endpoint}"
        await eventually(lambda: silent in caplog.text)
        await asyncio.sleep(0.6)  # three more periods: told once
        assert caplog.text.count(silent) == 1
    finally:
        await direct.stop()
        pub.close()


def test_serve_with_an_engine_that_never_answers_shows_it_in_the_doctor_and_metrics(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The service with an --engine whose server never answers: /readyz ready, /v1/workers empty, and
    nothing said anywhere. /v1/doctor names it (engine_down, its URL and the error) and /metrics counts
    it (``kv_router_config_problems{kind="engine_down"}``, ``kv_router_engine_up`` 0). The doctor's grace
    (a minute) is left out here."""
    import functools
    import random

    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry

    from api import app as app_module
    from api.app import create_app
    from api.config import load_settings
    from tests.waiting import until

    monkeypatch.setattr(app_module, "ConfigDoctor", functools.partial(ConfigDoctor, engine_down_after_s=0))
    url = f"http://127.0.0.1:{free_port()}"
    spec = f"{WORKER}=tcp://127.0.0.1:{free_port()},url={url}"
    settings = load_settings(flags={"engine": [spec], "block_size": BLOCK, "embedded_nats": False}, env={})
    app = create_app(settings, registry=CollectorRegistry(), rng=random.Random(0))
    with TestClient(app, base_url="http://127.0.0.1") as client:

        def told() -> bool:
            problems = client.get("/v1/doctor").json()
            return [(p["kind"], p["worker_id"]) for p in problems] == [("engine_down", WORKER)] and (
                f"its OpenAI server at {url} does not answer /health: ConnectError" in problems[0]["evidence"]
            )

        until(told, 10, "the doctor names the engine")
        metrics = client.get("/metrics").text
        assert 'kv_router_config_problems{kind="engine_down"} 1.0' in metrics
        assert f'kv_router_engine_up{{worker_id="{WORKER}"}} 0.0' in metrics
        assert client.get("/v1/workers").json() == {"workers": []}

"""An engine's replay that loses batches is asked again from the batch before the first one missing.

A vLLM engine answers a replay from a ZMQ ROUTER socket, which drops replies silently once the
receiver falls behind (its high-water mark; no error on either side): a long replay to a busy router
loses batches in its middle, and at times its end marker. `replay_batches` returns every batch once,
in order, with none missing between the first and the last, all from one engine process, or raises
`ReplayError`, or `ReplayHoles` for seqs the buffer itself lacks (TensorRT-LLM numbers a batch, then
may drop it): a seq missing right after the one a round was asked from, where no reply is dropped
yet. Here a replay ROUTER on loopback drops what each test says, as the engine's would.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
import zmq
import zmq.asyncio

from router.engines.zmq_stream import (
    END_SEQ,
    MAX_ENGINE_FRAME_BYTES,
    REPLAY_ROUNDS,
    ReplayError,
    ReplayHoles,
    ReplayTooLarge,
    replay_batches,
)
from router.event_plane.embedded_server import free_port

pytestmark = pytest.mark.anyio

BATCHES = {seq: b"batch %d" % seq for seq in range(10)}
# (round, seq) -> whether the ROUTER drops that reply; seq END_SEQ is the end marker. With
# ``positional``: (round, the reply's position in its answer) instead.
Drop = Callable[[int, int], bool]


@contextlib.asynccontextmanager
async def lossy_replay(
    context: zmq.asyncio.Context,
    drop: Drop,
    restarted_after: int | None = None,
    *,
    positional: bool = False,
    buffered: dict[int, bytes] = BATCHES,
) -> AsyncIterator[tuple[str, list[int]]]:
    """A replay ROUTER serving ``buffered`` as vLLM >= 0.26 does (``[identity, b"", topic, seq, payload]``),
    dropping what ``drop`` says (after round ``restarted_after``, another process's batches under the
    same seqs); yields its endpoint and the start of each request it was sent."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(endpoint)
    asked: list[int] = []

    async def serve() -> None:
        while True:
            identity, _, start = await socket.recv_multipart()
            round_ = len(asked)
            asked.append(int.from_bytes(start, "big"))
            for position, seq in enumerate([seq for seq in sorted(buffered) if seq >= asked[-1]] + [END_SEQ]):
                if not drop(round_, position if positional else seq):
                    payload = buffered.get(seq, b"")
                    if restarted_after is not None and round_ > restarted_after and seq != END_SEQ:
                        payload = b"restarted " + payload
                    await socket.send_multipart([identity, b"", b"kv@engine", seq.to_bytes(8, "big"), payload])

    task = asyncio.create_task(serve())
    try:
        yield endpoint, asked
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        socket.close()


@pytest.fixture
def context() -> Iterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


async def test_batches_dropped_in_the_middle_are_asked_for_again(context: zmq.asyncio.Context) -> None:
    async with lossy_replay(context, lambda round_, seq: round_ == 0 and seq in (4, 5)) as (endpoint, asked):
        batches = await replay_batches(context, endpoint, 0, timeout_s=2.0)
    assert batches == sorted(BATCHES.items())
    assert asked == [0, 3]  # from the batch before the hole, which must come back the same


async def test_a_dropped_end_marker_and_the_batches_before_it_are_asked_for_again(
    context: zmq.asyncio.Context,
) -> None:
    async with lossy_replay(context, lambda round_, seq: round_ == 0 and seq in (8, 9, END_SEQ)) as (endpoint, asked):
        batches = await replay_batches(context, endpoint, 2, timeout_s=1.0)  # the silence that ends it
    assert batches == [(seq, BATCHES[seq]) for seq in range(2, 10)]
    assert asked == [2, 7]


async def test_a_batch_missing_right_after_the_one_asked_from_is_the_buffers_own_hole(
    context: zmq.asyncio.Context,
) -> None:
    async with lossy_replay(context, lambda _, seq: seq == 5) as (endpoint, asked):
        with pytest.raises(ReplayHoles) as holes:
            await replay_batches(context, endpoint, 0, timeout_s=2.0)
    assert holes.value.batches == [(seq, payload) for seq, payload in sorted(BATCHES.items()) if seq != 5]
    assert holes.value.resumes == [6]
    assert asked == [0, 4]  # confirmed by the second round: asked from 4, the next reply was 6


async def test_replies_dropped_past_the_first_two_of_every_answer_are_an_error_not_a_hole(
    context: zmq.asyncio.Context,
) -> None:
    """A ROUTER's queue that fills in every answer drops replies after its first few: the batches exist,
    so nothing is taken for a hole of the buffer (which would leave the rank unverified for good)."""
    async with lossy_replay(context, lambda _, position: 2 <= position <= 7, positional=True) as (endpoint, asked):
        with pytest.raises(ReplayError, match="still missing") as failed:
            await replay_batches(context, endpoint, 0, timeout_s=2.0)
    assert not isinstance(failed.value, ReplayHoles)
    assert len(asked) == REPLAY_ROUNDS


async def test_a_seq_far_past_the_others_is_an_error_not_a_hole(context: zmq.asyncio.Context) -> None:
    far = {**BATCHES, 2**40: b"garbage numbered far ahead"}
    async with lossy_replay(context, lambda _, seq: False, buffered=far) as (endpoint, _):
        with pytest.raises(ReplayError, match="jumps from seq 9") as failed:
            await replay_batches(context, endpoint, 8, timeout_s=2.0)
    assert not isinstance(failed.value, ReplayHoles)


async def test_an_engine_restarted_between_two_rounds_is_an_error_not_a_mix(context: zmq.asyncio.Context) -> None:
    drop = lambda round_, seq: round_ == 0 and seq == 5  # noqa: E731
    async with lossy_replay(context, drop, restarted_after=0) as (endpoint, asked):
        with pytest.raises(ReplayError, match="seq 4 changed between two rounds"):
            await replay_batches(context, endpoint, 0, timeout_s=2.0)
    assert asked == [0, 4]


async def test_a_replay_of_nothing_buffered_ends_at_once(context: zmq.asyncio.Context) -> None:
    async with lossy_replay(context, lambda _, seq: False) as (endpoint, asked):
        assert await replay_batches(context, endpoint, 10, timeout_s=2.0) == []
    assert asked == [10]


async def test_a_round_past_its_bounds_is_refused_at_the_first_batch_past_them(context: zmq.asyncio.Context) -> None:
    """A replay socket answering more batches, or more bytes, than a round takes (a runaway peer: here a
    buffer of 50 batches of 9 bytes against a bound one short of it) raises `ReplayTooLarge`, a
    `ReplayError`: a failed replay, the rest unread. Within the bounds the same buffer replays whole."""
    buffered = {seq: b"batch %03d" % seq for seq in range(50)}
    reply = len(b"kv@engine") + 8 + 9  # every frame counts: the topic, the seq, the payload
    async with lossy_replay(context, lambda round_, seq: False, buffered=buffered) as (endpoint, asked):
        with pytest.raises(ReplayTooLarge, match="past 49 batches"):
            await replay_batches(context, endpoint, 0, max_batches=49)
        with pytest.raises(ReplayTooLarge, match=f"or {50 * reply - 1} bytes"):
            await replay_batches(context, endpoint, 0, max_bytes=50 * reply - 1)
        assert issubclass(ReplayTooLarge, ReplayError)
        whole = await replay_batches(context, endpoint, 0, max_batches=50, max_bytes=50 * reply)
        assert whole == sorted(buffered.items()) and asked == [0, 0, 0]  # each refusal one round: not asked again


async def test_a_reply_is_bounded_by_all_its_frames_and_none_past_the_frame_bound_is_read(
    context: zmq.asyncio.Context,
) -> None:
    """A replay socket's topic frame is memory as its payload is: a reply whose topic alone passes the
    round's bytes is refused (only payloads counted, it was taken). And a frame past
    `MAX_ENGINE_FRAME_BYTES` is never read (libzmq drops the connection at its header): the replay gets
    no answer, where it read the frame whole into memory."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)

    async def answer(topic: bytes, payload: bytes) -> None:
        identity, _, _ = await router.recv_multipart()
        await router.send_multipart([identity, b"", topic, (0).to_bytes(8, "big"), payload])
        await router.send_multipart([identity, b"", topic, END_SEQ.to_bytes(8, "big"), b""])

    try:
        answering = asyncio.create_task(answer(b"t" * 4096, b"batch"))
        with pytest.raises(ReplayTooLarge):
            await replay_batches(context, endpoint, 0, timeout_s=2.0, max_bytes=1024)
        await answering
        answering = asyncio.create_task(answer(b"kv@engine", bytes(MAX_ENGINE_FRAME_BYTES + 1)))
        with pytest.raises(ReplayError, match="no end marker"):
            await replay_batches(context, endpoint, 0, timeout_s=1.0)
        await answering
    finally:
        router.close()


async def test_a_replay_dripping_replies_fails_at_its_rounds_limit(context: zmq.asyncio.Context) -> None:
    """A ROUTER answering a batch every 0.2 s and never the end marker: each reply extends the wait by
    the timeout, so the round once lasted as long as the peer went on (up to `MAX_REPLAY_BATCHES` of
    them, the apply loop held all along); it fails at its limit."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)

    async def drip() -> None:
        identity, _, _ = await router.recv_multipart()
        for seq in itertools.count():
            await router.send_multipart([identity, b"", b"kv@engine", seq.to_bytes(8, "big"), b"batch"])
            await asyncio.sleep(0.2)  # the dripping is what is tested

    dripping = asyncio.create_task(drip())
    started = time.monotonic()
    try:
        with pytest.raises(ReplayError, match=r"still answering after 1\.0 s"):
            await replay_batches(context, endpoint, 0, timeout_s=1.0, round_limit_s=1.0)
        assert time.monotonic() - started < 5
    finally:
        dripping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await dripping
        router.close()

"""Reading an engine's SUB socket (`router.engines.zmq_drain.drain_sub`).

One PUB socket sends a script of messages to a SUB socket (real ZMQ sockets over inproc, so every
message is queued before the first read); it is drained with a series of (limit, room, room_bytes)
calls that must give the exact answers written out here: the well-formed messages as (seq, payload)
while there is room, drops after that, the frame count of every other shape. Then a `ZmqEngineStream`
with a small queue (by count, then by bytes) counts what its reader took, dropped and refused.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import zmq
import zmq.asyncio

from router.config import RouterConfig
from router.engines import zmq_drain
from router.engines.direct import SequencerSink
from router.engines.zmq_stream import ZmqEngineStream
from router.kv_router import KvRouter
from router.types import WorkerConfig
from tests.waiting import eventually, until

BIG = bytes(range(256)) * 800  # 200 kB: a message libzmq keeps on the heap, not inline
SCRIPT: list[list[bytes]] = [
    [b"kv", (0).to_bytes(8, "big"), b"p0"],
    [b"kv"],
    [b"kv", b"1234567", b"short seq"],
    [b"kv", ((1 << 64) - 1).to_bytes(8, "big"), b""],
    [b"kv", (5).to_bytes(8, "big"), b"a", b"b"],
    [b"kv", (6).to_bytes(8, "big")],
    *([b"kv", seq.to_bytes(8, "big"), BIG[seq:]] for seq in range(7, 11)),
]
ROOMY = 1 << 30
# (limit, room, room_bytes) of each call, and what it must answer: (messages, dropped, frame counts),
# then `out`. The byte room takes a payload that fits what is left of it, whatever came before.
CALLS: list[tuple[int, int, int, tuple[int, int, list[int]], list[tuple[int, bytes]]]] = [
    (3, 10, ROOMY, (3, 0, [1, 3]), [(0, b"p0")]),
    (5, 2, ROOMY, (5, 1, [4, 2]), [((1 << 64) - 1, b""), (7, BIG[7:])]),
    (100, 5, len(BIG[10:]), (2, 1, []), [(10, BIG[10:])]),  # seq 9's payload is one byte longer
    (100, 5, ROOMY, (0, 0, []), []),
]


@pytest.fixture
def sockets() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    publisher = context.socket(zmq.PUB)
    publisher.setsockopt(zmq.SNDHWM, 0)
    publisher.bind("inproc://engine")
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.RCVHWM, 0)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv")
    subscriber.connect("inproc://engine")

    def heard() -> bool:  # the subscription reaches the PUB socket as it sends: probe until one is heard
        publisher.send_multipart([b"kv-probe"])
        return bool(subscriber.poll(10))

    until(heard, 30, "the subscription reaches the PUB socket")
    while subscriber.poll(0):
        subscriber.recv_multipart()
    try:
        yield publisher, subscriber
    finally:
        for socket in (publisher, subscriber):
            socket.close(linger=0)
        context.term()


def _run(socket: zmq.Socket[bytes]) -> list[tuple[tuple[int, int, list[int]], list[tuple[int, bytes]]]]:
    answers = []
    for limit, room, room_bytes, _, _ in CALLS:
        out: list[tuple[int, bytes]] = []
        answers.append((zmq_drain.drain_sub(socket, limit, room, room_bytes, out), out))
    return answers


def test_the_reader_gives_the_written_answers(
    sockets: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    publisher, subscriber = sockets
    for frames in SCRIPT:
        publisher.send_multipart(frames)
    assert _run(subscriber) == [(answer, out) for _, _, _, answer, out in CALLS]


def test_a_closed_socket_raises_instead_of_reading(
    sockets: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    _, subscriber = sockets
    subscriber.close(linger=0)
    with pytest.raises((zmq.ZMQError, OSError)):
        zmq_drain.drain_sub(subscriber, 10, 10, ROOMY, [])


EMPTY_BATCH = msgspec.msgpack.encode([1700000000.5, [], 0])


@pytest.mark.anyio
@pytest.mark.parametrize(
    "bound", [{"queue_size": 3}, {"queue_bytes": 3 * len(EMPTY_BATCH)}], ids=["by_count", "by_bytes"]
)
async def test_a_stream_counts_what_its_reader_took_dropped_and_refused(bound: dict[str, int]) -> None:
    """A queue of three batches (by count, or by bytes: before, bounded by count alone, 10,000 batches of
    up to 16 MiB each could hold 160 GiB) takes three of a burst, drops the rest, counted as
    `dropped_queue_full`, and has its room back once applied."""
    context = zmq.asyncio.Context()
    publisher = context.socket(zmq.PUB)
    engine: zmq.Socket[bytes] = zmq.Socket.shadow(publisher.underlying)  # sends at once, no future
    engine.setsockopt(zmq.SNDHWM, 0)
    engine.bind("inproc://stream-engine")
    router = KvRouter(RouterConfig(block_size=16))
    router.register_worker(WorkerConfig(worker_id=3, block_size=16, leased=False))
    stream = ZmqEngineStream(
        SequencerSink(router, 3), "inproc://stream-engine", block_size=16, context=context, **bound
    )
    await stream.start()
    try:
        stats = stream.stats

        def probed() -> bool:  # until the subscription has reached the PUB socket
            if stats["rejected_bad_frames"]:  # in order: every probe sent before the one seen is in too
                return True
            engine.send_multipart([b"probe"])
            return False

        await eventually(probed, 30, "a probe reaches the reader")
        await eventually(lambda: stats["messages"] == stats["rejected_bad_frames"] > 0)
        # A probe sent just before the one seen may still be on its way: counted with the batches below.
        probes = stats["messages"]
        # All queued before the reader runs again: one read takes the queue's 3, drops the other 47.
        for seq in range(50):
            engine.send_multipart([b"kv", seq.to_bytes(8, "big"), EMPTY_BATCH])
        engine.send_multipart([b"kv", b"seq"])
        await eventually(lambda: stats["messages"] - stats["rejected_bad_frames"] == 50 and stats["applied"] == 3)
        assert stats["dropped_queue_full"] == 47 and stats["rejected_bad_frames"] - probes in (1, 2)
        assert stream.last_rejection["bad_frames"] == "expected [topic, seq(8 bytes), payload], got 2 frames"
        assert stream.backlog == 0
        # Applied, the three left room for three more (after a gap: the stream goes on, unverified).
        for seq in range(50, 53):
            engine.send_multipart([b"kv", seq.to_bytes(8, "big"), EMPTY_BATCH])
        await eventually(lambda: stats["applied"] == 6)
        assert stats["dropped_queue_full"] == 47 and stats["gap"] == 1
    finally:
        await stream.stop()
        publisher.close(linger=0)
        context.term()

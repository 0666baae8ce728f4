"""Reading an engine's SUB socket: the C reader (`indexer._events_native.drain_sub`) against pyzmq's.

One PUB socket sends a script of messages to two SUB sockets (real ZMQ sockets over inproc, so every
message is queued on both before the first read); each is drained with the same (limit, room)
calls, one in C and one through pyzmq, and both must give the exact answers written out here: the
well-formed messages as (seq, payload) while there is room, drops after that, the frame count of
every other shape.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from router.engines import zmq_drain

Drain = Callable[[zmq.Socket[bytes], int, int, list[tuple[int, bytes]]], tuple[int, int, list[int]]]

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
# (limit, room) of each call, and what it must answer: (messages, dropped, frame counts), then `out`.
CALLS: list[tuple[int, int, tuple[int, int, list[int]], list[tuple[int, bytes]]]] = [
    (3, 10, (3, 0, [1, 3]), [(0, b"p0")]),
    (100, 2, (7, 3, [4, 2]), [((1 << 64) - 1, b""), (7, BIG[7:])]),
    (100, 5, (0, 0, []), []),
]


@pytest.fixture
def sockets() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes], zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    publisher = context.socket(zmq.PUB)
    publisher.setsockopt(zmq.SNDHWM, 0)
    publisher.bind("inproc://engine")
    subscribers = []
    for _ in range(2):
        subscriber = context.socket(zmq.SUB)
        subscriber.setsockopt(zmq.RCVHWM, 0)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"kv")
        subscriber.connect("inproc://engine")
        subscribers.append(subscriber)
    # Subscriptions reach the PUB socket as it sends: probe until both subscribers hear one.
    deadline = time.monotonic() + 5
    pending = set(range(2))
    while pending and time.monotonic() < deadline:
        publisher.send_multipart([b"kv-probe"])
        for index in list(pending):
            if subscribers[index].poll(10):
                pending.discard(index)
    assert not pending, "the subscriptions never reached the PUB socket"
    for subscriber in subscribers:
        while subscriber.poll(0):
            subscriber.recv_multipart()
    try:
        yield publisher, subscribers[0], subscribers[1]
    finally:
        for socket in (publisher, *subscribers):
            socket.close(linger=0)
        context.term()


def _run(drain: Drain, socket: zmq.Socket[bytes]) -> list[tuple[tuple[int, int, list[int]], list[tuple[int, bytes]]]]:
    answers = []
    for limit, room, _, _ in CALLS:
        out: list[tuple[int, bytes]] = []
        answers.append((drain(socket, limit, room, out), out))
    return answers


def test_both_readers_give_the_written_answers(
    sockets: tuple[zmq.Socket[bytes], zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    if not zmq_drain.NATIVE:
        pytest.skip("the C reader is off (KV_ROUTER_NO_NATIVE, not built, or libzmq's calls not found)")
    publisher, for_c, for_python = sockets
    for frames in SCRIPT:
        publisher.send_multipart(frames)
    expected = [(answer, out) for _, _, answer, out in CALLS]
    assert _run(zmq_drain.drain_sub, for_c) == expected
    assert _run(zmq_drain.drain_sub_python, for_python) == expected


def test_the_reader_in_use_gives_the_written_answers(
    sockets: tuple[zmq.Socket[bytes], zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    """Whichever reader `KV_ROUTER_NO_NATIVE` selects (the suite runs both ways)."""
    publisher, subscriber, _ = sockets
    for frames in SCRIPT:
        publisher.send_multipart(frames)
    assert _run(zmq_drain.drain_sub, subscriber) == [(answer, out) for _, _, answer, out in CALLS]


def test_a_closed_socket_raises_instead_of_reading(
    sockets: tuple[zmq.Socket[bytes], zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    _, subscriber, _ = sockets
    subscriber.close(linger=0)
    with pytest.raises((zmq.ZMQError, OSError)):
        zmq_drain.drain_sub(subscriber, 10, 10, [])

"""Reading what an engine's SUB socket holds, every queued message in one call.

`drain_sub` reads without blocking up to ``limit`` messages. Each ``[topic, seq (8 bytes BE),
payload]`` goes to ``out`` as ``(seq, payload)`` while ``room`` lasts and is counted as dropped after
that (the stream's bounded queue); any other shape is listed by its frame count. Through pyzmq a
three-frame message costs about 12 µs of Python calls; `indexer._events_native.drain_sub` does the
same in one C call per wake-up with libzmq's own message calls, taken from the library pyzmq loaded
(the extension does not link libzmq). Without the C module, with ``KV_ROUTER_NO_NATIVE=1``, or when
pyzmq's libzmq does not export them, the pyzmq loop runs, with the same answers
(tests/test_zmq_drain.py runs both over real sockets).
"""

from __future__ import annotations

import ctypes
import logging

import zmq

from indexer.events_native import ENABLED as EVENTS_NATIVE
from indexer.events_native import accel as events_accel

__all__ = ["NATIVE", "drain_sub", "drain_sub_python"]

log = logging.getLogger(__name__)

# The C reader's libzmq calls, in `configure_zmq`'s order.
_ZMQ_CALLS = (
    "zmq_msg_init",
    "zmq_msg_recv",
    "zmq_msg_close",
    "zmq_msg_data",
    "zmq_msg_size",
    "zmq_msg_more",
    "zmq_errno",
)


def _configure_native() -> bool:
    """Hand libzmq's message calls to the C reader; False when they cannot be found."""
    # The C side's 64-byte message holds libzmq 4's zmq_msg_t (64 bytes, or fewer in its first releases).
    if not EVENTS_NATIVE or zmq.zmq_version_info()[0] < 4:
        return False
    try:
        from zmq.backend.cython import _zmq

        # dlsym on pyzmq's extension searches the libraries it loaded: its own libzmq.
        library = ctypes.CDLL(_zmq.__file__)
        addresses = [ctypes.cast(getattr(library, name), ctypes.c_void_p).value or 0 for name in _ZMQ_CALLS]
        events_accel.configure_zmq(*addresses)
    except (ImportError, OSError, AttributeError, ValueError) as exc:
        log.info("reading engine SUB sockets through pyzmq (libzmq's calls not found: %s)", exc)
        return False
    return True


NATIVE = _configure_native()


def drain_sub_python(
    socket: zmq.Socket[bytes], limit: int, room: int, out: list[tuple[int, bytes]]
) -> tuple[int, int, list[int]]:
    """`drain_sub` through pyzmq: ``(messages read, dropped for want of room, frame counts of the
    misshapen ones)``."""
    messages = dropped = 0
    bad: list[int] = []
    while messages < limit:
        try:
            frames = socket.recv_multipart(zmq.NOBLOCK, copy=True)
        except zmq.Again:
            break
        messages += 1
        if len(frames) != 3 or len(frames[1]) != 8:
            bad.append(len(frames))
        elif room > 0:
            out.append((int.from_bytes(frames[1], "big"), frames[2]))
            room -= 1
        else:
            dropped += 1
    return messages, dropped, bad


def drain_sub(
    socket: zmq.Socket[bytes], limit: int, room: int, out: list[tuple[int, bytes]]
) -> tuple[int, int, list[int]]:
    """Up to ``limit`` queued messages of a SUB socket into ``out`` (see the module's text)."""
    if NATIVE:
        return events_accel.drain_sub(socket.underlying, limit, room, out)
    return drain_sub_python(socket, limit, room, out)

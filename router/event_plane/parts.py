"""A reply too large for one NATS message (the server's ``max_payload``: 1 MiB unless configured) goes
in parts: several replies to the asker's own inbox, each marked ``more`` but the last, and only to an
asker that said it reads parts. A worker's resync answer (`router.event_plane.resync_parts`) and a
replica's view (`router.replicas.sync`) both go this way; this module holds what they share: cutting
a reply's items into parts that fit (`pack`) and reading the parts (`request_in_parts`).

The asker reads at most `MAX_PARTS_BYTES` of parts for one answer: a worker or peer that goes on saying
``more`` (hostile or buggy) would otherwise grow the asker's memory without end. Past it the answer is
abandoned (`PartsTooLarge`), undecoded, as one never answered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import TypeVar

import msgspec
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError

from router.event_plane.embedded_server import MAX_PAYLOAD_BYTES

__all__ = ["MAX_PARTS_BYTES", "PartsTooLarge", "pack", "request_in_parts"]

T = TypeVar("T")
R = TypeVar("R")

_encode = msgspec.msgpack.encode
# A request's reply when nobody serves its subject: the server's status message (what nc.request reads).
_STATUS_HEADER = "Status"
_NO_RESPONDERS = "503"
# The bytes one answer's parts may bring together: as much as one reply may hold on a server with
# NATS' largest max_payload (the embedded server's, sized for a worker's whole dump): about 1.3M
# blocks of a dump at tens of bytes a block, ten times the largest event the sequencer takes.
MAX_PARTS_BYTES = MAX_PAYLOAD_BYTES


class PartsTooLarge(Exception):
    """An answer whose parts brought more than `MAX_PARTS_BYTES`: abandoned unread."""


def pack(items: Iterable[T], room: int) -> list[list[T]] | None:
    """``items`` in order, in as few consecutive groups as keep each one's msgpack within ``room``
    bytes (msgpack is concatenative: a list's items encode alone alike); None when one item alone is
    larger. O(bytes of the items)."""
    parts: list[list[T]] = [[]]
    size = 0
    for item in items:
        encoded = len(_encode(item))
        if encoded > room:
            return None
        if size + encoded > room and parts[-1]:
            parts.append([])
            size = 0
        parts[-1].append(item)
        size += encoded
    return parts


async def request_in_parts(
    nc: Client, subject: str, payload: bytes, timeout: float, add: Callable[[bytes], R | None]
) -> R:
    """Ask on ``subject`` with an inbox of the request's own and give each reply's bytes to ``add``
    until it returns the whole answer (the last part, or a reply not in parts); each reply must come
    within ``timeout`` of the one before. Raises `NoRespondersError`, NATS' `TimeoutError` and its
    other errors, whatever ``add`` raises, and `PartsTooLarge` (before ``add`` sees the part) once the
    parts brought more than `MAX_PARTS_BYTES`."""
    inbox = nc.new_inbox()
    subscription = await nc.subscribe(inbox)
    try:
        await nc.publish(subject, payload, reply=inbox)
        read_bytes = 0
        while True:
            message = await subscription.next_msg(timeout=timeout)
            headers = message.headers
            if headers and headers.get(_STATUS_HEADER) == _NO_RESPONDERS:
                raise NoRespondersError
            read_bytes += len(message.data)
            if read_bytes > MAX_PARTS_BYTES:
                raise PartsTooLarge(f"its parts brought more than {MAX_PARTS_BYTES} bytes")
            whole = add(message.data)
            if whole is not None:
                return whole
    finally:
        with contextlib.suppress(NatsError):  # the connection closed meanwhile: nothing to undo
            await subscription.unsubscribe()

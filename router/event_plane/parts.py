"""A reply too large for one NATS message (the server's ``max_payload``: 1 MiB unless configured) goes
in parts: several replies to the asker's own inbox, each marked ``more`` but the last, and only to an
asker that said it reads parts. A worker's resync answer (`router.event_plane.resync_parts`) and a
replica's view (`router.replicas.sync`) both go this way; this module holds what they share: cutting
a reply's items into parts that fit (`pack`), asking and reading the parts (`request_in_parts`) and
joining them into the whole answer (`PartsJoiner`, which each kind of answer completes).

The asker reads at most `MAX_PARTS_BYTES` of parts for one answer: a worker or peer that goes on saying
``more`` (hostile or buggy) would otherwise grow the asker's memory without end. Past it the answer is
abandoned (`PartsTooLarge`), undecoded, as one never answered.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterable
from typing import Generic, TypeVar

import msgspec
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError

from router.event_plane.embedded_server import MAX_PAYLOAD_BYTES

__all__ = ["MAX_PARTS_BYTES", "PartsJoiner", "PartsTooLarge", "pack", "request_in_parts"]

T = TypeVar("T")
A = TypeVar("A")

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


class PartsJoiner(abc.ABC, Generic[A]):
    """One answer's parts, joined in the order they come: `add` each reply's bytes; it returns the whole
    answer once the last part (or a reply not in parts) is in, else None. A kind of answer says how its
    replies decode (`decode`), which are parts with more to come (`more`) and how its parts make the
    whole (`join`). One joiner reads one answer. At most `MAX_PARTS_BYTES` are read for it: past it
    `PartsTooLarge`, the part left undecoded. Raises what an undecodable reply raises."""

    __slots__ = ("_parts", "_read_bytes")

    def __init__(self) -> None:
        self._parts: list[A] = []
        self._read_bytes = 0

    def add(self, data: bytes) -> A | None:
        self._read_bytes += len(data)
        if self._read_bytes > MAX_PARTS_BYTES:
            raise PartsTooLarge(f"its parts brought more than {MAX_PARTS_BYTES} bytes")
        reply = self.decode(data)
        if self.more(reply):
            self._parts.append(reply)
            return None
        return self.join(self._parts, reply) if self._parts else reply

    @abc.abstractmethod
    def decode(self, data: bytes) -> A:
        """One reply's bytes as the answer's type."""

    @abc.abstractmethod
    def more(self, reply: A) -> bool:
        """Whether ``reply`` is a part with more to come."""

    @abc.abstractmethod
    def join(self, parts: list[A], last: A) -> A:
        """The whole answer from the ``parts`` before the ``last`` reply, in the order they came."""


async def request_in_parts(nc: Client, subject: str, payload: bytes, timeout: float, joiner: PartsJoiner[A]) -> A:
    """Ask on ``subject`` with an inbox of the request's own and give each reply's bytes to ``joiner``
    until it returns the whole answer (the last part, or a reply not in parts); each reply must come
    within ``timeout`` of the one before. Raises `NoRespondersError`, NATS' `TimeoutError` and its
    other errors, and whatever ``joiner`` raises (`PartsTooLarge` among them)."""
    inbox = nc.new_inbox()
    subscription = await nc.subscribe(inbox)
    try:
        await nc.publish(subject, payload, reply=inbox)
        while True:
            message = await subscription.next_msg(timeout=timeout)
            headers = message.headers
            if headers and headers.get(_STATUS_HEADER) == _NO_RESPONDERS:
                raise NoRespondersError
            whole = joiner.add(message.data)
            if whole is not None:
                return whole
    finally:
        with contextlib.suppress(NatsError):  # the connection closed meanwhile: nothing to undo
            await subscription.unsubscribe()

"""A reply too large for one NATS message (the server's ``max_payload``: 1 MiB unless configured) goes
in parts: several replies to the asker's own inbox, each marked ``more`` but the last, and only to an
asker that said it reads parts. A worker's resync answer (`router.event_plane.resync_parts`) and a
replica's view (`router.replicas.sync`) both go this way; this module holds what they share: cutting
a reply's items into parts that fit (`pack`) and reading the parts (`request_in_parts`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import TypeVar

import msgspec
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError

__all__ = ["pack", "request_in_parts"]

T = TypeVar("T")
R = TypeVar("R")

_encode = msgspec.msgpack.encode
# A request's reply when nobody serves its subject: the server's status message (what nc.request reads).
_STATUS_HEADER = "Status"
_NO_RESPONDERS = "503"


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
    other errors, and whatever ``add`` raises."""
    inbox = nc.new_inbox()
    subscription = await nc.subscribe(inbox)
    try:
        await nc.publish(subject, payload, reply=inbox)
        while True:
            message = await subscription.next_msg(timeout=timeout)
            headers = message.headers
            if headers and headers.get(_STATUS_HEADER) == _NO_RESPONDERS:
                raise NoRespondersError
            whole = add(message.data)
            if whole is not None:
                return whole
    finally:
        with contextlib.suppress(NatsError):  # the connection closed meanwhile: nothing to undo
            await subscription.unsubscribe()

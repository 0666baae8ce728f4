"""Ids for requests that came without one (the proxy's bookings, `/v1/new` without an id).

Shaped as ``uuid4().hex`` is (32 hex digits) and as unique across processes and restarts, at a fifth
of its cost on the proxy's hot path (no ``os.urandom`` call per request): a random 64-bit prefix drawn
once per process, drawn again in a forked child, then a counter."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

__all__ = ["new_request_id"]

_prefix: str
_counter: Iterator[int]


def _draw() -> None:
    global _prefix, _counter
    _prefix = os.urandom(8).hex()
    _counter = itertools.count(1)


_draw()
os.register_at_fork(after_in_child=_draw)


def new_request_id() -> str:
    return f"{_prefix}{next(_counter):016x}"

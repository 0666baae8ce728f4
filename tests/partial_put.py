"""A client putting one object into a NATS Object Store slowly, run as a process of its own by the tests
of what an interrupted put leaves (``python -m tests.partial_put URL BUCKET NAME ...``).

It puts ``--chunks`` chunks of ``--chunk-bytes`` bytes (chunk ``i`` is the byte ``i % 256`` repeated, see
`content`), one every ``--every`` seconds, through nats-py's own `ObjectStore.put`. Then, with
``--hang``, it waits to be killed before the put ends: the chunks are in the bucket's stream and no meta
names them, as a router killed mid-snapshot leaves them. Without it the put ends (its meta written) and
the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import threading
import time
from typing import Any

import nats
from nats.js.api import ObjectMeta, ObjectMetaOptions

__all__ = ["content"]


def content(chunks: int, chunk_bytes: int) -> bytes:
    """The object a put of ``chunks`` chunks of ``chunk_bytes`` writes."""
    return b"".join(bytes((index % 256,)) * chunk_bytes for index in range(chunks))


class _PacedReader(io.BufferedIOBase):
    """The object's bytes a chunk at a time, each after ``every_s`` (nats-py reads it in a thread of its
    executor, so the sleep holds no event loop); with ``hang``, no end until the process is killed."""

    def __init__(self, chunks: int, chunk_bytes: int, every_s: float, hang: bool) -> None:
        super().__init__()
        self._chunks = chunks
        self._chunk_bytes = chunk_bytes
        self._every_s = every_s
        self._hang = hang
        self._sent = 0

    def readable(self) -> bool:
        return True

    def readinto(self, into: Any) -> int:
        if self._sent == self._chunks:
            if self._hang:
                threading.Event().wait()  # until SIGKILL: the put never reaches its meta
            return 0
        time.sleep(self._every_s)  # the pace of a slow put is what the tests are about
        target = memoryview(into).cast("B")
        assert len(target) == self._chunk_bytes, "nats-py reads one chunk of max_chunk_size at a time"
        target[:] = bytes((self._sent % 256,)) * self._chunk_bytes
        self._sent += 1
        return self._chunk_bytes


async def _put(args: argparse.Namespace) -> None:
    nc = await nats.connect(args.url)
    try:
        store = await nc.jetstream().object_store(args.bucket)
        reader = _PacedReader(args.chunks, args.chunk_bytes, args.every, args.hang)
        meta = ObjectMeta(options=ObjectMetaOptions(max_chunk_size=args.chunk_bytes))
        await store.put(args.name, reader, meta=meta)
    finally:
        await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("url")
    parser.add_argument("bucket")
    parser.add_argument("name")
    parser.add_argument("--chunks", type=int, default=3)
    parser.add_argument("--chunk-bytes", type=int, default=64 * 1024)
    parser.add_argument("--every", type=float, default=0.0, help="seconds before each chunk")
    parser.add_argument("--hang", action="store_true", help="never end the put: wait to be killed")
    asyncio.run(_put(parser.parse_args()))


if __name__ == "__main__":
    main()

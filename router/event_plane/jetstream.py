"""How many copies JetStream keeps of the streams and buckets kv-router uses (``jetstream_replicas``).

One copy (the default) lives on one server of a NATS cluster: when that server is down the stream has
no leader, and a worker cannot register, a router cannot record its cursor and a restarting router
never gets ready. Three copies on a three-server cluster survive any one server (the Raft majority).
A stream or bucket is created with the setting and, when it already exists with another count (made
by an earlier router, or by a worker that started first), scaled to it at start: JetStream moves the
copies itself (NATS 2.10+).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

from router.supervision import ServiceFault

if TYPE_CHECKING:  # the settings import MAX_REPLICAS: no NATS client for that
    from nats.js import JetStreamContext

__all__ = [
    "MAX_REPLICAS",
    "JetStreamUnavailable",
    "jetstream_answering",
    "kv_stream",
    "object_chunk_subject",
    "object_stream",
    "open_bucket",
    "scale_stream",
    "with_replicas",
]

log = logging.getLogger(__name__)

# JetStream's own bound on a stream's replicas.
MAX_REPLICAS = 5
# JetStream's error code for more than one copy on a server that is not clustered.
NOT_CLUSTERED = 10074

T = TypeVar("T")


class JetStreamUnavailable(ServiceFault):
    """JetStream's API went unanswered: the server runs without it, or a cluster has no leader yet."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"JetStream did not answer for {what} (not enabled on the NATS server, or a cluster without a "
            "leader yet), and kv-router keeps its worker registry there: start nats-server with -js (or "
            "`jetstream {}` in its config)"
        )


@contextmanager
def jetstream_answering(what: str) -> Iterator[None]:
    """Turn nats-py's bare ``ServiceUnavailableError`` (no responder on JetStream's API) met in the
    block into `JetStreamUnavailable`, which says what to do."""
    from nats.js.errors import ServiceUnavailableError  # here: the settings import this module

    try:
        yield
    except ServiceUnavailableError as exc:
        raise JetStreamUnavailable(what) from exc


def kv_stream(bucket: str) -> str:
    """The stream behind a key-value bucket."""
    return f"KV_{bucket}"


def object_stream(bucket: str) -> str:
    """The stream behind an object store bucket."""
    return f"OBJ_{bucket}"


def object_chunk_subject(bucket: str, nuid: str) -> str:
    """The subject of one put's chunks in an object store bucket (each put draws a fresh ``nuid``, named
    in the object's meta once every chunk is in); ``nuid="*"`` matches every put's."""
    return f"$O.{bucket}.C.{nuid}"


async def scale_stream(js: JetStreamContext, name: str, replicas: int) -> None:
    """Give the existing stream ``name`` ``replicas`` copies, if it has another count."""
    info = await js.stream_info(name)
    config = info.config
    if config.num_replicas == replicas:
        return
    before = config.num_replicas

    async def update(copies: int) -> None:
        if copies != before:
            config.num_replicas = copies
            await js.update_stream(config)
            log.info("JetStream stream %s: %s -> %d replicas", name, before, copies)

    await with_replicas(update, replicas, f"stream {name}")


async def with_replicas(create: Callable[[int], Awaitable[T]], replicas: int, what: str) -> T:
    """``create(replicas)``; on a NATS server that is not clustered (it refuses more than one copy), a
    WARNING and ``create(1)``: the service runs, with what it has, rather than restart in a loop."""
    from nats.js.errors import APIError  # here: the settings import this module for MAX_REPLICAS

    try:
        return await create(replicas)
    except APIError as exc:
        if replicas == 1 or exc.err_code != NOT_CLUSTERED:
            raise
    log.warning("JetStream %s: the NATS server is not clustered, so it keeps one copy (jetstream_replicas=%d "
                "needs a cluster of at least that many servers)", what, replicas)  # fmt: skip
    return await create(1)


async def open_bucket(
    js: JetStreamContext,
    bucket: str,
    open_existing: Callable[[str], Awaitable[T]],
    create: Callable[[int], Awaitable[T]],
    *,
    stream: str,
    replicas: int | None,
) -> T:
    """The key-value or object ``bucket`` (its stream ``stream``): ``open_existing(bucket)``, or when it
    does not exist ``create`` with ``replicas`` copies (one for None; `with_replicas`); one that exists
    is scaled to ``replicas`` (None: its count left to those that pass one, as a worker leaves it to
    the routers)."""
    from nats.js.errors import NotFoundError  # here: the settings import this module for MAX_REPLICAS

    try:
        with jetstream_answering(f"bucket {bucket}"):
            opened = await open_existing(bucket)
    except NotFoundError:  # nats-py's BucketNotFoundError is one
        return await with_replicas(create, replicas or 1, f"bucket {bucket}")
    if replicas is not None:
        await scale_stream(js, stream, replicas)
    return opened

"""`DurableEvents`: KV events kept in JetStream and the index snapshotted to the Object Store
(``--durable-events``), so a router killed at any moment comes back with exactly the index it had.

- Stream ``KV_EVENTS_{ns}`` over ``kv.{ns}.events.>`` (file storage), created if absent with the
  configured max age and max bytes. Workers publish as before; the stream keeps what they publish.
- Consumer: an *ordered, ephemeral* push consumer per router, started at the sequence after the
  router's snapshot. Why not a durable consumer: the router's position must be the one its snapshot
  covers, not an ack floor kept by the server, and an ephemeral consumer leaves nothing behind when a
  router dies. The ordered consumer re-creates itself from the last sequence it delivered after a
  reconnect or a missed heartbeat, so a restarted nats-server costs nothing. The events go through the
  router's `EventSequencer` as ever (per-(worker, dp_rank) numbering and gap repair are unchanged);
  the core-NATS event subscription is off in this mode, the stream is the one source.
- Snapshots: every ``snapshot_every_events`` events or ``snapshot_every_s`` seconds (whichever comes
  first, and only when something changed and no resync is in flight, since a resync's held events are
  in neither the dump nor the stream's remainder) the index dump, the sequencer's stream positions and
  the stream sequence they cover go to the Object Store bucket ``kv_router_snapshots_{ns}`` as one
  msgpack object named after the router (the store chunks it).
- The dump never holds the event loop for long: it is read and encoded in slices of about
  ``SNAPSHOT_SLICE_S`` of work, yielding to the loop between them, so decisions keep answering.
  Stream events wait meanwhile (the dump must cover exactly ``applied_seq``); any other change of the
  index during the dump (an event over HTTP, a resync's answer, a worker removed) moves
  `RadixTree.changes`, and that attempt is dropped and tried again (after ``MAX_INTERRUPTED`` in a
  row, the dump is read in one step).
- Restart: load the router's own snapshot (or, when it has none, cannot fetch it, or the stream no
  longer reaches back to it, the newest usable one), restore index and positions, replay the stream
  from the next sequence, and only then serve. No worker needs to answer anything.
- Purge: each router records its applied and snapshot sequences in the KV bucket
  ``kv_router_cursors_{ns}`` (entries expire when a router stops refreshing them); after a snapshot,
  stream data below the lowest snapshot sequence of the live routers is purged. A live router never
  needs anything older than its own snapshot, so nothing a live router needs is ever purged. A cursor
  once seen holds the floor until it would have expired, even when a later listing misses it (a key
  being rewritten can drop out of a listing for a moment: a restarting router rewrites its own just
  then); a listing that fails purges nothing. A restarting router's cursor holds the floor only for
  purges reckoned after it was recorded: one reckoned on an earlier listing can land until the replay
  has read past the snapshot. So the replay must read on from the snapshot without a gap (the stream
  first, then each message, then, when nothing comes, the stream again); when it cannot, the newest
  usable snapshot is loaded again (the purging peer's covers what it purged).
- Tidying the store, after each snapshot: the snapshots no restart can use any more are deleted, and
  so are the chunks no object names (a put killed before its meta, or after it but before the chunks
  it replaced were purged) once their newest is ``ORPHAN_CHUNKS_GRACE_S`` old on the server's clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import (
    ConsumerConfig,
    DeliverPolicy,
    KeyValueConfig,
    ObjectInfo,
    ObjectMeta,
    ObjectMetaOptions,
    ObjectStoreConfig,
    StorageType,
    StreamConfig,
)
from nats.js.errors import (
    BadObjectMetaError,
    DigestMismatchError,
    KeyDeletedError,
    KeyNotFoundError,
    NoKeysError,
    NotFoundError,
)
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from indexer.events import NonNegative, RouterEvent
from router.event_plane.jetstream import (
    jetstream_answering,
    kv_stream,
    object_chunk_subject,
    object_stream,
    open_bucket,
    scale_stream,
    with_replicas,
)
from router.event_plane.ratelimited_log import RateLimitedLog
from router.event_plane.subjects import Subjects
from router.event_plane.subscriber import EVENTS_PENDING_LIMIT, ingest_published
from router.kv_router import KvRouter
from router.supervision import Supervisor, raise_if_cancelling

__all__ = ["DurableEvents", "IndexSnapshot", "StreamPosition"]

log = logging.getLogger(__name__)

# Applying a replayed backlog must not starve routing decisions: yield after this much work.
YIELD_AFTER_S = 0.0005
# Object Store chunks: fewer, larger messages than nats-py's 128 KiB default, and still well under
# a stock nats-server's 1 MiB max_payload.
SNAPSHOT_CHUNK_BYTES = 512 * 1024
# A snapshot's dump is read and encoded in slices of about this much work, the loop free between them.
SNAPSHOT_SLICE_S = 0.002
# Dumped events hold at most this many blocks (a longer chain is cut), so a slice overruns by little.
SNAPSHOT_EVENT_BLOCKS = 256
# Sliced dumps interrupted in a row by index changes that do not wait for them; the next is one step.
MAX_INTERRUPTED = 3
# A restart loads a snapshot at most this many times (again when the stream was purged past the one it
# loaded before its replay read that far), then keeps the last.
MAX_RESTORE_ATTEMPTS = 3
# A replay that applied nothing for this long, with nothing queued, asks whether the stream was purged
# past it: a purge up to the stream's end leaves no later message to show the gap.
REPLAY_STALL_CHECK_S = 1.0
# Fetching a snapshot may take this long plus a second per SNAPSHOT_FETCH_BYTES_PER_S of its size: a
# fetch whose object is replaced meanwhile (its owner wrote a newer one) waits forever in nats-py.
SNAPSHOT_FETCH_MIN_S = 10.0
SNAPSHOT_FETCH_BYTES_PER_S = 4 << 20
# A listing of the snapshot store or of the cursors may take this long (nats-py waits without bound).
LISTING_TIMEOUT_S = 10.0
# Chunks no object names are purged once their newest is this much older than this router's newest
# (server timestamps both). A put still under way adds one every few seconds at most: each chunk waits
# for its acknowledgement (5 s at most in nats-py, then the put fails and purges its own), so only a
# put whose process is dead, or frozen for ten minutes, is ever this quiet.
ORPHAN_CHUNKS_GRACE_S = 600.0
# msgpack's array header with a 32-bit length (patched once the dump has been counted).
_ARRAY32 = 0xDD


class StreamPosition(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """Where one (worker, dp_rank)'s event numbering stood when the snapshot was taken."""

    worker_id: NonNegative
    dp_rank: NonNegative
    last_event_id: NonNegative | None
    trusted: bool
    # The worker's publisher epoch then (absent from snapshots written before it was kept).
    epoch: str | None = None


class IndexSnapshot(msgspec.Struct, kw_only=True):
    """The index as stored events, with the stream sequence and the event positions it covers."""

    router_name: str
    stream_seq: NonNegative
    created_at_ms: NonNegative
    positions: list[StreamPosition]
    events: list[RouterEvent]


class _SnapshotHead(msgspec.Struct, kw_only=True):
    """`IndexSnapshot` without its events: written first, the events appended one by one after it."""

    router_name: str
    stream_seq: NonNegative
    created_at_ms: NonNegative
    positions: list[StreamPosition]


class _PiecesReader(io.BufferedIOBase):
    """A file over the snapshot's pieces, so that `ObjectStore.put` takes it chunk by chunk (in its
    executor) with no copy of the whole object."""

    def __init__(self, pieces: list[bytearray]) -> None:
        super().__init__()
        self._pieces = pieces
        self._piece = 0
        self._at = 0  # read up to here in the current piece

    def readable(self) -> bool:
        return True

    def readinto(self, into: Any) -> int:
        target = memoryview(into).cast("B")
        filled = 0
        pieces = self._pieces
        while filled < len(target) and self._piece < len(pieces):
            piece = pieces[self._piece]
            count = min(len(target) - filled, len(piece) - self._at)
            target[filled : filled + count] = memoryview(piece)[self._at : self._at + count]
            filled += count
            self._at += count
            if self._at == len(piece):
                self._piece += 1
                self._at = 0
        return filled


async def _release_last_first(pieces: list[bytearray]) -> None:
    """Free the pieces from the last one, in slices. Freed first to last (or as one buffer), the
    allocator gives the whole heap top back in one step at the end: ~10-25 ms of the loop per 59 MB;
    from the top down each free returns one piece's worth."""
    slice_ends = time.perf_counter() + SNAPSHOT_SLICE_S
    while pieces:
        pieces.pop()
        if time.perf_counter() >= slice_ends:
            await asyncio.sleep(0)
            slice_ends = time.perf_counter() + SNAPSHOT_SLICE_S


class _Cursor(msgspec.Struct, kw_only=True):
    snapshot_seq: NonNegative
    applied_seq: NonNegative


_snapshot_decoder = msgspec.msgpack.Decoder(IndexSnapshot)
# Built at import: built on first use, inside the first snapshot's purge, it held the loop ~10 ms.
_cursor_decoder = msgspec.json.Decoder(_Cursor)
_encoder = msgspec.msgpack.Encoder()


class DurableEvents:
    def __init__(
        self,
        router: KvRouter,
        nc: Client,
        *,
        namespace: str = "default",
        router_name: str,
        max_age_s: float = 3600.0,
        max_bytes: int = -1,
        snapshot_every_events: int = 100_000,
        snapshot_every_s: float = 30.0,
        catch_up_timeout_s: float = 120.0,
        replicas: int = 1,
    ) -> None:
        self.router = router
        self._replicas = replicas  # copies of the stream and buckets (`router.event_plane.jetstream`)
        self.nc = nc
        self.subjects = Subjects(namespace)
        self.router_name = router_name
        self._max_age = max_age_s
        self._max_bytes = max_bytes
        self.snapshot_every_events = snapshot_every_events
        self.snapshot_every_s = snapshot_every_s
        self._catch_up_timeout = catch_up_timeout_s
        self._cursor_ttl = max(60.0, 3 * snapshot_every_s)
        self._refresh_every = max(1.0, min(snapshot_every_s, 20.0))  # well within the TTL
        self._purge_not_before = 0.0  # monotonic; after a reconnect, until the routers recorded again
        # Router name -> (snapshot sequence, when last listed): the purge floor's memory.
        self._cursors_seen: dict[str, tuple[int, float]] = {}
        # The workers the applied snapshot held and its replay reached (`discard`).
        self._restored_workers: set[int] = set()
        self._js: JetStreamContext = nc.jetstream()
        self._store: ObjectStore | None = None
        self._cursors: KeyValue | None = None
        self._subscription: JetStreamContext.PushSubscription | None = None
        self.applied_seq = 0  # the last stream sequence applied to the index
        self.snapshot_seq = 0  # the stream sequence the newest snapshot of this router covers
        self._events_since_snapshot = 0
        self._replay_ended = asyncio.Event()  # set once the replay reached its target, or broke at a gap
        self._catch_up_target = 0
        self._replaying = False  # between a replay's start and its end (`replay_progress`)
        self._breaks_at_gap = False  # while replaying from a snapshot that can be loaded again
        self._replay_broken = False
        # Cleared while a snapshot's dump is read in slices: stream events wait for it.
        self._ingest_open = asyncio.Event()
        self._ingest_open.set()
        self._interrupted_in_row = 0
        self._busy_since = 0.0
        self._background = Supervisor("durable-events")
        self._bad_input = RateLimitedLog(log)
        # Gauges: the size of this router's newest snapshot, and the stream sequence its last purge kept
        # from (0: none yet).
        self.last_snapshot_bytes = 0
        self.purged_below = 0
        # Outcome -> count (counters only): stream_messages, snapshots, purges, restored_events, ...
        # What alerts and panels read is present from the start, at 0 (a counter first seen at 1 reads as
        # no increase to Prometheus).
        self.outcomes: dict[str, int] = dict.fromkeys(("stream_messages", "snapshots", "restored_events"), 0)

    # ------------------------------------------------------------------ lifecycle
    async def restore(self) -> None:
        """Before the event plane starts: make sure stream and buckets exist, load the snapshot and record
        this router's cursor at it. Raises what NATS raises with nothing applied; once a snapshot is
        applied, `discard` undoes it."""
        await self._ensure_stream()
        self._store = await self._open_store()
        self._cursors = await self._open_cursors()
        await self._load()
        # From now on: a replay of a long stream can outlast the cursor's TTL.
        self._background.keep_running("cursor", self._cursor_loop)

    async def _load(self) -> None:
        """Apply the snapshot `_load_snapshot` picks, if any, and record the cursor at it: a purge reckoned
        with this cursor keeps all the replay needs."""
        started = time.perf_counter()
        snapshot = await self._load_snapshot()
        loaded = time.perf_counter()
        if snapshot is not None:
            self._apply_snapshot(snapshot)
            # The snapshot restores its workers' epochs as they were when it was written. A worker that
            # registered since with another epoch (its publisher restarted while this router was down)
            # has that old state dropped: here when a failed start is tried again, or a purge made the
            # snapshot load again after the event plane registered the workers (on a first start none
            # is registered yet, and each registration observes its epoch itself).
            self.router.observe_registered_epochs()
            log.info("index snapshot: fetched and decoded in %.2f s, applied in %.2f s",
                     loaded - started, time.perf_counter() - loaded)  # fmt: skip
        await self._record_cursor()

    @staticmethod
    def _covers(snapshot_seq: int, first_seq: int, last_seq: int) -> bool:
        """Whether a snapshot at ``snapshot_seq`` and the stream from ``first_seq`` to ``last_seq`` make
        the whole index: the stream holds what follows the snapshot, and the snapshot is not from a
        stream that has since been recreated (its sequence past the stream's end)."""
        return first_seq <= snapshot_seq + 1 <= last_seq + 1

    def discard(self) -> None:
        """Forget what `restore` applied and the replay after it: the index and event streams of the
        workers its snapshot held and its replay reached, so that a start tried again restores onto
        nothing of its own."""
        for worker_id in sorted(self._restored_workers):
            self.router.forget_cache_of(worker_id)
        self._restored_workers.clear()
        self.applied_seq = self.snapshot_seq = 0

    async def start(self) -> None:
        """After the event plane started (workers registered): replay the stream from the snapshot on,
        then follow it. A peer's purge reckoned on a listing of the cursors taken before this router
        recorded its own can land any time until the replay has read past it: the replay then finds the
        stream purged past what it had yet to read, and the newest usable snapshot is loaded again (the
        purging peer's own covers what it purged), rather than every worker asked for its state."""
        for attempt in range(1, MAX_RESTORE_ATTEMPTS + 1):
            # Only a replay from a snapshot can fall short of it (a full one reads what the stream holds).
            reload_if_purged = attempt < MAX_RESTORE_ATTEMPTS and self.snapshot_seq > 0
            if await self._replay(reload_if_purged):
                break
            log.warning("stream purged past the snapshot at sequence %d before its replay read it; loading again",
                        self.snapshot_seq)  # fmt: skip
            self._count("snapshot_purged_while_loading")
            await self._unsubscribe()
            self.discard()
            await self._load()
        self._background.keep_running("snapshots", self._snapshot_loop)

    async def _replay(self, reload_if_purged: bool) -> bool:
        """Follow the stream from the sequence after `applied_seq` and wait until it has been read up to
        its last sequence now. False, with ``reload_if_purged``, when the stream turned out purged past
        what was still to read (nothing more is applied then); without it, a stream that starts too late
        is logged and every worker asked for its state."""
        info = await self._js.stream_info(self.subjects.events_stream)
        self._catch_up_target = info.state.last_seq
        if info.state.first_seq > self.applied_seq + 1:
            if reload_if_purged:
                return False
            log.error("stream %s starts at %d but this index covers only up to %d: events are missing; "
                      "asking every worker for its state", self.subjects.events_stream, info.state.first_seq,
                      self.applied_seq)  # fmt: skip
            self._count("stream_behind_snapshot")
            for request in self.router.sequencer.resync_all():
                self.router.sequencer.send_resync(request)
        self._breaks_at_gap = reload_if_purged
        self._replay_broken = False
        self._replay_ended.clear()
        # Done at once when the stream holds nothing to replay: read up to its end already, or nothing
        # left in it up to the target (purged past its last message: none will ever come).
        if self.applied_seq >= self._catch_up_target or info.state.first_seq > self._catch_up_target:
            self._replay_ended.set()
        self._replaying = True
        try:
            await self._follow(self.applied_seq + 1)
            started = time.monotonic()
            try:
                await asyncio.wait_for(self._until_replayed(), self._catch_up_timeout)
            except TimeoutError:
                log.error("stream replay did not catch up to %d within %.0f s (at %d); serving anyway",
                          self._catch_up_target, self._catch_up_timeout, self.applied_seq)  # fmt: skip
        finally:
            self._replaying = False
        self._breaks_at_gap = False
        if self._replay_broken:
            return False
        log.info("durable events: replayed up to stream sequence %d in %.2f s", self.applied_seq,
                 time.monotonic() - started)  # fmt: skip
        return True

    def replay_progress(self) -> tuple[int, int] | None:
        """While a restart replays the stream: the sequence applied and the one it replays up to."""
        return (self.applied_seq, self._catch_up_target) if self._replaying else None

    async def _follow(self, start: int) -> None:
        """Subscribe the ordered consumer from stream sequence ``start`` on."""
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if start > 1 else DeliverPolicy.ALL,
            opt_start_seq=start if start > 1 else None,
        )
        self._subscription = await self._js.subscribe(
            self.subjects.all_events,
            stream=self.subjects.events_stream,
            cb=self._on_message,
            ordered_consumer=True,
            config=config,
            pending_msgs_limit=EVENTS_PENDING_LIMIT,
        )

    async def _until_replayed(self) -> None:
        """Until the replay reached its target or broke at a gap (`_on_message`). A purge up to the
        stream's end shows no gap, no later message comes: so a replay that may break and applied
        nothing for ``REPLAY_STALL_CHECK_S``, with nothing queued, breaks when the stream now starts
        past what it applied."""
        if not self._breaks_at_gap:
            await self._replay_ended.wait()
            return
        applied_before = self.applied_seq
        while not self._replay_ended.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._replay_ended.wait(), REPLAY_STALL_CHECK_S)
            subscription = self._subscription
            stalled = self.applied_seq == applied_before and subscription is not None and not subscription.pending_msgs
            applied_before = self.applied_seq
            if stalled and not self._replay_ended.is_set():
                try:
                    state = (await self._js.stream_info(self.subjects.events_stream)).state
                except (NatsError, TimeoutError, OSError):  # NATS out of reach a moment: the replay goes on after it
                    continue
                if state.first_seq > self.applied_seq + 1:
                    self._break_replay()

    def _break_replay(self) -> None:
        """Give the replay up: the stream no longer holds what it had yet to read."""
        self._replay_broken = True
        self._replay_ended.set()

    async def _unsubscribe(self) -> None:
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()

    async def stop(self) -> None:
        await self._background.stop()
        await self._unsubscribe()

    # ------------------------------------------------------------------ stream and buckets
    async def _ensure_stream(self) -> None:
        name = self.subjects.events_stream
        try:
            with jetstream_answering(f"stream {name}"):
                info = await self._js.stream_info(name)
        except NotFoundError:

            async def create(copies: int) -> None:
                await self._js.add_stream(
                    StreamConfig(
                        name=name,
                        subjects=[self.subjects.all_events],
                        storage=StorageType.FILE,
                        max_age=self._max_age,
                        max_bytes=self._max_bytes,
                        num_replicas=copies,
                    )
                )

            await with_replicas(create, self._replicas, f"stream {name}")
            log.info("created JetStream stream %s over %s", name, self.subjects.all_events)
            return
        config = info.config
        if (config.max_age, config.max_bytes) != (self._max_age, self._max_bytes):
            config.max_age = self._max_age
            config.max_bytes = self._max_bytes
            await self._js.update_stream(config)
            log.info("stream %s: max age %.0f s, max bytes %d", name, self._max_age, self._max_bytes)
        await scale_stream(self._js, name, self._replicas)

    async def _open_store(self) -> ObjectStore:
        bucket = self.subjects.snapshot_bucket

        async def create(copies: int) -> ObjectStore:
            config = ObjectStoreConfig(storage=StorageType.FILE, replicas=copies)
            return await self._js.create_object_store(bucket, config)

        stream, replicas = object_stream(bucket), self._replicas
        return await open_bucket(self._js, bucket, self._js.object_store, create, stream=stream, replicas=replicas)

    async def _open_cursors(self) -> KeyValue:
        bucket = self.subjects.router_cursor_bucket

        async def create(copies: int) -> KeyValue:
            config = KeyValueConfig(bucket=bucket, ttl=self._cursor_ttl, storage=StorageType.FILE, replicas=copies)
            return await self._js.create_key_value(config)

        return await open_bucket(
            self._js, bucket, self._js.key_value, create, stream=kv_stream(bucket), replicas=self._replicas
        )

    # ------------------------------------------------------------------ snapshots
    async def _load_snapshot(self) -> IndexSnapshot | None:
        """This router's snapshot if the stream still reaches back to it, else the newest usable one
        (an unreadable one skipped)."""
        assert self._store is not None
        candidates: list[tuple[int, str, int]] = []
        with contextlib.suppress(NotFoundError):
            for entry in await asyncio.wait_for(self._store.list(), LISTING_TIMEOUT_S):
                if entry.deleted:
                    continue
                try:
                    seq = int(entry.description or "")
                except ValueError:
                    continue
                candidates.append((seq, entry.name, entry.size or 0))
        # Read after the listing: a snapshot a peer wrote meanwhile is within the stream's end.
        state = (await self._js.stream_info(self.subjects.events_stream)).state
        usable = sorted(
            (candidate for candidate in candidates if self._covers(candidate[0], state.first_seq, state.last_seq)),
            key=lambda candidate: (candidate[1] != self.router_name, -candidate[0]),
        )
        for seq, name, size in usable:
            try:
                # Into a buffer: without one, nats-py concatenates the chunks (quadratic in the size).
                buffer = io.BytesIO()
                timeout = SNAPSHOT_FETCH_MIN_S + size / SNAPSHOT_FETCH_BYTES_PER_S
                await asyncio.wait_for(self._store.get(name, writeinto=buffer), timeout)
                snapshot = _snapshot_decoder.decode(buffer.getbuffer())
            except (NotFoundError, BadObjectMetaError, DigestMismatchError, TimeoutError, msgspec.DecodeError) as exc:
                # The object's own trouble: the next one may do. (NATS's trouble raises: the start is
                # tried again.)
                log.warning("snapshot %s (stream sequence %d) unreadable: %s", name, seq, exc or type(exc).__name__)
                self._count("snapshot_unreadable")
                continue
            log.info("loading index snapshot %s at stream sequence %d (%d events)", name, seq, len(snapshot.events))
            return snapshot
        if candidates:
            log.warning("no usable index snapshot (stream from %d to %d); replaying the stream",
                        state.first_seq, state.last_seq)  # fmt: skip
        return None

    def _apply_snapshot(self, snapshot: IndexSnapshot) -> None:
        positions = [(p.worker_id, p.dp_rank, p.last_event_id, p.trusted) for p in snapshot.positions]
        epochs = {p.worker_id: p.epoch for p in snapshot.positions if p.epoch is not None}
        self._restored_workers.update(p.worker_id for p in snapshot.positions)
        self._restored_workers.update(event.worker_id for event in snapshot.events)
        restored = self.router.sequencer.restore_snapshot(snapshot.events, positions, epochs)
        self.applied_seq = self.snapshot_seq = snapshot.stream_seq
        self._count("restored_events", restored)

    def _positions(self) -> list[StreamPosition] | None:
        """The sequencer's stream positions; None while a resync is in flight (its held events
        would be in neither the dump nor the stream's rest)."""
        status = self.router.sequencer.status()
        if any(stream.resyncing for stream in status):
            return None
        epochs = self.router.sequencer.epochs()
        return [
            StreamPosition(
                worker_id=stream.worker_id,
                dp_rank=stream.dp_rank,
                last_event_id=stream.last_event_id,
                trusted=stream.trusted,
                epoch=epochs.get(stream.worker_id),
            )
            for stream in status
        ]

    async def encode_snapshot(self) -> tuple[int, list[bytearray]] | None:
        """The snapshot at `applied_seq` as msgpack (an `IndexSnapshot`, in pieces of about
        ``SNAPSHOT_CHUNK_BYTES`` to be joined in order) with the sequence it covers, read in slices of
        ``SNAPSHOT_SLICE_S`` while stream events wait; None while a resync is in flight or when
        another change of the index interrupted it."""
        positions = self._positions()
        if positions is None:
            self._count("snapshot_deferred")
            return None
        stream_seq = self.applied_seq
        head = _encoder.encode(_SnapshotHead(router_name=self.router_name, stream_seq=stream_seq,
                                             created_at_ms=int(time.time() * 1000), positions=positions))  # fmt: skip
        # The head's map gains the events (a struct of a few fields is a fixmap: 0x80 | fields).
        assert head[0] == 0x84, "IndexSnapshot's head is a fixmap of 4 fields"
        first = bytearray((0x85,))
        first += memoryview(head)[1:]
        _encoder.encode_into("events", first, -1)
        count_at = len(first) + 1
        first += bytes((_ARRAY32, 0, 0, 0, 0))
        # Pieces, not one buffer: they are freed in slices (`_release_last_first`), one buffer of a
        # 1M-block snapshot would be freed in one step.
        pieces = [first]
        piece = first
        index = self.router.tree
        changes = index.changes
        one_step = self._interrupted_in_row >= MAX_INTERRUPTED
        encode_into = _encoder.encode_into
        count = 0
        self._ingest_open.clear()
        try:
            slice_ends = time.perf_counter() + SNAPSHOT_SLICE_S
            for event in index.iter_dump_events(SNAPSHOT_EVENT_BLOCKS):
                if len(piece) >= SNAPSHOT_CHUNK_BYTES:
                    piece = bytearray()
                    pieces.append(piece)
                encode_into(event, piece, -1)
                count += 1
                if not one_step and time.perf_counter() >= slice_ends:
                    await asyncio.sleep(0)
                    if index.changes != changes:
                        break
                    slice_ends = time.perf_counter() + SNAPSHOT_SLICE_S
        finally:
            self._ingest_open.set()
        if index.changes != changes or self.applied_seq != stream_seq or self._positions() != positions:
            self._interrupted_in_row += 1
            self._count("snapshot_interrupted")
            log.info("index snapshot: the index changed while it was read (%d in a row); trying again",
                     self._interrupted_in_row)  # fmt: skip
            return None
        self._interrupted_in_row = 0
        first[count_at : count_at + 4] = count.to_bytes(4, "big")
        return stream_seq, pieces

    async def write_snapshot(self) -> bool:
        events_covered = self._events_since_snapshot
        encoded = await self.encode_snapshot()
        if encoded is None:
            return False
        stream_seq, pieces = encoded
        size = sum(len(piece) for piece in pieces)
        assert self._store is not None
        meta = ObjectMeta(description=str(stream_seq), options=ObjectMetaOptions(max_chunk_size=SNAPSHOT_CHUNK_BYTES))
        try:
            written = await self._store.put(self.router_name, _PiecesReader(pieces), meta=meta)
        finally:
            await _release_last_first(pieces)
        self.snapshot_seq = stream_seq
        self._events_since_snapshot -= events_covered
        self._count("snapshots")
        self.last_snapshot_bytes = size
        await self._record_cursor()
        await self._purge()
        assert written.nuid, "a put names its chunks' subject"
        await self._tidy_store(written.nuid)
        return True

    async def _snapshot_loop(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(min(1.0, self.snapshot_every_s))
            now = time.monotonic()
            due = self._events_since_snapshot >= self.snapshot_every_events or (
                self._events_since_snapshot > 0 and now - last >= self.snapshot_every_s
            )
            if due and self.applied_seq > self.snapshot_seq and await self.write_snapshot():
                last = now
            raise_if_cancelling()  # each NATS call of a snapshot may have swallowed it

    async def _cursor_loop(self) -> None:
        """Stay among the live routers: the cursor refreshed well within its TTL, from the restore on
        (a replay or a slow snapshot must not let it expire)."""
        while True:
            await asyncio.sleep(self._refresh_every)
            await self._record_cursor()
            raise_if_cancelling()  # the put may have swallowed it: a stopped router must not stay live

    def on_reconnected(self) -> None:
        """NATS was out of reach: every router's cursor may have expired meanwhile (and this one's
        memory of them aged), so no purge until each live router has had time to record its own again;
        this one's is recorded at once."""
        self._purge_not_before = time.monotonic() + 2 * self._refresh_every
        self._background.spawn("cursor-after-reconnect", self._record_cursor())

    # ------------------------------------------------------------------ purge
    async def _record_cursor(self) -> None:
        assert self._cursors is not None
        cursor = _Cursor(snapshot_seq=self.snapshot_seq, applied_seq=self.applied_seq)
        await self._cursors.put(self.router_name, msgspec.json.encode(cursor))

    async def _purge(self) -> None:
        """Drop stream data every live router's snapshot covers."""
        if time.monotonic() < self._purge_not_before:
            self._count("purge_deferred")
            return
        listed = await self._list_cursors()
        if listed is None:
            self._count("purge_skipped")
            return
        now = time.monotonic()
        seen = self._cursors_seen
        for name, snapshot_seq in listed.items():
            seen[name] = (snapshot_seq, now)
        for name in [name for name, (_, at) in seen.items() if now - at > self._cursor_ttl]:
            del seen[name]
        floor = min([self.snapshot_seq, *(snapshot_seq for snapshot_seq, _ in seen.values())])
        if floor > 0:
            await self._js.purge_stream(self.subjects.events_stream, seq=floor + 1)
            self._count("purges")
            self.purged_below = floor + 1

    async def _list_cursors(self) -> dict[str, int] | None:
        """Each listed router's snapshot sequence; None when the bucket could not be read."""
        assert self._cursors is not None
        try:
            keys = await asyncio.wait_for(self._cursors.keys(), LISTING_TIMEOUT_S)
        except NoKeysError:
            return {}
        except (NatsError, TimeoutError) as exc:
            log.warning("router cursors unreadable, no purge this time: %s", exc)
            return None
        listed = {}
        for key in keys:
            try:
                entry = await self._cursors.get(key)
            except (KeyNotFoundError, KeyDeletedError):
                continue  # expired since the listing
            except (NatsError, TimeoutError) as exc:
                log.warning("router cursor %s unreadable, no purge this time: %s", key, exc)
                return None
            try:
                listed[key] = _cursor_decoder.decode(entry.value or b"").snapshot_seq
            except msgspec.DecodeError:
                self._bad_input.warning("undecodable router cursor", key)
        return listed

    async def _tidy_store(self, own_nuid: str) -> None:
        """After a snapshot (``own_nuid``: its put's): drop what the store holds for no one, the stale
        snapshots and the orphaned chunks, from one listing of the objects."""
        assert self._store is not None
        try:
            try:
                entries = await asyncio.wait_for(self._store.list(), LISTING_TIMEOUT_S)
            except NotFoundError:  # nats-py's answer for an empty store
                entries = []
            await self._delete_stale_snapshots(entries)
            await self._purge_orphan_chunks(entries, own_nuid)
        except (NatsError, TimeoutError) as exc:
            self._bad_input.warning("snapshot store not tidied", str(exc) or type(exc).__name__)

    async def _delete_stale_snapshots(self, entries: list[ObjectInfo]) -> None:
        """Drop the snapshots no restart can use any more (the stream no longer holds what follows
        them): a router renamed on every restart, as a Deployment's pods are, leaves one each time."""
        assert self._store is not None
        # Read after the listing: a snapshot a peer wrote meanwhile is within the stream's end.
        state = (await self._js.stream_info(self.subjects.events_stream)).state
        for entry in entries:
            try:
                seq = int(entry.description or "")
            except ValueError:
                continue
            # A live router's (its cursor listed lately) is left to it: restarted under its old name,
            # it may be writing a new one under that name right now.
            if entry.deleted or entry.name in self._cursors_seen:
                continue
            if not self._covers(seq, state.first_seq, state.last_seq):
                with contextlib.suppress(NotFoundError):  # a peer deleted it first
                    await self._store.delete(entry.name)
                    self._count("stale_snapshots_deleted")
                    log.info("deleted snapshot %s (stream sequence %d): the stream starts at %d",
                             entry.name, seq, state.first_seq)  # fmt: skip

    async def _purge_orphan_chunks(self, entries: list[ObjectInfo], own_nuid: str) -> None:
        """Purge the chunk subjects no object of ``entries`` names. A put publishes its chunks, then the
        meta naming them, then purges the chunks it replaced: a process killed in between leaves chunks
        no meta will ever name, in the bucket's stream for good. A peer's put under way has chunks no
        meta names yet either; it is told apart by age, on the server's clock alone: a subject is purged
        only when its newest chunk is ``ORPHAN_CHUNKS_GRACE_S`` older than the newest of the put this
        router just made (a put that ended after ``entries`` were listed looks unnamed, but its chunks
        are new)."""
        bucket = self.subjects.snapshot_bucket
        stream = object_stream(bucket)
        named = {entry.nuid for entry in entries if not entry.deleted}
        if not named:  # our own snapshot's meta was just written: a listing without it is no listing
            return
        listed = (await self._js.stream_info(stream, subjects_filter=object_chunk_subject(bucket, "*"))).state
        unnamed = {
            subject: chunks
            for subject, chunks in (listed.subjects or {}).items()
            if subject.rpartition(".")[2] not in named
        }
        if not unnamed:
            return
        now = (await self._js.get_last_msg(stream, object_chunk_subject(bucket, own_nuid))).time
        for subject, chunks in unnamed.items():
            try:
                newest = (await self._js.get_last_msg(stream, subject)).time
            except NotFoundError:  # a peer purged it first
                continue
            if now is None or newest is None or (now - newest).total_seconds() < ORPHAN_CHUNKS_GRACE_S:
                continue
            await self._js.purge_stream(stream, subject=subject)
            self._count("orphan_chunks_purged", chunks)
            log.info("purged %d orphaned snapshot chunks on %s (no object names them; the newest is %.0f s old)",
                     chunks, subject, (now - newest).total_seconds())  # fmt: skip

    # ------------------------------------------------------------------ events
    async def _on_message(self, message: Msg) -> None:
        now = time.perf_counter()
        if now - self._busy_since > YIELD_AFTER_S:
            await asyncio.sleep(0)
            self._busy_since = time.perf_counter()
        if not self._ingest_open.is_set():
            await self._ingest_open.wait()  # a snapshot's dump is being read
        seq = message.metadata.sequence.stream
        if self._breaks_at_gap:
            if self._replay_broken:
                return  # the replay was given up: this message is read again after the reload
            if seq > self.applied_seq + 1:
                self._break_replay()  # purged before it was read: applying what follows would leave a hole
                return
        # As on the core subscription: the subject's worker's events, under the publisher's epoch.
        own = ingest_published(self.router.sequencer, self.subjects, message, self._bad_input)
        if not self._replay_ended.is_set():
            self._restored_workers.update(event.worker_id for event in own)
        self.applied_seq = seq
        self._events_since_snapshot += 1
        self._count("stream_messages")
        if seq >= self._catch_up_target:
            self._replay_ended.set()

    def _count(self, outcome: str, by: int = 1) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + by

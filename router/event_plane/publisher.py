"""The worker side of the event plane: what an engine (or a bridge, or a mock worker) runs.

``KvEventPublisher`` numbers each dp rank's events from 1 and publishes them on
``kv.{ns}.events.{worker_id}``, single or batched. It keeps a bounded ring of recent events and its
own index of the blocks it holds, so it can answer a router's resync request on
``kv.{ns}.resync.{worker_id}`` with the events since an id or, when those are gone, a full dump.
It registers the worker in the ``kv_router_workers_{ns}`` bucket, heartbeats (each heartbeat carries
the registration, so a worker that a router expired comes back as soon as it beats again), and
publishes ``ActiveLoad``. Each publisher is one epoch (a start nonce in its registration and in the
``Kv-Publisher-Epoch`` header of its event messages): a restarted process numbering from 1 again is
seen by routers as a new publisher, not as duplicates of the old one.

Usage from an asyncio engine integration::

    publisher = KvEventPublisher(nc, WorkerConfig(worker_id=7, block_size=16))
    await publisher.start()
    await publisher.stored([(block_hash, tokens_hash), ...], parent_hash=None)
    await publisher.removed([block_hash])
    async with publisher.batch():      # one NATS message for everything inside
        ...
    await publisher.stop()

Events are checked against what the publisher holds before they are numbered: a store under an
unknown parent raises ``ParentBlockNotFound`` and is never sent. What it holds is a flat
`indexer.held_blocks.HeldBlocks` (a dict per rank and tier, walked only to answer a dump), and each
event is encoded once, when it is emitted: the ring keeps those bytes, a batch joins them, and
stored events are written without a Python object per block (`StoredEventEncoder`), removed ones
without their structs (`RemovedEventEncoder`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.errors import OutboundBufferLimitError
from nats.js.kv import KeyValue

from indexer.engine_events import (
    EngineCleared,
    EngineEvent,
    EngineOffloaded,
    EngineRemoved,
    EngineStored,
    resolve_offloaded,
)
from indexer.errors import UNDECODABLE, BlockNotFound, KvIndexError
from indexer.events import (
    U64_MAX,
    RemovedEventEncoder,
    ResyncBatch,
    ResyncRequest,
    ResyncResponse,
    ResyncTooNew,
    RouterEvent,
    StorageTier,
    StoredEventEncoder,
    as_u64,
    cleared_event,
    encode_router_events,
    join_encoded_events,
    removed_event,
    stored_event,
)
from indexer.events_native import ENABLED as EVENTS_NATIVE
from indexer.events_native import accel as events_accel
from indexer.held_blocks import HeldBlocks
from indexer.native import declined
from router.event_plane.jetstream import kv_stream, open_bucket
from router.event_plane.messages import ActiveLoad, Heartbeat, Refusal
from router.event_plane.ratelimited_log import RateLimitedLog
from router.event_plane.resync_parts import reply_parts
from router.event_plane.subjects import EPOCH_HEADER, Subjects
from router.supervision import Supervisor
from router.types import WorkerConfig

__all__ = ["KvEventPublisher", "event_payloads", "open_registry"]

log = logging.getLogger(__name__)

DEFAULT_RING_SIZE = 1024
# The longest a stop waits for NATS to take the worker's deregistration and what is buffered: a worker
# stopped while NATS is out of reach stops all the same (routers drop it once its lease runs out).
STOP_NATS_WAIT_S = 2.0


def event_payloads(encoded: list[bytes], limit: int, *, msgpack: bool = False) -> Iterator[bytes]:
    """Events encoded one by one, joined into payloads of at most ``limit`` bytes (the server's
    max_payload), in order: halved until each fits; an event past it alone is its own payload (the
    caller's to refuse or send)."""
    payload = join_encoded_events(encoded, msgpack=msgpack)
    if len(payload) <= limit or len(encoded) == 1:
        yield payload
        return
    half = len(encoded) // 2
    yield from event_payloads(encoded[:half], limit, msgpack=msgpack)
    yield from event_payloads(encoded[half:], limit, msgpack=msgpack)


async def open_registry(nc: Client, subjects: Subjects, replicas: int | None = None) -> KeyValue:
    """The worker registry bucket, created on first use (with ``replicas`` copies, or one). A router
    passes its ``jetstream_replicas``: an existing bucket is scaled to it (`scale_stream`); a worker
    passes None and leaves the count to the routers."""
    js = nc.jetstream()
    bucket = subjects.registry_bucket

    async def create(copies: int) -> KeyValue:
        return await js.create_key_value(bucket=bucket, history=1, replicas=copies)

    return await open_bucket(js, bucket, js.key_value, create, stream=kv_stream(bucket), replicas=replicas)


class _RankLog:
    __slots__ = ("last_event_id", "ring")

    def __init__(self, ring_size: int) -> None:
        self.last_event_id = 0
        self.ring: deque[tuple[int, bytes]] = deque(maxlen=ring_size)  # (event id, the event encoded)


class KvEventPublisher:
    def __init__(
        self,
        nc: Client,
        registration: WorkerConfig,
        *,
        namespace: str = "default",
        ring_size: int = DEFAULT_RING_SIZE,
        heartbeat_interval: float = 1.0,
        msgpack: bool = True,
    ) -> None:
        self.nc = nc
        # Each publisher process is one epoch: routers seeing a new one drop what the last one sent.
        epoch = registration.epoch or secrets.token_hex(8)
        self.registration = msgspec.structs.replace(registration, epoch=epoch)
        self._headers = {EPOCH_HEADER: epoch}
        self.worker_id = registration.worker_id
        self.subjects = Subjects(namespace)
        self._ring_size = ring_size
        self._heartbeat_interval = heartbeat_interval
        self._msgpack = msgpack
        self._ranks: dict[int, _RankLog] = {}
        self._held = HeldBlocks(self.worker_id)  # what this worker holds, to answer full-dump resyncs
        self._encoder = StoredEventEncoder(self.worker_id)
        self._removed_encoder = RemovedEventEncoder(self.worker_id)
        self._decoder = msgspec.msgpack.Decoder(RouterEvent) if msgpack else msgspec.json.Decoder(RouterEvent)
        self._batch: list[bytes] | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._background = Supervisor(f"publisher-{registration.worker_id}")
        self._resync_subscription: Subscription | None = None
        # Ranks whose source lost events for good (an engine gap a bridge could not replay).
        self._unverified: set[int] = set()
        # A router's refusal of this registration (its block size differs): logged once, and set
        # for the worker's process to act on (the mock worker exits).
        self.refusal: Refusal | None = None
        self.refused = asyncio.Event()
        self._refused_subscription: Subscription | None = None
        # Event batches NATS could not take: out of reach long enough to fill the connection's buffer.
        self.unsent_batches = 0
        self._unsent_log = RateLimitedLog(log)

    # ------------------------------------------------------------------ lifecycle
    async def start(self, *, heartbeat: bool = True) -> None:
        """Serve resyncs, register, and start heartbeating."""
        self._resync_subscription = await self.nc.subscribe(self.subjects.resync(self.worker_id), cb=self._on_resync)
        self._refused_subscription = await self.nc.subscribe(self.subjects.refused(self.worker_id), cb=self._on_refused)
        await self.register()
        if heartbeat:
            # The registration also goes out at once as a heartbeat, on plain NATS ahead of this
            # worker's first events: the registry's watch reaches routers a JetStream hop later, and
            # events that overtake it would be dropped as an unknown worker's.
            await self._beat()
            self.start_heartbeat()

    async def stop(self, *, deregister: bool = False) -> None:
        self.stop_heartbeat()
        for subscription in (self._resync_subscription, self._refused_subscription):
            if subscription is not None:
                await subscription.unsubscribe()
        self._resync_subscription = self._refused_subscription = None
        try:
            async with asyncio.timeout(STOP_NATS_WAIT_S):
                if deregister:
                    registry = await open_registry(self.nc, self.subjects)
                    await registry.delete(str(self.worker_id))
                await self.nc.flush()
        except (TimeoutError, NatsError) as exc:
            log.warning(
                "worker %d stopping without NATS (%r): %s",
                self.worker_id,
                exc,
                "routers drop it once its lease runs out" if deregister else "its last events may not have gone",
            )

    async def register(self) -> None:
        registry = await open_registry(self.nc, self.subjects)
        await registry.put(str(self.worker_id), msgspec.json.encode(self.registration))

    async def withdraw(self) -> None:
        """Out of routing while the worker cannot serve: heartbeats stop and the registry entry goes
        (every router drops the worker at once); `register` and `start_heartbeat` bring it back."""
        self.stop_heartbeat()
        registry = await open_registry(self.nc, self.subjects)
        await registry.delete(str(self.worker_id))

    def start_heartbeat(self) -> None:
        if self._heartbeat_task is None or self._heartbeat_task.done():
            self._heartbeat_task = self._background.keep_running("heartbeat", self._heartbeat_loop)

    def stop_heartbeat(self) -> None:
        task, self._heartbeat_task = self._heartbeat_task, None
        if task is not None:
            task.cancel()

    async def _beat(self) -> None:
        beat = Heartbeat(worker_id=self.worker_id, sent_at_ms=int(time.time() * 1000), registration=self.registration)
        with contextlib.suppress(Exception):  # a disconnected client buffers or drops; keep beating
            await self.nc.publish(self.subjects.heartbeat(self.worker_id), msgspec.json.encode(beat))

    async def _heartbeat_loop(self) -> None:
        while True:
            await self._beat()
            await asyncio.sleep(self._heartbeat_interval)

    # ------------------------------------------------------------------ events
    async def stored(
        self,
        blocks: Iterable[tuple[int, int]],
        *,
        parent_hash: int | None = None,
        dp_rank: int = 0,
        storage_tier: StorageTier = StorageTier.DEVICE,
    ) -> int:
        """Publish blocks stored under ``parent_hash`` as ``(block_hash, tokens_hash)``; returns the event id."""
        pairs = list(blocks)
        return await self.stored_hashes(
            [block for block, _ in pairs],
            [tokens for _, tokens in pairs],
            parent_hash=parent_hash,
            dp_rank=dp_rank,
            storage_tier=storage_tier,
        )

    async def stored_hashes(
        self,
        block_hashes: list[int],
        tokens_hashes: list[int],
        *,
        parent_hash: int | None = None,
        dp_rank: int = 0,
        storage_tier: StorageTier = StorageTier.DEVICE,
    ) -> int:
        """`stored` with the two hashes of each block in two lists (no pair per block): the bridge's path."""
        # Hashes as u64 (i64 reinterpreted), checked before anything is held or numbered.
        if block_hashes and (min(block_hashes) < 0 or max(block_hashes) > U64_MAX):
            block_hashes = [as_u64(value, "block_hash") for value in block_hashes]
        if tokens_hashes and (min(tokens_hashes) < 0 or max(tokens_hashes) > U64_MAX):
            tokens_hashes = [as_u64(value, "tokens_hash") for value in tokens_hashes]
        if parent_hash is not None and parent_hash >> 64:
            parent_hash = as_u64(parent_hash, "parent_hash")
        rank = self._rank_log(dp_rank)
        return await self._emit(
            rank, *self._stored(rank, dp_rank, storage_tier, parent_hash, block_hashes, tokens_hashes)
        )

    async def removed(
        self, block_hashes: Iterable[int], *, dp_rank: int = 0, storage_tier: StorageTier = StorageTier.DEVICE
    ) -> int:
        rank = self._rank_log(dp_rank)
        numbered = self._removed(rank, dp_rank, storage_tier, list(block_hashes))
        return rank.last_event_id if numbered is None else await self._emit(rank, *numbered)

    async def cleared(self, *, dp_rank: int = 0, storage_tier: StorageTier = StorageTier.DEVICE) -> int:
        rank = self._rank_log(dp_rank)
        return await self._emit(rank, *self._cleared(rank, dp_rank, storage_tier))

    def emit_engine_events(
        self, dp_rank: int, events: Iterable[EngineEvent], into: list[bytes]
    ) -> list[tuple[EngineStored | EngineOffloaded, KvIndexError]]:
        """Decoded engine events (their hashes u64 already) into ``into``, an `engine_batch`, in one pass,
        the bridge's path: what `stored_hashes`, `removed` and `cleared` do, without a coroutine per event.
        Stores refused by what the rank holds are returned with the reason and never sent; so are the
        hashes of an offload that name no device block the rank holds (`BlockNotFound`)."""
        rank = self._rank_log(dp_rank)
        keep, send = rank.ring.append, into.append
        refused: list[tuple[EngineStored | EngineOffloaded, KvIndexError]] = []
        for event in self._offloads_resolved(dp_rank, events, refused):
            if type(event) is EngineStored:
                try:
                    numbered = self._stored(
                        rank, dp_rank, event.tier, event.parent_hash, event.block_hashes, event.tokens_hashes
                    )
                except KvIndexError as exc:
                    refused.append((event, exc))
                    continue
            elif type(event) is EngineRemoved:
                removal = self._removed(rank, dp_rank, event.tier, event.block_hashes)
                if removal is None:
                    continue
                numbered = removal
            else:
                numbered = self._cleared(rank, dp_rank, StorageTier.DEVICE)
            keep(numbered)
            send(numbered[1])
        return refused

    def _offloads_resolved(
        self,
        dp_rank: int,
        events: Iterable[EngineEvent],
        refused: list[tuple[EngineStored | EngineOffloaded, KvIndexError]],
    ) -> Iterator[EngineStored | EngineRemoved | EngineCleared]:
        """``events`` with each offload as the stores it resolves to, against the device blocks held when
        it is reached (lazily: after the stores before it); its unresolved hashes go to ``refused``."""
        for event in events:
            if not isinstance(event, EngineOffloaded):
                yield event
                continue
            held = self._held.tables.get((dp_rank, StorageTier.DEVICE), {})
            stores, unresolved = resolve_offloaded(event, held.get)
            if unresolved:
                refused.append((event, BlockNotFound((self.worker_id, dp_rank), unresolved)))
            yield from stores

    def emit_engine_payload(
        self,
        payload: bytes,
        block_size: int,
        seed: int,
        default_rank: int,
        hash_records: tuple[dict[tuple[int | None, int], int], dict[int, int], int],
        into: list[bytes],
    ) -> tuple[int, int, int, int, list[tuple[int, int, int, int | None, int]]] | None:
        """`decode_engine_batch` and `emit_engine_events` of one engine payload in one C call (and the
        first-block hash check whose records are ``hash_records``: by content, by hash, the bound).
        Returns ``(dp_rank, applied, events, ignored, contradictions)``: the first ``applied`` of the
        batch's ``events`` decoded events are in ``into``, an `engine_batch` (fewer: the next store was
        refused and the rest is the caller's); None, with nothing changed, for what the Python path must do."""
        # Blocks held in copies take the Python path, which counts them (`HeldBlocks`).
        if not (EVENTS_NATIVE and self._msgpack and self._encoder.native) or self._held.has_copies:
            return None
        taken = events_accel.bridge_batch(
            payload,
            block_size,
            seed,
            default_rank,
            self.next_event_id,
            self._held.tables,
            self._encoder.templates,
            self._removed_encoder.templates,
            self._encoder.row,
            *hash_records,
        )
        if taken is None:
            declined("indexer._events_native", "bridge_batch_form")
            return None
        dp_rank, applied, events, ignored, contradictions, numbered = taken
        if applied < events:
            declined("indexer._events_native", "bridge_store_refused")
        if numbered:
            rank = self._ranks[dp_rank]
            rank.last_event_id = numbered[-1][0]
            rank.ring.extend(numbered)
            into.extend([encoded for _, encoded in numbered])
        return dp_rank, applied, events, ignored, contradictions

    def emit_cleared(self, dp_rank: int, tiers: Iterable[StorageTier], into: list[bytes]) -> None:
        """A clear of each of ``tiers`` of the rank into ``into``, an `engine_batch` (an engine restarted)."""
        rank = self._rank_log(dp_rank)
        for tier in tiers:
            numbered = self._cleared(rank, dp_rank, tier)
            rank.ring.append(numbered)
            into.append(numbered[1])

    def next_event_id(self, dp_rank: int) -> int | None:
        """The id the rank's next event takes, for the C step to number a batch with (it hands the
        numbered events back to `emit_engine_payload`); None for a rank that has published nothing yet."""
        rank = self._ranks.get(dp_rank)
        return None if rank is None else rank.last_event_id + 1

    # Each of the three holds the event, numbers it in ``rank`` and returns (event id, its bytes).
    def _stored(
        self,
        rank: _RankLog,
        dp_rank: int,
        storage_tier: StorageTier,
        parent_hash: int | None,
        block_hashes: list[int],
        tokens_hashes: list[int],
    ) -> tuple[int, bytes]:
        self._held.store(dp_rank, storage_tier, parent_hash, block_hashes, tokens_hashes)
        rank.last_event_id = event_id = rank.last_event_id + 1
        if self._msgpack:
            payload = self._encoder.encode(event_id, dp_rank, storage_tier, parent_hash, block_hashes, tokens_hashes)
        else:
            blocks = zip(block_hashes, tokens_hashes, strict=True)
            event = stored_event(event_id, blocks, parent_hash=parent_hash, dp_rank=dp_rank)
            payload = encode_router_events(RouterEvent(self.worker_id, event, storage_tier))
        return event_id, payload

    def _removed(
        self, rank: _RankLog, dp_rank: int, storage_tier: StorageTier, block_hashes: list[int]
    ) -> tuple[int, bytes] | None:
        """None: only copies of blocks still held in another copy were removed, which routers must not hear."""
        if block_hashes and (min(block_hashes) < 0 or max(block_hashes) > U64_MAX):
            block_hashes = [as_u64(value, "block_hash") for value in block_hashes]
        # A removal of unknown hashes still applies the rest; routers report the unknown ones alike.
        forwarded = self._held.remove(dp_rank, storage_tier, block_hashes)
        if block_hashes and not forwarded:
            return None
        block_hashes = forwarded
        rank.last_event_id = event_id = rank.last_event_id + 1
        if self._msgpack:
            return event_id, self._removed_encoder.encode(event_id, dp_rank, storage_tier, block_hashes)
        event = removed_event(event_id, block_hashes, dp_rank=dp_rank)
        return event_id, self._encode(RouterEvent(self.worker_id, event, storage_tier))

    def _cleared(self, rank: _RankLog, dp_rank: int, storage_tier: StorageTier) -> tuple[int, bytes]:
        self._unverified.discard(dp_rank)
        self._held.clear(dp_rank, storage_tier)
        rank.last_event_id = event_id = rank.last_event_id + 1
        event = RouterEvent(self.worker_id, cleared_event(event_id, dp_rank=dp_rank), storage_tier)
        return event_id, self._encode(event)

    def mark_unverified(self, dp_rank: int = 0) -> None:
        """What this rank holds is no longer known: the next event id is skipped, so routers see a gap,
        and their resyncs of the rank are refused until it clears; they keep it untrusted meanwhile."""
        if dp_rank not in self._unverified:
            self._unverified.add(dp_rank)
            self._rank_log(dp_rank).last_event_id += 1

    def last_event_ids(self) -> dict[int, int]:
        """Per rank that has published: the id of its last event (a skipped id counts: see
        `mark_unverified`), what a router's own count of the worker's stream is compared with."""
        return {dp_rank: rank.last_event_id for dp_rank, rank in self._ranks.items()}

    def unverified_ranks(self) -> frozenset[int]:
        """The ranks whose holdings are unknown since a gap nobody could replay, until they clear."""
        return frozenset(self._unverified)

    def holds(self, dp_rank: int, block_hash: int) -> bool:
        """Whether this rank holds a copy of the block, in any tier (`HeldBlocks.holds`)."""
        return self._held.holds(dp_rank, block_hash)

    def held_tiers(self, dp_rank: int) -> set[StorageTier]:
        """The storage tiers this rank has held blocks in since they were last cleared."""
        return self._held.tiers(dp_rank)

    def _rank_log(self, dp_rank: int) -> _RankLog:
        rank = self._ranks.get(dp_rank)
        if rank is None:
            rank = self._ranks[dp_rank] = _RankLog(self._ring_size)
            ranks = self.registration.dp_ranks
            if dp_rank not in ranks:  # an engine run with external data parallelism stamps its own rank
                log.warning(
                    "events of worker %d under dp rank %d, but it is registered with ranks %d..%d: routers refuse "
                    "them (unknown_dp_rank); an engine run with external or hybrid data parallelism (vLLM "
                    "--data-parallel-rank) stamps its own rank, which the registration must hold (dp_start_rank)",
                    self.worker_id,
                    dp_rank,
                    ranks.start,
                    ranks.stop - 1,
                )
        return rank

    def _encode(self, event: RouterEvent) -> bytes:
        return encode_router_events(event, msgpack=self._msgpack)

    async def _emit(self, rank: _RankLog, event_id: int, payload: bytes) -> int:
        rank.ring.append((event_id, payload))
        if self._batch is not None:
            self._batch.append(payload)
        else:
            await self._send([payload])
        return event_id

    @contextlib.asynccontextmanager
    async def batch(self) -> AsyncIterator[None]:
        """Collect the events emitted inside into one message (one list), sent on exit."""
        if self._batch is not None:
            yield
            return
        self._batch = []
        try:
            yield
        finally:
            events, self._batch = self._batch, None
            if events:
                await self._send(events)

    @contextlib.asynccontextmanager
    async def engine_batch(self) -> AsyncIterator[list[bytes]]:
        """A batch of its own, apart from `batch`'s: the list the `emit_engine_*` calls inside append to,
        sent as one message on exit. One per engine stream (a bridge's dp ranks): a stream whose batch is
        open never holds back, nor joins, another's."""
        events: list[bytes] = []
        try:
            yield events
        finally:
            if events:
                await self._send(events)

    async def _send(self, events: list[bytes]) -> None:
        # A batch that outgrew the server's limit goes out in parts, still in order.
        for payload in event_payloads(events, self.nc.max_payload, msgpack=self._msgpack):
            await self._publish_events(payload)

    async def _publish_events(self, payload: bytes) -> None:
        try:
            await self.nc.publish(self.subjects.events(self.worker_id), payload, headers=self._headers)
        except OutboundBufferLimitError:
            # Not lost: the events stay in their ranks' rings, and a router sees the gap at the next event
            # that reaches it and has them replayed (or resyncs the whole rank).
            self.unsent_batches += 1
            self._unsent_log.warning(
                "events unsent",
                f"worker {self.worker_id}: NATS out of reach and the connection's buffer full; routers "
                "have them replayed once it is back",
            )

    async def publish_load(self, load: ActiveLoad) -> None:
        with contextlib.suppress(OutboundBufferLimitError):  # NATS out of reach: the next report supersedes it
            await self.nc.publish(self.subjects.load(self.worker_id), msgspec.json.encode(load))

    # ------------------------------------------------------------------ resync
    def answer_resync(self, request: ResyncRequest) -> ResyncResponse:
        if request.dp_rank in self._unverified:
            return ResyncResponse(error=f"dp rank {request.dp_rank} is unverified: its engine lost events")
        rank = self._ranks.get(request.dp_rank) or _RankLog(0)
        last = rank.last_event_id
        start = request.start_event_id
        if start is not None and start > last + 1:
            return ResyncResponse(
                too_new=ResyncTooNew(requested_start=start, requested_end=request.end_event_id, newest_available=last)
            )
        oldest = rank.ring[0][0] if rank.ring else last + 1
        if start is not None and start >= oldest:
            end = last if request.end_event_id is None else min(request.end_event_id, last)
            wanted = [self._decoder.decode(payload) for event_id, payload in rank.ring if start <= event_id <= end]
            return ResyncResponse(events=ResyncBatch(events=wanted, last_event_id=end))
        dump = self._held.dump_events(request.dp_rank)
        return ResyncResponse(tree_dump=ResyncBatch(events=dump, last_event_id=last))

    async def _on_refused(self, message: Msg) -> None:
        try:
            refusal = msgspec.json.decode(message.data, type=Refusal)
        except UNDECODABLE:
            return
        if self.refusal is None or refusal.reason != self.refusal.reason:
            log.error(
                "a router refused worker %d: %s. Start the worker with block size %d (or the router with --block-size "
                "%s); until then it is not routed",
                self.worker_id,
                refusal.reason,
                refusal.router_block_size,
                self.registration.block_size,
            )
        self.refusal = refusal
        self.refused.set()

    async def _on_resync(self, message: Msg) -> None:
        in_parts = False
        try:
            request = msgspec.json.decode(message.data, type=ResyncRequest)
        except UNDECODABLE as exc:
            response = ResyncResponse(error=f"invalid resync request: {exc}")
        else:
            response = self.answer_resync(request)
            in_parts = request.in_parts
        payloads = [msgspec.msgpack.encode(response)]
        limit = self.nc.max_payload
        if len(payloads[0]) > limit:
            # In parts to an asker that reads them (`resync_parts`); else, or when it cannot be cut, refused.
            parts = reply_parts(response, limit) if in_parts else None
            refusal = f"reply of {len(payloads[0])} bytes exceeds the server's max_payload of {limit}"
            payloads = parts or [msgspec.msgpack.encode(ResyncResponse(error=refusal))]
        if message.reply:
            for payload in payloads:
                await self.nc.publish(message.reply, payload)

    def dump_events(self) -> list[RouterEvent]:
        """What this worker holds on every rank and tier, as the stored events a full dump answers."""
        return self._held.dump_events()

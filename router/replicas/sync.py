"""`ReplicaSync`: routers that share one load view over NATS (``--replica-sync``).

Every booking change a router makes (a booking with its blocks and prefill tokens, ``mark_prefill``,
``mark_free``, expiry) reaches it synchronously through `KvRouter.booking_listener`, is queued, and is
published on ``kv.{ns}.router.sync`` in a `SyncBatch` numbered per replica: at once after a quiet
spell, else with the changes of a ``batch_window_s`` window (2 ms). Peers apply it with the
``replicated`` entry points of `KvRouter`, which never publish again.

Why the views converge whatever the order or loss: a request only moves forward, booked -> prefill
done -> freed, and every replica keeps the ids it saw freed for ``tombstone_s``. Applying a change is
idempotent and commutative (a booking arriving after its free is ignored, a mark_prefill arriving before
its booking is kept for it), so each replica's view is the join of everything it has heard, and merging
another replica's whole view (`StateReply`) can only move it forward.

- Lost messages: batches are numbered; a number skipped, or a heartbeat naming a batch never seen,
  is a gap and the sender's whole view is requested (``kv.{ns}.router.sync.state.{id}``, in parts
  when larger than a NATS message) and merged; a failed ask leaves the gap pending, asked again.
- Late joiners: on start a replica asks any peer (queue group) for its view; a peer heard from first
  with a batch number above 1 is asked directly, so it is consistent even if that first ask failed.
- Dead replicas: one silent for ``lease_s`` (no heartbeat) has the bookings it made dropped; one that
  stops cleanly says so (``leaving``) and its bookings go at once. Its queued requests were never booked.
- Request ids are global: a request booked on one replica can be marked on any.

A booking expires only where it was booked, and that expiry is published like a free, so a request
expires everywhere when it expires there. (Dynamo starts a remote booking's expiry clock when it is
received; a peer's own expiry, published, would free the booking where the proxy holds it for a stream
longer than ``request_expiry_secs``.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError, OutboundBufferLimitError

from indexer.errors import UNDECODABLE
from router.errors import DuplicateRequestId, UnknownWorker
from router.event_plane.parts import PartsTooLarge, request_in_parts
from router.event_plane.ratelimited_log import RateLimitedLog
from router.event_plane.subjects import Subjects
from router.kv_router import KvRouter
from router.replicas.messages import (
    Booked,
    BookingEntry,
    Change,
    Freed,
    PrefillMarked,
    StateReader,
    StateReply,
    StateRequest,
    SyncBatch,
    SyncBeat,
    state_parts,
    sync_decoder,
)
from router.sequences import Booking
from router.supervision import Supervisor, raise_if_cancelling

__all__ = ["ReplicaSync"]

log = logging.getLogger(__name__)

# At most this many changes per published batch (a burst is split, each part numbered).
MAX_BATCH_CHANGES = 512
# After publishing a batch, changes gather this long into the next one: a change after a quiet spell
# goes out in the loop turn it is made, under load one message carries a window's changes (each
# message costs both ends far more than a change in it). It bounds the lag it adds.
BATCH_WINDOW_S = 0.002
# On a clean stop, how long a batch being published may take to go out before it is cancelled.
STOP_DRAIN_S = 2.0
# A failed ask for a peer's view is repeated at its next beat, then after twice as long each time up to
# this: the gap stays pending (a lost free would leak its booking) without a peer asked every beat for
# a view it cannot send.
REPAIR_BACKOFF_MAX_S = 10.0
# Sync lag samples kept (seconds from publish to apply, by the wall clock of one host or NTP).
LAG_SAMPLES = 4096
# A peer's booking on a worker not registered here waits this long for the worker (its registration
# reaches each router through the registry's watch, which can trail the sync message), then is refused.
UNKNOWN_WORKER_WAIT_S = 10.0
# At most this many bookings wait for their worker; beyond, one is refused at once.
MAX_WAITING_BOOKINGS = 10_000

_encode = msgspec.msgpack.Encoder().encode
# A message's sender field lies within its first bytes: map header, the tag, then replica_id.
_SENDER_WITHIN = 64
_state_request = msgspec.msgpack.Decoder(StateRequest)


@dataclass(slots=True)
class _Peer:
    last_seen: float
    # Its batches up to this one are all in this view (applied, or through a view merged): never past a
    # batch missed, since peers that join copy it and would never see that gap.
    cursor: int = 0
    seen: int = 0  # its highest batch number known here (applied, or named by a beat)
    repairing: bool = False
    # Another gap showed while a repair was in flight: its answer may predate it, so ask again.
    repair_again: bool = False
    # A gap no successful repair has covered yet (the last ask failed): ask at a beat from retry_at.
    unrepaired: bool = False
    failed_asks: int = 0
    retry_at: float = 0.0


@dataclass(slots=True)
class _WaitingBooking:
    """A peer's booking on a worker not registered here yet."""

    origin: str
    booking: Booking
    generation: int
    predicted: Sequence[int] | None
    since: float


class ReplicaSync:
    def __init__(
        self,
        router: KvRouter,
        nc: Client,
        *,
        namespace: str = "default",
        lease_s: float = 10.0,
        heartbeat_s: float | None = None,
        state_timeout_s: float = 2.0,
        batch_window_s: float = BATCH_WINDOW_S,
        replica_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.router = router
        self.nc = nc
        self.subjects = Subjects(namespace)
        self.replica_id = replica_id or uuid.uuid4().hex[:16]
        self.lease_s = lease_s
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else min(1.0, lease_s / 5)
        self.tombstone_s = max(2 * lease_s, 30.0)
        self._state_timeout = state_timeout_s
        self.batch_window_s = batch_window_s
        self._clock = clock
        self._seq = 0
        self._outbox: list[Change | None] = []
        # Request id -> where its changes wait in the outbox: a request freed before its booking went
        # out is dropped from the batch whole (peers would book and free it in one step).
        self._unsent: dict[str, list[int]] = {}
        self._wake = asyncio.Event()
        # Set while nothing waits to go out: the outbox is empty and no batch is being published.
        self._idle = asyncio.Event()
        self._idle.set()
        self._peers: dict[str, _Peer] = {}
        self._origin: dict[str, str] = {}  # active request id -> the replica that booked it
        self._freed: OrderedDict[str, float] = OrderedDict()  # request id -> when it was freed
        # Request id -> its generation (`Booked.generation`), above 0 only: active, and freed (tombstones).
        self._generation: dict[str, int] = {}
        self._freed_generation: dict[str, int] = {}
        self._early_prefill: dict[str, float] = {}  # marked before its booking arrived
        self._waiting: dict[str, _WaitingBooking] = {}  # request id -> its booking, its worker unknown here
        # Replicas dropped here (left or silent) -> when: other views naming them do not bring them
        # back; only their own next message does (they were cut off, not dead).
        self._gone: dict[str, float] = {}
        self._decode = sync_decoder()
        # The service gives this a connection without echo; on a shared one (tests, embedders) every
        # message starts with its tag, then its sender, so this replica's own echoes are recognised
        # in their first bytes and never decoded.
        self._own_sender = _encode("replica_id") + _encode(self.replica_id)
        self._subscriptions: list[Subscription] = []
        self._background = Supervisor("replica-sync")
        self._bad_input = RateLimitedLog(log)
        # Outcome -> count: published, applied, duplicate, gap, repaired, peer_expired, rejected_<reason>, ...
        # Present from the start, at 0: a counter first seen at 1 reads as no increase to Prometheus.
        self.outcomes: Counter[str] = Counter(
            dict.fromkeys(("published", "unpublished", "applied", "gap", "repaired"), 0)
        )
        self.lag_s: deque[float] = deque(maxlen=LAG_SAMPLES)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Subscribe, publish the router's bookings so far, learn the current bookings from a peer (if
        there is one), go on publishing."""
        nc = self.nc
        self._subscriptions = [
            await nc.subscribe(self.subjects.router_sync, cb=self._on_sync, pending_msgs_limit=1_000_000),
            await nc.subscribe(self.subjects.router_sync_state(self.replica_id), cb=self._on_state_request),
        ]
        self.router.booking_listener = self
        # Heard at once, not a heartbeat later: a peer that has heard of no other answers a mark for an id
        # it does not hold 404, as a lone router does, and the booking made here would then leak.
        await self._beat()
        # Bookings made before the listener was attached (HTTP serves while the plane starts; a durable
        # replay can take minutes) go out as if made now: else a free told to a peer would be a 404.
        for request_id, booking in self.router.bookings():
            self.booked(request_id, booking, None)
        self._background.keep_running("publish", self._publish_loop)
        self._background.keep_running("heartbeat", self._heartbeat_loop)
        await self._join()
        # Only now may peers ask "anyone" for the bookings: this replica has them.
        self._subscriptions.append(
            await nc.subscribe(self.subjects.router_sync_state(), queue="state", cb=self._on_state_request)
        )
        log.info("replica sync: replica %s on %s", self.replica_id, self.subjects.router_sync)

    async def stop(self) -> None:
        """Let the outbox drain (a batch being published is not cut off: its changes, frees of
        requests other replicas booked among them, would reach no peer), tell peers this replica is
        leaving (they drop its bookings), unsubscribe, drop the peers' bookings."""
        if self.router.booking_listener is self:
            self.router.booking_listener = None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.drained(), STOP_DRAIN_S)
        await self._background.stop()
        with contextlib.suppress(Exception):
            await self._flush()
            beat = SyncBeat(replica_id=self.replica_id, seq=self._seq, sent_at_ms=_now_ms(), leaving=True)
            await self.nc.publish(self.subjects.router_sync, _encode(beat))
            await self.nc.flush(timeout=2)
        for subscription in self._subscriptions:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()
        self._subscriptions = []
        # Peers' bookings are kept current no longer (their frees go unheard): dropped, so a sync started
        # again on this router (a retried start) learns them afresh instead of publishing them as its own.
        me, now = self.replica_id, self._clock()
        for request_id in [request_id for request_id, origin in self._origin.items() if origin != me]:
            self._free(request_id, now, None, tombstone=False)

    async def _join(self) -> None:
        asked_at = self._clock()
        try:
            reply = await self._ask(self.subjects.router_sync_state())
        except NoRespondersError:
            log.info("replica sync: no peer yet, starting with no bookings")
            return
        except (TimeoutError, NatsError) as exc:
            log.warning("replica sync: no peer answered the join (%r); peers are asked as they are heard", exc)
            return
        if reply is not None:
            self._merge_reply(reply, "joined", asked_at)

    async def _ask(self, subject: str) -> StateReply | None:
        """A peer's view, in parts if it is large; None (rejected, logged) when it cannot be decoded or
        its parts go past `MAX_PARTS_BYTES`. Raises NATS' errors (`NoRespondersError`, `TimeoutError`,
        ...)."""
        request = _encode(StateRequest(replica_id=self.replica_id, in_parts=True))
        try:
            return await request_in_parts(self.nc, subject, request, self._state_timeout, StateReader())
        except UNDECODABLE as exc:
            self._reject("undecodable", f"state reply: {exc}")
            return None
        except PartsTooLarge as exc:
            self._reject("oversized", f"state reply: {exc}")
            return None

    # ------------------------------------------------------------------ local changes (BookingListener)
    def booked(self, request_id: str, booking: Booking, predicted: Sequence[int] | None) -> None:
        self._origin[request_id] = self.replica_id
        generation = 0
        if request_id in self._freed:  # booked again within the tombstone window: a newer booking
            generation = self._generation[request_id] = self._freed_generation.get(request_id, 0) + 1
        worker_id, dp_rank = booking.key
        self._unsent[request_id] = [len(self._outbox)]
        hashes = _wire_hashes(booking.hashes)
        self._queue(Booked(request_id=request_id, worker_id=worker_id, dp_rank=dp_rank, hashes=hashes,
                           private_blocks=booking.private_blocks, prefill_tokens=booking.prefill_tokens,
                           context_tokens=booking.context_tokens,
                           expected_output_tokens=booking.expected_output_tokens,
                           generation=generation, predicted_blocks=_wire_hashes(predicted)))  # fmt: skip

    def prefill_marked(self, request_id: str) -> None:
        unsent = self._unsent.get(request_id)
        if unsent is not None:
            unsent.append(len(self._outbox))
        self._queue(PrefillMarked(request_id=request_id))

    def freed(self, request_id: str) -> None:
        self._origin.pop(request_id, None)
        generation = self._generation.pop(request_id, 0)
        self._tombstone(request_id, self._clock(), generation)
        unsent = self._unsent.pop(request_id, None)
        if unsent is None:
            self._queue(Freed(request_id=request_id, generation=generation))
            return
        outbox = self._outbox
        for index in unsent:
            outbox[index] = None
        self.outcomes["elided"] += len(unsent) + 1

    def marked_unknown(self, request_id: str, *, free: bool) -> bool:
        """A mark told to this replica for an id it has not booked: the booking may be on its way from the
        peer that made it. Kept for it (a tombstone, so the booking is refused when it arrives, or an early
        prefill mark) and published, so the peer holding it, and every other, applies it too. False for an
        id freed here lately (a repeated mark, not one ahead of its booking), and with no peer heard from:
        nobody else can hold it (a wrong id stays a 404, as on a lone router)."""
        if request_id in self._freed or not self._peers:
            return False
        now = self._clock()
        if free:
            self._tombstone(request_id, now, 0)
            self._queue(Freed(request_id=request_id, generation=0))
        else:
            self._early_prefill[request_id] = now
            self._queue(PrefillMarked(request_id=request_id))
        self.outcomes["passed_marks"] += 1
        return True

    def _queue(self, change: Change) -> None:
        outbox = self._outbox
        if not outbox:
            self._wake.set()  # set stays set until the publish loop takes the whole outbox
            self._idle.clear()
        outbox.append(change)

    async def drained(self) -> None:
        """Once every change made so far has been handed to NATS (or its batch failed to publish: peers
        see the gap its number leaves and repair it)."""
        await self._idle.wait()

    async def _publish_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._flush()
            await asyncio.sleep(self.batch_window_s)

    async def _flush(self) -> None:
        try:
            while self._outbox:
                taken, self._outbox = self._outbox, []
                self._unsent.clear()
                await self._publish([change for change in taken if change is not None])
        finally:
            if not self._outbox:
                self._idle.set()

    async def _publish(self, pending: list[Change]) -> None:
        for start in range(0, len(pending), MAX_BATCH_CHANGES):
            await self._publish_batch(pending[start : start + MAX_BATCH_CHANGES])

    def _batch_payload(self, changes: list[Change]) -> tuple[list[Change], bytes]:
        """The next batch of ``changes`` as msgpack, with the changes it carries."""
        batch = SyncBatch(replica_id=self.replica_id, seq=self._seq + 1, sent_at_ms=_now_ms(), changes=changes)
        try:
            return changes, _encode(batch)
        except (msgspec.EncodeError, OverflowError, TypeError):
            # A change no door should have let in (every field is bounded where it enters): it alone
            # is dropped, counted and logged; the batch's other changes still reach the peers.
            batch.changes = changes = [change for change in changes if self._encodable(change)]
            return changes, _encode(batch)

    async def _publish_batch(self, changes: list[Change]) -> None:
        changes, payload = self._batch_payload(changes)
        limit = self.nc.max_payload
        if len(payload) > limit:
            # Long prompts' block hashes (~9 bytes a block) pass the server's max_payload (1 MiB on a
            # stock server) long before MAX_BATCH_CHANGES changes: NATS would refuse the batch whole
            # (the publish loop crashed, the peers repaired from full views). Halved until each fits.
            if len(changes) > 1:
                half = len(changes) // 2
                await self._publish_batch(changes[:half])
                await self._publish_batch(changes[half:])
            else:  # a booking no view could carry either
                self._reject("oversized_change", f"{type(changes[0]).__name__} of {len(payload)} bytes not sent "
                             f"to the peers: the server's max_payload is {limit}")  # fmt: skip
            return
        self._seq += 1
        try:
            await self.nc.publish(self.subjects.router_sync, payload)
        except OutboundBufferLimitError:
            # NATS out of reach long enough to fill the connection's buffer: the peers see the gap
            # this batch's number leaves at the next one that reaches them, and ask for the view.
            self.outcomes["unpublished"] += len(changes)
            self._bad_input.warning("sync batch not published", "NATS out of reach, the connection's buffer full")
            return
        self.outcomes["published"] += len(changes)
        self.outcomes["published_batches"] += 1

    def _encodable(self, change: Change) -> bool:
        try:
            _encode(change)
        except (msgspec.EncodeError, OverflowError, TypeError) as exc:
            self._reject("unencodable_change", f"{type(change).__name__} not sent to the peers: {exc}")
            return False
        return True

    async def _beat(self) -> None:
        beat = SyncBeat(replica_id=self.replica_id, seq=self._seq, sent_at_ms=_now_ms())
        with contextlib.suppress(Exception):  # a disconnected client buffers or drops; keep beating
            await self.nc.publish(self.subjects.router_sync, _encode(beat))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            await self._beat()
            self._expire_peers()
            self._prune()
            if self._waiting:
                self._place_waiting()

    # ------------------------------------------------------------------ peers' changes
    async def _on_sync(self, message: Msg) -> None:
        data = message.data
        if self._own_sender in data[:_SENDER_WITHIN]:
            return  # our own echo
        try:
            sync = self._decode.decode(data)
        except UNDECODABLE as exc:
            self._reject("undecodable", f"sync message: {exc}")
            return
        sender = sync.replica_id
        if sender == self.replica_id:
            return  # our own echo (framed unlike our encoder's: not recognised above)
        now = self._clock()
        if self._gone.pop(sender, None) is not None and not (isinstance(sync, SyncBeat) and sync.leaving):
            log.warning("replica sync: peer %s dropped here is alive after all", sender)
        peer = self._peers.get(sender)
        if peer is None:
            peer = self._peers[sender] = _Peer(last_seen=now)
            log.info("replica sync: peer %s", sender)
        peer.last_seen = now
        if isinstance(sync, SyncBeat):
            if sync.leaving:
                self._drop_peer(sender, "left")
            elif sync.seq > peer.seen:
                peer.seen = sync.seq
                self._repair(sender, peer)  # its last batches never arrived
            elif peer.unrepaired and not peer.repairing and now >= peer.retry_at:
                self._repair(sender, peer)  # a repair failed
            return
        if sync.seq <= peer.seen:
            self.outcomes["duplicate"] += 1
            return
        if sync.seq > peer.seen + 1:
            self._repair(sender, peer)
        peer.seen = sync.seq
        try:
            applied = 0
            for change in sync.changes:
                applied += self._apply(change, sender, now)
        except Exception:
            # Never leave a batch half applied in silence: log it and repair from the sender's view.
            log.exception("replica sync: applying batch %d of %s failed; asking for its view", sync.seq, sender)
            self.outcomes["rejected_apply_error"] += 1
            self._repair(sender, peer)
            return
        if not peer.unrepaired:
            peer.cursor = sync.seq
        self.outcomes["applied"] += applied
        self.lag_s.append(max(0.0, time.time() - sync.sent_at_ms / 1000))

    def _apply(self, change: Change, origin: str, now: float) -> bool:
        """Apply one peer change; whether it was applied (not a duplicate, late or rejected booking)."""
        kind = type(change)
        if kind is Freed:
            assert isinstance(change, Freed)
            self._free(change.request_id, now, change.generation)
            return True
        if kind is Booked:
            assert isinstance(change, Booked)
            return self._book(
                change.request_id, origin, change.booking(), change.generation, now, change.predicted_blocks
            )
        request_id = change.request_id
        if not self.router.mark_prefill(request_id, replicated=True) and request_id not in self._freed:
            self._early_prefill[request_id] = now
        return True

    def _book(
        self,
        request_id: str,
        origin: str,
        booking: Booking,
        generation: int,
        now: float,
        predicted: Sequence[int] | None = None,
    ) -> bool:
        if request_id in self._freed and generation <= self._freed_generation.get(request_id, 0):
            self.outcomes["booked_after_free"] += 1
            return False
        if request_id in self._origin:  # booked here already (an active booking raises below)
            held = self._generation.get(request_id, 0)
            if generation <= held:
                self.outcomes["duplicate_booking"] += 1
                return False
            # A newer booking of the id: its free, made before it, has not reached this replica yet.
            self._free(request_id, now, held)
        try:
            self.router.book_replicated(request_id, booking, predicted)
        except DuplicateRequestId:
            self.outcomes["duplicate_booking"] += 1
            return False
        except UnknownWorker as exc:
            if len(self._waiting) >= MAX_WAITING_BOOKINGS:
                self._reject("booking", f"{exc}; {MAX_WAITING_BOOKINGS} bookings wait for their worker already")
            else:
                self._waiting[request_id] = _WaitingBooking(origin, booking, generation, predicted, now)
                self.outcomes["waiting_for_worker"] += 1
            return False
        if self._waiting:
            waiting = self._waiting.get(request_id)
            if waiting is not None and waiting.generation <= generation:
                del self._waiting[request_id]  # an older booking of the id, superseded
        self._origin[request_id] = origin
        if generation:
            self._generation[request_id] = generation
        if self._early_prefill and self._early_prefill.pop(request_id, None) is not None:
            self.router.mark_prefill(request_id, replicated=True)
        return True

    def _free(self, request_id: str, now: float, generation: int | None, *, tombstone: bool = True) -> None:
        """Free the booking of ``generation`` (None: whichever is booked) or an earlier one; a newer
        booking of the id stays (the free is a late one of a booking the id had before)."""
        if generation is not None and self._generation.get(request_id, 0) > generation:
            self._tombstone(request_id, now, generation)
            return
        self.router.mark_free(request_id, replicated=True)
        self._origin.pop(request_id, None)
        held = self._generation.pop(request_id, 0)
        if self._early_prefill:
            self._early_prefill.pop(request_id, None)
        if self._waiting:
            waiting = self._waiting.get(request_id)
            if waiting is not None and (generation is None or waiting.generation <= generation):
                del self._waiting[request_id]
        if tombstone:
            self._tombstone(request_id, now, held if generation is None else generation)

    def _place_waiting(self) -> None:
        """At a beat (not per batch: the walk is O(waiting)), book the waiting bookings whose rank is
        registered now; refuse those that waited too long. Each keeps the time it began to wait."""
        now = self._clock()
        for request_id, waiting in list(self._waiting.items()):
            worker_id, dp_rank = waiting.booking.key
            worker = self.router.worker(worker_id)
            if worker is not None and dp_rank in worker.dp_ranks:
                del self._waiting[request_id]
                booked = self._book(
                    request_id, waiting.origin, waiting.booking, waiting.generation, now, waiting.predicted
                )
                self.outcomes["applied"] += booked
            elif now - waiting.since > UNKNOWN_WORKER_WAIT_S:
                del self._waiting[request_id]
                self._reject(
                    "booking",
                    f"request {request_id}: rank {dp_rank} of worker {worker_id} unknown here for "
                    f"{UNKNOWN_WORKER_WAIT_S:g} s",
                )

    def _tombstone(self, request_id: str, now: float, generation: int) -> None:
        freed = self._freed
        freed[request_id] = now
        freed.move_to_end(request_id)
        if generation > self._freed_generation.get(request_id, 0):
            self._freed_generation[request_id] = generation

    # ------------------------------------------------------------------ repair and joining
    def _repair(self, sender: str, peer: _Peer) -> None:
        self.outcomes["gap"] += 1
        peer.unrepaired = True
        if peer.repairing:
            peer.repair_again = True
            return
        peer.repairing = True
        self._background.spawn(f"repair-{sender}", self._ask_state(sender, peer))

    async def _ask_state(self, sender: str, peer: _Peer) -> None:
        subject = self.subjects.router_sync_state(sender)
        try:
            while True:
                peer.repair_again = False
                asked_at = self._clock()
                reply = await self._ask(subject)
                raise_if_cancelling()  # a stopped sync merges no more bookings
                if reply is None or not self._merge_reply(reply, "repaired", asked_at):
                    why = "its view was refused or unreadable"
                    break
                if not peer.repair_again:
                    # Its view covered its batches up to its reply; those since came without a gap.
                    peer.cursor = peer.seen = max(peer.seen, peer.cursor)
                    peer.unrepaired = False
                    peer.failed_asks = 0
                    return
        except (TimeoutError, NatsError) as exc:
            why = repr(exc)
        finally:
            peer.repairing = False
        # The gap stays pending: asked again at a beat of the peer, later after each failure.
        backoff = min(self.heartbeat_s * 2**peer.failed_asks, REPAIR_BACKOFF_MAX_S)
        peer.failed_asks += 1
        peer.retry_at = self._clock() + backoff
        log.warning("replica sync: peer %s did not send its bookings (%s); asking again in %.1f s",
                    sender, why, backoff)  # fmt: skip
        self.outcomes["repair_failed"] += 1

    async def _on_state_request(self, message: Msg) -> None:
        try:
            request = _state_request.decode(message.data)
        except UNDECODABLE as exc:
            self._reject("undecodable", f"state request: {exc}")
            return
        if not message.reply:
            return
        for payload in self._state_payloads(request.in_parts):
            await self.nc.publish(message.reply, payload)
        self.outcomes["state_served"] += 1

    def _state_payloads(self, in_parts: bool) -> list[bytes]:
        """This replica's view as one message, else in parts to an asker that reads them, else refused."""
        state = self.state()
        payload = _encode(state)
        limit = self.nc.max_payload
        if len(payload) <= limit:
            return [payload]
        parts = state_parts(state, limit) if in_parts else None
        if parts is not None:
            self.outcomes["state_served_in_parts"] += 1
            return parts
        error = f"state of {len(payload)} bytes exceeds the server's max_payload of {limit}"
        log.error("replica sync: %s", error)
        return [_encode(StateReply(replica_id=self.replica_id, error=error))]

    def state(self) -> StateReply:
        """This replica's whole view, as a peer merges it."""
        now = self._clock()
        me = self.replica_id
        origin, generation = self._origin, self._generation
        bookings = [
            BookingEntry(
                request_id=request_id,
                origin=origin.get(request_id, me),
                worker_id=booking.key[0],
                dp_rank=booking.key[1],
                hashes=_wire_hashes(booking.hashes),
                private_blocks=booking.private_blocks,
                prefill_tokens=booking.prefill_tokens,
                context_tokens=booking.context_tokens,
                expected_output_tokens=booking.expected_output_tokens,
                generation=generation.get(request_id, 0),
            )
            for request_id, booking in self.router.bookings()
        ]
        cursors = {peer_id: peer.cursor for peer_id, peer in self._peers.items()}
        cursors[me] = self._seq
        silent = {peer_id: now - peer.last_seen for peer_id, peer in self._peers.items()}
        return StateReply(replica_id=me, bookings=bookings, freed=list(self._freed), cursors=cursors, silent_s=silent,
                          freed_generations=dict(self._freed_generation))  # fmt: skip

    def _merge_reply(self, reply: StateReply, outcome: str, asked_at: float) -> bool:
        """Merge a peer's view, asked for at ``asked_at``, into this one; False (rejected) when the peer
        refused to send it."""
        if reply.error is not None:
            self._reject("state_refused", f"peer {reply.replica_id}: {reply.error}")
            return False
        now = self._clock()
        me = self.replica_id
        gone = self._gone
        dropped_at = gone.get(reply.replica_id)
        if dropped_at is not None and dropped_at < asked_at:
            del gone[reply.replica_id]  # dropped before it was asked, and it answered: alive
        # Else dropped while the ask was on its way (it left: a request it took before unsubscribing is
        # answered after its leaving beat): its view is older than that, its bookings stay dropped.
        # Learn every replica the responder knows, with its silence, so dead ones expire here too.
        for peer_id, silent_s in reply.silent_s.items():
            if peer_id != me and peer_id not in self._peers and peer_id not in gone:
                self._peers[peer_id] = _Peer(last_seen=now - silent_s)
        if reply.replica_id != me and reply.replica_id not in gone:
            responder = self._peers.setdefault(reply.replica_id, _Peer(last_seen=now))
            responder.last_seen = now
        # The responder's cursors pass no batch it missed: its view covers each peer's batches up to them.
        for peer_id, cursor in reply.cursors.items():
            peer = self._peers.get(peer_id)
            if peer is not None and cursor > peer.cursor:
                peer.cursor = cursor
                peer.seen = max(peer.seen, cursor)
        freed_generations = reply.freed_generations
        for request_id in reply.freed:
            generation = freed_generations.get(request_id, 0)
            if request_id not in self._freed or generation > self._freed_generation.get(request_id, 0):
                self._free(request_id, now, generation)
        for entry in reply.bookings:
            request_id = entry.request_id
            if entry.origin in gone:
                continue  # the responder has not dropped it yet; this replica has
            if entry.origin not in self._peers and entry.origin != me:
                self._peers[entry.origin] = _Peer(last_seen=now)
            local = self.router.booking(request_id)
            if local is None or entry.generation > self._generation.get(request_id, 0):
                booked = self._book(request_id, entry.origin, entry.booking(), entry.generation, now)
                self.outcomes["applied"] += booked
            elif entry.prefill_tokens == 0 and local.prefill_tokens > 0:
                self.router.mark_prefill(request_id, replicated=True)
        self.outcomes[outcome] += 1
        log.info("replica sync: %s from %s (%d bookings)", outcome, reply.replica_id, len(reply.bookings))
        return True

    # ------------------------------------------------------------------ liveness
    def _expire_peers(self) -> None:
        now = self._clock()
        for peer_id, peer in list(self._peers.items()):
            if now - peer.last_seen > self.lease_s:
                self._drop_peer(peer_id, f"silent for {now - peer.last_seen:.1f} s")

    def _drop_peer(self, peer_id: str, why: str) -> None:
        self._peers.pop(peer_id, None)
        now = self._gone[peer_id] = self._clock()
        dropped = [request_id for request_id, origin in self._origin.items() if origin == peer_id]
        for request_id in [r for r, waiting in self._waiting.items() if waiting.origin == peer_id]:
            del self._waiting[request_id]
        # No tombstones: if the peer was only cut off, its view brings back what it still has booked.
        for request_id in dropped:
            self._free(request_id, now, None, tombstone=False)
        self.outcomes["peer_expired" if why != "left" else "peer_left"] += 1
        log.warning("replica sync: peer %s %s: dropped its %d bookings", peer_id, why, len(dropped))

    def _prune(self) -> None:
        cutoff = self._clock() - self.tombstone_s
        freed = self._freed
        while freed:
            request_id, at = next(iter(freed.items()))
            if at >= cutoff:
                break
            del freed[request_id]
            self._freed_generation.pop(request_id, None)
        for request_id, at in list(self._early_prefill.items()):
            if at < cutoff:
                del self._early_prefill[request_id]
        for peer_id, at in list(self._gone.items()):
            if at < cutoff:
                del self._gone[peer_id]
        # Requests dropped with a removed worker never pass through a free.
        for request_id in [r for r in self._origin if self.router.booking(r) is None]:
            del self._origin[request_id]
            self._generation.pop(request_id, None)

    # ------------------------------------------------------------------ reads
    @property
    def peers(self) -> list[str]:
        return sorted(self._peers)

    def _reject(self, reason: str, message: str) -> None:
        self.outcomes[f"rejected_{reason}"] += 1
        self._bad_input.warning(reason, message)


def _wire_hashes(hashes: Sequence[int] | None) -> tuple[int, ...] | None:
    """A booking's hashes as sent: the router's own tuple as it is (no copy), anything else as one."""
    return hashes if hashes is None or isinstance(hashes, tuple) else tuple(hashes)


def _now_ms() -> int:
    return int(time.time() * 1000)

"""The router's side of the NATS event plane: events, load, the worker registry and liveness.

- KV events go through an `EventSequencer` into the router's index (exactly once, in order, with gap
  repair by resync; see `indexer.sequencer`). Events of workers that are not registered are counted
  and dropped.
- ``ActiveLoad`` on ``kv.{ns}.load.*`` feeds each rank's reported ``kv_used_blocks`` (busy thresholds)
  and the engine's waiting / running requests (the load view: ``/v1/workers``, metrics).
- The registry bucket ``kv_router_workers_{ns}`` is watched: a put registers or updates a worker, a
  delete removes it. HTTP registration writes into the same bucket (`register` / `deregister`).
- Registry writes (HTTP registrations and removals, a lease's expiry, a registration from a heartbeat)
  apply here at once and are owed to the bucket, in order (a later write of a worker replaces one
  still owed): written at once while NATS is there, else by the registry keeper once it is back,
  retried every second while NATS or JetStream fails them. NATS back, the keeper first checks the
  bucket: one gone (a server restarted with an empty store) is recreated, and one that is not the
  bucket the watch read (recreated meanwhile: its revisions start again) is read afresh from its
  start, and the registrations this router made over HTTP are put back.
- Heartbeats on ``kv.{ns}.heartbeat.*``: a heartbeat-leased worker silent for ``lease_s`` is deleted
  from the bucket, routing and the index; its next heartbeat (which carries its registration) brings
  it back, and its first event then triggers a full resync.
- A worker that registers is asked for a full dump of each rank (its first events may have raced ahead
  of its registration and been dropped). During a durable restart (``hold_join_resyncs``) those asks
  wait until the stream is replayed (`release_join_resyncs`): a rank the snapshot or the replay gave a
  trusted stream under the same publisher epoch is not asked at all (the stream holds all it sent);
  a worker registered under a new epoch, or a rank neither knew, is asked as ever.
- A registration or heartbeat whose publisher epoch differs from the known one is a restarted
  worker: its index state is dropped and its event ids start afresh (`EventSequencer.observe_epoch`).
- Leases do not run while NATS is disconnected (no heartbeat can arrive): each restarts when it is
  back, so an outage keeps the workers and the index.
- After a reconnect every stream is resynced in full, since events may have been lost meanwhile; the
  index is kept and live events keep applying while the dumps come (stale but useful beats empty).
- An events message NATS dropped because this router fell behind (a slow consumer, `on_slow_consumer`)
  untrusts its worker's streams and asks for their full dumps at once: a worker that goes quiet after
  the loss would otherwise stay trusted but stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from functools import partial

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from indexer.errors import UNDECODABLE
from indexer.slots import WorkerRank
from router.errors import BlockSizeMismatch, UnknownWorker
from router.event_plane.jetstream import JetStreamUnavailable
from router.event_plane.messages import ActiveLoad, Heartbeat, Refusal
from router.event_plane.publisher import open_registry
from router.event_plane.ratelimited_log import RateLimitedLog
from router.event_plane.subjects import Subjects
from router.event_plane.subscriber import EVENTS_PENDING_LIMIT, KvEventSubscriber
from router.kv_router import KvRouter, RemovalReason
from router.supervision import Supervisor, raise_if_cancelling
from router.types import WorkerConfig

__all__ = ["RouterEventPlane"]

log = logging.getLogger(__name__)

# What a registry write meets while NATS or JetStream is out of reach or the bucket is gone: it stays owed.
REGISTRY_UNREACHABLE = (NatsError, JetStreamUnavailable)
# How long the registry keeper waits before it tries a failed write again.
REGISTRY_RETRY_S = 1.0


class RouterEventPlane:
    def __init__(
        self,
        router: KvRouter,
        nc: Client,
        *,
        namespace: str = "default",
        lease_s: float = 10.0,
        resync_timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        subscribe_events: bool = True,
        jetstream_replicas: int = 1,
        events_pending_limit: int = EVENTS_PENDING_LIMIT,
    ) -> None:
        self.router = router
        self.nc = nc
        self.subjects = Subjects(namespace)
        self._jetstream_replicas = jetstream_replicas  # the registry bucket's copies
        self.lease_s = lease_s
        self._clock = clock
        self.sequencer = router.sequencer
        self.subscriber = KvEventSubscriber(
            nc,
            self.sequencer,
            namespace=namespace,
            resync_timeout_s=resync_timeout_s,
            subscribe=subscribe_events,
            pending_limit=events_pending_limit,
        )
        # Outcome -> count for load, heartbeat and registry messages (events count in the sequencer).
        # Present from the start, at 0 (a counter first seen at 1 reads as no increase to Prometheus):
        # what the alerts read.
        self.outcomes: Counter[str] = Counter(
            dict.fromkeys(("registered", "reconnects", "expired", "events_dropped"), 0)
        )
        self._leased: dict[int, float] = {}  # heartbeat-leased worker -> last sign of life
        self._load_reported: set[WorkerRank] = set()  # ranks whose engine load came over NATS
        self._leases_paused = False  # NATS was seen disconnected: leases restart once it is back
        self._registry: KeyValue | None = None
        self._watch: asyncio.Task[None] | None = None
        # The creation of the bucket the keeper last checked (`_check_registry_bucket`): the one whose
        # entries the watch reads and this router's registrations were put in.
        self._checked_bucket: datetime | None = None
        # Registry writes owed, oldest first: worker -> its registration, or None for its deletion.
        self._owed: dict[int, WorkerConfig | None] = {}
        self._owned: set[int] = set()  # registered here over HTTP: put back into a bucket that lost them
        self._put_back: set[int] = set()  # owed writes that are such put-backs: made only where the key is absent
        self._registry_due = asyncio.Event()  # wakes the registry keeper
        self._check_bucket = False  # NATS came back, or a write failed: the bucket may be gone or recreated
        self._writing = asyncio.Lock()  # one writer at a time, so the writes land in order
        self._registry_trouble = RateLimitedLog(log)
        self._subscriptions: list[Subscription] = []
        self._background = Supervisor("event-plane")
        self._bad_input = RateLimitedLog(log)
        # Worker -> why its latest registration was refused (for diagnosis).
        self.refused_registrations: dict[int, str] = {}
        # While a durable restart replays: the ranks of workers registered meanwhile whose join resync
        # waits for the replay's end (`release_join_resyncs`); None otherwise.
        self._held_joins: set[WorkerRank] | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self, *, hold_join_resyncs: bool = False) -> None:
        """Subscribe, read the registry and start the background loops. ``hold_join_resyncs`` (a durable
        restart, its snapshot restored and its replay still to come): the full resyncs that registrations
        would ask for wait for `release_join_resyncs`."""
        self._held_joins = None
        if hold_join_resyncs:
            # A start tried again finds the workers its attempt before registered (their registry entries
            # now echo): their joins are held as theirs were.
            router = self.router
            self._held_joins = {
                (worker.worker_id, rank)
                for worker in router.workers()
                if worker.leased and router.expects_events(worker)
                for rank in worker.dp_ranks
            }
        self._registry = await open_registry(self.nc, self.subjects, self._jetstream_replicas)
        self._checked_bucket = (await self._registry.status()).stream_info.created
        await self.subscriber.start()
        self._subscriptions = [
            await self.nc.subscribe(self.subjects.all_loads, cb=self._on_load),
            await self.nc.subscribe(self.subjects.all_heartbeats, cb=self._on_heartbeat),
        ]
        initial_done = asyncio.Event()
        self._watch = self._background.keep_running("registry-watch", partial(self._watch_registry, initial_done))
        self._background.keep_running("lease-expiry", self._expire_silent_workers)
        self._background.keep_running("registry-keeper", self._keep_registry)
        await asyncio.wait_for(initial_done.wait(), timeout=10)

    def release_join_resyncs(self) -> None:
        """The durable restart's replay is done: ask each rank held since `start` for its full dump unless
        the snapshot or the replay gave it a trusted stream (under the worker's registered epoch: a new
        one dropped the old streams), which holds all the worker sent. Joins from now on ask at once."""
        held, self._held_joins = self._held_joins, None
        for worker_id, dp_rank in sorted(held or ()):
            worker = self.router.worker(worker_id)
            if worker is None or dp_rank not in worker.dp_ranks:
                continue  # gone meanwhile: a registration that brings it back asks
            if self.sequencer.heard_from(worker_id, dp_rank) and (worker_id, dp_rank) not in self.sequencer.untrusted:
                self.outcomes["join_resync_skipped"] += 1
                continue
            self._join_resync(worker_id, dp_rank)

    def _join_resync(self, worker_id: int, dp_rank: int) -> None:
        request = self.sequencer.request_full_resync(worker_id, dp_rank)
        if request is not None:
            self.subscriber.launch_resync(request, soon_again=True)

    async def stop(self) -> None:
        await self._background.stop()
        for subscription in self._subscriptions:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()
        await self.subscriber.stop()

    def on_disconnected(self) -> None:
        """NATS lost: the engine load reports it brought stop coming, and the last ones are forgotten
        (`KvRouter.forget_engine_load`); one still queued in the client is not taken (`_on_load`)."""
        reported, self._load_reported = self._load_reported, set()
        self.router.forget_engine_load(reported)

    async def on_reconnected(self) -> None:
        self.outcomes["reconnects"] += 1
        self.subscriber.resync_all()
        self._check_bucket = True  # a server restarted with an empty store has lost it
        self._registry_due.set()

    def on_slow_consumer(self, subject: str) -> bool:
        """NATS dropped a message on ``subject`` before this router read it (the subscription's pending
        buffer was full: a slow consumer). On a worker's events subject it is counted (``events_dropped``)
        and logged, and the worker's ranks are untrusted and asked for a full dump: otherwise, should the
        worker go quiet, no gap would ever show the loss. False for any other subject (not handled here)."""
        worker_id = self.subjects.events_sender(subject)
        if worker_id is None:
            return False
        self.outcomes["events_dropped"] += 1
        worker = self.router.worker(worker_id)
        outcome = (
            f"worker {worker_id} is not registered: nothing to resync"
            if worker is None
            else f"worker {worker_id}'s streams are untrusted until the full resync asked for now"
        )
        self._bad_input.warning(
            "KV events dropped", f"on {subject}: this router fell behind (slow consumer); {outcome}"
        )
        if worker is not None:
            self.subscriber.resync_lost(worker_id, worker.dp_ranks)
        return True

    # ------------------------------------------------------------------ registry
    async def register(self, config: WorkerConfig, *, leased: bool = False) -> None:
        """Register a worker here and write it into the shared registry; every router watching it
        registers the worker. Raises `BlockSizeMismatch`, changing nothing, for a worker whose block
        size differs from the router's; never a NATS error (`_write_registry`)."""
        self.router.check_block_size(config)
        block_size = config.block_size or self.router.config.block_size
        registration = msgspec.structs.replace(config, block_size=block_size, leased=leased)
        registration = registration.keeping(self.router.worker(config.worker_id))  # the registry holds it whole
        await self._apply_registration(registration)  # at once here; the watch's echo is then a no-op
        self._owned.add(config.worker_id)
        await self._write_registry(config.worker_id, registration)

    async def deregister(self, worker_id: int, reason: RemovalReason = "api") -> None:
        """Remove a worker here and from the shared registry; never a NATS error (`_write_registry`)."""
        self._remove(worker_id, reason)
        await self._write_registry(worker_id, None)

    @property
    def registry_writes_owed(self) -> int:
        """Workers whose registry write (a registration or a removal) is applied here and still owed."""
        return len(self._owed)

    def _owe(self, worker_id: int, registration: WorkerConfig | None, *, if_absent: bool = False) -> None:
        """Owe the registry a write of ``registration`` (None: the worker's deletion), after those owed
        before; it replaces one of the same worker still owed. ``if_absent``: a put-back into a new
        bucket, made only where nobody has registered the worker since. The registry keeper is woken."""
        self._owed.pop(worker_id, None)
        self._owed[worker_id] = registration
        if if_absent:
            self._put_back.add(worker_id)
        else:
            self._put_back.discard(worker_id)
        self._registry_due.set()

    async def _write_registry(self, worker_id: int, registration: WorkerConfig | None) -> None:
        """Owe the write, and make it now while NATS is there and no other write is under way: the caller
        then answers once every router can learn it. NATS out of reach (its client would send the write at
        a reconnection nobody awaits), the bucket to be checked first, or the write failed: the registry
        keeper writes it; another write under way (the keeper's, which may wait on JetStream for seconds,
        or another caller's) pays it with its own, as it pays until nothing is owed."""
        self._owe(worker_id, registration)
        if not self.nc.is_connected or self._check_bucket or self._writing.locked():
            return  # the keeper (or the write under way, which pays until nothing is owed) writes it
        try:
            await self._pay_owed(check_bucket=False)
        except REGISTRY_UNREACHABLE:
            self._check_bucket = True
            self._registry_due.set()

    async def _keep_registry(self) -> None:
        """Write what the registry is owed whenever there is some and NATS is there, the bucket checked
        first when NATS came back or a write failed (`_check_registry_bucket`); a failure is logged
        (rate-limited) and tried again every `REGISTRY_RETRY_S`."""
        if self._owed or self._check_bucket:
            self._registry_due.set()  # owed before this loop started again (after a crash)
        while True:
            await self._registry_due.wait()
            self._registry_due.clear()
            if not self.nc.is_connected:
                continue  # woken again when it is back (`on_reconnected`)
            try:
                await self._pay_owed(check_bucket=True)
            except REGISTRY_UNREACHABLE as exc:
                self._check_bucket = True
                self._registry_trouble.warning(
                    "registry unreachable",
                    f"{type(exc).__name__}: {exc}; {len(self._owed)} worker registry writes owed, applied "
                    f"here already, tried again in {REGISTRY_RETRY_S:g} s",
                )
                await asyncio.sleep(REGISTRY_RETRY_S)
                self._registry_due.set()

    async def _pay_owed(self, *, check_bucket: bool) -> None:
        """Write what is owed, oldest first, each forgotten once written unless owed again meanwhile.
        With the bucket to be checked: that first if ``check_bucket`` (the keeper), else nothing (the
        keeper is on it). Raises what NATS raises, the rest still owed."""
        async with self._writing:
            if self._check_bucket:
                if not check_bucket:
                    return
                await self._check_registry_bucket()
                self._check_bucket = False
            registry = self._registry
            assert registry is not None
            while self._owed:
                worker_id, registration = next(iter(self._owed.items()))
                if registration is None:
                    await registry.delete(str(worker_id))
                elif worker_id in self._put_back:
                    # Registered anew elsewhere meanwhile: that one is newer, and the watch brings it here.
                    with contextlib.suppress(KeyWrongLastSequenceError):
                        await registry.create(str(worker_id), msgspec.json.encode(registration))
                else:
                    await registry.put(str(worker_id), msgspec.json.encode(registration))
                if worker_id in self._owed and self._owed[worker_id] is registration:
                    del self._owed[worker_id]
                    self._put_back.discard(worker_id)

    async def _check_registry_bucket(self) -> None:
        """The bucket as NATS has it now, opened as at start (one gone, as with a server restarted on an
        empty store, is created again). Unless it is the bucket the watch reads, it is read afresh from
        its start (nats-py's watch would go on at the revision after the last it saw, and miss every
        entry of the new bucket below it), and the registrations made here over HTTP are owed to it."""
        registry = await open_registry(self.nc, self.subjects, self._jetstream_replicas)
        created = (await registry.status()).stream_info.created
        if created == self._checked_bucket:
            return
        log.warning(
            "the worker registry bucket %s is not the one this router read (NATS lost its JetStream state, or "
            "the bucket was made again): reading it afresh, and putting back the %d workers registered here",
            self.subjects.registry_bucket,
            len(self._owned),
        )
        self._registry = registry
        if self._watch is not None:
            await self._background.cancel(self._watch)
        self._watch = self._background.keep_running("registry-watch", partial(self._watch_registry, asyncio.Event()))
        for worker_id in sorted(self._owned - self._owed.keys()):
            held = self.router.worker(worker_id)
            if held is None or held.leased:  # its publisher's now, which registers it itself
                self._owned.discard(worker_id)
            else:
                self._owe(worker_id, held, if_absent=True)
        self._checked_bucket = created  # last: a check cut short is made again

    async def _watch_registry(self, initial_done: asyncio.Event) -> None:
        assert self._registry is not None
        # The initial contents end at the entry the server sends with nothing pending after it, or at the
        # bucket's last revision when the watch starts (a later entry shows it passed; that revision may
        # be gone, purged, and never come). Not at nats-py's own end marker: it can come before an entry
        # the server had already sent (it then asks the consumer, which counts that one delivered).
        info = (await self._registry.status()).stream_info
        if info.created != self._checked_bucket:
            # Not the bucket the keeper checked (this watch started again, by its supervisor, after NATS
            # lost the bucket and another process made it): the keeper puts this router's back.
            self._check_bucket = True
            self._registry_due.set()
        state = info.state
        initial_end = state.last_seq if state.messages else 0
        # Made under a shield: a cancellation landing while nats-py subscribes (a start that fails just
        # after this one signalled its initial contents) would leave the subscription with no watcher
        # to stop it, receiving the registry's updates on the connection from then on.
        making = asyncio.ensure_future(self._registry.watchall())
        try:
            watcher = await asyncio.shield(making)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):  # the connection may be gone
                await (await making).stop()  # type: ignore[no-untyped-call]
            raise
        if initial_end == 0:
            initial_done.set()
        try:
            # Iterated, not `updates(timeout)`: on Python 3.11 its wait_for swallows a cancellation that
            # lands as an entry arrives, and the task would outlive `stop`.
            async for entry in watcher:
                if entry is None:  # nats-py's marker, see above
                    continue
                await self._apply_registry_entry(entry)
                if entry.delta == 0 or entry.revision >= initial_end:
                    initial_done.set()
        finally:
            # Its subscription would outlive the task (a stopped plane, a retried start) and keep
            # receiving the registry's updates on the connection.
            with contextlib.suppress(Exception):  # the connection may be gone
                await watcher.stop()  # type: ignore[no-untyped-call]

    async def _apply_registry_entry(self, entry: KeyValue.Entry) -> None:
        try:
            worker_id = int(entry.key)
        except ValueError:
            self._reject("bad_registry_key", f"registry key {entry.key!r} is not a worker id")
            return
        if entry.operation in ("DEL", "PURGE"):
            self._remove(worker_id)
            return
        try:
            registration = msgspec.json.decode(entry.value or b"", type=WorkerConfig)
        except UNDECODABLE as exc:
            self._reject("bad_registration", f"worker {worker_id}: {exc}")
            return
        await self._apply_registration(registration)

    async def _apply_registration(self, config: WorkerConfig) -> bool:
        """Register ``config`` with the router; False when it is refused (its block size differs)."""
        config = config.keeping(self.router.worker(config.worker_id))
        try:
            self.router.check_block_size(config)
        except BlockSizeMismatch as exc:
            reason = f"worker {exc.worker_id} uses block size {exc.worker_block_size}, router {exc.router_block_size}"
            await self._refuse(config, reason)
            return False
        self.refused_registrations.pop(config.worker_id, None)
        previous = self.router.worker(config.worker_id)
        if previous == config:
            return True  # the watch echoing a registration this router applied already
        is_new = previous is None
        worker_id = config.worker_id
        # Ranks a restored snapshot gave a stream: one gone after the registration is a new epoch's.
        restored = {rank for rank in config.dp_ranks if self.sequencer.heard_from(worker_id, rank)}
        self.router.register_worker(config)
        if config.leased:
            self._leased.setdefault(worker_id, self._clock())
            if is_new and self.router.expects_events(config):
                # Its first events may have raced ahead of this registration and been dropped. (A worker
                # without events has none to resync.) During a durable restart, a rank whose stream the
                # snapshot restored under this epoch, or the replay brings, needs none: held till then.
                for dp_rank in config.dp_ranks:
                    restarted = dp_rank in restored and not self.sequencer.heard_from(worker_id, dp_rank)
                    if self._held_joins is not None and not restarted:
                        self._held_joins.add((worker_id, dp_rank))
                    else:
                        self._join_resync(worker_id, dp_rank)
        else:
            self._leased.pop(config.worker_id, None)
        self.outcomes["registered" if is_new else "updated"] += 1
        return True

    async def _refuse(self, config: WorkerConfig, reason: str) -> None:
        """Count a refused registration (each heartbeat repeats it), log it once per worker and reason,
        and tell the worker, which says so itself (the mock worker exits)."""
        self.outcomes["rejected_block_size_mismatch"] += 1
        if self.refused_registrations.get(config.worker_id) != reason:
            log.warning("block_size_mismatch: %s: registration refused (logged once per worker)", reason)
        self.refused_registrations[config.worker_id] = reason
        refusal = Refusal(worker_id=config.worker_id, reason=reason, router_block_size=self.router.config.block_size)
        with contextlib.suppress(Exception):  # the worker hears the next one if this is lost
            await self.nc.publish(self.subjects.refused(config.worker_id), msgspec.json.encode(refusal))

    def _remove(self, worker_id: int, reason: RemovalReason = "deregistered") -> None:
        self._leased.pop(worker_id, None)
        self._owned.discard(worker_id)
        self.subscriber.forget_worker(worker_id)
        if self.router.has_worker(worker_id):
            self.router.remove_worker(worker_id, reason)
            self.outcomes["removed"] += 1
        else:
            # Never registered here, but a restored snapshot may hold its blocks: it has left, so they go
            # too (kept, every later snapshot would carry them, and a new process of it inherit them).
            self.router.forget_cache_of(worker_id)

    # ------------------------------------------------------------------ liveness and load
    async def _on_heartbeat(self, message: Msg) -> None:
        try:
            beat = msgspec.json.decode(message.data, type=Heartbeat)
        except UNDECODABLE as exc:
            self._reject("bad_heartbeat", f"on {message.subject}: {exc}")
            return
        registration = beat.registration
        if message.subject != self.subjects.heartbeat(beat.worker_id) or (
            registration is not None and registration.worker_id != beat.worker_id
        ):
            # A beat speaks for the worker its subject names, or it could restart another one's streams.
            named = None if registration is None else registration.worker_id
            self._reject("bad_heartbeat", f"on {message.subject}: worker {beat.worker_id}, registration of {named}")
            return
        self.outcomes["heartbeats"] += 1
        known = self.router.worker(beat.worker_id)
        if known is not None:
            if beat.worker_id in self._leased:
                self._leased[beat.worker_id] = self._clock()
            if registration is not None and registration.epoch is not None and registration.epoch != known.epoch:
                if known.epoch is not None:
                    log.info("worker %d restarted (publisher epoch %s): starting its streams afresh",
                             beat.worker_id, registration.epoch)  # fmt: skip
                await self._apply_registration(registration)
        elif registration is not None:
            if not await self._apply_registration(registration):
                return  # refused again: said once already
            log.info("worker %d registered from its heartbeat", beat.worker_id)
            self._owe(beat.worker_id, registration)  # written by the keeper: this callback never waits on NATS

    async def _expire_silent_workers(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.lease_s / 4))
            if not self.nc.is_connected:
                # Heartbeats missed now are the outage's, not the workers': each lease restarts when
                # NATS is back, so only a worker that stays silent after that expires.
                self._leases_paused = True
                continue
            now = self._clock()
            if self._leases_paused:
                self._leases_paused = False
                self._leased = dict.fromkeys(self._leased, now)
            for worker_id, seen in list(self._leased.items()):
                if now - seen > self.lease_s:
                    log.warning("worker %d silent for %.1f s: removing it", worker_id, now - seen)
                    self.outcomes["expired"] += 1
                    await self.deregister(worker_id, "lease_expired")
                    raise_if_cancelling()  # a stopped router must not go on deleting from the shared registry

    async def _on_load(self, message: Msg) -> None:
        try:
            load = msgspec.json.decode(message.data, type=ActiveLoad)
        except UNDECODABLE as exc:
            self._reject("bad_load", f"on {message.subject}: {exc}")
            return
        if load.kv_used_blocks is None and load.num_requests_waiting is None and load.num_requests_running is None:
            return
        if not self.nc.is_connected:
            return  # read before the disconnect, handled after it (`on_disconnected`): stale already
        try:
            self.router.update_engine_load(
                load.worker_id,
                load.dp_rank,
                load.kv_used_blocks,
                load.num_requests_waiting,
                load.num_requests_running,
            )
        except (UnknownWorker, KeyError, ValueError) as exc:
            self._reject("load_for_unknown_worker", str(exc))
            return
        self._load_reported.add((load.worker_id, load.dp_rank))
        self.outcomes["loads"] += 1

    def _reject(self, reason: str, message: str) -> None:
        self.outcomes[f"rejected_{reason}"] += 1
        self._bad_input.warning(reason, message)

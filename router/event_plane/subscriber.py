"""KV events from NATS into the index, through the sequencer, with resyncs run in the background.

Subscribes to ``kv.{ns}.events.>`` (one ``RouterEvent`` or a list per message, JSON or msgpack; the
publisher epoch, if any, in the ``Kv-Publisher-Epoch`` header). nats-py delivers one subscription's
messages one at a time, so each stream's order is kept. When the sequencer asks for a resync, a task
requests it on ``kv.{ns}.resync.{worker_id}``, at most ``max_concurrent_resyncs`` at a time: "no
responders" fails it at once, timeouts are retried a few times with backoff. Streams left unverified
are offered a full resync again by a slow loop (``EventSequencer.due_retries``), never from the event
path. Undecodable payloads are counted and logged (rate-limited); nothing stops the subscription.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError

from indexer.errors import UNDECODABLE, EventDecodeError
from indexer.events import ResyncRequest, ResyncResponse, RouterEvent, decode_router_events
from indexer.sequencer import EventSequencer
from indexer.slots import WorkerRank
from router.event_plane.parts import PartsTooLarge, request_in_parts
from router.event_plane.ratelimited_log import RateLimitedLog
from router.event_plane.resync_parts import ResyncReader
from router.event_plane.subjects import EPOCH_HEADER, Subjects
from router.supervision import Supervisor, raise_if_cancelling

__all__ = ["KvEventSubscriber", "ingest_published"]

# Messages an events subscription holds for this router to read; beyond it, or beyond nats-py's 128 MiB
# of them (its default bytes limit, which a flood of large batches reaches first), NATS drops them (a
# slow consumer: the plane then untrusts the worker's streams and asks for their full dumps).
EVENTS_PENDING_LIMIT = 1_000_000
# How often the slow loop looks for unverified streams whose retry time has come.
RETRY_CHECK_S = 1.0
# The waits before asking again a worker nobody serves the resyncs of (its bridge or publisher may be
# subscribing again after NATS came back), before the sequencer's retry (`retry_interval_s` later).
NO_RESPONDERS_RETRY_S = (0.5, 1.0, 2.0)

log = logging.getLogger(__name__)

# Applying a backlog of events must not starve routing decisions on the same loop: after this much
# continuous work the subscriber yields once (nats-py hands queued messages over without yielding).
YIELD_AFTER_S = 0.0005


def ingest_published(
    sequencer: EventSequencer, subjects: Subjects, message: Msg, bad_input: RateLimitedLog
) -> list[RouterEvent]:
    """The one door of a message published on a worker's events subject (live, or replayed from the
    stream): decoded (an undecodable one counted and logged), then the events of the worker the subject
    names sequenced, with the message's publisher epoch. Another worker's are refused, counted
    (``rejected_foreign``) and logged: a publisher writes to its own worker's subject only, and an event
    for another worker, under this epoch, would restart that worker's streams (its index wiped, its own
    events refused from then on) or rewrite its blocks. Returns the events sequenced."""
    try:
        events = decode_router_events(message.data, msgpack=None)
    except EventDecodeError as exc:
        sequencer.count_undecodable()
        bad_input.warning("undecodable KV event", f"on {message.subject}: {exc}")
        return []
    sender = subjects.events_sender(message.subject)
    own = [event for event in events if event.worker_id == sender]
    if len(own) < len(events):
        foreign = [event for event in events if event.worker_id != sender]
        sequencer.refuse(foreign, "foreign", f"published on {message.subject}")
        named = sorted({event.worker_id for event in foreign})
        bad_input.warning(
            "KV events of another worker", f"on {message.subject}: {len(foreign)} of worker(s) {named[:4]}"
        )
    headers = message.headers
    sequencer.ingest(own, epoch=headers.get(EPOCH_HEADER) if headers else None)
    return own


class KvEventSubscriber:
    def __init__(
        self,
        nc: Client,
        sequencer: EventSequencer,
        *,
        namespace: str = "default",
        resync_timeout_s: float = 2.0,
        resync_attempts: int = 3,
        resync_backoff_s: float = 0.2,
        max_concurrent_resyncs: int = 16,
        subscribe: bool = True,
        pending_limit: int = EVENTS_PENDING_LIMIT,
    ) -> None:
        self.nc = nc
        self.sequencer = sequencer
        self.subjects = Subjects(namespace)
        self._timeout = resync_timeout_s
        self._attempts = resync_attempts
        self._backoff = resync_backoff_s
        self._resync_slots = asyncio.Semaphore(max_concurrent_resyncs)
        self._resyncs = Supervisor("event-subscriber")
        self._retries = Supervisor("event-subscriber")
        self._subscription: Subscription | None = None
        self._bad_input = RateLimitedLog(log)
        self._busy_since = 0.0
        # False: events come from elsewhere (the JetStream stream); resyncs still go out from here.
        self._subscribe = subscribe
        self._pending_limit = pending_limit
        # Ranks that lost events (`resync_lost`) no full dump was asked for since: an answer applied to
        # anything else (sent before the loss, or a range) leaves them untrusted and asks for one.
        self._lost: set[WorkerRank] = set()

    async def start(self) -> None:
        # Resyncs that events from any door call for now go out over NATS.
        self.sequencer.resync_transport = self.launch_resync
        # With events from elsewhere too: an unverified stream is asked again every retry interval.
        self._retries.keep_running("resync-retries", self._retry_unverified)
        if self._subscribe:
            self._subscription = await self.nc.subscribe(
                self.subjects.all_events, cb=self._on_message, pending_msgs_limit=self._pending_limit
            )

    async def stop(self) -> None:
        self.sequencer.resync_transport = None
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            await subscription.unsubscribe()
        await self._retries.stop()
        await self._resyncs.stop()

    async def _on_message(self, message: Msg) -> None:
        now = time.perf_counter()
        if now - self._busy_since > YIELD_AFTER_S:
            await asyncio.sleep(0)
            self._busy_since = time.perf_counter()
        ingest_published(self.sequencer, self.subjects, message, self._bad_input)

    async def _retry_unverified(self) -> None:
        while True:
            await asyncio.sleep(RETRY_CHECK_S)
            if self.nc.is_connected:
                for request in self.sequencer.due_retries():
                    self.launch_resync(request)

    def launch_resync(self, request: ResyncRequest, *, soon_again: bool = False) -> None:
        """Ask for ``request``'s dump. ``soon_again``: "no responders" is asked again after
        `NO_RESPONDERS_RETRY_S` (a registration's or a reconnection's ask: the worker's bridge or
        publisher may be subscribing meanwhile), not only by the slow loop's retry."""
        waits = NO_RESPONDERS_RETRY_S if soon_again else ()
        self._resyncs.spawn(f"resync-{request.worker_id}-{request.dp_rank}", self._resync(request, waits))

    def resync_all(self) -> None:
        """After a reconnect events may have been lost: ask every worker for its full state."""
        for request in self.sequencer.resync_all():
            self.launch_resync(request, soon_again=True)

    def resync_lost(self, worker_id: int, dp_ranks: Iterable[int]) -> None:
        """Events of ``worker_id`` were lost on their way here, of ranks unknown (NATS dropped a message:
        a slow consumer). No gap shows it if the worker then goes quiet, so each rank is untrusted and
        asked for a full dump: now, or, while a resync of it is in flight, after it. A full dump asked
        from now on holds the lost events (the worker published them before this router missed them);
        an answer to anything else is followed by one."""
        for dp_rank in dp_ranks:
            key = (worker_id, dp_rank)
            if key in self._lost:
                continue  # an earlier loss waits for a full dump already, which holds this one's events too
            self._lost.add(key)
            self._ask_dump_for_loss(worker_id, dp_rank)

    def _ask_dump_for_loss(self, worker_id: int, dp_rank: int) -> None:
        self.sequencer.mark_untrusted(worker_id, dp_rank)
        request = self.sequencer.request_full_resync(worker_id, dp_rank)
        if request is not None:
            self.launch_resync(request, soon_again=True)

    def forget_worker(self, worker_id: int) -> None:
        """A removed worker's losses need no dump (a worker registered again is asked for one anyway)."""
        self._lost = {key for key in self._lost if key[0] != worker_id}

    @property
    def resyncs_in_flight(self) -> int:
        return self._resyncs.running

    async def _resync(self, request: ResyncRequest, waits: tuple[float, ...]) -> None:
        for wait in (*waits, None):
            if not await self._resync_once(request):
                return
            if wait is None:
                break
            raise_if_cancelling()
            await asyncio.sleep(wait)
            if not self.sequencer.resync_in_flight(request):
                return  # replaced meanwhile (a reconnection asks anew): not asked twice
        log.debug("no responder for resyncs of worker %s dp_rank %s", request.worker_id, request.dp_rank)
        self.sequencer.resync_failed(request, no_responders=True)

    async def _resync_once(self, request: ResyncRequest) -> bool:
        """Ask for ``request``'s dump and hand the outcome to the sequencer; True: nobody serves it."""
        async with self._resync_slots:
            for attempt in range(self._attempts):
                try:
                    response = await self._ask(request)
                    raise_if_cancelling()  # a stopped plane applies no more dumps
                except NoRespondersError:
                    return True  # an answer, not a timeout
                except UNDECODABLE as exc:
                    self.sequencer.count_undecodable(resync_reply=True)
                    self._bad_input.warning("undecodable resync reply", f"from worker {request.worker_id}: {exc}")
                    break
                except PartsTooLarge as exc:
                    self.sequencer.count_oversized_resync()
                    self._bad_input.warning("oversized resync reply", f"from worker {request.worker_id}: {exc}")
                    break
                except (TimeoutError, NatsError) as exc:
                    log.debug("resync of worker %s attempt %d failed: %r", request.worker_id, attempt + 1, exc)
                    await asyncio.sleep(self._backoff * 2**attempt)
                    continue
                if response.error is not None:
                    log.warning("worker %s refused a resync: %s", request.worker_id, response.error)
                applied = self.sequencer.resync_in_flight(request)  # not replaced or forgotten meanwhile
                follow_up = self.sequencer.resync_done(request, response)
                if follow_up is not None:
                    self.launch_resync(follow_up)
                elif applied and (request.worker_id, request.dp_rank) in self._lost:
                    self._ask_dump_for_loss(request.worker_id, request.dp_rank)
                return False
        self._bad_input.warning(
            "unanswered resync",
            f"worker {request.worker_id} dp_rank {request.dp_rank}: routing on its live events, unverified; "
            f"a full resync is tried again in {self.sequencer.retry_interval_s:.0f} s",
        )
        self.sequencer.resync_failed(request)
        return False

    async def _ask(self, request: ResyncRequest) -> ResyncResponse:
        """The worker's answer to ``request``: a large one comes in parts (`router.event_plane.resync_parts`),
        each within ``timeout`` of the one before. Raises `NoRespondersError`, NATS' `TimeoutError` and its
        other errors, an undecodable reply's, and `PartsTooLarge`."""
        if request.start_event_id is None and self.sequencer.resync_in_flight(request):
            self._lost.discard((request.worker_id, request.dp_rank))  # this dump holds every event lost before
        # Sent asking for parts; the sequencer is answered for its own request (it knows it by identity).
        payload = msgspec.json.encode(msgspec.structs.replace(request, in_parts=True))
        subject = self.subjects.resync(request.worker_id)
        return await request_in_parts(self.nc, subject, payload, self._timeout, ResyncReader())

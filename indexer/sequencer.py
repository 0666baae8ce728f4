"""Exactly-once, in-order application of each (worker, dp_rank)'s event stream, never blind.

Events are numbered per (worker, dp_rank) from 1 by the publisher. For each stream the sequencer
keeps ``synced_through``, the id up to which the index reflects the stream without a hole, and the
live events applied beyond it that still await reconciliation:

- an id at or below the newest one seen is a duplicate and dropped;
- the next id, on a stream with nothing to reconcile, is applied (the common path);
- the first event ever seen from a stream is applied at once and trusted when its id is 1 (nothing
  can precede it); any other first id is applied at once too, and a full dump is requested so a
  router that starts after its workers learns what they cached before;
- a larger id is a gap: the event is applied at once (routable now), the stream becomes untrusted
  and the missing range is requested;
- while a resync is in flight every new live event is applied at once and kept. When the answer
  comes the stream is reconciled: a dump replaces the rank's state, missing events are applied, and
  then the kept live events newer than the answer are applied again, in order. Re-applying them last
  is what keeps a replayed store from resurrecting a block that a later live event removed;
- an answer also says how far the publisher has numbered (a dump's last id; a replay's, when it stops
  short of the end asked for), and the newest id goes back there (or to a kept id above it), so that
  its next events apply instead of passing for duplicates. A kept event heard before the resync was
  asked for, yet past a hole above that id, was never numbered (a buggy or hostile publisher's id far
  ahead): it is refused (``id_ahead_of_publisher``) and a dump rebuilds the rank without what it did.
  (Kept ids straight after the answer's stay: a dump may lag the events already sent.) So no question
  is asked twice: a replay fills the range asked for (else a dump is asked for), a dump accounts for
  every id heard before it was asked for, and a hole still open after reconciling is a new one, asked
  at once;
- "no answer" (no responder, timeouts, no transport) gives up at once: what was applied stays, the
  stream is untrusted, and `due_retries` offers it a full resync again every ``retry_interval_s``
  until one succeeds;
- ``cleared`` is a barrier when it clears every tier the stream holds blocks in (the tiers of its
  stored events since its last barrier or dump, less those cleared in order since): it applies at
  once, cancels any resync in flight (its answer would be stale) and restarts the stream from its id,
  trusted. A clear of one tier while another holds blocks is an ordinary event: a hole before it may
  hold the other tier's events, so the gap and its resync stay. (Events lost in a hole are taken to
  be of the tiers the stream is known to use: an engine's clear, of the device tier, on a stream of
  device events is a barrier, as it must be for a stream whose engine lost events);
- a publisher epoch (a start nonce, from an event header or a registration) that differs from the
  one seen before means the publisher restarted: its streams and index state are dropped and its
  ids start afresh (`observe_epoch`). Events whose ids went back to 1 before the registration said
  so are kept aside (bounded) and replayed into the fresh streams.

Index rejections of events applied ahead of a hole are deferred: the hole may hold their parent.
They count when the stream gives up; after a reconciliation the re-application decides.

The sequencer does no I/O: ``receive`` and ``resync_done`` return the ``ResyncRequest`` to send, and
the transport (``router.event_plane.subscriber``) answers with ``resync_done`` or ``resync_failed``.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from indexer.errors import KvIndexError
from indexer.events import ResyncRequest, ResyncResponse, RouterEvent, StorageTier
from indexer.radix_tree import RadixTree
from indexer.slots import WorkerRank

__all__ = ["EventSequencer", "IngestReport", "StreamStatus"]

# Beyond this many unreconciled events a stream drops them and asks for a fresh full dump instead.
MAX_HELD_EVENTS = 100_000
# No engine stores or removes this many blocks in one event (a 1M-token prompt at block size 16 is
# 65,536 blocks); a bigger one is rejected before it can stall the loop that routes requests.
MAX_EVENT_BLOCKS = 1 << 17
# An unverified stream asks for a full dump again this often (outside the event path).
RETRY_INTERVAL_S = 15.0
# Events of a stream whose ids went back to 1, kept until a registration says the worker restarted.
MAX_REGRESSED_EVENTS = 1024

# Epochs a worker's publisher has left behind, kept to tell a late event of a replaced process.
RETIRED_EPOCHS_KEPT = 8
# Workers forgotten (removed) whose epochs are remembered: bounds the memory of workers that never return.
FORGOTTEN_WORKERS_KEPT = 4096
# Reasons of the most recent rejections kept for callers that report them (the HTTP reply).
RECENT_REJECTIONS = 8
# (worker, rank) pairs `unknown_dp_rank_events` counts at most, and workers `unknown_worker_events`.
MAX_UNKNOWN_RANKS = 1024
MAX_UNKNOWN_WORKERS = 1024


@dataclass
class _Stream:
    synced_through: int | None = None  # the index reflects every event up to here; None: base unknown
    last_id: int | None = None  # the newest id applied
    unreconciled: dict[int, RouterEvent] = field(default_factory=dict)  # applied beyond synced_through
    deferred: list[tuple[RouterEvent, str, str]] = field(default_factory=list)  # rejections ahead of a hole
    resync: ResyncRequest | None = None  # the request in flight, if any
    heard_when_asked: int | None = None  # the newest id heard when that request was made: its answer must count it
    trusted: bool = False
    # Whether what synced_through covers came from a verified start (id 1, a dump, a barrier), not
    # from giving up; only a dump can verify a stream again.
    verified_base: bool = False
    last_applied_at: float | None = None  # clock time of the newest event applied
    retry_at: float | None = None  # when an unverified stream asks for a dump again
    regressed: list[RouterEvent] = field(default_factory=list)  # ids back from 1: a restart not yet announced
    # Whether the worker ever sent this stream an event (live, replayed or in a dump): a stream is also
    # opened by a resync asked for at registration, which a worker whose engine sends nothing answers
    # with an empty dump or not at all.
    heard: bool = False
    # The storage tiers this stream's stored events reached since its last barrier or dump (less those
    # cleared in order since): what a clear must cover to be a barrier.
    tiers: set[StorageTier] = field(default_factory=set)


@dataclass(slots=True)
class IngestReport:
    """What became of each event of one `EventSequencer.ingest_reported` call, every event in exactly
    one count: ``applied`` to the index; a ``duplicate`` (an id already seen) dropped; ``rejected``
    (refused, or refused by the index and given up on); ``held``: applied ahead of a hole in its
    stream (a gap in the ids, or ids before the first one heard) and refused by the index for now,
    since the hole may hold what it needs (its parent block); it counts as a rejection when the stream
    gives up on the hole (`outcomes`' ``rejected_<reason>``), and is applied again if the hole is
    filled. ``reasons``: those of the last rejected and held events, oldest first."""

    applied: int = 0
    duplicate: int = 0
    rejected: int = 0
    held: int = 0
    reasons: deque[str] = field(default_factory=lambda: deque(maxlen=RECENT_REJECTIONS))


@dataclass(frozen=True, slots=True)
class StreamStatus:
    worker_id: int
    dp_rank: int
    last_event_id: int | None
    trusted: bool
    resyncing: bool
    unreconciled_events: int
    last_event_age_s: float | None


class EventSequencer:
    def __init__(
        self,
        index: RadixTree,
        *,
        worker_ranks: Callable[[int], range | None] | None = None,
        max_held_events: int = MAX_HELD_EVENTS,
        max_event_blocks: int = MAX_EVENT_BLOCKS,
        retry_interval_s: float = RETRY_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        # A registered worker's dp ranks (None: not registered); events of others are refused.
        self._worker_ranks = worker_ranks
        self._max_held = max_held_events
        self._max_blocks = max_event_blocks
        self.retry_interval_s = retry_interval_s
        self._clock = clock
        self._streams: dict[WorkerRank, _Stream] = {}
        self._epochs: dict[int, str] = {}  # worker -> the publisher epoch its streams belong to
        self._retired_epochs: dict[int, deque[str]] = {}  # worker -> epochs it has left behind
        # Forgotten workers' last epochs, kept so a late event of that process cannot pass for a
        # restart once the worker is back under another epoch (oldest dropped first).
        self._forgotten_epochs: dict[int, str] = {}
        # Streams not known complete; read on every decision when untrusted overlap is discounted.
        self.untrusted: set[WorkerRank] = set()
        # Outcome -> count: applied, duplicate, gap, reapplied, resync_*, rejected_<reason>, ...
        self.outcomes: Counter[str] = Counter()
        # (event type, status) -> count of events that reached the index: status ok or Dynamo's label.
        self.applied: Counter[tuple[str, str]] = Counter()
        self.recent_rejections: deque[str] = deque(maxlen=RECENT_REJECTIONS)
        self.rejected = 0  # events refused whole or in part, whatever the reason
        # Where resync requests go; None while no transport can reach workers (they fail at once).
        self.resync_transport: Callable[[ResyncRequest], None] | None = None
        # Blocks stored or removed by applied live events (dumps excluded): the ingest rate's numerator.
        self.blocks_applied = 0
        # Per stream and per worker, for diagnosis: gaps opened, events refused for an unknown worker.
        self.gaps_by_stream: Counter[WorkerRank] = Counter()
        # At most MAX_UNKNOWN_WORKERS keys: a sender stamping random worker ids must not grow it without bound.
        self.unknown_worker_events: Counter[int] = Counter()
        # Events of a registered worker under a rank outside its ranks, by (worker, rank): an engine run
        # with external data parallelism stamps its own rank, which the worker's registration must hold.
        # At most MAX_UNKNOWN_RANKS keys: a sender stamping random ranks must not grow it without bound.
        self.unknown_dp_rank_events: Counter[WorkerRank] = Counter()
        # Told (worker_id, dp_rank; None: every rank) whenever blocks leave a rank's index: a removal or
        # a clear applied, a dump replacing the rank, a restarted publisher's worker emptied.
        self.on_blocks_left: Callable[[int, int | None], None] | None = None

    # ------------------------------------------------------------------ live events
    def ingest(self, events: Iterable[RouterEvent], *, epoch: str | None = None) -> None:
        """The door every transport uses: sequence each event, sending the resyncs it calls for.
        ``epoch`` is the publisher epoch the transport carried beside the events, if any."""
        for event in events:
            worker_id = event.worker_id
            if epoch is not None and self._epochs.get(worker_id) != epoch and not self.observe_epoch(worker_id, epoch):
                self.outcomes["stale_epoch"] += 1  # a process that has since been replaced
                continue
            request = self.receive(event)
            if request is not None:
                self.send_resync(request)

    def ingest_reported(self, events: Iterable[RouterEvent]) -> IngestReport:
        """`ingest` (no epoch) for a caller that answers for each event (``POST /v1/events``): what
        became of it, once any resync it called for has been sent (a resync failing at once, without a
        transport, rejects an event held for it). Rejections of other events that resync gives up on
        are among ``reasons`` too."""
        report = IngestReport()
        outcomes = self.outcomes
        for event in events:
            rejected, duplicate, deferred = self.rejected, outcomes["duplicate"], outcomes["deferred_rejections"]
            request = self.receive(event)
            held = None
            if outcomes["deferred_rejections"] > deferred:
                stream = self._streams[(event.worker_id, event.event.dp_rank)]
                held = stream.deferred[-1]
            if request is not None:
                self.send_resync(request)
            if outcomes["duplicate"] > duplicate:
                report.duplicate += 1
            elif self.rejected > rejected:
                report.rejected += 1
                report.reasons.extend(list(self.recent_rejections)[-min(self.rejected - rejected, RECENT_REJECTIONS) :])
            elif held is not None:
                report.held += 1
                report.reasons.append(
                    f"worker {event.worker_id} event {event.event.event_id}: held: {held[2]}; applied ahead of a "
                    "hole in its stream's event ids, which may hold what it needs: rejected if it stays unfilled"
                )
            else:
                report.applied += 1
        return report

    def send_resync(self, request: ResyncRequest) -> None:
        if self.resync_transport is None:
            self.resync_failed(request)
        else:
            self.resync_transport(request)

    def receive(self, event: RouterEvent) -> ResyncRequest | None:
        """Take one live event; returns a resync to start, if this event calls for one."""
        key = (event.worker_id, event.event.dp_rank)
        if self._worker_ranks is not None:
            ranks = self._worker_ranks(event.worker_id)
            if ranks is None:
                unknown = self.unknown_worker_events
                if event.worker_id in unknown or len(unknown) < MAX_UNKNOWN_WORKERS:
                    unknown[event.worker_id] += 1
                self._reject(event, "unknown_worker", "worker not registered")
                return None
            if key[1] not in ranks:  # a stream of its own, and a slot in every node, for each such rank
                if key in self.unknown_dp_rank_events or len(self.unknown_dp_rank_events) < MAX_UNKNOWN_RANKS:
                    self.unknown_dp_rank_events[key] += 1
                self._reject(event, "unknown_dp_rank", f"dp rank {key[1]} is not one of its ranks {ranks}")
                return None
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = _Stream()
            self.untrusted.add(key)
        event_id = event.event.event_id
        last = stream.last_id
        cleared = event.event.is_cleared
        if cleared and (last is None or event_id > last) and stream.tiers <= {event.storage_tier}:
            self._barrier(key, stream, event)
            return None
        if last is not None and event_id <= last:
            self._duplicate(stream, event)
            return None
        if stream.resync is None and not stream.unreconciled:
            synced = stream.synced_through
            if (synced is not None and event_id == synced + 1) or (synced is None and event_id == 1):
                applied = self._apply(event, stream)
                stream.synced_through = stream.last_id = event_id
                if cleared:  # in order: nothing of that tier can be missing any more
                    stream.tiers.discard(event.storage_tier)
                if synced is None and applied:  # a stream's very first event: nothing can precede it
                    stream.verified_base = True
                    self._trust(key, stream)
                return None
        return self._apply_ahead(key, stream, event)

    def _duplicate(self, stream: _Stream, event: RouterEvent) -> None:
        self.outcomes["duplicate"] += 1
        # Ids back at 1 (and the run after them) look like a restarted publisher: keep them, in case
        # its registration says so (`observe_epoch`).
        regressed = stream.regressed
        event_id = event.event.event_id
        follows = regressed and regressed[-1].event.event_id + 1 == event_id
        if (event_id == 1 or follows) and len(regressed) < MAX_REGRESSED_EVENTS:
            regressed.append(event)

    def _apply_ahead(self, key: WorkerRank, stream: _Stream, event: RouterEvent) -> ResyncRequest | None:
        """Apply an event beyond what is known contiguous, keep it for reconciliation, and ask for
        whatever can make the stream whole again."""
        if len(stream.unreconciled) >= self._max_held:
            # Too much to re-apply: drop the record and let a fresh dump (taken after now) cover it.
            self.outcomes["unreconciled_overflow"] += len(stream.unreconciled)
            stream.unreconciled.clear()
            stream.deferred.clear()
            stream.synced_through = None
            stream.resync = None
        self._apply(event, stream, deferred=True)
        event_id = event.event.event_id
        stream.unreconciled[event_id] = event
        stream.last_id = event_id
        if stream.resync is not None:
            return None
        if stream.synced_through is None:
            self._distrust(key, stream)
            return self._start_resync(key, stream, start=None)
        return self._open_gap(key, stream)

    def _barrier(self, key: WorkerRank, stream: _Stream, event: RouterEvent) -> None:
        event_id = event.event.event_id
        if stream.resync is not None:
            self.outcomes["resync_cancelled"] += 1
            stream.resync = None
        stream.unreconciled.clear()
        stream.deferred.clear()
        self._apply(event, stream)
        stream.tiers.clear()
        stream.synced_through = stream.last_id = event_id
        stream.verified_base = True
        self._trust(key, stream)

    # ------------------------------------------------------------------ resync
    def _open_gap(self, key: WorkerRank, stream: _Stream) -> ResyncRequest:
        """Events after ``synced_through`` and before the first one kept never arrived: ask for them
        (or for a dump, when what precedes the hole was never verified)."""
        assert stream.synced_through is not None and stream.unreconciled
        self.outcomes["gap"] += 1
        self.gaps_by_stream[key] += 1
        self._distrust(key, stream)
        if not stream.verified_base:
            return self._start_resync(key, stream, start=None)
        start = stream.synced_through + 1
        return self._start_resync(key, stream, start=start, end=min(stream.unreconciled) - 1)

    def _start_resync(
        self, key: WorkerRank, stream: _Stream, *, start: int | None, end: int | None = None
    ) -> ResyncRequest:
        request = ResyncRequest(worker_id=key[0], dp_rank=key[1], start_event_id=start, end_event_id=end)
        stream.resync = request
        stream.heard_when_asked = stream.last_id
        stream.retry_at = None
        self.outcomes["resync_full" if start is None else "resync_range"] += 1
        return request

    def resync_done(self, request: ResyncRequest, response: ResyncResponse) -> ResyncRequest | None:
        """Apply a worker's answer to ``request``; returns a follow-up resync if one is needed."""
        key = (request.worker_id, request.dp_rank)
        stream = self._streams.get(key)
        if stream is None or stream.resync is not request:
            self.outcomes["resync_stale"] += 1  # cancelled by a barrier or a newer resync
            return None
        stream.resync = None
        if response.tree_dump is not None:
            self._drop_unnumbered(stream, response.tree_dump.last_event_id)
            self.index.remove_worker_dp_rank(*key)
            self._blocks_left(*key)
            stream.tiers.clear()
            whole = True
            for event in self._of_stream(key, response.tree_dump.events):
                whole = self._apply(event, stream, from_dump=True) and whole
            stream.synced_through = response.tree_dump.last_event_id
            stream.heard = stream.heard or bool(stream.synced_through)  # events once, all evicted since
            stream.verified_base = whole
            self.outcomes["resync_dump_applied"] += 1
        elif response.events is not None:
            last = stream.synced_through or 0
            for event in sorted(self._of_stream(key, response.events.events), key=lambda e: e.event.event_id):
                event_id = event.event.event_id
                if event_id == last + 1:
                    self._apply(event, stream, replayed=True)
                    last = event_id
                elif event_id > last + 1:
                    break  # the worker skipped some: the check below falls back to a dump
            stream.synced_through = last
            if request.end_event_id is not None and last < request.end_event_id:
                self.outcomes["resync_incomplete"] += 1
                newest = response.events.last_event_id
                if newest < request.end_event_id:  # short of the end asked for: all the publisher numbered
                    self._drop_unnumbered(stream, newest)
                    stream.last_id = max(last, newest, max(stream.unreconciled, default=0))
                # A dump, which also rebuilds the rank without what dropped events did when applied ahead.
                return self._start_resync(key, stream, start=None)
            self.outcomes["resync_events_applied"] += 1
        else:
            # TooNew or Error: the worker no longer has those events; only a dump can help.
            if request.start_event_id is not None:
                return self._start_resync(key, stream, start=None)
            self.outcomes["resync_refused"] += 1
            self._give_up(key, stream)
            return None
        return self._reconcile(key, stream)

    def _reconcile(self, key: WorkerRank, stream: _Stream) -> ResyncRequest | None:
        """After an answer: apply the kept live events newer than it again, in order, so they win over
        whatever the answer replayed; then the stream is whole, or the next hole is requested."""
        synced = stream.synced_through
        assert synced is not None
        kept = sorted(item for item in stream.unreconciled.items() if item[0] > synced)
        stream.unreconciled = {}
        stream.deferred.clear()
        for event_id, event in kept:
            self._apply(event, stream, replayed=True)
            if event_id == synced + 1:
                synced = event_id
            else:
                stream.unreconciled[event_id] = event
        stream.synced_through = synced
        # Lower than before when a dump says the publisher numbered no further: its next ids must apply.
        stream.last_id = max(stream.unreconciled, default=synced)
        if stream.unreconciled:
            # A new hole, never the same question again (so asking at once cannot loop): a replay
            # filled the range asked for, and a dump accounts for every id heard before it was asked.
            return self._open_gap(key, stream)
        if stream.verified_base:
            self._trust(key, stream)
        else:
            stream.retry_at = self._clock() + self.retry_interval_s
        return None

    def _drop_unnumbered(self, stream: _Stream, newest: int) -> None:
        """Refuse the kept events that a resync answer shows were never numbered: heard before the
        resync was asked for (the answer had to count them), yet past a hole above ``newest``, the id
        the publisher says it numbered up to. A run straight after ``newest`` stays: a dump may lag the
        events already sent. What they did when applied ahead goes with the rank's state: the answer
        is a dump, or asks for one."""
        heard = stream.heard_when_asked
        if heard is None:
            return
        successor = newest + 1
        dropped: set[int] = set()
        for event_id in sorted(stream.unreconciled):
            if event_id == successor:
                successor += 1
            elif successor < event_id <= heard:
                dropped.add(event_id)
                detail = f"id ahead of its publisher, which says it numbered events up to {newest}"
                self._reject(stream.unreconciled.pop(event_id), "id_ahead_of_publisher", detail)
        if dropped:  # counted once, here: not again when the stream gives up
            stream.deferred = [entry for entry in stream.deferred if entry[0].event.event_id not in dropped]

    def resync_failed(self, request: ResyncRequest, *, no_responders: bool = False) -> None:
        """Nobody answered ``request`` (``no_responders``: nobody serves the worker's resyncs; or
        timeouts, no transport): carry on with what is applied; the stream stays untrusted and is
        offered a retry later."""
        key = (request.worker_id, request.dp_rank)
        stream = self._streams.get(key)
        if stream is None or stream.resync is not request:
            return
        if no_responders:
            self.outcomes["resync_no_responders"] += 1
        stream.resync = None
        self.outcomes["resync_failed"] += 1
        self._give_up(key, stream)

    def _give_up(self, key: WorkerRank, stream: _Stream) -> None:
        """Accept what is applied as the stream's state, best effort, until a later sync verifies it."""
        self._distrust(key, stream)
        stream.verified_base = False
        for event, label, detail in stream.deferred:
            self._reject(event, label, detail)
        stream.deferred.clear()
        stream.unreconciled.clear()
        stream.synced_through = stream.last_id
        stream.retry_at = self._clock() + self.retry_interval_s

    def due_retries(self) -> list[ResyncRequest]:
        """Full resyncs for the unverified streams whose retry time has come (the slow schedule)."""
        now = self._clock()
        requests = []
        for key in list(self.untrusted):
            stream = self._streams.get(key)
            if stream is not None and stream.resync is None and stream.retry_at is not None and stream.retry_at <= now:
                self.outcomes["resync_retries"] += 1
                requests.append(self._start_resync(key, stream, start=None))
        return requests

    def _trust(self, key: WorkerRank, stream: _Stream) -> None:
        stream.trusted = True
        stream.retry_at = None
        self.untrusted.discard(key)

    def _distrust(self, key: WorkerRank, stream: _Stream) -> None:
        stream.trusted = False
        self.untrusted.add(key)

    def _blocks_left(self, worker_id: int, dp_rank: int | None) -> None:
        if self.on_blocks_left is not None:
            self.on_blocks_left(worker_id, dp_rank)

    # ------------------------------------------------------------------ workers
    def forget_worker(self, worker_id: int) -> None:
        """Drop every stream of ``worker_id`` (its index state is the caller's to remove). Its epoch
        is remembered: the same process may come back (a lease renewed, a withdrawal ended), but once
        another epoch is registered, the forgotten one is retired like any replaced epoch."""
        for key in [key for key in self._streams if key[0] == worker_id]:
            del self._streams[key]
            self.untrusted.discard(key)
        epoch = self._epochs.pop(worker_id, None)
        if epoch is not None:
            forgotten = self._forgotten_epochs
            forgotten.pop(worker_id, None)
            forgotten[worker_id] = epoch
            if len(forgotten) > FORGOTTEN_WORKERS_KEPT:
                oldest = next(iter(forgotten))
                del forgotten[oldest]
                self._retired_epochs.pop(oldest, None)

    def forget_stream(self, worker_id: int, dp_rank: int) -> None:
        """Drop one rank's stream (its index state is the caller's to remove): a rank added again
        starts afresh, untrusted until its events say otherwise."""
        key = (worker_id, dp_rank)
        self._streams.pop(key, None)
        self.untrusted.discard(key)

    def mark_untrusted(self, worker_id: int, dp_rank: int) -> None:
        """A transport lost events of this stream for good (an engine gap nobody can replay): it stays
        untrusted until a ``cleared`` barrier or a full dump."""
        key = (worker_id, dp_rank)
        stream = self._streams.get(key)
        if stream is None:
            # Lost before anything was heard (a router started against a running engine): the first
            # event that comes is not the stream's start, so it must not trust it as one.
            stream = self._streams[key] = _Stream(synced_through=0)
        self._distrust(key, stream)
        stream.verified_base = False
        self.outcomes["marked_untrusted"] += 1

    def heard_from(self, worker_id: int, dp_rank: int) -> bool:
        """Whether this (worker, dp_rank) ever sent an event: live, replayed, or in a dump (one empty
        since counts by its last event id). A stream opened by a resync alone has heard nothing."""
        stream = self._streams.get((worker_id, dp_rank))
        return stream is not None and stream.heard

    def observe_epoch(self, worker_id: int, epoch: str) -> bool:
        """The publisher of ``worker_id`` runs as ``epoch`` (from its registration or an event header).
        A different epoch than before means it restarted: its streams and index state are dropped,
        its ids start afresh, and events that came back from id 1 meanwhile are replayed. An epoch it
        has already left behind (a replay of the old process's events after the new one registered)
        changes nothing: returns False, and its events are dropped."""
        if self._worker_ranks is not None and self._worker_ranks(worker_id) is None:
            return True
        known = self._epochs.get(worker_id)
        if known == epoch:
            return True
        retired = self._retired_epochs.setdefault(worker_id, deque(maxlen=RETIRED_EPOCHS_KEPT))
        if epoch in retired:
            return False
        self._epochs[worker_id] = epoch
        if known is None:
            forgotten = self._forgotten_epochs.pop(worker_id, None)
            if forgotten is not None and forgotten != epoch:
                retired.append(forgotten)  # the worker came back as another process
            return True
        retired.append(known)
        regressed = [
            event for key, stream in self._streams.items() if key[0] == worker_id for event in stream.regressed
        ]
        for key in [key for key in self._streams if key[0] == worker_id]:
            del self._streams[key]
            self.untrusted.discard(key)
        self.index.remove_worker(worker_id)
        self._blocks_left(worker_id, None)
        self.outcomes["publisher_restarts"] += 1
        self.ingest(regressed)
        return True

    def resync_in_flight(self, request: ResyncRequest) -> bool:
        """True while ``request`` is its stream's resync: not yet answered, failed, or replaced."""
        stream = self._streams.get((request.worker_id, request.dp_rank))
        return stream is not None and stream.resync is request

    def request_full_resync(self, worker_id: int, dp_rank: int) -> ResyncRequest | None:
        """Start a full resync of one stream now (e.g. when its worker registers), unless one runs."""
        key = (worker_id, dp_rank)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = _Stream()
            self.untrusted.add(key)
        if stream.resync is not None:
            return None
        return self._start_resync(key, stream, start=None)

    def restore_snapshot(
        self,
        events: Iterable[RouterEvent],
        positions: Iterable[tuple[int, int, int | None, bool]],
        epochs: Mapping[int, str] | None = None,
    ) -> int:
        """Load an index snapshot into an index that holds nothing of its streams yet: its dump events
        applied (the index's state, outside any stream's order; a rejected one counted as any event's),
        then each stream, given as ``(worker_id, dp_rank, last_event_id, trusted)``, resumed where the
        snapshot left it, and each worker's publisher epoch (`epochs`) as it was then (so that a
        publisher restarted since is told from a replay of old ids). Returns the events applied
        (``snapshot_applied``)."""
        applied = 0
        index = self.index
        tiers: dict[WorkerRank, set[StorageTier]] = {}
        for event in events:
            if event.event.stored is not None:
                tiers.setdefault((event.worker_id, event.event.dp_rank), set()).add(event.storage_tier)
            try:
                index.apply_router_event(event)
            except KvIndexError as exc:
                self._reject(event, exc.label, str(exc))
                continue
            applied += 1
        self.outcomes["snapshot_applied"] += applied
        for worker_id, dp_rank, last_event_id, trusted in positions:
            self._restore_stream(worker_id, dp_rank, last_event_id, trusted, tiers.get((worker_id, dp_rank), set()))
        if epochs:
            self._epochs.update(epochs)
        return applied

    def epochs(self) -> dict[int, str]:
        """Each worker's publisher epoch, as far as its events said (a copy)."""
        return dict(self._epochs)

    def _restore_stream(
        self, worker_id: int, dp_rank: int, last_event_id: int | None, trusted: bool, tiers: set[StorageTier]
    ) -> None:
        """Resume a stream where an index snapshot left it (the index holds its state up to there)."""
        key = (worker_id, dp_rank)
        self._streams[key] = _Stream(
            synced_through=last_event_id,
            last_id=last_event_id,
            trusted=trusted,
            verified_base=trusted,
            heard=last_event_id is not None,
            tiers=tiers,
        )
        if trusted:
            self.untrusted.discard(key)
        else:
            self.untrusted.add(key)

    def resync_all(self) -> list[ResyncRequest]:
        """Ask every known stream for a full dump, e.g. after a reconnect may have lost events. The
        index is kept and live events keep applying meanwhile: stale but useful beats empty."""
        requests = []
        for key, stream in self._streams.items():
            self._distrust(key, stream)
            requests.append(self._start_resync(key, stream, start=None))
        return requests

    def refuse(self, events: Iterable[RouterEvent], label: str, detail: str) -> None:
        """Events a transport refused before sequencing them: each counted (``rejected_<label>``) and
        its reason kept, none applied."""
        for event in events:
            self._reject(event, label, detail)

    def count_undecodable(self, *, resync_reply: bool = False) -> None:
        """A payload a transport could not decode: an event (``rejected_undecodable``) or a resync's
        reply (``rejected_undecodable_resync``); nothing reached the index."""
        self.outcomes["rejected_undecodable_resync" if resync_reply else "rejected_undecodable"] += 1

    def count_oversized_resync(self) -> None:
        """A resync's reply a transport refused for its size, before decoding it; nothing reached the index."""
        self.outcomes["rejected_oversized_resync"] += 1

    # ------------------------------------------------------------------ reads
    def status(self) -> list[StreamStatus]:
        now = self._clock()
        return [
            StreamStatus(
                worker_id=key[0],
                dp_rank=key[1],
                last_event_id=stream.last_id,
                trusted=stream.trusted,
                resyncing=stream.resync is not None,
                unreconciled_events=len(stream.unreconciled),
                last_event_age_s=None if stream.last_applied_at is None else now - stream.last_applied_at,
            )
            for key, stream in sorted(self._streams.items())
        ]

    def freshness(self, key: WorkerRank) -> tuple[bool, float | None]:
        """Whether the rank's stream is trusted, and the age of the newest event applied for it."""
        stream = self._streams.get(key)
        if stream is None or stream.last_applied_at is None:
            return False, None
        return stream.trusted, self._clock() - stream.last_applied_at

    # ------------------------------------------------------------------ applying
    def _apply(
        self,
        event: RouterEvent,
        stream: _Stream,
        *,
        from_dump: bool = False,
        replayed: bool = False,
        deferred: bool = False,
    ) -> bool:
        """Apply one event to the index. ``deferred``: ahead of a hole, so a rejection may be the hole's
        fault and is kept until the stream is reconciled or gives up. False: refused unapplied (too
        large), which leaves the stream unverified, so no caller may verify it afterwards."""
        stream.heard = True
        if event.event.stored is not None:  # even refused: the worker holds blocks in that tier
            stream.tiers.add(event.storage_tier)
        if _block_count(event) > self._max_blocks:
            # Counted and skipped; the worker's stream is no longer known complete.
            self._reject(event, "oversized_event", f"more than {self._max_blocks} blocks")
            key = (event.worker_id, event.event.dp_rank)
            self._distrust(key, stream)
            stream.verified_base = False
            stream.retry_at = self._clock() + self.retry_interval_s
            return False
        data = event.event
        kind = "cleared" if data.is_cleared else ("stored" if data.stored is not None else "removed")
        if kind != "stored":  # blocks leave, even where the index refuses part of the event
            self._blocks_left(event.worker_id, data.dp_rank)
        try:
            self.index.apply_router_event(event)
        except KvIndexError as exc:
            if replayed:
                self._reject(event, exc.label, str(exc))
                return True
            self.applied[kind, exc.label] += 1
            if deferred:
                self.outcomes["deferred_rejections"] += 1
                stream.deferred.append((event, exc.label, str(exc)))
            else:
                self._reject(event, exc.label, str(exc))
            return True
        if replayed:
            self.outcomes["reapplied"] += 1
            return True
        self.applied[kind, "ok"] += 1
        if from_dump:
            self.outcomes["dump_applied"] += 1
        else:
            self.outcomes["applied"] += 1
            self.blocks_applied += _block_count(event)
        stream.last_applied_at = self._clock()
        return True

    def _of_stream(self, key: WorkerRank, events: list[RouterEvent]) -> list[RouterEvent]:
        """The events of a resync answer that belong to the stream asked about: another worker's or
        rank's (a buggy or hostile worker) would rewrite that one's index, so they are refused."""
        own = [event for event in events if (event.worker_id, event.event.dp_rank) == key]
        if len(own) < len(events):
            for event in events:
                if (event.worker_id, event.event.dp_rank) != key:
                    self._reject(event, "resync_foreign", f"in the resync answer for worker {key[0]} rank {key[1]}")
        return own

    def _reject(self, event: RouterEvent, label: str, detail: str) -> None:
        self.outcomes[f"rejected_{label}"] += 1
        self.rejected += 1
        self.recent_rejections.append(f"worker {event.worker_id} event {event.event.event_id}: {detail}")


def _block_count(event: RouterEvent) -> int:
    stored, removed = event.event.stored, event.event.removed
    if stored is not None:
        return len(stored.blocks)
    return len(removed.block_hashes) if removed is not None else 0

"""Exactly-once, in-order application of each (worker, dp_rank)'s event stream, with gap repair.

Events are numbered per (worker, dp_rank) from 1 by the publisher. For each stream the sequencer
keeps the id of the last applied event:

- an id at or below it is a duplicate and dropped;
- the next id is applied;
- a larger id is a gap: the stream becomes untrusted and a resync is requested for the missing
  range (or a full dump when the worker cannot serve it); live events are held meanwhile, so a
  replayed store can never resurrect a block that a later live event removed;
- the first event ever seen from a stream is applied at once and trusted when its id is 1 (nothing
  can precede it); any other first id asks for a full dump, so a router that starts after its
  workers learns what they cached before;
- ``cleared`` is a barrier: it applies at once, cancels any resync in flight (its answer would be
  stale) and restarts the stream from its id.

The sequencer does no I/O: ``receive`` and ``resync_done`` return the ``ResyncRequest`` to send, and
the transport (``router.event_plane.subscriber``) answers with ``resync_done`` or ``resync_failed``.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from indexer.errors import KvIndexError
from indexer.events import ResyncRequest, ResyncResponse, RouterEvent
from indexer.radix_tree import RadixTree
from indexer.slots import WorkerRank

__all__ = ["EventSequencer", "StreamStatus"]

# Beyond this many held events a stream stops holding and asks for a full dump instead.
MAX_HELD_EVENTS = 100_000
# No engine stores or removes this many blocks in one event (a 1M-token prompt at block size 16 is
# 65,536 blocks); a bigger one is rejected before it can stall the loop that routes requests.
MAX_EVENT_BLOCKS = 1 << 17

# Reasons of the most recent rejections kept for callers that report them (the HTTP reply).
RECENT_REJECTIONS = 8


@dataclass
class _Stream:
    last_applied: int | None = None  # None: never synchronised
    resync: ResyncRequest | None = None  # the request in flight, if any
    held: dict[int, RouterEvent] = field(default_factory=dict)  # event id -> event, while resyncing
    trusted: bool = False


@dataclass(frozen=True, slots=True)
class StreamStatus:
    worker_id: int
    dp_rank: int
    last_event_id: int | None
    trusted: bool
    resyncing: bool
    held_events: int


class EventSequencer:
    def __init__(
        self,
        index: RadixTree,
        *,
        accept_worker: Callable[[int], bool] | None = None,
        max_held_events: int = MAX_HELD_EVENTS,
        max_event_blocks: int = MAX_EVENT_BLOCKS,
    ) -> None:
        self.index = index
        self._accept_worker = accept_worker
        self._max_held = max_held_events
        self._max_blocks = max_event_blocks
        self._streams: dict[WorkerRank, _Stream] = {}
        # Outcome -> count: applied, duplicate, held, gap, resync_*, rejected_<reason>.
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
        self.unknown_worker_events: Counter[int] = Counter()

    # ------------------------------------------------------------------ live events
    def ingest(self, events: Iterable[RouterEvent]) -> None:
        """The door every transport uses: sequence each event, sending the resyncs it calls for."""
        for event in events:
            request = self.receive(event)
            if request is not None:
                self.send_resync(request)

    def send_resync(self, request: ResyncRequest) -> None:
        if self.resync_transport is None:
            self.resync_failed(request)
        else:
            self.resync_transport(request)

    def receive(self, event: RouterEvent) -> ResyncRequest | None:
        """Take one live event; returns a resync to start, if this event calls for one."""
        if self._accept_worker is not None and not self._accept_worker(event.worker_id):
            self.unknown_worker_events[event.worker_id] += 1
            self._reject(event, "unknown_worker", "worker not registered")
            return None
        key = (event.worker_id, event.event.dp_rank)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = _Stream()
        event_id = event.event.event_id
        last = stream.last_applied
        if event.event.is_cleared and (last is None or event_id > last):
            return self._barrier(key, stream, event)
        if stream.resync is not None:
            if last is not None and event_id <= last:
                self.outcomes["duplicate"] += 1
                return None
            return self._hold(key, stream, event)
        if last is None:
            if event_id == 1:  # a stream's very first event: nothing can precede it
                self._apply(event)
                stream.last_applied = 1
                stream.trusted = True
                return None
            self._hold(key, stream, event)
            return self._start_resync(key, stream, start=None)
        if event_id <= last:
            self.outcomes["duplicate"] += 1
            return None
        if event_id == last + 1:
            self._apply(event)
            stream.last_applied = event_id
            return None
        self._hold(key, stream, event)
        return self._open_gap(key, stream, last + 1, event_id - 1)

    def _barrier(self, key: WorkerRank, stream: _Stream, event: RouterEvent) -> ResyncRequest | None:
        event_id = event.event.event_id
        if stream.resync is not None:
            self.outcomes["resync_cancelled"] += 1
            stream.resync = None
        self._apply(event)
        stream.last_applied = event_id
        stream.trusted = True
        return self._drain_held(key, stream)

    def _hold(self, key: WorkerRank, stream: _Stream, event: RouterEvent) -> ResyncRequest | None:
        if len(stream.held) >= self._max_held:
            # Whatever is held will be covered by a full dump taken after it.
            self.outcomes["held_overflow"] += len(stream.held)
            stream.held.clear()
            stream.last_applied = None
            return self._start_resync(key, stream, start=None)
        stream.held[event.event.event_id] = event
        self.outcomes["held"] += 1
        return None

    # ------------------------------------------------------------------ resync
    def _open_gap(self, key: WorkerRank, stream: _Stream, start: int, end: int) -> ResyncRequest:
        """Events ``start..end`` never arrived: distrust the stream and ask the worker for them."""
        self.outcomes["gap"] += 1
        self.gaps_by_stream[key] += 1
        stream.trusted = False
        return self._start_resync(key, stream, start=start, end=end)

    def _start_resync(
        self, key: WorkerRank, stream: _Stream, *, start: int | None, end: int | None = None
    ) -> ResyncRequest:
        request = ResyncRequest(worker_id=key[0], dp_rank=key[1], start_event_id=start, end_event_id=end)
        stream.resync = request
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
            self.index.remove_worker_dp_rank(*key)
            for event in response.tree_dump.events:
                self._apply(event, from_dump=True)
            stream.last_applied = response.tree_dump.last_event_id
            stream.trusted = True
            self.outcomes["resync_dump_applied"] += 1
        elif response.events is not None:
            last = stream.last_applied or 0
            for event in sorted(response.events.events, key=lambda e: e.event.event_id):
                event_id = event.event.event_id
                if event_id == last + 1:
                    self._apply(event)
                    last = event_id
                elif event_id > last + 1:
                    break  # the worker skipped some: the check below falls back to a dump
            if request.end_event_id is not None and last < request.end_event_id:
                self.outcomes["resync_incomplete"] += 1
                return self._start_resync(key, stream, start=None)
            stream.last_applied = last
            stream.trusted = True
            self.outcomes["resync_events_applied"] += 1
        else:
            # TooNew or Error: the worker no longer has those events; only a dump can help.
            if request.start_event_id is not None:
                return self._start_resync(key, stream, start=None)
            self.outcomes["resync_refused"] += 1
            self._give_up(stream)
            return None
        return self._drain_held(key, stream)

    def resync_failed(self, request: ResyncRequest) -> None:
        """The worker did not answer ``request`` (after retries): carry on with what is held."""
        stream = self._streams.get((request.worker_id, request.dp_rank))
        if stream is None or stream.resync is not request:
            return
        stream.resync = None
        self.outcomes["resync_failed"] += 1
        self._give_up(stream)

    def _give_up(self, stream: _Stream) -> None:
        """Apply held events in order as best effort; the stream stays untrusted until a later sync."""
        stream.trusted = False
        held = sorted(stream.held.items())
        stream.held.clear()
        for event_id, event in held:
            if stream.last_applied is None or event_id > stream.last_applied:
                self._apply(event)
                stream.last_applied = event_id

    def _drain_held(self, key: WorkerRank, stream: _Stream) -> ResyncRequest | None:
        if not stream.held:
            return None
        held = stream.held
        stream.held = {}
        last = stream.last_applied
        assert last is not None
        pending = sorted(held.items())
        for position, (event_id, event) in enumerate(pending):
            if event_id <= last:
                self.outcomes["duplicate"] += 1
            elif event_id == last + 1:
                self._apply(event)
                last = event_id
            else:
                stream.last_applied = last
                stream.held = dict(pending[position:])
                return self._open_gap(key, stream, last + 1, event_id - 1)
        stream.last_applied = last
        return None

    # ------------------------------------------------------------------ workers
    def forget_worker(self, worker_id: int) -> None:
        """Drop every stream of ``worker_id`` (its index state is the caller's to remove)."""
        for key in [key for key in self._streams if key[0] == worker_id]:
            del self._streams[key]

    def mark_untrusted(self, worker_id: int, dp_rank: int) -> None:
        """A transport lost events of this stream for good (an engine gap nobody can replay): it stays
        untrusted until a ``cleared`` barrier or a full dump."""
        stream = self._streams.get((worker_id, dp_rank))
        if stream is None:
            stream = self._streams[(worker_id, dp_rank)] = _Stream()
        stream.trusted = False
        self.outcomes["marked_untrusted"] += 1

    def has_stream(self, worker_id: int, dp_rank: int) -> bool:
        """Whether events of this (worker, dp_rank) ever reached the sequencer."""
        return (worker_id, dp_rank) in self._streams

    def request_full_resync(self, worker_id: int, dp_rank: int) -> ResyncRequest | None:
        """Start a full resync of one stream now (e.g. when its worker registers), unless one runs."""
        key = (worker_id, dp_rank)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = _Stream()
        if stream.resync is not None:
            return None
        return self._start_resync(key, stream, start=None)

    def restore_stream(self, worker_id: int, dp_rank: int, last_event_id: int | None, trusted: bool) -> None:
        """Resume a stream where an index snapshot left it (the index holds its state up to there)."""
        self._streams[worker_id, dp_rank] = _Stream(last_applied=last_event_id, trusted=trusted)

    def resync_all(self) -> list[ResyncRequest]:
        """Ask every known stream for a full dump, e.g. after a reconnect may have lost events."""
        requests = []
        for key, stream in self._streams.items():
            stream.trusted = False
            requests.append(self._start_resync(key, stream, start=None))
        return requests

    def status(self) -> list[StreamStatus]:
        return [
            StreamStatus(
                worker_id=key[0],
                dp_rank=key[1],
                last_event_id=stream.last_applied,
                trusted=stream.trusted,
                resyncing=stream.resync is not None,
                held_events=len(stream.held),
            )
            for key, stream in sorted(self._streams.items())
        ]

    # ------------------------------------------------------------------ applying
    def _apply(self, event: RouterEvent, *, from_dump: bool = False) -> None:
        if _block_count(event) > self._max_blocks:
            # Counted and skipped; the worker's stream is no longer known complete.
            self._reject(event, "oversized_event", f"more than {self._max_blocks} blocks")
            stream = self._streams.get((event.worker_id, event.event.dp_rank))
            if stream is not None:
                stream.trusted = False
            return
        data = event.event
        kind = "cleared" if data.is_cleared else ("stored" if data.stored is not None else "removed")
        try:
            self.index.apply_router_event(event)
        except KvIndexError as exc:
            self.applied[kind, exc.label] += 1
            self._reject(event, exc.label, str(exc))
        else:
            self.applied[kind, "ok"] += 1
            if from_dump:
                self.outcomes["dump_applied"] += 1
                return
            self.outcomes["applied"] += 1
            self.blocks_applied += _block_count(event)

    def _reject(self, event: RouterEvent, label: str, detail: str) -> None:
        self.outcomes[f"rejected_{label}"] += 1
        self.rejected += 1
        self.recent_rejections.append(f"worker {event.worker_id} event {event.event.event_id}: {detail}")


def _block_count(event: RouterEvent) -> int:
    data = event.event.data
    if isinstance(data, str):
        return 0
    if data.stored is not None:
        return len(data.stored.blocks)
    return len(data.removed.block_hashes) if data.removed is not None else 0

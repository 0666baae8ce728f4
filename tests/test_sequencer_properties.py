"""Property tests of the sequencer against the truth: one engine-like stream applied in order.

Events are lost, the router joins late, resync answers are snapshots taken at any time between the
request and its delivery (live events newer than the snapshot may already have been applied), some
resyncs go unanswered and are retried. Whenever the sequencer calls the stream trusted, the router's
index for the rank is exactly the worker's state at the last event id: in particular no replayed store
ever resurrected a block that a later live event removed. Every live event is applied when it arrives.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer.events import ResyncBatch, ResyncRequest, ResyncResponse, RouterEvent
from indexer.radix_tree import RadixTree
from indexer.sequencer import EventSequencer
from tests.event_streams import EventOp, generate


def engine_stream(seed: int, requests: int) -> list[RouterEvent]:
    """One (worker, rank 0) stream of an LRU engine, ids 1..n (without the generator's worker-level
    operations, which the engine model applies without an event)."""
    events = [
        RouterEvent(op.worker_id, op.event)
        for op in generate(
            seed, workers=1, dp_size=1, requests=requests, capacity=48, query_every=10**9, rare_ops=False
        )
        if isinstance(op, EventOp)
    ]
    assert [e.event.event_id for e in events] == list(range(1, len(events) + 1))
    return events


def state(tree: RadixTree) -> list[tuple[int | None, int, int]]:
    """Every block the tree holds as (parent block hash, block hash, tokens hash), whatever chains
    its dump groups them in."""
    blocks = []
    for event in tree.dump_events():
        stored = event.event.stored
        assert stored is not None
        parent = stored.parent_hash
        for block in stored.blocks:
            blocks.append((parent, block.block_hash, block.tokens_hash))
            parent = block.block_hash
    return sorted(blocks, key=repr)


def truth_at(events: list[RouterEvent], position: int) -> RadixTree:
    tree = RadixTree()
    for event in events[:position]:
        tree.apply_router_event(event)
    return tree


def answer(events: list[RouterEvent], request: ResyncRequest, position: int, ring: int) -> ResyncResponse:
    """What `KvEventPublisher.answer_resync` returns when the worker is at ``position``."""
    start = request.start_event_id
    oldest = max(1, position - ring + 1)
    if start is not None and start >= oldest:
        end = position if request.end_event_id is None else min(request.end_event_id, position)
        return ResyncResponse(events=ResyncBatch(events=events[start - 1 : end], last_event_id=end))
    dump = truth_at(events, position).dump_events()  # the worker's own index at that point
    return ResyncResponse(tree_dump=ResyncBatch(events=dump, last_event_id=position))


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), data=st.data())
def test_trusted_means_exactly_the_workers_state(seed: int, data: st.DataObject) -> None:
    events = engine_stream(seed, data.draw(st.integers(10, 40), label="requests"))
    n = len(events)
    truth = RadixTree()
    truth_states = [state(truth)]
    for event in events:
        truth.apply_router_event(event)
        truth_states.append(state(truth))
    ring = data.draw(st.integers(1, 32), label="ring")
    joined = data.draw(st.integers(0, min(n - 1, 10)), label="events before the router joined")
    lost = data.draw(st.sets(st.integers(joined, n - 1), max_size=max(1, n // 6)), label="lost")
    now = [0.0]
    tree = RadixTree()
    sequencer = EventSequencer(tree, retry_interval_s=5.0, clock=lambda: now[0])
    # Requests sent and not yet answered: (request, worker position when it was sent).
    pending: list[tuple[ResyncRequest, int]] = []
    sequencer.resync_transport = lambda request: pending.append((request, position))

    def deliver_answers(final: bool = False) -> None:
        while pending and (final or data.draw(st.booleans(), label="deliver an answer")):
            request, sent_at = pending.pop(data.draw(st.integers(0, len(pending) - 1), label="which"))
            if not final and data.draw(st.integers(0, 4), label="outcome") == 0:
                sequencer.resync_failed(request)
                continue
            snapshot = position if final else data.draw(st.integers(sent_at, position), label="snapshot")
            follow_up = sequencer.resync_done(request, answer(events, request, snapshot, ring))
            if follow_up is not None:
                sequencer.send_resync(follow_up)
            check()

    def check() -> None:
        [status] = sequencer.status()
        if status.trusted:
            assert status.last_event_id is not None
            assert state(tree) == truth_states[status.last_event_id]

    position = 0
    for index, event in enumerate(events):
        position = index + 1
        if index < joined or index in lost:
            continue
        sequencer.ingest([event])
        stored = event.event.stored
        if stored is not None and stored.parent_hash is None:
            # Applied on arrival, whatever is in flight: its blocks are routable now.
            key = (event.worker_id, 0)
            assert tree.find_matches([stored.blocks[0].tokens_hash]).scores.get(key) == 1
        check()
        deliver_answers()
        now[0] += 1.0
        for request in sequencer.due_retries():
            sequencer.send_resync(request)
    # Quiet at last: every answer arrives and retries run until the stream is verified.
    for _ in range(10):
        deliver_answers(final=True)
        now[0] += 10.0
        for request in sequencer.due_retries():
            sequencer.send_resync(request)
    statuses = sequencer.status()
    assert all(status.trusted for status in statuses)
    check() if statuses else None

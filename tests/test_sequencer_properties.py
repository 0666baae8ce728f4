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

from indexer.events import U64_MAX, ResyncBatch, ResyncRequest, ResyncResponse, RouterEvent, removed_event, stored_event
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


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), data=st.data())
def test_an_id_far_ahead_never_keeps_the_publishers_later_events_out(seed: int, data: st.DataObject) -> None:
    """An event whose id is far ahead of its publisher's numbering, wherever it falls in the stream,
    storing a block of its own or removing one the worker holds: one round of resync answers (at
    most a replay and a dump) refuses it and undoes it, every later real event applies on arrival,
    and the stream ends trusted with exactly the worker's state."""
    events = engine_stream(seed, data.draw(st.integers(10, 30), label="requests"))
    n = len(events)
    position = data.draw(st.integers(1, n - 1), label="events before the far one")
    far_id = data.draw(st.integers(position + 2, U64_MAX), label="its id")
    held = [block for _, block, _ in state(truth_at(events, position))]
    worker_id = events[0].worker_id
    if held and data.draw(st.booleans(), label="a removal"):
        far = RouterEvent(worker_id, removed_event(far_id, [data.draw(st.sampled_from(held), label="block")]))
    else:
        far = RouterEvent(worker_id, stored_event(far_id, [(U64_MAX, U64_MAX)]))
    tree = RadixTree()
    sequencer = EventSequencer(tree)
    asked: list[ResyncRequest] = []
    sequencer.resync_transport = asked.append
    sequencer.ingest([*events[:position], far])
    answered = 0
    while answered < min(len(asked), 4):  # answered at once, the publisher still at ``position``; a loop stops
        follow_up = sequencer.resync_done(asked[answered], answer(events, asked[answered], position, ring=64))
        answered += 1
        if follow_up is not None:
            sequencer.send_resync(follow_up)
    assert len(asked) <= 2
    assert sequencer.outcomes["rejected_id_ahead_of_publisher"] == sequencer.rejected == 1
    sequencer.ingest(events[position:])
    assert sequencer.outcomes["duplicate"] == 0
    [status] = sequencer.status()
    assert (status.trusted, status.last_event_id) == (True, n)
    assert state(tree) == state(truth_at(events, n))

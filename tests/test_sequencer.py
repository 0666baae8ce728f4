"""The per-stream sequencer: duplicates, gaps, holds, barriers and resync answers."""

from __future__ import annotations

from indexer.events import (
    U64_MAX,
    ResyncBatch,
    ResyncRequest,
    ResyncResponse,
    ResyncTooNew,
    RouterEvent,
    StorageTier,
    cleared_event,
    removed_event,
    stored_event,
)
from indexer.radix_tree import RadixTree
from indexer.sequencer import MAX_UNKNOWN_WORKERS, EventSequencer
from tests.test_sequencer_properties import answer

W = 42


def store(event_id: int, block: int, parent: int | None = None, rank: int = 0) -> RouterEvent:
    return RouterEvent(W, stored_event(event_id, [(block, block)], parent_hash=parent, dp_rank=rank))


def remove(event_id: int, block: int) -> RouterEvent:
    return RouterEvent(W, removed_event(event_id, [block]))


def synced(last: int = 0) -> tuple[EventSequencer, RadixTree]:
    """A sequencer whose stream of W has applied event ``last + 1`` (block 1): event 1 opens a stream
    at once; a later first event is synchronised by an empty dump up to ``last``."""
    tree = RadixTree()
    sequencer = EventSequencer(tree)
    request = sequencer.receive(store(last + 1, 1))
    if last == 0:
        assert request is None
    else:
        assert request == ResyncRequest(worker_id=W, dp_rank=0, start_event_id=None)
        sequencer.resync_done(request, ResyncResponse(tree_dump=ResyncBatch(events=[], last_event_id=last)))
    return sequencer, tree


def held_blocks(tree: RadixTree) -> int:
    return sum(tree.stats().blocks.values())


def test_a_later_first_event_is_routable_at_once_and_a_dump_completes_the_rank() -> None:
    tree = RadixTree()
    sequencer = EventSequencer(tree)
    request = sequencer.receive(store(5, 50))
    assert request is not None and request.start_event_id is None
    assert tree.find_matches([50]).scores == {(W, 0): 1}  # routable while the dump is on its way
    assert not sequencer.status()[0].trusted
    dump = [store(0, 40)]  # the worker held block 40 before the router came up
    assert sequencer.resync_done(request, ResyncResponse(tree_dump=ResyncBatch(events=dump, last_event_id=4))) is None
    assert tree.find_matches([40]).scores == {(W, 0): 1}
    assert tree.find_matches([50]).scores == {(W, 0): 1}  # event 5 applied again after the dump
    [status] = sequencer.status()
    assert (status.last_event_id, status.trusted, status.resyncing) == (5, True, False)


def test_a_stream_that_starts_at_id_1_is_applied_at_once_and_trusted() -> None:
    tree = RadixTree()
    sequencer = EventSequencer(tree)
    assert sequencer.receive(store(1, 10)) is None  # nothing can precede event 1: no resync
    assert tree.find_matches([10]).scores == {(W, 0): 1}
    [status] = sequencer.status()
    assert (status.last_event_id, status.trusted, status.resyncing) == (1, True, False)


def test_without_a_transport_a_resync_fails_at_once_and_the_events_apply() -> None:
    tree = RadixTree()
    sequencer = EventSequencer(tree)
    sequencer.ingest([store(4, 40), store(5, 50, parent=40)])  # joined mid-stream, nobody to ask
    assert tree.find_matches([40, 50]).scores == {(W, 0): 2}
    assert sequencer.outcomes["resync_failed"] == 1
    [status] = sequencer.status()
    assert (status.last_event_id, status.trusted, status.resyncing) == (5, False, False)


def test_duplicates_are_dropped_and_the_next_id_applies() -> None:
    sequencer, tree = synced(0)
    assert tree.find_matches([1]).scores == {(W, 0): 1}
    assert sequencer.receive(store(1, 1)) is None
    assert sequencer.receive(store(2, 2, parent=1)) is None
    assert sequencer.outcomes["duplicate"] == 1
    assert tree.find_matches([1, 2]).scores == {(W, 0): 2}


def test_gap_applies_live_events_at_once_and_the_answer_cannot_resurrect_a_removed_block() -> None:
    sequencer, tree = synced(0)
    request = sequencer.receive(store(4, 4))
    assert request == ResyncRequest(worker_id=W, dp_rank=0, start_event_id=2, end_event_id=3)
    assert sequencer.outcomes["gap"] == 1
    assert tree.find_matches([4]).scores == {(W, 0): 1}  # routable now, not after the resync
    assert not sequencer.status()[0].trusted
    # A live removal of block 2 arrives while the resync is in flight; the replayed store of block 2
    # (event 2, older) must not bring it back.
    assert sequencer.receive(remove(5, 2)) is None
    missing = [store(2, 2, parent=1), store(3, 3, parent=1)]
    follow_up = sequencer.resync_done(request, ResyncResponse(events=ResyncBatch(events=missing, last_event_id=3)))
    assert follow_up is None
    assert tree.find_matches([1, 2]).scores == {(W, 0): 1}
    assert tree.find_matches([1, 3]).scores == {(W, 0): 2}
    [status] = sequencer.status()
    assert (status.last_event_id, status.trusted, status.unreconciled_events) == (5, True, 0)


def test_live_events_ahead_of_a_hole_whose_parent_is_in_it_apply_once_the_hole_is_filled() -> None:
    sequencer, tree = synced(0)
    request = sequencer.receive(store(3, 3, parent=2))  # block 2 is in the hole (event 2)
    assert request is not None
    assert sequencer.rejected == 0  # deferred, not rejected: the hole may hold the parent
    missing = [store(2, 2, parent=1)]
    sequencer.resync_done(request, ResyncResponse(events=ResyncBatch(events=missing, last_event_id=2)))
    assert tree.find_matches([1, 2, 3]).scores == {(W, 0): 3}
    assert sequencer.rejected == 0 and sequencer.status()[0].trusted


def test_a_second_hole_found_while_reconciling_is_requested_next() -> None:
    sequencer, tree = synced(0)
    first = sequencer.receive(store(3, 3, parent=1))
    assert first is not None
    assert sequencer.receive(store(6, 6, parent=1)) is None  # another loss, while the first resync runs
    follow_up = sequencer.resync_done(first, ResyncResponse(events=ResyncBatch(events=[store(2, 2, parent=1)],
                                                                                last_event_id=2)))  # fmt: skip
    assert follow_up == ResyncRequest(worker_id=W, dp_rank=0, start_event_id=4, end_event_id=5)
    assert tree.find_matches([1, 6]).scores == {(W, 0): 2}
    missing = [store(4, 4, parent=1), store(5, 5, parent=1)]
    assert sequencer.resync_done(follow_up, ResyncResponse(events=ResyncBatch(events=missing, last_event_id=5))) is None
    assert sequencer.status()[0].trusted


def test_an_unanswered_resync_is_retried_on_the_slow_schedule_until_verified() -> None:
    now = [100.0]
    tree = RadixTree()
    sequencer = EventSequencer(tree, retry_interval_s=30.0, clock=lambda: now[0])
    request = sequencer.receive(store(7, 7))
    assert request is not None
    sequencer.resync_failed(request)  # e.g. "no responders"
    assert tree.find_matches([7]).scores == {(W, 0): 1}
    assert sequencer.due_retries() == []
    now[0] += 29.0
    assert sequencer.due_retries() == []
    now[0] += 1.0
    [retry] = sequencer.due_retries()
    assert retry.start_event_id is None
    assert sequencer.due_retries() == []  # one in flight at a time
    sequencer.resync_failed(retry)
    now[0] += 30.0
    [again] = sequencer.due_retries()
    sequencer.resync_done(again, ResyncResponse(tree_dump=ResyncBatch(events=[store(0, 7)], last_event_id=7)))
    assert sequencer.status()[0].trusted
    now[0] += 300.0
    assert sequencer.due_retries() == []  # verified: no more retries
    assert sequencer.outcomes["resync_retries"] == 2


def test_a_new_publisher_epoch_clears_the_worker_and_restarts_its_ids() -> None:
    sequencer, tree = synced(0)
    sequencer.observe_epoch(W, "first")
    sequencer.ingest([store(2, 2, parent=1)], epoch="first")
    sequencer.ingest([store(1, 5)], epoch="second")  # restarted: ids from 1 again
    assert tree.find_matches([1]).scores == {}  # the old process's blocks are gone
    assert tree.find_matches([5]).scores == {(W, 0): 1}
    [status] = sequencer.status()
    assert (status.last_event_id, status.trusted) == (1, True)
    assert sequencer.outcomes["publisher_restarts"] == 1


def test_late_events_of_a_replaced_process_change_nothing() -> None:
    # A durable router's replay after a restart: the snapshot knew the worker as "first", its registration
    # says "second", and then the stream brings the old process's last events.
    sequencer, tree = synced(0)
    sequencer.observe_epoch(W, "first")
    sequencer.ingest([store(2, 2, parent=1)], epoch="first")
    assert sequencer.observe_epoch(W, "second")
    sequencer.ingest([store(3, 7, parent=2), store(4, 8, parent=7)], epoch="first")
    assert tree.find_matches([1]).scores == {} and tree.find_matches([7]).scores == {}
    assert sequencer.outcomes["stale_epoch"] == 2 and sequencer.outcomes["publisher_restarts"] == 1
    assert not sequencer.observe_epoch(W, "first")  # nor does a registration of it
    sequencer.ingest([store(1, 5)], epoch="second")
    assert tree.find_matches([5]).scores == {(W, 0): 1}


def test_a_late_event_of_a_forgotten_process_does_not_replace_the_worker_registered_since() -> None:
    # A new bridge deletes the registry entry first (the worker is forgotten), then registers as
    # "second"; one event of the old process, from another subscription, arrives after that.
    registered: dict[int, range] = {W: range(1)}
    tree = RadixTree()
    sequencer = EventSequencer(tree, worker_ranks=registered.get)
    sequencer.observe_epoch(W, "first")
    sequencer.ingest([store(1, 1)], epoch="first")
    sequencer.forget_worker(W)
    del registered[W]
    tree.remove_worker(W)
    registered[W] = range(1)
    assert sequencer.observe_epoch(W, "second")
    sequencer.ingest([store(2, 2, parent=1)], epoch="first")
    sequencer.ingest([store(1, 5), store(2, 6, parent=5)], epoch="second")
    assert tree.find_matches([5, 6]).scores == {(W, 0): 2}
    assert tree.find_matches([1]).scores == {}
    assert sequencer.outcomes["stale_epoch"] == 1 and sequencer.outcomes["publisher_restarts"] == 0
    assert sequencer.epochs() == {W: "second"} and sequencer.status()[0].trusted


def test_a_forgotten_worker_that_comes_back_as_the_same_process_keeps_its_epoch() -> None:
    # A lease expired (or the publisher withdrew) and the same process heartbeats again.
    sequencer, tree = synced(0)
    sequencer.observe_epoch(W, "first")
    sequencer.forget_worker(W)
    tree.remove_worker(W)
    assert sequencer.observe_epoch(W, "first")
    sequencer.ingest([store(2, 2)], epoch="first")  # its first event since: applied, a dump asked for
    assert tree.find_matches([2]).scores == {(W, 0): 1}
    assert sequencer.outcomes["stale_epoch"] == 0 and sequencer.epochs() == {W: "first"}


def test_ids_that_went_down_are_replayed_once_the_registration_says_the_worker_restarted() -> None:
    sequencer, tree = synced(0)
    sequencer.observe_epoch(W, "first")
    sequencer.ingest([store(2, 2, parent=1), store(3, 3, parent=2)])
    sequencer.ingest([store(1, 8), store(2, 9, parent=8)])  # no epoch on the events: duplicates for now
    assert tree.find_matches([8]).scores == {}
    sequencer.observe_epoch(W, "second")  # the registration of the restarted process
    assert tree.find_matches([1]).scores == {}
    assert tree.find_matches([8, 9]).scores == {(W, 0): 2}
    sequencer.ingest([store(3, 10, parent=9)])
    assert tree.find_matches([8, 9, 10]).scores == {(W, 0): 3}
    assert sequencer.status()[0].trusted


def test_worker_that_lost_the_events_is_asked_for_a_dump_which_replaces_the_rank() -> None:
    sequencer, tree = synced(0)
    request = sequencer.receive(store(9, 9))
    assert request is not None
    too_new = ResyncResponse(too_new=ResyncTooNew(requested_start=2, requested_end=8, newest_available=1))
    follow_up = sequencer.resync_done(request, too_new)
    assert follow_up is not None and follow_up.start_event_id is None
    dump = [store(0, 7), store(1, 8, parent=7)]
    assert sequencer.resync_done(follow_up, ResyncResponse(tree_dump=ResyncBatch(events=dump, last_event_id=8))) is None
    # Block 1 (from before) is gone: the dump replaced the rank's state; event 9 applied after it.
    assert tree.find_matches([1]).scores == {}
    assert tree.find_matches([7, 8]).scores == {(W, 0): 2}
    assert tree.find_matches([9]).scores == {(W, 0): 1}


def test_cleared_is_a_barrier_that_cancels_a_resync_in_flight() -> None:
    sequencer, tree = synced(0)
    request = sequencer.receive(store(5, 5))
    assert request is not None
    assert sequencer.receive(RouterEvent(W, cleared_event(6))) is None
    assert sequencer.receive(store(7, 70)) is None
    stale = sequencer.resync_done(
        request, ResyncResponse(tree_dump=ResyncBatch(events=[store(0, 99)], last_event_id=4))
    )
    assert stale is None
    assert sequencer.outcomes["resync_stale"] == 1
    assert tree.find_matches([99]).scores == {}
    assert tree.find_matches([1]).scores == {}
    assert tree.find_matches([70]).scores == {(W, 0): 1}
    assert sequencer.status()[0].last_event_id == 7


def host(event_id: int, block: int | None = None) -> RouterEvent:
    """A host-tier store of ``block``, or (None) a host-tier clear."""
    data = cleared_event(event_id) if block is None else stored_event(event_id, [(block, block)])
    return RouterEvent(W, data, storage_tier=StorageTier.HOST_PINNED)


def test_a_clear_of_one_tier_is_no_barrier_while_another_holds_blocks() -> None:
    sequencer, tree = synced(0)
    assert sequencer.receive(host(2, 20)) is None
    request = sequencer.receive(store(5, 5))  # events 3 and 4 (device blocks) were lost
    assert request is not None and (request.start_event_id, request.end_event_id) == (3, 4)
    assert sequencer.receive(host(6)) is None  # the host tier only: the device's hole stays
    [status] = sequencer.status()
    assert (status.trusted, status.resyncing) == (False, True)
    missing = ResyncBatch(events=[store(3, 3, parent=1), store(4, 4, parent=3)], last_event_id=4)
    assert sequencer.resync_done(request, ResyncResponse(events=missing)) is None
    assert tree.find_matches([1, 3, 4]).scores == {(W, 0): 3}
    assert tree.find_matches([20]).tier_hits == {}
    assert sequencer.status()[0].trusted and sequencer.outcomes["resync_cancelled"] == 0


def test_a_clear_is_a_barrier_once_the_other_tiers_were_cleared_in_order() -> None:
    sequencer, tree = synced(0)
    sequencer.ingest([host(2, 20), host(3)])  # the host tier held blocks, then cleared them in order
    request = sequencer.receive(store(5, 5))
    assert request is not None
    assert sequencer.receive(RouterEvent(W, cleared_event(6))) is None  # the device tier: all it holds
    assert sequencer.status()[0].trusted and sequencer.outcomes["resync_cancelled"] == 1
    assert tree.find_matches([1]).scores == {} and tree.find_matches([5]).scores == {}


def test_unanswered_resync_keeps_what_was_applied_best_effort() -> None:
    sequencer, tree = synced(0)
    request = sequencer.receive(store(3, 3))
    assert request is not None
    sequencer.receive(store(4, 4, parent=3))
    sequencer.resync_failed(request)
    assert tree.find_matches([3, 4]).scores == {(W, 0): 2}
    assert not sequencer.status()[0].trusted


def test_ranks_are_independent_streams() -> None:
    sequencer, tree = synced(0)
    request = sequencer.receive(store(3, 10, rank=1))  # rank 1 joins mid-stream: it asks for a dump
    assert request is not None and request.dp_rank == 1
    assert sequencer.receive(store(2, 2, parent=1)) is None  # rank 0 keeps flowing
    assert tree.find_matches([1, 2]).scores == {(W, 0): 2}


def test_events_of_unknown_workers_are_counted_and_dropped() -> None:
    tree = RadixTree()
    sequencer = EventSequencer(tree, worker_ranks=lambda worker_id: None if worker_id == W else range(1))
    assert sequencer.receive(store(1, 1)) is None
    assert sequencer.outcomes["rejected_unknown_worker"] == 1
    assert tree.stats().nodes == 0


def test_events_of_many_unknown_workers_are_counted_in_bounded_memory() -> None:
    """A sender stamping a new worker id on each event: every one is refused and counted, and the
    per-worker count (which the doctor reports) keeps at most MAX_UNKNOWN_WORKERS of them."""
    tree = RadixTree()
    sequencer = EventSequencer(tree, worker_ranks=lambda worker_id: None)
    for worker_id in range(MAX_UNKNOWN_WORKERS + 500):
        assert sequencer.receive(RouterEvent(worker_id, stored_event(1, [(1, 1)]))) is None
    assert sequencer.outcomes["rejected_unknown_worker"] == MAX_UNKNOWN_WORKERS + 500
    assert len(sequencer.unknown_worker_events) == MAX_UNKNOWN_WORKERS
    assert sequencer.receive(RouterEvent(0, stored_event(2, [(1, 1)]))) is None  # one counted goes on counting
    assert sequencer.unknown_worker_events[0] == 2 and tree.stats().nodes == 0


def test_events_of_ranks_a_worker_lacks_are_counted_and_dropped() -> None:
    """Each rank is a stream and a slot in the index: a worker of two ranks (2 and 3) naming rank 0 or
    3000 would make phantom ranks that every decision then scores."""
    tree = RadixTree()
    sequencer = EventSequencer(tree, worker_ranks=lambda worker_id: range(2, 4))
    for rank in (0, 3000, 4):
        assert sequencer.receive(store(1, 1, rank=rank)) is None
    assert sequencer.outcomes["rejected_unknown_dp_rank"] == 3
    assert tree.stats().nodes == 0 and not sequencer.status()
    assert sequencer.receive(store(1, 1, rank=3)) is None
    assert tree.find_matches([1]).scores == {(W, 3): 1}


def test_a_resync_answer_changes_only_the_stream_it_answers() -> None:
    """A dump (or a replay) for worker W's rank 0 that carries another worker's or rank's events, a
    'cleared' among them, leaves those alone: refused and counted."""
    sequencer, tree = synced(0)
    other = RouterEvent(W + 1, stored_event(1, [(9, 9)]))
    assert sequencer.receive(other) is None
    assert sequencer.receive(store(1, 8, rank=1)) is None
    request = sequencer.receive(store(5, 5))  # W rank 0 skips ahead: a dump is asked for
    assert request is not None and (request.worker_id, request.dp_rank) == (W, 0)
    foreign = [RouterEvent(W + 1, cleared_event(0)), store(0, 1), RouterEvent(W, cleared_event(0, dp_rank=1))]
    sequencer.resync_done(request, ResyncResponse(tree_dump=ResyncBatch(events=foreign, last_event_id=4)))
    assert sequencer.outcomes["rejected_resync_foreign"] == 2
    assert tree.find_matches([9]).scores == {(W + 1, 0): 1}
    assert tree.find_matches([8]).scores == {(W, 1): 1}
    assert tree.find_matches([1]).scores == {(W, 0): 1}


def test_index_rejections_are_counted_by_reason() -> None:
    sequencer, _ = synced(0)
    sequencer.receive(store(2, 5, parent=77))
    sequencer.receive(remove(3, 55))
    assert sequencer.outcomes["rejected_parent_block_not_found"] == 1
    assert sequencer.outcomes["rejected_block_not_found"] == 1
    assert sequencer.status()[0].last_event_id == 3


def test_too_many_unreconciled_events_fall_back_to_a_fresh_dump() -> None:
    tree = RadixTree()
    sequencer = EventSequencer(tree, max_held_events=3)
    first = sequencer.receive(store(2, 1))
    assert first is not None
    for event_id in (3, 4):
        assert sequencer.receive(store(event_id, event_id)) is None
    overflow = sequencer.receive(store(5, 5))
    assert overflow is not None and overflow.start_event_id is None
    assert held_blocks(tree) == 4  # all routable meanwhile
    assert sequencer.resync_done(first, ResyncResponse(tree_dump=ResyncBatch(events=[], last_event_id=4))) is None
    assert sequencer.outcomes["resync_stale"] == 1
    dump = [store(0, n) for n in (1, 3, 4, 5)]
    sequencer.resync_done(overflow, ResyncResponse(tree_dump=ResyncBatch(events=dump, last_event_id=5)))
    assert held_blocks(tree) == 4
    assert sequencer.status()[0].trusted


def test_absurdly_large_events_are_rejected_and_the_stream_distrusted() -> None:
    tree = RadixTree()
    sequencer = EventSequencer(tree, max_event_blocks=4)
    assert sequencer.receive(store(1, 1)) is None
    huge = RouterEvent(W, stored_event(2, [(100 + i, 100 + i) for i in range(5)], parent_hash=1))
    assert sequencer.receive(huge) is None
    assert sequencer.outcomes["rejected_oversized_event"] == 1
    assert tree.find_matches([1, 100]).scores == {(W, 0): 1}
    [status] = sequencer.status()
    assert (status.last_event_id, status.trusted) == (2, False)
    assert sequencer.receive(store(3, 2, parent=1)) is None  # the stream goes on
    assert tree.find_matches([1, 2]).scores == {(W, 0): 2}


def test_an_oversized_first_event_or_dump_event_leaves_the_stream_untrusted() -> None:
    huge = [(100 + i, 100 + i) for i in range(5)]
    sequencer = EventSequencer(RadixTree(), max_event_blocks=4)
    assert sequencer.receive(RouterEvent(W, stored_event(1, huge))) is None  # its first event, refused
    assert not sequencer.status()[0].trusted and sequencer.outcomes["rejected_oversized_event"] == 1
    sequencer = EventSequencer(RadixTree(), max_event_blocks=4)
    request = sequencer.receive(store(5, 5))
    assert request is not None
    dump = ResyncBatch(events=[RouterEvent(W, stored_event(0, huge))], last_event_id=4)
    assert sequencer.resync_done(request, ResyncResponse(tree_dump=dump)) is None
    assert not sequencer.status()[0].trusted and sequencer.outcomes["rejected_oversized_event"] == 1


def test_a_snapshot_is_restored_through_the_sequencer_and_its_streams_resume_where_it_left_them() -> None:
    tree = RadixTree()
    sequencer = EventSequencer(tree)
    snapshot = [store(0, 1), store(0, 2, parent=1), RouterEvent(7, stored_event(0, [(9, 9)])), store(0, 5, parent=4)]
    positions = [(W, 0, 12, True), (7, 0, 3, False)]
    assert sequencer.restore_snapshot(snapshot, positions) == 3
    assert tree.find_matches([1, 2]).scores == {(W, 0): 2}
    assert tree.find_matches([9]).scores == {(7, 0): 1}
    # A block under a parent the snapshot does not hold is refused and counted, not raised.
    assert sequencer.outcomes["snapshot_applied"] == 3
    assert sequencer.outcomes["rejected_parent_block_not_found"] == sequencer.rejected == 1
    assert [(s.worker_id, s.last_event_id, s.trusted) for s in sequencer.status()] == [(7, 3, False), (W, 12, True)]
    assert sequencer.untrusted == {(7, 0)}
    # The streams go on from there: 13 applies, 12 is a duplicate.
    assert sequencer.receive(store(13, 3, parent=2)) is None
    sequencer.receive(store(12, 8))
    assert sequencer.outcomes["duplicate"] == 1
    assert tree.find_matches([1, 2, 3]).scores == {(W, 0): 3}


def test_the_transports_count_undecodable_payloads_and_unanswered_resyncs_through_the_sequencer() -> None:
    sequencer, _ = synced(last=0)
    sequencer.count_undecodable()
    sequencer.count_undecodable(resync_reply=True)
    sequencer.count_oversized_resync()
    request = sequencer.receive(store(3, 3))  # a gap: a range resync
    assert request is not None
    sequencer.resync_failed(request, no_responders=True)
    assert (
        sequencer.outcomes["rejected_undecodable"],
        sequencer.outcomes["rejected_undecodable_resync"],
        sequencer.outcomes["rejected_oversized_resync"],
        sequencer.outcomes["resync_no_responders"],
        sequencer.outcomes["resync_failed"],
    ) == (1, 1, 1, 1, 1)


def test_a_stream_opened_by_a_resync_has_heard_from_its_worker_only_once_events_came() -> None:
    def registered_and_asked() -> tuple[EventSequencer, ResyncRequest]:
        sequencer = EventSequencer(RadixTree())
        request = sequencer.request_full_resync(W, 0)  # what a NATS registration asks at once
        assert request is not None and not sequencer.heard_from(W, 0)
        return sequencer, request

    unanswered, request = registered_and_asked()
    unanswered.resync_failed(request, no_responders=True)
    assert not unanswered.heard_from(W, 0)
    empty, request = registered_and_asked()
    empty.resync_done(request, ResyncResponse(tree_dump=ResyncBatch(events=[], last_event_id=0)))
    assert not empty.heard_from(W, 0)  # the engine never sent one: nothing is wired to it
    evicted, request = registered_and_asked()  # events once, every block evicted since
    evicted.resync_done(request, ResyncResponse(tree_dump=ResyncBatch(events=[], last_event_id=7)))
    assert evicted.heard_from(W, 0)
    dumped, request = registered_and_asked()
    dumped.resync_done(request, ResyncResponse(tree_dump=ResyncBatch(events=[store(0, 40)], last_event_id=1)))
    assert dumped.heard_from(W, 0)
    unanswered.ingest([store(1, 1)])  # and the first live event
    assert unanswered.heard_from(W, 0) and not unanswered.heard_from(W, 1)
    restored = EventSequencer(RadixTree())
    restored.restore_snapshot([], [(W, 0, 3, True), (W, 1, None, False)])
    assert restored.heard_from(W, 0) and not restored.heard_from(W, 1)


# ------------------------------------------------------------------ ids far ahead of the publisher
FAR = 999  # the block an event far ahead of its publisher's numbering stores


def published(n: int) -> list[RouterEvent]:
    """A publisher's events 1..n: event i stores block i under block i - 1."""
    return [store(i, i, parent=i - 1 if i > 1 else None) for i in range(1, n + 1)]


def test_an_id_far_ahead_is_refused_its_removal_undone_and_the_publishers_next_events_apply() -> None:
    events = published(8)
    sequencer, tree = synced(0)
    sequencer.ingest(events[1:5])
    far = RouterEvent(W, removed_event(5 + 10**6, [3]))  # a buggy publisher: its last id + 10**6
    request = sequencer.receive(far)
    assert request == ResyncRequest(worker_id=W, dp_rank=0, start_event_id=6, end_event_id=5 + 10**6 - 1)
    assert tree.find_matches([1, 2, 3]).scores == {(W, 0): 2}  # applied ahead, as any gap's event
    # The replay stops at 5, short of the end asked for: the publisher numbered no further.
    dump_request = sequencer.resync_done(request, answer(events, request, 5, 64))
    assert dump_request is not None and dump_request.start_event_id is None
    assert sequencer.outcomes["rejected_id_ahead_of_publisher"] == sequencer.rejected == 1
    assert sequencer.recent_rejections[-1].startswith(f"worker {W} event {5 + 10**6}: id ahead of its publisher")
    assert sequencer.status()[0].last_event_id == 5
    assert sequencer.receive(events[5]) is None  # its next event applies: no duplicate of the far id
    assert sequencer.status()[0].last_event_id == 6 and sequencer.outcomes["duplicate"] == 0
    assert sequencer.resync_done(dump_request, answer(events, dump_request, 5, 64)) is None
    assert tree.find_matches(list(range(1, 7))).scores == {(W, 0): 6}  # the dump brought block 3 back
    sequencer.ingest(events[6:])
    assert tree.find_matches(list(range(1, 9))).scores == {(W, 0): 8}
    [status] = sequencer.status()
    assert (status.last_event_id, status.trusted, status.resyncing) == (8, True, False)
    assert sequencer.outcomes["duplicate"] == 0 and sequencer.rejected == 1


def test_a_first_event_far_ahead_is_refused_by_the_dump_a_late_router_asks_for() -> None:
    events = published(6)
    tree = RadixTree()
    sequencer = EventSequencer(tree)
    request = sequencer.receive(store(U64_MAX, FAR))  # the first event heard: the router joined late
    assert request is not None and request.start_event_id is None
    assert sequencer.resync_done(request, answer(events, request, 5, 64)) is None  # no further question
    assert tree.find_matches([FAR]).scores == {}
    assert tree.find_matches(list(range(1, 6))).scores == {(W, 0): 5}
    assert sequencer.outcomes["rejected_id_ahead_of_publisher"] == 1
    assert sequencer.receive(events[5]) is None
    assert tree.find_matches(list(range(1, 7))).scores == {(W, 0): 6}
    [status] = sequencer.status()
    assert (status.last_event_id, status.trusted) == (6, True)


def test_an_id_far_ahead_costs_two_resyncs_not_a_loop() -> None:
    """Each round the publisher answers what it was asked, then sends its next event: the far id
    costs a replay (which shows it unnumbered) and the dump that clears it, then nothing more."""
    now = [0.0]
    tree = RadixTree()
    sequencer = EventSequencer(tree, retry_interval_s=15.0, clock=lambda: now[0])
    asked: list[ResyncRequest] = []
    sequencer.resync_transport = asked.append
    events = published(30)
    sequencer.ingest(events[:5])
    sequencer.ingest([store(U64_MAX, FAR)])
    position, answered = 5, 0
    for _ in range(20):
        pending, answered = asked[answered:], len(asked)
        for request in pending:
            follow_up = sequencer.resync_done(request, answer(events, request, position, 64))
            if follow_up is not None:
                sequencer.send_resync(follow_up)
        sequencer.ingest([events[position]])
        position += 1
        now[0] += 1.0
        asked.extend(sequencer.due_retries())
    assert [request.start_event_id for request in asked] == [6, None]
    assert tree.find_matches([FAR]).scores == {}
    assert tree.find_matches(list(range(1, 26))).scores == {(W, 0): 25}
    assert sequencer.outcomes["rejected_id_ahead_of_publisher"] == sequencer.rejected == 1
    now[0] += 1000.0
    assert sequencer.status()[0].trusted and sequencer.due_retries() == []


def test_when_the_dump_that_clears_an_id_far_ahead_goes_unanswered_it_is_asked_again_on_the_slow_schedule() -> None:
    now = [0.0]
    tree = RadixTree()
    sequencer = EventSequencer(tree, retry_interval_s=30.0, clock=lambda: now[0])
    events = published(7)
    for event in events[:5]:
        assert sequencer.receive(event) is None
    # Far ahead, and under a parent the worker does not hold: held (deferred) by the index for now.
    request = sequencer.receive(store(U64_MAX, FAR, parent=777))
    assert request is not None
    dump_request = sequencer.resync_done(request, answer(events, request, 5, 64))
    assert dump_request is not None
    sequencer.resync_failed(dump_request)  # a timeout
    assert not sequencer.status()[0].trusted
    assert sequencer.receive(events[5]) is None  # not blind meanwhile: the next real event applies
    assert tree.find_matches(list(range(1, 7))).scores == {(W, 0): 6}
    assert sequencer.due_retries() == []  # nothing asked again at once
    now[0] += 30.0
    [retry] = sequencer.due_retries()
    assert retry.start_event_id is None
    assert sequencer.resync_done(retry, answer(events, retry, 7, 64)) is None
    assert tree.find_matches(list(range(1, 8))).scores == {(W, 0): 7}
    assert sequencer.status()[0].trusted
    # Counted once, as refused for its id: not again as held when the stream gave up.
    assert sequencer.rejected == sequencer.outcomes["rejected_id_ahead_of_publisher"] == 1


def test_an_id_far_ahead_given_up_on_is_undone_by_the_first_dump_that_answers() -> None:
    """Nobody answered: the far id passes for the stream's newest, and the publisher's next events for
    duplicates, until the slow schedule's dump says how far the publisher numbered."""
    now = [0.0]
    tree = RadixTree()
    sequencer = EventSequencer(tree, retry_interval_s=30.0, clock=lambda: now[0])
    events = published(8)
    for event in events[:5]:
        assert sequencer.receive(event) is None
    request = sequencer.receive(store(U64_MAX, FAR))
    assert request is not None
    sequencer.resync_failed(request, no_responders=True)
    now[0] += 30.0
    [retry] = sequencer.due_retries()
    assert sequencer.resync_done(retry, answer(events, retry, 6, 64)) is None
    assert tree.find_matches([FAR]).scores == {}
    sequencer.ingest(events[6:])
    assert tree.find_matches(list(range(1, 9))).scores == {(W, 0): 8}
    [status] = sequencer.status()
    assert (status.last_event_id, status.trusted) == (8, True)


def test_events_heard_after_a_dump_was_asked_for_stay_even_past_a_hole() -> None:
    """A dump taken before events the router heard since the request: they are newer, not unnumbered;
    the hole below them (a lost event) is a new question, asked at once."""
    events = [store(i, i) for i in range(1, 9)]
    tree = RadixTree()
    sequencer = EventSequencer(tree)
    request = sequencer.receive(events[4])  # joined late: event 5 first
    assert request is not None and request.start_event_id is None
    assert sequencer.receive(events[5]) is None
    assert sequencer.receive(events[7]) is None  # event 7 was lost
    follow_up = sequencer.resync_done(request, answer(events, request, 5, 64))
    assert follow_up == ResyncRequest(worker_id=W, dp_rank=0, start_event_id=7, end_event_id=7)
    assert sequencer.resync_done(follow_up, answer(events, follow_up, 8, 64)) is None
    assert [tree.find_matches([block]).scores for block in range(1, 9)] == [{(W, 0): 1}] * 8
    assert sequencer.status()[0].trusted and sequencer.rejected == 0

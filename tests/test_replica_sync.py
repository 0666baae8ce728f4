"""Replica sync on a real nats-server: routers in one process, each with its own NATS connection.

The differential check: after every step and a moment of quiet, every replica's ``potential_loads``
for a set of prompts equal those of one reference router that received every call itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from router.config import RouterConfig
from router.event_plane import parts
from router.event_plane.connection import NatsOptions, connect
from router.event_plane.embedded_server import EmbeddedNats
from router.event_plane.subjects import Subjects
from router.kv_router import KvRouter
from router.replicas.messages import Booked, Freed, StateReply, SyncBatch, sync_decoder
from router.replicas.sync import ReplicaSync
from router.request_ids import new_request_id
from router.types import PotentialLoad, RouteRequest, WorkerConfig
from tests.test_api_support import prompt
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

# No computed-prompt credit: it lasts a second from each router's own first-token mark, so a decision near
# its end could see it where the reference, deciding on its own, does not (a replica booked a prompt with
# 0 prefill tokens where the reference had 32, once in 40 runs beside another test run); its replication is
# tests/test_computed_prompt_credit.py's.
CONFIG = RouterConfig(block_size=16, computed_prompt_credit_secs=0)
WORKERS = [WorkerConfig(worker_id=w, dp_size=2) for w in (1, 2, 3)]
# A few families of prompts sharing prefixes, so bookings share blocks.
PROMPTS = [prompt(seed % 4, 32) + prompt(seed, 16 * (1 + seed % 5)) for seed in range(12)]


def new_router(clock: Callable[[], float] = time.monotonic) -> KvRouter:
    router = KvRouter(CONFIG, rng=random.Random(0), clock=clock)
    for worker in WORKERS:
        router.register_worker(worker)
    return router


class Replica:
    def __init__(self, router: KvRouter, nc: Client, sync: ReplicaSync) -> None:
        self.router, self.nc, self.sync = router, nc, sync


@contextlib.asynccontextmanager
async def replica(
    url: str,
    *,
    lease_s: float = 10.0,
    heartbeat_s: float = 0.1,
    state_timeout_s: float = 2.0,
    clock: Callable[[], float] = time.monotonic,
) -> AsyncIterator[Replica]:
    """A router (its bookings expiring by ``clock``) and its replica sync on its own NATS connection."""
    nc = await connect(NatsOptions(url))
    router = new_router(clock)
    sync = ReplicaSync(router, nc, lease_s=lease_s, heartbeat_s=heartbeat_s, state_timeout_s=state_timeout_s)
    await sync.start()
    try:
        yield Replica(router, nc, sync)
    finally:
        await sync.stop()
        await nc.close()


def loads(router: KvRouter) -> list[list[PotentialLoad]]:
    return [router.potential_loads(tokens) for tokens in PROMPTS]


def bookings(router: KvRouter) -> dict[str, tuple[object, ...]]:
    """Per active request what the policies read beside the loads: the prompt and output lengths too."""
    return {
        request_id: (booking.key, booking.prefill_tokens, booking.context_tokens, booking.expected_output_tokens)
        for request_id, booking in router.bookings()
    }


async def agree(replicas: list[Replica], reference: KvRouter) -> None:
    """Until every replica's loads and bookings are the reference's."""

    differences: list[str] = []

    def same() -> bool:
        expected_loads, expected_bookings = loads(reference), bookings(reference)
        differences.clear()
        for index, r in enumerate(replicas):
            held = bookings(r.router)
            if held != expected_bookings:
                extra = {k: v for k, v in held.items() if expected_bookings.get(k) != v}
                missing = {k: v for k, v in expected_bookings.items() if held.get(k) != v}
                differences.append(f"replica {index} bookings: has {extra}, lacks {missing}")
            differences.extend(
                f"replica {index} loads of prompt {at}: {got} against {want}"
                for at, (got, want) in enumerate(zip(loads(r.router), expected_loads, strict=True))
                if got != want
            )
        return not differences

    try:
        await eventually(same, 30, "the replicas agree")
    except AssertionError:
        raise AssertionError("the replicas never agreed: " + "; ".join(differences[:6])) from None


@contextlib.asynccontextmanager
async def sync_lost(target: Replica, *, heartbeats: bool = False) -> AsyncIterator[None]:
    """Inside, ``target`` publishes nothing: its batches (and with ``heartbeats`` its heartbeats too, as
    if it hung) are numbered and then lost on the way."""
    real = target.nc.publish
    lost = {"batch", "beat"} if heartbeats else {"batch"}

    async def lose(subject: str, payload: bytes = b"", reply: str = "", headers: dict[str, str] | None = None) -> None:
        if subject == target.sync.subjects.router_sync and msgspec.msgpack.decode(payload)["type"] in lost:
            return
        await real(subject, payload, reply, headers)

    target.nc.publish = lose  # type: ignore[method-assign,assignment]
    try:
        yield
        await target.sync.drained()  # what was queued inside is published (and lost) inside
    finally:
        target.nc.publish = real  # type: ignore[method-assign]


async def random_steps(replicas: list[Replica], reference: KvRouter, rng: random.Random, steps: int) -> None:
    active: list[str] = []
    for step in range(steps):
        action = rng.random()
        if action < 0.5 or not active:
            request_id = f"r{step}-{rng.randrange(1 << 30)}"
            tokens = rng.choice(PROMPTS)
            request = RouteRequest(tokens=tokens, request_id=request_id, expected_output_tokens=16 + step)
            decision = await rng.choice(replicas).router.new(request)
            pin = (decision.worker_id, decision.dp_rank)
            await reference.new(request, pinned_worker=pin)
            active.append(request_id)
        else:
            # Marks go to any replica, not the one that booked (request ids are global).
            request_id = rng.choice(active)
            target = rng.choice(replicas).router
            if action < 0.75:
                await eventually(lambda: target.booking(request_id) is not None, 30)  # noqa: B023
                assert target.mark_prefill(request_id)
                reference.mark_prefill(request_id)
            else:
                await eventually(lambda: target.booking(request_id) is not None, 30)  # noqa: B023
                assert target.mark_free(request_id)
                reference.mark_free(request_id)
                active.remove(request_id)
        await agree(replicas, reference)


async def test_three_replicas_agree_with_one_router_that_saw_every_call(nats_server: EmbeddedNats) -> None:
    reference = new_router()
    async with replica(nats_server.url) as a, replica(nats_server.url) as b, replica(nats_server.url) as c:
        await random_steps([a, b, c], reference, random.Random(7), 120)
        assert sum(r.sync.outcomes["gap"] for r in (a, b, c)) == 0


async def test_a_late_joiner_learns_the_bookings_and_lost_batches_are_repaired(nats_server: EmbeddedNats) -> None:
    reference = new_router()
    rng = random.Random(11)
    async with replica(nats_server.url) as a, replica(nats_server.url) as b:
        await random_steps([a, b], reference, rng, 40)
        async with replica(nats_server.url) as late:
            assert late.sync.outcomes["joined"] == 1
            await agree([a, b, late], reference)
            async with sync_lost(a):  # a's changes reach nobody ...
                await random_steps([a], reference, rng, 15)
            # ... until the gap its next batch or heartbeat shows makes each peer ask a for its view.
            await agree([a, b, late], reference)
            assert b.sync.outcomes["repaired"] >= 1 and late.sync.outcomes["repaired"] >= 1
            await random_steps([a, b, late], reference, rng, 30)


async def test_a_silent_replica_loses_its_bookings_after_its_lease(nats_server: EmbeddedNats) -> None:
    # A lease of 15 heartbeats: a loaded machine's stalls do not expire a replica that still beats.
    async with replica(nats_server.url, lease_s=1.5) as a, replica(nats_server.url, lease_s=1.5) as b:
        await b.router.new(RouteRequest(tokens=PROMPTS[0], request_id="on-b"))
        await a.router.new(RouteRequest(tokens=PROMPTS[1], request_id="on-a"))
        await eventually(lambda: a.router.booking("on-b") is not None and b.router.booking("on-a") is not None)
        async with sync_lost(b, heartbeats=True):  # b hangs: no heartbeats, no batches
            await eventually(lambda: a.router.booking("on-b") is None, 30, "a drops the silent b's booking")
        assert a.sync.outcomes["peer_expired"] == 1
        assert [request_id for request_id, _ in a.router.bookings()] == ["on-a"]  # its own stay
        assert sum(load.active_requests for load in a.router.potential_loads(PROMPTS[0])) == 1


async def test_a_replica_is_heard_of_as_it_starts_and_marks_of_its_bookings_are_passed_on_at_once(
    nats_server: EmbeddedNats,
) -> None:
    """A replica beats as it starts, not a heartbeat later: until a replica has heard of a peer, a mark
    for an id it does not hold is the client's 404 (as on a lone router), and a booking the new replica
    made, freed on the old one before its batch arrived, leaked for 300 s."""
    async with replica(nats_server.url, heartbeat_s=60) as old, replica(nats_server.url, heartbeat_s=60) as new:
        await eventually(lambda: old.sync.peers == [new.sync.replica_id], 10, "the old replica hears of it")
        assert old.router.pass_mark_to_replicas("booked-on-new", free=True)


async def test_a_replica_that_stops_cleanly_takes_its_bookings_at_once(nats_server: EmbeddedNats) -> None:
    async with replica(nats_server.url) as a:
        async with replica(nats_server.url) as b:
            await b.router.new(RouteRequest(tokens=PROMPTS[0], request_id="x"))
            await eventually(lambda: a.router.booking("x") is not None)
        # Within the 10 s lease; the outcome tells a leave from an expiry, however slow the machine.
        await eventually(lambda: a.router.booking("x") is None, 30, "a drops the leaving b's booking")
        assert a.sync.outcomes["peer_left"] == 1 and a.sync.outcomes["peer_expired"] == 0


async def test_a_view_answered_by_a_peer_as_it_leaves_does_not_bring_its_bookings_back(
    nats_server: EmbeddedNats,
) -> None:
    """A peer asked for its view (a gap repair) answers and stops: its leaving beat can be read before its
    answer (another subscription; a request it took before unsubscribing is answered after the beat).
    The answer, older than the leave, brings back neither the peer nor its bookings."""
    async with replica(nats_server.url, state_timeout_s=60) as a:  # a's ask waits for the held answer
        nc = await connect(NatsOptions(nats_server.url))
        router = new_router()
        p = Replica(router, nc, ReplicaSync(router, nc, heartbeat_s=0.1))
        await p.sync.start()
        try:
            await p.router.new(RouteRequest(tokens=PROMPTS[0], request_id="x"))
            await eventually(lambda: a.router.booking("x") is not None)
            real, held = nc.publish, []

            async def hold_replies(subject: str, payload: bytes = b"", *args: Any) -> None:
                if subject.startswith("_INBOX."):  # p's answer to a's ask, on its way
                    held.append((subject, payload))
                    return
                await real(subject, payload, *args)

            nc.publish = hold_replies  # type: ignore[method-assign,assignment]
            async with sync_lost(p):
                await p.router.new(RouteRequest(tokens=PROMPTS[1], request_id="y"))  # lost: a gap
            await p.router.new(RouteRequest(tokens=PROMPTS[2], request_id="z"))  # a sees the gap, asks p
            await eventually(lambda: len(held) == 1, 30, "p answers a's ask")
            await p.sync.stop()  # leaving: a drops p's bookings
            await eventually(lambda: a.sync.outcomes["peer_left"] == 1 and not bookings(a.router), 30, "a drops p")
            for subject, payload in held:  # the answer arrives after the leave
                await real(subject, payload)
            await eventually(lambda: a.sync.outcomes["repaired"] == 1, 30, "a merges the answer")
            assert bookings(a.router) == {} and a.sync.peers == []
        finally:
            await p.sync.stop()  # again when the test failed before it: its leaving beat is sent again
            await nc.close()


async def test_a_clean_stop_lets_the_batch_being_published_go_out(nats_server: EmbeddedNats) -> None:
    """A free told to the replica that is stopping, of a request another replica booked, still reaches
    that replica: the stop waits for the outbox to drain instead of cancelling the batch on its way."""
    async with replica(nats_server.url) as b:
        await b.router.new(RouteRequest(tokens=PROMPTS[0], request_id="booked-on-b"))
        async with replica(nats_server.url) as a:
            await eventually(lambda: a.router.booking("booked-on-b") is not None)
            real, gate, held = a.nc.publish, asyncio.Event(), []

            async def slow(subject: str, payload: bytes = b"", *args: Any) -> None:
                if subject == a.sync.subjects.router_sync and msgspec.msgpack.decode(payload)["type"] == "batch":
                    held.append(payload)
                    await gate.wait()  # a slow server: the batch is on its way when the stop begins
                await real(subject, payload, *args)

            a.nc.publish = slow  # type: ignore[method-assign,assignment]
            assert a.router.mark_free("booked-on-b")
            await eventually(lambda: len(held) == 1)
            stopping = asyncio.create_task(a.sync.stop())
            await eventually(lambda: a.router.booking_listener is None)  # the stop has begun
            assert not stopping.done()  # ... and waits for the batch
            gate.set()
            await stopping
            a.nc.publish = real  # type: ignore[method-assign]
            await eventually(lambda: b.router.booking("booked-on-b") is None, 30, "b hears the free a was told")
            assert a.sync.outcomes["published"] == 1


async def test_undecodable_sync_messages_are_counted_and_ignored(nats_server: EmbeddedNats, client: Client) -> None:
    reference = new_router()
    async with replica(nats_server.url) as a, replica(nats_server.url) as b:
        await client.publish(a.sync.subjects.router_sync, b"\xc1 not msgpack")
        await client.publish(a.sync.subjects.router_sync, msgspec.msgpack.encode({"type": "batch", "seq": "x"}))
        await client.publish(a.sync.subjects.router_sync, b"\x81\xa1x" * 50_000)  # nested past msgspec's depth
        await random_steps([a, b], reference, random.Random(3), 10)
        assert a.sync.outcomes["rejected_undecodable"] == 3


async def test_a_request_freed_before_its_booking_went_out_reaches_no_peer(nats_server: EmbeddedNats) -> None:
    reference = new_router()
    async with replica(nats_server.url) as a, replica(nats_server.url) as b:
        # Booked, marked and freed in one loop turn: the publish loop has not run, nothing is sent.
        await a.router.new(RouteRequest(tokens=PROMPTS[0], request_id="short"))
        assert a.router.mark_prefill("short") and a.router.mark_free("short")
        decision = await a.router.new(RouteRequest(tokens=PROMPTS[1], request_id="kept"))
        await reference.new(RouteRequest(tokens=PROMPTS[1], request_id="kept"),
                            pinned_worker=(decision.worker_id, decision.dp_rank))  # fmt: skip
        await agree([a, b], reference)
        assert a.sync.outcomes["elided"] == 3  # booking, prefill mark, free
        assert a.sync.outcomes["published"] == 1 and b.sync.outcomes["applied"] == 1
        assert [request_id for request_id, _ in b.router.bookings()] == ["kept"]
        # a remembers it freed (its view says so to a late joiner); b never knew it: a mark there is unknown.
        assert "short" in a.sync.state().freed and not b.router.mark_free("short")
        # A request whose booking went out is freed on the peer by the free that follows it.
        assert a.router.mark_free("kept")
        reference.mark_free("kept")
        await agree([a, b], reference)
        assert b.sync.outcomes["applied"] == 2 and a.sync.outcomes["elided"] == 3


async def test_a_change_that_cannot_be_encoded_is_dropped_alone(nats_server: EmbeddedNats) -> None:
    """Defence in depth: every field is bounded where it enters, but a change that still cannot be
    encoded is counted and logged, and the rest of its batch reaches the peers."""
    reference = new_router()
    async with replica(nats_server.url) as a, replica(nats_server.url) as b:
        decision = await a.router.new(RouteRequest(tokens=PROMPTS[1], request_id="kept"))
        await reference.new(RouteRequest(tokens=PROMPTS[1], request_id="kept"),
                            pinned_worker=(decision.worker_id, decision.dp_rank))  # fmt: skip
        booking = a.router.booking("kept")
        assert booking is not None
        a.sync.booked("huge", booking._replace(expected_output_tokens=2**70), None)  # same loop turn: one batch
        await agree([a, b], reference)
        assert a.sync.outcomes["rejected_unencodable_change"] == 1
        assert a.sync.outcomes["published"] == 1 and b.sync.outcomes["applied"] == 1
        assert [request_id for request_id, _ in b.router.bookings()] == ["kept"]


# The sync wire types as peers before tuple-typed hashes declared them.
class OldBooked(msgspec.Struct, tag="booked", kw_only=True):
    request_id: str
    worker_id: int
    dp_rank: int
    hashes: list[int] | None
    private_blocks: int = 0
    prefill_tokens: int = 0


class OldFreed(msgspec.Struct, tag="freed", kw_only=True):
    request_id: str
    expired: bool = False


class OldBatch(msgspec.Struct, tag="batch", kw_only=True):
    replica_id: str
    seq: int
    sent_at_ms: int
    changes: list[OldBooked | OldFreed]


def test_sync_batches_keep_the_wire_shape_older_peers_decode() -> None:
    """Booking hashes are sent from the router's tuple; on the wire they stay the msgpack array an
    older peer (``hashes: list[int]``) decodes, and what it sends decodes here."""

    hashes = (2**64 - 1, 7, 2**63)
    new = SyncBatch(replica_id="r", seq=3, sent_at_ms=5, changes=[
        Booked(request_id="x", worker_id=1, dp_rank=2, hashes=hashes, private_blocks=1, prefill_tokens=9),
        Freed(request_id="y"),
    ])  # fmt: skip
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=OldBatch)
    assert old.changes == [
        OldBooked(request_id="x", worker_id=1, dp_rank=2, hashes=list(hashes), private_blocks=1, prefill_tokens=9),
        OldFreed(request_id="y"),
    ]
    assert sync_decoder().decode(msgspec.msgpack.encode(old)) == new


async def test_both_legs_of_a_disaggregated_request_reach_every_replica_and_leave_through_any(
    nats_server: EmbeddedNats,
) -> None:
    async with replica(nats_server.url) as a, replica(nats_server.url) as b:
        for router in (a.router, b.router):
            router.register_worker(WorkerConfig(worker_id=10, role="prefill"))
            router.register_worker(WorkerConfig(worker_id=11, role="decode"))
        request = RouteRequest(tokens=prompt(99, 512), request_id="pd")  # over the 256-token threshold
        decision = await a.router.new(request, pinned_worker=(11, 0), pinned_prefill=(10, 0))
        assert decision.disaggregation is not None and decision.disaggregation.path == "remote_prefill"
        await eventually(lambda: b.router.booking("pd") is not None and b.router.booking("pd#prefill") is not None)
        assert b.router.mark_prefill("pd")  # told to the replica that did not book it
        for router in (a.router, b.router):
            await eventually(lambda: router.booking("pd#prefill") is None)  # noqa: B023
        assert a.router.booking("pd") is not None
        assert b.router.mark_free("pd")
        await eventually(lambda: not list(a.router.bookings()) and not list(b.router.bookings()))


async def test_a_mark_ahead_of_its_booking_applies_everywhere_once_it_arrives(nats_server: EmbeddedNats) -> None:
    """A mark told to a replica the booking has not reached yet (each booked on a and marked on b in one
    loop turn, before a's batch went out) is kept there and passed on: the free frees the booking on a
    and b refuses it when it arrives, the prefill mark applies on both; a remote prefill leg goes with
    its request's free. A repeated free of an id freed lately is unknown, as on a lone router."""
    reference = new_router()
    async with replica(nats_server.url) as a, replica(nats_server.url) as b:
        for router in (a.router, b.router, reference):
            router.register_worker(WorkerConfig(worker_id=10, role="prefill", dp_size=2))
            router.register_worker(WorkerConfig(worker_id=11, role="decode", dp_size=2))
        for router in (a.router, reference):
            await router.new(RouteRequest(tokens=PROMPTS[0], request_id="freed"), pinned_worker=(1, 0))
            await router.new(RouteRequest(tokens=PROMPTS[1], request_id="prefilled"), pinned_worker=(2, 1))
        await a.router.new(RouteRequest(tokens=prompt(99, 512), request_id="pd"), pinned_worker=(11, 0))
        assert a.router.booking("pd#prefill") is not None
        assert not b.router.mark_free("freed") and b.router.pass_mark_to_replicas("freed", free=True)
        assert not b.router.mark_prefill("prefilled") and b.router.pass_mark_to_replicas("prefilled", free=False)
        assert b.router.pass_mark_to_replicas("pd", free=True)
        reference.mark_free("freed")
        reference.mark_prefill("prefilled")
        await agree([a, b], reference)
        assert b.sync.outcomes["booked_after_free"] >= 1
        assert not b.router.pass_mark_to_replicas("freed", free=True)  # freed here lately: a repeated free
        assert b.router.mark_free("prefilled")
        reference.mark_free("prefilled")
        await agree([a, b], reference)


async def book_and_free(target: Replica, count: int) -> None:
    """``count`` short requests booked and freed through ``target`` in one loop turn each (no batch goes
    out): ``target`` keeps a tombstone of each for the tombstone window, as under a steady load."""
    for _ in range(count):
        request_id = new_request_id()  # the router's own ids, as long as most clients'
        await target.router.new(RouteRequest(tokens=PROMPTS[1], request_id=request_id))
        assert target.router.mark_free(request_id)


async def test_a_view_larger_than_a_nats_message_reaches_peers_in_parts() -> None:
    # ~34 bytes per request freed in the tombstone window: at ~1,000 frees/s fleet-wide a view passes a
    # stock server's 1 MiB; here 3,000 frees pass a 64 KiB one.
    with EmbeddedNats(max_payload=64 * 1024) as server:
        async with replica(server.url) as a, replica(server.url) as b:
            await b.router.new(RouteRequest(tokens=PROMPTS[0], request_id="x"))
            await a.router.new(RouteRequest(tokens=PROMPTS[2], request_id="kept"))
            await eventually(lambda: a.router.booking("x") is not None and b.router.booking("kept") is not None)
            await book_and_free(a, 3000)
            assert len(msgspec.msgpack.encode(a.sync.state())) > 64 * 1024
            async with sync_lost(a):
                assert a.router.mark_free("x")  # freed through a; the batch carrying it is lost
            await eventually(lambda: b.router.booking("x") is None, 30, "b repairs the gap from a's view")
            assert a.sync.outcomes["state_served_in_parts"] >= 1
            async with replica(server.url) as late:  # its join is answered by a or b, both views too large
                assert late.sync.outcomes["joined"] == 1
                assert late.router.booking("kept") is not None and late.router.booking("x") is None


async def test_a_batch_larger_than_a_nats_message_reaches_peers_as_several() -> None:
    """Long prompts' block hashes (~9 bytes a block) pass the server's max_payload long before
    MAX_BATCH_CHANGES changes: a loop turn's bookings (or a durable replay's, queued as sync starts) go
    out as several numbered batches, not lost with the publish loop's crash until a beat shows the gap."""
    with EmbeddedNats(max_payload=64 * 1024) as server:
        # Beats far apart: what reaches b within the test came in batches, not through a repair.
        async with (
            replica(server.url, lease_s=300, heartbeat_s=60) as a,
            replica(server.url, lease_s=300, heartbeat_s=60) as b,
        ):
            request_ids = [f"long-{n}" for n in range(100)]
            for n, request_id in enumerate(request_ids):  # 256 blocks each: ~2.3 KiB a booking, in one batch
                await a.router.new(RouteRequest(tokens=prompt(n, 16 * 256), request_id=request_id))
            # One booking alone past max_payload (its peers' views could not carry it either): dropped alone.
            await a.router.new(RouteRequest(tokens=prompt(0, 16 * 8000), request_id="huge"))
            await eventually(lambda: all(b.router.booking(r) is not None for r in request_ids), 10, "b books all")
            assert b.sync.outcomes["gap"] == 0 and a.sync.outcomes["published_batches"] > 1
            assert a.sync.outcomes["rejected_oversized_change"] == 1 and b.router.booking("huge") is None


async def test_a_refused_view_leaves_the_gap_pending_until_the_peer_sends_it() -> None:
    """A peer that cannot send its view (an older one, its view over the server's max_payload) is asked
    again at its later beats; the free its lost batch carried arrives once it answers."""
    with EmbeddedNats() as server:
        async with replica(server.url) as a, replica(server.url) as b:
            await b.router.new(RouteRequest(tokens=PROMPTS[0], request_id="x"))
            await eventually(lambda: a.router.booking("x") is not None)
            real, refusing = a.nc.publish, True

            async def refuse(subject: str, payload: bytes = b"", *args: Any) -> None:
                if refusing and subject.startswith("_INBOX."):  # a reply to a state request
                    refusal = StateReply(replica_id=a.sync.replica_id, error="state exceeds max_payload")
                    payload = msgspec.msgpack.encode(refusal)
                await real(subject, payload, *args)

            a.nc.publish = refuse  # type: ignore[method-assign,assignment]
            try:
                async with sync_lost(a):
                    assert a.router.mark_free("x")  # the batch carrying the free is lost
                await a.router.new(RouteRequest(tokens=PROMPTS[1], request_id="y"))  # the next shows the gap
                await eventually(lambda: b.sync.outcomes["rejected_state_refused"] >= 1, 30, "b's ask is refused")
                assert b.router.booking("x") is not None and b.router.booking("y") is not None
                refusing = False
                await eventually(lambda: b.router.booking("x") is None, 30, "b asks again and repairs the gap")
            finally:
                a.nc.publish = real  # type: ignore[method-assign]


async def test_bookings_made_before_sync_starts_reach_the_peers(nats_server: EmbeddedNats) -> None:
    """HTTP serves from the first moment, before the plane (and a durable replay) has started replica
    sync: what was booked meanwhile reaches the peers, so a free sent to one of them is no 404."""
    async with replica(nats_server.url) as b:
        nc = await connect(NatsOptions(nats_server.url))
        router = new_router()
        await router.new(RouteRequest(tokens=PROMPTS[0], request_id="early"))
        assert router.mark_prefill("early")
        await router.new(RouteRequest(tokens=PROMPTS[1], request_id="early-freed"))
        assert router.mark_free("early-freed")
        sync = ReplicaSync(router, nc, heartbeat_s=0.1)
        await sync.start()
        try:
            await eventually(lambda: b.router.booking("early") is not None, 30, "b learns the early booking")
            assert bookings(b.router) == bookings(router) and b.router.booking("early-freed") is None
            assert b.router.mark_free("early")
            await eventually(lambda: router.booking("early") is None, 30, "the free through b reaches a")
        finally:
            await sync.stop()
            await nc.close()


async def test_a_booking_on_a_worker_a_peer_learns_later_waits_for_it(nats_server: EmbeddedNats) -> None:
    """A worker's registration reaches each router through the registry's watch, which can trail the sync
    message of a booking on it: the peer keeps that booking until the worker is registered there, then
    books it (before, it refused it, undercounted the worker's load and answered its free with a 404)."""
    late_worker = WorkerConfig(worker_id=9)
    async with replica(nats_server.url) as a, replica(nats_server.url) as b:
        b.router.register_worker(late_worker)  # known to b only, for now
        await b.router.new(RouteRequest(tokens=PROMPTS[0], request_id="on-9"), pinned_worker=(9, 0))
        await b.router.new(RouteRequest(tokens=PROMPTS[1], request_id="on-9-freed"), pinned_worker=(9, 0))
        await eventually(lambda: a.sync.outcomes["waiting_for_worker"] == 2, 30, "a holds both bookings")
        assert a.router.booking("on-9") is None
        assert b.router.mark_free("on-9-freed")  # freed while a still waits for the worker
        await eventually(lambda: a.sync.outcomes["applied"] >= 1, 30, "a applies the free")
        a.router.register_worker(late_worker)
        await eventually(lambda: a.router.booking("on-9") is not None, 30, "a books it once the worker is known")
        assert bookings(a.router) == bookings(b.router)
        assert a.router.booking("on-9-freed") is None
        assert a.router.mark_free("on-9")  # a free through the peer ends it everywhere
        await eventually(lambda: b.router.booking("on-9") is None, 30, "the free through a reaches b")
        assert a.sync.outcomes["rejected_booking"] == 0


@pytest.mark.parametrize("known_here", ["nothing of the worker", "the worker, not the rank"])
async def test_a_booking_on_a_rank_never_registered_is_refused_after_its_wait(
    nats_server: EmbeddedNats, known_here: str
) -> None:
    from router.replicas.sync import UNKNOWN_WORKER_WAIT_S

    now = [0.0]
    nc = await connect(NatsOptions(nats_server.url))
    router = new_router()
    if known_here == "the worker, not the rank":
        router.register_worker(WorkerConfig(worker_id=9))  # rank 0 only
    a = ReplicaSync(router, nc, lease_s=3600.0, heartbeat_s=0.05, clock=lambda: now[0])
    await a.start()
    try:
        async with replica(nats_server.url) as b:
            b.router.register_worker(WorkerConfig(worker_id=9, dp_size=2))
            await b.router.new(RouteRequest(tokens=PROMPTS[0], request_id="on-9"), pinned_worker=(9, 1))
            await eventually(lambda: a.outcomes["waiting_for_worker"] == 1, 30, "a holds the booking")
            await asyncio.sleep(0.3)  # beats: it waits still, counted once
            assert a.outcomes["waiting_for_worker"] == 1 and a.outcomes["rejected_booking"] == 0
            now[0] += UNKNOWN_WORKER_WAIT_S + 1
            await eventually(lambda: a.outcomes["rejected_booking"] == 1, 30, "refused at a beat after its wait")
            router.register_worker(WorkerConfig(worker_id=9, dp_size=2))
            await asyncio.sleep(0.3)  # beats: nothing waits any more
            assert router.booking("on-9") is None
    finally:
        await a.stop()
        await nc.close()


async def test_a_held_booking_outlasting_the_expiry_stays_booked_on_every_replica(nats_server: EmbeddedNats) -> None:
    """The proxy holds its bookings to the answer's end (a reasoning model's stream may outlast
    request_expiry_secs). A peer expired its copy by its own clock and published the expiry, which freed
    the booking on the replica that held it: the stream left its worker's load everywhere. A booking
    expires where it was booked, and its peers follow that replica's free or expiry."""
    now = [0.0]
    async with (
        replica(nats_server.url, clock=lambda: now[0]) as a,
        replica(nats_server.url, clock=lambda: now[0]) as b,
    ):
        await a.router.new(RouteRequest(tokens=PROMPTS[0], request_id="streaming"))
        assert a.router.hold("streaming")
        await a.router.new(RouteRequest(tokens=PROMPTS[1], request_id="abandoned"))  # a decision API caller's
        await eventually(lambda: bookings(b.router) == bookings(a.router), 30, "b books both")
        now[0] += CONFIG.request_expiry_secs + 1
        assert b.router.expire_stale() == []  # a's to expire
        assert a.router.expire_stale() == ["abandoned"]
        await eventually(lambda: b.router.booking("abandoned") is None, 30, "a's expiry reaches b")
        await asyncio.sleep(0.3)  # beats: nothing else moves
        assert set(bookings(a.router)) == set(bookings(b.router)) == {"streaming"}
        assert a.router.mark_free("streaming")  # the stream's end
        await eventually(lambda: not bookings(b.router), 30, "its free reaches b")


async def test_bookings_on_a_worker_registered_before_nats_was_reached_reach_the_peers(
    nats_server: EmbeddedNats,
) -> None:
    """A worker registered over HTTP before the router reached NATS, and requests booked on it: once the
    plane starts, the worker is in the shared registry before replica sync publishes those bookings, so
    every peer books them and a free sent through a peer ends them."""
    from api.config import EventPlaneConfig, HaConfig
    from api.plane_lifecycle import PlaneLifecycle

    def life() -> tuple[KvRouter, PlaneLifecycle]:
        router = KvRouter(CONFIG)
        return router, PlaneLifecycle(router, EventPlaneConfig(nats_url=nats_server.url), HaConfig(replica_sync=True))

    router_a, a = life()
    router_b, b = life()
    task_a = asyncio.create_task(a.run())
    task_b: asyncio.Task[None] | None = None
    try:
        await asyncio.wait_for(a.started(), 30)
        await b.register(WorkerConfig(worker_id=99))  # before b reached NATS
        for i in range(5):
            await router_b.new(RouteRequest(tokens=PROMPTS[i], request_id=f"early-{i}"))
        task_b = asyncio.create_task(b.run())
        await asyncio.wait_for(b.started(), 30)
        await eventually(lambda: len(bookings(router_a)) == 5, 30, "a books all five")
        assert bookings(router_a) == bookings(router_b)
        assert a.replicas is not None and a.replicas.outcomes["rejected_booking"] == 0
        assert router_a.mark_free("early-0")
        await eventually(lambda: router_b.booking("early-0") is None, 30, "the free through a reaches b")
    finally:
        for task, lifecycle in ((task_b, b), (task_a, a)):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            await lifecycle.stop()


async def test_a_view_naming_a_peer_silent_for_nan_seconds_is_refused(
    nats_server: EmbeddedNats, client: Client
) -> None:
    """A joiner's view from a misbehaving peer that says it last heard from a replica NaN seconds ago:
    refused as undecodable (before, the joiner took that replica on as a peer that never expired, and
    with it every booking the view said it made)."""

    async def answer(message: Msg) -> None:
        reply = {"replica_id": "odd", "silent_s": {"ghost": float("nan")}, "bookings": []}
        await client.publish(message.reply, msgspec.msgpack.encode(reply))

    subscription = await client.subscribe(Subjects().router_sync_state(), queue="state", cb=answer)
    try:
        async with replica(nats_server.url) as joiner:
            assert "ghost" not in joiner.sync.peers
            assert joiner.sync.outcomes["rejected_undecodable"] == 1
    finally:
        await subscription.unsubscribe()


async def test_a_view_whose_parts_go_on_past_the_bound_is_abandoned_unread(
    nats_server: EmbeddedNats, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A misbehaving peer whose view says ``more`` part after part: the joiner reads at most
    `MAX_PARTS_BYTES` of it (1 MiB here, 64 MiB in service), refuses the answer as oversized (counted,
    logged) and starts with no bookings, as when no peer answers; it books and syncs as usual after.
    Before, the parts were joined without a bound: the joiner's memory grew as long as the peer sent."""
    monkeypatch.setattr(parts, "MAX_PARTS_BYTES", 1 << 20)
    part = msgspec.msgpack.encode(StateReply(replica_id="endless", error="x" * (100 << 10), more=True))
    sent = 0

    async def answer(message: Msg) -> None:
        nonlocal sent
        for _ in range(40):  # four times the bound; the joiner stops reading after the eleventh
            await client.publish(message.reply, part)
            sent += 1
        await client.flush()

    subscription = await client.subscribe(Subjects().router_sync_state(), queue="state", cb=answer)
    try:
        async with replica(nats_server.url) as joiner:
            assert sent == 40 and joiner.sync.outcomes["rejected_oversized"] == 1
            assert "endless" not in joiner.sync.peers and list(joiner.router.bookings()) == []
            await subscription.unsubscribe()
            async with replica(nats_server.url) as peer:
                await joiner.router.new(RouteRequest(tokens=PROMPTS[0], request_id="after"))
                await eventually(lambda: peer.router.booking("after") is not None, 5, "the booking synced")
    finally:
        with contextlib.suppress(nats.errors.BadSubscriptionError):
            await subscription.unsubscribe()


async def test_a_lone_replica_passes_no_mark_for_an_id_nobody_booked(nats_server: EmbeddedNats) -> None:
    """With replica sync on and no peer heard from, a mark for an id not booked here cannot be ahead of
    a peer's booking: it is not passed on (the client's 404, as on a lone router), and nothing is kept or
    published for it. With a peer, it is passed (a 202 in the API)."""
    async with replica(nats_server.url) as lone:
        assert not lone.router.pass_mark_to_replicas("typo", free=True)
        assert lone.sync.outcomes["passed_marks"] == 0
        async with replica(nats_server.url) as peer:
            await eventually(lambda: peer.sync.replica_id in lone.sync.peers, 5, "the peer heard")
            assert lone.router.pass_mark_to_replicas("ahead", free=True)


async def test_a_request_id_booked_again_after_its_free_reaches_every_replica(nats_server: EmbeddedNats) -> None:
    """A client retrying with the same X-Request-Id after the first attempt was freed: within the
    tombstone window the retry's booking is newer than the free, so peers book it and a free sent
    through any of them ends it everywhere."""
    async with replica(nats_server.url) as a, replica(nats_server.url) as b, replica(nats_server.url) as c:
        everyone = (a, b, c)
        await a.router.new(RouteRequest(tokens=PROMPTS[0], request_id="req-42"))
        await eventually(lambda: all(r.router.booking("req-42") is not None for r in everyone))
        assert b.router.mark_free("req-42")  # the first attempt ends, freed through b
        await eventually(lambda: all(r.router.booking("req-42") is None for r in everyone))
        await a.router.new(RouteRequest(tokens=PROMPTS[0], request_id="req-42"))  # the retry
        await eventually(lambda: all(r.router.booking("req-42") is not None for r in everyone), 30,
                         "every replica books the retry")  # fmt: skip
        async with replica(nats_server.url) as late:  # a joiner learns it from a view holding the tombstone
            assert late.router.booking("req-42") is not None
            assert c.router.mark_free("req-42")
            await eventually(lambda: all(r.router.booking("req-42") is None for r in (*everyone, late)), 30,
                             "the retry's free through c ends it everywhere")  # fmt: skip
        assert sum(r.sync.outcomes["booked_after_free"] for r in everyone) == 0


async def test_a_view_with_a_repair_pending_does_not_hide_the_gap_from_a_joiner(nats_server: EmbeddedNats) -> None:
    """A replica that missed a batch reports its cursor below it until repaired: a joiner copying its
    view sees the gap at the sender's next beat and asks the sender itself."""
    async with replica(nats_server.url) as a, replica(nats_server.url) as y:
        await a.sync._subscriptions[2].unsubscribe()  # the joiner's ask for anyone's view lands on y
        await a.router.new(RouteRequest(tokens=PROMPTS[0], request_id="r"))
        await eventually(lambda: y.router.booking("r") is not None)
        release, real_ask = asyncio.Event(), y.sync._ask_state

        async def slow_ask(sender: str, peer: Any) -> None:  # y's repair takes its time
            await release.wait()
            await real_ask(sender, peer)

        y.sync._ask_state = slow_ask  # type: ignore[method-assign]
        async with sync_lost(a):
            assert a.router.mark_free("r")  # the batch carrying the free is lost
        await a.router.new(RouteRequest(tokens=PROMPTS[1], request_id="s"))  # y sees the gap, repairs slowly
        await eventually(lambda: y.router.booking("s") is not None and y.sync.outcomes["gap"] >= 1)
        try:
            async with replica(nats_server.url) as joiner:
                assert joiner.sync.outcomes["joined"] == 1 and joiner.router.booking("s") is not None
                await eventually(lambda: joiner.router.booking("r") is None, 30, "the joiner repairs the gap itself")
                assert y.router.booking("r") is not None  # y's repair is still held
        finally:
            release.set()
        await eventually(lambda: y.router.booking("r") is None, 30, "y repairs once its ask goes out")


async def test_a_cache_predicted_on_one_replica_is_predicted_on_every_one(nats_server: EmbeddedNats) -> None:
    """Workers without KV events: each replica predicts their caches from the prompts routed to them, by
    whichever replica routed them (``--processes N`` children each route a share of the prompts)."""

    def approximate() -> KvRouter:
        router = KvRouter(CONFIG, rng=random.Random(0))
        for worker_id in (1, 2):
            router.register_worker(WorkerConfig(worker_id=worker_id, kv_events=False))
        return router

    def predicted(router: KvRouter) -> dict[int, int]:
        return {w.worker_id: w.device_blocks for w in router.overlap(PROMPTS[3]).workers if w.device_blocks}

    connections = [await connect(NatsOptions(nats_server.url)) for _ in range(2)]
    a, b = (ReplicaSync(approximate(), nc, heartbeat_s=0.1) for nc in connections)
    for sync in (a, b):
        await sync.start()
    try:
        decision = await a.router.new(RouteRequest(tokens=PROMPTS[3], request_id="p"))
        blocks = len(PROMPTS[3]) // 16
        assert predicted(a.router) == {decision.worker_id: blocks}
        await eventually(lambda: predicted(b.router) == {decision.worker_id: blocks}, 30, "b predicts it too")
        again = await b.router.new(RouteRequest(tokens=PROMPTS[3], request_id="q"))
        assert (again.worker_id, again.overlap_blocks) == (decision.worker_id, blocks)
    finally:
        for sync in (a, b):
            await sync.stop()
        for nc in connections:
            await nc.close()


async def test_changes_made_while_nats_is_gone_past_the_connections_buffer_reach_the_peers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """NATS killed while one replica books more than its connection buffers (64 KiB here, 2 MiB by
    default): its publish loop does not crash (the changes it could not publish are counted), and once
    NATS is back the peer repairs the gap and holds every booking."""
    with EmbeddedNats() as server:
        nc = await nats.connect(server.url, pending_size=64 * 1024, reconnect_time_wait=0.2, max_reconnect_attempts=-1)
        router = new_router()
        sync = ReplicaSync(router, nc, heartbeat_s=0.1)
        await sync.start()
        try:
            async with replica(server.url) as peer:
                await eventually(lambda: sync.outcomes["joined"] + peer.sync.outcomes["joined"] >= 1)
                assert server.pid is not None
                os.kill(server.pid, signal.SIGKILL)
                await eventually(lambda: not nc.is_connected)
                with caplog.at_level(logging.ERROR, logger="router.supervision"):
                    for _ in range(2000):  # bounded: the buffer is full after a few hundred
                        await router.new(RouteRequest(tokens=PROMPTS[0], request_id=new_request_id()))
                        await asyncio.sleep(0)
                        if sync.outcomes["unpublished"] >= 50:
                            break
                    assert sync.outcomes["unpublished"] >= 50
                    server.restart()
                    await agree([peer], router)
                assert [r.getMessage() for r in caplog.records if "publish" in r.getMessage()] == []
        finally:
            await sync.stop()
            await nc.close()

"""Replica-sync wire types (msgpack), on ``kv.{ns}.router.sync`` and its state request/reply.

A router publishes `SyncBatch`es of booking changes, numbered per replica from 1, and a `SyncBeat`
every heartbeat interval carrying the number of its last batch (so a lost last batch shows as a gap
too). `StateRequest` / `StateReply` carry a replica's whole view: active bookings, recently freed ids
and the batch numbers it has applied from every peer.

Extensible on purpose: every struct ignores fields it does not know and new fields take defaults, so a
booking that carries more (output blocks, a policy override) can be added without breaking older peers.
"""

from __future__ import annotations

import itertools
from typing import Annotated

import msgspec

from indexer.events import U32, U64, NonNegative
from router.event_plane.parts import PartsJoiner, pack
from router.sequences import Booking

__all__ = [
    "Booked",
    "BookingEntry",
    "Change",
    "Freed",
    "PrefillMarked",
    "StateReader",
    "StateReply",
    "StateRequest",
    "SyncBatch",
    "SyncBeat",
    "SyncMessage",
    "state_parts",
    "sync_decoder",
]


class _BookingFields(msgspec.Struct, kw_only=True, gc=False):
    """What a replica tells of one booking, in a `Booked` change and in a `StateReply`'s entries: its
    rank, shared sequence hashes, private blocks, prefill, prompt length and expected output length
    (the last two absent from older peers' messages)."""

    request_id: str
    worker_id: U64
    dp_rank: U32
    hashes: tuple[int, ...] | None  # a msgpack array (older peers decode it as a list)
    private_blocks: NonNegative = 0
    prefill_tokens: NonNegative = 0
    context_tokens: NonNegative = 0
    expected_output_tokens: NonNegative | None = None
    # Which booking of this id: 0, one more each time an id freed within the tombstone window is booked
    # again (a client's retry reusing its X-Request-Id), so peers holding its tombstone take it.
    generation: NonNegative = 0

    def booking(self) -> Booking:
        return Booking((self.worker_id, self.dp_rank), self.hashes, self.private_blocks, self.prefill_tokens,
                       self.context_tokens, self.expected_output_tokens)  # fmt: skip


class Booked(_BookingFields, tag="booked", kw_only=True, gc=False):
    """A request booked on (worker_id, dp_rank). ``predicted_blocks``: its prompt's block hashes, when
    the rank's cache is predicted from what is routed to it (a worker without KV events)."""

    predicted_blocks: tuple[int, ...] | None = None


class PrefillMarked(msgspec.Struct, tag="prefill_marked", kw_only=True, gc=False):
    request_id: str


class Freed(msgspec.Struct, tag="freed", kw_only=True, gc=False):
    """Freed by a caller, or (``expired``) by the sender's stale-request expiry; ``generation``: the
    booking freed (a late free of an earlier booking of the id leaves a newer one booked)."""

    request_id: str
    expired: bool = False
    generation: NonNegative = 0


Change = Booked | PrefillMarked | Freed


class SyncBatch(msgspec.Struct, tag="batch", kw_only=True, gc=False):
    replica_id: str
    seq: NonNegative
    sent_at_ms: NonNegative
    changes: list[Change]


class SyncBeat(msgspec.Struct, tag="beat", kw_only=True, gc=False):
    """Liveness; ``seq`` is the sender's last batch. ``leaving``: it stops now, drop its bookings."""

    replica_id: str
    seq: NonNegative
    sent_at_ms: NonNegative = 0
    leaving: bool = False


SyncMessage = SyncBatch | SyncBeat


class StateRequest(msgspec.Struct, kw_only=True):
    """``in_parts``: the asker reads a reply in parts (`state_parts`); an older one gets an error instead."""

    replica_id: str
    in_parts: bool = False


class BookingEntry(_BookingFields, kw_only=True, gc=False):
    """One active booking in a `StateReply`; ``origin`` is the replica that booked it."""

    origin: str


# How long ago a replica was heard from: never NaN nor negative (a peer learnt with either would never expire).
Seconds = Annotated[float, msgspec.Meta(ge=0)]


class StateReply(msgspec.Struct, kw_only=True):
    """A replica's view: what is booked, what was freed lately, how far it has read each peer
    (``cursors``, its own last batch included) and how long ago it heard from each (``silent_s``).
    ``more``: a part, the next ones to the same inbox carry the rest (`state_parts`)."""

    replica_id: str
    bookings: list[BookingEntry] = []
    freed: list[str] = []
    cursors: dict[str, int] = {}
    silent_s: dict[str, Seconds] = {}
    error: str | None = None
    more: bool = False
    # The generation of each freed id whose booking was not the first (few: only reused ids).
    freed_generations: dict[str, int] = {}


# Room in a part for its keys and lists' headers beside what the last part's envelope measures.
_PART_ENVELOPE_BYTES = 64
_encode = msgspec.msgpack.encode
_state_reply = msgspec.msgpack.Decoder(StateReply)


def state_parts(reply: StateReply, max_bytes: int) -> list[bytes] | None:
    """``reply`` (msgpack) as parts of at most ``max_bytes`` each: its bookings and freed ids in order,
    its cursors, silences and freed generations in the last part; None when one booking alone is too large. All parts
    come from one `StateReply`, so the asker merges one moment's view, as from a reply in one piece."""
    last_part = msgspec.structs.replace(reply, bookings=[], freed=[])
    room = max_bytes - len(_encode(last_part)) - _PART_ENVELOPE_BYTES
    groups = pack(itertools.chain(reply.bookings, reply.freed), room) if room > 0 else None
    if groups is None:
        return None
    last = len(groups) - 1
    parts = []
    for index, group in enumerate(groups):
        bookings = [item for item in group if isinstance(item, BookingEntry)]
        freed = [item for item in group if isinstance(item, str)]
        part = (
            msgspec.structs.replace(last_part, bookings=bookings, freed=freed)
            if index == last
            else StateReply(replica_id=reply.replica_id, bookings=bookings, freed=freed, more=True)
        )
        parts.append(_encode(part))
    return parts


class StateReader(PartsJoiner[StateReply]):
    """The asker's side: a `PartsJoiner` of `StateReply`s whose parts' bookings and freed ids are joined
    in order, the last part's cursors, silences and freed generations kept."""

    __slots__ = ()

    def decode(self, data: bytes) -> StateReply:
        return _state_reply.decode(data)

    def more(self, reply: StateReply) -> bool:
        return reply.more

    def join(self, parts: list[StateReply], last: StateReply) -> StateReply:
        bookings = [booking for part in parts for booking in part.bookings]
        freed = [request_id for part in parts for request_id in part.freed]
        if bookings or freed:
            last.bookings = [*bookings, *last.bookings]
            last.freed = [*freed, *last.freed]
        return last


def sync_decoder() -> msgspec.msgpack.Decoder[SyncBatch | SyncBeat]:
    return msgspec.msgpack.Decoder(SyncMessage)

"""A resync reply too large for one NATS message (the server's ``max_payload``: 1 MiB unless configured)
goes in parts, as several replies to the asker's inbox. A full dump of a real engine's cache is tens of
bytes a block, so one of 20k blocks no longer fits; sent whole, it was refused, and the router stayed
blind to what the worker held.

Each part is a whole `ResyncResponse` whose batch holds the next events in order and says ``more``,
but for the last. Only to an asker that said it reads parts (``ResyncRequest.in_parts``). A dump's store
larger than a part is cut into stores of consecutive blocks, each under the last block of the one
before: the same chain. A range's event is never cut (its id numbers it); one alone too large is
answered as before, with an error. The parts are cut by `router.event_plane.parts.pack`, and read
within `router.event_plane.parts.MAX_PARTS_BYTES`.
"""

from __future__ import annotations

import msgspec

from indexer.events import KvCacheEventData, ResyncBatch, ResyncResponse, RouterEvent, looks_like_msgpack
from router.event_plane.parts import PartsJoiner, pack

__all__ = ["ResyncReader", "reply_parts"]

_encode = msgspec.msgpack.encode
_json_response = msgspec.json.Decoder(ResyncResponse)
_msgpack_response = msgspec.msgpack.Decoder(ResyncResponse)

# Room in a part for what is not its events: the response's and the batch's keys, the list's header,
# the last event id.
_ENVELOPE_BYTES = 256


def reply_parts(response: ResyncResponse, max_bytes: int) -> list[bytes] | None:
    """``response`` (msgpack) as parts of at most ``max_bytes`` each; None when it has no batch to split
    or one of a range's events alone is too large. O(bytes of the reply), and a store cut in halves
    until its pieces fit is encoded once per halving."""
    dump = response.tree_dump is not None
    batch = _batch(response)
    if batch is None:
        return None
    room = max_bytes - _ENVELOPE_BYTES
    pieces = (piece for event in batch.events for piece in (_cut(event, room) if dump else (event,)))
    parts = pack(pieces, room)
    if parts is None:
        return None
    last = len(parts) - 1
    batches = (
        ResyncBatch(events=events, last_event_id=batch.last_event_id, more=i < last) for i, events in enumerate(parts)
    )
    if dump:
        return [_encode(ResyncResponse(tree_dump=part)) for part in batches]
    return [_encode(ResyncResponse(events=part)) for part in batches]


def _cut(event: RouterEvent, room: int) -> list[RouterEvent]:
    """A dump's event as stores that each fit ``room`` (itself, when it does or cannot be cut)."""
    stored = event.event.stored
    if stored is None or len(stored.blocks) < 2 or len(_encode(event)) <= room:
        return [event]
    half = len(stored.blocks) // 2
    start = stored.start_position
    head = msgspec.structs.replace(stored, blocks=stored.blocks[:half])
    tail = msgspec.structs.replace(
        stored,
        blocks=stored.blocks[half:],
        parent_hash=stored.blocks[half - 1].block_hash,
        start_position=None if start is None else start + half,
    )
    pieces = []
    for piece in (head, tail):
        cut = msgspec.structs.replace(event.event, data=KvCacheEventData(stored=piece))
        pieces.extend(_cut(msgspec.structs.replace(event, event=cut), room))
    return pieces


class ResyncReader(PartsJoiner[ResyncResponse]):
    """The asker's side (as `router.replicas.messages.StateReader` for a replica's view): a
    `PartsJoiner` of `ResyncResponse`s, msgpack or JSON (from a worker that answers in it), whose
    parts' events are joined in order under the last part's ``last_event_id``."""

    __slots__ = ()

    def decode(self, data: bytes) -> ResyncResponse:
        return (_msgpack_response if looks_like_msgpack(data) else _json_response).decode(data)

    def more(self, reply: ResyncResponse) -> bool:
        batch = _batch(reply)
        return batch is not None and batch.more

    def join(self, parts: list[ResyncResponse], last: ResyncResponse) -> ResyncResponse:
        batch = _batch(last)
        events = [event for part in parts for event in _events(part)]
        if batch is None or not events:
            return last
        whole = ResyncBatch(events=[*events, *batch.events], last_event_id=batch.last_event_id)
        return ResyncResponse(tree_dump=whole) if last.tree_dump is not None else ResyncResponse(events=whole)


def _batch(response: ResyncResponse) -> ResyncBatch | None:
    """The dump or the range a response carries, if any."""
    return response.tree_dump if response.tree_dump is not None else response.events


def _events(part: ResyncResponse) -> list[RouterEvent]:
    batch = _batch(part)
    assert batch is not None, "a part with more to come has a batch"
    return batch.events

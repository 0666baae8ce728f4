"""Joining an answer sent in parts (`router.event_plane.parts.PartsJoiner`), here through a replica's
view (`router.replicas.messages.StateReader`): the parts joined in the order they came, no answer while
its last part is missing (an unanswered request over a real nats-server), and no more than
`MAX_PARTS_BYTES` read for one answer."""

from __future__ import annotations

import msgspec
import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from router.event_plane import parts
from router.event_plane.parts import PartsTooLarge, request_in_parts
from router.replicas.messages import BookingEntry, StateReader, StateReply, state_parts

pytestmark = pytest.mark.anyio

WHOLE = StateReply(
    replica_id="peer",
    bookings=[
        BookingEntry(request_id=f"r{i}", worker_id=i % 3, dp_rank=0, hashes=(i, i + 1), origin="peer")
        for i in range(40)
    ],
    freed=[f"f{i}" for i in range(30)],
    cursors={"peer": 7},
    silent_s={"other": 1.5},
)


def whole_in_parts() -> list[bytes]:
    cut = state_parts(WHOLE, 512)
    assert cut is not None and len(cut) >= 4
    return cut


def test_parts_are_joined_in_the_order_they_came_into_the_whole_answer() -> None:
    cut = whole_in_parts()
    reader = StateReader()
    assert [reader.add(part) for part in cut[:-1]] == [None] * (len(cut) - 1)
    assert reader.add(cut[-1]) == WHOLE
    # Two parts swapped on the way: joined as they came (parts carry no number).
    first, second = (msgspec.msgpack.decode(part, type=StateReply) for part in cut[:2])
    reader = StateReader()
    for part in [cut[1], cut[0], *cut[2:]]:
        joined = reader.add(part)
    assert joined is not None and joined.bookings[: len(second.bookings)] == second.bookings
    assert joined.bookings[len(second.bookings) : len(second.bookings) + len(first.bookings)] == first.bookings
    # A reply not in parts is the answer as it is.
    assert StateReader().add(msgspec.msgpack.encode(WHOLE)) == WHOLE


async def test_an_answer_whose_last_part_never_comes_is_an_unanswered_request(client: Client) -> None:
    async def answer_all_but_the_last(message: Msg) -> None:
        for part in whole_in_parts()[:-1]:
            await client.publish(message.reply, part)

    await client.subscribe("kv.test.parts", cb=answer_all_but_the_last)
    with pytest.raises(nats.errors.TimeoutError):
        await request_in_parts(client, "kv.test.parts", b"", 0.3, StateReader())


def test_parts_past_the_bound_are_refused_undecoded(monkeypatch: pytest.MonkeyPatch) -> None:
    cut = whole_in_parts()
    monkeypatch.setattr(parts, "MAX_PARTS_BYTES", len(cut[0]) + 10)
    reader = StateReader()
    assert reader.add(cut[0]) is None
    with pytest.raises(PartsTooLarge, match=f"more than {len(cut[0]) + 10} bytes"):
        reader.add(b"\xc1" * 11)  # not msgpack: refused for its size before any decoding
    # Within the bound, the same bytes are decoded (and fail as such).
    with pytest.raises(msgspec.DecodeError):
        StateReader().add(b"\xc1" * 11)

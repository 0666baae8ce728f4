"""A resync reply too large for one NATS message, in parts (`router.event_plane.resync_parts`): every
part within the limit, and the parts read back to what the whole reply rebuilds."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.events import ResyncBatch, ResyncResponse, StorageTier
from indexer.held_blocks import HeldBlocks
from router.event_plane.resync_parts import ResyncReader, reply_parts

LIMIT = 1024


def held_from(response: ResyncResponse) -> HeldBlocks:
    """What a worker holding exactly the reply's dump would dump."""
    assert response.tree_dump is not None
    held = HeldBlocks(7)
    for event in response.tree_dump.events:
        stored = event.event.stored
        assert stored is not None
        blocks = [block.block_hash for block in stored.blocks]
        tokens = [block.tokens_hash for block in stored.blocks]
        held.store(event.event.dp_rank, event.storage_tier, stored.parent_hash, blocks, tokens)
    return held


def read_back(parts: list[bytes]) -> ResyncResponse:
    reader = ResyncReader()
    answers = [reader.add(part) for part in parts]
    assert all(answer is None for answer in answers[:-1]) and answers[-1] is not None
    return answers[-1]


@settings(max_examples=60, deadline=None)
@given(
    chains=st.lists(st.integers(min_value=1, max_value=400), min_size=1, max_size=12),
    host=st.integers(min_value=0, max_value=80),
)
def test_a_dump_in_parts_rebuilds_what_the_whole_dump_does(chains: list[int], host: int) -> None:
    """Chains (one far longer than a part), branches, a lower tier: each part fits, the last event id
    is kept, and the parts rebuild the same blocks under the same parents."""
    held = HeldBlocks(7)
    next_hash = 1
    parent = None
    for length in chains:
        blocks = list(range(next_hash, next_hash + length))
        held.store(0, StorageTier.DEVICE, parent, blocks, [b * 3 for b in blocks])
        parent = blocks[length // 2]  # the next chain branches off this one's middle
        next_hash += length
    if host:
        held.store(0, StorageTier.HOST_PINNED, None, list(range(10**6, 10**6 + host)), [1] * host)
    whole = ResyncResponse(tree_dump=ResyncBatch(events=held.dump_events(0), last_event_id=41))
    parts = reply_parts(whole, LIMIT)
    assert parts is not None and all(len(part) <= LIMIT for part in parts)
    joined = read_back(parts)
    assert joined.tree_dump is not None and joined.tree_dump.last_event_id == 41
    assert not joined.tree_dump.more
    assert held_from(joined).tables == held.tables


def test_a_range_in_parts_keeps_its_events_and_an_event_too_large_alone_is_not_cut() -> None:
    held = HeldBlocks(7)
    for start in range(1, 400, 4):
        held.store(0, StorageTier.DEVICE, None, list(range(start, start + 4)), [0, 0, 0, 0])
    events = held.dump_events(0)
    whole = ResyncResponse(events=ResyncBatch(events=events, last_event_id=100))
    parts = reply_parts(whole, LIMIT)
    assert parts is not None and len(parts) > 1 and all(len(part) <= LIMIT for part in parts)
    joined = read_back(parts)
    assert joined.events is not None and joined.events.events == events and joined.events.last_event_id == 100
    long = HeldBlocks(7)
    long.store(0, StorageTier.DEVICE, None, list(range(1, 200)), [0] * 199)
    assert reply_parts(ResyncResponse(events=ResyncBatch(events=long.dump_events(0), last_event_id=1)), LIMIT) is None
    assert reply_parts(ResyncResponse(error="no"), LIMIT) is None


@pytest.mark.parametrize(
    "response", [ResyncResponse(error="no"), ResyncResponse(tree_dump=ResyncBatch(events=[], last_event_id=3))]
)
def test_a_reply_not_in_parts_reads_as_itself(response: ResyncResponse) -> None:
    assert ResyncReader().add(msgspec.msgpack.encode(response)) == response
    assert ResyncReader().add(msgspec.json.encode(response)) == response

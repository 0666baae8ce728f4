"""KV-event wire types: Dynamo's JSON and msgpack shapes, u64 handling and clear decode errors."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from indexer.events import (
    EventDecodeError,
    RouterEvent,
    StorageTier,
    cleared_event,
    decode_router_events,
    encode_router_events,
    removed_event,
    stored_event,
)

DYNAMO_DUMP_LINE = (
    b'{"worker_id":5,"storage_tier":"device","residency_domain":"worker",'
    b'"event":{"event_id":0,"data":{"stored":{"parent_hash":null,"start_position":null,'
    b'"blocks":[{"block_hash":100,"tokens_hash":11,"mm_extra_info":null},'
    b'{"block_hash":101,"tokens_hash":12,"mm_extra_info":null}]}},"dp_rank":0}}'
)


def test_decodes_dynamo_dump_line_ignoring_unknown_fields() -> None:
    [event] = decode_router_events(DYNAMO_DUMP_LINE)
    assert event.worker_id == 5
    assert event.storage_tier is StorageTier.DEVICE
    stored = event.event.stored
    assert stored is not None
    assert stored.parent_hash is None
    assert [(b.block_hash, b.tokens_hash) for b in stored.blocks] == [(100, 11), (101, 12)]


def test_json_round_trip_matches_design_shapes() -> None:
    events = [
        RouterEvent(7, stored_event(1, [(333, 444)], parent_hash=222, dp_rank=1)),
        RouterEvent(7, removed_event(2, [333]), storage_tier=StorageTier.HOST_PINNED),
        RouterEvent(7, cleared_event(3)),
    ]
    encoded = encode_router_events(events)
    assert msgspec.json.decode(encoded) == [
        {
            "worker_id": 7,
            "event": {
                "event_id": 1,
                "data": {
                    "stored": {
                        "blocks": [{"block_hash": 333, "tokens_hash": 444, "mm_extra_info": None}],
                        "parent_hash": 222,
                        "start_position": None,
                    }
                },
                "dp_rank": 1,
            },
            "storage_tier": "device",
        },
        {
            "worker_id": 7,
            "event": {"event_id": 2, "data": {"removed": {"block_hashes": [333]}}, "dp_rank": 0},
            "storage_tier": "host_pinned",
        },
        {"worker_id": 7, "event": {"event_id": 3, "data": "cleared", "dp_rank": 0}, "storage_tier": "device"},
    ]
    assert decode_router_events(encoded) == events
    assert decode_router_events(encode_router_events(events, msgpack=True), msgpack=True) == events


def test_cleared_map_form_is_normalised_to_the_bare_string() -> None:
    [event] = decode_router_events(b'{"worker_id":1,"event":{"event_id":4,"data":{"cleared":null}}}')
    assert event.event.is_cleared
    assert event.event.data == "cleared"
    assert b'"data":"cleared"' in encode_router_events(event)


def test_negative_i64_hashes_are_reinterpreted_as_u64() -> None:
    payload = (
        b'{"worker_id":1,"event":{"event_id":1,"data":{"stored":{"parent_hash":-1,'
        b'"blocks":[{"block_hash":-2,"tokens_hash":-9223372036854775808}]}}}}'
    )
    [event] = decode_router_events(payload)
    stored = event.event.stored
    assert stored is not None
    assert stored.parent_hash == 2**64 - 1
    assert (stored.blocks[0].block_hash, stored.blocks[0].tokens_hash) == (2**64 - 2, 2**63)
    [removal] = decode_router_events(b'{"worker_id":1,"event":{"event_id":2,"data":{"removed":{"block_hashes":[-3]}}}}')
    assert removal.event.removed is not None
    assert removal.event.removed.block_hashes == [2**64 - 3]


def test_worker_ids_above_2_pow_63_are_accepted() -> None:
    big = 2**64 - 17
    [event] = decode_router_events(b'{"worker_id":%d,"event":{"event_id":1,"data":"cleared"}}' % big)
    assert event.worker_id == big


@pytest.mark.parametrize(
    ("payload", "where"),
    [
        (b'{"worker_id":-1,"event":{"event_id":1,"data":"cleared"}}', "$.worker_id"),
        (
            b'{"worker_id":18446744073709551616,"event":{"event_id":1,"data":"cleared"}}',
            "worker_id 18446744073709551616",
        ),
        (b'{"worker_id":1,"event":{"event_id":1,"data":"wiped"}}', "$.event.data"),
        (b'{"worker_id":1,"event":{"event_id":1,"data":{}}}', "$.event.data"),
        (
            b'{"worker_id":1,"event":{"event_id":1,"data":{"stored":{"blocks":[]},"removed":{"block_hashes":[]}}}}',
            "$.event.data",
        ),
        (
            b'{"worker_id":1,"event":{"event_id":1,"data":{"stored":{"blocks":[{"block_hash":1}]}}}}',
            "$.event.data.stored.blocks[0]",
        ),
        (b'[{"worker_id":1,"event":{"event_id":1,"data":"cleared"}},{"worker_id":"x"}]', "$[1].worker_id"),
        (
            b'{"worker_id":1,"event":{"event_id":1,"data":{"removed":{"block_hashes":[1.5]}}}}',
            "$.event.data.removed.block_hashes[0]",
        ),
        (b'{"worker_id":1,"storage_tier":"gpu","event":{"event_id":1,"data":"cleared"}}', "$.storage_tier"),
        (b'{"worker_id":1,"event":{"event_id":1,"dp_rank":4294967296,"data":"cleared"}}', "$.event.dp_rank"),
        (
            b'{"worker_id":1,"event":{"event_id":1,"data":{"stored":{"blocks":[{"block_hash":1,'
            b'"tokens_hash":18446744073709551616}]}}}}',
            "tokens_hash 18446744073709551616 does not fit in u64 - at `$.event.data.stored`",
        ),
    ],
)
def test_invalid_payloads_raise_one_typed_error_saying_where(payload: bytes, where: str) -> None:
    with pytest.raises(EventDecodeError) as info:
        decode_router_events(payload)
    assert isinstance(info.value, ValueError)
    assert where in str(info.value)


def _stored_with(data_extra: dict[str, object] | None = None, mm: object = None) -> dict[str, object]:
    block: dict[str, object] = {"block_hash": 1, "tokens_hash": 2}
    if mm is not None:
        block["mm_extra_info"] = {"mm_objects": [mm]}
    data = {"stored": {"parent_hash": None, "blocks": [block]}, **(data_extra or {})}
    return {"worker_id": 1, "event": {"event_id": 1, "dp_rank": 0, "data": data}}


# What Dynamo's serde refuses and the struct form let through: its externally tagged data holds exactly
# one key (a second one, null or unknown, is an error), and a multimodal object's offsets are required
# pairs of usize.
DYNAMO_REFUSES = [
    (_stored_with({"removed": None}), "$.event.data.removed"),
    (_stored_with({"bogus": 1}), "unknown field `bogus` - at `$.event.data`"),
    (_stored_with({"cleared": None}), "exactly one of"),
    (_stored_with(mm={"mm_hash": 3}), "missing required field `offsets`"),
    (_stored_with(mm={"mm_hash": 3, "offsets": [[-1, 2]]}), "mm_objects[0].offsets"),
]


@pytest.mark.parametrize(("event", "where"), DYNAMO_REFUSES)
@pytest.mark.parametrize("packed", [False, True], ids=["json", "msgpack"])
def test_data_with_a_second_key_or_mm_objects_without_offsets_are_refused(
    event: dict[str, object], where: str, packed: bool
) -> None:
    payload = msgspec.msgpack.encode(event) if packed else msgspec.json.encode(event)
    with pytest.raises(EventDecodeError) as info:
        decode_router_events(payload, msgpack=packed)
    assert where in str(info.value)
    # The well-formed neighbours still decode (the one key; offsets given, non-negative).
    [ok] = decode_router_events(msgspec.json.encode(_stored_with(mm={"mm_hash": 3, "offsets": [[0, 2]]})))
    assert ok.event.stored is not None and ok.event.removed is None
    assert encode_router_events(ok).count(b"removed") == 0  # an absent kind is not written either


def test_truncated_json_and_garbage_msgpack_are_decode_errors() -> None:
    with pytest.raises(EventDecodeError, match="invalid RouterEvent JSON"):
        decode_router_events(b'{"worker_id":1,')
    with pytest.raises(EventDecodeError, match="invalid RouterEvent msgpack"):
        decode_router_events(b"\xc1\xff", msgpack=True)


u64 = st.integers(0, 2**64 - 1)


@given(
    st.lists(
        st.tuples(u64, st.integers(0, 2**32 - 1), st.lists(st.tuples(u64, u64), max_size=5), st.booleans()),
        max_size=8,
    ),
    st.booleans(),
)
def test_any_event_list_round_trips(specs: list[tuple[int, int, list[tuple[int, int]], bool]], packed: bool) -> None:
    events = [
        RouterEvent(worker, stored_event(i + 1, blocks, dp_rank=rank) if blocks else cleared_event(i + 1))
        for i, (worker, rank, blocks, _) in enumerate(specs)
    ]
    assert decode_router_events(encode_router_events(events, msgpack=packed), msgpack=packed) == events

"""The router's C accelerator (`router._native`) gives the pure-Python code's answers bit for bit.

Booking and release refcounts, the prefix bisections, the dynamo policy's costs and the lowest cost. The C
functions are called directly whatever ``KV_ROUTER_NO_NATIVE`` says.
"""

from __future__ import annotations

import math
import random
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.config import RouterConfig
from router.overlap import RankOverlap
from router.policies.base import SelectionContext
from router.policies.dynamo import DynamoPolicy, python_costs
from router.sequences import RankState, python_held_prefix, python_shared_prefix

native = pytest.importorskip("router._native", reason="the C accelerator is not built")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=60, unique=True), st.data())
def test_booking_and_release_count_blocks_as_python(hashes: list[int], data: st.DataObject) -> None:
    held = data.draw(st.integers(0, len(hashes)))
    existing = {block: data.draw(st.integers(1, 3)) for block in hashes[:held]}
    extra = {100 + i: 1 for i in range(data.draw(st.integers(0, 3)))}
    fast, slow = {**existing, **extra}, {**existing, **extra}
    native.book_blocks(fast, tuple(hashes), held)
    for block in hashes[:held]:
        slow[block] += 1
    slow.update(dict.fromkeys(hashes[held:], 1))
    assert fast == slow
    shared = data.draw(st.integers(0, len(hashes)))
    native.release_blocks(fast, hashes, shared)
    for block in hashes[:shared]:
        slow[block] -= 1
    for block in hashes[shared:]:
        del slow[block]
    assert fast == slow


def test_booking_a_missing_shared_block_raises_as_python() -> None:
    with pytest.raises(KeyError):
        native.book_blocks({}, (1, 2), 1)
    with pytest.raises(KeyError):
        native.release_blocks({1: 1}, (1, 2), 0)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.integers(0, 30), st.integers(1, 3), max_size=20), st.lists(st.integers(0, 30), max_size=25))
def test_held_and_shared_prefixes_bisect_as_python(refs: dict[int, int], hashes: list[int]) -> None:
    assert native.held_prefix(refs, hashes) == python_held_prefix(refs, hashes)
    try:
        expected: int | type[KeyError] = python_shared_prefix(refs, hashes)
    except KeyError:
        expected = KeyError
    if expected is KeyError:
        with pytest.raises(KeyError):
            native.shared_prefix(refs, tuple(hashes))
    else:
        assert native.shared_prefix(refs, tuple(hashes)) == expected


def _bits(values: list[float]) -> list[bytes]:
    return [struct.pack("<d", value) for value in values]


weights = st.floats(0.0, 4.0) | st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0])
loads = st.integers(0, 50_000)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    ranks=st.integers(1, 12),
    isl=st.integers(1, 20_000),
    block_size=st.sampled_from([1, 16, 64]),
    track_prefill=st.booleans(),
    credit=weights,
    decay=st.sampled_from([0.0, 0.0, 0.5, 2.0]) | st.floats(0.0, 3.0),
    host=weights,
    disk=weights,
    scale=weights,
    request_weight=weights,
    tainted=st.booleans(),
)
def test_the_dynamo_costs_are_python_s_bit_for_bit(
    data: st.DataObject,
    ranks: int,
    isl: int,
    block_size: int,
    track_prefill: bool,
    credit: float,
    decay: float,
    host: float,
    disk: float,
    scale: float,
    request_weight: float,
    tainted: bool,
) -> None:
    states = []
    for index in range(ranks):
        rank = RankState((index, 0))
        rank.prefill_tokens = data.draw(loads)
        rank.decode_blocks = data.draw(loads)
        rank.requests = data.draw(st.integers(0, 300))
        states.append(rank)
    overlaps = {
        rank.key: RankOverlap(device, h, d, float(device), data.draw(st.integers(0, isl + 40)))
        for rank in states
        if data.draw(st.booleans())
        for device, h, d in [data.draw(st.tuples(st.integers(0, 2_000), st.integers(0, 50), st.integers(0, 50)))]
    }
    depths = {rank: data.draw(st.integers(0, 2_000)) for rank in states if data.draw(st.booleans())}
    multipliers = [data.draw(st.floats(1 / math.e, math.e)) for _ in states] if tainted else None
    config = RouterConfig(
        block_size=block_size,
        router_track_prefill_tokens=track_prefill,
        overlap_score_credit=credit,
        overlap_score_credit_decay=decay,
        host_cache_hit_weight=host,
        disk_cache_hit_weight=disk,
        prefill_load_scale=scale,
        decode_active_request_weight=request_weight,
    )
    context = SelectionContext(
        isl_tokens=isl,
        config=config,
        ranks=states,
        overlaps=overlaps,
        depths=depths,
        booked_blocks=data.draw(st.integers(0, 2_000)),
        taint_multipliers=multipliers,
    )
    expected = python_costs(context)
    fast = native.dynamo_costs(
        states, overlaps, depths, isl, block_size, context.booked_blocks, track_prefill,
        credit, decay, host, disk, scale, request_weight, multipliers,
    )  # fmt: skip
    assert fast is not None
    assert _bits(fast) == _bits(expected)
    assert _bits(DynamoPolicy(config, random.Random(0)).costs(context)) == _bits(expected)


def test_the_dynamo_costs_leave_what_they_were_not_written_for_to_python() -> None:
    rank = RankState((1, 0))
    args = ({}, {}, 64, 16, 4, True, 1.0, 0.0, 0.75, 0.25, 1.0, 0.0, None)
    assert native.dynamo_costs([rank], *args) is not None
    rank.prefill_tokens = 2**60  # past what a double holds exactly in a sum
    assert native.dynamo_costs([rank], *args) is None
    rank.prefill_tokens = 0
    assert native.dynamo_costs([rank], {}, {}, 64, 16, 4, True, 1, 0.0, 0.75, 0.25, 1.0, 0.0, None) is None  # int
    assert native.dynamo_costs([], {}, {}, 64, 16, 4, True, 1.0, 0.5, 0.75, 0.25, 1.0, 0.0, None) is None  # min([])


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from([0.0, -0.0, 1.0, 2.5, math.inf, -math.inf, math.nan]) | st.floats(), max_size=12))
def test_the_lowest_cost_is_min_and_equality_as_python(costs: list[float]) -> None:
    found = native.lowest_cost(costs)
    if not costs:
        assert found is None
        return
    lowest = min(costs)
    ties = [index for index, cost in enumerate(costs) if cost == lowest]
    assert found == ((ties[0], len(ties)) if ties else None)

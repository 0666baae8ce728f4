"""The router's C accelerator (`router._native`) gives the pure-Python code's answers bit for bit.

A rank's booked blocks (the C trie against the Python dict: held and shared prefixes, refcounts), the
dynamo and latency policies' costs and the lowest cost. The C code is called directly whatever ``KV_ROUTER_NO_NATIVE``
says.
"""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from indexer.hashing import compute_block_hashes, compute_sequence_hashes
from router.booked_blocks import BookedBlocks
from router.config import RouterConfig
from router.overlap import RankOverlap
from router.policies.base import SelectionContext
from router.policies.dynamo import DynamoPolicy, python_costs
from router.policies.latency import CostWeights, LatencyPolicy, python_costs_and_held
from router.sequences import RankState

pytestmark = pytest.mark.both_paths

native = pytest.importorskip("router._native", reason="the C accelerator is not built")

BS = 4


# Prompts as the router books them: sequence hashes of a few shared document prefixes, then a tail.
DOCUMENTS = [[document * 1000 + i for i in range(12 * BS)] for document in range(3)]
prompts = st.builds(
    lambda document, shared, tail, as_tuple: (tuple if as_tuple else list)(
        compute_sequence_hashes(compute_block_hashes(DOCUMENTS[document][: shared * BS] + tail, BS))
    ),
    st.integers(0, 2),
    st.integers(0, 12),
    st.lists(st.integers(50_000, 50_003), max_size=4 * BS),
    st.booleans(),
).filter(bool)


class BookedBlocksMachine(RuleBasedStateMachine):
    """Random bookings and releases on one rank: the C trie and the Python dict answer alike."""

    @initialize()
    def setup(self) -> None:
        self.fast = native.BookedBlocks()
        self.slow = BookedBlocks()
        self.booked: list[Sequence[int]] = []

    @rule(hashes=prompts)
    def book(self, hashes: Sequence[int]) -> None:
        assert self.fast.held(hashes) == self.slow.held(hashes)
        assert self.fast.book(hashes) == self.slow.book(hashes)
        self.booked.append(hashes)

    @precondition(lambda self: self.booked)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        hashes = self.booked.pop(data.draw(st.integers(0, len(self.booked) - 1)))
        assert self.fast.shared(hashes) == self.slow.shared(hashes)
        assert self.fast.release(hashes) == self.slow.release(hashes)

    @rule(hashes=prompts)
    def held(self, hashes: Sequence[int]) -> None:
        assert self.fast.held(hashes) == self.slow.held(hashes)

    @invariant()
    def same_refcounts(self) -> None:
        assert self.fast.refcounts() == self.slow.refcounts()
        assert len(self.fast) == len(self.slow) == len(self.slow.refcounts())


TestBookedBlocksMachine = BookedBlocksMachine.TestCase
TestBookedBlocksMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_the_booked_trie_splits_and_joins_runs_as_prompts_come_and_go() -> None:
    long = tuple(range(100, 110))  # stands in for sequence hashes: equal exactly when the prefix is
    fork = (*long[:4], 7, 8)
    booked = native.BookedBlocks()
    assert booked.book(long) == 0
    assert booked.book(fork) == 4  # splits the run of `long` after its 4th block
    assert booked.book(long[:2]) == 2  # ends inside a run: split again
    assert len(booked) == 12
    assert booked.shared(long) == 4 and booked.shared(long[:2]) == 2 and booked.shared(fork) == 4
    assert booked.refcounts() == {**dict.fromkeys(long[:2], 3), **dict.fromkeys(long[2:4], 2),
                                  **dict.fromkeys(long[4:], 1), 7: 1, 8: 1}  # fmt: skip
    assert booked.release(long) == 4
    assert len(booked) == 6 and booked.held(long) == 4
    assert booked.release(fork) == 2 and booked.release(long[:2]) == 0
    assert len(booked) == 0 and booked.refcounts() == {} and booked.held(long) == 0
    with pytest.raises(KeyError):
        booked.release(long)  # not booked


def _bits(values: list[float]) -> list[bytes]:
    return [struct.pack("<d", value) for value in values]


weights = st.floats(0.0, 4.0) | st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0])
loads = st.integers(0, 50_000)


def _rank_states(data: st.DataObject, count: int) -> list[RankState]:
    """Ranks with every load a policy's cost reads drawn: booked prefill and blocks, requests, the
    context in flight and the decoding requests' output lengths."""
    states = []
    for index in range(count):
        rank = RankState((index, 0))
        rank.prefill_tokens = data.draw(loads)
        rank.decode_blocks = data.draw(loads)
        rank.requests = data.draw(st.integers(0, 300))
        rank.context_tokens = data.draw(st.integers(0, 2_000_000))
        rank.decoding_inverse_output = data.draw(st.floats(0.0, 50.0))
        rank.decoding_untold = data.draw(st.integers(0, 300))
        states.append(rank)
    return states


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
    states = _rank_states(data, ranks)
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


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    ranks=st.integers(1, 12),
    isl=st.integers(1, 20_000),
    block_size=st.sampled_from([1, 16, 64]),
    track_prefill=st.booleans(),
    credit=weights,
    weighed=st.tuples(weights, weights, weights, weights, st.floats(0.0, 0.01), weights, st.floats(0.0, 5_000.0)),
    default_output=st.integers(1, 2_000),
    with_fills=st.booleans(),
)
def test_the_latency_costs_are_python_s_bit_for_bit(
    data: st.DataObject,
    ranks: int,
    isl: int,
    block_size: int,
    track_prefill: bool,
    credit: float,
    weighed: tuple[float, float, float, float, float, float, float],
    default_output: int,
    with_fills: bool,
) -> None:
    """Costs and held tokens, with and without credit, fills, pass budgets, the passes a prefill adds and
    the ITL stall term; the policy's own `costs` (C when built) equal to them too."""
    states = _rank_states(data, ranks)
    overlaps = {
        rank.key: RankOverlap(0, 0, 0, 0.0, data.draw(st.integers(0, isl + 40)))
        for rank in states
        if data.draw(st.booleans())
    }
    depths = {rank: data.draw(st.integers(0, 2_000)) for rank in states if data.draw(st.booleans())}
    fills = {rank.key: data.draw(st.floats(0.0, 1.0)) for rank in states if data.draw(st.booleans())}
    pass_tokens = {rank.key: data.draw(st.integers(1, 50_000)) for rank in states if data.draw(st.booleans())}
    scale, miss, stall, itl_stall, decode, others, pass_base = weighed
    config = RouterConfig(
        block_size=block_size,
        router_track_prefill_tokens=track_prefill,
        overlap_score_credit=credit,
        prefill_load_scale=scale,
        latency_miss_weight=1.0 + miss,
        latency_stall_weight=stall,
        latency_itl_stall_weight=itl_stall,
        latency_decode_weight=decode,
        latency_decode_others_weight=others,
        latency_default_output_tokens=default_output,
        latency_pass_base_tokens=pass_base,
    )
    context = SelectionContext(
        isl_tokens=isl,
        config=config,
        ranks=states,
        overlaps=overlaps,
        depths=depths,
        booked_blocks=0,
        taint_multipliers=None,
        cache_fill=fills if with_fills else None,
        pass_tokens=pass_tokens,
    )
    policy = LatencyPolicy(config, random.Random(0))
    weights_of_request = policy._weights(context)
    expected_costs, expected_held = python_costs_and_held(context, weights_of_request, default_output)
    fast = native.latency_costs(
        states, overlaps, depths, context.cache_fill, pass_tokens, isl, block_size, track_prefill, default_output,
        *weights_of_request,
    )  # fmt: skip
    assert fast is not None
    assert _bits(fast[0]) == _bits(expected_costs) and fast[1] == expected_held
    assert _bits(policy.costs(context)) == _bits(expected_costs)


def test_the_latency_costs_leave_what_they_were_not_written_for_to_python() -> None:
    rank = RankState((1, 0))
    weights = CostWeights(1.0, 1.0, 5.0, 0.2, 0.0, 0.5, 1.0, 0.0)
    args = ({}, {}, None, {}, 64, 16, True, 256)
    assert native.latency_costs([rank], *args, *weights) == ([0.5 * 0.0 + 64.0 * 6.0 + 0.0], [0])
    rank.context_tokens = 2**60  # past what a double holds exactly in a sum
    assert native.latency_costs([rank], *args, *weights) is None
    rank.context_tokens = 0
    assert native.latency_costs([rank], *args, *weights._replace(credit=1)) is None  # an int weight
    assert native.latency_costs([rank], *args, *weights._replace(decode_weight=math.inf)) is None
    assert native.latency_costs([rank], {}, {}, {rank.key: 1}, {}, 64, 16, True, 256, *weights) is None  # int fill
    assert native.latency_costs([rank], {}, {}, None, {}, 2**64, 16, True, 256, *weights) is None  # Python's ints

    class Overlaps(dict[object, object]):
        """A mapping whose lookups C's dict calls would not see."""

    assert native.latency_costs([rank], Overlaps(), {}, None, {}, 64, 16, True, 256, *weights) is None


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

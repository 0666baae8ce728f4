"""The C accelerator (`indexer._native`) gives the pure-Python code's answers bit for bit.

Both paths run in this process whatever ``KV_ROUTER_NO_NATIVE`` says: the C functions are called
directly, trees and body decoders are built with ``native`` / ``packed_tokens`` on and off. XXH3 is
checked against the `xxhash` package on every length class of the specification.
"""

from __future__ import annotations

import math
import random
import struct
from array import array
from typing import Any

import msgspec
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.codec import BodyDecoder, Call
from api.errors import ApiError
from api.wire import NewRequest, PotentialLoadsRequest
from indexer.events import (
    KvStoredData,
    RouterEvent,
    StorageTier,
    StoredBlock,
    StoredEventEncoder,
    encode_router_events,
    stored_event,
)
from indexer.hashing import SEED, python_block_hashes, python_sequence_hashes, sequence_hash_tuple
from indexer.radix_tree import KvIndexError, RadixTree
from router.config import RouterConfig
from router.overlap import RankOverlap
from router.policies.base import SelectionContext
from router.policies.dynamo import DynamoPolicy, python_costs
from router.sequences import RankState, python_held_prefix, python_shared_prefix
from tests.event_streams import EventOp, QueryOp, WorkerOp, generate

native = pytest.importorskip("indexer._native", reason="the C accelerator is not built")

U64 = st.integers(0, 2**64 - 1)
SEEDS = st.sampled_from([0, SEED]) | U64
# XXH3's length classes (the specification's code paths): 0, 1-3, 4-8, 9-16, 17-128, 129-240, > 240.
LENGTH_CLASSES = [(0, 0), (1, 3), (4, 8), (9, 16), (17, 128), (129, 240), (241, 5000)]


@pytest.mark.parametrize(("shortest", "longest"), LENGTH_CLASSES)
@settings(max_examples=150, deadline=None)
@given(data=st.data(), seed=SEEDS)
def test_xxh3_matches_the_xxhash_package_on_every_length_class(
    shortest: int, longest: int, data: st.DataObject, seed: int
) -> None:
    payload = data.draw(st.binary(min_size=shortest, max_size=longest))
    assert native.xxh3_64(payload, seed) == xxhash.xxh3_64_intdigest(payload, seed)


@pytest.mark.parametrize("length", [240, 241, 1023, 1024, 1025, 2048, 4096, 4097, 65536 + 13])
def test_xxh3_matches_at_the_long_hash_stripe_and_block_boundaries(length: int) -> None:
    payload = random.Random(length).randbytes(length)
    for seed in (0, SEED, 2**64 - 1):
        assert native.xxh3_64(payload, seed) == xxhash.xxh3_64_intdigest(payload, seed)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=600),
    block_size=st.integers(1, 64),
    eagle=st.booleans(),
    seed=SEEDS,
)
def test_block_hashes_match_python(tokens: list[int], block_size: int, eagle: bool, seed: int) -> None:
    packed = memoryview(array("I", tokens)).cast("B")
    stride = 4 * block_size
    window = stride + 4 if eagle else stride
    assert native.block_hashes(packed, seed, stride, window) == python_block_hashes(packed, seed, stride, window)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1) | st.integers(-3, 2**70) | st.booleans() | st.floats(), max_size=50))
def test_token_lists_pack_as_array_packs_them(tokens: list[Any]) -> None:
    try:
        expected: bytes | None = array("I", tokens).tobytes()
    except (OverflowError, TypeError):
        expected = None  # the Python path raises, naming the id
    assert native.pack_u32(tokens) == expected


@settings(max_examples=300, deadline=None)
@given(st.lists(U64, max_size=300))
def test_sequence_hashes_match_python(local_hashes: list[int]) -> None:
    assert list(native.sequence_hashes(local_hashes, SEED)) == python_sequence_hashes(local_hashes)


@pytest.mark.parametrize("bad", [-1, 2**64, 1.0, "7"])
def test_a_bad_local_hash_is_reported_as_python_reports_it(bad: Any) -> None:
    hashes = [1, 2, bad, 4]
    with pytest.raises((OverflowError, TypeError)):
        native.sequence_hashes(hashes, SEED)
    with pytest.raises(ValueError) as from_python:
        python_sequence_hashes(hashes)
    with pytest.raises(ValueError) as dispatched:
        sequence_hash_tuple(hashes)
    assert str(dispatched.value) == str(from_python.value)


# ------------------------------------------------------------------ JSON token arrays
def _packed(body: bytes) -> bytes | None:
    split = native.split_json_tokens(body)
    if split is None:
        return None
    packed, start, end = split
    assert body[start] == ord("[") and body[end - 1] == ord("]")
    return packed


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=300), st.sampled_from(["", " ", "\n", "\t ", "\r\n"]))
def test_a_json_token_array_packs_to_the_u32_bytes_of_its_ids(tokens: list[int], space: str) -> None:
    array_text = "[" + space + ("," + space).join(map(str, tokens)) + space + "]"
    escaped = r'"b": "a \\ \" ] }"'  # a string member with escapes and brackets inside
    body = f'{space}{{"a": {{"tokens": [1, "]"]}},{space}"tokens"{space}:{space}{array_text}, {escaped}}}{space}'
    assert msgspec.json.decode(body)["tokens"] == tokens
    assert _packed(body.encode()) == array("I", tokens).tobytes()


@settings(max_examples=1000, deadline=None)
@given(st.text(alphabet='[]{}0123456789,-.eE+ \t\n"x:\\', max_size=40))
def test_the_json_token_parser_never_accepts_what_msgspec_rejects_or_reads_differently(text: str) -> None:
    body = ('{"tokens":' + text + "}").encode()
    packed = _packed(body)
    if packed is None:
        return
    tokens = msgspec.json.decode(body, type=dict[str, Any])["tokens"]
    assert all(type(token) is int and 0 <= token < 2**32 for token in tokens)
    assert packed == array("I", tokens).tobytes()


def _decode(decoder: BodyDecoder[Any], body: bytes) -> tuple[str, Any]:
    try:
        request = decoder.decode(Call(body))
    except ApiError as exc:
        return type(exc).__name__, str(exc)
    fields = msgspec.structs.asdict(request)
    tokens = fields.pop("tokens")
    if isinstance(tokens, list) and all(type(t) is int and 0 <= t < 2**32 for t in tokens):
        tokens = array("I", tokens).tobytes()  # the form the packed path hands over
    return "decoded", (tokens, fields)


token_values = st.integers(0, 2**32 - 1) | st.integers(-5, 2**40) | st.floats(allow_nan=False, allow_infinity=False)
token_fields = (  # ids in and out of u32, floats, base64 strings, near-JSON
    st.lists(token_values, max_size=40).map(lambda tokens: msgspec.json.encode(tokens))
    | st.binary(max_size=12).map(lambda packed: msgspec.json.encode(packed))
    | st.sampled_from([b"[01]", b"[1,]", b"[-0]", b"[1e3]", b"null", b"{}", b'"not base64!"', b"[1, 2 ]"])
)
other_fields = st.sampled_from(
    [b"", b',"request_id":"r-1"', b',"request_id":""', b',"unknown":1', b',"lora_name":"a","explain":true',
     b',"lora_name":"x\\"y"', b',"tokens":[1]', b',"block_mm_infos":[{"mm_objects":[]}]', b',"lora_name":1']
)  # fmt: skip


@pytest.mark.parametrize("body_type", [NewRequest, PotentialLoadsRequest])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tokens=token_fields, rest=other_fields, truncate=st.booleans(), first=st.booleans())
def test_bodies_decode_alike_with_and_without_the_packed_token_path(
    body_type: type, tokens: bytes, rest: bytes, truncate: bool, first: bool
) -> None:
    body = (
        (b'{"tokens":' + tokens + rest + b"}")
        if first
        else (b'{"priority_jump":1' + rest + b',"tokens":' + tokens + b"}")
    )
    if truncate:
        body = body[:-1]
    packed = BodyDecoder(body_type, packed_tokens=True)
    ordinary = BodyDecoder(body_type, packed_tokens=False)
    assert _decode(packed, body) == _decode(ordinary, body)
    decoded = packed.decode(Call(body)) if _decode(ordinary, body)[0] == "decoded" else None
    assert decoded is None or isinstance(decoded, body_type)


# ------------------------------------------------------------------ the radix tree
def _apply(tree: RadixTree, op: EventOp | WorkerOp, tier: StorageTier) -> str | None:
    try:
        if isinstance(op, WorkerOp):
            getattr(tree, op.kind)(op.worker_id)
        else:
            tree.apply_event(op.worker_id, op.event, tier)
    except KvIndexError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _same_answers(workers: int, dp_size: int, seed: int, requests: int) -> None:
    trees = RadixTree(native=True), RadixTree(native=False)
    rng = random.Random(seed)
    for op in generate(seed, workers=workers, dp_size=dp_size, requests=requests, capacity=96, groups=6):
        if isinstance(op, QueryOp):
            fast, slow = (tree.find_matches(op.local_hashes) for tree in trees)
            assert fast.scores == slow.scores
            assert list(fast.scores) == list(slow.scores)  # the same order, too
            assert fast.tier_hits == slow.tier_hits
            continue
        # Now and then the same event also lands on a lower tier, so matches walk both.
        tiers = [StorageTier.DEVICE] + ([StorageTier.HOST_PINNED] if rng.random() < 0.1 else [])
        for tier in tiers:
            assert _apply(trees[0], op, tier) == _apply(trees[1], op, tier)
    fast_stats, slow_stats = (tree.stats() for tree in trees)
    assert (fast_stats.blocks, fast_stats.nodes) == (slow_stats.blocks, slow_stats.nodes)
    # Branch dicts are counted alike too (the C removal collapses them as `_prune` does).
    assert fast_stats.estimated_bytes - slow_stats.estimated_bytes == fast_stats.nodes * (
        trees[0]._node_bytes - trees[1]._node_bytes
    )
    assert trees[0].dump_events() == trees[1].dump_events()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32))
def test_native_and_python_trees_answer_alike(seed: int) -> None:
    _same_answers(workers=6, dp_size=2, seed=seed, requests=200)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32))
def test_native_and_python_trees_answer_alike_past_64_slots(seed: int) -> None:
    # Slots of 64 and more take the Python walks inside a native tree; their masks mix with the rest.
    _same_answers(workers=44, dp_size=2, seed=seed, requests=400)


def test_a_worker_reusing_a_hash_elsewhere_loses_the_old_block_alike() -> None:
    answers = []
    for native_tree in (True, False):
        tree = RadixTree(native=native_tree)
        tree.apply_event(8, stored_event(1, [(10, 1), (11, 2)]))
        tree.apply_event(7, stored_event(1, [(10, 1), (11, 2), (10, 3)]))  # hash 10 again, deeper
        tree.apply_event(7, stored_event(2, [(12, 4)], parent_hash=10))
        stats = tree.stats()
        queries = ([1, 2, 3, 4], [1, 2], [1])
        answers.append(([tree.find_matches(q).scores for q in queries], stats.blocks, stats.nodes))
    assert answers[0] == answers[1]
    assert answers[0][0][0] == {(8, 0): 2}  # worker 7 no longer holds its first block


def test_the_c_node_behaves_as_the_python_node() -> None:
    from indexer.radix_tree import _Node

    for cls in (native.Node, _Node):
        root = cls(0, 0, None, 0)
        child = cls(2**64 - 1, 5, root, 0b101)
        root.children = {5: child}
        assert (child.block_hash, child.local_hash, child.parent, child.owners) == (2**64 - 1, 5, root, 0b101)
        assert repr(child) == "_Node(block_hash=18446744073709551615, local_hash=5, owners=0x5)"
        child.owners |= 2
        assert child.owners == 7
        assert root.children == {5: child}
    with pytest.raises(OverflowError):
        native.Node(-1, 0, None, 0)
    with pytest.raises(TypeError):
        native.Node(0, 0, None, 0).owners = "x"  # type: ignore[assignment]


def test_the_u64_check_of_stored_blocks_matches_python() -> None:
    blocks = [StoredBlock(1, 2), StoredBlock(2**64 - 1, 0)]
    assert not native.has_wide_hash(blocks)
    for wide in (-1, 2**64, -(2**63)):
        block = StoredBlock(1, 2)
        block.tokens_hash = wide
        assert native.has_wide_hash([*blocks, block])
    stored = msgspec.json.decode(
        b'{"blocks":[{"block_hash":-1,"tokens_hash":3},{"block_hash":4,"tokens_hash":-2}]}', type=KvStoredData
    )
    assert [(b.block_hash, b.tokens_hash) for b in stored.blocks] == [(2**64 - 1, 3), (4, 2**64 - 2)]


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


def test_packed_tokens_are_little_endian_u32() -> None:
    assert native.split_json_tokens(b'{"tokens":[1,258]}') == (struct.pack("<2I", 1, 258), 10, 17)
    for unsupported in (b'{"tokens":[1],"tokens":[2]}', b'{"tok\\u0065ns":[1]}', b"[1]", b'{"tokens":"AAAA"}'):
        assert native.split_json_tokens(unsupported) is None


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


class _Recorder:
    """httptools' view of a request: what uvicorn's callbacks collect."""

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.messages = 0
        self.began = 0

    def on_message_begin(self) -> None:
        self.began += 1

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.messages += 1


header_names = st.sampled_from(
    ["Content-Type", "content-length", "Accept", "X-Request-Id", "authorization", "Host", "Connection",
     "Transfer-Encoding", "Expect", "Upgrade", "X-Other", "Bad Name", "Keep-Alive", ""]
)  # fmt: skip
header_values = st.sampled_from(
    ["application/json", "application/msgpack", "close", "chunked", "100-continue", "req-1", "a b"]
) | st.text(alphabet="ab1/;=-, \t\x7f\xe9\x00", max_size=8)
targets = st.sampled_from(["/v1/new", "/v1/mark_free?explain=true"]) | st.text(
    alphabet='/v1newrk?=&%#"<> ~', max_size=14
).map(lambda t: "/" + t)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    method=st.sampled_from(["POST", "POST", "POST", "GET", "post"]),
    target=targets,
    version=st.sampled_from(["HTTP/1.1", "HTTP/1.1", "HTTP/1.1", "HTTP/1.0", "HTTP/1.1 "]),
    headers=st.lists(st.tuples(header_names, st.sampled_from([": ", ": ", ":", ":  "]), header_values), max_size=5),
    body=st.binary(max_size=12),
    length=st.sampled_from(["exact", "exact", "exact", "none", "short", "long"]),
    trailing=st.sampled_from([b"", b"", b"", b"POST / HTTP/1.1\r\n"]),
)
def test_the_whole_request_parser_accepts_only_what_httptools_reads_alike(
    method: str,
    target: str,
    version: str,
    headers: list[tuple[str, str, str]],
    body: bytes,
    length: str,
    trailing: bytes,
) -> None:
    httptools = pytest.importorskip("httptools")
    lines = [f"{method} {target} {version}"] + [f"{name}{colon}{value}" for name, colon, value in headers]
    declared = {"exact": len(body), "short": max(len(body) - 1, 0), "long": len(body) + 1}.get(length)
    if declared is not None:
        lines.append(f"Content-Length: {declared}")
    data = "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + body + trailing
    parsed = native.parse_post(data)
    head, _, body = data.partition(b"\r\n\r\n")
    if isinstance(parsed, int):  # a plain head with its body still to come: it parses once that is in
        assert len(body) < parsed
        body += b"z" * (parsed - len(body))
        data = head + b"\r\n\r\n" + body
        parsed = native.parse_post(data)
        assert isinstance(parsed, tuple)
    if parsed is None:
        return
    recorder = _Recorder()
    parser = httptools.HttpRequestParser(recorder)
    parser.feed_data(data)  # raises for anything httptools refuses: the C parser must not take it
    assert (recorder.began, recorder.messages) == (1, 1)
    assert parser.get_method() == b"POST" and parser.get_http_version() == "1.1" and parser.should_keep_alive()
    assert not parser.should_upgrade()
    path, query, content_type, accept, request_id, authorization, parsed_body = parsed
    assert (path, query) == recorder.url.partition(b"?")[::2]
    seen = dict(recorder.headers)
    assert len(seen) == len(recorder.headers) or all(
        n not in (b"content-type", b"accept", b"x-request-id", b"authorization", b"content-length")
        for n, _ in recorder.headers
        if [m for m, _ in recorder.headers].count(n) > 1
    )
    assert content_type == seen.get(b"content-type")
    assert accept == seen.get(b"accept")
    assert request_id == (seen[b"x-request-id"].decode("latin-1") if b"x-request-id" in seen else None)
    assert authorization == seen.get(b"authorization")
    assert parsed_body == recorder.body == body
    assert int(seen[b"content-length"]) == len(body)


def test_the_whole_request_parser_reads_a_plain_post() -> None:
    data = (
        b"POST /v1/new?explain=true HTTP/1.1\r\nHost: h\r\ncontent-type: application/json\r\n"
        b"Content-Length: 2\r\nX-Request-Id: r-1\r\nAuthorization: Bearer t\r\n\r\n{}"
    )
    expected = (b"/v1/new", b"explain=true", b"application/json", None, "r-1", b"Bearer t", b"{}")
    assert native.parse_post(data) == expected
    assert native.parse_post(data[:-1]) == 2  # the body not all here yet: its Content-Length
    for refused in (
        data + b"POST",  # a pipelined second request
        data[:-3],  # the head not all here yet
        data.replace(b"Host: h", b"Connection: close"),
        data.replace(b"Host: h", b"Expect: 100-continue"),
        data.replace(b"HTTP/1.1", b"HTTP/1.0"),
        data.replace(b"POST", b"GET"),
    ):
        assert native.parse_post(refused) is None


# ------------------------------------------------------------------ the bridge's wire paths
EDGES = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63, 2**64 - 1]
EDGY_U64 = st.sampled_from(EDGES) | U64


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(EDGY_U64, EDGY_U64), max_size=70))
def test_stored_block_rows_are_the_bytes_msgspec_writes(pairs: list[tuple[int, int]]) -> None:
    row = msgspec.msgpack.encode(StoredBlock(2**64 - 1, 2**64 - 2))
    before, rest = row.split(msgspec.msgpack.encode(2**64 - 1))
    between, after = rest.split(msgspec.msgpack.encode(2**64 - 2))
    rows = native.msgpack_rows([b for b, _ in pairs], [t for _, t in pairs], before, between, after)
    assert rows == msgspec.msgpack.encode([StoredBlock(b, t) for b, t in pairs])


def test_stored_block_rows_refuse_what_is_not_u64() -> None:
    for bad in (-1, 2**64, "1"):
        assert native.msgpack_rows([1, bad], [2, 3], b"", b"", b"") is None
    with pytest.raises(ValueError, match="differ in length"):
        native.msgpack_rows([1, 2], [3], b"", b"", b"")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1]) | st.integers(0, 2**32 - 1)))
def test_msgpack_token_ids_pack_as_array_packs_them(tokens: list[int]) -> None:
    assert native.msgpack_u32s(msgspec.msgpack.encode(tokens)) == array("I", tokens).tobytes()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40) | st.builds(msgspec.msgpack.encode, st.lists(st.integers(-(2**63), 2**64 - 1))))
def test_msgpack_token_ids_are_packed_only_when_msgspec_reads_the_same_u32s(data: bytes) -> None:
    packed = native.msgpack_u32s(data)
    try:
        tokens: list[int] | None = msgspec.msgpack.decode(data, type=list[int])
    except msgspec.DecodeError:
        tokens = None
    if packed is not None:  # never an answer of its own: exactly msgspec's ints
        assert tokens is not None and array("I", packed).tolist() == tokens
    elif tokens is not None and all(0 <= token < 2**32 for token in tokens):
        # u32 ids in a form msgspec never writes for them (signed or 64-bit) are left to msgspec.
        assert any(byte in data for byte in b"\xcf\xd0\xd1\xd2\xd3")


@settings(max_examples=200, deadline=None)
@given(
    worker=st.sampled_from([0, 7, 2**64 - 1, 2**64 - 3]) | U64,
    event_id=st.integers(1, 2**64 - 1),
    dp_rank=st.integers(0, 2**32 - 1),
    tier=st.sampled_from(list(StorageTier)),
    parent=st.none() | EDGY_U64,
    pairs=st.lists(st.tuples(EDGY_U64, EDGY_U64), min_size=1, max_size=40),
)
def test_the_stored_event_encoder_writes_what_msgspec_writes(
    worker: int, event_id: int, dp_rank: int, tier: StorageTier, parent: int | None, pairs: list[tuple[int, int]]
) -> None:
    expected = encode_router_events(
        RouterEvent(worker, stored_event(event_id, pairs, parent_hash=parent, dp_rank=dp_rank), tier), msgpack=True
    )
    hashes, tokens = [b for b, _ in pairs], [t for _, t in pairs]
    for encoder in (StoredEventEncoder(worker, native=True), StoredEventEncoder(worker, native=False)):
        assert encoder.encode(event_id, dp_rank, tier, parent, hashes, tokens) == expected

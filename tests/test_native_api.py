"""The HTTP front's C accelerator (`api._native`) reads requests as the Python path does.

The JSON token parser never takes what msgspec rejects or reads differently, bodies decode alike with and
without it, and the whole-request parser takes only what httptools reads alike. The C functions are called
directly whatever ``KV_ROUTER_NO_NATIVE`` says.
"""

from __future__ import annotations

import struct
from array import array
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.codec import BodyDecoder, Call
from api.errors import ApiError
from api.http_protocol import response_bytes
from api.metrics import LATENCY_BUCKETS, OVERLAP_BLOCK_BUCKETS, RATIO_BUCKETS, _Histogram
from api.wire import NewRequest, PotentialLoadsRequest

pytestmark = pytest.mark.both_paths

native = pytest.importorskip("api._native", reason="the C accelerator is not built")


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


def _assert_accepted_only_as_msgspec_reads(body: bytes) -> None:
    """The parser may decline a body; what it accepts is u32 tokens, exactly as msgspec reads them."""
    packed = _packed(body)
    if packed is None:
        return
    tokens = msgspec.json.decode(body, type=dict[str, Any])["tokens"]
    assert all(type(token) is int and 0 <= token < 2**32 for token in tokens)
    assert packed == array("I", tokens).tobytes()


@settings(max_examples=1000, deadline=None)
@given(st.text(alphabet='[]{}0123456789,-.eE+ \t\n"x:\\', max_size=40))
def test_the_json_token_parser_never_accepts_what_msgspec_rejects_or_reads_differently(text: str) -> None:
    body = ('{"tokens":' + text + "}").encode()
    _assert_accepted_only_as_msgspec_reads(body)


@settings(max_examples=1000, deadline=None)
@given(st.text(alphabet="[]0123456789,-.eE+ \t\n", max_size=40), st.integers(0, 12))
def test_digit_runs_read_eight_bytes_at_once_are_read_as_msgspec_reads_them(text: str, pad: int) -> None:
    # Padding after the array: digit runs far enough from the end of the body to be read 8 bytes at
    # once (the parser reads the last 7 bytes one at a time).
    body = ('{"tokens":' + text + ', "p": "' + "x" * pad + '"}').encode()
    _assert_accepted_only_as_msgspec_reads(body)


@pytest.mark.parametrize("digits", range(1, 12))
def test_every_digit_count_packs_or_is_refused_as_json_says(digits: int) -> None:
    for value in (10 ** (digits - 1), 10**digits - 1, 2**32 - 1, 2**32):
        if len(str(value)) != digits:
            continue
        body = b'{"tokens":[%d,%d,%d],"pad":"xxxxxxxxxxxxxxxx"}' % (value, value, value)
        assert _packed(body) == (array("I", [value] * 3).tobytes() if value < 2**32 else None)
    leading_zero = b'{"tokens":[1,0%s],"pad":"xxxxxxxxxxxxxxxx"}' % (b"1" * (digits - 1) or b"0")
    assert _packed(leading_zero) is None  # not JSON: msgspec's own error


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
def test_packed_tokens_are_little_endian_u32() -> None:
    assert native.split_json_tokens(b'{"tokens":[1,258]}') == (struct.pack("<2I", 1, 258), 10, 17)
    for unsupported in (b'{"tokens":[1],"tokens":[2]}', b'{"tok\\u0065ns":[1]}', b"[1]", b'{"tokens":"AAAA"}'):
        assert native.split_json_tokens(unsupported) is None


def test_the_token_array_is_found_under_the_member_named() -> None:
    body = b'{"tokens": [9], "prompt": [1, 258]}'
    assert native.split_json_tokens(body, b"prompt") == (struct.pack("<2I", 1, 258), 26, 34)
    assert native.split_json_tokens(body) == (struct.pack("<I", 9), 11, 14)
    assert native.split_json_tokens(b'{"prompt": "hi"}', b"prompt") is None
    assert native.split_json_tokens(b'{"prompts": [1]}', b"prompt") is None
    with pytest.raises(TypeError):
        native.split_json_tokens(body, "prompt")  # type: ignore[arg-type]


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


def test_the_whole_request_parser_declines_a_head_past_the_python_paths_bounds() -> None:
    """At the bounds (a 65,536-byte target; 100 fields; 65,536 header bytes counted as on the wire) a
    POST is parsed; one past them is declined, for httptools' path to refuse it (414, 431)."""

    def post(target: bytes, fields: list[bytes]) -> bytes:
        return b"POST %b HTTP/1.1\r\n%bContent-Length: 2\r\n\r\n{}" % (target, b"".join(fields))

    # Content-Length's line is one field of 19 bytes: "Content-Length" + ": " + "2" + CRLF.
    target = b"/v1/new?" + b"a" * (65_536 - 8)
    assert isinstance(native.parse_post(post(target, [])), tuple)
    assert native.parse_post(post(target + b"a", [])) is None
    assert isinstance(native.parse_post(post(b"/v1/new", [b"a: b\r\n"] * 99)), tuple)
    assert native.parse_post(post(b"/v1/new", [b"a: b\r\n"] * 100)) is None
    filler = [b"x: %b\r\n" % (b"v" * 1_000)] * 64  # 64 x 1,005 = 64,320 bytes; + 19 + 1,197 = 65,536
    assert isinstance(native.parse_post(post(b"/v1/new", [*filler, b"y: %b\r\n" % (b"v" * 1_192)])), tuple)
    assert native.parse_post(post(b"/v1/new", [*filler, b"y: %b\r\n" % (b"v" * 1_193)])) is None


# ------------------------------------------------------------------ the bridge's wire paths


# ------------------------------------------------------------------ one response's bytes
@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: ", b""]),
    st.binary(max_size=300),
    st.none() | st.text(alphabet=st.characters(max_codepoint=255), max_size=40),
    st.sampled_from([b"", b"connection: close\r\n", b"www-authenticate: Bearer\r\nconnection: close\r\n"]),
)
def test_a_response_is_written_byte_for_byte_as_the_python_path_writes_it(
    head: bytes, body: bytes, request_id: str | None, lines: bytes
) -> None:
    written = native.response(head, body, request_id, lines)
    assert written == response_bytes(head, body, request_id, lines)


def test_a_response_carries_its_request_id_unless_it_holds_a_control_character() -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-length: "
    assert native.response(head, b"{}", "req-1", b"") == head + b"2\r\nx-request-id: req-1\r\n\r\n{}"
    assert native.response(head, b"{}", "req\x01", b"") == head + b"2\r\n\r\n{}"
    assert native.response(head, b"{}", "tab\there", b"") == head + b"2\r\nx-request-id: tab\there\r\n\r\n{}"
    assert native.response(head, b"{}", "\u20ac", b"") is None  # not latin-1: the Python path's error


# ------------------------------------------------------------------ histogram series
@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([LATENCY_BUCKETS, OVERLAP_BLOCK_BUCKETS, RATIO_BUCKETS, (), (1.0,)]),
    st.lists(st.floats(allow_nan=True) | st.integers(-(2**70), 2**70) | st.sampled_from(RATIO_BUCKETS), max_size=60),
)
def test_a_histogram_series_counts_and_sums_as_the_python_one(bounds: tuple[float, ...], values: list[Any]) -> None:
    ours, python = native.Histogram(bounds), _Histogram(bounds)
    for value in values:
        try:
            python.observe(value)
        except OverflowError:  # an int too large for a float: counted, then refused by the sum, alike
            with pytest.raises(OverflowError):
                ours.observe(value)
            continue
        ours.observe(value)
    assert ours.bounds == python.bounds
    assert ours.counts == python.counts
    assert struct.pack("<d", ours.total) == struct.pack("<d", python.total) or (ours.total != ours.total) == (
        python.total != python.total
    )


def test_a_histogram_series_takes_other_numbers_as_the_python_one_and_refuses_what_it_refuses() -> None:
    """A bool, an int's or a float's subclass, a Decimal or a Fraction are counted and summed as the
    twin does (the C code refused them all); a string is refused by the comparison, as there."""
    from decimal import Decimal
    from fractions import Fraction

    class Ratio(float):
        pass

    class Count(int):
        pass

    ours, python = native.Histogram(RATIO_BUCKETS), _Histogram(RATIO_BUCKETS)
    for value in (True, False, Ratio(0.3), Count(2), Fraction(1, 3), 0.25):
        ours.observe(value)
        python.observe(value)
    assert ours.counts == python.counts and ours.total == python.total
    for series in (ours, python):
        with pytest.raises(TypeError):
            series.observe("0.5")
        with pytest.raises(TypeError):  # compares (Decimal with float), then the float sum refuses it
            series.observe(Decimal("0.5"))
    assert ours.counts == python.counts and ours.total == python.total


def test_a_histogram_series_counts_an_int_beyond_any_float_before_refusing_it_as_the_python_one() -> None:
    ours, python = native.Histogram(RATIO_BUCKETS), _Histogram(RATIO_BUCKETS)
    for series in (ours, python):
        with pytest.raises(OverflowError, match="int too large to convert to float"):
            series.observe(10**400)
        with pytest.raises(OverflowError):
            series.observe(-(10**400))
        series.observe(0.5)
    assert ours.counts == python.counts and ours.counts[-1] == 1 and ours.counts[0] == 1
    assert ours.total == python.total == 0.5


def test_histogram_bounds_are_read_as_the_python_one_reads_them_even_as_they_change() -> None:
    """A bound's `__float__` that empties the list of bounds (which the C code read past: a crash) ends
    the bounds there, as the twin's generator ends; a string bound is `float()`ed as there."""

    def bounds_emptied_by_their_first() -> list[Any]:
        class Emptying:
            def __float__(self) -> float:
                bounds.clear()
                return 1.0

        bounds: list[Any] = [Emptying(), 2.0, *map(float, range(3, 200))]
        return bounds

    python = _Histogram(bounds_emptied_by_their_first())
    assert native.Histogram(bounds_emptied_by_their_first()).bounds == python.bounds == (1.0,)
    assert native.Histogram(bounds_emptied_by_their_first()).counts == [0, 0]
    assert native.Histogram(["0.5", 1, True]).bounds == _Histogram(["0.5", 1, True]).bounds == (0.5, 1.0, 1.0)


def test_a_build_of_another_interface_is_not_called(caplog: pytest.LogCaptureFixture) -> None:
    """An in-place build older than the code (a `git pull` without `pip install -e .`) would be called
    with signatures it does not have: its C paths stay off, and the log says how to rebuild."""
    from types import ModuleType

    from api.native import INTERFACE, _current

    stale = ModuleType("api._native")
    assert _current(stale) is None
    assert "pip install -e ." in caplog.text
    stale.INTERFACE = INTERFACE  # type: ignore[attr-defined]
    assert _current(stale) is stale
    assert native.INTERFACE == INTERFACE  # this tree's build is the current one

"""Inputs for fuzzing the service (this module holds no tests): hypothesis strategies for HTTP requests
and wire payloads, shared by ``tests/test_fuzz.py`` (bounded, in CI) and ``bench/fuzz.py`` (long runs).

Requests are mostly near-valid, since a fuzzer that only sends garbage never gets past the first
decoder: each route's real field names with values drawn around their edges (negative, u32 / u64
bounds, huge, wrong types), mixed with arbitrary JSON, msgpack of the same values and raw bytes.
"""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import strategies as st

from tests.test_api_support import prompt, stored_event

__all__ = ["EDGE_INTS", "FIELDS", "PATHS", "event_payloads", "json_values", "requests", "wire_payloads"]

EDGE_INTS = [0, 1, -1, 2, 15, 16, 17, 63, 64, 1023, 1024, 1025, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32,
             (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 1 << 64, -(1 << 63), -(1 << 64), 10**30]  # fmt: skip

# Field names each body may carry (the real ones, so values get past the schema's key checks).
FIELDS: dict[str, list[str]] = {
    "/v1/new": ["tokens", "request_id", "explain", "lora_name", "cache_namespace", "block_mm_infos",
                "routing_constraints", "priority_jump", "strict_priority", "router_config_override",
                "expected_output_tokens", "worker_id", "dp_rank"],
    "/v1/router": ["method", "tokens", "request_id", "block_mm_infos", "lora_name", "cache_namespace",
                   "routing_constraints", "priority_jump", "strict_priority"],
    "/v1/potential_loads": ["tokens", "lora_name", "cache_namespace", "block_mm_infos"],
    "/v1/overlap": ["tokens", "lora_name", "cache_namespace", "block_mm_infos"],
    "/v1/mark_prefill": ["request_id"],
    "/v1/mark_free": ["request_id"],
    "/v1/events": ["worker_id", "event", "event_id", "dp_rank", "data", "stored", "removed", "cleared",
                   "parent_hash", "blocks", "block_hash", "tokens_hash", "block_hashes", "start_position"],
    "/v1/workers": ["worker_id", "dp_start_rank", "dp_size", "block_size", "total_kv_blocks",
                    "max_num_batched_tokens", "taints", "leased"],
    "/v1/route": ["token_ids", "model", "request_id", "routing", "mm_routing_info", "annotations",
                  "router_config_override", "_HEALTH_CHECK", "return_request", "sampling_options"],
}  # fmt: skip
# Dynamo's RoutingHints and MmRoutingInfo fields, for the nested hints of /v1/route.
ROUTING_FIELDS = ["backend_instance_id", "dp_rank", "prefill_worker_id", "prefill_dp_rank", "decode_worker_id",
                  "expected_output_tokens", "lora_name", "cache_salt", "priority_jump", "strict_priority",
                  "priority", "allowed_worker_ids", "routing_constraints"]  # fmt: skip
MM_FIELDS = ["routing_token_ids", "block_mm_infos", "expanded_prompt_len"]
PATHS = [*FIELDS, "/v1/workers/1", "/v1/workers/18446744073709551616", "/v1/workers/-1", "/v1/workers/x",
         "/v1/dump", "/healthz", "/readyz", "/metrics", "/docs", "/openapi.json", "/", "/v1/", "/v1/new/x",
         "/v1//new", "/v1/NEW", "/%00", "/v1/workers/1/2"]  # fmt: skip
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
_METHOD_NAMES = ["new", "potential_loads", "mark_prefill", "mark_free", "route", "other", ""]

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(EDGE_INTS),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(_METHOD_NAMES),
)
json_values: st.SearchStrategy[Any] = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)
_token_lists = st.one_of(
    st.lists(st.sampled_from(EDGE_INTS), max_size=40),
    st.integers(0, 64).map(lambda n: prompt(n, n * 3)),
    st.binary(max_size=80),  # packed u32 (msgpack) or, in JSON, a wrong type
)


@st.composite
def _body_value(draw: st.DrawFn, path: str) -> Any:
    """A near-valid body for ``path``: a valid one with fields replaced, removed or added."""
    base: dict[str, Any]
    if path == "/v1/events":
        tokens = prompt(draw(st.integers(0, 5)), 64)
        event = stored_event(draw(st.sampled_from([1, 2, 0, (1 << 64) - 1])), tokens)
        base = draw(st.sampled_from([event, {"worker_id": 1, "event": {"event_id": 2, "data": "cleared"}},
                                     {"worker_id": 1, "event": {"event_id": 3, "data": {"removed": {
                                         "block_hashes": [1, 2]}}}}]))  # fmt: skip
        if draw(st.booleans()):
            return draw(st.lists(st.just(base) | json_values, max_size=3))
        base = msgspec.json.decode(msgspec.json.encode(base))
        target = base["event"]
    else:
        base = {"tokens": draw(_token_lists)} if "tokens" in FIELDS[path] else {"worker_id": 1}
        if path == "/v1/route":
            hint_values = st.sampled_from([1, 2, 0, 3]) | st.sampled_from(EDGE_INTS) | json_values
            base = {"token_ids": draw(_token_lists),
                    "routing": draw(st.dictionaries(st.sampled_from(ROUTING_FIELDS), hint_values, max_size=4)),
                    "annotations": draw(st.sampled_from([[], ["query_instance_id"], ["other"]]))}  # fmt: skip
            if draw(st.booleans()):
                base["mm_routing_info"] = draw(st.dictionaries(st.sampled_from(MM_FIELDS), hint_values | _token_lists))
        if path == "/v1/router":
            base["method"] = draw(st.sampled_from(_METHOD_NAMES))
        if "request_id" in FIELDS[path]:
            base["request_id"] = draw(st.sampled_from(["r1", "", "booked", "x" * 300]) | st.text(max_size=8))
        target = base
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(FIELDS[path]) | st.text(max_size=8))
        action = draw(st.sampled_from(["set", "set", "delete"]))
        if action == "delete":
            target.pop(key, None)
        else:
            target[key] = draw(json_values | st.sampled_from(EDGE_INTS) | _token_lists)
    return base


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, str, bytes, dict[str, str]]:
    """(method, path, body bytes, headers) of one HTTP request."""
    path = draw(st.sampled_from(PATHS))
    method = "POST" if path in FIELDS and draw(st.integers(0, 9)) else draw(st.sampled_from(METHODS))
    value = draw(_body_value(path)) if path in FIELDS else draw(json_values)
    encoding = draw(st.sampled_from(["json", "json", "msgpack", "raw", "truncated"]))
    headers: dict[str, str] = {}
    if encoding == "msgpack":
        body = _encoded(value, msgpack=True)
        headers["content-type"] = "application/msgpack"
    elif encoding == "raw":
        body = draw(st.binary(max_size=200))
        headers["content-type"] = draw(st.sampled_from(["application/json", "application/msgpack", "text/plain"]))
    else:
        body = msgspec.json.encode(value)
        if encoding == "truncated" and body:
            body = body[: draw(st.integers(0, len(body) - 1))]
        headers["content-type"] = "application/json"
    if draw(st.booleans()):
        headers["accept"] = draw(st.sampled_from(["application/msgpack", "application/json", "*/*", "x"]))
    if draw(st.booleans()):
        headers["x-request-id"] = draw(st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=40))
    if draw(st.integers(0, 4)) == 0:
        headers["authorization"] = draw(st.sampled_from(["Bearer x", "Basic y", "", "Bearer"]))
    return method, path, body, headers


def _encoded(value: Any, msgpack: bool) -> bytes:
    if msgpack:
        try:
            return msgspec.msgpack.encode(value)
        except OverflowError:  # msgpack has no integers past 64 bits; JSON does
            return msgspec.msgpack.encode(msgspec.json.encode(value))  # a str body: refused as well
    return msgspec.json.encode(value)


@st.composite
def event_payloads(draw: st.DrawFn) -> bytes:
    """Bytes as a KV event message carries them: near-valid RouterEvents (JSON or msgpack) or garbage."""
    kind = draw(st.integers(0, 4))
    if kind == 0:
        return draw(st.binary(max_size=300))
    value = draw(_body_value("/v1/events"))
    data = _encoded(value, msgpack=kind == 1)
    if kind == 2 and data:
        index = draw(st.integers(0, len(data) - 1))
        data = data[:index] + bytes([draw(st.integers(0, 255))]) + data[index + 1 :]
    return data


_WIRE_FIELDS = {
    "heartbeat": ["worker_id", "sent_at_ms", "registration"],
    "load": ["worker_id", "dp_rank", "kv_used_blocks", "active_decode_blocks", "active_prefill_tokens"],
    "registration": FIELDS["/v1/workers"],
    "resync": ["Events", "TreeDump", "TooNew", "Error", "events", "last_event_id", "latest_event_id"],
}


@st.composite
def wire_payloads(draw: st.DrawFn, kind: str) -> bytes:
    """A heartbeat, load, registration or resync reply payload: near-valid JSON / msgpack, or garbage."""
    if draw(st.integers(0, 5)) == 0:
        return draw(st.binary(max_size=200))
    value: dict[str, Any] = {"worker_id": draw(st.sampled_from([1, 2, 0]) | st.sampled_from(EDGE_INTS))}
    if kind == "resync":
        batch = {"events": draw(st.lists(_body_value("/v1/events"), max_size=2)), "last_event_id": 3}
        value = {draw(st.sampled_from(["Events", "TreeDump", "TooNew", "Error"])): batch}
    for _ in range(draw(st.integers(0, 4))):
        key = draw(st.sampled_from(_WIRE_FIELDS[kind]))
        value[key] = draw(json_values | st.sampled_from(EDGE_INTS))
    return _encoded(value, msgpack=kind == "resync" and draw(st.booleans()))

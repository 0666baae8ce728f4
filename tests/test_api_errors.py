"""Bad input, route by route: each gets ``{"error": {"type", "message"}}`` with the right status, and
the router's state (workers and their live loads, the index, potential loads) is unchanged after it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from fastapi.testclient import TestClient

from tests.test_api_support import MSGPACK, metric, msgpack, prompt, serve, state, stored_event

TOKENS = prompt(0, 64)
JSON_HEADERS = {"content-type": "application/json"}
MSGPACK_IN = {"content-type": MSGPACK["content-type"]}

# (route, body bytes, headers, expected status, expected error type)
CASES: list[tuple[str, bytes, dict[str, str], int, str]] = [
    # malformed bodies
    ("/v1/new", b'{"tokens": [1, 2', JSON_HEADERS, 400, "malformed_body"),
    ("/v1/router", b"not json", JSON_HEADERS, 400, "malformed_body"),
    ("/v1/potential_loads", b"\xc1", MSGPACK_IN, 400, "malformed_body"),
    ("/v1/events", b"[{", JSON_HEADERS, 400, "invalid_events"),
    ("/v1/workers", b"{", JSON_HEADERS, 400, "malformed_body"),
    # A misspelt setting is named, not silently left at its default.
    ("/v1/workers", b'{"worker_id": 77, "dp_sise": 8}', JSON_HEADERS, 422, "invalid_request"),
    # wrong types and shapes
    ("/v1/new", b'{"tokens": "seven"}', JSON_HEADERS, 422, "invalid_request"),  # not base64 packed tokens
    ("/v1/new", b'{"tokens": [1.5]}', JSON_HEADERS, 422, "invalid_request"),
    ("/v1/new", b'{"tokens": [1], "priority": 3}', JSON_HEADERS, 422, "invalid_request"),
    ("/v1/new", msgpack({"tokens": [1], "priority_jump": float("nan")}), MSGPACK_IN, 422, "invalid_request"),
    # Dynamo's u32 fields: a negative or huge value would reach the replicas' sync and the load's decay.
    ("/v1/new", b'{"tokens": [1], "expected_output_tokens": -1}', JSON_HEADERS, 422, "invalid_request"),
    ("/v1/new", msgpack({"tokens": [1], "expected_output_tokens": 2**64 - 1}), MSGPACK_IN, 422, "invalid_request"),
    ("/v1/new", b'{"tokens": [1], "strict_priority": -1}', JSON_HEADERS, 422, "invalid_request"),
    ("/v1/new", b'{"tokens": [1], "request_id": "has space"}', JSON_HEADERS, 422, "invalid_request"),
    ("/v1/new", b'{"tokens": []}', JSON_HEADERS, 422, "invalid_request"),
    ("/v1/router", b'{"tokens": [1]}', JSON_HEADERS, 422, "invalid_request"),
    ("/v1/router", b'{"method": "rout", "tokens": [1]}', JSON_HEADERS, 422, "invalid_request"),
    ("/v1/router", b'{"method": "mark_free"}', JSON_HEADERS, 422, "invalid_request"),
    # A credit past MAX_WEIGHT: the prompt is cached on worker 1, where it overflowed the cost (a 500).
    ("/v1/new", json.dumps({"tokens": TOKENS, "router_config_override": {"overlap_score_credit": 1e308}}).encode(),
     JSON_HEADERS, 422, "invalid_request"),
    ("/v1/router", json.dumps({"method": "new", "tokens": TOKENS, "request_id": "big",
     "router_config_override": {"overlap_score_credit": 1e308}}).encode(), JSON_HEADERS, 422, "invalid_request"),
    ("/v1/mark_prefill", b"{}", JSON_HEADERS, 422, "invalid_request"),
    ("/v1/mark_free", b'{"request_id": 7}', JSON_HEADERS, 422, "invalid_request"),
    ("/v1/overlap", b'{"token_ids": [1]}', JSON_HEADERS, 422, "invalid_request"),
    ("/v1/events", b'{"worker_id": 1}', JSON_HEADERS, 400, "invalid_events"),
    ("/v1/events", b'{"worker_id": -1, "event": {"event_id": 1, "data": "cleared"}}', JSON_HEADERS, 400,
     "invalid_events"),
    ("/v1/workers", b'{"worker_id": 3, "dp_size": 0}', JSON_HEADERS, 422, "invalid_request"),
    ("/v1/workers", b'{"worker_id": "three"}', JSON_HEADERS, 422, "invalid_request"),
    # token ids outside u32
    ("/v1/new", b'{"tokens": [1, 4294967296]}', JSON_HEADERS, 422, "invalid_request"),
    ("/v1/potential_loads", b'{"tokens": [-1]}', JSON_HEADERS, 422, "invalid_request"),
    ("/v1/router", b'{"method": "new", "tokens": [99999999999]}', JSON_HEADERS, 422, "invalid_request"),
    # packed tokens whose length is not a multiple of 4
    ("/v1/new", msgpack({"tokens": b"\x01\x00\x00\x00\x02"}), MSGPACK_IN, 400, "malformed_body"),
    ("/v1/overlap", msgpack({"tokens": b"\x01"}), MSGPACK_IN, 400, "malformed_body"),
    ("/v1/router", msgpack({"method": "potential_loads", "tokens": b"abc"}), MSGPACK_IN, 400, "malformed_body"),
    # a prompt over the token limit (100 in these tests)
    ("/v1/new", b'{"tokens": [' + b",".join([b"1"] * 101) + b"]}", JSON_HEADERS, 413, "prompt_too_long"),
    ("/v1/potential_loads", msgpack({"tokens": bytes(404)}), MSGPACK_IN, 413, "prompt_too_long"),
    ("/v1/router", b'{"method": "new", "tokens": [' + b",".join([b"1"] * 101) + b"]}", JSON_HEADERS, 413,
     "prompt_too_long"),
    # unknown request ids on the separate routes
    ("/v1/mark_prefill", b'{"request_id": "nope"}', JSON_HEADERS, 404, "unknown_request_id"),
    ("/v1/mark_free", b'{"request_id": "nope"}', JSON_HEADERS, 404, "unknown_request_id"),
]  # fmt: skip


def _route(**fields: Any) -> bytes:
    return json.dumps({"token_ids": TOKENS, **fields}).encode()


# Dynamo's PreprocessedRequest on /v1/route (and /v1/router's route method): (route, body, headers,
# status, type, what the message must name). Workers 1 and 2 have one dp rank each, worker 3 two.
ROUTE_CASES: list[tuple[str, bytes, dict[str, str], int, str, str]] = [
    ("/v1/route", b'{"token_ids": [1, 2', JSON_HEADERS, 400, "malformed_body", "JSON"),
    ("/v1/route", b'{"model": "m"}', JSON_HEADERS, 422, "invalid_request", "token_ids"),
    ("/v1/route", b'{"token_ids": "seven"}', JSON_HEADERS, 422, "invalid_request", "token_ids"),
    ("/v1/route", b'{"token_ids": []}', JSON_HEADERS, 422, "invalid_request", "token_ids"),
    ("/v1/route", b'{"token_ids": [1, 4294967296]}', JSON_HEADERS, 422, "invalid_request", "$.token_ids[1]"),
    ("/v1/route", msgpack({"token_ids": b"\x01\x00\x00\x00\x02"}), MSGPACK_IN, 400, "malformed_body", "token_ids"),
    ("/v1/router", msgpack({"method": "route", "token_ids": b"abc"}), MSGPACK_IN, 400, "malformed_body",
     "token_ids"),
    ("/v1/route", msgpack({"token_ids": bytes(404)}), MSGPACK_IN, 413, "prompt_too_long", "token_ids"),
    ("/v1/route", _route(model=7), JSON_HEADERS, 422, "invalid_request", "$.model"),
    ("/v1/route", _route(annotations="query_instance_id"), JSON_HEADERS, 422, "invalid_request", "$.annotations"),
    ("/v1/route", _route(request_id="has space"), JSON_HEADERS, 422, "invalid_request", "$.request_id"),
    ("/v1/route", msgpack({"token_ids": [1], "return_request": True, "engine": msgspec.msgpack.Ext(1, b"x")}),
     MSGPACK_IN, 422, "invalid_request", "return_request"),
    ("/v1/route", _route(routing={"backend_instance_id": 9}), JSON_HEADERS, 404, "unknown_worker",
     "routing.backend_instance_id: worker 9"),
    ("/v1/router", b'{"method": "route", "token_ids": [1], "routing": {"backend_instance_id": 9}}', JSON_HEADERS,
     404, "unknown_worker", "routing.backend_instance_id"),
    ("/v1/route", _route(routing={"backend_instance_id": 1, "dp_rank": 1}), JSON_HEADERS, 404, "unknown_worker",
     "routing.dp_rank"),
    ("/v1/route", _route(routing={"backend_instance_id": 3}), JSON_HEADERS, 422, "invalid_request",
     "routing.dp_rank: worker 3 has dp ranks 0..1"),
    ("/v1/route", _route(routing={"dp_rank": -1}), JSON_HEADERS, 422, "invalid_request", "$.routing.dp_rank"),
    ("/v1/route", _route(routing={"backend_instance_id": 1, "allowed_worker_ids": [2]}), JSON_HEADERS, 422,
     "invalid_request", "routing.allowed_worker_ids"),
    ("/v1/route", _route(routing={"allowed_worker_ids": [-2]}), JSON_HEADERS, 422, "invalid_request",
     "$.routing.allowed_worker_ids"),
    ("/v1/route", _route(routing={"allowed_worker_ids": [9]}), JSON_HEADERS, 503, "no_eligible_worker", "worker"),
    ("/v1/route", _route(routing={"prefill_worker_id": 9}), JSON_HEADERS, 404, "unknown_worker",
     "routing.prefill_worker_id"),
    ("/v1/route", _route(routing={"prefill_worker_id": 1, "prefill_dp_rank": 3}), JSON_HEADERS, 404,
     "unknown_worker", "routing.prefill_dp_rank"),
    ("/v1/route", _route(routing={"prefill_dp_rank": 0}), JSON_HEADERS, 422, "invalid_request",
     "routing.prefill_dp_rank"),
    ("/v1/route", _route(routing={"decode_worker_id": 9}), JSON_HEADERS, 404, "unknown_worker",
     "routing.decode_worker_id"),
    ("/v1/route", _route(routing={"cache_salt": 5}), JSON_HEADERS, 422, "invalid_request", "$.routing.cache_salt"),
    ("/v1/route", _route(routing={"strict_priority": -1}), JSON_HEADERS, 422, "invalid_request",
     "$.routing.strict_priority"),
    ("/v1/route", _route(routing={"priority": 2**31}), JSON_HEADERS, 422, "invalid_request", "$.routing.priority"),
    ("/v1/route", msgpack({"token_ids": [1], "routing": {"priority_jump": float("nan")}}), MSGPACK_IN, 422,
     "invalid_request", "$.routing.priority_jump"),
    ("/v1/route", _route(routing={"routing_constraints": {"required_taints": ["gpu=h100"]}}), JSON_HEADERS, 503,
     "no_eligible_worker", "gpu=h100"),
    ("/v1/route", _route(router_config_override={"router_temperature": -1.0}), JSON_HEADERS, 422,
     "invalid_request", "router_config_override"),
    ("/v1/route", _route(router_config_override={"prefill_load_scale": 1e7}), JSON_HEADERS, 422,
     "invalid_request", "prefill_load_scale: must be a number from 0 to 1e+06"),
    ("/v1/route", _route(router_config_override={"router_temperature": "hot"}), JSON_HEADERS, 422,
     "invalid_request", "$.router_config_override.router_temperature"),
    ("/v1/route", _route(mm_routing_info={"routing_token_ids": [1]}), JSON_HEADERS, 422, "invalid_request",
     "block_mm_infos"),
    ("/v1/route", _route(mm_routing_info={"routing_token_ids": [1], "block_mm_infos": [{"mm_objects": [{
     "mm_hash": -1, "offsets": [[0, 1]]}]}]}), JSON_HEADERS, 422, "invalid_request", "mm_hash"),
    ("/v1/route", _route(mm_routing_info={"routing_token_ids": [1] * 101, "block_mm_infos": []}), JSON_HEADERS, 413,
     "prompt_too_long", "mm_routing_info.routing_token_ids"),
    ("/v1/route", _route(mm_routing_info={"routing_token_ids": [1], "block_mm_infos": [None],
     "expanded_prompt_len": 2**64 - 1}), JSON_HEADERS, 413, "prompt_too_long", "mm_routing_info.expanded_prompt_len"),
]  # fmt: skip
CASES += [case[:5] for case in ROUTE_CASES]


@pytest.fixture(params=[True, False], ids=["protocol", "asgi"])
def client(request: pytest.FixtureRequest) -> Iterator[TestClient]:
    with serve(fast_protocol=request.param, max_prompt_tokens=100, max_body_bytes=4096) as client:
        for worker_id in (1, 2):
            client.post("/v1/workers", json={"worker_id": worker_id})
        client.post("/v1/workers", json={"worker_id": 3, "dp_size": 2})
        client.post("/v1/events", json=stored_event(1, TOKENS))
        assert client.post("/v1/new", json={"tokens": TOKENS, "request_id": "live"}).status_code == 200
        yield client


def _assert_error(reply: Any, status: int, kind: str) -> None:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert error["type"] == kind
    assert isinstance(error["message"], str) and error["message"]


@pytest.mark.parametrize(
    ("route", "body", "headers", "status", "kind"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_bad_request_is_refused_and_changes_nothing(
    client: TestClient, route: str, body: bytes, headers: dict[str, str], status: int, kind: str
) -> None:
    before = state(client)
    _assert_error(client.post(route, content=body, headers=headers), status, kind)
    assert state(client) == before


@pytest.mark.parametrize(
    ("route", "body", "headers", "status", "kind", "names"),
    ROUTE_CASES,
    ids=[f"{c[0]}-{i}" for i, c in enumerate(ROUTE_CASES)],
)
def test_a_refused_preprocessed_request_names_its_field(
    client: TestClient, route: str, body: bytes, headers: dict[str, str], status: int, kind: str, names: str
) -> None:
    reply = client.post(route, content=body, headers=headers)
    _assert_error(reply, status, kind)
    assert names in reply.json()["error"]["message"]


# A prompt of neither form: what the field takes, after msgspec's words (which name neither form).
AS_JSON = "is an array of u32 token ids (or, as a string, base64 of packed little-endian u32)"
AS_MSGPACK = "is an array of u32 token ids (or a bin of packed little-endian u32)"
PROMPT_FORMS = [
    ("/v1/new", b'{"tokens": "abc"}', JSON_HEADERS, f"Invalid base64 encoded string - at `$.tokens`; tokens {AS_JSON}"),
    ("/v1/router", b'{"method": "new", "tokens": 7}', JSON_HEADERS,
     f"Expected `bytes | array`, got `int` - at `$.tokens`; tokens {AS_JSON}"),
    ("/v1/route", b'{"token_ids": "seven"}', JSON_HEADERS,
     f"Invalid base64 encoded string - at `$.token_ids`; token_ids {AS_JSON}"),
    ("/v1/potential_loads", msgpack({"tokens": "abc"}), MSGPACK_IN,
     f"Expected `bytes | array`, got `str` - at `$.tokens`; tokens {AS_MSGPACK}"),
]  # fmt: skip


@pytest.mark.parametrize(("route", "body", "headers", "message"), PROMPT_FORMS, ids=[c[0] for c in PROMPT_FORMS])
def test_a_prompt_of_neither_form_is_told_the_forms_it_takes(
    client: TestClient, route: str, body: bytes, headers: dict[str, str], message: str
) -> None:
    reply = client.post(route, content=body, headers=headers)
    assert reply.status_code == 422
    assert reply.json() == {"error": {"type": "invalid_request", "message": message}}


JSON_AS_MSGPACK = (
    "the body is not msgpack (Content-Type: application/msgpack); it looks like JSON: send Content-Type: "
    "application/json"
)


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/new", b'{"tokens": [1, 2]}'),
        ("/v1/router", b' \n{"method": "new", "tokens": [1, 2]}'),
        ("/v1/potential_loads", b'{"tokens": [1, 2'),  # not even valid JSON: still JSON's look
        ("/v1/workers", b'{"worker_id": 9}'),
    ],
    ids=["new", "router-after-whitespace", "potential_loads-truncated", "workers"],
)
def test_json_sent_as_msgpack_is_told_to_say_json(client: TestClient, route: str, body: bytes) -> None:
    before = state(client)
    reply = client.post(route, content=body, headers=MSGPACK_IN)
    assert reply.status_code == 400
    assert reply.json() == {"error": {"type": "malformed_body", "message": JSON_AS_MSGPACK}}
    assert state(client) == before


# Weights msgpack can carry but no cost can use: NaN or infinite taint weights and shared-cache multipliers.
_NAN_TAINT = {"routing_constraints": {"preferred_taints": {"gpu=h100": float("nan")}}}
NON_FINITE_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/new", {"tokens": TOKENS, **_NAN_TAINT}, "$.routing_constraints.preferred_taints"),
    ("/v1/router", {"method": "new", "tokens": TOKENS, **_NAN_TAINT}, "$.routing_constraints.preferred_taints"),
    ("/v1/route", {"token_ids": TOKENS, "routing": _NAN_TAINT}, "$.routing.routing_constraints.preferred_taints"),
    ("/v1/route", {"token_ids": TOKENS, "routing": {"routing_constraints": {"preferred_taints": {"a": float("inf")}}}},
     "$.routing.routing_constraints.preferred_taints"),
    ("/v1/new", {"tokens": TOKENS, "router_config_override": {"shared_cache_multiplier": float("nan")}},
     "$.router_config_override.shared_cache_multiplier"),
    ("/v1/route", {"token_ids": TOKENS, "router_config_override": {"shared_cache_multiplier": float("-inf")}},
     "$.router_config_override.shared_cache_multiplier"),
]  # fmt: skip


@pytest.mark.parametrize(("route", "body", "names"), NON_FINITE_CASES, ids=[c[0] for c in NON_FINITE_CASES])
def test_a_non_finite_weight_is_refused_naming_its_field(
    client: TestClient, route: str, body: dict[str, Any], names: str
) -> None:
    client.post("/v1/workers", json={"worker_id": 4, "taints": ["gpu=h100", "a"]})
    before = state(client)
    reply = client.post(route, content=msgpack(body), headers=MSGPACK_IN)
    _assert_error(reply, 422, "invalid_request")
    assert names in reply.json()["error"]["message"]
    assert state(client) == before


# Unknown members nested past msgspec's depth: it gives up with a RecursionError while skipping them.
DEEP_JSON = b'{"x": ' + b"[" * 3000
DEEP_MSGPACK = b"\x81\xa1x" + b"\x91" * 3000


@pytest.mark.parametrize(
    ("route", "body", "headers"),
    [("/v1/new", DEEP_JSON, JSON_HEADERS), ("/v1/router", DEEP_MSGPACK, MSGPACK_IN),
     ("/v1/potential_loads", DEEP_MSGPACK, MSGPACK_IN), ("/v1/events", DEEP_JSON, JSON_HEADERS)],
)  # fmt: skip
def test_nesting_past_msgspecs_depth_is_a_client_error(
    client: TestClient, route: str, body: bytes, headers: dict[str, str]
) -> None:
    before = state(client)
    reply = client.post(route, content=body, headers=headers)
    # The fast path skips unknown members (400, msgspec's recursion message); FastAPI's routes refuse
    # them as unknown fields first (422) on the request bodies.
    if reply.status_code == 400:
        _assert_error(reply, 400, "invalid_events" if route == "/v1/events" else "malformed_body")
        assert "recursion" in reply.json()["error"]["message"]
    else:
        _assert_error(reply, 422, "invalid_request")
    assert state(client) == before


# Worker ids past u64, which Dynamo's RoutingHints fail to deserialize: 422 naming the hint, not a 404 for a
# worker that cannot exist nor an allowed id left out.
U64_OVERFLOW_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/route", {"backend_instance_id": 2**64}, "backend_instance_id"),
    ("/v1/route", {"prefill_worker_id": 2**64}, "prefill_worker_id"),
    ("/v1/route", {"decode_worker_id": 2**64}, "decode_worker_id"),
    ("/v1/route", {"allowed_worker_ids": [2**64]}, "allowed_worker_ids"),
    ("/v1/route", {"allowed_worker_ids": [1, 2**70]}, "allowed_worker_ids"),
    ("/v1/router", {"backend_instance_id": 2**64, "dp_rank": 0}, "backend_instance_id"),
]


@pytest.mark.parametrize(("route", "routing", "names"), U64_OVERFLOW_CASES, ids=[c[2] for c in U64_OVERFLOW_CASES])
def test_a_worker_id_hint_past_u64_is_refused_naming_it(
    client: TestClient, route: str, routing: dict[str, Any], names: str
) -> None:
    before = state(client)
    method = {"method": "route"} if route == "/v1/router" else {}
    reply = client.post(route, content=_route(routing=routing, **method), headers=JSON_HEADERS)
    _assert_error(reply, 422, "invalid_request")
    message = reply.json()["error"]["message"]
    assert names in message and "$.routing" in message and "u64" in message
    assert state(client) == before
    # The largest u64 is a worker id like any other: not registered, a 404 / no candidate, not a 422.
    top = {**routing, names: [2**64 - 1] if isinstance(routing[names], list) else 2**64 - 1}
    reply = client.post(route, content=_route(routing=top, **method), headers=JSON_HEADERS)
    assert reply.status_code in (404, 503), reply.text
    assert state(client) == before


@pytest.mark.parametrize("weight", [-1.0, float("nan")])
def test_a_bad_overlap_score_weight_is_refused_under_its_own_name(client: TestClient, weight: float) -> None:
    """``overlap_score_weight`` is Dynamo's alias of ``prefill_load_scale``: a bad value is named as sent."""
    override = {"router_config_override": {"overlap_score_weight": weight}}
    before = state(client)
    for route, body in (("/v1/route", {"token_ids": TOKENS, **override}), ("/v1/new", {"tokens": TOKENS, **override})):
        reply = client.post(route, content=msgpack(body), headers=MSGPACK_IN)
        _assert_error(reply, 422, "invalid_request")
        message = reply.json()["error"]["message"]
        assert "router_config_override: overlap_score_weight" in message and "prefill_load_scale" not in message
    assert state(client) == before


def test_events_and_mm_objects_dynamo_refuses_are_refused(client: TestClient) -> None:
    """Event data with a second key (null or unknown) or a multimodal object without offsets or with a
    negative one: /v1/events refuses the batch (invalid_events) and /v1/route's mm_routing_info the
    request (422 naming the field); nothing changes."""
    block = {"block_hash": 1, "tokens_hash": 2}
    stored = {"stored": {"parent_hash": None, "blocks": [block]}}
    bad_mm = [{"mm_hash": 3}, {"mm_hash": 3, "offsets": [[-1, 2]]}]
    before = state(client)
    datas = [{**stored, "removed": None}, {**stored, "bogus": 1}]
    datas += [{"stored": {"blocks": [{**block, "mm_extra_info": {"mm_objects": [mm]}}]}} for mm in bad_mm]
    for data in datas:
        event = {"worker_id": 1, "event": {"event_id": 99, "dp_rank": 0, "data": data}}
        _assert_error(client.post("/v1/events", json=event), 400, "invalid_events")
    for mm in bad_mm:
        info = {"routing_token_ids": TOKENS, "block_mm_infos": [{"mm_objects": [mm]}]}
        reply = client.post("/v1/route", content=_route(mm_routing_info=info), headers=JSON_HEADERS)
        _assert_error(reply, 422, "invalid_request")
        assert "$.mm_routing_info.block_mm_infos[0].mm_objects[0]" in reply.json()["error"]["message"]
    assert state(client) == before


def test_router_variants_ignore_unknown_fields_as_dynamo_does(client: TestClient) -> None:
    """Dynamo's `RouterRequest` (serde, tagged by "method", no deny_unknown_fields) ignores fields it
    does not name, so a newer Dynamo client's additions are not refused on ``/v1/router``; our own
    separate routes stay strict: a misspelt field there is a 422 naming it."""
    tokens = prompt(3, 32)
    loads = client.post("/v1/router", json={"method": "potential_loads", "tokens": tokens}).json()
    reply = client.post("/v1/router", json={"method": "potential_loads", "tokens": tokens, "newer_field": 1})
    assert (reply.status_code, reply.json()) == (200, loads)
    reply = client.post("/v1/router", json={"method": "new", "tokens": tokens, "request_id": "n", "policy_class": "x"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["method"] == "new"
    for method, answer in (("mark_prefill", "prefill_marked"), ("mark_free", "free_marked")):
        reply = client.post("/v1/router", json={"method": method, "request_id": "n", "newer_field": [1]})
        assert (reply.status_code, reply.json()) == (200, {"method": answer, "success": True})
    before = state(client)
    for route, body in (
        ("/v1/new", {"tokens": tokens, "policy_class": "x"}),
        ("/v1/potential_loads", {"tokens": tokens, "newer_field": 1}),
        ("/v1/mark_free", {"request_id": "live", "newer_field": 1}),
    ):
        reply = client.post(route, json=body)
        _assert_error(reply, 422, "invalid_request")
        assert "unknown field" in reply.json()["error"]["message"]
    assert state(client) == before


def test_duplicate_active_request_id_is_a_conflict(client: TestClient) -> None:
    before = state(client)
    for route, body in (
        ("/v1/new", {"tokens": prompt(1, 32), "request_id": "live"}),
        ("/v1/router", {"method": "new", "tokens": prompt(1, 32), "request_id": "live"}),
    ):
        _assert_error(client.post(route, json=body), 409, "duplicate_request_id")
    _assert_error(client.post("/v1/new", json={"tokens": prompt(1, 32)}, headers={"x-request-id": "live"}), 409,
                  "duplicate_request_id")  # fmt: skip
    assert state(client) == before


def test_body_over_the_limit(client: TestClient) -> None:
    before = state(client)
    big = b'{"tokens": [' + b",".join([b"1"] * 3000) + b"]}"
    for route in ("/v1/new", "/v1/router", "/v1/events", "/v1/workers"):
        _assert_error(client.post(route, content=big, headers=JSON_HEADERS), 413, "body_too_large")

    # Without Content-Length (chunked upload), the limit is enforced while reading.
    def chunks() -> Iterator[bytes]:
        for start in range(0, len(big), 1000):
            yield big[start : start + 1000]

    for route in ("/v1/new", "/v1/workers"):
        _assert_error(client.post(route, content=chunks(), headers=JSON_HEADERS), 413, "body_too_large")
    assert state(client) == before


def test_no_worker_and_unknown_routes(client: TestClient) -> None:
    constrained = {"tokens": TOKENS, "routing_constraints": {"required_taints": ["gpu=b200"]}}
    before = state(client)
    _assert_error(client.post("/v1/new", json=constrained), 503, "no_eligible_worker")
    _assert_error(client.delete("/v1/workers/77"), 404, "unknown_worker")
    _assert_error(client.get("/v1/workers/77"), 404, "unknown_worker")
    _assert_error(client.delete("/v1/workers/seven"), 422, "invalid_request")
    _assert_error(client.get("/v1/nothing"), 404, "not_found")
    _assert_error(client.put("/v1/new", json={}), 405, "method_not_allowed")
    assert state(client) == before


def test_errors_are_counted_by_method_and_outcome(client: TestClient) -> None:
    client.post("/v1/new", content=b"{", headers=JSON_HEADERS)
    client.post("/v1/router", content=b'{"method": "x"}', headers=JSON_HEADERS)
    client.post("/v1/router", json={"method": "new", "tokens": prompt(1, 32), "request_id": "live"})
    assert metric(client, "kv_router_requests_total", method="new", outcome="malformed_body") == 1
    assert metric(client, "kv_router_requests_total", method="router", outcome="invalid_request") == 1
    assert metric(client, "kv_router_requests_total", method="new", outcome="duplicate_request_id") == 1


def test_packed_tokens_reach_the_hasher_as_bytes(client: TestClient) -> None:
    """The msgpack path hands packed tokens to the router as one bytes object: a 16k-token prompt
    costs no per-token Python objects (the list path would allocate about 16k * 32 bytes of ints)."""
    import tracemalloc

    tokens = prompt(2, 100)
    packed = struct.pack(f"<{len(tokens)}I", *tokens)
    as_list = client.post("/v1/overlap", json={"tokens": tokens}).json()
    assert client.post("/v1/overlap", content=msgpack({"tokens": packed}), headers=MSGPACK_IN).json() == as_list

    big = bytes(range(256)) * 256  # 16,384 tokens, 64 KiB
    with serve(max_body_bytes=1 << 20) as roomy:
        roomy.post("/v1/workers", json={"worker_id": 1})
        body = msgpack({"tokens": big})
        roomy.post("/v1/overlap", content=body, headers=MSGPACK_IN)  # warm-up
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            assert roomy.post("/v1/overlap", content=body, headers=MSGPACK_IN).status_code == 200
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
    # A few copies of the 64 KiB body (through the protocol: the read, the body, the decoded bin, about
    # 200 KiB with the client's) but not the list path's 16k ints and their list (about 600 KiB more).
    assert peak < 16_384 * 32, peak

"""``POST /v1/route`` and ``/v1/router``'s ``route`` method: Dynamo's `PreprocessedRequest` routed by
every one of its routing inputs, in each of the forms Dynamo serializes it.

Each test drives a real app (`create_app`, its lifespan, the FastAPI route or the hot protocol's
``/v1/router``) with real KV events, and checks what a gateway sees: the chosen worker and rank, the
overlap, what was booked where (``/v1/workers``), what came back.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from api.app import create_app
from api.config import ServiceConfig, Settings
from indexer.events import RouterEvent
from indexer.events import stored_event as kv_stored_event
from indexer.hashing import compute_block_hashes, compute_sequence_hashes
from router.config import RouterConfig
from tests.dynamo_fleet import prompt_stored_event
from tests.test_api_support import BLOCK_SIZE, MSGPACK, serve, state, stored_event
from tests.waiting import eventually

TOKENS = list(range(1000, 1000 + 4 * BLOCK_SIZE))  # below 2^31: Dynamo packs them as int32
# Fields of a PreprocessedRequest the router does not read (the engine's), and one from the future.
ENGINE_FIELDS: dict[str, Any] = {
    "stop_conditions": {"max_tokens": 16, "ignore_eos": False},
    "sampling_options": {"temperature": 0.7, "n": 1},
    "output_options": {"logprobs": None},
    "eos_token_ids": [2],
    "mdc_sum": None,
    "bootstrap_info": {"bootstrap_host": "10.0.0.1", "bootstrap_port": 9000, "bootstrap_room": 7},
    "extra_args": {"anything": [1, 2]},
    "_HEALTH_CHECK": False,
    "a_field_of_a_later_release": {"nested": True},
}


def _register(client: TestClient, *workers: dict[str, Any]) -> None:
    for worker in workers:
        assert client.post("/v1/workers", json=worker).status_code == 201


def _active(client: TestClient, worker_id: int) -> dict[int, tuple[int, int]]:
    """Per dp rank of the worker: (active requests, active prefill tokens)."""
    ranks = client.get(f"/v1/workers/{worker_id}").json()["ranks"]
    return {r["dp_rank"]: (r["active_requests"], r["active_prefill_tokens"]) for r in ranks}


@pytest.fixture
def client() -> Iterator[TestClient]:
    with serve() as client:
        _register(client, {"worker_id": 1}, {"worker_id": 2, "dp_size": 2})
        client.post("/v1/events", json=stored_event(1, TOKENS))
        yield client


def _decision(reply: httpx.Response) -> tuple[int, int, int, int]:
    assert reply.status_code == 200, reply.text
    body = msgspec.msgpack.decode(reply.content) if "msgpack" in reply.headers["content-type"] else reply.json()
    return body["worker_id"], body["dp_rank"], body["overlap_blocks"], body["cached_tokens"]


@pytest.mark.parametrize("door", ["/v1/route", "/v1/router"])
def test_json_msgpack_and_packed_int32_token_ids_route_and_book_alike(client: TestClient, door: str) -> None:
    method = {"method": "route"} if door == "/v1/router" else {}
    packed = struct.pack(f"<{len(TOKENS)}i", *TOKENS)
    forms = [
        (msgspec.json.encode({**method, "token_ids": TOKENS, **ENGINE_FIELDS}), {"content-type": "application/json"}),
        (msgspec.msgpack.encode({**method, "token_ids": TOKENS, **ENGINE_FIELDS}), MSGPACK),
        (msgspec.msgpack.encode({**method, "token_ids": packed, "model": "m", **ENGINE_FIELDS}), MSGPACK),
    ]
    for i, (body, headers) in enumerate(forms):
        reply = client.post(door, content=body, headers={**headers, "x-request-id": f"r{i}"})
        assert _decision(reply) == (1, 0, 4, 4 * BLOCK_SIZE)
        assert reply.headers["x-request-id"] == f"r{i}"
        assert _active(client, 1) == {0: (i + 1, 0)}  # all of it cached: no prefill left to load it
    for i in range(len(forms)):
        assert client.post("/v1/mark_free", json={"request_id": f"r{i}"}).status_code == 200
    assert _active(client, 1) == {0: (0, 0)}


def test_a_pinned_rank_is_booked_like_any_other(client: TestClient) -> None:
    pinned = {"backend_instance_id": 2, "dp_rank": 1}
    reply = client.post("/v1/route", json={"token_ids": TOKENS, "routing": pinned, "request_id": "p"})
    assert _decision(reply) == (2, 1, 0, 0)
    assert reply.json()["receipt"]["reason"] == "pinned"
    assert _active(client, 2) == {0: (0, 0), 1: (1, len(TOKENS))}
    # One rank: the worker is enough. The prompt's cache on worker 1 does not move a pinned request.
    reply = client.post("/v1/route", json={"token_ids": TOKENS, "routing": {"backend_instance_id": 1}})
    assert _decision(reply)[:2] == (1, 0)
    assert client.post("/v1/mark_free", json={"request_id": "p"}).status_code == 200
    assert _active(client, 2) == {0: (0, 0), 1: (0, 0)}


def test_a_dp_rank_without_a_worker_is_reported_unused(client: TestClient) -> None:
    reply = client.post("/v1/route", json={"token_ids": TOKENS, "routing": {"dp_rank": 1}})
    assert _decision(reply)[:2] == (1, 0)
    assert reply.json()["unused_hints"] == ["dp_rank"]


def test_allowed_worker_ids_limit_the_candidates(client: TestClient) -> None:
    assert _decision(client.post("/v1/route", json={"token_ids": TOKENS}))[0] == 1
    allowed = {"allowed_worker_ids": [2, 99]}  # 99 is not registered: left out, as Dynamo does
    for _ in range(4):
        reply = client.post("/v1/route", json={"token_ids": TOKENS, "routing": allowed})
        assert _decision(reply)[0] == 2
        assert reply.json()["receipt"]["candidates"] == 2


def test_lora_name_and_cache_salt_salt_the_overlap(client: TestClient) -> None:
    salted = list(range(5000, 5000 + 3 * BLOCK_SIZE))
    for event_id, salt in enumerate(({"lora_name": "adapter-a"}, {"cache_namespace": "tenant-a"}), start=1):
        event = prompt_stored_event(2, salted, BLOCK_SIZE, event_id=event_id, dp_rank=1, **salt)
        client.post("/v1/events", content=msgspec.json.encode(event), headers={"content-type": "application/json"})
    plain = client.post("/v1/route", json={"token_ids": salted, "annotations": ["query_instance_id"]})
    assert _decision(plain)[2] == 0
    for hint in ({"lora_name": "adapter-a"}, {"cache_salt": "tenant-a"}):
        reply = client.post(
            "/v1/route", json={"token_ids": salted, "routing": hint, "annotations": ["query_instance_id"]}
        )
        assert _decision(reply) == (2, 1, 3, 3 * BLOCK_SIZE)
    both = client.post("/v1/route", json={"token_ids": salted, "routing": {"lora_name": "adapter-a",
                                                                             "cache_salt": "tenant-a"}})  # fmt: skip
    assert _decision(both)[2] == 0  # a third salt: neither cache


def test_routing_constraints_filter_and_prefer_by_taint() -> None:
    with serve() as client:
        _register(client, {"worker_id": 1}, {"worker_id": 2, "taints": ["gpu=h100"]}, {"worker_id": 3})
        client.post("/v1/events", json=stored_event(1, TOKENS))
        query = {"token_ids": TOKENS, "annotations": ["query_instance_id"]}  # nothing booked in between
        required = {"routing_constraints": {"required_taints": ["gpu=h100"]}}
        reply = client.post("/v1/route", json={**query, "routing": required})
        assert _decision(reply)[0] == 2 and reply.json()["receipt"]["candidates"] == 1
        # Preferred: the cost of worker 2 times exp(-tanh(5)) makes it cheaper than worker 1's cache.
        preferred = {"routing_constraints": {"preferred_taints": {"gpu=h100": 5.0}}}
        reply = client.post("/v1/route", json={**query, "routing": preferred})
        assert _decision(reply)[0] == 2
        assert _decision(client.post("/v1/route", json=query))[0] == 1


def test_router_config_override_is_the_new_routes_override() -> None:
    with serve() as client:
        _register(client, {"worker_id": 1}, {"worker_id": 2})
        client.post("/v1/events", json=stored_event(1, TOKENS))
        held = {"token_ids": list(range(2 * BLOCK_SIZE)), "routing": {"backend_instance_id": 1}, "request_id": "held"}
        client.post("/v1/route", json=held)
        client.post("/v1/mark_prefill", json={"request_id": "held"})
        # Worker 1 holds the prompt and another request's two blocks; worker 2 is idle. Credited, the
        # overlap makes worker 1 cost 0 + 6 blocks against 4 + 4; uncredited, 4 + 6 against 8.
        query = {"token_ids": TOKENS, "annotations": ["query_instance_id"]}
        assert _decision(client.post("/v1/route", json=query))[0] == 1
        override = {"overlap_score_credit": 0.0}
        reply = client.post("/v1/route", json={**query, "router_config_override": override})
        new = client.post("/v1/new", json={"tokens": TOKENS, "router_config_override": override})
        assert _decision(reply)[0] == 2 == new.json()["worker_id"]


def test_mm_routing_info_overlaps_on_routing_tokens_and_loads_by_the_expanded_length(client: TestClient) -> None:
    mm = [None, {"mm_objects": [{"mm_hash": 0xDEADBEEF, "offsets": [[0, BLOCK_SIZE]]}]}]
    routing_tokens = list(range(7000, 7000 + 2 * BLOCK_SIZE))
    local = compute_block_hashes(routing_tokens, BLOCK_SIZE, block_mm_infos=mm)
    stored = kv_stored_event(2, zip(compute_sequence_hashes(local), local, strict=True), dp_rank=1)
    client.post("/v1/events", content=msgspec.json.encode(RouterEvent(worker_id=2, event=stored)),
                headers={"content-type": "application/json"})  # fmt: skip
    info = {"routing_token_ids": routing_tokens, "block_mm_infos": mm, "expanded_prompt_len": 100}
    body = {"token_ids": [1, 2, 3], "mm_routing_info": info, "request_id": "mm"}
    assert _decision(client.post("/v1/route", json=body)) == (2, 1, 2, 2 * BLOCK_SIZE)
    assert _active(client, 2)[1] == (1, 100 - 2 * BLOCK_SIZE)  # the expanded length, less what is cached
    # Without the image's hash the second block is another block: one block of overlap.
    no_mm = {**info, "block_mm_infos": [None, None]}
    reply = client.post("/v1/route", json={"token_ids": [1, 2, 3], "mm_routing_info": no_mm, "routing": {
        "backend_instance_id": 2, "dp_rank": 1}, "annotations": ["query_instance_id"]})  # fmt: skip
    assert _decision(reply)[2] == 1
    # On a worker without the cache: the expanded length, or without one the request's own token
    # count (the seed's expanded_prompt_token_count).
    on_worker_1 = {"backend_instance_id": 1}
    client.post("/v1/route", json={"token_ids": [1, 2, 3], "mm_routing_info": info, "routing": on_worker_1})
    assert _active(client, 1) == {0: (1, 100)}
    no_length = {**info, "expanded_prompt_len": 0}
    client.post("/v1/route", json={"token_ids": [1, 2, 3], "mm_routing_info": no_length, "routing": on_worker_1})
    assert _active(client, 1) == {0: (2, 103)}
    # No routing tokens: Dynamo routes the request's own tokens and reads none of the rest, so an
    # expanded length above max_prompt_tokens is no prompt too long.
    unread = {"routing_token_ids": [], "block_mm_infos": mm, "expanded_prompt_len": 2**64 - 1}
    reply = client.post("/v1/route", json={"token_ids": [1, 2, 3], "mm_routing_info": unread, "routing": on_worker_1})
    assert _decision(reply) == (1, 0, 0, 0)
    assert _active(client, 1) == {0: (3, 106)}


# Dynamo 1.6's WorkerIdInfo for an aggregated fleet: the one worker named for both phases.
BOTH_PHASES_ON_1 = {"prefill_worker_id": 1, "prefill_dp_rank": 0, "decode_worker_id": 1, "decode_dp_rank": 0}


def test_query_instance_id_answers_without_booking(client: TestClient) -> None:
    before = state(client)
    # Dynamo 1.6's key:value form (its gateway sends an empty value), and the bare one of earlier releases.
    for annotation in ("query_instance_id:", "query_instance_id"):
        body = {"token_ids": TOKENS, "annotations": [annotation], **ENGINE_FIELDS}
        reply = client.post("/v1/route", json=body)
        assert _decision(reply)[:2] == (1, 0)
        answer = reply.json()
        assert answer["nvext"] == {"worker_id": BOTH_PHASES_ON_1, "token_ids": TOKENS}
        assert "request_id" not in answer and "x-request-id" not in reply.headers
    packed = msgspec.msgpack.encode({"method": "route", "token_ids": struct.pack(f"<{len(TOKENS)}i", *TOKENS),
                                     "annotations": ["query_instance_id"]})  # fmt: skip
    answer = msgspec.msgpack.decode(client.post("/v1/router", content=packed, headers=MSGPACK).content)
    assert (answer["method"], answer["nvext"]) == ("route", {"worker_id": BOTH_PHASES_ON_1, "token_ids": TOKENS})
    assert state(client) == before


def test_the_request_comes_back_ready_to_forward(client: TestClient) -> None:
    body = {"token_ids": TOKENS, "routing": {"lora_name": None, "priority": 3}, "return_request": True,
            "request_id": "f", **ENGINE_FIELDS}  # fmt: skip
    back = client.post("/v1/route", json=body).json()["request"]
    expected = {k: v for k, v in body.items() if k not in ("return_request", "request_id")}
    expected["routing"] = {"lora_name": None, "priority": 3, "backend_instance_id": 1, "dp_rank": 0}
    assert back == expected
    # msgpack keeps the packed form; JSON gets Dynamo's sequence.
    packed = struct.pack(f"<{len(TOKENS)}i", *TOKENS)
    body = msgspec.msgpack.encode({"token_ids": packed, "return_request": True, "routing": {"allowed_worker_ids": [2]}})
    back = msgspec.msgpack.decode(client.post("/v1/route", content=body, headers=MSGPACK).content)["request"]
    assert back["token_ids"] == packed and back["routing"]["backend_instance_id"] == 2
    in_json = client.post("/v1/route", content=body, headers={"content-type": MSGPACK["content-type"]})
    assert in_json.json()["request"]["token_ids"] == TOKENS


@pytest.mark.parametrize("door", ["/v1/route", "/v1/router"])
def test_packed_token_ids_sent_as_base64_come_back_in_dynamos_forms(client: TestClient, door: str) -> None:
    """JSON's packed form (base64 text, which Dynamo's reader refuses: it takes a sequence or bytes) is
    handed back as Dynamo writes the prompt: a sequence in JSON, one bin of packed ids in msgpack."""
    packed = struct.pack(f"<{len(TOKENS)}I", *TOKENS)
    method = {"method": "route"} if door == "/v1/router" else {}
    body = msgspec.json.encode({**method, "token_ids": packed, "return_request": True})  # bytes: base64 text
    assert client.post(door, content=body).json()["request"]["token_ids"] == TOKENS
    reply = client.post(door, content=body, headers={"accept": MSGPACK["accept"]})
    assert msgspec.msgpack.decode(reply.content)["request"]["token_ids"] == packed


# The fields of the seed's PreprocessedRequest the router does not read, each in a shape Dynamo's serde
# takes (Dynamo 1.6.1's `KvRouter.generate_from_request` routes this body): all accepted and handed back
# as sent. (``kv_hint`` is left out: its struct is not in the seeds; it is kept opaque.)
SEED_FIELDS: dict[str, Any] = {
    **{k: v for k, v in ENGINE_FIELDS.items() if k != "a_field_of_a_later_release"},
    "model": "m",
    "prompt_embeds": "AAAA",
    "multi_modal_data": {"image_url": [{"Url": "http://x/a.png"}]},
    "multi_modal_uuids": {"image_url": [None, "u1"]},
    "mdc_sum": "abc",
    "annotations": ["x"],
    "prefill_result": {"disaggregated_params": None, "prompt_tokens_details": {"cached_tokens": 4}},
    "encoder_result": {"embeddings": [1, 2]},
    "migration_link": {"trace_id": "0" * 32, "span_id": "1" * 16},
    "bootstrap_info": {"bootstrap_host": "h", "bootstrap_port": 65535, "bootstrap_room": 2**64 - 1,
                       "handoff_id": "67e55044-10b1-426f-9247-bb680e5fe0c8"},
    "require_reasoning": True,
    "router": {"ttft_target": 100.0, "itl_target": 10.0},
    "agent_context": {"session_id": "s"},
    "image_cache_scope": "s",
    "mm_processor_kwargs": {"use_audio_in_video": True},
    "media_io_kwargs": None,
    "request_timestamp_ms": 1700000000000,
}  # fmt: skip


def test_every_field_the_seed_names_is_accepted_and_handed_back(client: TestClient) -> None:
    body = {"token_ids": TOKENS, "return_request": True, **SEED_FIELDS}
    reply = client.post("/v1/route", json=body)
    assert reply.status_code == 200, reply.text
    back = reply.json()["request"]
    assert back == {**SEED_FIELDS, "token_ids": TOKENS, "routing": {"backend_instance_id": 1, "dp_rank": 0}}
    # msgpack too, a UUID as its 16 bytes.
    info = {**SEED_FIELDS["bootstrap_info"], "handoff_id": bytes(range(16))}
    packed = msgspec.msgpack.encode({**body, "bootstrap_info": info})
    reply = client.post("/v1/route", content=packed, headers=MSGPACK)
    assert reply.status_code == 200, reply.content
    assert msgspec.msgpack.decode(reply.content)["request"]["bootstrap_info"] == info


# Fields the router does not read, in shapes Dynamo's serde refuses: refused naming the field, not
# booked and handed back.
ENGINE_FIELDS_REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"bootstrap_info": {"bootstrap_host": "h", "bootstrap_port": 70000, "bootstrap_room": 1}},
     "$.bootstrap_info.bootstrap_port"),
    ({"bootstrap_info": {"bootstrap_port": 1, "bootstrap_room": 1}}, "bootstrap_host"),
    ({"bootstrap_info": {"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 2**64}}, "bootstrap_room"),
    ({"bootstrap_info": {"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 1, "handoff_id": "x"}},
     "handoff_id"),
    ({"encoder_result": [1]}, "$.encoder_result"),
    ({"eos_token_ids": "x"}, "$.eos_token_ids"),
    ({"eos_token_ids": [-1]}, "$.eos_token_ids[0]"),
    ({"stop_conditions": 5}, "$.stop_conditions"),
    ({"sampling_options": None}, "$.sampling_options"),
    ({"mdc_sum": 5}, "$.mdc_sum"),
    ({"require_reasoning": "yes"}, "$.require_reasoning"),
    ({"prefill_result": {}}, "disaggregated_params"),
    ({"migration_link": {"trace_id": "a"}}, "span_id"),
    ({"request_timestamp_ms": "x"}, "$.request_timestamp_ms"),
    ({"multi_modal_uuids": {"image": [1]}}, "$.multi_modal_uuids"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "names"), ENGINE_FIELDS_REFUSED, ids=[c[1] for c in ENGINE_FIELDS_REFUSED])
def test_an_engine_field_dynamo_refuses_is_refused_naming_it(
    client: TestClient, fields: dict[str, Any], names: str
) -> None:
    before = state(client)
    for door, method in (("/v1/route", {}), ("/v1/router", {"method": "route"})):
        reply = client.post(door, json={"token_ids": TOKENS, "return_request": True, **method, **fields})
        assert reply.status_code == 422, reply.text
        error = reply.json()["error"]
        assert error["type"] == "invalid_request" and names in error["message"]
    assert state(client) == before


def test_prefill_and_decode_worker_ids_are_checked_and_reported_unused(client: TestClient) -> None:
    hints = {"prefill_worker_id": 2, "prefill_dp_rank": 1, "decode_worker_id": 1}
    reply = client.post("/v1/route", json={"token_ids": TOKENS, "routing": hints})
    assert _decision(reply)[:2] == (1, 0)  # routed as an aggregated request: its cache is on worker 1
    assert reply.json()["unused_hints"] == ["prefill_worker_id", "prefill_dp_rank", "decode_worker_id"]


def test_model_picks_the_workers_serving_it() -> None:
    with serve() as client:
        _register(client, {"worker_id": 1, "models": ["a"]}, {"worker_id": 2, "models": ["b"]}, {"worker_id": 3})
        client.post("/v1/events", json=stored_event(1, TOKENS))
        assert _decision(client.post("/v1/route", json={"token_ids": TOKENS, "model": "b"}))[0] in (2, 3)
        assert _decision(client.post("/v1/route", json={"token_ids": TOKENS, "model": "a"}))[0] == 1
        assert _decision(client.post("/v1/route", json={"token_ids": TOKENS}))[0] == 1


def test_a_model_no_worker_serves_is_named_in_the_error() -> None:
    with serve() as client:
        _register(client, {"worker_id": 1, "models": ["a"]}, {"worker_id": 2, "models": ["b"]})
        before = state(client)
        unserved = client.post("/v1/route", json={"token_ids": TOKENS, "model": "c"})
        assert unserved.status_code == 503
        error = unserved.json()["error"]
        assert error["type"] == "no_eligible_worker" and "serving model 'c'" in error["message"]
        assert state(client) == before


def test_strict_priority_and_priority_jump_order_the_queue() -> None:
    """One saturated worker: requests wait; freeing capacity lets the strict tier go first, then the
    one whose priority jump puts it ahead of an earlier arrival."""
    settings = Settings(
        service=ServiceConfig(),
        router=RouterConfig(block_size=BLOCK_SIZE, router_queue_threshold=0.0, router_queue_request_limit_per_worker=8),
    )
    app = create_app(settings, registry=CollectorRegistry())

    async def scenario() -> list[str]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
                await client.post("/v1/workers", json={"worker_id": 1, "max_num_batched_tokens": 16})
                await client.post("/v1/route", json={"token_ids": TOKENS, "request_id": "running"})
                order: list[str] = []
                pending = 0

                async def route(request_id: str, routing: dict[str, Any]) -> None:
                    nonlocal pending
                    body = {"token_ids": TOKENS, "request_id": request_id, "routing": routing}
                    reply = client.post("/v1/route", json=body)
                    pending += 1
                    assert (await reply).status_code == 200
                    order.append(request_id)

                async def queued() -> int:
                    loads = await client.post("/v1/potential_loads", json={"tokens": [1]})
                    return int(loads.json()["pending_count"])

                async def all_queued() -> bool:
                    return await queued() == len(waiting)

                waiting = []
                for request_id, routing in (("plain", {}), ("jumped", {"priority_jump": 100.0}),
                                            ("tier1", {"strict_priority": 1})):  # fmt: skip
                    waiting.append(asyncio.create_task(route(request_id, routing)))
                    await eventually(all_queued, what=f"{request_id} is queued")
                for done, previous in enumerate(("running", "tier1", "jumped"), start=1):
                    await client.post("/v1/mark_free", json={"request_id": previous})
                    await eventually(lambda done=done: len(order) >= done)  # type: ignore[misc]
                await asyncio.gather(*waiting)
                return order

    assert asyncio.run(scenario()) == ["tier1", "jumped", "plain"]

"""A disaggregated fleet over HTTP (issue 27): roles registered and listed, both legs in the replies of
``/v1/new`` and ``/v1/route``, the prefill / decode hints validated against roles, freeing both legs,
the metrics."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from router.engines.bridge_config import BridgeConfig
from tests.test_api_support import BLOCK_SIZE, serve, stored_event

PREFILL, DECODE, OTHER_DECODE = 1, 2, 3
LONG = list(range(1000, 1000 + 40 * BLOCK_SIZE))  # 40 blocks: well over the 256-token threshold


@pytest.fixture
def client() -> Iterator[TestClient]:
    with serve() as client:
        for worker_id, role in ((PREFILL, "prefill"), (DECODE, "decode"), (OTHER_DECODE, "decode")):
            assert client.post("/v1/workers", json={"worker_id": worker_id, "role": role}).status_code == 201
        yield client


def _loads(client: TestClient) -> dict[int, tuple[int, int]]:
    """Per worker: (active requests, active prefill tokens)."""
    workers = client.get("/v1/workers").json()["workers"]
    return {
        w["config"]["worker_id"]: (w["ranks"][0]["active_requests"], w["ranks"][0]["active_prefill_tokens"])
        for w in workers
    }


def test_roles_are_listed_and_checked(client: TestClient) -> None:
    roles = {w["config"]["worker_id"]: w["config"]["role"] for w in client.get("/v1/workers").json()["workers"]}
    assert roles == {PREFILL: "prefill", DECODE: "decode", OTHER_DECODE: "decode"}
    bad = client.post("/v1/workers", json={"worker_id": 9, "role": "encode"})
    assert bad.status_code == 422 and "role" in bad.text
    metrics = client.get("/metrics").text
    assert f'kv_router_worker_role{{role="prefill",worker_id="{PREFILL}"}} 1.0' in metrics


def test_a_prefill_workers_handoff_is_registered_listed_and_checked(client: TestClient) -> None:
    sglang = {"worker_id": 7, "role": "prefill", "handoff": "bootstrap", "bootstrap_port": 8998}
    assert client.post("/v1/workers", json=sglang).status_code == 201
    listed = {w["config"]["worker_id"]: w["config"] for w in client.get("/v1/workers").json()["workers"]}
    assert (listed[7]["handoff"], listed[7]["bootstrap_port"]) == ("bootstrap", 8998)
    assert (listed[PREFILL]["handoff"], listed[PREFILL]["bootstrap_port"]) == ("kv_transfer_params", None)
    for bad in ({"handoff": "mooncake"}, {"bootstrap_port": 70000}, {"bootstrap_port": 0}):
        refused = client.post("/v1/workers", json={"worker_id": 8, "role": "prefill", **bad})
        assert refused.status_code == 422 and next(iter(bad)) in refused.text


def test_an_update_keeps_the_role_and_handoff_fields_it_does_not_name(client: TestClient) -> None:
    """A capacity update of an SGLang prefill worker leaves it one: with the defaults it would take whole
    requests and decode legs, and its prefill legs would be run in the wrong style. A field named is
    changed alone."""
    sglang = {"worker_id": 7, "role": "prefill", "handoff": "bootstrap", "bootstrap_port": 9000}
    assert client.post("/v1/workers", json=sglang).status_code == 201

    def listed() -> tuple[str, str, int | None, int | None]:
        config = {w["config"]["worker_id"]: w["config"] for w in client.get("/v1/workers").json()["workers"]}[7]
        return config["role"], config["handoff"], config.get("bootstrap_port"), config.get("total_kv_blocks")

    assert client.post("/v1/workers", json={"worker_id": 7, "total_kv_blocks": 4096}).status_code == 200
    assert listed() == ("prefill", "bootstrap", 9000, 4096)
    assert client.post("/v1/workers", json={"worker_id": 7, "bootstrap_port": 9001}).status_code == 200
    assert listed() == ("prefill", "bootstrap", 9001, None)
    assert client.post("/v1/workers", json={"worker_id": 7, "role": "both"}).status_code == 200
    assert listed() == ("both", "bootstrap", 9001, None)


def test_a_request_id_ending_in_the_prefill_legs_suffix_is_refused_as_json(client: TestClient) -> None:
    answer = client.post("/v1/new", json={"tokens": LONG, "request_id": "job#prefill"})
    assert answer.status_code == 422, answer.text
    assert "must not end in '#prefill'" in answer.json()["error"]["message"]
    assert all(load == (0, 0) for load in _loads(client).values())


def test_the_bridge_registers_its_handoff() -> None:
    config = BridgeConfig(
        worker_id=5, zmq_endpoint="tcp://127.0.0.1:5557", role="prefill", handoff="bootstrap", bootstrap_port=9000
    )
    registration = config.registration()
    assert (registration.role, registration.handoff, registration.bootstrap_port) == ("prefill", "bootstrap", 9000)


def test_new_names_both_legs_and_mark_free_releases_them(client: TestClient) -> None:
    reply = client.post("/v1/new", json={"tokens": LONG, "request_id": "a"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    how = body["disaggregation"]
    assert body["worker_id"] in (DECODE, OTHER_DECODE) and how["path"] == "remote_prefill"
    assert how["prefill"]["worker_id"] == PREFILL and how["prefill"]["booking_id"] == "a#prefill"
    assert how["decode_uncached_tokens"] == len(LONG) and how["threshold_tokens"] == 256
    loads = _loads(client)
    assert loads[PREFILL] == (1, len(LONG)) and loads[body["worker_id"]] == (1, 0)
    assert client.post("/v1/mark_prefill", json={"request_id": "a"}).json()["success"]
    assert _loads(client)[PREFILL] == (0, 0) and _loads(client)[body["worker_id"]] == (1, 0)
    assert client.post("/v1/mark_free", json={"request_id": "a"}).json()["success"]
    assert set(_loads(client).values()) == {(0, 0)}
    assert 'kv_router_disaggregated_decisions_total{path="remote_prefill"} 1.0' in client.get("/metrics").text


def test_a_prompt_cached_on_a_decode_worker_is_prefilled_there(client: TestClient) -> None:
    client.post("/v1/events", json=stored_event(OTHER_DECODE, LONG, blocks=38))
    body = client.post("/v1/new", json={"tokens": LONG, "request_id": "b"}).json()
    assert body["worker_id"] == OTHER_DECODE
    how = body["disaggregation"]
    assert (how["path"], how["decode_uncached_tokens"], how.get("prefill")) == ("local_prefill", 2 * BLOCK_SIZE, None)
    assert "below the 256-token threshold" in how["reason"]


def _route(client: TestClient, routing: dict[str, Any], **fields: Any) -> Any:
    return client.post("/v1/route", json={"token_ids": LONG, "routing": routing, **fields})


def test_route_hints_pin_the_legs_and_are_checked_against_roles(client: TestClient) -> None:
    reply = _route(client, {"decode_worker_id": OTHER_DECODE, "prefill_worker_id": PREFILL}, return_request=True)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["worker_id"] == OTHER_DECODE and "unused_hints" not in body
    assert body["disaggregation"]["prefill"]["worker_id"] == PREFILL
    routing = body["request"]["routing"]
    assert (routing["backend_instance_id"], routing["decode_worker_id"]) == (OTHER_DECODE, OTHER_DECODE)
    assert (routing["prefill_worker_id"], routing["prefill_dp_rank"]) == (PREFILL, 0)
    wrong = _route(client, {"prefill_worker_id": DECODE})
    assert wrong.status_code == 422
    assert "routing.prefill_worker_id: worker 2 has role decode: it cannot run the prefill leg" in wrong.text
    wrong = _route(client, {"decode_worker_id": PREFILL})
    assert wrong.status_code == 422 and "it cannot run the decode leg" in wrong.text
    clash = _route(client, {"decode_worker_id": DECODE, "backend_instance_id": OTHER_DECODE})
    assert clash.status_code == 422 and "differs from routing.backend_instance_id" in clash.text
    assert _loads(client)[DECODE] == (0, 0)  # refused requests booked nothing

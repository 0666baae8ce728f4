"""End to end through the real app: workers, events, the four routing methods on their own routes and
through Dynamo's tagged ``/v1/router``, overlap, dump, reconfiguration, OpenAPI.

Every test runs twice: with kv-router's HTTP protocol serving the hot routes
(`tests/protocol_asgi.py`), and with FastAPI's routes serving them; both must answer the same.
"""

from __future__ import annotations

import asyncio
import random
import struct
from collections.abc import Iterator

import httpx
import msgspec
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from api.app import create_app
from api.config import ServiceConfig, Settings
from api.proxy.wire import ROUTES
from indexer.events import decode_router_events
from router.config import RouterConfig
from router.errors import BlockSizeMismatch
from router.kv_router import KvRouter
from router.types import RouteRequest, WorkerConfig
from tests.metrics import sample
from tests.protocol_asgi import ThroughProtocol
from tests.test_api_support import BLOCK_SIZE, MSGPACK, msgpack, prompt, serve, stored_event
from tests.waiting import eventually


@pytest.fixture(params=[True, False], ids=["protocol", "asgi"])
def client(request: pytest.FixtureRequest) -> Iterator[TestClient]:
    # Dynamo's policy by name: these routes are checked against its choices and costs, whatever the default.
    with serve(fast_protocol=request.param, policy="dynamo") as client:
        yield client


def _register(client: TestClient, *worker_ids: int) -> None:
    for worker_id in worker_ids:
        assert client.post("/v1/workers", json={"worker_id": worker_id}).status_code == 201


def test_new_picks_the_worker_holding_the_prefix(client: TestClient) -> None:
    _register(client, 1, 2, 3)
    tokens = prompt(1, 160)  # 10 full blocks
    reply = client.post("/v1/events", json=[stored_event(2, tokens, blocks=6), stored_event(3, tokens, blocks=2)])
    assert reply.json() == {
        "received": 2,
        "applied": 2,
        "rejected": 0,
        "duplicate": 0,
        "held": 0,
        "relayed": 0,
        "errors": [],
    }

    decision = client.post("/v1/new", json={"tokens": tokens, "request_id": "r1"})
    assert decision.status_code == 200
    body = decision.json()
    assert (body["worker_id"], body["dp_rank"], body["overlap_blocks"]) == (2, 0, 6)
    assert body["cached_tokens"] == 6 * BLOCK_SIZE
    assert body["request_id"] == "r1" == decision.headers["x-request-id"]
    assert body["explanation"] is None
    assert set(body["timing"]) == {"hashing_s", "matching_s", "scheduling_s", "queued_s"}


def test_new_request_id_from_header_or_generated(client: TestClient) -> None:
    _register(client, 1)
    tokens = prompt(2, 40)
    from_header = client.post("/v1/new", json={"tokens": tokens}, headers={"x-request-id": "hdr-7"})
    assert from_header.json()["request_id"] == "hdr-7" == from_header.headers["x-request-id"]
    generated = client.post("/v1/new", json={"tokens": tokens}).json()["request_id"]
    assert generated and generated != "hdr-7"
    # Both were booked under those ids: each can be freed once.
    assert client.post("/v1/mark_free", json={"request_id": "hdr-7"}).json() == {
        "request_id": "hdr-7",
        "success": True,
    }
    assert client.post("/v1/mark_free", headers={"x-request-id": generated}, json={}).status_code == 200


def test_explain_lists_every_candidate(client: TestClient) -> None:
    _register(client, 1, 2)
    tokens = prompt(3, 64)
    client.post("/v1/events", json=stored_event(1, tokens))
    by_query = client.post("/v1/new?explain=true", json={"tokens": tokens}).json()["explanation"]
    by_body = client.post("/v1/new", json={"tokens": tokens, "explain": True}).json()["explanation"]
    for explanation in (by_query, by_body):
        assert explanation["policy"] == "dynamo"
        assert {c["worker_id"] for c in explanation["candidates"]} == {1, 2}
        winner = min(explanation["candidates"], key=lambda c: c["cost"])
        assert winner["worker_id"] == 1 and winner["device_overlap_blocks"] == 4


def test_potential_loads_match_the_library(client: TestClient) -> None:
    _register(client, 1, 2)
    tokens = prompt(4, 100)
    events = [stored_event(1, tokens, blocks=3)]
    client.post("/v1/events", json=events)
    client.post("/v1/new", json={"tokens": prompt(5, 50), "request_id": "busy"})

    # The same calls on the library, with the same seed for its random tie-breaks.
    library = KvRouter(RouterConfig(block_size=BLOCK_SIZE), rng=random.Random(0))
    for worker_id in (1, 2):
        library.register_worker(WorkerConfig(worker_id=worker_id))
    for event in decode_router_events(msgspec.json.encode(events)):
        library.apply_event(event)
    asyncio.run(library.new(RouteRequest(tokens=prompt(5, 50), request_id="busy")))
    expected = [msgspec.structs.asdict(load) for load in library.potential_loads(tokens)]
    assert any(load["active_requests"] for load in expected)

    own = client.post("/v1/potential_loads", json={"tokens": tokens}).json()
    assert own == {"loads": expected, "pending_count": 0, "pending_isl_tokens": 0}
    tagged = client.post("/v1/router", json={"method": "potential_loads", "tokens": tokens}).json()
    assert tagged == {"method": "potential_loads", **own}


def test_mark_prefill_and_mark_free_change_the_loads(client: TestClient) -> None:
    _register(client, 1)
    tokens = prompt(6, 70)  # 4 full blocks and 6 tokens

    def load() -> dict[str, int]:
        rank = client.get("/v1/workers/1").json()["ranks"][0]
        return {k: rank[k] for k in ("active_prefill_tokens", "active_decode_blocks", "active_requests")}

    assert load() == {"active_prefill_tokens": 0, "active_decode_blocks": 0, "active_requests": 0}
    client.post("/v1/new", json={"tokens": tokens, "request_id": "a"})
    assert load() == {"active_prefill_tokens": 70, "active_decode_blocks": 4, "active_requests": 1}
    assert client.post("/v1/mark_prefill", json={"request_id": "a"}).json() == {"request_id": "a", "success": True}
    assert load() == {"active_prefill_tokens": 0, "active_decode_blocks": 4, "active_requests": 1}
    assert client.post("/v1/mark_free", json={"request_id": "a"}).status_code == 200
    assert load() == {"active_prefill_tokens": 0, "active_decode_blocks": 0, "active_requests": 0}
    # A second free: the id is no longer active.
    again = client.post("/v1/mark_free", json={"request_id": "a"})
    assert again.status_code == 404
    assert again.json()["error"]["type"] == "unknown_request_id"


@pytest.mark.parametrize("fast_protocol", [True, False], ids=["protocol", "asgi"])
def test_record_output_counts_output_blocks_on_the_worker(fast_protocol: bool) -> None:
    with serve(fast_protocol=fast_protocol, router_track_output_blocks=True) as client:
        _register(client, 1)
        tokens = prompt(6, 70)  # 4 full blocks and 6 tokens: the 11th generated token opens a block

        def decode_blocks() -> int:
            return int(client.get("/v1/workers/1").json()["ranks"][0]["active_decode_blocks"])

        client.post("/v1/new", json={"tokens": tokens, "request_id": "a"})
        client.post("/v1/new", json={"tokens": prompt(7, 70), "request_id": "b", "expected_output_tokens": 20})
        assert decode_blocks() == 8
        progress = client.post("/v1/record_output", json={"request_id": "a", "generated_tokens": 10})
        assert progress.json() == {"request_id": "a", "success": True}
        assert decode_blocks() == 8
        client.post("/v1/record_output", json={"generated_tokens": 11}, headers={"x-request-id": "a"})
        assert decode_blocks() == 9
        # b said it would generate 20 tokens: after 11, 45 % of its 4 + 1 blocks still count.
        client.post("/v1/record_output", json={"request_id": "b", "generated_tokens": 11})
        assert decode_blocks() == 5 + round(5 * 0.45)
        for body, status, kind in (
            ({"request_id": "zz", "generated_tokens": 1}, 404, "unknown_request_id"),
            ({"request_id": "a", "generated_tokens": -1}, 422, "invalid_request"),
            ({"request_id": "a", "generated_tokens": 2**32}, 422, "invalid_request"),
            ({"generated_tokens": 1}, 422, "invalid_request"),
        ):
            refused = client.post("/v1/record_output", json=body)
            assert (refused.status_code, refused.json()["error"]["type"]) == (status, kind)
        assert decode_blocks() == 5 + round(5 * 0.45)
        client.post("/v1/mark_free", json={"request_id": "a"})
        client.post("/v1/mark_free", json={"request_id": "b"})
        assert decode_blocks() == 0
        metrics = client.get("/metrics").text
        assert 'kv_router_requests_total{method="record_output",outcome="ok"} 3.0' in metrics


def test_record_output_without_output_tracking_changes_no_load(client: TestClient) -> None:
    _register(client, 1)
    client.post("/v1/new", json={"tokens": prompt(6, 70), "request_id": "a"})
    before = client.get("/v1/workers/1").json()["ranks"]
    assert client.post("/v1/record_output", json={"request_id": "a", "generated_tokens": 500}).status_code == 200
    assert client.get("/v1/workers/1").json()["ranks"] == before


def test_dynamo_router_protocol_field_for_field(client: TestClient) -> None:
    _register(client, 9)
    tokens = prompt(7, 48)
    client.post("/v1/events", json=stored_event(9, tokens))
    new = client.post("/v1/router", json={"method": "new", "tokens": tokens}, headers={"x-request-id": "ctx-1"})
    assert new.json() == {"method": "new", "worker_id": 9, "dp_rank": 0, "overlap_blocks": 3}
    assert new.headers["x-request-id"] == "ctx-1"
    # Dynamo's exact serialized request from its unit tests is accepted as is.
    exact = b'{"method":"new","tokens":[1,2,3],"priority_jump":0.0,"cache_namespace":"tenant-a"}'
    assert client.post("/v1/router", content=exact).json()["method"] == "new"

    marked = client.post("/v1/router", json={"method": "mark_prefill", "request_id": "ctx-1"})
    assert marked.json() == {"method": "prefill_marked", "success": True}
    # Without a payload id, the context id (X-Request-Id) is used, as Dynamo does.
    freed = client.post("/v1/router", json={"method": "mark_free"}, headers={"x-request-id": "ctx-1"})
    assert freed.json() == {"method": "free_marked", "success": True}
    # Dynamo 1.6.1: unknown ids are success=false, not an error.
    assert client.post("/v1/router", json={"method": "mark_free", "request_id": "ctx-1"}).json() == {
        "method": "free_marked",
        "success": False,
    }
    assert client.post("/v1/router", json={"method": "mark_prefill", "request_id": "zz"}).json() == {
        "method": "prefill_marked",
        "success": False,
    }


@pytest.mark.parametrize("fast_protocol", [True, False], ids=["protocol", "asgi"])
def test_queue_waits_dispatches_and_rejects(fast_protocol: bool) -> None:
    """A saturated worker parks `new` in the queue; a full queue answers Dynamo's `queue_rejected`
    on /v1/router and 429 on /v1/new; freeing capacity dispatches the waiting request."""
    settings = Settings(
        service=ServiceConfig(fast_protocol=fast_protocol),
        router=RouterConfig(block_size=BLOCK_SIZE, router_queue_threshold=0.0, router_queue_request_limit_per_worker=1),
    )
    app = create_app(settings, registry=CollectorRegistry())

    async def scenario() -> None:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=ThroughProtocol(app) if fast_protocol else app)
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
                await client.post("/v1/workers", json={"worker_id": 1, "max_num_batched_tokens": 16})
                first = await client.post("/v1/new", json={"tokens": prompt(8, 64), "request_id": "first"})
                assert first.status_code == 200
                waiting = asyncio.create_task(
                    client.post("/v1/new", json={"tokens": prompt(9, 64), "request_id": "second"})
                )

                async def queued() -> bool:
                    loads = await client.post("/v1/potential_loads", json={"tokens": [1]})
                    return bool(loads.json()["pending_count"])

                await eventually(queued, what="the second request is queued")
                exported = (await client.get("/metrics")).text
                assert "kv_router_queue_pending_requests 1.0" in exported
                assert "kv_router_queue_pending_isl_tokens 64.0" in exported
                rejected = await client.post("/v1/router", json={"method": "new", "tokens": prompt(10, 32)})
                assert rejected.json() == {
                    "method": "queue_rejected",
                    "rejection": {"policy_class": "default", "limit_kind": "requests", "current": 1, "limit": 1},
                }
                too_many = await client.post("/v1/new", json={"tokens": prompt(10, 32)})
                assert too_many.status_code == 429
                assert too_many.json()["error"]["detail"]["rejection"]["limit_kind"] == "requests"
                # Each rejection counted once, as queue_rejected: the only new counted ok is the first.
                exported = (await client.get("/metrics")).text
                assert sample(exported, "kv_router_requests_total", method="new", outcome="queue_rejected") == 2
                assert sample(exported, "kv_router_requests_total", method="new", outcome="ok") == 1
                assert not waiting.done()
                await client.post("/v1/mark_free", json={"request_id": "first"})
                second = await waiting
                assert second.status_code == 200 and second.json()["request_id"] == "second"
                assert second.json()["timing"]["queued_s"] > 0

    asyncio.run(scenario())


def test_msgpack_with_packed_tokens_routes_like_json(client: TestClient) -> None:
    _register(client, 1, 2)
    tokens = prompt(10, 96)
    client.post("/v1/events", json=stored_event(2, tokens, blocks=5))
    packed = struct.pack(f"<{len(tokens)}I", *tokens)
    reply = client.post("/v1/new", content=msgpack({"tokens": packed, "request_id": "m1"}), headers=MSGPACK)
    assert reply.headers["content-type"] == "application/msgpack"
    decision = msgspec.msgpack.decode(reply.content)
    assert (decision["worker_id"], decision["overlap_blocks"], decision["cached_tokens"]) == (2, 5, 80)
    as_list = client.post("/v1/overlap", json={"tokens": tokens}).json()
    as_packed = client.post(
        "/v1/overlap", content=msgpack({"tokens": packed}), headers={"content-type": MSGPACK["content-type"]}
    )
    assert as_packed.json() == as_list
    tagged = client.post("/v1/router", content=msgpack({"method": "new", "tokens": packed}), headers=MSGPACK)
    assert msgspec.msgpack.decode(tagged.content) == {
        "method": "new",
        "worker_id": 2,
        "dp_rank": 0,
        "overlap_blocks": 5,
    }


def test_events_in_msgpack(client: TestClient) -> None:
    _register(client, 1)
    tokens = prompt(11, 32)
    reply = client.post("/v1/events", content=msgpack([stored_event(1, tokens)]), headers=MSGPACK)
    assert msgspec.msgpack.decode(reply.content)["applied"] == 1
    assert client.post("/v1/overlap", json={"tokens": tokens}).json()["workers"][0]["device_blocks"] == 2


def test_rejected_events_are_reported_not_raised(client: TestClient) -> None:
    _register(client, 1)
    tokens = prompt(12, 32)
    orphan = stored_event(1, tokens)
    orphan["event"]["data"]["stored"]["parent_hash"] = 12345  # a parent worker 1 never stored
    removal = {"worker_id": 1, "event": {"event_id": 2, "data": {"removed": {"block_hashes": [999]}}}}
    reply = client.post("/v1/events", json=[orphan, removal, stored_event(1, tokens, event_id=3)]).json()
    assert (reply["received"], reply["applied"], reply["rejected"]) == (3, 1, 2)
    assert len(reply["errors"]) == 2


def test_every_received_event_is_in_exactly_one_count(client: TestClient) -> None:
    """An event after a gap: without NATS its resync fails at once and the index's refusal stands, so
    it is rejected with its reason, like the same event in order; the counts add up to ``received``."""
    _register(client, 2)

    def removal(event_id: int) -> dict[str, object]:
        return {"worker_id": 2, "event": {"event_id": event_id, "data": {"removed": {"block_hashes": [1]}}}}

    for event_id in (1, 50):
        reply = client.post("/v1/events", json=removal(event_id)).json()
        assert reply["received"] == reply["applied"] + reply["rejected"] + reply["duplicate"] + reply["held"] == 1
        assert (reply["rejected"], reply["held"]) == (1, 0)
        [reason] = reply["errors"]
        assert reason.startswith(f"worker 2 event {event_id}: ")
    batch = [removal(50), stored_event(2, prompt(3, 32), event_id=51), removal(60)]
    reply = client.post("/v1/events", json=batch).json()
    assert (reply["received"], reply["duplicate"], reply["applied"], reply["rejected"], reply["held"]) == (
        3,
        1,
        1,
        1,
        0,
    )


def test_overlap_and_dump(client: TestClient) -> None:
    _register(client, 1, 2)
    tokens = prompt(13, 80)
    client.post("/v1/events", json=[stored_event(1, tokens, blocks=5), stored_event(2, tokens, blocks=2)])
    report = client.post("/v1/overlap", json={"tokens": tokens}).json()
    assert report["block_size"] == BLOCK_SIZE and report["num_blocks"] == 5
    assert [(w["worker_id"], w["device_blocks"], w["cached_tokens"]) for w in report["workers"]] == [
        (1, 5, 80),
        (2, 2, 32),
    ]
    dump = client.get("/v1/dump").json()
    assert sorted(
        sum(len(e["event"]["data"]["stored"]["blocks"]) for e in dump if e["worker_id"] == w) for w in (1, 2)
    ) == [2, 5]
    # The dump replays into an empty router to the same answers.
    with serve() as fresh:
        _register(fresh, 1, 2)
        assert fresh.post("/v1/events", json=dump).json()["rejected"] == 0
        assert fresh.post("/v1/overlap", json={"tokens": tokens}).json() == report


def test_workers_reconfigure_without_restart(client: TestClient) -> None:
    _register(client, 1, 2)
    tokens = prompt(14, 64)
    client.post("/v1/events", json=stored_event(1, tokens))
    # Update worker 1 in place: two dp ranks and a taint. Its index is kept.
    updated = client.post("/v1/workers", json={"worker_id": 1, "dp_size": 2, "taints": ["gpu=h200"]})
    assert updated.status_code == 200
    assert [r["dp_rank"] for r in updated.json()["ranks"]] == [0, 1]
    assert updated.json()["config"]["leased"] is False  # static: it need not heartbeat
    # A capacity update that names no ranks keeps them (a source set them: direct mode's dp=N, a bridge's
    # --dp-size); one that names them sets them.
    capacity = client.post("/v1/workers", json={"worker_id": 1, "total_kv_blocks": 1000, "taints": ["gpu=h200"]})
    assert [r["dp_rank"] for r in capacity.json()["ranks"]] == [0, 1]
    assert capacity.json()["config"]["total_kv_blocks"] == 1000
    narrowed = client.post("/v1/workers", json={"worker_id": 3, "dp_size": 3})
    assert [r["dp_rank"] for r in narrowed.json()["ranks"]] == [0, 1, 2]
    narrowed = client.post("/v1/workers", json={"worker_id": 3, "dp_size": 1})
    assert [r["dp_rank"] for r in narrowed.json()["ranks"]] == [0]
    client.delete("/v1/workers/3")
    constrained = {"tokens": tokens, "routing_constraints": {"required_taints": ["gpu=h200"]}}
    assert client.post("/v1/new", json=constrained).json()["worker_id"] == 1
    assert client.post("/v1/new", json={"tokens": tokens}).json()["overlap_blocks"] == 4
    # Deregister: its index entries and requests go, and it is no longer chosen.
    removed = client.delete("/v1/workers/1")
    assert removed.status_code == 200 and removed.json()["config"]["worker_id"] == 1
    assert [w["config"]["worker_id"] for w in client.get("/v1/workers").json()["workers"]] == [2]
    assert client.post("/v1/new", json={"tokens": tokens}).json()["worker_id"] == 2
    assert client.post("/v1/overlap", json={"tokens": tokens}).json()["workers"][0]["device_blocks"] == 0
    missing = client.delete("/v1/workers/1")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "unknown_worker"
    no_taint = client.post("/v1/new", json=constrained)
    assert no_taint.status_code == 503 and no_taint.json()["error"]["type"] == "no_eligible_worker"


def test_health_readiness_and_openapi(client: TestClient) -> None:
    for path in ("/healthz", "/health", "/liveness"):
        assert client.get(path).json() == {"status": "ok"}, path
    for path in ("/readyz", "/readiness"):
        assert client.get(path).json() == {"ready": True, "workers": 0}, path
    with serve(ready_min_workers=1) as strict:
        for path in ("/readyz", "/readiness"):
            not_ready = strict.get(path)
            assert not_ready.status_code == 503 and "1 required" in not_ready.json()["reason"], path
        strict.post("/v1/workers", json={"worker_id": 5})
        assert strict.get("/readyz").status_code == 200
        assert strict.get("/readiness").status_code == 200
    document = client.get("/openapi.json").json()
    assert {"/health", "/liveness", "/readiness"} <= set(document["paths"])
    new = document["paths"]["/v1/new"]["post"]
    assert new["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/NewRequest"}
    assert "application/msgpack" in new["requestBody"]["content"]
    schemas = document["components"]["schemas"]
    assert "tokens" in schemas["NewRequest"]["properties"]
    assert schemas["RouteDecision"]["required"][:2] == ["worker_id", "dp_rank"]
    router = document["paths"]["/v1/router"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert set(router["discriminator"]["mapping"]) == {"new", "potential_loads", "mark_prefill", "mark_free", "route"}
    # Dynamo's names on the wire: cache_namespace is cache_salt, is_probe _HEALTH_CHECK.
    assert {"cache_salt", "backend_instance_id", "dp_rank"} <= set(schemas["RoutingHints"]["properties"])
    assert {"token_ids", "routing", "mm_routing_info", "_HEALTH_CHECK"} <= set(schemas["RouteBody"]["properties"])
    assert "/v1/route" in document["paths"]
    assert client.get("/docs").status_code == 200


def test_router_config_override_on_new_and_on_the_router_protocol(client: TestClient) -> None:
    _register(client, 1)
    idle = prompt(99, 1)

    def booked_prefill() -> int:
        loads = client.post("/v1/potential_loads", json={"tokens": idle}).json()["loads"]
        return int(loads[0]["potential_prefill_tokens"]) - 1

    override = {"track_prefill_tokens": False}
    new = client.post("/v1/new", json={"tokens": prompt(1, 64), "request_id": "a", "router_config_override": override})
    assert new.status_code == 200
    assert booked_prefill() == 0  # booked without its prefill, as the override asked
    client.post("/v1/router", json={"method": "new", "tokens": prompt(2, 64), "router_config_override": override})
    assert booked_prefill() == 0
    client.post("/v1/new", json={"tokens": prompt(3, 64), "request_id": "c"})
    assert booked_prefill() == 64  # the router's own config again

    bad = client.post("/v1/new", json={"tokens": prompt(4, 64), "router_config_override": {"router_temperature": -1}})
    assert bad.status_code == 422
    assert bad.json()["error"]["type"] == "invalid_request"
    assert "router_temperature" in bad.json()["error"]["message"]


def test_a_worker_url_is_its_engine_server_root_behind_a_prefix_or_not_never_an_endpoint(client: TestClient) -> None:
    """A ``url`` is the engine's OpenAI server root, with or without /v1 and behind an ingress's path
    prefix or not; one going on past /v1 (an endpoint's) is a 422 naming ``url``: accepted before, the
    proxy posted to /v1/completions/v1/completions and probed /v1/completions/health."""
    for worker_id, url in enumerate(("http://gw/engine-a/v1", "http://gw/engine-b", "http://h:8000/v1/"), 1):
        registered = client.post("/v1/workers", json={"worker_id": worker_id, "url": url})
        assert registered.status_code == 201, registered.text
        assert registered.json()["config"]["url"] == url
    for url in ("http://h:8000/v1/completions", "http://h:8000/v1/chat/completions", "http://gw/engine-a/v1/models"):
        refused = client.post("/v1/workers", json={"worker_id": 9, "url": url})
        assert refused.status_code == 422
        error = refused.json()["error"]
        assert error["type"] == "invalid_request"
        assert "url must be an engine's http(s) URL" in error["message"] and "goes on past /v1" in error["message"]
        assert "give the engine's OpenAI server root" in error["message"] and "with or without /v1" in error["message"]
    assert [w["config"]["worker_id"] for w in client.get("/v1/workers").json()["workers"]] == [1, 2, 3]


def test_a_worker_of_another_block_size_is_refused_and_nothing_registered(client: TestClient) -> None:
    """HTTP only: a registration naming another block size is a 409 naming both sizes, for a new
    worker and for a registered one (left as it was); the router refuses it itself too."""
    refused = client.post("/v1/workers", json={"worker_id": 5, "block_size": 2 * BLOCK_SIZE})
    assert refused.status_code == 409
    error = refused.json()["error"]
    assert error["type"] == "block_size_mismatch"
    assert f"block size {2 * BLOCK_SIZE}" in error["message"] and f"router {BLOCK_SIZE}" in error["message"]
    assert error["detail"] == {"worker_id": 5, "worker_block_size": 2 * BLOCK_SIZE, "router_block_size": BLOCK_SIZE}
    assert client.get("/v1/workers").json()["workers"] == []
    assert client.get("/v1/workers/5").status_code == 404
    # A registered worker re-registered with another size keeps its configuration.
    assert client.post("/v1/workers", json={"worker_id": 6, "block_size": BLOCK_SIZE}).status_code == 201
    again = client.post("/v1/workers", json={"worker_id": 6, "block_size": 2 * BLOCK_SIZE, "total_kv_blocks": 9})
    assert again.status_code == 409 and again.json()["error"]["type"] == "block_size_mismatch"
    [worker] = client.get("/v1/workers").json()["workers"]
    assert worker["config"]["block_size"] == BLOCK_SIZE and worker["config"].get("total_kv_blocks") is None
    router = KvRouter(RouterConfig(block_size=BLOCK_SIZE))
    with pytest.raises(BlockSizeMismatch, match=f"worker 7 uses block size {2 * BLOCK_SIZE}, router {BLOCK_SIZE}"):
        router.register_worker(WorkerConfig(worker_id=7, block_size=2 * BLOCK_SIZE))
    assert router.workers() == []


def test_the_openai_routes_without_the_proxy_say_it_is_off(client: TestClient) -> None:
    """Without ``--proxy``, the proxy's routes answer a 404 in OpenAI's error shape saying how to turn
    it on, not a bare "Not Found"."""
    calls = [("POST", path) for path in ROUTES] + [("GET", "/v1/models")]
    assert {path for _, path in calls} >= {"/v1/completions", "/v1/chat/completions", "/v1/responses"}
    for method, path in calls:
        reply = client.request(method, path, json={"model": "m", "prompt": "x"})
        assert reply.status_code == 404 and reply.headers["content-type"] == "application/json"
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == 404
        assert "proxy is off" in error["message"] and "kv-router serve --proxy" in error["message"]
        assert f"{method} {path}" in error["message"]

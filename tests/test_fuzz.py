"""Property-based fuzzing of every route and every event decoder, bounded for CI (``bench/fuzz.py``
runs the same inputs for millions of cases).

Routes: near-valid and garbage bodies in JSON and msgpack, odd headers and methods, through the ASGI
fast path and through FastAPI's routes. Never a 5xx, every error in the ``{"error": {"type",
"message"}}`` shape, and a refused request changes nothing: the workers with their live loads, the
index (``/v1/dump``) and ``potential_loads`` are the same before and after.

Event plane: KV event messages (``decode_router_events`` then the sequencer), resync replies
(decoded as the subscriber does, then ``resync_done``), heartbeats, loads and registrations (through
the real `RouterEventPlane` handlers, on a real NATS connection). Never an exception out of a
handler; an undecodable or refused message is counted.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.aio.msg import Msg

from indexer.errors import EventDecodeError
from indexer.events import ResyncRequest, ResyncResponse, decode_router_events, looks_like_msgpack
from router.config import RouterConfig
from router.event_plane.connection import NatsOptions, connect
from router.event_plane.embedded_server import EmbeddedNats
from router.event_plane.plane import RouterEventPlane
from router.kv_router import KvRouter
from router.types import MAX_DP_SIZE, WorkerConfig
from tests.fuzz_inputs import event_payloads, requests, wire_payloads
from tests.test_api_support import prompt, serve, state, stored_event

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=False,
)


@pytest.fixture(scope="module", params=[True, False], ids=["protocol", "asgi"])
def client(request: pytest.FixtureRequest) -> Iterator[TestClient]:
    with serve(fast_protocol=request.param, max_body_bytes=64 * 1024, max_prompt_tokens=4096) as client:
        for worker_id in (1, 2):
            assert client.post("/v1/workers", json={"worker_id": worker_id, "total_kv_blocks": 100}).status_code == 201
        assert client.post("/v1/events", json=stored_event(1, prompt(1, 64))).json()["applied"] == 1
        assert client.post("/v1/new", json={"tokens": prompt(1, 64), "request_id": "booked"}).status_code == 200
        yield client


def _check_error_shape(reply: Any) -> None:
    if reply.request.method == "HEAD":
        return
    body = reply.json() if reply.headers.get("content-type", "").startswith("application/json") else None
    if body is None:  # msgpack errors are JSON too: an error body is always JSON
        pytest.fail(f"error reply without a JSON body: {reply.status_code} {reply.content[:200]!r}")
    assert set(body) == {"error"} and {"type", "message"} <= set(body["error"]), body


@FUZZ
@given(request=requests())
def test_routes_never_fail_and_refusals_change_nothing(client: TestClient, request: Any) -> None:
    method, path, body, headers = request
    before = state(client)
    reply = client.request(method, path, content=body, headers=headers)
    assert reply.status_code < 500, (reply.status_code, reply.content[:300])
    if reply.status_code >= 400:
        _check_error_shape(reply)
        assert state(client) == before, (method, path, body[:200], reply.status_code)


def test_the_regressions_the_fuzzer_found(client: TestClient) -> None:
    """A registration with a huge dp_size used to build that many ranks (minutes of blocked loop);
    ranks past u32 were accepted and answered as dp_rank values no Dynamo client can decode."""
    before = state(client)
    for body in ({"worker_id": 7, "dp_size": 3_000_000}, {"worker_id": 7, "dp_size": MAX_DP_SIZE + 1},
                 {"worker_id": 7, "dp_start_rank": (1 << 32) - 1, "dp_size": 2}):  # fmt: skip
        reply = client.post("/v1/workers", json=body)
        assert reply.status_code == 422 and reply.json()["error"]["type"] == "invalid_request"
    assert state(client) == before


# ---------------------------------------------------------------------- event decoders


@FUZZ
@given(payloads=st.lists(event_payloads(), min_size=1, max_size=4))
def test_event_messages_decode_or_are_rejected(payloads: list[bytes]) -> None:
    router = KvRouter(RouterConfig(block_size=16), rng=random.Random(0))
    router.register_worker(WorkerConfig(worker_id=1))
    for payload in payloads:
        try:
            events = decode_router_events(payload, msgpack=None)
        except EventDecodeError:
            continue
        router.sequencer.ingest(events)  # never raises: bad events are counted rejections
    # The index still answers and dumps what it holds.
    router.overlap(prompt(1, 64), None, None, None)
    router.tree.dump_events()


_resync_json = msgspec.json.Decoder(ResyncResponse)
_resync_msgpack = msgspec.msgpack.Decoder(ResyncResponse)


@FUZZ
@given(payload=wire_payloads("resync"))
def test_resync_replies_decode_or_are_rejected(payload: bytes) -> None:
    router = KvRouter(RouterConfig(block_size=16), rng=random.Random(0))
    router.register_worker(WorkerConfig(worker_id=1))
    asked: list[ResyncRequest] = []
    router.sequencer.resync_transport = asked.append
    events = [stored_event(1, prompt(1, 64), event_id=1), stored_event(1, prompt(2, 64), event_id=3)]
    router.sequencer.ingest(decode_router_events(msgspec.json.encode(events)))  # a gap: a resync goes out
    assert asked
    try:
        response = (_resync_msgpack if looks_like_msgpack(payload) else _resync_json).decode(payload)
    except msgspec.DecodeError:
        return
    follow_up = router.sequencer.resync_done(asked[-1], response)
    assert follow_up is None or follow_up.worker_id == 1
    router.overlap(prompt(1, 64), None, None, None)


@pytest.fixture
def plane(client_nc: Client) -> RouterEventPlane:
    router = KvRouter(RouterConfig(block_size=16), rng=random.Random(0))
    router.register_worker(WorkerConfig(worker_id=1, total_kv_blocks=100))
    return RouterEventPlane(router, client_nc)


@pytest.fixture
async def client_nc(nats_server: EmbeddedNats) -> AsyncIterator[Client]:
    """A connected NATS client of its own: this module's ``client`` is the HTTP service's, which shadows
    tests/conftest.py's NATS one (the plane was handed a TestClient, which answered nothing it asked)."""
    nc = await connect(NatsOptions(nats_server.url))
    yield nc
    await nc.close()


@pytest.mark.anyio
@FUZZ
@given(
    messages=st.lists(
        st.sampled_from(["heartbeat", "load", "registration"]).flatmap(
            lambda kind: wire_payloads(kind).map(lambda data: (kind, data))
        ),
        min_size=1,
        max_size=4,
    )
)
async def test_control_messages_are_applied_or_counted(plane: RouterEventPlane, messages: list[Any]) -> None:
    handled = sum(plane.outcomes.values())
    for kind, data in messages:
        if kind == "registration":
            try:
                registration = msgspec.json.decode(data, type=WorkerConfig)
            except msgspec.DecodeError:
                continue
            await plane._apply_registration(registration)
            continue
        message = Msg(_client=plane.nc, subject=f"kv.default.{kind}.1", data=data)
        await (plane._on_heartbeat if kind == "heartbeat" else plane._on_load)(message)
    assert sum(plane.outcomes.values()) >= handled
    plane.router.potential_loads(prompt(3, 32), None, None, None)
    await asyncio.sleep(0)

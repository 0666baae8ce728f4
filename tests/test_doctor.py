"""The configuration doctor: each misconfiguration it names, made to happen, seen, and gone once fixed."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from api.app import create_app
from api.config import EventPlaneConfig, Settings
from indexer.events import ResyncBatch, ResyncResponse, RouterEvent, stored_event
from indexer.hashing import compute_block_hashes, compute_sequence_hashes
from mocker.zmq_engine import VllmZmqPublisher
from router.config import RouterConfig
from router.doctor import ConfigDoctor, Problem
from router.engines.direct import DirectEngine
from router.event_plane.embedded_server import free_port
from router.kv_router import KvRouter
from router.types import RouteRequest, WorkerConfig
from tests.engine_fakes import EngineHttp, FakeEngine
from tests.waiting import eventually

BLOCK = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _router(*workers: WorkerConfig) -> KvRouter:
    router = KvRouter(RouterConfig(block_size=BLOCK), rng=random.Random(0))
    for worker in workers:
        router.register_worker(worker)
    return router


def _doctor(router: KvRouter, clock: Clock, **options: float) -> ConfigDoctor:
    settings = {"sample_every": 1, "sample_delay_s": 0.0, "hash_mismatch_after": 5, **options}
    return ConfigDoctor(router, clock=clock, **settings)  # type: ignore[arg-type]


def _kinds(problems: list[Problem]) -> list[tuple[str, int | None]]:
    return [(p.kind, p.worker_id) for p in problems]


def _stored(worker_id: int, event_id: int, tokens: list[int], **salt: str) -> RouterEvent:
    local = compute_block_hashes(tokens, BLOCK, **salt)
    return RouterEvent(worker_id, stored_event(event_id, zip(compute_sequence_hashes(local), local, strict=True)))


async def _route(router: KvRouter, prompts: list[list[int]]) -> None:
    for i, tokens in enumerate(prompts):
        await router.new(RouteRequest(tokens=tokens, request_id=f"r-{i}"))


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(50_000) for _ in range(3 * BLOCK)] for _ in range(count)]


@pytest.mark.anyio
async def test_a_worker_routed_for_a_minute_without_events_is_not_wired(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    router = _router(WorkerConfig(worker_id=1, leased=False), WorkerConfig(worker_id=2, leased=False, kv_events=False))
    doctor = _doctor(router, clock)
    await _route(router, _prompts(10))
    assert doctor.check() == []
    clock.now += 61
    with caplog.at_level(logging.WARNING, logger="router.doctor"):
        assert _kinds(doctor.check()) == [("events_not_wired", 1)]  # worker 2 is in approximate mode
        assert _kinds(doctor.check()) == [("events_not_wired", 1)]
    assert len([r for r in caplog.records if "events_not_wired" in r.getMessage()]) == 1  # one WARNING
    assert doctor.problems[0].since == clock.now
    assert doctor.counts()["events_not_wired"] == 1
    router.sequencer.ingest([_stored(1, 1, _prompts(1)[0])])
    assert doctor.check() == []


@pytest.mark.anyio
@pytest.mark.parametrize("answer", ["none", "empty_dump"])
async def test_a_worker_whose_registration_resync_found_no_events_is_still_not_wired(clock: Clock, answer: str) -> None:
    # A worker registered over NATS with events expected: the event plane asks it for a full resync at
    # once, which opens its stream. An engine that sends nothing answers it with an empty dump, or
    # nobody answers; either way it has sent no event, and the doctor says so.
    router = _router(WorkerConfig(worker_id=1))
    doctor = _doctor(router, clock)
    request = router.sequencer.request_full_resync(1, 0)
    assert request is not None
    if answer == "none":
        router.sequencer.resync_failed(request, no_responders=True)
    else:
        router.sequencer.resync_done(request, ResyncResponse(tree_dump=ResyncBatch(events=[], last_event_id=0)))
    await _route(router, _prompts(10))
    clock.now += 61
    assert _kinds(doctor.check()) == [("events_not_wired", 1)]
    router.sequencer.ingest([_stored(1, 1, _prompts(1)[0])])
    assert doctor.check() == []


@pytest.mark.anyio
@pytest.mark.parametrize("salted", [True, False])
async def test_blocks_hashed_with_another_salt_than_the_requests_are_a_hash_mismatch(
    clock: Clock, salted: bool
) -> None:
    router = _router(WorkerConfig(worker_id=1, leased=False))
    doctor = _doctor(router, clock)
    prompts = _prompts(8)
    salt = {"lora_name": "adapter-the-requests-do-not-name"} if salted else {}
    router.sequencer.ingest(_stored(1, i + 1, tokens, **salt) for i, tokens in enumerate(prompts))
    await _route(router, prompts)
    clock.now += 1
    assert _kinds(doctor.check()) == ([("tokens_hash_mismatch", 1)] if salted else [])


def test_a_stream_that_keeps_gapping_and_events_from_an_unknown_worker(clock: Clock) -> None:
    router = _router(WorkerConfig(worker_id=1, leased=False))
    doctor = _doctor(router, clock, gap_window_s=600, gap_threshold=3)
    tokens = _prompts(1)[0]
    router.sequencer.ingest([_stored(1, 1, tokens)])
    for event_id in (3, 5, 7):  # each skips one id; without a transport the resync fails at once
        router.sequencer.ingest([_stored(1, event_id, tokens)])
    router.sequencer.ingest([_stored(99, 1, tokens)])
    assert _kinds(doctor.check()) == [("stream_gapping", 1), ("unregistered_worker", 99)]
    clock.now += 601  # the gaps age out of the window
    router.register_worker(WorkerConfig(worker_id=99, leased=False))
    assert doctor.check() == []


@pytest.mark.anyio
async def test_an_engine_with_another_block_size_is_reported_over_http(caplog: pytest.LogCaptureFixture) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    engine = FakeEngine(5, endpoint, None)  # block size 4, router 16
    await engine.start()
    router = KvRouter(RouterConfig(block_size=16))
    direct = DirectEngine(router, f"5={endpoint}")
    await direct.start()
    try:
        doctor = ConfigDoctor(router, engines=[direct])

        async def mismatch_seen() -> bool:  # the first batches may go before the SUB socket is joined
            if direct.streams[0].stats["rejected_block_size_mismatch"]:  # none sent after it is in flight
                return True
            await engine.step()
            return False

        await eventually(mismatch_seen, 30, "a batch of the wrong block size is rejected")
        (problem,) = doctor.check()
        assert (problem.kind, problem.worker_id) == ("block_size_mismatch", 5)
        assert "the engine's block size is 4, the router's 16" in problem.evidence
    finally:
        await direct.stop()
        await engine.stop()


def _vllm_stored(block_hash: int, tokens: list[int], **fields: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": [block_hash], "parent_block_hash": None, "token_ids": tokens,
            "block_size": BLOCK, "lora_id": None, "medium": "GPU", **fields}  # fmt: skip


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("second", "expected"),
    [
        # vLLM salting by a request's cache_salt (not in its events): same tokens, another engine hash.
        (_vllm_stored(2, [1, 2, 3, 4]), "the engine salts its cache with something its events do not carry"),
        # One engine block, sent once with a LoRA name and once without: our salt varies, the engine's not.
        (_vllm_stored(1, [1, 2, 3, 4], lora_name="adapter"), "varies where the engine's does not"),
        (_vllm_stored(1, [1, 2, 3, 4]), None),  # the same block stored again (after an eviction): fine
    ],
)
async def test_engine_block_hashes_that_contradict_our_hashing_of_their_token_ids_are_a_hash_mismatch(
    second: dict[str, Any], expected: str | None
) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    engine = VllmZmqPublisher(endpoint)
    await engine.start()
    router = KvRouter(RouterConfig(block_size=BLOCK))
    direct = DirectEngine(router, f"5={endpoint}")
    await direct.start()
    try:
        doctor = ConfigDoctor(router, engines=[direct])
        first = msgspec.msgpack.encode([0.0, [_vllm_stored(1, [1, 2, 3, 4])], 0])

        async def first_applied() -> bool:  # the first batches may go before the SUB socket is joined
            if direct.streams[0].stats["applied"]:  # none sent after it is in flight
                return True
            await engine.send(first, seq=0)
            return False

        await eventually(first_applied, 30, "the first batch is applied")
        removal = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}
        await engine.send(msgspec.msgpack.encode([0.0, [removal, second], 0]), seq=1)
        # A copy of the first batch still in flight when it was applied reads as a restart (seq 0 again)
        # and is applied too: the second batch is the one applied beyond those.
        stats = direct.streams[0].stats
        await eventually(lambda: stats["applied"] - stats["restarts"] >= 2, 30, "the second batch is applied")
        problems = doctor.check()
        if expected is None:
            assert problems == []
        else:
            (problem,) = problems
            assert (problem.kind, problem.worker_id) == ("tokens_hash_mismatch", 5)
            assert expected in problem.evidence
        # The engine restarts (its seq goes back to 0) fixed: the problem goes with its old process.
        restarts = direct.streams[0].stats["restarts"]
        await engine.send(msgspec.msgpack.encode([0.0, [_vllm_stored(1, [1, 2, 3, 4])], 0]), seq=0)
        await eventually(lambda: direct.streams[0].stats["restarts"] > restarts, 30, "the engine's restart is seen")
        assert doctor.check() == []
    finally:
        await direct.stop()
        await engine.stop()


@pytest.fixture
def client() -> Iterator[TestClient]:
    settings = Settings(router=RouterConfig(block_size=BLOCK), event_plane=EventPlaneConfig(embedded_nats=False))
    app = create_app(settings, registry=CollectorRegistry(), rng=random.Random(0))
    with TestClient(app, base_url="http://127.0.0.1") as test_client:
        yield test_client


def test_get_doctor_lists_problems_and_the_gauge_counts_them(client: TestClient) -> None:
    assert client.get("/v1/doctor").json() == []
    metrics = client.get("/metrics").text
    assert 'kv_router_config_problems{kind="unregistered_worker"} 0.0' in metrics
    event = msgspec.json.encode(_stored(77, 1, _prompts(1)[0]))
    client.post("/v1/events", content=event, headers={"content-type": "application/json"})
    (problem,) = client.get("/v1/doctor").json()
    assert set(problem) == {"kind", "worker_id", "evidence", "since"}
    assert (problem["kind"], problem["worker_id"]) == ("unregistered_worker", 77)
    assert "1 events from worker 77" in problem["evidence"]
    assert 'kv_router_config_problems{kind="unregistered_worker"} 1.0' in client.get("/metrics").text


@pytest.mark.anyio
async def test_an_engine_that_answers_but_whose_event_socket_never_delivers_names_the_bind_address() -> None:
    # vLLM given tcp://127.0.0.1:PORT connects its PUB socket instead of binding it: nobody listens on
    # the port the router subscribes to, the engine serves requests, and nothing flows.
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    http = await EngineHttp().start()
    router = KvRouter(RouterConfig(block_size=BLOCK))
    direct = DirectEngine(router, f"5={endpoint},url={http.url}/v1", health_interval_s=0.1)
    await direct.start()
    publisher = VllmZmqPublisher(f"tcp://*:{port}")
    try:
        doctor = ConfigDoctor(router, engines=[direct], engine_silent_after_s=3.0)  # not yet at the first check
        await eventually(lambda: router.has_worker(5))
        await router.new(RouteRequest(tokens=list(range(16)), request_id="r1"))
        await eventually(lambda: direct.up_at is not None, what="the engine's health probe answers")
        assert [p.kind for p in doctor.check()] == []  # up and routed only just now
        await eventually(lambda: [p.kind for p in doctor.check()] == ["engine_events_silent"])
        (problem,) = doctor.problems
        assert problem.worker_id == 5 and f"tcp://*:{port}" in problem.evidence and http.url in problem.evidence

        # Bound as vLLM binds tcp://*:PORT: the events flow and the problem goes.
        await publisher.start()

        async def delivered() -> bool:  # sent again until the subscription has reached the PUB socket
            await publisher.send(msgspec.msgpack.encode([0.0, [_vllm_stored(1, [1, 2, 3, 4])], 0]))
            return bool(direct.streams[0].stats["messages"])

        await eventually(delivered, what="the engine's events are delivered", poll=0.05)
        assert doctor.check() == []
    finally:
        await publisher.stop()
        await direct.stop()
        await http.stop()


def test_a_both_worker_with_the_bootstrap_handoff_in_a_two_leg_fleet_is_sent_legs_of_both_modes(clock: Clock) -> None:
    sglang = WorkerConfig(worker_id=3, leased=False, handoff="bootstrap", bootstrap_port=8998)
    router = KvRouter(RouterConfig(block_size=BLOCK, disagg_among_both_workers=True), rng=random.Random(0))
    router.register_worker(sglang)
    doctor = _doctor(router, clock)
    assert doctor.check() == []  # one worker: routed aggregated
    router.register_worker(WorkerConfig(worker_id=4, leased=False))
    (problem,) = doctor.check()
    assert (problem.kind, problem.worker_id) == ("handoff_unservable", 3)
    assert "register it with role prefill or decode" in problem.evidence
    assert doctor.counts()["handoff_unservable"] == 1
    router.register_worker(msgspec.structs.replace(sglang, role="prefill"))  # its own mode: servable
    assert doctor.check() == []
    # Dedicated roles beside it route in two legs too, with or without the option.
    aggregated = _router(sglang, WorkerConfig(worker_id=5, leased=False))
    assert _doctor(aggregated, clock).check() == []
    aggregated.register_worker(WorkerConfig(worker_id=6, leased=False, role="decode"))
    assert _kinds(_doctor(aggregated, clock).check()) == [("handoff_unservable", 3)]
    # Alone for its model, it is never paired with another worker: fine.
    separate = _router(
        msgspec.structs.replace(sglang, models=frozenset({"small"})),
        WorkerConfig(worker_id=7, leased=False, role="prefill", models=frozenset({"large"})),
        WorkerConfig(worker_id=8, leased=False, role="decode", models=frozenset({"large"})),
    )
    assert separate.disaggregated and _doctor(separate, clock).check() == []

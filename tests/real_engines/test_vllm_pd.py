"""A real vLLM prefill/decode pair behind ``kv-router serve --proxy`` (issue 27's real-engine lane):
two CPU engines whose KV goes from one to the other through vLLM's ExampleConnector (each prompt's KV
written to a shared directory by the engine that computes it, loaded by an engine given the same
prompt), registered by ``kv-router bridge --role prefill --handoff sequential`` and ``--role decode``
over a real nats-server, with the real `openai` client. A long prompt is prefilled on the prefill
engine and decoded on the decode engine, which loads its KV; a short one stays on the decode engine
(conditional disaggregation). Then the same engines as two workers of role both, the router
disaggregating among them (``--disagg-among-both-workers``): a long prompt is prefilled on one and
its KV loaded by the other. Both bookings are freed after each.

The pair is this module's own (the connector is an engine setting), started in parallel once the
session's engines are stopped, and stopped by their PIDs."""

from __future__ import annotations

import random
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from router.event_plane.embedded_server import EmbeddedNats
from tests.metrics import sample, total
from tests.real_engines.engines import BLOCK_SIZE, MODEL, VllmEngine, lane_model, stop_shared_engines, vllm_python
from tests.real_engines.fleet import Bridge, bridge_router, ready
from tests.router_processes import RouterProcess
from tests.waiting import eventually

pytestmark = [pytest.mark.real_engines, pytest.mark.anyio]

PREFILL, DECODE = 11, 12
LOADED = "External Cache Hit!"  # the ExampleConnector's log line when an engine finds a prompt's KV stored


@pytest.fixture(scope="module")
def pd_pair(lane_dir: Path) -> Iterator[tuple[VllmEngine, VllmEngine]]:
    """The prefill engine (kv_producer) and the decode engine (kv_consumer), sharing a KV directory."""
    python = vllm_python()
    assert python is not None
    stop_shared_engines()  # one set of engines at a time on the lane's machine
    model = lane_model(lane_dir)
    shared = lane_dir / "pd-kv"
    shared.mkdir(exist_ok=True)

    def transfer(role: str) -> dict[str, Any]:
        extra = {"shared_storage_path": str(shared)}
        return {"kv_connector": "ExampleConnector", "kv_role": role, "kv_connector_extra_config": extra}

    pair = (
        VllmEngine(python, model, lane_dir, PREFILL, transfer("kv_producer")),
        VllmEngine(python, model, lane_dir, DECODE, transfer("kv_consumer")),
    )
    try:
        for engine in pair:
            engine.start()
        for engine in pair:
            engine.wait_ready()
        print(f"\nP/D pair ready in {', '.join(f'{engine.ready_after:.0f} s' for engine in pair)}")
        yield pair
    finally:
        for engine in pair:
            engine.stop()


@contextmanager
def bridged_router(
    lane_dir: Path, nats_url: str, bridges: Sequence[tuple[VllmEngine, tuple[str, ...]]], *flags: str,
    roles: dict[int, str],
) -> Iterator[RouterProcess]:  # fmt: skip
    """A ``kv-router bridge`` beside each engine (with its flags) and ``kv-router serve --proxy`` (with
    ``flags``) fed by them, ready once it proxies to every worker with these roles; all stopped after."""
    processes = [Bridge(lane_dir, nats_url, engine, *engine_flags) for engine, engine_flags in bridges]
    try:
        router = bridge_router(lane_dir, nats_url, *flags)
        try:
            ready(router, set(roles))
            workers = router.get("/v1/workers")["workers"]
            assert {worker["config"]["worker_id"]: worker["config"]["role"] for worker in workers} == roles
            yield router
        finally:
            router.stop()
    finally:
        for process in processes:
            process.stop()


@pytest.fixture(scope="module")
def pd_router(
    pd_pair: tuple[VllmEngine, VllmEngine], lane_nats: EmbeddedNats, lane_dir: Path
) -> Iterator[RouterProcess]:
    """``kv-router serve --proxy`` with the pair registered by their bridges, each with its role."""
    prefill, decode = pd_pair
    bridges = [(prefill, ("--role", "prefill", "--handoff", "sequential")), (decode, ("--role", "decode"))]
    with bridged_router(lane_dir, lane_nats.url, bridges, roles={PREFILL: "prefill", DECODE: "decode"}) as router:
        yield router


@pytest.fixture
def among_both_router(
    pd_pair: tuple[VllmEngine, VllmEngine], lane_nats: EmbeddedNats, lane_dir: Path
) -> Iterator[RouterProcess]:
    """The same pair as two workers of role both (the ExampleConnector stores and loads on either
    engine), registered by bridges of their own in a namespace of their own beside ``pd_router``'s, and
    ``kv-router serve --proxy --disagg-among-both-workers`` routing them."""
    bridges = [(engine, ("--handoff", "sequential", "--namespace", "among-both")) for engine in pd_pair]
    flags = ("--nats-namespace", "among-both", "--disagg-among-both-workers")
    with bridged_router(lane_dir, lane_nats.url, bridges, *flags, roles={PREFILL: "both", DECODE: "both"}) as router:
        yield router


def idle(router: RouterProcess) -> bool:
    """Nothing booked on either worker: both legs' bookings freed."""
    return all(
        rank["active_requests"] == 0 and rank["active_prefill_tokens"] == 0 and rank["active_decode_blocks"] == 0
        for worker in router.get("/v1/workers")["workers"]
        for rank in worker["ranks"]
    )


def finished(engine: VllmEngine) -> float:
    """Requests the engine has finished (its own Prometheus counter)."""
    with urllib.request.urlopen(f"{engine.url}/metrics", timeout=10) as reply:
        return total(reply.read().decode(), "vllm:request_success_total")


def client(router: RouterProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{router.port}/v1", api_key="unused", max_retries=0, timeout=120
    )


async def streamed(router: RouterProcess, prompt: list[int]) -> tuple[Mapping[str, str], list[Any]]:
    """The prompt's greedy completion of 4 tokens through the proxy, streamed with its usage."""
    async with client(router) as openai_client:
        raw = await openai_client.completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in raw.parse()]
    return raw.headers, chunks


def answered_as_by(engine: VllmEngine, prompt: list[int], chunks: list[Any]) -> None:
    """The streamed text is what ``engine`` answers the prompt from its own KV."""
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    status, direct = engine.post(
        "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    )
    assert status == 200, direct
    assert text == direct["choices"][0]["text"]


async def handed_off_once(router: RouterProcess) -> None:
    """Both legs' bookings freed, one hand-off counted."""
    await eventually(lambda: idle(router), 30, "both bookings are freed")
    assert sample(router.metrics(), "kv_router_proxy_handoffs_total", style="sequential", outcome="ok") == 1.0


async def test_a_long_prompt_is_prefilled_on_the_prefill_engine_and_its_kv_loaded_by_the_decode_engine(
    pd_pair: tuple[VllmEngine, VllmEngine], pd_router: RouterProcess
) -> None:
    prefill, decode = pd_pair
    rng = random.Random(27)
    prompt = [rng.randrange(10, 5990) for _ in range(13 * BLOCK_SIZE + 10)]  # 426 tokens: over the 256 threshold
    loads_before = decode.log().count(LOADED)
    prefilled_before = finished(prefill)
    headers, chunks = await streamed(pd_router, prompt)
    assert headers["x-kv-router-disaggregation"] == "remote_prefill"
    assert headers["x-kv-router-prefill-worker"] == str(PREFILL)
    assert headers["x-kv-router-worker"] == str(DECODE)
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == len(prompt)
    # The decode engine never saw this prompt: the 13 full blocks it reports cached (all but the last,
    # partial one) are the KV the prefill engine stored, loaded through the connector.
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == 13 * BLOCK_SIZE
    assert decode.log().count(LOADED) == loads_before + 1
    assert finished(prefill) == prefilled_before + 1  # the prefill leg, one token
    # With the loaded KV the decode engine generates what the prefill engine generates from its own.
    answered_as_by(prefill, prompt, chunks)
    await handed_off_once(pd_router)


async def test_a_short_prompt_stays_on_the_decode_engine(
    pd_pair: tuple[VllmEngine, VllmEngine], pd_router: RouterProcess
) -> None:
    prefill, decode = pd_pair
    rng = random.Random(270)
    prompt = [rng.randrange(10, 5990) for _ in range(3 * BLOCK_SIZE + 10)]  # 106 tokens: under the threshold
    loads_before = decode.log().count(LOADED)
    prefilled_before = finished(prefill)
    async with client(pd_router) as openai_client:
        raw = await openai_client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=4)
    answer = raw.parse()
    assert raw.headers["x-kv-router-disaggregation"] == "local_prefill"
    assert "x-kv-router-prefill-worker" not in raw.headers
    assert raw.headers["x-kv-router-worker"] == str(DECODE)
    assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.prompt_tokens_details is not None and answer.usage.prompt_tokens_details.cached_tokens == 0
    assert decode.log().count(LOADED) == loads_before  # computed there, nothing loaded
    assert finished(prefill) == prefilled_before  # the prefill engine had no part in it
    await eventually(lambda: idle(pd_router), 30, "its booking is freed")


async def test_engines_of_role_both_hand_a_long_prompt_over_to_each_other(
    pd_pair: tuple[VllmEngine, VllmEngine], among_both_router: RouterProcess
) -> None:
    """Disaggregation among workers of role both: one engine prefills the long prompt, the other loads
    its KV and answers what the first would have."""
    engines = {engine.worker_id: engine for engine in pd_pair}
    rng = random.Random(2700)
    prompt = [rng.randrange(10, 5990) for _ in range(13 * BLOCK_SIZE + 10)]  # over the 256-token threshold
    loads_before = {worker: engine.log().count(LOADED) for worker, engine in engines.items()}
    finished_before = {worker: finished(engine) for worker, engine in engines.items()}
    headers, chunks = await streamed(among_both_router, prompt)
    assert headers["x-kv-router-disaggregation"] == "remote_prefill"
    decode, prefill = int(headers["x-kv-router-worker"]), int(headers["x-kv-router-prefill-worker"])
    assert {decode, prefill} == {PREFILL, DECODE}
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 13 * BLOCK_SIZE  # the prefilling engine's KV, loaded
    assert engines[decode].log().count(LOADED) == loads_before[decode] + 1
    assert engines[prefill].log().count(LOADED) == loads_before[prefill]
    assert finished(engines[prefill]) == finished_before[prefill] + 1  # the prefill leg
    assert finished(engines[decode]) == finished_before[decode] + 1  # the client's answer
    answered_as_by(engines[prefill], prompt, chunks)
    await handed_off_once(among_both_router)

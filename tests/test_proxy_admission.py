"""The proxy's concurrency cap (`api.proxy.admission`): a bounded wait for a slot, in the router's queue
order, refused with a 429 and Retry-After when full or timed out; with the real `openai` client."""

from __future__ import annotations

import asyncio
import gc
import weakref

import httpx
import msgspec
import openai
import pytest

from api.config import ProxyConfig
from api.proxy.admission import Admission
from router.errors import QueueRejected
from router.event_plane.embedded_server import EmbeddedNats
from router.types import RouteRequest, WorkerConfig
from tests.gate_worker import Gate, register, served
from tests.metrics import sample
from tests.proxy_fleet import MODEL, Fleet, fleet, idle
from tests.waiting import eventually

pytestmark = pytest.mark.anyio


async def gauges(f: Fleet) -> tuple[float | None, float | None]:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{f.url}/metrics")).text
    return sample(text, "kv_router_proxy_requests_in_flight"), sample(text, "kv_router_proxy_requests_waiting")


async def test_requests_over_the_cap_wait_then_go_and_a_full_queue_or_a_timed_out_wait_is_a_429(
    nats_server: EmbeddedNats,
) -> None:
    proxy = {
        "proxy_max_concurrent_requests": 1,
        "proxy_max_waiting_requests": 1,
        "proxy_queue_timeout_secs": 3.0,  # the third's wait below outlasts a loaded machine's polls
        "proxy_retry_after_secs": 2,
        "proxy_health_check_interval_secs": 0,
    }
    gate = Gate(refusals=0, hold=asyncio.Event())
    async with fleet(nats_server.url, (), proxy=proxy) as f, served(gate) as url:
        await register(f, 7, url)

        def ask() -> asyncio.Future[object]:
            return asyncio.ensure_future(f.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1))

        try:
            first = ask()
            await eventually(lambda: len(gate.arrivals) == 1, what="the first request at the worker")
            waiting = ask()

            async def one_waits() -> bool:
                return await gauges(f) == (1.0, 1.0)

            await eventually(one_waits, what="one in flight, one waiting")
            # The queue is full: refused at once.
            with pytest.raises(openai.RateLimitError) as full:
                await f.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1)
            assert full.value.response.headers["retry-after"] == "2"
            assert full.value.response.json()["error"]["type"] == "rate_limit_exceeded"
            assert "(proxy_max_waiting_requests)" in full.value.response.json()["error"]["message"]
            # A text prompt, which the worker would tokenize: refused before that call, which the cap does not
            # hold back (twenty at once made twenty /tokenize calls, then were refused).
            arrived = len(gate.arrivals)
            with pytest.raises(openai.RateLimitError):
                await asyncio.wait_for(f.client.completions.create(model=MODEL, prompt="some text", max_tokens=1), 10)
            assert len(gate.arrivals) == arrived
            # Dynamo's instance query takes no slot (it is booked nowhere and sent to no worker): answered.
            query = await f.client.completions.create(
                model=MODEL,
                prompt=[1, 2, 3],
                max_tokens=1,
                extra_body={"nvext": {"annotations": ["query_instance_id:"]}},
            )
            assert query.model_extra is not None and query.model_extra["nvext"]["worker_id"]["decode_worker_id"] == 7
            # The one waiting gives up at its timeout, while the first still holds the slot.
            with pytest.raises(openai.RateLimitError, match=r"no free slot within 3 s") as timed_out:
                await waiting
            assert timed_out.value.response.headers["retry-after"] == "2"
            assert len(gate.arrivals) == 1
            # One more waits, and goes as soon as the slot is free.
            third = ask()
            await eventually(one_waits, what="one in flight, one waiting")
            gate.hold.set()  # type: ignore[union-attr]
            for done in await asyncio.gather(first, third):
                assert done.choices[0].text == " fine"  # type: ignore[attr-defined]
            assert len(gate.arrivals) == 2
            assert await gauges(f) == (0.0, 0.0)
            async with httpx.AsyncClient() as http:
                text = (await http.get(f"{f.url}/metrics")).text
            assert sample(text, "kv_router_proxy_requests_total", route="completions", outcome="queue_rejected") == 3
            assert idle(f.router)
        finally:
            gate.hold.set()  # type: ignore[union-attr]  # a failed check leaves no request held


async def test_a_slot_goes_to_whom_the_router_would_serve_first_and_a_cancelled_wait_frees_its_place() -> None:
    admission = Admission(
        ProxyConfig(proxy_max_concurrent_requests=1, proxy_max_waiting_requests=3, proxy_queue_timeout_secs=30),
        "fcfs",
    )
    order: list[str] = []

    async def one(name: str, tier: int = 0) -> None:
        async with admission.slot(RouteRequest(tokens=[1], strict_priority=tier), 1):
            order.append(name)
            await asyncio.sleep(0)

    holder = admission.slot(RouteRequest(tokens=[1]), 1)
    await holder.__aenter__()
    low = asyncio.ensure_future(one("low"))
    gone = asyncio.ensure_future(one("gone"))
    high = asyncio.ensure_future(one("high", tier=1))
    await eventually(lambda: len(admission.queue) == 3)
    with pytest.raises(QueueRejected):
        await one("over the limit")
    gone.cancel()
    await eventually(lambda: len(admission.queue) == 2)
    await holder.__aexit__(None, None, None)
    await asyncio.gather(low, high)
    assert order == ["high", "low"]  # strict priority first, as in the router's queue
    assert admission.in_flight == 0 and len(admission.queue) == 0


class _Body:
    """Stands for a request's body: what a waiter's frame holds while it waits."""


async def test_waits_that_time_out_behind_a_held_slot_keep_nothing_of_their_requests() -> None:
    """Every slot held by long streams, a stream of requests each waiting out its timeout: none of them
    may stay in memory. The queue kept every timed-out waiter until a slot freed, and each one's
    exception kept its request's frames, body included (a 200 KB prompt a request: 81 → 968 MB)."""
    admission = Admission(
        ProxyConfig(proxy_max_concurrent_requests=1, proxy_max_waiting_requests=64, proxy_queue_timeout_secs=0.001),
        "fcfs",
    )
    bodies: list[weakref.ref[_Body]] = []

    async def one() -> None:
        body = _Body()
        bodies.append(weakref.ref(body))
        async with admission.slot(RouteRequest(tokens=[1]), 1):
            raise AssertionError("no slot is free")

    async def refused(requests: int) -> int:
        outcomes = await asyncio.gather(*(one() for _ in range(requests)), return_exceptions=True)
        return sum(isinstance(outcome, QueueRejected) for outcome in outcomes)

    holder = admission.slot(RouteRequest(tokens=[1]), 1)
    await holder.__aenter__()
    for _ in range(50):
        assert await refused(40) == 40
    await asyncio.sleep(0)  # the loop lets go of the handle that woke us, which holds the last round's answers
    gc.collect()
    assert len(bodies) == 2000 and sum(body() is not None for body in bodies) == 0
    assert len(admission.queue) == 0 and admission.in_flight == 1
    await holder.__aexit__(None, None, None)
    assert admission.in_flight == 0


async def test_every_worker_over_its_busy_threshold_is_a_503_saying_when_to_come_back(
    nats_server: EmbeddedNats,
) -> None:
    """The router's busy thresholds refuse a request while every worker is over them, which passes as
    their load does: the 503 carries a Retry-After, as the other transient refusals do."""
    gate = Gate(refusals=0, hold=asyncio.Event())
    proxy = {"proxy_retry_after_secs": 3, "proxy_health_check_interval_secs": 0}
    async with (
        fleet(nats_server.url, (), router={"active_prefill_tokens_threshold": 1}, proxy=proxy) as f,
        served(gate) as url,
    ):
        await register(f, 7, url)
        first = asyncio.ensure_future(f.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1))
        try:
            await eventually(lambda: len(gate.arrivals) == 1, what="the first request at the worker")
            with pytest.raises(openai.InternalServerError) as busy:
                client = f.client.with_options(max_retries=0)
                await asyncio.wait_for(client.completions.create(model=MODEL, prompt=[4, 5, 6], max_tokens=1), 10)
        finally:
            gate.hold.set()  # type: ignore[union-attr]
            await first
        assert busy.value.response.status_code == 503
        assert busy.value.response.headers.get("retry-after") == "3"


@pytest.mark.parametrize("kv_events", [True, False])
async def test_a_prompt_an_engine_refused_is_not_taken_for_cached_there(
    nats_server: EmbeddedNats, kv_events: bool
) -> None:
    """A 4xx from the engine: it never computed the prompt. The proxy credited it as computed there (with
    KV events, until they came) or kept the prediction made at routing (without), so the same prompt
    next was said cached on a worker holding none of it (x-kv-router-cached-tokens 192 of 200)."""
    gate = Gate(refusals=1, status=400)
    prompt = list(range(1000, 1200))
    async with fleet(nats_server.url, (), proxy={"proxy_health_check_interval_secs": 0}) as f, served(gate) as url:
        worker = WorkerConfig(worker_id=7, block_size=64, url=url, models=frozenset({MODEL}), kv_events=kv_events)
        async with httpx.AsyncClient(base_url=f.url) as http:
            assert (await http.post("/v1/workers", content=msgspec.json.encode(worker))).status_code == 201
        with pytest.raises(openai.BadRequestError):
            await f.client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        again = await f.client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=1)
        assert again.headers["x-kv-router-cached-tokens"] == "0"
        await eventually(lambda: idle(f.router))

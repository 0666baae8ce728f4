"""Retries of the proxy (`api.proxy.retry`): exponential backoff with jitter, an overloaded engine's
429 / 503 and its Retry-After, a worker refusing connections until it comes up, and the bounds in count
and time; with the real `openai` client against the proxy and workers served by uvicorn on loopback."""

from __future__ import annotations

import asyncio
import email.utils
import math
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.config import ProxyConfig
from api.proxy.retry import RetryPolicy, retry_after_secs
from router.event_plane.embedded_server import EmbeddedNats, free_port
from tests.gate_worker import Gate, register, served
from tests.metrics import sample
from tests.proxy_fleet import MODEL, Fleet, fleet, idle
from tests.test_proxy_worker_health import PROMPTS, hold_prompts, worker_status
from tests.waiting import eventually

pytestmark = pytest.mark.anyio


async def retries(f: Fleet, reason: str) -> float | None:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{f.url}/metrics")).text
    return sample(text, "kv_router_proxy_retries_total", reason=reason)


async def test_an_overloaded_engines_retry_after_is_waited_for_then_the_request_goes_through(
    nats_server: EmbeddedNats,
) -> None:
    gate = Gate(refusals=2, status=429, retry_after="1")
    proxy = {"proxy_retries": 3, "proxy_retry_backoff_secs": 0.01}
    async with fleet(nats_server.url, (), proxy=proxy) as f, served(gate) as url:
        await register(f, 7, url)
        completion = await f.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1)
        assert completion.choices[0].text == " fine"
        assert len(gate.arrivals) == 3
        gaps = [later - earlier for earlier, later in zip(gate.arrivals, gate.arrivals[1:], strict=False)]
        assert min(gaps) >= 1.0  # the engine's Retry-After, not the 10 ms backoff
        assert await retries(f, "overloaded") == 2
        assert idle(f.router)


async def test_a_pinned_request_is_retried_on_its_worker_while_another_serves_the_model(
    nats_server: EmbeddedNats,
) -> None:
    """Pinned (``nvext.backend_instance_id``), a request that met its engine's 429 goes to that engine
    again after the backoff, not to the other worker, and not back to the client."""
    busy, other = Gate(refusals=1, status=429, retry_after="0"), Gate(refusals=0)
    proxy = {"proxy_retries": 3, "proxy_retry_backoff_secs": 0.01, "proxy_health_check_interval_secs": 0}
    async with fleet(nats_server.url, (), proxy=proxy) as f, served(busy) as url7, served(other) as url8:
        await register(f, 7, url7)
        await register(f, 8, url8)
        pinned = {"nvext": {"backend_instance_id": 7, "dp_rank": 0}}
        raw = await f.client.completions.with_raw_response.create(
            model=MODEL, prompt=[1, 2, 3], max_tokens=1, extra_body=pinned
        )
        assert raw.parse().choices[0].text == " fine" and raw.headers["x-kv-router-worker"] == "7"
        assert (len(busy.arrivals), len(other.arrivals)) == (2, 0)
        assert await retries(f, "overloaded") == 1
        assert idle(f.router)


@pytest.mark.parametrize(("status", "retry_after"), [(429, "30"), (503, "8")])
async def test_an_engines_retry_after_neither_ends_nor_delays_the_retry_on_another_worker(
    nats_server: EmbeddedNats, status: int, retry_after: str
) -> None:
    """Worker 9, every policy's first choice (it holds the prompts), answers 429 with a Retry-After past
    the 10 s budget, or 503 with Retry-After: 8, while worker 8 is idle: the request goes to worker 8
    after the ordinary backoff. Before, the client got the 429, or waited the 8 s. Worker 9 is then left
    out of routing for its Retry-After (its circuit closed: it paced us, it did not fail), so the next
    request goes to worker 8 at once."""
    busy, free = Gate(refusals=100, status=status, retry_after=retry_after), Gate(refusals=0)
    proxy = {"proxy_health_check_interval_secs": 0}
    async with fleet(nats_server.url, (), proxy=proxy) as f, served(busy) as url9, served(free) as url8:
        await register(f, 9, url9)
        await register(f, 8, url8)
        await hold_prompts(f, 9)
        started = time.monotonic()
        raw = await f.client.completions.with_raw_response.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1)
        assert raw.headers["x-kv-router-worker"] == "8"
        assert time.monotonic() - started < 4.0  # the backoff, not worker 9's Retry-After
        assert len(busy.arrivals) == 1
        availability = (await worker_status(f, 9))["availability"]
        assert availability["routable"] is False and availability["circuit"] == "closed"
        assert 0 < availability["paced_for_secs"] <= 10.0  # worker_breaker_open_secs at most
        raw = await f.client.completions.with_raw_response.create(model=MODEL, prompt=PROMPTS[1], max_tokens=1)
        assert raw.headers["x-kv-router-worker"] == "8" and len(busy.arrivals) == 1
        assert await retries(f, "overloaded") == 1
        assert idle(f.router)


async def test_retries_are_bounded_in_count_and_the_engines_last_answer_goes_to_the_client(
    nats_server: EmbeddedNats,
) -> None:
    gate = Gate(refusals=100, status=503, retry_after="0")
    proxy = {"proxy_retries": 2, "proxy_retry_backoff_secs": 0.01}
    async with fleet(nats_server.url, (), proxy=proxy) as f, served(gate) as url:
        await register(f, 7, url)
        with pytest.raises(openai.InternalServerError) as caught:
            await f.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1)
        assert caught.value.status_code == 503
        assert caught.value.response.json()["error"]["message"] == "engine busy"
        assert caught.value.response.headers["retry-after"] == "0"
        assert len(gate.arrivals) == 3  # the first attempt and proxy_retries more
        assert await retries(f, "overloaded") == 2
        assert idle(f.router)


@pytest.mark.parametrize("retry_after", ["60", "1e400"])  # the second no float holds: it was read as absent
async def test_a_retry_after_beyond_the_time_budget_ends_the_retries_at_once(
    nats_server: EmbeddedNats, retry_after: str
) -> None:
    gate = Gate(refusals=100, status=429, retry_after=retry_after)
    proxy = {"proxy_retries": 5, "proxy_retry_budget_secs": 5.0}
    async with fleet(nats_server.url, (), proxy=proxy) as f, served(gate) as url:
        await register(f, 7, url)
        with pytest.raises(openai.RateLimitError) as caught:
            await f.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1)
        assert caught.value.response.headers["retry-after"] == retry_after
        assert caught.value.response.headers["x-kv-router-worker"] == "7"
        assert len(gate.arrivals) == 1
        assert await retries(f, "overloaded") == 0.0  # exported from the start, never counted
        assert idle(f.router)


async def test_the_retry_budget_runs_from_when_the_body_was_in_not_from_the_first_attempt(
    nats_server: EmbeddedNats,
) -> None:
    """A request that waited 1.5 s for a slot (the concurrency cap) meets an engine's 429 with
    Retry-After: 1: a retry would start 2.5 s after it came in, past the 2 s budget, so the engine's
    answer goes to the client at once. The budget ran from the first attempt, and it was retried."""
    busy, slow = Gate(refusals=100, status=429, retry_after="1"), Gate(refusals=0, hold=asyncio.Event())
    proxy = {"proxy_retries": 3, "proxy_retry_budget_secs": 2.0, "proxy_max_concurrent_requests": 1}
    async with fleet(nats_server.url, (), proxy=proxy) as f, served(busy) as url7, served(slow) as url8:
        await register(f, 7, url7)
        await register(f, 8, url8)

        def pinned(worker_id: int) -> dict[str, object]:
            return {"nvext": {"backend_instance_id": worker_id, "dp_rank": 0}}

        holding = asyncio.ensure_future(
            f.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1, extra_body=pinned(8))
        )
        await eventually(lambda: len(slow.arrivals) == 1, what="the slot held on worker 8")
        assert slow.hold is not None
        asyncio.get_running_loop().call_later(1.5, slow.hold.set)
        with pytest.raises(openai.RateLimitError) as caught:
            await f.client.completions.create(model=MODEL, prompt=[4, 5, 6], max_tokens=1, extra_body=pinned(7))
        assert caught.value.response.headers["retry-after"] == "1"
        assert len(busy.arrivals) == 1
        assert (await holding).choices[0].text == " fine"
        assert idle(f.router)


async def test_a_worker_refusing_connections_is_retried_after_backoffs_until_it_is_up(
    nats_server: EmbeddedNats,
) -> None:
    port = free_port()
    proxy = {
        "proxy_retries": 20,
        "proxy_retry_backoff_secs": 0.05,
        "proxy_retry_backoff_max_secs": 0.2,
        "proxy_health_check_interval_secs": 0,  # the retries alone bring the request through
    }
    async with fleet(nats_server.url, (), proxy=proxy) as f:
        await register(f, 7, f"http://127.0.0.1:{port}")  # nothing listens there yet
        asked = asyncio.ensure_future(f.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1))

        async def retried() -> bool:
            return (await retries(f, "upstream_error") or 0) >= 1

        await eventually(retried, what="a retry after the refused connection")
        assert not asked.done()
        gate = Gate(refusals=0)
        async with served(gate, port):
            completion = await asked
        assert completion.choices[0].text == " fine"
        assert len(gate.arrivals) == 1
        assert idle(f.router)


@given(
    base=st.floats(0.001, 1.0),
    cap=st.floats(0.001, 5.0),
    retry=st.integers(1, 80),
    draw=st.floats(0.0, 1.0),
)
def test_the_backoff_doubles_up_to_its_cap_and_keeps_its_upper_half(
    base: float, cap: float, retry: int, draw: float
) -> None:
    config = ProxyConfig(
        proxy_retries=100, proxy_retry_backoff_secs=base, proxy_retry_backoff_max_secs=cap, proxy_retry_budget_secs=1e9
    )
    policy = RetryPolicy(config, uniform=lambda low, high: low + draw * (high - low))
    ceiling = min(cap, base * 2.0 ** (retry - 1))
    wait = policy.backoff(retry)
    assert ceiling / 2 - 1e-12 <= wait <= ceiling + 1e-12
    assert policy.delay(retry, None, 0.0, 0.0) == pytest.approx(wait)
    assert policy.delay(retry, 1000.0, 0.0, 0.0) == 1000.0  # the engine's Retry-After wins when longer


def test_retries_stop_past_their_count_and_their_time_budget() -> None:
    config = ProxyConfig(
        proxy_retries=2, proxy_retry_backoff_secs=1.0, proxy_retry_backoff_max_secs=1.0, proxy_retry_budget_secs=3.0
    )
    policy = RetryPolicy(config, uniform=lambda low, high: high)
    assert policy.delay(1, None, started=0.0, now=0.0) == 1.0
    assert policy.delay(2, None, started=0.0, now=1.5) == 1.0
    assert policy.delay(3, None, started=0.0, now=0.0) is None  # past proxy_retries
    assert policy.delay(2, None, started=0.0, now=2.5) is None  # would start after the budget
    assert policy.delay(1, 5.0, started=0.0, now=0.0) is None  # Retry-After beyond the budget


@pytest.fixture
def host_zone_off_utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TZ", "Asia/Kolkata")  # UTC+5:30, no daylight saving
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.usefixtures("host_zone_off_utc")
def test_retry_after_is_read_as_seconds_or_an_http_date() -> None:
    assert retry_after_secs(b"3") == 3.0
    assert retry_after_secs(b" 0 ") == 0.0
    assert retry_after_secs(b"-5") == 0.0
    now = 1_700_000_000.0
    assert retry_after_secs(email.utils.formatdate(now + 30, usegmt=True).encode(), now=now) == 30.0
    # asctime's form has no zone: GMT, as every HTTP-date (it was read in the host's zone).
    assert retry_after_secs(time.asctime(time.gmtime(now + 30)).encode(), now=now) == 30.0
    # Past what a float holds: past any retry budget (it was read as absent, retried after the backoff).
    assert retry_after_secs(b"1e400") == retry_after_secs(b"inf") == math.inf
    for unreadable in (None, b"", b"soon", b"nan"):
        assert retry_after_secs(unreadable) is None

"""Workers out of routing and back, through the proxy with the real `openai` client: the circuit breaker
(failures open it, the decision API avoids the worker too, a half-open probe closes it) and the active
health checks (a worker that stops answering ``/health`` leaves routing and comes back by itself), as
``/v1/workers`` and the metrics show them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import httpx
import openai
import pytest

from api.config import ProxyConfig
from api.proxy import health_checks
from api.proxy.health_checks import WorkerHealthChecks
from router.config import RouterConfig
from router.engines.openai_server import HealthProbe
from router.event_plane.connection import NatsOptions, connect
from router.event_plane.embedded_server import EmbeddedNats, free_port
from router.event_plane.publisher import KvEventPublisher
from router.kv_router import KvRouter
from router.types import WorkerConfig
from tests.gate_worker import Gate, register, served
from tests.metrics import sample
from tests.proxy_fleet import MODEL, SSE_HEAD, Fleet, fleet, idle, raw_worker, sse_chunk
from tests.test_api_proxy import stored_event
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

# Prompts only worker 9 holds (worker 1 holds each one it served, so none is used twice).
NO_CHECKS = {"proxy_retry_backoff_secs": 0.01, "proxy_health_check_interval_secs": 0}
PROMPTS = [list(range(start, start + 4 * 64)) for start in range(5000, 9000, 1000)]
DONE = b"data: [DONE]\n\n"


async def worker_status(f: Fleet, worker_id: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=f.url) as http:
        workers = (await http.get("/v1/workers")).json()["workers"]
    return next(w for w in workers if w["config"]["worker_id"] == worker_id)


async def metric(f: Fleet, name: str, **labels: str) -> float | None:
    async with httpx.AsyncClient() as http:
        return sample((await http.get(f"{f.url}/metrics")).text, name, **labels)


async def hold_prompts(f: Fleet, worker_id: int) -> None:
    async with httpx.AsyncClient(base_url=f.url) as http:
        for event_id, prompt in enumerate(PROMPTS, 1):
            event = stored_event(worker_id, prompt)
            event["event"]["event_id"] = event_id
            assert (await http.post("/v1/events", json=event)).json()["applied"] == 1


async def test_failures_open_a_workers_circuit_for_every_caller_and_a_half_open_probe_closes_it(
    nats_server: EmbeddedNats,
) -> None:
    # Open long enough for the checks below on a loaded machine (half-open once it is up is waited for).
    router = {"worker_breaker_failures": 2, "worker_breaker_open_secs": 3.0}
    port = free_port()
    async with fleet(nats_server.url, (1,), router=router, proxy=NO_CHECKS) as f:
        # Worker 9 holds the prompt, so every policy's first choice, but nothing listens at its URL yet.
        await register(f, 9, f"http://127.0.0.1:{port}")
        await hold_prompts(f, 9)
        for prompt in PROMPTS[:2]:
            raw = await f.client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=2)
            assert raw.headers["x-kv-router-worker"] == "1"  # retried on the next best
        status = await worker_status(f, 9)
        assert status["availability"]["circuit"] == "open" and status["availability"]["routable"] is False
        assert status["availability"]["consecutive_failures"] == 2
        assert "ConnectionRefusedError" in status["availability"]["last_failure"]
        assert await metric(f, "kv_router_worker_circuit_state", worker_id="9") == 2.0
        assert await metric(f, "kv_router_worker_circuit_opened_total", worker_id="9") == 1.0
        # The decision API leaves it out as well: the breaker is the router's, not the proxy's.
        async with httpx.AsyncClient(base_url=f.url) as http:
            decision = (await http.post("/v1/new", json={"tokens": PROMPTS[2]})).json()
            assert decision["worker_id"] == 1
            assert (await http.post("/v1/mark_free", json={"request_id": decision["request_id"]})).status_code == 200
        # The worker comes up; once its circuit is half-open, one request probes it and closes it.
        gate = Gate(refusals=0)
        async with served(gate, port):

            async def half_open() -> bool:
                return (await worker_status(f, 9))["availability"]["circuit"] == "half_open"

            await eventually(half_open, what="worker 9's circuit half-open")
            raw = await f.client.completions.with_raw_response.create(model=MODEL, prompt=PROMPTS[3], max_tokens=2)
            assert raw.headers["x-kv-router-worker"] == "9"
            assert len(gate.arrivals) == 1
            status = await worker_status(f, 9)
            assert status["availability"]["circuit"] == "closed" and status["availability"]["routable"] is True
            assert await metric(f, "kv_router_worker_circuit_state", worker_id="9") == 0.0
        assert await metric(f, "kv_router_worker_circuit_state", worker_id="1") == 0.0
        assert idle(f.router)


@pytest.mark.parametrize(
    ("retry_after", "circuit", "arrivals"), [("1", "closed", 1), ("0", "open", 2), (None, "open", 2)]
)
async def test_an_engines_503_saying_when_to_come_back_is_no_failure_and_a_bare_503_is(
    nats_server: EmbeddedNats, retry_after: str | None, circuit: str, arrivals: int
) -> None:
    """An engine answering 503 with Retry-After is overloaded, not broken: like its 429, its circuit is
    not told (it was, and opened), and it is left out of routing that long (the next two requests are
    the proxy's own 503s). A 503 without one, or saying "now" (``Retry-After: 0``: a broken pod behind
    an ingress, which would otherwise stay in routing for good), is still a failure."""
    router = {"worker_breaker_failures": 2, "worker_breaker_open_secs": 30.0}
    gate = Gate(refusals=100, status=503, retry_after=retry_after)
    async with fleet(nats_server.url, (), router=router, proxy={**NO_CHECKS, "proxy_retries": 0}) as f:
        async with served(gate) as url:
            await register(f, 9, url)
            for _ in range(3):
                with pytest.raises(openai.InternalServerError) as caught:
                    await f.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1)
                assert caught.value.status_code == 503
            availability = (await worker_status(f, 9))["availability"]
            assert availability["circuit"] == circuit
            assert len(gate.arrivals) == arrivals  # open: the third never reached it
        assert idle(f.router)


async def test_a_half_open_circuit_closes_at_its_streaming_probes_first_events_not_at_the_streams_end(
    nats_server: EmbeddedNats,
) -> None:
    """A half-open worker's probe is a stream: once its first events are handed on, the circuit closes,
    and other requests reach the worker while it streams on. Before, the circuit stayed half-open for
    the probe stream's whole life (minutes, for a long generation), every other request a 503. While
    the probe has no answer yet, the 503 says Retry-After (it said none)."""
    router = {"worker_breaker_failures": 1, "worker_breaker_open_secs": 3.0}
    answer_probe, end_streams = asyncio.Event(), asyncio.Event()
    arrived = 0

    async def recovering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal arrived
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            await reader.readuntil(b"\r\n\r\n")
            arrived += 1
            if arrived == 1:  # fails: its circuit opens
                writer.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            else:
                if arrived == 2:  # the probe: its answer comes when the test says
                    await asyncio.wait_for(answer_probe.wait(), 20)
                writer.write(SSE_HEAD + sse_chunk(" a"))
                await writer.drain()
                await asyncio.wait_for(end_streams.wait(), 20)
                writer.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(DONE), DONE))
            await writer.drain()
        writer.close()

    async with fleet(nats_server.url, (), router=router, proxy={**NO_CHECKS, "proxy_retries": 0}) as f:
        async with raw_worker(recovering) as url, httpx.AsyncClient(base_url=f.url) as http:
            await register(f, 9, url)
            with pytest.raises(openai.APIStatusError) as failed:
                await f.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1)
            assert failed.value.status_code == 502

            async def circuit_is(state: str) -> bool:
                return (await worker_status(f, 9))["availability"]["circuit"] == state

            await eventually(lambda: circuit_is("half_open"), what="worker 9's circuit half-open")
            probe = asyncio.ensure_future(
                f.client.completions.create(model=MODEL, prompt=[4, 5, 6], max_tokens=4, stream=True)
            )
            await eventually(lambda: arrived == 2, what="the probe at worker 9")
            body = {"model": MODEL, "prompt": [7, 8, 9], "max_tokens": 1}
            refused = await http.post("/v1/completions", json=body)  # the probe's place is taken
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            answer_probe.set()
            probing = await probe
            assert (await probing.__anext__()).choices[0].text == " a"
            assert await circuit_is("closed")  # the probe still streaming
            other = await f.client.completions.with_raw_response.create(
                model=MODEL, prompt=[10, 11, 12], max_tokens=4, stream=True
            )
            assert other.headers["x-kv-router-worker"] == "9"
            end_streams.set()
            for stream in (probing, other.parse()):
                async for _chunk in stream:
                    pass
        assert idle(f.router)


async def test_an_answer_once_an_open_circuits_time_is_up_closes_it_though_no_decision_half_opened_it(
    nats_server: EmbeddedNats,
) -> None:
    """A stream sent before worker 9's circuit opened has its first events once the open time is up, no
    decision having looked at the worker since: that answer is a half-open probe's and closes the
    circuit, as a failure then opens it again. Before, it only reset the count of failures: the worker
    stayed half-open after answering, its next requests probes one at a time."""
    router = {"worker_breaker_failures": 1, "worker_breaker_open_secs": 1.0}
    answer_first, arrived = asyncio.Event(), 0

    async def slow_then_failing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal arrived
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            await reader.readuntil(b"\r\n\r\n")
            arrived += 1
            if arrived == 1:  # answered when the test says
                await asyncio.wait_for(answer_first.wait(), 20)
                writer.write(SSE_HEAD + sse_chunk(" a") + b"%x\r\n%b\r\n0\r\n\r\n" % (len(DONE), DONE))
            else:  # fails: the circuit opens
                writer.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            await writer.drain()
        writer.close()

    async with fleet(nats_server.url, (), router=router, proxy={**NO_CHECKS, "proxy_retries": 0}) as f:
        async with raw_worker(slow_then_failing) as url:
            await register(f, 9, url)
            first = asyncio.ensure_future(
                f.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1, stream=True)
            )
            await eventually(lambda: arrived == 1, what="the first request at worker 9")
            with pytest.raises(openai.APIStatusError) as failed:
                await f.client.completions.create(model=MODEL, prompt=[4, 5, 6], max_tokens=1)
            assert failed.value.status_code == 502
            assert (await worker_status(f, 9))["availability"]["circuit"] == "open"

            async def circuit_is(state: str) -> bool:
                return (await worker_status(f, 9))["availability"]["circuit"] == state

            await eventually(lambda: circuit_is("half_open"), what="worker 9's open time up")
            answer_first.set()
            assert [chunk.choices[0].text async for chunk in await first] == [" a"]
            availability = (await worker_status(f, 9))["availability"]
            assert (availability["circuit"], availability["routable"]) == ("closed", True)
            assert await metric(f, "kv_router_worker_circuit_state", worker_id="9") == 0.0
        assert idle(f.router)


async def test_a_health_check_answered_with_a_head_then_a_trickling_body_fails_at_its_timeout() -> None:
    """httpx's timeout is per read: a ``/health`` answering its head, then its body a byte at a time, was
    waited for to its end and passed. The whole exchange is bounded now."""
    gone, closed = asyncio.Event(), asyncio.Event()

    async def trickling(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                await reader.readuntil(b"\r\n\r\n")
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 40\r\n\r\n")
                for _ in range(40):  # 10 s in all, each byte well within the timeout
                    if gone.is_set():
                        break
                    writer.write(b".")
                    await writer.drain()
                    await asyncio.sleep(0.25)
        finally:
            writer.close()
            closed.set()

    failed: list[str] = []

    async def passing() -> None:
        pass

    async def failing(problem: str) -> None:
        failed.append(problem)

    async with raw_worker(trickling) as url:
        probe = HealthProbe(f"{url}/health", on_up=passing, on_down=failing, timeout_s=1.0)
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=probe.timeout_s) as client:  # as its own loop makes it
            await probe.probe_once(client)
        elapsed = time.monotonic() - started
        gone.set()
        await asyncio.wait_for(closed.wait(), 10)
    assert probe.healthy is False and failed == ["no whole answer within 1 s"]
    assert elapsed < 5.0


async def test_a_worker_that_stops_answering_its_health_checks_leaves_routing_and_comes_back_by_itself(
    nats_server: EmbeddedNats,
) -> None:
    checks = {
        "proxy_health_check_interval_secs": 0.1,
        "proxy_health_check_timeout_secs": 2.0,  # a stopped server refuses at once; a loaded machine is slow
        "proxy_health_check_failures": 2,
        "proxy_health_check_successes": 2,
    }
    port = free_port()
    async with fleet(nats_server.url, (1,), proxy=checks) as f:

        async def check_is(verdict: str) -> bool:
            return (await worker_status(f, 9))["availability"]["health_check"] == verdict

        gate = Gate(refusals=0)
        async with served(gate, port) as url:
            await register(f, 9, url)
            await hold_prompts(f, 9)
            await eventually(lambda: check_is("passing"), what="worker 9 passing its checks")
            raw = await f.client.completions.with_raw_response.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2)
            assert raw.headers["x-kv-router-worker"] == "9"
        # Its server is gone: two failed checks later it is out of routing, before any request failed on it.
        await eventually(lambda: check_is("failing"), what="worker 9 failing its checks")
        status = await worker_status(f, 9)
        assert status["availability"]["routable"] is False and status["availability"]["circuit"] == "closed"
        assert await metric(f, "kv_router_worker_health_check_passing", worker_id="9") == 0.0
        raw = await f.client.completions.with_raw_response.create(model=MODEL, prompt=PROMPTS[1], max_tokens=2)
        assert raw.headers["x-kv-router-worker"] == "1"
        assert await metric(f, "kv_router_proxy_upstream_failures_total") == 0.0  # never tried
        async with httpx.AsyncClient(base_url=f.url) as http:  # out for the decision API too
            decision = (await http.post("/v1/new", json={"tokens": PROMPTS[2]})).json()
            assert decision["worker_id"] == 1
            assert (await http.post("/v1/mark_free", json={"request_id": decision["request_id"]})).status_code == 200
        # It comes back: two passed checks later it is routed to again, with nobody re-registering it.
        back = Gate(refusals=0)
        async with served(back, port):
            await eventually(lambda: check_is("passing"), what="worker 9 passing its checks again")
            assert back.health_checks >= 2
            raw = await f.client.completions.with_raw_response.create(model=MODEL, prompt=PROMPTS[3], max_tokens=2)
            assert raw.headers["x-kv-router-worker"] == "9"
            assert len(back.arrivals) == 1
            assert await metric(f, "kv_router_worker_health_check_passing", worker_id="9") == 1.0
        assert idle(f.router)


async def test_a_worker_failing_its_checks_registered_again_is_out_of_routing_again(nats_server: EmbeddedNats) -> None:
    """Removing a worker forgets its verdict; registered again (same id, same URL) before the checks'
    next look at the registrations, it gets a new probe, whose first verdict is reported."""
    checks = {
        "proxy_health_check_interval_secs": 0.5,
        "proxy_health_check_timeout_secs": 3.0,  # nothing listens at worker 9's URL: refused at once
        "proxy_health_check_failures": 1,
        "proxy_health_check_successes": 1,
    }
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    async with fleet(nats_server.url, (1,), proxy=checks) as f:

        async def check_is(verdict: str) -> bool:
            return (await worker_status(f, 9))["availability"]["health_check"] == verdict

        await register(f, 9, url)
        await eventually(lambda: check_is("failing"), what="worker 9 failing its checks")
        async with httpx.AsyncClient(base_url=f.url) as http:
            assert (await http.delete("/v1/workers/9")).status_code in (200, 204)
        await register(f, 9, url)
        await eventually(lambda: check_is("failing"), what="worker 9 failing its checks again")
        assert (await worker_status(f, 9))["availability"]["routable"] is False


async def test_a_worker_failing_its_checks_registered_again_with_a_lease_is_back_in_routing(
    nats_server: EmbeddedNats,
) -> None:
    """A static worker failing its checks registers again with a heartbeat lease (a bridge took it
    over): it is no longer probed, and was kept out of routing by its last failing verdict until
    removed. A worker the checks no longer probe has no verdict of theirs."""
    checks = {
        "proxy_health_check_interval_secs": 0.2,
        "proxy_health_check_timeout_secs": 3.0,  # nothing listens at worker 9's first URL: refused at once
        "proxy_health_check_failures": 1,
    }
    async with fleet(nats_server.url, (), proxy=checks) as f, served(Gate(refusals=0)) as url:
        await register(f, 9, f"http://127.0.0.1:{free_port()}")
        await eventually(lambda: f.router.health.availability(9).health_check == "failing", what="worker 9 failing")
        nc = await connect(NatsOptions(nats_server.url))
        bridge = KvEventPublisher(nc, WorkerConfig(worker_id=9, block_size=64, url=url, models=frozenset({MODEL})))
        try:
            await bridge.start()
            await eventually(lambda: f.router.health.availability(9).health_check == "unknown", what="no verdict")
            availability = (await worker_status(f, 9))["availability"]
            assert availability["routable"] is True and availability["health_check"] == "unknown"
            async with httpx.AsyncClient(base_url=f.url) as http:  # routed to again (it was a 503)
                decision = (await http.post("/v1/new", json={"tokens": PROMPTS[0]})).json()
                assert decision["worker_id"] == 9
                freed = await http.post("/v1/mark_free", json={"request_id": decision["request_id"]})
                assert freed.status_code == 200
        finally:
            await bridge.stop(deregister=True)
            await nc.close()


async def test_chats_are_tokenized_by_workers_in_routing_only(nats_server: EmbeddedNats) -> None:
    """Without local tokenizer files a chat is tokenized by a worker's /tokenize: never by one out of
    routing (a hung one would hold every other chat for the read timeout)."""
    # The hung worker fails its checks at the timeout; the healthy one must not, on a loaded machine.
    checks = {"proxy_health_check_interval_secs": 0.2, "proxy_health_check_timeout_secs": 3.0,
              "proxy_health_check_failures": 1, "proxy_read_timeout_secs": 5}  # fmt: skip
    asked: list[bytes] = []
    done = asyncio.Event()

    async def hung(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                asked.append((await reader.readuntil(b"\r\n")).strip())
                await done.wait()  # never answers, its health checks included
        finally:
            writer.close()

    async with fleet(nats_server.url, (1,), proxy=checks) as f, raw_worker(hung) as url:
        await register(f, 9, url)
        await eventually(lambda: f.router.health.availability(9).health_check == "failing", what="worker 9 failing")
        for turn in range(4):
            chat = await f.client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"turn {turn}"}], max_tokens=2
            )
            assert chat.choices[0].message.content
        assert [line for line in asked if not line.startswith(b"GET /health")] == []
        assert idle(f.router)
        done.set()


async def test_with_every_worker_out_of_routing_the_answer_is_a_503_saying_when_to_come_back(
    nats_server: EmbeddedNats,
) -> None:
    router = {"worker_breaker_failures": 1, "worker_breaker_open_secs": 30.0}
    proxy = {**NO_CHECKS, "proxy_retries": 0}
    async with fleet(nats_server.url, (), router=router, proxy=proxy) as f:
        await register(f, 9, f"http://127.0.0.1:{free_port()}")  # nothing listens there
        with pytest.raises(openai.APIStatusError) as failed:
            await f.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1)
        assert failed.value.status_code == 502
        with pytest.raises(openai.APIStatusError) as out:
            await f.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1)
        assert out.value.status_code == 503
        assert "out of routing" in out.value.response.json()["error"]["message"]
        assert 1 <= int(out.value.response.headers["retry-after"]) <= 30
        assert idle(f.router)


async def test_failures_of_a_worker_that_left_do_not_keep_it_out_of_routing_when_it_is_back(
    nats_server: EmbeddedNats,
) -> None:
    """Streams still on a worker when it is removed end afterwards, broken: their failures were told to
    a breaker kept under its id, open once they were enough, and the worker registered again was out
    of routing for ``worker_breaker_open_secs``. A worker that left has no breaker to tell."""
    router = {"worker_breaker_failures": 2, "worker_breaker_open_secs": 60.0}
    die = asyncio.Event()

    async def dying(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(SSE_HEAD + sse_chunk(" a"))  # the stream begins ...
            await writer.drain()
            await die.wait()
        writer.close()  # ... and breaks, without [DONE]

    async with fleet(nats_server.url, (), router=router, proxy=NO_CHECKS) as f, raw_worker(dying) as url:
        await register(f, 9, url)
        streams = []
        for prompt in PROMPTS[:2]:
            raw = await f.client.completions.with_raw_response.create(
                model=MODEL, prompt=prompt, max_tokens=4, stream=True
            )
            assert raw.headers["x-kv-router-worker"] == "9"
            streams.append(raw.parse())
        async with httpx.AsyncClient(base_url=f.url) as http:
            assert (await http.delete("/v1/workers/9")).status_code in (200, 204)
        die.set()
        for stream in streams:
            with pytest.raises(openai.APIError, match="failed mid-stream"):
                async for _chunk in stream:
                    pass
        assert await metric(f, "kv_router_proxy_upstream_failures_total") == 2.0
        await register(f, 9, url)
        availability = (await worker_status(f, 9))["availability"]
        assert availability["routable"] is True and availability["circuit"] == "closed"
        assert availability["consecutive_failures"] == 0 and availability["circuit_opened"] == 0
        async with httpx.AsyncClient(base_url=f.url) as http:  # the decision API routes to it (it was a 503)
            decision = (await http.post("/v1/new", json={"tokens": PROMPTS[2]})).json()
            assert decision["worker_id"] == 9
            assert (await http.post("/v1/mark_free", json={"request_id": decision["request_id"]})).status_code == 200
        assert idle(f.router)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://127.0.0.1:99999", "its port is not a number in 1-65535"),
        ("http://:8000", "it has no host"),
        ("http://127.0.0.1:0", "its port is not a number in 1-65535"),
        ("http://a..b:8000", "its host is not a valid name"),
        ("http://127.0.0.1:8000/v1?model=m", "it has a query or fragment"),
        ("http://127.0.0.1:8000/v1/completions", "its path '/v1/completions' goes on past /v1"),
    ],
)
async def test_a_worker_url_the_proxy_cannot_connect_to_is_refused_at_registration(
    nats_server: EmbeddedNats, url: str, problem: str
) -> None:
    """Accepted before, such a URL made every request routed to the worker a 500 (no retry, nothing
    told to its breaker) and its health checks crash."""
    async with fleet(nats_server.url, (1,), proxy=NO_CHECKS) as f, httpx.AsyncClient(base_url=f.url) as http:
        refused = await http.post("/v1/workers", json={"worker_id": 9, "url": url, "models": [MODEL]})
        assert refused.status_code == 422
        assert "url" in refused.text and problem in refused.text
        assert [w["config"]["worker_id"] for w in (await http.get("/v1/workers")).json()["workers"]] == [1]
        completion = await f.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2)
        assert completion.choices[0].text
        assert idle(f.router)


async def test_a_probe_that_cannot_even_ask_is_a_failed_check_and_no_worker_stops_the_others_probes(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error of the HTTP client itself (a port past 65535: an ExceptionGroup, not an httpx error) is
    a failed check, counted, not a crash of the probe; and a worker no probe can be made for is logged
    once while the next workers get theirs."""
    failed: list[str] = []

    async def passing() -> None:
        raise AssertionError("no answer can pass")

    async def failing(problem: str) -> None:
        failed.append(problem)

    probe = HealthProbe("http://127.0.0.1:99999/health", on_up=passing, on_down=failing)
    async with httpx.AsyncClient(timeout=2) as client:
        await probe.probe_once(client)
    assert probe.failures == 1 and probe.healthy is False
    assert len(failed) == 1 and failed[0].startswith("ExceptionGroup")

    router = KvRouter(RouterConfig(block_size=64))
    checks = WorkerHealthChecks(router, ProxyConfig(proxy_health_check_interval_secs=0.1))
    unprobed = health_checks._probe_url

    def probe_url(worker: WorkerConfig) -> str:
        if worker.worker_id == 8:
            raise RuntimeError("no probe for this one")
        return unprobed(worker)

    monkeypatch.setattr(health_checks, "_probe_url", probe_url)
    async with served(Gate(refusals=0)) as url:
        for worker_id in (8, 9):
            router.register_worker(WorkerConfig(worker_id=worker_id, url=url, leased=False))
        try:
            for _ in range(3):
                await checks.sync()
            await eventually(lambda: router.health.availability(9).health_check == "passing", what="worker 9 probed")
        finally:
            await checks.stop()
    assert router.health.availability(8).health_check == "unknown"
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        f"worker 8: no health check can be made for {url!r}"
    ]

"""A worker that leaves routing as gone or unreachable (removed over the API here; its engine's probe, a
lease, a failing health check alike) fails the proxy's exchanges still open with it at once, not at the
read timeout: a request whose client has had nothing yet goes to another worker, a stream already
begun ends with its SSE error event, and a request that was waiting for a connection to the worker
goes elsewhere too. The read timeout here is 30 s: every answer is asserted well within it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from router.event_plane.embedded_server import EmbeddedNats
from router.kv_router import KvRouter
from tests.gate_worker import Gate, register, served
from tests.metrics import sample
from tests.proxy_fleet import MODEL, SSE_HEAD, fleet, idle, raw_worker, sse_chunk
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

READ_TIMEOUT_S = 30.0
PROXY = {"proxy_read_timeout_secs": READ_TIMEOUT_S, "proxy_retry_backoff_secs": 0.01}
# Well under the read timeout, with room for a loaded machine.
PROMPT_ANSWER_S = 5.0


async def remove(url: str, worker_id: int) -> None:
    async with httpx.AsyncClient(base_url=url) as http:
        assert (await http.delete(f"/v1/workers/{worker_id}")).status_code in (200, 204)


async def metric(url: str, name: str, **labels: str) -> float:
    async with httpx.AsyncClient(base_url=url) as http:
        return sample((await http.get("/metrics")).text, name, **labels) or 0.0


def booked_on(router: KvRouter, worker_id: int) -> int:
    return sum(load.active_requests for load in router.rank_loads() if load.worker_id == worker_id)


@contextlib.asynccontextmanager
async def held() -> AsyncIterator[tuple[Gate, str]]:
    """A worker that takes requests and answers none until the test ends."""
    hold = asyncio.Event()
    gate = Gate(refusals=0, hold=hold)
    async with served(gate) as url:
        try:
            yield gate, url
        finally:
            hold.set()  # the server's shutdown waits for the requests it holds


async def test_a_request_on_a_removed_worker_goes_at_once_to_another(nats_server: EmbeddedNats) -> None:
    async with fleet(nats_server.url, (), proxy=PROXY) as f, held() as (nine, nine_url), held() as (ten, ten_url):
        await register(f, 9, nine_url)
        await register(f, 10, ten_url)
        started = time.monotonic()
        sent = asyncio.ensure_future(
            f.client.completions.with_raw_response.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4)
        )
        await eventually(lambda: len(nine.arrivals) + len(ten.arrivals) == 1, what="the request reached a worker")
        (left, silent), (other, answering) = sorted(((9, nine), (10, ten)), key=lambda pair: -len(pair[1].arrivals))
        assert answering.hold is not None
        answering.hold.set()
        await remove(f.url, left)
        raw = await asyncio.wait_for(sent, READ_TIMEOUT_S)
        assert time.monotonic() - started < PROMPT_ANSWER_S
        assert raw.headers["x-kv-router-worker"] == str(other)
        assert raw.parse().choices[0].text == " fine"
        assert len(silent.arrivals) == 1
        assert await metric(f.url, "kv_router_proxy_retries_total", reason="upstream_error") == 1.0
        await eventually(lambda: idle(f.router))


async def test_requests_waiting_for_a_connection_to_a_removed_worker_fail_at_once(nats_server: EmbeddedNats) -> None:
    """One connection per worker: the second request waits for the first's; once the worker leaves, the
    place the first request's connection gives back does not take the second to it (no worker is left
    to try: both are the client's 502 at once)."""
    proxy = {**PROXY, "proxy_connections_per_worker": 1}
    async with fleet(nats_server.url, (), proxy=proxy) as f, held() as (silent, url):
        await register(f, 9, url)
        started = time.monotonic()
        sent = [
            asyncio.ensure_future(f.client.completions.create(model=MODEL, prompt=[i, 2, 3], max_tokens=4))
            for i in (1, 2)
        ]
        await eventually(lambda: booked_on(f.router, 9) == 2, what="both requests booked on worker 9")
        await eventually(lambda: len(silent.arrivals) == 1, what="the first request reached worker 9")
        await remove(f.url, 9)
        for failed in await asyncio.wait_for(asyncio.gather(*sent, return_exceptions=True), READ_TIMEOUT_S):
            assert isinstance(failed, openai.APIStatusError) and failed.status_code == 502
            assert "worker 9: left routing: removed (api)" in str(failed.body)
        assert time.monotonic() - started < PROMPT_ANSWER_S
        assert len(silent.arrivals) == 1  # the second never went to worker 9
        await eventually(lambda: idle(f.router))


async def test_a_stream_on_a_removed_worker_ends_at_once_with_an_error_event(nats_server: EmbeddedNats) -> None:
    first_sent = asyncio.Event()

    async def stalls_after_one_event(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(SSE_HEAD + sse_chunk(" one"))
            await writer.drain()
            first_sent.set()
            await reader.read()  # silent until the proxy closes the connection
        writer.close()

    async with fleet(nats_server.url, (), proxy=PROXY) as f, raw_worker(stalls_after_one_event) as url:
        await register(f, 9, url)
        started = time.monotonic()
        stream = await f.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4, stream=True)
        texts = []
        with pytest.raises(openai.APIError) as failed:
            async for chunk in stream:
                texts.append(chunk.choices[0].text)
                await first_sent.wait()
                await remove(f.url, 9)
        assert time.monotonic() - started < PROMPT_ANSWER_S
        assert texts == [" one"]
        assert "worker 9 failed mid-stream: left routing: removed (api)" in str(failed.value)
        await eventually(lambda: idle(f.router))


async def test_a_prompt_tokenized_by_a_removed_worker_is_tokenized_by_another(nats_server: EmbeddedNats) -> None:
    """No tokenizer files: the workers tokenize text, taking turns; worker 9's /tokenize never answers."""

    asked: list[bytes] = []

    async def never_answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            asked.append((await reader.readuntil(b"\r\n\r\n")).split(b" ")[1])
            await reader.read()  # silent until the proxy closes the connection
        writer.close()

    async with fleet(nats_server.url, (1,), proxy=PROXY) as f, raw_worker(never_answers) as url:
        await register(f, 9, url)
        started = time.monotonic()
        # Two at once: one of them asks worker 9 first, whichever has the turn.
        sent = [
            asyncio.ensure_future(
                f.client.completions.with_raw_response.create(model=MODEL, prompt=f"hello {i}", max_tokens=2)
            )
            for i in (1, 2)
        ]
        await eventually(lambda: b"/tokenize" in asked, what="worker 9 was asked to tokenize")
        await remove(f.url, 9)
        for raw in await asyncio.wait_for(asyncio.gather(*sent), READ_TIMEOUT_S):
            assert raw.headers["x-kv-router-worker"] == "1"
        assert time.monotonic() - started < PROMPT_ANSWER_S
        await eventually(lambda: idle(f.router))

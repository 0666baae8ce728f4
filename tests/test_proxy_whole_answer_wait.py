"""A whole (not streamed) answer comes at its end: a long generation is silent for all of it. Its
silence past ``proxy_read_timeout_secs`` blames the worker only once the worker has left routing
(failing its health checks); while it is in routing the proxy waits, up to
``proxy_request_timeout_secs``, which bounds the wait for a whole answer (or a stream's first
events) trickling in too. A stream's silence still fails at the read timeout, and so does a
disaggregated prefill leg's (its answer comes once its prompt is computed)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httpx
import msgspec
import openai
import pytest

from router.event_plane.embedded_server import EmbeddedNats
from router.types import WorkerConfig
from tests.gate_worker import register
from tests.metrics import sample
from tests.proxy_fleet import MODEL, fleet, idle, raw_worker
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

ANSWER = b'{"choices": [{"index": 0, "text": " late"}], "object": "text_completion"}'
# A sick worker answers its health check at once (503); the generous check timeout keeps a healthy
# one in routing on a loaded machine (a 0.2 s connect timeout failed one in CI).
QUICK = {"proxy_read_timeout_secs": 0.2, "proxy_retry_backoff_secs": 0.01, "proxy_health_check_interval_secs": 0.1,
         "proxy_health_check_timeout_secs": 5.0, "proxy_health_check_failures": 1}  # fmt: skip


class SlowWorker:
    """Answers each completion after ``delay_s`` (a long generation, not streamed); its ``/health``
    passes until ``sick`` is set. Counts the completions it was sent."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.sick = asyncio.Event()
        self.completions = 0
        self._connections: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def listening(self) -> AsyncIterator[str]:
        """Its URL; on exit, connections still waiting to answer are ended."""
        try:
            async with raw_worker(self.serve) as url:
                yield url
        finally:
            for task in self._connections:
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._answer(reader, writer)
        except asyncio.CancelledError:
            pass  # ended by listening(): ending normally keeps asyncio's stream callback from logging it
        finally:
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"GET"):
                    status = b"503 Service Unavailable" if self.sick.is_set() else b"200 OK"
                    writer.write(b"HTTP/1.1 %b\r\ncontent-length: 0\r\n\r\n" % status)
                    await writer.drain()
                    continue
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                self.completions += 1
                await self._complete(writer)

    async def _complete(self, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(self.delay_s)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                     % (len(ANSWER), ANSWER))  # fmt: skip
        await writer.drain()


async def failures(url: str) -> float | None:
    async with httpx.AsyncClient(base_url=url) as http:
        return sample((await http.get("/metrics")).text, "kv_router_proxy_upstream_failures_total")


async def test_a_silent_whole_answer_is_waited_for_while_its_worker_is_in_routing(nats_server: EmbeddedNats) -> None:
    worker = SlowWorker(delay_s=1.0)  # five read timeouts of silence
    async with fleet(nats_server.url, (), proxy=QUICK) as f, worker.listening() as url:
        await register(f, 9, url)
        answer = await f.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1000)
        assert answer.choices[0].text == " late"
        assert worker.completions == 1  # not retried
        assert f.router.health.availability(9).consecutive_failures == 0  # nor blamed
        assert not await failures(f.url)
        await eventually(lambda: idle(f.router))


async def test_a_whole_answer_is_waited_for_no_longer_than_the_request_timeout(nats_server: EmbeddedNats) -> None:
    worker = SlowWorker(delay_s=5.0)
    proxy = {**QUICK, "proxy_request_timeout_secs": 0.6, "proxy_retries": 0}
    async with fleet(nats_server.url, (), proxy=proxy) as f, worker.listening() as url:
        await register(f, 9, url)
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as failed:
            await f.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1000)
        assert time.monotonic() - started < 4.0
        assert failed.value.status_code == 502
        assert "no answer within 0.6 s (proxy_request_timeout_secs)" in str(failed.value.body)
        await eventually(lambda: idle(f.router))


async def test_a_silent_worker_that_leaves_routing_fails_its_whole_answer(nats_server: EmbeddedNats) -> None:
    worker = SlowWorker(delay_s=8.0)
    proxy = {**QUICK, "proxy_retries": 0}
    async with fleet(nats_server.url, (), proxy=proxy) as f, worker.listening() as url:
        await register(f, 9, url)
        started = time.monotonic()
        sent = asyncio.ensure_future(f.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1000))
        await eventually(lambda: worker.completions == 1, what="the completion reached the worker")
        worker.sick.set()  # its health checks fail from now: it leaves routing
        with pytest.raises(openai.APIStatusError) as failed:
            await sent
        assert time.monotonic() - started < 4.0
        assert failed.value.status_code == 502
        # Failed as it left routing (its health check failing), not at its next read timeout.
        assert "worker 9: left routing: its health checks fail" in str(failed.value.body)
        await eventually(lambda: idle(f.router))


async def test_a_silent_stream_still_fails_at_the_read_timeout(nats_server: EmbeddedNats) -> None:
    worker = SlowWorker(delay_s=8.0)  # sends no head at all: a stream that never begins
    proxy = {**QUICK, "proxy_retries": 0}
    async with fleet(nats_server.url, (), proxy=proxy) as f, worker.listening() as url:
        await register(f, 9, url)
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as failed:
            await f.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1000, stream=True)
        assert time.monotonic() - started < 4.0
        assert failed.value.status_code == 502
        assert "read timeout" in str(failed.value.body)


async def test_a_prefill_leg_silent_past_the_read_timeout_is_a_failure_of_its_worker(nats_server: EmbeddedNats) -> None:
    """Unlike a whole answer to the client, a disaggregated prefill leg answers once its prompt is
    computed: silent past the read timeout, its engine is stuck (its HTTP server still passing the
    health checks), and the request is prefilled elsewhere, here on its decode worker (no retry left).
    Waited for while the worker stayed in routing, a stuck engine held requests for
    proxy_request_timeout_secs (30 min)."""
    worker = SlowWorker(delay_s=10.0)
    async with (
        fleet(nats_server.url, (2,), roles={2: "decode"}, proxy={**QUICK, "proxy_retries": 0}) as f,
        worker.listening() as url,
    ):
        prefill = WorkerConfig(worker_id=9, url=url, models=frozenset({MODEL}), role="prefill",
                               handoff="sequential", kv_events=False, block_size=64)  # fmt: skip
        async with httpx.AsyncClient(base_url=f.url) as http:
            assert (await http.post("/v1/workers", content=msgspec.json.encode(prefill))).status_code == 201
        started = time.monotonic()
        raw = await f.client.completions.with_raw_response.create(model=MODEL, prompt=list(range(1000, 1512)),
                                                                  max_tokens=4)  # fmt: skip
        assert time.monotonic() - started < 5.0  # not the prefill leg's 10 s
        assert raw.headers["x-kv-router-worker"] == "2"
        assert raw.headers["x-kv-router-disaggregation"] == "local_prefill"
        assert raw.parse().choices[0].text
        assert f.router.health.availability(9).consecutive_failures == 1
        await eventually(lambda: idle(f.router))


class TricklingWorker(SlowWorker):
    """Answers each completion's head at once, then a byte every ``delay_s`` for 50 of them (never
    silent for a read timeout), then the rest: a whole answer's leading spaces, or a stream's first
    event a byte at a time."""

    def __init__(self, stream: bool) -> None:
        super().__init__(delay_s=0.1)
        self.stream = stream

    async def _complete(self, writer: asyncio.StreamWriter) -> None:
        content_type, trickled, rest = (
            (b"text/event-stream", b"data: " + b"x" * 44, b"\n\n") if self.stream
            else (b"application/json", b" " * 50, ANSWER)
        )  # fmt: skip
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: %b\r\ntransfer-encoding: chunked\r\n\r\n" % content_type)
        for byte in trickled:
            writer.write(b"1\r\n%c\r\n" % byte)
            await writer.drain()
            await asyncio.sleep(self.delay_s)
        writer.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(rest), rest))
        await writer.drain()


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_trickling_in_is_waited_for_no_longer_than_the_request_timeout(
    nats_server: EmbeddedNats, stream: bool
) -> None:
    """The request timeout bounds the wait for a whole answer's end (a stream's first events) however
    the worker sends it: never silent for a read timeout, a worker sending a byte at a time was
    waited for as long as it liked, holding the request and its booking."""
    proxy = {**QUICK, "proxy_request_timeout_secs": 0.8, "proxy_retries": 0}
    worker = TricklingWorker(stream)
    async with fleet(nats_server.url, (), proxy=proxy) as f, worker.listening() as url:
        await register(f, 9, url)
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as failed:
            await f.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1000, stream=stream)
        assert time.monotonic() - started < 3.0
        assert failed.value.status_code == 502
        assert "no answer within 0.8 s (proxy_request_timeout_secs)" in str(failed.value.body)
        assert worker.completions == 1
        await eventually(lambda: idle(f.router))

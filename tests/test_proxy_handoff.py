"""The proxy's hand-off on a disaggregated fleet (`api.proxy.handoff`), in both styles, with the real
`openai` client, a real nats-server and mock workers serving both roles over their OpenAI API:
both legs run and the decode worker's stream reaches the client; a short uncached prompt stays on
the decode worker; a failing prefill leg goes to another prefill worker; a decode leg failing before
its first token frees the prefill leg's booking; a client leaving cancels both legs. Every booking is
released in every case."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import msgspec
import openai
import pytest

from mocker.config import EngineConfig
from router.disaggregation import prefill_booking_id
from router.event_plane.embedded_server import EmbeddedNats
from router.types import HandoffStyle, RouteRequest, WorkerConfig
from tests.metrics import sample
from tests.proxy_fleet import MODEL, Fleet, fleet, idle, raw_worker
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

STYLES: list[HandoffStyle] = ["kv_transfer_params", "bootstrap"]
# 512 tokens: 8 blocks of 64, well over the 256-token local-prefill threshold.
LONG = list(range(1000, 1512))


async def scrape(url: str) -> str:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"{url}/metrics")).text


async def register(f: Fleet, worker: WorkerConfig) -> None:
    async with httpx.AsyncClient() as http:
        answer = await http.post(f"{f.url}/v1/workers", content=msgspec.json.encode(worker))
        assert answer.status_code in (200, 201), answer.text


# What a scripted worker answers a request (its head and body): status, header lines, body.
Answer = Callable[[bytes, bytes], Awaitable[tuple[bytes, bytes, bytes]]]
ENGINE_FAILURE = b'{"error": {"message": "engine failure"}}'


@contextlib.asynccontextmanager
async def scripted_worker(answer: Answer) -> AsyncIterator[tuple[str, list[bytes]]]:
    """A worker answering each request as ``answer`` says, after reading it; yields its URL and the
    request lines (the proxy's health checks left out: one may come at any time on a slow machine)."""
    seen: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while head := await reader.readuntil(b"\r\n\r\n"):
                line = head.split(b"\r\n", 1)[0]
                if not line.startswith(b"GET /health "):
                    seen.append(line)
                lines = head.lower().split(b"\r\n")
                length = next((int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length")), 0)
                status, headers, body = await answer(head, await reader.readexactly(length))
                writer.write(b"HTTP/1.1 %b\r\ncontent-type: application/json\r\n%b" % (status, headers) +
                             b"content-length: %d\r\n\r\n%b" % (len(body), body))  # fmt: skip
                await writer.drain()
        writer.close()

    async with raw_worker(serve) as url:
        yield url, seen


@contextlib.asynccontextmanager
async def failing_worker(
    status: bytes = b"500 Internal Server Error", headers: bytes = b"", bodies: list[bytes] | None = None
) -> AsyncIterator[tuple[str, list[bytes]]]:
    """A worker answering every request ``status`` (and header lines ``headers``); yields its URL and the
    request lines (their bodies into ``bodies``, when given)."""

    async def answer(head: bytes, body: bytes) -> tuple[bytes, bytes, bytes]:
        if bodies is not None:
            bodies.append(body)
        return status, headers, ENGINE_FAILURE

    async with scripted_worker(answer) as worker:
        yield worker


def prefill_worker_at(url: str, style: HandoffStyle) -> WorkerConfig:
    """Worker 9, a prefill worker at ``url`` (a `failing_worker`): no KV events, its bootstrap port its
    HTTP port in bootstrap style."""
    port = int(url.rsplit(":", 1)[1])
    return WorkerConfig(
        worker_id=9, url=url, models=frozenset({MODEL}), role="prefill", handoff=style, leased=False,
        kv_events=False, block_size=64, bootstrap_port=port if style == "bootstrap" else None,
    )  # fmt: skip


def cached_blocks(f: Fleet, worker_id: int) -> int:
    """The blocks the router's index holds for the worker, from its KV events."""
    return sum(blocks for (worker, _), blocks in f.router.tree.stats().blocks.items() if worker == worker_id)


def ballast(f: Fleet, request_id: str, **pins: tuple[int, int]) -> Callable[[], Awaitable[object]]:
    """Book a long prompt's load on a pinned worker, so the router prefers the others."""
    request = RouteRequest(tokens=list(range(50_000, 50_000 + 4096)), request_id=request_id)
    return lambda: f.router.new(request, **pins)  # type: ignore[arg-type]


@pytest.mark.parametrize("fast_protocol", [True, False])
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("style", STYLES)
async def test_a_long_prompt_is_prefilled_remotely_and_its_stream_comes_from_the_decode_worker(
    nats_server: EmbeddedNats, style: HandoffStyle, stream: bool, fast_protocol: bool
) -> None:
    """Over both adapters of the proxy's routes: the HTTP protocol and their FastAPI routes."""
    service = {"fast_protocol": fast_protocol}
    async with fleet(nats_server.url, (1, 2), roles={1: "prefill", 2: "decode"}, handoff=style, service=service) as f:
        usage: Any = {"include_usage": True} if stream else None
        raw = await f.client.completions.with_raw_response.create(
            model=MODEL, prompt=LONG, max_tokens=6, stream=stream, stream_options=usage
        )
        if stream:
            chunks = [chunk async for chunk in raw.parse()]  # type: ignore[union-attr]
            text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
        else:
            text = raw.parse().choices[0].text  # type: ignore[union-attr]
        assert text == " w1 w2 w3 w4 w5 w6"
        assert raw.headers["x-kv-router-worker"] == "2"
        assert raw.headers["x-kv-router-disaggregation"] == "remote_prefill"
        assert raw.headers["x-kv-router-prefill-worker"] == "1"
        # The prefill worker ran one leg of one token; the decode worker pulled all 8 blocks of KV.
        assert f.apis[1].prefill_legs == 1
        assert f.apis[2].pulled_blocks == 8
        assert f.apis[1].aborted == f.apis[2].aborted == 0
        await eventually(lambda: idle(f.router))

        async def counted() -> bool:
            metrics = await scrape(f.url)
            done = sample(metrics, "kv_router_proxy_requests_total", route="completions", outcome="ok")
            return done == 1.0 and sample(metrics, "kv_router_proxy_handoffs_total", style=style, outcome="ok") == 1.0

        await eventually(counted)  # counted once the decode leg's task is back, just after the client's end
        # Each role published its own KV events: the same prompt is now cached on the decode worker,
        # so it stays there (conditional disaggregation), and nothing more goes to the prefill worker.
        await eventually(lambda: cached_blocks(f, 1) >= 8 and cached_blocks(f, 2) >= 8)
        again = await f.client.completions.with_raw_response.create(model=MODEL, prompt=LONG, max_tokens=2)
        assert again.headers["x-kv-router-disaggregation"] == "local_prefill"
        assert "x-kv-router-prefill-worker" not in again.headers
        assert again.parse().choices[0].text == " w1 w2"
        assert f.apis[1].prefill_legs == 1
        assert idle(f.router)


async def test_a_short_prompt_runs_on_the_decode_worker_alone(nats_server: EmbeddedNats) -> None:
    async with fleet(nats_server.url, (1, 2), roles={1: "prefill", 2: "decode"}) as f:
        raw = await f.client.completions.with_raw_response.create(model=MODEL, prompt=LONG[:100], max_tokens=3)
        assert raw.parse().choices[0].text == " w1 w2 w3"
        assert raw.headers["x-kv-router-worker"] == "2"
        assert raw.headers["x-kv-router-disaggregation"] == "local_prefill"
        assert f.apis[1].prefill_legs == 0 and f.apis[2].pulled_blocks == 0
        assert idle(f.router)


async def test_workers_of_role_both_hand_a_long_prompt_over_to_each_other(nats_server: EmbeddedNats) -> None:
    """``disagg_among_both_workers`` on two workers of role both (vLLM's NIXL connector with kv_role
    kv_both serves either leg): one prefills the long prompt, the other pulls its KV and streams."""
    router = {"disagg_among_both_workers": True}
    async with fleet(nats_server.url, (1, 2), router=router) as f:
        raw = await f.client.completions.with_raw_response.create(model=MODEL, prompt=LONG, max_tokens=4)
        assert raw.parse().choices[0].text == " w1 w2 w3 w4"
        assert raw.headers["x-kv-router-disaggregation"] == "remote_prefill"
        decode, prefill = int(raw.headers["x-kv-router-worker"]), int(raw.headers["x-kv-router-prefill-worker"])
        assert {decode, prefill} == {1, 2}
        assert (f.apis[prefill].prefill_legs, f.apis[decode].pulled_blocks) == (1, 8)
        assert f.apis[decode].prefill_legs == 0
        await eventually(lambda: idle(f.router))
        # Now cached on the decode worker too: its repeat stays there, prefilled from its own cache.
        await eventually(lambda: cached_blocks(f, decode) >= 8)
        again = await f.client.completions.with_raw_response.create(model=MODEL, prompt=LONG, max_tokens=2)
        assert again.headers["x-kv-router-disaggregation"] == "local_prefill"
        assert f.apis[prefill].prefill_legs == 1 and idle(f.router)


async def test_among_both_workers_a_failing_prefill_leg_leaves_the_request_to_its_decode_worker(
    nats_server: EmbeddedNats,
) -> None:
    """Worker 9 (role both, answering 500) is the only other worker to prefill on: its leg fails, and
    the request, booked again without it, is prefilled and answered by its decode worker alone: with one
    worker left it is routed as one leg (no disaggregation header)."""
    async with (
        fleet(nats_server.url, (1,), router={"disagg_among_both_workers": True}) as f,
        failing_worker() as (url, seen),
    ):
        await register(f, msgspec.structs.replace(prefill_worker_at(url, "kv_transfer_params"), role="both"))
        # Load on worker 9, so that the decode leg goes to worker 1 and the prefill leg to 9.
        await ballast(f, "ballast", pinned_worker=(9, 0), pinned_prefill=(9, 0))()
        raw = await f.client.completions.with_raw_response.create(model=MODEL, prompt=LONG, max_tokens=4)
        assert raw.parse().choices[0].text == " w1 w2 w3 w4"
        assert [line for line in seen if line.startswith(b"POST")] == [b"POST /v1/completions HTTP/1.1"]
        assert raw.headers["x-kv-router-worker"] == "1"
        assert "x-kv-router-disaggregation" not in raw.headers
        assert f.apis[1].prefill_legs == 0 and f.apis[1].pulled_blocks == 0
        metrics = await scrape(f.url)
        style = "kv_transfer_params"
        assert sample(metrics, "kv_router_proxy_handoffs_total", style=style, outcome="prefill_failed") == 1.0
        f.router.mark_free("ballast")
        assert idle(f.router)


@pytest.mark.parametrize("style", STYLES)
async def test_a_failing_prefill_leg_is_retried_on_another_prefill_worker(
    nats_server: EmbeddedNats, style: HandoffStyle
) -> None:
    async with (
        fleet(nats_server.url, (1, 2), roles={1: "prefill", 2: "decode"}, handoff=style) as f,
        failing_worker() as (url, seen),
    ):
        await register(f, prefill_worker_at(url, style))
        # Prefill load on worker 1, so that the router's first choice is the failing worker 9.
        await ballast(f, "ballast", pinned_prefill=(1, 0))()
        assert f.router.booking(prefill_booking_id("ballast")) is not None
        raw = await f.client.completions.with_raw_response.create(model=MODEL, prompt=LONG, max_tokens=4, stream=True)
        text = "".join([chunk.choices[0].text async for chunk in raw.parse()])
        assert text == " w1 w2 w3 w4"
        # One prefill leg went to worker 9 (in bootstrap style its decode leg asked it for the room too).
        assert [line for line in seen if line.startswith(b"POST")] == [b"POST /v1/completions HTTP/1.1"]
        assert raw.headers["x-kv-router-prefill-worker"] == "1"
        assert f.apis[1].prefill_legs == 1
        metrics = await scrape(f.url)
        assert sample(metrics, "kv_router_proxy_handoffs_total", style=style, outcome="prefill_failed") == 1.0
        assert sample(metrics, "kv_router_proxy_handoffs_total", style=style, outcome="ok") == 1.0
        if style == "bootstrap":  # the decode leg sent with the failed one was given up (connection closed)
            await eventually(lambda: f.apis[2].aborted == 1)
        f.router.mark_free("ballast")
        assert idle(f.router)


@pytest.mark.parametrize("style", [*STYLES, "sequential"])
async def test_a_prefill_worker_that_never_answers_is_left_for_another_within_the_read_timeout(
    nats_server: EmbeddedNats, style: HandoffStyle
) -> None:
    """A prefill engine stuck behind an HTTP server that still takes requests: its leg is silent past the
    read timeout, and the request goes to another prefill worker, the stuck one blamed. Its leg was
    waited for up to proxy_request_timeout_secs (30 min); in bootstrap style the decode leg, waiting for
    the KV, was blamed instead, each attempt went back to the stuck worker, and the decode workers'
    circuits opened one by one."""
    stuck = asyncio.Event()

    async def answer(head: bytes, body: bytes) -> tuple[bytes, bytes, bytes]:
        await stuck.wait()
        return b"500 Internal Server Error", b"", ENGINE_FAILURE

    proxy = {"proxy_read_timeout_secs": 1.0, "proxy_health_check_interval_secs": 0}
    async with (
        fleet(nats_server.url, (1, 2), roles={1: "prefill", 2: "decode"}, handoff=style, proxy=proxy) as f,
        scripted_worker(answer) as (url, _),
    ):
        await register(f, prefill_worker_at(url, style))
        await ballast(f, "ballast", pinned_prefill=(1, 0))()  # the router's first choice: the stuck worker 9
        try:
            create = f.client.completions.with_raw_response.create(model=MODEL, prompt=LONG, max_tokens=4, stream=True)
            raw = await asyncio.wait_for(create, 20)
            text = "".join([chunk.choices[0].text async for chunk in raw.parse()])
        finally:
            stuck.set()
        assert text == " w1 w2 w3 w4"
        assert raw.headers["x-kv-router-prefill-worker"] == "1"
        metrics = await scrape(f.url)
        assert sample(metrics, "kv_router_proxy_handoffs_total", style=style, outcome="prefill_failed") == 1.0
        assert f.router.health.availability(9).consecutive_failures == 1
        assert f.router.health.availability(2).consecutive_failures == 0  # waiting on KV is no fault of its own
        f.router.mark_free("ballast")
        await eventually(lambda: idle(f.router))


async def test_a_decode_leg_refusing_the_request_says_nothing_of_its_bootstrap_prefill_worker(
    nats_server: EmbeddedNats,
) -> None:
    """Both legs at once: the decode worker refuses the body (a 4xx) before the prefill leg answers. The
    prefill worker did nothing to be credited for: it was told it answered, which reset its count of
    failures (and would close a half-open circuit on a leg that never answered)."""
    stuck = asyncio.Event()

    async def prefill(head: bytes, body: bytes) -> tuple[bytes, bytes, bytes]:
        await stuck.wait()
        return b"500 Internal Server Error", b"", ENGINE_FAILURE

    async def decode(head: bytes, body: bytes) -> tuple[bytes, bytes, bytes]:
        return b"400 Bad Request", b"", b'{"error": {"message": "refused"}}'

    async with (
        fleet(nats_server.url, (), handoff="bootstrap") as f,
        scripted_worker(prefill) as (prefill_url, _),
        scripted_worker(decode) as (decode_url, _),
    ):
        await register(f, prefill_worker_at(prefill_url, "bootstrap"))
        decoder = WorkerConfig(worker_id=2, url=decode_url, models=frozenset({MODEL}), role="decode",
                               handoff="bootstrap", leased=False, kv_events=False, block_size=64)  # fmt: skip
        await register(f, decoder)
        f.router.health.failed(9, "an earlier failure")
        try:
            with pytest.raises(openai.BadRequestError):
                await f.client.completions.create(model=MODEL, prompt=LONG, max_tokens=2)
        finally:
            stuck.set()
        assert f.router.health.availability(9).consecutive_failures == 1
        await eventually(lambda: idle(f.router))


@pytest.mark.parametrize("style", STYLES)
async def test_prefill_workers_all_failing_beyond_the_retries_leave_the_request_to_its_decode_worker(
    nats_server: EmbeddedNats, style: HandoffStyle
) -> None:
    """Three prefill workers answering 500, two retries: each prefill leg fails once, then, no retry
    left, the request goes once more to its healthy decode worker alone, as a decision with no prefill
    worker left would send it, instead of a 502."""
    proxy = {"proxy_retries": 2, "proxy_retry_backoff_secs": 0.01}
    async with contextlib.AsyncExitStack() as stack:
        f = await stack.enter_async_context(
            fleet(nats_server.url, (2,), roles={2: "decode"}, handoff=style, proxy=proxy)
        )
        seen_by_worker = {}
        for worker_id in (7, 8, 9):
            url, seen = await stack.enter_async_context(failing_worker())
            await register(f, msgspec.structs.replace(prefill_worker_at(url, style), worker_id=worker_id))
            seen_by_worker[worker_id] = seen
        raw = await f.client.completions.with_raw_response.create(model=MODEL, prompt=LONG, max_tokens=3, stream=True)
        text = "".join([chunk.choices[0].text async for chunk in raw.parse()])
        assert text == " w1 w2 w3"
        assert raw.headers["x-kv-router-worker"] == "2"
        assert raw.headers["x-kv-router-disaggregation"] == "local_prefill"
        assert "x-kv-router-prefill-worker" not in raw.headers
        for seen in seen_by_worker.values():
            assert [line for line in seen if line.startswith(b"POST")] == [b"POST /v1/completions HTTP/1.1"]
        assert f.apis[2].pulled_blocks == 0  # prefilled there, no KV handed over
        metrics = await scrape(f.url)
        assert sample(metrics, "kv_router_proxy_handoffs_total", style=style, outcome="prefill_failed") == 3.0
        assert sample(metrics, "kv_router_proxy_requests_total", route="completions", outcome="ok") == 1.0
        # The two retries and the last attempt on the decode worker alone: a retry too.
        assert sample(metrics, "kv_router_proxy_retries_total", reason="upstream_error") == 3.0
        await eventually(lambda: idle(f.router))


async def test_prefill_legs_failing_past_the_retry_budget_leave_no_last_attempt_to_the_decode_worker(
    nats_server: EmbeddedNats,
) -> None:
    """A prefill leg failing after proxy_retry_budget_secs: the request does not go once more to its decode
    worker alone (a retry, which may not start past the budget): the client has the 502 of its failure."""

    async def failing_late(head: bytes, body: bytes) -> tuple[bytes, bytes, bytes]:
        await asyncio.sleep(0.5)
        return b"500 Internal Server Error", b"", ENGINE_FAILURE

    proxy = {"proxy_retries": 0, "proxy_retry_budget_secs": 0.2}
    async with (
        fleet(nats_server.url, (2,), roles={2: "decode"}, proxy=proxy) as f,
        scripted_worker(failing_late) as (url, seen),
    ):
        await register(f, prefill_worker_at(url, "kv_transfer_params"))
        with pytest.raises(openai.APIStatusError) as refused:
            await f.client.completions.create(model=MODEL, prompt=LONG, max_tokens=2)
        assert refused.value.status_code == 502 and "prefill worker 9: HTTP 500" in str(refused.value)
        assert seen == [b"POST /v1/completions HTTP/1.1"]
        assert f.apis[2].generated == 0  # nothing sent to the decode worker
        metrics = await scrape(f.url)
        assert sample(metrics, "kv_router_proxy_retries_total", reason="upstream_error") == 0
        assert sample(metrics, "kv_router_proxy_requests_total", route="completions", outcome="upstream_error") == 1
        await eventually(lambda: idle(f.router))


@contextlib.asynccontextmanager
async def behind_a_prefill_worker_answering(
    nats_url: str, params: dict[str, Any]
) -> AsyncIterator[tuple[Fleet, list[bytes]]]:
    """A prefill worker (9) whose answers carry ``params`` as their ``kv_transfer_params``, tried first
    (worker 1, the other prefill worker, holds a ballast's prefill), beside decode worker 2; and the
    request lines worker 9 saw."""

    async def answer(head: bytes, body: bytes) -> tuple[bytes, bytes, bytes]:
        answer = {"object": "text_completion", "choices": [{"index": 0, "text": " p"}], "kv_transfer_params": params}
        return b"200 OK", b"", msgspec.json.encode(answer)

    async with (
        fleet(nats_url, (1, 2), roles={1: "prefill", 2: "decode"}) as f,
        scripted_worker(answer) as (url, seen),
    ):
        await register(f, prefill_worker_at(url, "kv_transfer_params"))
        await ballast(f, "ballast", pinned_prefill=(1, 0))()
        yield f, seen


@pytest.mark.parametrize(
    "params",
    [{}, {"do_remote_prefill": True, "remote_engine_id": "stub"}, {"do_remote_prefill": True, "remote_block_ids": [0]}],
    ids=["empty", "no block ids", "no engine host port"],
)
async def test_a_prefill_leg_answering_params_no_decode_leg_can_pull_with_is_retried_elsewhere_and_blamed(
    nats_server: EmbeddedNats, params: dict[str, Any]
) -> None:
    """vLLM's NixlConnector on the decode side needs the blocks and where they are: given less, it
    prefills the prompt itself unannounced (the client told remote_prefill) or refuses the request. Such
    a prefill leg failed: its worker is told, and the leg goes to the other prefill worker."""
    async with behind_a_prefill_worker_answering(nats_server.url, params) as (f, seen):
        raw = await f.client.completions.with_raw_response.create(model=MODEL, prompt=LONG, max_tokens=3)
        assert raw.parse().choices[0].text == " w1 w2 w3"
        assert seen == [b"POST /v1/completions HTTP/1.1"]
        assert raw.headers["x-kv-router-disaggregation"] == "remote_prefill"
        assert raw.headers["x-kv-router-prefill-worker"] == "1"
        assert f.apis[1].prefill_legs == 1 and f.apis[2].pulled_blocks == 8 and f.apis[2].generated == 1
        assert f.router.health.availability(9).consecutive_failures == 1
        metrics = await scrape(f.url)
        style = "kv_transfer_params"
        assert sample(metrics, "kv_router_proxy_handoffs_total", style=style, outcome="prefill_failed") == 1.0
        assert sample(metrics, "kv_router_proxy_handoffs_total", style=style, outcome="ok") == 1.0
        f.router.mark_free("ballast")
        await eventually(lambda: idle(f.router))


async def test_a_prefill_leg_naming_no_blocks_for_a_prompt_shorter_than_one_is_handed_on(
    nats_server: EmbeddedNats,
) -> None:
    """vLLM's connectors before "send every block" answer a prompt shorter than a block with
    ``remote_block_ids: []`` (the decode side computes those tokens): a hand-off, not a failure of the
    prefill worker (it was, so five short prompts opened every prefill worker's circuit)."""
    params = {"do_remote_prefill": True, "remote_block_ids": [], "remote_engine_id": "stub",
              "remote_host": "127.0.0.1", "remote_port": 5600}  # fmt: skip
    async with behind_a_prefill_worker_answering(nats_server.url, params) as (f, seen):
        raw = await f.client.completions.with_raw_response.create(model=MODEL, prompt=LONG, max_tokens=3)
        assert raw.headers["x-kv-router-disaggregation"] == "remote_prefill"
        assert raw.headers["x-kv-router-prefill-worker"] == "9"
        assert seen == [b"POST /v1/completions HTTP/1.1"] and f.apis[1].prefill_legs == 0
        assert f.router.health.availability(9).consecutive_failures == 0
        metrics = await scrape(f.url)
        failed = sample(metrics, "kv_router_proxy_handoffs_total", style="kv_transfer_params", outcome="prefill_failed")
        assert failed is None
        f.router.mark_free("ballast")
        await eventually(lambda: idle(f.router))


async def cached_tokens(f: Fleet, tokens: list[int]) -> dict[int, int]:
    """What the router believes each worker holds of ``tokens`` (``POST /v1/overlap``)."""
    async with httpx.AsyncClient() as http:
        answer = await http.post(f"{f.url}/v1/overlap", json={"tokens": tokens})
    return {worker["worker_id"]: worker["cached_tokens"] for worker in answer.json()["workers"]}


@pytest.mark.parametrize("style", STYLES)
async def test_without_kv_events_a_failed_prefill_leg_predicts_nothing_and_the_retry_prefills_remotely(
    nats_server: EmbeddedNats, style: HandoffStyle
) -> None:
    """Approximate mode (no worker sends KV events): the prompt is predicted cached where it is routed.
    A prefill leg failing computed it on neither worker, so the retry sees the decode worker still
    uncached and prefills on the healthy prefill worker, and the failed worker is credited nothing."""
    async with (
        fleet(nats_server.url, (1, 2), roles={1: "prefill", 2: "decode"}, handoff=style, kv_events=False) as f,
        failing_worker() as (url, seen),
    ):
        await register(f, prefill_worker_at(url, style))
        await ballast(f, "ballast", pinned_prefill=(1, 0))()  # prefill load on worker 1: worker 9 comes first
        raw = await f.client.completions.with_raw_response.create(model=MODEL, prompt=LONG, max_tokens=3)
        assert raw.parse().choices[0].text == " w1 w2 w3"
        assert [line for line in seen if line.startswith(b"POST")] == [b"POST /v1/completions HTTP/1.1"]
        assert raw.headers["x-kv-router-disaggregation"] == "remote_prefill"
        assert raw.headers["x-kv-router-prefill-worker"] == "1" and raw.headers["x-kv-router-worker"] == "2"
        assert f.apis[1].prefill_legs == 1 and f.apis[2].pulled_blocks == 8
        assert await cached_tokens(f, LONG) == {1: len(LONG), 2: len(LONG), 9: 0}
        f.router.mark_free("ballast")
        await eventually(lambda: idle(f.router))


@pytest.mark.parametrize("style", STYLES)
async def test_a_prefill_leg_that_succeeds_resets_its_workers_circuit_breaker(
    nats_server: EmbeddedNats, style: HandoffStyle
) -> None:
    """As a decode worker's answer does: failures far apart never add up to an open circuit, and a
    half-open one closes on its prefill worker's success."""
    config = {"worker_breaker_failures": 2, "worker_breaker_open_secs": 0.2}
    async with fleet(nats_server.url, (1, 2), roles={1: "prefill", 2: "decode"}, handoff=style, router=config) as f:
        f.router.health.failed(1, "an earlier failure")
        assert f.router.health.availability(1).consecutive_failures == 1
        raw = await f.client.completions.with_raw_response.create(model=MODEL, prompt=LONG, max_tokens=2)
        assert raw.headers["x-kv-router-prefill-worker"] == "1"
        assert f.router.health.availability(1).consecutive_failures == 0

        f.router.health.failed(1, "two failures")
        assert f.router.health.failed(1, "in a row") == "open"
        await eventually(lambda: f.router.health.state(1) == "half_open")
        raw = await f.client.completions.with_raw_response.create(model=MODEL, prompt=LONG[::-1], max_tokens=2)
        assert raw.headers["x-kv-router-prefill-worker"] == "1"
        assert f.router.health.state(1) == "closed"
        await eventually(lambda: idle(f.router))


@pytest.mark.parametrize(
    ("pin", "worker"),
    [
        ({"backend_instance_id": 1}, "worker 1"),
        ({"decode_worker_id": 1}, "worker 1"),
        ({"prefill_worker_id": 2}, "worker 2"),
    ],
    ids=["whole request to a prefill worker", "decode leg to a prefill worker", "prefill leg to a decode worker"],
)
async def test_a_pin_to_a_worker_whose_role_cannot_run_the_leg_is_refused_as_json(
    nats_server: EmbeddedNats, pin: dict[str, int], worker: str
) -> None:
    """One status for every leg pinned where its role cannot run it: the 422 of a hint the fleet cannot serve."""
    async with fleet(nats_server.url, (1, 2), roles={1: "prefill", 2: "decode"}) as f:
        body = {"model": MODEL, "prompt": LONG, "max_tokens": 2, "nvext": pin}
        async with httpx.AsyncClient() as http:
            answer = await http.post(f"{f.url}/v1/completions", json=body)
        assert answer.status_code == 422, answer.text
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error" and worker in error["message"], error
        metrics = await scrape(f.url)
        assert sample(metrics, "kv_router_proxy_requests_total", route="completions", outcome="bad_request") == 1.0
        assert f.apis[1].generated == f.apis[2].generated == 0
        assert idle(f.router)


@pytest.mark.parametrize("style", STYLES)
async def test_a_decode_leg_failing_before_its_first_token_frees_the_prefill_booking(
    nats_server: EmbeddedNats, style: HandoffStyle
) -> None:
    # One attempt: the lone decode worker is not tried again after the backoff (tests/test_proxy_retries).
    async with (
        fleet(nats_server.url, (1,), roles={1: "prefill"}, handoff=style, proxy={"proxy_retries": 0}) as f,
        failing_worker() as (url, seen),
    ):
        bad = WorkerConfig(
            worker_id=9, url=url, models=frozenset({MODEL}), role="decode", leased=False, kv_events=False, block_size=64
        )
        await register(f, bad)
        with pytest.raises(openai.APIStatusError) as refused:
            await f.client.completions.create(model=MODEL, prompt=LONG, max_tokens=4)
        assert refused.value.status_code == 502
        assert "worker 9" in str(refused.value)
        # Both legs' bookings are gone when the client has its answer.
        assert idle(f.router)
        assert [key for key, _ in f.router.bookings()] == []
        assert len(seen) == 1
        # No hand-off ok: the decode leg never answered (in either style).
        assert sample(await scrape(f.url), "kv_router_proxy_handoffs_total", style=style, outcome="ok") is None
        if style == "kv_transfer_params":
            assert f.apis[1].prefill_legs == 1  # prefilled, then the decode leg failed
        else:
            await eventually(lambda: f.apis[1].prefill_legs + f.apis[1].aborted == 1)


@pytest.mark.parametrize("style", STYLES)
async def test_a_decode_leg_failing_goes_to_another_decode_worker(
    nats_server: EmbeddedNats, style: HandoffStyle
) -> None:
    async with (
        fleet(nats_server.url, (1, 2), roles={1: "prefill", 2: "decode"}, handoff=style) as f,
        failing_worker() as (url, seen),
    ):
        bad = WorkerConfig(
            worker_id=9, url=url, models=frozenset({MODEL}), role="decode", leased=False, kv_events=False, block_size=64
        )
        await register(f, bad)
        await ballast(f, "ballast", pinned_worker=(2, 0))()  # decode load on worker 2: worker 9 comes first
        raw = await f.client.completions.with_raw_response.create(model=MODEL, prompt=LONG, max_tokens=3, stream=True)
        text = "".join([chunk.choices[0].text async for chunk in raw.parse()])
        assert text == " w1 w2 w3"
        assert len(seen) == 1 and raw.headers["x-kv-router-worker"] == "2"
        # One hand-off ok, the one whose decode leg answered (in either style).
        assert sample(await scrape(f.url), "kv_router_proxy_handoffs_total", style=style, outcome="ok") == 1.0
        f.router.mark_free("ballast")
        await eventually(lambda: idle(f.router))


@pytest.mark.parametrize("style", STYLES)
async def test_an_overloaded_prefill_worker_is_the_engine_pacing_us_and_the_leg_goes_to_another(
    nats_server: EmbeddedNats, style: HandoffStyle
) -> None:
    """A prefill worker's 429 (Retry-After 0) is no refusal of the request: the leg goes again, here to
    the other prefill worker, and the client gets its completion; no failure is told to the breaker."""
    proxy = {"proxy_retries": 3, "proxy_retry_backoff_secs": 0.01}
    async with (
        fleet(nats_server.url, (2, 3), roles={2: "decode", 3: "prefill"}, handoff=style, proxy=proxy) as f,
        failing_worker(b"429 Too Many Requests", b"retry-after: 0\r\n") as (url, seen),
    ):
        await register(f, prefill_worker_at(url, style))
        await ballast(f, "ballast", pinned_prefill=(3, 0), pinned_worker=(2, 0))()  # worker 9 comes first
        completion = await f.client.completions.create(model=MODEL, prompt=LONG, max_tokens=2)
        assert completion.choices[0].text == " w1 w2"
        assert [line for line in seen if line.startswith(b"POST")] == [b"POST /v1/completions HTTP/1.1"]
        assert f.apis[3].prefill_legs == 1
        text = await scrape(f.url)
        assert sample(text, "kv_router_proxy_handoffs_total", style=style, outcome="prefill_overloaded") == 1
        assert sample(text, "kv_router_proxy_retries_total", reason="overloaded") == 1
        assert sample(text, "kv_router_proxy_upstream_failures_total") == 0  # the engine pacing us, no failure
        f.router.mark_free("ballast")
        await eventually(lambda: idle(f.router))


@pytest.mark.parametrize("client", ["reads to the end", "leaves mid-stream"])
async def test_a_bootstrap_prefill_leg_failing_once_the_decode_leg_streams_is_counted_once_as_late(
    nats_server: EmbeddedNats, client: str
) -> None:
    """SGLang's style sends both legs at once. The prefill worker hands its room over (the decode leg
    streams), then its leg fails: the client's stream goes on to its end, and the hand-off is counted
    once, ``prefill_failed_late`` (not also ``prefill_failed``, which says the request went again);
    counted all the same when the client leaves after that failure, before the stream's end."""
    streaming, failed = asyncio.Event(), asyncio.Event()

    async def answer(head: bytes, body: bytes) -> tuple[bytes, bytes, bytes]:
        if head.startswith(b"GET /bootstrap/"):  # the room is ready: the decode leg goes on
            return b"200 OK", b"", b'{"blocks": 0}'
        # The prefill leg: it fails once the client has the decode leg's first tokens.
        await asyncio.wait_for(streaming.wait(), 10)
        failed.set()
        return b"500 Internal Server Error", b"", ENGINE_FAILURE

    async with (
        fleet(nats_server.url, (2,), roles={2: "decode"}, handoff="bootstrap") as f,
        scripted_worker(answer) as (url, seen),
    ):
        await register(f, prefill_worker_at(url, "bootstrap"))
        stream = await f.client.completions.create(model=MODEL, prompt=LONG, max_tokens=400, stream=True)
        texts = []
        async for chunk in stream:
            texts.append(chunk.choices[0].text)
            streaming.set()
            if client == "leaves mid-stream" and failed.is_set():
                await asyncio.sleep(0.1)  # the proxy reads the prefill leg's failure
                await stream.close()
                break
        if client == "reads to the end":
            assert "".join(texts) == "".join(f" w{i}" for i in range(1, 401))
        else:
            assert len(texts) < 400
        assert b"POST /v1/completions HTTP/1.1" in seen

        async def counted() -> dict[str, float | None]:
            text = await scrape(f.url)
            return {
                outcome: sample(text, "kv_router_proxy_handoffs_total", style="bootstrap", outcome=outcome)
                for outcome in ("ok", "prefill_failed", "prefill_failed_late")
            }

        async def any_counted() -> bool:
            return any((await counted()).values())

        await eventually(any_counted, what="the hand-off is counted")
        assert await counted() == {"ok": None, "prefill_failed": None, "prefill_failed_late": 1.0}
        await eventually(lambda: idle(f.router))


@pytest.mark.parametrize("kv_events", [True, False])
@pytest.mark.parametrize("style", STYLES)
async def test_a_prefill_leg_refused_with_4xx_is_the_clients_answer(
    nats_server: EmbeddedNats, style: HandoffStyle, kv_events: bool
) -> None:
    """Without KV events the router predicts a prompt cached where it routes it: refused, the prompt was
    computed on neither leg, and is predicted on neither (it was kept on both)."""
    async with (
        fleet(nats_server.url, (2,), roles={2: "decode"}, handoff=style, kv_events=kv_events) as f,
        failing_worker(b"400 Bad Request") as (url, seen),
    ):
        await register(f, prefill_worker_at(url, style))
        with pytest.raises(openai.BadRequestError) as refused:
            await f.client.completions.create(model=MODEL, prompt=LONG, max_tokens=2)
        assert "engine failure" in str(refused.value)
        headers = refused.value.response.headers
        assert (headers["x-kv-router-prefill-worker"], headers["x-kv-router-worker"]) == ("9", "2")
        assert headers["x-kv-router-disaggregation"] == "remote_prefill"
        assert (headers["x-kv-router-dp-rank"], headers["x-kv-router-cached-tokens"]) == ("0", "0")  # the receipt whole
        assert [line for line in seen if line.startswith(b"POST")] == [b"POST /v1/completions HTTP/1.1"]
        assert f.apis[2].pulled_blocks == 0
        assert await cached_tokens(f, LONG) == {2: 0, 9: 0}
        await eventually(lambda: idle(f.router))


@pytest.mark.parametrize("style", STYLES)
async def test_a_prefill_answer_over_the_bound_is_the_clients_502_and_goes_to_no_other_worker(
    nats_server: EmbeddedNats, style: HandoffStyle
) -> None:
    """A prefill leg whose answer outgrows proxy_max_answer_bytes: another prefill worker would send as
    much, so the client gets a 502 at once (as on one leg), no other worker is tried and no failure is
    told to the breaker."""

    async def too_large(head: bytes, body: bytes) -> tuple[bytes, bytes, bytes]:
        return b"200 OK", b"", b'{"pad": "' + b"x" * 4096 + b'"}'

    async with (
        fleet(
            nats_server.url,
            (2, 3),
            roles={2: "decode", 3: "prefill"},
            handoff=style,
            proxy={"proxy_max_answer_bytes": 1024, "proxy_retries": 2},
        ) as f,  # fmt: skip
        scripted_worker(too_large) as (url, seen),
    ):
        await register(f, prefill_worker_at(url, style))
        await ballast(f, "ballast", pinned_prefill=(3, 0), pinned_worker=(2, 0))()  # worker 9 comes first
        with pytest.raises(openai.APIStatusError) as refused:
            await f.client.completions.create(model=MODEL, prompt=LONG, max_tokens=2)
        assert refused.value.status_code == 502
        assert "prefill worker 9" in str(refused.value) and "proxy_max_answer_bytes" in str(refused.value)
        assert [line for line in seen if line.startswith(b"POST")] == [b"POST /v1/completions HTTP/1.1"]
        assert f.apis[3].prefill_legs == 0
        text = await scrape(f.url)
        assert sample(text, "kv_router_proxy_handoffs_total", style=style, outcome="prefill_refused") == 1
        assert sample(text, "kv_router_proxy_upstream_failures_total") == 0
        # The request counted as a one-leg answer over the bound is.
        assert sample(text, "kv_router_proxy_requests_total", route="completions", outcome="upstream_error") == 1
        f.router.mark_free("ballast")
        await eventually(lambda: idle(f.router))


async def test_a_prefill_leg_is_one_token_of_one_choice_and_a_refusal_tells_no_decode_worker(
    nats_server: EmbeddedNats,
) -> None:
    """The prefill leg an engine gets: ``n`` 1 (an engine prefills n choices as n requests, each holding
    its blocks, of which the decode leg pulls one), one token, ``max_output_tokens`` 1 on the Responses
    API (``max_tokens`` is not one of its fields). Its 4xx is the client's answer and the prefill worker
    answered; the decode worker, never sent the request, keeps the failure it had."""
    bodies: list[bytes] = []

    async def refusing_legs(head: bytes, body: bytes) -> tuple[bytes, bytes, bytes]:
        """As an engine refusing these legs: it tokenizes the Responses API's chat (a /tokenize 400 would
        be the prompt's refusal, the client's at once, before any leg)."""
        bodies.append(body)
        if head.startswith(b"POST /tokenize "):
            return b"200 OK", b"", msgspec.json.encode({"tokens": list(range(1, 641)), "count": 640})
        return b"400 Bad Request", b"", ENGINE_FAILURE

    async with (
        fleet(nats_server.url, (2,), roles={2: "decode"}) as f,
        scripted_worker(refusing_legs) as (url, seen),
    ):
        await register(f, prefill_worker_at(url, "kv_transfer_params"))
        f.router.health.failed(2, "an earlier failure")
        f.router.health.failed(9, "an earlier failure")
        with pytest.raises(openai.BadRequestError):
            await f.client.completions.create(model=MODEL, prompt=LONG, max_tokens=8, n=2, stream=True)
        with pytest.raises(openai.BadRequestError):
            await f.client.responses.create(model=MODEL, input="a long question " * 40, max_output_tokens=64)
        legs = {line: msgspec.json.decode(body) for line, body in zip(seen, bodies, strict=True)}
        completion, response = legs[b"POST /v1/completions HTTP/1.1"], legs[b"POST /v1/responses HTTP/1.1"]
        assert (completion["n"], completion["max_tokens"], completion["stream"]) == (1, 1, False)
        assert completion["kv_transfer_params"]["do_remote_decode"] is True
        assert response["max_output_tokens"] == 1 and "max_tokens" not in response
        assert f.router.health.availability(2).consecutive_failures == 1
        assert f.router.health.availability(9).consecutive_failures == 0
        await eventually(lambda: idle(f.router))


async def test_a_model_served_by_workers_of_role_both_is_not_split_by_another_models_prefill_worker(
    nats_server: EmbeddedNats,
) -> None:
    """Workers 5 and 6 (role both, no KV connector) serve another model beside a prefill and a decode
    worker: its long prompts go to one of them whole, with no prefill leg to fail there."""
    bodies: list[bytes] = []
    async with (
        fleet(nats_server.url, (1, 2), roles={1: "prefill", 2: "decode"}) as f,
        failing_worker(b"200 OK", bodies=bodies) as (url5, seen5),
        failing_worker(b"200 OK", bodies=bodies) as (url6, seen6),
    ):
        for worker_id, url in ((5, url5), (6, url6)):
            other = WorkerConfig(
                worker_id=worker_id, url=url, models=frozenset({"other"}), leased=False, kv_events=False, block_size=64
            )
            await register(f, other)
        async with httpx.AsyncClient() as http:
            answer = await http.post(
                f"{f.url}/v1/completions", json={"model": "other", "prompt": LONG, "max_tokens": 4}
            )
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-kv-router-worker"] in ("5", "6")
        assert "x-kv-router-disaggregation" not in answer.headers
        assert len(seen5) + len(seen6) == 1 and "kv_transfer_params" not in msgspec.json.decode(bodies[0])
        assert f.apis[1].generated == f.apis[2].generated == 0
        assert f.router.health.availability(5).consecutive_failures == 0
        await eventually(lambda: idle(f.router))


async def test_among_both_workers_embeddings_go_to_one_worker_whole(nats_server: EmbeddedNats) -> None:
    """A pooling request has no KV to hand over: among workers of role both that hand prefill over to
    each other, it still runs on one of them alone."""
    async with fleet(nats_server.url, (1, 2), router={"disagg_among_both_workers": True}) as f:
        raw = await f.client.embeddings.with_raw_response.create(model=MODEL, input="embed me " * 80)
        assert raw.parse().data[0].embedding[1] in (1.0, 2.0)
        assert "x-kv-router-disaggregation" not in raw.headers
        assert f.apis[1].pooled + f.apis[2].pooled == 1 and f.apis[1].prefill_legs == f.apis[2].prefill_legs == 0
        assert "kv_router_proxy_handoffs_total{" not in await scrape(f.url)
        await eventually(lambda: idle(f.router))


@pytest.mark.parametrize("style", STYLES)
async def test_a_remote_prefill_waits_in_the_queue_while_the_prefill_pool_is_busy(
    nats_server: EmbeddedNats, style: HandoffStyle
) -> None:
    """The router's queue holds a disaggregated request while its prefill pool is queue-busy (any
    pending prefill, at threshold 0); a full queue is a 429; once the prefill worker is free the
    request runs both legs."""
    router = {"router_queue_threshold": 0.0, "router_queue_isl_token_limit_per_worker": 256}
    async with fleet(nats_server.url, (1, 2), roles={1: "prefill", 2: "decode"}, handoff=style, router=router) as f:
        # Another gateway's remote prefill holds the only prefill worker (its decode leg books no prefill).
        elsewhere = await ballast(f, "elsewhere")()
        assert elsewhere.disaggregation is not None and elsewhere.disaggregation.path == "remote_prefill"
        waiting = asyncio.ensure_future(
            f.client.completions.with_raw_response.create(model=MODEL, prompt=LONG, max_tokens=3, stream=True)
        )
        await eventually(lambda: f.router.queue_stats().pending_count == 1)
        # 256 tokens x 2 workers: the 512 waiting fill the queue, a short prompt behind them is refused.
        with pytest.raises(openai.RateLimitError) as caught:
            await f.client.completions.create(model=MODEL, prompt=LONG[:100], max_tokens=2)
        assert caught.value.response.json()["error"]["type"] == "rate_limit_exceeded"
        assert f.apis[1].prefill_legs == 0 and f.apis[2].generated == 0
        assert f.router.booking("elsewhere") is not None and f.router.booking(prefill_booking_id("elsewhere"))
        assert f.router.mark_prefill("elsewhere")  # its prefill leg answered: the prefill pool is free
        raw = await waiting
        text = "".join([chunk.choices[0].text async for chunk in raw.parse()])
        assert text == " w1 w2 w3"
        assert raw.headers["x-kv-router-disaggregation"] == "remote_prefill"
        assert raw.headers["x-kv-router-prefill-worker"] == "1" and raw.headers["x-kv-router-worker"] == "2"
        assert f.apis[1].prefill_legs == 1 and f.apis[2].pulled_blocks == 8
        assert f.router.mark_free("elsewhere")
        await eventually(lambda: idle(f.router))
        assert f.router.queue_stats().pending_count == 0


SLOW = EngineConfig(num_gpu_blocks=512, speedup_ratio=0.02)  # a 512-token prefill takes about a second


@pytest.mark.parametrize("style", STYLES)
async def test_a_client_leaving_cancels_both_legs(nats_server: EmbeddedNats, style: HandoffStyle) -> None:
    async with fleet(nats_server.url, (1, 2), roles={1: "prefill", 2: "decode"}, handoff=style, engine=SLOW) as f:
        request = asyncio.ensure_future(
            f.client.completions.create(model=MODEL, prompt=LONG, max_tokens=50, stream=True)
        )
        await eventually(lambda: bool(f.workers[1]._streams))  # the prefill leg is in the prefill engine
        if style == "bootstrap":  # and the decode leg waits at its bootstrap room
            await eventually(lambda: len(f.apis[1].rooms) == 1)
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request
        await eventually(lambda: f.apis[1].aborted == 1)
        if style == "bootstrap":
            await eventually(lambda: f.apis[2].aborted == 1)
        else:  # the decode leg was never sent
            assert f.apis[2].aborted == 0 and f.apis[2].pulled_blocks == 0
        await eventually(lambda: idle(f.router))
        metrics = await scrape(f.url)
        assert (sample(metrics, "kv_router_proxy_requests_total", route="completions", outcome="client_disconnected")
                == 1.0)  # fmt: skip


@pytest.mark.parametrize("style", STYLES)
async def test_a_client_leaving_mid_stream_cancels_the_decode_leg(
    nats_server: EmbeddedNats, style: HandoffStyle
) -> None:
    async with fleet(nats_server.url, (1, 2), roles={1: "prefill", 2: "decode"}, handoff=style, engine=SLOW) as f:
        stream = await f.client.completions.create(model=MODEL, prompt=LONG, max_tokens=200, stream=True)
        first = await stream.__anext__()
        assert first.choices[0].text == " w1"
        await stream.close()
        await eventually(lambda: f.apis[2].aborted == 1)
        assert f.apis[1].prefill_legs == 1 and f.apis[1].aborted == 0
        await eventually(lambda: idle(f.router))


@pytest.mark.parametrize("stream", [True, False])
async def test_sequential_style_sends_the_decode_leg_the_clients_body_once_the_prefill_leg_answered(
    nats_server: EmbeddedNats, stream: bool
) -> None:
    """``sequential`` (a connector sharing KV through a store keyed by the prompt, as vLLM's
    ExampleConnector): the prefill leg (one token, not streamed, no params) is answered, with no
    ``kv_transfer_params``, before the decode worker gets anything; then the client's body goes to the
    decode worker as it came."""
    prefill_bodies: list[dict[str, Any]] = []
    decode_busy_at_prefill: list[int] = []
    async with fleet(nats_server.url, (2,), roles={2: "decode"}) as f:

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                while head := await reader.readuntil(b"\r\n\r\n"):
                    lines = head.lower().split(b"\r\n")
                    length = next(int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length"))
                    prefill_bodies.append(msgspec.json.decode(await reader.readexactly(length)))
                    decode_busy_at_prefill.append(f.apis[2].generated)
                    body = msgspec.json.encode(
                        {"object": "text_completion", "model": MODEL, "kv_transfer_params": None,
                         "choices": [{"index": 0, "text": " w1", "finish_reason": "length"}]}
                    )  # fmt: skip
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" +
                                 b"content-length: %d\r\n\r\n%b" % (len(body), body))  # fmt: skip
                    await writer.drain()
            writer.close()

        async with raw_worker(serve) as url:
            prefill = WorkerConfig(
                worker_id=9, url=url, models=frozenset({MODEL}), role="prefill", handoff="sequential",
                leased=False, kv_events=False, block_size=64,
            )  # fmt: skip
            await register(f, prefill)
            usage: Any = {"include_usage": True} if stream else None
            raw = await f.client.completions.with_raw_response.create(
                model=MODEL, prompt=LONG, max_tokens=4, stream=stream, stream_options=usage,
                extra_body={"min_tokens": 2},
            )  # fmt: skip
            if stream:
                chunks = [chunk async for chunk in raw.parse()]  # type: ignore[union-attr]
                text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
            else:
                text = raw.parse().choices[0].text  # type: ignore[union-attr]
            assert text == " w1 w2 w3 w4"  # the decode worker's answer
            assert raw.headers["x-kv-router-worker"] == "2"
            assert raw.headers["x-kv-router-disaggregation"] == "remote_prefill"
            assert raw.headers["x-kv-router-prefill-worker"] == "9"
            assert prefill_bodies == [
                {"model": MODEL, "prompt": LONG, "max_tokens": 1, "stream": False}
            ]  # no min_tokens, stream_options nor kv_transfer_params
            assert decode_busy_at_prefill == [0]  # the decode leg went after the prefill leg's answer
            assert f.apis[2].generated == 1 and f.apis[2].pulled_blocks == 0  # the client's body: no params
            await eventually(lambda: idle(f.router))
            metrics = await scrape(f.url)
            assert sample(metrics, "kv_router_proxy_handoffs_total", style="sequential", outcome="ok") == 1.0

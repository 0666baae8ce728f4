"""The proxy's spans over OTLP/HTTP (`api.proxy.tracing`), received by an OTLP endpoint on loopback and
decoded with OpenTelemetry's own protobuf types: the request's span is the child of the client's
``traceparent`` and the worker's parent, with its steps (tokenize, decision, upstream first byte,
answer) below it; with the real `openai` client."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from api.config import ProxyConfig
from api.proxy.tracing import SHUTDOWN_BUDGET_S, ProxyTracing
from router.event_plane.embedded_server import EmbeddedNats, free_port
from tests.proxy_fleet import MODEL, fleet, idle
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


class Collector:
    """An OTLP/HTTP traces endpoint: every span posted to it."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.services: set[str] = set()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource_spans in request.resource_spans:
            for attribute in resource_spans.resource.attributes:
                if attribute.key == "service.name":
                    self.services.add(attribute.value.string_value)
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(scope_spans.spans)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})


@contextlib.asynccontextmanager
async def collector() -> AsyncIterator[tuple[Collector, str]]:
    app, port = Collector(), free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning"))
    serving = asyncio.create_task(server.serve())
    await eventually(lambda: server.started or serving.done())
    try:
        yield app, f"http://127.0.0.1:{port}/v1/traces"
    finally:
        server.should_exit = True
        await serving


async def test_a_streamed_requests_spans_join_the_clients_trace_and_parent_the_workers(
    nats_server: EmbeddedNats,
) -> None:
    async with collector() as (received, endpoint):
        proxy = {"proxy_otlp_endpoint": endpoint, "proxy_otlp_service_name": "gateway-under-test"}
        async with fleet(nats_server.url, (1,), proxy=proxy) as f:
            headers = {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "x-request-id": "traced-1"}
            stream = await f.client.completions.create(
                model=MODEL, prompt="trace me " * 20, max_tokens=3, stream=True, extra_headers=headers
            )
            assert "".join([chunk.choices[0].text async for chunk in stream]) == " w1 w2 w3"
            sent = f.apis[1].last_headers[b"traceparent"].decode()
            assert idle(f.router)
        # The proxy's stop exported what was left.
        await eventually(lambda: len(received.spans) >= 5, what="the request's five spans")
    by_name = {span.name: span for span in received.spans}
    root = by_name["kv-router.proxy completions"]
    assert root.trace_id.hex() == TRACE_ID and root.parent_span_id.hex() == CLIENT_SPAN
    attributes = {a.key: a.value.string_value for a in root.attributes}
    assert attributes["kv_router.outcome"] == "ok" and attributes["kv_router.request_id"] == "traced-1"
    # The worker's parent is the proxy's span, in the client's trace.
    assert sent == f"00-{TRACE_ID}-{root.span_id.hex()}-01"
    steps = ["tokenize", "decision", "upstream first byte", "answer"]
    for name in steps:
        step = by_name[name]
        assert step.trace_id == root.trace_id and step.parent_span_id == root.span_id, name
        assert root.start_time_unix_nano <= step.start_time_unix_nano <= step.end_time_unix_nano
        assert step.end_time_unix_nano <= root.end_time_unix_nano, name
    # In order: each step starts once the one before it has.
    starts = [by_name[name].start_time_unix_nano for name in steps]
    assert starts == sorted(starts)
    assert received.services == {"gateway-under-test"}


async def test_without_a_traceparent_the_request_starts_a_trace_the_worker_joins(nats_server: EmbeddedNats) -> None:
    async with collector() as (received, endpoint):
        async with fleet(nats_server.url, (1,), proxy={"proxy_otlp_endpoint": endpoint}) as f:
            await f.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1)
            sent = f.apis[1].last_headers[b"traceparent"].decode()
        await eventually(lambda: any(s.name == "kv-router.proxy completions" for s in received.spans))
    root = next(s for s in received.spans if s.name == "kv-router.proxy completions")
    assert root.parent_span_id == b""
    version, trace_id, parent, flags = sent.split("-")
    assert (version, trace_id, parent) == ("00", root.trace_id.hex(), root.span_id.hex())
    assert int(flags, 16) & 1  # sampled (the SDK may set level 2's random-trace-id bit too)
    assert {s.name for s in received.spans} == {
        "kv-router.proxy completions",
        "tokenize",
        "decision",
        "upstream first byte",
        "answer",
    }


async def test_a_malformed_traceparent_starts_a_trace_of_its_own_without_the_clients_tracestate(
    nats_server: EmbeddedNats,
) -> None:
    """The client's ``tracestate`` beside a malformed ``traceparent`` belongs to no trace the proxy
    joins: it went to the engine with the proxy's new trace."""
    async with (
        collector() as (_, endpoint),
        fleet(nats_server.url, (1,), proxy={"proxy_otlp_endpoint": endpoint}) as f,
    ):
        headers = {"traceparent": "garbage", "tracestate": "vendor=x"}
        await f.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1, extra_headers=headers)
        sent = f.apis[1].last_headers
        assert sent[b"traceparent"].startswith(b"00-") and len(sent[b"traceparent"]) == 55
        assert b"tracestate" not in sent


async def test_a_collector_that_never_answers_holds_the_shutdown_at_most_its_budget(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A collector that takes the connection and never answers: the proxy's shutdown gives up on the
    last spans within its budget, saying so. With the SDK's defaults it took 30 s (three exports of
    10 s), past what a pod's grace period leaves once the requests in flight have drained."""
    # Listening, never accepting: the kernel completes each connection and nothing ever answers it
    # (nor holds it open on this side once the socket is closed: no accepted socket left to collect).
    collector_socket = socket.socket()
    collector_socket.bind(("127.0.0.1", 0))
    collector_socket.listen(64)
    port = collector_socket.getsockname()[1]
    try:
        tracing = ProxyTracing(ProxyConfig(proxy_otlp_endpoint=f"http://127.0.0.1:{port}/v1/traces"))
        tracing.end(tracing.begin("completions", None, None), "ok", {})
        started = time.monotonic()
        await asyncio.wait_for(tracing.shutdown(), SHUTDOWN_BUDGET_S + 10)
        took = time.monotonic() - started
    finally:
        collector_socket.close()
    assert took < SHUTDOWN_BUDGET_S + 1
    # Said by the SDK (its export timed out) or by us (the budget ran out first).
    assert "Failed to export spans" in caplog.text or "the OTLP collector did not take the last spans" in caplog.text

"""The proxy's spans, exported over OTLP/HTTP (``proxy_otlp_endpoint``; the ``otel`` extra).

Per request, a span ``kv-router.proxy <route>`` from its body in to its end, a child of the client's
``traceparent`` when it sent one (else the root of a new trace), and the worker gets the proxy's span as
its parent (``traceparent``), so the engine's spans hang below it. Its children, made at its end from
the times noted on the way (`Timeline`): ``tokenize``, ``decision`` (booking included, a queue wait
too), ``upstream first byte`` (the request written to the worker's first events, or to its answer's
head when not streamed) and ``answer`` (from there to the end: the stream's end, or the whole body).
The SDK's batch processor exports them from its own thread; nothing here blocks the event loop.
A collector that does not answer costs an export at most `EXPORT_TIMEOUT_S` (its spans dropped, as
the SDK drops spans past its queue) and the service's shutdown at most `SHUTDOWN_BUDGET_S`: the
SDK's defaults (10 s an export, three tries at shutdown) let a dead collector add 30 s to every
shutdown, past a pod's grace period. Without an endpoint none of this is imported or run.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from api.config import ProxyConfig
from router.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

__all__ = ["EXPORT_TIMEOUT_S", "SHUTDOWN_BUDGET_S", "ProxyTracing", "RequestSpan", "Timeline", "check_sdk"]

log = logging.getLogger(__name__)

EXPORT_TIMEOUT_S = 3.0
SHUTDOWN_BUDGET_S = 5.0


def check_sdk() -> None:
    """Raise `ConfigError` unless the OpenTelemetry SDK and its OTLP exporter import (the ``otel``
    extra, not in the image): ``kv-router serve`` calls it first, so a missing SDK stops start-up in
    one line instead of a traceback from inside the app."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace.export  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            "proxy_otlp_endpoint", f"the OpenTelemetry SDK is not installed: pip install 'kv-router[otel]' ({exc})"
        ) from None


class Timeline:
    """When one request passed each step (`time.time_ns`; 0: not reached)."""

    __slots__ = ("decided", "deciding", "first_byte", "sent", "tokenized")

    def __init__(self) -> None:
        self.tokenized = self.deciding = self.decided = self.sent = self.first_byte = 0


class RequestSpan:
    """The span of one request, begun as it came in."""

    __slots__ = ("began", "span", "timeline", "traceparent")

    def __init__(self, span: Span, began: int) -> None:
        self.span = span
        self.began = began
        self.timeline = Timeline()
        context = span.get_span_context()
        flags = int(context.trace_flags)
        self.traceparent = f"00-{context.trace_id:032x}-{context.span_id:016x}-{flags:02x}".encode()


class ProxyTracing:
    """The tracer provider and exporter (made at start-up, shut down, flushing, with the proxy)."""

    def __init__(self, config: ProxyConfig) -> None:
        endpoint = config.proxy_otlp_endpoint
        assert endpoint is not None
        check_sdk()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = TracerProvider(resource=Resource.create({"service.name": config.proxy_otlp_service_name}))
        exporter = OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S)
        self._provider.add_span_processor(
            BatchSpanProcessor(exporter, schedule_delay_millis=500, export_timeout_millis=EXPORT_TIMEOUT_S * 1000)
        )
        self._tracer: Tracer = self._provider.get_tracer("kv-router.proxy")
        self._propagator = TraceContextTextMapPropagator()

    def begin(self, route: str, traceparent: bytes | None, tracestate: bytes | None) -> RequestSpan:
        carrier = {}
        if traceparent:
            carrier["traceparent"] = traceparent.decode("latin-1")
            if tracestate:
                carrier["tracestate"] = tracestate.decode("latin-1")
        parent = self._propagator.extract(carrier) if carrier else None
        began = time.time_ns()
        span = self._tracer.start_span(f"kv-router.proxy {route}", context=parent, start_time=began)
        span.set_attribute("kv_router.route", route)
        return RequestSpan(span, began)

    def end(self, request: RequestSpan, outcome: str, attributes: dict[str, Any]) -> None:
        """The request's children from its timeline, then its own end."""
        from opentelemetry.trace import StatusCode, set_span_in_context

        now = time.time_ns()
        span, times = request.span, request.timeline
        parent = set_span_in_context(span)
        steps = (
            ("tokenize", request.began, times.tokenized),
            ("decision", times.deciding, times.decided),
            ("upstream first byte", times.sent, times.first_byte),
            ("answer", times.first_byte, now if times.first_byte else 0),
        )
        for name, start, end in steps:
            if start and end:
                self._tracer.start_span(name, context=parent, start_time=start).end(end_time=end)
        span.set_attribute("kv_router.outcome", outcome)
        for key, value in attributes.items():
            span.set_attribute(key, value)
        if outcome not in ("ok", "upstream_status"):
            span.set_status(StatusCode.ERROR, outcome)
        span.end(end_time=now)

    async def shutdown(self) -> None:
        """Export what is left, for at most `SHUTDOWN_BUDGET_S`. The SDK's shutdown blocks, so it runs
        in a daemon thread: one the collector holds past the budget is left behind (a thread of the
        default executor would hold the process's exit until it returned); the wait for it is one of the
        executor's, which returns within the budget."""
        flushing = threading.Thread(target=self._provider.shutdown, name="otlp-shutdown", daemon=True)
        flushing.start()
        await asyncio.to_thread(flushing.join, SHUTDOWN_BUDGET_S)
        if flushing.is_alive():
            log.warning(
                "the OTLP collector did not take the last spans within %.0f s: they are dropped", SHUTDOWN_BUDGET_S
            )

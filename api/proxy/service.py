"""`Proxy`: one OpenAI request from the client to a worker and back, booked in the router throughout.

Per request: read and check the body (a malformed one is a 400, nothing booked); find the workers that
serve its model and have a URL (none: 503); get its token ids (`api.proxy.tokens`); book it with
`KvRouter.new` among those workers (the queue may hold it; a queue rejection is a 429 with
Retry-After); forward the body unchanged to the chosen worker; hand the answer back.

Booking follows the request: ``mark_prefill`` at the first streamed chunk (at the response when not
streaming), ``mark_free`` when it ends however it ends: done, the worker failing, the client leaving
(which also closes the upstream connection, so the engine stops the request). Every booking is made
and released through `KvRouter`, so replicas and metrics see the proxy's requests like any other.

A worker that refuses the connection, times out or answers 5xx before its first byte is reported to
its circuit breaker (`router.worker_health`: enough failures in a row take it out of routing) and the
request is booked again on the next best worker, and an
overloaded engine's 429 / 503 is retried alike, after a jittered exponential backoff (and the engine's
Retry-After when the retry may go to it again: `api.proxy.retry`), at most ``proxy_retries`` times
within ``proxy_retry_budget_secs``;
after the first byte has gone to the client, a failure ends the stream with an SSE error event. The
reply carries ``x-kv-router-worker``, ``x-kv-router-dp-rank`` and ``x-kv-router-cached-tokens``
(the router's prediction); the engine's reported cached tokens, when it reports them, are compared
with that prediction (`api.proxy.metrics`).

A request annotated ``query_instance_id`` (Dynamo's, in ``nvext.annotations``) is checked and routed
the same way but neither booked nor forwarded: the answer is the decision (`api.proxy.instance_query`).

The proxy's ``POST`` routes are stream routes (`routes`, `api.http_stream`): `answer` gets a
`StreamCall` from the HTTP protocol or from their FastAPI route (`api.asgi.StreamEndpoint`), and
writes to it alike. CPU per request is a body decode, a routing decision and one exchange on a
pooled connection (`api.proxy.upstream`); per streamed read, one write to the client: the stream is
not parsed, only its last pieces are searched for the usage report.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable
from functools import partial
from typing import NamedTuple, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry

from api.auth import Access, ApiAuth, unauthorized_reply
from api.codec import JSON, Reply
from api.config import ProxyConfig, ServiceConfig
from api.cors import Cors
from api.errors import ApiError, prompt_too_long
from api.hints import RoutingCall, routing_call
from api.http_stream import Headers, Sink, StreamCall, StreamRoute
from api.metrics import ApiMetrics
from api.native import ENABLED as NATIVE
from api.native import accel
from api.openapi import Schemas
from api.proxy.admission import Admission
from api.proxy.client_headers import ClientHeaders, Passed, WithHeaders
from api.proxy.handoff import Forward, Handoff, PrefillFailed
from api.proxy.health_checks import WorkerHealthChecks
from api.proxy.instance_query import instance_reply
from api.proxy.metrics import ProxyMetrics
from api.proxy.prompt_bytes import chat_bytes, text_bytes
from api.proxy.retry import OVERLOADED, Refused, RetryPolicy, WorkerFailed, overloaded_answer, unanswered
from api.proxy.tokens import PromptRefused, PromptTokenizer, TokenizeFailed, load_model_files
from api.proxy.tracing import ProxyTracing, Timeline
from api.proxy.upstream import Streaming, Upstream, UpstreamConnection, UpstreamError
from api.proxy.wire import (
    ROUTES,
    ChatBody,
    CompletionBody,
    EmbeddingsBody,
    ErrorReply,
    ModelCard,
    ModelList,
    RerankBody,
    ResponsesBody,
    TokenIdsBody,
    Usage,
    batch_rest,
    error_body,
    finished_stream,
    prompt_token_ids,
    receipt_headers,
    reported_usage,
)
from api.wire import NvExt, queries_instance
from indexer.errors import UNDECODABLE
from indexer.hashing import pack_tokens
from router.errors import AllWorkersOverloaded, InvalidRequest, NoEligibleWorker, QueueRejected, WorkersUnavailable
from router.kv_router import KvRouter
from router.prompt import token_count
from router.request_ids import new_request_id
from router.types import RouteDecision, RouterConfigOverride, WorkerConfig

__all__ = ["ROUTES", "Proxy"]

# Models an unknown model's 404 names (a fleet may serve many).
MODELS_NAMED = 10

logger = logging.getLogger(__name__)

# Routes whose work is a prefill the engine does not reuse (pooling models): routed by load alone,
# the cache credit zeroed (Dynamo's per-request router_config_override).
_BY_LOAD = frozenset({"embeddings", "rerank"})
_NO_CACHE_CREDIT = RouterConfigOverride(overlap_score_credit=0.0)
_PATHS = {route: path.encode() for path, route in ROUTES.items()}

_JSON = b"application/json"
_Converted = TypeVar("_Converted", EmbeddingsBody, RerankBody, ResponsesBody)
_encode = msgspec.json.Encoder().encode
# A completion's prompt of token ids, as its raw body shows it (JSON whitespace allowed).
_IDS_PROMPT = re.compile(rb'"prompt"[ \t\r\n]*:[ \t\r\n]*\[[ \t\r\n]*[0-9]')


class Proxy:
    """The proxy of one app: its router, settings, upstream session, tokenizers and metrics."""

    def __init__(
        self,
        router: KvRouter,
        config: ProxyConfig,
        service: ServiceConfig,
        registry: CollectorRegistry,
        decisions: ApiMetrics,
    ) -> None:
        self.router = router
        self.config = config
        self.metrics = ProxyMetrics(registry, config.proxy_calibration_window, router.has_worker)
        # The decision metrics the decision API keeps (per worker, phases, overlap, hits): the proxy's
        # decisions are counted there too, so a proxy-only fleet's dashboards and alerts see them.
        self.decisions = decisions
        self.upstream = Upstream(config)
        self.retry = RetryPolicy(config)
        self.health_checks = WorkerHealthChecks(router, config)
        self.admission = Admission(config, router.config.router_queue_policy)
        self.tracing = ProxyTracing(config) if config.proxy_otlp_endpoint else None
        self.client_headers = ClientHeaders(config, Cors(service, config.proxy_request_id_header), self.tracing)
        self.metrics.watch_admission(lambda: self.admission.in_flight, lambda: len(self.admission.queue))
        self.handoff = Handoff(router, self.upstream, registry, self.worker_answered, self.worker_failed)
        local = load_model_files(config.tokenizer_paths(), config.proxy_tokenizer_cache_tokens)
        self.tokenizer = PromptTokenizer(local, self.upstream, self.metrics.prompt)
        self.metrics.watch_tokenizer_caches(
            {
                model: files.encoder.cache
                for model, files in local.items()
                if files.encoder is not None and files.encoder.cache is not None
            }
        )
        self._max_body_bytes = service.max_body_bytes
        self._max_prompt_tokens = service.max_prompt_tokens
        self._by_bytes_without_events = config.proxy_route_text_by_bytes
        # Output progress changes what routing reads only with output blocks tracked or a policy pricing
        # the context in flight (`KvRouter.tracks_output`).
        self._track_output = router.tracks_output
        self._decoders: dict[str, Callable[[bytes], PackedIds | TokenIdsBody | CompletionBody | ChatBody]] = {
            "completions": _completion_decoder(),
            "chat_completions": msgspec.json.Decoder(ChatBody).decode,
            # Routed as the completion or chat they amount to; their bodies still go as they came.
            "embeddings": _converted(EmbeddingsBody, EmbeddingsBody.as_completion),
            "rerank": _converted(RerankBody, RerankBody.as_completion),
            "responses": _converted(ResponsesBody, ResponsesBody.as_chat),
        }

    async def start(self) -> None:
        await self.upstream.start()
        self.router.left_routing_observers.append(self._worker_left)
        self.health_checks.start()

    async def stop(self) -> None:
        await self.health_checks.stop()
        if self._worker_left in self.router.left_routing_observers:
            self.router.left_routing_observers.remove(self._worker_left)
        await self.upstream.stop()
        if self.tracing is not None:
            await self.tracing.shutdown()  # the spans left, exported

    def routes(self, auth: ApiAuth | None = None) -> dict[str, StreamRoute]:
        """The proxy's ``POST`` routes (`api.http_stream`, answered by the HTTP protocol or by
        `api.asgi.StreamEndpoint`), decisions for the API token; a body over the limit is refused in
        OpenAI's shape, and counted."""
        auth = auth or ApiAuth(None)
        unauthorized = _in_openai_shape(unauthorized_reply())
        too_large_reply = Reply(413, self._too_large().body)

        def route_for(route: str) -> StreamRoute:
            async def handle(request: StreamCall) -> None:
                authorization = request.authorization
                presented = [(b"authorization", authorization)] if authorization else []
                if auth.refuse(Access.DECISION, presented) is not None:
                    self.metrics.count(route, "unauthorized")
                    # The request id, and CORS: a browser script of an allowed origin may read why.
                    headers = [*_header_bytes(unauthorized), *self.client_headers.unread(request.head)]
                    await request.whole(unauthorized.status, headers, unauthorized.body)
                    return
                await self.answer(route, request)

            def too_large(head: bytes) -> Reply:
                self.metrics.count(route, "bad_request")
                unread = self.client_headers.unread(head)
                headers = tuple((name.decode("latin-1"), value.decode("latin-1")) for name, value in unread)
                return Reply(too_large_reply.status, too_large_reply.body, headers=headers)

            return StreamRoute(handle, too_large, self.config.proxy_client_write_timeout_secs)

        return {path: route_for(route) for path, route in ROUTES.items()}

    def add_models_route(self, app: FastAPI, auth: ApiAuth) -> None:
        """``GET /v1/models`` on the app, a read for the API token, its 401 in OpenAI's shape
        (documented by `document`, with the routes' schemas)."""
        unauthorized = _in_openai_shape(unauthorized_reply())

        async def list_models(request: Request) -> Response:
            if auth.refuse(Access.READ, request.scope["headers"]) is not None:
                return Response(unauthorized.body, 401, dict(unauthorized.headers), media_type=JSON)
            return Response(self.models(), media_type=JSON)

        app.add_api_route("/v1/models", list_models, methods=["GET"], include_in_schema=False)

    # ------------------------------------------------------------------ workers
    def models(self) -> bytes:
        """``GET /v1/models``: the union of the models the proxied workers declare."""
        names = sorted({model for worker in self.router.workers() if worker.url for model in worker.models})
        return _encode(ModelList(data=[ModelCard(id=name) for name in names]))

    def document(self, schemas: Schemas) -> None:
        """Add the proxy's routes to the OpenAPI document (``/docs``): they are answered in front of
        FastAPI, which would not list them."""
        errors = {
            status: (ErrorReply, text)
            for status, text in (
                (400, "malformed body"),
                (401, "the API token is needed (--protect-decisions)"),
                (404, "no worker serves the model (the fleet serves others)"),
                (413, "body or prompt too long"),
                (429, "the router's queue is full (Retry-After)"),
                (502, "the worker failed"),
                (503, "no worker to forward to"),
            )
        }
        tags = ["OpenAI proxy"]
        for path, body, summary in (
            ("/v1/completions", CompletionBody, "a completion, routed to the worker holding most of the prompt"),
            ("/v1/chat/completions", ChatBody, "a chat completion, routed to the worker holding most of the prompt"),
            ("/v1/responses", ResponsesBody, "a response (Responses API), routed by its prompt rendered as a chat"),
            ("/v1/embeddings", EmbeddingsBody, "embeddings, routed to the least loaded worker serving the model"),
            ("/v1/rerank", RerankBody, "a ranking of documents, routed to the least loaded worker serving the model"),
        ):
            operation = schemas.operation(request=body, responses=errors, msgpack=False)
            operation["responses"]["200"] = {
                "description": "the worker's answer as it sent it (text/event-stream when stream is true); headers "
                "x-kv-router-worker and x-kv-router-cached-tokens name the choice",
                "content": {"application/json": {}, "text/event-stream": {}},
            }
            schemas.add_path(path, "post", {"summary": summary, "tags": tags, **operation})
        models = schemas.operation(responses={200: (ModelList, "the models the proxied workers serve")})
        schemas.add_path("/v1/models", "get", {"summary": "the models of the proxied workers", "tags": tags, **models})

    def workers_for(self, model: str) -> list[WorkerConfig]:
        """Workers with a URL serving ``model`` (declaring no models: any). Those out of routing (circuit
        open, health check failing) are left out by the router itself (`router.worker_health`)."""
        return [w for w in self.router.workers() if w.url is not None and (not w.models or model in w.models)]

    def _unserved(self, model: str) -> Refused:
        """No worker serves ``model``: a 404 as OpenAI's (and vLLM's) when the fleet serves others, a
        503 while it has no worker to forward to at all."""
        served = sorted({name for w in self.router.workers() if w.url is not None for name in w.models})
        if not served:
            return Refused.error(503, "service_unavailable", f"no worker serves model {model!r}", "no_worker")
        listed = ", ".join(repr(name) for name in served[:MODELS_NAMED])
        more = f" and {len(served) - MODELS_NAMED} more" if len(served) > MODELS_NAMED else ""
        message = f"the model {model!r} does not exist here: the workers serve {listed}{more}"
        return Refused.error(404, "invalid_request_error", message, "bad_request")

    def worker_failed(self, worker_id: int, problem: str) -> None:
        """A worker failed a request: count it, and tell its circuit breaker (one line when it opens)."""
        self.metrics.upstream_failure()
        if self.router.health.failed(worker_id, problem) == "open":
            open_secs = self.router.config.worker_breaker_open_secs
            logger.warning("worker %d failed (%s): its circuit opened, out of routing for %g s", worker_id, problem,
                           open_secs)  # fmt: skip

    def _attempt_failed(self, failed: WorkerFailed) -> None:
        """A failed attempt told to the router: the worker's failure, or its engine pacing us (then left
        out of routing for its Retry-After, `router.worker_health`)."""
        if not failed.paced:
            self.worker_failed(failed.worker_id, str(failed))
        elif failed.retry_after is not None:
            self.router.health.paced(failed.worker_id, failed.retry_after)

    def _worker_left(self, worker_id: int, why: str) -> None:
        """A worker left routing as gone or unreachable: what it was still answering fails now rather than
        at the read timeout, and goes to another worker if the client has had nothing of it yet."""
        failed = self.upstream.abandon(worker_id, why)
        if failed:
            logger.warning("worker %d left routing (%s): its %d open exchanges failed", worker_id, why, failed)

    def worker_answered(self, worker_id: int) -> None:
        """A worker answered a request: its circuit breaker's count of failures starts again."""
        if self.router.health.succeeded(worker_id) == "closed":
            logger.warning("worker %d answered its probe: its circuit closed, back in routing", worker_id)

    # ------------------------------------------------------------------ one request
    async def answer(self, route: str, request: StreamCall) -> None:
        """Answer one request whose body is in; a cancellation once the client has gone
        (``request.is_disconnected()``) is the end of the request, counted as such."""
        outcome = "ok"
        received = time.perf_counter()
        booking_id = new_request_id()
        passed = self.client_headers.read(request, booking_id, route)
        # The request id (and CORS) on every answer; the request's span's timeline, if exported.
        reply = WithHeaders(request, passed.answer, passed.span.timeline if passed.span is not None else None)
        try:
            outcome = await self._proxy(
                route, request.body, request.authorization, reply, received, booking_id, passed.upstream
            )
        except Refused as refused:
            outcome = refused.outcome
            await reply.whole(refused.status, refused.headers, refused.body)
        except asyncio.CancelledError:
            if not reply.is_disconnected():
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            outcome = "client_disconnected"
        except Exception:
            # A defect, not a worker's failure or the client's: said as JSON and counted, never a bare
            # 500 (after the first byte the protocol closes the connection, the stream cut short).
            outcome = "internal_error"
            if reply.answered:  # the protocol logs it and closes the connection
                self._ended(route, passed, outcome)
                raise
            logger.exception("proxy: a request on %s failed", route)
            message = "the proxy failed on this request (its log says why)"
            failed = Refused.error(500, "internal_error", message, outcome)
            await reply.whole(failed.status, failed.headers, failed.body)
        self._ended(route, passed, outcome)

    def _ended(self, route: str, passed: Passed, outcome: str) -> None:
        if passed.span is not None and self.tracing is not None:
            self.tracing.end(passed.span, outcome, {"kv_router.request_id": passed.request_id})
        self.metrics.count(route, outcome)

    def _too_large(self) -> Refused:
        message = f"request body exceeds the limit of {self._max_body_bytes} bytes"
        return Refused.error(413, "invalid_request_error", message, "bad_request")

    async def _proxy(
        self,
        route: str,
        body: bytes,
        authorization: bytes | None,
        reply: WithHeaders,
        received: float,
        request_id: str,
        passed: bytes,
    ) -> str:
        """``request_id``: the booking's; ``passed``: the header lines the worker gets of the client's
        (request id, trace context)."""
        try:
            decoded = self._decoders[route](body)
            request = decoded.body if isinstance(decoded, PackedIds) else decoded
            model = request.model
            # Token ids as packed u32 from here on, text as it came: bytes are not tracked by the cyclic GC,
            # while a list of ints held for the stream's life is walked by every young collection (at 100
            # streams of 256 tokens, 25k visits each, most of its pause).
            prompt: str | bytes
            rest_ids = rest_bytes = 0  # a batch's other prompts (`batch_rest`)
            if isinstance(request, TokenIdsBody):
                prompt = decoded.packed if isinstance(decoded, PackedIds) else bytes(pack_tokens(request.prompt))
                if not prompt:
                    raise ValueError("prompt is empty")
            elif isinstance(request, CompletionBody):
                given = prompt_token_ids(request.prompt)
                prompt = given if isinstance(given, str) else bytes(pack_tokens(given))
                rest_ids, rest_bytes = batch_rest(request.prompt)
            elif not request.messages:
                raise ValueError("messages is empty")
            else:
                prompt = ""
        except (*UNDECODABLE, ValueError) as exc:
            raise Refused.error(400, "invalid_request_error", str(exc), "bad_request") from None
        workers = self.workers_for(model)
        if not workers:
            raise self._unserved(model)
        # Dynamo's nvext hints, read as /v1/route reads a PreprocessedRequest's routing, and vLLM's
        # cache_salt as the cache namespace.
        nvext = request.nvext if request.nvext is not None else NvExt()
        query = queries_instance(nvext.annotations)  # Dynamo's query_instance_id: nothing booked
        # A text or chat prompt for workers whose caches are predicted from the routing tokens alone (no KV
        # events): its bytes serve (`api.proxy.prompt_bytes`). Not for an instance query, whose answer is the
        # tokens; token ids as given are the engine's own.
        by_bytes = (
            isinstance(prompt, str)
            and self._by_bytes_without_events
            and not query
            and all(map(self.router.predicts_only, workers))
        )
        # Before a worker's /tokenize, which the cap does not hold back; an instance query takes no slot.
        full = None if query else self.admission.refusal()
        if full is not None:
            raise _queue_refusal(full, self.config.proxy_retry_after_secs)
        try:
            if isinstance(prompt, bytes):
                packed = prompt
                self.metrics.prompt("ids")
            elif by_bytes:
                packed = chat_bytes(request) if isinstance(request, ChatBody) else text_bytes(prompt)
                self.metrics.prompt("bytes")
            else:
                # With no local tokenizer files the workers tokenize: those in routing only (a hung one
                # would hold the request for its read timeout), unless none is.
                tokenizing = self.router.health.usable(workers) or workers
                if isinstance(request, ChatBody):
                    packed = await self.tokenizer.chat(request, tokenizing)
                else:
                    assert isinstance(request, CompletionBody)
                    packed = await self.tokenizer.text(model, prompt, tokenizing, request.add_special_tokens)
        except TokenizeFailed as exc:
            raise Refused.error(503, "service_unavailable", str(exc), "tokenize_failed") from None
        except PromptRefused as exc:
            raise Refused.error(400, "invalid_request_error", str(exc), "bad_request") from None
        if not packed:
            raise Refused.error(400, "invalid_request_error", "the prompt has no tokens", "bad_request")
        routing_tokens = token_count(packed)
        if routing_tokens > self._max_prompt_tokens:
            refusal = prompt_too_long(routing_tokens, self._max_prompt_tokens)
            raise Refused.error(refusal.status, "invalid_request_error", refusal.message, "bad_request")
        timeline = reply.timeline  # None unless spans are exported
        if timeline is not None:
            timeline.tokenized = time.time_ns()
        stream = request.stream
        by_id = {worker.worker_id: worker for worker in workers}
        hints = nvext.routing_hints(cache_salt=request.cache_namespace)
        try:
            routing = routing_call(
                self.router,
                packed,
                hints,
                request_id=None if query else request_id,
                field_prefix="nvext.",
                serving=by_id.keys(),
            )
        except ApiError as exc:  # counted as a bad request: its type is no outcome of the proxy's
            raise Refused.error(exc.status, "invalid_request_error", exc.message, "bad_request") from None
        if rest_ids or rest_bytes:
            # Booked with the whole batch: routed by its first prompt alone it loaded the worker as one
            # request. Texts not tokenized are counted at the first's tokens per byte.
            per_byte = routing_tokens / max(len(prompt.encode()), 1) if isinstance(prompt, str) else 1.0
            routing_tokens += rest_ids + math.ceil(rest_bytes * per_byte)
            routing.isl_tokens = routing_tokens
        if route in _BY_LOAD:
            routing.request.router_config_override = _NO_CACHE_CREDIT
            routing.one_leg = True
        if routing.pinned is not None and routing.pinned[0] not in by_id:
            message = f"nvext.backend_instance_id: worker {routing.pinned[0]} does not serve model {model!r} over HTTP"
            raise Refused.error(400, "invalid_request_error", message, "bad_request")
        if query:
            return await self._instance_query(route, model, packed, stream, routing, set(by_id), request_id, reply)
        del decoded, request, prompt
        # What the worker gets of the client's headers besides the content type: its credentials, its
        # request id and trace context.
        headers = passed + (b"authorization: " + authorization + b"\r\n" if authorization is not None else b"")
        path = _PATHS[route]
        try:
            async with self.admission.slot(routing.request, routing_tokens):
                bytes_routed = routing_tokens if by_bytes else 0
                return await self._attempts(
                    routing, by_id, path, body, headers, stream, reply, received, request_id, bytes_routed
                )
        except QueueRejected as exc:  # no slot under the concurrency cap (api.proxy.admission)
            raise _queue_refusal(exc, self.config.proxy_retry_after_secs) from None

    async def _attempts(
        self,
        routing: RoutingCall,
        by_id: dict[int, WorkerConfig],
        path: bytes,
        body: bytes,
        headers: bytes,
        stream: bool,
        reply: WithHeaders,
        received: float,
        request_id: str,
        bytes_routed: int,
    ) -> str:
        """Book and forward, again after a failure before the client had a byte (`api.proxy.retry`):
        on the next best worker, else (all tried, or pinned) the same ones after the backoff; the retries
        spent on failing prefill legs, once more on the decode worker alone (`_decode_worker_may_prefill`),
        a retry too: counted, and not after ``proxy_retry_budget_secs``.
        ``bytes_routed``: the routing tokens of a prompt routed by its bytes (`api.proxy.prompt_bytes`), else 0."""
        timeline = reply.timeline
        candidates = set(by_id) if routing.among is None else set(by_id) & routing.among
        among = set(candidates)
        pinned = {rank[0] for rank in (routing.pinned, routing.pinned_prefill) if rank is not None}
        failures: list[str] = []
        started = time.monotonic() - (time.perf_counter() - received)  # the budget runs from the body in
        retry = 0
        local_prefill_reason: str | None = None  # the last attempt's, once the prefill legs failed
        while True:
            try:
                if timeline is not None:
                    timeline.deciding = time.time_ns()
                decision = await self._book(routing, among, local_prefill_reason)
                if timeline is not None:
                    timeline.decided = time.time_ns()
            except Refused as refused:
                if not failures or refused.outcome != "no_worker":
                    raise
                break  # the workers that failed are out of routing now: nobody left to try
            worker = by_id[decision.worker_id]
            try:
                legs = self.handoff.legs(decision, by_id)
                if legs is None:
                    outcome = await self._forward(
                        worker, decision, path, body, headers, stream, reply, received, timeline, bytes_routed
                    )
                else:
                    # Two legs (`api.proxy.handoff`): both carry one request id, as vLLM's P/D proxy sends
                    # it (the client's, passed on in ``headers``, unless its header has another name).
                    both = headers
                    if self.client_headers.name != b"x-request-id":
                        both += b"x-request-id: " + request_id.encode() + b"\r\n"
                    forward = self._decode_leg(worker, decision, path, both, stream, received, bytes_routed)
                    # The decode leg tells its worker's breaker, if it is sent (a prefill leg refused is not).
                    outcome = await self.handoff.run(legs, path, body, both, reply, forward)
                self._refused_by_engine(outcome, request_id)
                return outcome
            except Refused as refused:  # a prefill leg's 4xx, the client's answer
                self._refused_by_engine(refused.outcome, request_id)
                raise
            except WorkerFailed as exc:  # again without that worker (or prefill worker); bookings freed below
                if reply.answered:
                    # The client has this answer's head: neither a retry nor a 502 may follow it (a
                    # failure after the first byte is the stream's error event, `_stream_end`). A defect
                    # if reached: the protocol logs it and closes the connection.
                    raise
                failed_id, problem, failed = exc.worker_id, str(exc), exc
                # Its prompt computed on neither leg that failed: not predicted cached there for the next attempt.
                self.router.forget_uncomputed_predictions(request_id)
            finally:
                self.router.mark_free(request_id)
            failures.append(problem)
            self._attempt_failed(failed)
            among.discard(failed_id)
            # A request needs a worker that decodes (on an aggregated fleet, any of them); none left to
            # try, or the one that failed pinned: the same ones again.
            if failed_id in pinned or not any(by_id[left].serves("decode") for left in among):
                among = set(candidates)
            retry += 1
            # An engine's Retry-After is its own: waited for only when the retry may go to it again.
            retry_after = failed.retry_after if failed_id in among else None
            delay = self.retry.delay(retry, retry_after, started, time.monotonic())
            if delay is None:
                if (
                    local_prefill_reason is None
                    and _decode_worker_may_prefill(failed, routing)
                    and self.retry.within_budget(started, time.monotonic())
                ):
                    # As a decision with no prefill worker left would: the decode worker alone, at once.
                    local_prefill_reason = "its prefill legs failed and no retry was left (" + "; ".join(failures) + ")"
                    self.metrics.retried("upstream_error")
                    continue
                break
            self.metrics.retried("overloaded" if failed.answer is not None else "upstream_error")
            await asyncio.sleep(delay)
        if failed.answer is not None:  # the engine's own 429 / 503 and its Retry-After, as it sent them
            status, answer_headers, content = failed.answer
            await reply.whole(status, answer_headers, content)
            return "upstream_status"
        raise Refused.error(502, "upstream_error", "no worker answered: " + "; ".join(failures), "upstream_error")

    async def _instance_query(
        self,
        route: str,
        model: str,
        packed: bytes,
        stream: bool,
        routing: RoutingCall,
        among: set[int],
        request_id: str,
        reply: StreamCall,
    ) -> str:
        """Dynamo's ``query_instance_id`` (`api.proxy.instance_query`): the decision, with the request
        booked nowhere (no request id) and sent to no worker."""
        if routing.among is not None:
            among &= routing.among
        decision = await self._book(routing, among)
        content_type, body = instance_reply(route, model, packed, decision, request_id, stream)
        headers = [
            (b"content-type", content_type),
            (b"x-kv-router-worker", str(decision.worker_id).encode()),
            (b"x-kv-router-dp-rank", str(decision.dp_rank).encode()),
            (b"x-kv-router-cached-tokens", str(decision.cached_tokens).encode()),
        ]
        await reply.whole(200, headers, body)
        return "instance_query"

    async def _book(
        self, routing: RoutingCall, among: set[int], local_prefill_reason: str | None = None
    ) -> RouteDecision:
        started = time.perf_counter()
        routed = routing.request
        try:
            decision = await self.router.new(
                routed,
                among=among,
                pinned_worker=routing.pinned,
                pinned_prefill=routing.pinned_prefill,
                isl_tokens=routing.isl_tokens,
                one_leg=routing.one_leg,
                local_prefill_reason=local_prefill_reason,
            )
            if routed.request_id is not None:
                self.router.hold(routed.request_id)  # freed by `_attempts` on every path, however long it runs
        except QueueRejected as exc:
            raise _queue_refusal(exc, self.config.proxy_retry_after_secs) from None
        except WorkersUnavailable as exc:  # out of routing after failures: back when a circuit half-opens
            wait = exc.retry_after_secs
            extra = {} if wait is None else {"retry_after": str(max(1, math.ceil(wait)))}
            raise Refused.error(503, "service_unavailable", str(exc), "no_worker", **extra) from None
        except AllWorkersOverloaded as exc:  # busy thresholds: passes as the workers' load does
            retry_after = str(self.config.proxy_retry_after_secs)
            raise Refused.error(503, "service_unavailable", str(exc), "no_worker", retry_after=retry_after) from None
        except NoEligibleWorker as exc:  # no worker with the taints asked for: waiting does not bring one
            raise Refused.error(503, "service_unavailable", str(exc), "no_worker") from None
        except InvalidRequest as exc:  # a routing hint that does not fit the fleet (a pin to a prefill worker)
            # As api.hints refuses one.
            raise Refused.error(422, "invalid_request_error", str(exc), "bad_request") from None
        self.decisions.decision(decision, token_count(routed.tokens), time.perf_counter() - started)
        return decision

    async def _forward(
        self,
        worker: WorkerConfig,
        decision: RouteDecision,
        path: bytes,
        body: bytes,
        headers: bytes,
        stream: bool,
        reply: StreamCall,
        received: float,
        timeline: Timeline | None = None,
        bytes_routed: int = 0,
    ) -> str:
        """One attempt on one worker; raises `WorkerFailed` while the client has received nothing (`unanswered`).
        An answer is told to the worker's breaker (a stream broken mid-way told it its failure).
        ``received``: when the request's body was in (perf_counter), for the proxy's added latency;
        ``bytes_routed``: the routing tokens of a prompt routed by its bytes (else 0), see `_calibrate`."""
        request_id = decision.request_id
        assert request_id is not None and worker.url is not None
        if worker.dp_size > 1:
            headers += b"x-data-parallel-rank: " + str(decision.dp_rank).encode() + b"\r\n"
        ours = receipt_headers(decision)
        streaming = start = None
        if stream:
            on_events = None
            if self._track_output:
                on_events = _OutputProgress(self.router.record_output, request_id, self.router.config.block_size)
            start = _StreamStart(self, reply, request_id, worker.worker_id, ours)
            streaming = Streaming(start, on_events, finished_stream)
        sending = time.perf_counter()
        if timeline is not None:
            timeline.sent = time.time_ns()
        try:
            patient = None if stream else partial(self.router.in_routing, worker.worker_id)
            connection = await self.upstream.open(
                worker.url, path, body, headers, streaming, patient, worker_id=worker.worker_id
            )
        except UpstreamError as exc:
            raise unanswered(WorkerFailed, worker.worker_id, exc) from None
        if timeline is not None:
            timeline.first_byte = time.time_ns()  # the answer's head; a stream's first events below
        try:
            status = connection.status
            if status in OVERLOADED:
                raise await _overloaded(connection, worker.worker_id)
            if status >= 500:
                raise WorkerFailed(worker.worker_id, f"HTTP {status}")
            # A new list: ``begin`` may yet read ``ours`` (it adds the content type itself).
            with_type = [(b"content-type", connection.content_type or _JSON), *ours]
            if not stream or status != 200:
                try:
                    content = await connection.read()
                except UpstreamError as exc:
                    raise unanswered(WorkerFailed, worker.worker_id, exc) from None
                try:
                    await reply.whole(status, with_type, content)
                finally:  # after the client has it: off the latency it sees
                    self._answered_whole(decision, status, content, bytes_routed)
                self.worker_answered(worker.worker_id)
                return "ok" if status == 200 else "upstream_status"
            problem = await self._handed_on(connection, worker.worker_id, sending - received)
            if timeline is not None and connection.begun_at:
                timeline.first_byte = time.time_ns() - int((time.perf_counter() - connection.begun_at) * 1e9)
            outcome = await self._stream_end(connection, decision, reply, problem, bytes_routed)
            assert start is not None  # a stream
            if outcome == "ok" and not start.probe_answered:
                self.worker_answered(worker.worker_id)
            return outcome
        finally:
            connection.release()  # back to the pool if read to its end; else closed, so the engine stops

    def _refused_by_engine(self, outcome: str, request_id: str) -> None:
        """An engine that refused the request (a 4xx, on either leg) never computed its prompt: it is
        predicted cached on no leg (the next request sharing the prefix was steered to a worker holding
        none of it). Before `mark_free`."""
        if outcome == "upstream_status":
            self.router.forget_uncomputed_predictions(request_id)

    def _answered_whole(self, decision: RouteDecision, status: int, content: bytes, bytes_routed: int) -> None:
        """A whole answer is in: the booking's prefill is done, and the answer's usage is compared with
        the prediction and counted as the request's output; an engine's refusal (not 200) is neither
        (`_refused_by_engine`)."""
        request_id = decision.request_id
        assert request_id is not None
        if status != 200:
            return
        self.router.mark_prefill(request_id)
        usage = reported_usage(content)
        self._calibrate(decision, usage, bytes_routed)
        if usage is not None and usage.completion_tokens and self._track_output:
            self.router.record_output(request_id, usage.completion_tokens)

    def _decode_leg(
        self, worker: WorkerConfig, decision: RouteDecision, path: bytes, headers: bytes, stream: bool, received: float,
        bytes_routed: int,
    ) -> Forward:  # fmt: skip
        """The decode leg of a two-leg request: `_forward` of the body the hand-off gives."""

        async def forward(body: bytes, reply: StreamCall) -> str:
            return await self._forward(
                worker, decision, path, body, headers, stream, reply, received, bytes_routed=bytes_routed
            )

        return forward

    async def _handed_on(self, connection: UpstreamConnection, worker_id: int, before_sent: float) -> str | None:
        """The stream handed on from the read callback: returns at its end, what went wrong after its
        first byte (None: nothing); raises `WorkerFailed` while the client has had nothing (`unanswered`)."""
        try:
            begun = await connection.handed_on()
        except UpstreamError as exc:
            if not connection.begun:
                raise unanswered(WorkerFailed, worker_id, exc) from None
            # Lost after its last event (the answer's framing cut short): the client has the whole stream.
            problem: str | None = None if finished_stream(connection.tail) else str(exc)
        except asyncio.CancelledError:
            # Written in the read callback: what the tail holds has gone to the client.
            if not finished_stream(connection.tail):
                raise
            _client_left_at_the_end()
            problem = None
        else:
            if not begun:
                raise WorkerFailed(worker_id, "the stream ended before its first byte")
            problem = None
        self.metrics.added.observe(before_sent + connection.first_sent_at - connection.begun_at)
        return problem

    async def _stream_end(
        self, connection: UpstreamConnection, decision: RouteDecision, reply: StreamCall, problem: str | None,
        bytes_routed: int,
    ) -> str:  # fmt: skip
        """A stream's end: its usage compared with the prediction, or the failure told as an SSE event."""
        if problem is None:
            ending = connection.tail
            # An OpenAI stream ends with [DONE]; a worker killed mid-stream may just close the connection.
            if finished_stream(ending):
                self._calibrate(decision, _usage_in_stream(ending), bytes_routed)
            else:
                problem = "the stream ended before data: [DONE]"
        if problem is not None:
            # The client has its headers and part of the stream: say what happened as an SSE event.
            message = f"worker {decision.worker_id} failed mid-stream: {problem}"
            self.worker_failed(decision.worker_id, message)
            await reply.end(b"data: " + error_body(502, "upstream_error", message) + b"\n\n")
        else:
            await reply.end()
        return "ok" if problem is None else "upstream_error"

    def _calibrate(self, decision: RouteDecision, usage: Usage | None, bytes_routed: int) -> None:
        """The prediction against the engine's count. A prompt routed by its bytes was predicted in routing
        tokens of four bytes (``bytes_routed`` of them): converted by the prompt's own tokens per routing token."""
        if usage is None or usage.cached_tokens is None:
            return
        disaggregation = decision.disaggregation
        if disaggregation is not None and disaggregation.prefill is not None:
            return  # the decode worker counts the KV handed to it as cached: no measure of the prediction
        predicted = decision.cached_tokens
        if bytes_routed:
            if not usage.prompt_tokens:
                return
            predicted = round(predicted * usage.prompt_tokens / bytes_routed)
        self.metrics.cached_tokens(decision.worker_id, predicted, usage.cached_tokens)


class _StreamStart:
    """What starts a stream handed on from the worker connection's read callback (`Begin`): the booking's
    prefill is done, the client's head goes out with the first events, and a half-open circuit has its
    probe's answer now (``probe_answered``: its end is not told again), not at the stream's end: other
    requests may not probe the worker meanwhile, and a stream may last minutes. A closed circuit is told
    at the end, so that streams broken mid-way stay failures in a row."""

    __slots__ = ("headers", "probe_answered", "proxy", "reply", "request_id", "worker_id")

    def __init__(self, proxy: Proxy, reply: StreamCall, request_id: str, worker_id: int, headers: Headers) -> None:
        self.proxy = proxy
        self.reply = reply
        self.request_id = request_id
        self.worker_id = worker_id
        self.headers = headers
        self.probe_answered = False

    def __call__(self, content_type: bytes | None) -> Sink:
        proxy = self.proxy
        proxy.router.mark_prefill(self.request_id)
        if proxy.router.health.state(self.worker_id) == "half_open":
            proxy.worker_answered(self.worker_id)
            self.probe_answered = True
        return self.reply.begin(200, [(b"content-type", content_type or _JSON), *self.headers])


class _OutputProgress:
    """Tells the router how many tokens a stream has generated, counting the SSE events handed on: an
    OpenAI stream sends one per token, besides a role-only first chunk of a chat, a usage report and
    ``[DONE]`` (at most three over, at the stream's end). Told at the first event, then once ``every``
    more have passed, so that the router is at most a quarter of a block behind (a new output block is
    what changes the booking) at a few calls per block; per piece, a count of ``\\n\\n`` and a compare."""

    __slots__ = ("events", "every", "next_at", "record", "request_id")

    def __init__(self, record: Callable[[str, int], bool], request_id: str, block_size: int) -> None:
        self.record = record
        self.request_id = request_id
        self.every = max(1, block_size // 4)
        self.events = 0
        self.next_at = 1

    def __call__(self, data: bytes) -> None:
        events = self.events = self.events + (data.count(b"\n\n") or data.count(b"\r\n\r\n"))
        if events >= self.next_at:
            self.next_at = events + self.every
            self.record(self.request_id, events)


def _decode_worker_may_prefill(failed: WorkerFailed, routing: RoutingCall) -> bool:
    """Whether a request whose retries are spent goes once more, to its decode worker alone: its last
    prefill leg failed (an overloaded engine's answer is the client's, a pinned prefill leg not moved)."""
    return isinstance(failed, PrefillFailed) and failed.answer is None and routing.pinned_prefill is None


def _queue_refusal(rejected: QueueRejected, retry_after: int) -> Refused:
    """No room: the router's queue, or the proxy's wait for a slot, full or timed out."""
    return Refused.error(429, "rate_limit_exceeded", str(rejected), "queue_rejected", retry_after=str(retry_after))


async def _overloaded(connection: UpstreamConnection, worker_id: int) -> WorkerFailed:
    """An overloaded engine's answer, read whole, as the failure that makes the proxy try again."""
    status = connection.status
    try:
        content = await connection.read()
    except UpstreamError as exc:
        return WorkerFailed(worker_id, str(exc))
    answer, retry_after = overloaded_answer(connection, worker_id, content)
    return WorkerFailed(worker_id, f"HTTP {status}", answer, retry_after)


def _client_left_at_the_end() -> None:
    """The request's task was cancelled because its client left once it had the stream's last event:
    the official `openai` client closes the connection right after ``data: [DONE]``, often before the
    worker's end of the HTTP answer. The request is done, not abandoned: it carries on to its end
    (``ok``, its usage calibrated, its latency observed) as if the client had stayed."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


def _converted(
    body: type[_Converted], convert: Callable[[_Converted], CompletionBody | ChatBody]
) -> Callable[[bytes], CompletionBody | ChatBody]:
    decode = msgspec.json.Decoder(body).decode
    return lambda raw: convert(decode(raw))


class PackedIds(NamedTuple):
    """A completion whose prompt of token ids the C parser took out of the JSON as packed u32
    (`api._native.split_json_tokens`): the body decoded without them, and the ids."""

    body: TokenIdsBody
    packed: bytes


def _completion_decoder() -> Callable[[bytes], PackedIds | TokenIdsBody | CompletionBody]:
    """Each body decoded once: a prompt the raw bytes show to be token ids (``"prompt": [`` and a digit)
    is parsed straight into packed u32 by the C accelerator and the rest decoded by msgspec, or decoded
    and range-checked by msgspec in one pass; any other by the general decoder. The look at the bytes
    only picks the decoder: a body it misjudges is decoded by the other one too, with the same answer
    (the general decoder's prompt goes through `prompt_token_ids`' same checks), and whatever the C
    parser declines (a float, an id out of range, a repeated key) msgspec decodes, with its own error."""
    ids = msgspec.json.Decoder(TokenIdsBody).decode
    general = msgspec.json.Decoder(CompletionBody).decode

    def decode(body: bytes) -> PackedIds | TokenIdsBody | CompletionBody:
        key = body.find(b'"prompt"')
        if key >= 0 and _IDS_PROMPT.match(body, key):
            split = accel.split_json_tokens(body, b"prompt") if NATIVE else None
            if split is not None:
                packed, start, end = split
                try:
                    return PackedIds(ids(body[:start] + b"[]" + body[end:]), packed)
                except msgspec.DecodeError:
                    pass  # the body's own bytes decoded below: errors at their positions in it
            try:
                return ids(body)
            except msgspec.ValidationError:
                pass  # another field, a batch, an id out of range: the general decoder says what
        return general(body)

    return decode


def _in_openai_shape(reply: Reply) -> Reply:
    """A refusal of the service's (the API token's 401) with its message and type in OpenAI's error
    shape, as the proxy's own refusals, its headers kept."""
    error = msgspec.json.decode(reply.body)["error"]
    return Reply(reply.status, error_body(reply.status, error["type"], error["message"]), headers=reply.headers)


def _header_bytes(reply: Reply) -> Headers:
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in reply.headers]


def _usage_in_stream(tail: bytes) -> Usage | None:
    """The last usage report among a stream's last events."""
    if b'"usage"' not in tail:
        return None
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            usage = reported_usage(line[6:])
            if usage is not None:
                return usage
    return None

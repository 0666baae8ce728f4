"""The hot routes, bytes in and bytes out: decode with msgspec, call `KvRouter`, encode the reply.

One method per route; each takes a `Call` and returns a `Reply`, so the HTTP protocol and the
FastAPI routes share them. Every reply, error or not, is counted by method and outcome. All input
checks (schema, token ids in u32, packed length, prompt size, request id) run before the router is
called, and the router itself validates before it changes anything, so a refused request leaves
the router's state as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from typing import Any, ParamSpec

import msgspec

from api.auth import Access, ApiAuth
from api.codec import BodyDecoder, Call, Reply, encode
from api.config import ServiceConfig
from api.contract import HotHandler, HotOutcome
from api.eager import Suspended, start
from api.errors import (
    ApiError,
    ClientDisconnected,
    InvalidBody,
    MalformedBody,
    UnknownRequestId,
    error_reply,
    prompt_too_long,
)
from api.hints import routing_call
from api.metrics import ApiMetrics
from api.wire import (
    MAX_REQUEST_ID,
    EventsReply,
    MarkReply,
    MarkRequest,
    NewRequest,
    NvExtResponse,
    OutputProgress,
    PotentialLoadsReply,
    PotentialLoadsRequest,
    RouteBody,
    RouteReply,
    RouterFreeMarked,
    RouterMarkFree,
    RouterMarkPrefill,
    RouterNew,
    RouterNewResponse,
    RouterPotentialLoads,
    RouterPotentialLoadsResponse,
    RouterPrefillMarked,
    RouterQueueRejected,
    RouterRequest,
    RouterRoute,
    RouterRouteResponse,
    WorkerIdInfo,
    is_request_id,
    queries_instance,
)
from indexer.events import RouterEvent, decode_router_events
from indexer.hashing import unpack_tokens
from router.errors import QueueRejected
from router.kv_router import KvRouter
from router.request_ids import new_request_id
from router.types import RouteDecision, Tokens

__all__ = ["HOT_ACCESS", "HOT_PATHS", "Handlers"]

logger = logging.getLogger(__name__)
P = ParamSpec("P")

# Path -> handler method name; the HTTP protocol and the FastAPI routes both serve these.
HOT_PATHS = {
    "/v1/router": "router",
    "/v1/new": "new",
    "/v1/potential_loads": "potential_loads",
    "/v1/mark_prefill": "mark_prefill",
    "/v1/mark_free": "mark_free",
    "/v1/record_output": "record_output",
    "/v1/events": "events",
    "/v1/overlap": "overlap",
}
# Path -> when it needs the API token (`api.auth`): events change the index; the rest decide or book.
HOT_ACCESS = {path: Access.ADMIN if path == "/v1/events" else Access.DECISION for path in HOT_PATHS}


class Handlers:
    """The hot routes of one app, bound to its router, metrics and limits."""

    def __init__(
        self,
        router: KvRouter,
        metrics: ApiMetrics,
        service: ServiceConfig,
        auth: ApiAuth | None = None,
        relay_events: Callable[[list[RouterEvent]], Awaitable[int]] | None = None,
    ) -> None:
        """``relay_events``: where the events posted here go instead of this router's sequencer, when
        replicas keep an index each (`PlaneLifecycle.relay_events`: it says how many it relayed)."""
        self._router = router
        self._relay_events = relay_events
        self._auth = auth or ApiAuth(None)
        self._metrics = metrics
        self._max_prompt_tokens = service.max_prompt_tokens
        self._new_body: BodyDecoder[NewRequest] = BodyDecoder(NewRequest)
        self._router_body: BodyDecoder[RouterRequest] = BodyDecoder(RouterRequest)
        self._loads_body: BodyDecoder[PotentialLoadsRequest] = BodyDecoder(PotentialLoadsRequest)
        self._mark_body: BodyDecoder[MarkRequest] = BodyDecoder(MarkRequest)
        self._output_body: BodyDecoder[OutputProgress] = BodyDecoder(OutputProgress)
        self._route_body: BodyDecoder[RouteBody] = BodyDecoder(RouteBody)

    def routes(self) -> dict[str, HotHandler]:
        """Path -> handler, each behind the API token where its access class needs it."""
        count = self._metrics.count
        return {
            path: self._auth.guard(HOT_ACCESS[path], getattr(self, name), partial(count, name, "unauthorized"))
            for path, name in HOT_PATHS.items()
        }

    def app_routes(self) -> dict[str, HotHandler]:
        """Path -> handler of the routes served by the FastAPI app only (not the hot protocol), each
        behind the API token where its access class needs it."""
        refused = partial(self._metrics.count, "route", "unauthorized")
        return {"/v1/route": self._auth.guard(Access.DECISION, self.route, refused)}

    # ------------------------------------------------------------------ routes
    async def router(self, call: Call) -> Reply:
        """``POST /v1/router``: Dynamo's tagged ``RouterRequest`` -> ``RouterResponse``."""
        try:
            request = self._router_body.decode(call)
        except Exception as exc:
            return self._error("router", exc)
        if isinstance(request, RouterNew):
            return await self._router_new(request, call)
        if isinstance(request, RouterRoute):
            return await self._guard("route", self._route(request, call, RouterRouteResponse))
        if isinstance(request, RouterPotentialLoads):
            return self._guarded("potential_loads", self._router_potential_loads, request, call)
        if isinstance(request, RouterMarkPrefill):
            return self._guarded("mark_prefill", self._router_mark, request, call)
        return self._guarded("mark_free", self._router_mark, request, call)

    def new(self, call: Call) -> HotOutcome:
        """``POST /v1/new``: pick and book a worker; the reply names it, its overlap and cached tokens.

        Answered on the caller's stack, no coroutine made, unless the request has to wait in the
        router's queue (then the coroutine that waits, `_new_waiting`)."""
        started = time.perf_counter()
        try:
            request = self._new_body.decode(call)
            tokens = self._check_prompt(request.tokens)
            explain = request.explain or call.explain
            if request.request_id is None:
                request = msgspec.structs.replace(request, request_id=_header_id(call) or new_request_id())
            decision = self._router.decide(request, explain=explain)
        except Exception as exc:
            return self._error("new", exc)
        if not isinstance(decision, RouteDecision):
            return self._new_waiting(decision, call, tokens, started)
        return self._new_reply(decision, call, tokens, started)

    async def _new_waiting(
        self, waiting: Coroutine[Any, Any, RouteDecision], call: Call, tokens: int, started: float
    ) -> Reply:
        try:
            decision = await self._queued(waiting, call)
        except Exception as exc:
            return self._error("new", exc)
        return self._new_reply(decision, call, tokens, started)

    def _new_reply(self, decision: RouteDecision, call: Call, tokens: int, started: float) -> Reply:
        try:
            body = encode(decision, call.reply_msgpack)
        except Exception as exc:
            return self._error("new", exc)
        self._metrics.decision(decision, tokens, time.perf_counter() - started)
        self._metrics.count("new")
        return Reply(200, body, call.reply_msgpack, decision.request_id)

    async def route(self, call: Call) -> Reply:
        """``POST /v1/route`` (a FastAPI route, not a hot one): Dynamo's `PreprocessedRequest` with its
        routing hints -> the decision (`RouteReply`); ``{"method": "route"}`` on ``/v1/router`` is the
        same call."""
        try:
            body = self._route_body.decode(call)
        except Exception as exc:
            return self._error("route", exc)
        return await self._guard("route", self._route(body, call, RouteReply))

    def potential_loads(self, call: Call) -> Reply:
        return self._guarded("potential_loads", self._potential_loads, call)

    def mark_prefill(self, call: Call) -> Reply:
        return self._guarded("mark_prefill", self._mark, call, free=False)

    def mark_free(self, call: Call) -> Reply:
        return self._guarded("mark_free", self._mark, call, free=True)

    def record_output(self, call: Call) -> Reply:
        """``POST /v1/record_output``: the request's generated tokens so far (``router_track_output_blocks``)."""
        return self._guarded("record_output", self._record_output, call)

    def events(self, call: Call) -> HotOutcome:
        if self._relay_events is None:
            return self._guarded("events", self._events, call)
        return self._guard("events", self._relayed_events(call, self._relay_events))

    def overlap(self, call: Call) -> Reply:
        return self._guarded("overlap", self._overlap, call)

    # ------------------------------------------------------------------ implementations
    async def _router_new(self, request: RouterNew, call: Call) -> Reply:
        """``new`` on ``/v1/router``; counts its own outcome (not `_guard`): a queue rejection is
        Dynamo's answer, a 200, but counted as ``queue_rejected`` only, as ``/v1/new``'s 429 is."""
        started = time.perf_counter()
        try:
            tokens = self._check_prompt(request.tokens)
            # Dynamo takes the id of `new` from the request-plane context; over HTTP that is X-Request-Id.
            if request.request_id is None:
                request = msgspec.structs.replace(request, request_id=_header_id(call) or new_request_id())
            try:
                decision = self._router.decide(request)
                if not isinstance(decision, RouteDecision):
                    decision = await self._queued(decision, call)
            except QueueRejected as exc:
                self._metrics.count("new", "queue_rejected")
                return self._reply(RouterQueueRejected(rejection=exc.rejection), call, request.request_id)
            response = RouterNewResponse(
                worker_id=decision.worker_id, dp_rank=decision.dp_rank, overlap_blocks=decision.overlap_blocks
            )
            reply = self._reply(response, call, decision.request_id)
        except Exception as exc:
            return self._error("new", exc)
        self._metrics.decision(decision, tokens, time.perf_counter() - started)
        self._metrics.count("new")
        return reply

    async def _route(self, body: RouteBody, call: Call, reply_type: type[RouteReply]) -> Reply:
        started = time.perf_counter()
        tokens = self._check_prompt(body.token_ids, "token_ids")
        if not tokens:
            raise InvalidBody("token_ids: a request needs at least one token")
        mm_routing_info = body.mm_routing_info
        # Without routing tokens Dynamo reads none of it (the request's own tokens are routed), nor does routing_call.
        if mm_routing_info is not None and mm_routing_info.routing_token_ids:
            self._check_prompt(mm_routing_info.routing_token_ids, "mm_routing_info.routing_token_ids")
            # The prompt's length for load when given: bounded as the prompt is (unbounded, it booked
            # any load, past u64 once summed).
            if mm_routing_info.expanded_prompt_len > self._max_prompt_tokens:
                raise prompt_too_long(
                    mm_routing_info.expanded_prompt_len, self._max_prompt_tokens, "mm_routing_info.expanded_prompt_len"
                )
        query = queries_instance(body.annotations)  # answer the choice, book nothing
        # Checked before anything is booked: what cannot be handed back is refused first.
        forward = _forwardable(call, body.token_ids) if body.return_request else None
        request_id = None if query else body.request_id or _header_id(call) or new_request_id()
        routing = routing_call(
            self._router,
            body.token_ids,
            body.routing,
            request_id=request_id,
            model=body.model,
            mm_routing_info=body.mm_routing_info,
            router_config_override=body.router_config_override,
        )
        decision = self._router.decide(
            routing.request,
            pinned_worker=routing.pinned,
            pinned_prefill=routing.pinned_prefill,
            among=routing.among,
            explain=call.explain,
            isl_tokens=routing.isl_tokens,
        )
        if not isinstance(decision, RouteDecision):
            decision = await self._queued(decision, call)
        reply = reply_type(
            worker_id=decision.worker_id,
            dp_rank=decision.dp_rank,
            overlap_blocks=decision.overlap_blocks,
            cached_tokens=decision.cached_tokens,
            request_id=decision.request_id,
            receipt=decision.receipt,
            explanation=decision.explanation,
            disaggregation=decision.disaggregation,
            nvext=NvExtResponse(worker_id=WorkerIdInfo.of(decision), token_ids=_token_list(body.token_ids))
            if query
            else None,
            unused_hints=routing.unused_hints,
            request=_with_routing(forward, decision) if forward is not None else None,
        )
        self._metrics.decision(decision, tokens, time.perf_counter() - started)
        return self._reply(reply, call, decision.request_id)

    async def _queued(self, waiting: Coroutine[Any, Any, RouteDecision], call: Call) -> RouteDecision:
        """A decision that has to wait (in the router's queue, or for its first workers); it watches
        for the client leaving."""
        decision = start(waiting)
        if not isinstance(decision, Suspended):
            return decision
        if call.wait_disconnect is not None:
            return await _unless_disconnected(decision, call.wait_disconnect, self._router.mark_free)
        return await decision

    def _potential_loads(self, call: Call) -> Reply:
        request = self._loads_body.decode(call)
        return self._reply(self._loads(request, PotentialLoadsReply), call)

    def _router_potential_loads(self, request: RouterPotentialLoads, call: Call) -> Reply:
        return self._reply(self._loads(request, RouterPotentialLoadsResponse), call)

    def _loads(self, request: PotentialLoadsRequest, reply_type: type[PotentialLoadsReply]) -> PotentialLoadsReply:
        self._check_prompt(request.tokens)
        loads = self._router.potential_loads(
            request.tokens, request.lora_name, request.cache_namespace, request.block_mm_infos
        )
        queue = self._router.queue_stats()
        return reply_type(loads=loads, pending_count=queue.pending_count, pending_isl_tokens=queue.pending_isl_tokens)

    def _mark(self, call: Call, *, free: bool) -> Reply:
        request_id = _request_id(self._mark_body.decode(call).request_id, call)
        router = self._router
        if (router.mark_free if free else router.mark_prefill)(request_id):
            return self._reply(MarkReply(request_id=request_id, success=True), call, request_id)
        # Not booked here: with replica sync a peer may hold it (its booking on its way), so not a 404.
        if router.pass_mark_to_replicas(request_id, free=free):
            reply = MarkReply(request_id=request_id, success=True, passed_to_replicas=True)
            return Reply(202, encode(reply, call.reply_msgpack), call.reply_msgpack, request_id)
        raise UnknownRequestId(f"request {request_id!r} is not active")

    def _record_output(self, call: Call) -> Reply:
        progress = self._output_body.decode(call)
        request_id = _request_id(progress.request_id, call)
        if not self._router.record_output(request_id, progress.generated_tokens):
            raise UnknownRequestId(f"request {request_id!r} is not active")
        return self._reply(MarkReply(request_id=request_id, success=True), call, request_id)

    def _router_mark(self, request: RouterMarkPrefill | RouterMarkFree, call: Call) -> Reply:
        request_id = _request_id(request.request_id, call)
        router = self._router
        # Passed to the replicas (an id a peer may hold, its booking not here yet) counts as a success.
        if isinstance(request, RouterMarkPrefill):
            marked = router.mark_prefill(request_id) or router.pass_mark_to_replicas(request_id, free=False)
            return self._reply(RouterPrefillMarked(success=marked), call, request_id)
        freed = router.mark_free(request_id) or router.pass_mark_to_replicas(request_id, free=True)
        return self._reply(RouterFreeMarked(success=freed), call, request_id)

    def _events(self, call: Call) -> Reply:
        events = decode_router_events(call.body, msgpack=call.msgpack)
        return self._apply_events(events, call)

    async def _relayed_events(self, call: Call, relay: Callable[[list[RouterEvent]], Awaitable[int]]) -> Reply:
        events = decode_router_events(call.body, msgpack=call.msgpack)
        relayed = await relay(events)
        if not relayed:  # the event plane has not started: here alone, as without replicas
            return self._apply_events(events, call)
        return self._reply(EventsReply(received=len(events), applied=0, rejected=0, relayed=relayed), call)

    def _apply_events(self, events: list[RouterEvent], call: Call) -> Reply:
        report = self._router.sequencer.ingest_reported(events)
        reply = EventsReply(
            received=len(events),
            applied=report.applied,
            rejected=report.rejected,
            duplicate=report.duplicate,
            held=report.held,
            errors=list(report.reasons),
        )
        return self._reply(reply, call)

    def _overlap(self, call: Call) -> Reply:
        request = self._loads_body.decode(call)
        self._check_prompt(request.tokens)
        report = self._router.overlap(
            request.tokens, request.lora_name, request.cache_namespace, request.block_mm_infos
        )
        return self._reply(report, call)

    # ------------------------------------------------------------------ helpers
    def _check_prompt(self, tokens: Tokens, field: str = "tokens") -> int:
        """The prompt's token count, after the checks the router must never see fail; errors name
        ``field``."""
        if isinstance(tokens, bytes):
            if len(tokens) % 4:
                raise MalformedBody(
                    f"{field}: packed tokens must be little-endian u32, 4 bytes each; got {len(tokens)} bytes"
                )
            count = len(tokens) // 4
        else:
            count = len(tokens)
        if count > self._max_prompt_tokens:
            raise prompt_too_long(count, self._max_prompt_tokens, field)
        return count

    def _reply(self, value: Any, call: Call, request_id: str | None = None) -> Reply:
        return Reply(200, encode(value, call.reply_msgpack), call.reply_msgpack, request_id)

    async def _guard(self, method: str, work: Coroutine[Any, Any, Reply]) -> Reply:
        """Run one route's work; count its outcome; turn any error into its JSON error reply."""
        try:
            reply = await work
        except Exception as exc:
            return self._error(method, exc)
        self._metrics.count(method)
        return reply

    def _guarded(self, method: str, work: Callable[P, Reply], *args: P.args, **kwargs: P.kwargs) -> Reply:
        """`_guard` for work that never waits: called directly, no coroutine of its own (one less
        layer on every ``mark_free``)."""
        try:
            reply = work(*args, **kwargs)
        except Exception as exc:
            return self._error(method, exc)
        self._metrics.count(method)
        return reply

    def _error(self, method: str, exc: Exception) -> Reply:
        mapped = error_reply(exc)
        if mapped is None:
            logger.exception("%s failed", method, exc_info=exc)
            mapped = error_reply(_Internal(f"internal error in {method}: {type(exc).__name__}"))
            assert mapped is not None
        status, kind, body = mapped
        self._metrics.count(method, kind)
        return Reply(status, body)


def _request_id(body_id: str | None, call: Call) -> str:
    """The body's request id if given, else ``X-Request-Id`` (Dynamo: the payload's, else the context's)."""
    request_id = body_id or _header_id(call)
    if request_id is None:
        raise InvalidBody("request_id is required (body field or X-Request-Id header)")
    return request_id


def _header_id(call: Call) -> str | None:
    """``X-Request-Id`` as a request id, held to the body field's rule (`api.wire.RequestId`): a request
    booked under it is echoed in that header and freed by the body field. `InvalidBody` otherwise."""
    given = call.request_id
    if given is not None and not is_request_id(given):
        raise InvalidBody(
            f"X-Request-Id: a request id is 1 to {MAX_REQUEST_ID} visible ASCII characters, without spaces"
        )
    return given


def _token_list(tokens: Tokens) -> list[int]:
    """Token ids as a list; packed ones are little-endian (Dynamo's int32 blob, ids below 2^31)."""
    return unpack_tokens(tokens) if isinstance(tokens, bytes) else tokens


def _forwardable(call: Call, token_ids: Tokens) -> dict[str, Any]:
    """The request as it came, every field kept (engine-only ones too), our own fields dropped, to be
    handed back; packed token ids (``token_ids``, as decoded) stay packed in msgpack and become a
    sequence in JSON, as Dynamo writes them. `InvalidBody` if it cannot be written back in the reply's
    encoding (a msgpack extension type in JSON)."""
    raw: dict[str, Any] = msgspec.msgpack.decode(call.body) if call.msgpack else msgspec.json.decode(call.body)
    for ours in ("method", "request_id", "return_request"):
        raw.pop(ours, None)
    if isinstance(token_ids, bytes):
        # Also when they came as JSON's base64 text, which Dynamo's reader refuses (a sequence or bytes only).
        raw["token_ids"] = token_ids if call.reply_msgpack else _token_list(token_ids)
    if not isinstance(raw.get("routing"), dict):
        raw["routing"] = {}
    try:
        encode(raw, call.reply_msgpack)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidBody(f"return_request: the request cannot be handed back in this encoding: {exc}") from None
    return raw


def _with_routing(request: dict[str, Any], decision: RouteDecision) -> dict[str, Any]:
    """The request with the decision in ``routing.backend_instance_id`` / ``dp_rank``, ready to forward;
    on a disaggregated fleet the decode worker there, and the remote prefill leg, if any, in
    ``prefill_worker_id`` / ``prefill_dp_rank`` and ``decode_worker_id``."""
    request["routing"].update(backend_instance_id=decision.worker_id, dp_rank=decision.dp_rank)
    how = decision.disaggregation
    if how is not None:
        request["routing"]["decode_worker_id"] = decision.worker_id
        if how.prefill is not None:
            request["routing"].update(prefill_worker_id=how.prefill.worker_id, prefill_dp_rank=how.prefill.dp_rank)
    return request


class _Internal(ApiError):
    status = 500
    type = "internal_error"


async def _unless_disconnected(
    decision: Suspended[RouteDecision], disconnected: Callable[[], Awaitable[None]], free: Callable[[str], bool]
) -> RouteDecision:
    """Await a decision waiting in the queue, but give up (and free its place) if the client goes
    away first: a request nobody will mark free must not be booked. ``free``: the router's `mark_free`,
    for a decision made in the same turn as the client left (the queue freed as it went)."""
    task = decision.task(asyncio.get_running_loop())
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        left = watcher.done() and not watcher.cancelled() and watcher.exception() is None
        watcher.cancel()
    if not task.done():
        task.cancel()  # the router leaves the queue, or undoes a booking made in the meantime
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnected("client disconnected while the request waited in the queue")
    if left:  # decided as the client left: booked for nobody, so given back
        booked = task.result().request_id if task.exception() is None else None
        if booked is not None:
            free(booked)
        raise ClientDisconnected("client disconnected as the request left the queue")
    return task.result()

"""The FastAPI routes: the hot routes as thin adapters onto `Handlers`, and the admin and
operations routes (workers, dump, info, health, readiness, metrics).

Bodies are decoded and encoded with msgspec here too; FastAPI contributes routing, path
parameters and the OpenAPI document, whose schemas come from the same msgspec types (`Schemas`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from api.asgi import wait_disconnect
from api.auth import Access, ApiAuth
from api.codec import JSON, MSGPACK, BodyDecoder, Call, encode, is_msgpack, read_head
from api.config import Settings
from api.contract import HotHandler, answered
from api.handlers import HOT_PATHS, Handlers
from api.native import active_accelerators
from api.openapi import Schemas
from api.plane_lifecycle import PlaneLifecycle
from api.process_metrics import ProcessGroup
from api.proxy.wire import ROUTES, error_body
from api.version import package_version
from api.wire import (
    EventPlaneHealth,
    EventsReply,
    MarkReply,
    MarkRequest,
    NewRequest,
    OutputProgress,
    PotentialLoadsReply,
    PotentialLoadsRequest,
    PredictedRouterEvent,
    RouteBody,
    RouteReply,
    RouterRequest,
    RouterResponse,
    ServiceInfo,
    WorkerRegistration,
    WorkersReply,
    WorkerStatus,
)
from indexer.events import RouterEvent
from indexer.sequencer import StreamStatus
from router.doctor import ConfigDoctor, Problem
from router.errors import UnknownWorker
from router.kv_router import KvRouter
from router.types import OverlapReport, RouteDecision, WorkerConfig

__all__ = [
    "LIVENESS_ALIASES",
    "READINESS_ALIASES",
    "ServiceState",
    "add_admin_routes",
    "add_hot_routes",
    "add_proxy_off_routes",
]

# Other names of /healthz and /readyz.
LIVENESS_ALIASES = ("/health", "/liveness")
READINESS_ALIASES = ("/readiness",)
# A registration over HTTP that names neither keeps the ranks the worker has.
_RANK_FIELDS = frozenset({"dp_start_rank", "dp_size"})
_HANDOFF_FIELDS = frozenset({"role", "handoff", "bootstrap_port"})


_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}, "detail": {"type": "object"}},
        }
    },
}

# Route path -> (summary, request body type, reply type).
_HOT_DOCS: dict[str, tuple[str, Any, Any]] = {
    "/v1/router": (
        "Dynamo's RouterRequest (tagged by method) answered with its RouterResponse",
        RouterRequest,
        RouterResponse,
    ),
    "/v1/new": (
        "Pick a worker for a prompt and book it (request id from the body, X-Request-Id, or generated); "
        "?explain=true adds the per-candidate explanation",
        NewRequest,
        RouteDecision,
    ),
    "/v1/potential_loads": ("Every worker's load if the prompt went there; books nothing", PotentialLoadsRequest,
                            PotentialLoadsReply),
    "/v1/mark_prefill": ("The request's prefill is done: its prefill tokens stop loading its worker, and its "
                         "prompt counts as cached there for computed_prompt_credit_secs", MarkRequest, MarkReply),
    "/v1/mark_free": ("The request is finished or cancelled: release its load", MarkRequest, MarkReply),
    "/v1/record_output": ("The request's generated tokens so far: with router_track_output_blocks its output "
                          "blocks count on its worker, decayed by its expected_output_tokens", OutputProgress,
                          MarkReply),
    "/v1/events": ("Apply one RouterEvent or a list of them to the index", RouterEvent | list[RouterEvent],
                   EventsReply),
    "/v1/overlap": ("Every worker's cached prefix of the prompt, per storage tier; books nothing",
                    PotentialLoadsRequest, OverlapReport),
    "/v1/route": ("Route Dynamo's PreprocessedRequest (JSON, or msgpack with token_ids as a sequence or packed "
                  "int32) by all its routing hints; books it unless annotated query_instance_id; "
                  "return_request hands it back with routing.backend_instance_id / dp_rank set",
                  RouteBody, RouteReply),
}  # fmt: skip


def _hot_endpoint(handler: HotHandler) -> Any:
    async def endpoint(request: Request) -> Response:
        head = read_head(request.scope["headers"])
        call = head.call(await request.body(), request.scope["query_string"], partial(wait_disconnect, request.receive))
        reply = await answered(handler(call))
        # The headers in the protocol's order, so that both adapters answer the same bytes.
        headers = {"content-type": reply.media_type, "content-length": str(len(reply.body))}
        if reply.request_id is not None:
            headers["x-request-id"] = reply.request_id
        headers.update(reply.headers)
        return Response(reply.body, reply.status, headers=headers)

    return endpoint


def add_hot_routes(app: FastAPI, handlers: Handlers, schemas: Schemas) -> None:
    """The hot routes, as the HTTP protocol (`api.http_protocol`) also serves them, answered here
    wherever it does not (``--no-fast-protocol``, another ASGI server, mounted under a prefix), and
    the decision routes only FastAPI serves (``/v1/route``)."""
    hot_routes = APIRouter(tags=["routing"])
    routes = handlers.routes()
    names = dict(HOT_PATHS)
    for path, handler in handlers.app_routes().items():
        routes[path] = handler
        names[path] = path.rsplit("/", 1)[-1]
    for path, handler in routes.items():
        summary, body_type, reply_type = _HOT_DOCS[path]
        extra = schemas.operation(body_type, {200: (reply_type, "OK")})
        extra["responses"]["default"] = {
            "description": "error",
            "content": {"application/json": {"schema": _ERROR_SCHEMA}},
        }
        hot_routes.add_api_route(
            path, _hot_endpoint(handler), methods=["POST"], summary=summary, name=names[path], openapi_extra=extra
        )
    app.include_router(hot_routes)


@dataclass
class ServiceState:
    """What the service's lifespan changes while it runs, read by the admin routes."""

    serving: bool = False  # between startup and shutdown: /readyz can say ready
    doctor: ConfigDoctor | None = None  # made at startup, once the engines heard directly are known


def add_admin_routes(
    app: FastAPI,
    kv_router: KvRouter,
    registry: CollectorRegistry,
    schemas: Schemas,
    auth: ApiAuth,
    *,
    settings: Settings,
    lifecycle: PlaneLifecycle | None,
    state: ServiceState,
    process_group: ProcessGroup | None = None,
) -> None:
    admin, read, probe = (auth.dependency(access) for access in (Access.ADMIN, Access.READ, Access.PROBE))
    worker_body: BodyDecoder[WorkerRegistration] = BodyDecoder(WorkerRegistration)

    def streams_by_worker() -> dict[int, list[StreamStatus]]:
        # Every door feeds the one sequencer: NATS, HTTP and engines heard directly alike.
        by_worker: dict[int, list[StreamStatus]] = {}
        for stream in kv_router.sequencer.status():
            by_worker.setdefault(stream.worker_id, []).append(stream)
        return by_worker

    def status_of(config: WorkerConfig, request: Request) -> WorkerStatus:
        ranks = [load for load in kv_router.rank_loads() if load.worker_id == config.worker_id]
        streams = streams_by_worker().get(config.worker_id, [])
        availability = kv_router.health.availability(config.worker_id)
        return WorkerStatus(config=config, ranks=ranks, event_streams=streams, availability=availability)

    def reply(value: Any, request: Request, status: int = 200) -> Response:
        msgpack = is_msgpack(read_head(request.scope["headers"]).accept)
        return Response(encode(value, msgpack), status, media_type=MSGPACK if msgpack else JSON)

    @app.get(
        "/v1/workers",
        dependencies=[read],
        tags=["workers"],
        summary="Registered workers with the live load of each dp rank",
        openapi_extra=schemas.operation(responses={200: (WorkersReply, "OK")}),
    )
    async def list_workers(request: Request) -> Response:
        loads = kv_router.rank_loads()
        by_worker: dict[int, list[Any]] = {}
        for load in loads:
            by_worker.setdefault(load.worker_id, []).append(load)
        streams = streams_by_worker()
        statuses = [
            WorkerStatus(
                config=c,
                ranks=by_worker.get(c.worker_id, []),
                event_streams=streams.get(c.worker_id, []),
                availability=kv_router.health.availability(c.worker_id),
            )
            for c in kv_router.workers()
        ]
        return reply(WorkersReply(workers=statuses), request)

    @app.post(
        "/v1/workers",
        dependencies=[admin],
        tags=["workers"],
        summary="Register a worker, or reconfigure a registered one in place (its index is kept)",
        openapi_extra=schemas.operation(
            WorkerConfig, {201: (WorkerStatus, "registered"), 200: (WorkerStatus, "updated")}
        ),
    )
    async def register_worker(request: Request) -> Response:
        call = read_head(request.scope["headers"]).call(await request.body(), b"", None)
        # Registered over HTTP means static: no heartbeat lease, with or without an event plane.
        fields = {**msgspec.structs.asdict(worker_body.decode(call)), "leased": False}
        existing = kv_router.worker(fields["worker_id"])
        named = _named_fields(call) if existing is not None else set()
        if existing is not None and not _RANK_FIELDS & named:
            # A capacity or taint update of a worker whose ranks its source set (direct mode's dp=N, a
            # bridge's --dp-size) keeps them: the default one rank would drop the others' blocks.
            fields.update(dp_start_rank=existing.dp_start_rank, dp_size=existing.dp_size)
        if existing is not None:
            # So does each of its disaggregated role and hand-off fields it does not name (a bridge's
            # --role): the defaults would make a prefill worker take whole requests.
            fields.update({name: getattr(existing, name) for name in _HANDOFF_FIELDS - named})
        config = WorkerConfig(**fields)
        known = existing is not None
        if lifecycle is not None:
            await lifecycle.register(config)  # into the shared registry, so every router learns it
        else:
            kv_router.register_worker(config.keeping(kv_router.worker(config.worker_id)))
        return reply(status_of(config, request), request, 200 if known else 201)

    @app.delete(
        "/v1/workers/{worker_id}",
        dependencies=[admin],
        tags=["workers"],
        summary="Deregister a worker: its index entries and active requests are dropped",
        openapi_extra=schemas.operation(responses={200: (WorkerStatus, "the removed worker")}),
    )
    async def remove_worker(worker_id: int, request: Request) -> Response:
        config = next((w for w in kv_router.workers() if w.worker_id == worker_id), None)
        if config is None:
            raise UnknownWorker(worker_id)
        if lifecycle is not None:
            await lifecycle.deregister(worker_id)
        else:
            kv_router.remove_worker(worker_id)
        return reply(WorkerStatus(config=config, ranks=[]), request)

    @app.get(
        "/v1/workers/{worker_id}",
        dependencies=[read],
        tags=["workers"],
        summary="One worker with the live load of each dp rank",
        openapi_extra=schemas.operation(responses={200: (WorkerStatus, "OK")}),
    )
    async def get_worker(worker_id: int, request: Request) -> Response:
        config = next((w for w in kv_router.workers() if w.worker_id == worker_id), None)
        if config is None:
            raise UnknownWorker(worker_id)
        return reply(status_of(config, request), request)

    @app.get(
        "/v1/dump",
        dependencies=[read],
        tags=["index"],
        summary="The whole KV index as stored events (replayable into /v1/events); blocks approximate mode "
        'predicted carry "predicted": true',
        openapi_extra=schemas.operation(responses={200: (list[RouterEvent], "OK")}),
    )
    async def dump(request: Request) -> Response:
        events: list[RouterEvent] = kv_router.tree.dump_events()
        if kv_router.predictions is not None:
            # Approximate mode's blocks, marked: predicted from routing, not reported by the worker.
            events += [
                PredictedRouterEvent(e.worker_id, e.event, e.storage_tier, predicted=True)
                for e in kv_router.predictions.dump_events()
            ]
        return reply(events, request)

    @app.get(
        "/v1/doctor",
        dependencies=[read],
        tags=["operations"],
        summary="Configuration problems seen now (block size, hashing salt, events not wired, gaps, unknown workers)",
        openapi_extra=schemas.operation(responses={200: (list[Problem], "OK")}),
    )
    async def doctor(request: Request) -> Response:
        checker = state.doctor
        return reply(checker.check() if checker is not None else [], request)

    @app.get(
        "/v1/info",
        dependencies=[read],
        tags=["operations"],
        summary="Where workers publish (the NATS URL in use, embedded or not) and the router's geometry",
        openapi_extra=schemas.operation(responses={200: (ServiceInfo, "OK")}),
    )
    async def info(request: Request) -> Response:
        body = ServiceInfo(
            version=package_version(),
            nats_url=lifecycle.url if lifecycle is not None else None,
            nats_namespace=settings.event_plane.nats_namespace,
            block_size=kv_router.config.block_size,
            policy=kv_router.config.policy,
            native=active_accelerators(),
        )
        return reply(body, request)

    @app.get(
        "/healthz",
        dependencies=[probe],
        tags=["operations"],
        summary="Liveness: the process answers (the event plane's state in the body)",
    )
    async def healthz(request: Request) -> Response:
        if lifecycle is None:
            return Response(b'{"status":"ok"}', media_type="application/json")
        body = {"status": "ok", "event_plane": lifecycle.health()}
        return Response(encode(body, False), media_type="application/json")

    # The names Kubernetes probes and the other gateways use, answered alike.
    for alias in LIVENESS_ALIASES:
        app.add_api_route(
            alias, healthz, methods=["GET"], dependencies=[probe], tags=["operations"], summary="Liveness: as /healthz"
        )

    @app.get(
        "/readyz",
        dependencies=[probe],
        tags=["operations"],
        summary="Readiness: serving, at least ready_min_workers workers registered, and the event plane started "
        "once (a NATS outage after that keeps the replica ready: it routes on the index it has); else 503 with "
        "the reason",
    )
    async def readyz(request: Request) -> Response:
        workers = len(kv_router.workers())
        health: EventPlaneHealth | None = lifecycle.health() if lifecycle is not None else None
        reason = None
        if not state.serving:
            reason = "not serving (starting or shutting down)"
        elif lifecycle is not None and not lifecycle.ready:
            reason = lifecycle.not_ready_reason()
        elif workers < settings.service.ready_min_workers:
            reason = f"{workers} workers registered, {settings.service.ready_min_workers} required"
        readiness: dict[str, Any] = {"ready": reason is None, "workers": workers}
        if reason is not None:
            readiness["reason"] = reason
        if health is not None:
            readiness["event_plane"] = health
        body = encode(readiness, False)
        return Response(body, 200 if reason is None else 503, media_type="application/json")

    for alias in READINESS_ALIASES:
        app.add_api_route(
            alias, readyz, methods=["GET"], dependencies=[probe], tags=["operations"], summary="Readiness: as /readyz"
        )

    # Load balancers probe with HEAD: the GET's status and headers, without its body (the server drops it).
    for paths, answer in ((("/healthz", *LIVENESS_ALIASES), healthz), (("/readyz", *READINESS_ALIASES), readyz)):
        for path in paths:
            app.add_api_route(path, answer, methods=["HEAD"], dependencies=[probe], include_in_schema=False)

    @app.get("/metrics", dependencies=[read], tags=["operations"], summary="Prometheus metrics (kv_router_*)")
    async def metrics() -> Response:
        exposition = generate_latest(registry)
        if process_group is not None:
            exposition = await process_group.exposition(exposition)
        return Response(exposition, media_type=CONTENT_TYPE_LATEST)


PROXY_OFF = (
    "the OpenAI proxy is off on this service: start it with `kv-router serve --proxy` to serve {method} {path} "
    "(it serves the OpenAI API in front of the workers, each request routed to the worker best placed for "
    "it); without it, ask for a decision "
    "with POST /v1/new or /v1/route and send the request to that worker yourself"
)


def add_proxy_off_routes(app: FastAPI, auth: ApiAuth) -> None:
    """Without ``--proxy``: the proxy's OpenAI routes (``api.proxy.wire.ROUTES``, ``GET /v1/models``)
    answer a 404 in OpenAI's error shape saying the proxy is off, rather than a bare "Not Found"."""

    def off(method: str, path: str) -> Any:
        # OpenAI's type for a URL it does not serve; the message says why.
        body = error_body(404, "invalid_request_error", PROXY_OFF.format(method=method, path=path))

        async def proxy_off() -> Response:
            return Response(body, 404, media_type=JSON)

        return proxy_off

    for path in ROUTES:
        app.add_api_route(
            path,
            off("POST", path),
            methods=["POST"],
            dependencies=[auth.dependency(Access.DECISION)],
            include_in_schema=False,
        )
    app.add_api_route(
        "/v1/models",
        off("GET", "/v1/models"),
        methods=["GET"],
        dependencies=[auth.dependency(Access.READ)],
        include_in_schema=False,
    )


def _named_fields(call: Call) -> set[str]:
    """The top-level field names of an already validated body (JSON or msgpack)."""
    body = (msgspec.msgpack if call.msgpack else msgspec.json).decode(call.body)
    return set(body) if isinstance(body, dict) else set()

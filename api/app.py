"""`create_app(settings)`: the FastAPI application around one `KvRouter`.

The app owns the router, the metrics registry and its background tasks: the periodic sweep of stale
requests and, with a NATS URL, the event plane (`PlaneLifecycle`, connected in the background so
that HTTP serves at once). Its lifespan starts them and marks the app as serving; at shutdown it stops
answering ready, cancels requests still waiting in the queue and stops them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from api.asgi import BodyLimit, StreamEndpoint
from api.auth import ApiAuth
from api.config import Settings
from api.contract import HotRoutes
from api.cors import Cors
from api.docs import add_docs_routes
from api.engine_lifecycle import running_dynamo_sources, running_engines
from api.errors import ApiError, InvalidBody, NotFound, error_reply
from api.ha_metrics import HaCollector
from api.handlers import Handlers
from api.metrics import (
    ApiMetrics,
    DoctorCollector,
    EmbeddedNatsCollector,
    EngineStreamCollector,
    EventPlaneCollector,
    EventStreamCollector,
    NativeDeclinesCollector,
    RouterStateCollector,
    register_build_info,
)
from api.native import active_accelerators
from api.openapi import Schemas
from api.plane_lifecycle import PlaneLifecycle
from api.process_metrics import ProcessGroup
from api.routes import ServiceState, add_admin_routes, add_hot_routes, add_proxy_off_routes
from api.version import package_version
from router.doctor import ConfigDoctor
from router.errors import KvRouterError
from router.event_plane.embedded_server import ServerKeeper
from router.kv_router import KvRouter
from router.supervision import Supervisor

if TYPE_CHECKING:
    from api.proxy.service import Proxy

__all__ = ["EXPIRY_SWEEP_SECS", "RouterApp", "create_app"]

logger = logging.getLogger(__name__)

# Dynamo sweeps stale requests globally every 60 s besides the check on each `new` (§4.5); the sweep
# is what frees the load of requests nobody marked free while no new request arrives. It also re-checks
# the queue (`KvRouter.expire_stale`): a backstop for a head that became dispatchable with no call to
# dispatch it.
EXPIRY_SWEEP_SECS = 60.0
# How often the configuration doctor looks (its checks read state; each costs well under a millisecond).
DOCTOR_INTERVAL_SECS = 5.0


def create_app(
    settings: Settings | None = None,
    *,
    registry: CollectorRegistry | None = None,
    rng: random.Random | None = None,
    process_group: ProcessGroup | None = None,
    embedded: ServerKeeper | None = None,
) -> RouterApp:
    """The service for ``settings``; ``registry`` receives its metrics (a fresh one by default),
    ``rng`` seeds the router's random choices (ties, sampling); ``process_group``: this is one process
    of ``--processes N``, whose ``/metrics`` answers for all of them (`api.process_metrics`);
    ``embedded``: the keeper of the embedded nats-server ``settings`` name (its restarts are counted,
    and the app is not ready once it is given up)."""
    settings = settings or Settings()
    registry = registry if registry is not None else CollectorRegistry()
    kv_router = KvRouter(settings.router, rng=rng, resync_retry_s=settings.event_plane.resync_retry_secs)
    metrics = ApiMetrics(registry)
    registry.register(RouterStateCollector(kv_router))
    registry.register(EventStreamCollector(kv_router.sequencer))
    registry.register(NativeDeclinesCollector())
    register_build_info(
        registry, version=package_version(), policy=settings.router.policy, native=active_accelerators()
    )
    proxy = None
    if settings.proxy.proxy:
        from api.proxy.service import Proxy  # imported only when enabled: tokenizers

        proxy = Proxy(kv_router, settings.proxy, settings.service, registry, metrics)
    security = settings.security
    auth = ApiAuth(
        security.token(),
        protect_decisions=security.protect_decisions,
        protect_reads=security.protect_reads,
        protect_probes=security.protect_probes,
    )
    lifecycle = (
        PlaneLifecycle(kv_router, settings.event_plane, settings.ha, http_port=settings.service.port, embedded=embedded)
        if settings.event_plane.nats_url
        else None
    )
    relay = lifecycle.relay_events if lifecycle is not None and settings.ha.replica_sync else None
    handlers = Handlers(kv_router, metrics, settings.service, auth, relay)
    if lifecycle is not None:
        registry.register(EventPlaneCollector(lifecycle))
        registry.register(HaCollector(lifecycle))
    if embedded is not None:
        registry.register(EmbeddedNatsCollector(embedded))

    state = ServiceState()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        background = Supervisor("service")
        async with contextlib.AsyncExitStack() as stack:
            if lifecycle is not None:
                stack.push_async_callback(lifecycle.stop)  # after its task is cancelled (LIFO)
            stack.push_async_callback(background.stop)
            if lifecycle is not None:
                background.keep_running("event-plane", lifecycle.run)
            plane = await lifecycle.started() if lifecycle is not None and settings.engines.dynamo_endpoint else None
            engines = await stack.enter_async_context(running_engines(kv_router, settings.engines))
            await stack.enter_async_context(running_dynamo_sources(kv_router, settings.engines, plane))
            if engines:
                engine_collector = EngineStreamCollector(
                    [stream for engine in engines for stream in engine.streams], engines
                )
                registry.register(engine_collector)
                stack.callback(registry.unregister, engine_collector)
            doctor = ConfigDoctor(kv_router, registrations=lifecycle, engines=engines)
            state.doctor = doctor
            doctor_collector = DoctorCollector(doctor)
            registry.register(doctor_collector)
            stack.callback(registry.unregister, doctor_collector)
            background.keep_running("doctor", partial(_run_doctor, doctor))
            background.keep_running("expiry-sweep", partial(_sweep_stale_requests, kv_router))
            if proxy is not None:
                await proxy.start()
                stack.push_async_callback(proxy.stop)
            if process_group is not None:
                await stack.enter_async_context(process_group.serving(partial(generate_latest, registry)))
            state.serving = True
            try:
                yield
            finally:
                # Shutdown, in order: stop answering ready; release requests still queued (their
                # callers get an error instead of hanging); then the sweep stops with the stack.
                state.serving = False
                cancelled = kv_router.cancel_waiting()
                if cancelled:
                    logger.warning("shutdown: cancelled %d queued requests", cancelled)

    limit = settings.service.max_body_bytes
    streams = proxy.routes(auth) if proxy is not None else {}
    app = RouterApp(
        kv_router=kv_router,
        event_plane=lifecycle,
        proxy=proxy,
        hot=HotRoutes(
            handlers.routes(),
            limit,
            streams,
            head_timeout_secs=settings.service.request_head_timeout_secs,
            body_timeout_secs=settings.service.request_body_timeout_secs,
            write_timeout_secs=settings.service.response_write_timeout_secs,
        ),
        max_body_bytes=limit,
        own_413=frozenset(streams),
        title="kv-router",
        version=package_version(),
        description="KV-cache-aware request router for LLM engine fleets, wire-compatible with NVIDIA "
        "Dynamo's KV router. Bodies are JSON, or msgpack with Content-Type: application/msgpack "
        "(replies in msgpack with Accept: application/msgpack).",
        lifespan=lifespan,
        docs_url=None,  # served by api.docs, without a CDN
        redoc_url=None,
        openapi_url=None,
    )
    schemas = Schemas()
    add_hot_routes(app, handlers, schemas)
    add_admin_routes(
        app,
        kv_router,
        registry,
        schemas,
        auth,
        settings=settings,
        lifecycle=lifecycle,
        state=state,
        process_group=process_group,
    )
    if proxy is not None:
        proxy.add_models_route(app, auth)
        proxy.document(schemas)
    else:
        add_proxy_off_routes(app, auth)
    schemas.install(app)
    add_docs_routes(app, auth)
    _add_error_handlers(app)
    Cors(settings.service, settings.proxy.proxy_request_id_header).install(app)
    for path, stream in streams.items():
        # Documented by `Proxy.document`; these answer where the HTTP protocol does not.
        app.router.routes.append(Route(path, StreamEndpoint(stream, limit), methods=["POST"], include_in_schema=False))
    return app


class RouterApp(FastAPI):
    """A FastAPI app entered through `BodyLimit` (every request's body held to ``max_body_bytes``).

    ``hot`` is what kv-router's HTTP protocol (`api.http_protocol`) answers before ASGI: the hot
    routes and the stream routes (the proxy's), where it is in front (``fast_protocol``, `api.server`);
    the app's own routes answer the same paths with the same handlers wherever it is not.
    ``kv_router``, ``event_plane`` (None without NATS) and ``proxy`` (None without ``--proxy``) are
    the service's parts, for whoever runs it (tests, benchmarks, the demo).
    """

    def __init__(
        self,
        *,
        kv_router: KvRouter,
        event_plane: PlaneLifecycle | None,
        proxy: Proxy | None,
        hot: HotRoutes,
        max_body_bytes: int,
        own_413: frozenset[str],
        **fastapi: Any,
    ) -> None:
        """``fastapi``: FastAPI's own settings (title, lifespan, ...); ``own_413``: the paths that answer
        an oversized body themselves (the proxy's, in its error shape)."""
        super().__init__(**fastapi)
        self.kv_router = kv_router
        self.event_plane = event_plane
        self.proxy = proxy
        self.hot = hot
        self.front: ASGIApp = BodyLimit(partial(FastAPI.__call__, self), max_body_bytes, own_413=own_413)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.front(scope, receive, send)


async def _run_doctor(doctor: ConfigDoctor) -> None:
    while True:
        doctor.check()
        await asyncio.sleep(DOCTOR_INTERVAL_SECS)


async def _sweep_stale_requests(kv_router: KvRouter) -> None:
    while True:
        await asyncio.sleep(EXPIRY_SWEEP_SECS)
        kv_router.expire_stale()


def _error_response(exc: Exception) -> Response:
    mapped = error_reply(exc)
    assert mapped is not None
    status, _, body = mapped
    headers = dict(exc.headers) if isinstance(exc, ApiError) else None
    return Response(body, status, headers=headers, media_type="application/json")


def _add_error_handlers(app: FastAPI) -> None:
    """Errors of the non-hot routes, in the same ``{"error": {"type", "message"}}`` shape."""

    async def known(_: Request, exc: Exception) -> Response:
        return _error_response(exc)

    async def validation(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return _error_response(InvalidBody(problems))

    async def http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        error = NotFound(message) if exc.status_code == 404 else ApiError(message)
        error.status = exc.status_code
        if exc.status_code == 405:
            error.type = "method_not_allowed"
        return _error_response(error)

    app.add_exception_handler(ApiError, known)
    app.add_exception_handler(KvRouterError, known)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(HTTPException, http)

"""The service's NATS event plane over its lifetime, never in the way of HTTP.

`embedded_nats` starts the private nats-server that ``kv-router serve`` uses when no URL is given
(on another port, with a WARNING, when the configured one is taken), with a token made for it and
handed to local tools in a connection file (`router.event_plane.connection_file`), and keeps it running
(`ServerKeeper`: a server that dies is started again on its port, with its token and JetStream store;
one that keeps dying is given up, and the app it serves is then not ready). `PlaneLifecycle`
connects the app's router to NATS in the background: HTTP serves from the first moment, each failed
attempt is one log line (backoff doubling to 5 s, no traceback), and the `RouterEventPlane` starts
once NATS answers. It then tracks the connection: one WARNING when it is lost, one INFO when it is back.

With ``--durable-events`` the newest index snapshot is restored and the JetStream stream replayed
before the plane counts as started; with ``--replica-sync`` the replica joins its peers' bookings as it
starts (`router.replicas`).

Readiness (``/readyz``) follows `ready`: not ready until the event plane has started once (the index
and the worker registry come from it; `not_ready_reason` says what it waits for: NATS, the snapshot's
restore, the stream's replay and how far it is, the plane's start); afterwards a NATS outage does
*not* make the replica unready, unless it is the embedded server's and that was given up.
The router keeps routing on the index it has and its own load bookkeeping, which beats taking every
replica out of a Service because NATS blinked; the outage shows in the ``/readyz`` and ``/healthz``
bodies (`health`) and in ``kv_router_nats_connected`` / ``kv_router_event_plane_state``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Iterator, Mapping
from typing import Literal

import msgspec
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.errors import SlowConsumerError

from api.config import EventPlaneConfig, HaConfig
from api.errors import EventPlaneUnavailable, EventTooLarge
from api.wire import EventPlaneHealth
from indexer.events import RouterEvent, encode_router_events
from router.event_plane.connection import (
    NatsOptions,
    close_connection,
    connect,
    connect_when_available,
    is_authorization_error,
)
from router.event_plane.connection_file import (
    LocalServer,
    connection_file_path,
    remove_connection_file,
    write_connection_file,
)
from router.event_plane.embedded_server import EmbeddedNats, ServerKeeper, free_port
from router.event_plane.plane import RouterEventPlane
from router.event_plane.publisher import event_payloads
from router.event_plane.ratelimited_log import RateLimitedLog
from router.event_plane.urls import redact_nats_url
from router.kv_router import KvRouter
from router.replicas.durable import DurableEvents
from router.replicas.sync import ReplicaSync
from router.supervision import raise_if_cancelling, unwind
from router.types import WorkerConfig

__all__ = ["PlaneLifecycle", "PlaneState", "embedded_nats"]

logger = logging.getLogger(__name__)

PlaneState = Literal["connecting", "connected", "disconnected"]

# The longest `PlaneLifecycle.caught_up` waits for the workers' full dumps once the plane has started: a
# live worker answers within milliseconds; one that does not holds no process back for longer.
CATCH_UP_DUMPS_WAIT_S = 5.0
# How long events posted over HTTP wait for NATS to take them before the client is told to send again.
RELAY_FLUSH_SECS = 5


@contextlib.contextmanager
def embedded_nats(config: EventPlaneConfig) -> Iterator[tuple[EventPlaneConfig, ServerKeeper | None]]:
    """The event plane settings to use, and the keeper of the embedded server: ``config`` itself and
    None when it names a NATS URL (or has no embedded server), else the URL and token of an embedded
    server started here, which only clients with that token may join, kept running until the end; the
    token is written to a connection file (0600) for local tools."""
    if config.nats_url is not None or not config.embedded_nats:
        yield config, None
        return
    wanted = config.embedded_nats_port
    try:
        server = EmbeddedNats(port=wanted, require_token=True).start()
    except RuntimeError:  # the port is taken (another kv-router, a system nats-server)
        server = EmbeddedNats(port=free_port(), require_token=True).start()
        logger.warning(
            "port %d is taken: the embedded nats-server listens on port %d instead (workers need that port)",
            wanted,
            server.port,
        )
    assert server.token is not None
    local = LocalServer(url=server.url, token=server.token, pid=os.getpid())
    path = connection_file_path(server.port, config.nats_connection_file)
    where = "no connection file (this user has no home directory; set --nats-connection-file)"
    if path is not None:
        try:
            write_connection_file(path, local)
            where = f"local tools (kv-router mock-worker, bridge, replay) read it from {path}"
        except OSError as exc:
            logger.warning("cannot write the NATS connection file %s (%s): local tools cannot find the token",
                           path, exc.strerror or exc)  # fmt: skip
            where = "no connection file"
    logger.info(
        "embedded nats-server started on port %d, loopback only; clients need its token: %s (--nats-url to use "
        "your own NATS)",
        server.port,
        where,
    )
    keeper = ServerKeeper(server).start()
    try:
        # The server's token replaces any credentials configured for an external NATS.
        yield (
            msgspec.structs.replace(
                config,
                nats_url=server.url,
                nats_token=server.token,
                nats_user=None,
                nats_password=None,
                nats_creds_file=None,
            ),
            keeper,
        )
    finally:
        if path is not None:
            remove_connection_file(path, local)
        keeper.stop()


class PlaneLifecycle:
    """Connect, start and watch the event plane of one app; `run` is its supervised background loop."""

    def __init__(
        self,
        router: KvRouter,
        config: EventPlaneConfig,
        ha: HaConfig | None = None,
        *,
        http_port: int = 0,
        embedded: ServerKeeper | None = None,
    ) -> None:
        """``embedded``: the keeper of the embedded nats-server ``config`` names, run by this process."""
        assert config.nats_url is not None
        self.router = router
        self.config = config
        self.ha = ha or HaConfig()
        self.embedded = embedded
        self._http_port = http_port
        # The URL as logs and HTTP bodies show it: never the credentials it may carry.
        self.url = redact_nats_url(config.nats_url)
        self.plane: RouterEventPlane | None = None
        # Run beside the plane when configured (``ha``), started after it and stopped before it.
        self.replicas: ReplicaSync | None = None
        self.durable: DurableEvents | None = None
        self.state: PlaneState = "connecting"
        self.disconnects = 0
        self.last_error: str | None = None
        self._since = time.monotonic()
        self._nc: Client | None = None
        self._sync_nc: Client | None = None  # replica sync's own connection
        self._restoring: DurableEvents | None = None  # while a start restores the snapshot and replays
        self._closing = False
        # Registered over HTTP before the plane started: written to the shared registry once it does.
        self._unshared: dict[int, WorkerConfig] = {}
        self._started = asyncio.Event()
        self._start_error: str | None = None  # why the last attempt to start the plane failed
        self._async_errors = RateLimitedLog(logger)

    # ------------------------------------------------------------------ state
    @property
    def ready(self) -> bool:
        return self.plane is not None and (self.embedded is None or self.embedded.failure is None)

    @property
    def refused_registrations(self) -> Mapping[int, str]:
        """The running plane's refused registrations (none before it starts)."""
        return self.plane.refused_registrations if self.plane is not None else {}

    def not_ready_reason(self) -> str:
        """Why the plane has not started yet (``/readyz``'s reason): NATS not reached, or, NATS connected,
        the plane starting: the durable restart restoring its snapshot or replaying the stream, the
        registry being read; or the embedded nats-server given up."""
        if self.embedded is not None and self.embedded.failure is not None:
            return self.embedded.failure
        restoring = self._restoring
        if restoring is not None:
            progress = restoring.replay_progress()
            if progress is None:
                return f"restoring the index snapshot from NATS at {self.url}"
            return "replaying the event stream: at {} of {}".format(*progress)
        if self._nc is not None and self._nc.is_connected:
            failed = f"; the last attempt failed: {self._start_error}" if self._start_error else ""
            return f"event plane starting: NATS at {self.url} connected{failed}"
        return f"event plane not started: NATS at {self.url} " + (
            f"unreachable ({self.last_error})" if self.last_error else "not connected yet"
        )

    def health(self) -> EventPlaneHealth:
        return EventPlaneHealth(
            state=self.state,
            nats_url=self.url,
            state_for_s=round(time.monotonic() - self._since, 3),
            disconnects=self.disconnects,
            last_error=self.last_error,
            registry_writes_owed=self.plane.registry_writes_owed if self.plane is not None else 0,
        )

    def _enter(self, state: PlaneState) -> None:
        self.state = state
        self._since = time.monotonic()

    # ------------------------------------------------------------------ running
    async def run(self) -> None:
        """Connect (retrying), start the plane, then idle until cancelled; a failure to start raises
        (the supervisor logs it and runs this again)."""
        if self.plane is None:
            nc = self._nc or await connect_when_available(
                NatsOptions.from_settings(self.config),
                on_attempt_failed=self._attempt_failed,
                on_reconnect=self._reconnected,
                on_disconnect=self._disconnected,
                on_error=self._async_error,
            )
            self._nc = nc
            durable = self._durable_events(nc)
            plane = RouterEventPlane(
                self.router,
                nc,
                namespace=self.config.nats_namespace,
                lease_s=self.config.worker_lease_secs,
                resync_timeout_s=self.config.resync_timeout_secs,
                subscribe_events=durable is None,
                jetstream_replicas=self.config.jetstream_replicas,
            )
            replicas: ReplicaSync | None = None
            sync_nc: Client | None = None
            self._restoring = durable
            try:
                if durable is not None:
                    await durable.restore()
                # A restart's restored streams need no worker's dump: the joins' resyncs wait for the replay.
                await plane.start(hold_join_resyncs=durable is not None)
                if durable is not None:
                    await durable.start()
                    self._restoring = None
                    plane.release_join_resyncs()
                # Workers registered over HTTP meanwhile are shared before replica sync publishes what
                # was booked on them (peers book only on workers they know), and again after its start.
                await self._share_registrations(plane)
                if self.ha.replica_sync:
                    # Its own connection, without echo: every batch would otherwise come back to its
                    # sender, costing a parse, a message and a task switch to be recognised and dropped.
                    options = NatsOptions.from_settings(self.config, name="kv-router-sync")
                    sync_nc = await connect(dataclasses.replace(options, no_echo=True))
                    replicas = ReplicaSync(
                        self.router, sync_nc, namespace=self.config.nats_namespace, lease_s=self.ha.replica_lease_secs
                    )
                    await replicas.start()
                    await self._share_registrations(plane)
                raise_if_cancelling()  # lost on its way during the start: undone, not left running
            except BaseException as exc:
                # Tried again by the supervisor: from nothing, not on top of this attempt's half (a
                # plane left running would keep its subscriptions and tasks beside the next one's).
                if isinstance(exc, Exception):
                    self._start_error = f"{type(exc).__name__}: {exc}"
                await unwind(_undo_start(plane, durable, replicas, sync_nc))
                raise
            finally:
                self._restoring = None
            self.durable, self.replicas, self._sync_nc = durable, replicas, sync_nc
            self.plane = plane
            self.last_error = self._start_error = None
            self._enter("connected")
            self._started.set()
            logger.info(
                "event plane: NATS at %s (point workers here; GET /v1/info says so too), subjects kv.%s.*, "
                "%d workers registered",
                self.url,
                self.config.nats_namespace,
                len(self.router.workers()),
            )
        await asyncio.Event().wait()

    async def started(self) -> RouterEventPlane:
        """Wait until the plane has started (for parts that cannot run without it)."""
        await self._started.wait()
        assert self.plane is not None
        return self.plane

    async def caught_up(self) -> None:
        """Wait until the plane has started and the full dumps it asked for on start (of the workers
        registered by heartbeat: those registered over HTTP are never asked) are in, or
        `CATCH_UP_DUMPS_WAIT_S` has passed (a worker that does not answer is asked again later, as
        always): what a process started again beside serving siblings waits for before it listens, so
        that its first decisions see those workers' caches."""
        plane = await self.started()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CATCH_UP_DUMPS_WAIT_S
        while plane.subscriber.resyncs_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.02)

    async def _share_registrations(self, plane: RouterEventPlane) -> None:
        """Write the workers registered over HTTP before the plane started to the shared registry. More
        can come while one is written (each write awaits NATS); they join this loop, not the plane's."""
        while self._unshared:
            worker_id, config = next(iter(self._unshared.items()))
            # As the router holds it: a block size adopted since (--block-size auto) is its own.
            held = self.router.worker(worker_id)
            await plane.register(
                config if held is None else msgspec.structs.replace(config, block_size=held.block_size)
            )
            if self._unshared.get(worker_id) is config:
                del self._unshared[worker_id]

    async def register(self, config: WorkerConfig) -> None:
        """Register a worker in the shared registry (every router learns it); before the plane has
        started, in this router now and in the registry once it starts; while NATS is out of reach, in
        this router now and in the registry once NATS is back (`RouterEventPlane.register`: never a
        NATS error)."""
        if self.plane is not None:
            await self.plane.register(config)
            return
        self.router.register_worker(config)
        self._unshared[config.worker_id] = config

    async def relay_events(self, events: list[RouterEvent]) -> int:
        """Events posted over HTTP, published on their workers' events subjects (with replica sync: every
        replica, this one too, applies them from there, in the order the NATS server took them; applied
        here first, a sibling could meet a later event posted to it before this one reached it, and
        call it a gap). Returns how many went out once the server has them (flushed), so that an event
        posted after the answer is behind them everywhere; 0 before the plane has started (then the
        caller applies them here alone). An event larger than the server's max_payload is refused."""
        nc = self._nc
        if self.plane is None or nc is None:
            return 0
        if not nc.is_connected:
            # Buffered, they would go out at a reconnection the client cannot see; refused, the client
            # sends them again (a repeated event is a duplicate everywhere).
            raise EventPlaneUnavailable(f"NATS at {self.url} is out of reach: the events cannot reach the replicas")
        by_worker: dict[int, list[bytes]] = {}
        for event in events:
            by_worker.setdefault(event.worker_id, []).append(encode_router_events(event))
        subjects = self.plane.subjects
        # Every part made first: an event past max_payload refuses the batch before any of it goes out.
        parts = [(subjects.events(worker_id), payload) for worker_id, encoded in by_worker.items()
                 for payload in event_payloads(encoded, nc.max_payload)]  # fmt: skip
        if (largest := max((len(payload) for _, payload in parts), default=0)) > nc.max_payload:
            raise EventTooLarge(
                f"an event of {largest} bytes is past the NATS server's max_payload of {nc.max_payload}"
            )
        for subject, payload in parts:
            await nc.publish(subject, payload)
        try:
            await nc.flush(timeout=RELAY_FLUSH_SECS)
        except NatsError as exc:  # its TimeoutError among them
            raise EventPlaneUnavailable(
                f"NATS at {self.url} did not take the events within {RELAY_FLUSH_SECS:g} s ({type(exc).__name__}); "
                "send them again (a repeated event is a duplicate everywhere)"
            ) from None
        return len(events)

    async def deregister(self, worker_id: int) -> None:
        """Remove a worker here and from the shared registry (while NATS is out of reach, from the
        registry once it is back). Raises `UnknownWorker` for a worker this router does not know."""
        if self.plane is not None:
            await self.plane.deregister(worker_id)
            return
        self._unshared.pop(worker_id, None)
        self.router.remove_worker(worker_id)

    def _durable_events(self, nc: Client) -> DurableEvents | None:
        ha = self.ha
        if not ha.durable_events:
            return None
        return DurableEvents(
            self.router,
            nc,
            namespace=self.config.nats_namespace,
            router_name=ha.router_name or f"{socket.gethostname()}-{self._http_port}",
            max_age_s=ha.events_stream_max_age_secs,
            max_bytes=ha.events_stream_max_bytes,
            snapshot_every_events=ha.snapshot_every_events,
            snapshot_every_s=ha.snapshot_every_secs,
            replicas=self.config.jetstream_replicas,
        )

    async def stop(self) -> None:
        self._closing = True
        plane, self.plane = self.plane, None
        replicas, self.replicas = self.replicas, None
        durable, self.durable = self.durable, None
        if replicas is not None:
            await replicas.stop()
        if durable is not None:
            await durable.stop()
        if plane is not None:
            await plane.stop()
        for nc in (self._sync_nc, self._nc):
            if nc is not None:
                await close_connection(nc)
        self._sync_nc = self._nc = None

    # ------------------------------------------------------------------ connection events
    def _attempt_failed(self, attempt: int, backoff_s: float, error: Exception) -> None:
        self.last_error = f"{type(error).__name__}: {error}"
        problem = "unreachable"
        if is_authorization_error(error):
            problem = "refused the credentials (check --nats-user/--nats-password, --nats-token or --nats-creds-file)"
        logger.warning(
            "NATS at %s %s (%s); retry %d in %.1f s; /readyz answers 503 until the event plane starts",
            self.url,
            problem,
            self.last_error,
            attempt,
            backoff_s,
        )

    async def _disconnected(self) -> None:
        if self._closing or self.state != "connected":
            return
        self.disconnects += 1
        self._enter("disconnected")
        if self.plane is not None:
            self.plane.on_disconnected()
        logger.warning(
            "lost the NATS connection to %s: routing continues on the current index and the router's own "
            "bookings (the engines' load reports resume with it); live events resume and every stream is "
            "resynced when it is back",
            self.url,
        )

    async def _reconnected(self) -> None:
        outage = time.monotonic() - self._since
        self._enter("connected")
        self.last_error = None  # the outage's: an error while connected is said anew
        plane = self.plane
        streams = len(plane.sequencer.status()) if plane is not None else 0
        logger.info("reconnected to NATS at %s after %.1f s: resyncing %d streams in the background",
                    self.url, outage, streams)  # fmt: skip
        if plane is not None:
            await plane.on_reconnected()
        if self.durable is not None:
            self.durable.on_reconnected()

    async def _async_error(self, error: Exception) -> None:
        self.last_error = f"{type(error).__name__}: {error}"
        plane = self.plane
        if isinstance(error, SlowConsumerError) and plane is not None and plane.on_slow_consumer(error.subject):
            return  # a worker's KV events: counted, logged and resynced by the plane
        if isinstance(error, SlowConsumerError) or "violation" in str(error).lower():
            self._async_errors.warning("NATS error", self.last_error)
        else:  # the connection's own trouble: the disconnect WARNING and the reconnect INFO say it
            logger.debug("NATS: %s", self.last_error)


async def _undo_start(
    plane: RouterEventPlane, durable: DurableEvents | None, replicas: ReplicaSync | None, sync_nc: Client | None
) -> None:
    """Stop what a failed start started, last first; each step may fail (the connection may be what failed)."""
    if replicas is not None:
        with contextlib.suppress(Exception):
            await replicas.stop()
    if sync_nc is not None:
        with contextlib.suppress(Exception):
            await sync_nc.close()
    with contextlib.suppress(Exception):
        await plane.stop()
    if durable is not None:
        await durable.stop()
        durable.discard()

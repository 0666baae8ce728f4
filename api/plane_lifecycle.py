"""The service's NATS event plane: connect with the configured options and run `RouterEventPlane`.

`embedded_nats` starts the private nats-server that ``kv-router serve`` uses when no URL is given;
`running_event_plane` connects the app's router to a server for the app's lifetime, with replica sync
and durable events when the `HaConfig` asks for them (`router.replicas`). With durable events the
index snapshot is restored before the plane starts and the stream replayed before serving.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Iterator

from api.config import EventPlaneConfig, HaConfig
from router.event_plane.connection import NatsOptions, connect
from router.event_plane.embedded_server import EmbeddedNats, free_port
from router.event_plane.plane import RouterEventPlane
from router.kv_router import KvRouter
from router.replicas.durable import DurableEvents
from router.replicas.sync import ReplicaSync

__all__ = ["embedded_nats", "nats_options", "running_event_plane"]

logger = logging.getLogger(__name__)


def nats_options(config: EventPlaneConfig) -> NatsOptions:
    assert config.nats_url is not None
    return NatsOptions(
        url=config.nats_url,
        user=config.nats_user,
        password=config.nats_password,
        token=config.nats_token,
        creds_file=config.nats_creds_file,
        tls_ca_file=config.nats_tls_ca_file,
        tls_cert_file=config.nats_tls_cert_file,
        tls_key_file=config.nats_tls_key_file,
    )


@contextlib.contextmanager
def embedded_nats(config: EventPlaneConfig) -> Iterator[str | None]:
    """The NATS URL to use: the configured one, an embedded server's, or None (HTTP events only)."""
    if config.nats_url is not None or not config.embedded_nats:
        yield config.nats_url
        return
    try:
        server = EmbeddedNats(port=config.embedded_nats_port).start()
    except RuntimeError:  # the port is taken (another kv-router, a system nats-server)
        server = EmbeddedNats(port=free_port()).start()
    logger.info("embedded NATS event plane at %s (point workers here; --nats-url to use your own)", server.url)
    try:
        yield server.url
    finally:
        server.stop()


@contextlib.asynccontextmanager
async def running_event_plane(
    router: KvRouter, config: EventPlaneConfig, ha: HaConfig | None = None, *, http_port: int = 0
) -> AsyncIterator[RouterEventPlane]:
    ha = ha or HaConfig()
    holder: list[RouterEventPlane] = []

    async def on_reconnect() -> None:
        if holder:
            await holder[0].on_reconnected()

    nc = await connect(nats_options(config), on_reconnect=on_reconnect)
    durable = None
    if ha.durable_events:
        durable = DurableEvents(
            router,
            nc,
            namespace=config.nats_namespace,
            router_name=ha.router_name or f"{socket.gethostname()}-{http_port}",
            max_age_s=ha.events_stream_max_age_secs,
            max_bytes=ha.events_stream_max_bytes,
            snapshot_every_events=ha.snapshot_every_events,
            snapshot_every_s=ha.snapshot_every_secs,
        )
        await durable.restore()
    plane = RouterEventPlane(
        router,
        nc,
        namespace=config.nats_namespace,
        lease_s=config.worker_lease_secs,
        resync_timeout_s=config.resync_timeout_secs,
        subscribe_events=durable is None,
    )
    holder.append(plane)
    await plane.start()
    logger.info("event plane: subscribed to kv.%s.* on %s", config.nats_namespace, config.nats_url)
    replicas = None
    try:
        if durable is not None:
            await durable.start()
        if ha.replica_sync:
            replicas = ReplicaSync(router, nc, namespace=config.nats_namespace, lease_s=ha.replica_lease_secs)
            await replicas.start()
        plane.durable = durable
        plane.replicas = replicas
        yield plane
    finally:
        if replicas is not None:
            await replicas.stop()
        if durable is not None:
            await durable.stop()
        await plane.stop()
        await nc.close()

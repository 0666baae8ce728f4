"""The bridge's own Prometheus ``/metrics`` (``kv-router bridge --metrics-port``).

A bridge runs beside each engine, so what goes wrong between the engine and NATS shows here first:
batches dropped on a full queue, gaps and replays, events refused, a router refusing the worker, an
engine withdrawn, a NATS connection lost. The engine streams' counts keep the names the service uses
for the streams it hears itself (``kv_router_engine_stream_*``, `EngineStreamCollector`); the rest is
``kv_router_bridge_*`` (`BridgeCollector`). Everything is read from the bridge's own state at scrape
time, in its event loop, so keeping it costs the event path nothing.

The endpoint is a plain asyncio server that answers ``GET /metrics`` and closes the connection: one
scrape every few seconds needs no HTTP framework in a sidecar.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from api.metrics import PREFIX, EngineStreamCollector
from router.engines.bridge import Bridge

__all__ = ["BridgeCollector", "bridge_registry", "serve_metrics"]

BRIDGE = f"{PREFIX}_bridge"
# A scraper's request line and headers; anything longer is not a scrape.
MAX_REQUEST_BYTES = 16_384
READ_TIMEOUT_S = 5.0


class BridgeCollector(Collector):
    """The bridge's publisher, engine probe and NATS connection, read at scrape time."""

    def __init__(self, bridge: Bridge) -> None:
        self._bridge = bridge

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        bridge = self._bridge
        last_ids, unverified, rejected, unsent, refused, up, probes, connected, reconnects = families = self._families()
        publisher = bridge.publisher
        unverified_ranks = publisher.unverified_ranks()
        for dp_rank, event_id in sorted(publisher.last_event_ids().items()):
            last_ids.add_metric([str(dp_rank)], event_id)
        for dp_rank in range(bridge.config.dp_size):
            unverified.add_metric([str(dp_rank)], float(dp_rank in unverified_ranks))
        for outcome, count in sorted(bridge.refused_events().items()):
            rejected.add_metric([outcome.removeprefix("rejected_")], count)
        unsent.add_metric([], publisher.unsent_batches)
        if publisher.refusal is not None:
            refused.add_metric([str(publisher.refusal.router_block_size)], 1.0)
        if bridge.health is not None:  # without a probe the bridge cannot tell: no series, not a false 1
            up.add_metric([], float(not bridge.withdrawn))
            probes.add_metric(["ok"], bridge.health.probes - bridge.health.failures)
            probes.add_metric(["failed"], bridge.health.failures)
        connected.add_metric([], float(bridge.nc.is_connected))
        reconnects.add_metric([], bridge.nc.stats["reconnects"])
        yield from families

    @staticmethod
    def _families() -> list[CounterMetricFamily | GaugeMetricFamily]:
        return [
            GaugeMetricFamily(
                f"{BRIDGE}_last_event_id",
                "Id of the last event published per dp rank (a gap nobody could replay skips one): a router "
                "caught up with the worker shows it in /v1/workers (event_streams).",
                labels=["dp_rank"],
            ),
            GaugeMetricFamily(
                f"{BRIDGE}_rank_unverified",
                "1 while what the rank holds is unknown (a gap nobody could replay), until the engine clears it.",
                labels=["dp_rank"],
            ),
            CounterMetricFamily(
                f"{BRIDGE}_events_refused",
                "Engine events not published, by reason (a store under a parent the engine never stored; "
                "offloaded_unresolved: hashes of a token-less lower-tier store naming no block the rank holds).",
                labels=["reason"],
            ),
            CounterMetricFamily(
                f"{BRIDGE}_event_batches_unsent",
                "Event batches NATS could not take (out of reach long enough to fill the connection's buffer); "
                "kept in the ranks' rings, and replayed to the routers that see the gap once NATS is back.",
            ),
            GaugeMetricFamily(
                f"{BRIDGE}_worker_refused",
                "1 while a router refuses the worker: its block size differs from the router's "
                "(router_block_size; the bridge logs the router's words).",
                labels=["router_block_size"],
            ),
            GaugeMetricFamily(
                f"{BRIDGE}_engine_up",
                "1 while the engine answers the bridge's health probe; 0 while it does not (the worker is "
                "withdrawn from the routers meanwhile). Not exported when the bridge probes no health URL.",
            ),
            CounterMetricFamily(
                f"{BRIDGE}_engine_probes", "Health probes of the engine, by outcome.", labels=["outcome"]
            ),
            GaugeMetricFamily(f"{BRIDGE}_nats_connected", "1 while the NATS connection is up."),
            CounterMetricFamily(f"{BRIDGE}_nats_reconnects", "Times the NATS connection was made again."),
        ]


def bridge_registry(bridge: Bridge) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(EngineStreamCollector(bridge.streams))
    registry.register(BridgeCollector(bridge))
    return registry


async def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> asyncio.Server:
    """``GET /metrics`` on ``host:port``, each answer closing its connection; 404 elsewhere, 405 for
    another method, 400 for what is not an HTTP request."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            writer.close()
            return
        status, content_type, body = _reply(head, registry)
        writer.write(
            f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n".encode()
            + body
        )
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    return await asyncio.start_server(answer, host, port, limit=MAX_REQUEST_BYTES)


def _reply(head: bytes, registry: CollectorRegistry) -> tuple[str, str, bytes]:
    parts = head.split(b"\r\n", 1)[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
        return "400 Bad Request", "text/plain", b"not an HTTP request\n"
    method, target = parts[0], parts[1].split(b"?", 1)[0]
    if target != b"/metrics":
        return "404 Not Found", "text/plain", b"only /metrics is served here\n"
    if method != b"GET":
        return "405 Method Not Allowed", "text/plain", b"GET /metrics\n"
    return "200 OK", CONTENT_TYPE_LATEST, generate_latest(registry)

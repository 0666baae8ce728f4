"""Metrics of replica sync and durable events (`router.replicas`), read when ``/metrics`` is scraped.

- ``kv_router_replica_sync_changes_total{outcome}``: published, unpublished (NATS out of reach and the
  connection's buffer full: the peers repair the gap), applied, duplicate, gap, repaired, joined,
  peer_expired, peer_left, rejected_<reason>, ...
- ``kv_router_replica_sync_peers``: replicas heard from within their lease.
- ``kv_router_replica_sync_lag_seconds{quantile}``: publish-to-applied lag of the last 4,096 batches
  received (wall clocks of sender and receiver; NTP-synchronised hosts or one host).
- ``kv_router_durable_events_total{outcome}``, ``kv_router_durable_stream_sequence{kind}`` (applied,
  snapshot): how far this router has read the JetStream stream and what its newest snapshot covers.
- ``kv_router_durable_last_snapshot_bytes``: the size of this router's newest snapshot (0: none yet).
- ``kv_router_durable_purged_below_sequence``: the stream sequence this router's last purge kept data
  from (0: none yet).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from api.metrics import PREFIX
from api.plane_lifecycle import PlaneLifecycle

__all__ = ["HaCollector"]

LAG_QUANTILES = (0.5, 0.9, 0.99)


class HaCollector(Collector):
    def __init__(self, lifecycle: PlaneLifecycle) -> None:
        self._lifecycle = lifecycle

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        changes, peers, lag, durable_outcomes, sequence, snapshot_bytes, purged_below = families = self._families()
        replicas = self._lifecycle.replicas
        if replicas is not None:
            for outcome, count in sorted(replicas.outcomes.items()):
                changes.add_metric([outcome], count)
            peers.add_metric([], len(replicas.peers))
            samples = sorted(replicas.lag_s)
            for quantile in LAG_QUANTILES:
                value = samples[min(len(samples) - 1, int(quantile * len(samples)))] if samples else 0.0
                lag.add_metric([str(quantile)], value)
        durable = self._lifecycle.durable
        if durable is not None:
            for outcome, count in sorted(durable.outcomes.items()):
                durable_outcomes.add_metric([outcome], count)
            sequence.add_metric(["applied"], durable.applied_seq)
            sequence.add_metric(["snapshot"], durable.snapshot_seq)
            snapshot_bytes.add_metric([], durable.last_snapshot_bytes)
            purged_below.add_metric([], durable.purged_below)
        yield from families

    @staticmethod
    def _families() -> tuple[CounterMetricFamily, GaugeMetricFamily, GaugeMetricFamily, CounterMetricFamily,
                             GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:  # fmt: skip
        return (
            CounterMetricFamily(
                f"{PREFIX}_replica_sync_changes",
                "Replica-sync booking changes and repairs by outcome.",
                labels=["outcome"],
            ),
            GaugeMetricFamily(f"{PREFIX}_replica_sync_peers", "Peer replicas heard from within their lease."),
            GaugeMetricFamily(
                f"{PREFIX}_replica_sync_lag_seconds",
                "Publish-to-applied lag of the last sync batches received.",
                labels=["quantile"],
            ),
            CounterMetricFamily(
                f"{PREFIX}_durable_events",
                "Durable-events work by outcome (stream messages, snapshots, ...).",
                labels=["outcome"],
            ),
            GaugeMetricFamily(
                f"{PREFIX}_durable_stream_sequence",
                "JetStream stream sequence applied / covered by the snapshot.",
                labels=["kind"],
            ),
            GaugeMetricFamily(
                f"{PREFIX}_durable_last_snapshot_bytes", "Size of this router's newest index snapshot (0: none yet)."
            ),
            GaugeMetricFamily(
                f"{PREFIX}_durable_purged_below_sequence",
                "JetStream stream sequence this router's last purge kept data from (0: none yet).",
            ),
        )

"""The observability pack in ``deploy/``: every metric the Grafana dashboard and the Prometheus alert
rules query exists in ``/metrics`` of a real service after traffic (HTTP and a NATS worker; and, for
the proxy's panels, a ``--proxy`` service under uvicorn with mock workers, called with the real
``openai`` client), with the labels the queries match on; every query parses as PromQL; the rule file
has the shape Prometheus loads.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import promql_parser
import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from api.app import create_app
from api.config import EventPlaneConfig, HaConfig, ServiceConfig, Settings
from router.config import RouterConfig
from router.event_plane.embedded_server import EmbeddedNats, free_port
from router.event_plane.messages import ActiveLoad
from tests.metrics import label_names
from tests.proxy_fleet import MODEL, fleet
from tests.test_api_event_plane import BLOCK, Workers
from tests.test_api_support import prompt, stored_event
from tests.waiting import eventually, until

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "kv-router.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
# The series of `kv-router bridge --metrics-port`, beside each engine, not in the service's /metrics.
BRIDGE_PREFIX = "kv_router_bridge_"
# Series Prometheus makes itself (per scrape target), and the labels it adds to every series.
PROMETHEUS_SERIES = {"up"}
TARGET_LABELS = {"__name__", "instance", "job", "namespace", "pod"}
# Grafana's interval variables, replaced by a duration so that the query parses as PromQL.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":  # label_values(METRIC, LABEL): Grafana's, not PromQL
            metric_name, label = variable["definition"].removeprefix("label_values(").rstrip(")").split(", ")
            queries.append(f"count by ({label}) ({metric_name})")
    return [_grafana_to_promql(query) for query in queries]


def alert_rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(ALERTS.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def _grafana_to_promql(query: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        query = query.replace(variable, value)
    return query


def selectors(query: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names matched) of every vector selector in the query."""
    found: list[tuple[str, set[str]]] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            found.append((node.name, {matcher.name for matcher in node.matchers.matchers}))

    promql_parser.walk(promql_parser.parse(query), visit)
    assert found, f"no metric in {query!r}"
    return found


@pytest.fixture
def exposition(nats_server: EmbeddedNats) -> Iterator[dict[str, set[str]]]:
    """Sample name -> label names in ``/metrics`` of a service with a NATS event plane after traffic."""
    settings = Settings(
        service=ServiceConfig(),
        router=RouterConfig(block_size=BLOCK),
        event_plane=EventPlaneConfig(nats_url=nats_server.url, worker_lease_secs=30),
        ha=HaConfig(replica_sync=True, durable_events=True),  # the HA overlay's panels
    )
    app = create_app(settings, registry=CollectorRegistry(), rng=random.Random(0))
    workers = Workers(nats_server.url)
    try:
        with TestClient(app, base_url="http://127.0.0.1") as client:
            tokens = prompt(5, 4 * BLOCK)
            workers.start(2, tokens, total_kv_blocks=64)
            assert client.post("/v1/workers", json={"worker_id": 1, "total_kv_blocks": 100}).status_code == 201
            client.post("/v1/events", json=[stored_event(1, prompt(6, 2 * BLOCK)), stored_event(9, tokens)])

            def load_reported() -> bool:
                # Load reports are not replayed: one sent before the router subscribed is lost, as a
                # worker's periodic report would be, so report until it is seen.
                workers.call(workers.publishers[0].publish_load(ActiveLoad(worker_id=2, kv_used_blocks=12)))
                return 'kv_router_worker_kv_used_blocks{dp_rank="0",worker_id="2"} 12.0' in client.get("/metrics").text

            until(load_reported, timeout=30)
            assert client.post("/v1/new", json={"tokens": tokens, "request_id": "a"}).json()["worker_id"] == 2
            # A worker without KV events, routed to: approximate mode predicts its cache.
            assert client.post("/v1/workers", json={"worker_id": 3, "kv_events": False}).status_code == 201
            chosen = client.post("/v1/route", json={"token_ids": tokens, "routing": {"backend_instance_id": 3}})
            assert chosen.status_code == 200, chosen.text
            text = client.get("/metrics").text
    finally:
        workers.close()
    names = label_names(text)
    for name, labels in label_names(asyncio.run(_proxied_traffic(nats_server.url))).items():
        names.setdefault(name, set()).update(labels)
    yield names


async def _proxied_traffic(nats_url: str) -> str:
    """``/metrics`` of a proxy after completions, streamed and not, until a prediction was calibrated and
    a worker's health checked."""
    async with fleet(nats_url, proxy={"proxy_health_check_interval_secs": 0.2}) as proxied:
        async with httpx.AsyncClient() as http:  # a static worker, health-checked (nothing listens: failing)
            static = {"worker_id": 9, "url": f"http://127.0.0.1:{free_port()}"}
            assert (await http.post(f"{proxied.url}/v1/workers", json=static)).status_code == 201
        tokens = list(range(1, 4 * 64 + 1))
        stream = await proxied.client.completions.create(model=MODEL, prompt=tokens, max_tokens=2, stream=True)
        async for _ in stream:
            pass
        metrics = ""

        async def predicted_cached() -> bool:  # the same prompt again, until its blocks' events are in
            nonlocal metrics
            await proxied.client.completions.create(model=MODEL, prompt=tokens, max_tokens=2)
            async with httpx.AsyncClient() as http:
                metrics = (await http.get(f"{proxied.url}/metrics")).text
            return (
                "kv_router_proxy_cache_calibration{" in metrics and "kv_router_worker_health_check_passing{" in metrics
            )

        await eventually(
            predicted_cached, 20, "a request through the proxy is predicted cached, its worker checked", poll=0.1
        )
        return metrics


def test_every_metric_the_dashboard_and_the_alerts_query_is_exposed(exposition: dict[str, set[str]]) -> None:
    queries = dashboard_queries() + [rule["expr"] for rule in alert_rules()]
    used: set[str] = set()
    for query in queries:
        for name, labels in selectors(query):
            used.add(name)
            if name in PROMETHEUS_SERIES or name.startswith(BRIDGE_PREFIX):
                continue  # a bridge's series: its own /metrics, checked in tests/test_engine_bridge.py
            assert name in exposition, f"{name} (in {query!r}) is not in /metrics"
            assert labels - TARGET_LABELS <= exposition[name], f"{query!r} matches labels {name} does not have"
    # What issue 15 asks the pack to show, by the metrics that carry it.
    for name in (
        "kv_router_requests_total",  # decisions/s
        "kv_router_decision_duration_seconds_bucket",  # latency by phase
        "kv_router_decisions_total",  # per-worker decisions
        "kv_router_worker_active_prefill_tokens",  # per-worker load
        "kv_router_worker_kv_used_blocks",  # KV usage
        "kv_router_predicted_cache_hit_ratio_sum",
        "kv_router_events_applied_total",
        "kv_router_stream_events_total",  # applied and rejected by reason
        "kv_router_worker_stream_trusted",
        "kv_router_queue_pending_requests",
        "kv_router_nats_connected",
        "kv_router_build_info",
        "kv_router_proxy_requests_total",  # the proxy: requests, added latency, retries, calibration
        "kv_router_proxy_added_seconds_bucket",
        "kv_router_proxy_upstream_failures_total",
        "kv_router_proxy_cache_calibration",
        "kv_router_config_problems",  # the doctor
        "kv_router_workers_removed_total",  # workers dropped, by why
        "kv_router_worker_kv_events",  # which workers the stale-index alert reads
        "kv_router_worker_health_check_passing",
        "kv_router_proxy_retries_total",
        "kv_router_replica_sync_lag_seconds",  # the HA overlay
        "kv_router_durable_stream_sequence",
        "kv_router_durable_purged_below_sequence",  # gauges, not outcomes of the durable-events counter
        "kv_router_durable_last_snapshot_bytes",
    ):
        assert name in used, f"the pack does not show {name}"


def test_alert_rules_have_the_shape_prometheus_loads() -> None:
    document = yaml.safe_load(ALERTS.read_text())
    assert set(document) == {"groups"}
    names = [rule["alert"] for rule in alert_rules()]
    assert len(names) == len(set(names))
    for group in document["groups"]:
        assert set(group) <= {"name", "interval", "rules", "limit"} and group["name"]
    for rule in alert_rules():
        assert set(rule) <= {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}, rule
        promql_parser.parse(rule["expr"])
        if "for" in rule:
            promql_parser.parse_duration(rule["for"])
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}
        assert rule["annotations"]["summary"]
    for expected in (
        "KvRouterWorkerFailingHealthChecks",
        "KvRouterConfigProblem",
        "KvRouterStreamUntrusted",
        "KvRouterIndexStale",
        "KvRouterWorkerDropped",
        "KvRouterEventRejectionRateHigh",
        "KvRouterQueueGrowing",
        "KvRouterNatsDisconnected",
    ):
        assert expected in names


def test_dashboard_panels_are_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {
            (x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not mine & cells, f"panel {panel['title']!r} overlaps another"
        cells |= mine
        for target in panel.get("targets", []):
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}

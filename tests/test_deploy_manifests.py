"""``deploy/``: the compose file against the compose specification, and every Kubernetes manifest the
Kustomize overlays render against the Kubernetes schemas (strict: unknown fields fail), with the
properties issue 15 asks of them; the router's config file in the ConfigMap is one the service loads.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import check_jsonschema
import jsonschema
import kubernetes_validate
import pytest
import yaml

from api.cli import build_parser
from api.config import load_settings, resolve_settings
from mocker.config import EngineConfig
from router.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
OVERLAYS = sorted(path.name for path in (KUBERNETES / "overlays").iterdir() if path.is_dir())
KUBERNETES_VERSION = "1.30.0"
# Kinds outside the core schemas: (apiVersion, kind) -> the vendored schema (tests/schemas/README.md).
CUSTOM_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): Path(__file__).with_name("schemas")
    / "servicemonitor-monitoring.coreos.com-v1.json",
}
KUBECTL = shutil.which("kubectl")


# ---------------------------------------------------------------------------------------- compose
def compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return document


def test_compose_file_follows_the_compose_spec() -> None:
    spec_path = Path(check_jsonschema.__file__).parent / "builtin_schemas" / "vendor" / "compose-spec.json"
    spec = json.loads(spec_path.read_text())
    errors = sorted(jsonschema.Draft7Validator(spec).iter_errors(compose()), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def test_compose_starts_nats_router_and_workers_in_health_order() -> None:
    services = compose()["services"]
    assert "--jetstream" in services["nats"]["command"]
    for name, service in services.items():
        depends_on = service.get("depends_on", {})
        conditions = depends_on if isinstance(depends_on, dict) else {key: {} for key in depends_on}
        for dependency, condition in conditions.items():
            if "healthcheck" in services[dependency]:  # a dependency that reports health is waited for
                assert condition.get("condition") == "service_healthy", (name, dependency)
    router = services["kv-router"]
    assert router["depends_on"]["nats"]["condition"] == "service_healthy"
    assert router["build"]["target"] == "runtime"
    assert router["environment"]["KV_ROUTER_NATS_URL"] == "nats://nats:4222"
    # Proxied LLM streams run for minutes: a rollout lets them finish before the SIGKILL.
    shutdown_secs = int(router["environment"]["KV_ROUTER_SHUTDOWN_TIMEOUT_SECS"])
    assert shutdown_secs >= 120 and int(router["stop_grace_period"].removesuffix("s")) > shutdown_secs
    workers = [service for service in services.values() if service.get("entrypoint") == ["kv-router", "mock-worker"]]
    assert len(workers) >= 2
    for worker in workers:
        assert worker["build"]["target"] == "simulator"
        assert worker["depends_on"]["kv-router"]["condition"] == "service_healthy"
        assert worker["command"][worker["command"].index("--nats-url") + 1] == "nats://nats:4222"
    # The mock workers keep Dynamo's mocker geometry; the router is set to the same block size.
    assert int(router["environment"]["KV_ROUTER_BLOCK_SIZE"]) == EngineConfig().block_size
    ids = [worker["command"][worker["command"].index("--worker-id") + 1] for worker in workers]
    assert len(set(ids)) == len(ids)
    # The commands are ones the CLI takes (argparse exits on an unknown flag).
    for worker in workers:
        build_parser().parse_args([*worker["entrypoint"][1:], *worker["command"]])


def test_compose_observability_profile_provisions_the_dashboard_and_rules() -> None:
    services = compose()["services"]
    assert services["prometheus"]["profiles"] == services["grafana"]["profiles"] == ["observability"]
    assert all("profiles" not in services[name] for name in ("nats", "kv-router"))

    def mounted(service: str) -> dict[str, str]:
        pairs = (volume.removesuffix(":ro").split(":", 1) for volume in services[service]["volumes"])
        return {target: source for source, target in pairs}

    prometheus = mounted("prometheus")
    config = yaml.safe_load((DEPLOY / prometheus["/etc/prometheus/prometheus.yml"]).read_text())
    assert (DEPLOY / prometheus[config["rule_files"][0]]).resolve() == (DEPLOY / "prometheus" / "alerts.yaml")
    assert config["scrape_configs"][0]["static_configs"][0]["targets"] == ["kv-router:8000"]
    grafana = mounted("grafana")
    provisioning = DEPLOY / grafana["/etc/grafana/provisioning"]
    provider = yaml.safe_load((provisioning / "dashboards" / "kv-router.yaml").read_text())["providers"][0]
    dashboards = provider["options"]["path"]
    assert (DEPLOY / grafana[f"{dashboards}/kv-router.json"]).resolve() == DEPLOY / "grafana" / "kv-router.json"
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"


# ------------------------------------------------------------------------------------- kubernetes
@cache
def rendered(overlay: str) -> tuple[dict[str, Any], ...]:
    """What ``kubectl kustomize`` renders of an overlay (or of ``base``)."""
    assert KUBECTL is not None
    path = KUBERNETES / "base" if overlay == "base" else KUBERNETES / "overlays" / overlay
    output = subprocess.run([KUBECTL, "kustomize", str(path)], check=True, capture_output=True, text=True).stdout
    return tuple(document for document in yaml.safe_load_all(output) if document)


needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl (for `kubectl kustomize`) is not installed")


def _strict(schema: Any) -> Any:
    """Unknown fields rejected, as the API server's strict field validation does."""
    if isinstance(schema, dict):
        strict = {key: _strict(value) for key, value in schema.items()}
        if "properties" in strict and "additionalProperties" not in strict:
            strict["additionalProperties"] = False
        return strict
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    return schema


@cache
def _custom_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    schema = json.loads(CUSTOM_SCHEMAS[api_version, kind].read_text())
    schema["properties"]["metadata"] = {"type": "object"}  # checked against ObjectMeta by the API server
    return jsonschema.Draft7Validator(_strict(schema))


def validate(document: dict[str, Any]) -> None:
    key = (document["apiVersion"], document["kind"])
    if key in CUSTOM_SCHEMAS:
        errors = list(_custom_validator(*key).iter_errors(document))
        assert not errors, [f"{list(e.absolute_path)}: {e.message}" for e in errors]
        return
    kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def by_kind(documents: tuple[dict[str, Any], ...], kind: str) -> Iterator[dict[str, Any]]:
    return (document for document in documents if document["kind"] == kind)


@needs_kubectl
@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_every_rendered_manifest_matches_the_kubernetes_schemas(overlay: str) -> None:
    documents = rendered(overlay)
    kinds = {document["kind"] for document in documents}
    expected = {"Deployment", "StatefulSet", "Service", "ConfigMap", "ServiceMonitor", "PodDisruptionBudget"}
    assert expected | {"NetworkPolicy"} <= kinds
    for document in documents:
        validate(document)


def test_a_misspelt_field_fails_validation() -> None:
    """The validation is strict: a field Kubernetes does not know is an error, not ignored."""
    deployment = next(yaml.safe_load_all((KUBERNETES / "base" / "router.yaml").read_text()))
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "IfNotPresent"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    monitor = yaml.safe_load((KUBERNETES / "base" / "servicemonitor.yaml").read_text())
    validate(monitor)
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(AssertionError):
        validate(monitor)


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_are_hardened_and_probed(overlay: str) -> None:
    documents = rendered(overlay)
    workloads = [*by_kind(documents, "Deployment"), *by_kind(documents, "StatefulSet")]
    assert {workload["metadata"]["name"] for workload in workloads} == {"kv-router", "nats"}
    for workload in workloads:
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"]:
            assert container["imagePullPolicy"] == "IfNotPresent"
            assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(container)
            if workload["metadata"]["name"] == "kv-router":
                # A large snapshot's decode holds the loop for seconds: no failed liveness check for it.
                assert container["livenessProbe"].get("timeoutSeconds", 1) >= 5
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert container["securityContext"]["readOnlyRootFilesystem"] is True
            assert container["resources"]["limits"]["memory"]


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_config_comes_from_a_configmap_the_service_loads(overlay: str, tmp_path: Path) -> None:
    documents = rendered(overlay)
    pod = router_pod(documents)
    container = pod["containers"][0]
    config_path = Path(container["args"][container["args"].index("--config") + 1])
    mount = next(m for m in container["volumeMounts"] if Path(m["mountPath"]) == config_path.parent)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    config_map = next(
        c for c in by_kind(documents, "ConfigMap") if c["metadata"]["name"] == volume["configMap"]["name"]
    )
    (tmp_path / config_path.name).write_text(config_map["data"][config_path.name])
    settings = load_settings(env=pod_environment(container), config_file=tmp_path / config_path.name)
    assert Path(build_parser().parse_args(["serve", *container["args"]]).config) == config_path
    assert settings.event_plane.nats_url == "nats://nats:4222"
    assert (settings.service.host, settings.service.port) == ("0.0.0.0", 8000)
    port = next(p for p in container["ports"] if p["name"] == "http")["containerPort"]
    assert port == settings.service.port
    service = next(s for s in by_kind(documents, "Service") if s["metadata"]["name"] == "kv-router")
    router = next(d for d in by_kind(documents, "Deployment") if d["metadata"]["name"] == "kv-router")
    assert service["spec"]["selector"].items() <= router["spec"]["template"]["metadata"]["labels"].items()
    # Proxied LLM streams last minutes: a rollout must not cut them after a few seconds.
    assert settings.service.shutdown_timeout_secs >= 120
    # More grace than the preStop sleep and then the service's own shutdown timeout, so in-flight
    # requests finish before the kubelet's SIGKILL.
    assert pod["terminationGracePeriodSeconds"] > pre_stop_secs(container) + settings.service.shutdown_timeout_secs


def image_environment(target: str = "runtime") -> dict[str, str]:
    """The variables the Dockerfile's ``target`` stage sets (``ENV`` in it and the stages it is built
    FROM), as a container of the image starts with them."""
    stages: dict[str, tuple[str, dict[str, str]]] = {}  # stage -> (the stage it is FROM, its ENV)
    stage = ""
    for line in (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines():
        instruction = line.split(maxsplit=1)[0] if line.strip() else ""
        if instruction == "FROM":
            words = line.split()
            stage = words[3] if len(words) >= 4 and words[2].upper() == "AS" else words[1]
            stages[stage] = (words[1], {})
        elif instruction == "ENV":
            stages[stage][1].update(word.split("=", 1) for word in shlex.split(line)[1:])
    environment: dict[str, str] = {}
    while target in stages:
        target, variables = stages[target]
        environment = variables | environment  # a later stage's value wins
    return environment


def pod_environment(container: dict[str, Any]) -> dict[str, str]:
    """The router container's variables: the image's, then the pod's (which override them); those
    from the pod's own fields (the router's name) filled in as Kubernetes would."""
    pod = {variable["name"]: variable.get("value", "kv-router-0") for variable in container["env"]}
    return image_environment() | pod


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_setting_of_the_config_file_takes_effect(overlay: str, tmp_path: Path) -> None:
    """No key of the ConfigMap's settings file is overridden by a variable of the container: the
    image's ``ENV`` (host, port, log format, NATS URL) or the pod's own would win over the file, and an
    edit of the file (the NATS URL pointed at your server) would silently change nothing."""
    documents = rendered(overlay)
    container = router_pod(documents)["containers"][0]
    config_map = next(c for c in by_kind(documents, "ConfigMap") if c["metadata"]["name"].startswith("kv-router-"))
    text = config_map["data"]["config.toml"]
    (tmp_path / "config.toml").write_text(text)
    environment = pod_environment(container)
    assert {"KV_ROUTER_HOST", "KV_ROUTER_NATS_URL"} <= set(image_environment())
    _, origin = resolve_settings(env=environment, config_file=tmp_path / "config.toml")
    overridden = {key: origin[key] for key in tomllib.loads(text) if not origin[key].startswith("config file")}
    assert not overridden, f"set in config.toml but taken from elsewhere: {overridden}"


def router_pod(documents: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    router = next(d for d in by_kind(documents, "Deployment") if d["metadata"]["name"] == "kv-router")
    pod: dict[str, Any] = router["spec"]["template"]["spec"]
    return pod


def pre_stop_secs(container: dict[str, Any]) -> int:
    """How long the container's preStop hook waits (an ``exec`` of sleep, or the ``sleep`` handler)."""
    pre_stop = container["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        return int(pre_stop["sleep"]["seconds"])
    program, seconds = pre_stop["exec"]["command"]
    assert program == "/bin/sleep"  # the image is Debian's (the Dockerfile's BASE_IMAGE)
    return int(seconds)


@needs_kubectl
@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_router_pods_serve_until_their_endpoint_is_gone_and_take_no_service_links(overlay: str) -> None:
    """A rollout refuses no request: SIGTERM closes the listener at once, so the pod waits first
    (preStop) while Services still send it traffic; and Kubernetes injects no ``KV_ROUTER_PORT=tcp://...``
    from the kv-router Service, which the service would read as its port setting."""
    pod = router_pod(rendered(overlay))
    assert pre_stop_secs(pod["containers"][0]) >= 5
    assert pod["enableServiceLinks"] is False
    with pytest.raises(ConfigError, match="port"):
        load_settings(env={"KV_ROUTER_PORT": "tcp://10.96.0.10:8000"})  # what a service link would say


# nats-server's lame duck mode when its config sets none: 2 min in all, the first 10 s a grace period.
NATS_LAME_DUCK_DEFAULTS = {"lame_duck_duration": 120.0, "lame_duck_grace_period": 10.0}
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "": 1.0}


def nats_setting_secs(config: str, name: str) -> float:
    """A duration of a nats-server config file ("30s", "2m"; a bare number is seconds), in seconds."""
    found = re.search(rf'^\s*{name}\s*[:=]?\s*"?(\d+(?:\.\d+)?)(ms|s|m|h|)"?\s*$', config, re.MULTILINE)
    if found is None:
        return NATS_LAME_DUCK_DEFAULTS[name]
    return float(found[1]) * _DURATION_UNITS[found[2]]


@needs_kubectl
@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_nats_lame_duck_mode_ends_before_the_kubelet_kills_the_server(overlay: str) -> None:
    """The NATS pod's preStop hook puts nats-server in lame duck mode: it takes no new client, then
    closes its clients one at a time (so that they reconnect elsewhere spread out, not all at once) for
    up to ``lame_duck_duration`` (2 min by default: about one client a second), ignoring the SIGTERM
    that follows. All of it must fit in the pod's grace period, or a server with many clients (a GPU
    fleet's engines) is SIGKILLed with the rest of them still connected."""
    documents = rendered(overlay)
    nats = next(by_kind(documents, "StatefulSet"))
    pod = nats["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert any(word.startswith("ldm=") for word in container["lifecycle"]["preStop"]["exec"]["command"])
    config = next(c for c in by_kind(documents, "ConfigMap") if c["metadata"]["name"].startswith("nats-"))
    text = config["data"]["nats.conf"]
    duration = nats_setting_secs(text, "lame_duck_duration")
    assert nats_setting_secs(text, "lame_duck_grace_period") < duration
    # With time to spare for the server's own shutdown after it.
    assert duration + 10 <= pod["terminationGracePeriodSeconds"], (duration, pod["terminationGracePeriodSeconds"])


_BINARY_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def binary_bytes(quantity: str) -> int:
    """A memory size as Kubernetes ("1Gi") or Go's GOMEMLIMIT ("900MiB") writes it, in bytes."""
    found = re.fullmatch(r"(\d+)(Ki|Mi|Gi|KiB|MiB|GiB)?", quantity)
    assert found is not None, quantity
    return int(found[1]) * _BINARY_UNITS.get(found[2] or "", 1)


@needs_kubectl
@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_nats_collects_its_heap_before_the_kubelet_kills_it(overlay: str) -> None:
    """nats-server is a Go program: with a memory limit on its container and no GOMEMLIMIT, its heap
    grows to twice what is live before the runtime collects, past the limit under load (an OOM kill
    of the event plane). Its soft limit is set, below the container's."""
    nats = next(by_kind(rendered(overlay), "StatefulSet"))
    [container] = nats["spec"]["template"]["spec"]["containers"]
    env = {variable["name"]: variable.get("value") for variable in container["env"]}
    limit = binary_bytes(container["resources"]["limits"]["memory"])
    assert "GOMEMLIMIT" in env, env
    assert binary_bytes(env["GOMEMLIMIT"]) < limit


@needs_kubectl
@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_nats_servers_prefer_nodes_of_their_own(overlay: str) -> None:
    nats = next(by_kind(rendered(overlay), "StatefulSet"))
    anti_affinity = nats["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    [term] = anti_affinity["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    labels = nats["spec"]["template"]["metadata"]["labels"]
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= labels.items()


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_network_policies_and_monitoring_select_the_pods(overlay: str) -> None:
    documents = rendered(overlay)
    pods = {
        workload["metadata"]["name"]: workload["spec"]["template"]["metadata"]["labels"]
        for workload in [*by_kind(documents, "Deployment"), *by_kind(documents, "StatefulSet")]
    }

    def selects(selector: dict[str, Any], name: str) -> bool:
        return bool(selector.get("matchLabels")) and selector["matchLabels"].items() <= pods[name].items()

    budgets = list(by_kind(documents, "PodDisruptionBudget"))
    assert all(any(selects(b["spec"]["selector"], name) for b in budgets) for name in pods)
    router_budget = next(b for b in budgets if selects(b["spec"]["selector"], "kv-router"))
    replicas = next(d for d in by_kind(documents, "Deployment"))["spec"]["replicas"]
    assert router_budget["spec"]["minAvailable"] < replicas or replicas == router_budget["spec"]["minAvailable"] == 0
    policies = list(by_kind(documents, "NetworkPolicy"))
    assert all(any(selects(p["spec"]["podSelector"], name) for p in policies) for name in pods)
    monitor = next(by_kind(documents, "ServiceMonitor"))
    service = next(s for s in by_kind(documents, "Service") if s["metadata"]["name"] == "kv-router")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}


@needs_kubectl
def test_nats_runs_jetstream_and_the_ha_overlay_prepares_replicas() -> None:
    for overlay in OVERLAYS:
        documents = rendered(overlay)
        nats_config = next(c for c in by_kind(documents, "ConfigMap") if c["metadata"]["name"].startswith("nats-"))
        assert "jetstream {" in nats_config["data"]["nats.conf"]
    ha = rendered("ha")
    router = next(d for d in by_kind(ha, "Deployment") if d["metadata"]["name"] == "kv-router")
    assert router["spec"]["replicas"] >= 2
    variables = router["spec"]["template"]["spec"]["containers"][0]["env"]
    env = {variable["name"]: variable.get("value") for variable in variables}
    assert env["KV_ROUTER_REPLICA_SYNC"] == env["KV_ROUTER_DURABLE_EVENTS"] == "true"
    [name] = [v for v in variables if v["name"] == "KV_ROUTER_ROUTER_NAME"]
    assert name["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}  # each replica its own name
    nats = next(by_kind(ha, "StatefulSet"))
    assert nats["spec"]["replicas"] == 3
    # As many copies of every stream and bucket as NATS servers: losing one keeps them all.
    assert env["KV_ROUTER_JETSTREAM_REPLICAS"] == str(nats["spec"]["replicas"])
    config = next(c for c in by_kind(ha, "ConfigMap") if c["metadata"]["name"].startswith("nats-"))["data"]["nats.conf"]
    routes = [f"nats://nats-{i}.{nats['spec']['serviceName']}:6222" for i in range(3)]
    assert all(route in config for route in routes)
    single = rendered("single")
    assert next(by_kind(single, "Deployment"))["spec"]["replicas"] == 1

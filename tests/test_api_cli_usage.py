"""The CLI explains itself: help text for every setting, ``--policy`` choices from the registry, one
line and exit code 2 for every bad value (run as the real console script, never a traceback),
``kv-router config show`` with each setting's source, the example config file, and ``/docs`` with
no external host."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import msgspec
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from api.app import create_app
from api.cli import show_settings
from api.config import ENV_PREFIX, SECTIONS, ProxyConfig, Settings, load_settings, resolve_settings, stray_variables
from router.event_plane.embedded_server import free_port
from router.policies.registry import policy_names
from tests.router_processes import kv_router_command
from tests.test_api_server import ROOT
from tests.test_api_support import serve
from tests.test_api_tls import self_signed

EXAMPLE = ROOT / "docs" / "kv-router.example.toml"


def _kv(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*kv_router_command(), *args], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)


def test_every_setting_has_a_description_where_it_is_defined() -> None:
    for section, struct in SECTIONS.items():
        info = msgspec.inspect.type_info(struct)
        assert isinstance(info, msgspec.inspect.StructType)
        for field in info.fields:
            t, description = field.type, None
            while isinstance(t, msgspec.inspect.Metadata):
                description = description or (t.extra_json_schema or {}).get("description")
                t = t.type
            assert description and len(description) > 15, f"{section}.{field.name} has no real description"


def test_help_explains_router_settings_with_defaults_and_lists_policies() -> None:
    done = _kv("serve", "--help", env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0
    text = done.stdout
    assert "router setting " not in text  # the old placeholder
    assert "tokens per KV block" in text and "default: 16]" in text
    assert "seconds" in text and "KV_ROUTER_REQUEST_EXPIRY_SECS; default: 300.0" in text
    assert "§" not in text and "reference" not in text  # the team's notes are not the user's
    assert "{" + ",".join(policy_names()) + "}" in text  # --policy's choices, from the registry


BAD = [
    (["serve", "--policy", "foo"], "invalid choice: 'foo'"),
    (["serve", "--port", "eighty"], "port: expected an integer, got 'eighty' (from flag --port)"),
    (["serve", "--nats-url", "http://127.0.0.1:8000"], "'http://127.0.0.1:8000' is not a NATS URL: use nats://"),
    (["mock-worker", "--nats-url", "http://127.0.0.1:8000"], "is not a NATS URL"),
    (
        ["mock-worker", "--http-url", "http://mock-worker-1:8100"],
        "--http-url needs --http-port (where the API listens)",
    ),
    (["mock-worker", "--http-port", "0", "--http-url", "mock-worker-1:8100"], "--http-url: not an http(s) URL"),
    (["serve", "--nats-url", "nats://127.0.0.1:4222,http://127.0.0.1:8000"], "'http://127.0.0.1:8000' is not a NATS"),
    (["serve", "--port", "70000"], "<= 65535"),
    (["serve", "--jetstream-replicas", "3"], "jetstream_replicas: 3 copies need a NATS cluster"),
    (["serve", "--block-size", "0"], "block_size: must be a positive integer"),
    (["serve", "--router-temperature", "-1"], "router_temperature: must be a number from 0 to 1e+06"),
    (["serve", "--router-temperature", "nan"], "router_temperature"),
    # Accepted before, then every decision a 500 (an int or a rounding overflowing); config show
    # checks as serve does, without serving on a tree that lets them in.
    (["config", "show", "--overlap-score-credit", "1e308"], "overlap_score_credit: must be a number from 0 to 1e+06"),
    (
        ["config", "show", "--active-prefill-tokens-threshold-frac", "1e305"],
        "active_prefill_tokens_threshold_frac: must be a number from 0 to 1e+06",
    ),
    (["serve", "--config", "/nonexistent/kv-router.toml"], "cannot read config file"),
    (["serve", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["config", "show", "--max-body-bytes", "1.5"], "max_body_bytes"),
    (["nope"], "invalid choice: 'nope'"),
    (["serve", "--engine-zmq", "garbage"], "engine_zmq: 'garbage': expected WORKER_ID=tcp://HOST:PORT"),
    # Each of these was taken, then served nothing: a traceback, or a worker that never came.
    (["serve", "--engine", "1=tcp://127.0.0.1:\u0665\u0665\u0665\u0667"],
     "the event endpoint must be tcp://HOST:PORT, got 'tcp://127.0.0.1:\u0665\u0665\u0665\u0667'"),
    (["serve", "--engine", "1=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5557"],
     "the replay endpoint is the event endpoint tcp://127.0.0.1:5557: the engine's replay socket listens"),
    (["serve", "--engine", "1=tcp://[::1:5557"],
     "the event endpoint 'tcp://[::1:5557' has a malformed IPv6 host '[::1': write tcp://[ADDRESS]:PORT"),
    (["serve", "--engine", "1=tcp://127.0.0.1:5557,url=http://127.0.0.1:8000/v1/completions"],
     "url: not an http(s) URL of an engine: 'http://127.0.0.1:8000/v1/completions': its path '/v1/completions' "
     "goes on past /v1 (an endpoint's path): give the engine's OpenAI server root, http(s)://HOST[:PORT][/PREFIX], "
     "with or without /v1 (from flag --engine)"),
    (["serve", "--engine", "1=tcp://127.0.0.1:5557", "--engine", "2=tcp://127.0.0.1:5557"],
     "'2=tcp://127.0.0.1:5557': its event endpoint tcp://127.0.0.1:5557 is worker 1's event endpoint too"),
    (["serve", "--engine", "1=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558", "--engine-zmq",
      "2=tcp://127.0.0.1:5558"], "its event endpoint tcp://127.0.0.1:5558 is worker 1's replay endpoint too"),
    (["serve", "--engine", "1=tcp://127.0.0.1:5557,url=http://127.0.0.1:8000", "--engine",
      "2=tcp://127.0.0.1:5559,url=http://127.0.0.1:8000/v1"],
     "its url http://127.0.0.1:8000 is worker 1's url too (each engine has sockets and a URL of its own)"),
    (["serve", "--dynamo-endpoint", "garbage"], "dynamo_endpoint: 'garbage': expected NAMESPACE.COMPONENT.ENDPOINT"),
    (["serve", "--proxy", "--tokenizer", "mock-model=/nope.json"], "model 'mock-model': cannot read /nope.json"),
    (
        ["serve", "--proxy", "--proxy-otlp-endpoint", "collector:4318"],
        "proxy_otlp_endpoint: 'collector:4318' is not an http(s) URL of a collector: its scheme is not http or https",
    ),
    (["bridge"], "--worker-id is required (or KV_ROUTER_BRIDGE_WORKER_ID, or worker_id in --config)"),
    (["bridge", "--worker-id", "1", "--zmq-endpoint", "tcp://127.0.0.1:5557", "--metrics-port", "70000"], "<= 65535"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "says"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_value_is_one_line_and_exit_code_2(argv: list[str], says: str) -> None:
    done = _kv(*argv)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr
    if argv[0] in ("serve", "config"):  # a setting's problem names the command whose --help lists it
        command = "kv-router " + " ".join(argv[:2] if argv[0] == "config" else argv[:1])
        assert done.stderr.startswith(f"{command}: error: ") and done.stderr.endswith(f" (see {command} --help)\n")


MISSPELT = [
    (["serve", "--block_size", "64"], "kv-router serve: error: unrecognized arguments: --block_size 64; "
     "did you mean --block-size? (see kv-router serve --help)"),
    (["config", "show", "--polcy=latency"], "kv-router config show: error: unrecognized arguments: "
     "--polcy=latency; did you mean --policy? (see kv-router config show --help)"),
    (["mock-worker", "--http_port", "9001"], "kv-router mock-worker: error: unrecognized arguments: --http_port "
     "9001; did you mean --http-port? (see kv-router mock-worker --help)"),
    (["serve", "--no-such-flag"], "kv-router serve: error: unrecognized arguments: --no-such-flag "
     "(see kv-router serve --help)"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "says"), MISSPELT, ids=["serve", "config-show", "mock-worker", "nothing-close"])
def test_a_misspelt_flag_is_told_by_its_command_with_the_flag_meant(argv: list[str], says: str) -> None:
    done = _kv(*argv)
    assert done.returncode == 2
    assert done.stderr == says + "\n"


def test_a_bad_model_file_stops_serve_in_one_line_naming_it(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0"}')
    (tmp_path / "chat_template.jinja").write_text("{% if add_generation_prompt %}")
    for flag, says in (
        (str(tmp_path), f"tokenizer: every model: cannot load {tmp_path / 'tokenizer.json'}"),
        (f"m={tmp_path}", "tokenizer: model 'm': cannot load"),
    ):
        done = _kv("serve", "--proxy", "--tokenizer", flag, "--port", "1")
        assert done.returncode == 2 and says in done.stderr, done.stderr
        assert len(done.stderr.splitlines()) == 1
    from tests.chat_vectors.models import assemble  # a good tokenizer.json, then a template that does not compile

    assemble("chatml-tools", tmp_path / "model")
    (tmp_path / "model" / "chat_template.jinja").write_text("{% if add_generation_prompt %}")
    done = _kv("serve", "--proxy", "--tokenizer", str(tmp_path / "model"), "--port", "1")
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert f"chat template {tmp_path / 'model' / 'chat_template.jinja'}: line 1: " in done.stderr


# `kv-router` as a host lacking something installed: the OpenTelemetry SDK (the `otel` extra, not in
# the image) made unimportable, or no nats-server beside Python (PATH lacks one too, below).
_WITHOUT = """
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.startswith(("opentelemetry.sdk", "opentelemetry.exporter")):
            raise ModuleNotFoundError(f"No module named {name!r}")
if sys.argv.pop(1) == "otel":
    sys.meta_path.insert(0, Missing())
else:
    sys.executable = "/nonexistent/bin/python"
from api.cli import main
sys.exit(main())
"""


@pytest.mark.parametrize(
    ("missing", "argv", "says"),
    [
        (
            "otel",
            ["--proxy", "--proxy-otlp-endpoint", "http://127.0.0.1:9/v1/traces", "--nats-url", "none",
             "--no-embedded-nats"],
            "proxy_otlp_endpoint: the OpenTelemetry SDK is not installed: pip install 'kv-router[otel]'",
        ),
        ("nats-server", [], "nats_url: not set, and the embedded NATS started instead needs a nats-server binary"),
    ],
)  # fmt: skip
def test_what_is_not_installed_stops_serve_in_one_line(
    missing: str, argv: list[str], says: str, tmp_path: Path
) -> None:
    """Before anything starts (rc 2, one line, the fix in it): not a traceback from inside start-up."""
    wrapper = tmp_path / "kv_router_without.py"
    wrapper.write_text(_WITHOUT)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, str(wrapper), missing, "serve", "--port", str(free_port()), *argv],
        capture_output=True, text=True, timeout=60, env=env, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert says in done.stderr
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr


def test_a_misspelt_variable_is_a_warning_naming_the_setting_meant() -> None:
    misspelt = ENV_PREFIX + "BLOCKSIZE"  # spelt out, the scan below would take it for a name in use
    done = _kv("config", "show", env={**os.environ, misspelt: "64"})
    assert done.returncode == 0, done.stderr
    assert "\nblock_size = 16  # default\n" in done.stdout  # ignored: settings come from known names only
    [line] = [line for line in done.stderr.splitlines() if misspelt in line]
    assert "WARNING" in line and f"{misspelt} is not a kv-router setting" in line
    assert line.endswith("did you mean KV_ROUTER_BLOCK_SIZE?")


def test_proxy_settings_without_the_proxy_are_a_warning_each() -> None:
    """Read only by the proxy: given with --proxy off (a switch left off, say), they changed nothing
    without a word."""
    env = {**os.environ, ENV_PREFIX + "PROXY_RETRIES": "4"}
    done = _kv("config", "show", "--proxy-connect-timeout-secs", "3", env=env)
    assert done.returncode == 0, done.stderr
    said = [line.split("WARNING api.cli: ")[-1] for line in done.stderr.splitlines() if "WARNING" in line]
    assert said == [
        "proxy_retries (environment variable KV_ROUTER_PROXY_RETRIES) has no effect without --proxy",
        "proxy_connect_timeout_secs (flag --proxy-connect-timeout-secs) has no effect without --proxy",
    ]
    assert "WARNING" not in _kv("config", "show", "--proxy", "--proxy-retries", "4").stderr


def test_a_proxy_cap_under_several_processes_is_a_warning_saying_how_many_reach_the_workers() -> None:
    """Each of --processes N admits its own proxy_max_concurrent_requests: a cap sized for the workers
    let N times as many reach them, without a word."""
    done = _kv("config", "show", "--proxy", "--processes", "3", "--proxy-max-concurrent-requests", "8")
    assert done.returncode == 0, done.stderr
    said = [line.split("WARNING api.cli: ")[-1] for line in done.stderr.splitlines() if "WARNING" in line]
    assert said == [
        "proxy_max_concurrent_requests 8 holds per process: the 3 processes forward up to 24 requests at a time "
        "(give each process its share of what the workers take)"
    ]
    assert "WARNING" not in _kv("config", "show", "--proxy", "--proxy-max-concurrent-requests", "8").stderr


def test_variables_in_use_that_are_no_settings_are_no_warning() -> None:
    """Every KV_ROUTER_* name the repository uses (the bridge's, CI's, the tests' and benchmarks'), and
    what Kubernetes sets for the kv-router Service (and a kv-router-metrics one) in every pod."""
    in_use = {
        name
        for path in ROOT.rglob("*")
        if path.suffix in (".py", ".md", ".sh", ".toml", ".yaml", ".yml") or path.name in ("Dockerfile", "run")
        if not {".git", ".venv"} & set(path.parts) and path.is_file()
        for name in re.findall(r"\bKV_ROUTER_\w*[A-Z0-9]\b", path.read_text(errors="replace"))
    }
    assert {"KV_ROUTER_BRIDGE_WORKER_ID", "KV_ROUTER_NO_NATIVE", "KV_ROUTER_VLLM_PYTHON"} <= in_use
    service_links = {
        "KV_ROUTER_SERVICE_HOST": "10.96.0.10",
        "KV_ROUTER_SERVICE_PORT": "8000",
        "KV_ROUTER_SERVICE_PORT_HTTP": "8000",
        "KV_ROUTER_PORT_8000_TCP": "tcp://10.96.0.10:8000",
        "KV_ROUTER_PORT_8000_TCP_PROTO": "tcp",
        "KV_ROUTER_PORT_8000_TCP_PORT": "8000",
        "KV_ROUTER_PORT_8000_TCP_ADDR": "10.96.0.10",
        "KV_ROUTER_METRICS_SERVICE_HOST": "10.96.0.11",
        "KV_ROUTER_METRICS_PORT": "tcp://10.96.0.11:9000",
    }
    assert stray_variables({**dict.fromkeys(in_use, "1"), **service_links}) == []


def test_bad_config_files_and_environment(tmp_path: Path) -> None:
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"block_size": ')
    unreadable = tmp_path / "secret.toml"
    unreadable.write_text("port = 1\n")
    unreadable.chmod(0)
    json_flag = tmp_path / "flag.json"
    json_flag.write_text("{}")
    typo = tmp_path / "typo.toml"
    typo.write_text("blok_size = 32\n")
    yaml = tmp_path / "kv.yaml"
    yaml.write_text("block_size: 32\n")
    cases = [
        (["serve", "--config", str(bad_json)], None, "is not valid JSON"),
        (["serve", "--config", str(typo)], None, "blok_size: unknown setting in config file"),
        (["serve", "--config", str(typo)], None, "did you mean 'block_size'?"),
        (["serve", "--config", str(yaml)], None, "YAML is not read; write it as TOML (.toml) or JSON"),
        (["serve", "--config", str(tmp_path)], None, "cannot read config file"),
        (["serve"], {"KV_ROUTER_POLICY": "foo"}, "unknown policy 'foo'; choose from"),
        (["serve"], {"KV_ROUTER_BLOCK_SIZE": "x"}, "environment variable KV_ROUTER_BLOCK_SIZE"),
    ]
    readable = unreadable.open().close() is None if _is_root() else False
    if not readable:
        cases.append((["serve", "--config", str(unreadable)], None, "cannot read config file"))
    for argv, env, says in cases:
        done = _kv(*argv, env={"PATH": "/usr/bin:/bin", **(env or {})})
        assert done.returncode == 2 and says in done.stderr, (argv, done.stderr)
        assert len(done.stderr.splitlines()) == 1


def test_one_setting_turns_the_http_protocol_off(tmp_path: Path) -> None:
    """``fast_protocol`` alone says whether kv-router's HTTP protocol is in front; the old second
    switch (``fast_path``) is refused wherever it is given, with the setting to use instead."""
    old = tmp_path / "old.toml"
    old.write_text("fast_path = false\n")
    done = _kv("serve", "--config", str(old), env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 2, done.stderr
    assert "fast_path: unknown setting in config file" in done.stderr
    assert "removed, use 'fast_protocol'" in done.stderr
    done = _kv("serve", "--port", "1", env={"PATH": "/usr/bin:/bin", "KV_ROUTER_FAST_PATH": "0"})
    assert done.returncode == 2, done.stderr
    assert "fast_path: unknown setting in environment variable KV_ROUTER_FAST_PATH; removed, use 'fast_protocol'" in (
        done.stderr
    )
    done = _kv("serve", "--no-fast-path", "--port", "1", env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 2 and "unrecognized arguments: --no-fast-path" in done.stderr, done.stderr
    shown = _kv("config", "show", "--no-fast-protocol", env={"PATH": "/usr/bin:/bin"})
    assert "fast_protocol = false  # flag --no-fast-protocol" in shown.stdout.splitlines(), shown.stdout
    assert "fast_path" not in shown.stdout


def _is_root() -> bool:
    import os

    return os.geteuid() == 0


def test_config_show_prints_values_and_their_sources(tmp_path: Path) -> None:
    config = tmp_path / "kv.toml"
    config.write_text('block_size = 64\npolicy = "round_robin"\nport = 9001\n')
    env = {"PATH": "/usr/bin:/bin", "KV_ROUTER_PORT": "9002", "KV_ROUTER_NATS_TOKEN": "nats-secret",
           "KV_ROUTER_NATS_URL": "nats://nats.example:4222"}  # fmt: skip
    done = _kv("config", "show", "--config", str(config), "--block-size", "32", env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "block_size = 32  # flag --block-size" in lines
    assert f'policy = "round_robin"  # config file {config}' in lines
    assert "port = 9002  # environment variable KV_ROUTER_PORT" in lines
    assert "router_temperature = 0.0  # default" in lines
    assert 'nats_url = "nats://nats.example:4222"  # environment variable KV_ROUTER_NATS_URL' in lines
    assert 'nats_token = "***"  # environment variable KV_ROUTER_NATS_TOKEN' in lines
    assert "nats-secret" not in done.stdout


def test_config_show_output_is_a_config_file_giving_the_same_settings(tmp_path: Path) -> None:
    settings, origin = resolve_settings(flags={"block_size": "8", "router_queue_threshold": "1.5", "port": "1"})
    shown = tmp_path / "shown.toml"
    shown.write_text(show_settings(settings, origin))
    assert load_settings(config_file=shown) == settings


def test_the_example_config_file_loads(tmp_path: Path) -> None:
    # Its file paths point at a deployment's mounts: make them exist here.
    text = EXAMPLE.read_text().replace("/etc/kv-router/", f"{tmp_path}/")
    for relative in re.findall(re.escape(str(tmp_path)) + r"/([\w/.-]+)", text):
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".creds":  # checked to hold a user JWT and seed
            path.write_text("-----BEGIN NATS USER JWT-----\neyJ\n-----BEGIN USER NKEY SEED-----\nSU\n")
        elif path.suffix in (".crt", ".key"):  # loaded as a pair
            cert, key = self_signed(path.parent, path.stem)
            assert {cert, key} >= {path}
        else:
            path.write_text("example-token\n")
    example = tmp_path / "example.toml"
    example.write_text(text)
    settings = load_settings(config_file=example)
    assert tomllib.loads(EXAMPLE.read_text())["block_size"] == settings.router.block_size == 64
    assert settings.router.router_queue_threshold == 2.0
    (engine,) = settings.engines.engine_specs()
    assert (engine.worker_id, engine.replay, engine.url) == (7, "tcp://10.0.0.7:5558", "http://10.0.0.7:8100")
    assert settings.event_plane.nats_url == "tls://nats.example.internal:4222"
    assert settings.security.token() == "example-token"
    assert settings.security.ssl_certfile is not None


def test_config_show_reads_the_example_on_any_machine() -> None:
    # The file says to run this; its paths are a deployment's mounts, absent here: shown, not refused.
    done = _kv("config", "show", "--config", str(EXAMPLE.relative_to(ROOT)))
    assert done.returncode == 0, done.stderr
    assert "block_size = 64  # config file docs/kv-router.example.toml" in done.stdout
    assert "# kv-router serve would refuse these settings on this host:" in done.stdout
    refused = done.stdout.partition("# kv-router serve would refuse these settings on this host:\n")[2]
    # Every file the host lacks, each once: not only the first, for the next to show once it is fixed.
    assert [line.partition(":")[0] for line in refused.splitlines()] == [
        "#   api_token_file",
        "#   ssl_certfile",
        "#   ssl_keyfile",
        "#   nats_tls_ca_file",
        "#   nats_creds_file",
    ], refused
    assert "#   api_token_file: cannot read /etc/kv-router/api-token" in done.stdout
    comment = next(line for line in EXAMPLE.read_text().splitlines() if line.startswith("policy ="))
    assert all(name in comment for name in policy_names()), comment


def test_docs_work_offline() -> None:
    with serve() as client:
        for page in ("/docs", "/redoc"):
            html = client.get(page)
            assert html.status_code == 200
            # No external host anywhere in the page: every asset comes from this service.
            assert not re.findall(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}", html.text), html.text
            for asset in re.findall(r'(?:src|href)="(/[^"]+)"', html.text):
                reply = client.get(asset)
                assert reply.status_code == 200 and len(reply.content) > 1000, asset
        assert "validatorUrl" in client.get("/docs").text
        assert client.get("/openapi.json").json()["paths"]["/v1/new"]


@pytest.mark.parametrize(
    ("host", "says"),
    [("127.0.0.1", "the port is in use"), ("nope.invalid", "the host does not resolve")],
    ids=["port-in-use", "unresolvable-host"],
)
def test_an_address_it_cannot_listen_on_is_one_line_and_nothing_left_running(host: str, says: str) -> None:
    nats_port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        done = _kv("serve", "--host", host, "--port", str(port), "--embedded-nats-port", str(nats_port))
        elapsed = time.monotonic() - started
    shown = f"{host}:{port}"
    assert done.returncode == 1, done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"kv-router serve: cannot listen on {shown}: {says}")
    # Refused before anything started: no embedded nats-server was ever on its port.
    assert "nats-server" not in done.stderr and elapsed < 30
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", nats_port))


PROXY_PATHS = {"/v1/completions": "post", "/v1/chat/completions": "post", "/v1/models": "get"}


def test_docs_list_the_proxy_routes_when_the_proxy_is_on() -> None:
    with serve() as client:
        assert not PROXY_PATHS.keys() & client.get("/openapi.json").json()["paths"].keys()
    settings = Settings(proxy=ProxyConfig(proxy=True))
    with TestClient(create_app(settings, registry=CollectorRegistry()), base_url="http://127.0.0.1") as client:
        document = client.get("/openapi.json").json()
        for path, method in PROXY_PATHS.items():
            assert method in document["paths"][path], path
        completions = document["paths"]["/v1/completions"]["post"]
        body = completions["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
        assert {"model", "prompt", "stream"} <= document["components"]["schemas"][body]["properties"].keys()
        assert "text/event-stream" in completions["responses"]["200"]["content"]
        assert "/v1/new" in document["paths"]  # the router's own routes stay
        assert client.get("/docs").status_code == 200

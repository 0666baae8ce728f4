"""``kv-router``'s flags, environment variables and config file resolve to the same settings."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from api.cli import build_parser, main
from api.config import SECTIONS, ServiceConfig, load_settings
from api.version import package_version
from router.config import RouterConfig
from router.errors import ConfigError


def _serve_flags() -> set[str]:
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    return {action.dest for action in serve._actions if action.dest not in ("help", "config")}


def test_every_setting_has_a_flag_and_no_flag_is_extra() -> None:
    fields = {name for struct in SECTIONS.values() for name in struct.__struct_fields__}
    assert {"block_size", "port", "nats_url", "worker_lease_secs"} <= fields
    assert _serve_flags() == fields


def test_section_fields_do_not_collide() -> None:
    seen: list[str] = [name for struct in SECTIONS.values() for name in struct.__struct_fields__]
    assert len(seen) == len(set(seen))


def test_defaults_are_the_structs_defaults() -> None:
    settings = load_settings()
    assert settings.router == RouterConfig()
    assert settings.service == ServiceConfig()


def test_flags_env_and_file_with_precedence(tmp_path: Path) -> None:
    config = tmp_path / "router.toml"
    config.write_text('block_size = 64\npolicy = "round_robin"\nport = 9001\nrouter_queue_threshold = 2.0\n')
    env = {
        "KV_ROUTER_BLOCK_SIZE": "32",
        "KV_ROUTER_ROUTER_TEMPERATURE": "0.5",
        "KV_ROUTER_ROUTER_QUEUE_THRESHOLD": "none",
    }
    settings = load_settings(
        flags={"block_size": "128", "router_track_active_blocks": False}, env=env, config_file=config
    )
    assert settings.router.block_size == 128  # flag over env over file
    assert settings.router.router_temperature == 0.5  # env
    assert settings.router.router_queue_threshold is None  # env "none" clears the file's value
    assert settings.router.policy == "round_robin"  # file
    assert settings.service.port == 9001  # file
    assert settings.router.router_track_active_blocks is False  # flag


def test_json_config_file(tmp_path: Path) -> None:
    config = tmp_path / "router.json"
    config.write_text(json.dumps({"overlap_score_credit": 2, "log_format": "json"}))
    settings = load_settings(config_file=config)
    assert settings.router.overlap_score_credit == 2.0
    assert settings.service.log_format == "json"


def test_unrelated_prefixed_environment_is_ignored() -> None:
    # CI exports KV_ROUTER_CI_VENV: not a setting, and not an error.
    assert load_settings(env={"KV_ROUTER_CI_VENV": ".venv", "HOME": "/root"}).router == RouterConfig()


@pytest.mark.parametrize(
    ("flags", "env", "file_text", "says"),
    [
        ({"block_size": "0"}, {}, None, "block_size: must be a positive integer, got 0 (from flag --block-size)"),
        (
            {},
            {"KV_ROUTER_PORT": "eighty"},
            None,
            "port: expected an integer, got 'eighty' (from environment variable KV_ROUTER_PORT)",
        ),
        ({}, {}, '{"blok_size": 3}', "blok_size: unknown setting in config file"),
        ({}, {}, "[1, 2]", "must hold one table of settings"),
        # `config show` heads each section's keys with its name; taken for a table, the key was "unknown".
        ({}, {}, '{"proxy": {"proxy_retries": 3}}', "proxy: config file "),
        (
            {},
            {},
            '{"security": {"protect_reads": true}}',
            "[security] is a table, but the settings are keys of the top",
        ),
        # Dropped for the embedded server's own token: the user thought them in use.
        ({"nats_token": "t"}, {}, None, "nats_token: is for a NATS server given with nats_url"),
        ({}, {"KV_ROUTER_NATS_USER": "u"}, None, "nats_user: is for a NATS server given with nats_url"),
        # Every site a user visits could call with the user's credentials.
        (
            {"cors_allow_origins": ["*"], "cors_allow_credentials": True},
            {},
            None,
            "cors_allow_credentials: with cors_allow_origins * any site could call",
        ),
        ({}, {}, "{", "is not valid JSON"),
        ({"router_queue_request_limit_per_worker": "2"}, {}, None, "needs router_queue_threshold"),
    ],
)
def test_bad_settings_name_the_setting_and_its_source(
    tmp_path: Path, flags: dict[str, str], env: dict[str, str], file_text: str | None, says: str
) -> None:
    config = None
    if file_text is not None:
        config = tmp_path / "settings.json"
        config.write_text(file_text)
    with pytest.raises(ConfigError) as caught:
        load_settings(flags=flags, env=env, config_file=config)
    assert says in str(caught.value)


def test_missing_config_file() -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(config_file=Path("/nonexistent/kv-router.toml"))


def test_parser_types_and_choices() -> None:
    parser = build_parser()
    args = vars(
        parser.parse_args(
            ["serve", "--block-size", "64", "--no-router-assume-kv-reuse", "--router-queue-policy", "wspt",
             "--log-format", "json", "--router-queue-threshold", "none"]
        )
    )  # fmt: skip
    assert args == {
        "command": "serve",
        "config": None,
        "block_size": "64",
        "router_assume_kv_reuse": False,
        "router_queue_policy": "wspt",
        "log_format": "json",
        "router_queue_threshold": None,
    }
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--router-queue-policy", "random"])


def test_cli_rejects_bad_settings_with_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--block-size", "-3"])
    assert exited.value.code == 2
    assert "block_size" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["", "X Request Id", "x-req:id", "x-req\u00e9"])
def test_a_request_id_header_that_is_no_header_name_is_refused(name: str) -> None:
    """Accepted before, it was written into every request to the workers and every answer, breaking them."""
    with pytest.raises(ConfigError, match=f"proxy_request_id_header: {re.escape(repr(name))} is not an HTTP header"):
        load_settings(flags={"proxy_request_id_header": name})
    assert load_settings(flags={"proxy_request_id_header": "X-Correlation_Id.2"}).proxy.proxy_request_id_header


def test_the_service_refuses_to_start_with_a_request_id_header_that_is_no_header_name() -> None:
    script = Path(sys.executable).with_name("kv-router")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "api.cli"]
    serve = [*command, "serve", "--proxy", "--no-embedded-nats", "--port", "0", "--proxy-request-id-header", "x-req:id"]
    # Bounded: the service that took it served on (and a test waiting for its exit would wait for good).
    done = subprocess.run(serve, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "proxy_request_id_header: 'x-req:id' is not an HTTP header name" in done.stderr


def test_version_from_the_console_script() -> None:
    script = Path(sys.executable).with_name("kv-router")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "api.cli"]
    done = subprocess.run([*command, "--version"], capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.strip() == f"kv-router {package_version()}"
    help_text = subprocess.run([*command, "serve", "--help"], capture_output=True, text=True, check=True, timeout=60)
    assert "--block-size" in help_text.stdout and "KV_ROUTER_BLOCK_SIZE" in help_text.stdout


def test_settings_round_trip_through_msgspec() -> None:
    settings = load_settings(flags={"block_size": "8"})
    assert msgspec.convert(msgspec.to_builtins(settings.router), RouterConfig) == settings.router

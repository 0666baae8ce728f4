"""List settings explain how they are written: a ``KV_ROUTER_*`` variable holding a plain string for a list
says that it wants a JSON list and shows the line to write; every list flag's help says "environment: a
JSON list", and its default is the real one, as ``kv-router config show`` prints it."""

from __future__ import annotations

import argparse
import os
import subprocess

import pytest

from api.cli import build_parser
from api.config import SECTIONS, load_settings
from router.errors import ConfigError
from tests.router_processes import ROOT, kv_router_command


def test_a_list_in_the_environment_that_is_no_json_list_says_how_to_write_it() -> None:
    with pytest.raises(ConfigError) as error:
        load_settings(env={"KV_ROUTER_CORS_ALLOW_METHODS": "GET, PUT"})
    assert 'a JSON list: KV_ROUTER_CORS_ALLOW_METHODS=\'["GET", "PUT"]\'' in str(error.value)
    assert load_settings(env={"KV_ROUTER_CORS_ALLOW_METHODS": '["GET", "PUT"]'}).service.cors_allow_methods == [
        "GET",
        "PUT",
    ]


def test_config_show_with_a_plain_string_list_variable_is_one_line_with_the_format() -> None:
    env = {**os.environ, "KV_ROUTER_CORS_ALLOW_ORIGINS": "https://a.example"}
    done = subprocess.run([*kv_router_command(), "config", "show"], capture_output=True, text=True, timeout=60,
                          env=env, cwd=ROOT)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert "cors_allow_origins: expected a list, got 'https://a.example'" in done.stderr
    assert """a JSON list: KV_ROUTER_CORS_ALLOW_ORIGINS='["https://a.example"]'""" in done.stderr


def _serve_help() -> dict[str, str]:
    parser = build_parser(plugins={})
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    return {action.dest: action.help or "" for action in serve._actions}


def test_every_list_flag_says_its_environment_form_and_its_real_default() -> None:
    helps = _serve_help()
    defaults: dict[str, list[str]] = {}
    for struct in SECTIONS.values():
        instance = struct()
        for name in struct.__struct_fields__:
            value = getattr(instance, name)
            if isinstance(value, list):
                defaults[name] = value
    assert {"cors_allow_origins", "cors_allow_methods", "engine", "engine_zmq", "tokenizer"} <= defaults.keys()
    for name, value in defaults.items():
        text = helps[name]
        assert "environment: a JSON list" in text, (name, text)
        shown = "[" + ", ".join(f'"{item}"' for item in value) + "]"
        assert f"default: {shown}]" in text, (name, text)
    assert 'default: ["GET", "POST"]]' in helps["cors_allow_methods"]

"""The ``kv-router`` command: ``kv-router serve``, ``kv-router --version``, and the subcommands other
packages register as ``kv_router.commands`` entry points (replay, mock-worker, demo from the simulator).

Flags are generated from the fields of every settings section (`api.config.SECTIONS`), so each
`RouterConfig` field has its flag without a hand-written list: ``block_size`` becomes
``--block-size``, booleans get ``--x`` / ``--no-x``, and a field whose type is not a scalar takes a
JSON value. Only the flags the user gave are passed on, so the config file and ``KV_ROUTER_*``
variables still apply to the others (see `api.config.load_settings` for the precedence).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Protocol

import msgspec

from api.config import ENV_PREFIX, SECTIONS, load_settings
from api.version import package_version
from router.errors import ConfigError

__all__ = ["COMMAND_ENTRY_POINTS", "Command", "build_parser", "main"]

# Other packages (the simulator, the engine bridge) add subcommands here, so this one imports none
# of them: an installation without one simply lacks its commands.
COMMAND_ENTRY_POINTS = "kv_router.commands"


class Command(Protocol):
    """What a ``kv_router.commands`` entry point names: a subcommand's help, flags and body."""

    @property
    def help(self) -> str: ...
    @property
    def description(self) -> str | None: ...
    def configure(self, parser: argparse.ArgumentParser) -> None: ...
    def run(self, args: argparse.Namespace) -> int: ...


class _Missing:
    """A subcommand whose package is not installed: it says so instead of failing at import."""

    description = None

    def __init__(self, name: str, error: ImportError) -> None:
        self.help = f"(not available in this installation: {error})"
        self._message = f"kv-router {name} is not available in this installation ({error})"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    def run(self, args: argparse.Namespace) -> int:
        print(self._message, file=sys.stderr)
        return 2


def plugin_commands() -> dict[str, Command]:
    commands: dict[str, Command] = {}
    for entry in sorted(entry_points(group=COMMAND_ENTRY_POINTS), key=lambda e: e.name):
        try:
            commands[entry.name] = entry.load()
        except ImportError as exc:
            commands[entry.name] = _Missing(entry.name, exc)
    return commands


def _unwrap(t: msgspec.inspect.Type) -> tuple[msgspec.inspect.Type, str | None]:
    """The field's type without its metadata, and the description found in that metadata."""
    description = None
    while isinstance(t, msgspec.inspect.Metadata):
        description = description or (t.extra_json_schema or {}).get("description")
        t = t.type
    return t, description


def _without_none(t: msgspec.inspect.Type) -> msgspec.inspect.Type:
    if isinstance(t, msgspec.inspect.UnionType):
        rest = [u for u in t.types if not isinstance(u, msgspec.inspect.NoneType)]
        if len(rest) == 1:
            return _unwrap(rest[0])[0]
    return t


_SCALARS = (
    msgspec.inspect.IntType,
    msgspec.inspect.FloatType,
    msgspec.inspect.StrType,
    msgspec.inspect.LiteralType,
    msgspec.inspect.EnumType,
)


def _add_field_flag(group: argparse._ArgumentGroup, section: str, field: msgspec.inspect.Field) -> None:
    t, description = _unwrap(field.type)
    optional = isinstance(t, msgspec.inspect.UnionType) and any(
        isinstance(u, msgspec.inspect.NoneType) for u in t.types
    )
    t = _without_none(t)
    default = field.default if field.default is not msgspec.NODEFAULT else None
    flag = "--" + field.name.replace("_", "-")
    env = ENV_PREFIX + field.name.upper()
    text = description or f"{section} setting {field.name}"
    text = f"{text} [env {env}; default: {default}]"
    kwargs: dict[str, Any] = {"dest": field.name, "default": argparse.SUPPRESS, "help": text}
    if isinstance(t, msgspec.inspect.BoolType):
        group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        return
    if isinstance(t, msgspec.inspect.ListType) and isinstance(t.item_type, msgspec.inspect.StrType):
        group.add_argument(flag, action="append", metavar=field.name.upper(), **kwargs)
        return
    if isinstance(t, msgspec.inspect.LiteralType):
        kwargs["choices"] = [str(v) for v in t.values] + (["none"] if optional else [])
    elif isinstance(t, msgspec.inspect.EnumType):
        kwargs["choices"] = [str(m.value) for m in t.cls] + (["none"] if optional else [])
    elif not isinstance(t, _SCALARS):
        kwargs["type"] = _json_value
        kwargs["metavar"] = "JSON"
    if optional and "choices" not in kwargs and "type" not in kwargs:
        kwargs["type"] = _optional_value
    if "metavar" not in kwargs and "choices" not in kwargs:
        kwargs["metavar"] = field.name.upper()
    group.add_argument(flag, **kwargs)


def _optional_value(text: str) -> str | None:
    return None if text.strip().lower() in ("none", "null") else text


def _json_value(text: str) -> Any:
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None


def build_parser(plugins: dict[str, Command] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kv-router", description="KV-cache-aware request router for LLM engine fleets."
    )
    parser.add_argument("--version", action="version", version=f"kv-router {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve routing decisions over HTTP",
        description="Serve routing decisions, KV events and metrics over HTTP. Every flag can also be "
        f"set as an environment variable {ENV_PREFIX}<NAME> or as a key of the --config file.",
    )
    serve.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"JSON or TOML file of settings, keyed by field name [env {ENV_PREFIX}CONFIG]",
    )
    for section, struct in SECTIONS.items():
        info = msgspec.inspect.type_info(struct)
        assert isinstance(info, msgspec.inspect.StructType)
        group = serve.add_argument_group(f"{section} settings")
        for field in info.fields:
            _add_field_flag(group, section, field)
    for name, command in (plugin_commands() if plugins is None else plugins).items():
        command.configure(commands.add_parser(name, help=command.help, description=command.description))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    plugins = plugin_commands()
    parser = build_parser(plugins)
    namespace = parser.parse_args(argv)
    if namespace.command in plugins:
        return plugins[namespace.command].run(namespace)
    args = vars(namespace)
    command = args.pop("command")
    if command == "serve":
        config_file = args.pop("config") or _env_config_file()
        try:
            settings = load_settings(flags=args, env=os.environ, config_file=config_file)
        except ConfigError as exc:
            parser.error(str(exc))
        from api.server import serve  # imported late: --help and --version stay fast

        serve(settings)
    return 0


def _env_config_file() -> Path | None:
    value = os.environ.get(ENV_PREFIX + "CONFIG")
    return Path(value) if value else None


if __name__ == "__main__":
    sys.exit(main())

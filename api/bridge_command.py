"""``kv-router bridge``: run `router.engines.bridge.Bridge` beside one engine until SIGTERM.

Each `BridgeConfig` field is a flag (``--zmq-endpoint``), a ``KV_ROUTER_BRIDGE_*`` variable
(``KV_ROUTER_BRIDGE_ZMQ_ENDPOINT``) and a key of the ``--config`` file (``zmq_endpoint``); precedence,
lowest first: defaults, the file, the environment, flags.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from api.config import _none_if_null, _plain, _read_file, did_you_mean, flag_origin
from router.engines.bridge_config import BridgeConfig
from router.errors import ConfigError

__all__ = ["BRIDGE", "BRIDGE_ENV_PREFIX", "BridgeCommand", "load_bridge_config"]

BRIDGE_ENV_PREFIX = "KV_ROUTER_BRIDGE_"


def load_bridge_config(
    flags: Mapping[str, Any], env: Mapping[str, str], config_file: Path | None = None
) -> BridgeConfig:
    fields = set(BridgeConfig.__struct_fields__)
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    if config_file is not None:
        for name, value in _read_file(config_file).items():
            if name not in fields:
                raise ConfigError(name, f"unknown setting in config file {config_file}{did_you_mean(name, fields)}")
            merged[name], origin[name] = value, f"config file {config_file}"
    for key, value in env.items():
        name = key[len(BRIDGE_ENV_PREFIX) :].lower()
        if key.startswith(BRIDGE_ENV_PREFIX) and name in fields:
            parsed: Any = _none_if_null(value)
            if name in ("taints", "served_model") and parsed is not None:
                parsed = msgspec.json.decode(parsed) if parsed.lstrip().startswith("[") else parsed.split(",")
            merged[name], origin[name] = parsed, f"environment variable {key}"
    for name, value in flags.items():
        merged[name], origin[name] = value, flag_origin(name, value)
    try:
        return msgspec.convert(merged, BridgeConfig, strict=False)
    except msgspec.ValidationError as exc:
        message = str(exc)
        missing = message.removeprefix("Object missing required field `").removesuffix("`")
        if missing in fields and missing not in merged:
            flag, env_name = "--" + missing.replace("_", "-"), BRIDGE_ENV_PREFIX + missing.upper()
            raise ConfigError(missing, f"{flag} is required (or {env_name}, or {missing} in --config)") from None
        # msgspec names the field of a bad value (``at `$.x```); the config's own check starts with it (``x: ...``).
        field = next((n for n in origin if f"$.{n}`" in message or message.startswith(f"{n}: ")), "bridge")
        message = _plain(message, merged).removeprefix(f"{field}: ")
        where = origin.get(field)
        raise ConfigError(field, f"{message} (from {where})" if where else message) from None


def _flag_type(name: str, info: msgspec.inspect.Type) -> dict[str, Any]:
    if isinstance(info, msgspec.inspect.UnionType):
        info = next(t for t in info.types if not isinstance(t, msgspec.inspect.NoneType))
    if isinstance(info, msgspec.inspect.LiteralType):
        return {"choices": [str(v) for v in info.values]}
    if isinstance(info, msgspec.inspect.ListType):
        return {"action": "append", "metavar": name.upper().removesuffix("S")}
    if isinstance(info, msgspec.inspect.IntType):
        return {"type": int}
    if isinstance(info, msgspec.inspect.FloatType):
        return {"type": float}
    return {}


class BridgeCommand:
    help = "relay one vLLM / SGLang / TRT-LLM engine's ZMQ KV events to the routers over NATS"
    description = (
        "A sidecar next to one engine: subscribes to its KV-event PUB socket (and its replay socket), decodes "
        "every vLLM / SGLang / TensorRT-LLM event form, and publishes the events, the worker's registration, "
        f"heartbeats and load on the NATS event plane. Every flag is also {BRIDGE_ENV_PREFIX}<NAME> and a key "
        "of the --config file."
    )

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--config", type=Path, default=None, metavar="FILE", help="JSON or TOML settings file")
        info = msgspec.inspect.type_info(BridgeConfig)
        assert isinstance(info, msgspec.inspect.StructType)
        for field in info.fields:
            description = ""
            t = field.type
            while isinstance(t, msgspec.inspect.Metadata):
                description = description or (t.extra_json_schema or {}).get("description", "")
                t = t.type
            default = None if field.default is msgspec.NODEFAULT else field.default
            env = BRIDGE_ENV_PREFIX + field.name.upper()
            parser.add_argument(
                "--" + field.name.replace("_", "-"),
                dest=field.name,
                default=argparse.SUPPRESS,
                help=f"{description} [env {env}; default: {default}]",
                **_flag_type(field.name, t),
            )

    def run(self, args: argparse.Namespace) -> int:
        import asyncio
        import logging
        import signal

        from router.engines.bridge import Bridge
        from router.engines.engine_spec import EndpointRefused
        from router.event_plane.connection import (
            NatsOptions,
            check_certificate,
            check_creds_file,
            check_nats_url,
            close_connection,
        )
        from router.event_plane.connection_file import DEFAULT_URL, ConnectionFileError
        from router.event_plane.first_connection import FirstConnectionError, LocalToolConnection
        from router.event_plane.jetstream import JetStreamUnavailable
        from router.event_plane.urls import redact_nats_url

        flags = vars(args).copy()
        flags.pop("command", None)
        config_file = flags.pop("config", None) or (
            Path(os.environ[BRIDGE_ENV_PREFIX + "CONFIG"]) if os.environ.get(BRIDGE_ENV_PREFIX + "CONFIG") else None
        )
        try:
            config = load_bridge_config(flags, os.environ, config_file)
            if config.nats_url is not None:
                check_nats_url(config.nats_url)
            if config.nats_creds_file is not None:
                check_creds_file(config.nats_creds_file)
            if config.nats_tls_cert_file is not None:
                try:
                    check_certificate(config.nats_tls_cert_file, config.nats_tls_key_file)
                except ValueError as exc:
                    raise ValueError(f"nats_tls_cert_file: {exc}") from None
        except (ConfigError, ValueError) as exc:
            print(f"kv-router bridge: {exc}", file=sys.stderr)
            return 2
        logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        # httpx logs every request at INFO: one line per engine-metrics scrape, every second.
        logging.getLogger("httpx").setLevel(logging.WARNING)

        # Without a URL: a router's embedded NATS on this host, its URL and token from the router's
        # connection file (read again at each attempt: the router may still be starting).
        options = NatsOptions.from_settings(
            msgspec.structs.replace(config, nats_url=config.nats_url or DEFAULT_URL),
            name=f"kv-router-bridge-{config.worker_id}",
        )
        connection = LocalToolConnection("kv-router bridge", config.nats_url, options, wait_s=config.nats_wait_secs)
        nats_wait = (
            f"NATS at {redact_nats_url(options.url)}" if config.nats_url else "the NATS of a local kv-router serve"
        )

        async def serve() -> int:
            stopping = asyncio.Event()
            signalled: list[signal.Signals] = []
            bridge: Bridge | None = None

            async def run_bridge() -> int:
                nonlocal bridge
                try:
                    nc, resolved = await connection.connect()
                except (ConnectionFileError, FirstConnectionError) as exc:
                    print(f"kv-router bridge: {exc}", file=sys.stderr)
                    return 2
                bridge = Bridge(config, nc)
                shown = redact_nats_url(resolved.url)
                metrics = None
                try:
                    if config.metrics_port is not None:
                        # Here, not above: the service's metrics modules are 25 more modules, ~50 ms of every start.
                        from api.bridge_metrics import bridge_registry, serve_metrics

                        try:
                            metrics = await serve_metrics(
                                bridge_registry(bridge), config.metrics_host, config.metrics_port
                            )
                        except OSError as exc:
                            print(f"kv-router bridge: --metrics-port: {exc}", file=sys.stderr)
                            return 2
                        host, port = metrics.sockets[0].getsockname()[:2]
                        print(
                            f"bridge for worker {config.worker_id}: metrics on http://{host}:{port}/metrics", flush=True
                        )
                    print(f"bridge for worker {config.worker_id}: {config.zmq_endpoint} -> {shown}", flush=True)
                    try:
                        await bridge.run_until(stopping)
                    except EndpointRefused as exc:
                        print(f"kv-router bridge: {exc}", file=sys.stderr)
                        return 2
                    except JetStreamUnavailable as exc:
                        print(f"kv-router bridge: NATS at {shown}: {exc}", file=sys.stderr)
                        return 2
                    return 0
                finally:
                    if metrics is not None:
                        metrics.close()  # a scrape under way ends within its read timeout: waited for, not cut off
                        await metrics.wait_closed()
                    await close_connection(nc)

            run = asyncio.create_task(run_bridge())

            def on_signal(sig: signal.Signals) -> None:
                if signalled:  # the first only: a second must not cut short the stop under way
                    return
                signalled.append(sig)
                stopping.set()
                if bridge is None or bridge.waiting_for is not None:
                    run.cancel()  # a start may wait without end (NATS out of reach): cut short

            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, on_signal, sig)
            try:
                return await run
            except asyncio.CancelledError:
                if not signalled:
                    raise  # not our stop: the run itself is being cancelled
                # Said, and not a success: a bridge stopped before its start completed never relayed.
                waiting_for = nats_wait if bridge is None else bridge.waiting_for
                print(f"kv-router bridge: stopped by {signalled[0].name} before its start completed (still waiting "
                      f"for {waiting_for})", file=sys.stderr)  # fmt: skip
                return 2

        return asyncio.run(serve())


BRIDGE = BridgeCommand()

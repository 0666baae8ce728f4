"""`EngineSpec`: one engine heard directly (``kv-router serve --engine``), parsed; light to import (the
CLI checks specs before anything starts)."""

from __future__ import annotations

from typing import NamedTuple

from router.engines.openai_server import openai_base

__all__ = [
    "ENGINE_SPEC_FORM",
    "MAX_DP_SIZE",
    "MAX_ENGINE_FRAME_BYTES",
    "EndpointRefused",
    "EngineSpec",
    "check_rank_ports",
    "check_zmq_endpoint",
    "is_ipv6_literal",
    "parse_engine_spec",
    "rank_endpoint",
]

# The largest frame an engine's socket may send us (libzmq drops the connection past it, before reading
# the frame): without it a peer's frame of any size is read whole into memory. Real batches measure
# 35 B to 4.3 KiB (shared/vectors/real-engines: vLLM 0.32, SGLang); a step that stores a 1M-token
# prompt at once, the longest context an engine takes, is ~5 MiB of msgpack token ids (5 B each).
MAX_ENGINE_FRAME_BYTES = 16 << 20

# Data-parallel ranks one --engine may name (each one a socket, and a port, of its own).
MAX_DP_SIZE = 256


class EndpointRefused(ValueError):
    """ZMQ refused an engine's endpoint on connect (`check_zmq_endpoint` lets none such through): a
    stream's start fails with it, in one line, rather than retrying what would fail alike."""


class EngineSpec(NamedTuple):
    """One ``--engine`` (``--engine-zmq``): ``WORKER_ID=tcp://HOST:PORT[,replay=tcp://HOST:PORT]
    [,url=http://HOST:PORT[/PREFIX][/v1]][,models=NAME+NAME][,dp=N]``. With ``dp=N`` (an engine run with
    ``--data-parallel-size N``) rank ``r`` publishes on ``PORT + r`` and replays on the replay port plus
    ``r``, as vLLM lays them out."""

    worker_id: int
    endpoint: str
    replay: str | None = None
    url: str | None = None  # the engine's OpenAI server root (`openai_base`)
    models: tuple[str, ...] | None = None  # None: asked from the engine's /v1/models
    dp_size: int = 1

    def __str__(self) -> str:
        options = [f"replay={self.replay}"] if self.replay else []
        options += [f"url={self.url}"] if self.url else []
        options += ["models=" + "+".join(self.models)] if self.models is not None else []
        options += [f"dp={self.dp_size}"] if self.dp_size != 1 else []
        return ",".join([f"{self.worker_id}={self.endpoint}", *options])

    def addresses(self) -> list[tuple[str, str]]:
        """Where this engine is heard, each address named: every rank's event and replay socket, and its
        URL. Two engines never share one (`api.config` refuses it)."""
        named = [("url", self.url)] if self.url else []
        for _, event, replay in self.rank_endpoints():
            named += [("event endpoint", event)] + ([("replay endpoint", replay)] if replay else [])
        return named

    def rank_endpoints(self) -> list[tuple[int, str, str | None]]:
        """Each dp rank with its event socket and its replay socket (None: no replay)."""
        return [
            (
                rank,
                rank_endpoint(self.endpoint, rank),
                None if self.replay is None else rank_endpoint(self.replay, rank),
            )
            for rank in range(self.dp_size)
        ]


ENGINE_SPEC_FORM = "WORKER_ID=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,url=http://HOST:PORT][,models=NAME+NAME][,dp=N]"


def _is_port_number(port: str) -> bool:
    """ASCII digits only: ``str.isdigit`` takes other scripts' digits (Arabic-Indic U+0660..U+0669), which
    ``int`` reads and ZMQ refuses on connect."""
    return port.isascii() and port.isdigit()


def check_zmq_endpoint(endpoint: str, what: str, *, bind: bool = False) -> None:
    """Raise ``ValueError`` (one line) unless ``endpoint`` is an address an engine's ZMQ socket can be
    reached at, ``tcp://HOST:PORT`` (or ``ipc://PATH``): ZMQ refuses anything else on every connect, so
    a stream given one would fail again and again. ``what`` names the socket (event, replay).

    The engine's bind address is refused too (``tcp://*:5557``, vLLM's documented value, copied; or no
    host): ZMQ refuses ``*`` on a connect, and connects an empty host nowhere. So is a port outside
    1-65535, which ZMQ takes and never reaches (it binds one past 65535 as its remainder). With
    ``bind`` the address is one to bind, as an engine's is: ``*`` is every interface there."""
    scheme, sep, rest = endpoint.partition("://")
    host, colon, port = rest.rpartition(":")
    valid = sep and "=" not in endpoint and (
        (scheme == "tcp" and colon and _is_port_number(port)) or (scheme == "ipc" and rest)
    )  # fmt: skip
    if not valid:
        raise ValueError(f"the {what} endpoint must be tcp://HOST:PORT, got {endpoint!r}")
    if scheme != "tcp":
        return
    bracketed = host.startswith("[") and host.endswith("]") and host.count("[") == host.count("]") == 1
    if ("[" in host or "]" in host) and not (bracketed and len(host) > 2):
        raise ValueError(
            f"the {what} endpoint {endpoint!r} has a malformed IPv6 host {host!r}: write tcp://[ADDRESS]:PORT"
        )
    if host == "" or (host == "*" and not bind):
        problem = "has no host" if not host else "is a bind address (* binds every interface)"
        raise ValueError(
            f"the {what} endpoint {endpoint!r} {problem}: give the engine's address to connect to, not the "
            f"address it binds, e.g. tcp://127.0.0.1:{port} for an engine on this host"
        )
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"the {what} endpoint {endpoint!r} has port {port}: a TCP port is 1 to 65535")


def is_ipv6_literal(endpoint: str) -> bool:
    """``tcp://[ADDRESS]:PORT``: libzmq connects to it only with ``zmq.IPV6``, which for a host name
    (``localhost``) would take the name's IPv6 address alone, where an engine bound to ``tcp://*:PORT``
    does not listen."""
    return endpoint.partition("://")[2].startswith("[")


def rank_endpoint(endpoint: str, dp_rank: int) -> str:
    """vLLM's layout: rank ``r`` of ``tcp://HOST:PORT`` listens on ``PORT + r``."""
    if dp_rank == 0:
        return endpoint
    head, sep, port = endpoint.rpartition(":")
    if not sep or not _is_port_number(port):
        raise ValueError(f"{endpoint!r} has no port to offset for dp rank {dp_rank}")
    return f"{head}:{int(port) + dp_rank}"


def parse_engine_spec(spec: str) -> EngineSpec:
    """An ``--engine`` spec (see `EngineSpec`); raises ``ValueError`` saying what is wrong, in one line."""
    worker, sep, rest = spec.partition("=")
    try:
        worker_id = int(worker.strip())
    except ValueError:
        raise ValueError(f"engine {spec!r}: expected {ENGINE_SPEC_FORM}") from None
    if not 0 <= worker_id < 1 << 64:
        raise ValueError(f"engine {spec!r}: the worker id must be a u64")
    parts = [part.strip() for part in rest.split(",")]
    if not sep or not parts[0]:
        raise ValueError(f"engine {spec!r}: no endpoint after {worker!r}=")
    endpoint = parts[0]
    try:
        check_zmq_endpoint(endpoint, "event")
    except ValueError as exc:
        raise ValueError(f"engine {spec!r}: {exc}") from None
    options: dict[str, str] = {}
    for option in parts[1:]:
        key, _, value = option.partition("=")
        if key not in ("replay", "url", "models", "dp") or not value:
            raise ValueError(f"engine {spec!r}: unknown or empty option {option!r} (replay=, url=, models=, dp=)")
        if key in options:
            raise ValueError(f"engine {spec!r}: {key}= given twice")
        options[key] = value
    url = None
    if "url" in options:
        try:
            url = openai_base(options["url"])
        except ValueError as exc:
            raise ValueError(f"engine {spec!r}: url: {exc}") from None
    models = None
    if "models" in options:
        if url is None:
            raise ValueError(f"engine {spec!r}: models= needs url= (the models served there)")
        models = tuple(name for name in options["models"].split("+") if name)
    dp_size = _dp_size(spec, options.get("dp", "1"))
    replay = options.get("replay")
    if replay is not None:
        try:
            check_zmq_endpoint(replay, "replay")
        except ValueError as exc:
            raise ValueError(f"engine {spec!r}: {exc}") from None
        if replay == endpoint:
            raise ValueError(
                f"engine {spec!r}: the replay endpoint is the event endpoint {endpoint}: the engine's replay socket "
                "listens on a port of its own (vLLM's replay_endpoint)"
            )
    if dp_size > 1:
        try:
            check_rank_ports(endpoint, replay, dp_size)
        except ValueError as exc:
            raise ValueError(f"engine {spec!r}: {exc}") from None
    return EngineSpec(worker_id, endpoint, replay, url, models, dp_size)


def _dp_size(spec: str, value: str) -> int:
    try:
        dp_size = int(value)
    except ValueError:
        dp_size = 0
    if not 1 <= dp_size <= MAX_DP_SIZE:
        raise ValueError(
            f"engine {spec!r}: dp= takes the engine's data-parallel size, 1 to {MAX_DP_SIZE}, got {value!r}"
        )
    return dp_size


def check_rank_ports(endpoint: str, replay: str | None, dp_size: int) -> None:
    """Each rank's sockets are a port above the last rank's: both must be TCP ports that leave room, and
    the event and replay ranges must not meet. Raises ``ValueError`` saying what is wrong."""
    ranges: list[tuple[str, int]] = []
    for name, address in (("event", endpoint), ("replay", replay)):
        if address is None:
            continue
        head, sep, port = address.rpartition(":")
        if not address.startswith("tcp://") or not sep or not _is_port_number(port):
            raise ValueError(f"dp={dp_size} needs tcp://HOST:PORT {name} sockets, got {address!r}")
        if int(port) + dp_size - 1 > 65535:
            raise ValueError(f"{name} ports {port}+0..{dp_size - 1} pass 65535")
        ranges.append((head, int(port)))
    if len(ranges) == 2:
        (event_host, event_port), (replay_host, replay_port) = ranges
        if event_host == replay_host and abs(event_port - replay_port) < dp_size:
            raise ValueError(
                f"with dp={dp_size} the event ports {event_port}..{event_port + dp_size - 1} and the replay ports "
                f"{replay_port}..{replay_port + dp_size - 1} overlap (rank r uses port + r for both): start the "
                "engine's replay endpoint at least dp ports away"
            )

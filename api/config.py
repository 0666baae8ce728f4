"""The service's configuration: its own HTTP settings beside the router's `RouterConfig`.

Every setting lives in one flat namespace of field names so that a flag (``--max-body-bytes``), an
environment variable (``KV_ROUTER_MAX_BODY_BYTES``) and a key of a config file (``max_body_bytes``)
name the same thing. Each *section* is a msgspec struct; `SECTIONS` lists them, so a later section
(the NATS event plane, say) joins the CLI, the environment and the file by being added there.

Precedence, lowest first: field defaults, the config file, ``KV_ROUTER_*`` variables, flags.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from router.config import RouterConfig
from router.engines.engine_spec import EngineSpec, parse_engine_spec
from router.engines.openai_server import ENGINE_HEALTH_TIMEOUT_SECS
from router.errors import ConfigError
from router.event_plane.jetstream import MAX_REPLICAS
from router.event_plane.urls import redact_nats_url
from router.policies.registry import policy_names
from router.types import url_problem

__all__ = [
    "ANY_MODEL",
    "ENV_PREFIX",
    "LIST_IN_ENVIRONMENT",
    "SECRETS",
    "SECTIONS",
    "EngineSourcesConfig",
    "EventPlaneConfig",
    "HaConfig",
    "ProxyConfig",
    "SecurityConfig",
    "ServiceConfig",
    "Settings",
    "closest_name",
    "flag_origin",
    "idle_settings",
    "load_settings",
    "masked",
    "per_process_caps",
    "resolve_settings",
    "stray_variables",
]

ENV_PREFIX = "KV_ROUTER_"
# How a list setting is written in its environment variable (every list flag's help says it).
LIST_IN_ENVIRONMENT = "environment: a JSON list"
# `ProxyConfig.tokenizer_paths`' key of the files for every model without its own.
ANY_MODEL = "*"
# Settings that are gone -> the one to use instead: refused with that hint wherever they are given (in
# the environment too, where an unknown KV_ROUTER_ name is otherwise another tool's), never ignored.
RETIRED = {"fast_path": "fast_protocol"}


def _doc(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


# Settings whose values are secrets: masked wherever settings are shown (`kv-router config show`, reprs).
SECRETS = frozenset({"api_token", "nats_password", "nats_token"})


def masked(name: str, value: Any) -> Any:
    """``value``, or ``"***"`` if setting ``name`` is a secret that is set; a NATS URL without the
    credentials it may carry (``nats://***@host:port``)."""
    if name == "nats_url" and isinstance(value, str):
        return redact_nats_url(value)
    return "***" if name in SECRETS and value is not None else value


PositiveSecs = Annotated[float, msgspec.Meta(gt=0)]


def _masked_repr(self: msgspec.Struct) -> str:
    shown = ", ".join(f"{name}={masked(name, getattr(self, name))!r}" for name in self.__struct_fields__)
    return f"{type(self).__name__}({shown})"


class ServiceConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How the HTTP service listens, logs and limits its inputs."""

    host: Annotated[str, _doc("address to listen on (use 0.0.0.0 inside a container)")] = "127.0.0.1"
    port: Annotated[int, _doc("TCP port to listen on"), msgspec.Meta(ge=0, le=65535)] = 8000
    log_level: Annotated[Literal["debug", "info", "warning", "error"], _doc("lowest level of log records written")] = (
        "info"
    )
    log_format: Annotated[Literal["text", "json"], _doc("plain text lines or one JSON object per line")] = "text"
    access_log: Annotated[bool, _doc("log one line per HTTP request (costs throughput)")] = False
    # 8 MiB is Dynamo select_service's body limit: a 16k-token prompt is about 115 KB of JSON, so this
    # leaves room for event batches while refusing runaway uploads before they are buffered.
    max_body_bytes: Annotated[int, _doc("largest request body accepted, in bytes"), msgspec.Meta(ge=1)] = (
        8 * 1024 * 1024
    )
    max_prompt_tokens: Annotated[
        int, _doc("longest prompt accepted by new / potential_loads / overlap"), msgspec.Meta(ge=1)
    ] = 1_048_576
    ready_min_workers: Annotated[
        int, _doc("/readyz answers 503 until at least this many workers are registered"), msgspec.Meta(ge=0)
    ] = 0
    fast_protocol: Annotated[
        bool,
        _doc(
            "serve HTTP with kv-router's own protocol (the hot and proxy routes answered before ASGI, the "
            "rest run on the app); turn off for uvicorn's stock httptools protocol: every request through FastAPI "
            "(and any middleware added to the app)"
        ),
    ] = True
    shutdown_timeout_secs: Annotated[
        int, _doc("on SIGTERM, seconds in-flight requests may take to finish"), msgspec.Meta(ge=0)
    ] = 30
    request_head_timeout_secs: Annotated[
        PositiveSecs,
        _doc(
            "longest a request's head (request line and headers) may take to arrive from its first byte; then a "
            "408 and the connection closes (kv-router's protocol: a client must not hold a connection open with a "
            "request it never finishes)"
        ),
    ] = 10.0
    request_body_timeout_secs: Annotated[
        PositiveSecs,
        _doc(
            "longest a request's body may go without a byte arriving while the service reads it; then a 408 and "
            "the connection closes (kv-router's protocol)"
        ),
    ] = 30.0
    response_write_timeout_secs: Annotated[
        PositiveSecs,
        _doc(
            "longest a client may read nothing of an answer the service has written (its own routes'; the "
            "proxy's streams have proxy_client_write_timeout_secs); then the connection is dropped (kv-router's "
            "protocol: a client that never reads would hold it, and what was written to it, for good)"
        ),
    ] = 60.0
    cors_allow_origins: Annotated[
        list[str],
        _doc(
            "browser origins allowed to call the service (CORS), e.g. https://app.example.com; * for any; "
            "repeatable; empty: CORS off"
        ),
    ] = []
    cors_allow_methods: Annotated[list[str], _doc("CORS: methods a browser may use (default GET, POST)")] = (
        msgspec.field(default_factory=lambda: ["GET", "POST"])
    )
    cors_allow_headers: Annotated[list[str], _doc("CORS: request headers a browser may send (default *: any)")] = (
        msgspec.field(default_factory=lambda: ["*"])
    )
    cors_allow_credentials: Annotated[
        bool, _doc("CORS: browsers may send cookies and the Authorization header (the origin is echoed, never *)")
    ] = False
    cors_max_age_secs: Annotated[
        int, _doc("CORS: seconds a browser may cache a preflight answer"), msgspec.Meta(ge=0)
    ] = 600

    def __post_init__(self) -> None:
        if self.cors_allow_credentials and "*" in self.cors_allow_origins:
            # The origin is echoed with credentials: every site a user visits could call with theirs.
            raise ConfigError("cors_allow_credentials", "with cors_allow_origins * any site could call with a "
                              "user's credentials: list the origins allowed")  # fmt: skip


class EventPlaneConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Where worker KV events, load, heartbeats and registrations come from (NATS)."""

    nats_url: Annotated[
        str | None,
        _doc(
            "NATS server of the workers' event plane (a cluster's: several URLs, comma-separated); unset: "
            "kv-router serve starts an embedded one"
        ),
    ] = None
    embedded_nats: Annotated[
        bool, _doc("without --nats-url, start a private nats-server on loopback (off: HTTP events only)")
    ] = True
    embedded_nats_port: Annotated[
        int, _doc("port of the embedded nats-server (a free one if taken)"), msgspec.Meta(ge=1, le=65535)
    ] = 4222
    nats_namespace: Annotated[str, _doc("deployment namespace: subjects kv.<namespace>.*")] = "default"
    nats_user: Annotated[
        str | None, _doc("user name for a NATS server with user / password authentication (with --nats-password)")
    ] = None
    nats_password: Annotated[
        str | None, _doc("password of --nats-user (prefer the environment variable: a flag shows in the process list)")
    ] = None
    nats_token: Annotated[str | None, _doc("token for a NATS server with token authentication")] = None
    nats_creds_file: Annotated[
        str | None, _doc("NATS credentials file (.creds: user JWT and nkey seed) for decentralised auth")
    ] = None
    nats_tls_ca_file: Annotated[
        str | None, _doc("PEM CA bundle to verify the NATS server's TLS certificate (turns TLS on)")
    ] = None
    nats_tls_cert_file: Annotated[
        str | None, _doc("PEM client certificate for NATS servers that verify clients (with --nats-tls-key-file)")
    ] = None
    nats_tls_key_file: Annotated[str | None, _doc("PEM private key of --nats-tls-cert-file")] = None
    nats_connection_file: Annotated[
        str | None,
        _doc(
            "where the embedded nats-server's URL and token are written (0600) for local tools, which read "
            "the same setting; unset: $XDG_RUNTIME_DIR/kv-router/nats-<port>.json, else ~/.cache/kv-router/"
        ),
    ] = None
    jetstream_replicas: Annotated[
        int,
        _doc(
            "copies JetStream keeps of the worker registry and, with durable events, of the event stream, "
            "snapshot store and cursor bucket: 3 on a three-server NATS cluster survives losing any one server "
            "(1 lives on one server); existing ones are scaled to it at start"
        ),
        msgspec.Meta(ge=1, le=MAX_REPLICAS),
    ] = 1
    worker_lease_secs: Annotated[
        float, _doc("a heartbeating worker silent this long is removed"), msgspec.Meta(gt=0)
    ] = 10.0
    resync_timeout_secs: Annotated[
        float, _doc("how long to wait for a worker's answer to one resync request"), msgspec.Meta(gt=0)
    ] = 2.0
    resync_retry_secs: Annotated[
        float,
        _doc("an unverified event stream (its resync went unanswered) is offered a full resync this often"),
        msgspec.Meta(gt=0),
    ] = 15.0

    def __post_init__(self) -> None:
        if self.jetstream_replicas > 1 and self.nats_url is None and self.embedded_nats:
            raise ConfigError(
                "jetstream_replicas",
                f"{self.jetstream_replicas} copies need a NATS cluster; the embedded nats-server is one server "
                "(set --nats-url to your cluster, or leave jetstream_replicas at 1)",
            )
        if self.nats_url is None:
            # The embedded server makes its own token, and without it no NATS is used: said, not dropped.
            for name in ("nats_user", "nats_password", "nats_token", "nats_creds_file", "nats_tls_ca_file",
                         "nats_tls_cert_file", "nats_tls_key_file"):  # fmt: skip
                if getattr(self, name) is not None:
                    raise ConfigError(name, "is for a NATS server given with nats_url (the embedded one makes "
                                      "its own token)")  # fmt: skip
        if self.nats_tls_key_file is not None and self.nats_tls_cert_file is None:
            # Without its certificate the key was never read: the connection went out without TLS.
            raise ConfigError("nats_tls_key_file", "is the key of a client certificate: give nats_tls_cert_file too")

    __repr__ = _masked_repr  # never the NATS password or token


class SecurityConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Who may call which routes (a bearer token, `api.auth`), and TLS for HTTP."""

    api_token: Annotated[
        str | None,
        _doc(
            "bearer token required by the routes that change state other than bookings (/v1/events, worker "
            "registration and removal); clients send Authorization: Bearer <token>. A flag is visible to "
            "other users in the process list: prefer --api-token-file or the environment variable"
        ),
    ] = None
    api_token_file: Annotated[
        str | None, _doc("file holding the API token (surrounding whitespace is ignored); instead of --api-token")
    ] = None
    protect_decisions: Annotated[
        bool,
        _doc(
            "with an API token, also require it on the decision routes: /v1/new, /v1/router, /v1/mark_prefill, "
            "/v1/mark_free, /v1/potential_loads, /v1/overlap and the OpenAI proxy"
        ),
    ] = False
    protect_reads: Annotated[
        bool, _doc("with an API token, also require it to read state: GET /v1/workers, /v1/dump, /metrics, /docs")
    ] = False
    protect_probes: Annotated[bool, _doc("with an API token, also require it on /healthz and /readyz")] = False
    ssl_certfile: Annotated[str | None, _doc("serve HTTPS with this PEM certificate (chain); needs --ssl-keyfile")] = (
        None
    )
    ssl_keyfile: Annotated[str | None, _doc("PEM private key of --ssl-certfile")] = None

    def __post_init__(self) -> None:
        if self.api_token is not None and self.api_token_file is not None:
            raise ConfigError("api_token", "give the token or a file holding it, not both (api_token_file is set)")
        if self.api_token is not None:
            _check_token("api_token", self.api_token)
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ConfigError("ssl_certfile", "HTTPS needs both ssl_certfile and ssl_keyfile")
        if self.api_token is None and self.api_token_file is None:
            # Asked for protection and given no token (a secret not mounted, say): it would run open.
            for name in ("protect_decisions", "protect_reads", "protect_probes"):
                if getattr(self, name):
                    raise ConfigError(name, "needs an API token (api_token_file or api_token): without one it "
                                      "protects nothing")  # fmt: skip

    __repr__ = _masked_repr

    def token(self) -> str | None:
        """The API token: the setting, or the file's content (`ConfigError` if it cannot be read)."""
        if self.api_token_file is None:
            return self.api_token
        try:
            text = Path(self.api_token_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or "not text"
            raise ConfigError("api_token_file", f"cannot read {self.api_token_file}: {reason}") from None
        _check_token("api_token_file", text)
        return text


def _check_token(name: str, token: str) -> None:
    # RFC 6750's b64token is visible ASCII without spaces; the message never echoes the token.
    if not token or not all("!" <= c <= "~" for c in token):
        raise ConfigError(name, "the API token must be non-empty visible ASCII without spaces")


class EngineSourcesConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Engines the router hears itself, without a bridge (direct mode), and Dynamo workers on NATS."""

    engine: Annotated[
        list[str],
        _doc(
            "an engine heard directly: WORKER_ID=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,url=http://HOST:PORT]"
            "[,models=NAME+NAME]: its KV-event PUB socket, its replay socket, its OpenAI server (with or without "
            "/v1: the worker is then registered for the proxy with the models its /v1/models lists, and leaves "
            "routing after three failed /health probes in a row or a refused connection) (repeatable; "
            "environment: a JSON list)"
        ),
    ] = []
    engine_zmq: Annotated[list[str], _doc("the same as --engine (its older name)")] = []
    block_size_auto: Annotated[
        bool,
        _doc(
            "adopt the block size the engines heard directly name in their stored events (the first engine's "
            "decides; an engine naming another is refused); what --block-size auto sets"
        ),
    ] = False
    engine_zmq_topic: Annotated[str, _doc("topic prefix of the engines' KV events (empty: every topic)")] = ""
    engine_health_interval_secs: Annotated[
        float, _doc("seconds between probes of a directly heard engine's /health (engines given a url)"),
        msgspec.Meta(gt=0),
    ] = 1.0  # fmt: skip
    engine_health_timeout_secs: Annotated[
        float,
        _doc(
            "a probe of an engine's /health not answered 200 within this long fails (three in a row take it out of "
            "routing; a refused connection at once)"
        ),
        msgspec.Meta(gt=0),
    ] = ENGINE_HEALTH_TIMEOUT_SECS
    dynamo_endpoint: Annotated[
        list[str],
        _doc(
            "NVIDIA Dynamo workers' endpoint NAMESPACE.COMPONENT.ENDPOINT whose kv-events and kv_metrics "
            "(DYN_EVENT_PLANE=nats) feed this router over its NATS (repeatable; environment: a JSON list)"
        ),
    ] = []

    def engine_specs(self) -> list[EngineSpec]:
        """Every ``--engine`` and ``--engine-zmq``, parsed; raises `ConfigError` naming the setting of a
        bad or repeated one."""
        specs: dict[int, EngineSpec] = {}
        # Each socket and URL, and whose: two engines given one would hear one engine twice, as two workers.
        claimed: dict[str, tuple[int, str]] = {}
        for field, texts in (("engine", self.engine), ("engine_zmq", self.engine_zmq)):
            for text in texts:
                try:
                    spec = parse_engine_spec(text)
                except ValueError as exc:
                    raise ConfigError(field, str(exc).removeprefix("engine ")) from None
                if spec.worker_id in specs:
                    raise ConfigError(field, f"{text!r}: worker {spec.worker_id} is given twice")
                for what, address in spec.addresses():
                    owner, owners_what = claimed.setdefault(address, (spec.worker_id, what))
                    if owner != spec.worker_id:
                        raise ConfigError(field, f"{text!r}: its {what} {address} is worker {owner}'s {owners_what} "
                                          "too (each engine has sockets and a URL of its own)")  # fmt: skip
                specs[spec.worker_id] = spec
        return list(specs.values())


class ProxyConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The OpenAI-compatible front door: /v1/completions, /v1/chat/completions, /v1/responses, /v1/embeddings,
    /v1/rerank, /v1/models; its retries, health checks, concurrency cap, client headers and spans."""

    proxy: Annotated[
        bool, _doc("serve the OpenAI API and forward each request to the worker the router picks (workers with a url)")
    ] = False
    proxy_retries: Annotated[
        int,
        _doc(
            "attempts after the first when a worker refuses the connection, answers 5xx before its first byte, or "
            "is overloaded (429 or 503): on the next best worker, else the same one after the backoff"
        ),
        msgspec.Meta(ge=0),
    ] = 2
    proxy_retry_backoff_secs: Annotated[
        float,
        _doc("backoff before the first retry, doubling for each next one; jittered: drawn from its upper half"),
        msgspec.Meta(ge=0),
    ] = 0.05
    proxy_retry_backoff_max_secs: Annotated[
        float,
        _doc("the longest backoff between two attempts (an engine's Retry-After may ask for more)"),
        msgspec.Meta(ge=0),
    ] = 2.0
    proxy_retry_budget_secs: Annotated[
        float,
        _doc(
            "no retry starts later than this after the request came in; an engine's Retry-After beyond it ends the "
            "retries and its answer goes to the client"
        ),
        msgspec.Meta(ge=0),
    ] = 10.0
    proxy_connect_timeout_secs: Annotated[PositiveSecs, _doc("time to open a connection to a worker")] = 2.0
    proxy_read_timeout_secs: Annotated[
        PositiveSecs, _doc("longest silence of a worker: before its first byte (prefill, its queue) and between chunks")
    ] = 300.0
    proxy_request_timeout_secs: Annotated[
        PositiveSecs,
        _doc(
            "longest wait from a request to its whole (not streamed) answer's end, or to a stream's first events, "
            "however the worker sends them (silent or trickling); a whole answer comes at its end, so its silence "
            "past proxy_read_timeout_secs blames the worker only once it has left routing (registered, passing "
            "its health checks)"
        ),
    ] = 1800.0
    proxy_client_write_timeout_secs: Annotated[
        PositiveSecs,
        _doc(
            "longest a streamed answer waits for a client that reads nothing of it; then its connection is dropped "
            "and the request ends as a disconnect (its worker's stream closed, its booking freed)"
        ),
    ] = 60.0
    proxy_max_answer_bytes: Annotated[
        int,
        _doc(
            "largest worker's answer the proxy holds, in bytes: a whole (not streamed) answer past it is a 502 "
            "(not retried: another worker would send as much), a stream's event left unended past it ends the "
            "stream with its error event; a stream handed on as it comes is not bounded in all"
        ),
        msgspec.Meta(ge=1),
    ] = 64 * 1024 * 1024
    proxy_connections_per_worker: Annotated[
        int, _doc("pooled keep-alive connections to one worker (0: no limit)"), msgspec.Meta(ge=0)
    ] = 512
    proxy_retry_after_secs: Annotated[
        int, _doc("Retry-After of a 429 when the router's queue refuses a request"), msgspec.Meta(ge=0)
    ] = 1
    proxy_request_id_header: Annotated[
        str,
        _doc(
            "the request id header: the client's passed to the worker and echoed on the answer, else one made "
            "here; an HTTP header name (RFC 9110 token)"
        ),
    ] = "X-Request-Id"
    proxy_otlp_endpoint: Annotated[
        str | None,
        _doc(
            "export the proxy's spans (request, tokenize, decision, upstream first byte, stream) over OTLP/HTTP "
            "to this URL, e.g. http://collector:4318/v1/traces; needs the otel extra (pip install "
            "'kv-router[otel]'); unset: no spans, traceparent passed on as it came"
        ),
    ] = None
    proxy_otlp_service_name: Annotated[str, _doc("service.name of the exported spans")] = "kv-router"
    proxy_max_concurrent_requests: Annotated[
        int,
        _doc(
            "requests the proxy forwards at a time, per process (--processes N: N times as many reach the "
            "workers); the next ones wait for a slot, in the router's queue order (router_queue_policy, nvext "
            "priorities); 0: no cap"
        ),
        msgspec.Meta(ge=0),
    ] = 0
    proxy_max_waiting_requests: Annotated[
        int,
        _doc("requests waiting for a slot under proxy_max_concurrent_requests; one more is a 429 with Retry-After"),
        msgspec.Meta(ge=0),
    ] = 256
    proxy_queue_timeout_secs: Annotated[
        PositiveSecs, _doc("longest wait for a slot under proxy_max_concurrent_requests, then a 429 with Retry-After")
    ] = 30.0
    proxy_health_check_interval_secs: Annotated[
        float,
        _doc(
            "seconds between two GET /health of each worker registered over HTTP with a url (a worker failing them "
            "leaves routing, and comes back once it passes); 0: no active health checks"
        ),
        msgspec.Meta(ge=0),
    ] = 5.0
    proxy_health_check_timeout_secs: Annotated[
        PositiveSecs, _doc("a health check not answered 200 within this long fails")
    ] = 2.0
    proxy_health_check_failures: Annotated[
        int, _doc("failed health checks in a row that take a worker out of routing"), msgspec.Meta(ge=1)
    ] = 3
    proxy_health_check_successes: Annotated[
        int, _doc("passed health checks in a row that bring a worker failing them back"), msgspec.Meta(ge=1)
    ] = 2
    proxy_calibration_window: Annotated[
        int, _doc("requests per worker in the predicted-vs-actual cached tokens gauge"), msgspec.Meta(ge=1)
    ] = 256
    proxy_tokenizer_cache_tokens: Annotated[
        int,
        _doc(
            "per model with local tokenizer files, the token ids of recent text pieces (between its added "
            "tokens: a chat's messages, a shared system prompt) kept so they are not encoded again; counted "
            "in tokens, each piece 16 more; 0: off"
        ),
        msgspec.Meta(ge=0),
    ] = 1_048_576
    proxy_route_text_by_bytes: Annotated[
        bool,
        _doc(
            "a model none of whose workers sends KV events (their caches predicted from what the router sends "
            "them) has its text and chat prompts routed by their bytes, four a token: nothing tokenized, no "
            "/tokenize; off: tokenized as for workers with events"
        ),
    ] = True
    tokenizer: Annotated[
        list[str],
        _doc(
            "a model's own tokenizer files, so the proxy tokenizes its text and chat prompts itself: "
            "MODEL=PATH, or PATH for every model without its own; PATH a model directory (tokenizer.json, and "
            "the chat template of chat_template.jinja or tokenizer_config.json) or a tokenizer.json (its "
            "directory read the same way); never downloaded; repeatable; environment: a JSON list. Other "
            "models are tokenized by a worker's /tokenize"
        ),
    ] = []

    def __post_init__(self) -> None:
        self.tokenizer_paths()  # a malformed value fails at start-up, naming the setting
        otlp = self.proxy_otlp_endpoint
        problem = None if otlp is None else url_problem(otlp)
        if problem is not None:
            # Else every span batch is lost, said only once a request has been served.
            raise ConfigError("proxy_otlp_endpoint", f"{otlp!r} is not an http(s) URL of a collector: {problem}")
        # Written into every request to the workers and every answer: a name that is none breaks them all.
        if not _HEADER_NAME.fullmatch(self.proxy_request_id_header):
            raise ConfigError(
                "proxy_request_id_header",
                f"{self.proxy_request_id_header!r} is not an HTTP header name (RFC 9110: one or more of letters, "
                "digits and !#$%&'*+-.^_`|~)",
            )

    def tokenizer_paths(self) -> dict[str, Path]:
        """Model name (`ANY_MODEL`: every model without its own) -> its directory or tokenizer.json."""
        paths: dict[str, Path] = {}
        for item in self.tokenizer:
            model, sep, path = item.partition("=") if "=" in item else (ANY_MODEL, "=", item)
            if not sep or not model.strip() or not path.strip():
                raise ValueError(f"tokenizer: expected MODEL=PATH or PATH, got {item!r}")
            paths[model.strip()] = Path(path.strip())
        return paths


# An HTTP field name: RFC 9110's token.
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


class HaConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """High availability on the NATS event plane (`router.replicas`): replicas, durable events."""

    replica_sync: Annotated[
        bool, _doc("share bookings with the other routers on kv.<namespace>.router.sync (one load view)")
    ] = False
    replica_lease_secs: Annotated[
        float, _doc("a replica silent this long has its bookings dropped by the others"), msgspec.Meta(gt=0)
    ] = 10.0
    durable_events: Annotated[
        bool,
        _doc(
            "keep KV events in the JetStream stream KV_EVENTS_<namespace> and snapshot the index to the "
            "object store kv_router_snapshots_<namespace>; a restart loads the snapshot and replays the stream"
        ),
    ] = False
    router_name: Annotated[
        str | None,
        _doc("this router's stable name for its snapshot (default: host name and HTTP port; a pod name in Kubernetes)"),
    ] = None
    events_stream_max_age_secs: Annotated[
        float, _doc("durable events: the stream keeps events at most this long"), msgspec.Meta(gt=0)
    ] = 3600.0
    events_stream_max_bytes: Annotated[
        int, _doc("durable events: the stream keeps at most this many bytes (-1: no limit)"), msgspec.Meta(ge=-1)
    ] = 1 << 30
    snapshot_every_events: Annotated[
        int, _doc("durable events: snapshot the index after this many stream messages"), msgspec.Meta(ge=1)
    ] = 100_000
    snapshot_every_secs: Annotated[
        float, _doc("durable events: snapshot at least this often while events arrive"), msgspec.Meta(gt=0)
    ] = 30.0
    processes: Annotated[
        int,
        _doc("serve from this many processes sharing the port (SO_REUSEPORT), each a replica (replica sync on)"),
        msgspec.Meta(ge=1),
    ] = 1


class Settings(msgspec.Struct, kw_only=True, frozen=True):
    """Everything `kv-router serve` needs, one struct per section."""

    service: ServiceConfig = msgspec.field(default_factory=ServiceConfig)
    router: RouterConfig = msgspec.field(default_factory=RouterConfig)
    event_plane: EventPlaneConfig = msgspec.field(default_factory=EventPlaneConfig)
    engines: EngineSourcesConfig = msgspec.field(default_factory=EngineSourcesConfig)
    proxy: ProxyConfig = msgspec.field(default_factory=ProxyConfig)
    security: SecurityConfig = msgspec.field(default_factory=SecurityConfig)
    ha: HaConfig = msgspec.field(default_factory=HaConfig)


# Section name in `Settings` -> its struct type. Field names must be unique across sections.
SECTIONS: dict[str, type[msgspec.Struct]] = {
    "service": ServiceConfig,
    "router": RouterConfig,
    "event_plane": EventPlaneConfig,
    "engines": EngineSourcesConfig,
    "proxy": ProxyConfig,
    "security": SecurityConfig,
    "ha": HaConfig,
}


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ConfigError("config", f"cannot read config file {path}: {exc.strerror}") from None
    if path.suffix in (".yaml", ".yml"):
        raise ConfigError("config", f"config file {path}: YAML is not read; write it as TOML (.toml) or JSON")
    try:
        is_toml = path.suffix == ".toml"
        data: Any = tomllib.loads(text.decode()) if is_toml else json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError("config", f"config file {path} is not valid {'TOML' if is_toml else 'JSON'}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError("config", f"config file {path} must hold one table of settings")
    return data


def _field_section() -> dict[str, str]:
    owner: dict[str, str] = {}
    for section, struct in SECTIONS.items():
        for name in struct.__struct_fields__:
            if name in owner:  # pragma: no cover - guarded by a test over SECTIONS
                raise AssertionError(f"setting {name!r} is defined by both {owner[name]} and {section}")
            owner[name] = section
    return owner


def load_settings(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: Path | None = None,
) -> Settings:
    """Resolve settings from defaults, a JSON or TOML file, ``KV_ROUTER_*`` variables and flags.

    ``flags`` holds only the flags the user gave (field name -> value); strings are converted to
    each field's type, and each section's own validation runs on the merged values.
    """
    return resolve_settings(flags, env, config_file)[0]


def resolve_settings(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: Path | None = None,
    *,
    problems: list[ConfigError] | None = None,
) -> tuple[Settings, dict[str, str]]:
    """`load_settings`, and where each setting not left at its default came from (name -> "flag
    --port", "environment variable KV_ROUTER_PORT", "config file x.toml"). With ``problems``, what
    only this host can check (files to read, engine specs) is appended there instead of raised:
    ``kv-router config show`` prints a deployment's file on any machine."""
    owner = _field_section()
    merged: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    origin: dict[str, str] = {}

    def put(name: str, value: Any, where: str) -> None:
        if name == "block_size" and isinstance(value, str) and value.strip().lower() == "auto":
            name, value = "block_size_auto", True  # the engines' block size, adopted (EngineSourcesConfig)
        section = owner.get(name)
        if section is None:
            hint = f"; removed, use {RETIRED[name]!r}" if name in RETIRED else did_you_mean(name, owner)
            raise ConfigError(name, f"unknown setting in {where}{hint}")
        merged[section][name] = value
        origin[name] = where

    if config_file is not None:
        for name, value in _read_file(config_file).items():
            if isinstance(value, dict) and name in SECTIONS:
                # `config show` heads each section's keys with its name: taken for a TOML table, it is not one.
                raise ConfigError(name, f"config file {config_file}: [{name}] is a table, but the settings are "
                                  "keys of the top level: leave out the table headers")  # fmt: skip
            put(name, value, f"config file {config_file}")
    for key, value in (env or {}).items():
        name = key[len(ENV_PREFIX) :].lower()
        # Other tools share the prefix (CI's KV_ROUTER_CI_VENV, say): only known names are settings.
        if key.startswith(ENV_PREFIX) and (name in owner or name in RETIRED):
            put(name, _none_if_null(value), f"environment variable {key}")
    for name, value in (flags or {}).items():
        put(name, value, flag_origin(name, value))

    sections: dict[str, msgspec.Struct] = {}
    for section, struct in SECTIONS.items():
        try:
            sections[section] = msgspec.convert(merged[section], struct, strict=False)
        except msgspec.ValidationError as exc:
            raise ConfigError(section, _explain(_plain(str(exc), merged[section], origin), origin)) from None
    settings = Settings(**sections)  # type: ignore[arg-type]
    try:
        _check_names(settings)
    except ConfigError as exc:
        raise _explained(exc, origin) from None
    found = _file_problems(settings)
    try:
        _check_engine_specs(settings)
    except ConfigError as exc:
        found.insert(0, exc)
    for problem in found:
        if problems is None:
            raise _explained(problem, origin) from None
        problems.append(_explained(problem, origin))
    return settings, origin


def _explained(problem: ConfigError, origin: Mapping[str, str]) -> ConfigError:
    """The problem naming where its setting came from."""
    return ConfigError(problem.field, _explain(str(problem), origin).removeprefix(f"{problem.field}: "))


def _check_names(settings: Settings) -> None:
    """A registered policy; a NATS URL that is one."""
    policy = settings.router.policy
    if policy not in policy_names():
        raise ConfigError("policy", f"unknown policy {policy!r}; choose from {', '.join(policy_names())}")
    if settings.event_plane.nats_url is not None:
        from router.event_plane.connection import check_nats_url  # nats-py: only when it is needed

        try:
            check_nats_url(settings.event_plane.nats_url)
        except ValueError as exc:
            raise ConfigError("nats_url", str(exc)) from None


def _check_engine_specs(settings: Settings) -> None:
    """Engine specs parse (at start-up they would fail inside the app's lifespan, as a traceback)."""
    engines = settings.engines
    if not engines.engine_specs() and engines.block_size_auto:
        raise ConfigError("block_size", "auto needs an engine heard directly (--engine): its stored events decide")
    if engines.dynamo_endpoint:
        from router.engines.dynamo_source import DynamoEndpoint

        for spec in engines.dynamo_endpoint:
            try:
                DynamoEndpoint.parse(spec)
            except ValueError as exc:
                raise ConfigError("dynamo_endpoint", str(exc).removeprefix("dynamo_endpoint ")) from None


def _file_problems(settings: Settings) -> list[ConfigError]:
    """Files that must be readable on this host: a problem for each setting whose file is not (all of
    them, so that fixing one does not merely show the next)."""
    found: list[ConfigError] = []

    def check(name: str, test: Callable[[], object]) -> None:
        try:
            test()
        except ConfigError as exc:
            found.append(exc)
        except ValueError as exc:
            found.append(ConfigError(name, str(exc)))

    def readable(path: Path) -> None:
        if not os.access(path, os.R_OK):
            raise ValueError(f"cannot read {path}")

    check("api_token_file", settings.security.token)
    for model, path in settings.proxy.tokenizer_paths().items():
        file = path / "tokenizer.json" if path.is_dir() else path
        if not os.access(file, os.R_OK) or not file.is_file():
            whose = "every model" if model == ANY_MODEL else f"model {model!r}"
            found.append(ConfigError("tokenizer", f"{whose}: cannot read {file}"))
    security, plane = settings.security, settings.event_plane
    files = {
        "ssl_certfile": security.ssl_certfile,
        "ssl_keyfile": security.ssl_keyfile,
        "nats_tls_ca_file": plane.nats_tls_ca_file,
        "nats_tls_cert_file": plane.nats_tls_cert_file,
        "nats_tls_key_file": plane.nats_tls_key_file,
    }
    for name, given in files.items():
        if given is not None:
            check(name, partial(readable, Path(given)))
    from router.event_plane.connection import check_certificate  # ssl: only when it is needed

    unreadable = {problem.field for problem in found}
    pairs = [("ssl_certfile", "ssl_keyfile"), ("nats_tls_cert_file", "nats_tls_key_file")]
    for cert, key in pairs:
        cert_file = files[cert]
        if cert_file is not None and not {cert, key} & unreadable:
            check(cert, partial(check_certificate, cert_file, files[key]))
    if plane.nats_creds_file is not None:
        from router.event_plane.connection import check_creds_file  # nats-py: only when it is needed

        check("nats_creds_file", partial(check_creds_file, plane.nats_creds_file))
    return found


def flag_origin(name: str, value: object) -> str:
    """Where a setting given on the command line came from, as the user typed it: a switch turned off
    was ``--no-<name>``."""
    return f"flag --{'no-' if value is False else ''}{name.replace('_', '-')}"


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for a misspelt setting name, else nothing."""
    close = closest_name(name, known)
    return f"; did you mean {close!r}?" if close else ""


def closest_name(name: str, known: Iterable[str]) -> str | None:
    """The name among ``known`` that ``name`` likely misspells (a setting, a variable, a flag), or None."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    return close[0] if close else None


# KV_ROUTER_* variables read by others than the settings: the settings file, `kv-router bridge`
# (KV_ROUTER_BRIDGE_*), the service's own children (KV_ROUTER__*), the tests, benchmarks and CI.
_NOT_SETTINGS = frozenset(
    {"config", "no_native", "shared", "lane_dir", "vllm_python", "vllm_venv", "http_bench_netns"}
)  # fmt: skip
_NOT_SETTINGS_PREFIXES = ("bridge_", "_", "bench_", "ci_")
# What Kubernetes sets in every pod for each Service of its namespace, named after it: for the
# kv-router Service KV_ROUTER_SERVICE_HOST, KV_ROUTER_SERVICE_PORT(_HTTP), KV_ROUTER_PORT_8000_TCP(_ADDR,
# _PORT, _PROTO) and KV_ROUTER_PORT=tcp://... (that one the port setting's name); kv-router-x's alike.
_SERVICE_LINK = re.compile(r"(\w+_)?(service_host|service_port(_\w+)?|port_\d+_(tcp|udp|sctp)(_\w+)?)")
_SERVICE_LINK_ADDRESS = re.compile(r"(\w+_)?port")


def idle_settings(settings: Settings, origin: Mapping[str, str]) -> list[str]:
    """A warning for each setting given that this configuration never reads (the proxy's without
    ``--proxy``): set by mistake or for a switch left off, it would change nothing without a word."""
    if settings.proxy.proxy:
        return []
    return [
        f"{name} ({origin[name]}) has no effect without --proxy"
        for name in ProxyConfig.__struct_fields__
        if name != "proxy" and name in origin
    ]


def per_process_caps(settings: Settings) -> list[str]:
    """A warning when a cap sized for the workers holds per process: under ``--processes N`` each
    process admits its own ``proxy_max_concurrent_requests``, so N times as many reach the workers."""
    processes, cap = settings.ha.processes, settings.proxy.proxy_max_concurrent_requests
    if processes < 2 or not settings.proxy.proxy or cap == 0:
        return []
    return [
        f"proxy_max_concurrent_requests {cap} holds per process: the {processes} processes forward up to "
        f"{processes * cap} requests at a time (give each process its share of what the workers take)"
    ]


def stray_variables(env: Mapping[str, str]) -> list[str]:
    """A warning for each ``KV_ROUTER_*`` variable that is no setting, naming the setting likely meant:
    a misspelt one is ignored, and without a word the service would run on the default."""
    owner = _field_section()
    warnings = []
    for key, value in sorted(env.items()):
        name = key[len(ENV_PREFIX) :].lower()
        if (
            not key.startswith(ENV_PREFIX)
            or name in owner
            or name in RETIRED
            or name in _NOT_SETTINGS
            or name.startswith(_NOT_SETTINGS_PREFIXES)
            or _SERVICE_LINK.fullmatch(name)
            or (_SERVICE_LINK_ADDRESS.fullmatch(name) and value.startswith(("tcp://", "udp://", "sctp://")))
        ):
            continue
        close = closest_name(name, owner)
        hint = f"; did you mean {ENV_PREFIX}{close.upper()}?" if close else ""
        warnings.append(f"environment variable {key} is not a kv-router setting and is ignored{hint}")
    return warnings


_KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string", "array": "a list"}


def _plain(message: str, values: Mapping[str, Any], origin: Mapping[str, str] | None = None) -> str:
    """msgspec's ``Expected `int`, got `str` - at `$.block_size``` as ``block_size: expected an integer,
    got 'x'``; other messages unchanged. A list setting given a string in a ``KV_ROUTER_*`` variable
    (``origin`` says) is shown how to write it there."""
    match = re.fullmatch(r"Expected `(\w+)`, got `\w+` - at `\$\.(\w+)`", message)
    if match is None:
        return message
    kind, name = match.groups()
    value = values.get(name)
    said = f"{name}: expected {_KINDS.get(kind, kind)}, got {value!r}"
    if kind == "array" and isinstance(value, str) and (origin or {}).get(name, "").startswith("environment"):
        # A list from the environment is a string unless it is JSON: say how to write it.
        example = json.dumps([item.strip() for item in value.split(",") if item.strip()] or ["a", "b"])
        said += f"; in the environment, a JSON list: {ENV_PREFIX}{name.upper()}='{example}'"
    return said


def _none_if_null(value: str) -> Any:
    # An environment variable cannot hold null; "none" / "null" clear an optional setting, and a
    # JSON list is a list setting's value.
    text = value.strip()
    if text.lower() in ("none", "null"):
        return None
    if text.startswith("["):
        try:
            return json.loads(text)
        except ValueError:
            pass
    return value


def _explain(message: str, origin: Mapping[str, str]) -> str:
    # msgspec says "... - at `$.field`"; a section's own check says "field: ...". Either way, add
    # where the offending value came from.
    marker = "at `$."
    if marker in message:
        name = message.split(marker, 1)[1].split("`", 1)[0].split(".", 1)[0].split("[", 1)[0]
    else:
        name = message.split(":", 1)[0]
    return f"{message} (from {origin[name]})" if name in origin else message

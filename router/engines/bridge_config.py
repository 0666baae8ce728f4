"""`BridgeConfig`: every setting of ``kv-router bridge``, light to import (the CLI builds flags from it)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Literal

import msgspec

from router.engines.engine_spec import MAX_ENGINE_FRAME_BYTES, check_rank_ports, check_zmq_endpoint
from router.engines.openai_server import ENGINE_HEALTH_TIMEOUT_SECS, health_url, openai_base
from router.types import HandoffStyle, WorkerConfig, WorkerRole

__all__ = ["BridgeConfig"]


def _doc(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class BridgeConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Every setting of ``kv-router bridge`` (flag ``--x-y``, variable ``KV_ROUTER_BRIDGE_X_Y``, file key ``x_y``)."""

    worker_id: Annotated[int, _doc("the worker's id in the router's registry"), msgspec.Meta(ge=0)]
    zmq_endpoint: Annotated[str, _doc("the engine's KV-event PUB socket, tcp://HOST:PORT (dp rank 0)")]
    zmq_topic: Annotated[str, _doc("topic prefix to subscribe to (empty: every topic)")] = ""
    replay_endpoint: Annotated[
        str | None, _doc("the engine's replay ROUTER socket, tcp://HOST:PORT (dp rank 0); unset: gaps stay gaps")
    ] = None
    engine: Annotated[
        Literal["auto", "vllm", "sglang", "trtllm"],
        _doc("engine kind, for the names of its Prometheus metrics (auto: whichever names the engine exposes)"),
    ] = "auto"
    block_size: Annotated[int, _doc("the engine's KV block size in tokens"), msgspec.Meta(ge=1)] = 16
    dp_size: Annotated[
        int, _doc("data-parallel ranks, on consecutive ports from --zmq-endpoint and --replay-endpoint"),
        msgspec.Meta(ge=1),
    ] = 1  # fmt: skip
    total_kv_blocks: Annotated[Annotated[int, msgspec.Meta(ge=0)] | None, _doc("KV blocks per rank (or vLLM's)")] = None
    max_num_batched_tokens: Annotated[Annotated[int, msgspec.Meta(ge=1)] | None, _doc("tokens per engine step")] = None
    taints: Annotated[list[str], _doc("the worker's taints (JSON list)")] = []
    role: Annotated[
        WorkerRole,
        _doc("what the engine does in a disaggregated fleet: prefill, decode, or both (an aggregated engine)"),
    ] = "both"
    handoff: Annotated[
        HandoffStyle,
        _doc(
            "with role prefill (or both, on a fleet routed with --disagg-among-both-workers): how kv-router serve "
            "--proxy hands a prefilled request to its decode worker: "
            "kv_transfer_params (vLLM's NIXL connector), bootstrap (SGLang, with --bootstrap-port) or sequential "
            "(a connector sharing KV through a store keyed by the prompt, e.g. vLLM's ExampleConnector)"
        ),
    ] = "kv_transfer_params"
    bootstrap_port: Annotated[
        Annotated[int, msgspec.Meta(ge=1, le=65535)] | None,
        _doc("with --handoff bootstrap: the engine's bootstrap port (SGLang's --disaggregation-bootstrap-port)"),
    ] = None
    engine_metrics_url: Annotated[
        str | None, _doc("the engine's Prometheus endpoint, scraped for KV usage and published as load")
    ] = None
    engine_metrics_interval_secs: Annotated[float, _doc("seconds between scrapes"), msgspec.Meta(gt=0)] = 1.0
    openai_url: Annotated[
        str | None,
        _doc(
            "the engine's OpenAI server root, http://HOST:PORT[/PREFIX] with or without /v1 (no endpoint's path, "
            "/v1/completions): registered as the worker's URL for kv-router serve --proxy, with the models it "
            "lists on /v1/models (unless --served-model)"
        ),
    ] = None
    served_model: Annotated[
        list[str], _doc("a model the engine serves (repeatable; default: what its /v1/models lists)")
    ] = []
    engine_health_interval_secs: Annotated[
        float,
        _doc(
            "seconds between probes of the engine's /health on --openai-url (else of its --engine-metrics-url): "
            "after three failed probes in a row, or a refused connection, the worker is withdrawn from the routers"
        ),
        msgspec.Meta(gt=0),
    ] = 1.0
    engine_health_timeout_secs: Annotated[
        float,
        _doc("a probe of the engine's /health (or metrics URL) not answered 200 within this long fails"),
        msgspec.Meta(gt=0),
    ] = ENGINE_HEALTH_TIMEOUT_SECS
    heartbeat_interval_secs: Annotated[float, _doc("seconds between heartbeats"), msgspec.Meta(gt=0)] = 1.0
    queue_size: Annotated[int, _doc("engine batches buffered per rank before drops"), msgspec.Meta(ge=1)] = 10_000
    queue_bytes: Annotated[
        int,
        _doc("bytes of engine batches buffered per rank before drops (at least the largest frame an engine may send)"),
        msgspec.Meta(ge=MAX_ENGINE_FRAME_BYTES),
    ] = 256 << 20
    batch_window_secs: Annotated[
        float,
        _doc(
            "engine batches within half this long of the last NATS message wait for the window's end to go out together"
        ),
        msgspec.Meta(ge=0),
    ] = 0.001
    nats_url: Annotated[
        str | None,
        _doc(
            "NATS server of the routers' event plane (a cluster's: several URLs, comma-separated; unset: the "
            "embedded NATS of a kv-router serve on this host, found with its token in its connection file, "
            "whatever its port; else nats://127.0.0.1:4222)"
        ),
    ] = None
    nats_wait_secs: Annotated[
        float,
        _doc("how long the first NATS connection is retried (a router started just before is still starting)"),
        msgspec.Meta(ge=0),
    ] = 30.0
    metrics_port: Annotated[
        Annotated[int, msgspec.Meta(ge=0, le=65535)] | None,
        _doc("port of the bridge's own Prometheus /metrics (0: any free port, printed at start; unset: none)"),
    ] = None
    metrics_host: Annotated[
        str, _doc("address the /metrics port listens on (0.0.0.0: scraped from other hosts, as in a pod)")
    ] = "127.0.0.1"
    namespace: Annotated[str, _doc("deployment namespace: subjects kv.<namespace>.*")] = "default"
    nats_user: Annotated[str | None, _doc("NATS user name")] = None
    nats_password: Annotated[str | None, _doc("NATS password")] = None
    nats_token: Annotated[str | None, _doc("NATS authentication token")] = None
    nats_creds_file: Annotated[str | None, _doc("NATS credentials file (JWT + nkey)")] = None
    nats_tls_ca_file: Annotated[str | None, _doc("CA bundle to verify the NATS server")] = None
    nats_tls_cert_file: Annotated[str | None, _doc("client certificate for NATS TLS")] = None
    nats_tls_key_file: Annotated[str | None, _doc("client key for NATS TLS")] = None

    def __post_init__(self) -> None:
        for name, endpoint, what in (("zmq_endpoint", self.zmq_endpoint, "event"),
                                     ("replay_endpoint", self.replay_endpoint, "replay")):  # fmt: skip
            if endpoint is not None:
                try:
                    check_zmq_endpoint(endpoint, what)
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
        if self.openai_url is not None:
            try:
                openai_base(self.openai_url)
            except ValueError as exc:
                raise ValueError(f"openai_url: {exc}") from None
        if self.served_model and self.openai_url is None:
            raise ValueError("served_model needs openai_url (the models served there)")
        if self.dp_size > 1:
            check_rank_ports(self.zmq_endpoint, self.replay_endpoint, self.dp_size)
        if self.nats_tls_key_file is not None and self.nats_tls_cert_file is None:
            # Without its certificate the key was never read: the connection went out without TLS.
            raise ValueError("nats_tls_key_file is the key of a client certificate: give nats_tls_cert_file too")

    @property
    def openai_base(self) -> str | None:
        """The engine's OpenAI server root (`openai_base`), if given."""
        return None if self.openai_url is None else openai_base(self.openai_url)

    @property
    def health_url(self) -> str | None:
        """What the bridge probes: ``/health`` of the engine's OpenAI server, else its metrics endpoint
        (whatever serves it, a 200 is a live engine)."""
        if self.openai_url is not None:
            return health_url(openai_base(self.openai_url))
        return self.engine_metrics_url

    def registration(self, models: Iterable[str] = ()) -> WorkerConfig:
        return WorkerConfig(
            worker_id=self.worker_id,
            dp_size=self.dp_size,
            block_size=self.block_size,
            total_kv_blocks=self.total_kv_blocks,
            max_num_batched_tokens=self.max_num_batched_tokens,
            taints=frozenset(self.taints),
            role=self.role,
            handoff=self.handoff,
            bootstrap_port=self.bootstrap_port,
            url=self.openai_base,
            models=frozenset(models),
        )

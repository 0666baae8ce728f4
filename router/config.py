"""`RouterConfig`: every knob of the scheduler, with Dynamo 1.6.1's names and defaults.

Defaults are Dynamo's (`reference/dynamo-router.md` §4.8, `KvRouterConfig` of the 1.6.1 binding and
`LoadThresholdConfig` for the busy thresholds of §4.6). Fields Dynamo does not have are marked as ours.
A config is validated when built, and a bad value raises `ConfigError` naming the field.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from router.errors import ConfigError
from router.types import RouterConfigOverride

__all__ = ["PrefillLoadModel", "QueuePolicy", "RouterConfig"]

QueuePolicy = Literal["fcfs", "wspt", "lcfs"]
# "none": a booked prefill counts in full until marked done; "linear": the oldest pending prefill of a
# rank decays as it runs, at `router_prefill_tokens_per_s` (Dynamo's "ais" predicts the duration with
# its AISimulate model instead).
PrefillLoadModel = Literal["none", "linear"]


class RouterConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Configuration of one `KvRouter`; immutable once built (§4.8)."""

    block_size: int = 16
    # Cost function (§4.2).
    overlap_score_credit: float = 1.0
    overlap_score_credit_decay: float = 0.0
    prefill_load_scale: float = 1.0
    decode_active_request_weight: float = 0.0
    host_cache_hit_weight: float = 0.75
    disk_cache_hit_weight: float = 0.25
    router_temperature: float = 0.0
    # Load tracking (§4.5).
    router_track_active_blocks: bool = True
    # Count a request's output blocks as it generates (`KvRouter.record_output`), decayed by its
    # expected output length when it gives one (§4.5).
    router_track_output_blocks: bool = False
    router_assume_kv_reuse: bool = True
    router_track_prefill_tokens: bool = True
    router_prefill_load_model: PrefillLoadModel = "none"
    # Ours: the prefill rate of one rank (tokens/s) the "linear" load model expects.
    router_prefill_tokens_per_s: float = 50_000.0
    request_expiry_secs: float = 300.0
    # Busy thresholds (§4.6); None skips the check.
    active_decode_blocks_threshold: float | None = None
    active_prefill_tokens_threshold: int | None = None
    active_prefill_tokens_threshold_frac: float | None = None
    # Queue (§4.7); no threshold means no queue.
    router_queue_threshold: float | None = None
    router_queue_policy: QueuePolicy = "fcfs"
    # Ours, after Dynamo's per-class `request_queue_limit_per_worker` /
    # `raw_isl_token_queue_limit_per_worker`: bounds scaled by the number of registered workers.
    router_queue_request_limit_per_worker: int | None = None
    router_queue_isl_token_limit_per_worker: int | None = None
    # Routing waits until this many workers have registered (Dynamo's DYN_ROUTER_MIN_INITIAL_WORKERS).
    router_min_initial_workers: int = 0
    # Ours: the selection policy by registry name (`router.policies`).
    policy: str = "dynamo"
    # Ours, knobs of the `cache_affinity` policy (router/policies/cache_affinity.py), tuned on the shared
    # traces (docs/routing-quality.md): how many queued prefill tokens one uncached prompt token is
    # worth (> 1 trades some queueing for cache affinity, which also saves the fleet's cache space);
    # the queued-token cost of one token of active decode context on the rank; and whether prompt
    # prefixes booked on a rank but not yet reported stored count as cached there.
    affinity_miss_weight: float = 3.0
    affinity_decode_weight: float = 0.05
    affinity_predict_inflight: bool = True
    # Ours, knobs of the `latency` policy (router/policies/latency.py): the weight of this prompt's
    # uncached tokens on a full cache (1 on an empty one); the cost of one prefill token to each request
    # decoding on the rank; the cost, in prefill tokens, of one output token per token of context in
    # flight on the rank; and the output length assumed for a request that does not say how long it is.
    latency_miss_weight: float = 6.0
    latency_stall_weight: float = 0.05
    latency_decode_weight: float = 0.0004
    latency_default_output_tokens: int = 256
    # Dynamo reads this from the model card: EAGLE hashing windows span one extra token (§1.1).
    enable_eagle: bool = False
    # Approximate mode (Dynamo's use_kv_events=false, §3.7): off for every worker, or per worker with
    # WorkerConfig.kv_events, the router records each routed prompt's blocks on the chosen rank for
    # router_ttl_secs, at most the worker's total_kv_blocks per rank (least recently routed out first).
    kv_events: bool = True
    router_ttl_secs: float = 120.0

    def __post_init__(self) -> None:
        if type(self.block_size) is not int or self.block_size < 1:
            raise ConfigError("block_size", f"must be a positive integer, got {self.block_size!r}")
        for name in (
            "overlap_score_credit",
            "overlap_score_credit_decay",
            "prefill_load_scale",
            "decode_active_request_weight",
            "host_cache_hit_weight",
            "disk_cache_hit_weight",
            "router_temperature",
            "affinity_miss_weight",
            "affinity_decode_weight",
            "latency_miss_weight",
            "latency_stall_weight",
            "latency_decode_weight",
            "router_ttl_secs",
        ):
            _require_non_negative(name, getattr(self, name))
        if not (math.isfinite(self.request_expiry_secs) and self.request_expiry_secs > 0):
            raise ConfigError("request_expiry_secs", f"must be a positive number, got {self.request_expiry_secs}")
        threshold = self.active_decode_blocks_threshold
        if threshold is not None and not (math.isfinite(threshold) and 0.0 <= threshold <= 1.0):
            raise ConfigError("active_decode_blocks_threshold", f"must be between 0.0 and 1.0, got {threshold}")
        if self.active_prefill_tokens_threshold is not None and self.active_prefill_tokens_threshold < 0:
            raise ConfigError(
                "active_prefill_tokens_threshold", f"must be >= 0, got {self.active_prefill_tokens_threshold}"
            )
        for name in ("active_prefill_tokens_threshold_frac", "router_queue_threshold"):
            value = getattr(self, name)
            if value is not None:
                _require_non_negative(name, value)
        for name in ("router_queue_request_limit_per_worker", "router_queue_isl_token_limit_per_worker"):
            limit = getattr(self, name)
            if limit is None:
                continue
            if limit < 1:
                raise ConfigError(name, f"must be >= 1, got {limit}")
            if self.router_queue_threshold is None:
                raise ConfigError(name, "bounds the queue, which needs router_queue_threshold to be set")
        if not (math.isfinite(self.router_prefill_tokens_per_s) and self.router_prefill_tokens_per_s > 0):
            raise ConfigError(
                "router_prefill_tokens_per_s", f"must be a positive number, got {self.router_prefill_tokens_per_s}"
            )
        if self.router_prefill_load_model != "none":
            if not self.router_track_prefill_tokens:
                raise ConfigError("router_prefill_load_model", "requires router_track_prefill_tokens")
            if self.router_queue_policy != "fcfs":
                raise ConfigError("router_prefill_load_model", "requires router_queue_policy fcfs")
        if self.router_min_initial_workers < 0:
            raise ConfigError("router_min_initial_workers", f"must be >= 0, got {self.router_min_initial_workers}")
        if self.router_track_output_blocks and not self.router_track_active_blocks:
            raise ConfigError("router_track_output_blocks", "requires router_track_active_blocks")
        if self.latency_default_output_tokens < 0:
            raise ConfigError(
                "latency_default_output_tokens", f"must be >= 0, got {self.latency_default_output_tokens}"
            )
        if not self.policy:
            raise ConfigError("policy", "must name a registered selection policy")

    def with_override(self, override: RouterConfigOverride) -> RouterConfig:
        """This config with a request's override applied (Dynamo's `RouterConfigOverride`); raises
        `ConfigError` naming the field for a bad value."""
        fields: dict[str, object] = {}
        if override.overlap_score_weight is not None:
            # Deprecated alias, as Dynamo maps it: the scale, and 0 switches the credit off too.
            fields["prefill_load_scale"] = override.overlap_score_weight
            if override.overlap_score_weight == 0.0:
                fields["overlap_score_credit"] = 0.0
        if override.overlap_score_credit is not None:
            fields["overlap_score_credit"] = override.overlap_score_credit
        if override.prefill_load_scale is not None and override.overlap_score_weight is None:
            fields["prefill_load_scale"] = override.prefill_load_scale
        if override.router_temperature is not None:
            fields["router_temperature"] = override.router_temperature
        if override.assume_kv_reuse is not None:
            fields["router_assume_kv_reuse"] = override.assume_kv_reuse
        if override.track_prefill_tokens is not None:
            fields["router_track_prefill_tokens"] = override.track_prefill_tokens
        return msgspec.structs.replace(self, **fields) if fields else self


def _require_non_negative(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0.0):
        raise ConfigError(name, f"must be a finite number >= 0, got {value}")

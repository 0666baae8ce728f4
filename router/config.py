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

__all__ = ["QueuePolicy", "RouterConfig"]

QueuePolicy = Literal["fcfs", "wspt", "lcfs"]


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
    router_assume_kv_reuse: bool = True
    router_track_prefill_tokens: bool = True
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
    # Dynamo reads this from the model card: EAGLE hashing windows span one extra token (§1.1).
    enable_eagle: bool = False

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
        if not self.policy:
            raise ConfigError("policy", "must name a registered selection policy")


def _require_non_negative(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0.0):
        raise ConfigError(name, f"must be a finite number >= 0, got {value}")

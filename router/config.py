"""`RouterConfig`: every knob of the scheduler, with Dynamo 1.6.1's names and defaults.

Dynamo's fields have Dynamo's defaults (`reference/dynamo-router.md` §4.8, `KvRouterConfig` of the 1.6.1
binding and `LoadThresholdConfig` for the busy thresholds of §4.6). Fields Dynamo does not have are
marked as ours; one of them, ``policy``, defaults to ours, `latency` (`policy="dynamo"` is Dynamo's
selector, whose cost the fields marked "dynamo policy" shape).
A config is validated when built, and a bad value raises `ConfigError` naming the field.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec

from router.errors import ConfigError
from router.types import RouterConfigOverride

__all__ = ["MAX_WEIGHT", "PrefillLoadModel", "QueuePolicy", "RouterConfig"]

# The largest cost weight, credit or threshold multiple taken, there or in a request's override: far past
# any tuning, yet its products with token and block counts stay finite floats that round to ints (1e308,
# finite and >= 0, made every decision on a cached prompt an OverflowError, a 500). Dynamo bounds none.
MAX_WEIGHT = 1e6

QueuePolicy = Literal["fcfs", "wspt", "lcfs"]
# "none": a booked prefill counts in full until marked done; "linear": the oldest pending prefill of a
# rank decays as it runs, at `router_prefill_tokens_per_s` (Dynamo's "ais" predicts the duration with
# its AISimulate model instead).
PrefillLoadModel = Literal["none", "linear"]


def _doc(text: str) -> msgspec.Meta:
    # Read by the CLI (`kv-router serve --help`) and the config docs.
    return msgspec.Meta(description=text)


class RouterConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How the router scores workers, tracks their load and queues requests: Dynamo 1.6.1's settings and
    defaults, and ours (the selection policy among them); immutable once built."""

    block_size: Annotated[
        int,
        _doc(
            "tokens per KV block; must equal every worker's block size (workers that differ are refused); auto: "
            "the block size the engines heard directly (--engine) name in their events"
        ),
    ] = 16
    # Cost function (§4.2).
    overlap_score_credit: Annotated[
        float,
        _doc(
            "prefill blocks credited per cached prompt block in the cost (cost = prefill_load_scale x max(0, "
            "prefill blocks - credit) + decode blocks); 0 ignores the cache, > 1 favours it over load"
        ),
    ] = 1.0
    overlap_score_credit_decay: Annotated[
        float,
        _doc(
            "dynamo policy: shrinks the cache credit of ranks with more queued prefill tokens than the least-loaded "
            "one (credit / (1 + decay x extra queued blocks / prompt blocks)); 0: no decay"
        ),
    ] = 0.0
    prefill_load_scale: Annotated[
        float, _doc("weight of a rank's uncached prefill blocks (queued + this prompt's) against its decode blocks")
    ] = 1.0
    decode_active_request_weight: Annotated[
        float,
        _doc("dynamo policy: cost, in blocks, added per request already active on the rank; 0: the count is ignored"),
    ] = 0.0
    host_cache_hit_weight: Annotated[
        float, _doc("credit per prompt block found in a rank's host (CPU) cache tier, as a fraction of a device hit")
    ] = 0.75
    disk_cache_hit_weight: Annotated[
        float, _doc("credit per prompt block found in a rank's disk or external tier, as a fraction of a device hit")
    ] = 0.25
    router_temperature: Annotated[
        float,
        _doc(
            "dynamo policy: 0, always the cheapest rank; > 0, sample ranks by softmax of -cost / temperature "
            "(spreads ties)"
        ),
    ] = 0.0
    # Load tracking (§4.5).
    router_track_active_blocks: Annotated[
        bool, _doc("count each rank's active decode blocks from the prompts routed there (off: prefill-only cost)")
    ] = True
    # Count a request's output blocks as it generates (`KvRouter.record_output`), decayed by its
    # expected output length when it gives one (§4.5).
    router_track_output_blocks: Annotated[
        bool,
        _doc(
            "count a request's output blocks on its rank as it generates (record_output), decayed by its "
            "expected output length when it gives one"
        ),
    ] = False
    router_assume_kv_reuse: Annotated[
        bool, _doc("prompt blocks shared by concurrent requests on one rank count once (as the engine reuses them)")
    ] = True
    router_track_prefill_tokens: Annotated[
        bool, _doc("count each rank's queued prefill tokens until mark_prefill (off: prefill load is ignored)")
    ] = True
    router_prefill_load_model: Annotated[
        PrefillLoadModel,
        _doc(
            "none: a booked prefill counts in full until mark_prefill; linear: the oldest pending prefill "
            "of a rank decays as it runs, at router_prefill_tokens_per_s"
        ),
    ] = "none"
    # Ours: the prefill rate of one rank (tokens/s) the "linear" load model expects.
    router_prefill_tokens_per_s: Annotated[
        float,
        _doc("ours: prefill rate of one rank, in tokens per second, that the linear prefill load model expects"),
    ] = 50_000.0
    request_expiry_secs: Annotated[
        float, _doc("a booked request never marked free is released after this many seconds")
    ] = 300.0
    # Busy thresholds (§4.6); None skips the check.
    active_decode_blocks_threshold: Annotated[
        float | None,
        _doc(
            "a rank is busy while its used (or active decode) KV blocks exceed this fraction (0.0-1.0) of its "
            "total_kv_blocks; a worker with every rank busy gets no new requests; unset: no check"
        ),
    ] = None
    active_prefill_tokens_threshold: Annotated[
        int | None, _doc("a rank is busy while its queued prefill tokens exceed this many; unset: no check")
    ] = None
    active_prefill_tokens_threshold_frac: Annotated[
        float | None,
        _doc(
            "a rank is busy while its queued prefill tokens exceed this multiple of its max_num_batched_tokens; "
            "unset: no check"
        ),
    ] = None
    # Queue (§4.7); no threshold means no queue.
    router_queue_threshold: Annotated[
        float | None,
        _doc(
            "park a request in the router's queue while every eligible rank has more queued prefill tokens than "
            "this multiple of its max_num_batched_tokens; unset: no queue"
        ),
    ] = None
    router_queue_policy: Annotated[
        QueuePolicy,
        _doc(
            "order of the queue: fcfs (arrival, with priority), wspt (shortest uncached prompt first, weighted by "
            "priority), lcfs (newest first, for experiments)"
        ),
    ] = "fcfs"
    # Ours, after Dynamo's per-class `request_queue_limit_per_worker` /
    # `raw_isl_token_queue_limit_per_worker`: bounds scaled by the number of registered workers.
    router_queue_request_limit_per_worker: Annotated[
        int | None,
        _doc(
            "ours: the queue holds at most this many requests per registered worker, then answers queue_rejected "
            "(429); needs router_queue_threshold; unset: unbounded"
        ),
    ] = None
    router_queue_isl_token_limit_per_worker: Annotated[
        int | None,
        _doc(
            "ours: the queue holds at most this many prompt tokens per registered worker, then answers "
            "queue_rejected (429); needs router_queue_threshold; unset: unbounded"
        ),
    ] = None
    # Routing waits until this many workers have registered (Dynamo's DYN_ROUTER_MIN_INITIAL_WORKERS).
    router_min_initial_workers: Annotated[
        int,
        _doc(
            "routing decisions wait until this many workers have registered (Dynamo's "
            "DYN_ROUTER_MIN_INITIAL_WORKERS); 0: no wait"
        ),
    ] = 0
    # Ours: the selection policy by registry name (`router.policies`).
    policy: Annotated[
        str,
        _doc(
            "ours: the selection policy, by its name in the policy registry: dynamo is Dynamo 1.6.1's cost "
            "function; the others are described in the README (Policies)"
        ),
    ] = "latency"
    # Ours, knobs of the `cache_affinity` policy (router/policies/cache_affinity.py), tuned on the shared
    # traces (docs/routing-quality.md): how many queued prefill tokens one uncached prompt token is
    # worth (> 1 trades some queueing for cache affinity, which also saves the fleet's cache space);
    # the queued-token cost of one token of active decode context on the rank; and whether prompt
    # prefixes booked on a rank but not yet reported stored count as cached there.
    affinity_miss_weight: Annotated[
        float,
        _doc(
            "cache_affinity: queued prefill tokens one uncached prompt token is worth (> 1 trades some queueing "
            "for cache hits, which also saves the fleet's cache space)"
        ),
    ] = 3.0
    affinity_decode_weight: Annotated[
        float, _doc("cache_affinity: queued-token cost of one token of active decode context on the rank")
    ] = 0.05
    affinity_predict_inflight: Annotated[
        bool,
        _doc("cache_affinity: prompt prefixes booked on a rank but not yet reported stored count as cached there"),
    ] = True
    # Ours, knobs of the `latency` policy (router/policies/latency.py): the weight of this prompt's
    # uncached tokens on a full cache (1 on an empty one); the cost of one prefill token to each request
    # decoding on the rank; the cost, in prefill tokens, of one output token per token of context in
    # flight on the rank; and the output length assumed for a request that does not say how long it is.
    latency_miss_weight: Annotated[
        float,
        _doc(
            "latency policy: weight of this prompt's uncached tokens when the rank's cache is full (1 when it is empty)"
        ),
    ] = 6.0
    latency_stall_weight: Annotated[
        float,
        _doc("latency policy: cost of one prefill token to each request decoding on the rank"),
    ] = 0.2
    latency_decode_weight: Annotated[
        float,
        _doc("latency policy: cost, in prefill tokens, of one output token per token of context in flight on the rank"),
    ] = 0.0012
    # Ours: the decode weight grows with the fleet's load (requests in flight per candidate rank), so that
    # near saturation, where the ITL bound binds, the `latency` policy spreads decode work as `dynamo` does.
    latency_decode_load_weight: Annotated[
        float,
        _doc(
            "latency policy: added to latency_decode_weight per request in flight per candidate rank, "
            "averaged over the candidates (0: a fixed decode weight)"
        ),
    ] = 0.0
    # Ours: this request's context slows each decode step of the requests already on the rank as theirs
    # slows its own; 1 prices both sides alike, 0 only its own (`latency`'s first form).
    latency_decode_others_weight: Annotated[
        float,
        _doc(
            "latency policy: weight of the decode slowdown this request's context causes each request on the rank, "
            "relative to the slowdown their context causes it (0: its own only)"
        ),
    ] = 1.0
    # Ours: the decode side per output token (every request the default length) rather than per response.
    latency_decode_per_token: Annotated[
        bool,
        _doc(
            "latency policy: price the decode side per output token, every request as long as "
            "latency_default_output_tokens, not per response (its expected output length)"
        ),
    ] = True
    # Ours: a prefill stall of t ms adds t / length to the mean inter-token latency of each request decoding
    # beside it, so pricing the stall per request by the default output length over its own steers long
    # prefills away from short answers, which an ITL bound catches first.
    latency_itl_stall_weight: Annotated[
        float,
        _doc(
            "latency policy: cost of one prefill token to each request on the rank, times "
            "latency_default_output_tokens over that request's expected output length (0: off)"
        ),
    ] = 0.0
    # Ours: an engine pass that runs prefill costs a fixed time beside its tokens' (Dynamo's mocker fit:
    # 16.5 ms, the time of about 1,090 prefill tokens). A request pays it in its TTFT for every pass until
    # its prefill is done, and each pass it adds to a rank's queue stalls every request decoding there; one
    # that fits in the passes the rank has queued anyway adds none.
    latency_pass_base_tokens: Annotated[
        float,
        _doc(
            "latency policy: fixed cost of one engine pass that runs prefill, in prefill tokens: to the request "
            "for each pass until its prefill is done, to each request decoding on the rank for each pass it adds "
            "(a rank without max_num_batched_tokens: one pass; 0: off)"
        ),
    ] = 2000.0
    latency_default_output_tokens: Annotated[
        int,
        _doc("latency policy: output length, in tokens, assumed for a request that does not give one"),
    ] = 256
    # Ours: a rank costing at most this fraction more than the cheapest wins when it holds more of the
    # prompt (computed or in flight): the hit rate breaks near-ties of the `latency` cost.
    latency_hit_margin: Annotated[
        float,
        _doc(
            "latency policy: a rank within this fraction of the least cost wins when it holds more of the prompt "
            "(0: the least cost always)"
        ),
    ] = 0.05
    untrusted_overlap_weight: Annotated[
        float,
        _doc(
            "share of its overlap a rank whose event stream is untrusted (a gap, an unanswered resync, a reconnect "
            "not yet resynced) is credited with; 1.0 trusts it fully; the dynamo policy ignores it (parity)"
        ),
    ] = 0.5
    # Dynamo reads this from the model card: EAGLE hashing windows span one extra token (§1.1).
    enable_eagle: Annotated[
        bool,
        _doc(
            "EAGLE speculative decoding (SGLang's bigram-keyed cache): each block's hash window spans one extra "
            "token, as the engines' stored blocks do"
        ),
    ] = False
    # Disaggregated fleets (workers registered with role prefill or decode); llm-d's prefix-based PD decider
    # and vllm-router's P/D proposal (PR #130) use a few hundred tokens, 256 in the latter.
    disagg_local_prefill_below_tokens: Annotated[
        int,
        _doc(
            "disaggregated fleets: a request whose uncached prompt on the chosen decode worker is below this many "
            "tokens is prefilled there, skipping the remote prefill; 0: always prefill remotely"
        ),
        msgspec.Meta(ge=0),
    ] = 256
    disagg_prefill_queue_limit_tokens: Annotated[
        Annotated[int, msgspec.Meta(ge=0)] | None,
        _doc(
            "disaggregated fleets: when the chosen prefill worker already has more than this many prefill tokens "
            "pending, and more than the decode worker would have with this prompt, the request is prefilled on the "
            "decode worker (the prefill pool is saturated); unset: never"
        ),
    ] = None
    # Load-aware conditional disaggregation: the local path also when the prefill pool is the longer wait.
    disagg_local_prefill_sooner_below_tokens: Annotated[
        Annotated[int, msgspec.Meta(ge=0)] | None,
        _doc(
            "disaggregated fleets: a request whose uncached prompt on the chosen decode worker is below this many "
            "tokens is also prefilled there when that is the shorter wait: when disagg_local_prefill_cost_factor "
            "times (the decode worker's pending prefill tokens plus this prompt's uncached ones) is below the chosen "
            "prefill worker's pending prefill tokens; unset: never"
        ),
    ] = None
    disagg_local_prefill_cost_factor: Annotated[
        float,
        _doc(
            "disaggregated fleets: what a prefill token on a decode worker is counted as, in prefill-worker tokens, "
            "by disagg_local_prefill_sooner_below_tokens (its passes also decode its batch, whose tokens it delays)"
        ),
        msgspec.Meta(ge=0),
    ] = 2.0
    # Estimated-TTFT conditional disaggregation (docs/disaggregation.md): both paths' waits in prefill tokens,
    # with the router's booked load; the local one also charged for the decode batch its prefill stalls.
    disagg_local_prefill_stall_weight: Annotated[
        Annotated[float, msgspec.Meta(ge=0)] | None,
        _doc(
            "disaggregated fleets: prefill on the chosen decode worker whenever that is the sooner first token by "
            "the router's estimate, in prefill tokens: local = the decode worker's pending prefill + this prompt's "
            "uncached tokens there x (1 + this weight x the requests active there, whose decoding the prefill "
            "stalls), remote = the prefill worker's pending prefill + the prompt's uncached tokens there (x the "
            "same factor for the requests active there when it is a worker of role both) + "
            "disagg_transfer_cost_per_token x the tokens the decode worker lacks; unset: never"
        ),
    ] = None
    disagg_transfer_cost_per_token: Annotated[
        float,
        _doc(
            "disaggregated fleets: the KV transfer of one token to the decode worker, in prefill tokens' time, for "
            "disagg_local_prefill_stall_weight (0.35: 128 KiB per token at 25 GB/s against 15 us of prefill)"
        ),
        msgspec.Meta(ge=0),
    ] = 0.35
    # Dynamo's advice for a prefill-only router is router_track_active_blocks off (§4.2): a prefill worker
    # decodes nothing, so its cost is its pending prefill. Booked, a prefill leg's prompt blocks count as
    # decode load on the worker holding the prefix (while its prefill runs) and push that prefix's next
    # requests to a worker without it.
    disagg_prefill_track_active_blocks: Annotated[
        bool,
        _doc(
            "disaggregated fleets: book a remote prefill leg's prompt blocks on its prefill worker and price them as "
            "decode load when placing prefill legs (Dynamo's router_track_active_blocks on a prefill router); off "
            "(default, Dynamo's advice for prefill-only routers): the prefill pool is priced by its pending prefill "
            "tokens and cache alone, plus the decode load of any role-both worker's own requests"
        ),
    ] = False
    disagg_prefill_policy: Annotated[
        str | None,
        _doc(
            "disaggregated fleets: the selection policy, by its name in the policy registry, that places remote "
            "prefill legs (the decode worker stays with policy); unset: policy for both"
        ),
    ] = None
    disagg_among_both_workers: Annotated[
        bool,
        _doc(
            "route a fleet of workers of role both as a disaggregated one: each request's decode worker, and a "
            "remote prefill leg on another worker unless the conditional rules keep it local (every engine needs a "
            "KV connector serving either leg, as vLLM's NixlConnector with kv_role kv_both does, in the "
            "kv_transfer_params hand-off; pair it with disagg_local_prefill_stall_weight, docs/disaggregation.md); "
            "off: disaggregated only when some worker is prefill or decode"
        ),
    ] = False
    disagg_decode_overlap_credit: Annotated[
        bool,
        _doc(
            "disaggregated fleets: pick the decode worker pricing the prefill it would do itself, credited with its "
            "own cache (its connector reuses it); off: by decode load alone"
        ),
    ] = True
    # Approximate mode (Dynamo's use_kv_events=false, §3.7): off for every worker, or per worker with
    # WorkerConfig.kv_events, the router records each routed prompt's blocks on the chosen rank for
    # router_ttl_secs, at most the worker's total_kv_blocks per rank (least recently routed out first).
    kv_events: Annotated[
        bool,
        _doc(
            "off: approximate mode for every worker (no KV events; each routed prompt counts as cached on "
            "its rank for router_ttl_secs); per worker with its kv_events"
        ),
    ] = True
    router_ttl_secs: Annotated[
        float,
        _doc(
            "approximate mode: seconds a routed prompt's blocks count as cached on its rank (at most "
            "total_kv_blocks per rank, least recently routed out first)"
        ),
    ] = 120.0
    # Ours: an engine's KV events trail its answer (vLLM publishes a step's events from a thread, then the
    # bridge and NATS carry them), so a prompt sent again at once found its blocks unindexed.
    computed_prompt_credit_secs: Annotated[
        float,
        _doc(
            "ours: seconds a request's computed prompt (its first token out) counts as cached on its rank while "
            "its engine's events about it may still be on their way (blocks leaving the rank end it); 0: off; the "
            "dynamo policy ignores it (parity)"
        ),
        msgspec.Meta(ge=0),
    ] = 1.0
    # Ours: the circuit breaker per worker (router/worker_health.py), fed by the proxy's outcomes.
    worker_breaker_failures: Annotated[
        int,
        _doc(
            "ours: failures in a row (refused, timed out, 5xx, a broken stream) that open a worker's circuit: it is "
            "left out of routing by every policy for worker_breaker_open_secs; 0: no circuit breaker"
        ),
        msgspec.Meta(ge=0),
    ] = 5
    worker_breaker_open_secs: Annotated[
        float,
        _doc("ours: how long an open circuit leaves its worker out before it goes half-open (probe requests)"),
        msgspec.Meta(ge=0),
    ] = 10.0
    worker_breaker_half_open_probes: Annotated[
        int,
        _doc(
            "ours: requests let through at a time to a half-open worker; this many successes in a row close its "
            "circuit, one failure opens it again"
        ),
        msgspec.Meta(ge=1),
    ] = 1

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
            "latency_decode_load_weight",
            "latency_decode_others_weight",
            "latency_itl_stall_weight",
            "latency_pass_base_tokens",
            "latency_hit_margin",
        ):
            _require_weight(name, getattr(self, name))
        _require_non_negative("router_ttl_secs", self.router_ttl_secs)
        if not 0.0 <= self.untrusted_overlap_weight <= 1.0:
            raise ConfigError(
                "untrusted_overlap_weight", f"must be between 0.0 and 1.0, got {self.untrusted_overlap_weight}"
            )
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
                _require_weight(name, value)
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
        if self.disagg_prefill_policy == "":
            raise ConfigError("disagg_prefill_policy", "must name a registered selection policy or be unset")

    def with_override(self, override: RouterConfigOverride) -> RouterConfig:
        """This config with a request's override applied (Dynamo's `RouterConfigOverride`); raises
        `ConfigError` naming the field for a bad value."""
        fields: dict[str, object] = {}
        if override.overlap_score_weight is not None:
            # Deprecated alias, as Dynamo maps it: the scale, and 0 switches the credit off too. Checked
            # here, so that a bad value is refused under the name the caller sent.
            _require_weight("overlap_score_weight", override.overlap_score_weight)
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


def _require_weight(name: str, value: float) -> None:
    if not (math.isfinite(value) and 0.0 <= value <= MAX_WEIGHT):
        raise ConfigError(name, f"must be a number from 0 to {MAX_WEIGHT:g}, got {value}")

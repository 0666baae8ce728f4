"""`RouterConfig` validation and the policy registry."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import msgspec
import pytest

from router import ConfigError, KvRouter, RouterConfig, RouteRequest, WorkerConfig
from router.policies import Selection, SelectionContext, SelectionPolicy, policy_names, register_policy, registry


def test_dynamos_knobs_default_to_dynamos_and_the_policy_to_latency() -> None:
    config = RouterConfig()
    assert (config.overlap_score_credit, config.overlap_score_credit_decay, config.prefill_load_scale) == (1.0, 0, 1.0)
    assert (config.host_cache_hit_weight, config.disk_cache_hit_weight) == (0.75, 0.25)
    assert (config.router_temperature, config.decode_active_request_weight, config.request_expiry_secs) == (0, 0, 300)
    assert config.router_track_active_blocks and config.router_assume_kv_reuse and config.router_track_prefill_tokens
    assert (config.router_queue_threshold, config.router_queue_policy) == (None, "fcfs")
    # Ours: the policy that carries the most traffic at a latency SLO (docs/routing-quality.md).
    assert config.policy == "latency"
    assert (config.latency_stall_weight, config.latency_decode_weight) == (0.2, 0.0012)
    assert (config.latency_decode_others_weight, config.latency_decode_per_token) == (1.0, True)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"block_size": 0}, "block_size"),
        ({"overlap_score_credit": -1.0}, "overlap_score_credit"),
        ({"prefill_load_scale": float("nan")}, "prefill_load_scale"),
        ({"router_temperature": float("inf")}, "router_temperature"),
        ({"request_expiry_secs": 0.0}, "request_expiry_secs"),
        ({"active_decode_blocks_threshold": 1.5}, "active_decode_blocks_threshold"),
        ({"active_prefill_tokens_threshold": -1}, "active_prefill_tokens_threshold"),
        ({"active_prefill_tokens_threshold_frac": -0.1}, "active_prefill_tokens_threshold_frac"),
        ({"router_queue_threshold": -1.0}, "router_queue_threshold"),
        ({"router_queue_request_limit_per_worker": 4}, "router_queue_request_limit_per_worker"),
        (
            {"router_queue_threshold": 1.0, "router_queue_isl_token_limit_per_worker": 0},
            "router_queue_isl_token_limit_per_worker",
        ),
    ],
)
def test_invalid_values_name_their_field(fields: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field}: ") as caught:
        RouterConfig(**fields)  # type: ignore[arg-type]
    assert caught.value.field == field
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.json.decode(msgspec.json.encode(fields), type=RouterConfig)


def test_unknown_fields_and_policies_are_refused() -> None:
    with pytest.raises(msgspec.ValidationError, match="overlap_score_credt"):
        msgspec.json.decode(b'{"overlap_score_credt": 2}', type=RouterConfig)
    with pytest.raises(ConfigError, match=r"^policy: unknown policy 'smart'") as caught:
        KvRouter(RouterConfig(policy="smart"))
    assert caught.value.field == "policy"


def picks(policy: str, requests: int, **prepare: int) -> list[int]:
    router = KvRouter(RouterConfig(policy=policy), rng=random.Random(1))
    for worker_id in (1, 2, 3):
        router.register_worker(WorkerConfig(worker_id=worker_id))
    for worker_id, count in prepare.items():
        for index in range(count):
            request = RouteRequest(tokens=[index], request_id=f"{worker_id}-{index}")
            asyncio.run(router.new(request, pinned_worker=(int(worker_id[1:]), 0)))
    return [asyncio.run(router.new(RouteRequest(tokens=[7] * 40))).worker_id for _ in range(requests)]


def test_round_robin_cycles() -> None:
    assert picks("round_robin", 7) == [1, 2, 3, 1, 2, 3, 1]


def test_random_covers_every_worker() -> None:
    counts = Counter(picks("random", 300))
    assert set(counts) == {1, 2, 3} and min(counts.values()) > 60


def test_least_loaded_prefers_fewest_active_requests() -> None:
    assert set(picks("least_loaded", 5, w1=2, w2=1, w3=2)) == {2}


def test_a_registered_policy_becomes_selectable(monkeypatch: pytest.MonkeyPatch) -> None:
    # Registered into a copy of the registry, so no later test of the session lists it.
    monkeypatch.setattr(registry, "_POLICIES", dict(registry._POLICIES))

    class LastCandidate(SelectionPolicy):
        name = "last_candidate"

        def __init__(self, config: RouterConfig, rng: random.Random) -> None:
            pass

        def select(self, context: SelectionContext) -> Selection:
            return Selection(len(context) - 1, "always the last")

    register_policy("last_candidate", LastCandidate)
    assert "last_candidate" in policy_names()
    assert picks("last_candidate", 3) == [3, 3, 3]
    with pytest.raises(ValueError, match="already registered"):
        register_policy("last_candidate", LastCandidate)

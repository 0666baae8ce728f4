"""Selection policies by name. A new policy is a class following `SelectionPolicy` whose constructor
takes ``(config, rng)``; `register_policy` makes it selectable through ``RouterConfig.policy``."""

from __future__ import annotations

import random

from router.config import RouterConfig
from router.errors import ConfigError
from router.policies.base import PolicyFactory, SelectionPolicy
from router.policies.cache_affinity import CacheAffinityPolicy
from router.policies.dynamo import DynamoPolicy
from router.policies.latency import LatencyPolicy
from router.policies.simple import LeastLoadedPolicy, RandomPolicy, RoundRobinPolicy

__all__ = ["create_policy", "policy_names", "register_policy"]

_POLICIES: dict[str, PolicyFactory] = {
    DynamoPolicy.name: DynamoPolicy,
    RoundRobinPolicy.name: RoundRobinPolicy,
    RandomPolicy.name: RandomPolicy,
    LeastLoadedPolicy.name: LeastLoadedPolicy,
    CacheAffinityPolicy.name: CacheAffinityPolicy,
    LatencyPolicy.name: LatencyPolicy,
}


def register_policy(name: str, factory: PolicyFactory) -> None:
    if name in _POLICIES:
        raise ValueError(f"a selection policy named {name!r} is already registered")
    _POLICIES[name] = factory


def policy_names() -> list[str]:
    return sorted(_POLICIES)


def create_policy(config: RouterConfig, rng: random.Random) -> SelectionPolicy:
    """The policy ``config.policy`` names, built for this config and RNG."""
    factory = _POLICIES.get(config.policy)
    if factory is None:
        raise ConfigError("policy", f"unknown policy {config.policy!r}; registered: {', '.join(policy_names())}")
    return factory(config, rng)

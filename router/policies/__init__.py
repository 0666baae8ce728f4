"""Selection policies: given scored candidates, pick one (see `base` for the contract)."""

from router.policies.base import Candidate, PolicyFactory, Selection, SelectionContext, SelectionPolicy
from router.policies.cache_affinity import CacheAffinityPolicy
from router.policies.dynamo import DynamoPolicy
from router.policies.latency import LatencyPolicy
from router.policies.registry import create_policy, policy_names, register_policy
from router.policies.simple import LeastLoadedPolicy, RandomPolicy, RoundRobinPolicy

__all__ = [
    "CacheAffinityPolicy",
    "Candidate",
    "DynamoPolicy",
    "LatencyPolicy",
    "LeastLoadedPolicy",
    "PolicyFactory",
    "RandomPolicy",
    "RoundRobinPolicy",
    "Selection",
    "SelectionContext",
    "SelectionPolicy",
    "create_policy",
    "policy_names",
    "register_policy",
]

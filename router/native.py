"""The router's optional C accelerator (`router._native`, built from router/_native.c).

The refcount loops of booking and release and their prefix bisections (router/sequences.py), the
dynamo policy's costs and lowest cost (router/policies/dynamo.py). Callers test ``ENABLED`` first
and keep their Python code beside it; ``KV_ROUTER_NO_NATIVE=1`` switches it off with the others
(indexer/native.py).
"""

from __future__ import annotations

from indexer.native import SWITCHED_OFF

__all__ = ["ENABLED", "accel"]

try:
    from router import _native as accel
except ImportError:  # not built: the pure-Python code runs; `accel` is never touched then
    accel = None  # type: ignore[assignment]

ENABLED = accel is not None and not SWITCHED_OFF

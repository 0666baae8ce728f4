"""The router's optional C accelerator (`router._native`, built from router/_native.c).

The refcount loops of booking and release and their prefix bisections (router/sequences.py), the
dynamo policy's costs and lowest cost (router/policies/dynamo.py), the latency policy's costs
(router/policies/latency.py). Callers test ``ENABLED`` first
and keep their Python code beside it; ``KV_ROUTER_NO_NATIVE=1`` switches it off with the others
(indexer/native.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from indexer.native import SWITCHED_OFF, load_extension

__all__ = ["ENABLED", "accel"]

if TYPE_CHECKING:  # the extension's types (router/_native.pyi)
    from router import _native as accel
else:
    accel = load_extension("router._native")  # None: never touched, ENABLED is false

ENABLED = accel is not None and not SWITCHED_OFF

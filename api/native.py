"""The HTTP front's optional C accelerator (`api._native`, built from api/_native.c).

A JSON body's tokens array as packed u32 (api/codec.py) and one whole plain POST request
(api/http_protocol.py). Callers test ``ENABLED`` first and keep their Python path beside it;
``KV_ROUTER_NO_NATIVE=1`` switches it off with the others (indexer/native.py).
"""

from __future__ import annotations

from indexer.native import SWITCHED_OFF

__all__ = ["ENABLED", "accel"]

try:
    from api import _native as accel
except ImportError:  # not built: the Python path runs; `accel` is never touched then
    accel = None  # type: ignore[assignment]

ENABLED = accel is not None and not SWITCHED_OFF

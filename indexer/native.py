"""The optional C accelerator: one switch for every caller.

`indexer._native` (built from `indexer/_native.c` at install when a compiler is there) runs the
per-block inner loops: XXH3-64, block and sequence hashes, JSON token arrays to packed u32, and the
radix tree's store and match walks. Each caller keeps its pure-Python code beside it and tests
``ENABLED`` first; the two give the same answers bit for bit (tests/test_native.py).
``KV_ROUTER_NO_NATIVE=1`` forces the Python code, as does a failed build; both are read once, at
import.
"""

from __future__ import annotations

import os

__all__ = ["ENABLED", "NATIVE_DISABLED_ENV", "accel"]

NATIVE_DISABLED_ENV = "KV_ROUTER_NO_NATIVE"

try:
    from indexer import _native as accel
except ImportError:  # not built: the pure-Python code runs; `accel` is never touched then
    accel = None  # type: ignore[assignment]

ENABLED = accel is not None and os.environ.get(NATIVE_DISABLED_ENV, "") in ("", "0")

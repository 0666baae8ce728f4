"""The engine bridge's optional C step (`indexer._events_native`, built from indexer/_events_native.c).

One call decodes a plain engine batch into `indexer.engine_events`' events (hashes folded, tokens
hashed, tiers mapped), one call records a stored chain in `indexer.held_blocks.HeldBlocks`. It needs
the indexer's accelerator too (its token packing and XXH3 block hashes), and is off with it:
``KV_ROUTER_NO_NATIVE=1`` or a failed build of either runs the Python code, which gives the same
answers (tests/test_events_native.py).
"""

from __future__ import annotations

from indexer.native import ENABLED as INDEXER_NATIVE

__all__ = ["ENABLED", "accel"]

try:
    from indexer import _events_native as accel
except ImportError:  # not built: the pure-Python code runs; `accel` is never touched then
    accel = None  # type: ignore[assignment]

ENABLED = INDEXER_NATIVE and accel is not None

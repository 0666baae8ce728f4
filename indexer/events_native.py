"""The engine bridge's optional C step (`indexer._events_native`, built from indexer/_events_native.c).

One call decodes a plain engine batch into `indexer.engine_events`' events (hashes folded, tokens
hashed, tiers mapped), one call records a stored chain in `indexer.held_blocks.HeldBlocks`. It needs
the indexer's accelerator too (its token packing and XXH3 block hashes), and is off with it:
``KV_ROUTER_NO_NATIVE=1`` or a failed build of either runs the Python code, which gives the same
answers (tests/test_events_native.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from indexer.native import ENABLED as INDEXER_NATIVE
from indexer.native import load_extension

__all__ = ["ENABLED", "accel"]

if TYPE_CHECKING:  # the extension's types (indexer/_events_native.pyi)
    from indexer import _events_native as accel
else:
    accel = load_extension("indexer._events_native")  # None: never touched, ENABLED is false

ENABLED = INDEXER_NATIVE and accel is not None

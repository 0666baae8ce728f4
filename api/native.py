"""The HTTP front's optional C accelerator (`api._native`, built from api/_native.c).

A JSON body's tokens array as packed u32 (api/codec.py) and one whole plain POST request
(api/http_protocol.py). Callers test ``ENABLED`` first and keep their Python path beside it;
``KV_ROUTER_NO_NATIVE=1`` switches it off with the others (indexer/native.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from indexer import events_native
from indexer import native as indexer_native
from indexer.native import SWITCHED_OFF, load_extension
from router import native as router_native

__all__ = ["ENABLED", "accel", "active_accelerators"]

if TYPE_CHECKING:  # the extension's types (api/_native.pyi)
    from api import _native as accel
else:
    accel = load_extension("api._native")  # None: never touched, ENABLED is false

ENABLED = accel is not None and not SWITCHED_OFF


def active_accelerators() -> list[str]:
    """The C accelerators this process runs, by layer (for ``/v1/info`` and ``kv_router_build_info``):
    an image or a machine without a compiler shows none, and runs the pure-Python code."""
    layers = {
        "indexer": indexer_native.ENABLED,
        "events": events_native.ENABLED,
        "router": router_native.ENABLED,
        "api": ENABLED,
    }
    return [name for name, enabled in layers.items() if enabled]

"""The HTTP front's optional C accelerator (`api._native`, built from api/_native.c).

A JSON body's array of token ids as packed u32 (the decision API's ``tokens``, api/codec.py; a
completion's ``prompt``, api/proxy/service.py) and one whole plain POST request (api/http_protocol.py).
Callers test ``ENABLED`` first and keep their Python path beside it; ``KV_ROUTER_NO_NATIVE=1``
switches it off with the others (indexer/native.py), and so does a build of another interface than
this code's (an in-place build older than a ``git pull``: rebuild with ``pip install -e .``).
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import TYPE_CHECKING

from indexer import events_native
from indexer import native as indexer_native
from indexer.native import SWITCHED_OFF, load_extension
from router import native as router_native

__all__ = ["ENABLED", "accel", "active_accelerators"]

# The interface of api/_native.c this code calls (its NATIVE_INTERFACE).
INTERFACE = 2


def _current(module: ModuleType | None) -> ModuleType | None:
    """The extension when it is a build of this code's interface; else None, said once."""
    if module is not None and getattr(module, "INTERFACE", None) != INTERFACE:
        logging.getLogger(__name__).warning(
            "api._native is a build of another interface (%s; this code calls %d): its C paths are off until it "
            "is rebuilt (pip install -e .)",
            getattr(module, "INTERFACE", "none"),
            INTERFACE,
        )
        return None
    return module


if TYPE_CHECKING:  # the extension's types (api/_native.pyi)
    from api import _native as accel
else:
    accel = _current(load_extension("api._native"))  # None: never touched, ENABLED is false

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

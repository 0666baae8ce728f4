"""The optional C accelerators: the one switch, and the indexer's extension.

Each layer has its own extension, built at install when a compiler is there: `indexer._native`
(this module: XXH3-64, block and sequence hashes, token lists to packed u32, the radix tree's store,
match and removal walks, the msgpack encodings of the event paths), `router._native`
(router/native.py) and `api._native` (api/native.py). Each caller keeps its pure-Python code beside
it and tests its layer's ``ENABLED`` first; the two give the same answers bit for bit
(tests/test_native*.py). ``KV_ROUTER_NO_NATIVE=1`` (``SWITCHED_OFF``, read once at import) forces
the Python code in every layer, as does a failed build of that layer's extension.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import TYPE_CHECKING

__all__ = ["DECLINES", "ENABLED", "NATIVE_DISABLED_ENV", "SWITCHED_OFF", "accel", "declined", "load_extension"]

NATIVE_DISABLED_ENV = "KV_ROUTER_NO_NATIVE"
SWITCHED_OFF = os.environ.get(NATIVE_DISABLED_ENV, "") not in ("", "0")

DECLINES: dict[tuple[str, str], int] = {}
"""(C module, reason) -> how often a C path of this process handed its input to the Python twin, in
every layer: a silent slow-down shows as a count that grows (api/metrics.py exports it)."""


def declined(module: str, reason: str) -> None:
    """Count one hand-over of ``module``'s C path to the Python code, for ``reason``."""
    key = (module, reason)
    DECLINES[key] = DECLINES.get(key, 0) + 1


def load_extension(name: str) -> ModuleType | None:
    """A layer's C extension by its full name (``router._native``), or None when it is not built.
    Imported by name rather than ``from router import _native``, which goes through the package: its
    ``__init__`` imports the modules that import the extension, a cycle (the extension itself imports
    no Python module)."""
    try:
        return importlib.import_module(name)
    except ImportError:  # not built: the pure-Python code runs
        return None


if TYPE_CHECKING:  # the extension's types (indexer/_native.pyi)
    from indexer import _native as accel
else:
    accel = load_extension("indexer._native")  # None: never touched, ENABLED is false

ENABLED = accel is not None and not SWITCHED_OFF

if accel is not None:
    # The key of the C BlockMaps' hashing, random per process: block hashes a sender picks cannot be
    # chosen to share one home (see `BlockMap` in indexer/README.md).
    accel.set_map_key(int.from_bytes(os.urandom(8), "little"))

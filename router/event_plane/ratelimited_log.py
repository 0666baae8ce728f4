"""Logging for bad input that may arrive in floods: at most one line per reason per interval."""

from __future__ import annotations

import logging
import time

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self._logger = logger
        self._interval = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, reason: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last.get(reason, -self._interval) < self._interval:
            self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
            return
        self._last[reason] = now
        skipped = self._suppressed.pop(reason, 0)
        suffix = f" ({skipped} more like it suppressed)" if skipped else ""
        self._logger.warning("%s: %s%s", reason, message, suffix)

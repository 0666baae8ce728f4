"""A one-line progress bar on stderr (a terminal), redrawn at most every ``interval_s``; no dependency."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """``bar(done, total)`` redraws; `close` ends the line. Silent when ``enabled`` is False."""

    def __init__(
        self, label: str, *, enabled: bool = True, stream: TextIO | None = None, interval_s: float = 0.2
    ) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        # Redrawing a line with carriage returns only makes sense on a terminal.
        self.enabled = enabled and self.stream.isatty()
        self.interval_s = interval_s
        self._started = time.monotonic()
        self._drawn = 0.0
        self._last = (0, 0)

    def __call__(self, done: int, total: int) -> None:
        self._last = (done, total)
        now = time.monotonic()
        if self.enabled and (now - self._drawn >= self.interval_s or done >= total):
            self._drawn = now
            self._draw(done, total, now)

    def _draw(self, done: int, total: int, now: float) -> None:
        width = 30
        filled = width * done // total if total else width
        elapsed = now - self._started
        eta = elapsed * (total - done) / done if done else 0.0
        self.stream.write(
            f"\r{self.label:<14} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}"
            f"  {elapsed:5.1f}s elapsed, {eta:5.1f}s left "
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(*self._last, time.monotonic())
            self.stream.write("\n")
            self.stream.flush()

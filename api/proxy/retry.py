"""When the proxy tries a request again after the workers failed it before its first byte.

A retry follows a connection failure, a 5xx or a stream ending before its first byte, and an
overloaded engine's 429 or 503. Before retry ``n`` (1, 2, ...) the proxy waits an exponential backoff
with jitter, ``d = min(proxy_retry_backoff_max_secs, proxy_retry_backoff_secs * 2 ** (n - 1))``, drawn
uniformly from ``[d / 2, d]`` (half of it fixed, so retries never bunch at zero; half random, so the
clients a failure hit do not come back in step), and at least the engine's ``Retry-After``. Retries
are bounded in count (``proxy_retries``) and in time: none starts later than
``proxy_retry_budget_secs`` after the request's body was in (a ``Retry-After`` beyond that ends the
retries at once and the engine's answer goes to the client). A disaggregated request whose prefill legs
failed beyond the count goes once more, at once, to its decode worker alone: a retry as well, counted
and bounded by the same budget.
"""

from __future__ import annotations

import datetime
import email.utils
import math
import random
import time
from collections.abc import Callable
from typing import ClassVar

from api.config import ProxyConfig
from api.http_stream import Headers
from api.proxy.upstream import AnswerTooLarge, UpstreamConnection, UpstreamError, WorkerSilent
from api.proxy.wire import error_body

__all__ = [
    "OVERLOADED",
    "Overloaded",
    "Refused",
    "RetryPolicy",
    "WorkerFailed",
    "overloaded_answer",
    "retry_after_secs",
    "unanswered",
]

# An engine's answers meaning "too busy now, try again" (vLLM and SGLang's, with a Retry-After or not).
OVERLOADED = frozenset({429, 503})


class RetryPolicy:
    """The backoff and the bounds of the retries of one proxy (`ProxyConfig`)."""

    def __init__(self, config: ProxyConfig, uniform: Callable[[float, float], float] = random.uniform) -> None:
        self.retries = config.proxy_retries
        self._base = config.proxy_retry_backoff_secs
        self._cap = config.proxy_retry_backoff_max_secs
        self._budget = config.proxy_retry_budget_secs
        self._uniform = uniform

    def backoff(self, retry: int) -> float:
        """The jittered wait before retry ``retry`` (1 for the first)."""
        ceiling = min(self._cap, self._base * 2.0 ** min(retry - 1, 64))
        return self._uniform(ceiling / 2, ceiling)

    def delay(self, retry: int, retry_after: float | None, started: float, now: float) -> float | None:
        """The wait before retry ``retry`` (at least the engine's ``retry_after``), or None when there is
        to be no such retry: past the count, or starting after the time budget (``started``, ``now``:
        monotonic seconds)."""
        if retry > self.retries:
            return None
        wait = self.backoff(retry)
        if retry_after is not None:
            wait = max(wait, retry_after)
        return wait if self.within_budget(started, now + wait) else None

    def within_budget(self, started: float, now: float) -> bool:
        """Whether an attempt with no backoff may start now: the last one past the count (the decode worker
        alone, its prefill legs failed) is a retry too, and none starts after the time budget."""
        return now - started <= self._budget


def retry_after_secs(value: bytes | None, now: float | None = None) -> float | None:
    """An HTTP ``Retry-After`` in seconds from now: delay-seconds (one too large for a float is
    infinite: past any retry budget) or an HTTP-date; None if absent or unreadable (then the backoff
    alone applies)."""
    if not value:
        return None
    text = value.decode("latin-1").strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:  # asctime's form, or -0000: HTTP-dates are GMT, never the host's zone
            when = when.replace(tzinfo=datetime.UTC)
        seconds = when.timestamp() - (time.time() if now is None else now)
    if math.isnan(seconds):
        return None
    return max(seconds, 0.0)


# An overloaded engine's answer as the client gets it when no retry follows: status, headers, body.
Overloaded = tuple[int, Headers, bytes]


class WorkerFailed(Exception):
    """A worker failed the request while its client had received nothing: it may go again without
    ``worker_id``. ``answer``: an overloaded engine's own 429 or 503 (status, headers, body), the client's
    if no retry follows; ``retry_after``: its Retry-After in seconds."""

    role: ClassVar[str] = "worker"  # how the message names the worker

    def __init__(
        self,
        worker_id: int,
        problem: str,
        answer: Overloaded | None = None,
        retry_after: float | None = None,
        *,
        silent: bool = False,
    ) -> None:
        """``silent``: nothing came from the worker for the read timeout (`WorkerSilent`)."""
        super().__init__(f"{self.role} {worker_id}: {problem}")
        self.worker_id = worker_id
        self.answer = answer
        self.retry_after = retry_after
        self.silent = silent

    @property
    def paced(self) -> bool:
        """The engine paces us, which is no failure of the worker (its breaker is not told): its 429, or a
        503 saying when to come back, later than now (an engine overloaded, not broken). A bare 503, or
        one saying "now" (``Retry-After: 0``, a past date: a broken pod behind an ingress), is a failure:
        it would neither trip the breaker nor leave routing for any time."""
        if self.answer is None:
            return False
        status, retry_after = self.answer[0], self.retry_after
        return status == 429 or (status == 503 and retry_after is not None and retry_after > 0)


class Refused(Exception):
    """An answer that is the client's at once, never retried, while it has had nothing: the proxy's own
    refusal (`error`) or a worker's 4xx passed on. ``outcome``: how the request is counted;
    ``headers``: without content-length (JSON unless they give a content type)."""

    def __init__(self, status: int, body: bytes, outcome: str, headers: Headers) -> None:
        super().__init__(f"HTTP {status} ({outcome})")
        self.status = status
        self.body = body
        self.outcome = outcome
        self.headers = headers

    @classmethod
    def error(cls, status: int, kind: str, message: str, outcome: str, **headers: str) -> Refused:
        """The proxy's own refusal, its body an OpenAI error; ``headers`` by name, ``_`` for ``-``."""
        pairs = [(name.replace("_", "-").encode(), value.encode()) for name, value in headers.items()]
        return cls(status, error_body(status, kind, message), outcome, pairs)


def unanswered(failure: type[WorkerFailed], worker_id: int, exc: UpstreamError) -> WorkerFailed | Refused:
    """What a failure of a worker's answer before the client had a byte of it raises: the worker's
    (``failure``, `WorkerFailed` or a kind of it: tried again), but for an answer over
    ``proxy_max_answer_bytes``, at once the client's 502 (another worker would send as much, and the
    worker is not to blame)."""
    message = f"{failure.role} {worker_id}: {exc}"
    if isinstance(exc, AnswerTooLarge):
        return Refused.error(502, "upstream_error", message, "upstream_error")
    return failure(worker_id, str(exc), silent=isinstance(exc, WorkerSilent))


def overloaded_answer(
    connection: UpstreamConnection, worker_id: int, content: bytes
) -> tuple[Overloaded, float | None]:
    """An overloaded engine's answer (read whole: ``content``) as the client gets it if no retry follows,
    with the worker that gave it and its Retry-After; and that Retry-After in seconds."""
    headers: Headers = [
        (b"content-type", connection.content_type or b"application/json"),
        (b"x-kv-router-worker", str(worker_id).encode()),
    ]
    if connection.retry_after is not None:
        headers.append((b"retry-after", connection.retry_after))
    return (connection.status, headers, content), retry_after_secs(connection.retry_after)

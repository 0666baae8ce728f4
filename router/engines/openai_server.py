"""An engine's OpenAI-compatible HTTP server as the router talks to it: its base URL, models and health.

vLLM and SGLang serve ``/v1/completions``, ``/v1/models`` and ``/v1/chat/completions`` under ``/v1``
and ``/health`` and ``/tokenize`` at the root. Users give either form of the URL; `openai_base` takes
it back to the root once (``http://h:8000/v1/`` -> ``http://h:8000``), and every path is added to the
root from there (the proxy's ``/v1/completions`` and ``/tokenize``, the probes below). The root may
have a path, an ingress's prefix (``http://gw/engine-a``); a path going on past ``/v1`` (an endpoint's,
``/v1/completions``) is refused.

Used by direct mode (`router.engines.direct`) and by the bridge (`router.engines.bridge`) alike:
`served_models` asks ``GET /v1/models`` (`wait_for_models` until the engine answers: it may take a
minute to start), `HealthProbe` asks ``GET /health`` every interval and tells its owner when the
engine stops answering and when it answers again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import msgspec

from router.supervision import Supervisor
from router.types import engine_url_problem

if TYPE_CHECKING:
    import httpx

__all__ = ["ENGINE_FAILURES_TO_DOWN", "HealthProbe", "health_url", "openai_base", "served_models", "wait_for_models"]

log = logging.getLogger(__name__)


def openai_base(url: str) -> str:
    """The server root of an engine's OpenAI URL, with or without ``/v1`` (behind a path prefix or not:
    ``http://gw/engine-a/v1`` -> ``http://gw/engine-a``); raises ``ValueError`` for one that is no
    such URL (`router.types.engine_url_problem`: an endpoint's path, ``/v1/completions``, included)."""
    problem = engine_url_problem(url)
    if problem is not None:
        raise ValueError(f"not an http(s) URL of an engine: {url!r}: {problem}")
    parts = urlsplit(url.strip())
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return f"{parts.scheme}://{parts.netloc}{path}"


def health_url(base: str) -> str:
    """The health probe's URL of the engine whose OpenAI server root is ``base``."""
    return base + "/health"


class _Model(msgspec.Struct):
    id: str


class _Models(msgspec.Struct):
    data: list[_Model]


_decode_models = msgspec.json.Decoder(_Models).decode


async def served_models(client: httpx.AsyncClient, base: str) -> list[str]:
    """The model names the engine at ``base`` serves (``GET /v1/models``); raises ``httpx.HTTPError``
    or ``ValueError`` for an engine that does not answer or answers something else."""
    reply = await client.get(base + "/v1/models")
    reply.raise_for_status()
    try:
        return sorted({model.id for model in _decode_models(reply.content).data})
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"GET {base}/v1/models: {exc}") from None


async def wait_for_models(base: str, *, retry_s: float = 1.0, timeout_s: float = 5.0) -> list[str]:
    """`served_models`, asked again every ``retry_s`` until the engine answers (it may still be loading
    its model); the first failure is logged, then every minute."""
    import httpx

    attempts = 0
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        while True:
            try:
                models = await served_models(client, base)
            except (httpx.HTTPError, ValueError) as exc:
                if attempts % max(1, round(60 / retry_s)) == 0:
                    log.info("engine at %s does not list its models yet (%s); asking again", base, exc)
                attempts += 1
                await asyncio.sleep(retry_s)
                continue
            log.info("engine at %s serves %s", base, ", ".join(models) or "no model")
            return models


# An engine's own probe (direct mode, the bridge): this many slow or failed answers in a row take it out
# of routing (its index is dropped and rebuilt from the replay when it is back); a refused connection
# at once.
ENGINE_FAILURES_TO_DOWN = 3
# Its whole answer's bound. A loaded engine's HTTP server shares its event loop with the streams it
# serves and may answer late; a gone one is caught at once by the refused connection, and a wedged one
# within three probes of this.
ENGINE_HEALTH_TIMEOUT_SECS = 5.0


def _refused(exc: BaseException) -> bool:
    """Whether the connection was refused (nothing listens), as opposed to a name that did not resolve,
    a network out of reach or a TLS failure, which httpx reports as the same `ConnectError`."""
    seen: BaseException | None = exc
    for _ in range(8):  # httpx's error, httpcore's, the OSError under them
        if seen is None:
            return False
        if isinstance(seen, ConnectionRefusedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class HealthProbe:
    """``GET url`` (an engine's ``/health``) every ``interval_s``: ``on_down`` when it stops answering 200 (refused, an
    error status, or no answer within the timeout) ``failures_to_down`` times in a row, or at once when
    its connection is refused with ``down_when_refused`` (nothing listens: the engine is gone, while a
    slow answer may be a busy one); ``on_up`` when it answers again ``successes_to_up`` times in a row
    (and at the first answer). Only transitions are told; the probe's own task is supervised."""

    def __init__(
        self,
        url: str,
        *,
        on_up: Callable[[], Awaitable[None]],
        on_down: Callable[[str], Awaitable[None]],
        interval_s: float = 1.0,
        timeout_s: float | None = None,
        failures_to_down: int = 1,
        successes_to_up: int = 1,
        down_when_refused: bool = False,
    ) -> None:
        self.url = url
        self.failures_to_down = failures_to_down
        self.down_when_refused = down_when_refused
        self.successes_to_up = successes_to_up
        self._passed = self._failed = 0  # probes in a row that passed, that failed
        self.interval_s = interval_s
        self.timeout_s = timeout_s if timeout_s is not None else max(1.0, interval_s)
        self.healthy: bool | None = None  # None: not probed yet
        self.probes = 0
        self.failures = 0
        self.last_problem: str | None = None  # why the last probe failed (None: it passed, or none yet)
        self._on_up = on_up
        self._on_down = on_down
        self._background = Supervisor(f"health-{url}")

    def start(self) -> None:
        self._background.keep_running("probe", self._loop)

    async def stop(self) -> None:
        await self._background.stop()

    async def _loop(self) -> None:
        import httpx

        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            while True:
                await self.probe_once(client)
                await asyncio.sleep(self.interval_s)

    async def probe_once(self, client: httpx.AsyncClient) -> None:
        self.probes += 1
        problem = None
        refused = False
        try:
            # The whole exchange bounded, not each read (httpx's timeout): a head, then a body trickling a
            # byte at a time, would never time out.
            async with asyncio.timeout(self.timeout_s):
                reply = await client.get(self.url)
            if reply.status_code != 200:
                problem = f"HTTP {reply.status_code}"
        except TimeoutError:
            problem = f"no whole answer within {self.timeout_s:g} s"
        except Exception as exc:  # not only httpx's own errors: a probe that cannot ask fails, never crashes
            problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            refused = _refused(exc)
        self.last_problem = problem
        if problem is None:
            self._passed, self._failed = self._passed + 1, 0
            if self.healthy is not True and (self.healthy is None or self._passed >= self.successes_to_up):
                await self._transition(True, self._on_up())
            return
        self.failures += 1
        self._passed, self._failed = 0, self._failed + 1
        down = self._failed >= self.failures_to_down or (refused and self.down_when_refused)
        if self.healthy is not False and down:
            await self._transition(False, self._on_down(problem))

    async def _transition(self, healthy: bool, told: Awaitable[None]) -> None:
        """``healthy`` put back if the callback raises, so the next probe tells the transition again: a
        bridge whose registration failed in a NATS hiccup must not stay withdrawn until its engine
        fails once more."""
        before, self.healthy = self.healthy, healthy
        try:
            await told
        except BaseException:
            self.healthy = before
            raise

"""Whether a worker may be routed to at all: its circuit breaker and its active health check's verdict.

Every decision's candidates pass through `WorkerHealth.usable` (`KvRouter._eligible`), whatever the
policy, whoever asks (the proxy, ``/v1/new``, ``/v1/route``), so a worker taken out of routing here is
out of it for all of them.

The circuit breaker, per worker, fed by the outcomes a caller reports (`failed`, `succeeded`: the
proxy's exchanges with the worker):

* closed: routed to; ``worker_breaker_failures`` failures in a row open it;
* open: left out for ``worker_breaker_open_secs``, then half-open;
* half-open: routed to by at most ``worker_breaker_half_open_probes`` requests at a time (the probes);
  that many successes in a row close it, one failure opens it again. A probe that reports nothing
  within ``worker_breaker_open_secs`` (its caller never reports outcomes) gives its place up (the
  proxy reports a stream's success once it has begun, not at its end). An open circuit whose time is
  up is half-open whether or not a decision has looked at it since: a failure then opens it again, a
  success is a probe's (one of ``worker_breaker_half_open_probes`` to close it).

An engine pacing its callers (a 429, or a 503, saying ``Retry-After``: `paced`) is no failure: its
breaker is not told, but it is left out of routing for the time it asked, at most
``worker_breaker_open_secs`` (the longest a failing worker is left out; no breaker, no pacing either).

The active health check (`set_health`: the service probes each worker's ``/health``) is a verdict of
its own: a worker failing it is left out, whatever its circuit, until it passes again. A worker whose
engine is probed by the source that registers it (direct mode, `set_engine_probed`) is not probed by
the proxy's checks as well: that source removes it when the engine stops answering.

Outcomes and verdicts of a worker no longer registered are ignored: requests still on it when it
was removed end afterwards, and their failures would make a breaker for an id nothing routes to,
which a worker registered again under that id would find open.

Costs: `usable` is one dict lookup per candidate when every circuit is closed and every check passes
(the common case: it returns the list it was given).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from router.config import RouterConfig
from router.types import WorkerAvailability, WorkerConfig

__all__ = ["STATE_VALUES", "CircuitState", "WorkerHealth"]

CircuitState = Literal["closed", "open", "half_open"]
# Gauge values of the states (`kv_router_worker_circuit_state`).
STATE_VALUES: dict[CircuitState, float] = {"closed": 0.0, "half_open": 1.0, "open": 2.0}


class _Breaker:
    __slots__ = ("failures", "last_problem", "opened_at", "opened_times", "probes", "state", "successes")

    def __init__(self) -> None:
        self.state: CircuitState = "closed"
        self.failures = 0  # in a row
        self.successes = 0  # in a row while half-open
        self.opened_at = 0.0
        self.opened_times = 0
        self.probes: list[float] = []  # when each probe in flight was routed (half-open)
        self.last_problem = ""


class WorkerHealth:
    """The circuit breakers and health-check verdicts of the registered workers."""

    def __init__(
        self,
        config: RouterConfig,
        clock: Callable[[], float],
        registered: Callable[[int], bool],
        check_failing: Callable[[int], None] = lambda worker_id: None,
    ) -> None:
        """``registered``: whether a worker id is registered now; ``check_failing``: told of a worker whose
        health check turns failing (it leaves routing, `set_health`)."""
        self._registered = registered
        self._check_failing = check_failing
        self._threshold = config.worker_breaker_failures
        self._open_secs = config.worker_breaker_open_secs
        self._probes = config.worker_breaker_half_open_probes
        self._clock = clock
        self._breakers: dict[int, _Breaker] = {}
        self._failing_checks: set[int] = set()  # workers whose health check fails
        self._checked: set[int] = set()  # workers a health check has judged
        # Workers whose engine the source that registers them probes (kept while they are removed).
        self._engine_probed: set[int] = set()
        # Workers whose engine asked to be left alone (its Retry-After): until when (clock seconds).
        self._paced_until: dict[int, float] = {}
        self._troubled = 0  # breakers not closed, failing checks, paced workers: 0 is the fast path

    def usable(self, workers: list[WorkerConfig]) -> list[WorkerConfig]:
        """The workers that may be routed to now, in their order."""
        if not self._troubled:
            return workers
        return [worker for worker in workers if self._admits(worker.worker_id)]

    def _admits(self, worker_id: int) -> bool:
        if worker_id in self._failing_checks or self._still_paced(worker_id):
            return False
        breaker = self._breakers.get(worker_id)
        if breaker is None or breaker.state == "closed":
            return True
        now = self._clock()
        if breaker.state == "open" and not self._half_open_at(breaker, now):
            return False
        breaker.probes = [at for at in breaker.probes if now - at < self._open_secs]
        return len(breaker.probes) < self._probes

    def _half_open_at(self, breaker: _Breaker, now: float) -> bool:
        """An open circuit whose time is up goes half-open (no probe yet); returns whether it did."""
        if now - breaker.opened_at < self._open_secs:
            return False
        breaker.state, breaker.successes, breaker.probes = "half_open", 0, []
        return True

    def _still_paced(self, worker_id: int) -> bool:
        """Whether the worker's engine asked to be left alone until later than now (its pacing ended: forgotten)."""
        until = self._paced_until.get(worker_id)
        if until is None:
            return False
        if self._clock() < until:
            return True
        del self._paced_until[worker_id]
        self._troubled -= 1
        return False

    def routed(self, worker_id: int) -> None:
        """A request was routed to the worker: while half-open it is one of the probes."""
        if self._troubled:
            breaker = self._breakers.get(worker_id)
            if breaker is not None and breaker.state == "half_open":
                breaker.probes.append(self._clock())

    def failed(self, worker_id: int, problem: str) -> CircuitState | None:
        """The worker failed a request (refused, timed out, 5xx, a broken stream); returns the state its
        circuit moved to, or None if it stayed as it was."""
        if self._threshold == 0 or not self._registered(worker_id):
            return None
        breaker = self._breakers.get(worker_id)
        if breaker is None:
            breaker = self._breakers[worker_id] = _Breaker()
        breaker.last_problem = problem
        breaker.failures += 1
        if breaker.state == "open":
            # Its time up, no decision has looked at it since: half-open, so this failure opens it again.
            self._half_open_at(breaker, self._clock())
        if breaker.state == "half_open" or (breaker.state == "closed" and breaker.failures >= self._threshold):
            if breaker.state == "closed":
                self._troubled += 1
            breaker.state, breaker.opened_at, breaker.probes = "open", self._clock(), []
            breaker.opened_times += 1
            return "open"
        return None

    def succeeded(self, worker_id: int) -> CircuitState | None:
        """The worker answered a request; returns ``"closed"`` if that closed its circuit."""
        breaker = self._breakers.get(worker_id)
        if breaker is None:
            return None
        breaker.failures = 0
        if breaker.state == "open":
            # Its time up, no decision has looked at it since: half-open, so this success is a probe's, as
            # `failed` reads a failure then (a success while its time runs leaves it open).
            self._half_open_at(breaker, self._clock())
        if breaker.state == "half_open":
            if breaker.probes:
                breaker.probes.pop(0)
            breaker.successes += 1
            if breaker.successes >= self._probes:
                breaker.state = "closed"
                self._troubled -= 1
                return "closed"
        return None

    def paced(self, worker_id: int, secs: float) -> None:
        """The worker's engine asked to be left alone for ``secs`` (a 429 or 503 with ``Retry-After``): out of
        routing that long, at most ``worker_breaker_open_secs`` (its last word counts)."""
        if self._threshold == 0 or not self._registered(worker_id) or min(secs, self._open_secs) <= 0:
            return
        if worker_id not in self._paced_until:
            self._troubled += 1
        self._paced_until[worker_id] = self._clock() + min(secs, self._open_secs)

    def _paced_for(self, worker_id: int, now: float) -> float | None:
        """Seconds the worker's engine is still to be left alone (None: it is not paced)."""
        until = self._paced_until.get(worker_id)
        return until - now if until is not None and until > now else None

    def set_health(self, worker_id: int, passing: bool) -> bool:
        """The active health check's verdict on the worker; returns whether it changed."""
        if not self._registered(worker_id):  # a probe's last answer, come after the worker left
            return False
        known = worker_id in self._checked
        self._checked.add(worker_id)
        failing = worker_id in self._failing_checks
        if passing and failing:
            self._failing_checks.discard(worker_id)
            self._troubled -= 1
            return True
        if not passing and not failing:
            self._failing_checks.add(worker_id)
            self._troubled += 1
            self._check_failing(worker_id)
            return True
        return not known

    def unchecked(self, worker_id: int) -> None:
        """No health check judges the worker any more (its registration is no longer probed): its last
        verdict goes, a failing one with it."""
        if worker_id in self._failing_checks:
            self._failing_checks.discard(worker_id)
            self._troubled -= 1
        self._checked.discard(worker_id)

    def failing_checks(self, worker_id: int) -> bool:
        """Whether the worker's last health-check verdict is failing."""
        return worker_id in self._failing_checks

    def set_engine_probed(self, worker_id: int, probed: bool) -> None:
        """Whether the source that registers the worker probes its engine's ``/health`` itself (direct
        mode with a URL), so that no other check probes it too."""
        if probed:
            self._engine_probed.add(worker_id)
        else:
            self._engine_probed.discard(worker_id)

    def engine_probed(self, worker_id: int) -> bool:
        return worker_id in self._engine_probed

    def forget(self, worker_id: int) -> None:
        """The worker left: a worker registered again under its id starts afresh."""
        breaker = self._breakers.pop(worker_id, None)
        if breaker is not None and breaker.state != "closed":
            self._troubled -= 1
        if self._paced_until.pop(worker_id, None) is not None:
            self._troubled -= 1
        self.unchecked(worker_id)

    def reopens_in(self, worker_ids: list[int]) -> float | None:
        """Seconds until the first of these workers may be routed to again: an open circuit's time left,
        a paced engine's, 0 for a half-open circuit whose probe places are taken (a probe's answer may
        free one any moment). None: none is out for a time that can be told (one fails its health check)."""
        if any(worker_id in self._failing_checks for worker_id in worker_ids):
            return None
        now = self._clock()
        waits = []
        for worker_id in worker_ids:
            breaker = self._breakers.get(worker_id)
            circuit = None
            if breaker is not None and breaker.state == "open":
                circuit = max(0.0, breaker.opened_at + self._open_secs - now)
            elif breaker is not None and breaker.state == "half_open":
                circuit = 0.0
            paced = self._paced_for(worker_id, now)
            if circuit is not None or paced is not None:
                waits.append(max(circuit or 0.0, paced or 0.0))
        return min(waits) if waits else None

    def state(self, worker_id: int) -> CircuitState:
        """The worker's circuit now (an open one whose time is up reads half-open)."""
        breaker = self._breakers.get(worker_id)
        if breaker is None:
            return "closed"
        if breaker.state == "open" and self._clock() - breaker.opened_at >= self._open_secs:
            return "half_open"
        return breaker.state

    def availability(self, worker_id: int) -> WorkerAvailability:
        """What ``/v1/workers`` shows of it."""
        breaker = self._breakers.get(worker_id)
        state = self.state(worker_id)
        check: Literal["unknown", "passing", "failing"] = "unknown"
        if worker_id in self._checked:
            check = "failing" if worker_id in self._failing_checks else "passing"
        now = self._clock()
        reopens = None
        if breaker is not None and state == "open":
            reopens = max(0.0, breaker.opened_at + self._open_secs - now)
        paced_for = self._paced_for(worker_id, now)
        return WorkerAvailability(
            routable=state != "open" and check != "failing" and paced_for is None,
            circuit=state,
            consecutive_failures=breaker.failures if breaker is not None else 0,
            circuit_opened=breaker.opened_times if breaker is not None else 0,
            half_open_in_secs=reopens,
            last_failure=breaker.last_problem if breaker is not None and breaker.last_problem else None,
            health_check=check,
            paced_for_secs=paced_for,
        )

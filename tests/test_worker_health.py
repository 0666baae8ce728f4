"""The circuit breaker per worker and the health-check verdicts (`router.worker_health`), and that every
decision of `KvRouter` (every policy, the decision API as well as the proxy) leaves out the workers
they take out of routing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.config import RouterConfig
from router.errors import NoEligibleWorker, WorkersUnavailable
from router.kv_router import KvRouter
from router.policies import policy_names
from router.types import RouteRequest, WorkerConfig
from router.worker_health import WorkerHealth


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def health(failures: int = 3, open_secs: float = 10.0, probes: int = 1) -> tuple[WorkerHealth, Clock]:
    clock = Clock()
    config = RouterConfig(
        worker_breaker_failures=failures, worker_breaker_open_secs=open_secs, worker_breaker_half_open_probes=probes
    )
    return WorkerHealth(config, clock, lambda worker_id: True), clock


WORKERS = [WorkerConfig(worker_id=i) for i in (1, 2, 3)]


def ids(workers: list[WorkerConfig]) -> list[int]:
    return [worker.worker_id for worker in workers]


def test_failures_in_a_row_open_the_circuit_and_a_success_between_them_starts_the_count_again() -> None:
    h, _ = health(failures=3)
    assert h.usable(WORKERS) is WORKERS  # nothing troubled: the list as given
    h.failed(2, "refused")
    h.failed(2, "refused")
    h.succeeded(2)
    h.failed(2, "refused")
    h.failed(2, "refused")
    assert h.state(2) == "closed" and ids(h.usable(WORKERS)) == [1, 2, 3]
    assert h.failed(2, "HTTP 500") == "open"
    assert h.state(2) == "open" and ids(h.usable(WORKERS)) == [1, 3]
    shown = h.availability(2)
    assert (shown.routable, shown.circuit, shown.consecutive_failures, shown.circuit_opened) == (False, "open", 3, 1)
    assert shown.last_failure == "HTTP 500" and shown.half_open_in_secs == 10.0


def test_an_open_circuit_goes_half_open_lets_its_probes_through_and_closes_on_their_success() -> None:
    h, clock = health(failures=1, open_secs=5.0, probes=2)
    h.failed(1, "refused")
    clock.now += 4.9
    assert ids(h.usable(WORKERS)) == [2, 3]
    clock.now += 0.1
    assert h.state(1) == "half_open" and ids(h.usable(WORKERS)) == [1, 2, 3]
    h.routed(1)
    h.routed(1)
    assert ids(h.usable(WORKERS)) == [2, 3]  # both probes in flight: no third
    assert h.succeeded(1) is None  # one of two
    assert ids(h.usable(WORKERS)) == [1, 2, 3]  # its place is free again
    h.routed(1)
    assert h.succeeded(1) == "closed"
    assert h.state(1) == "closed" and h.usable(WORKERS) is WORKERS


def test_a_failed_probe_opens_the_circuit_again_and_a_lost_probe_gives_its_place_up() -> None:
    h, clock = health(failures=1, open_secs=5.0)
    h.failed(1, "refused")
    clock.now += 5.0
    assert ids(h.usable(WORKERS)) == [1, 2, 3]
    h.routed(1)
    assert h.failed(1, "refused") == "open"
    assert h.availability(1).circuit_opened == 2
    clock.now += 5.0
    assert ids(h.usable(WORKERS)) == [1, 2, 3]
    h.routed(1)  # a probe whose outcome never comes (its caller does not report outcomes)
    assert ids(h.usable(WORKERS)) == [2, 3]
    clock.now += 5.0
    assert ids(h.usable(WORKERS)) == [1, 2, 3]


def test_a_failure_once_an_open_circuits_time_is_up_opens_it_again_though_no_decision_half_opened_it() -> None:
    """A request routed before the circuit opened fails after its open time: the circuit is half-open
    (no decision looked at it since, to move it); the failure opens it for another open time. Before,
    it only counted the failure, and the worker was let through again at once."""
    h, clock = health(failures=1, open_secs=5.0)
    h.failed(1, "refused")
    clock.now += 6.0
    assert h.failed(1, "the stream broke") == "open"
    assert ids(h.usable(WORKERS)) == [2, 3]
    shown = h.availability(1)
    assert (shown.circuit, shown.circuit_opened, shown.half_open_in_secs) == ("open", 2, 5.0)
    clock.now += 2.0
    assert h.failed(1, "refused") is None  # still within its open time: counted only
    assert h.availability(1).half_open_in_secs == 3.0


def test_an_engine_pacing_us_keeps_its_worker_out_for_its_retry_after_at_most_the_open_time() -> None:
    h, clock = health(failures=1, open_secs=10.0)
    h.paced(2, 3.0)
    assert ids(h.usable(WORKERS)) == [1, 3] and h.state(2) == "closed"
    shown = h.availability(2)
    assert (shown.routable, shown.paced_for_secs, shown.consecutive_failures) == (False, 3.0, 0)
    assert h.reopens_in([2]) == 3.0
    clock.now += 3.0
    assert ids(h.usable(WORKERS)) == [1, 2, 3]
    assert h.usable(WORKERS) is WORKERS  # its pacing over and forgotten: the fast path again
    assert h.availability(2).routable and h.availability(2).paced_for_secs is None
    h.paced(2, 3600.0)  # an engine asking for an hour is left out no longer than a failing one
    assert h.availability(2).paced_for_secs == 10.0
    h.paced(2, 1.0)  # its last word counts
    assert h.reopens_in([2]) == 1.0
    h.forget(2)
    assert h.usable(WORKERS) is WORKERS
    h.paced(3, 0.0)
    assert h.usable(WORKERS) is WORKERS
    off, _ = health(failures=0)  # no breaker: nothing moves routing but the health checks
    off.paced(1, 5.0)
    assert off.usable(WORKERS) is WORKERS


def test_a_half_open_circuit_whose_probe_places_are_taken_may_be_asked_again_at_once() -> None:
    """Its probe's answer may free the place any moment: the wait is 0 (the proxy's 503 says
    Retry-After: 1), not unknown (it said none)."""
    h, clock = health(failures=1, open_secs=5.0)
    h.failed(1, "refused")
    h.failed(2, "refused")
    clock.now += 5.0
    assert ids(h.usable(WORKERS)) == [1, 2, 3]
    h.routed(1)
    h.routed(2)
    assert h.reopens_in([1, 2]) == 0.0
    h.paced(1, 2.0)
    assert h.reopens_in([1]) == 2.0


def test_a_failing_health_check_takes_a_worker_out_whatever_its_circuit_and_passing_brings_it_back() -> None:
    h, _ = health()
    assert h.availability(3).health_check == "unknown"
    assert h.set_health(3, False)
    assert ids(h.usable(WORKERS)) == [1, 2] and h.availability(3).health_check == "failing"
    assert not h.set_health(3, False)
    assert h.set_health(3, True)
    assert h.usable(WORKERS) is WORKERS and h.availability(3).health_check == "passing"


def test_no_breaker_with_zero_failures_and_a_worker_registered_again_starts_afresh() -> None:
    off, _ = health(failures=0)
    for _ in range(10):
        off.failed(1, "refused")
    assert off.state(1) == "closed"
    h, _ = health(failures=1)
    h.failed(1, "refused")
    h.set_health(2, False)
    h.forget(1)
    h.forget(2)
    assert h.usable(WORKERS) is WORKERS and h.availability(1).circuit_opened == 0


def test_outcomes_and_verdicts_of_a_worker_no_longer_registered_are_ignored() -> None:
    """Requests and probes still on a worker when it left end afterwards: nothing is kept for its id."""
    registered = {1, 2}
    h = WorkerHealth(RouterConfig(worker_breaker_failures=1), Clock(), registered.__contains__)
    assert h.failed(3, "the worker closed the connection mid-answer") is None
    assert not h.set_health(3, False)
    registered.add(3)  # registered again under that id: in routing, nothing held against it
    assert h.usable(WORKERS) is WORKERS
    shown = h.availability(3)
    assert (shown.circuit, shown.circuit_opened, shown.health_check) == ("closed", 0, "unknown")


@given(
    st.lists(
        st.tuples(st.sampled_from(["fail", "ok", "route", "tick", "check_ok", "check_bad", "pace"]), st.integers(1, 3))
    )
)
def test_usable_is_exactly_the_workers_whose_availability_says_routable(steps: list[tuple[str, int]]) -> None:
    h, clock = health(failures=2, open_secs=3.0)
    for action, worker_id in steps:
        if action == "fail":
            h.failed(worker_id, "x")
        elif action == "ok":
            h.succeeded(worker_id)
        elif action == "route" and worker_id in ids(h.usable(WORKERS)):
            h.routed(worker_id)
        elif action == "tick":
            clock.now += 1.0
        elif action.startswith("check"):
            h.set_health(worker_id, action == "check_ok")
        elif action == "pace":
            h.paced(worker_id, 1.5)
        usable = set(ids(h.usable(WORKERS)))
        for worker in WORKERS:
            availability = h.availability(worker.worker_id)
            if availability.circuit != "half_open":  # half-open: routable while a probe's place is free
                assert (worker.worker_id in usable) == availability.routable


@pytest.mark.anyio
@pytest.mark.parametrize("policy", sorted(policy_names()))
async def test_every_policy_leaves_out_a_worker_whose_circuit_is_open(policy: str) -> None:
    router = KvRouter(RouterConfig(policy=policy, worker_breaker_failures=1, block_size=4))
    for worker_id in (1, 2):
        router.register_worker(WorkerConfig(worker_id=worker_id, block_size=4))
    router.health.failed(1, "refused")
    for n in range(6):
        decision = await router.new(RouteRequest(tokens=list(range(n, n + 16)), request_id=f"r{n}"))
        assert decision.worker_id == 2
    router.health.failed(2, "refused")
    with pytest.raises(WorkersUnavailable, match=r"workers \[1, 2\] are out of routing") as caught:
        await router.new(RouteRequest(tokens=[1, 2, 3, 4], request_id="none"))
    assert isinstance(caught.value, NoEligibleWorker)
    assert caught.value.retry_after_secs is not None and 0 < caught.value.retry_after_secs <= 10.0


@pytest.mark.anyio
async def test_a_decision_only_asked_for_takes_no_probe_place_of_a_half_open_worker() -> None:
    # Dynamo's query_instance_id and /v1/route without an id: nothing is sent, no answer will come back.
    clock = Clock()
    config = RouterConfig(worker_breaker_failures=1, worker_breaker_open_secs=5.0, block_size=4)
    router = KvRouter(config, clock=clock)
    router.register_worker(WorkerConfig(worker_id=1, block_size=4))
    router.health.failed(1, "refused")
    clock.now += 5.0
    assert router.health.state(1) == "half_open"
    for n in range(3):
        assert (await router.new(RouteRequest(tokens=list(range(n, n + 8))))).worker_id == 1
    booked = await router.new(RouteRequest(tokens=[9] * 8, request_id="probe"))
    assert booked.worker_id == 1  # the one probe place was still free
    with pytest.raises(WorkersUnavailable):
        await router.new(RouteRequest(tokens=[8] * 8, request_id="second"))


def test_the_wait_until_a_probe_is_the_first_open_circuits_and_unknown_while_a_check_fails() -> None:
    h, clock = health(failures=1, open_secs=10.0)
    assert h.reopens_in([1, 2]) is None
    h.failed(1, "refused")
    clock.now += 4.0
    h.failed(2, "refused")
    assert h.reopens_in([1, 2]) == 6.0 and h.reopens_in([2]) == 10.0
    h.set_health(2, False)
    assert h.reopens_in([1, 2]) is None

"""Background work is never silently dead: crashes are logged and loops restarted."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import pytest

from router.supervision import ServiceFault, Supervisor, raise_if_cancelling, unwind

pytestmark = pytest.mark.anyio


async def test_a_crashing_loop_is_logged_and_restarted(caplog: pytest.LogCaptureFixture) -> None:
    runs = 0
    healthy = asyncio.Event()

    async def flaky() -> None:
        nonlocal runs
        runs += 1
        if runs < 3:
            raise RuntimeError(f"boom {runs}")
        healthy.set()
        await asyncio.Event().wait()

    supervisor = Supervisor("test", first_backoff_s=0.01)
    with caplog.at_level(logging.ERROR, logger="router.supervision"):
        supervisor.keep_running("flaky", flaky)
        await asyncio.wait_for(healthy.wait(), timeout=5)
    assert supervisor.restarts["flaky"] == 2
    crashes = [r for r in caplog.records if "flaky crashed" in r.getMessage()]
    assert len(crashes) == 2 and all(r.exc_info for r in crashes)
    assert supervisor.running == 1
    await supervisor.stop()
    assert supervisor.running == 0


async def test_a_service_fault_is_one_log_line_a_retry_without_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """A fault of the surroundings whose message says what to do (no JetStream on the NATS server) is
    retried as any crash, each attempt one line: a traceback every few seconds would bury it."""
    runs = 0
    healthy = asyncio.Event()

    async def waits_for_jetstream() -> None:
        nonlocal runs
        runs += 1
        if runs < 3:
            raise ServiceFault("JetStream did not answer: start nats-server with -js")
        healthy.set()
        await asyncio.Event().wait()

    supervisor = Supervisor("test", first_backoff_s=0.01)
    with caplog.at_level(logging.ERROR, logger="router.supervision"):
        supervisor.keep_running("plane", waits_for_jetstream)
        await asyncio.wait_for(healthy.wait(), timeout=5)
    assert supervisor.restarts["plane"] == 2
    said = [r.getMessage() for r in caplog.records]
    line = "test: plane failed: JetStream did not answer: start nats-server with -js; retrying in 0.0 s"
    assert said == [line, line]
    assert not any(r.exc_info for r in caplog.records)
    await supervisor.stop()


async def test_cancel_ends_one_loop_for_good_and_leaves_the_others_running() -> None:
    async def forever() -> None:
        await asyncio.Event().wait()

    supervisor = Supervisor("test")
    one = supervisor.keep_running("one", forever)
    supervisor.keep_running("other", forever)
    await asyncio.sleep(0)
    await supervisor.cancel(one)
    assert one.cancelled() and supervisor.running == 1 and not supervisor.restarts
    await supervisor.stop()
    assert supervisor.running == 0


async def test_a_failed_one_shot_task_is_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    async def fails() -> None:
        raise ValueError("bad answer")

    supervisor = Supervisor("test")
    with caplog.at_level(logging.ERROR, logger="router.supervision"):
        task = supervisor.spawn("resync-1-0", fails())
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)
    assert supervisor.failures["resync-1-0"] == 1
    assert any("resync-1-0 failed" in r.getMessage() and r.exc_info for r in caplog.records)
    await supervisor.stop()


async def test_a_loop_that_returns_is_restarted_too() -> None:
    runs = 0
    again = asyncio.Event()

    async def returns() -> None:
        nonlocal runs
        runs += 1
        if runs == 2:
            again.set()

    supervisor = Supervisor("test", first_backoff_s=0.01)
    supervisor.keep_running("returns", returns)
    await asyncio.wait_for(again.wait(), timeout=5)
    assert supervisor.restarts["returns"] >= 1
    await supervisor.stop()


async def test_stop_does_not_hang_on_a_task_that_ignores_cancellation(caplog: pytest.LogCaptureFixture) -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue  # swallowed, as a buggy library might

    supervisor = Supervisor("test", stop_timeout_s=0.2)
    supervisor.spawn("stubborn", stubborn())
    await asyncio.sleep(0)
    with caplog.at_level(logging.ERROR, logger="router.supervision"):
        await asyncio.wait_for(supervisor.stop(), timeout=5)
    assert any("ignored cancellation" in r.getMessage() and "test:stubborn" in r.getMessage() for r in caplog.records)
    release.set()
    for task in asyncio.all_tasks():
        if task.get_name() == "test:stubborn":
            task.cancel()
            await asyncio.wait([task], timeout=1)


async def _answered_as_stopped(supervisor: Supervisor, answers: asyncio.Queue[asyncio.Future[int]]) -> None:
    """The loop's pending answer arrives in the same turn of the event loop as `stop`'s cancellation:
    Python 3.11's ``asyncio.wait_for`` then returns the answer and the cancellation is lost (nats-py's
    requests, key-value calls and ``next_msg`` are built on it)."""
    answer = await answers.get()
    answer.set_result(1)
    await supervisor.stop()  # cancels before its first await: in this same turn


def _asks(
    answers: asyncio.Queue[asyncio.Future[int]], rounds: list[int], check: bool = False
) -> Callable[[], Awaitable[None]]:
    async def loop() -> None:
        while True:
            answer: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            await answers.put(answer)
            rounds.append(await asyncio.wait_for(answer, timeout=3600))
            if check:
                raise_if_cancelling()

    return loop


async def test_a_loop_whose_cancellation_wait_for_swallowed_is_cancelled_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answers: asyncio.Queue[asyncio.Future[int]] = asyncio.Queue()
    rounds: list[int] = []
    supervisor = Supervisor("test", stop_timeout_s=3)
    supervisor.keep_running("asks", _asks(answers, rounds))
    with caplog.at_level(logging.ERROR, logger="router.supervision"):
        await _answered_as_stopped(supervisor, answers)
    assert supervisor.running == 0
    assert [r.getMessage() for r in caplog.records] == []
    assert rounds == [1]  # the answer the lost cancellation let through; its next ask was cancelled


async def test_raise_if_cancelling_ends_a_loop_at_the_round_its_cancellation_was_lost_in() -> None:
    answers: asyncio.Queue[asyncio.Future[int]] = asyncio.Queue()
    rounds: list[int] = []
    supervisor = Supervisor("test", stop_timeout_s=3)
    supervisor.keep_running("asks", _asks(answers, rounds, check=True))
    await _answered_as_stopped(supervisor, answers)
    assert supervisor.running == 0 and rounds == [1]
    assert answers.empty()  # no further round was begun


async def test_a_loop_that_returns_after_its_cancellation_was_lost_is_not_restarted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answers: asyncio.Queue[asyncio.Future[int]] = asyncio.Queue()
    rounds: list[int] = []

    async def one_round() -> None:  # returns once answered; its supervisor would start it again
        answer: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        await answers.put(answer)
        rounds.append(await asyncio.wait_for(answer, timeout=3600))

    supervisor = Supervisor("test", first_backoff_s=0.0, stop_timeout_s=3)
    supervisor.keep_running("one-round", one_round)
    with caplog.at_level(logging.ERROR, logger="router.supervision"):
        await _answered_as_stopped(supervisor, answers)
    assert supervisor.running == 0 and supervisor.restarts["one-round"] == 0
    assert [r.getMessage() for r in caplog.records] == []


@pytest.mark.parametrize("guarded", [True, False])
async def test_a_clean_up_under_unwind_is_not_cut_by_stops_second_cancellation(guarded: bool) -> None:
    """A loop cancelled while it starts undoes its half-made start (awaiting the server); `stop` asks
    again after half a second. Under `unwind` the clean-up finishes; bare, it is cut where it waits."""
    steps: list[str] = []
    begun = asyncio.Event()

    async def undo() -> None:
        for step in ("replicas", "durable", "plane"):
            await asyncio.sleep(0.3)  # each a NATS round trip on a slow server
            steps.append(step)

    async def starts() -> None:
        try:
            begun.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await (unwind(undo()) if guarded else undo())
            raise

    supervisor = Supervisor("test", stop_timeout_s=3)
    supervisor.keep_running("starts", starts)
    await begun.wait()
    await supervisor.stop()
    assert supervisor.running == 0
    assert steps == (["replicas", "durable", "plane"] if guarded else ["replicas"])


async def test_unwind_delivers_a_cancellation_that_lands_as_its_clean_up_ends(caplog: pytest.LogCaptureFixture) -> None:
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def clean_up() -> None:
        await done

    task = asyncio.ensure_future(unwind(clean_up()))
    for _ in range(3):
        await asyncio.sleep(0)  # the clean-up is waiting
    done.set_result(None)
    task.cancel()  # in the same turn as the clean-up's end
    with pytest.raises(asyncio.CancelledError):
        await task

    async def failing() -> None:
        await asyncio.sleep(0.05)
        raise RuntimeError("durable.stop failed")

    task = asyncio.ensure_future(unwind(failing()))
    await asyncio.sleep(0)
    task.cancel()
    with caplog.at_level(logging.ERROR, logger="router.supervision"), pytest.raises(asyncio.CancelledError):
        await task  # the cancellation still delivered; the clean-up's failure logged, not lost
    assert [(r.getMessage(), str(r.exc_info[1]) if r.exc_info else "") for r in caplog.records] == [
        ("a clean-up failed while its task was being cancelled", "durable.stop failed")
    ]

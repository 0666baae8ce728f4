"""`api.eager`: a coroutine run on the caller's stack until it first waits, then finished by asyncio
with the usual semantics (wake-up by its future, cancellation delivered at its ``await``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from api.eager import Suspended, start, within


async def _add(a: int, b: int) -> int:
    return a + b


async def _fails() -> None:
    raise KeyError("boom")


def test_a_coroutine_that_never_waits_runs_to_its_result_without_a_loop() -> None:
    assert start(_add(2, 3)) == 5
    with pytest.raises(KeyError, match="boom"):
        start(_fails())


def test_a_suspended_coroutine_continues_when_its_future_is_done() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        gate: asyncio.Future[int] = loop.create_future()
        steps: list[str] = []

        async def waits() -> int:
            steps.append("before")
            value = await gate
            steps.append("after")
            await asyncio.sleep(0)  # a bare yield, then another future
            return value + await asyncio.sleep(0.001, result=1)  # a timer's future: what is tested

        outcome = start(waits())
        assert isinstance(outcome, Suspended) and steps == ["before"]
        task = outcome.task(loop)
        for _ in range(5):  # turns of the loop in which it could wrongly finish
            await asyncio.sleep(0)
        assert not task.done()
        gate.set_result(41)
        assert await task == 42
        assert steps == ["before", "after"]

        # Awaited directly by the current task rather than in one of its own.
        gate2: asyncio.Future[str] = loop.create_future()

        async def echo() -> str:
            return await gate2

        direct = start(echo())
        assert isinstance(direct, Suspended)
        loop.call_soon(gate2.set_result, "ok")
        assert await direct == "ok"

    asyncio.run(scenario())


def test_an_exception_set_on_its_future_is_raised_at_its_await() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        gate: asyncio.Future[int] = loop.create_future()

        async def waits() -> str:
            try:
                await gate
            except ValueError as exc:
                return f"caught {exc}"
            return "no"

        outcome = start(waits())
        assert isinstance(outcome, Suspended)
        task = outcome.task(loop)
        gate.set_exception(ValueError("bad"))
        assert await task == "caught bad"

    asyncio.run(scenario())


@pytest.mark.parametrize("before_first_step", [True, False], ids=["before_first_step", "while_waiting"])
def test_cancelling_its_task_delivers_the_cancellation_at_its_await(before_first_step: bool) -> None:
    """Its clean-up runs in both cases, also when the task is cancelled before it ever ran."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        gate: asyncio.Future[None] = loop.create_future()
        seen: list[Any] = []

        async def waits() -> None:
            try:
                await gate
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise

        outcome = start(waits())
        assert isinstance(outcome, Suspended)
        task = outcome.task(loop)
        if not before_first_step:
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seen == ["cancelled"]

    asyncio.run(scenario())


def test_within_is_a_deadline_that_leaves_the_callers_own_cancellation_alone() -> None:
    """`within`, the deadline of a coroutine `start` runs: its work's result; at the deadline a
    `TimeoutError`, the work cancelled and finished first; the caller cancelled as the deadline
    passes, a cancellation (not a timeout, which the caller might take for a slow peer and go on)."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        cleaned: list[str] = []
        callers: list[asyncio.Task[None]] = []

        async def hangs(cancel_the_caller: bool = False) -> None:
            try:
                await loop.create_future()  # never done
            finally:
                cleaned.append("work")
                if cancel_the_caller:
                    callers[0].cancel()

        assert await within(1, asyncio.sleep(0, result="done")) == "done"
        timed = start(within(0.05, hangs()))
        assert isinstance(timed, Suspended)
        with pytest.raises(TimeoutError):
            await timed.task(loop)
        assert cleaned == ["work"]

        cancelled = start(within(0.05, hangs(cancel_the_caller=True)))
        assert isinstance(cancelled, Suspended)
        callers.append(cancelled.task(loop))
        with pytest.raises(asyncio.CancelledError):
            await callers[0]
        assert cleaned == ["work", "work"]

    asyncio.run(scenario())


def test_within_cancelled_before_its_task_first_runs_cancels_its_work() -> None:
    """A request cancelled before its task ever ran has the cancellation thrown in at `within`'s
    await with no task driving it: the work `within` started (a worker connection being opened)
    is cancelled too, and its clean-up runs, rather than finishing for nobody."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        cleaned: list[str] = []

        async def hangs() -> None:
            try:
                await loop.create_future()  # never done
            finally:
                cleaned.append("work")

        outcome = start(within(5, hangs()))
        assert isinstance(outcome, Suspended)
        task = outcome.task(loop)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)  # the work's cancellation is delivered at its next step
        assert cleaned == ["work"]

    asyncio.run(scenario())

"""rollsafe.concurrency: a call on a daemon thread, a deadline, and clean-up when it ends late."""

from __future__ import annotations

import threading

import pytest

from rollsafe.concurrency import DaemonCall, DeadlineExceeded, Outcome, run_with_deadline
from rollsafe.errors import RollsafeError


def test_a_call_within_its_deadline_returns_its_value_or_its_error() -> None:
    assert run_with_deadline(lambda: 7, 5.0, name="quick") == 7

    def boom() -> int:
        raise KeyError("x")

    with pytest.raises(KeyError):
        run_with_deadline(boom, 5.0, name="boom")


def test_a_late_call_is_abandoned_and_its_outcome_cleaned_up_on_its_thread() -> None:
    release = threading.Event()
    late: list[tuple[Outcome[str], str]] = []
    cleaned = threading.Event()

    def slow() -> str:
        release.wait(10)
        return "group"

    def on_late(outcome: Outcome[str]) -> None:
        late.append((outcome, threading.current_thread().name))
        cleaned.set()

    with pytest.raises(DeadlineExceeded) as info:
        run_with_deadline(slow, 0.05, name="slow-join", on_late=on_late)
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, RollsafeError)
    assert not late
    release.set()
    assert cleaned.wait(5)
    ((outcome, thread),) = late
    assert outcome.ok and outcome.value == "group" and thread == "slow-join"


def test_abandon_after_the_call_finished_leaves_the_outcome_to_the_caller() -> None:
    late: list[Outcome[int]] = []
    call = DaemonCall.start(lambda: 1, name="done", on_late=late.append)
    assert call.wait(5)
    assert call.abandon() is False
    assert call.outcome().value == 1 and not late and call.future.result() == 1


def test_on_abandon_runs_before_the_late_hook() -> None:
    release = threading.Event()
    order: list[str] = []
    finished = threading.Event()

    def hook(_: Outcome[None]) -> None:
        order.append("late")
        finished.set()

    call: DaemonCall[None] = DaemonCall.start(
        lambda: release.wait(10) and None, name="ordered", on_late=hook
    )
    assert not call.wait(0.01)
    assert call.abandon(lambda: (release.set(), order.append("abandon")))
    assert finished.wait(5)
    assert order == ["abandon", "late"] and call.abandoned
    assert call.thread.daemon


def test_cancelling_the_future_of_a_running_call_changes_nothing() -> None:
    """``asyncio.wrap_future`` cancels the wrapped future when its task is cancelled (a health
    round's timeout): the call keeps running and still reports its outcome."""
    import asyncio

    release = threading.Event()
    call = DaemonCall.start(lambda: release.wait(10) and "late", name="probe")

    async def give_up() -> None:
        task = asyncio.ensure_future(asyncio.wrap_future(call.future))
        await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(give_up())
    assert not call.future.cancelled()
    release.set()
    assert call.wait(5) and call.result() == "late" and call.future.result() == "late"

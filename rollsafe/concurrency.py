"""Run a blocking call on a daemon thread with a deadline, and clean up when it ends late.

Owns :class:`DaemonCall`, the one pattern every deadline site of rollsafe shares: a call that
may hang (a store connect, a collective, an engine restart, a probe of a hung engine) runs on a
thread of its own that never blocks interpreter exit; the caller waits at most its deadline; if
it gives up (:meth:`DaemonCall.abandon`) the call keeps running, and whatever it produces late
is handed to ``on_late`` on that thread (close the group it opened, free the engine it marked
busy), exactly once, never racing the caller. Imports only the standard library.

::

    call = DaemonCall.start(open_group, name="join-g1", on_late=lambda o: o.ok and o.value.close())
    if not call.wait(deadline_s):
        call.abandon()            # the late group is closed on the joining thread
        raise DeadlineExceeded("join-g1", deadline_s)
    group = call.result()         # re-raises the call's own error
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from rollsafe.errors import RollsafeError

__all__ = ["DaemonCall", "DeadlineExceeded", "Outcome", "run_with_deadline", "start_daemon"]

T = TypeVar("T")


class DeadlineExceeded(RollsafeError, TimeoutError):
    """A call did not finish within its deadline (it may still be running, abandoned)."""

    def __init__(self, what: str, seconds: float) -> None:
        self.what = what
        self.seconds = seconds
        super().__init__(f"{what}: not done within {seconds:g}s")


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """How a call ended: its ``value``, or the ``error`` it raised."""

    value: T | None = None
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def start_daemon(fn: Callable[[], Any], *, name: str) -> threading.Thread:
    """Start ``fn`` on a new daemon thread named ``name`` (fire and forget); return the thread."""
    thread = threading.Thread(target=fn, name=name, daemon=True)
    thread.start()
    return thread


class DaemonCall(Generic[T]):
    """One call of ``fn`` on its own daemon thread (build it with :meth:`start`).

    ``finished`` is set when the call returned or raised; :attr:`future` completes at the same
    time (for ``asyncio.wrap_future`` or ``add_done_callback``; it is running from the start, so
    it cannot be cancelled). ``on_late(outcome)`` runs on the
    call's thread only if the call finished after :meth:`abandon` returned True.
    """

    def __init__(
        self,
        fn: Callable[[], T],
        *,
        name: str,
        on_late: Callable[[Outcome[T]], None] | None = None,
    ) -> None:
        self.name = name
        self.finished = threading.Event()
        self.future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._fn = fn
        self._on_late = on_late
        self._outcome: Outcome[T] | None = None
        self._handover = threading.Lock()
        self._abandoned = False
        self._thread = threading.Thread(target=self._body, name=name, daemon=True)

    @classmethod
    def start(
        cls,
        fn: Callable[[], T],
        *,
        name: str,
        on_late: Callable[[Outcome[T]], None] | None = None,
    ) -> DaemonCall[T]:
        """Start ``fn()`` on a new daemon thread named ``name``."""
        call = cls(fn, name=name, on_late=on_late)
        # a running call cannot be cancelled: ``future.cancel()`` (e.g. from a cancelled
        # ``asyncio.wrap_future``) returns False instead of orphaning the outcome
        call.future.set_running_or_notify_cancel()
        call._thread.start()
        return call

    def _body(self) -> None:
        try:
            outcome: Outcome[T] = Outcome(value=self._fn())
        except BaseException as exc:  # handed to the caller (or to on_late), never lost
            outcome = Outcome(error=exc)
        with self._handover:
            self._outcome = outcome
            self.finished.set()
            late = self._abandoned
        if outcome.error is None:
            self.future.set_result(outcome.value)  # type: ignore[arg-type]
        else:
            self.future.set_exception(outcome.error)
        if late and self._on_late is not None:
            self._on_late(outcome)

    # ------------------------------------------------------------------ the caller's side
    def wait(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds (None: forever); True when the call finished."""
        return self.finished.wait(None if timeout is None else max(0.0, timeout))

    def done(self) -> bool:
        return self.finished.is_set()

    def abandon(self, on_abandon: Callable[[], None] | None = None) -> bool:
        """Give up on the call. True when it is still running: it is marked abandoned and
        ``on_abandon`` runs (under the hand-over lock, so before any ``on_late``); its late
        outcome goes to ``on_late``. False when it already finished: nothing is marked, and the
        caller owns the outcome (:meth:`outcome`)."""
        with self._handover:
            if self.finished.is_set():
                return False
            self._abandoned = True
            if on_abandon is not None:
                on_abandon()
            return True

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    def outcome(self) -> Outcome[T]:
        """The finished call's outcome; :class:`RuntimeError` while it runs."""
        if self._outcome is None:
            raise RuntimeError(f"{self.name}: still running")
        return self._outcome

    def result(self) -> T:
        """The finished call's value, or its own exception re-raised."""
        outcome = self.outcome()
        if outcome.error is not None:
            raise outcome.error
        return outcome.value  # type: ignore[return-value]

    @property
    def thread(self) -> threading.Thread:
        return self._thread


def run_with_deadline(
    fn: Callable[[], T],
    timeout: float,
    *,
    name: str,
    on_late: Callable[[Outcome[T]], None] | None = None,
) -> T:
    """``fn()`` on a daemon thread, waited for at most ``timeout`` seconds: its value, its own
    exception re-raised, or :class:`DeadlineExceeded` (the call is abandoned; ``on_late`` gets
    its late outcome)."""
    call = DaemonCall.start(fn, name=name, on_late=on_late)
    if not call.wait(timeout) and call.abandon():
        raise DeadlineExceeded(name, timeout)
    return call.result()

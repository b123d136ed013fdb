"""The record of an operation's steps: what each took, how long, and how it ended.

Owns :class:`RecoveryStep` (one step: name, attempt, start, seconds, ok, detail) and
:class:`StepLog`, the one handler of :class:`~rollsafe.operations.effects.NoteStep` (a
decision the operation records, timed since the previous step) and the one place a timed
step's record is written (:meth:`StepLog.record`). A recovery keeps one log per recovery (its
:class:`~rollsafe.fleet.recovery.RecoveryResult`'s ``steps``); the fleet's membership keeps one
for its node losses and removals.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import rollsafe.operations.effects as fx
from rollsafe.operations.executor import Executor, handles
from rollsafe.text import bound_text

__all__ = ["RecoveryStep", "StepLog", "TimedStep"]

log = logging.getLogger(__name__)

_MAX_DETAIL = 512


@dataclass(frozen=True)
class RecoveryStep:
    """One timed step of a recovery (``attempt`` counts from 1)."""

    name: str
    attempt: int
    started_at: float
    seconds: float
    ok: bool
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "attempt": self.attempt,
            "started_at": self.started_at,
            "seconds": self.seconds,
            "ok": self.ok,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class TimedStep:
    """The declaration of a step an executor runs under a deadline and records once
    (``handles(fx.Restart, step=TimedStep("restart"))``): ``name`` is its record's name;
    ``starts_attempt``: the step starts the attempt's clock (a placement, before the claim of
    a node-loss recovery); ``share(remaining_s)``: the step may take only that much of what is
    left (the export's pull takes half, :func:`~rollsafe.policy.pull_budget_s`, leaving the
    fallback the rest). What happens when it runs late is the same for every such step: the
    group is busy (no new recovery starts on it) until the step's thread ends, its cancel event
    is set, and then the clean-ups it left run and the recovery is tried again."""

    name: str
    starts_attempt: bool = False
    #: the step's own bound: this share of what is left of the attempt (None: all of it)
    share: Callable[[float], float] | None = None


class StepLog(Executor):
    """The steps of one recovery (or of one fleet's membership changes), in order.

    ``keep``: how many steps are kept (None: all). ``label`` prefixes the log lines. Thread-safe:
    a step that ran late may be recorded from its own thread."""

    def __init__(self, *, label: str = "", keep: int | None = None, log_steps: bool = False):
        self.label = label
        self.attempt = 0
        self._log_steps = log_steps
        self._steps: deque[RecoveryStep] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._mark = time.perf_counter()

    @property
    def steps(self) -> tuple[RecoveryStep, ...]:
        with self._lock:
            return tuple(self._steps)

    def begin_attempt(self) -> int:
        """A new attempt begins (a claim or a placement): its number."""
        with self._lock:
            self.attempt += 1
            return self.attempt

    def mark(self) -> None:
        """The next noted step is timed from now."""
        self._mark = time.perf_counter()

    def record(self, name: str, t0: float, ok: bool, detail: str = "") -> RecoveryStep:
        """Record step ``name``, begun at ``t0`` (``time.perf_counter()``) and ended now."""
        seconds = time.perf_counter() - t0
        step = RecoveryStep(
            name, self.attempt, time.time() - seconds, seconds, ok, bound_text(detail, _MAX_DETAIL)
        )
        with self._lock:
            self._steps.append(step)
        self._mark = time.perf_counter()
        if self._log_steps:
            log.log(
                logging.INFO if ok else logging.WARNING,
                "%sstep %s %s: %s",
                self.label,
                name,
                "ok" if ok else "refused",
                detail,
            )
        return step

    @handles(fx.NoteStep)
    def note(self, effect: fx.NoteStep) -> fx.Outcome[None]:
        """A decision of the operation, timed since the previous step."""
        self.record(effect.name, self._mark, effect.ok, effect.detail)
        return fx.DONE

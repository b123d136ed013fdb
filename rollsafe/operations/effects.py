"""The effects an operation yields and the outcomes its executor sends back, as frozen data.

An effect names one step of I/O (register version N with the transport, update these groups,
send this event to that group, ...); the executor performs it and answers with an outcome:
:class:`Ok` (with the step's value), :class:`Failed` (the error, as text: errors are data) or
:class:`TimedOut`. Nothing here does I/O or imports torch; the executors
(:class:`rollsafe.fleet.SyncCoordinator`, :class:`rollsafe.verify.FleetModel`) give each
effect its meaning.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rollsafe.policy import ExportJudgement, GroupFacts
from rollsafe.statemachines.events import GroupEvent, ModeEvent

__all__ = [
    "AbandonExport",
    "Effect",
    "ExportJudged",
    "ExportSeen",
    "Failed",
    "HandOff",
    "Hook",
    "LockTransport",
    "ObserveExport",
    "Ok",
    "Outcome",
    "Pause",
    "PrepareTargets",
    "ReadGroups",
    "RecordVersions",
    "Register",
    "Resume",
    "SendGroup",
    "SendMode",
    "SetFleetVersion",
    "StartExport",
    "TimedOut",
    "UnlockTransport",
    "Update",
    "UpdateDone",
    "drive",
]


# ====================================================================== outcomes
@dataclass(frozen=True)
class Ok:
    """The step was done; ``value`` is what it returned (None for a plain step)."""

    value: Any = None


@dataclass(frozen=True)
class Failed:
    """The step raised or was refused; ``error`` says why (``"TypeName: message"``)."""

    error: str


@dataclass(frozen=True)
class TimedOut:
    """The step ran past its deadline; ``after_s`` is the deadline, when the executor has one."""

    after_s: float | None = None

    @property
    def error(self) -> str:
        return "timed out" if self.after_s is None else f"timed out after {self.after_s:g}s"


Outcome = Ok | Failed | TimedOut


# ====================================================================== effects
@dataclass(frozen=True)
class Effect:
    """One step of I/O an operation asks its executor to perform."""


@dataclass(frozen=True)
class ExportSeen:
    """The value of :class:`ObserveExport`: the previous export and the mode, as observed."""

    version: int
    state: str | None  # the export machine's state; None: the exporter no longer knows it
    mode_state: str | None  # the immediate-recovery mode's state; None: no mode configured


@dataclass(frozen=True)
class ObserveExport(Effect):
    """Look at the export started by the previous sync, once: :class:`Ok` of
    :class:`ExportSeen`, or ``Ok(None)`` when there is none to judge (no exporter, never
    started, already judged)."""


@dataclass(frozen=True)
class ExportJudged(Effect):
    """Record how the previous export was judged (:func:`rollsafe.policy.judge_export`)."""

    version: int
    judgement: ExportJudgement
    observed: str | None


@dataclass(frozen=True)
class SendMode(Effect):
    """Send ``event`` to the immediate-recovery mode (decided by ``decided_by``)."""

    event: ModeEvent
    decided_by: str


@dataclass(frozen=True)
class AbandonExport(Effect):
    """Abandon the export of ``version`` (it was late): never used, its directory removed."""

    version: int
    reason: str


@dataclass(frozen=True)
class LockTransport(Effect):
    """Take the transport's lock: no other register or update runs until
    :class:`UnlockTransport`."""


@dataclass(frozen=True)
class UnlockTransport(Effect):
    """Release the lock :class:`LockTransport` took."""


@dataclass(frozen=True)
class Register(Effect):
    """Register ``version`` with the transport: :class:`Ok` of what it published
    (``(name, version)`` or None), or :class:`Failed`."""

    version: int


@dataclass(frozen=True)
class Pause(Effect):
    """Pause the health checks (and generation, where the caller asked) until :class:`Resume`."""


@dataclass(frozen=True)
class Resume(Effect):
    """Undo :class:`Pause`."""


@dataclass(frozen=True)
class Hook(Effect):
    """Run the colocated hook ``name`` (``offload_trainer``, ``onload_engines``,
    ``onload_trainer``); :class:`Ok` also when none is configured."""

    name: str


@dataclass(frozen=True)
class ReadGroups(Effect):
    """The facts of every group now: :class:`Ok` of a tuple of
    :class:`~rollsafe.policy.GroupFacts`."""


@dataclass(frozen=True)
class PrepareTargets(Effect):
    """Build the transport target of each of ``groups``: :class:`Ok` of ``{group: why}`` for
    the groups whose target could not be built (they are not updated)."""

    groups: tuple[GroupFacts, ...]


@dataclass(frozen=True)
class UpdateDone:
    """The value of :class:`Update`."""

    rank_ok: Mapping[str, Mapping[int, bool]]  # per targeted group, per rank: loaded N
    #: groups that moved (failed, claimed by a recovery) while the update ran -> their state now
    moved: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Update(Effect):
    """Push ``version`` to ``groups`` in one transport update: :class:`Ok` of
    :class:`UpdateDone`; :class:`Failed` / :class:`TimedOut` when the update as a whole failed
    (then every target failed)."""

    version: int
    groups: tuple[GroupFacts, ...]


@dataclass(frozen=True)
class RecordVersions(Effect):
    """The members of ``groups`` now report ``version`` (their engines hold it)."""

    groups: tuple[str, ...]
    version: int


@dataclass(frozen=True)
class SetFleetVersion(Effect):
    """The fleet's version becomes ``version``."""

    version: int


@dataclass(frozen=True)
class SendGroup(Effect):
    """Send ``event`` to group ``group`` (decided by ``decided_by``): :class:`Ok`, or
    :class:`Failed` when its machine refused it (it moved meanwhile)."""

    group: str
    event: GroupEvent
    decided_by: str


@dataclass(frozen=True)
class HandOff(Effect):
    """Hand failed group ``group`` to the recovery coordinator."""

    group: str


@dataclass(frozen=True)
class StartExport(Effect):
    """Start the HF export of ``version``: ``Ok(True)`` started (or already written by the
    transport), ``Ok(False)`` no exporter, :class:`Failed` it did not start."""

    version: int


R = TypeVar("R")


def drive(steps: Generator[Effect, Outcome, R], perform: Callable[[Effect], Outcome]) -> R:
    """Run the step sequence ``steps`` to its end, answering each effect with
    ``perform(effect)``; return the sequence's result. An exception ``perform`` raises ends
    the sequence (it is closed) and propagates."""
    try:
        effect = next(steps)
        while True:
            effect = steps.send(perform(effect))
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    finally:
        steps.close()

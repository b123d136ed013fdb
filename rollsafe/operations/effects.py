"""The effects an operation yields and the outcomes its executor sends back, as frozen data.

An effect names one step of I/O (register version N with the transport, update these groups,
send this event to that group, ...); the executor performs it and answers with an outcome:
:class:`Ok` (with the step's value), :class:`Failed` (the error, as text: errors are data) or
:class:`TimedOut`. Nothing here does I/O or imports torch; the executors
(:class:`rollsafe.fleet.SyncCoordinator`, :class:`rollsafe.fleet.RecoveryCoordinator`,
:class:`rollsafe.verify.FleetModel`) give each effect its meaning.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rollsafe.policy import ExportFacts, ExportJudgement, GroupFacts, Handoff
from rollsafe.statemachines.events import GroupEvent, ModeEvent

__all__ = [
    "AbandonExport",
    "AwaitDrained",
    "AwaitHealthy",
    "Effect",
    "ExportJudged",
    "ExportSeen",
    "Failed",
    "GetEngine",
    "GroupFailed",
    "HandOff",
    "Hook",
    "Leased",
    "LockHealth",
    "LockTransport",
    "NoteStep",
    "ObserveExport",
    "Ok",
    "Outcome",
    "Pause",
    "Place",
    "PrepareTargets",
    "ProbeFacts",
    "ProbeMembers",
    "Probed",
    "PullExport",
    "Pulled",
    "PushFacts",
    "PushUnderLock",
    "Pushed",
    "ReadGroups",
    "ReadProbeFacts",
    "ReadPushFacts",
    "ReadRecovery",
    "ReadStates",
    "ReadStrategy",
    "RecordVersions",
    "RecoveryFacts",
    "Register",
    "ReleaseLease",
    "ReleasePlacement",
    "ReportMembers",
    "ReportRank",
    "Restart",
    "Resume",
    "SendGroup",
    "SendGroups",
    "SendMode",
    "SetFailureCounts",
    "SetFleetVersion",
    "StartExport",
    "StopEngine",
    "StrategyFacts",
    "TakeLease",
    "TargetedPush",
    "TimedOut",
    "UnlockHealth",
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
    """The step ran past its deadline; ``after_s`` is the deadline, when the executor has one;
    ``why`` is the executor's own wording of it (the fleet's ``StepTimeout`` message)."""

    after_s: float | None = None
    why: str | None = None

    @property
    def error(self) -> str:
        if self.why is not None:
            return self.why
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


# ---------------------------------------------------------------------- recovery
@dataclass(frozen=True)
class RecoveryFacts:
    """The value of :class:`ReadRecovery`: what the gate of a recovery reads."""

    state: str  # the group's machine state
    budget_left: bool
    complete: bool  # every rank of the group is known
    remaining_s: float | None  # the rollout's remaining seconds (None: unknown)
    expected_s: float  # the expected seconds of a recovery
    busy: bool = False  # a timed-out step of an earlier attempt still runs in the background
    budget: int = 0  # restarts left
    initial_budget: int = 0
    can_push: bool = True  # a transport is there for a targeted push
    #: a placed group's actor still answers (None: not placed, or not asked)
    placement_alive: bool | None = None


@dataclass(frozen=True)
class ReadRecovery(Effect):
    """The facts of group ``group`` now: :class:`Ok` of :class:`RecoveryFacts`."""

    group: str


@dataclass(frozen=True)
class NoteStep(Effect):
    """Record step ``name`` of the recovery (a decision, no I/O): the fleet times it into its
    :class:`~rollsafe.fleet.RecoveryResult`; the verifier ignores it."""

    name: str
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class StrategyFacts:
    """The value of :class:`ReadStrategy`: what :func:`rollsafe.policy.choose_strategy` reads."""

    mode_state: str
    fleet_version: int
    export: ExportFacts | None  # the export of the fleet's version, None: none known
    can_push: bool
    #: the group's node cannot read the trainer's export path: an export it restarts from is
    #: moved there first (:class:`PullExport`, ``docs/cluster.md`` section 5)
    moved: bool = False


@dataclass(frozen=True)
class ReadStrategy(Effect):
    """The facts a strategy is chosen from: :class:`Ok` of :class:`StrategyFacts`, or
    ``Ok(None)`` when immediate recovery is not configured (no mode or no exporter)."""


@dataclass(frozen=True)
class Leased:
    """The value of :class:`TakeLease`: a lease on the export of ``version`` at ``path``;
    ``token`` is the executor's own lease object."""

    version: int
    path: str | None
    token: Any = field(default=None, compare=False)


@dataclass(frozen=True)
class TakeLease(Effect):
    """Lease the ``ready`` export of ``version`` for ``holder``: :class:`Ok` of :class:`Leased`,
    :class:`Failed` when it cannot be leased (superseded, deleted, not ready)."""

    version: int
    holder: str


@dataclass(frozen=True)
class Pulled:
    """The value of :class:`PullExport`: the copy of the export on the group's node at
    ``path``, ``nbytes`` moved there (0: a copy already there matched, ``reused``)."""

    path: str
    nbytes: int
    reused: bool = False
    node_id: str | None = None


@dataclass(frozen=True)
class PullExport(Effect):
    """Move the leased export to group ``group``'s node (the ``moved`` mode: published once
    per version into Ray's object store, pulled by the group's actor, every file checked
    against the export's manifest before it is kept): :class:`Ok` of :class:`Pulled`,
    :class:`Failed` (or :class:`TimedOut`) naming why; nothing unverified is ever left to
    load."""

    group: str
    lease: Leased


@dataclass(frozen=True)
class ReleaseLease(Effect):
    """Release ``lease``. ``once_restart_ends``: the restart that loads from it timed out and
    still runs in the background: release it when that restart ends, never before (the
    directory must not be deleted under a loading engine)."""

    lease: Leased
    once_restart_ends: bool = False


@dataclass(frozen=True)
class GetEngine(Effect):
    """Get group ``group``'s restartable engine handle (the ``launcher`` step)."""

    group: str


@dataclass(frozen=True)
class StopEngine(Effect):
    """Stop group ``group``'s failed engine (the ``shutdown`` step; its warm standby kept)."""

    group: str


@dataclass(frozen=True)
class Restart(Effect):
    """Restart group ``group``'s engine: from the export at ``model_path`` reporting
    ``weight_version``, or on dummy weights when ``model_path`` is None."""

    group: str
    model_path: str | None = None
    weight_version: int | None = None

    @property
    def dummy(self) -> bool:
        return self.model_path is None


@dataclass(frozen=True)
class AwaitHealthy(Effect):
    """Point group ``group`` at its restarted engine and wait until it answers ``/health``."""

    group: str


@dataclass(frozen=True)
class ReportMembers(Effect):
    """Every member of group ``group`` reports ``weights_version``; ``healthy``: their health
    (None: keep what each reported last)."""

    group: str
    weights_version: int | None
    healthy: bool | None = None


@dataclass(frozen=True)
class PushUnderLock(Effect):
    """Take the transport's lock and run :func:`rollsafe.operations.recover.push_locked` for
    ``group`` under it (the ``push`` step, under the attempt's deadline): :class:`Ok` of its
    :class:`~rollsafe.operations.recover.PushEnd`, :class:`Failed` / :class:`TimedOut` when it
    was cut short (the push may still run in the background, holding the lock)."""

    group: str
    keeps_weights: bool


@dataclass(frozen=True)
class PushFacts:
    """The value of :class:`ReadPushFacts`: what :func:`rollsafe.policy.plan_targeted_push`
    reads."""

    published: tuple[str, int] | None
    fleet_version: int
    state: str


@dataclass(frozen=True)
class ReadPushFacts(Effect):
    """The transport's published checkpoint, the fleet's version and group ``group``'s state."""

    group: str


@dataclass(frozen=True)
class Pushed:
    """The value of :class:`TargetedPush`: per rank of the group, whether it loaded the
    version; ``why`` the transport's reason when it did not; ``refused``: the transport cannot
    push to one group (a ``TransportError`` before anything moved, e.g. ``P2PUnavailable``)."""

    rank_ok: Mapping[int, bool]
    why: str = ""
    refused: bool = False


@dataclass(frozen=True)
class TargetedPush(Effect):
    """Push the registered checkpoint of ``version`` to group ``group`` only: :class:`Ok` of
    :class:`Pushed`, :class:`Failed` / :class:`TimedOut` when it raised or was cut short."""

    group: str
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


# ---------------------------------------------------------------------- probe
@dataclass(frozen=True)
class Probed:
    """The value of :class:`ProbeMembers` when the probe answered: the ranks it found
    unhealthy (empty: every member healthy) and its own wording of why (None when healthy)."""

    unhealthy: tuple[int, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class ProbeMembers(Effect):
    """Probe every member of group ``group`` once: :class:`Ok` of :class:`Probed`;
    :class:`Failed` when the probe raised (or an earlier one is still stuck in the engine);
    :class:`TimedOut` when it did not answer in time. Both count as a failure of every rank."""

    group: str


@dataclass(frozen=True)
class LockHealth(Effect):
    """Take the health checker's lock: a ``pause()`` waits until :class:`UnlockHealth`, so once
    it returns no probe answer is applied."""


@dataclass(frozen=True)
class UnlockHealth(Effect):
    """Release the lock :class:`LockHealth` took."""


@dataclass(frozen=True)
class ProbeFacts:
    """The value of :class:`ReadProbeFacts`: what :func:`rollsafe.policy.judge_probe` reads.
    ``moved``: the group left the probed states (or was restarted, or removed) while it was
    probed: the answer is about an incarnation that no longer exists."""

    ranks: tuple[int, ...]
    counts: Mapping[int, int]  # consecutive failures per rank so far
    recorded_healthy: Mapping[int, bool]
    moved: bool = False


@dataclass(frozen=True)
class ReadProbeFacts(Effect):
    """The facts of group ``group`` now: :class:`Ok` of :class:`ProbeFacts`, or ``Ok(None)``
    when no answer may be applied (checks paused or stopped since the probe began)."""

    group: str


@dataclass(frozen=True)
class ReportRank(Effect):
    """Rank ``rank`` of group ``group`` reports ``healthy``."""

    group: str
    rank: int
    healthy: bool


@dataclass(frozen=True)
class SetFailureCounts(Effect):
    """Group ``group``'s consecutive failures per rank become ``counts`` (empty: forgotten)."""

    group: str
    counts: Mapping[int, int]


@dataclass(frozen=True)
class GroupFailed(Effect):
    """Group ``group`` was sent ``fail`` by the probe: report it and hand it over as
    ``handoff`` says (:class:`~rollsafe.policy.Handoff`: ``enqueue`` for the recovery
    coordinator, off this thread)."""

    group: str
    unhealthy: tuple[int, ...]  # the ranks at the threshold
    failures: int  # consecutive failures that decided it
    reason: str
    handoff: Handoff


# ---------------------------------------------------------------------- placement and removal
@dataclass(frozen=True)
class ReadStates(Effect):
    """The machine states of ``groups``: :class:`Ok` of ``((group id, state), ...)``, in
    order (a group the fleet no longer holds is left out)."""

    groups: tuple[str, ...]


@dataclass(frozen=True)
class SendGroups(Effect):
    """Send each group its events in ONE step of the fleet's registry (no request is
    dispatched between two of them): :class:`Ok` of the groups that refused an event (a
    tuple of ``(group id, why)``; empty when every event was taken)."""

    events: tuple[tuple[str, tuple[GroupEvent, ...]], ...]
    decided_by: str


@dataclass(frozen=True)
class Place(Effect):
    """Give group ``group``'s old placement back and place it anew (``GroupPlacer``):
    :class:`Ok` of the new node's id, :class:`Failed` when no node has room (it waits)."""

    group: str


@dataclass(frozen=True)
class ReleasePlacement(Effect):
    """Give group ``group``'s placement back (its engine is stopped)."""

    group: str


@dataclass(frozen=True)
class AwaitDrained(Effect):
    """Wait for group ``group``'s in-flight requests to end (up to the fleet's drain bound):
    :class:`Ok` of the requests still running (they continue elsewhere when it stops)."""

    group: str

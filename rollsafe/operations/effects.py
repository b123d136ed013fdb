"""The effects an operation yields and the outcomes its executor sends back, as frozen data.

An effect names one step of I/O (register version N with the transport, update these groups,
send this event to that group, ...); the executor performs it and answers with an outcome:
:class:`Ok` (with the step's value), :class:`Failed` (the error, as text: errors are data) or
:class:`TimedOut`. Every effect declares the type of its value (``Register`` is an
``Effect[tuple[str, int] | None]``): an operation asks with :func:`ask` (the outcome, typed) or
:func:`read` (a fact the executor always has: its value), so each reply has its type. Nothing
here does I/O or imports torch; the executors (:mod:`rollsafe.operations.executor`) give each
effect its meaning, and :class:`Run` drives a sequence (to its end, or to a stop point).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeAlias, TypeVar, cast

from rollsafe.errors import RollsafeError
from rollsafe.policy import ExportFacts, ExportJudgement, GroupFacts, Handoff, SpareFacts
from rollsafe.statemachines.events import DeltaEvent, GroupEvent, ModeEvent

__all__ = [
    "DONE",
    "AbandonExport",
    "AwaitDrained",
    "AwaitHealthy",
    "BaseFacts",
    "CheckVersion",
    "Delivered",
    "Effect",
    "EncodeDelta",
    "Encoded",
    "ExportJudged",
    "ExportSeen",
    "Failed",
    "GetEngine",
    "GroupFailed",
    "HandOff",
    "Hook",
    "KeepSnapshot",
    "Leased",
    "LockHealth",
    "LockTransport",
    "NoteStep",
    "ObserveExport",
    "Ok",
    "OperationError",
    "Outcome",
    "Pause",
    "Place",
    "PrepareTargets",
    "ProbeFacts",
    "ProbeMembers",
    "Probed",
    "PullExport",
    "Pulled",
    "PushEnd",
    "PushFacts",
    "PushTargets",
    "PushUnderLock",
    "Pushed",
    "ReadBase",
    "ReadGroups",
    "ReadProbeFacts",
    "ReadPushFacts",
    "ReadRecovery",
    "ReadSpares",
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
    "Run",
    "SendBase",
    "SendGroup",
    "SendGroups",
    "SendMode",
    "SetFailureCounts",
    "SparesSeen",
    "StartExport",
    "Steps",
    "StopEngine",
    "StrategyFacts",
    "TakeLease",
    "TargetedPush",
    "TimedOut",
    "UnlockHealth",
    "UnlockTransport",
    "Update",
    "UpdateDone",
    "ask",
    "drive",
    "read",
]

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class OperationError(RollsafeError, RuntimeError):
    """An executor answered an effect in a way the operation cannot use (a fact it must always
    have came back failed): a bug in the executor, never an outcome of I/O."""


# ====================================================================== outcomes
@dataclass(frozen=True)
class Ok(Generic[R_co]):
    """The step was done; ``value`` is what it returned (None for a plain step)."""

    value: R_co = None  # type: ignore[assignment]  # a plain step's Ok() carries None


#: The outcome of a plain step that was done (``Ok(None)``).
DONE: Ok[None] = Ok(None)


@dataclass(frozen=True)
class Failed:
    """The step raised or was refused; ``error`` says why (``"TypeName: message"``)."""

    error: str


@dataclass(frozen=True)
class TimedOut:
    """The step ran past its deadline; ``after_s`` is the deadline, when the executor has one;
    ``why`` is the executor's own wording of it (the fleet's ``StepTimeout`` message).
    ``started``: False when the deadline had passed before the step began (nothing of it runs
    on in the background), True when it began and is still running past its deadline."""

    after_s: float | None = None
    why: str | None = None
    started: bool = True

    @property
    def error(self) -> str:
        if self.why is not None:
            return self.why
        return "timed out" if self.after_s is None else f"timed out after {self.after_s:g}s"


Outcome: TypeAlias = Ok[R] | Failed | TimedOut


# ====================================================================== effects
@dataclass(frozen=True)
class Effect(Generic[R_co]):
    """One step of I/O an operation asks its executor to perform; ``R_co`` is the type of the
    value an :class:`Ok` answer carries."""


@dataclass(frozen=True)
class ExportSeen:
    """The value of :class:`ObserveExport`: the previous export and the mode, as observed."""

    version: int
    state: str | None  # the export machine's state; None: the exporter no longer knows it
    mode_state: str | None  # the immediate-recovery mode's state; None: no mode configured


@dataclass(frozen=True)
class ObserveExport(Effect["ExportSeen | None"]):
    """Look at the export started by the previous sync, once: :class:`Ok` of
    :class:`ExportSeen`, or ``Ok(None)`` when there is none to judge (no exporter, never
    started, already judged)."""


@dataclass(frozen=True)
class ExportJudged(Effect[None]):
    """Record how the previous export was judged (:func:`rollsafe.policy.judge_export`)."""

    version: int
    judgement: ExportJudgement
    observed: str | None


@dataclass(frozen=True)
class SendMode(Effect[None]):
    """Send ``event`` to the immediate-recovery mode (decided by ``decided_by``)."""

    event: ModeEvent
    decided_by: str


@dataclass(frozen=True)
class AbandonExport(Effect[None]):
    """Abandon the export of ``version`` (it was late): never used, its directory removed."""

    version: int
    reason: str


@dataclass(frozen=True)
class LockTransport(Effect[None]):
    """Take the transport's lock: no other register or update runs until
    :class:`UnlockTransport`."""


@dataclass(frozen=True)
class UnlockTransport(Effect[None]):
    """Release the lock :class:`LockTransport` took."""


@dataclass(frozen=True)
class Register(Effect["tuple[str, int] | None"]):
    """Register ``version`` with the transport: :class:`Ok` of what it published
    (``(name, version)`` or None), or :class:`Failed`."""

    version: int


@dataclass(frozen=True)
class Pause(Effect[None]):
    """Pause the health checks (and generation, where the caller asked) until :class:`Resume`."""


@dataclass(frozen=True)
class Resume(Effect[None]):
    """Undo :class:`Pause`."""


@dataclass(frozen=True)
class Hook(Effect[None]):
    """Run the colocated hook ``name`` (``offload_trainer``, ``onload_engines``,
    ``onload_trainer``); :class:`Ok` also when none is configured."""

    name: str


@dataclass(frozen=True)
class ReadGroups(Effect["tuple[GroupFacts, ...]"]):
    """The facts of every group now: :class:`Ok` of a tuple of
    :class:`~rollsafe.policy.GroupFacts`."""


@dataclass(frozen=True)
class PrepareTargets(Effect["Mapping[str, str]"]):
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
class Update(Effect["UpdateDone"]):
    """Push ``version`` to ``groups`` in one transport update: :class:`Ok` of
    :class:`UpdateDone`; :class:`Failed` / :class:`TimedOut` when the update as a whole failed
    (then every target failed)."""

    version: int
    groups: tuple[GroupFacts, ...]


@dataclass(frozen=True)
class RecordVersions(Effect[None]):
    """The members of ``groups`` now report ``version`` (their engines hold it) and the
    fleet's version becomes ``fleet_version``, in one step: a reader of the registry never
    sees one without the other (an ``active`` group at a version the fleet is not at)."""

    groups: tuple[str, ...]
    version: int
    fleet_version: int


@dataclass(frozen=True)
class SendGroup(Effect[str]):
    """Send ``event`` to group ``group`` (decided by ``decided_by``): :class:`Ok`, or
    :class:`Failed` when its machine refused it (it moved meanwhile). ``reason``, when given,
    is kept with the transition's inputs (a probe's ``fail`` says what the probe saw: the
    recorded run's ``fail`` row carries it)."""

    group: str
    event: GroupEvent
    decided_by: str
    reason: str | None = None


@dataclass(frozen=True)
class HandOff(Effect[None]):
    """Hand ``group`` to the recovery coordinator: a failed group to be recovered, or
    (``push_only``) a group marked stale at the fleet's version, up and waiting in
    ``pending_weights``, to be given only the targeted push of the registered checkpoint."""

    group: str
    push_only: bool = False


@dataclass(frozen=True)
class StartExport(Effect[bool]):
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
class ReadRecovery(Effect["RecoveryFacts"]):
    """The facts of group ``group`` now: :class:`Ok` of :class:`RecoveryFacts`."""

    group: str


@dataclass(frozen=True)
class NoteStep(Effect[None]):
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
class ReadStrategy(Effect["StrategyFacts | None"]):
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
class TakeLease(Effect["Leased"]):
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
class PullExport(Effect["Pulled"]):
    """Move the leased export to group ``group``'s node (the ``moved`` mode: published once
    per version into Ray's object store, pulled by the group's actor, every file checked
    against the export's manifest before it is kept): :class:`Ok` of :class:`Pulled`,
    :class:`Failed` (or :class:`TimedOut`) naming why; nothing unverified is ever left to
    load."""

    group: str
    lease: Leased


@dataclass(frozen=True)
class ReleaseLease(Effect[None]):
    """Release ``lease``. ``once_restart_ends``: the restart that loads from it timed out and
    still runs in the background: release it when that restart ends, never before (the
    directory must not be deleted under a loading engine)."""

    lease: Leased
    once_restart_ends: bool = False


@dataclass(frozen=True)
class GetEngine(Effect[None]):
    """Get group ``group``'s restartable engine handle (the ``launcher`` step)."""

    group: str


@dataclass(frozen=True)
class StopEngine(Effect[None]):
    """Stop group ``group``'s engine: a failed one before its restart (the ``shutdown`` step,
    ``keep_standby``: its warm standby takes the restart), or a removed one (everything)."""

    group: str
    keep_standby: bool = False


@dataclass(frozen=True)
class Restart(Effect[None]):
    """Restart group ``group``'s engine: from the export at ``model_path`` reporting
    ``weight_version``, or on dummy weights when ``model_path`` is None."""

    group: str
    model_path: str | None = None
    weight_version: int | None = None

    @property
    def dummy(self) -> bool:
        return self.model_path is None


@dataclass(frozen=True)
class AwaitHealthy(Effect[None]):
    """Point group ``group`` at its restarted engine and wait until it answers ``/health``."""

    group: str


@dataclass(frozen=True)
class ReportMembers(Effect[None]):
    """Every member of group ``group`` reports ``weights_version``; ``healthy``: their health
    (None: keep what each reported last)."""

    group: str
    weights_version: int | None
    healthy: bool | None = None


@dataclass(frozen=True)
class PushUnderLock(Effect["PushEnd"]):
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
class ReadPushFacts(Effect["PushFacts"]):
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
class TargetedPush(Effect["Pushed"]):
    """Push the registered checkpoint of ``version`` to group ``group`` only: :class:`Ok` of
    :class:`Pushed`, :class:`Failed` / :class:`TimedOut` when it raised or was cut short."""

    group: str
    version: int


@dataclass(frozen=True)
class PushEnd:
    """The value of :class:`PushUnderLock`: what
    :func:`rollsafe.operations.recover.push_locked` did. ``loaded``: every rank loaded
    ``version`` (``active``); ``poisoned``: the push failed on an engine that keeps no known
    weights (``fail`` sent); ``refused``: the transport cannot push to one group;
    ``deferred``: nothing pushed or a failed push that kept the old weights; ``cut_short``: the
    push raised or timed out."""

    result: Literal["loaded", "poisoned", "refused", "deferred", "cut_short"]
    why: str = ""
    version: int | None = None
    pushed: bool = False  # the transport was asked to push
    timed_out: bool = False
    #: where ``loaded`` took the group: ``active``, or ``standby`` for a spare
    state: str | None = None


# ---------------------------------------------------------------------- probe
@dataclass(frozen=True)
class Probed:
    """The value of :class:`ProbeMembers` when the probe answered: the ranks it found
    unhealthy (empty: every member healthy) and its own wording of why (None when healthy)."""

    unhealthy: tuple[int, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class ProbeMembers(Effect["Probed"]):
    """Probe every member of group ``group`` once: :class:`Ok` of :class:`Probed`;
    :class:`Failed` when the probe raised (or an earlier one is still stuck in the engine);
    :class:`TimedOut` when it did not answer in time. Both count as a failure of every rank."""

    group: str


@dataclass(frozen=True)
class LockHealth(Effect[None]):
    """Take the health checker's lock: a ``pause()`` waits until :class:`UnlockHealth`, so once
    it returns no probe answer is applied."""


@dataclass(frozen=True)
class UnlockHealth(Effect[None]):
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
class ReadProbeFacts(Effect["ProbeFacts | None"]):
    """The facts of group ``group`` now: :class:`Ok` of :class:`ProbeFacts`, or ``Ok(None)``
    when no answer may be applied (checks paused or stopped since the probe began)."""

    group: str


@dataclass(frozen=True)
class ReportRank(Effect[None]):
    """Rank ``rank`` of group ``group`` reports ``healthy``."""

    group: str
    rank: int
    healthy: bool


@dataclass(frozen=True)
class SetFailureCounts(Effect[None]):
    """Group ``group``'s consecutive failures per rank become ``counts`` (empty: forgotten)."""

    group: str
    counts: Mapping[int, int]


@dataclass(frozen=True)
class GroupFailed(Effect[None]):
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
class ReadStates(Effect["tuple[tuple[str, str], ...]"]):
    """The machine states of ``groups``: :class:`Ok` of ``((group id, state), ...)``, in
    order (a group the fleet no longer holds is left out)."""

    groups: tuple[str, ...]


@dataclass(frozen=True)
class SendGroups(Effect["tuple[tuple[str, str], ...]"]):
    """Send each group its events in ONE step of the fleet's registry (no request is
    dispatched between two of them): :class:`Ok` of the groups that refused an event (a
    tuple of ``(group id, why)``; empty when every event was taken). ``all_or_nothing`` (one
    event per group): when one machine would refuse, none is sent and every group is
    refused."""

    events: tuple[tuple[str, tuple[GroupEvent, ...]], ...]
    decided_by: str
    all_or_nothing: bool = False


@dataclass(frozen=True)
class Place(Effect[str]):
    """Give group ``group``'s old placement back and place it anew (``GroupPlacer``):
    :class:`Ok` of the new node's id, :class:`Failed` when no node has room (it waits)."""

    group: str


@dataclass(frozen=True)
class ReleasePlacement(Effect[None]):
    """Give group ``group``'s placement back (its engine is stopped)."""

    group: str


@dataclass(frozen=True)
class AwaitDrained(Effect[int]):
    """Wait for group ``group``'s in-flight requests to end (up to the fleet's drain bound):
    :class:`Ok` of the requests still running (they continue elsewhere when it stops)."""

    group: str


# ---------------------------------------------------------------------- spares
@dataclass(frozen=True)
class SparesSeen:
    """The value of :class:`ReadSpares`: the facts of the group to cover, of every spare,
    and the fleet's version, read together."""

    group: SpareFacts
    spares: tuple[SpareFacts, ...]
    fleet_version: int


@dataclass(frozen=True)
class ReadSpares(Effect[SparesSeen]):
    """The facts :func:`rollsafe.policy.plan_cover` reads to cover group ``group``:
    :class:`Ok` of :class:`SparesSeen`."""

    group: str


@dataclass(frozen=True)
class CheckVersion(Effect["tuple[str | None, ...]"]):
    """Ask group ``group``'s engines which weights version they serve (the last check of a
    spare before its promotion): :class:`Ok` of one answer per engine endpoint (None: it names
    none), :class:`Failed` / :class:`TimedOut` when an engine did not answer."""

    group: str


# ---------------------------------------------------------------------- delta push
@dataclass(frozen=True)
class BaseFacts:
    """The value of :class:`ReadBase`: what :func:`rollsafe.policy.plan_push` reads of one
    target: its confirmed ``base`` (None: none), the versions the sender ``held`` copies of,
    whether deltas are on and whether the target's engine applies them."""

    base: int | None
    held: frozenset[int]
    delta_enabled: bool
    applies_deltas: bool


@dataclass(frozen=True)
class ReadBase(Effect[BaseFacts]):
    """The delta facts of ``target`` now: :class:`Ok` of :class:`BaseFacts`."""

    target: str


@dataclass(frozen=True)
class SendBase(Effect[str]):
    """Send ``event`` to ``target``'s :class:`~rollsafe.statemachines.DeltaBase` (with the
    ``version`` pushed and the versions ``held``, which its guards read), decided by
    ``decided_by``: :class:`Ok` of its state, :class:`Failed` when refused (the target was
    reset while its push ran: the reset wins)."""

    target: str
    event: DeltaEvent
    version: int | None
    held: frozenset[int]
    decided_by: str


@dataclass(frozen=True)
class KeepSnapshot(Effect[None]):
    """Keep a copy of ``version``'s weights: a possible base once targets confirm it."""

    version: int


@dataclass(frozen=True)
class Encoded:
    """The value of :class:`EncodeDelta`: the delta's bytes, the full weights' bytes, and
    whether it is worth sending (smaller)."""

    nbytes: int
    full_nbytes: int
    worthwhile: bool


@dataclass(frozen=True)
class EncodeDelta(Effect[Encoded]):
    """Encode the delta from ``base`` to ``version`` for ``targets`` (one encoding per base):
    :class:`Ok` of :class:`Encoded`, :class:`Failed` when it cannot be encoded (the version's
    names or shapes differ from the base's)."""

    base: int
    version: int
    targets: tuple[str, ...]


@dataclass(frozen=True)
class Delivered:
    """What one target of a :class:`PushTargets` did: ``ok`` (it confirmed the version: every
    rank applied it), ``refused`` (its engine refused a delta by name; nothing changed), the
    transport's ``reason``, the bytes and seconds."""

    ok: bool
    reason: str = ""
    refused: bool = False
    nbytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class PushTargets(Effect[Mapping[str, Delivered]]):
    """Push ``version`` to ``targets`` in one transport update: the delta from ``base`` (its
    encoding), or the full weights (``base`` None). :class:`Ok` of a :class:`Delivered` per
    target (an update that raised fails every target, never raises here)."""

    targets: tuple[str, ...]
    version: int
    base: int | None


# ====================================================================== asking and driving
#: A step sequence: yields effects, is sent their outcomes, returns its result.
Steps = Generator[Effect[Any], Outcome[Any], R]


def ask(effect: Effect[R]) -> Generator[Effect[Any], Outcome[Any], Outcome[R]]:
    """Yield ``effect`` and return its outcome, typed by the effect (``yield from ask(e)``)."""
    outcome = yield effect
    return cast("Outcome[R]", outcome)


def read(effect: Effect[R]) -> Generator[Effect[Any], Outcome[Any], R]:
    """Yield ``effect``, a fact every executor has, and return its value. An executor that
    does not answer it :class:`Ok` is broken: :class:`OperationError` names the effect."""
    outcome = yield effect
    if not isinstance(outcome, Ok):
        raise OperationError(f"{type(effect).__name__} must be answered Ok, got {outcome!r}")
    return cast(R, outcome.value)


Perform = Callable[[Effect[Any]], Outcome[Any]]


class Run(Generic[R]):
    """One sequence driven by ``perform``: to its end (:meth:`finish`), or to a stop point
    (:meth:`until`: the first effect of a type, handed back unperformed) and on from there
    with that effect's outcome (:meth:`resume`). A health round stops every probe's sequence
    at :class:`ProbeMembers`, performs the probes together under one deadline, and resumes
    each with its answer. An exception ``perform`` raises ends the sequence (it is closed)
    and propagates."""

    __slots__ = ("_done", "_perform", "_result", "_steps")

    def __init__(self, steps: Steps[R], perform: Perform) -> None:
        self._steps = steps
        self._perform = perform
        self._done = False
        self._result: R | None = None

    @property
    def done(self) -> bool:
        return self._done

    @property
    def result(self) -> R:
        """The sequence's result (it must have ended)."""
        if not self._done:
            raise OperationError("the sequence has not ended")
        return cast(R, self._result)

    def until(self, stop: type[Effect[Any]]) -> Effect[Any] | None:
        """Start the sequence and perform its effects up to the first of type ``stop``,
        which is returned unperformed; None when the sequence ended first (:attr:`result`)."""
        return self._advance(None, stop)

    def resume(self, outcome: Outcome[Any]) -> R:
        """Answer the effect :meth:`until` stopped at with ``outcome`` and run to the end."""
        self._advance(outcome, None)
        return self.result

    def finish(self) -> R:
        """Run the whole sequence; return its result."""
        self._advance(None, None)
        return self.result

    def close(self) -> None:
        """Abandon the sequence (its ``finally`` blocks run)."""
        self._steps.close()

    def _advance(
        self, answer: Outcome[Any] | None, stop: type[Effect[Any]] | None
    ) -> Effect[Any] | None:
        """Send ``answer`` (None: start the sequence) and perform effects up to ``stop``."""
        steps = self._steps
        try:
            effect = next(steps) if answer is None else steps.send(answer)
            while stop is None or not isinstance(effect, stop):
                effect = steps.send(self._perform(effect))
        except StopIteration as ended:
            self._done, self._result = True, ended.value
            steps.close()
            return None
        except BaseException:
            steps.close()
            raise
        return effect


def drive(steps: Steps[R], perform: Perform) -> R:
    """Run the step sequence ``steps`` to its end, answering each effect with
    ``perform(effect)``; return the sequence's result. An exception ``perform`` raises ends
    the sequence (it is closed) and propagates."""
    return Run(steps, perform).finish()

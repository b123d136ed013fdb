"""The fleet's decisions, as pure functions: what to send and what to do after each observation.

Owns every decision the fleet control plane takes (``docs/design.md``, "The policy"): the health
manager, the recovery coordinator, the sync coordinator and retention observe the world (a
probe's answer, a register or update report, an export's state, a restart's outcome, the time
left in the rollout), ask a function here, and execute the answer: send the events it names, do
the I/O it names. No function here does I/O, starts a thread or reads a clock.

``rollsafe verify`` composes these same functions with the four real machines and explores the
outcomes of the I/O as nondeterministic choices, so what the verifier proves is what the fleet
runs. Callers look the functions up on this module at call time (``policy.judge_probe(...)``),
never by ``from ... import``: patching one function here changes the fleet and the verifier
alike, which is how the mutation tests plant bugs.

Each decision function is declared with :func:`sends` (which component calls it, which events it
may return); :data:`SENDERS` is that table plus the senders outside the policy (the launcher, the
transports, the exporter, the fleet's configuration). ``rollsafe diagrams`` draws its "who sends
what" overview from :data:`SENDERS`, and the verifier checks that every event a decision returns
was declared.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal, TypeVar

from rollsafe.statemachines.events import (
    AnyEvent,
    DeltaEvent,
    ExportEvent,
    GroupEvent,
    ModeEvent,
    RegistrationEvent,
)
from rollsafe.wire.group_names import RENDEZVOUS_TORCH, RENDEZVOUS_VLLM

__all__ = [
    "COVERABLE",
    "ENGINE_TRAITS",
    "PULL_SHARE",
    "SENDERS",
    "UNKNOWN_ENGINE",
    "VLLM_GLOO_TRAITS",
    "CoverPlan",
    "EngineTraits",
    "ExportAccess",
    "ExportFacts",
    "ExportJudgement",
    "ExportVerdict",
    "GroupFacts",
    "Handoff",
    "NodeLossPlan",
    "PlacementGate",
    "ProbeVerdict",
    "PushKind",
    "PushPlan",
    "RecoveryGate",
    "RecoveryStart",
    "RemovalPlan",
    "RestartOutcome",
    "RetentionPlan",
    "Sender",
    "Settlement",
    "SpareFacts",
    "SpareVerdict",
    "Strategy",
    "StrategyChoice",
    "TargetSelection",
    "TargetedPushPlan",
    "UpdateFailurePolicy",
    "after_drain",
    "after_placement",
    "after_pull",
    "after_push",
    "after_restart",
    "choose_strategy",
    "engine_traits",
    "export_access",
    "gate_placement",
    "gate_recovery",
    "judge_export",
    "judge_probe",
    "judge_request_failures",
    "judge_spare",
    "launch_events",
    "on_node_lost",
    "plan_cover",
    "plan_push",
    "plan_removal",
    "plan_retention",
    "plan_targeted_push",
    "proceed_after_register",
    "pull_budget_s",
    "select_targets",
    "settle_push",
    "settle_update",
]

F = TypeVar("F", bound=Callable[..., Any])

_EX = "ExportLifecycle"
_REG = "CheckpointRegistration"
_MODE = "ImmediateRecoveryMode"


@dataclass(frozen=True)
class Sender:
    """One component that sends some events to one machine (a row of the overview)."""

    component: str
    module: str
    machine: str
    events: tuple[str, ...]
    decided_by: str | None = None  # the policy function that decides them, if any


_senders: list[Sender] = []


def sends(component: str, module: str, **machines: Sequence[AnyEvent]) -> Callable[[F], F]:
    """Declare which events a decision function may return and who executes it."""

    def declare(fn: F) -> F:
        for machine, events in machines.items():
            _senders.append(
                Sender(component, module, machine, tuple(e.value for e in events), fn.__name__)
            )
        return fn

    return declare


# ====================================================================== engine kinds
@dataclass(frozen=True)
class EngineTraits:
    """What an engine kind does when a weight update fails, and whether an update must run
    paused: facts of the engine read from its source and checked on the real server
    (``docs/engines.md``, "How engines fail"), which the decisions below and ``rollsafe
    verify`` read.

    ``failed_update_keeps_weights``: a refused or failed update leaves the weights the engine
    served before (the reference engine's SGLang dialect stages every tensor and applies all
    or nothing). False for every real engine: vLLM 0.32 answers 500 to a failed
    ``reload_weights`` or update, keeps answering ``/health``, and dies on its next forward
    pass; SGLang 0.5.23's ``update_weights_from_disk`` points the model at the new path before
    loading, so its rollback re-reads the new files. Such a group is never trusted again on
    the word of ``/health``: it is taken out of routing and restarted.

    ``update_needs_pause``: a request that reaches the engine between the start and the end
    of an update kills it (vLLM), so every update runs with generation paused.

    ``applies_deltas``: the engine applies a delta update (``rollsafe.wire.delta``, #28) sent
    as named tensors over ``ipc``/``nccl`` onto exactly its base, all or nothing, and refuses
    anything else with a named error (``DeltaBaseMismatch``, ``DeltaFormatError``,
    ``DeltaDigestMismatch``) having changed nothing, so the sender pushes it full in the same
    update. True for the reference engine (both dialects) and for vLLM served through
    rollsafe's ``rollsafe_gloo`` weight-transfer plugin (vLLM on CPU, the launcher's default
    there: ``vllm-cpu``). False for SGLang (no delta apply) and for vLLM on a GPU: its backends
    are vLLM's own, whose ``sparse_nccl`` is neither this format nor transactional (a failed
    update there leaves a half-loaded model); a transport sends those engines full syncs.

    ``delta_base_by_content``: the engine knows no version label to check a delta's base by
    (vLLM's workers never see ``weight_version``), so it checks the touched tensors' digests
    against the header's ``base_digests`` instead, and keeps a host copy of the weights it
    loaded (one model's worth of host memory) to apply deltas onto: the sender writes the base
    digests and asks for the copy (``keep_delta_base``) for such a target only.

    ``rendezvous``: how the engine's ranks join an ``nccl``-transport weight-update group.
    ``"torch"`` (:data:`~rollsafe.wire.group_names.RENDEZVOUS_TORCH`): rollsafe's
    ``torch.distributed`` group over a prefixed ``TCPStore`` (SGLang, the reference engine,
    rollsafe's ``rollsafe_gloo`` plugin). ``"vllm"``: a real vLLM's ``nccl`` backend, which
    joins as vLLM's ``StatelessProcessGroup`` + PyNccl; the trainer joins it the same way
    (:mod:`rollsafe.wire.vllm_group`, which needs ``vllm`` importable in the trainer).
    """

    kind: str
    failed_update_keeps_weights: bool
    update_needs_pause: bool
    applies_deltas: bool = False
    delta_base_by_content: bool = False
    rendezvous: str = RENDEZVOUS_TORCH


#: (engine kind, HTTP dialect) -> its traits. ``None`` as dialect: any dialect of that kind.
ENGINE_TRAITS: dict[tuple[str, str | None], EngineTraits] = {
    ("reference", "sglang"): EngineTraits("reference-sglang", True, False, applies_deltas=True),
    ("reference", "vllm"): EngineTraits("reference-vllm", False, True, applies_deltas=True),
    ("sglang", None): EngineTraits("sglang", False, False, applies_deltas=False),
    ("vllm", None): EngineTraits(
        "vllm", False, True, applies_deltas=False, rendezvous=RENDEZVOUS_VLLM
    ),
}
#: vLLM served through rollsafe's ``rollsafe_gloo`` weight-transfer plugin (vLLM on CPU): a
#: failed update still poisons it, but it applies deltas, checking the base by content
VLLM_GLOO_TRAITS = EngineTraits(
    "vllm-cpu", False, True, applies_deltas=True, delta_base_by_content=True
)
#: the weight-transfer backend of :data:`VLLM_GLOO_TRAITS`, ``rollsafe.vllm_plugin.BACKEND`` (the
#: policy imports no adapter; tests/test_engine_delta.py checks that BACKEND selects these traits)
_GLOO_PLUGIN_BACKEND = "rollsafe_gloo"
#: an engine rollsafe knows nothing about: the careful answer to both questions
UNKNOWN_ENGINE = EngineTraits("unknown", False, True)


def engine_traits(
    kind: str | None, dialect: str | None = None, *, weight_transfer_backend: str | None = None
) -> EngineTraits:
    """The traits of engine ``kind`` (``"reference"``, ``"sglang"``, ``"vllm"``) speaking
    ``dialect``; an unknown kind gets :data:`UNKNOWN_ENGINE` (keeps nothing, needs a pause).
    A ``"vllm"`` engine whose ``weight_transfer_backend`` is rollsafe's plugin
    (``"rollsafe_gloo"``) gets :data:`VLLM_GLOO_TRAITS`."""
    kind = kind or "reference"
    if kind == "vllm" and weight_transfer_backend == _GLOO_PLUGIN_BACKEND:
        return VLLM_GLOO_TRAITS
    found = ENGINE_TRAITS.get((kind, dialect)) or ENGINE_TRAITS.get((kind, None))
    if found is None and kind == "reference":
        found = ENGINE_TRAITS.get((kind, "sglang"))
    return found or UNKNOWN_ENGINE


# ====================================================================== health
class Handoff(Enum):
    """Where a failed group goes after the health manager sent ``fail``: nowhere (none
    failed) or queued for the recovery coordinator, whose pool runs the recovery. There is no
    third choice: the probe's executor has no handler for a recovery's effects, so a recovery
    cannot run on the probe thread (``rollsafe verify`` shows what happens if a changed probe
    sequence tried: ``recovery_never_on_health_thread``)."""

    NONE = "none"  # no group failed
    ENQUEUE = "enqueue"  # queued for the recovery coordinator: recovery runs on its own pool


@dataclass(frozen=True)
class ProbeVerdict:
    """What to do with one probe answer of one group."""

    counts: dict[int, int]  # the new consecutive-failure counts (ranks with a count only)
    report_healthy: tuple[int, ...]  # ranks to report healthy (were recorded unhealthy)
    report_unhealthy: tuple[int, ...]  # ranks that reached the threshold
    events: tuple[GroupEvent, ...]
    handoff: Handoff


@sends("HealthManager", "rollsafe/operations/probe.py", WorkerGroupLifecycle=(GroupEvent.FAIL,))
def judge_probe(
    ranks: Sequence[int],
    unhealthy: Sequence[int],
    counts: Mapping[int, int],
    recorded_healthy: Mapping[int, bool],
    threshold: int,
) -> ProbeVerdict:
    """A probe found ``unhealthy`` ranks of a group (empty: all healthy).

    Healthy ranks reset their count (and are reported healthy where the record says otherwise);
    unhealthy ones count one more failure. Any rank at ``threshold`` consecutive failures is
    reported unhealthy and the whole group is sent ``fail`` (never a part of it), and the group
    is queued for recovery: recovery never runs on the probe thread.
    """
    bad = set(unhealthy)
    new_counts = {r: n for r, n in counts.items() if r in bad}
    report_healthy = tuple(r for r in ranks if r not in bad and not recorded_healthy.get(r, False))
    at_threshold: list[int] = []
    for rank in ranks:
        if rank in bad:
            new_counts[rank] = new_counts.get(rank, 0) + 1
            if new_counts[rank] >= threshold:
                at_threshold.append(rank)
    if not at_threshold:
        return ProbeVerdict(new_counts, report_healthy, (), (), Handoff.NONE)
    return ProbeVerdict(
        {}, report_healthy, tuple(at_threshold), (GroupEvent.FAIL,), Handoff.ENQUEUE
    )


@sends("RequestHealth", "rollsafe/fleet/request_health.py", WorkerGroupLifecycle=(GroupEvent.FAIL,))
def judge_request_failures(consecutive: int, threshold: int) -> tuple[GroupEvent, ...]:
    """``consecutive`` requests in a row failed on one incarnation of an active group: at
    ``threshold`` the whole group is sent ``fail`` (and handed to recovery, off this thread)."""
    return (GroupEvent.FAIL,) if consecutive >= threshold else ()


# ====================================================================== recovery
class RecoveryStart(Enum):
    """How a recovery of a group begins."""

    CLAIM = "claim"
    SKIP = "skip"  # the rollout ends before a recovery would
    RETIRE = "retire"  # restart budget spent
    NOT_NEEDED = "not_needed"  # the group is not inactive
    WAIT = "wait"  # a rank of the group is unknown: nothing to restart as a whole yet
    NODE_LOST = "node_lost"  # its placement is gone with its node: placed again, no budget


@dataclass(frozen=True)
class RecoveryGate:
    start: RecoveryStart
    reason: str
    events: tuple[GroupEvent, ...] = ()


@sends(
    "RecoveryCoordinator",
    "rollsafe/operations/recover.py",
    WorkerGroupLifecycle=(GroupEvent.CLAIM, GroupEvent.RETIRE, GroupEvent.NODE_LOST),
)
def gate_recovery(
    state: str,
    *,
    budget_left: bool,
    complete: bool,
    remaining_s: float | None,
    expected_s: float,
    placement_alive: bool | None = None,
) -> RecoveryGate:
    """Whether to recover an ``inactive`` group now: claim it, skip, retire it, or leave it.

    ``placement_alive``: for a group placed on a node (``placement="ray"``), whether its actor
    still answers (None: not placed, or not asked). False means the group's node (or its
    placement) is gone: it is a node loss, not a crash (``node_lost`` -> ``unplaced``: placed
    again, no budget spent), whoever saw the failure first (probes usually see it before
    Ray's own node health check)."""
    if state != "inactive":
        return RecoveryGate(RecoveryStart.NOT_NEEDED, f"group is {state}, not inactive")
    if placement_alive is False:
        return RecoveryGate(
            RecoveryStart.NODE_LOST,
            "its actor does not answer: its node is lost",
            (GroupEvent.NODE_LOST,),
        )
    if remaining_s is not None and remaining_s < expected_s:
        return RecoveryGate(
            RecoveryStart.SKIP,
            f"rollout about to finish: {remaining_s:.1f}s of work left < expected recovery time "
            f"{expected_s:.1f}s",
        )
    if not budget_left:
        return RecoveryGate(RecoveryStart.RETIRE, "restart budget spent", (GroupEvent.RETIRE,))
    if not complete:
        return RecoveryGate(RecoveryStart.WAIT, "a rank of the group is unknown")
    return RecoveryGate(RecoveryStart.CLAIM, "claimed", (GroupEvent.CLAIM,))


class Strategy(str, Enum):
    """How a claimed group gets the current weights back (tried in this order). A ``str``
    enum: a recovery's record carries it and compares equal to its value (``"immediate"``)."""

    IMMEDIATE = "immediate"  # restart from the ready export of the current version
    TARGETED_PUSH = "targeted_push"  # restart on dummy weights, push the registered checkpoint
    DEFERRED = "deferred"  # restart, wait in pending_weights for the next sync


@dataclass(frozen=True)
class ExportFacts:
    """What the exporter says about one export."""

    version: int
    state: str
    leases: int = 0


@dataclass(frozen=True)
class StrategyChoice:
    strategy: Strategy
    export_version: int | None
    reason: str


def choose_strategy(
    *,
    mode_state: str,
    fleet_version: int,
    export: ExportFacts | None,
    can_push: bool,
) -> StrategyChoice:
    """Immediate from a ``ready`` export of the fleet's version when the mode is ``enabled``; else a
    targeted push when a transport can do one; else deferred. A late (abandoned) export, an
    older one or one still being written is never used."""
    if mode_state != "enabled":
        reason = f"immediate recovery {mode_state}"
    elif export is None:
        reason = f"no export of v{fleet_version}"
    elif export.version != fleet_version or export.state != "ready":
        reason = f"export v{export.version} is {export.state}, fleet at v{fleet_version}"
    else:
        return StrategyChoice(Strategy.IMMEDIATE, export.version, f"ready export v{export.version}")
    if can_push:
        return StrategyChoice(Strategy.TARGETED_PUSH, None, reason)
    return StrategyChoice(Strategy.DEFERRED, None, reason)


@dataclass(frozen=True)
class RestartOutcome:
    events: tuple[GroupEvent, ...]
    member_version: int | None  # the version each restarted member reports (None: unknown)


@sends(
    "RecoveryCoordinator",
    "rollsafe/operations/recover.py",
    WorkerGroupLifecycle=(GroupEvent.RESTARTED, GroupEvent.RESTART_FAILED),
)
def after_restart(ok: bool, export_version: int | None) -> RestartOutcome:
    """A restart ended: ``restarted`` with the members at the export's version (immediate) or
    at no known version (dummy weights); ``restart_failed`` when it raised or timed out."""
    if not ok:
        return RestartOutcome((GroupEvent.RESTART_FAILED,), None)
    return RestartOutcome((GroupEvent.RESTARTED,), export_version)


@dataclass(frozen=True)
class TargetedPushPlan:
    """Whether a recovery pushes the registered checkpoint into a restarted group, and why."""

    push: bool
    version: int | None
    reason: str


def plan_targeted_push(
    published: tuple[str, int] | None, fleet_version: int, state: str
) -> TargetedPushPlan:
    """Push the registered checkpoint to a restarted group only when it is the fleet's version
    and the group still waits for weights. (Named ``plan_push`` before issue #28, whose delta
    sync took that name for the per-target delta-or-full decision.)"""
    if published is None or published[1] != fleet_version:
        return TargetedPushPlan(
            False, None, f"no registered checkpoint of v{fleet_version} (published: {published})"
        )
    if state != "pending_weights":
        return TargetedPushPlan(False, None, f"group moved to {state}")
    return TargetedPushPlan(True, published[1], f"push v{published[1]}")


@sends(
    "RecoveryCoordinator",
    "rollsafe/operations/recover.py",
    WorkerGroupLifecycle=(GroupEvent.WEIGHTS_LOADED, GroupEvent.FAIL),
)
def after_push(
    rank_ok: Mapping[int, bool], version: int, *, keeps_weights: bool = True
) -> tuple[GroupEvent, ...]:
    """A targeted push ended: ``weights_loaded`` only when every rank of the group loaded it.
    A failed push leaves the group waiting for the next sync when the engine kept the weights
    it had (``keeps_weights``); otherwise its weights are unknown: ``fail`` (restart it)."""
    if rank_ok and all(rank_ok.values()):
        return (GroupEvent.WEIGHTS_LOADED,)
    return () if keeps_weights else (GroupEvent.FAIL,)


# ====================================================================== sync
ExportJudgement = Literal["none", "on_time", "late", "failed"]


@dataclass(frozen=True)
class ExportVerdict:
    judgement: ExportJudgement
    mode_events: tuple[ModeEvent, ...]
    abandon: bool


@sends(
    "SyncCoordinator",
    "rollsafe/operations/sync.py",
    ImmediateRecoveryMode=(ModeEvent.EXPORT_LATE, ModeEvent.EXPORT_ON_TIME),
    ExportLifecycle=(ExportEvent.ABANDON,),
)
def judge_export(export_state: str | None, mode_state: str | None) -> ExportVerdict:
    """Sync N+1 began: judge the export of N. Still running: late (abandoned, the mode is
    suspended); ready: on time (counts toward re-arming); failed or unknown: nothing."""
    mode_on = mode_state is not None and mode_state != "disabled"
    if export_state in ("requested", "snapshotting", "writing", "committing"):
        return ExportVerdict("late", (ModeEvent.EXPORT_LATE,) if mode_on else (), True)
    if export_state in ("ready", "superseded"):
        return ExportVerdict("on_time", (ModeEvent.EXPORT_ON_TIME,) if mode_on else (), False)
    if export_state is None:
        return ExportVerdict("none", (), False)
    return ExportVerdict("failed", (), False)


def proceed_after_register(published: tuple[str, int] | None, version: int) -> bool:
    """Go on with the sync only when the transport published exactly this version; a failed
    register ends the sync (fleet version unchanged, no update, no export)."""
    return published is not None and published[1] == version


@dataclass(frozen=True)
class GroupFacts:
    """What the fleet knows about one group when a sync decides."""

    group_id: str
    state: str
    ranks: tuple[int, ...]
    unhealthy: tuple[int, ...] = ()
    #: :attr:`EngineTraits.failed_update_keeps_weights` of the group's engine (careful default)
    keeps_weights: bool = False
    #: the weights version each member last reported, in rank order (None: unknown)
    versions: tuple[int | None, ...] = ()


@dataclass(frozen=True)
class TargetSelection:
    targets: tuple[str, ...]
    considered: tuple[str, ...]  # active/pending groups (targeted or not)
    not_targeted: dict[str, str]


#: the states a sync updates: serving, spare (kept at the fleet's version) and behind
_SYNCED = ("active", "standby", "pending_weights")
#: the states a group is ready in (serving or spare) that a sync that misses it leaves behind
_READY = ("active", "standby")


def select_targets(groups: Sequence[GroupFacts]) -> TargetSelection:
    """Update every ``active``, ``standby`` (a spare: kept at the fleet's version) and
    ``pending_weights`` group whose members are all healthy."""
    targets: list[str] = []
    considered: list[str] = []
    skipped: dict[str, str] = {}
    for g in groups:
        if g.state not in _SYNCED:
            skipped[g.group_id] = f"state {g.state}"
            continue
        considered.append(g.group_id)
        if g.unhealthy:
            skipped[g.group_id] = f"unhealthy rank(s) {list(g.unhealthy)}"
            continue
        targets.append(g.group_id)
    return TargetSelection(tuple(targets), tuple(considered), skipped)


UpdateFailurePolicy = Literal["fail", "stale"]


@dataclass(frozen=True)
class Settlement:
    """What a sync does once the update of version N returned."""

    fleet_version: int
    record_version: tuple[str, ...]  # groups whose members now report N
    events: tuple[tuple[str, GroupEvent], ...]  # in this order
    recover: tuple[str, ...]  # groups handed to the recovery coordinator
    updated: tuple[str, ...]
    failed: tuple[str, ...]
    moved: tuple[str, ...]


@sends(
    "SyncCoordinator",
    "rollsafe/operations/sync.py",
    WorkerGroupLifecycle=(GroupEvent.FAIL, GroupEvent.MARK_STALE, GroupEvent.WEIGHTS_LOADED),
)
def settle_update(
    version: int,
    groups: Sequence[GroupFacts],
    targeted: Sequence[str],
    rank_ok: Mapping[str, Mapping[int, bool]],
    moved: Sequence[str] = (),
    on_failure: UpdateFailurePolicy = "fail",
) -> Settlement:
    """Settle the update of version N over the groups considered by :func:`select_targets`.

    A group counts as updated only if every one of its ranks loaded N and it did not move while
    we pushed (``moved``: a new incarnation; never credit it). Only updated groups record N.
    Failed groups are sent ``fail`` and handed to recovery (``"fail"``) or, if ready
    (``active`` or a spare in ``standby``), marked stale (``"stale"``, only for an engine that
    keeps its weights after a failed update: :attr:`GroupFacts.keeps_weights`; any other
    failed group holds unknown weights and is failed and recovered whatever the setting);
    ready groups not updated are marked stale (a spare behind the version is never left in
    ``standby``); pending groups updated are sent ``weights_loaded``. The fleet version
    becomes N.
    """
    moved_set = set(moved)
    updated: list[str] = []
    failed: list[str] = []
    for gid in targeted:
        results = rank_ok.get(gid, {})
        if gid in moved_set:
            continue
        if results and all(results.values()):
            updated.append(gid)
        else:
            failed.append(gid)
    events: list[tuple[str, GroupEvent]] = []
    recover: list[str] = []
    by_id = {g.group_id: g for g in groups}
    for gid in failed:
        if on_failure == "fail" or not by_id[gid].keeps_weights:
            events.append((gid, GroupEvent.FAIL))
            recover.append(gid)
        elif by_id[gid].state in _READY:
            events.append((gid, GroupEvent.MARK_STALE))
    done = set(updated)
    for g in groups:
        if g.group_id in failed or g.group_id in moved_set:
            continue
        if g.state in _READY and g.group_id not in done:
            events.append((g.group_id, GroupEvent.MARK_STALE))
        elif g.state == "pending_weights" and g.group_id in done:
            events.append((g.group_id, GroupEvent.WEIGHTS_LOADED))
    return Settlement(
        fleet_version=version,
        record_version=tuple(updated),
        events=tuple(events),
        recover=tuple(recover),
        updated=tuple(updated),
        failed=tuple(failed),
        moved=tuple(g for g in targeted if g in moved_set),
    )


@sends(
    "SyncCoordinator",
    "rollsafe/operations/sync.py",
    WorkerGroupLifecycle=(GroupEvent.MARK_STALE,),
)
def settle_latecomers(
    version: int, groups: Sequence[GroupFacts], updated: Sequence[str]
) -> tuple[tuple[str, GroupEvent], ...]:
    """Once the fleet version is N, the groups read again: a group ready now (``active``, or a
    spare in ``standby``) that this sync did not update and whose members do not all report N
    came back while the update ran (a restart from the previous version's export ended between
    :func:`select_targets`'s read and the new fleet version) and holds older weights:
    ``mark_stale`` (it waits in ``pending_weights`` for a push). After the new version is set
    no group turns ready below it (the group machine's guards read the fleet version), so one
    read closes the gap.
    """
    done = set(updated)
    return tuple(
        (g.group_id, GroupEvent.MARK_STALE)
        for g in groups
        if g.state in _READY and g.group_id not in done and any(v != version for v in g.versions)
    )


# ====================================================================== retention
@dataclass(frozen=True)
class RetentionPlan:
    supersede: tuple[tuple[int, int], ...]  # (version, newer version)
    delete: tuple[int, ...]
    kept: dict[int, str] = field(default_factory=dict)  # version -> why it stays


@sends(
    "Retention",
    "rollsafe/hf/retention.py",
    ExportLifecycle=(ExportEvent.SUPERSEDE, ExportEvent.DELETE),
)
def plan_retention(exports: Sequence[ExportFacts], keep_last: int) -> RetentionPlan:
    """Keep the newest ``keep_last`` ready exports; supersede older ready ones; delete
    superseded exports that no restart holds a lease on (a leased one stays until released)."""
    ready = sorted((e for e in exports if e.state == "ready"), key=lambda e: -e.version)
    supersede: list[tuple[int, int]] = []
    now_superseded: set[int] = set()
    if ready:
        newest = ready[0].version
        for old in ready[keep_last:]:
            supersede.append((old.version, newest))
            now_superseded.add(old.version)
    delete: list[int] = []
    kept: dict[int, str] = {}
    for e in sorted(exports, key=lambda e: e.version):
        if e.state != "superseded" and e.version not in now_superseded:
            continue
        if e.leases:
            kept[e.version] = f"{e.leases} lease(s) held"
            continue
        delete.append(e.version)
    return RetentionPlan(tuple(supersede), tuple(delete), kept)


# ====================================================================== nodes and removals
@dataclass(frozen=True)
class NodeLossPlan:
    """What a node's death does to the groups placed on it: ``events`` per group id (in the
    order given); groups already out of the picture (``unplaced``, ``retired``) get none."""

    events: tuple[tuple[str, tuple[GroupEvent, ...]], ...]

    @property
    def lost(self) -> tuple[str, ...]:
        """The groups that leave for ``unplaced`` (they wait for a new placement)."""
        return tuple(g for g, evs in self.events if GroupEvent.NODE_LOST in evs)


@sends(
    "NodeWatcher",
    "rollsafe/operations/place.py",
    WorkerGroupLifecycle=(GroupEvent.NODE_LOST, GroupEvent.RETIRE),
)
def on_node_lost(groups: Sequence[tuple[str, str]]) -> NodeLossPlan:
    """A node died with ``groups`` (``(group id, state)``) on it: every one of them leaves
    routing in the same step (``node_lost`` -> ``unplaced``), whatever its state; a group being
    removed (``draining``) is retired instead. No restart budget is spent: the engine did
    nothing wrong."""
    plan: list[tuple[str, tuple[GroupEvent, ...]]] = []
    for gid, state in groups:
        if state == "draining":
            plan.append((gid, (GroupEvent.RETIRE,)))
        elif state in ("unplaced", "retired"):
            plan.append((gid, ()))
        else:
            plan.append((gid, (GroupEvent.NODE_LOST,)))
    return NodeLossPlan(tuple(plan))


@dataclass(frozen=True)
class PlacementGate:
    """Whether to place an ``unplaced`` group now."""

    place: bool
    reason: str


def gate_placement(state: str, *, busy: bool) -> PlacementGate:
    """Place a group only while it is ``unplaced`` and no step of an earlier attempt still
    runs in the background. Placement never spends restart budget and is never retried in a
    loop: a group without room waits until a node joins or a group is removed."""
    if state != "unplaced":
        return PlacementGate(False, f"group is {state}, not unplaced")
    if busy:
        return PlacementGate(False, "a previous attempt's step is still running in the background")
    return PlacementGate(True, "unplaced")


@sends(
    "RecoveryCoordinator", "rollsafe/operations/place.py", WorkerGroupLifecycle=(GroupEvent.PLACED,)
)
def after_placement(placed: bool) -> tuple[GroupEvent, ...]:
    """A placement that found room sends ``placed`` (``unplaced`` -> ``recovering``, budget
    untouched): the restart that follows is recovery's usual one. No room: nothing (it waits)."""
    return (GroupEvent.PLACED,) if placed else ()


@dataclass(frozen=True)
class RemovalPlan:
    """How ``remove_group`` takes a group out: ``drain`` first (out of routing), ``retire``
    after its engine stopped; ``already``: it is retired or being removed."""

    events: tuple[GroupEvent, ...]
    reason: str
    already: bool = False


@sends(
    "RolloutFleet",
    "rollsafe/operations/place.py",
    WorkerGroupLifecycle=(GroupEvent.DRAIN, GroupEvent.RETIRE),
)
def plan_removal(state: str) -> RemovalPlan:
    """A removal drains a live group, then retires it; a removed group never comes back."""
    if state == "retired":
        return RemovalPlan((), "already retired", already=True)
    if state == "draining":
        return RemovalPlan((), "already being removed", already=True)
    return RemovalPlan((GroupEvent.DRAIN,), f"draining from {state}")


@sends("RolloutFleet", "rollsafe/operations/place.py", WorkerGroupLifecycle=(GroupEvent.RETIRE,))
def after_drain() -> tuple[GroupEvent, ...]:
    """A drained group whose engine stopped is retired (final)."""
    return (GroupEvent.RETIRE,)


# ====================================================================== spare groups (issue #37)
#: the states of a serving group out of routing that a spare may take over from: failed
#: (``inactive``, ``recovering``), lost with its node (``unplaced``) or behind the version
#: (``pending_weights``); a group being removed (``draining``) or ``retired`` is not covered
COVERABLE = frozenset({"inactive", "recovering", "unplaced", "pending_weights"})


@dataclass(frozen=True)
class SpareFacts:
    """What the fleet knows of one group when a spare is looked for: its state and role
    (``spare``), its size (``ranks``), whether every member is recorded healthy, each
    member's recorded version, and the node it runs on (None: unknown, or this machine)."""

    group_id: str
    state: str
    spare: bool
    ranks: int
    healthy: bool
    versions: tuple[int | None, ...]
    node: str | None = None


@dataclass(frozen=True)
class CoverPlan:
    """Which spares may take over from ``group``, in the order they are checked (empty: none
    may), and why."""

    group: str
    candidates: tuple[str, ...]
    reason: str

    def swap(self, spare: str) -> tuple[tuple[str, tuple[GroupEvent, ...]], ...]:
        """The events of one cover, sent all or nothing in one registry step: the spare is
        promoted (``standby`` -> ``active``), the covered group enlisted as a spare (its
        recovery refills the pool)."""
        return ((spare, (GroupEvent.PROMOTE,)), (self.group, (GroupEvent.ENLIST,)))


@sends(
    "SparePool",
    "rollsafe/operations/spare.py",
    WorkerGroupLifecycle=(GroupEvent.PROMOTE, GroupEvent.ENLIST),
)
def plan_cover(group: SpareFacts, spares: Sequence[SpareFacts], fleet_version: int) -> CoverPlan:
    """A serving ``group`` left routing: which spares may take over.

    Only a serving group out of routing (:data:`COVERABLE`) is covered. A candidate is a
    spare in ``standby`` of the same size whose members are all recorded healthy and at
    ``fleet_version``; spares on another node than ``group`` come first (a node's loss should
    not take both), then by id. Each is checked against its engine's own word before it is
    promoted (:func:`judge_spare`)."""
    if group.spare:
        return CoverPlan(group.group_id, (), "it is a spare: it covers, it is not covered")
    if group.state not in COVERABLE:
        return CoverPlan(group.group_id, (), f"it is {group.state}: nothing to cover")
    ready = [
        s
        for s in spares
        if s.spare
        and s.state == "standby"
        and s.ranks == group.ranks
        and s.healthy
        and all(v == fleet_version for v in s.versions)
    ]
    if not ready:
        seen = ", ".join(f"{s.group_id}={s.state}" for s in spares if s.spare) or "none"
        return CoverPlan(group.group_id, (), f"no spare ready at v{fleet_version} ({seen})")
    apart = group.node is None
    ready.sort(key=lambda s: (not apart and s.node == group.node, s.group_id))
    names = tuple(s.group_id for s in ready)
    return CoverPlan(group.group_id, names, f"spares ready at v{fleet_version}: {list(names)}")


@dataclass(frozen=True)
class SpareVerdict:
    """The last check of a spare before its promotion: ``promote`` it, or not and why;
    ``events`` to send it (``fail``: its engine holds other weights than the fleet recorded)."""

    promote: bool
    reason: str
    events: tuple[GroupEvent, ...] = ()


@sends("SparePool", "rollsafe/operations/spare.py", WorkerGroupLifecycle=(GroupEvent.FAIL,))
def judge_spare(reported: Sequence[str | None] | None, fleet_version: int) -> SpareVerdict:
    """The spare's engines were asked which weights they serve (``reported``, one per engine
    endpoint; None: no answer in time). Promoted only when every one names ``fleet_version``.
    No answer, or an engine that names none: not promoted (the health probes judge its
    health). An engine that names another version holds weights the fleet did not record:
    ``fail`` (it is recovered like any group)."""
    want = str(fleet_version)
    if reported is None or not reported:
        return SpareVerdict(False, "its engine did not answer the version check")
    if any(v is None for v in reported):
        return SpareVerdict(False, "its engine names no weights version")
    other = sorted({str(v) for v in reported if v != want})
    if other:
        return SpareVerdict(
            False,
            f"its engine serves v{', v'.join(other)}, the fleet recorded v{want}",
            (GroupEvent.FAIL,),
        )
    return SpareVerdict(True, f"its engine serves v{want}")


# ====================================================================== delta sync (issue #28)
PushKind = Literal["delta", "full"]
_DELTA = "DeltaBase"
_LEDGER = ("DeltaSender", "rollsafe/operations/push.py")


@dataclass(frozen=True)
class PushPlan:
    """How one target gets version N: a delta from its confirmed ``base``, or the full weights.

    ``reason`` says why a push is full: ``"forced"`` (a recovery's targeted push, a restarted,
    added or recovered target), ``"disabled"`` (deltas off), ``"engine cannot apply deltas"``
    (the engine kind's declared capability), ``"no base"`` (nothing confirmed for the target
    yet), ``"base vB not held"`` (a lagging target: the sender no longer holds the weights of
    its base), ``"base vB is not older than vN"``, or (set by the transport through
    :meth:`~rollsafe.registry.delta_ledger.DeltaLedger.fallback_full`) ``"delta not
    smaller"``; for a delta it names the base (``"delta v3 -> v4"``).
    """

    kind: PushKind
    base: int | None
    reason: str

    @property
    def event(self) -> DeltaEvent:
        """The :class:`~rollsafe.statemachines.DeltaBase` event that starts this push."""
        return DeltaEvent.SEND_DELTA if self.kind == "delta" else DeltaEvent.SEND_FULL


@sends(*_LEDGER, DeltaBase=(DeltaEvent.SEND_FULL, DeltaEvent.SEND_DELTA))
def plan_push(
    base: int | None,
    version: int,
    held: Collection[int],
    *,
    delta_enabled: bool,
    engine_applies_deltas: bool,
    force_full: bool,
) -> PushPlan:
    """Plan the push of ``version`` to one target whose confirmed base is ``base``.

    A delta only when deltas are on, the engine kind can apply them, the push is not forced
    full, the target has a confirmed base older than ``version`` and the sender still holds
    that base's weights (``held``: the versions it keeps a copy of); otherwise the full
    weights, with the reason (the first that applies, in that order). The sender's base for
    the target moves only when the push is confirmed (:func:`settle_push`), never here.
    """
    if force_full:
        return PushPlan("full", None, "forced")
    if not delta_enabled:
        return PushPlan("full", None, "disabled")
    if not engine_applies_deltas:
        return PushPlan("full", None, "engine cannot apply deltas")
    if base is None:
        return PushPlan("full", None, "no base")
    if base not in held:
        return PushPlan("full", None, f"base v{base} not held")
    if base >= version:
        return PushPlan("full", None, f"base v{base} is not older than v{version}")
    return PushPlan("delta", base, f"delta v{base} -> v{version}")


@sends(
    *_LEDGER,
    DeltaBase=(DeltaEvent.CONFIRM, DeltaEvent.UNCONFIRMED, DeltaEvent.REFUSED),
)
def settle_push(plan: PushPlan, *, ok: bool, refused: bool) -> DeltaEvent:
    """Which :class:`~rollsafe.statemachines.DeltaBase` event a push's outcome sends.

    ``ok``: the target confirmed the result (every rank applied it and its digest matched):
    ``confirm`` (the base becomes the pushed version). ``refused``: the engine refused a delta
    by name (base mismatch, format, digest), nothing changed: ``refused`` (base unchanged).
    Anything else (failed, lost, timed out, a refused full push): ``unconfirmed``; after a
    delta the base stays (an engine applies a delta all or nothing), after a full push it is
    dropped (the engine's weights are unknown).
    """
    if ok:
        return DeltaEvent.CONFIRM
    if refused and plan.kind == "delta":
        return DeltaEvent.REFUSED
    return DeltaEvent.UNCONFIRMED


# ====================================================================== launch
@sends("RolloutFleet", "rollsafe/fleet/fleet.py", WorkerGroupLifecycle=(GroupEvent.LAUNCHED,))
def launch_events(recorded_healthy: Mapping[int, bool]) -> tuple[GroupEvent, ...]:
    """A launched group is sent ``launched`` once every member reported healthy."""
    if recorded_healthy and all(recorded_healthy.values()):
        return (GroupEvent.LAUNCHED,)
    return ()


# ====================================================================== senders outside the policy
def _declare(component: str, module: str, machine: str, events: Sequence[AnyEvent]) -> None:
    _senders.append(Sender(component, module, machine, tuple(e.value for e in events)))


_declare(
    "WeightTransport",
    "rollsafe/transports/base.py",
    _REG,
    tuple(RegistrationEvent),
)
_declare(
    "HFExporter",
    "rollsafe/hf/exporter.py",
    _EX,
    (
        ExportEvent.ADOPT,
        ExportEvent.SNAPSHOT,
        ExportEvent.SNAPSHOT_DONE,
        ExportEvent.SHARDS_WRITTEN,
        ExportEvent.PUBLISH,
        ExportEvent.FAIL,
    ),
)
_declare(*_LEDGER, _DELTA, (DeltaEvent.FALLBACK_FULL, DeltaEvent.RESET))
_declare(
    "RolloutFleet config",
    "rollsafe/fleet/fleet.py",
    _MODE,
    (ModeEvent.ENABLE, ModeEvent.DISABLE),
)

#: Who sends which events to which machine: the decision functions above (``decided_by``) and
#: the senders outside the policy. ``rollsafe diagrams`` draws the overview from it.
SENDERS: tuple[Sender, ...] = tuple(_senders)


# ====================================================================== exports across nodes
class ExportAccess(Enum):
    """How the engines of a fleet reach an export written on the trainer's node
    (``docs/cluster.md`` section 5)."""

    LOCAL = "local"  # every engine is on the trainer's machine (placement "local")
    SHARED = "shared"  # export_root is declared (and checked) the same on every node
    MOVED = "moved"  # a restart elsewhere gets the export moved to its node's disk first


def export_access(*, placement: str, shared: bool) -> ExportAccess:
    """``placement="local"``: the engines read the trainer's path; ``"ray"`` with a shared
    ``export_root``: every node reads it; otherwise a restart from an export moves it to the
    group's node first (checked against its manifest there before it is loaded)."""
    if placement != "ray":
        return ExportAccess.LOCAL
    return ExportAccess.SHARED if shared else ExportAccess.MOVED


#: the share of a recovery attempt's remaining time its ``pull`` step may take (moved mode)
PULL_SHARE = 0.5


def pull_budget_s(remaining_s: float) -> float:
    """How long the ``pull`` step may take when ``remaining_s`` of the attempt are left:
    :data:`PULL_SHARE` of it, so a pull that does not finish (a node whose object store or
    actor is stuck) still leaves the fallback -- dummy weights and a targeted push -- the
    rest of the attempt instead of failing the whole recovery on the deadline."""
    return max(0.0, remaining_s) * PULL_SHARE


def after_pull(ok: bool, why: str, *, version: int, can_push: bool) -> StrategyChoice:
    """The leased export was (``ok``) or was not moved to the group's node: restart from the
    checked copy (immediate); else dummy weights and a targeted push of the registered
    checkpoint (deferred without a transport for it), the reason naming why. Bytes that did
    not match the manifest are never loaded."""
    if ok:
        return StrategyChoice(Strategy.IMMEDIATE, version, f"export v{version} moved and checked")
    reason = f"export v{version} could not be moved to the group's node ({why})"
    if can_push:
        return StrategyChoice(Strategy.TARGETED_PUSH, None, f"{reason}: dummy weights and a push")
    return StrategyChoice(Strategy.DEFERRED, None, f"{reason}: waits for the next sync")

"""One recovery attempt on an ``inactive`` group, written once (``docs/design.md``, "Operations").

:func:`attempt` is the sequence, top-down; every decision in it is :mod:`rollsafe.policy`'s and
every step of I/O is an effect its executor performs
(:class:`rollsafe.fleet.recovery.RecoveryCoordinator` on the real fleet,
:class:`rollsafe.verify.FleetModel` in ``rollsafe verify``). It is four
phases, each its own generator so that the verifier can let the rest of the fleet move between
them (a sync, a crash, retention), as it does between the fleet's threads:

1. :func:`claim` -- **gate** (:func:`~rollsafe.policy.gate_recovery`): a step of an earlier
   attempt still running in the background, not inactive, skip (the rollout ends first),
   retire (budget spent), wait (a rank unknown), node lost (a placed group whose actor does
   not answer: ``node_lost``, then :mod:`rollsafe.operations.place` places it, no budget
   spent), or **claim** (``inactive`` -> ``recovering``);
2. :func:`take_lease` -- **strategy** (:func:`~rollsafe.policy.choose_strategy`): immediate
   from the ready export of the fleet's version (a lease is taken on it) or a dummy restart;
   where the group's node cannot read the trainer's path (``moved``: a Ray-placed group
   without shared exports) the export is **pulled** to that node first (:class:`PullExport`,
   checked against its manifest there) and the restart loads the copy; a pull refused or
   failed falls back to a dummy restart (:func:`~rollsafe.policy.after_pull`, the reason in
   the ``strategy`` step);
3. :func:`restart` -- **launcher**, **shutdown**, **restart** (from the export, or on dummy
   weights), **health**, each of which may fail or time out: then ``restart_failed`` and the
   lease released (by a restart that timed out: only once it has ended in the background,
   since it may still be loading from the export); else the members report the export's
   version (or none) and ``restarted`` takes the group to ``active`` (immediate, done) or
   ``pending_weights``, and the lease is released;
4. :func:`push` -- the **targeted push** of the registered checkpoint, under the transport's
   lock (:func:`push_locked`: :func:`~rollsafe.policy.plan_targeted_push`, the push,
   :func:`~rollsafe.policy.after_push`): loaded -> ``weights_loaded`` (``active``); a failed
   or cut-short push on an engine that keeps no known weights -> ``fail`` (restarted again);
   otherwise **deferred**: the group waits in ``pending_weights`` for the next sync.

The attempt returns an :class:`AttemptEnd`; retrying (budget permitting) is the executor's loop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import rollsafe.policy as policy
from rollsafe.operations.effects import (
    AwaitHealthy,
    Failed,
    GetEngine,
    Leased,
    NoteStep,
    Ok,
    PullExport,
    PushEnd,
    PushUnderLock,
    ReadPushFacts,
    ReadRecovery,
    ReadStrategy,
    ReleaseLease,
    ReportMembers,
    Restart,
    SendGroup,
    Steps,
    StopEngine,
    TakeLease,
    TargetedPush,
    TimedOut,
    ask,
    read,
)
from rollsafe.statemachines.events import GroupEvent

__all__ = [
    "AttemptEnd",
    "RecoveryStatus",
    "attempt",
    "claim",
    "push",
    "push_locked",
    "restart",
    "take_lease",
]

#: How an attempt, and so a recovery, ended. ``active``: serving the current version;
#: ``standby``: a spare ready at the current version (back in the pool, never routed until
#: promoted); ``pending_weights``: up and waiting for the next sync (deferred); ``skipped``:
#: not attempted (the rollout ends first); ``retired``: restart budget spent; ``failed``:
#: every attempt failed, the group is ``inactive``; ``not_needed``: the group was not
#: ``inactive`` when the recovery started; ``unplaced``: its node is lost and no node has room
#: (it waits).
RecoveryStatus = Literal[
    "active",
    "standby",
    "pending_weights",
    "skipped",
    "retired",
    "failed",
    "not_needed",
    "unplaced",
]
Strategy = policy.Strategy


@dataclass(frozen=True)
class AttemptEnd:
    """How one attempt ended. ``retry``: another attempt may follow at once (budget
    permitting); ``timed_out``: a step ran past its deadline (the executor retries once that
    step has ended in the background). ``strategy`` / ``export_version``: None when the attempt
    did not get that far."""

    status: RecoveryStatus
    reason: str
    strategy: Strategy | None = None
    export_version: int | None = None
    retry: bool = False
    timed_out: bool = False


def attempt(group: str, traits: policy.EngineTraits, *, retried: bool = False) -> Steps[AttemptEnd]:
    """The steps of one recovery attempt on ``group`` (an engine of ``traits``); ``retried``:
    an earlier attempt of the same recovery failed."""
    end = yield from claim(group, retried=retried)
    if end is not None:
        return end
    lease = yield from take_lease(group)
    end = yield from restart(group, lease)
    if end is not None:
        return end
    return (yield from push(group, traits))


# ====================================================================== 1. claim
def claim(group: str, *, retried: bool = False) -> Steps[AttemptEnd | None]:
    """Gate and claim ``group``: None when it is ``recovering`` now (claimed), else the end."""
    facts = yield from read(ReadRecovery(group))
    if facts.busy:
        return AttemptEnd("failed", "a previous attempt's step is still running in the background")
    gate = policy.gate_recovery(
        facts.state,
        budget_left=facts.budget_left,
        complete=facts.complete,
        remaining_s=facts.remaining_s,
        expected_s=facts.expected_s,
        placement_alive=facts.placement_alive,
    )
    if gate.start is policy.RecoveryStart.NOT_NEEDED:
        if retried:
            return AttemptEnd("failed", f"group left inactive meanwhile ({facts.state})")
        return AttemptEnd("not_needed", gate.reason)
    if gate.start is policy.RecoveryStart.SKIP:
        yield NoteStep("skip", True, gate.reason)
        return AttemptEnd("skipped", gate.reason)
    if gate.start is policy.RecoveryStart.WAIT:
        yield NoteStep("claim", False, gate.reason)
        return AttemptEnd("failed", f"claim refused: {gate.reason}")
    for event in gate.events:
        sent = yield from ask(SendGroup(group, event, "gate_recovery"))
        if not isinstance(sent, Ok):
            yield NoteStep("claim", False, sent.error)
            return AttemptEnd("failed", f"claim refused: {sent.error}")
    if gate.start is policy.RecoveryStart.NODE_LOST:
        yield NoteStep("node_lost", True, gate.reason)
        return AttemptEnd("unplaced", gate.reason, retry=True)
    if gate.start is policy.RecoveryStart.RETIRE:
        yield NoteStep("claim", False, gate.reason)
        yield NoteStep("retire", True, gate.reason)
        return AttemptEnd("retired", f"restart budget of {facts.initial_budget} spent; retired")
    claimed = yield from read(ReadRecovery(group))
    yield NoteStep("claim", True, f"budget left {claimed.budget}")
    return None


# ====================================================================== 2. strategy
def take_lease(group: str) -> Steps[Leased | None]:
    """Choose the strategy; for an immediate restart lease the export (None: restart on dummy
    weights)."""
    facts = yield from read(ReadStrategy())
    if facts is None:  # immediate recovery is not configured
        return None
    choice = policy.choose_strategy(
        mode_state=facts.mode_state,
        fleet_version=facts.fleet_version,
        export=facts.export,
        can_push=facts.can_push,
    )
    if choice.strategy is not policy.Strategy.IMMEDIATE or choice.export_version is None:
        yield NoteStep("lease", False, choice.reason)
        return None
    taken = yield from ask(TakeLease(choice.export_version, f"recovery:{group}"))
    if not isinstance(taken, Ok):
        yield NoteStep("lease", False, taken.error)
        return None
    lease: Leased = taken.value
    yield NoteStep("lease", True, f"export v{lease.version} at {lease.path}")
    if not facts.moved:
        return lease
    # the group's node cannot read the trainer's path: move the export there, checked
    pulled = yield from ask(PullExport(group, lease))
    why = "" if isinstance(pulled, Ok) else pulled.error
    after = policy.after_pull(
        isinstance(pulled, Ok), why, version=lease.version, can_push=facts.can_push
    )
    if after.strategy is policy.Strategy.IMMEDIATE and isinstance(pulled, Ok):
        return dataclasses.replace(lease, path=pulled.value.path)
    yield NoteStep("strategy", False, after.reason)
    yield ReleaseLease(lease)
    return None


# ====================================================================== 3. restart
def restart(group: str, lease: Leased | None) -> Steps[AttemptEnd | None]:
    """Restart the claimed ``group`` (from ``lease``'s export, or on dummy weights): None when
    it is ``pending_weights`` now (a push follows), else the end. The lease is always released:
    at once, or -- by a restart that timed out -- once that restart has ended."""
    strategy = Strategy.IMMEDIATE if lease is not None else Strategy.TARGETED_PUSH
    version = lease.version if lease is not None else None
    path = lease.path if lease is not None else None
    for step in (
        GetEngine(group),
        StopEngine(group, keep_standby=True),
        Restart(group, path, version),
        AwaitHealthy(group),
    ):
        outcome = yield from ask(step)
        if not isinstance(outcome, Ok):
            # a restart that began and timed out still runs, loading from the export
            late = isinstance(outcome, TimedOut) and outcome.started and isinstance(step, Restart)
            return (yield from _restart_failed(group, lease, outcome, strategy, late=late))
    restarted = policy.after_restart(True, version)
    yield ReportMembers(group, restarted.member_version, healthy=True)
    target: str | None = None
    for event in restarted.events:
        sent = yield from ask(SendGroup(group, event, "after_restart"))
        if not isinstance(sent, Ok):
            yield NoteStep("restarted", False, sent.error)
            refused = Failed(f"restarted refused: {sent.error}")
            return (yield from _restart_failed(group, lease, refused, strategy))
        target = sent.value
    yield NoteStep("restarted", True, f"-> {target}")
    if lease is not None:
        yield ReleaseLease(lease)
    ready = _ready(target)
    if ready is None:
        return None
    if lease is not None:
        return AttemptEnd(
            ready, f"restarted from the ready export of v{lease.version}", strategy, version
        )
    return AttemptEnd(ready, "restarted at the current version", strategy)


def _ready(state: str | None) -> Literal["active", "standby"] | None:
    """The status of a group ready at the current version in ``state``: ``active`` (serving)
    or ``standby`` (a spare, back in the pool); None when it is not ready."""
    if state == "active":
        return "active"
    if state == "standby":
        return "standby"
    return None


def _restart_failed(
    group: str,
    lease: Leased | None,
    outcome: Failed | TimedOut,
    strategy: Strategy,
    *,
    late: bool = False,
) -> Steps[AttemptEnd]:
    """A restart step failed or timed out: ``restart_failed`` (when the group is still
    ``recovering``), the lease released (``late``: once the timed-out restart has ended)."""
    facts = yield from read(ReadRecovery(group))
    if facts.state == "recovering":
        for event in policy.after_restart(False, None).events:
            yield SendGroup(group, event, "after_restart")
    if lease is not None:
        yield ReleaseLease(lease, once_restart_ends=late)
    timed_out = isinstance(outcome, TimedOut)
    return AttemptEnd(
        "failed",
        outcome.error,
        strategy,
        lease.version if lease is not None else None,
        retry=not timed_out,
        timed_out=timed_out,
    )


# ====================================================================== 4. push
def push(group: str, traits: policy.EngineTraits) -> Steps[AttemptEnd]:
    """Push the fleet's registered checkpoint to the restarted (``pending_weights``) ``group``
    only; defer to the next sync when it cannot happen."""
    keeps = traits.failed_update_keeps_weights
    facts = yield from read(ReadRecovery(group))
    if not facts.can_push:
        return (yield from _defer(group, "no transport for a targeted push", note=True))
    section = yield from ask(PushUnderLock(group, keeps))
    if isinstance(section, Ok):
        end = section.value
        if end.result == "loaded":
            return AttemptEnd(
                _ready(end.state) or "active",
                f"targeted push of v{end.version} loaded",
                Strategy.TARGETED_PUSH,
            )
        if end.result == "poisoned":
            return AttemptEnd(
                "failed",
                f"targeted push failed ({end.why}) and a {traits.kind} engine keeps no known "
                "weights after a failed update: restarting it",
                Strategy.TARGETED_PUSH,
                retry=True,
            )
        if end.result != "cut_short":
            return (yield from _defer(group, end.why, note=end.result == "deferred"))
        why, timed_out = end.why, end.timed_out
    else:
        why, timed_out = section.error, isinstance(section, TimedOut)
    if keeps:  # up on dummy weights (not routable): it waits for the next sync
        return (yield from _defer(group, why, note=False))
    # a push cut short leaves this engine's weights unknown: restart it
    now = yield from read(ReadRecovery(group))
    if now.state in ("active", "pending_weights"):
        yield SendGroup(group, GroupEvent.FAIL, "after_push")
    return AttemptEnd(
        "failed",
        f"targeted push did not finish ({why}): its weights are unknown, restarting",
        Strategy.TARGETED_PUSH,
        retry=not timed_out,
        timed_out=timed_out,
    )


def push_locked(group: str, keeps_weights: bool) -> Steps[PushEnd]:
    """The push itself, run under the transport's lock (no sync registers or updates
    meanwhile): plan it, push, settle it."""
    facts = yield from read(ReadPushFacts(group))
    plan = policy.plan_targeted_push(facts.published, facts.fleet_version, facts.state)
    if not plan.push or plan.version is None:
        return PushEnd("deferred", plan.reason)
    pushed = yield from ask(TargetedPush(group, plan.version))
    if not isinstance(pushed, Ok):
        timed_out = isinstance(pushed, TimedOut)
        return PushEnd("cut_short", pushed.error, plan.version, True, timed_out)
    if pushed.value.refused:
        return PushEnd("refused", pushed.value.why, plan.version, True)
    events = policy.after_push(pushed.value.rank_ok, plan.version, keeps_weights=keeps_weights)
    why = pushed.value.why or "no result"
    if GroupEvent.FAIL in events:  # its weights are unknown now: restart it
        for event in events:
            yield SendGroup(group, event, "after_push")
        return PushEnd("poisoned", why, plan.version, True)
    if not events:
        return PushEnd("deferred", f"push failed: {why}", plan.version, True)
    yield ReportMembers(group, plan.version)
    state: str | None = None
    for event in events:
        sent = yield from ask(SendGroup(group, event, "after_push"))
        if not isinstance(sent, Ok):
            return PushEnd("cut_short", sent.error, plan.version, True)
        state = sent.value
    return PushEnd("loaded", "", plan.version, True, state=state)


def _defer(group: str, why: str, *, note: bool) -> Steps[AttemptEnd]:
    """No push now: the group waits for the next sync (or a sync updated it meanwhile)."""
    if note:
        yield NoteStep("push", False, why)
    facts = yield from read(ReadRecovery(group))
    deferred = Strategy.DEFERRED
    ready = _ready(facts.state)
    if ready is not None:  # a sync updated it meanwhile
        return AttemptEnd(ready, f"updated by a sync ({why})", deferred)
    if facts.state == "pending_weights":
        return AttemptEnd("pending_weights", f"deferred to the next sync: {why}", deferred)
    return AttemptEnd("failed", f"group is {facts.state} after its restart ({why})", deferred)

"""One weight sync of version N, written once (``docs/design.md``, "Operations").

:func:`sync` is the sequence, top-down; every decision in it is :mod:`rollsafe.policy`'s and
every step of I/O is an effect its executor performs (:class:`rollsafe.fleet.sync.SyncCoordinator`
on the real fleet, :class:`rollsafe.verify.FleetModel` in ``rollsafe verify``):

1. **judge the previous export** once: still running -> late (mode ``export_late``, the
   export abandoned); ready -> on time (``export_on_time``); failed -> nothing;
2. **register** N with the transport (under the transport's lock); a failed register, or one
   that did not publish N, ends the sync: nothing published, no group touched, no export;
3. **pause** health checks (and generation), run ``offload_trainer`` and ``onload_engines``;
   a failing hook ends the sync before anything is updated;
4. **update** every ``active`` / ``pending_weights`` group whose members are all healthy, in
   one transport update (an update that fails as a whole fails every target);
5. **settle**: updated groups record N and the fleet version becomes N (one step), the
   settlement's events are sent (``fail`` / ``mark_stale`` / ``weights_loaded``); the groups
   are read again and one that came back ``active`` below N while the update ran is marked
   stale (``settle_latecomers``) and handed over for the targeted push of N alone; failed
   groups are handed to recovery; the transport's lock is released;
6. ``onload_trainer``, **resume**; when the trainer's tensors are back, **start the export**
   of N.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import rollsafe.policy as policy
from rollsafe.operations.effects import (
    AbandonExport,
    ExportJudged,
    HandOff,
    Hook,
    LockTransport,
    ObserveExport,
    Ok,
    Pause,
    PrepareTargets,
    ReadGroups,
    RecordVersions,
    Register,
    Resume,
    SendGroup,
    SendMode,
    StartExport,
    Steps,
    UnlockTransport,
    Update,
    UpdateDone,
    ask,
    read,
)
from rollsafe.statemachines.events import GroupEvent
from rollsafe.text import bound_text

__all__ = ["SyncResult", "sync"]

_MAX_ERROR = 1024


@dataclass(frozen=True)
class SyncResult:
    """What one sync decided and saw (the executor adds its timings and per-target reports).

    ``ok``: the fleet moved to N (the update ran; groups may still have failed); False when
    the register or a pre-update hook failed. ``error``: why not, or the ``onload_trainer``
    failure that kept the export from starting.
    """

    version: int
    ok: bool = False
    error: str | None = None
    previous_export: policy.ExportJudgement = "none"
    fleet_version: int | None = None  # None: unchanged
    not_targeted: Mapping[str, str] = field(default_factory=dict)
    updated: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    failed_groups: tuple[str, ...] = ()  # sent ``fail``
    marked_stale: tuple[str, ...] = ()
    weights_loaded: tuple[str, ...] = ()
    handed_off: tuple[str, ...] = ()
    #: marked stale by ``settle_latecomers`` (back below N during the update), each handed
    #: over for the targeted push of N
    latecomers: tuple[str, ...] = ()
    export_started: bool = False
    export_error: str | None = None


def sync(version: int, *, on_failure: policy.UpdateFailurePolicy = "fail") -> Steps[SyncResult]:
    """The steps of one sync of ``version`` (the fleet's ``on_update_failure`` setting)."""
    judged = yield from judge_previous_export(version)

    yield LockTransport()
    registered = yield from ask(Register(version))
    if not isinstance(registered, Ok):
        yield UnlockTransport()
        error = f"register of v{version} failed: {registered.error}"
        return SyncResult(version, error=bound_text(error, _MAX_ERROR), previous_export=judged)
    if not policy.proceed_after_register(registered.value, version):
        yield UnlockTransport()
        error = f"register of v{version} did not publish it ({registered.value})"
        return SyncResult(version, error=error, previous_export=judged)

    yield Pause()
    for name in ("offload_trainer", "onload_engines"):
        hooked = yield from ask(Hook(name))
        if not isinstance(hooked, Ok):  # nothing was updated: the fleet stays at its version
            yield UnlockTransport()
            yield Resume()
            error = bound_text(f"{name} failed: {hooked.error}", _MAX_ERROR)
            return SyncResult(version, error=error, previous_export=judged)

    facts = yield from read(ReadGroups())
    selection = policy.select_targets(facts)
    by_id = {f.group_id: f for f in facts}
    not_targeted = dict(selection.not_targeted)
    targets = tuple(by_id[gid] for gid in selection.targets)
    if targets:
        prepared = yield from ask(PrepareTargets(targets))
        not_targeted.update(prepared.value if isinstance(prepared, Ok) else {})
        targets = tuple(t for t in targets if t.group_id not in not_targeted)
    done = UpdateDone({})
    if targets:
        pushed = yield from ask(Update(version, targets))
        if isinstance(pushed, Ok):
            done = pushed.value
        else:  # the update failed as a whole (a collective set-up, a deadline): every target
            done = UpdateDone({t.group_id: dict.fromkeys(t.ranks, False) for t in targets})
    targeted = tuple(t.group_id for t in targets)
    settlement = policy.settle_update(
        version,
        [by_id[gid] for gid in selection.considered],
        targeted,
        done.rank_ok,
        tuple(done.moved),
        on_failure,
    )
    for gid in settlement.moved:
        # it moved while we pushed: its members describe a new incarnation, never credit it
        not_targeted[gid] = f"moved to {done.moved[gid]} during the update"
    yield RecordVersions(settlement.record_version, version, settlement.fleet_version)
    sent: dict[GroupEvent, list[str]] = {}
    for gid, event in settlement.events:
        outcome = yield from ask(SendGroup(gid, event, "settle_update"))
        if isinstance(outcome, Ok):  # else it moved meanwhile (failed, for instance)
            sent.setdefault(event, []).append(gid)
    # a group that came back ``active`` during the update, below N (docs/design.md, "Sync")
    now = yield from read(ReadGroups())
    late: list[str] = []
    for gid, event in policy.settle_latecomers(version, now, settlement.updated):
        outcome = yield from ask(SendGroup(gid, event, "settle_latecomers"))
        if isinstance(outcome, Ok):
            sent.setdefault(event, []).append(gid)
            late.append(gid)
    handed = tuple(g for g in settlement.recover if g in sent.get(GroupEvent.FAIL, ()))
    for gid in handed:
        yield HandOff(gid)
    for gid in late:  # up at N-1: the push of N, now, not at the next sync
        yield HandOff(gid, push_only=True)
    yield UnlockTransport()

    trainer = yield from ask(Hook("onload_trainer"))
    yield Resume()
    result = SyncResult(
        version,
        ok=True,
        previous_export=judged,
        fleet_version=settlement.fleet_version,
        not_targeted=not_targeted,
        updated=settlement.updated,
        failed=settlement.failed,
        failed_groups=tuple(sent.get(GroupEvent.FAIL, ())),
        marked_stale=tuple(sent.get(GroupEvent.MARK_STALE, ())),
        weights_loaded=tuple(sent.get(GroupEvent.WEIGHTS_LOADED, ())),
        handed_off=handed,
        latecomers=tuple(late),
    )
    if not isinstance(trainer, Ok):  # the fleet moved on, but the tensors are not there
        error = bound_text(f"onload_trainer failed: {trainer.error}", _MAX_ERROR)
        return replace(result, error=error)

    started = yield from ask(StartExport(version))
    if isinstance(started, Ok):
        return replace(result, export_started=bool(started.value))
    return replace(result, export_error=bound_text(started.error, _MAX_ERROR))


def judge_previous_export(version: int) -> Steps[policy.ExportJudgement]:
    """Sync ``version`` began: judge the previous export once, by the policy."""
    seen = yield from ask(ObserveExport())
    if not isinstance(seen, Ok) or seen.value is None:
        return "none"
    export = seen.value
    verdict = policy.judge_export(export.state, export.mode_state)
    yield ExportJudged(export.version, verdict.judgement, export.state)
    for event in verdict.mode_events:
        yield SendMode(event, "judge_export")
    if verdict.abandon:
        yield AbandonExport(export.version, f"sync v{version} began first")
    return verdict.judgement

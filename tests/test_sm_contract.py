"""The machines' public contract (names, arguments, errors) as users and checks rely on it."""

from __future__ import annotations

import itertools
import threading

import pytest
from statemachine.exceptions import TransitionNotAllowed

from rollsafe import (
    CheckpointRegistration,
    ExportLifecycle,
    ImmediateRecoveryMode,
    WorkerGroupLifecycle,
)
from rollsafe.statemachines import DeltaBase, LeaseError, MissingGuardInput, TransitionRefused

DESIGN_STATES: dict[type, tuple[str, str]] = {
    WorkerGroupLifecycle: (
        "launching active inactive recovering pending_weights retired",
        "launched fail claim restarted restart_failed mark_stale weights_loaded retire",
    ),
    ExportLifecycle: (
        "requested snapshotting writing committing ready superseded deleted failed abandoned",
        "adopt snapshot snapshot_done shards_written publish supersede delete fail abandon",
    ),
    CheckpointRegistration: (
        "empty registering registered updating failed",
        "begin_register register_ok register_failed begin_update update_done",
    ),
    ImmediateRecoveryMode: (
        "disabled enabled suspended",
        "enable disable export_late export_on_time",
    ),
}


#: names added by an issue on top of the design's (every design name is kept as it is): issue
#: #25 (the fleet across nodes) gives a group a node to lose and a removal that drains it
#: (``docs/cluster.md``, section 8); issue #28 (delta sync) adds a machine, the sender's base
#: version per target (its names fixed by the issue's agreed interface; ``fallback_full`` is
#: the transport's switch of a planned delta to a full push of the same version); issue #37
#: (spare groups) adds the spare's ``standby`` state (a name the issue fixes), its promotion
#: and the enlisting of the group it covers
ISSUE_ADDITIONS: dict[type, tuple[str, str]] = {
    WorkerGroupLifecycle: ("unplaced draining standby", "node_lost placed drain promote enlist"),
    DeltaBase: (
        "no_base based sending_full sending_delta",
        "send_full send_delta fallback_full confirm unconfirmed refused reset",
    ),
}


@pytest.mark.parametrize(
    "cls",
    [*DESIGN_STATES, *(c for c in ISSUE_ADDITIONS if c not in DESIGN_STATES)],
    ids=lambda c: c.__name__,
)
def test_state_and_event_names_are_exactly_the_design(cls: type) -> None:
    states, events = DESIGN_STATES.get(cls, ("", ""))
    added_states, added_events = ISSUE_ADDITIONS.get(cls, ("", ""))
    assert set(states.split()).isdisjoint(added_states.split())
    assert {s.id for s in cls.states} == set(states.split()) | set(added_states.split())
    assert {str(e) for e in cls._events} == set(events.split()) | set(added_events.split())
    assert cls.__doc__ and "Invariants" in cls.__doc__


def test_the_design_transitions_of_a_group_are_unchanged_by_the_additions() -> None:
    """Every transition the design lists is still there, from the same sources to the same
    targets; the additions only add transitions (``retire`` still takes any non-final state;
    the spares' ones all touch ``standby``)."""
    design = {
        "launched": {("launching", "active"), ("launching", "pending_weights")},
        "fail": {
            ("launching", "inactive"),
            ("active", "inactive"),
            ("pending_weights", "inactive"),
        },
        "claim": {("inactive", "recovering")},
        "restarted": {("recovering", "active"), ("recovering", "pending_weights")},
        "restart_failed": {("recovering", "inactive")},
        "mark_stale": {("active", "pending_weights")},
        "weights_loaded": {("pending_weights", "active")},
    }
    have: dict[str, set[tuple[str, str]]] = {}
    for state in WorkerGroupLifecycle.states:
        for t in state.transitions:
            for event in t.events:
                have.setdefault(str(event), set()).add((t.source.id, t.target.id))
    for event, pairs in design.items():
        assert pairs <= have[event], event
        # issue #37's spares only add transitions into or out of ``standby``
        assert all("standby" in pair for pair in have[event] - pairs), event
    non_final = {s.id for s in WorkerGroupLifecycle.states if not s.final}
    assert have["retire"] == {(s, "retired") for s in non_final}


def _group(ranks: list[int] | None = None, **kw: object) -> WorkerGroupLifecycle:
    return WorkerGroupLifecycle(ranks or [0, 1], group_id="g", **kw)  # type: ignore[arg-type]


def _healthy(g: WorkerGroupLifecycle, version: int | None) -> None:
    for r in g.ranks:
        g.report_member(r, healthy=True, weights_version=version)


def test_worker_group_launch_paths() -> None:
    g = _group()
    assert g.state == "launching" and not g.is_routable
    _healthy(g, 3)
    g.launched(current_version=3)
    assert g.state == "active" and g.is_routable
    g2 = _group()
    _healthy(g2, 2)
    g2.send("launched", current_version=3)
    assert g2.state == "pending_weights" and not g2.is_routable


def test_worker_group_refusal_names_guard_and_changes_nothing() -> None:
    g = _group()
    g.report_member(0, healthy=True, weights_version=1)
    before = (g.state, g.members, len(g.history))
    with pytest.raises(TransitionRefused) as info:
        g.launched(current_version=1)
    assert isinstance(info.value, TransitionNotAllowed)
    message = str(info.value)
    assert "all_members_healthy" in message and "launching" in message and "(1,)" in message
    assert (g.state, g.members, len(g.history)) == before


def test_worker_group_claim_consumes_budget_until_retired() -> None:
    g = _group(restart_budget=1)
    g.fail()
    g.claim()
    assert g.restart_budget == 0 and g.state == "recovering"
    assert all(not m.healthy and m.weights_version is None for m in g.members.values())
    g.restart_failed()
    with pytest.raises(TransitionRefused, match="restart_budget_left"):
        g.claim()
    g.retire()
    assert g.state == "retired"
    with pytest.raises(TransitionNotAllowed):
        g.fail()


def test_worker_group_claim_needs_every_rank_known() -> None:
    g = _group()
    g.fail()
    g.forget_member(1)
    with pytest.raises(TransitionRefused, match="group_complete"):
        g.claim()
    g.report_member(1, healthy=False)
    g.claim()
    assert g.state == "recovering"


def test_worker_group_bad_input() -> None:
    g = _group()
    with pytest.raises(ValueError, match="rank 7 is not a member"):
        g.report_member(7, healthy=True)
    with pytest.raises(MissingGuardInput, match="current_version"):
        _healthy(g, 1) or g.launched()
    assert g.state == "launching"
    with pytest.raises(ValueError, match="repeated"):
        WorkerGroupLifecycle([1, 1])
    with pytest.raises(ValueError, match="at least one rank"):
        WorkerGroupLifecycle([])


def test_mark_stale_and_weights_loaded() -> None:
    g = _group()
    _healthy(g, 1)
    g.launched(current_version=1)
    with pytest.raises(TransitionRefused, match="behind_current_version"):
        g.mark_stale(current_version=1)
    g.mark_stale(current_version=2)
    assert g.state == "pending_weights"
    g.report_member(0, healthy=True, weights_version=2)
    with pytest.raises(TransitionRefused, match="all_at_current_version"):
        g.weights_loaded(current_version=2)
    g.report_member(1, healthy=True, weights_version=2)
    g.weights_loaded(current_version=2)
    assert g.state == "active"


def test_history_records_guard_inputs_and_is_bounded() -> None:
    g = _group()
    _healthy(g, 5)
    g.launched(current_version=5)
    rec = g.history[-1]
    assert (rec.event, rec.source, rec.target) == ("launched", "launching", "active")
    inputs = dict(rec.inputs)
    assert inputs["current_version"] == 5 and inputs["versions"] == (5, 5)
    assert rec.timestamp > 0 and rec.as_dict()["inputs"]["versions"] == [5, 5]
    for _ in range(WorkerGroupLifecycle.history_limit):
        g.mark_stale(current_version=6)
        g.weights_loaded(current_version=5)
    assert len(g.history) == WorkerGroupLifecycle.history_limit
    assert g.history[-1].seq == 1 + 2 * WorkerGroupLifecycle.history_limit


def _ready_export(version: int = 4) -> ExportLifecycle:
    e = ExportLifecycle(version)
    e.snapshot()
    e.snapshot_done()
    e.shards_written(ranks_ok=[0])
    e.publish(index_missing_keys=[], checksums_verified=True, renamed=True)
    return e


def test_export_publish_guards() -> None:
    e = ExportLifecycle(1, world_size=2)
    e.snapshot()
    e.snapshot_done()
    with pytest.raises(TransitionRefused, match="every_rank_reported_success"):
        e.shards_written(ranks_ok=[0])
    e.shards_written(ranks_ok=[0, 1])
    for bad in (
        {"index_missing_keys": ["x"], "checksums_verified": True, "renamed": True},
        {"index_missing_keys": [], "checksums_verified": False, "renamed": True},
        {"index_missing_keys": [], "checksums_verified": True, "renamed": False},
    ):
        with pytest.raises(TransitionRefused):
            e.publish(**bad)
    assert e.state == "committing"
    e.fail(reason="disk full")
    assert e.state == "failed" and e.failure_reason == "disk full"


def test_export_leases_block_delete() -> None:
    e = _ready_export()
    lease = e.acquire_lease("g0")
    with pytest.raises(TransitionRefused, match="newer_export_ready"):
        e.supersede(newer_version=4)
    e.supersede(newer_version=5)
    with pytest.raises(LeaseError, match="only in 'ready'"):
        e.acquire_lease("g1")
    with pytest.raises(TransitionRefused, match="no_leases_held"):
        e.delete()
    e.release_lease(lease)
    with pytest.raises(LeaseError, match="not held"):
        e.release_lease(lease)
    e.delete()
    assert e.state == "deleted"


def test_export_adopt() -> None:
    e = ExportLifecycle(9)
    with pytest.raises(TransitionRefused):
        e.adopt(verified=True, version=8)
    e.adopt(verified=True, version=9)
    assert e.state == "ready" and e.offerable


def test_registration_guards_and_published() -> None:
    c = CheckpointRegistration(world_size=2)
    keys = ["a.weight", "b.weight", "mtp.0.weight"]
    c.begin_register(name="ck", version=3)
    assert c.published is None
    with pytest.raises(TransitionRefused, match="key_coverage_exact"):
        c.register_ok(ranks_ok=[0, 1], expected_keys=keys, registered_keys=[*keys, "x"])
    with pytest.raises(TransitionRefused, match="key_coverage_exact"):
        c.register_ok(ranks_ok=[0, 1], expected_keys=keys, registered_keys=keys[1:])
    c.register_ok(ranks_ok=[1, 0], expected_keys=keys, registered_keys=keys[:2])
    assert c.published == ("ck", 3)
    for bad in ([], [[]], [[0], [0]], [[2]], [[-1]]):
        with pytest.raises(TransitionRefused, match="targets_valid"):
            c.begin_update(targets=bad)
    c.begin_update(targets=[[0], [1]])
    assert c.published == ("ck", 3)
    c.update_done(results={0: True, 1: (False, "engine died")})
    assert c.failed_targets == [1]
    with pytest.raises(TransitionRefused, match="version_not_older"):
        c.begin_register(name="old", version=2)
    c.begin_register(name="ck2", version=4)
    c.register_failed(reason="rank 1 threw")
    assert c.state == "failed" and c.published is None
    with pytest.raises(TransitionNotAllowed):
        c.begin_update(targets=[[0]])


def test_recovery_mode_rearms() -> None:
    m = ImmediateRecoveryMode(enabled=True, rearm_after=2)
    m.export_late()
    assert m.state == "suspended" and not m.allows_immediate
    m.export_on_time()
    assert m.state == "suspended" and m.on_time_streak == 1
    m.export_late()
    assert m.on_time_streak == 0
    m.export_on_time()
    m.export_on_time()
    assert m.state == "enabled" and m.allows_immediate
    off = ImmediateRecoveryMode()
    assert off.state == "disabled"
    with pytest.raises(TransitionNotAllowed):
        off.export_late()
    with pytest.raises(ValueError, match="rearm_after"):
        ImmediateRecoveryMode(rearm_after=0)


def test_concurrent_sends_are_serialized() -> None:
    """Threads hammering one group: every transition is recorded once, no torn state."""
    g = WorkerGroupLifecycle(range(4), restart_budget=10_000, group_id="t")
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for i in range(300):
                rank = (seed + i) % 4
                g.report_member(rank, healthy=(i % 7 != 0), weights_version=1)
                for event in ("launched", "restarted", "fail", "claim", "weights_loaded"):
                    try:
                        g.send(event, current_version=1)
                    except TransitionNotAllowed:
                        pass
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    hist = g.history
    assert all(a.target == b.source for a, b in itertools.pairwise(hist))
    assert hist[-1].target == g.state
    assert [r.seq for r in hist] == list(range(hist[0].seq, hist[-1].seq + 1))
    if len(hist) < WorkerGroupLifecycle.history_limit:
        assert g.restart_budget == 10_000 - sum(1 for r in hist if r.event == "claim")


def test_last_transition_is_the_newest_history_record() -> None:
    g = _group()
    assert g.last_transition is None
    _healthy(g, 1)
    g.launched(current_version=1)
    g.fail()
    assert g.last_transition == g.history[-1]
    assert (g.last_transition.source, g.last_transition.target) == ("active", "inactive")


def test_missing_guard_input_is_a_refusal_and_a_value_error() -> None:
    e = ExportLifecycle(1)
    e.snapshot()
    e.snapshot_done()
    e.shards_written(ranks_ok=[0])
    with pytest.raises(MissingGuardInput, match="index_missing_keys") as info:
        e.publish()
    assert isinstance(info.value, TransitionNotAllowed) and isinstance(info.value, ValueError)
    assert e.state == "committing" and not e.can("publish")
    assert e.explain("publish") == [str(info.value.reasons[0])]


# ---------------------------------------------------------------------- DeltaBase (issue #28)
def test_the_design_transitions_of_delta_base() -> None:
    """Every transition of the agreed interface, and no other."""
    want = {
        "send_full": {("no_base", "sending_full"), ("based", "sending_full")},
        "send_delta": {("based", "sending_delta")},
        "fallback_full": {("sending_delta", "sending_full")},
        "confirm": {("sending_full", "based"), ("sending_delta", "based")},
        "unconfirmed": {("sending_full", "no_base"), ("sending_delta", "based")},
        "refused": {("sending_delta", "based")},
        "reset": {(s.id, "no_base") for s in DeltaBase.states},
    }
    have: dict[str, set[tuple[str, str]]] = {}
    for state in DeltaBase.states:
        for t in state.transitions:
            for event in t.events:
                have.setdefault(str(event), set()).add((t.source.id, t.target.id))
    assert have == want


def test_delta_base_moves_only_on_confirm() -> None:
    d = DeltaBase("g0")
    assert (d.state, d.base, d.in_flight) == ("no_base", None, None)
    d.send_full(version=1)
    assert (d.state, d.base, d.in_flight) == ("sending_full", None, 1)
    d.confirm(version=1)
    assert (d.state, d.base) == ("based", 1)
    d.send_delta(version=2, held={1})
    assert (d.state, d.base, d.in_flight) == ("sending_delta", 1, 2)
    d.unconfirmed()
    assert (d.state, d.base, d.in_flight) == ("based", 1, None)  # a lost delta: base unchanged
    d.send_delta(version=2, held={1, 2})
    d.refused()
    assert (d.state, d.base) == ("based", 1)
    d.send_delta(version=2, held={1})
    d.fallback_full()
    assert (d.state, d.base, d.in_flight) == ("sending_full", None, 2)
    d.unconfirmed()
    assert (d.state, d.base) == ("no_base", None)  # a failed full push: weights unknown
    d.send_full(version=3)
    d.reset()
    assert (d.state, d.base, d.in_flight) == ("no_base", None, None)


def test_delta_base_refusals_name_the_guard_and_change_nothing() -> None:
    d = DeltaBase("g0")
    d.send_full(version=1)
    with pytest.raises(TransitionRefused, match="confirms_the_push"):
        d.confirm(version=2)
    d.confirm(version=1)
    before = (d.state, d.base, len(d.history))
    with pytest.raises(TransitionRefused, match="base_snapshot_held") as info:
        d.send_delta(version=2, held={0})
    assert "DeltaBase(g0)" in str(info.value) and "base=1" in str(info.value)
    with pytest.raises(TransitionRefused, match="newer_than_base"):
        d.send_delta(version=1, held={1})
    with pytest.raises(MissingGuardInput, match="held="):
        d.send_delta(version=2)
    with pytest.raises(MissingGuardInput, match="version="):
        d.send_full()
    with pytest.raises(TransitionNotAllowed):
        d.refused()  # no delta in flight
    assert (d.state, d.base, len(d.history)) == before
    rec = d.history[-1]
    assert (rec.event, rec.source, rec.target) == ("confirm", "sending_full", "based")
    assert dict(rec.inputs)["base"] == 1 and dict(rec.inputs)["version"] == 1

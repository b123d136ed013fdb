"""FleetRegistry: groups, ranks, fleet version, event delivery and listeners (outside locks)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from fleet_sim import SimEngineClient, bring_up, make_fleet

from rollsafe.registry import (
    DuplicateGroup,
    FleetListener,
    FleetRegistry,
    FleetVersionRegression,
    GroupTransition,
    OverlappingRanks,
    UnknownGroup,
    WorkerGroup,
)
from rollsafe.statemachines.base import TransitionRefused

JOIN_S = 10.0  # deadlock detector only; never a timing assertion


class Recorder(FleetListener):
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.lock = threading.Lock()

    def _add(self, hook: str, group: WorkerGroup, extra: Any = None) -> None:
        with self.lock:
            self.calls.append((hook, group.group_id, extra))

    def on_transition(self, group: WorkerGroup, record: GroupTransition) -> None:
        self._add("transition", group, (record.event, record.source, record.target))

    def on_group_active(self, group: WorkerGroup) -> None:
        self._add("active", group)

    def on_group_inactive(self, group: WorkerGroup) -> None:
        self._add("inactive", group)

    def on_group_pending_weights(self, group: WorkerGroup) -> None:
        self._add("pending_weights", group)

    def on_group_retired(self, group: WorkerGroup) -> None:
        self._add("retired", group)


# ---------------------------------------------------------------------- groups and ranks
def test_overlapping_ranks_are_refused_and_nothing_changes() -> None:
    reg = FleetRegistry()
    reg.add_group("a", [0, 1])
    with pytest.raises(OverlappingRanks) as info:
        reg.add_group("b", [1, 2, 3])
    err = info.value
    assert (err.group_id, err.other_group, err.ranks) == ("b", "a", (1,))
    assert "'b'" in str(err) and "'a'" in str(err) and "[1]" in str(err)
    assert "b" not in reg and len(reg) == 1
    reg.add_group("b", [2, 3])  # rank 2 and 3 stayed free
    assert reg.group_of_rank(3).group_id == "b"


def test_duplicate_id_unknown_group_and_bad_ranks() -> None:
    reg = FleetRegistry()
    reg.add_group("a", [0])
    with pytest.raises(DuplicateGroup, match="'a'"):
        reg.add_group("a", [5])
    with pytest.raises(UnknownGroup, match="'zz'"):
        reg.get("zz")
    with pytest.raises(UnknownGroup):
        reg.send("zz", "fail")
    with pytest.raises(ValueError, match="repeated"):
        reg.add_group("c", [7, 7])
    with pytest.raises(ValueError, match="at least one rank"):
        reg.add_group("d", [])
    assert [g.group_id for g in reg.groups()] == ["a"]
    with pytest.raises(KeyError, match="rank 9"):
        reg.group_of_rank(9)


def test_concurrent_adds_with_overlapping_ranks_admit_exactly_one() -> None:
    reg = FleetRegistry()
    barrier = threading.Barrier(8)
    outcomes: list[str] = []

    def add(i: int) -> None:
        barrier.wait()
        try:
            reg.add_group(f"g{i}", [100, 200 + i])
            outcomes.append("ok")
        except OverlappingRanks:
            outcomes.append("refused")

    threads = [threading.Thread(target=add, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert sorted(outcomes) == ["ok"] + ["refused"] * 7
    assert len(reg) == 1


def test_remove_group_retires_it_and_frees_its_ranks() -> None:
    reg, _ = make_fleet((2, 1))
    rec = Recorder()
    reg.add_listener(rec)
    group = reg.remove_group("g0")
    assert group.state == "retired"
    assert ("retired", "g0", None) in rec.calls
    assert "g0" not in reg
    reg.add_group("g9", [0, 1])  # ranks of g0 are free again


def test_routable_is_only_active_groups() -> None:
    reg, _ = make_fleet((1, 1, 1))
    reg.send("g1", "fail")
    reg.set_fleet_version(2)
    reg.send("g2", "mark_stale")
    assert [g.group_id for g in reg.routable()] == ["g0"]
    assert reg.get("g2").state == "pending_weights"


# ---------------------------------------------------------------------- version
def test_fleet_version_never_decreases() -> None:
    reg = FleetRegistry(fleet_version=3)
    reg.fleet_version = 5
    assert reg.set_fleet_version(5) == 5  # equal: a no-op
    with pytest.raises(FleetVersionRegression) as info:
        reg.set_fleet_version(4)
    assert (info.value.current, info.value.requested) == (5, 4)
    assert "5" in str(info.value) and "4" in str(info.value)
    with pytest.raises(FleetVersionRegression):
        reg.fleet_version = 0
    with pytest.raises(TypeError):
        reg.set_fleet_version("6")  # type: ignore[arg-type]
    assert reg.fleet_version == 5


def test_send_fills_in_the_fleet_version_for_versioned_guards() -> None:
    reg = FleetRegistry(fleet_version=2)
    reg.add_group("a", [0, 1])
    reg.report_member("a", 0, healthy=True, weights_version=1)
    reg.report_member("a", 1, healthy=True, weights_version=1)
    assert reg.can("a", "launched", current_version=1)
    rec = reg.send("a", "launched")  # members at 1, fleet at 2
    assert (rec.source, rec.target, rec.fleet_version) == ("launching", "pending_weights", 2)
    with pytest.raises(TransitionRefused):
        reg.send("a", "weights_loaded")  # still at 1
    reg.report_member("a", 0, healthy=True, weights_version=2)
    reg.report_member("a", 1, healthy=True, weights_version=2)
    assert reg.send("a", "weights_loaded").target == "active"
    with pytest.raises(TransitionRefused):
        reg.send("a", "mark_stale")  # not behind the fleet version: refused
    reg.set_fleet_version(3)
    assert reg.send("a", "mark_stale").target == "pending_weights"


# ---------------------------------------------------------------------- listeners
def test_listeners_get_hooks_in_transition_order() -> None:
    reg, _ = make_fleet((1,), active=False)
    rec = Recorder()
    reg.add_listener(rec)
    bring_up(reg, "g0")
    reg.send("g0", "fail")
    reg.send("g0", "claim")
    bring_up(reg, "g0", "restarted")
    assert rec.calls == [
        ("transition", "g0", ("launched", "launching", "active")),
        ("active", "g0", None),
        ("transition", "g0", ("fail", "active", "inactive")),
        ("inactive", "g0", None),
        ("transition", "g0", ("claim", "inactive", "recovering")),
        ("transition", "g0", ("restarted", "recovering", "active")),
        ("active", "g0", None),
    ]


def test_refused_event_notifies_nobody_and_changes_nothing() -> None:
    reg, _ = make_fleet((1,))
    rec = Recorder()
    reg.add_listener(rec)
    with pytest.raises(TransitionRefused, match="claim"):
        reg.send("g0", "claim")
    assert rec.calls == [] and reg.get("g0").state == "active"
    assert reg.get("g0").generation == 1  # only the launch


def test_listeners_run_outside_every_lock() -> None:
    """From inside a listener, ANOTHER thread can take the registry's and the group's locks."""
    reg, _ = make_fleet((1,))
    seen: list[bool] = []

    class Probe(FleetListener):
        def on_group_inactive(self, group: WorkerGroup) -> None:
            def grab() -> None:
                ok = group._lock.acquire(timeout=JOIN_S)
                if ok:
                    group._lock.release()
                ok2 = reg._lock.acquire(timeout=JOIN_S)
                if ok2:
                    reg._lock.release()
                ok3 = group.machine._lock.acquire(timeout=JOIN_S)
                if ok3:
                    group.machine._lock.release()
                seen.append(ok and ok2 and ok3)
                # and real work through the public API from that thread
                reg.snapshot()
                group.begin_request()

            t = threading.Thread(target=grab)
            t.start()
            t.join(JOIN_S)
            seen.append(not t.is_alive())

    reg.add_listener(Probe())
    reg.send("g0", "fail")
    assert seen == [True, True]


def test_listener_calling_back_into_the_registry_does_not_deadlock() -> None:
    reg, _ = make_fleet((1, 1))
    rec = Recorder()

    class Reentrant(FleetListener):
        def on_group_inactive(self, group: WorkerGroup) -> None:
            # a quick "recovery" right from the listener: claim it, read everything
            reg.send(group.group_id, "claim")
            reg.snapshot()
            reg.routable()
            reg.report_member(group.group_id, group.ranks[0], healthy=True, weights_version=1)

        def on_transition(self, group: WorkerGroup, record: GroupTransition) -> None:
            if record.target == "recovering":
                reg.send(group.group_id, "restarted")

    reg.add_listener(Reentrant())
    reg.add_listener(rec)

    done = threading.Event()

    def run() -> None:
        reg.send("g0", "fail")
        done.set()

    t = threading.Thread(target=run)
    t.start()
    t.join(JOIN_S)
    assert done.is_set(), "registry deadlocked on a re-entrant listener"
    assert reg.get("g0").state == "active"
    events = [c[2][0] for c in rec.calls if c[0] == "transition"]
    assert events == ["fail", "claim", "restarted"]  # nested sends delivered in order


def test_listener_errors_are_counted_and_do_not_break_others() -> None:
    reg, _ = make_fleet((1,))
    rec = Recorder()

    class Broken(FleetListener):
        def on_transition(self, group: WorkerGroup, record: GroupTransition) -> None:
            raise RuntimeError("listener bug")

    reg.add_listener(Broken())
    reg.add_listener(rec)
    reg.send("g0", "fail")
    assert reg.get("g0").state == "inactive"
    assert reg.listener_errors == 1
    assert ("inactive", "g0", None) in rec.calls


def test_add_listener_validates_and_dedups() -> None:
    reg = FleetRegistry()
    with pytest.raises(TypeError, match="not a fleet listener"):
        reg.add_listener(object())

    class Duck:
        def __init__(self) -> None:
            self.n = 0

        def on_group_active(self, group: WorkerGroup) -> None:
            self.n += 1

    duck = Duck()
    reg.add_listener(duck)
    reg.add_listener(duck)
    reg.add_group("a", [0])
    bring_up(reg, "a")
    assert duck.n == 1
    reg.remove_listener(duck)
    reg.send("a", "fail")
    reg.send("a", "claim")
    bring_up(reg, "a", "restarted")
    assert duck.n == 1


def test_concurrent_sends_deliver_each_groups_transitions_in_order() -> None:
    reg, _ = make_fleet([1] * 4, restart_budget=10_000)
    seqs: dict[str, list[int]] = {g.group_id: [] for g in reg.groups()}

    class Order(FleetListener):
        def on_transition(self, group: WorkerGroup, record: GroupTransition) -> None:
            seqs[group.group_id].append(record.seq)

    reg.add_listener(Order())
    errors: list[BaseException] = []

    def churn(gid: str) -> None:
        for _ in range(30):
            for event in ("fail", "claim", "restarted"):
                try:
                    if event == "restarted":
                        bring_up(reg, gid, "restarted")
                    else:
                        reg.send(gid, event)
                except TransitionRefused:
                    pass  # two threads race on g0: refusals are expected there
                except BaseException as exc:  # pragma: no cover - would be a bug
                    errors.append(exc)

    gids = [g.group_id for g in reg.groups()] + ["g0"]
    threads = [threading.Thread(target=churn, args=(gid,)) for gid in gids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not errors
    for s in seqs.values():
        assert s == sorted(s)
    # every transition (launches excluded, they happened before the listener) was delivered once
    assert sum(len(s) for s in seqs.values()) == sum(g.generation for g in reg.groups()) - 4


# ---------------------------------------------------------------------- inspection
def test_snapshot_is_json_friendly() -> None:
    reg, _ = make_fleet((2, 1))
    reg.send("g1", "fail")
    g0 = reg.get("g0")
    assert g0.begin_request() == "active"
    g0.end_request(ok=False, error="x" * 100_000)
    snap = json.loads(json.dumps(reg.snapshot()))
    assert snap["fleet_version"] == 1
    assert snap["routable"] == ["g0"]
    s0 = snap["groups"]["g0"]
    assert s0["state"] == "active" and s0["routable"] is True
    assert s0["members"]["0"] == {"known": True, "healthy": True, "weights_version": 1}
    assert s0["requests"]["dispatched_by_state"] == {"active": 1}
    assert len(s0["requests"]["last_error"]) <= 4096
    assert s0["endpoints"] == [SimEngineClient("g0").url]
    assert snap["groups"]["g1"]["last_transitions"][-1]["event"] == "fail"
    assert reg.dispatch_counts() == {"g0": {"active": 1}, "g1": {}}


def test_begin_request_admits_only_active_groups() -> None:
    reg, _ = make_fleet((1,))
    g = reg.get("g0")
    assert g.begin_request() == "active" and g.outstanding == 1
    reg.send("g0", "fail")
    assert g.begin_request() is None
    g.end_request(ok=True)
    assert g.outstanding == 0
    assert g.dispatch_counts() == {"active": 1}


def test_rebind_clients_points_the_group_at_the_restarted_engine() -> None:
    reg, clients = make_fleet((1, 1))
    new = SimEngineClient("g0-restarted")
    group = reg.rebind_clients("g0", [new])
    assert group.client is new and group.endpoints == (new.url,)
    assert reg.get("g1").client is clients["g1"]
    with pytest.raises(ValueError, match="at least one client"):
        reg.rebind_clients("g0", [])
    assert reg.get("g0").client is new


class _SlowVersionRegistry(FleetRegistry):
    """Moves its version a moment after it is asked: the window in which a reader that does
    not wait for a recording sees the members ahead of the fleet is wide."""

    def set_fleet_version(self, version: int) -> int:
        time.sleep(0.002)
        return super().set_fleet_version(version)


def test_a_consistent_reader_never_sees_a_syncs_versions_torn() -> None:
    """``RecordVersions`` (the sync's settle: the members' versions and the fleet's version)
    runs under :meth:`FleetRegistry.recording`; a reader through :meth:`FleetRegistry.consistent`
    (``fleet.picture()``, the soak's invariant check) sees both moved or neither. A plain
    reader beside it does see an ``active`` group ahead of its fleet (the soak's false
    ``active_groups_whole_and_current``, seed 934291), which shows the window is there."""

    from rollsafe.operations import effects as fx
    from rollsafe.registry import RegistryEffects

    reg = _SlowVersionRegistry(fleet_version=1)
    reg.add_group("g0", [0, 1])
    bring_up(reg, "g0")
    handler = RegistryEffects(reg)
    done = threading.Event()
    torn = {"consistent": 0, "plain": 0}
    reads = {"consistent": 0, "plain": 0}

    def versions() -> tuple[set[int | None], int]:
        members = reg.get("g0").machine.members.values()
        return {m.weights_version for m in members}, reg.fleet_version

    def reader(kind: str) -> None:
        while not done.is_set():
            got = reg.consistent(versions) if kind == "consistent" else versions()
            reads[kind] += 1
            if got[0] != {got[1]}:
                torn[kind] += 1

    threads = [threading.Thread(target=reader, args=(k,)) for k in ("consistent", "plain")]
    for t in threads:
        t.start()
    try:
        for version in range(2, 202):
            assert handler.record_versions(fx.RecordVersions(("g0",), version, version)) is fx.DONE
            time.sleep(0.0005)
    finally:
        done.set()
        for t in threads:
            t.join()
    assert reg.fleet_version == 201
    assert reads["consistent"] > 0 and torn["consistent"] == 0
    assert torn["plain"] > 0  # the window a consistent reader waits out


def test_record_versions_never_moves_the_fleet_back_and_changes_nothing() -> None:
    """A ``RecordVersions`` below the fleet's version is refused whole: no member records
    it, the fleet stays."""

    from rollsafe.operations import effects as fx
    from rollsafe.registry import RegistryEffects

    reg = FleetRegistry(fleet_version=5)
    reg.add_group("g0", [0])
    bring_up(reg, "g0")
    outcome = RegistryEffects(reg).record_versions(fx.RecordVersions(("g0",), 4, 4))
    assert isinstance(outcome, fx.Failed) and "4" in outcome.error
    assert reg.fleet_version == 5
    assert reg.get("g0").machine.members[0].weights_version == 5


def test_a_consistent_read_inside_a_recording_on_its_own_thread_reads_at_once() -> None:
    """A listener of a recorded change that reads the fleet consistently, on the recording's
    own thread, gets its read at once (waiting for the recording to end would never end)."""
    reg = FleetRegistry(fleet_version=1)
    with reg.recording():
        reg.set_fleet_version(2)
        assert reg.consistent(lambda: reg.fleet_version) == 2
    assert reg.consistent(lambda: reg.fleet_version) == 2

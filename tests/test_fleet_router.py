"""Router: routable groups only, least outstanding, sticky sessions, retries, bounded errors.

Simulated clients follow the real ``EngineClient`` protocol and check, when a request reaches
them, that their group is routable; the stateful test interleaves transitions and requests.
"""

from __future__ import annotations

import threading

import pytest
from fleet_sim import SimEngineClient, bring_up, generate, make_fleet
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from profiles import examples

from rollsafe.adapters.engines import EngineRequestError, EngineTimeout, EngineUnavailable
from rollsafe.fleet import NoRoutableGroup, RequestFailed
from rollsafe.fleet.router import Router, is_retryable
from rollsafe.ports import EngineClient, GenerateResult
from rollsafe.registry import FleetRegistry
from rollsafe.statemachines.base import TransitionRefused

PROMPT = [1, 2, 3]
JOIN_S = 10.0


def no_violations(clients: dict[str, SimEngineClient]) -> None:
    for c in clients.values():
        assert c.violations == []


def test_sim_clients_follow_the_engine_client_protocol() -> None:
    assert isinstance(SimEngineClient("x"), EngineClient)


def test_requests_go_only_to_routable_groups() -> None:
    reg, clients = make_fleet((1, 1, 1))
    router = Router(reg)
    reg.send("g0", "fail")
    reg.set_fleet_version(2)
    reg.send("g2", "mark_stale")
    served = {generate(router, PROMPT).group_id for _ in range(20)}
    assert served == {"g1"}
    assert clients["g0"].generate_calls == clients["g2"].generate_calls == 0
    assert set(reg.dispatch_counts()["g1"]) == {"active"}
    no_violations(clients)


def test_no_routable_group_is_a_named_error_listing_states() -> None:
    reg, _ = make_fleet((1, 1))
    router = Router(reg)
    reg.send("g0", "fail")
    reg.send("g1", "retire")
    with pytest.raises(NoRoutableGroup) as info:
        generate(router, PROMPT)
    assert info.value.states == {"g0": "inactive", "g1": "retired"}
    assert "g0=inactive" in str(info.value)
    with pytest.raises(NoRoutableGroup, match="no groups"):
        generate(Router(FleetRegistry()), PROMPT)


def _wait_outstanding(reg: FleetRegistry, total: int) -> None:
    for _ in range(2000):  # polling bound, not a timing assertion
        if sum(g.outstanding for g in reg.groups()) == total:
            return
        threading.Event().wait(0.005)
    raise AssertionError(f"never reached {total} outstanding requests")


def test_least_outstanding_choice_with_requests_in_flight() -> None:
    reg, clients = make_fleet((1, 1, 1))
    router = Router(reg)
    gate = threading.Event()
    for c in clients.values():
        c.generate_gate = gate
    results: list[str] = []
    threads = []
    for n in (1, 2, 3):
        t = threading.Thread(target=lambda: results.append(generate(router, PROMPT).group_id))
        t.start()
        threads.append(t)
        _wait_outstanding(reg, n)
        # each new request went to a group with nothing outstanding
        assert sorted(g.outstanding for g in reg.groups()) == [0] * (3 - n) + [1] * n
    gate.set()
    for t in threads:
        t.join(JOIN_S)
    assert sorted(results) == ["g0", "g1", "g2"]
    assert all(g.outstanding == 0 for g in reg.groups())
    no_violations(clients)


def test_least_outstanding_prefers_the_idle_group_deterministically() -> None:
    reg, _ = make_fleet((1, 1))
    router = Router(reg)
    g0 = reg.get("g0")
    for _ in range(3):
        assert g0.begin_request() == "active"  # g0 busy with 3 requests
    assert {generate(router, PROMPT).group_id for _ in range(5)} == {"g1"}


def test_sticky_sessions_stay_then_move_when_their_group_leaves() -> None:
    reg, clients = make_fleet((1, 1, 1))
    router = Router(reg)
    first = generate(router, PROMPT, session_id="s1").group_id
    assert router.session_group("s1") == first
    assert {generate(router, PROMPT, session_id="s1").group_id for _ in range(10)} == {first}
    reg.send(first, "fail")  # the listener unpins s1
    assert router.session_group("s1") is None
    moved = generate(router, PROMPT, session_id="s1").group_id
    assert moved != first
    assert {generate(router, PROMPT, session_id="s1").group_id for _ in range(10)} == {moved}
    # a group leaving routing by going stale moves its sessions too
    reg.set_fleet_version(2)
    reg.send(moved, "mark_stale")
    assert generate(router, PROMPT, session_id="s1").group_id not in {first, moved}
    assert router.stats()["sessions_moved"] >= 2
    no_violations(clients)


def test_session_table_is_bounded() -> None:
    reg, _ = make_fleet((1, 1))
    router = Router(reg, max_sessions=10)
    for i in range(50):
        generate(router, PROMPT, session_id=f"s{i}")
    assert router.stats()["sessions"] == 10
    assert router.session_group("s0") is None and router.session_group("s49") is not None


@pytest.mark.parametrize(
    "error",
    [
        EngineUnavailable("http://x", "/generate", "Connection refused"),
        EngineUnavailable("http://x", "/generate", "Connection reset by peer"),
        EngineTimeout("http://x", "/generate", "no answer within 1s"),
        EngineRequestError("http://x", "/generate", 503, "engine is restarting"),
    ],
)
def test_retryable_failures_are_retried_on_another_group(error: Exception) -> None:
    assert is_retryable(error)
    reg, clients = make_fleet((1, 1))
    hook: list[str] = []
    router = Router(reg, on_group_error=lambda gid, exc: hook.append(gid))
    clients["g0"].generate_error = error  # type: ignore[assignment]
    g1 = reg.get("g1")
    assert g1.begin_request() == "active"  # g1 busier: g0 (least outstanding) is tried first
    out = generate(router, PROMPT, session_id="s")
    g1.end_request(ok=True)
    assert (out.group_id, out.attempts) == ("g1", 2)
    assert hook == ["g0"] and clients["g0"].generate_calls == 1
    assert router.session_group("s") == "g1"
    # every request succeeds on g1 whatever the choice order
    for _ in range(5):
        assert generate(router, PROMPT).group_id == "g1"
    assert clients["g0"].generate_calls >= 1
    assert reg.get("g0").last_error is not None


def test_final_failures_are_not_retried() -> None:
    reg, clients = make_fleet((1, 1))
    router = Router(reg)
    bad = EngineRequestError("http://x", "/generate", 400, "prompt too long")
    assert not is_retryable(bad)
    clients["g0"].generate_error = bad
    clients["g1"].generate_error = bad
    with pytest.raises(RequestFailed) as info:
        generate(router, PROMPT)
    assert info.value.retryable is False
    assert len(info.value.attempts) == 1
    assert clients["g0"].generate_calls + clients["g1"].generate_calls == 1
    assert info.value.__cause__ is bad
    assert "prompt too long" in str(info.value)


def test_non_engine_errors_propagate_unchanged() -> None:
    reg, _ = make_fleet((1,))
    router = Router(reg)

    class Boom(SimEngineClient):
        def generate(self, *a: object, **k: object) -> GenerateResult:
            raise ValueError("bad sampling params")

    reg2 = FleetRegistry(fleet_version=1)
    reg2.add_group("b", [0], clients=[Boom("b")])
    bring_up(reg2, "b")
    with pytest.raises(ValueError, match="bad sampling"):
        generate(Router(reg2), PROMPT)
    assert reg2.get("b").outstanding == 0
    assert generate(router, PROMPT).group_id == "g0"


def test_retries_are_bounded_and_each_on_a_different_group() -> None:
    reg, clients = make_fleet((1, 1, 1, 1))
    router = Router(reg, max_attempts=3)
    for c in clients.values():
        c.generate_error = EngineUnavailable(c.url, "/generate", "Connection refused")
    with pytest.raises(RequestFailed) as info:
        generate(router, PROMPT)
    err = info.value
    assert err.retryable is True
    assert len(err.groups) == 3 and len(set(err.groups)) == 3
    assert sum(c.generate_calls for c in clients.values()) == 3
    # with fewer groups than attempts the router stops when it runs out of groups
    reg2, clients2 = make_fleet((1, 1))
    for c in clients2.values():
        c.generate_error = EngineTimeout(c.url, "/generate", "no answer")
    with pytest.raises(RequestFailed, match="no other routable group") as info2:
        generate(Router(reg2, max_attempts=5), PROMPT)
    assert len(info2.value.attempts) == 2


def test_error_text_is_bounded_across_attempts_and_repeated_failures() -> None:
    """A crashed engine under a partial rollout: huge error bodies, many retries, many calls."""
    limit = 2048
    reg, clients = make_fleet((1, 1, 1))
    router = Router(reg, max_attempts=3, max_error_chars=limit)
    huge = "Traceback (most recent call last):\n" + "  frame\n" * 200_000
    for c in clients.values():
        # EngineRequestError bounds its own message; build one past that bound too
        err = EngineRequestError(c.url, "/generate", 500, huge)
        err.args = (huge * 2,)
        c.generate_error = err
    sizes = set()
    for _ in range(50):  # a rollout re-submitting its partial request over and over
        with pytest.raises(RequestFailed) as info:
            generate(router, PROMPT)
        message = str(info.value)
        assert len(message) <= limit
        assert message.count("request failed") == 1  # errors never nest into each other
        assert message.count("EngineRequestError") == 3  # one bounded note per attempt
        sizes.add(len(message))
    assert len(sizes) == 1  # the 50th failure is no longer than the first
    for g in reg.groups():
        assert g.last_error is not None and len(g.last_error) <= 4096


def test_wait_for_routable_group() -> None:
    reg, clients = make_fleet((1,))
    reg.send("g0", "fail")
    reg.send("g0", "claim")
    router = Router(reg, wait_for_routable_s=JOIN_S)
    timer = threading.Timer(0.05, lambda: bring_up(reg, "g0", "restarted"))
    timer.start()
    assert generate(router, PROMPT).group_id == "g0"
    timer.join()
    no_violations(clients)


def test_request_that_raced_a_transition_is_rechecked_under_the_lock() -> None:
    """A group that leaves routing between the choice and the admission is skipped."""
    reg, clients = make_fleet((1, 1))
    router = Router(reg)
    g0 = reg.get("g0")
    original = g0.begin_request

    def racing_begin() -> str | None:
        if g0.state == "active":
            reg.send("g0", "fail")  # lands between the router's snapshot and its admission
        return original()

    g0.begin_request = racing_begin  # type: ignore[method-assign]
    for _ in range(5):
        assert generate(router, PROMPT).group_id == "g1"
    assert reg.dispatch_counts()["g0"] == {}
    no_violations(clients)


def test_closed_router_stops_listening() -> None:
    reg, _ = make_fleet((1, 1))
    router = Router(reg)
    generate(router, PROMPT, session_id="s")
    router.close()
    pinned = router.session_group("s")
    assert pinned is not None
    reg.send(pinned, "fail")
    assert router.session_group("s") == pinned  # no longer notified


# ---------------------------------------------------------------------- stateful
EVENTS = ["fail", "claim", "restarted", "restart_failed", "mark_stale", "weights_loaded"]


class RouterModel(RuleBasedStateMachine):
    """Interleave transitions, member reports, version bumps, engine failures and requests."""

    def __init__(self) -> None:
        super().__init__()
        self.reg, self.clients = make_fleet((1, 2, 1), restart_budget=10**6)
        self.router = Router(self.reg, max_attempts=2)
        self.gids = sorted(self.clients)

    @rule(gid=st.sampled_from(["g0", "g1", "g2"]), event=st.sampled_from(EVENTS))
    def transition(self, gid: str, event: str) -> None:
        try:
            self.reg.send(gid, event)
        except TransitionRefused:
            pass

    @rule(gid=st.sampled_from(["g0", "g1", "g2"]), healthy=st.booleans(), current=st.booleans())
    def report(self, gid: str, healthy: bool, current: bool) -> None:
        version = self.reg.fleet_version if current else self.reg.fleet_version - 1
        for r in self.reg.get(gid).ranks:
            self.reg.report_member(gid, r, healthy=healthy, weights_version=version)

    @rule()
    def bump_version(self) -> None:
        self.reg.set_fleet_version(self.reg.fleet_version + 1)

    @rule(gid=st.sampled_from(["g0", "g1", "g2"]), kind=st.sampled_from(["ok", "down", "4xx"]))
    def engine_behaviour(self, gid: str, kind: str) -> None:
        c = self.clients[gid]
        c.generate_error = {
            "ok": None,
            "down": EngineUnavailable(c.url, "/generate", "Connection refused"),
            "4xx": EngineRequestError(c.url, "/generate", 422, "bad input"),
        }[kind]

    @rule(session=st.sampled_from([None, "a", "b"]))
    def request(self, session: str | None) -> None:
        routable = {g.group_id for g in self.reg.routable()}
        try:
            out = generate(self.router, PROMPT, session_id=session)
        except NoRoutableGroup:
            assert not routable
            return
        except RequestFailed as exc:
            assert set(exc.groups) <= routable
            assert len(str(exc)) <= self.router.max_error_chars
            return
        assert out.group_id in routable
        if session is not None:
            assert self.router.session_group(session) == out.group_id

    @invariant()
    def no_request_reached_a_non_routable_group(self) -> None:
        for c in self.clients.values():
            assert c.violations == []
        for counts in self.reg.dispatch_counts().values():
            assert set(counts) <= {"active"}

    @invariant()
    def pinned_sessions_point_at_routable_groups(self) -> None:
        for sid in ("a", "b"):
            gid = self.router.session_group(sid)
            assert gid is None or self.reg.get(gid).is_routable

    @invariant()
    def nothing_outstanding_between_requests(self) -> None:
        assert all(g.outstanding == 0 for g in self.reg.groups())


TestRouterModel = RouterModel.TestCase
TestRouterModel.settings = settings(
    max_examples=examples(60), stateful_step_count=30, deadline=None
)

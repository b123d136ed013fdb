"""Delta sync's base versions (issue #28), by hypothesis: the machine, the ledger, the policy.

* :class:`DeltaBaseProperties`: :class:`~rollsafe.statemachines.DeltaBase` against an
  independent reference model written from its documented transitions; every event, legal or
  not, with valid and arbitrary inputs; a refused event changes nothing.
* :class:`DeltaLedgerProperties`: a :class:`~rollsafe.registry.delta_ledger.DeltaLedger` used
  the way a transport uses it, against engines whose true weights version the test keeps:
  pushes confirmed, lost, failed half way, refused, fallen back to full; targets restarted,
  added, lagging (the sender dropped their base's snapshot); the engine applies a delta only
  onto its exact base. Judged by :func:`rollsafe.invariants.base_never_ahead` and
  :func:`rollsafe.invariants.delta_only_onto_its_base`, the functions ``rollsafe verify``
  checks. ``machine_cls`` is a class attribute, so the mutation tests plant
  ``advance_base_on_send`` here.
* the pure decisions :func:`rollsafe.policy.plan_push` and :func:`rollsafe.policy.settle_push`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from profiles import examples
from statemachine.exceptions import TransitionNotAllowed

from rollsafe import invariants, policy
from rollsafe.invariants import DeltaPicture, FleetPicture, GroupPicture, MemberPicture
from rollsafe.registry.delta_ledger import DeltaLedger
from rollsafe.statemachines import DeltaBase, DeltaEvent

STEPS = 40
EVENTS = [e.value for e in DeltaEvent]
#: an engine whose weights are unknown after a full push failed half way
PARTIAL = invariants.POISONED


# ---------------------------------------------------------------------- the machine
@dataclass
class DeltaBaseSpec:
    """Reference model of DeltaBase (from its docstring's transitions)."""

    state: str = "no_base"
    base: int | None = None
    in_flight: int | None = None

    def step(self, event: str, **kw: Any) -> str | None:
        s, version, held = self.state, kw.get("version"), kw.get("held")
        if event == "send_full" and s in ("no_base", "based") and version is not None:
            self.in_flight = version
            return self._to("sending_full")
        sendable = s == "based" and version is not None and held is not None
        newer = version is not None and self.base is not None and version > self.base
        if event == "send_delta" and sendable and newer and self.base in (held or ()):
            self.in_flight = version
            return self._to("sending_delta")
        if event == "fallback_full" and s == "sending_delta":
            return self._to("sending_full")
        confirming = s in ("sending_full", "sending_delta") and version is not None
        if event == "confirm" and confirming and version == self.in_flight:
            self.base, self.in_flight = version, None
            return self._to("based")
        if event == "unconfirmed" and s in ("sending_full", "sending_delta"):
            self.in_flight = None
            if s == "sending_full":
                self.base = None
                return self._to("no_base")
            return self._to("based")
        if event == "refused" and s == "sending_delta":
            self.in_flight = None
            return self._to("based")
        if event == "reset":
            self.base = self.in_flight = None
            return self._to("no_base")
        return None

    def _to(self, state: str) -> str:
        self.state = state
        return state


class DeltaBaseProperties(RuleBasedStateMachine):
    machine_cls: ClassVar[type[DeltaBase]] = DeltaBase

    @initialize()
    def setup(self) -> None:
        self.d = self.machine_cls("t0")
        self.spec = DeltaBaseSpec()

    @rule(
        event=st.sampled_from(EVENTS),
        version=st.one_of(st.none(), st.integers(0, 5)),
        held=st.one_of(st.none(), st.frozensets(st.integers(0, 5), max_size=3)),
        use_send=st.booleans(),
    )
    def fire(
        self, event: str, version: int | None, held: frozenset[int] | None, use_send: bool
    ) -> None:
        kw: dict[str, Any] = {}
        if version is not None:
            kw["version"] = version
        if held is not None:
            kw["held"] = held
        before = (self.d.state, self.d.base, self.d.in_flight, len(self.d.history))
        expected = self.spec.step(event, **kw)
        try:
            if use_send:
                self.d.send(event, **kw)
            else:
                getattr(self.d, event)(**kw)
            taken = True
        except TransitionNotAllowed:
            taken = False
        if expected is None:
            assert not taken, f"{event}({kw}) from {before[0]} should have been refused"
            after = (self.d.state, self.d.base, self.d.in_flight, len(self.d.history))
            assert after == before, "a refused event changed the machine"
        else:
            assert taken, f"{event}({kw}) from {before[0]} should have been taken"

    @invariant()
    def matches_spec(self) -> None:
        if not hasattr(self, "d"):
            return
        assert self.d.state == self.spec.state
        assert self.d.in_flight == self.spec.in_flight
        shown = self.spec.base if self.spec.state in ("based", "sending_delta") else None
        assert self.d.base == shown
        assert (self.d.base is not None) == (self.d.state in ("based", "sending_delta"))


def test_delta_base_matches_its_spec() -> None:
    run(DeltaBaseProperties, examples(300))


# ---------------------------------------------------------------------- the ledger
TARGETS = ("g0", "g1", "g2")


class DeltaLedgerProperties(RuleBasedStateMachine):
    """A transport's use of the ledger against engines whose true version the test knows."""

    machine_cls: ClassVar[type[DeltaBase]] = DeltaBase

    @initialize(first=st.integers(1, 2))
    def setup(self, first: int) -> None:
        self.ledger = DeltaLedger(machine_cls=self.machine_cls)
        self.engine: dict[str, int | None] = dict.fromkeys(TARGETS[:first], None)
        self.version = 1
        self.dropped: set[int] = set()  # snapshots the sender evicted (lagging targets)
        self.wrong: list[str] = []
        self.refusals = 0

    def held(self) -> frozenset[int]:
        """The sender keeps the current version and every referenced base, less evictions."""
        return frozenset({self.version, *self.ledger.bases().values()}) - self.dropped

    @rule()
    def train_step(self) -> None:
        self.version += 1

    @precondition(lambda self: hasattr(self, "engine") and len(self.engine) < len(TARGETS))
    @rule()
    def add_target(self) -> None:
        """A group joins (its engine loaded the trainer's weights from disk: unknown here)."""
        target = TARGETS[len(self.engine)]
        self.engine[target] = None
        self.ledger.reset(target)

    @rule(data=st.data(), loaded=st.booleans())
    def restart(self, data: st.DataObject, loaded: bool) -> None:
        """A target restarts (from an export, or on dummy weights): the fleet resets it."""
        target = data.draw(st.sampled_from(sorted(self.engine)))
        self.engine[target] = self.version if loaded else None
        self.ledger.reset(target)

    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        """Memory pressure: the sender drops a referenced base's snapshot (its target lags)."""
        bases = sorted(set(self.ledger.bases().values()) - {self.version})
        if bases:
            self.dropped.add(data.draw(st.sampled_from(bases)))

    @rule(
        data=st.data(),
        outcome=st.sampled_from(["ok", "lost", "half", "not_smaller"]),
        delta_enabled=st.booleans(),
        engine_applies=st.booleans(),
        force=st.booleans(),
    )
    def push(
        self,
        data: st.DataObject,
        outcome: str,
        delta_enabled: bool,
        engine_applies: bool,
        force: bool,
    ) -> None:
        target = data.draw(st.sampled_from(sorted(self.engine)))
        version = self.version
        held = self.held()
        plan = self.ledger.plan(
            target,
            version,
            held,
            delta_enabled=delta_enabled,
            engine_applies_deltas=engine_applies,
            force_full=force,
        )
        if plan.kind == "delta":
            assert delta_enabled and engine_applies and not force
            base = plan.base
            assert base is not None and base in held and base < version
            if outcome == "not_smaller":
                plan = self.ledger.fallback_full(target, "delta not smaller")
                assert plan.kind == "full" and self.ledger.state(target) == "sending_full"
            else:
                self._delta(target, base, version, outcome)
                return
        self._full(target, version, outcome)

    def _delta(self, target: str, base: int, version: int, outcome: str) -> None:
        held_now = self.engine[target]
        if held_now != base:
            # the engine refuses it by name (nothing changes); the sender should never send it
            self.wrong.append(f"delta v{base} -> v{version} sent to {target} holding {held_now}")
            self.refusals += 1
            self.ledger.settle(target, version, ok=False, refused=True)
            assert self.ledger.state(target) == "based"
            # the transport retries the refused target in full in the same update
            self.ledger.plan(
                target,
                version,
                self.held(),
                delta_enabled=True,
                engine_applies_deltas=True,
                force_full=True,
            )
            self._full(target, version, "ok")
            return
        if outcome == "ok":
            self.engine[target] = version  # every rank applied it, the digest matched
            self.ledger.settle(target, version, ok=True, refused=False)
            assert self.ledger.base(target) == version
        else:  # lost, or failed on a rank: all or nothing, the engine is unchanged
            self.ledger.settle(target, version, ok=False, refused=False)

    def _full(self, target: str, version: int, outcome: str) -> None:
        if outcome in ("ok", "not_smaller"):
            self.engine[target] = version
            self.ledger.settle(target, version, ok=True, refused=False)
            assert self.ledger.base(target) == version
        elif outcome == "half":  # some ranks loaded, some did not: unknown weights
            self.engine[target] = PARTIAL
            self.ledger.settle(target, version, ok=False, refused=False)
        else:  # lost before it reached the engine
            self.ledger.settle(target, version, ok=False, refused=False)

    def picture(self) -> FleetPicture:
        return FleetPicture(
            fleet_version=self.version,
            groups=tuple(
                GroupPicture(t, "active", True, 1, (MemberPicture(0, True, True, v, True, v),))
                for t, v in sorted(self.engine.items())
            ),
            delta_bases=tuple(
                DeltaPicture(t, self.ledger.state(t), self.ledger.base(t)) for t in self.engine
            ),
            wrong_base_deltas=tuple(self.wrong),
        )

    @invariant()
    def base_is_what_the_engine_holds(self) -> None:
        if not hasattr(self, "ledger"):
            return
        picture = self.picture()
        broken = invariants.base_never_ahead(picture) + invariants.delta_only_onto_its_base(picture)
        assert not broken, "; ".join(broken)
        # a base whose snapshot the sender dropped is never diffed against
        for target in self.engine:
            assert self.ledger.state(target) in ("no_base", "based")


def test_ledger_keeps_each_base_true() -> None:
    run(DeltaLedgerProperties, examples(300))


def run(cls: type[RuleBasedStateMachine], count: int) -> None:
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(cls, settings=settings(max_examples=count, stateful_step_count=STEPS))


# ---------------------------------------------------------------------- the policy
@given(
    base=st.one_of(st.none(), st.integers(0, 6)),
    version=st.integers(0, 6),
    held=st.frozensets(st.integers(0, 6), max_size=4),
    delta_enabled=st.booleans(),
    engine_applies=st.booleans(),
    force=st.booleans(),
)
@settings(max_examples=examples(300))
def test_plan_push_sends_a_delta_only_from_a_held_older_base(
    base: int | None,
    version: int,
    held: frozenset[int],
    delta_enabled: bool,
    engine_applies: bool,
    force: bool,
) -> None:
    plan = policy.plan_push(
        base,
        version,
        held,
        delta_enabled=delta_enabled,
        engine_applies_deltas=engine_applies,
        force_full=force,
    )
    allowed = (
        delta_enabled
        and engine_applies
        and not force
        and base is not None
        and base in held
        and base < version
    )
    assert (plan.kind == "delta") == allowed
    if plan.kind == "delta":
        assert plan.base == base and plan.event is DeltaEvent.SEND_DELTA
    else:
        assert plan.base is None and plan.event is DeltaEvent.SEND_FULL and plan.reason


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"base": 3, "force_full": True}, "forced"),
        ({"base": 3, "delta_enabled": False}, "disabled"),
        ({"base": 3, "engine_applies_deltas": False}, "engine cannot apply deltas"),
        ({"base": None}, "no base"),
        ({"base": 2}, "base v2 not held"),
        ({"base": 4, "held": {4}}, "base v4 is not older than v4"),
        ({"base": 3}, "delta v3 -> v4"),
    ],
)
def test_plan_push_names_why_a_push_is_full(kwargs: dict[str, Any], reason: str) -> None:
    args: dict[str, Any] = {
        "held": {3},
        "delta_enabled": True,
        "engine_applies_deltas": True,
        "force_full": False,
        **kwargs,
    }
    base = args.pop("base")
    held = args.pop("held")
    assert policy.plan_push(base, 4, held, **args).reason == reason


def test_settle_push_moves_the_base_only_on_a_confirmation() -> None:
    delta = policy.PushPlan("delta", 3, "delta v3 -> v4")
    full = policy.PushPlan("full", None, "no base")
    assert policy.settle_push(delta, ok=True, refused=False) is DeltaEvent.CONFIRM
    assert policy.settle_push(full, ok=True, refused=False) is DeltaEvent.CONFIRM
    assert policy.settle_push(delta, ok=False, refused=True) is DeltaEvent.REFUSED
    assert policy.settle_push(delta, ok=False, refused=False) is DeltaEvent.UNCONFIRMED
    # a full push the engine refused is unconfirmed: its weights are not trusted after it
    assert policy.settle_push(full, ok=False, refused=True) is DeltaEvent.UNCONFIRMED

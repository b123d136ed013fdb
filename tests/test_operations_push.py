"""The delta push written once (``rollsafe.operations.push``): its steps driven by hand with
scripted outcomes, and one changed step changing what ``rollsafe verify`` reports and what a
transport's ``DeltaSender`` does.

The first part answers each effect the sequence yields from a script (no I/O, no machines)
and asserts the effects it yields and what it returns. The second part patches the sequence
(every target is settled as confirmed, also one whose push failed) and shows that both
executors run the patched steps: the verifier finds ``base_never_ahead`` broken, and a real
``DeltaSender`` records a base its failed target does not hold; the unpatched sequence is clean
in both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytest
import torch
from operations_helpers import rewritten

import rollsafe.operations.effects as fx
from rollsafe.operations import push as push_op
from rollsafe.ports import EngineClient, EngineTarget, TargetResult
from rollsafe.statemachines import DeltaEvent
from rollsafe.transports.delta import DeltaSender, DeltaSettings
from rollsafe.verify import ModelConfig, explore

Script = Mapping[type[fx.Effect[Any]], Callable[[Any], fx.Outcome[Any]]]

#: t1 confirmed v1 (a delta from it is possible), t2 has no base yet
BASES = {"t1": 1, "t2": None}


def read_base(effect: fx.ReadBase) -> fx.Outcome[fx.BaseFacts]:
    return fx.Ok(fx.BaseFacts(BASES[effect.target], frozenset({1}), True, True))


def all_ok(effect: fx.PushTargets) -> fx.Outcome[Mapping[str, fx.Delivered]]:
    return fx.Ok({t: fx.Delivered(True) for t in effect.targets})


DEFAULT: Script = {
    fx.ReadBase: read_base,
    fx.EncodeDelta: lambda e: fx.Ok(fx.Encoded(10, 100, True)),
    fx.PushTargets: all_ok,
}


def run(script: Script | None = None, **kw: Any) -> tuple[list[fx.Effect[Any]], Any]:
    """Drive one push of v2 to t1, t2 by hand: each effect answered by ``script`` (else
    :data:`DEFAULT`, else ``Ok()``)."""
    answers = {**DEFAULT, **(script or {})}
    seen: list[fx.Effect[Any]] = []

    def perform(effect: fx.Effect[Any]) -> fx.Outcome[Any]:
        seen.append(effect)
        answer = answers.get(type(effect))
        return answer(effect) if answer is not None else fx.Ok()

    return seen, fx.drive(push_op.push(2, ("t1", "t2"), **kw), perform)


def sends(effects: Sequence[fx.Effect[Any]]) -> list[tuple[str, DeltaEvent]]:
    return [(e.target, e.event) for e in effects if isinstance(e, fx.SendBase)]


def pushes(effects: Sequence[fx.Effect[Any]]) -> list[tuple[tuple[str, ...], int | None]]:
    return [(e.targets, e.base) for e in effects if isinstance(e, fx.PushTargets)]


# ====================================================================== scripted outcomes
def test_a_delta_where_a_base_is_confirmed_and_full_elsewhere() -> None:
    effects, out = run()
    assert sends(effects) == [
        ("t1", DeltaEvent.SEND_DELTA),
        ("t2", DeltaEvent.SEND_FULL),
        ("t1", DeltaEvent.CONFIRM),
        ("t2", DeltaEvent.CONFIRM),
    ]
    assert pushes(effects) == [(("t1",), 1), (("t2",), None)]
    assert out.kinds == {"t1": "delta", "t2": "full"}
    assert out.reasons == {"t2": "no base"} and out.bases == {"t1": 1}


def test_a_refused_delta_is_pushed_full_in_the_same_update() -> None:
    def refuse_delta(effect: fx.PushTargets) -> fx.Outcome[Mapping[str, fx.Delivered]]:
        if effect.base is None:
            return all_ok(effect)
        return fx.Ok(
            {t: fx.Delivered(False, "DeltaBaseMismatch: v0", True) for t in effect.targets}
        )

    effects, out = run({fx.PushTargets: refuse_delta})
    assert sends(effects) == [
        ("t1", DeltaEvent.SEND_DELTA),
        ("t2", DeltaEvent.SEND_FULL),
        ("t1", DeltaEvent.REFUSED),  # the base stays: nothing changed
        ("t1", DeltaEvent.SEND_FULL),
        ("t1", DeltaEvent.CONFIRM),
        ("t2", DeltaEvent.CONFIRM),
    ]
    assert pushes(effects) == [(("t1",), 1), (("t2", "t1"), None)]
    assert out.kinds == {"t1": "full", "t2": "full"}
    assert out.refusals == {"t1": "DeltaBaseMismatch: v0"} and out.reasons["t1"] == "delta refused"


@pytest.mark.parametrize(
    ("encoded", "why"),
    [
        (fx.Ok(fx.Encoded(100, 100, False)), "delta from v1 not smaller (100 >= 100 bytes)"),
        (fx.Failed("ValueError: shapes differ"), "not encoded: ValueError: shapes differ"),
    ],
)
def test_a_delta_not_worth_sending_goes_full(encoded: fx.Outcome[Any], why: str) -> None:
    effects, out = run({fx.EncodeDelta: lambda e: encoded})
    assert ("t1", DeltaEvent.FALLBACK_FULL) in sends(effects)
    assert pushes(effects) == [(("t2", "t1"), None)]  # one full update for both
    assert why in out.reasons["t1"] and out.kinds["t1"] == "full"


def test_a_failed_push_is_settled_unconfirmed() -> None:
    def t2_fails(effect: fx.PushTargets) -> fx.Outcome[Mapping[str, fx.Delivered]]:
        return fx.Ok(
            {t: fx.Delivered(t != "t2", "" if t != "t2" else "rank 1 died") for t in effect.targets}
        )

    effects, _ = run({fx.PushTargets: t2_fails})
    assert sends(effects)[-2:] == [("t1", DeltaEvent.CONFIRM), ("t2", DeltaEvent.UNCONFIRMED)]


def test_a_recoverys_push_forgets_the_bases_and_goes_full() -> None:
    effects, out = run(force_full=True, fresh=True)
    assert sends(effects)[:2] == [("t1", DeltaEvent.RESET), ("t1", DeltaEvent.SEND_FULL)]
    assert pushes(effects) == [(("t1", "t2"), None)]
    assert out.reasons == {"t1": "forced", "t2": "forced"}


# ====================================================================== one changed step
def confirms_every_target(original: Callable[..., fx.Steps[Any]]) -> Callable[..., Any]:
    """The sequence with one step changed: a target whose push failed is settled as confirmed
    (``unconfirmed`` becomes ``confirm``): the sender's base runs ahead of the engine."""

    def rewrite(effect: fx.Effect[Any]) -> list[fx.Effect[Any]]:
        if isinstance(effect, fx.SendBase) and effect.event is DeltaEvent.UNCONFIRMED:
            return [replace(effect, event=DeltaEvent.CONFIRM)]
        return [effect]

    return rewritten(original, rewrite)


def test_changing_one_step_changes_what_verify_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    config = ModelConfig(groups=1, ranks=2, engine="reference", node_loss=False, removals=0)
    clean = explore(config, depth=6)
    assert clean.ok and clean.complete
    monkeypatch.setattr(push_op, "push", confirms_every_target(push_op.push))
    changed = explore(config, depth=6)
    assert not changed.ok
    cex = changed.counterexamples[0]
    assert "base_never_ahead" in {v.invariant for v in cex.violations}
    assert cex.trace[-1].name == "sync"


def test_a_transport_runs_the_same_changed_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real ``DeltaSender``: v1 confirmed by both targets, v2 fails on ``t2``; its base
    stays v1 (or is dropped), never v2, unless the step is changed."""

    def bases_after() -> dict[str, int]:
        sender = DeltaSender(DeltaSettings())
        client: EngineClient = object()  # type: ignore[assignment]  # never called
        targets = [EngineTarget(n, (i,), client, applies_deltas=True) for i, n in enumerate("ab")]
        v1 = [("w", torch.zeros(4096))]
        v2 = [("w", torch.zeros(4096))]
        v2[0][1][:3] = 1.0  # a few elements changed: a delta is worth sending

        def send(
            group: list[EngineTarget], base: int | None, tensors: Any, version: list[int]
        ) -> dict[str, TargetResult]:
            return {
                t.name: TargetResult(t.name, not (t.name == "b" and version[0] == 2)) for t in group
            }

        version = [1]
        sender.push(targets, 1, v1, lambda g, b, t: send(g, b, t, version))
        version[0] = 2
        sender.push(targets, 2, v2, lambda g, b, t: send(g, b, t, version))
        return sender.ledger.bases()

    assert bases_after() == {"a": 2, "b": 1}  # b's failed delta kept its base (all or nothing)
    monkeypatch.setattr(push_op, "push", confirms_every_target(push_op.push))
    assert bases_after() == {"a": 2, "b": 2}  # the changed step ran: b's base ran ahead

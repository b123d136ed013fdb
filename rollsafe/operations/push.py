"""One push of version N with deltas on, written once (``docs/transports.md``, "Deltas").

:func:`push` is the sequence, top-down; every decision in it is :mod:`rollsafe.policy`'s
(:func:`~rollsafe.policy.plan_push`, :func:`~rollsafe.policy.settle_push`) and every step of
I/O an effect its executor performs: a tensor transport's ``DeltaSender`` (the ledger of
``DeltaBase`` machines, the base snapshots, the encoder and the transport's own push) on the
fleet, and :class:`rollsafe.verify.FleetModel` in ``rollsafe verify`` (its engines' ground
truth). What the verifier explores is then what the transports run:

1. **plan** every target (:func:`plan_target`): a delta only from the base it confirmed,
   still held by the sender, to an engine that applies deltas; else full, with the reason; its
   ``DeltaBase`` goes ``sending_delta`` / ``sending_full`` (a restarted target's base is first
   forgotten: ``fresh``);
2. keep a **snapshot** of N (a possible base once targets confirm it);
3. per base, **encode** one delta for its targets; one that cannot be encoded, or is not
   smaller than the full weights, sends those targets full instead (``fallback_full``);
4. **push** each base's delta to its targets; an engine that refuses it by name changed
   nothing: its base stays (``refused``) and it is pushed the full version in the same update;
5. **push** the full targets together;
6. **settle** every target (:func:`settle_target`): its base moves to N only when it
   confirmed N.

A ``DeltaLedger`` drives :func:`plan_target`, :func:`fall_back` and :func:`settle_target` on
their own for callers that push one target at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import rollsafe.policy as policy
from rollsafe.operations.effects import (
    Delivered,
    EncodeDelta,
    KeepSnapshot,
    Ok,
    PushTargets,
    ReadBase,
    SendBase,
    Steps,
    ask,
    read,
)
from rollsafe.statemachines.events import DeltaEvent

__all__ = ["PushOutcome", "fall_back", "plan_target", "push", "settle_target"]

#: why a target whose delta the engine refused is pushed in full
REFUSED = "delta refused"


@dataclass(frozen=True)
class PushOutcome:
    """What one push did, per target: what it got (``kinds``: ``full`` / ``delta``), why
    full (``reasons``), the delta its engine refused first (``refusals``), its result
    (``delivered``) and the base each delta came from (``bases``)."""

    version: int
    delivered: dict[str, Delivered] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    refusals: dict[str, str] = field(default_factory=dict)
    bases: dict[str, int] = field(default_factory=dict)


def push(
    version: int, targets: tuple[str, ...], *, force_full: bool = False, fresh: bool = False
) -> Steps[PushOutcome]:
    """The steps of one push of ``version`` to ``targets`` (``force_full``: a recovery's push;
    ``fresh``: the targets restarted, their bases are forgotten first)."""
    out = PushOutcome(version)
    plans: dict[str, policy.PushPlan] = {}
    by_base: dict[int, list[str]] = {}
    full: list[str] = []
    for target in targets:
        plan = yield from plan_target(target, version, force_full=force_full, fresh=fresh)
        plans[target] = plan
        if plan.kind == "delta" and plan.base is not None:
            by_base.setdefault(plan.base, []).append(target)
        else:
            full.append(target)
            out.reasons[target] = plan.reason
    yield KeepSnapshot(version)

    for base, group in sorted(by_base.items()):
        encoded = yield from ask(EncodeDelta(base, version, tuple(group)))
        why = ""
        if not isinstance(encoded, Ok):
            why = f"delta from v{base} not encoded: {encoded.error}"
        elif not encoded.value.worthwhile:
            size, whole = encoded.value.nbytes, encoded.value.full_nbytes
            why = f"delta from v{base} not smaller ({size} >= {whole} bytes)"
        if why:
            for target in group:
                plans[target] = yield from fall_back(target, why)
                full.append(target)
                out.reasons[target] = why
            continue
        delivered = yield from read(PushTargets(tuple(group), version, base))
        for target in group:
            got = delivered[target]
            if not got.ok and got.refused:  # the engine refused it by name: nothing changed
                yield from settle_target(target, plans[target], version, ok=False, refused=True)
                plans[target] = yield from plan_target(target, version, force_full=True)
                full.append(target)
                out.reasons[target] = REFUSED
                out.refusals[target] = got.reason
                continue
            out.delivered[target], out.kinds[target] = got, "delta"
            out.bases[target] = base

    if full:
        delivered = yield from read(PushTargets(tuple(full), version, None))
        for target in full:
            out.delivered[target], out.kinds[target] = delivered[target], "full"

    for target in targets:
        got = out.delivered[target]
        yield from settle_target(target, plans[target], version, ok=got.ok, refused=False)
    return out


def plan_target(
    target: str, version: int, *, force_full: bool = False, fresh: bool = False
) -> Steps[policy.PushPlan]:
    """Plan the push of ``version`` to ``target`` (:func:`~rollsafe.policy.plan_push`) and
    mark it in flight on its ``DeltaBase`` (``fresh``: its base is forgotten first)."""
    if fresh:
        yield SendBase(target, DeltaEvent.RESET, version, frozenset(), "restarted")
    facts = yield from read(ReadBase(target))
    plan = policy.plan_push(
        facts.base,
        version,
        facts.held,
        delta_enabled=facts.delta_enabled,
        engine_applies_deltas=facts.applies_deltas,
        force_full=force_full,
    )
    yield SendBase(target, plan.event, version, facts.held, "plan_push")
    return plan


def fall_back(target: str, reason: str) -> Steps[policy.PushPlan]:
    """The delta planned for ``target`` goes as a full push of the same version
    (``fallback_full``): not smaller, or it could not be encoded."""
    yield SendBase(target, DeltaEvent.FALLBACK_FULL, None, frozenset(), "fallback_full")
    return policy.PushPlan("full", None, reason)


def settle_target(
    target: str, plan: policy.PushPlan, version: int, *, ok: bool, refused: bool
) -> Steps[None]:
    """The push of ``version`` to ``target`` ended (:func:`~rollsafe.policy.settle_push`): its
    base moves to ``version`` only on ``ok`` (the target confirmed it)."""
    event = policy.settle_push(plan, ok=ok, refused=refused)
    yield SendBase(target, event, version, frozenset(), "settle_push")
    return None

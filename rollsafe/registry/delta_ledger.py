"""The sender's per-target base versions for delta sync (issue #28), torch-free and thread-safe.

Owns one :class:`~rollsafe.statemachines.DeltaBase` per target of a transport: it is the one
handler of :class:`~rollsafe.operations.effects.SendBase` (the event the push operation
decided, sent to the target's machine), a part of the transport's ``DeltaSender`` and of
``rollsafe verify``'s model. The decisions around each push are the push operation's
(:mod:`rollsafe.operations.push`: :func:`~rollsafe.policy.plan_push`, delta or full and why;
:func:`~rollsafe.policy.settle_push`, which event the outcome sends). For a caller that pushes
one target at a time, :meth:`DeltaLedger.plan`, :meth:`~DeltaLedger.fallback_full` and
:meth:`~DeltaLedger.settle` drive that operation's steps for one target; the base of a target
moves only when the target confirmed the result. What the transport must do around it:

* a delta planned but not worth sending (the encoded delta is not smaller than a full sync),
  or one it cannot send, goes full with :meth:`DeltaLedger.fallback_full` (machine event
  ``fallback_full``: ``sending_delta`` -> ``sending_full``, same version);
* a delta the engine refused (by name: ``DeltaBaseMismatch`` and the other ``DeltaError``\\ s)
  is settled ``refused=True`` (base unchanged), then pushed full in the same update
  (``plan(..., force_full=True)``);
* a target that restarted, was added, recovered or removed is :meth:`DeltaLedger.reset`
  (its next push is full); a recovery's targeted push is ``reset`` + ``force_full``;
* the sender keeps a copy of the weights of every version in :meth:`DeltaLedger.bases`
  (the bases still referenced) and passes the versions it holds as ``held``: a target whose
  base it dropped (a lagging one) gets a full push.

Guards refuse a wrong event with :class:`~rollsafe.statemachines.TransitionRefused` (nothing
changed): a second push to a target whose push is still in flight, a confirm of another
version than the one sent, a delta from a base the sender does not hold.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from typing import Any, TypeVar

import rollsafe.operations.effects as fx
import rollsafe.policy as policy
from rollsafe.errors import InvalidArgument, InvalidArgumentType
from rollsafe.operations import push as push_op
from rollsafe.operations.effects import drive
from rollsafe.operations.executor import Executor, handles
from rollsafe.statemachines.base import TransitionRefused
from rollsafe.statemachines.delta_base import DeltaBase
from rollsafe.statemachines.events import DeltaEvent

__all__ = ["DeltaLedger"]

R = TypeVar("R")


class DeltaLedger(Executor):
    """Per-target :class:`~rollsafe.statemachines.DeltaBase` machines of one transport.

    ``machine_cls`` builds each target's machine (tests plant bugs in it). Every method holds
    one lock, so pushes to several targets may plan and settle from several threads.
    """

    def __init__(self, *, machine_cls: type[DeltaBase] = DeltaBase) -> None:
        self._machine_cls = machine_cls
        self._lock = threading.RLock()
        self._machines: dict[str, DeltaBase] = {}
        self._plans: dict[str, policy.PushPlan] = {}
        self._refusal: TransitionRefused | None = None

    # ------------------------------------------------------------------ the effect
    @handles(fx.SendBase)
    def send_base(self, effect: fx.SendBase) -> fx.Outcome[str]:
        """Send the decided event to the target's machine (its guards read the version pushed
        and the versions held): its state, or :class:`Failed` when it refused (nothing
        changed; the refusal is kept for a caller that raises it)."""
        with self._lock:
            machine = self._machine(effect.target)
            kwargs: dict[str, Any] = {}
            if effect.version is not None:
                kwargs["version"] = effect.version
            if effect.event is DeltaEvent.SEND_DELTA:
                kwargs["held"] = effect.held
            try:
                machine.send(effect.event, **kwargs)
            except TransitionRefused as exc:
                self._refusal = exc
                return fx.Failed(str(exc))
            if effect.event is DeltaEvent.RESET:
                self._plans.pop(effect.target, None)
            return fx.Ok(machine.state)

    # ------------------------------------------------------------------ one target at a time
    def plan(
        self,
        target: str,
        version: int,
        held: Collection[int],
        *,
        delta_enabled: bool,
        engine_applies_deltas: bool,
        force_full: bool,
    ) -> policy.PushPlan:
        """Plan the push of ``version`` to ``target`` and mark it in flight (``send_delta`` or
        ``send_full``): :func:`rollsafe.operations.push.plan_target`. Raises
        :class:`~rollsafe.statemachines.TransitionRefused` (nothing changed) while a push to
        ``target`` is still in flight."""
        _check_target(target)
        _check_version(version)
        facts = fx.BaseFacts(
            self.base(target), frozenset(held), delta_enabled, engine_applies_deltas
        )
        with self._lock:
            plan = self._drive(push_op.plan_target(target, version, force_full=force_full), facts)
            self._plans[target] = plan
            return plan

    def fallback_full(self, target: str, reason: str) -> policy.PushPlan:
        """The delta planned for ``target`` goes as a full push of the same version instead
        (``reason``: ``"delta not smaller"``, or why it could not be sent). Refused unless a
        delta to ``target`` is in flight."""
        _check_target(target)
        with self._lock:
            self._known(target)
            plan = self._drive(push_op.fall_back(target, reason))
            self._plans[target] = plan
            return plan

    def settle(self, target: str, version: int, *, ok: bool, refused: bool) -> None:
        """The push of ``version`` to ``target`` ended: ``ok`` when the target confirmed the
        result, ``refused`` when its engine refused a delta by name (nothing changed). The
        base becomes ``version`` only on ``ok``; a confirm of another version than the one in
        flight is refused (nothing changed)."""
        _check_target(target)
        _check_version(version)
        with self._lock:
            machine = self._known(target)
            plan = self._plans.get(target)
            if plan is None or machine.in_flight is None:
                raise InvalidArgument(
                    "target",
                    f"DeltaLedger: no push to {target!r} is in flight (state {machine.state!r})",
                )
            settle = push_op.settle_target(target, plan, version, ok=ok, refused=refused)
            self._drive(settle)
            del self._plans[target]

    def reset(self, target: str) -> None:
        """``target`` restarted, was added, recovered or removed: nothing is known about its
        weights (its next push is full). A push in flight to it is forgotten."""
        _check_target(target)
        with self._lock:
            self.send_base(fx.SendBase(target, DeltaEvent.RESET, None, frozenset(), "reset"))

    def _drive(self, steps: fx.Steps[R], facts: fx.BaseFacts | None = None) -> R:
        """Drive one target's steps; a refused event raises its refusal (nothing changed)."""
        self._refusal = None

        def perform(effect: fx.Effect[Any]) -> fx.Outcome[Any]:
            if isinstance(effect, fx.ReadBase):
                assert facts is not None
                return fx.Ok(facts)
            outcome = self.perform(effect)
            if self._refusal is not None:
                refusal, self._refusal = self._refusal, None
                raise refusal
            return outcome

        return drive(steps, perform)

    # ------------------------------------------------------------------ reads
    def base(self, target: str) -> int | None:
        """The version ``target`` confirmed holding (None: unknown, or a full push under way)."""
        with self._lock:
            machine = self._machines.get(target)
            return machine.base if machine is not None else None

    def bases(self) -> dict[str, int]:
        """Target -> its base, for every target with one: the versions whose weights the
        sender must keep to compute deltas (any other snapshot may be evicted)."""
        with self._lock:
            return {t: m.base for t, m in self._machines.items() if m.base is not None}

    def state(self, target: str) -> str:
        """The state of ``target``'s machine (``no_base`` for a target never planned)."""
        with self._lock:
            machine = self._machines.get(target)
            return machine.state if machine is not None else "no_base"

    def machine(self, target: str) -> DeltaBase | None:
        """``target``'s machine (its history for audits and the timeline), if it has one."""
        with self._lock:
            return self._machines.get(target)

    def machine_for(self, target: str) -> DeltaBase:
        """``target``'s machine, made when it has none (a model checker restores its state)."""
        with self._lock:
            return self._machine(target)

    # ------------------------------------------------------------------ internals
    def _machine(self, target: str) -> DeltaBase:
        machine = self._machines.get(target)
        if machine is None:
            machine = self._machines[target] = self._machine_cls(target)
        return machine

    def _known(self, target: str) -> DeltaBase:
        machine = self._machines.get(target)
        if machine is None:
            raise InvalidArgument("target", f"DeltaLedger: unknown target {target!r}")
        return machine


def _check_target(target: object) -> None:
    if not isinstance(target, str):
        raise InvalidArgumentType("target", f"DeltaLedger: target must be a str, got {target!r}")
    if not target:
        raise InvalidArgument("target", "DeltaLedger: target must be a non-empty str")


def _check_version(version: object) -> None:
    if isinstance(version, bool) or not isinstance(version, int):
        raise InvalidArgumentType(
            "version", f"DeltaLedger: version must be an int, got {version!r}"
        )
    if version < 0:
        raise InvalidArgument("version", f"DeltaLedger: version must be >= 0, got {version}")

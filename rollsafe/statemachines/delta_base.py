"""DeltaBase: which weights version one target engine is known to hold, as the base of deltas.

Owns the sender's side of delta sync (issue #28): a delta names the version it applies onto,
so the sender must know, per target, the exact version that target's engine holds. That
knowledge is this machine's ``base``; it moves only when the target confirmed the result of a
push (never when a push is sent), is dropped when a full push fails (the engine's weights are
then unknown) and when the target restarts, is added or recovers (``reset``). One machine per
(transport, target); :class:`rollsafe.registry.delta_ledger.DeltaLedger` keeps them, and
``rollsafe verify`` drives the same machine against each engine's true version.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from statemachine import State

from rollsafe.statemachines.base import GuardedMachine, GuardInputMissing

__all__ = ["DeltaBase"]


class DeltaBase(GuardedMachine):
    """The confirmed base version of one target, and the push in flight to it.

    States: ``no_base`` (initial: nothing is known about the target's weights; only a full push
    may go), ``based`` (the target confirmed holding ``base``), ``sending_full`` (a full push of
    ``in_flight`` is under way), ``sending_delta`` (a delta from ``base`` to ``in_flight`` is
    under way).

    Events: ``send_full(version=)`` from ``no_base``/``based``; ``send_delta(version=, held=)``
    from ``based``, guarded by ``base_snapshot_held`` (the sender still holds a copy of the base
    version's weights to diff against: ``base in held``) and ``newer_than_base``;
    ``fallback_full`` (``sending_delta`` -> ``sending_full``: the delta was not smaller than a
    full sync, or could not be sent, and the same target gets a full push of the same version
    instead); ``confirm(version=)`` from either sending state, guarded by ``confirms_the_push``
    (the version is the one in flight), sets ``base`` to it; ``unconfirmed`` (the push failed or
    its result was never confirmed): from ``sending_full`` to ``no_base`` (the engine may hold
    part of the new weights), from ``sending_delta`` back to ``based`` with the base unchanged
    (an engine applies a delta all or nothing); ``refused`` (the engine refused the delta, named
    reason, nothing changed: ``sending_delta`` -> ``based``, base unchanged); ``reset`` from any
    state to ``no_base`` (the target restarted, was added, recovered or was removed).

    Invariants: ``base`` is an int exactly in ``based`` and ``sending_delta``, None otherwise;
    ``base`` changes only by ``confirm`` (to the version that was in flight), by ``unconfirmed``
    after a full push and by ``reset`` (to None), never by sending; a delta is sent only from
    ``based`` and only from a base whose weights the sender holds; ``in_flight`` is set exactly
    in the two sending states.
    """

    no_base = State("No base", initial=True)
    based = State("Based")
    sending_full = State("Sending full")
    sending_delta = State("Sending delta")

    send_full = no_base.to(sending_full, validators="version_given") | based.to(
        sending_full, validators="version_given"
    )
    send_delta = based.to(
        sending_delta,
        cond=["base_snapshot_held", "newer_than_base"],
        validators=["version_given", "held_given"],
    )
    fallback_full = sending_delta.to(sending_full)
    confirm = sending_full.to(
        based, cond="confirms_the_push", validators="version_given"
    ) | sending_delta.to(based, cond="confirms_the_push", validators="version_given")
    unconfirmed = sending_full.to(no_base) | sending_delta.to(based)
    refused = sending_delta.to(based)
    reset = (
        no_base.to(no_base)
        | based.to(no_base)
        | sending_full.to(no_base)
        | sending_delta.to(no_base)
    )

    def __init__(self, target: str = "") -> None:
        self.target = target
        self._base: int | None = None
        self._in_flight: int | None = None
        super().__init__()

    @property
    def label(self) -> str:
        return f"DeltaBase({self.target})" if self.target else "DeltaBase"

    @property
    def base(self) -> int | None:
        """The version the target confirmed holding (``based``, ``sending_delta``); else None."""
        if self.current_state_value in ("based", "sending_delta"):
            return self._base
        return None

    @property
    def in_flight(self) -> int | None:
        """The version being pushed (``sending_full``, ``sending_delta``); else None."""
        if self.current_state_value in ("sending_full", "sending_delta"):
            return self._in_flight
        return None

    def restore_base(self, base: int | None, in_flight: int | None) -> None:
        """Set the base and the version in flight (model checking only; the state is set with
        ``restore_state``)."""
        with self._lock:
            self._base, self._in_flight = base, in_flight

    def facts_token(self) -> Any:
        return (self._base, self._in_flight)

    def facts_from_token(self, token: Any) -> dict[str, Any]:
        base, in_flight = token
        return {"base": base, "in_flight": in_flight}

    # ------------------------------------------------------------------ validators
    def version_given(self, version: int | None = None) -> None:
        """``send_full``, ``send_delta`` and ``confirm`` need ``version=``."""
        if version is None:
            raise GuardInputMissing(f"{self.label}: this event needs version=")

    def held_given(self, held: Collection[int] | None = None) -> None:
        """``send_delta`` needs ``held=``: the versions whose weights the sender still holds."""
        if held is None:
            raise GuardInputMissing(f"{self.label}: send_delta needs held=")

    # ------------------------------------------------------------------ guards
    def base_snapshot_held(self, held: Collection[int] = ()) -> bool:
        """The sender still holds the base version's weights (a delta is computed from them)."""
        return self._base is not None and self._base in held

    def newer_than_base(self, version: int = -1) -> bool:
        """A delta moves the target forward: ``version`` is newer than the base."""
        return self._base is not None and version > self._base

    def confirms_the_push(self, version: int = -1) -> bool:
        """The confirmed version is the one in flight (a stale or foreign confirm is refused)."""
        return version == self._in_flight

    # ------------------------------------------------------------------ actions
    def on_send_full(self, version: int) -> None:
        self._in_flight = version

    def on_send_delta(self, version: int) -> None:
        self._in_flight = version

    def on_confirm(self, version: int) -> None:
        self._base = version
        self._in_flight = None

    def on_unconfirmed(self, source: State) -> None:
        if source.id == "sending_full":
            self._base = None  # a failed full push leaves the engine's weights unknown
        self._in_flight = None

    def on_refused(self) -> None:
        self._in_flight = None

    def on_reset(self) -> None:
        self._base = None
        self._in_flight = None

"""ImmediateRecoveryMode: whether a crashed group may be restarted from the async HF export.

One per fleet. Immediate recovery needs the export of the current version to be ready before the
next sync starts. A late export suspends the mode (that export is abandoned, never used); unlike
the reference design, which disabled immediate recovery forever after one late export, K
consecutive on-time exports re-arm it.
"""

from __future__ import annotations

from typing import Any

from statemachine import State

from rollsafe.errors import InvalidArgument
from rollsafe.statemachines.base import GuardedMachine

__all__ = ["ImmediateRecoveryMode"]


class ImmediateRecoveryMode(GuardedMachine):
    """Immediate-recovery switch of a fleet: ``disabled``, ``enabled`` or ``suspended``.

    ``export_late`` (the export of version N was not ready when sync N+1 began) moves
    ``enabled``/``suspended`` to ``suspended`` and resets the on-time streak;
    ``export_on_time`` keeps ``enabled``, and in ``suspended`` counts the streak, re-arming to
    ``enabled`` once it reaches ``rearm_after`` consecutive on-time exports.

    Invariants: a late export always leaves the mode ``suspended``; ``rearm_after`` consecutive
    on-time exports after the last late one always leave it ``enabled`` (never suspended
    forever); ``disabled`` changes only by ``enable``.
    """

    disabled = State("Disabled", initial=True)
    enabled = State("Enabled")
    suspended = State("Suspended")

    enable = disabled.to(enabled)
    disable = enabled.to(disabled) | suspended.to(disabled)
    export_late = enabled.to(suspended) | suspended.to.itself(  # type: ignore[no-untyped-call]
        internal=True
    )
    export_on_time = (
        enabled.to.itself(internal=True)  # type: ignore[no-untyped-call]
        | suspended.to(enabled, cond="rearm_streak_reached")
        | suspended.to.itself(internal=True)  # type: ignore[no-untyped-call]
    )

    def __init__(self, enabled: bool = False, rearm_after: int = 2) -> None:
        if rearm_after < 1:
            raise InvalidArgument("rearm_after", f"rearm_after must be >= 1, got {rearm_after}")
        self.rearm_after = rearm_after
        self.on_time_streak = 0
        super().__init__(start_value="enabled" if enabled else "disabled")

    @property
    def allows_immediate(self) -> bool:
        """Whether recovery may restart a group from the ready export now."""
        return bool(self.current_state_value == "enabled")

    def facts_token(self) -> Any:
        return self.on_time_streak

    def facts_from_token(self, token: Any) -> dict[str, Any]:
        return {"on_time_streak": token, "rearm_after": self.rearm_after}

    # ------------------------------------------------------------------ guards
    def rearm_streak_reached(self) -> bool:
        """This on-time export makes ``rearm_after`` consecutive ones."""
        return self.on_time_streak + 1 >= self.rearm_after

    # ------------------------------------------------------------------ actions
    def on_export_late(self) -> None:
        self.on_time_streak = 0

    def on_export_on_time(self, source: State, target: State) -> None:
        if target.id == "enabled":
            self.on_time_streak = 0  # re-armed (or already on): the streak starts over
        elif source.id == "suspended":
            self.on_time_streak += 1

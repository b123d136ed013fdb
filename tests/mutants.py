"""Deliberately planted versions of the reviewers' bugs (DESIGN.md section 1).

Each mutant subclasses a real machine and breaks exactly one thing; the mutation tests assert that
the property tests and the exhaustive verifier catch every one of them.
"""

from __future__ import annotations

from collections.abc import Collection

from rollsafe.statemachines import (
    CheckpointRegistration,
    ExportLifecycle,
    ImmediateRecoveryMode,
    WorkerGroupLifecycle,
)


class AnyHealthyGroup(WorkerGroupLifecycle):
    """Bug: the group guard asks any() member instead of all()."""

    def all_members_healthy(self) -> bool:
        return any(m.healthy for m in self._members.values())


class PublishOnFailedRegister(CheckpointRegistration):
    """Bug: a register in which a rank failed still publishes its name."""

    def every_rank_registered(self, ranks_ok: Collection[int] | None = None) -> bool:
        return True


class PublishAfterRegisterThrew(CheckpointRegistration):
    """Bug: the name is published before registration is known to succeed, and stays published
    although registration threw (publication no longer derived from the state)."""

    def on_register_failed(self, reason: str = "unspecified") -> None:
        self._published = self.pending
        self.failure_reason = reason

    @property
    def published(self) -> tuple[str, int] | None:
        return self._published


class DeleteLeasedExport(ExportLifecycle):
    """Bug: retention deletes an export while a restart still loads from it."""

    def no_leases_held(self) -> bool:
        return True


class SuspendedForever(ImmediateRecoveryMode):
    """Bug: one late export disables immediate recovery for good (never re-armed)."""

    def rearm_streak_reached(self) -> bool:
        return False


MUTANTS = {
    "any_instead_of_all": {"group_cls": AnyHealthyGroup},
    "publish_on_failed_register": {"registration_cls": PublishOnFailedRegister},
    "publish_after_register_threw": {"registration_cls": PublishAfterRegisterThrew},
    "delete_leased_export": {"export_cls": DeleteLeasedExport},
    "suspended_forever": {"mode_cls": SuspendedForever},
}

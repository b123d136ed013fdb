"""The machines' events as typed constants: one enum per machine.

Owns the event vocabulary the fleet sends. Each member's value is the event's name in its
machine class, so ``machine.send(GroupEvent.CLAIM)`` and ``registry.send(gid, GroupEvent.CLAIM)``
are checked by mypy (a misspelt constant is an attribute error) where a free string would not
be. :func:`event_name` turns a constant (or a plain string, for callers outside the typed API)
into the name the machine knows. A test checks that every member names an event of its machine
and that every event of a machine has a member.
"""

from __future__ import annotations

from enum import Enum

__all__ = [
    "AnyEvent",
    "DeltaEvent",
    "ExportEvent",
    "GroupEvent",
    "ModeEvent",
    "RegistrationEvent",
    "event_name",
]


class _Event(str, Enum):
    """An event constant: a ``str`` equal to, and printed as, the event's name."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class GroupEvent(_Event):
    """Events of :class:`~rollsafe.statemachines.WorkerGroupLifecycle`."""

    LAUNCHED = "launched"
    FAIL = "fail"
    CLAIM = "claim"
    RESTARTED = "restarted"
    RESTART_FAILED = "restart_failed"
    MARK_STALE = "mark_stale"
    WEIGHTS_LOADED = "weights_loaded"
    RETIRE = "retire"
    NODE_LOST = "node_lost"
    PLACED = "placed"
    DRAIN = "drain"
    PROMOTE = "promote"
    ENLIST = "enlist"


class ExportEvent(_Event):
    """Events of :class:`~rollsafe.statemachines.ExportLifecycle`."""

    ADOPT = "adopt"
    SNAPSHOT = "snapshot"
    SNAPSHOT_DONE = "snapshot_done"
    SHARDS_WRITTEN = "shards_written"
    PUBLISH = "publish"
    SUPERSEDE = "supersede"
    DELETE = "delete"
    FAIL = "fail"
    ABANDON = "abandon"


class RegistrationEvent(_Event):
    """Events of :class:`~rollsafe.statemachines.CheckpointRegistration`."""

    BEGIN_REGISTER = "begin_register"
    REGISTER_OK = "register_ok"
    REGISTER_FAILED = "register_failed"
    BEGIN_UPDATE = "begin_update"
    UPDATE_DONE = "update_done"


class ModeEvent(_Event):
    """Events of :class:`~rollsafe.statemachines.ImmediateRecoveryMode`."""

    ENABLE = "enable"
    DISABLE = "disable"
    EXPORT_LATE = "export_late"
    EXPORT_ON_TIME = "export_on_time"


class DeltaEvent(_Event):
    """Events of :class:`~rollsafe.statemachines.DeltaBase` (issue #28, delta sync)."""

    SEND_FULL = "send_full"
    SEND_DELTA = "send_delta"
    FALLBACK_FULL = "fallback_full"
    CONFIRM = "confirm"
    UNCONFIRMED = "unconfirmed"
    REFUSED = "refused"
    RESET = "reset"


AnyEvent = GroupEvent | ExportEvent | RegistrationEvent | ModeEvent | DeltaEvent


def event_name(event: AnyEvent | str) -> str:
    """The plain event name of a constant (``GroupEvent.CLAIM`` -> ``"claim"``)."""
    if isinstance(event, Enum):
        return str(event.value)
    return str(event)

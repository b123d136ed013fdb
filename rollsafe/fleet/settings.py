"""The fleet components' settings: the one place their defaults live, validated on construction.

Owns :class:`HealthSettings` (the :class:`~rollsafe.fleet.HealthManager`'s probing) and
:class:`RecoverySettings` (the :class:`~rollsafe.fleet.RecoveryCoordinator`'s pool, deadlines and
retries, plus the fleet-level restart budget and targeted-push switch). Each component takes its
settings object; its public keyword arguments (``interval_s=``, ``recovery_timeout_s=``...)
still work and override the object's fields. A bad value raises :class:`FleetConfigError` naming
the field (``health.interval_s``) when the settings object is built, before anything starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from rollsafe.fleet.registry import FleetError

__all__ = ["FleetConfigError", "HealthSettings", "RecoverySettings", "with_overrides"]

S = TypeVar("S")


class FleetConfigError(FleetError, ValueError):
    """A fleet setting is malformed; ``key`` names it (e.g. ``groups[1].ranks``)."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"fleet config {key!r}: {message}")


def check_number(
    key: str, value: object, *, integer: bool = False, zero: bool = False, alias: str = ""
) -> None:
    """Raise :class:`FleetConfigError` unless ``value`` is a positive number (``zero``: or 0)."""
    also = f" ({alias})" if alias else ""
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type:
        kind = "n int" if integer else " number"
        raise FleetConfigError(key, f"must be a{kind}, got {value!r}{also}")
    assert isinstance(value, (int, float))
    if value < 0 or (value == 0 and not zero):
        raise FleetConfigError(key, f"must be {'>= 0' if zero else '> 0'}, got {value!r}{also}")


@dataclass(frozen=True)
class HealthSettings:
    """How the health manager probes: every ``interval_s`` (or at once on a wake), each probe
    bounded by ``timeout_s``; ``failure_threshold`` consecutive failures of a rank fail its
    group. ``max_workers`` is validated but caps nothing: each sync probe runs on a daemon
    thread of its own and a group whose probe hangs is not probed again, so at most one probe
    thread per group is alive."""

    interval_s: float = 0.5
    timeout_s: float = 2.0
    failure_threshold: int = 2
    max_workers: int = 64

    def __post_init__(self) -> None:
        check_number("health.interval_s", self.interval_s, alias="interval_s=")
        check_number("health.timeout_s", self.timeout_s, alias="timeout_s=")
        check_number(
            "health.failure_threshold",
            self.failure_threshold,
            integer=True,
            alias="failure_threshold=",
        )
        check_number("health.max_workers", self.max_workers, integer=True, alias="max_workers=")


@dataclass(frozen=True)
class RecoverySettings:
    """How recoveries run: ``max_workers`` at once, each bounded by ``timeout_s``; skipped when
    ``remaining_work_s()`` says the rollout ends within ``expected_recovery_s``; a failed
    attempt is retried (``retry``) after ``retry_delay_s`` while the group's ``restart_budget``
    lasts. ``health_timeout_s`` bounds each health check of a restarted engine,
    ``stop_timeout_s`` the polite stop of a failed one. ``targeted_push=False`` gives the
    recovery no transport: without immediate recovery a restarted group then waits in
    ``pending_weights`` for the next sync (the deferred baseline)."""

    max_workers: int = 2
    timeout_s: float = 120.0
    restart_budget: int = 3
    targeted_push: bool = True
    expected_recovery_s: float = 10.0
    retry_delay_s: float = 0.5
    remaining_work_s: Callable[[], float | None] | None = None
    retry: bool = True
    health_timeout_s: float = 5.0
    stop_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        check_number("recovery.max_workers", self.max_workers, integer=True,
                      alias="max_workers=")  # fmt: skip
        check_number("recovery.timeout_s", self.timeout_s, alias="recovery_timeout_s=")
        check_number("recovery.restart_budget", self.restart_budget, integer=True, zero=True)
        check_number("recovery.expected_recovery_s", self.expected_recovery_s, zero=True,
                     alias="expected_recovery_s=")  # fmt: skip
        check_number("recovery.retry_delay_s", self.retry_delay_s, zero=True,
                     alias="retry_delay_s=")  # fmt: skip
        check_number("recovery.health_timeout_s", self.health_timeout_s,
                     alias="health_timeout_s=")  # fmt: skip
        check_number("recovery.stop_timeout_s", self.stop_timeout_s, zero=True,
                     alias="stop_timeout_s=")  # fmt: skip
        for name in ("targeted_push", "retry"):
            if not isinstance(getattr(self, name), bool):
                raise FleetConfigError(f"recovery.{name}", f"must be a bool, got "
                                       f"{getattr(self, name)!r}")  # fmt: skip
        if self.remaining_work_s is not None and not callable(self.remaining_work_s):
            raise FleetConfigError(
                "recovery.remaining_work_s",
                f"must be a callable or None, got {self.remaining_work_s!r}",
            )


def with_overrides(settings: S, overrides: Mapping[str, Any]) -> S:
    """``settings`` with the given fields replaced (None values ignored), validated again."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if not given:
        return settings
    return dataclasses.replace(settings, **given)  # type: ignore[type-var]

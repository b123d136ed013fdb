"""What the recorded-run writer and the metrics read of a fleet: :class:`FleetView`.

``rollsafe.observe`` sits below the fleet (``docs/architecture.md``): it reads a fleet through
this narrow interface and never imports ``RolloutFleet``, which implements it. Every member is
something the fleet already holds for its own use; nothing here is written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rollsafe.observe.observer import FleetObserver
    from rollsafe.observe.stream import RunStream
    from rollsafe.ports import WeightTransport
    from rollsafe.registry import FleetRegistry
    from rollsafe.statemachines.recovery_mode import ImmediateRecoveryMode

__all__ = ["FleetView", "RecoveryRecord", "SyncRecord"]


class _Config(Protocol):
    """The config values the observers name (``FleetConfig`` has them)."""

    @property
    def transport(self) -> Any: ...

    @property
    def enable_immediate_recovery(self) -> bool: ...

    @property
    def initial_version(self) -> int: ...

    @property
    def rearm_after(self) -> int: ...

    @property
    def on_update_failure(self) -> str: ...

    @property
    def recovery(self) -> Any: ...  # RecoverySettings: restart_budget, targeted_push

    @property
    def health(self) -> Any: ...  # HealthSettings: failure_threshold

    @property
    def engine_traits(self) -> Any: ...  # policy.EngineTraits

    @property
    def spare_groups(self) -> int: ...


class _Syncs(Protocol):
    def reports(self) -> Sequence[SyncRecord]: ...

    #: reports that left ``reports()`` (it keeps the last ones)
    reports_dropped: int


class _Router(Protocol):
    def stats(self) -> dict[str, Any]: ...


class SyncRecord(Protocol):
    """One sync's report as the observers read it (``rollsafe.fleet.SyncReport``)."""

    @property
    def version(self) -> int: ...

    @property
    def ok(self) -> bool: ...

    @property
    def started_at(self) -> float: ...

    @property
    def timings(self) -> Mapping[str, float]: ...

    @property
    def delta(self) -> Mapping[str, Any] | None:
        """The sync's deltas (``DeltaRecord.as_dict()``), None when deltas are off."""

    def as_dict(self) -> dict[str, Any]: ...


class RecoveryRecord(Protocol):
    """One recovery's record as the observers read it (``rollsafe.fleet.RecoveryResult``)."""

    @property
    def group_id(self) -> str: ...

    @property
    def status(self) -> str: ...

    @property
    def strategy(self) -> Any: ...

    @property
    def failed_at(self) -> float: ...

    @property
    def submitted_at(self) -> float: ...

    @property
    def finished_at(self) -> float: ...

    @property
    def steps(self) -> Sequence[Any]: ...

    @property
    def latency_s(self) -> float | None: ...

    def as_dict(self) -> dict[str, Any]: ...


class FleetView(Protocol):
    """A fleet as ``rollsafe.observe`` reads it (``RolloutFleet`` is one)."""

    @property
    def registry(self) -> FleetRegistry: ...

    @property
    def mode(self) -> ImmediateRecoveryMode: ...

    @property
    def observer(self) -> FleetObserver: ...

    @property
    def transport(self) -> WeightTransport | None: ...

    @property
    def exporter(self) -> Any: ...

    @property
    def started_at(self) -> float | None: ...

    @property
    def group_ids(self) -> list[str]: ...

    @property
    def config(self) -> _Config: ...

    @property
    def sync(self) -> _Syncs | None: ...

    @property
    def router(self) -> _Router: ...

    def timeline(self) -> list[dict[str, Any]]: ...

    def recoveries(self) -> Sequence[RecoveryRecord]: ...

    @property
    def recoveries_dropped(self) -> int:
        """Recoveries that left :meth:`recoveries` (it keeps the last ones)."""

    @property
    def stream(self) -> RunStream | None:
        """The run streamed to ``FleetConfig.run_dir`` (None: not streamed)."""

    def export_states(self) -> dict[int, str]: ...

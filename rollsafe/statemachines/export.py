"""ExportLifecycle: the lifecycle of one recovery export (the HF copy of weights version N).

The exporter (``rollsafe.hf``) does the I/O and reports what it verified; this machine decides
what may be published, offered for recovery, or deleted. It also owns the export's leases: a
restart that loads from an export holds a lease, leases can be taken only in ``ready``, and an
export with leases is never deleted.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from statemachine import State

from rollsafe.errors import InvalidArgument, RollsafeError
from rollsafe.statemachines.base import GuardedMachine, GuardInputMissing

__all__ = ["ExportLease", "ExportLifecycle", "LeaseError"]

_lease_ids = itertools.count(1)


class LeaseError(RollsafeError, RuntimeError):
    """A lease was asked for outside ``ready``, or an unknown lease was released."""


@dataclass(frozen=True)
class ExportLease:
    """A hold on a ready export: while any is held, the export cannot be deleted."""

    lease_id: int
    version: int
    holder: str


class ExportLifecycle(GuardedMachine):
    """Lifecycle of the recovery export of one weights version.

    States: ``requested`` (initial), ``snapshotting`` (host copy in progress; training blocked),
    ``writing`` (background writer writing shards into a hidden temp dir), ``committing`` (index,
    manifest, fsync, atomic rename), ``ready`` (complete and verified: may be offered for
    recovery), ``superseded`` (a newer export became ready), and the finals ``deleted``,
    ``failed`` (temp dir removed; nothing visible under the final name), ``abandoned`` (missed its
    deadline: the next sync began first; never used).

    Guards read the facts the exporter reports with each event: ``adopt(verified=, version=)``,
    ``shards_written(ranks_ok=)``, ``publish(index_missing_keys=, checksums_verified=,
    renamed=)``, ``supersede(newer_version=)``.

    Invariants: only ``ready`` exports hand out leases; an export with leases is never deleted;
    ``ready`` is reached only through a publish whose index, checksums and rename all verified,
    or by adopting a verified regular save of the same version.
    """

    requested = State("Requested", initial=True)
    snapshotting = State("Snapshotting")
    writing = State("Writing")
    committing = State("Committing")
    ready = State("Ready")
    superseded = State("Superseded")
    deleted = State("Deleted", final=True)
    failed = State("Failed", final=True)
    abandoned = State("Abandoned", final=True)

    adopt = requested.to(ready, cond="regular_save_verified", validators="save_version_given")
    snapshot = requested.to(snapshotting)
    snapshot_done = snapshotting.to(writing)
    shards_written = writing.to(
        committing, cond="every_rank_reported_success", validators="writer_report_given"
    )
    publish = committing.to(
        ready,
        cond=["index_covers_every_key", "manifest_checksums_verify", "atomic_rename_done"],
        validators="index_report_given",
    )
    supersede = ready.to(superseded, cond="newer_export_ready", validators="newer_version_given")
    delete = superseded.to(deleted, cond="no_leases_held")
    fail = snapshotting.to(failed) | writing.to(failed) | committing.to(failed)
    abandon = snapshotting.to(abandoned) | writing.to(abandoned) | committing.to(abandoned)

    def __init__(self, version: int, world_size: int = 1) -> None:
        if version < 0:
            raise InvalidArgument("version", f"export version must be >= 0, got {version}")
        if world_size < 1:
            raise InvalidArgument("world_size", f"export world_size must be >= 1, got {world_size}")
        self.version = version
        self.world_size = world_size
        self.failure_reason: str | None = None
        self._leases: dict[int, ExportLease] = {}
        super().__init__()

    @property
    def label(self) -> str:
        return f"ExportLifecycle(v{self.version})"

    # ------------------------------------------------------------------ leases
    @property
    def leases(self) -> tuple[ExportLease, ...]:
        """Leases currently held."""
        with self._lock:
            return tuple(self._leases.values())

    def acquire_lease(self, holder: str = "recovery") -> ExportLease:
        """Take a lease for a restart loading from this export. Only in ``ready``."""
        with self._lock:
            if self.current_state_value != "ready":
                raise LeaseError(
                    f"{self.label}: leases can be taken only in 'ready', not in {self.state!r}"
                )
            lease = ExportLease(next(_lease_ids), self.version, holder)
            self._leases[lease.lease_id] = lease
            return lease

    def release_lease(self, lease: ExportLease) -> None:
        """Give a lease back. Releasing an unknown (or already released) lease raises."""
        with self._lock:
            if self._leases.pop(lease.lease_id, None) is None:
                raise LeaseError(f"{self.label}: lease {lease.lease_id} is not held")

    def restore_lease(self, lease: ExportLease) -> None:
        """Hold ``lease`` whatever the state (model checking only: the explorer restores leased
        exports into any state it reached)."""
        with self._lock:
            self._leases[lease.lease_id] = lease

    @property
    def offerable(self) -> bool:
        """Whether recovery may load from this export now (``ready``)."""
        return bool(self.current_state_value == "ready")

    def facts_token(self) -> Any:
        return len(self._leases)

    def facts_from_token(self, token: Any) -> dict[str, Any]:
        return {"version": self.version, "leases": token}

    # ------------------------------------------------------------------ validators
    def save_version_given(self, version: int | None = None) -> None:
        """``adopt`` needs the regular save's ``version=``."""
        if version is None:
            raise GuardInputMissing(f"{self.label}: adopt needs version= of the regular save")

    def writer_report_given(self, ranks_ok: Collection[int] | None = None) -> None:
        """``shards_written`` needs the writers' ``ranks_ok=``."""
        if ranks_ok is None:
            raise GuardInputMissing(f"{self.label}: shards_written needs ranks_ok=")

    def index_report_given(self, index_missing_keys: Collection[str] | None = None) -> None:
        """``publish`` needs the index check's ``index_missing_keys=``."""
        if index_missing_keys is None:
            raise GuardInputMissing(f"{self.label}: publish needs index_missing_keys=")

    def newer_version_given(self, newer_version: int | None = None) -> None:
        """``supersede`` needs ``newer_version=``."""
        if newer_version is None:
            raise GuardInputMissing(f"{self.label}: supersede needs newer_version=")

    # ------------------------------------------------------------------ guards
    def regular_save_verified(self, verified: bool = False, version: int | None = None) -> bool:
        """A regular HF save of the same version exists and verified."""
        if version is None:
            return False
        return bool(verified) and version == self.version

    def every_rank_reported_success(self, ranks_ok: Collection[int] | None = None) -> bool:
        """Every writer rank in range(world_size) reported success."""
        if ranks_ok is None:
            return False
        return set(ranks_ok) == set(range(self.world_size))

    def index_covers_every_key(self, index_missing_keys: Collection[str] | None = None) -> bool:
        """The written index maps every expected key to a shard."""
        if index_missing_keys is None:
            return False
        return len(index_missing_keys) == 0

    def manifest_checksums_verify(self, checksums_verified: bool = False) -> bool:
        """Every file's size and checksum matched the manifest on read-back."""
        return bool(checksums_verified)

    def atomic_rename_done(self, renamed: bool = False) -> bool:
        """The temp dir was renamed to its final name (and the parent fsynced)."""
        return bool(renamed)

    def newer_export_ready(self, newer_version: int | None = None) -> bool:
        """A newer version's export is ready."""
        if newer_version is None:
            return False
        return newer_version > self.version

    def no_leases_held(self) -> bool:
        """No restart holds a lease on this export."""
        return not self._leases

    # ------------------------------------------------------------------ actions
    def on_fail(self, reason: str = "unspecified") -> None:
        self.failure_reason = reason

    def on_abandon(self, reason: str = "missed its deadline") -> None:
        self.failure_reason = reason

"""Which exports stay on disk: keep the newest N ready ones, delete the rest once unleased.

Owns the exporter's records (version, path, lifecycle, adopted or written by us), the execution
of the retention step that :func:`rollsafe.policy.plan_retention` decides (older ``ready``
exports are superseded; superseded exports without leases are deleted; the machine's ``delete``
guard refuses a leased one as a second net), the removal of a directory
(renamed to a hidden trash name first, so a half-deleted export is never visible under its final
name) and the clean-up of hidden temp/trash directories left by a writer that was killed.
Adopted directories (a user's regular ``save_pretrained`` output) are only un-listed, never
removed.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Collection, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from rollsafe.hf.layout import fsync_dir, parse_temp_name, temp_dir
from rollsafe.hf.verify import VerifiedExport, reverify, verify_hf_dir
from rollsafe.processes import pid_alive
from rollsafe.statemachines import ExportEvent, ExportLifecycle, TransitionNotAllowed

__all__ = [
    "ExportRecord",
    "apply_retention",
    "discard_dir",
    "move_to_trash",
    "remove_stale_temp_dirs",
]

log = logging.getLogger("rollsafe.hf")


@dataclass(frozen=True)
class ExportRecord:
    """An export known to the exporter: where it is and its lifecycle.

    ``adopted`` marks a user's own save adopted in place (never deleted from disk: retention
    only un-lists it). ``start`` marks the fleet's start checkpoint (its ``model_path``, the
    export of ``initial_version``: :meth:`~rollsafe.hf.HFExporter.adopt_start`), always
    ``adopted`` too. ``verified`` is what verification found when it became ready (file
    identities included): :meth:`reverify` checks the directory still holds those very files.
    """

    version: int
    path: Path
    lifecycle: ExportLifecycle
    adopted: bool = False
    verified: VerifiedExport | None = None
    start: bool = False

    @property
    def state(self) -> str:
        """The lifecycle state (``ready``, ``superseded``...)."""
        return self.lifecycle.state

    def reverify(self, *, full: bool = False) -> VerifiedExport:
        """Check the export still holds the files that verified (cheap ``stat`` check; with
        ``full=True`` also every header, key and SHA-256). Raises
        :class:`~rollsafe.hf.errors.ExportVerificationError` naming what changed. A record
        without a verification result (made by hand) is verified from scratch."""
        if self.verified is None:
            return verify_hf_dir(self.path, allow_missing_prefixes=())
        return reverify(self.verified, full=full)


def apply_retention(
    records: MutableMapping[int, ExportRecord], keep_last: int
) -> list[ExportRecord]:
    """Supersede ready exports beyond the newest ``keep_last``; delete unleased superseded ones.

    Sends ``supersede``/``delete`` to the machines and drops deleted records from ``records``;
    returns the deleted records whose directories the caller must remove (adopted ones are not
    returned: they stay on disk). Call with the exporter's lock held; remove directories after.
    """
    import rollsafe.policy as policy  # the decision; this function executes it

    facts = [
        policy.ExportFacts(r.version, r.state, len(r.lifecycle.leases)) for r in records.values()
    ]
    plan = policy.plan_retention(facts, keep_last)
    for version, newest in plan.supersede:
        old = records[version]
        old.lifecycle.send(ExportEvent.SUPERSEDE, newer_version=newest)
        log.info("export v%d superseded by v%d (%s)", old.version, newest, old.path)
    for version, why in plan.kept.items():
        record = records[version]
        log.info(
            "export v%d kept: %s (%s)",
            version,
            why,
            ", ".join(lease.holder for lease in record.lifecycle.leases),
        )
    to_remove: list[ExportRecord] = []
    for version in plan.delete:
        record = records[version]
        try:
            record.lifecycle.send(ExportEvent.DELETE)
        except TransitionNotAllowed as exc:  # a lease was taken meanwhile: keep it
            log.info("export v%d kept: %s", version, exc)
            continue
        del records[record.version]
        if record.adopted:
            log.info("adopted export v%d un-listed; %s left on disk", record.version, record.path)
        else:
            to_remove.append(record)
    return to_remove


def move_to_trash(path: Path, version: int) -> Path | None:
    """Take an export directory off its final name: rename it to a hidden trash name (atomic,
    fsynced). Returns the trash path to remove with ``shutil.rmtree``, or None if it was gone."""
    if not path.exists():
        return None
    trash = temp_dir(path.parent, version, kind="trash")
    os.rename(path, trash)
    fsync_dir(path.parent)
    return trash


def discard_dir(path: Path, version: int) -> None:
    """Remove an export directory: first rename it to a hidden trash name, then delete it."""
    trash = move_to_trash(path, version)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
        log.info("export v%d deleted (%s)", version, path)


def remove_stale_temp_dirs(root: Path, live: Collection[Path] = ()) -> list[Path]:
    """Remove hidden ``.hf-v*.tmp-<pid>-*`` / ``.trash-`` dirs whose writer process is dead.

    Directories of this process are kept unless their writer is gone (not in ``live``) and
    their kind is trash; directories of live processes are always kept.
    """
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    me = os.getpid()
    for entry in root.iterdir():
        parsed = parse_temp_name(entry.name)
        if parsed is None or entry in live or not entry.is_dir():
            continue
        _, kind, pid = parsed
        if pid == me:
            if kind != "trash":
                continue
        elif pid_alive(pid):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
        log.warning("removed stale %s dir %s (writer pid %d is gone)", kind, entry, pid)
    return removed

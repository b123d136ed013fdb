"""HFExporter: asynchronous HF safetensors export of the trainer's weights, one version at a time.

``start()`` checks the tensors, copies them into a host snapshot (the only part that blocks
training) and returns an :class:`ExportHandle`; a background writer thread then writes the
shards, index, template files and manifest into a hidden temp dir, verifies them by reading them
back, atomically renames the dir to ``root/hf-v{version}``, and drives the export's
:class:`~rollsafe.statemachines.ExportLifecycle` to ``ready``. Retention keeps the newest
``keep_last`` ready exports; leased ones stay until released. The fleet can ``abandon`` a late
export, ``adopt`` a regular save, find ``latest_ready`` exports and ``lease`` them.

Trainer-facing names match the seed trainer's: :meth:`HFExporter.start_hf_export`,
:meth:`HFExporter.is_hf_export_done`, :meth:`HFExporter.wait_hf_export` are methods (no hidden
module-level default exporter: the trainer owns one ``HFExporter`` per export root).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from rollsafe.hf.errors import (
    ExportAbandoned,
    ExportBusy,
    ExportExists,
    ExportFailed,
    ExportInputError,
    ExportVerificationError,
    UnknownExport,
)
from rollsafe.hf.layout import (
    INDEX_NAME,
    MANIFEST_NAME,
    ShardPlan,
    atomic_rename_noreplace,
    final_dir,
    fsync_dir,
    safetensors_header,
    temp_dir,
    template_files,
)
from rollsafe.hf.retention import (
    ExportRecord,
    apply_retention,
    discard_dir,
    move_to_trash,
    remove_stale_temp_dirs,
)
from rollsafe.hf.snapshot import (
    HostArena,
    NamedTensors,
    PinnedStaging,
    plan_for,
    snapshot_into,
    validate_named_tensors,
)
from rollsafe.hf.verify import VerifiedExport, inspect_hf_dir, readback_file
from rollsafe.hf.writer import (
    FileRecord,
    WriteAborted,
    build_index,
    build_manifest,
    copy_file,
    json_bytes,
    write_bytes_file,
    write_shard,
)
from rollsafe.statemachines import ExportLease, ExportLifecycle, TransitionRefused

__all__ = ["DEFAULT_SHARD_SIZE_BYTES", "ExportHandle", "ExportStats", "HFExporter"]

log = logging.getLogger("rollsafe.hf")

#: Default maximum shard size (2 GiB: several shards verify in parallel on big models).
DEFAULT_SHARD_SIZE_BYTES = 2 << 30
_HANDLES_KEPT = 16
_READBACK_WORKERS = 4
_OVERLAP_MIN_CPUS = 4
_IN_FLIGHT = ("snapshotting", "writing", "committing")


def _gb_s(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e9


def _check_version(version: object) -> int:
    """``version`` as an int >= 0, or :class:`ExportInputError` (bools and floats refused)."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ExportInputError(f"version must be an int >= 0, got {version!r}")
    return version


@dataclass
class ExportStats:
    """Sizes and phase timings (seconds) of one export, filled in as it runs."""

    tensor_bytes: int = 0
    shards: int = 0
    blocking_s: float = 0.0  # validation + snapshot: how long start() held the caller
    snapshot_s: float = 0.0
    write_s: float = 0.0  # shards written, hashed and fsynced
    commit_s: float = 0.0  # index, template files, manifest, dir fsync
    verify_s: float = 0.0  # read-back verification
    publish_s: float = 0.0  # rename, parent fsync, publish, retention
    total_s: float = 0.0  # start() called -> ready (or failed)


class ExportHandle:
    """One export in flight (or finished): poll with :meth:`done`, block with :meth:`wait`."""

    def __init__(self, version: int, path: Path, lifecycle: ExportLifecycle) -> None:
        self._version = version
        self._path = path
        self._lifecycle = lifecycle
        self._done = threading.Event()
        self._abort = threading.Event()
        self._error: ExportFailed | None = None
        self.stats = ExportStats()

    @property
    def version(self) -> int:
        """The weights version being exported."""
        return self._version

    @property
    def path(self) -> Path:
        """The final directory ``root/hf-v{version}`` (exists only once the export is ready)."""
        return self._path

    @property
    def lifecycle(self) -> ExportLifecycle:
        """The export's lifecycle machine."""
        return self._lifecycle

    @property
    def error(self) -> ExportFailed | None:
        """Why the export failed or was abandoned (None while running or once ready)."""
        return self._error

    def done(self) -> bool:
        """Whether the export finished (ready, failed or abandoned)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Path:
        """Block until the export finishes; return its final path.

        Raises :class:`ExportFailed` (or :class:`ExportAbandoned`) carrying the reason if it did
        not become ready, and ``TimeoutError`` if ``timeout`` seconds passed first.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(
                f"export of version {self._version} not finished after {timeout}s "
                f"(state {self._lifecycle.state!r})"
            )
        if self._error is not None:
            raise self._error
        return self._path

    def _aborted(self) -> None:
        if self._abort.is_set() or self._lifecycle.state == "abandoned":
            raise WriteAborted

    def __repr__(self) -> str:
        state = self._lifecycle.state
        return f"ExportHandle(version={self._version}, state={state!r}, path={str(self._path)!r})"


class HFExporter:
    """Writes, verifies, publishes, retains and leases HF safetensors exports under ``root``.

    ``template_dir``: a model directory whose non-weight files (``config.json``, tokenizer,
    generation config...) are copied into every export, so exports load with
    ``transformers.AutoModelForCausalLM.from_pretrained``. ``shard_size_bytes``: maximum shard
    size. ``keep_last``: how many ready exports retention keeps. Stale temp dirs of dead writers
    under ``root`` are removed on construction and on every ``start``.

    Retention runs when an export becomes ready: older exports are superseded, and unleased
    ones leave their final name (renamed to a hidden trash dir) before ``wait`` returns; their
    files are deleted right after, off the export's critical path. One exporter owns a root:
    two exporters (or processes) exporting the same versions into one root are not supported.
    The snapshot arena (host memory the size of the weights) is kept for the next export;
    :meth:`release_host_memory` drops it.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        template_dir: str | os.PathLike[str] | None = None,
        shard_size_bytes: int = DEFAULT_SHARD_SIZE_BYTES,
        keep_last: int = 2,
    ) -> None:
        if not isinstance(shard_size_bytes, int) or shard_size_bytes < 1:
            raise ExportInputError(
                f"shard_size_bytes must be a positive int, got {shard_size_bytes!r}"
            )
        if not isinstance(keep_last, int) or keep_last < 1:
            raise ExportInputError(f"keep_last must be an int >= 1, got {keep_last!r}")
        self.root = Path(root)
        self.template_dir = Path(template_dir) if template_dir is not None else None
        if self.template_dir is not None:
            if not self.template_dir.is_dir():
                raise ExportInputError(f"template_dir {self.template_dir} is not a directory")
            if not (self.template_dir / "config.json").is_file():
                log.warning(
                    "template_dir %s has no config.json: exports will not load in transformers",
                    self.template_dir,
                )
        self.shard_size_bytes = shard_size_bytes
        self.keep_last = keep_last
        self.root.mkdir(parents=True, exist_ok=True)
        self._cond = threading.Condition(threading.RLock())
        self._records: dict[int, ExportRecord] = {}
        self._handles: OrderedDict[int, ExportHandle] = OrderedDict()
        self._in_flight: ExportHandle | None = None
        self._unfit: dict[int, str] = {}  # ready exports that failed re-verification: never offered
        self._tmp: Path | None = None
        self._arena: HostArena | None = None
        self._staging = PinnedStaging()
        self._watchers: tuple[Callable[[int, ExportLifecycle], None], ...] = ()
        remove_stale_temp_dirs(self.root)

    def watch(self, watcher: Callable[[int, ExportLifecycle], None]) -> None:
        """Call ``watcher(version, lifecycle)`` with every export's lifecycle machine this
        exporter knows now, then with each new one as it is made (before its first transition,
        or for an adopted directory right after its ``adopt``), outside the exporter's lock: a
        fleet streaming its run (``rollsafe.observe.stream``) subscribes to each. An exception
        in ``watcher`` is logged and ignored."""
        with self._cond:
            known = {v: r.lifecycle for v, r in self._records.items()}
            for v, h in self._handles.items():
                known.setdefault(v, h.lifecycle)
            self._watchers = (*self._watchers, watcher)
        for version in sorted(known):
            self._announce(version, known[version], (watcher,))

    def _announce(
        self,
        version: int,
        lifecycle: ExportLifecycle,
        watchers: tuple[Callable[[int, ExportLifecycle], None], ...] | None = None,
    ) -> None:
        for watcher in self._watchers if watchers is None else watchers:
            try:
                watcher(version, lifecycle)
            except Exception:
                log.exception("export v%d: a lifecycle watcher failed (ignored)", version)

    # ================================================================== starting an export
    def start(
        self,
        named_tensors: NamedTensors,
        version: int,
        *,
        if_busy: Literal["error", "wait"] = "error",
    ) -> ExportHandle:
        """Snapshot ``named_tensors`` to host memory; export them as ``version`` in the background.

        Returns once the snapshot is taken (the caller may then modify or free the tensors).
        Raises a named :class:`ExportInputError` for bad input (nothing written),
        :class:`ExportBusy` while another export runs (``if_busy="wait"`` waits instead),
        :class:`ExportExists` if this version was already exported or adopted.
        """
        t0 = time.perf_counter()
        if if_busy not in ("error", "wait"):
            raise ExportInputError(f"if_busy must be 'error' or 'wait', got {if_busy!r}")
        _check_version(version)
        tensors = validate_named_tensors(named_tensors)
        plans, arena_bytes = plan_for(tensors, self.shard_size_bytes)
        final = final_dir(self.root, version)
        with self._cond:
            while self._in_flight is not None:
                if if_busy == "error":
                    raise ExportBusy(self._in_flight.version, version)
                self._cond.wait()
            if version in self._records or os.path.lexists(final):
                raise ExportExists(
                    f"an export of version {version} already exists at {final}", version, final
                )
            remove_stale_temp_dirs(self.root)
            lifecycle = ExportLifecycle(version)
            handle = ExportHandle(version, final, lifecycle)
            self._in_flight = handle
            self._remember(handle)
            arena, self._arena = self._arena, None
        self._announce(version, lifecycle)
        try:
            lifecycle.snapshot()
            t_snap = time.perf_counter()
            if arena is None or not (arena_bytes <= arena.nbytes <= 2 * arena_bytes):
                arena = None  # free the old arena before allocating a new one
                arena = HostArena(arena_bytes)
            copied = snapshot_into(arena, plans, dict(tensors), self._staging)
            handle.stats.snapshot_s = time.perf_counter() - t_snap
            lifecycle.snapshot_done()
        except TransitionRefused:  # abandoned while snapshotting
            self._finish(handle, arena, None, t0)
            return handle
        except Exception as exc:
            reason = f"snapshot failed: {type(exc).__name__}: {exc}"
            self._fail_machine(lifecycle, reason)
            self._finish(handle, arena, None, t0, ExportFailed(version, reason))
            raise ExportFailed(version, reason) from exc
        stats = handle.stats
        stats.tensor_bytes, stats.shards = copied, len(plans)
        stats.blocking_s = time.perf_counter() - t0
        log.info(
            "export v%d: snapshot of %d tensors, %.1f MiB in %.3fs (%.2f GB/s); %d shard(s)",
            version,
            len(tensors),
            copied / 2**20,
            stats.snapshot_s,
            _gb_s(copied, stats.snapshot_s),
            len(plans),
        )
        keys = [name for name, _ in tensors]
        writer = threading.Thread(
            target=self._write,
            args=(handle, plans, arena, keys, t0),
            name=f"rollsafe-hf-export-v{version}",
        )
        writer.start()
        return handle

    # ================================================================== the writer thread
    def _write(
        self,
        handle: ExportHandle,
        plans: list[ShardPlan],
        arena: HostArena,
        keys: list[str],
        t0: float,
    ) -> None:
        version, lifecycle, stats = handle.version, handle.lifecycle, handle.stats
        tmp = temp_dir(self.root, version)
        renamed = False
        error: ExportFailed | None = None
        trash: list[Path] = []
        with self._cond:
            self._tmp = tmp
        try:
            t = time.perf_counter()
            tmp.mkdir(mode=0o755)
            # Each shard is read back (byte-compared with the snapshot, hashed for the
            # manifest) on a pool: while the next shard is written when there are cores to
            # spare, else after the last one (on 2-3 cores the overlap only slows the writer).
            cpus = os.cpu_count() or 1
            overlap = cpus >= _OVERLAP_MIN_CPUS
            workers = max(1, min(_READBACK_WORKERS, len(plans), cpus))
            with ThreadPoolExecutor(workers, thread_name_prefix="rollsafe-hf-readback") as pool:
                try:
                    pending = []
                    for plan in plans:
                        handle._aborted()
                        region = arena.region(plan.arena_offset, plan.data_bytes)
                        write_shard(tmp / plan.file_name, plan, region, handle._aborted)
                        if overlap:
                            pending.append(pool.submit(self._read_back, tmp, plan, arena, handle))
                    if not overlap:
                        pending = [
                            pool.submit(self._read_back, tmp, p, arena, handle) for p in plans
                        ]
                    stats.write_s = time.perf_counter() - t
                    log.info(
                        "export v%d: %d shard(s), %.1f MiB written+fsynced in %.3fs (%.2f GB/s)",
                        version,
                        len(plans),
                        stats.tensor_bytes / 2**20,
                        stats.write_s,
                        _gb_s(stats.tensor_bytes, stats.write_s),
                    )
                    handle._aborted()
                    lifecycle.shards_written(ranks_ok=[0])
                    t = time.perf_counter()
                    files = [future.result() for future in pending]
                    stats.verify_s = time.perf_counter() - t  # read-back left after the last write
                finally:
                    pool.shutdown(wait=True, cancel_futures=True)

            t = time.perf_counter()
            files.append(write_bytes_file(tmp / INDEX_NAME, json_bytes(build_index(plans))))
            if self.template_dir is not None:
                for src in template_files(self.template_dir):
                    handle._aborted()
                    files.append(copy_file(src, tmp / src.name))
            extra = {"shard_size_bytes": self.shard_size_bytes}
            manifest = build_manifest(version, files, keys, extra)
            write_bytes_file(tmp / MANIFEST_NAME, json_bytes(manifest))
            fsync_dir(tmp)
            stats.commit_s = time.perf_counter() - t

            # Structure, keys and the small files' checksums, on what is now on disk.
            handle._aborted()
            t = time.perf_counter()
            report = inspect_hf_dir(
                tmp,
                expected_keys=keys,
                allow_missing_prefixes=(),
                require_manifest=True,
                prehashed={f.name: f.sha256 for f in files[: len(plans)]},
            )
            stats.verify_s += time.perf_counter() - t
            verified = report.raise_if_problems()
            log.info(
                "export v%d: read-back verification of %d file(s) in %.3fs",
                version,
                len(files),
                stats.verify_s,
            )

            t = time.perf_counter()
            with self._cond:
                handle._aborted()
                atomic_rename_noreplace(tmp, handle.path)
                renamed = True
                fsync_dir(self.root)
                lifecycle.publish(
                    index_missing_keys=report.index_missing_keys,
                    checksums_verified=report.checksums_verified,
                    renamed=True,
                )
                self._unfit.pop(version, None)
                self._records[version] = ExportRecord(
                    version, handle.path, lifecycle, verified=replace(verified, path=handle.path)
                )
            try:  # retire old exports now; delete their files once this handle is done
                trash = self._retire()[1]
            except Exception:  # the export is ready; retention will be retried next time
                log.exception("export v%d: retention failed after publish", version)
            stats.publish_s = time.perf_counter() - t
        except WriteAborted:
            pass
        except Exception as exc:
            if lifecycle.state == "abandoned":
                pass
            else:
                reason = f"{type(exc).__name__}: {exc}"
                self._fail_machine(lifecycle, reason)
                error = ExportFailed(version, reason)
        finally:
            if lifecycle.state != "ready":
                shutil.rmtree(tmp, ignore_errors=True)
                if renamed:  # renamed, then abandoned behind our back: never leave it visible
                    discard_dir(handle.path, version)
            self._finish(handle, arena, tmp, t0, error)
            _remove_trash(trash)

    @staticmethod
    def _read_back(
        tmp: Path, plan: ShardPlan, arena: HostArena, handle: ExportHandle
    ) -> FileRecord:
        """Read one shard back, compare it with the snapshot byte for byte, take its SHA-256."""
        parts: list[bytes | memoryview] = [
            safetensors_header(plan.slots),
            arena.region(plan.arena_offset, plan.data_bytes),
        ]
        digest = readback_file(tmp / plan.file_name, parts, handle._aborted)
        return FileRecord(plan.file_name, sum(len(p) for p in parts), digest)

    def _fail_machine(self, lifecycle: ExportLifecycle, reason: str) -> None:
        if lifecycle.state in _IN_FLIGHT:
            try:
                lifecycle.fail(reason=reason)
            except TransitionRefused:
                pass

    def _finish(
        self,
        handle: ExportHandle,
        arena: HostArena | None,
        tmp: Path | None,
        t0: float,
        error: ExportFailed | None = None,
    ) -> None:
        stats, lifecycle = handle.stats, handle.lifecycle
        stats.total_s = time.perf_counter() - t0
        if lifecycle.state == "abandoned":
            error = ExportAbandoned(handle.version, lifecycle.failure_reason or "abandoned")
            log.warning("export v%d abandoned: %s", handle.version, error.reason)
        elif error is not None:
            log.error("export v%d failed: %s", handle.version, error.reason)
        else:
            log.info(
                "export v%d ready at %s: %.1f MiB in %.3fs (blocking %.3fs, write %.3fs, "
                "commit %.3fs, verify %.3fs, publish %.3fs)",
                handle.version,
                handle.path,
                stats.tensor_bytes / 2**20,
                stats.total_s,
                stats.blocking_s,
                stats.write_s,
                stats.commit_s,
                stats.verify_s,
                stats.publish_s,
            )
        handle._error = error
        with self._cond:
            if self._in_flight is handle:
                self._in_flight = None
            if self._tmp == tmp:
                self._tmp = None
            if arena is not None and (self._arena is None or self._arena.nbytes < arena.nbytes):
                self._arena = arena
            self._cond.notify_all()
        handle._done.set()

    def _remember(self, handle: ExportHandle) -> None:
        self._handles[handle.version] = handle
        self._handles.move_to_end(handle.version)
        while len(self._handles) > _HANDLES_KEPT:
            self._handles.popitem(last=False)

    # ================================================================== fleet-facing API
    def abandon(self, version: int, reason: str = "missed its deadline") -> bool:
        """Abandon the in-flight export of ``version``: the writer stops at the next chunk or file,
        its temp dir is removed and it is never published. Returns False if no such export runs
        (already ready, failed, or unknown)."""
        with self._cond:
            handle = self._in_flight
            if handle is None or handle.version != version:
                return False
            handle._abort.set()
            try:
                handle.lifecycle.abandon(reason=reason)
            except TransitionRefused:
                return False
        log.warning("export v%d: abandon requested (%s)", version, reason)
        return True

    def adopt(
        self,
        path: str | os.PathLike[str],
        version: int,
        expected_keys: Collection[str] | None = None,
        *,
        allow_symlinks: bool = False,
    ) -> ExportRecord:
        """Publish an existing regular HF save (e.g. ``save_pretrained`` output) as ``version``
        without copying it. It is verified first (:func:`~rollsafe.hf.verify.verify_hf_dir`);
        retention never deletes it from disk, only un-lists it.

        ``version`` is checked exactly as in :meth:`start` (an int >= 0; ``True`` or ``1.5``
        raise :class:`ExportInputError`). The save must hold ``config.json`` and at least one
        tensor, and say what complete means: either a ``rollsafe-manifest.json`` (sizes,
        SHA-256 and key list, checked) or ``expected_keys`` from the caller (every key checked
        present). Its files must be regular files inside the directory; ``allow_symlinks=True``
        accepts links (e.g. a Hugging Face cache snapshot) and records their targets, which
        :meth:`lease` re-checks. Raises :class:`ExportVerificationError` (naming each file and
        field) if it does not verify, :class:`ExportExists` if ``version`` is already known.
        """
        _check_version(version)
        if not isinstance(path, (str, os.PathLike)):
            raise ExportInputError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        src = Path(path)
        with self._cond:
            if version in self._records:
                raise ExportExists(f"an export of version {version} is already known", version, src)
        report = inspect_hf_dir(
            src, expected_keys, require_config=True, allow_symlinks=bool(allow_symlinks)
        )
        if expected_keys is None and not report.manifest_found and report.dir_id is not None:
            report.problems.append(
                f"{MANIFEST_NAME} is missing: a save without a rollsafe manifest is adopted only "
                "with expected_keys= (nothing else says which tensors it must hold)"
            )
        verified = report.raise_if_problems()
        lifecycle = ExportLifecycle(version)
        saved_version = verified.version if verified.version is not None else version
        try:
            lifecycle.adopt(verified=True, version=saved_version)
        except TransitionRefused as exc:
            raise ExportVerificationError(
                src,
                [f"{MANIFEST_NAME}: field 'version' is {saved_version}, not {version} ({exc})"],
            ) from None
        with self._cond:
            if version in self._records:
                raise ExportExists(f"an export of version {version} is already known", version, src)
            record = ExportRecord(version, src, lifecycle, adopted=True, verified=verified)
            self._unfit.pop(version, None)
            self._records[version] = record
        self._announce(version, lifecycle)
        log.info("adopted %s as export v%d (%d keys)", src, version, len(verified.keys))
        self.cleanup()
        return record

    def adopt_start(self, path: str | os.PathLike[str], version: int) -> ExportRecord:
        """Make the directory a fleet's engines start on (its ``model_path``) the export of
        ``version`` (its ``initial_version``): the **start checkpoint**, verified once, in
        place, never copied (``docs/recovery.md``, "The start checkpoint").

        Checked as an export is (:func:`~rollsafe.hf.verify.inspect_hf_dir`): ``config.json``
        present and a JSON object, an index (or a single ``model.safetensors``) whose every
        file is there with a safetensors header that parses and holds every key the index maps
        to it, at least one tensor, and, when the directory holds a ``rollsafe-manifest.json``
        (a resume from an export), every file's size and SHA-256 against it and its
        ``version`` equal to ``version``. Without a manifest the directory itself says which
        tensors it holds: the engines were started from it, so what it holds *is* the
        fleet's ``initial_version``. Symlinks are accepted (a Hugging Face cache snapshot)
        and their targets recorded. Every file's identity is recorded, so a lease re-checks
        (:meth:`lease`) that the very files that verified are still there.

        The record is ``adopted`` and ``start``: retention supersedes and deletes it as it
        would any export (and never while a lease is held), but deleting it only un-lists
        it: the user's directory is never renamed, moved to trash or removed. Raises
        :class:`ExportVerificationError` naming the directory and every problem,
        :class:`ExportExists` when ``version`` is already known.
        """
        _check_version(version)
        if not isinstance(path, (str, os.PathLike)):
            raise ExportInputError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        src = Path(path)
        with self._cond:
            if version in self._records:
                raise ExportExists(f"an export of version {version} is already known", version, src)
        report = inspect_hf_dir(src, None, require_config=True, allow_symlinks=True)
        if report.manifest is not None:
            saved = report.manifest.get("version")
            if saved != version:
                report.problems.append(
                    f"{MANIFEST_NAME}: field 'version' is {saved!r}, but the fleet starts at "
                    f"initial_version {version}"
                )
        verified = report.raise_if_problems()
        lifecycle = ExportLifecycle(version)
        lifecycle.adopt(verified=True, version=version)
        record = ExportRecord(version, src, lifecycle, adopted=True, verified=verified, start=True)
        with self._cond:
            if version in self._records:
                raise ExportExists(f"an export of version {version} is already known", version, src)
            self._unfit.pop(version, None)
            self._records[version] = record
        self._announce(version, lifecycle)
        log.info(
            "start checkpoint %s adopted as export v%d (%d keys, %s)",
            src,
            version,
            len(verified.keys),
            "manifest checked" if verified.checksums_verified else "no manifest",
        )
        return record

    def latest_ready(self, version: int | None = None) -> ExportRecord | None:
        """The ready export of ``version`` (the newest ready one if None), or None.

        An export that failed re-verification (:meth:`lease`, :meth:`reverify`) is never
        offered again."""
        with self._cond:
            if version is not None:
                record = self._records.get(version)
                ok = record is not None and record.state == "ready" and version not in self._unfit
                return record if ok else None
            ready = [
                r
                for r in self._records.values()
                if r.state == "ready" and r.version not in self._unfit
            ]
            return max(ready, key=lambda r: r.version) if ready else None

    def exports(self) -> list[ExportRecord]:
        """Every export listed (ready, or superseded and still leased), oldest first."""
        with self._cond:
            return sorted(self._records.values(), key=lambda r: r.version)

    def lease(self, version: int, holder: str = "recovery", *, full: bool = False) -> ExportLease:
        """Take a lease on the ready export of ``version``, after re-verifying it.

        ``LeaseError`` if it is not ready. The export is then checked to still hold the very
        files that verified (:func:`~rollsafe.hf.verify.reverify`: a few ``stat`` calls per
        file; ``full=True`` re-hashes everything against the manifest). If it does not, the
        lease is given back, the export is never offered again (:meth:`latest_ready`) and
        :class:`ExportVerificationError` names what changed.
        """
        with self._cond:
            record = self._records.get(version)
            if record is None:
                raise UnknownExport(version, sorted(self._records))
            lease = record.lifecycle.acquire_lease(holder)
            unfit = self._unfit.get(version)
        try:
            if unfit is not None:
                raise ExportVerificationError(
                    record.path, [f"failed re-verification earlier and is not offered: {unfit}"]
                )
            self._reverify_record(record, full)
        except BaseException:
            with self._cond:
                record.lifecycle.release_lease(lease)
            raise
        return lease

    def reverify(self, version: int, *, full: bool = False) -> VerifiedExport:
        """Re-verify the listed export of ``version`` now (as :meth:`lease` does) and return
        what verified; a failure marks it unfit (never offered again) and raises
        :class:`ExportVerificationError`."""
        with self._cond:
            record = self._records.get(version)
            if record is None:
                raise UnknownExport(version, sorted(self._records))
        return self._reverify_record(record, full)

    def _reverify_record(self, record: ExportRecord, full: bool) -> VerifiedExport:
        try:
            verified = record.reverify(full=full)
        except ExportVerificationError as exc:
            reason = "; ".join(exc.problems[:3])
            with self._cond:
                self._unfit[record.version] = reason
            log.error(
                "export v%d failed re-verification, not offered any more: %s",
                record.version,
                reason,
            )
            raise
        with self._cond:
            self._unfit.pop(record.version, None)
        return verified

    def release(self, lease: ExportLease) -> None:
        """Give a lease back, then run retention (a superseded export may now be deleted)."""
        with self._cond:
            record = self._records.get(lease.version)
            if record is None:
                raise UnknownExport(lease.version, sorted(self._records))
            record.lifecycle.release_lease(lease)
        self.cleanup()

    def cleanup(self) -> list[Path]:
        """Run retention now and remove stale temp dirs; return the directories removed."""
        removed, trash = self._retire()
        _remove_trash(trash)
        return removed + remove_stale_temp_dirs(self.root, self._live_temp())

    def _retire(self) -> tuple[list[Path], list[Path]]:
        """Retention's decisions and renames (fast); the trash dirs are removed by the caller."""
        with self._cond:
            doomed = apply_retention(self._records, self.keep_last)
            for gone in [v for v in self._unfit if v not in self._records]:
                del self._unfit[gone]  # un-listed: a new export of that version starts clean
        # A second net beside ``adopted``: only a directory this exporter wrote (its own
        # ``root/hf-v{version}``) is ever removed; any other path is left where it is.
        mine = [r for r in doomed if r.path == final_dir(self.root, r.version)]
        for record in doomed:
            if record not in mine:
                log.warning(
                    "export v%d: %s is not this exporter's to remove; left on disk",
                    record.version,
                    record.path,
                )
        doomed = mine
        trash = [move_to_trash(r.path, r.version) for r in doomed]
        for record in doomed:
            log.info("export v%d deleted (%s)", record.version, record.path)
        return [r.path for r in doomed], [t for t in trash if t is not None]

    def _live_temp(self) -> list[Path]:
        with self._cond:
            return [self._tmp] if self._tmp is not None else []

    def release_host_memory(self) -> None:
        """Drop the cached snapshot arena (it is otherwise reused by the next export)."""
        with self._cond:
            self._arena = None

    @property
    def in_flight(self) -> ExportHandle | None:
        """The export currently running, if any."""
        with self._cond:
            return self._in_flight

    def handle(self, version: int | None = None) -> ExportHandle:
        """The handle of a recent export of ``version`` (the most recent one if None)."""
        with self._cond:
            if version is None:
                if not self._handles:
                    raise UnknownExport(-1, [])
                return next(reversed(self._handles.values()))
            handle = self._handles.get(version)
            if handle is None:
                raise UnknownExport(version, list(self._handles))
            return handle

    # ================================================================== trainer-facing aliases
    def start_hf_export(
        self,
        named_tensors: NamedTensors,
        version: int,
        *,
        if_busy: Literal["error", "wait"] = "error",
    ) -> ExportHandle:
        """Trainer-facing alias of :meth:`start`."""
        return self.start(named_tensors, version, if_busy=if_busy)

    def is_hf_export_done(self, version: int | None = None) -> bool:
        """Whether the export of ``version`` (the most recent one if None) has finished.
        True when nothing was ever started."""
        with self._cond:
            if version is None and not self._handles:
                return True
        return self.handle(version).done()

    def wait_hf_export(self, version: int | None = None, timeout: float | None = None) -> Path:
        """Wait for the export of ``version`` (most recent if None): :meth:`ExportHandle.wait`."""
        return self.handle(version).wait(timeout)

    def __repr__(self) -> str:
        known = sorted(self._records)
        return f"HFExporter(root={str(self.root)!r}, keep_last={self.keep_last}, exports={known})"


def _remove_trash(trash: list[Path]) -> None:
    for path in trash:
        shutil.rmtree(path, ignore_errors=True)

"""``disk`` weight transport: engines load a verified HF safetensors export of the version.

The engine reads the export itself (``/update_weights_from_disk`` with ``model_path`` and
``weight_version``); the trainer only makes sure the directory is a complete, verified export of
exactly the registered version, and holds a lease on the export's
:class:`~rollsafe.statemachines.ExportLifecycle` while each engine loads from it (released in
``finally``), so retention can never delete a directory an engine is reading.

``DiskTransport(exporter_or_root)`` works in one of two modes, chosen by the argument:

* an :class:`~rollsafe.hf.HFExporter`: ``register(weights, version)`` **adopts** the exporter's
  ``ready`` export of ``version`` when there is one (no copy; the exporter verified it when it
  published it), otherwise it **starts** the export of ``weights`` (waiting for an export already
  running) and **waits** until it is ready (``export_timeout``). A failed or abandoned export
  fails the register; nothing is published. Leases go through ``HFExporter.lease`` /
  ``HFExporter.release`` (so a superseded export is deleted once the last engine finished).
* a directory (``root``): ``register`` adopts ``root/hf-v{version}``, written by someone else
  (another process's exporter, a regular ``save_pretrained``). It must verify
  (:func:`~rollsafe.hf.verify_hf_dir`: index, headers, manifest sizes and SHA-256, key coverage
  against the registered names) and, when it has a manifest, say the same version; an
  unverified directory is refused. The transport keeps its own ``ExportLifecycle`` for leases.

In both modes the registered key set must match the export's exactly (missing keys only under
``allow_missing_prefixes``); the tensors' values are not compared (the export is trusted to hold
the version it names -- the manifest checksums guarantee the files are the ones written).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollsafe.errors import InvalidArgument, InvalidArgumentType
from rollsafe.ports import EngineTarget
from rollsafe.statemachines import ExportLease, ExportLifecycle
from rollsafe.transports.base import RegisterError, StagedTransport, TransportError
from rollsafe.wire.hf_index import HFIndexError, read_hf_index

if TYPE_CHECKING:
    import torch

    from rollsafe.hf import HFExporter

__all__ = ["DiskTransport"]


class DiskTransport(StagedTransport):
    """Engines load the registered version from a verified HF export on shared storage.

    ``exporter_or_root``: an :class:`~rollsafe.hf.HFExporter` (adopt or export-and-wait) or a
    directory holding ``hf-v{version}`` exports (adopt only). ``world_size``: size of the target
    rank space. ``export_timeout``: how long ``register`` waits for an export to become ready.
    ``request_timeout``: how long one engine may take to load. Engines must see the export at
    the same path as the trainer (shared storage).
    """

    name = "disk"

    def __init__(
        self,
        exporter_or_root: HFExporter | str | os.PathLike[str],
        *,
        world_size: int = 1,
        export_timeout: float = 600.0,
        request_timeout: float = 600.0,
        allow_missing_prefixes: Iterable[str] = ("mtp.",),
        max_parallel_targets: int = 8,
    ) -> None:
        super().__init__(
            world_size,
            allow_missing_prefixes=allow_missing_prefixes,
            max_parallel_targets=max_parallel_targets,
        )
        from rollsafe.hf import HFExporter

        if isinstance(exporter_or_root, HFExporter):
            self.exporter: HFExporter | None = exporter_or_root
            self.root = Path(exporter_or_root.root)
        elif isinstance(exporter_or_root, (str, os.PathLike)):
            self.exporter = None
            self.root = Path(exporter_or_root)
            if not self.root.is_dir():
                raise InvalidArgument(
                    str(self.root), f"export root {str(self.root)!r} is not a directory"
                )
        else:
            raise InvalidArgumentType(
                "exporter_or_root",
                "DiskTransport(exporter_or_root=...) needs an HFExporter or an export root "
                f"directory, got {type(exporter_or_root).__name__}",
            )
        if export_timeout <= 0 or request_timeout <= 0:
            raise InvalidArgument(
                "export_timeout", "export_timeout and request_timeout must be positive"
            )
        self.export_timeout = float(export_timeout)
        self.request_timeout = float(request_timeout)
        self.allow_missing = tuple(allow_missing_prefixes)
        self.path: Path | None = None
        self.adopted = False  # True: an existing ready export was used, nothing was written
        self._lifecycle: ExportLifecycle | None = None
        self._nbytes = 0
        self._verified: Any = None  # the VerifiedExport of a root-adopted directory

    # ------------------------------------------------------------------ register
    def _stage(
        self, items: list[tuple[str, torch.Tensor]], version: int
    ) -> tuple[Sequence[int], Sequence[str]]:
        self._unstage()
        names = [n for n, _ in items]
        if self.exporter is not None:
            path, lifecycle, adopted = self._from_exporter(items, version)
        else:
            path, lifecycle, adopted = self._from_root(names, version)
        keys = _export_keys(path)
        self.path, self._lifecycle, self.adopted = path, lifecycle, adopted
        self._nbytes = _weight_bytes(path)
        return range(self.registration.world_size), keys

    def _from_exporter(
        self, items: list[tuple[str, torch.Tensor]], version: int
    ) -> tuple[Path, ExportLifecycle, bool]:
        from rollsafe.hf import ExportExists, ExportFailed

        exporter = self.exporter
        assert exporter is not None
        record = exporter.latest_ready(version)
        adopted = record is not None
        if record is None:
            running = exporter.in_flight
            try:
                if running is not None and running.version == version:
                    handle = running
                else:
                    handle = exporter.start(items, version, if_busy="wait")
                handle.wait(self.export_timeout)
            except TimeoutError as exc:
                raise RegisterError(
                    f"{self.name}: export of v{version} not ready within {self.export_timeout}s"
                ) from exc
            except ExportExists as exc:
                raise RegisterError(
                    f"{self.name}: v{version} was exported before but is not ready any more "
                    f"(failed, superseded or deleted): {exc}"
                ) from exc
            except ExportFailed as exc:
                raise RegisterError(f"{self.name}: export of v{version} failed: {exc}") from exc
            record = exporter.latest_ready(version)
            if record is None:
                raise RegisterError(
                    f"{self.name}: export of v{version} finished but is not ready "
                    "(superseded by a newer export?)"
                )
        return Path(record.path), record.lifecycle, adopted

    def _from_root(self, names: list[str], version: int) -> tuple[Path, ExportLifecycle, bool]:
        from rollsafe.hf import ExportVerificationError, final_dir, verify_hf_dir
        from rollsafe.hf.errors import display_path

        path = final_dir(self.root, version)
        try:
            verified = verify_hf_dir(path, names, self.allow_missing)
        except ExportVerificationError as exc:
            raise RegisterError(
                f"{self.name}: {display_path(path)} is not a verified export: {exc}"
            ) from exc
        self._verified = verified  # re-checked (cheaply) before every push loads it
        if verified.version is not None and verified.version != version:
            raise RegisterError(
                f"{self.name}: {path} holds version {verified.version} (manifest), not {version}"
            )
        lifecycle = ExportLifecycle(version)
        lifecycle.adopt(verified=True, version=version)
        return path, lifecycle, True

    def _unstage(self) -> None:
        self.path, self._lifecycle, self.adopted, self._nbytes = None, None, False, 0
        self._verified = None

    # ------------------------------------------------------------------ update
    def _push(self, target: EngineTarget) -> int:
        path, lifecycle, version = self.path, self._lifecycle, self.version
        assert path is not None and lifecycle is not None and version is not None
        holder = f"disk:{target.name}"
        try:
            lease = self._lease(version, lifecycle, holder)
        except Exception as exc:
            raise TransportError(
                f"target {target.name!r}: export v{version} at {path} cannot be leased "
                f"(state {lifecycle.state!r}): {exc}"
            ) from exc
        verified = self._verified
        if verified is not None:  # the exporter's own leases re-verify in exporter.lease
            from rollsafe.hf import ExportVerificationError, reverify

            try:
                reverify(verified)
            except ExportVerificationError as exc:
                self._release(lifecycle, lease)
                raise TransportError(
                    f"target {target.name!r}: export v{version} changed since it was verified "
                    f"({exc}); not loaded"
                ) from exc
        try:
            target.client.update_weights_from_disk(
                str(path), weight_version=str(version), timeout=self.request_timeout
            )
        except Exception as exc:
            raise TransportError(
                f"target {target.name!r} (ranks {list(target.ranks)}): loading {path} failed: {exc}"
            ) from exc
        finally:
            self._release(lifecycle, lease)
        return self._nbytes

    def _lease(self, version: int, lifecycle: ExportLifecycle, holder: str) -> ExportLease:
        if self.exporter is not None:
            return self.exporter.lease(version, holder)
        return lifecycle.acquire_lease(holder)

    def _release(self, lifecycle: ExportLifecycle, lease: ExportLease) -> None:
        if self.exporter is not None:
            self.exporter.release(lease)
        else:
            lifecycle.release_lease(lease)

    @property
    def lifecycle(self) -> ExportLifecycle | None:
        """The registered export's lifecycle (None when nothing is registered)."""
        return self._lifecycle

    def close(self) -> None:
        self._unstage()
        super().close()


def _export_keys(path: Path) -> list[str]:
    """Tensor names of an HF directory, from its index (or the single file's header)."""
    try:
        return read_hf_index(path).keys
    except HFIndexError as exc:
        raise RegisterError(str(exc)) from exc


def _weight_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))

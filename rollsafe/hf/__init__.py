"""HF safetensors export, verification and retention for recovery (``rollsafe.hf``).

* :class:`HFExporter` writes ``root/hf-v{version}`` asynchronously: ``start()`` blocks only for
  the host snapshot, a writer thread writes HF-standard shards, index, template files (config,
  tokenizer) and ``rollsafe-manifest.json`` into a hidden temp dir, verifies them by read-back,
  renames atomically and drives the export's :class:`~rollsafe.statemachines.ExportLifecycle`.
  Trainer-facing aliases ``start_hf_export`` / ``is_hf_export_done`` / ``wait_hf_export`` are
  methods of the exporter (one exporter per export root; there is no module-level default).
* :func:`verify_hf_dir` checks any HF safetensors directory and raises
  :class:`ExportVerificationError` listing what is wrong (every file and field named; hostile
  JSON, symlinks and special files refused); :func:`reverify` checks, before a recovery loads
  it, that a verified export still holds the very files that verified (``HFExporter.lease``
  does it).
* Errors are named (:mod:`rollsafe.hf.errors`); bad input fails before anything is written.

Importing this package imports torch.
"""

from rollsafe.hf.errors import (
    DuplicateTensorName,
    EmptyExport,
    ExportAbandoned,
    ExportBusy,
    ExportExists,
    ExportFailed,
    ExportInputError,
    ExportVerificationError,
    HFExportError,
    NotATensor,
    UnknownExport,
    UnsupportedTensor,
)
from rollsafe.hf.exporter import DEFAULT_SHARD_SIZE_BYTES, ExportHandle, ExportStats, HFExporter
from rollsafe.hf.layout import INDEX_NAME, MANIFEST_NAME, final_dir
from rollsafe.hf.retention import ExportRecord
from rollsafe.hf.verify import (
    DirReport,
    FileIdentity,
    VerifiedExport,
    inspect_hf_dir,
    reverify,
    verify_hf_dir,
)

__all__ = [
    "DEFAULT_SHARD_SIZE_BYTES",
    "INDEX_NAME",
    "MANIFEST_NAME",
    "DirReport",
    "DuplicateTensorName",
    "EmptyExport",
    "ExportAbandoned",
    "ExportBusy",
    "ExportExists",
    "ExportFailed",
    "ExportHandle",
    "ExportInputError",
    "ExportRecord",
    "ExportStats",
    "ExportVerificationError",
    "FileIdentity",
    "HFExportError",
    "HFExporter",
    "NotATensor",
    "UnknownExport",
    "UnsupportedTensor",
    "VerifiedExport",
    "final_dir",
    "inspect_hf_dir",
    "reverify",
    "verify_hf_dir",
]

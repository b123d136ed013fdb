"""Named errors of the HF export: bad input, busy exporter, failed/abandoned export, verification.

Every error names the offending key, version or path, and a bad-input error is raised before
anything is written (nothing changes).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rollsafe.errors import RollsafeError

__all__ = [
    "DuplicateTensorName",
    "EmptyExport",
    "ExportAbandoned",
    "ExportBusy",
    "ExportExists",
    "ExportFailed",
    "ExportInputError",
    "ExportVerificationError",
    "HFExportError",
    "NotATensor",
    "UnknownExport",
    "UnsupportedTensor",
    "display_path",
]

#: How many problems an ``ExportVerificationError`` message lists (all are in ``.problems``).
MAX_PROBLEMS_SHOWN = 40


def display_path(path: str | Path) -> str:
    """How a verification message shows a directory: its own name only, never the host path
    above it (messages travel to clients and logs; which host paths exist is not theirs)."""
    p = Path(path)
    return p.name or str(p)


class HFExportError(RollsafeError):
    """Base class of every error raised by ``rollsafe.hf``."""


# --------------------------------------------------------------------------- bad input
class ExportInputError(HFExportError, ValueError):
    """The tensors or arguments given to an export are unusable; nothing was written."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class EmptyExport(ExportInputError):
    """An export was asked for with no tensors."""


class DuplicateTensorName(ExportInputError):
    """The same tensor name appears twice in the named tensors."""


class NotATensor(ExportInputError):
    """A value (or a name) in the named tensors is not a ``torch.Tensor`` (or a ``str``)."""


class UnsupportedTensor(ExportInputError):
    """A tensor cannot be written to safetensors (meta/sparse tensor, unsupported dtype)."""


class ExportExists(HFExportError):
    """An export of this version already exists (registered, or its final directory is on disk)."""

    def __init__(self, message: str, version: int, path: Path | None = None) -> None:
        super().__init__(message)
        self.version = version
        self.path = path


class UnknownExport(HFExportError, KeyError):
    """No export of the asked version is known to this exporter."""

    def __init__(self, version: int, known: Sequence[int]) -> None:
        super().__init__(version)
        self.version = version
        self.known = tuple(known)

    def __str__(self) -> str:
        return f"no export of version {self.version} is known (known versions: {list(self.known)})"


# --------------------------------------------------------------------------- running exports
class ExportBusy(HFExportError):
    """Another export is still in flight (one at a time); pass ``if_busy="wait"`` to queue."""

    def __init__(self, in_flight_version: int, requested_version: int) -> None:
        super().__init__(
            f"cannot start the export of version {requested_version}: the export of version "
            f"{in_flight_version} is still in flight (wait for it, abandon it, or pass "
            f"if_busy='wait')"
        )
        self.in_flight_version = in_flight_version
        self.requested_version = requested_version


class ExportFailed(HFExportError):
    """An export did not become ready (``reason`` says why); nothing is under its final name."""

    def __init__(self, version: int, reason: str) -> None:
        super().__init__(f"export of version {version} failed: {reason}")
        self.version = version
        self.reason = reason


class ExportAbandoned(ExportFailed):
    """An export was abandoned (e.g. it missed its deadline); it was never published."""

    def __init__(self, version: int, reason: str) -> None:
        HFExportError.__init__(self, f"export of version {version} was abandoned: {reason}")
        self.version = version
        self.reason = reason


# --------------------------------------------------------------------------- verification
class ExportVerificationError(HFExportError):
    """A directory does not hold a complete, consistent HF safetensors save.

    ``problems`` lists every finding (missing files, size or checksum mismatches, unparsable
    headers, keys missing from their file, missing or extra keys); the message shows them too.
    ``path`` is the full directory path; the message shows only its name (:func:`display_path`).
    """

    def __init__(self, path: Path, problems: Sequence[str]) -> None:
        self.path = Path(path)
        self.problems = list(problems)
        shown = self.problems[:MAX_PROBLEMS_SHOWN]
        lines = "\n".join(f"  - {p}" for p in shown)
        more = len(self.problems) - len(shown)
        tail = f"\n  ... and {more} more" if more > 0 else ""
        super().__init__(
            f"{display_path(self.path)}: not a valid HF safetensors export, {len(self.problems)} "
            f"problem(s):\n{lines}{tail}"
        )

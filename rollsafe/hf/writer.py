"""The background half of an export: write shards, index, template files and manifest, durably.

Each shard is written straight from the host snapshot (header, then its data region in large
``write`` calls, no extra copies); Linux is asked to start write-back after every chunk so the
closing ``fsync`` has little left to do. Every file is fsynced; the caller fsyncs the directory.
The writer checks ``abort`` before every chunk and every file, so an abandoned export stops at
the next boundary. SHA-256 checksums of shards are taken when they are read back and compared
with the snapshot (``rollsafe.hf.verify.readback_file``), which keeps hashing off the write path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollsafe.errors import RollsafeError
from rollsafe.hf.layout import MANIFEST_FORMAT, ShardPlan, safetensors_header

__all__ = [
    "CHUNK_BYTES",
    "FileRecord",
    "WriteAborted",
    "build_index",
    "build_manifest",
    "copy_file",
    "write_bytes_file",
    "write_shard",
]

#: Size of each ``write`` of shard data.
CHUNK_BYTES = 32 << 20
_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


class WriteAborted(RollsafeError):
    """Raised inside the writer when the export was abandoned; unwinds to the exporter."""


@dataclass(frozen=True)
class FileRecord:
    """A written file: its name in the export dir, size and SHA-256 of what was written."""

    name: str
    size: int
    sha256: str


# --------------------------------------------------------------------------- write-back hint
_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range: Any = None
_sync_file_range_checked = False


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask Linux to start writing ``[offset, offset+nbytes)`` back now (never blocks on it)."""
    global _sync_file_range, _sync_file_range_checked
    if not _sync_file_range_checked:
        _sync_file_range_checked = True
        name = ctypes.util.find_library("c")
        fn = getattr(ctypes.CDLL(name), "sync_file_range", None) if name else None
        if fn is not None:
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            fn.restype = ctypes.c_int
        _sync_file_range = fn
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def write_shard(path: Path, plan: ShardPlan, region: memoryview, abort: Callable[[], None]) -> int:
    """Write one safetensors shard from its snapshot ``region``, fsync it, return its size.

    ``region`` holds the shard's data section exactly as planned (so the data is written
    straight from the snapshot, with no copy); ``abort()`` raises :class:`WriteAborted` when the
    export was abandoned. Checksums are taken on read-back (``verify.readback_file``).
    """
    header = safetensors_header(plan.slots)
    fd = os.open(path, _FLAGS, 0o644)
    try:
        _write_all(fd, header)
        written = len(header)
        for off in range(0, len(region), CHUNK_BYTES):
            abort()
            chunk = region[off : off + CHUNK_BYTES]
            _write_all(fd, chunk)
            _start_writeback(fd, written, len(chunk))
            written += len(chunk)
        os.fsync(fd)
    finally:
        os.close(fd)
    return written


def write_bytes_file(path: Path, data: bytes) -> FileRecord:
    """Write a small file (index, manifest, copied template file) and fsync it."""
    fd = os.open(path, _FLAGS, 0o644)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return FileRecord(path.name, len(data), hashlib.sha256(data).hexdigest())


def copy_file(src: Path, dst: Path) -> FileRecord:
    """Copy a (small, non-weight) template file into the export and fsync it."""
    return write_bytes_file(dst, src.read_bytes())


def json_bytes(obj: Any) -> bytes:
    """Stable, human-readable JSON (as ``save_pretrained`` writes its index)."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def build_index(plans: Iterable[ShardPlan]) -> dict[str, Any]:
    """``model.safetensors.index.json``: total tensor bytes and the key -> shard map."""
    weight_map: dict[str, str] = {}
    total = 0
    for plan in plans:
        total += plan.data_bytes
        for slot in plan.slots:
            weight_map[slot.name] = plan.file_name
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


def build_manifest(
    version: int, files: Iterable[FileRecord], keys: Iterable[str], extra: Mapping[str, Any]
) -> dict[str, Any]:
    """``rollsafe-manifest.json``: version, every file's size and SHA-256, keys, provenance."""
    from rollsafe.version import VERSION

    return {
        "format": MANIFEST_FORMAT,
        "version": version,
        "created": time.time(),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rollsafe_version": VERSION,
        "files": {
            f.name: {"size": f.size, "sha256": f.sha256}
            for f in sorted(files, key=lambda f: f.name)
        },
        "keys": sorted(keys),
        **extra,
    }

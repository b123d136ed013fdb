"""Read-back verification of an HF safetensors directory (an export or a regular save).

:func:`inspect_hf_dir` reads a directory and collects every problem it finds without raising:
index (or single ``model.safetensors``), files present, safetensors headers that parse and that
the ``safetensors`` library accepts, every indexed key present in its file, sizes and SHA-256
against ``rollsafe-manifest.json`` when one exists, and key coverage against ``expected_keys``
(missing keys under an allow-listed prefix such as ``mtp.`` are tolerated). :func:`verify_hf_dir`
raises :class:`ExportVerificationError` listing the problems, or returns a
:class:`VerifiedExport`. The exporter uses the same facts to drive ``ExportLifecycle.publish``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollsafe.hf.errors import ExportVerificationError
from rollsafe.hf.layout import INDEX_NAME, MANIFEST_NAME, SINGLE_FILE_NAME

__all__ = [
    "DirReport",
    "VerifiedExport",
    "inspect_hf_dir",
    "readback_file",
    "sha256_file",
    "verify_hf_dir",
]

_ITEM_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1, "F8_E8M0": 1,
    "U16": 2, "U32": 4, "U64": 8, "C64": 8,
}  # fmt: skip
_MAX_HEADER = 100 << 20
_READ_BYTES = 16 << 20
_KEYS_SHOWN = 12


def _few(keys: Iterable[str]) -> str:
    items = sorted(keys)
    shown = ", ".join(repr(k) for k in items[:_KEYS_SHOWN])
    more = len(items) - _KEYS_SHOWN
    return f"[{shown}{f', ... +{more} more' if more > 0 else ''}]"


@dataclass(frozen=True)
class VerifiedExport:
    """A directory that verified: what it holds, and what was checked."""

    path: Path
    keys: tuple[str, ...]
    weight_files: tuple[str, ...]
    tensor_bytes: int
    checksums_verified: bool  # a manifest existed and every file matched it
    missing_allowed_keys: tuple[str, ...] = ()  # expected keys absent under an allowed prefix
    version: int | None = None  # from the manifest, when there is one
    manifest: dict[str, Any] | None = None


@dataclass
class DirReport:
    """Everything :func:`inspect_hf_dir` found; ``problems`` is empty when the dir is sound."""

    path: Path
    problems: list[str] = field(default_factory=list)
    weight_map: dict[str, str] = field(default_factory=dict)
    file_keys: dict[str, set[str]] = field(default_factory=dict)
    tensor_bytes: int = 0
    index_missing_keys: list[str] = field(default_factory=list)
    missing_allowed_keys: list[str] = field(default_factory=list)
    extra_keys: list[str] = field(default_factory=list)
    manifest: dict[str, Any] | None = None
    checksums_verified: bool = False

    def raise_if_problems(self) -> VerifiedExport:
        """The verified export, or :class:`ExportVerificationError` listing every problem."""
        if self.problems:
            raise ExportVerificationError(self.path, self.problems)
        version = self.manifest.get("version") if self.manifest else None
        return VerifiedExport(
            path=self.path,
            keys=tuple(sorted(self.weight_map)),
            weight_files=tuple(sorted(set(self.weight_map.values()))),
            tensor_bytes=self.tensor_bytes,
            checksums_verified=self.checksums_verified,
            missing_allowed_keys=tuple(self.missing_allowed_keys),
            version=version if isinstance(version, int) else None,
            manifest=self.manifest,
        )


def sha256_file(path: Path) -> str:
    """SHA-256 of a file, read in large unbuffered chunks."""
    h = hashlib.sha256()
    buf = bytearray(_READ_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def readback_file(
    path: Path, expected: Sequence[bytes | memoryview], abort: Callable[[], None] | None = None
) -> str:
    """Read ``path`` back, check it equals the concatenation of ``expected``; return its SHA-256.

    Used by the exporter to verify a freshly written shard against the snapshot it came from
    (byte for byte) while computing the checksum that goes into the manifest. Raises
    :class:`ExportVerificationError` naming the file and the first differing chunk offset.
    """
    h = hashlib.sha256()
    buf = bytearray(_READ_BYTES)
    view = memoryview(buf)
    want = sum(len(part) for part in expected)
    pos = 0
    problem: str | None = None
    with open(path, "rb", buffering=0) as f:
        for part in expected:
            part_view = memoryview(part).cast("B")
            off = 0
            while off < len(part_view):
                if abort is not None:
                    abort()
                n = f.readinto(view[: min(_READ_BYTES, len(part_view) - off)])
                if not n:
                    problem = f"{path.name}: {pos} bytes on disk, {want} were written"
                    break
                h.update(view[:n])
                if not buf.startswith(part_view[off : off + n]):
                    problem = (
                        f"{path.name}: content differs from the snapshot in bytes {pos}..{pos + n}"
                    )
                    break
                off += n
                pos += n
            if problem:
                break
        if problem is None and f.read(1):
            problem = f"{path.name}: longer than the {want} bytes written"
    if problem is not None:
        raise ExportVerificationError(path.parent, [problem])
    return h.hexdigest()


def _read_json(path: Path, what: str, problems: list[str]) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        problems.append(f"{what} {path.name} cannot be read as JSON: {exc}")
        return None


def _check_header(path: Path, problems: list[str]) -> tuple[set[str], int] | None:
    """Parse a safetensors header by hand (clear messages), then let the library open it."""
    name = path.name
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                problems.append(f"{name}: {size} bytes, too short for a safetensors header")
                return None
            n = int.from_bytes(prefix, "little")
            if n > _MAX_HEADER or 8 + n > size:
                problems.append(f"{name}: header length {n} does not fit the file ({size} bytes)")
                return None
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        problems.append(f"{name}: safetensors header does not parse: {exc}")
        return None
    if not isinstance(header, dict):
        problems.append(f"{name}: safetensors header is not a JSON object")
        return None
    keys: set[str] = set()
    end = 0
    nbytes = 0
    bad: list[str] = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            begin, stop = (int(x) for x in info["data_offsets"])
            expect = math.prod(int(d) for d in info["shape"]) * _ITEM_SIZES[info["dtype"]]
        except (KeyError, TypeError, ValueError):
            bad.append(key)
            continue
        if stop - begin != expect or begin < 0:
            bad.append(key)
            continue
        keys.add(key)
        end = max(end, stop)
        nbytes += stop - begin
    if bad:
        problems.append(f"{name}: malformed header entries for {_few(bad)}")
    if 8 + n + end != size:
        problems.append(
            f"{name}: size {size} bytes, but its header describes {8 + n + end} bytes "
            "(truncated or padded file)"
        )
    if bad or 8 + n + end != size:
        return None
    try:  # the real reader must accept it too (overlaps, holes, dtype spellings...)
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            lib_keys = set(handle.keys())
        if lib_keys != keys:
            problems.append(f"{name}: safetensors reports keys {_few(lib_keys ^ keys)} differently")
    except Exception as exc:
        problems.append(f"{name}: safetensors cannot open it: {exc}")
        return None
    return keys, nbytes


def _safe_name(name: Any) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
    )


def inspect_hf_dir(
    path: str | os.PathLike[str],
    expected_keys: Collection[str] | None = None,
    allow_missing_prefixes: Collection[str] = ("mtp.",),
    *,
    require_manifest: bool = False,
    hash_workers: int | None = None,
    prehashed: Mapping[str, str] | None = None,
) -> DirReport:
    """Check an HF safetensors directory; collect every problem (never raises for bad content).

    ``prehashed`` maps file names to SHA-256 digests the caller already took by reading those
    files back in this process (the exporter does, while comparing them with its snapshot);
    they are compared with the manifest without being read again.
    """
    root = Path(path)
    report = DirReport(root)
    problems = report.problems
    if not root.is_dir():
        problems.append(f"{root} is not a directory")
        return report

    # ---------------------------------------------------------------- manifest
    manifest_path = root / MANIFEST_NAME
    manifest_files: dict[str, Any] = {}
    if manifest_path.is_file():
        manifest = _read_json(manifest_path, "manifest", problems)
        if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict):
            report.manifest = manifest
            manifest_files = manifest["files"]
        elif manifest is not None:
            problems.append(f"manifest {MANIFEST_NAME} has no 'files' mapping")
    elif require_manifest:
        problems.append(f"{MANIFEST_NAME} is missing")

    # ---------------------------------------------------------------- index / single file
    index_path = root / INDEX_NAME
    if index_path.is_file():
        index = _read_json(index_path, "index", problems)
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict):
            if index is not None:
                problems.append(f"index {INDEX_NAME} has no 'weight_map' mapping")
            return report
        unsafe = sorted({str(v) for v in wm.values() if not _safe_name(v)})
        if unsafe:
            problems.append(f"index maps keys to file names outside the directory: {unsafe}")
        report.weight_map = {str(k): str(v) for k, v in wm.items() if _safe_name(v)}
    elif (root / SINGLE_FILE_NAME).is_file():
        checked = _check_header(root / SINGLE_FILE_NAME, problems)
        if checked is None:
            return report
        report.weight_map = dict.fromkeys(checked[0], SINGLE_FILE_NAME)
    else:
        problems.append(f"neither {INDEX_NAME} nor {SINGLE_FILE_NAME} is present")
        return report

    by_file: dict[str, set[str]] = {}
    for key, fname in report.weight_map.items():
        by_file.setdefault(fname, set()).add(key)

    # ---------------------------------------------------------------- weight files and keys
    for fname, indexed in sorted(by_file.items()):
        fpath = root / fname
        if not fpath.is_file():
            problems.append(
                f"index maps {len(indexed)} key(s) to missing file {fname}: {_few(indexed)}"
            )
            continue
        checked = _check_header(fpath, problems)
        if checked is None:
            continue
        keys, nbytes = checked
        report.file_keys[fname] = keys
        report.tensor_bytes += nbytes
        absent = indexed - keys
        if absent:
            problems.append(
                f"{len(absent)} key(s) indexed to {fname} are not in it: {_few(absent)}"
            )
        unindexed = keys - indexed
        if unindexed:
            problems.append(
                f"{fname} holds {len(unindexed)} key(s) the index does not map to it: "
                f"{_few(unindexed)}"
            )

    # ---------------------------------------------------------------- manifest checks
    if report.manifest is not None:
        _check_manifest(root, report, manifest_files, set(by_file), hash_workers, prehashed or {})

    # ---------------------------------------------------------------- key coverage
    present = set(report.weight_map)
    if expected_keys is not None:
        expected = set(expected_keys)
        prefixes = tuple(allow_missing_prefixes)
        missing = expected - present
        report.missing_allowed_keys = sorted(
            k for k in missing if prefixes and k.startswith(prefixes)
        )
        report.index_missing_keys = sorted(missing - set(report.missing_allowed_keys))
        report.extra_keys = sorted(present - expected)
        if report.index_missing_keys:
            problems.append(
                f"{len(report.index_missing_keys)} expected key(s) missing: "
                f"{_few(report.index_missing_keys)}"
            )
        if report.extra_keys:
            problems.append(
                f"{len(report.extra_keys)} unexpected key(s) present: {_few(report.extra_keys)}"
            )
    return report


def _check_manifest(
    root: Path,
    report: DirReport,
    manifest_files: dict[str, Any],
    weight_files: set[str],
    hash_workers: int | None,
    prehashed: Mapping[str, str],
) -> None:
    problems = report.problems
    unlisted = sorted(weight_files - set(manifest_files))
    if (root / INDEX_NAME).is_file() and INDEX_NAME not in manifest_files:
        unlisted.insert(0, INDEX_NAME)
    if unlisted:
        problems.append(f"file(s) not listed in {MANIFEST_NAME}: {unlisted}")
    keys = report.manifest.get("keys") if report.manifest else None
    if isinstance(keys, list) and set(keys) != set(report.weight_map):
        diff = set(keys) ^ set(report.weight_map)
        problems.append(f"manifest key list and index differ on {len(diff)} key(s): {_few(diff)}")

    before = len(problems)
    to_hash: list[tuple[str, str, int]] = []
    for fname, info in sorted(manifest_files.items()):
        if not _safe_name(fname) or not isinstance(info, dict):
            problems.append(f"manifest entry {fname!r} is malformed")
            continue
        fpath = root / fname
        if not fpath.is_file():
            problems.append(f"{fname} is listed in the manifest but missing")
            continue
        size = fpath.stat().st_size
        if size != info.get("size"):
            problems.append(f"{fname}: size {size} bytes, manifest says {info.get('size')}")
            continue
        want = str(info.get("sha256"))
        if fname in prehashed:
            if prehashed[fname] != want:
                problems.append(f"{fname}: sha256 read back does not match the manifest's")
            continue
        to_hash.append((fname, want, size))
    workers = hash_workers or min(4, os.cpu_count() or 1)
    to_hash.sort(key=lambda item: -item[2])  # largest first keeps the pool busy to the end
    with ThreadPoolExecutor(
        max_workers=max(1, workers), thread_name_prefix="rollsafe-hf-verify"
    ) as pool:
        digests = list(pool.map(lambda item: sha256_file(root / item[0]), to_hash))
    for (fname, want, _), got in zip(to_hash, digests, strict=True):
        if got != want:
            problems.append(
                f"{fname}: sha256 {got[:16]}... does not match the manifest's {want[:16]}..."
            )
    # every listed file present, sized and hashed right, and every weight file listed
    report.checksums_verified = not unlisted and len(problems) == before


def verify_hf_dir(
    path: str | os.PathLike[str],
    expected_keys: Collection[str] | None = None,
    allow_missing_prefixes: Collection[str] = ("mtp.",),
) -> VerifiedExport:
    """Verify an HF safetensors directory; raise :class:`ExportVerificationError` listing problems.

    Checks the index (or a single ``model.safetensors``), that every indexed file exists and its
    header parses, that every indexed key is in its file, sizes and SHA-256 against
    ``rollsafe-manifest.json`` if present, and key coverage against ``expected_keys`` (missing
    keys under ``allow_missing_prefixes`` are tolerated and reported in the result).
    """
    return inspect_hf_dir(path, expected_keys, allow_missing_prefixes).raise_if_problems()

"""Read-back verification of an HF safetensors directory (an export or a regular save).

:func:`inspect_hf_dir` reads a directory and collects every problem it finds without raising:
index (or single ``model.safetensors``), files present, safetensors headers that parse and that
the ``safetensors`` library accepts, every indexed key present in its file, at least one tensor,
sizes and SHA-256 against ``rollsafe-manifest.json`` when one exists, and key coverage against
``expected_keys`` (missing keys under an allow-listed prefix such as ``mtp.`` are tolerated).
:func:`verify_hf_dir` raises :class:`ExportVerificationError` listing the problems, or returns a
:class:`VerifiedExport`. The exporter uses the same facts to drive ``ExportLifecycle.publish``.

The directory may be hostile. Every file it holds that verification reads (shards, index,
manifest, ``config.json``, files the manifest lists) must be a regular file directly inside it:
it is opened relative to the directory, without following symlinks and without blocking (a FIFO
is refused, not waited on). Symlinks are refused unless the caller passes
``allow_symlinks=True``; then the link's target is checked and its identity recorded. Every
file's identity (``st_dev``, ``st_ino``, size, ``mtime_ns``) is recorded in the result, so
:func:`reverify` can check cheaply, before a recovery loads the export, that it still holds the
very files that verified (or re-hash them all with ``full=True``). JSON is parsed with a size
cap, a depth limit, no duplicate keys, no non-finite numbers and no lone UTF-16 surrogates
(:mod:`rollsafe.wire.strict_json`); every malformed input is a problem naming the file and the
field, never an exception of another type. Messages name files by their name inside the
directory, never by host path.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import re
import stat
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard, cast

from rollsafe.hf.errors import ExportInputError, ExportVerificationError, display_path
from rollsafe.hf.layout import INDEX_NAME, MANIFEST_FORMAT, MANIFEST_NAME, SINGLE_FILE_NAME
from rollsafe.text import few as _few
from rollsafe.text import short_repr as _short
from rollsafe.wire.hf_index import safe_file_name as _safe_name
from rollsafe.wire.hf_index import weight_map_problems
from rollsafe.wire.strict_json import MAX_JSON_DEPTH, BadJSON, loads_bounded

__all__ = [
    "CONFIG_NAME",
    "MAX_HEADER_BYTES",
    "MAX_JSON_BYTES",
    "DirReport",
    "FileIdentity",
    "VerifiedExport",
    "inspect_hf_dir",
    "readback_file",
    "reverify",
    "sha256_file",
    "verify_hf_dir",
]

CONFIG_NAME = "config.json"
#: Largest safetensors header accepted (the ``safetensors`` library's own limit).
MAX_HEADER_BYTES = 100_000_000
#: Largest index, manifest or ``config.json`` read.
MAX_JSON_BYTES = 64 << 20

_ITEM_SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1,
    "F8_E8M0": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "C64": 8,
}
_MAX_HEADER = MAX_HEADER_BYTES  # kept for callers of the old private name
_READ_BYTES = 16 << 20
#: smallest read: past the size ``fstat`` gave, so a file that grew is still read at speed
_MIN_READ_BYTES = 64 << 10
_ENTRIES_SHOWN = 8
_MAX_NDIM = 64
_MAX_INT64 = (1 << 63) - 1
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_FD_DIR = "/proc/self/fd"

_O_READ = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


# --------------------------------------------------------------------------- results
@dataclass(frozen=True)
class FileIdentity:
    """What a file was when it verified: enough to tell later that it is still the same file.

    For a file reached through a symlink (only with ``allow_symlinks=True``) the identity is
    the target's, and ``symlink`` is True.
    """

    name: str
    st_dev: int
    st_ino: int
    size: int
    mtime_ns: int
    symlink: bool = False
    ctime_ns: int | None = None  # inode change time: cannot be set back (inode reuse, utime)

    def same_file(self, other: FileIdentity) -> bool:
        """Same device, inode, size, modification and change time (and link-ness)."""
        return self._key() == other._key()

    def _key(self) -> tuple[int, int, int, int, bool, int | None]:
        return (self.st_dev, self.st_ino, self.size, self.mtime_ns, self.symlink, self.ctime_ns)


@dataclass(frozen=True)
class VerifiedExport:
    """A directory that verified: what it holds, and what was checked.

    ``files`` records the identity of every file verification read (shards, index, manifest,
    config, manifest-listed files) and ``dir_id`` the directory's ``(st_dev, st_ino)``:
    :func:`reverify` compares them with what is on disk now.
    """

    path: Path
    keys: tuple[str, ...]
    weight_files: tuple[str, ...]
    tensor_bytes: int
    checksums_verified: bool  # a manifest existed and every file matched it
    missing_allowed_keys: tuple[str, ...] = ()  # expected keys absent under an allowed prefix
    version: int | None = None  # from the manifest, when there is one
    manifest: dict[str, Any] | None = None
    files: tuple[FileIdentity, ...] = ()
    dir_id: tuple[int, int] | None = None
    allow_symlinks: bool = False

    def reverify(self, *, full: bool = False, hash_workers: int | None = None) -> VerifiedExport:
        """:func:`reverify` this export."""
        return reverify(self, full=full, hash_workers=hash_workers)


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
    manifest_found: bool = False  # a manifest entry exists (readable or not)
    identities: dict[str, FileIdentity] = field(default_factory=dict)
    dir_id: tuple[int, int] | None = None
    allow_symlinks: bool = False

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
            version=version if _is_int(version) else None,
            manifest=self.manifest,
            files=tuple(self.identities[name] for name in sorted(self.identities)),
            dir_id=self.dir_id,
            allow_symlinks=self.allow_symlinks,
        )


# --------------------------------------------------------------------------- hashing, read-back
def sha256_file(path: Path) -> str:
    """SHA-256 of a file, read in large unbuffered chunks."""
    with open(path, "rb", buffering=0) as f:
        return _sha256_fd(f.fileno())


@contextmanager
def _read_buffer(size: int) -> Iterator[memoryview]:
    """A writable buffer for reading ``size`` bytes (at least ``_MIN_READ_BYTES``, at most
    ``_READ_BYTES``) in its own anonymous mapping, unmapped on exit.

    Not ``bytearray``: verification runs in short-lived threads (the exporter's, the hashing
    pool's), and glibc serves a large ``malloc`` from such a thread in a per-thread arena once
    its dynamic mmap threshold has risen (the first 16 MiB buffer freed raises it to 16 MiB);
    the freed top of an arena stays resident (``malloc_trim`` did not return it), so each new
    arena kept a buffer: the driver's RSS grew by 16 to 48 MiB a sync up to the arena cap (8 a
    core; issue #36). A mapping of its own goes back to the OS when closed.
    """
    buf = mmap.mmap(-1, min(max(size, _MIN_READ_BYTES), _READ_BYTES))
    try:
        with memoryview(buf) as view:
            yield view
    finally:
        buf.close()


def _sha256_fd(fd: int) -> str:
    h = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    with (
        open(fd, "rb", buffering=0, closefd=False) as f,
        _read_buffer(os.fstat(fd).st_size) as view,
    ):
        while n := f.readinto(view):
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
    want = sum(len(part) for part in expected)
    pos = 0
    problem: str | None = None
    with open(path, "rb", buffering=0) as f, _read_buffer(want) as view:
        for part in expected:
            part_view = memoryview(part).cast("B")
            off = 0
            while off < len(part_view):
                if abort is not None:
                    abort()
                n = f.readinto(view[: min(len(view), len(part_view) - off)])
                if not n:
                    problem = f"{path.name}: {pos} bytes on disk, {want} were written"
                    break
                h.update(view[:n])
                if not _same_bytes(view, part_view[off : off + n]):
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


def _same_bytes(buf: memoryview, part: memoryview) -> bool:
    """Whether ``buf`` starts with the bytes of ``part`` (``len(part) <= len(buf)``), at
    ``memcmp`` speed and without a copy: the mapping's ``find`` tried at offset 0 only."""
    mapping = cast(mmap.mmap, buf.obj)  # a view of _read_buffer's mapping
    return mapping.find(part, 0, len(part)) == 0


# --------------------------------------------------------------------------- opening files
class _Missing(Exception):
    """The name does not exist in the directory."""


class _Refused(Exception):
    """The name exists but is not acceptable (symlink, not a regular file, unreadable)."""


def _reason(exc: OSError) -> str:
    """An OSError's reason without its file name (which would carry a host path)."""
    return exc.strerror or type(exc).__name__


def _open_dir(root: Path, allow_symlinks: bool, problems: list[str]) -> int | None:
    """Open the export directory (not through a symlink unless allowed); None + a problem."""
    shown = display_path(root)
    try:
        st = os.lstat(root)
    except (OSError, ValueError):
        problems.append(f"{shown} is not a directory")
        return None
    if stat.S_ISLNK(st.st_mode) and not allow_symlinks:
        problems.append(
            f"{shown} is a symlink, not a directory (pass allow_symlinks=True to accept links)"
        )
        return None
    try:
        fd = os.open(root, _O_READ | _O_DIRECTORY | (0 if allow_symlinks else _O_NOFOLLOW))
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ENOENT, errno.ELOOP):
            problems.append(f"{shown} is not a directory")
        else:
            problems.append(f"{shown}: cannot be opened ({_reason(exc)})")
        return None
    if not stat.S_ISDIR(os.fstat(fd).st_mode):
        os.close(fd)
        problems.append(f"{shown} is not a directory")
        return None
    return fd


def _open_member(dir_fd: int, name: str, allow_symlinks: bool) -> tuple[int, FileIdentity]:
    """Open ``name`` inside the directory for reading; return the fd and the file's identity.

    Raises :class:`_Missing` if there is no such entry, :class:`_Refused` (message naming the
    file) for a symlink (unless allowed), a dangling link, or anything but a regular file.
    """
    try:
        lst = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise _Missing(name) from None
    except OSError as exc:
        raise _Refused(f"{name}: cannot be read ({_reason(exc)})") from None
    link = stat.S_ISLNK(lst.st_mode)
    if link and not allow_symlinks:
        raise _Refused(
            f"{name}: is a symlink; shards, index, manifest and config must be regular files "
            "inside the export directory (pass allow_symlinks=True to accept links)"
        )
    try:
        fd = os.open(name, _O_READ | (0 if allow_symlinks else _O_NOFOLLOW), dir_fd=dir_fd)
    except FileNotFoundError:
        if link:
            raise _Refused(f"{name}: is a symlink to a missing file") from None
        raise _Missing(name) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _Refused(
                f"{name}: is a symlink (replaced while verifying); pass allow_symlinks=True "
                "to accept links"
            ) from None
        raise _Refused(f"{name}: cannot be opened ({_reason(exc)})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        what = "a symlink to something" if link else "something"
        raise _Refused(f"{name}: is {what} other than a regular file")
    return fd, FileIdentity(
        name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, link, st.st_ctime_ns
    )


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return True


def _fd_path(fd: int, fallback: Path) -> str:
    """A path naming exactly the open file (Linux), so a library re-opens the same file."""
    path = f"{_FD_DIR}/{fd}"
    return path if os.path.isdir(_FD_DIR) else str(fallback)


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    """Up to ``n`` bytes at ``offset``; each read asks for what the file holds (plus a little,
    to see its end), not ``n``: ``os.pread`` allocates what it is asked for."""
    chunks: list[bytes] = []
    got = 0
    size = os.fstat(fd).st_size
    while got < n:
        left = max(size - offset - got, 0) + _MIN_READ_BYTES
        part = os.pread(fd, min(n - got, _READ_BYTES, left), offset + got)
        if not part:
            break
        chunks.append(part)
        got += len(part)
    return b"".join(chunks)


class _Scan:
    """One pass over a directory: opens members relative to it, records their identities and
    notices a file replaced between two opens."""

    def __init__(self, root: Path, dir_fd: int, report: DirReport, allow_symlinks: bool) -> None:
        self.root = root
        self.dir_fd = dir_fd
        self.report = report
        self.allow_symlinks = allow_symlinks

    def open(self, name: str) -> int:
        """The fd of ``name`` (caller closes); raises _Missing / _Refused."""
        fd, identity = _open_member(self.dir_fd, name, self.allow_symlinks)
        seen = self.report.identities.setdefault(name, identity)
        if not seen.same_file(identity):
            os.close(fd)
            raise _Refused(f"{name}: replaced or modified while it was being verified")
        return fd

    def read_json(self, name: str, what: str, problems: list[str]) -> Any:
        """Parse ``name`` as bounded JSON; None (and a problem naming it) when it cannot be."""
        try:
            fd = self.open(name)
        except _Missing:
            problems.append(f"{what} {name} is missing")
            return None
        except _Refused as exc:
            problems.append(str(exc))
            return None
        try:
            data = _pread_exact(fd, MAX_JSON_BYTES + 1, 0)
        except OSError as exc:
            problems.append(f"{what} {name} cannot be read ({_reason(exc)})")
            return None
        finally:
            os.close(fd)
        if len(data) > MAX_JSON_BYTES:
            problems.append(f"{what} {name} is larger than {MAX_JSON_BYTES} bytes")
            return None
        try:
            return loads_bounded(data, MAX_JSON_DEPTH)
        except BadJSON as exc:
            problems.append(f"{what} {name} cannot be read as JSON: {exc}")
            return None


# --------------------------------------------------------------------------- safetensors header
def _entry_span(info: Any, data_len: int) -> tuple[int, int] | str:
    """``(begin, stop)`` of a well-formed header entry, or why it is not (naming the field)."""
    if not isinstance(info, dict):
        return f"is {_short(info)}, not an object with dtype, shape and data_offsets"
    dtype = info.get("dtype")
    item = _ITEM_SIZES.get(dtype) if isinstance(dtype, str) else None
    if item is None:
        return f"field 'dtype' {_short(dtype)} is not a known safetensors dtype"
    shape = info.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_NDIM
        or not all(_is_int(d) and 0 <= d <= _MAX_INT64 for d in shape)
    ):
        return f"field 'shape' {_short(shape)} is not a list of at most {_MAX_NDIM} ints >= 0"
    nbytes = item
    for dim in shape:
        nbytes *= dim
        if nbytes > data_len:  # also stops the product before it can grow huge
            if 0 in shape:
                nbytes = 0
                break
            return (
                f"field 'shape' {_short(shape)} needs more bytes than the file's data section "
                f"holds ({data_len}; truncated file?)"
            )
    offsets = info.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(x) and 0 <= x <= _MAX_INT64 for x in offsets)
        or offsets[0] > offsets[1]
    ):
        return f"field 'data_offsets' {_short(offsets)} is not [begin, end] with 0 <= begin <= end"
    begin, stop = offsets
    if stop - begin != nbytes:
        return (
            f"field 'data_offsets' spans {stop - begin} bytes, but dtype {dtype} and shape "
            f"{_short(shape)} need {nbytes}"
        )
    return begin, stop


def _check_header(
    fd: int, name: str, size: int, problems: list[str], fallback: Path
) -> tuple[set[str], int] | None:
    """Parse a safetensors header by hand (clear messages), then let the library open it."""
    try:
        prefix = _pread_exact(fd, 8, 0)
        if len(prefix) < 8:
            problems.append(f"{name}: {size} bytes, too short for a safetensors header")
            return None
        n = int.from_bytes(prefix, "little")
        if n == 0 or n > MAX_HEADER_BYTES or 8 + n > size:
            problems.append(
                f"{name}: header length {n} does not fit the file ({size} bytes; at most "
                f"{MAX_HEADER_BYTES} bytes of header are accepted)"
            )
            return None
        raw = _pread_exact(fd, n, 8)
    except OSError as exc:
        problems.append(f"{name}: cannot be read ({_reason(exc)})")
        return None
    try:
        header = loads_bounded(raw, MAX_JSON_DEPTH)
    except BadJSON as exc:
        problems.append(f"{name}: safetensors header does not parse: {exc}")
        return None
    if not isinstance(header, dict):
        problems.append(f"{name}: safetensors header is not a JSON object")
        return None
    data_len = size - 8 - n
    spans: list[tuple[int, int, str]] = []
    bad: list[str] = []
    if "__metadata__" in header:
        meta = header["__metadata__"]
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            problems.append(f"{name}: header field '__metadata__' must map strings to strings")
            return None
    for key, info in header.items():
        if key == "__metadata__":
            continue
        span = _entry_span(info, data_len)
        if isinstance(span, str):
            bad.append(f"{_short(key)} {span}")
        else:
            spans.append((span[0], span[1], key))
    if bad:
        shown = "; ".join(bad[:_ENTRIES_SHOWN])
        more = f"; ... and {len(bad) - _ENTRIES_SHOWN} more" if len(bad) > _ENTRIES_SHOWN else ""
        problems.append(f"{name}: malformed header entries: {shown}{more}")
        return None
    end = max((stop for _, stop, _ in spans), default=0)
    if end != data_len:
        problems.append(
            f"{name}: size {size} bytes, but its header describes {8 + n + end} bytes "
            "(truncated or padded file)"
        )
        return None
    spans.sort()
    pos, prev = 0, None
    for begin, stop, key in spans:
        if begin != pos:
            what = "overlaps" if begin < pos else "leaves a gap after"
            other = _short(prev) if prev is not None else "the start of the data section"
            problems.append(
                f"{name}: header entry {_short(key)} field 'data_offsets' {what} {other}"
            )
            return None
        pos, prev = stop, key
    keys = {key for _, _, key in spans}
    if not keys:
        problems.append(f"{name}: holds no tensors")
        return None
    try:  # the real reader must accept it too (dtype spellings, anything we do not check)
        from safetensors import safe_open

        with safe_open(_fd_path(fd, fallback), framework="pt") as handle:
            lib_keys = set(handle.keys())
        if lib_keys != keys:
            problems.append(f"{name}: safetensors reports keys {_few(lib_keys ^ keys)} differently")
            return None
    except Exception as exc:
        problems.append(f"{name}: safetensors cannot open it: {type(exc).__name__}")
        return None
    return keys, data_len


def _check_weight_file(scan: _Scan, fname: str, problems: list[str]) -> tuple[set[str], int] | None:
    try:
        fd = scan.open(fname)
    except _Refused as exc:
        problems.append(str(exc))
        return None
    try:
        size = os.fstat(fd).st_size
        return _check_header(fd, fname, size, problems, scan.root / fname)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- manifest / index
def _manifest_fields(
    manifest: Any, problems: list[str]
) -> tuple[dict[str, Any] | None, dict[str, tuple[int, str]], list[str] | None]:
    """Validate the manifest's fields; return (the manifest, its well-formed file entries,
    its key list). Every malformed field is a problem naming it."""
    m = MANIFEST_NAME
    if not isinstance(manifest, dict):
        problems.append(f"manifest {m} is not a JSON object")
        return None, {}, None
    fmt = manifest.get("format")
    if fmt != MANIFEST_FORMAT:
        problems.append(f"manifest {m}: field 'format' is {_short(fmt)}, not {MANIFEST_FORMAT!r}")
    version = manifest.get("version")
    if not (_is_int(version) and 0 <= version <= _MAX_INT64):
        problems.append(f"manifest {m}: field 'version' {_short(version)} is not an int >= 0")
    files: dict[str, tuple[int, str]] = {}
    raw_files = manifest.get("files")
    if not isinstance(raw_files, dict):
        problems.append(f"manifest {m} has no 'files' mapping")
    else:
        for fname, info in raw_files.items():
            where = f"manifest {m}: field 'files' entry {_short(fname)}"
            if not _safe_name(fname):
                problems.append(f"{where} is not a plain file name inside the directory")
                continue
            if not isinstance(info, dict):
                problems.append(f"{where} is {_short(info)}, not an object")
                continue
            size, digest = info.get("size"), info.get("sha256")
            if not (_is_int(size) and 0 <= size <= _MAX_INT64):
                problems.append(f"{where}: field 'size' {_short(size)} is not an int >= 0")
                continue
            if not (isinstance(digest, str) and _SHA256_RE.fullmatch(digest)):
                problems.append(
                    f"{where}: field 'sha256' {_short(digest)} is not 64 lowercase hex digits"
                )
                continue
            files[fname] = (size, digest)
    keys = manifest.get("keys")
    if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        problems.append(f"manifest {m}: field 'keys' {_short(keys)} is not a list of strings")
        keys = None
    elif len(set(keys)) != len(keys):
        problems.append(f"manifest {m}: field 'keys' lists a key twice")
        keys = None
    return manifest, files, keys


def _index_weight_map(index: Any, problems: list[str]) -> dict[str, str] | None:
    """The index's well-formed weight map, problems naming every malformed field
    (:func:`rollsafe.wire.hf_index.weight_map_problems`)."""
    wm, found = weight_map_problems(index, where=INDEX_NAME)
    problems.extend(found)
    return wm


def _expected_set(expected_keys: Collection[str] | None) -> set[str] | None:
    if expected_keys is None:
        return None
    if isinstance(expected_keys, (str, bytes)):
        raise ExportInputError("expected_keys must be a collection of key names, not a string")
    expected = set(expected_keys)
    wrong = [k for k in expected if not isinstance(k, str)]
    if wrong:
        raise ExportInputError(f"expected_keys must be strings, got {_short(wrong[0])}")
    return expected


# --------------------------------------------------------------------------- inspection
def inspect_hf_dir(
    path: str | os.PathLike[str],
    expected_keys: Collection[str] | None = None,
    allow_missing_prefixes: Collection[str] = ("mtp.",),
    *,
    require_manifest: bool = False,
    hash_workers: int | None = None,
    prehashed: Mapping[str, str] | None = None,
    allow_symlinks: bool = False,
    require_config: bool = False,
) -> DirReport:
    """Check an HF safetensors directory; collect every problem (never raises for bad content).

    ``prehashed`` maps file names to SHA-256 digests the caller already took by reading those
    files back in this process (the exporter does, while comparing them with its snapshot);
    they are compared with the manifest without being read again. ``allow_symlinks``: accept
    files (and the directory) reached through symlinks, recording the targets' identities.
    ``require_config``: a ``config.json`` must be present (it is always checked when present:
    a JSON object within the size and depth limits). Raises :class:`ExportInputError` only for
    a bad argument (``expected_keys`` that are not strings).
    """
    root = Path(path)
    expected = _expected_set(expected_keys)
    prefixes = (
        (allow_missing_prefixes,)
        if isinstance(allow_missing_prefixes, str)
        else tuple(allow_missing_prefixes)
    )
    report = DirReport(root, allow_symlinks=bool(allow_symlinks))
    dir_fd = _open_dir(root, bool(allow_symlinks), report.problems)
    if dir_fd is None:
        return report
    try:
        st = os.fstat(dir_fd)
        report.dir_id = (st.st_dev, st.st_ino)
        scan = _Scan(root, dir_fd, report, bool(allow_symlinks))
        hashed = prehashed or {}
        _inspect(scan, expected, prefixes, require_manifest, require_config, hash_workers, hashed)
    finally:
        os.close(dir_fd)
    return report


def _inspect(
    scan: _Scan,
    expected: set[str] | None,
    prefixes: tuple[str, ...],
    require_manifest: bool,
    require_config: bool,
    hash_workers: int | None,
    prehashed: Mapping[str, str],
) -> None:
    report = scan.report
    problems = report.problems
    dir_fd = scan.dir_fd

    # ---------------------------------------------------------------- manifest
    manifest_files: dict[str, tuple[int, str]] = {}
    manifest_keys: list[str] | None = None
    if _exists(dir_fd, MANIFEST_NAME):
        report.manifest_found = True
        raw = scan.read_json(MANIFEST_NAME, "manifest", problems)
        if raw is not None:
            report.manifest, manifest_files, manifest_keys = _manifest_fields(raw, problems)
    elif require_manifest:
        problems.append(f"{MANIFEST_NAME} is missing")

    # ---------------------------------------------------------------- config
    if _exists(dir_fd, CONFIG_NAME):
        config = scan.read_json(CONFIG_NAME, "config", problems)
        if config is not None and not isinstance(config, dict):
            problems.append(f"config {CONFIG_NAME} is {_short(config)}, not a JSON object")
    elif require_config:
        problems.append(
            f"{CONFIG_NAME} is missing (a save without it does not load with from_pretrained)"
        )

    # ---------------------------------------------------------------- index / single file
    has_index = _exists(dir_fd, INDEX_NAME)
    if has_index:
        index = scan.read_json(INDEX_NAME, "index", problems)
        if index is None:
            return
        wm = _index_weight_map(index, problems)
        if wm is None:
            return
        report.weight_map = wm
    elif _exists(dir_fd, SINGLE_FILE_NAME):
        try:
            checked = _check_weight_file(scan, SINGLE_FILE_NAME, problems)
        except _Missing:
            problems.append(f"{SINGLE_FILE_NAME} disappeared while it was being verified")
            return
        if checked is None:
            return
        report.weight_map = dict.fromkeys(checked[0], SINGLE_FILE_NAME)
        report.file_keys[SINGLE_FILE_NAME] = checked[0]
        report.tensor_bytes = checked[1]
    else:
        problems.append(f"neither {INDEX_NAME} nor {SINGLE_FILE_NAME} is present")
        return

    by_file: dict[str, set[str]] = {}
    for key, fname in report.weight_map.items():
        by_file.setdefault(fname, set()).add(key)

    # ---------------------------------------------------------------- weight files and keys
    if has_index:
        for fname, indexed in sorted(by_file.items()):
            try:
                checked = _check_weight_file(scan, fname, problems)
            except _Missing:
                problems.append(
                    f"index maps {len(indexed)} key(s) to missing file {fname}: {_few(indexed)}"
                )
                continue
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
        _check_manifest(
            scan, manifest_files, manifest_keys, set(by_file), has_index, hash_workers, prehashed
        )

    # ---------------------------------------------------------------- key coverage
    present = set(report.weight_map)
    if expected is not None:
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


def _check_manifest(
    scan: _Scan,
    manifest_files: dict[str, tuple[int, str]],
    manifest_keys: list[str] | None,
    weight_files: set[str],
    has_index: bool,
    hash_workers: int | None,
    prehashed: Mapping[str, str],
) -> None:
    report = scan.report
    problems = report.problems
    before = len(problems)
    unlisted = sorted(weight_files - set(manifest_files))
    if has_index and INDEX_NAME not in manifest_files:
        unlisted.insert(0, INDEX_NAME)
    if unlisted:
        problems.append(f"file(s) not listed in {MANIFEST_NAME}: {_few(unlisted)}")
    if manifest_keys is not None and set(manifest_keys) != set(report.weight_map):
        diff = set(manifest_keys) ^ set(report.weight_map)
        problems.append(f"manifest key list and index differ on {len(diff)} key(s): {_few(diff)}")

    to_hash: list[tuple[str, str, int]] = []
    for fname, (want_size, want) in sorted(manifest_files.items()):
        try:
            fd = scan.open(fname)
        except _Missing:
            problems.append(f"{fname} is listed in the manifest but missing")
            continue
        except _Refused as exc:
            problems.append(str(exc))
            continue
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if size != want_size:
            problems.append(f"{fname}: size {size} bytes, manifest says {want_size}")
            continue
        if fname in prehashed:
            if prehashed[fname] != want:
                problems.append(f"{fname}: sha256 read back does not match the manifest's")
            continue
        to_hash.append((fname, want, size))

    def digest(fname: str) -> str | None:
        try:
            fd = scan.open(fname)
        except (_Missing, _Refused):
            return None
        try:
            return _sha256_fd(fd)
        except OSError:
            return None
        finally:
            os.close(fd)

    workers = hash_workers or min(4, os.cpu_count() or 1)
    to_hash.sort(key=lambda item: -item[2])  # largest first keeps the pool busy to the end
    with ThreadPoolExecutor(
        max_workers=max(1, workers), thread_name_prefix="rollsafe-hf-verify"
    ) as pool:
        digests = list(pool.map(lambda item: digest(item[0]), to_hash))
    for (fname, want, _), got in zip(to_hash, digests, strict=True):
        if got is None:
            problems.append(f"{fname}: replaced, modified or unreadable while being hashed")
        elif got != want:
            problems.append(
                f"{fname}: sha256 {got[:16]}... does not match the manifest's {want[:16]}..."
            )
    # every listed file present, sized and hashed right, and every weight file listed
    report.checksums_verified = not unlisted and len(problems) == before


def verify_hf_dir(
    path: str | os.PathLike[str],
    expected_keys: Collection[str] | None = None,
    allow_missing_prefixes: Collection[str] = ("mtp.",),
    *,
    allow_symlinks: bool = False,
    require_manifest: bool = False,
    require_config: bool = False,
) -> VerifiedExport:
    """Verify an HF safetensors directory; raise :class:`ExportVerificationError` listing problems.

    Checks the index (or a single ``model.safetensors``), that it maps at least one tensor, that
    every indexed file exists as a regular file inside the directory (symlinks only with
    ``allow_symlinks=True``) and its header parses, that every indexed key is in its file, sizes
    and SHA-256 against ``rollsafe-manifest.json`` if present (``require_manifest``: it must
    be), ``config.json`` (``require_config``: it must be present), and key coverage against
    ``expected_keys`` (missing keys under ``allow_missing_prefixes`` are tolerated and reported
    in the result). The result records every file's identity for :func:`reverify`.
    """
    return inspect_hf_dir(
        path,
        expected_keys,
        allow_missing_prefixes,
        allow_symlinks=allow_symlinks,
        require_manifest=require_manifest,
        require_config=require_config,
    ).raise_if_problems()


# --------------------------------------------------------------------------- re-verification
def reverify(
    export: VerifiedExport, *, full: bool = False, hash_workers: int | None = None
) -> VerifiedExport:
    """Check that a verified export still holds the very files that verified; return it.

    The cheap check (default; a few ``stat`` calls per file) re-opens the directory and every
    file verification read, the same way (no symlinks unless the export was verified with
    ``allow_symlinks=True``, regular files only), and compares device, inode, size and
    modification time with what was recorded, and sizes with the manifest's. ``full=True``
    then verifies the directory again from scratch (headers, keys, every SHA-256 against the
    manifest) and checks it is still the same set of files. Raises
    :class:`ExportVerificationError` naming each file that changed.
    """
    problems: list[str] = []
    if not export.files:
        problems.append("no file identities were recorded when it verified (verify it again)")
        raise ExportVerificationError(export.path, problems)
    dir_fd = _open_dir(export.path, export.allow_symlinks, problems)
    if dir_fd is None:
        raise ExportVerificationError(export.path, problems)
    sizes: dict[str, Any] = {}
    if export.manifest is not None and isinstance(export.manifest.get("files"), dict):
        sizes = {
            k: v.get("size") for k, v in export.manifest["files"].items() if isinstance(v, dict)
        }
    try:
        st = os.fstat(dir_fd)
        if export.dir_id is not None and (st.st_dev, st.st_ino) != export.dir_id:
            problems.append(
                f"{display_path(export.path)} is another directory than the one that verified"
            )
        for was in export.files:
            name = was.name
            try:
                fd, now = _open_member(dir_fd, name, export.allow_symlinks)
            except _Missing:
                problems.append(f"{name}: missing (it was there when the export verified)")
                continue
            except _Refused as exc:
                problems.append(str(exc))
                continue
            os.close(fd)
            if name in sizes and now.size != sizes[name]:
                problems.append(f"{name}: size {now.size} bytes, manifest says {sizes[name]}")
            elif now.size != was.size:
                problems.append(f"{name}: size {now.size} bytes, {was.size} when it verified")
            elif (now.st_dev, now.st_ino) != (was.st_dev, was.st_ino):
                target = "symlink target" if was.symlink else "file"
                problems.append(f"{name}: another {target} than the one that verified")
            elif now.symlink != was.symlink:
                problems.append(f"{name}: was {'' if was.symlink else 'not '}a symlink")
            elif now.mtime_ns != was.mtime_ns:
                problems.append(f"{name}: modified since it verified (mtime changed)")
            elif was.ctime_ns is not None and now.ctime_ns != was.ctime_ns:
                problems.append(
                    f"{name}: changed since it verified (its inode change time moved: rewritten "
                    "with its mtime put back, replaced, re-linked or chmod-ed)"
                )
    finally:
        os.close(dir_fd)
    if problems:
        raise ExportVerificationError(export.path, problems)
    if full:
        report = inspect_hf_dir(
            export.path,
            expected_keys=export.keys,
            allow_missing_prefixes=(),
            require_manifest=export.manifest is not None,
            hash_workers=hash_workers,
            allow_symlinks=export.allow_symlinks,
        )
        recorded = {f.name: f for f in export.files}
        for name, now in sorted(report.identities.items()):
            then = recorded.get(name)
            if then is not None and not then.same_file(now):
                report.problems.append(f"{name}: changed while it was being re-verified")
        if report.manifest != export.manifest:
            report.problems.append(f"{MANIFEST_NAME}: differs from the manifest that verified")
        report.raise_if_problems()
    return export

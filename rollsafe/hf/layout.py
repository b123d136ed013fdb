"""On-disk layout of an HF export and the durable file-system steps that publish it.

Owns the names (``hf-v{version}``, the hidden ``.hf-v{version}.tmp-<pid>-<rand>`` temp dir,
``model-0000i-of-0000n.safetensors``, the index and ``rollsafe-manifest.json``), the shard plan
(which tensor goes to which shard, at which byte offset), the safetensors header bytes, the
choice of template files to copy, and the durable primitives: fsync of files and directories and
an atomic rename that refuses to replace an existing final directory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import math
import os
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "INDEX_NAME",
    "MANIFEST_NAME",
    "SINGLE_FILE_NAME",
    "ShardPlan",
    "TensorSlot",
    "atomic_rename_noreplace",
    "final_dir",
    "fsync_dir",
    "parse_temp_name",
    "plan_shards",
    "safetensors_header",
    "shard_file_name",
    "temp_dir",
    "template_files",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
MANIFEST_NAME = "rollsafe-manifest.json"
MANIFEST_FORMAT = "rollsafe.hf-export.v1"

#: Alignment of each shard's data region inside the host snapshot arena.
ARENA_ALIGN = 4096

_TEMP_RE = re.compile(r"^\.hf-v(?P<version>\d+)\.(?P<kind>tmp|trash)-(?P<pid>\d+)-[0-9a-f]+$")
_FINAL_RE = re.compile(r"^hf-v(?P<version>\d+)$")

# Weight files and indexes of every common format: never copied from a template.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


def final_dir(root: Path, version: int) -> Path:
    """``root/hf-v{version}``: the only name under which an export is ever visible."""
    return root / f"hf-v{version}"


def temp_dir(root: Path, version: int, kind: str = "tmp") -> Path:
    """A fresh hidden ``root/.hf-v{version}.{kind}-<pid>-<rand>`` name (kind: tmp or trash)."""
    return root / f".hf-v{version}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def parse_temp_name(name: str) -> tuple[int, str, int] | None:
    """``(version, kind, pid)`` of a hidden temp/trash dir name, else None."""
    m = _TEMP_RE.match(name)
    if m is None:
        return None
    return int(m["version"]), m["kind"], int(m["pid"])


def parse_final_name(name: str) -> int | None:
    """The version of an ``hf-v{version}`` name, else None."""
    m = _FINAL_RE.match(name)
    return int(m["version"]) if m else None


def shard_file_name(i: int, n: int) -> str:
    """HF's shard naming: ``model-00001-of-00003.safetensors`` (1-based)."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


# --------------------------------------------------------------------------- shard plan
@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives: its shard, its byte range in the shard's data section."""

    name: str
    dtype: str  # safetensors spelling: F32, BF16...
    shape: tuple[int, ...]
    nbytes: int
    begin: int  # offset inside the shard's data section


@dataclass(frozen=True)
class ShardPlan:
    """One shard: its file name, tensors in file order, and its region of the host arena."""

    file_name: str
    slots: tuple[TensorSlot, ...]
    data_bytes: int
    arena_offset: int


def plan_shards(
    entries: Sequence[tuple[str, str, tuple[int, ...], int, int]], shard_size_bytes: int
) -> tuple[list[ShardPlan], int]:
    """Split ``(name, st_dtype, shape, nbytes, itemsize)`` entries into shards.

    Greedy in input order, like ``save_pretrained``: a shard is closed when the next tensor would
    push it over ``shard_size_bytes`` (a tensor larger than that gets a shard of its own). Inside
    a shard, tensors are ordered by item size (largest first), which keeps every tensor aligned
    to its element size both in the file's data section and in the arena. Returns the plans and
    the arena size.
    """
    groups: list[list[tuple[str, str, tuple[int, ...], int, int]]] = []
    current: list[tuple[str, str, tuple[int, ...], int, int]] = []
    size = 0
    for entry in entries:
        if current and size + entry[3] > shard_size_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(entry)
        size += entry[3]
    if current:
        groups.append(current)
    n = len(groups)
    plans: list[ShardPlan] = []
    arena_offset = 0
    for i, group in enumerate(groups):
        ordered = sorted(group, key=lambda e: -e[4])  # stable: input order within an item size
        slots: list[TensorSlot] = []
        begin = 0
        for name, st_dtype, shape, nbytes, _ in ordered:
            slots.append(TensorSlot(name, st_dtype, shape, nbytes, begin))
            begin += nbytes
        plans.append(ShardPlan(shard_file_name(i, n), tuple(slots), begin, arena_offset))
        arena_offset += math.ceil(begin / ARENA_ALIGN) * ARENA_ALIGN
    return plans, max(arena_offset, ARENA_ALIGN)


def safetensors_header(slots: Iterable[TensorSlot]) -> bytes:
    """The 8-byte length prefix plus the JSON header of a safetensors file.

    Same format as ``safetensors.torch.save_file(..., metadata={"format": "pt"})``: the JSON is
    padded with spaces to a multiple of 8 bytes so the data section starts aligned.
    """
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    for s in slots:
        header[s.name] = {
            "dtype": s.dtype,
            "shape": list(s.shape),
            "data_offsets": [s.begin, s.begin + s.nbytes],
        }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


# --------------------------------------------------------------------------- templates
def template_files(template_dir: Path) -> list[Path]:
    """The non-weight regular files at the top of ``template_dir`` (config, tokenizer...).

    Never weight files (``*.safetensors``, ``*.bin``...), weight indexes (``*.index.json``),
    a rollsafe manifest, or hidden files; subdirectories are not copied.
    """
    chosen: list[Path] = []
    for entry in sorted(template_dir.iterdir()):
        name = entry.name
        if name.startswith(".") or name == MANIFEST_NAME or not entry.is_file():
            continue
        if name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json"):
            continue
        chosen.append(entry)
    return chosen


# --------------------------------------------------------------------------- durability
def fsync_dir(path: Path) -> None:
    """fsync a directory so the names it holds (new files, a rename) are durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
_libc: ctypes.CDLL | None = None


def _renameat2(src: Path, dst: Path) -> bool:
    """Linux ``renameat2(RENAME_NOREPLACE)``; False if the call is unavailable here."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        if name is None:
            return False
        _libc = ctypes.CDLL(name, use_errno=True)
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL):  # kernel or file system without the flag
        return False
    raise OSError(err, os.strerror(err), str(dst))


def atomic_rename_noreplace(src: Path, dst: Path) -> None:
    """Atomically rename ``src`` to ``dst``; raise ``FileExistsError`` if ``dst`` exists.

    Uses ``renameat2(RENAME_NOREPLACE)`` where available (no window), else an existence check
    followed by ``os.rename`` (which itself refuses a non-empty target directory).
    """
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, "final export directory already exists", str(dst))
    try:
        if _renameat2(src, dst):
            return
    except OSError as exc:
        if exc.errno == errno.EEXIST:
            raise FileExistsError(
                errno.EEXIST, "final export directory already exists", str(dst)
            ) from None
        raise
    os.rename(src, dst)

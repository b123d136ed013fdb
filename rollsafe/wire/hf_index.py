"""The HF safetensors index, read one way by every reader of an export directory.

Owns the rules for ``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file
in the same directory) and the single-file layout (``model.safetensors``):
:func:`weight_map_problems` checks a parsed index and names every malformed field (the verifier
reports them all), :func:`read_weight_map` reads a directory's index and raises
:class:`HFIndexError` on the first problem, :func:`read_hf_index` also sizes the shard files (or
reads the single file's header), :func:`weight_files` lists them. The checkpoint-engine and
disk transports, the reference engine's disk loader and :mod:`rollsafe.hf.verify` all use it.
Imports only the standard library (safetensors for a single file's header).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollsafe.errors import RollsafeError
from rollsafe.text import few, short_repr

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "HFIndex",
    "HFIndexError",
    "read_hf_index",
    "read_weight_map",
    "safe_file_name",
    "weight_files",
    "weight_map_problems",
]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_MAX_INT64 = (1 << 63) - 1
_NAME_MAX_BYTES = 255


class HFIndexError(RollsafeError, ValueError):
    """An HF directory's weight index is unreadable or malformed, or a shard it names is
    missing; the message names the index (or the directory) and the problem."""


def safe_file_name(name: Any) -> bool:
    """A plain file name directly inside the directory (no separators, NUL, controls, dots)."""
    if not isinstance(name, str) or name in ("", ".", ".."):
        return False
    if any(c in "/\\" or ord(c) < 32 or ord(c) == 127 for c in name):
        return False
    try:
        return len(name.encode("utf-8")) <= _NAME_MAX_BYTES
    except UnicodeEncodeError:  # lone surrogates from a JSON \\ud800 escape
        return False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def weight_map_problems(
    index: Any, *, where: str = INDEX_FILE
) -> tuple[dict[str, str] | None, list[str]]:
    """The index's well-formed weight map (None when there is none) and a problem naming every
    malformed field (``where`` names the index in them)."""
    problems: list[str] = []
    i = where
    if not isinstance(index, dict):
        return None, [f"index {i} is not a JSON object"]
    wm = index.get("weight_map")
    if not isinstance(wm, dict):
        return None, [f"index {i} has no 'weight_map' mapping"]
    meta = index.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        problems.append(f"index {i}: field 'metadata' is {short_repr(meta)}, not an object")
    elif isinstance(meta, dict) and "total_size" in meta:
        total = meta["total_size"]
        if not (_is_int(total) and 0 <= total <= _MAX_INT64):
            problems.append(
                f"index {i}: field 'metadata.total_size' {short_repr(total)} is not an int >= 0"
            )
    if not wm:
        problems.append(
            f"index {i}: field 'weight_map' is empty (an export holds at least one tensor)"
        )
        return None, problems
    not_names = sorted(k for k, v in wm.items() if not isinstance(v, str))
    if not_names:
        problems.append(
            f"index {i}: field 'weight_map' maps {len(not_names)} key(s) to values that are not "
            f"file names: {few(not_names)}"
        )
    unsafe = sorted({v for v in wm.values() if isinstance(v, str) and not safe_file_name(v)})
    if unsafe:
        problems.append(
            f"index {i}: field 'weight_map' maps keys to file names outside the directory: "
            f"{few(unsafe)}"
        )
    not_st = sorted(
        {v for v in wm.values() if safe_file_name(v) and not v.endswith(".safetensors")}
    )
    if not_st:
        problems.append(
            f"index {i}: field 'weight_map' maps keys to files that are not .safetensors: "
            f"{few(not_st)}"
        )
    return {k: v for k, v in wm.items() if safe_file_name(v) and v.endswith(".safetensors")}, (
        problems
    )


def read_weight_map(directory: str | Path, *, shown: str | None = None) -> dict[str, str] | None:
    """The weight map of ``directory``'s index, or None when it has no index file.

    Raises :class:`HFIndexError` when the index is unreadable or malformed (the first problem,
    prefixed with ``shown``, default the index's path) or names a shard that is not a file.
    """
    index = Path(directory) / INDEX_FILE
    if not index.is_file():
        return None
    where = shown if shown is not None else str(index)
    try:
        parsed = json.loads(index.read_text())
    except (OSError, ValueError) as exc:
        raise HFIndexError(f"{where}: unreadable index ({exc})") from exc
    wm, problems = weight_map_problems(parsed, where=INDEX_FILE)
    if problems or wm is None:
        raise HFIndexError(f"{where}: {problems[0] if problems else 'no weight map'}")
    for key, fname in sorted(wm.items()):
        if not (Path(directory) / fname).is_file():
            raise HFIndexError(f"{where}: shard {fname!r} (key {key!r}) is missing")
    return wm


@dataclass(frozen=True)
class HFIndex:
    """An HF safetensors directory: ``weight_map`` (key -> file) and each file's size in bytes."""

    path: Path
    weight_map: dict[str, str]
    file_sizes: dict[str, int]

    @property
    def keys(self) -> list[str]:
        return sorted(self.weight_map)

    def files_of(self, names: Iterable[str]) -> list[Path]:
        return [self.path / n for n in names]


def read_hf_index(export_dir: str | Path) -> HFIndex:
    """Read ``model.safetensors.index.json`` (or a single ``model.safetensors``) of a directory.

    Raises :class:`HFIndexError` naming the path when the index is unreadable, empty, names a
    non-plain or missing shard file, or the directory holds neither layout.
    """
    path = Path(export_dir)
    if not path.is_dir():
        raise HFIndexError(f"export dir {str(path)!r} is not a directory")
    weight_map = read_weight_map(path)
    if weight_map is not None:
        sizes = {f: (path / f).stat().st_size for f in sorted(set(weight_map.values()))}
        return HFIndex(path, weight_map, sizes)
    single = path / SINGLE_FILE
    if single.is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(single), framework="pt") as f:
                keys = list(f.keys())
        except Exception as exc:
            raise HFIndexError(f"{single}: unreadable safetensors file ({exc})") from exc
        if not keys:
            raise HFIndexError(f"{single}: holds no tensors")
        return HFIndex(path, dict.fromkeys(keys, SINGLE_FILE), {SINGLE_FILE: single.stat().st_size})
    raise HFIndexError(f"{str(path)!r} has neither {INDEX_FILE} nor {SINGLE_FILE}")


def weight_files(directory: str | Path, *, shown: str | None = None) -> list[Path] | None:
    """The weight files of ``directory`` (its index's shards, or the single file), sorted;
    None when it holds neither layout. Raises :class:`HFIndexError` as :func:`read_weight_map`."""
    path = Path(directory)
    weight_map = read_weight_map(path, shown=shown)
    if weight_map is not None:
        return [path / f for f in sorted(set(weight_map.values()))]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    return None

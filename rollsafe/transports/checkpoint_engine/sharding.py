"""Sharding: which trainer rank registers which keys or files, and whether they cover the model.

Owns :func:`partition_keys` / :func:`assign_files` (deterministic, size-balanced shares),
:func:`read_hf_index` (the HF index through :mod:`rollsafe.wire.hf_index`, errors as
:class:`~rollsafe.transports.RegisterError`) and the key-coverage check
(:class:`KeyCoverage`, :func:`check_key_coverage`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from rollsafe.errors import InvalidArgument
from rollsafe.transports.base import (
    RegisterError,
)
from rollsafe.wire.hf_index import HFIndex, HFIndexError
from rollsafe.wire.hf_index import read_hf_index as _read_hf_index

_MAX_LISTED = 10


def partition_keys(sizes: Iterable[tuple[str, int]], world_size: int) -> list[list[str]]:
    """Split keys over ``world_size`` ranks, balancing bytes; deterministic for the same input.

    Largest first onto the least-loaded rank (ties: lower rank), keys in each share sorted.
    Every rank computing this from the same (name, nbytes) list gets the same answer.
    """
    if world_size < 1:
        raise InvalidArgument("world_size", f"world_size must be >= 1, got {world_size}")
    ordered = sorted(sizes, key=lambda kv: (-int(kv[1]), kv[0]))
    names = [n for n, _ in ordered]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise InvalidArgument("keys", f"duplicate keys in partition input: {dup[:_MAX_LISTED]}")
    load = [0] * world_size
    shares: list[list[str]] = [[] for _ in range(world_size)]
    for name, nbytes in ordered:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        shares[rank].append(name)
        load[rank] += max(int(nbytes), 1)
    return [sorted(s) for s in shares]


def assign_files(file_sizes: Mapping[str, int], world_size: int) -> list[list[str]]:
    """Assign shard files to ranks, balancing bytes (same rule as :func:`partition_keys`)."""
    return partition_keys(file_sizes.items(), world_size)


def read_hf_index(export_dir: str | Path) -> HFIndex:
    """Read an HF directory's index (or single file): :func:`rollsafe.wire.hf_index.read_hf_index`,
    its :class:`~rollsafe.wire.hf_index.HFIndexError` raised as :class:`RegisterError`."""
    try:
        return _read_hf_index(export_dir)
    except HFIndexError as exc:
        raise RegisterError(str(exc)) from exc


def listed(keys: Collection[str]) -> str:
    ordered = sorted(keys)
    head = ", ".join(repr(k) for k in ordered[:_MAX_LISTED])
    more = len(ordered) - _MAX_LISTED
    return f"[{head}{f', ... {more} more' if more > 0 else ''}]"


@dataclass(frozen=True)
class KeyCoverage:
    """Registered keys against expected ones: what is missing (allowed or not), extra, doubled."""

    missing: tuple[str, ...] = ()
    allowed_missing: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    duplicated: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not (self.missing or self.extra or self.duplicated)

    def describe(self) -> str:
        """One line naming the offending keys (bounded); empty when ``ok``."""
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} missing key(s) {listed(self.missing)}")
        if self.extra:
            parts.append(f"{len(self.extra)} extra key(s) {listed(self.extra)}")
        if self.duplicated:
            parts.append(
                f"{len(self.duplicated)} key(s) registered by several ranks "
                f"{listed(self.duplicated)}"
            )
        return "; ".join(parts)


def check_key_coverage(
    expected: Iterable[str],
    registered: Iterable[str],
    allow_missing_prefixes: Sequence[str] = ("mtp.",),
) -> KeyCoverage:
    """Compare keys like the registration guard does, keeping the names for the error message.

    ``registered`` may repeat a key (one entry per rank that registered it): a repeat is
    reported as ``duplicated``. Missing keys under ``allow_missing_prefixes`` are tolerated.
    """
    exp = set(expected)
    seen: set[str] = set()
    dup: set[str] = set()
    for k in registered:
        (dup if k in seen else seen).add(k)
    prefixes = tuple(allow_missing_prefixes)
    gone = exp - seen
    allowed = {k for k in gone if prefixes and k.startswith(prefixes)}
    return KeyCoverage(
        missing=tuple(sorted(gone - allowed)),
        allowed_missing=tuple(sorted(allowed)),
        extra=tuple(sorted(seen - exp)),
        duplicated=tuple(sorted(dup)),
    )

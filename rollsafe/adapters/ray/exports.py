"""The shared-exports check: a path the user declares shared is read back on every Ray node.

``RaySettings(shared_exports=True)`` declares that ``export_root`` is the same directory on
every node of the cluster (NFS, a parallel file system...). :func:`check_shared_exports` checks
that at the fleet's start:

1. a probe file of random bytes is written under ``export_root`` (written to a temporary name,
   ``fsync``\\ ed, renamed into place, the directory ``fsync``\\ ed: what an export does);
2. one lightweight Ray task per alive node (``num_cpus=0``, pinned there with
   ``NodeAffinitySchedulingStrategy(node_id, soft=False)``) reads it and returns its size and
   sha256 (and the node it ran on);
3. a node that cannot read it, reads other bytes, or does not answer within ``timeout_s``
   fails the check with :class:`SharedExportUnreadable` naming the node id and the path;
4. the probe file is removed afterwards, whatever happened.

Ray is imported when the check runs, not when this module is imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollsafe.errors import InvalidArgument, RollsafeError

__all__ = [
    "PROBE_PREFIX",
    "ProbeFile",
    "SharedExportUnreadable",
    "SharedExportsCheck",
    "check_shared_exports",
    "judge_reads",
    "read_probe",
    "write_probe",
]

#: the probe file's name starts with this (a hidden file: never taken for an export version)
PROBE_PREFIX = ".rollsafe-shared-probe-"


class SharedExportUnreadable(RollsafeError, RuntimeError):
    """A node of the Ray cluster could not read back the probe file written under a path the
    fleet declared shared (``RaySettings.shared_exports``). ``node_id`` and ``path`` name the
    first such node and the file; ``failures`` maps every failing node id to its reason."""

    def __init__(self, node_id: str, path: str, failures: Mapping[str, str]) -> None:
        self.node_id = node_id
        self.path = path
        self.failures = dict(failures)
        others = len(self.failures) - 1
        more = f" (and {others} other node(s): {sorted(set(self.failures) - {node_id})})"
        super().__init__(
            f"export_root is declared shared (ray.shared_exports=True) but Ray node {node_id} "
            f"cannot read the probe file {path}: {self.failures.get(node_id, '?')}"
            + (more if others else "")
        )


@dataclass(frozen=True)
class ProbeFile:
    """The probe written by the trainer's process: its ``path``, ``size`` and ``sha256``."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class SharedExportsCheck:
    """A passed check: the ``probe`` that every node in ``nodes`` (node id -> the node its
    task actually ran on, the same id) read back equal, in ``seconds``."""

    root: str
    probe: ProbeFile
    nodes: Mapping[str, str] = field(default_factory=dict)
    seconds: float = 0.0


def write_probe(root: str | os.PathLike[str], nbytes: int = 4096) -> ProbeFile:
    """Write ``nbytes`` random bytes to a new probe file under ``root`` (created if missing),
    durably and atomically (temporary name, fsync, rename, fsync of the directory)."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise InvalidArgument("nbytes", f"must be an int > 0, got {nbytes!r}")
    directory = Path(root).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    data = secrets.token_bytes(nbytes)
    name = f"{PROBE_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    final = directory / name
    tmp = directory / f"{name}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return ProbeFile(str(final), nbytes, hashlib.sha256(data).hexdigest())


def read_probe(path: str) -> dict[str, Any]:
    """What one node sees at ``path``: ``{"size", "sha256", "node_id"}`` (runs in a Ray task
    on that node; raises ``OSError`` when the file cannot be read)."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    node_id: str | None = None
    ray = sys.modules.get("ray")  # inside a Ray task it is imported; never start a Ray here
    if ray is not None and ray.is_initialized():
        with contextlib.suppress(Exception):
            node_id = str(ray.get_runtime_context().get_node_id())
    return {"size": size, "sha256": digest.hexdigest(), "node_id": node_id}


def judge_reads(probe: ProbeFile, reads: Mapping[str, dict[str, Any] | BaseException]) -> None:
    """Raise :class:`SharedExportUnreadable` unless every node's read (``node_id`` -> what
    :func:`read_probe` returned there, or the exception its task raised) saw ``probe``'s
    size and digest, on that very node. The first failing node id (in sorted order) is
    the error's ``node_id``."""
    failures: dict[str, str] = {}
    for node_id, read in reads.items():
        if isinstance(read, BaseException):
            failures[node_id] = f"{type(read).__name__}: {read}"
        elif read.get("node_id") not in (None, node_id):
            failures[node_id] = f"the read ran on node {read.get('node_id')}, not there"
        elif read.get("size") != probe.size or read.get("sha256") != probe.sha256:
            failures[node_id] = (
                f"read {read.get('size')} bytes with sha256 {read.get('sha256')}, "
                f"want {probe.size} bytes with sha256 {probe.sha256}"
            )
    if failures:
        first = sorted(failures)[0]
        raise SharedExportUnreadable(first, probe.path, failures)


def check_shared_exports(
    root: str | os.PathLike[str],
    *,
    nodes: Iterable[str] | None = None,
    timeout_s: float = 60.0,
    nbytes: int = 4096,
) -> SharedExportsCheck:
    """Check that every node (default: every alive node of the joined Ray cluster; or the
    ``nodes`` ids given) reads back a probe written under ``root`` within ``timeout_s``;
    raise :class:`SharedExportUnreadable` naming the node and the path otherwise. The probe
    is removed either way. Needs an initialised Ray."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise InvalidArgument("timeout_s", f"must be a number > 0, got {timeout_s!r}")
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    api: Any = ray  # ray.nodes() is untyped
    t0 = time.monotonic()
    if nodes is None:
        targets = [str(n["NodeID"]) for n in api.nodes() if n.get("Alive")]
    else:
        targets = [str(n) for n in nodes]
    if not targets:
        raise InvalidArgument("nodes", "no Ray node to check the shared export_root on")
    probe = write_probe(root, nbytes)
    try:
        task = ray.remote(num_cpus=0, max_retries=0)(read_probe)
        refs = {
            node_id: task.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                name=f"rollsafe-shared-probe-{node_id[:12]}",
            ).remote(probe.path)
            for node_id in targets
        }
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        done = set(ready)
        reads: dict[str, dict[str, Any] | BaseException] = {}
        for node_id, ref in refs.items():
            if ref not in done:
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=True)
                reads[node_id] = TimeoutError(f"no answer within {timeout_s:g} s")
                continue
            try:
                reads[node_id] = ray.get(ref, timeout=timeout_s)
            except Exception as exc:  # the task's own error (OSError) or Ray's (unschedulable)
                reads[node_id] = exc
        judge_reads(probe, reads)
        ran_on = {n: str(r["node_id"]) for n, r in reads.items() if isinstance(r, dict)}
        return SharedExportsCheck(str(Path(root)), probe, ran_on, time.monotonic() - t0)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(probe.path)

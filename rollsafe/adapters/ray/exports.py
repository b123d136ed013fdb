"""Exports every Ray node can use: the ``shared`` check and the ``moved`` mode.

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

The ``moved`` mode (a node that cannot read the trainer's path): :func:`publish_export` puts a
verified export's files into Ray's object store in chunks (hashing them against the export's
``rollsafe-manifest.json`` on the way), and :func:`receive_export`, on the engine's node
(``EngineHost.pull_export``), writes them under a local directory, checks every file's size and
sha256 against the manifest **before** the directory is renamed into place, and refuses a
mismatch (:class:`ExportPullRefused`, nothing left behind). :class:`ExportMover` is the fleet's
use of the two in recovery: one publication per export version, reused by every recovery of
it and dropped once the export is retired, pulled by the restarting group's actor.

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
    "DEFAULT_CHUNK_BYTES",
    "PROBE_PREFIX",
    "ExportMover",
    "ExportParcel",
    "ExportPullRefused",
    "ExportPullTimeout",
    "ProbeFile",
    "PulledExport",
    "SharedExportUnreadable",
    "SharedExportsCheck",
    "check_shared_exports",
    "judge_reads",
    "publish_export",
    "read_probe",
    "receive_export",
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

    def __reduce__(self) -> tuple[Any, ...]:  # keeps its fields through pickling
        return (type(self), (self.node_id, self.path, self.failures))


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
    _fsync_dir(directory)
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


# --------------------------------------------------------------------------- the "moved" mode
#: bytes per object-store chunk of a published export
DEFAULT_CHUNK_BYTES = 64 << 20


class ExportPullRefused(RollsafeError, RuntimeError):
    """A pulled export's file did not match the export's manifest (size or sha256): nothing was
    loaded or left in place. ``export`` names the export directory, ``file`` the file,
    ``reason`` what differed."""

    def __init__(self, export: str, file: str, reason: str) -> None:
        self.export = export
        self.file = file
        self.reason = reason
        super().__init__(f"pulled export {export!r}: file {file!r} refused: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:  # raised in a Ray actor: travels pickled
        return (type(self), (self.export, self.file, self.reason))


class ExportPullTimeout(RollsafeError, TimeoutError):
    """A pull of export ``export`` did not finish within ``timeout_s``: ``phase`` says what
    waited (``"actor"``: the group's actor did not answer, its worker process has not started;
    ``"transfer"``: a chunk of ``file`` did not arrive from the object store). Nothing was
    left in place."""

    def __init__(self, export: str, phase: str, timeout_s: float, file: str = "") -> None:
        self.export = export
        self.phase = phase
        self.timeout_s = timeout_s
        self.file = file
        what = (
            "the group's actor did not answer (its worker process has not started)"
            if phase == "actor"
            else f"a chunk of {file!r} did not arrive from Ray's object store"
        )
        super().__init__(f"pulled export {export!r}: {what} within {timeout_s:.1f} s")

    def __reduce__(self) -> tuple[Any, ...]:  # raised in a Ray actor: travels pickled
        return (type(self), (self.export, self.phase, self.timeout_s, self.file))


@dataclass(frozen=True)
class ExportParcel:
    """A verified export published into Ray's object store (:func:`publish_export`): its
    directory ``name``, the ``manifest`` bytes as written, each manifest file's ``(size,
    sha256)`` in ``files`` and its chunks' object refs in ``chunks`` (in order)."""

    name: str
    manifest: bytes
    files: Mapping[str, tuple[int, str]]
    chunks: Mapping[str, tuple[Any, ...]]

    @property
    def nbytes(self) -> int:
        return sum(size for size, _ in self.files.values())


@dataclass(frozen=True)
class PulledExport:
    """Where a node's copy of an export is (``path``), the bytes moved (0: a copy already
    there matched the manifest, ``reused``), the node (``node_id``, when known)."""

    path: str
    nbytes: int
    reused: bool
    node_id: str | None = None


def _manifest_files(manifest: bytes, where: str) -> dict[str, tuple[int, str]]:
    import json

    from rollsafe.hf.layout import MANIFEST_NAME

    try:
        files = json.loads(manifest)["files"]
        out = {str(n): (int(i["size"]), str(i["sha256"])) for n, i in files.items()}
    except (ValueError, KeyError, TypeError) as exc:
        raise ExportPullRefused(where, MANIFEST_NAME, f"unreadable manifest: {exc!r}") from exc
    for name in out:
        if name != os.path.basename(name) or name.startswith("."):
            raise ExportPullRefused(where, name, "not a plain file name inside the export")
    return out


def publish_export(
    export_dir: str | os.PathLike[str],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    put: Any = None,
    version: int | None = None,
) -> ExportParcel:
    """Put a verified export (a directory with ``rollsafe-manifest.json``) into Ray's object
    store, ``chunk_bytes`` per object; every file is hashed on the way and refused
    (:class:`ExportPullRefused`) when it no longer matches the manifest. ``put``: what stores a
    chunk (default ``ray.put``).

    A verified regular save without a manifest (the fleet's start checkpoint, its
    ``model_path`` adopted as the export of ``initial_version``) is published with a manifest
    made of what is read: every regular file directly inside it (hidden names left out), its
    size and SHA-256 taken on the way, its tensor names (from the headers) and ``version``
    (the export's version: required for such a directory). Nothing on disk says what its
    bytes must be: that they are still the ones that verified is the lease's
    re-verification (every file's identity), and the receiving node checks its copy against
    this manifest as for any export, so the copy is a complete export with its manifest."""
    from rollsafe.hf.layout import MANIFEST_NAME

    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise InvalidArgument("chunk_bytes", f"must be an int > 0, got {chunk_bytes!r}")
    if put is None:
        import ray

        put = ray.put
    src = Path(export_dir)
    if not (src / MANIFEST_NAME).exists():
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise InvalidArgument(
                "version",
                f"{src.name} has no {MANIFEST_NAME}: publishing it as a regular save needs the "
                f"export's version (an int >= 0), got {version!r}",
            )
        return _publish_regular_save(src, chunk_bytes, put, version)
    manifest = (src / MANIFEST_NAME).read_bytes()
    files = _manifest_files(manifest, src.name)
    chunks: dict[str, tuple[Any, ...]] = {}
    for name, (size, sha256) in files.items():
        digest = hashlib.sha256()
        refs: list[Any] = []
        got = 0
        with open(src / name, "rb") as f:
            while data := f.read(chunk_bytes):
                digest.update(data)
                got += len(data)
                refs.append(put(data))
        if (got, digest.hexdigest()) != (size, sha256):
            raise ExportPullRefused(
                src.name, name, f"the source reads {got} bytes / {digest.hexdigest()}"
            )
        chunks[name] = tuple(refs)
    return ExportParcel(src.name, manifest, files, chunks)


def _publish_regular_save(src: Path, chunk_bytes: int, put: Any, version: int) -> ExportParcel:
    """:func:`publish_export` of a directory without a manifest: one is made of what is read."""
    import json

    from rollsafe.hf.layout import MANIFEST_FORMAT
    from rollsafe.hf.verify import inspect_hf_dir

    report = inspect_hf_dir(src, require_config=True, allow_symlinks=True)
    if report.problems:
        raise ExportPullRefused(src.name, "*", "; ".join(report.problems[:3]))

    files: dict[str, tuple[int, str]] = {}
    chunks: dict[str, tuple[Any, ...]] = {}
    for entry in sorted(src.iterdir(), key=lambda p: p.name):
        if entry.name.startswith(".") or not entry.is_file():
            continue
        digest = hashlib.sha256()
        refs: list[Any] = []
        got = 0
        with open(entry, "rb") as f:
            while data := f.read(chunk_bytes):
                digest.update(data)
                got += len(data)
                refs.append(put(data))
        files[entry.name] = (got, digest.hexdigest())
        chunks[entry.name] = tuple(refs)
    if not files:
        raise ExportPullRefused(src.name, "*", "a regular save with no file to publish")
    manifest = json.dumps(
        {
            "format": MANIFEST_FORMAT,
            "version": version,
            "regular_save": src.name,
            "keys": sorted(report.weight_map),
            "files": {n: {"size": size, "sha256": sha} for n, (size, sha) in files.items()},
        },
        indent=1,
        sort_keys=True,
    ).encode()
    return ExportParcel(src.name, manifest, files, chunks)


def _matches(directory: Path, files: Mapping[str, tuple[int, str]]) -> bool:
    for name, (size, sha256) in files.items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != size:
            return False
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while data := f.read(1 << 20):
                digest.update(data)
        if digest.hexdigest() != sha256:
            return False
    return True


def receive_export(
    parcel: ExportParcel,
    dest_root: str | os.PathLike[str],
    *,
    get: Any = None,
    timeout_s: float | None = None,
) -> PulledExport:
    """Write ``parcel`` under ``dest_root`` on this node (runs where the engine runs): each file
    is fetched chunk by chunk (``get``, default ``ray.get``), hashed, and checked against the
    manifest before the directory is renamed into place as ``dest_root/<name>``; a mismatch
    raises :class:`ExportPullRefused` and leaves nothing behind. A copy already there that
    matches the manifest is reused (nothing fetched). ``timeout_s`` bounds the whole fetch:
    each chunk is asked with ``get(ref, timeout=<what is left>)``, and a chunk that does not
    arrive in time (``get`` raises ``TimeoutError``, as ``ray.get`` does) raises
    :class:`ExportPullTimeout`, nothing left behind; None: ``get(ref)``, no bound."""
    from rollsafe.hf.layout import MANIFEST_NAME

    if timeout_s is not None and (
        isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0
    ):
        raise InvalidArgument("timeout_s", f"timeout_s must be a number > 0 or None: {timeout_s!r}")
    if get is None:
        import ray

        get = ray.get
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    files = _manifest_files(parcel.manifest, parcel.name)
    if dict(files) != dict(parcel.files) or set(parcel.chunks) != set(files):
        raise ExportPullRefused(parcel.name, MANIFEST_NAME, "the parcel's files differ from it")
    if parcel.name != os.path.basename(parcel.name) or parcel.name.startswith("."):
        raise InvalidArgument("parcel.name", f"not a directory name: {parcel.name!r}")
    root = Path(dest_root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / parcel.name
    if final.is_dir() and _matches(final, files):
        return PulledExport(str(final), 0, True)
    if final.exists():  # an older or damaged copy: never left where a restart could load it
        _remove_aside(final)
    tmp = root / f".{parcel.name}.pull-{secrets.token_hex(6)}"
    tmp.mkdir()
    try:
        moved = 0
        for name, (size, sha256) in files.items():
            digest = hashlib.sha256()
            got = 0
            with open(tmp / name, "wb") as f:
                for ref in parcel.chunks[name]:
                    if deadline is None:
                        data = get(ref)
                    else:
                        left = deadline - time.monotonic()
                        try:
                            if left <= 0:
                                raise TimeoutError("no time left")
                            data = get(ref, timeout=left)
                        except TimeoutError as late:
                            raise ExportPullTimeout(
                                parcel.name, "transfer", float(timeout_s or 0.0), name
                            ) from late
                    digest.update(data)
                    got += len(data)
                    if got > size:
                        break
                    f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if (got, digest.hexdigest()) != (size, sha256):
                raise ExportPullRefused(
                    parcel.name,
                    name,
                    f"received {got} bytes with sha256 {digest.hexdigest()}, the manifest "
                    f"says {size} bytes with sha256 {sha256}",
                )
            moved += got
        with open(tmp / MANIFEST_NAME, "wb") as f:
            f.write(parcel.manifest)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            # another pull on this node put it there first: use that copy if it is this one
            if final.is_dir() and _matches(final, files):
                return PulledExport(str(final), moved, True)
            raise
        _fsync_dir(root)
        return PulledExport(str(final), moved, False)
    finally:
        _rmtree(tmp)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_aside(path: Path) -> None:
    """Rename ``path`` to a hidden name at once, then remove it."""
    old = path.with_name(f".{path.name}.old-{secrets.token_hex(6)}")
    os.rename(path, old)
    _rmtree(old)


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- the fleet's mover
class ExportMover:
    """The fleet's ``moved`` mode for recovery: each verified export is published once per
    version (:func:`publish_export`, reused by every recovery of that version) and pulled by
    the restarting group's actor to its node (``EngineHost.pull_export``, checked against the
    manifest there). ``handle_for(group_id)`` returns the group's handle (a
    :class:`~rollsafe.adapters.ray.RayEngineGroup`); ``keep(version)`` says whether an export
    is still current (False: its parcel is dropped, and Ray frees the chunks once no pull holds
    them); ``dest_root``: the directory on each node the copies go under (None: the node's
    temporary directory), one sub-directory per node and per ``fleet``. ``publish`` is what
    publishes (default :func:`publish_export` with ``chunk_bytes``). Thread-safe."""

    def __init__(
        self,
        handle_for: Any,
        *,
        keep: Any = None,
        dest_root: str | None = None,
        fleet: str = "rollsafe",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        publish: Any = None,
    ) -> None:
        import threading

        self.handle_for = handle_for
        self.keep = keep
        self.dest_root = dest_root
        self.fleet = fleet
        self.chunk_bytes = chunk_bytes
        #: what publishes an export's directory (None: :func:`publish_export` with
        #: ``chunk_bytes`` and the export's version)
        self.publish = publish
        self._lock = threading.Lock()
        self._parcels: dict[int, tuple[str, ExportParcel]] = {}
        self._publishing: dict[int, threading.Lock] = {}
        #: counters: exports published, pulls asked, bytes moved, pulls refused or failed
        self.publishes = 0
        self.pulls = 0
        self.bytes_pulled = 0
        self.failed_pulls = 0
        self.last_error: str | None = None

    def parcel(self, version: int, path: str) -> ExportParcel:
        """The published export of ``version`` at ``path``: published on the first call
        (hashed against its manifest on the way), the same parcel afterwards."""
        import threading

        self.prune()
        with self._lock:
            gate = self._publishing.setdefault(version, threading.Lock())
        with gate:  # one publication per version, even when recoveries ask at once
            with self._lock:
                held = self._parcels.get(version)
            if held is not None and held[0] == str(path):
                return held[1]
            publish = self.publish
            parcel: ExportParcel
            if publish is not None:
                parcel = publish(str(path))
            else:
                parcel = publish_export(str(path), chunk_bytes=self.chunk_bytes, version=version)
            with self._lock:
                self._parcels[version] = (str(path), parcel)
                self.publishes += 1
            return parcel

    def pull(
        self, group_id: str, version: int, path: str, *, timeout_s: float | None = None
    ) -> PulledExport:
        """Move the export of ``version`` (at ``path`` on this node) to ``group_id``'s node:
        its checked copy there (:class:`PulledExport`, with the node's id).
        Raises :class:`ExportPullRefused` (a file did not match the manifest: nothing left
        there), :class:`ExportPullTimeout` (not done within ``timeout_s``; None: the handle's
        own bound) or the Ray error of a pull that failed."""
        with self._lock:
            self.pulls += 1
        try:
            parcel = self.parcel(version, path)
            kwargs: dict[str, Any] = {"fleet": self.fleet}
            if timeout_s is not None:
                kwargs["timeout_s"] = timeout_s
            got = self.handle_for(group_id).pull_export(parcel, self.dest_root, **kwargs)
        except BaseException as exc:
            with self._lock:
                self.failed_pulls += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, ExportPullRefused):  # a damaged parcel: publish it anew
                    self._parcels.pop(version, None)
            raise
        node = got.get("node_id")
        pulled = PulledExport(
            str(got["path"]),
            int(got["nbytes"]),
            bool(got["reused"]),
            None if node is None else str(node),
        )
        with self._lock:
            self.bytes_pulled += pulled.nbytes
        return pulled

    def prune(self) -> list[int]:
        """Drop the parcels of exports that ``keep`` no longer keeps (retired); return them."""
        keep = self.keep
        if keep is None:
            return []
        with self._lock:
            versions = list(self._parcels)
        gone = []
        for version in versions:
            try:
                kept = bool(keep(version))
            except Exception:
                kept = True
            if not kept:
                gone.append(version)
        with self._lock:
            for version in gone:
                self._parcels.pop(version, None)
                self._publishing.pop(version, None)
        return gone

    def published(self) -> list[int]:
        """The versions whose parcel is held now."""
        with self._lock:
            return sorted(self._parcels)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "published": sorted(self._parcels),
                "publishes": self.publishes,
                "pulls": self.pulls,
                "bytes_pulled": self.bytes_pulled,
                "failed_pulls": self.failed_pulls,
                "last_error": self.last_error,
            }

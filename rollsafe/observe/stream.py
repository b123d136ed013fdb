"""A fleet's run streamed to disk as it happens: ``stream.jsonl``, whole for runs of any length.

Owns :class:`RunStream`, the writer a fleet with ``FleetConfig.run_dir`` opens at
:meth:`RolloutFleet.start <rollsafe.fleet.fleet.RolloutFleet.start>`, and its reading back
(:func:`load_stream`, and :func:`load_recorded`: what ``rollsafe verify --trace RUN_DIR``
replays). The machines keep only their last ``history_limit`` transitions in memory and the
coordinators their last syncs and recoveries, so a record written from memory at the end of a
long run is cut; the stream is not: every row is appended the moment it happens.

``stream.jsonl`` holds the rows of :mod:`rollsafe.observe.runfile`'s ``timeline.jsonl``, in the
order they were written, not sorted by time (a sync's row is written when it ends, stamped when
it began):

* ``run`` (first line): as in ``timeline.jsonl``, with ``record: "streamed"`` and the model
  facts of the groups the fleet started with;
* ``group`` / ``export`` / ``registration`` / ``mode``: each machine transition, as the machine
  takes it (:meth:`GuardedMachine.subscribe <rollsafe.statemachines.base.GuardedMachine.
  subscribe>`; each machine's rows are in ``seq`` order, from 1);
* ``group_joined``: a group the fleet added after it started (``subject``, ``ranks``);
* ``sync`` / ``recovery``: each sync's and recovery's row as it ends;
* ``end`` (last line): written by :meth:`RunStream.close` when the fleet closes.

Every line is written whole and flushed; the file is fsync'd (and its directory) at close. A
crash leaves a readable prefix: :func:`load_stream` reads it (a last line cut mid-write is
dropped), and :attr:`RunData.partial <rollsafe.observe.runfile.RunData.partial>` says why the
record ends early; ``rollsafe verify --trace`` replays that prefix and says it is partial.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollsafe.errors import InvalidArgument
from rollsafe.observe.runfile import (
    TIMELINE,
    TRANSITION_KINDS,
    RunData,
    RunFileError,
    _check_row,
    _jsonable,
    load_run,
)

if TYPE_CHECKING:
    from rollsafe.registry import WorkerGroup
    from rollsafe.registry.table import GroupTransition
    from rollsafe.statemachines.base import GuardedMachine, TransitionRecord

__all__ = ["STREAM", "RunStream", "load_recorded", "load_stream"]

log = logging.getLogger(__name__)

#: the streamed record's file name in a run directory
STREAM = "stream.jsonl"


class RunStream:
    """Appends a run's rows to ``directory/stream.jsonl`` as they happen (see the module).

    ``header``: the ``run`` row (``kind``, ``format``, ``groups``, ``model``...), written first
    with ``record: "streamed"`` and an empty ``cut``.
    Thread-safe: machines call :meth:`transition` from the threads that send their events."""

    def __init__(self, directory: str | os.PathLike[str], header: Mapping[str, Any]) -> None:
        out = Path(directory)
        if out.exists() and not out.is_dir():
            raise InvalidArgument("run_dir", f"{out} exists and is not a directory")
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / STREAM
        self._lock = threading.Lock()
        self._file = self.path.open("w", encoding="utf-8")
        #: each machine watched -> its subscriber (weakly: a forgotten export's machine goes)
        self._watched: weakref.WeakKeyDictionary[
            GuardedMachine, Callable[[TransitionRecord], None]
        ] = weakref.WeakKeyDictionary()
        self._groups: dict[str, list[int]] = {}
        self.rows_written = 0
        #: why writing stopped early (None: it did not)
        self.failed: str | None = None
        model = header.get("model")
        for g in (model.get("groups") or []) if isinstance(model, Mapping) else []:
            self._groups[str(g["id"])] = [int(r) for r in g["ranks"]]
        self.write({**header, "record": "streamed", "cut": []})

    # ------------------------------------------------------------------ writing
    @property
    def closed(self) -> bool:
        return self._file.closed

    def write(self, row: Mapping[str, Any]) -> None:
        """Append ``row`` (a JSON object with ``kind`` and ``timestamp``) and flush it. After
        :meth:`close` it is dropped. A write that fails (a full disk) stops the stream for good,
        logged once: the file stays a clean prefix of the run, read back as partial, rather
        than a record with rows missing in its middle."""
        line = json.dumps(_jsonable(row)) + "\n"
        with self._lock:
            if self._file.closed or self.failed is not None:
                return
            try:
                self._file.write(line)
                self._file.flush()
            except OSError as exc:
                self.failed = f"{type(exc).__name__}: {exc}"
                log.error(
                    "run stream %s: writing failed (%s): the record ends here", self.path, exc
                )
                return
            self.rows_written += 1

    def transition(self, kind: str, subject: str, record: TransitionRecord) -> None:
        """One machine transition as a ``group`` / ``export`` / ``registration`` / ``mode`` row."""
        if kind not in TRANSITION_KINDS:
            raise InvalidArgument("kind", f"{kind!r} is not one of {TRANSITION_KINDS}")
        self.write({**record.as_dict(), "kind": kind, "subject": subject})

    def watch(self, kind: str, subject: str, machine: GuardedMachine) -> None:
        """Stream every transition of ``machine`` from now on, and those it still holds (its
        first: a machine watched before its ring buffer turned over). Watching a machine twice
        does nothing."""

        def subscriber(record: TransitionRecord) -> None:
            self.transition(kind, subject, record)

        with self._lock:
            if machine in self._watched or self._file.closed:
                return
            self._watched[machine] = subscriber
        first = machine.subscribe(subscriber)
        if first > 1:  # it had taken more than its history keeps before it was watched
            log.warning(
                "run stream %s: %s %s was watched after %d transitions had left its history: "
                "the record of it starts at transition %d",
                self.path,
                kind,
                subject,
                first - 1,
                first,
            )

    def watch_group(self, group: WorkerGroup) -> None:
        """Stream group ``group``'s transitions; a group the run row did not list (added at
        runtime) gets a ``group_joined`` row first."""
        gid = group.group_id
        with self._lock:
            joined = gid not in self._groups
            if joined:
                self._groups[gid] = [int(r) for r in group.ranks]
        if joined:
            first = group.machine.history[:1]
            at = first[0].timestamp if first else _now()
            self.write(
                {"kind": "group_joined", "subject": gid, "timestamp": at, "ranks": group.ranks}
            )
        self.watch("group", gid, group.machine)

    def on_transition(self, group: WorkerGroup, record: GroupTransition) -> None:
        """The registry's listener hook: a group's first transition seen starts its stream."""
        self.watch_group(group)

    @property
    def groups(self) -> list[dict[str, Any]]:
        """Every group the run had (started with or joined), with its fleet ranks."""
        with self._lock:
            return [{"id": g, "ranks": list(r)} for g, r in self._groups.items()]

    def close(self, end: Mapping[str, Any] | None = None) -> None:
        """Write ``end`` (the ``end`` row), flush, fsync the file and its directory, close.
        Idempotent; every machine stops streaming to it."""
        with self._lock:
            if self._file.closed:
                return
            try:
                if end is not None and self.failed is None:
                    self._file.write(json.dumps(_jsonable(end)) + "\n")
                    self.rows_written += 1
                self._file.flush()
                os.fsync(self._file.fileno())
            except OSError as exc:
                self.failed = self.failed or f"{type(exc).__name__}: {exc}"
                log.error("run stream %s: closing failed (%s)", self.path, exc)
            finally:
                with contextlib.suppress(OSError):
                    self._file.close()
            watched = list(self._watched.items())
            self._watched.clear()
        for machine, subscriber in watched:
            machine.unsubscribe(subscriber)  # a closed stream takes nothing more
        with contextlib.suppress(OSError):
            fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def rows(self) -> list[dict[str, Any]]:
        """Every row written so far, read back (the run's record, in time order: see
        :func:`load_stream`)."""
        with self._lock:
            if not self._file.closed and self.failed is None:
                with contextlib.suppress(OSError):
                    self._file.flush()
        return load_stream(self.path).rows


def _now() -> float:
    return time.time()


# ---------------------------------------------------------------------------- reading
def load_stream(path: str | os.PathLike[str]) -> RunData:
    """Read a streamed record (a run directory, or its ``stream.jsonl``): its rows in time order
    (``timestamp``; rows of one instant in the order written), the ``run`` row first and the
    ``end`` row last, ``group_joined`` rows folded into the run row's model groups. A record
    with no ``end`` row (the fleet did not close it) or a last line cut mid-write is read up to
    there, and :attr:`RunData.partial` says so. :class:`RunFileError` names a missing file, a
    bad line or a first line that is not the ``run`` row."""
    p = Path(path)
    directory, stream = (p, p / STREAM) if p.is_dir() else (p.parent, p)
    if not stream.is_file():
        raise RunFileError(stream, "not found (a streamed run needs stream.jsonl)")
    try:
        raw = stream.read_bytes()
    except OSError as exc:
        raise RunFileError(stream, f"cannot be read: {exc}") from None
    lines = raw.split(b"\n")
    partial: str | None = None
    if lines and lines[-1] == b"":
        lines.pop()
    elif lines:
        lines.pop()  # the last line has no newline: the writer stopped mid-line
        partial = f"its last line ({len(lines) + 1}) was cut mid-write"
    if not lines:
        raise RunFileError(stream, "is empty")
    header: dict[str, Any] | None = None
    end: dict[str, Any] | None = None
    body: list[dict[str, Any]] = []
    joined: list[dict[str, Any]] = []
    for n, line in enumerate(lines, 1):
        try:
            row = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise RunFileError(stream, f"not valid JSON ({exc})", n) from None
        problem = _check_row(row)
        if problem is not None:
            raise RunFileError(stream, problem, n)
        kind = row["kind"]
        if n == 1:
            if kind != "run":
                raise RunFileError(stream, "the first line must be the 'run' row", n)
            header = row
        elif kind == "run":
            raise RunFileError(stream, "a second 'run' row", n)
        elif end is not None:
            raise RunFileError(stream, "a row after the run's 'end' row", n)
        elif kind == "end":
            end = row
        elif kind == "group_joined":
            joined.append(row)
        else:
            body.append(row)
    assert header is not None
    if end is None and partial is None:
        partial = (
            f"it has no 'end' row ({len(lines)} lines): the fleet did not close it (it "
            "crashed, or still runs)"
        )
    model = header.get("model")
    if isinstance(model, dict) and joined:
        known = {str(g.get("id")) for g in model.get("groups") or []}
        extra = [
            {"id": str(j["subject"]), "ranks": list(j.get("ranks") or [])}
            for j in joined
            if str(j["subject"]) not in known
        ]
        model["groups"] = [*(model.get("groups") or []), *extra]
    body.sort(key=lambda r: float(r["timestamp"]))  # stable: one instant keeps its order
    start = float(header["timestamp"])
    rows = [header, *body, *([end] if end is not None else [])]
    for r in rows:
        r["t"] = float(r["timestamp"]) - start
    return RunData(
        directory, rows, header=header, end=end, t0=start, files=[STREAM], partial=partial
    )


def load_recorded(path: str | os.PathLike[str]) -> RunData:
    """The record ``rollsafe verify --trace`` replays: a run directory's ``stream.jsonl`` when
    it has one (the whole run), else its ``timeline.jsonl`` (:func:`load_run`); a path to one
    of the two files reads that file."""
    p = Path(path)
    if p.is_dir() and (p / STREAM).is_file():
        return load_stream(p)
    if p.name == STREAM:
        return load_stream(p)
    if p.is_dir() and not (p / TIMELINE).exists():
        raise RunFileError(p / TIMELINE, f"not found (a recorded run needs {STREAM} or {TIMELINE})")
    return load_run(p)

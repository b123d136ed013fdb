"""The recorded-run format: ``timeline.jsonl`` (plus ``fleet.json``), written and read back.

Owns the files :meth:`RolloutFleet.record(path) <rollsafe.fleet.fleet.RolloutFleet.record>` and
``rollsafe demo`` write, and their validation when ``rollsafe report`` reads them. A fleet with
``FleetConfig.run_dir`` also streams its run as it happens (``stream.jsonl``,
:mod:`rollsafe.observe.stream`), and ``record`` then takes the transitions, syncs and
recoveries from there: whole, however long the run.

``timeline.jsonl`` holds one JSON object per line, each with ``kind``, ``timestamp`` (wall
clock, seconds) and ``t`` (seconds since the run's start), in time order:

* ``run`` (first line): ``format`` (:data:`FORMAT`), ``groups`` (ids in lane order),
  ``transport``, ``started_at``, and ``model``: what ``rollsafe verify --trace`` builds the
  verifier's model from (each group's id and fleet ranks, ``initial_version``,
  ``restart_budget``, ``rearm_after``, ``immediate_recovery``, ``failure_threshold``,
  ``on_update_failure``, ``targeted_push``, the engine kind and whether a failed update keeps
  its weights, ``deltas``, the exporter's ``keep_last``), ``record`` (``"streamed"``: the
  transitions, syncs and recoveries come whole from the fleet's streamed run,
  :mod:`rollsafe.observe.stream`; ``"memory"``: from what the fleet keeps in memory, its last
  ones) and ``cut`` (what a ``memory`` record lost: machines whose history no longer starts at
  their first transition, syncs and recoveries that left memory; empty: the record is whole);
* ``group`` / ``export`` / ``registration`` / ``mode``: one machine transition each, as in
  :meth:`RolloutFleet.timeline` (``subject``, ``machine``, ``seq``, ``event``, ``source``,
  ``target``, ``inputs``; a group event sent by an operation has the policy function that
  decided it in ``inputs.decided_by``);
* ``mark``: a point the caller knew (``event``, e.g. ``crash``; ``subject`` the group);
* ``sync``: one weight sync (``version``, ``ok``, ``seconds``, ``phases``, ``updated``...);
* ``recovery``: one recovery of a group (the ``RecoveryResult`` fields, plus the failure
  episode's ``onset``, ``onset_source`` and ``detected_at`` when known);
* ``export_stats``: one finished export's phase timings (``blocking_s``, ``total_s``...);
* ``requests``: cumulative ``served`` / ``failed`` counts per group at that time;
* ``end`` (last line): final ``groups`` states, ``fleet_version``, ``dispatch_counts`` (requests
  admitted per group, keyed by the group's state at admission), router stats.

Files written before the ``run`` / ``end`` lines existed (transition rows only) still load; a file
that starts with a ``run`` line and has no ``end`` line is truncated. :func:`load_run` raises
:class:`RunFileError` naming the file and the first bad line.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollsafe.errors import RollsafeError

if TYPE_CHECKING:
    from rollsafe.observe.view import FleetView, RecoveryRecord, SyncRecord

__all__ = [
    "FORMAT",
    "TRANSITION_KINDS",
    "RunData",
    "RunFileError",
    "build_rows",
    "end_row",
    "load_run",
    "recovery_row",
    "run_header",
    "sync_row",
    "write_run",
]

FORMAT = "rollsafe-timeline/1"
TIMELINE = "timeline.jsonl"
TRANSITION_KINDS = ("group", "export", "registration", "mode")
_KNOWN_KINDS = (
    *TRANSITION_KINDS,
    "run",
    "mark",
    "sync",
    "recovery",
    "export_stats",
    "requests",
    "end",
)


class RunFileError(RollsafeError, ValueError):
    """A recorded-run file is missing, truncated or malformed; ``path`` and ``line`` name where."""

    def __init__(self, path: Path | str, message: str, line: int | None = None) -> None:
        self.path = Path(path)
        self.line = line
        self.problem = message
        where = f"{self.path}" + (f" line {line}" if line is not None else "")
        super().__init__(f"{where}: {message}")


@dataclass
class RunData:
    """A recorded run read back: every row, and the optional JSON files next to it."""

    directory: Path
    rows: list[dict[str, Any]]
    summary: dict[str, Any] | None = None  # summary.json (the demo's)
    fleet: dict[str, Any] | None = None  # fleet.json (RolloutFleet.record)
    header: dict[str, Any] | None = None
    end: dict[str, Any] | None = None
    t0: float = 0.0
    files: list[str] = field(default_factory=list)
    #: why the record ends before the run did (a streamed run the fleet never closed: it
    #: crashed; :func:`rollsafe.observe.stream.load_stream`); None: it holds the whole run
    partial: str | None = None

    def of(self, *kinds: str) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["kind"] in kinds]

    @property
    def groups(self) -> list[str]:
        """Group ids in lane order: the header's, else in order of first appearance."""
        if self.header is not None and isinstance(self.header.get("groups"), list):
            return [str(g) for g in self.header["groups"]]
        seen: list[str] = []
        for r in self.rows:
            if r["kind"] == "group" and r["subject"] not in seen:
                seen.append(r["subject"])
        return seen

    @property
    def duration(self) -> float:
        return max((float(r["t"]) for r in self.rows), default=0.0)


# ---------------------------------------------------------------------------- writing
def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    return str(value)


def build_rows(
    fleet: FleetView, *, t0: float | None = None, marks: Iterable[Mapping[str, Any]] = ()
) -> list[dict[str, Any]]:
    """Every row of ``fleet``'s run so far (see the module doc), ``t`` counted from ``t0``
    (default: when the fleet started). ``marks``: extra ``{"kind": "crash", "group": gid,
    "timestamp": ...}`` points, added to the fleet observer's own.

    A fleet that streams its run (``FleetConfig.run_dir``: ``fleet.stream``) gives its
    transitions, syncs and recoveries from the stream, whole (``record: "streamed"`` in the
    ``run`` row); otherwise they come from memory, which keeps only the last ones of each
    (``record: "memory"``), and the ``run`` row's ``cut`` lists what left it (empty: the record
    is whole): ``rollsafe verify --trace`` refuses a cut record by name."""
    observer = fleet.observer
    if observer.started_at is not None and observer.stopped_at is None:
        observer.sample_now()  # the request counts as of now, not of the last sampling tick
    start = t0 if t0 is not None else (fleet.started_at or observer.started_at or time.time())
    stream = fleet.stream
    cut: list[str] = []
    groups: list[dict[str, Any]] | None = None
    if stream is not None:
        streamed = [
            r for r in stream.rows() if r["kind"] in (*TRANSITION_KINDS, "sync", "recovery")
        ]
        rows: list[dict[str, Any]] = [{k: v for k, v in r.items() if k != "t"} for r in streamed]
        groups = stream.groups
        if stream.failed is not None:
            cut.append(f"the stream stopped early: writing failed ({stream.failed})")
    else:
        rows = [dict(r) for r in fleet.timeline()]
        cut += _cut_histories(rows)
        transport_name = _transport_name(fleet)
        if fleet.sync is not None:
            rows += [sync_row(rep, transport_name) for rep in fleet.sync.reports()]
            dropped = int(getattr(fleet.sync, "reports_dropped", 0))
            if dropped:
                cut.append(f"syncs: the first {dropped} left memory (it keeps the last ones)")
        episodes = observer.episodes()
        rows += [recovery_row(res, episodes) for res in fleet.recoveries()]
        dropped = fleet.recoveries_dropped
        if dropped:
            cut.append(f"recoveries: the first {dropped} left memory (it keeps the last ones)")
    all_marks = [*observer.marks(), *(dict(m) for m in marks)]
    seen_marks: set[tuple[Any, ...]] = set()
    for m in all_marks:
        key = (m.get("kind"), m.get("group"), round(float(m["timestamp"]), 6))
        if key in seen_marks:
            continue
        seen_marks.add(key)
        info = {k: v for k, v in m.items() if k not in ("kind", "group", "timestamp", "at")}
        rows.append(
            {
                "kind": "mark",
                "event": str(m.get("kind", "mark")),
                "subject": m.get("group"),
                "timestamp": float(m["timestamp"]),
                **info,
            }
        )
    if fleet.exporter is not None:
        for version in sorted(fleet.export_states()):
            try:
                handle = fleet.exporter.handle(version)
            except Exception:
                continue
            if not handle.done():
                continue
            stats = handle.stats
            rows.append(
                {
                    "kind": "export_stats",
                    "subject": f"v{version}",
                    "timestamp": handle.lifecycle.history[-1].timestamp
                    if handle.lifecycle.history
                    else start,
                    "state": handle.lifecycle.state,
                    **{
                        k: getattr(stats, k)
                        for k in (
                            "tensor_bytes",
                            "blocking_s",
                            "snapshot_s",
                            "write_s",
                            "commit_s",
                            "verify_s",
                            "publish_s",
                            "total_s",
                        )
                    },
                }
            )
    for s in observer.samples():
        rows.append(
            {
                "kind": "requests",
                "subject": "fleet",
                "timestamp": s.timestamp,
                "served": dict(s.served),
                "failed": dict(s.failed),
            }
        )
    rows.sort(key=lambda r: float(r["timestamp"]))
    end_at = observer.stopped_at or time.time()
    if rows:
        end_at = max(end_at, float(rows[-1]["timestamp"]))
    header = run_header(fleet, start, groups=groups)
    header["record"] = "streamed" if stream is not None else "memory"
    header["cut"] = cut
    out = [header, *rows, end_row(fleet, max(end_at, start))]
    for row in out:
        row["t"] = float(row["timestamp"]) - start
    return [_jsonable(r) for r in out]


def _cut_histories(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The machines whose in-memory history no longer starts at their first transition."""
    first: dict[tuple[str, str], int] = {}
    for r in rows:
        key = (str(r["kind"]), str(r["subject"]))
        first[key] = min(first.get(key, int(r["seq"])), int(r["seq"]))
    return [
        f"{kind} {subject}: its history starts at transition {seq} (memory keeps the last ones)"
        for (kind, subject), seq in sorted(first.items())
        if seq > 1
    ]


def _transport_name(fleet: FleetView) -> str:
    return str(fleet.transport.name if fleet.transport is not None else fleet.config.transport)


def run_header(
    fleet: FleetView, start: float, *, groups: Sequence[Mapping[str, Any]] | None = None
) -> dict[str, Any]:
    """The ``run`` row of ``fleet``'s record (see the module), its run started at ``start``
    (wall clock); ``groups``: the model's groups (``{"id", "ranks"}``, default: the
    registry's now)."""
    return {
        "kind": "run",
        "format": FORMAT,
        "subject": "fleet",
        "timestamp": start,
        "started_at": fleet.started_at,
        "groups": fleet.group_ids,
        "transport": _transport_name(fleet),
        "immediate_recovery": fleet.config.enable_immediate_recovery,
        "model": _model_facts(fleet, groups),
    }


def end_row(fleet: FleetView, end_at: float) -> dict[str, Any]:
    """The ``end`` row of ``fleet``'s record: its state at ``end_at`` (now)."""
    return {
        "kind": "end",
        "subject": "fleet",
        "timestamp": end_at,
        "groups": {g.group_id: g.state for g in fleet.registry.groups()},
        "fleet_version": fleet.registry.fleet_version,
        "dispatch_counts": fleet.registry.dispatch_counts(),
        "router": fleet.router.stats(),
        "mode": fleet.mode.state,
        "exports": {str(v): s for v, s in fleet.export_states().items()},
    }


def sync_row(rep: SyncRecord, transport: str) -> dict[str, Any]:
    """The ``sync`` row of one sync's report."""
    d = rep.as_dict()
    timings = d.pop("timings")
    return {
        "kind": "sync",
        "subject": transport,
        "timestamp": rep.started_at,
        "seconds": timings.get("total_s"),
        "phases": {k.removesuffix("_s"): v for k, v in timings.items()},
        **{
            k: d[k]
            for k in (
                "version",
                "ok",
                "error",
                "updated",
                "failed",
                "targeted",
                "failed_groups",
                "export_started",
                "previous_export",
            )
        },
        **({"delta": _delta_brief(d["delta"])} if d.get("delta") else {}),
    }


def recovery_row(res: RecoveryRecord, episodes: Sequence[Any]) -> dict[str, Any]:
    """The ``recovery`` row of one recovery's result, with its failure episode's ``onset``,
    ``onset_source`` and ``detected_at`` when one of ``episodes`` is its."""
    d = res.as_dict()
    ep = _episode_for(episodes, res.group_id, res.failed_at)
    if ep is not None:
        d.update(onset=ep.onset, onset_source=ep.onset_source, detected_at=ep.detected_at)
    return {"kind": "recovery", "subject": res.group_id, "timestamp": res.failed_at, **d}


def _model_facts(
    fleet: FleetView, groups: Sequence[Mapping[str, Any]] | None = None
) -> dict[str, Any]:
    """The ``run`` row's ``model``: the groups (ids and fleet ranks, in the registry's order,
    or ``groups``) and every setting the verifier's model reads (``rollsafe verify --trace``)."""
    cfg = fleet.config
    traits = cfg.engine_traits
    transport = fleet.transport
    if groups is None:
        groups = [{"id": g.group_id, "ranks": list(g.ranks)} for g in fleet.registry.groups()]
    return {
        "groups": [{"id": str(g["id"]), "ranks": list(g["ranks"])} for g in groups],
        "initial_version": cfg.initial_version,
        "restart_budget": cfg.recovery.restart_budget,
        "rearm_after": cfg.rearm_after,
        "immediate_recovery": cfg.enable_immediate_recovery,
        "failure_threshold": cfg.health.failure_threshold,
        "on_update_failure": cfg.on_update_failure,
        "targeted_push": bool(cfg.recovery.targeted_push),
        "engine": traits.kind,
        "failed_update_keeps_weights": traits.failed_update_keeps_weights,
        "deltas": transport is not None and transport.deltas is not None,
        "keep_last": getattr(fleet.exporter, "keep_last", None),
        "spare_groups": cfg.spare_groups,
    }


def _episode_for(episodes: Sequence[Any], group_id: str, failed_at: float) -> Any:
    best, gap = None, math.inf
    for ep in episodes:
        if ep.group_id != group_id:
            continue
        d = abs(ep.detected_at - failed_at)
        if d < gap:
            best, gap = ep, d
    return best if gap <= 30.0 else None


def write_run(
    directory: str | os.PathLike[str],
    rows: Sequence[Mapping[str, Any]],
    *,
    fleet_json: Mapping[str, Any] | None = None,
) -> list[Path]:
    """Write ``timeline.jsonl`` (and ``fleet.json``) atomically into ``directory``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = [_atomic(out / TIMELINE, "".join(json.dumps(r) + "\n" for r in rows))]
    if fleet_json is not None:
        written.append(
            _atomic(out / "fleet.json", json.dumps(_jsonable(fleet_json), indent=2) + "\n")
        )
    return written


def _atomic(path: Path, text: str) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------- reading
def _number(row: Mapping[str, Any], key: str) -> bool:
    v = row.get(key)
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_row(row: Any) -> str | None:
    """What is wrong with one parsed row (None if nothing)."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    kind = row.get("kind")
    if not isinstance(kind, str):
        return "no 'kind' string"
    if not _number(row, "timestamp"):
        return f"{kind} row: 'timestamp' must be a finite number, got {row.get('timestamp')!r}"
    if "t" in row and not _number(row, "t"):
        return f"{kind} row: 't' must be a finite number, got {row.get('t')!r}"
    if kind in TRANSITION_KINDS:
        for key in ("subject", "event", "source", "target"):
            if not isinstance(row.get(key), str) or not row[key]:
                return f"{kind} transition row: {key!r} must be a non-empty string"
    elif kind == "requests":
        for key in ("served", "failed"):
            counts = row.get(key)
            if not isinstance(counts, dict) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in counts.values()
            ):
                return f"requests row: {key!r} must map group ids to counts >= 0"
    elif kind == "recovery":
        if not isinstance(row.get("group_id"), str) or not isinstance(row.get("status"), str):
            return "recovery row: needs 'group_id' and 'status' strings"
        for key in ("failed_at", "finished_at"):
            if not _number(row, key):
                return f"recovery row: {key!r} must be a finite number"
    elif kind == "sync":
        if not isinstance(row.get("version"), int) or not isinstance(row.get("ok"), bool):
            return "sync row: needs an int 'version' and a bool 'ok'"
    elif kind == "run":
        if row.get("format") != FORMAT:
            return f"run row: unknown format {row.get('format')!r} (this rollsafe reads {FORMAT})"
        if not isinstance(row.get("groups"), list):
            return "run row: 'groups' must be a list"
    elif kind == "end" and not isinstance(row.get("groups"), dict):
        return "end row: 'groups' must map group ids to states"
    return None


def load_run(path: str | os.PathLike[str]) -> RunData:
    """Read and validate a recorded run (a directory, or its ``timeline.jsonl`` itself)."""
    p = Path(path)
    if p.is_dir():
        directory, timeline = p, p / TIMELINE
    else:
        directory, timeline = p.parent, p
    if not timeline.is_file():
        raise RunFileError(timeline, "not found (a recorded run needs timeline.jsonl)")
    try:
        raw = timeline.read_bytes()
    except OSError as exc:
        raise RunFileError(timeline, f"cannot be read: {exc}") from None
    if not raw.strip():
        raise RunFileError(timeline, "is empty")
    rows: list[dict[str, Any]] = []
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    elif lines:
        # the last line has no newline: a writer stopped mid-line (the file is cut short)
        last = len(lines)
        try:
            json.loads(lines[-1])
        except ValueError as exc:
            raise RunFileError(
                timeline, f"truncated: the last line is incomplete JSON ({exc})", last
            ) from None
    header: dict[str, Any] | None = None
    end: dict[str, Any] | None = None
    prev_ts = -math.inf
    for n, line in enumerate(lines, 1):
        if not line.strip():
            raise RunFileError(timeline, "blank line", n)
        try:
            row = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise RunFileError(timeline, f"not UTF-8 ({exc})", n) from None
        except ValueError as exc:
            raise RunFileError(timeline, f"not valid JSON ({exc})", n) from None
        problem = _check_row(row)
        if problem is not None:
            raise RunFileError(timeline, problem, n)
        if end is not None:
            raise RunFileError(timeline, "a row after the run's 'end' row", n)
        if row["kind"] == "run":
            if n != 1:
                raise RunFileError(timeline, "the 'run' row must be the first line", n)
            header = row
        elif row["kind"] == "end":
            end = row
        if row["kind"] not in ("run", "end"):  # rows are written in time order
            if float(row["timestamp"]) < prev_ts - 1e-6:
                raise RunFileError(
                    timeline, f"timestamps go backwards ({row['timestamp']} < {prev_ts})", n
                )
            prev_ts = float(row["timestamp"])
        rows.append(row)
    if header is not None and end is None:
        raise RunFileError(
            timeline,
            f"truncated: {len(lines)} lines and no 'end' row (the run's last line is missing)",
            len(lines),
        )
    t0 = (
        float(header["timestamp"])
        if header is not None
        else (min(float(r["timestamp"]) - float(r.get("t", 0.0)) for r in rows))
    )
    for r in rows:
        if "t" not in r:
            r["t"] = float(r["timestamp"]) - t0
    data = RunData(directory, rows, header=header, end=end, t0=t0, files=[TIMELINE])
    for name in ("summary.json", "fleet.json"):
        f = directory / name
        if not f.exists():
            continue
        try:
            obj = json.loads(f.read_text(encoding="utf-8"))
        except ValueError as exc:
            lineno = getattr(exc, "lineno", None)
            raise RunFileError(f, f"not valid JSON ({exc})", lineno) from None
        except OSError as exc:
            raise RunFileError(f, f"cannot be read: {exc}") from None
        if not isinstance(obj, dict):
            raise RunFileError(f, f"expected a JSON object, got {type(obj).__name__}", 1)
        setattr(data, "summary" if name == "summary.json" else "fleet", obj)
        data.files.append(name)
    return data


def _delta_brief(delta: Mapping[str, Any]) -> dict[str, Any]:
    """A sync row's deltas: bytes by kind, targets that got a delta, fallbacks, refusals."""
    rows = list(delta.get("targets", {}).values())
    return {
        "delta_targets": sum(1 for r in rows if r["kind"] == "delta"),
        "bytes_delta": sum(int(r["nbytes"]) for r in rows if r["kind"] == "delta"),
        "bytes_full": sum(int(r["nbytes"]) for r in rows if r["kind"] == "full"),
        "fallbacks": sum(
            1
            for r in rows
            if r["kind"] == "full" and (r.get("refused") or "not smaller" in str(r.get("reason")))
        ),
        "refusals": sum(1 for r in rows if r.get("refused")),
        "changed_fraction": delta.get("changed_fraction"),
    }

"""A small, plausible recorded run built by hand (rows as ``RolloutFleet.record`` writes them).

Two groups; ``g1`` crashes at t=2.8, is detected at 3.0 and is active again at 3.6 (immediate
recovery); one sync (v1) at 2.0 whose export is ready at 2.5; request samples every 0.5 s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

T0 = 1_700_000_000.0

GROUP = "WorkerGroupLifecycle"
EXPORT = "ExportLifecycle"
REG = "CheckpointRegistration"


def _tr(
    kind: str, subject: str, machine: str, t: float, event: str, src: str, dst: str, seq: int
) -> dict[str, Any]:
    return {
        "kind": kind,
        "subject": subject,
        "machine": machine,
        "seq": seq,
        "event": event,
        "source": src,
        "target": dst,
        "timestamp": T0 + t,
        "t": t,
        "inputs": {},
    }


def run_rows() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [
        {
            "kind": "run",
            "format": "rollsafe-timeline/1",
            "subject": "fleet",
            "timestamp": T0,
            "t": 0.0,
            "groups": ["g0", "g1"],
            "transport": "ipc",
            "immediate_recovery": True,
        },
        _tr("group", "g0", GROUP, 1.0, "launched", "launching", "active", 1),
        _tr("group", "g1", GROUP, 1.1, "launched", "launching", "active", 1),
        _tr("registration", "ipc", REG, 2.0, "begin_register", "empty", "registering", 1),
        {
            "kind": "sync",
            "subject": "ipc",
            "timestamp": T0 + 2.0,
            "t": 2.0,
            "seconds": 0.2,
            "version": 1,
            "ok": True,
            "phases": {"register": 0.05, "update": 0.1, "total": 0.2},
            "updated": ["g0", "g1"],
            "failed": [],
            "targeted": ["g0", "g1"],
        },
        _tr("registration", "ipc", REG, 2.05, "register_ok", "registering", "registered", 2),
        _tr("registration", "ipc", REG, 2.06, "begin_update", "registered", "updating", 3),
        _tr("registration", "ipc", REG, 2.15, "update_done", "updating", "registered", 4),
        _tr("export", "v1", EXPORT, 2.2, "snapshot", "requested", "snapshotting", 1),
        _tr("export", "v1", EXPORT, 2.25, "snapshot_done", "snapshotting", "writing", 2),
        _tr("export", "v1", EXPORT, 2.4, "shards_written", "writing", "committing", 3),
        _tr("export", "v1", EXPORT, 2.5, "publish", "committing", "ready", 4),
        {
            "kind": "mark",
            "event": "crash",
            "subject": "g1",
            "timestamp": T0 + 2.8,
            "t": 2.8,
            "rank": 0,
            "pid": 4242,
        },
        _tr("group", "g1", GROUP, 3.0, "fail", "active", "inactive", 2),
        {
            "kind": "recovery",
            "subject": "g1",
            "timestamp": T0 + 3.0,
            "t": 3.0,
            "group_id": "g1",
            "status": "active",
            "strategy": "immediate",
            "reason": "ok",
            "failed_at": T0 + 3.0,
            "submitted_at": T0 + 3.0,
            "started_at": T0 + 3.05,
            "finished_at": T0 + 3.6,
            "active_at": T0 + 3.6,
            "latency_s": 0.6,
            "attempts": 1,
            "export_version": 1,
            "fleet_version": 1,
            "onset": T0 + 2.8,
            "onset_source": "crash_mark",
            "detected_at": T0 + 3.0,
            "steps": [
                {
                    "name": "claim",
                    "attempt": 1,
                    "started_at": T0 + 3.05,
                    "seconds": 0.001,
                    "ok": True,
                    "detail": "",
                },
                {
                    "name": "restart",
                    "attempt": 1,
                    "started_at": T0 + 3.1,
                    "seconds": 0.45,
                    "ok": True,
                    "detail": "",
                },
            ],
        },
        _tr("group", "g1", GROUP, 3.05, "claim", "inactive", "recovering", 3),
        _tr("group", "g1", GROUP, 3.6, "restarted", "recovering", "active", 4),
    ]
    served = 0
    for i in range(11):
        t = 0.5 * i
        served += 0 if 2.8 <= t <= 3.6 else 3
        rows.append(
            {
                "kind": "requests",
                "subject": "fleet",
                "timestamp": T0 + t,
                "t": t,
                "served": {"g0": 2 * i, "g1": served},
                "failed": {"g0": 0, "g1": 1},
            }
        )
    rows.sort(key=lambda r: r["timestamp"])
    rows.append(
        {
            "kind": "end",
            "subject": "fleet",
            "timestamp": T0 + 5.0,
            "t": 5.0,
            "groups": {"g0": "active", "g1": "active"},
            "fleet_version": 1,
            "dispatch_counts": {"g0": {"active": 20}, "g1": {"active": 25}},
        }
    )
    return rows


def write_run_dir(path: Path, rows: list[dict[str, Any]] | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in (rows if rows is not None else run_rows())]
    (path / "timeline.jsonl").write_text("\n".join(lines) + "\n")
    return path

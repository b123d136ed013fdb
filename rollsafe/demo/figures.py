"""The run's figures, computed after it ended: :func:`analyse` -> :class:`Figures`.

Owns the analytics of the report: the recovery latency (crash -> out of routing -> ``active``
with current weights, and where the restarted engine came from), the throughput lost by the
crashed group in the crash step against its other steps, the continued requests (tokens kept
vs regenerated, the crash step's share), each group's warm standby, and the trainer's own
account (pid, round trips).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollsafe.demo.state import DemoRun

__all__ = ["Figures", "analyse"]


@dataclass
class Figures:
    """What ``summary.json`` and the printed report show besides the run's records."""

    trainer_info: dict[str, Any]
    recovery: dict[str, Any]
    throughput: dict[str, Any]
    continuation: dict[str, Any]
    standbys: dict[str, Any]


def analyse(run: DemoRun) -> Figures:
    """The figures of a finished run (the trainer is asked for its account after it closed)."""
    trainer_info = run.trainer.describe()
    recovery = _recovery(run)
    throughput = _throughput(run, recovery)
    return Figures(
        trainer_info=trainer_info,
        recovery=recovery,
        throughput=throughput,
        continuation=_continuation(run, throughput),
        standbys={gid: g.get("standby") for gid, g in run.snapshot["registry"]["groups"].items()},
    )


def _recovery(run: DemoRun) -> dict[str, Any]:
    """Recovery latency: when the crashed group left routing and came back ``active``."""
    crash, timeline = run.crash, run.timeline
    recovery: dict[str, Any] = {"crashed": crash is not None}
    if crash is None:
        return recovery
    back = [
        r
        for r in timeline
        if r["kind"] == "group"
        and r["subject"] == crash["group"]
        and r["target"] == "active"
        and r["timestamp"] > crash["at"]
    ]
    out_of_routing = [
        r
        for r in timeline
        if r["kind"] == "group"
        and r["subject"] == crash["group"]
        and r["event"] in ("fail", "node_lost")  # a probe's verdict, or its node died
        and r["timestamp"] > crash["at"]
    ]
    recovery.update(crash)
    recovery["active_again_at"] = back[0]["timestamp"] if back else None
    recovery["latency_s"] = back[0]["timestamp"] - crash["at"] if back else None
    recovery["detected_after_s"] = (
        out_of_routing[0]["timestamp"] - crash["at"] if out_of_routing else None
    )
    mine = [r for r in run.recoveries if r["group_id"] == crash["group"]]
    recovery["strategy"] = mine[0]["strategy"] if mine else None
    recovery["status"] = mine[0]["status"] if mine else None
    recovery["restart_source"] = mine[0].get("restart_source") if mine else None
    recovery["standby_at_restart"] = mine[0].get("standby_at_restart") if mine else None
    recovery["coordinator"] = mine
    return recovery


def _throughput(run: DemoRun, recovery: dict[str, Any]) -> dict[str, Any]:
    """Requests per step, and what the crashed group lost in the crash step."""
    crash, steps = run.crash, run.steps
    base = [s for s in steps if s["step"] != (crash or {}).get("step")]
    per_group_rate = {
        g: (sum(s["served_by_group"].get(g, 0) for s in base) / len(base)) if base else None
        for g in ([crash["group"]] if crash else [])
    }
    throughput: dict[str, Any] = {
        "per_step": [
            {
                "step": s["step"],
                "served": s["served"],
                "failed": s["failed"],
                "by_group": s["served_by_group"],
            }
            for s in steps
        ],
        "served_total": sum(s["served"] for s in steps),
        "failed_total": sum(s["failed"] for s in steps),
    }
    if crash is not None:
        crash_step = next(s for s in steps if s["step"] == crash["step"])
        g = crash["group"]
        typical = per_group_rate.get(g)
        throughput["crashed_group_served_in_crash_step"] = crash_step["served_by_group"].get(g, 0)
        throughput["crashed_group_served_per_other_step"] = typical
        if typical:
            lost = max(0.0, typical - crash_step["served_by_group"].get(g, 0))
            throughput["requests_lost_in_crash_step"] = round(lost, 1)
            throughput["fraction_of_crash_step_lost"] = round(
                lost / max(1.0, sum(s["served"] for s in base) / len(base)), 3
            )
        throughput["group_unavailable_s"] = recovery.get("latency_s")
    return throughput


def _continuation(run: DemoRun, throughput: dict[str, Any]) -> dict[str, Any]:
    """Continued requests (#17): tokens kept vs regenerated, the crash step's share."""
    opts, crash, steps = run.opts, run.crash, run.steps
    continuation: dict[str, Any] = {
        "mode": "start_over" if getattr(opts, "no_continuation", False) else "continue",
        "max_new_tokens": getattr(opts, "max_new_tokens", 8),
        "total": run.snapshot["router"]["continuation"],
        "per_step": {s["step"]: s.get("continuation", {}) for s in steps},
    }
    if crash is not None:
        cstep = next(s for s in steps if s["step"] == crash["step"]).get("continuation", {})
        continuation["crash_step"] = cstep
        continuation["tokens_regenerated_after_crash"] = cstep.get("tokens_regenerated", 0)
        continuation["tokens_kept_after_crash"] = cstep.get("tokens_kept", 0)
        continuation["crash_step_lost_fraction"] = throughput.get("fraction_of_crash_step_lost")
    return continuation

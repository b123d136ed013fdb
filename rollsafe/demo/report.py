"""The report: what the fleet recorded, the files of ``--out``, the printout, the exit status.

Owns :func:`collect` (the timeline, snapshot and recoveries, read while the fleet is up),
:func:`report` (``summary.json`` with its keys, ``timeline.jsonl``/``fleet.json``/
``timeline.svg`` through :meth:`~rollsafe.fleet.fleet.RolloutFleet.record`, ``paths.md``, with
``--nodes`` ``node_loss.svg``; the
printed timeline, recovery, warm standbys, throughput, continued requests, checksums, dispatch
and where the time went; then ``demo OK`` and 0, or ``demo FAILED`` with the failures and 1),
and the two renderings of the timeline: :func:`mermaid_paths` and :func:`timeline_table`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from rollsafe.demo.figures import Figures
from rollsafe.demo.state import DemoRun

__all__ = ["collect", "mermaid_paths", "report", "summarize", "timeline_table"]


def collect(run: DemoRun) -> None:
    """Keep what the fleet recorded (timeline, snapshot, recoveries) before it closes."""
    run.timeline = run.fleet.timeline()
    run.snapshot = run.fleet.snapshot()
    run.recoveries = [r.as_dict() for r in run.fleet.recoveries()]


def report(run: DemoRun, figures: Figures) -> int:
    """Write ``--out``, print the report; the exit status (0 if every invariant held, else 1)."""
    summary = summarize(run, figures)
    _write(run, summary)
    _print(run, figures, summary)
    if summary["ok"]:
        print("demo OK: all invariants held")
        return 0
    print("demo FAILED:")
    for f_ in run.failures:
        print(f"  - {f_}")
    return 1


def summarize(run: DemoRun, figures: Figures) -> dict[str, Any]:
    """``summary.json``."""
    failures = run.failures
    steps = run.steps
    return {
        "ok": not failures,
        "failures": failures,
        "options": {
            k: v for k, v in vars(run.opts).items() if not k.startswith("_") and k != "func"
        },
        "engine": run.opts.engine,
        "vllm_python": run.opts.vllm_python if run.vllm else None,
        "immediate_recovery": run.immediate,
        "trainer": figures.trainer_info,
        "scratch_dir": str(run.work),
        "groups": dict(zip([f"g{i}" for i in range(len(run.sizes))], run.sizes, strict=True)),
        "recovery": figures.recovery,
        "throughput": figures.throughput,
        "continuation": figures.continuation,
        "standby": figures.standbys,
        "checksums": {
            "per_step": {s["step"]: s["checksums"] for s in steps},
            "final": run.final_checks,
            "all_matched": not any("MISMATCH" in f or "checksum" in f for f in failures),
            # (step, group) checks where the engine reported no data for some tensors (a CPU
            # vLLM's linear weights) and none differed: not counted as matched or as failed
            "unverified": sorted(
                f"{s['step']}:{gid}"
                for s in steps
                for gid, check in s["checksums"].items()
                if check.startswith("unverified")
            ),
        },
        # vLLM: greedy tokens and logprobs of fixed prompts, every active group against the
        # first that did not crash (rollsafe.probe); empty for the reference engine
        "probe": (
            {
                "start": run.probes.get("start", {}),
                "per_step": {s["step"]: s.get("probe", {}) for s in steps},
                "final": run.probes.get("final", {}),
                "all_alike": not any("probe" in f for f in failures),
            }
            if run.vllm
            else {}
        ),
        "dispatch_counts": run.dispatch,
        # --nodes: the cluster, each lost group's return (phases), requests and checks
        "nodes": run.node_figures or None,
        "steps": steps,
        "final_snapshot": run.snapshot,
        "timings_s": {k: round(v, 3) for k, v in run.timings.items()},
        "wall_s": round(time.monotonic() - run.wall0, 3),
    }


def _write(run: DemoRun, summary: dict[str, Any]) -> None:
    # timeline.jsonl (transitions, syncs, recoveries, the crash, request rates), fleet.json and
    # timeline.svg; `rollsafe report <out>` reads them back and redraws the picture
    out = run.out
    run.fleet.record(out, t0=run.t_begin)
    if run.nodes and run.node_loss is not None:
        from rollsafe.demo.nodes import write_node_loss_svg

        write_node_loss_svg(run, out / "node_loss.svg")
    (out / "paths.md").write_text(mermaid_paths(run.timeline))
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")


def _print(run: DemoRun, figures: Figures, summary: dict[str, Any]) -> None:
    print(f"\nengine: {run.engine}")
    print("timeline (every machine transition, seconds since start):")
    print(timeline_table(run.timeline, run.t_begin))
    _print_recovery(run, figures)
    _print_throughput(run, figures)
    print(
        "checksums: every active engine == trainer after every step:"
        f" {summary['checksums']['all_matched']}"
        + (
            f" (unverified, the engine had no data for some tensors:"
            f" {', '.join(summary['checksums']['unverified'])})"
            if summary["checksums"]["unverified"]
            else ""
        )
    )
    if run.vllm:
        probe = summary["probe"]
        print(
            "probe: every active group answers the fixed prompts alike (greedy tokens and"
            f" logprobs) after every step: {probe['all_alike']}; at the end {probe['final']}"
        )
    print(f"dispatch to non-active groups: {run.bad_dispatch or 'none'}")
    if run.nodes:
        from rollsafe.demo.nodes import print_report

        print_report(run)
    _print_time(run, figures, summary["wall_s"])
    out = run.out
    print(f"report: {out}/timeline.jsonl, {out}/paths.md, {out}/summary.json, {out}/fleet.json")
    print(f"picture: {out}/timeline.svg (`rollsafe report {out}` checks the run and redraws it)")
    if run.nodes and run.node_loss is not None:
        print(f"node loss picture: {out}/node_loss.svg (the same timeline from just before it)")


def _print_recovery(run: DemoRun, figures: Figures) -> None:
    crash, recovery = run.crash, figures.recovery
    print("\nrecovery:")
    if crash is None:
        print("  no crash scheduled")
    else:
        lat = recovery["latency_s"]
        print(
            f"  {crash['group']}: {crash.get('what', 'rank 1')}"
            f" {'removed' if run.nodes else 'SIGKILLed'} at step {crash['step']};"
            f" out of routing after {recovery['detected_after_s'] or float('nan'):.2f}s;"
            f" active with current weights after {lat if lat is not None else float('nan'):.2f}s"
            f" (strategy {recovery['strategy']}, status {recovery['status']})"
        )
        if recovery.get("restart_source"):
            print(
                f"  restarted from a {recovery['restart_source'].replace('_', ' ')}"
                f" (its standby was {recovery['standby_at_restart']} when the restart began)"
            )
    if run.opts.warm_standby:
        print("warm standbys (at the end; starts by source, fallbacks to a fresh spawn):")
        for gid, status in figures.standbys.items():
            sb = status or {}
            print(
                f"  {gid}: {sb.get('state')} | ready {sb.get('used_ready', 0)}"
                f" warming {sb.get('used_warming', 0)} fallbacks {sb.get('fallbacks', 0)}"
                f" (raced {sb.get('raced', 0)}; last fallback: {sb.get('last_fallback')})"
            )


def _print_throughput(run: DemoRun, figures: Figures) -> None:
    crash, throughput, continuation = run.crash, figures.throughput, figures.continuation
    print("throughput:")
    for s in throughput["per_step"]:
        by = s["by_group"]
        print(f"  step {s['step']}: served {s['served']} failed {s['failed']} by group {by}")
    if "requests_lost_in_crash_step" in throughput:
        print(
            f"  lost in the crash step: ~{throughput['requests_lost_in_crash_step']} requests"
            f" of {crash and crash['group']}"
            f" ({throughput['fraction_of_crash_step_lost']:.1%} of a normal step's total)"
        )
    total = continuation["total"]
    print(
        f"continued requests ({continuation['mode']}): after a failure {total['after_failure']},"
        f" after a sync abort {total['after_abort']}; tokens kept {total['tokens_kept']},"
        f" regenerated {total['tokens_regenerated']}; short requests read whole and sent again"
        f" after a failure {total['whole_lost']} (up to {continuation['max_new_tokens']} token(s)"
        " each)"
    )
    if "crash_step" in continuation:
        print(
            f"  crash step: {continuation['tokens_kept_after_crash']} token(s) kept,"
            f" {continuation['tokens_regenerated_after_crash']} regenerated, lost throughput"
            f" {continuation['crash_step_lost_fraction'] or 0:.1%}"
        )


def _print_time(run: DemoRun, figures: Figures, wall_s: float) -> None:
    print("where time went:")
    for k, v in run.timings.items():
        print(f"  {k:<46} {v:7.2f}s")
    print(f"  {'total':<46} {wall_s:7.2f}s")
    if run.actor:
        info = figures.trainer_info
        print(
            f"  trainer actor pid {info['pid']} (driver pid {info['driver_pid']});"
            " round trips (driver-measured = in actor + Ray overhead):"
        )
        for method, rt in info["round_trips"].items():
            print(
                f"    {method:<9} {rt['calls']:3d} calls {rt['seconds']:7.3f}s"
                f" = {rt['in_actor_s']:.3f}s in actor + {rt['overhead_s']:.3f}s Ray"
            )
        print(
            f"    weights fetched zero-copy from the object store:"
            f" {info['weights_fetched_zero_copy']}; rebuilt and verified in"
            f" {info['fetch_rebuild_verify_s']:.3f}s"
        )


def mermaid_paths(timeline: Sequence[dict[str, Any]]) -> str:
    """One ``stateDiagram-v2`` per machine of the states it actually visited (markdown)."""
    subjects: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in timeline:
        key = (row["kind"], "exports" if row["kind"] == "export" else row["subject"])
        subjects.setdefault(key, []).append(row)
    parts = ["# Paths the machines took in this run\n"]
    for (kind, subject), rows in subjects.items():
        edges: dict[tuple[str, str], list[str]] = {}
        for r in rows:
            events = edges.setdefault((r["source"], r["target"]), [])
            if r["event"] not in events:
                events.append(r["event"])
        lines = ["stateDiagram-v2", f"    [*] --> {rows[0]['source']}"]
        for (src, dst), events in edges.items():
            lines.append(f"    {src} --> {dst} : {', '.join(events)}")
        parts.append(f"## {kind} {subject}\n\n```mermaid\n" + "\n".join(lines) + "\n```\n")
    return "\n".join(parts)


def timeline_table(timeline: Sequence[dict[str, Any]], t0: float) -> str:
    """The printed timeline: one line per machine transition, seconds since ``t0``."""
    out = [f"{'t (s)':>8}  {'machine':<28} {'event':<16} transition"]
    for r in timeline:
        name = f"{r['kind']} {r['subject']}"
        move = f"{r['source']} -> {r['target']}"
        why = (r.get("inputs") or {}).get("reason")
        move += f" ({why})" if why else ""
        out.append(f"{r['timestamp'] - t0:8.3f}  {name:<28} {r['event']:<16} {move}")
    return "\n".join(out)

"""``rollsafe report PATH``: open a recorded run, check it, print it, draw it.

Owns the reading side of a recorded run for people: ``PATH`` is a directory written by
``rollsafe demo`` (``demo-report/``) or by :meth:`RolloutFleet.record(path)
<rollsafe.fleet.fleet.RolloutFleet.record>` (or its ``timeline.jsonl`` itself). It

1. validates the files (:func:`~rollsafe.observe.runfile.load_run`): a missing, truncated or
   corrupt file is named with its first bad line, and the exit status is 2;
2. prints the summary (length, groups and their final states, syncs, exports, requests per
   group, crashes), the recovery breakdown (onset -> detection -> active, each recovery step)
   and the invariant checks below, each ``ok`` or ``FAILED`` with what broke it;
3. writes the SVG picture (:mod:`~rollsafe.observe.timeline_svg`), by default
   ``PATH/timeline.svg``.

Exit status: 0 when every check holds, 1 when one fails, 2 on bad input.

Invariant checks (what a recorded run can show after the fact):

* every transition is an edge of its machine (source, event, target as the class declares);
* every machine's transitions chain (each starts where the previous one ended);
* no request was admitted to a group that was not ``active`` (dispatch counts by state);
* the fleet's weights version only went up (successful syncs in increasing version order);
* exports became ready in increasing version order;
* every group that failed was ``active`` again (or retired) by the end of the run;
* the run's own verdict (``summary.json`` ``ok``), when it has one.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollsafe.observe.runfile import TRANSITION_KINDS, RunData, RunFileError, load_run
from rollsafe.observe.timeline_svg import recovery_spans, write_svg

__all__ = ["Check", "add_arguments", "check_invariants", "main", "run_report"]

EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_INPUT = 0, 1, 2
_KIND_MACHINE = {
    "group": "WorkerGroupLifecycle",
    "export": "ExportLifecycle",
    "registration": "CheckpointRegistration",
    "mode": "ImmediateRecoveryMode",
}


class Check:
    """One invariant check: its name, whether it held, and what broke it."""

    def __init__(self, name: str, problems: Sequence[str], skipped: str | None = None) -> None:
        self.name = name
        self.problems = list(problems)
        self.skipped = skipped

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self) -> str:
        if self.skipped:
            return f"  [skip]   {self.name}: {self.skipped}"
        if self.ok:
            return f"  [ok]     {self.name}"
        shown = "; ".join(self.problems[:3]) + (
            f" (+{len(self.problems) - 3} more)" if len(self.problems) > 3 else ""
        )
        return f"  [FAILED] {self.name}: {shown}"


def _edges() -> dict[str, set[tuple[str, str, str]]]:
    from rollsafe.diagrams import transitions_of
    from rollsafe.statemachines import MACHINES

    return {
        cls.__name__: {(src, event, dst) for src, dst, event, _ in transitions_of(cls)}
        for cls in MACHINES
    }


def check_invariants(run: RunData) -> list[Check]:
    """The invariant checks of the module doc, in order."""
    checks: list[Check] = []
    transitions = run.of(*TRANSITION_KINDS)
    edges = _edges()
    illegal = []
    for r in transitions:
        machine = _KIND_MACHINE.get(r["kind"]) or str(r.get("machine", "")).split("(")[0]
        allowed = edges.get(machine)
        if allowed is None:
            continue
        if (r["source"], r["event"], r["target"]) not in allowed:
            illegal.append(
                f"{r['kind']} {r['subject']} t={r['t']:.3f}: {r['event']} "
                f"{r['source']} -> {r['target']} is not a {machine} transition"
            )
    checks.append(Check("every transition is an edge of its machine", illegal))

    chain: list[str] = []
    last: dict[tuple[str, str], str] = {}
    for r in transitions:
        key = (r["kind"], r["subject"])
        if key in last and last[key] != r["source"]:
            chain.append(
                f"{r['kind']} {r['subject']} t={r['t']:.3f}: {r['event']} starts in "
                f"{r['source']!r} but the previous transition ended in {last[key]!r}"
            )
        last[key] = r["target"]
    checks.append(Check("each machine's transitions chain", chain))

    dispatch = None
    if run.end is not None and isinstance(run.end.get("dispatch_counts"), dict):
        dispatch = run.end["dispatch_counts"]
    elif run.summary is not None and isinstance(run.summary.get("dispatch_counts"), dict):
        dispatch = run.summary["dispatch_counts"]
    name = "requests were admitted only to active groups"
    if dispatch is None:
        checks.append(Check(name, [], skipped="no dispatch counts recorded"))
    else:
        bad = [
            f"{g}: {c}" for g, c in dispatch.items() if isinstance(c, dict) and set(c) - {"active"}
        ]
        checks.append(Check(name, bad))

    syncs = [r for r in run.of("sync") if r.get("ok")]
    regress = [
        f"v{b['version']} synced after v{a['version']}"
        for a, b in itertools.pairwise(syncs)
        if b["version"] <= a["version"]
    ]
    checks.append(
        Check(
            "the weights version only went up",
            regress,
            skipped=None if syncs else "no sync recorded",
        )
    )

    ready = []
    for r in run.of("export"):
        if r["target"] == "ready":
            try:
                ready.append(int(str(r["subject"]).lstrip("v")))
            except ValueError:
                continue
    order = [f"v{b} ready after v{a}" for a, b in itertools.pairwise(ready) if b <= a]
    checks.append(
        Check(
            "exports became ready in version order",
            order,
            skipped=None if ready else "no export became ready",
        )
    )

    not_back = []
    final_state: dict[str, str] = {}
    for r in run.of("group"):
        final_state[r["subject"]] = r["target"]
    failed = {r["subject"] for r in run.of("group") if r["target"] == "inactive"}
    for gid in sorted(failed):
        state = final_state.get(gid)
        if state not in ("active", "retired"):
            not_back.append(f"{gid} ended {state}")
    checks.append(
        Check(
            "every failed group was back (active) or retired by the end",
            not_back,
            skipped=None if failed else "no group failed",
        )
    )

    if run.summary is not None and "ok" in run.summary:
        failures = [str(f) for f in run.summary.get("failures") or []] or (
            [] if run.summary["ok"] else ["summary.json says ok: false"]
        )
        checks.append(Check("the run's own invariants (summary.json)", failures))
    return checks


def _fmt_s(v: Any) -> str:
    return "n/a" if v is None else f"{float(v):.3f}s"


def summary_lines(run: RunData) -> list[str]:
    lines = [f"recorded run {run.directory} ({', '.join(run.files)})"]
    header = run.header or {}
    lines.append(
        f"  {run.duration:.1f}s, {len(run.groups)} group(s) {run.groups}"
        + (f", transport {header['transport']}" if header.get("transport") else "")
        + (
            f", immediate recovery {header['immediate_recovery']}"
            if "immediate_recovery" in header
            else ""
        )
    )
    final: dict[str, str] = {}
    for r in run.of("group"):
        final[r["subject"]] = r["target"]
    if run.end is not None:
        final.update({str(k): str(v) for k, v in run.end["groups"].items()})
        lines.append(f"  fleet version at the end: v{run.end.get('fleet_version')}")
    lines.append("  final states: " + (", ".join(f"{g}={s}" for g, s in final.items()) or "-"))
    counts: dict[str, int] = defaultdict(int)
    for r in run.of(*TRANSITION_KINDS):
        counts[r["kind"]] += 1
    lines.append("  transitions: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    syncs = run.of("sync")
    if syncs:
        lines.append(
            f"  syncs: {len(syncs)} ("
            + ", ".join(
                f"v{s['version']} {'ok' if s['ok'] else 'FAILED'} {_fmt_s(s.get('seconds'))}"
                for s in syncs[:8]
            )
            + (", ..." if len(syncs) > 8 else "")
            + ")"
        )
    ready = [r["subject"] for r in run.of("export") if r["target"] == "ready"]
    if ready:
        lines.append(f"  exports ready: {', '.join(ready)}")
    samples = run.of("requests")
    if samples:
        last = samples[-1]
        lines.append(
            "  requests served: "
            + ", ".join(f"{g} {n}" for g, n in last["served"].items())
            + "; failed: "
            + ", ".join(f"{g} {n}" for g, n in last["failed"].items())
        )
    elif run.summary is not None and isinstance(run.summary.get("throughput"), dict):
        tp = run.summary["throughput"]
        lines.append(f"  requests served {tp.get('served_total')}, failed {tp.get('failed_total')}")
    crashes = [r for r in run.of("mark") if r.get("event") == "crash"]
    for c in crashes:
        lines.append(
            f"  crash: {c.get('subject')} at t={c['t']:.3f}s"
            + (f" (rank {c['rank']}, pid {c.get('pid')})" if "rank" in c else "")
        )
    return lines


def recovery_lines(run: RunData) -> list[str]:
    spans = recovery_spans(run.rows)
    if not spans:
        return ["  no recovery"]
    recs = run.of("recovery")
    lines = []
    for i, s in enumerate(spans):
        rec = recs[i] if i < len(recs) else {}
        source = rec.get("restart_source")
        restart = (
            f"; restart from {source} (standby was {rec.get('standby_at_restart') or 'n/a'})"
            if source
            else ""
        )
        lines.append(
            f"  {s['group']}: {s.get('status')} via {s.get('strategy') or 'n/a'};"
            f" onset t={s['onset']:.3f}s ({s['onset_source']}),"
            f" detected +{s['detected'] - s['onset']:.3f}s,"
            f" active +{_fmt_s(s['latency_s'])}{restart}"
        )
        steps = recs[i].get("steps") if i < len(recs) else None
        if isinstance(steps, list) and steps:
            for st in steps:
                if not isinstance(st, dict):
                    continue
                ok = "" if st.get("ok", True) else " FAILED"
                detail = f" ({st['detail']})" if st.get("detail") else ""
                lines.append(
                    f"      {st.get('name', '?'):<16} {_fmt_s(st.get('seconds'))}{ok}{detail[:120]}"
                )
    return lines


def run_report(path: str | Path, *, svg: str | Path | None = None, draw: bool = True) -> int:
    """Print the report of the recorded run at ``path``; return the exit status."""
    try:
        run = load_run(path)
    except RunFileError as exc:
        print(f"rollsafe report: bad input: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for line in summary_lines(run):
        print(line)
    print("recovery:")
    for line in recovery_lines(run):
        print(line)
    checks = check_invariants(run)
    print("invariant checks:")
    for c in checks:
        print(c.line())
    if draw:
        out = Path(svg) if svg is not None else run.directory / "timeline.svg"
        try:
            write_svg(out, run.rows, title=f"rollsafe run {run.directory.name}")
        except OSError as exc:
            print(f"rollsafe report: cannot write {out}: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        print(f"picture: {out}")
    failed = [c for c in checks if not c.ok]
    if failed:
        print(f"report: {len(failed)} check(s) FAILED")
        return EXIT_CHECK_FAILED
    print("report: every check held")
    return EXIT_OK


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "path",
        help="a recorded run: demo-report/, a RolloutFleet.record() "
        "directory, or its timeline.jsonl",
    )
    p.add_argument(
        "--svg", default=None, help="where to write the picture (default PATH/timeline.svg)"
    )
    p.add_argument("--no-svg", action="store_true", help="do not write the picture")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollsafe report", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_report(args.path, svg=args.svg, draw=not args.no_svg)

"""Median cost of one guarded transition of each machine vs a bare python-statemachine one.

Every figure is measured in the same run: a bare two-state machine (one unguarded event, no
callbacks) is the baseline, and each rollsafe machine takes a cycle of guarded transitions with
its real guard inputs, history recording included. Each call is timed on its own; the reported
figure is the median over all calls of all rounds, and the ratio to the bare median is what the
target (<= 1.5x) is about.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from statemachine import State, StateMachine

from rollsafe.statemachines import (
    CheckpointRegistration,
    ExportLifecycle,
    ImmediateRecoveryMode,
    WorkerGroupLifecycle,
)

__all__ = ["main", "measure"]


class _Bare(StateMachine):
    a = State(initial=True)
    b = State()
    go = a.to(b) | b.to(a)


Step = Callable[[], Any]


def _timed(step: Step, n: int, reset: Step | None = None) -> list[float]:
    out = []
    clock = time.perf_counter_ns
    for _ in range(n):
        if reset is not None:
            reset()
        t0 = clock()
        step()
        out.append((clock() - t0) / 1000.0)
    return out


def _bare(n: int) -> list[float]:
    m = _Bare()
    return _timed(m.go, n)


def _worker_group(n: int) -> list[float]:
    g = WorkerGroupLifecycle(range(8), group_id="bench")
    for r in range(8):
        g.report_member(r, healthy=True, weights_version=1)
    g.launched(current_version=1)
    samples: list[float] = []
    half = n // 2
    for _ in range(half):
        t0 = time.perf_counter_ns()
        g.mark_stale(current_version=2)
        t1 = time.perf_counter_ns()
        g.weights_loaded(current_version=1)
        t2 = time.perf_counter_ns()
        samples += [(t1 - t0) / 1000.0, (t2 - t1) / 1000.0]
    return samples


def _export(n: int) -> list[float]:
    e = ExportLifecycle(7)
    facts = {"index_missing_keys": (), "checksums_verified": True, "renamed": True}
    return _timed(lambda: e.publish(**facts), n, reset=lambda: e.restore_state("committing"))


def _registration(n: int) -> list[float]:
    c = CheckpointRegistration(world_size=8)
    keys = [f"model.layers.{i}.weight" for i in range(64)]
    c.begin_register(name="bench", version=1)
    c.register_ok(ranks_ok=range(8), expected_keys=keys, registered_keys=keys)
    targets = [[0, 1, 2, 3], [4, 5, 6, 7]]
    results = {r: True for r in range(8)}
    samples: list[float] = []
    for _ in range(n // 2):
        t0 = time.perf_counter_ns()
        c.begin_update(targets=targets)
        t1 = time.perf_counter_ns()
        c.update_done(results=results)
        t2 = time.perf_counter_ns()
        samples += [(t1 - t0) / 1000.0, (t2 - t1) / 1000.0]
    return samples


def _recovery_mode(n: int) -> list[float]:
    m = ImmediateRecoveryMode(enabled=True, rearm_after=1)
    samples: list[float] = []
    for _ in range(n // 2):
        t0 = time.perf_counter_ns()
        m.export_late()
        t1 = time.perf_counter_ns()
        m.export_on_time()
        t2 = time.perf_counter_ns()
        samples += [(t1 - t0) / 1000.0, (t2 - t1) / 1000.0]
    return samples


CASES: dict[str, Callable[[int], list[float]]] = {
    "bare python-statemachine": _bare,
    "WorkerGroupLifecycle (8 ranks)": _worker_group,
    "ExportLifecycle": _export,
    "CheckpointRegistration (8 ranks)": _registration,
    "ImmediateRecoveryMode": _recovery_mode,
}


def measure(rounds: int = 7, per_round: int = 2000) -> dict[str, Any]:
    """Run every case ``rounds`` times, interleaved, and return medians and ratios."""
    samples: dict[str, list[float]] = {name: [] for name in CASES}
    for fn in CASES.values():  # warm-up
        fn(200)
    for _ in range(rounds):
        for name, fn in CASES.items():
            samples[name] += fn(per_round)
    bare = statistics.median(samples["bare python-statemachine"])
    rows = {}
    for name, values in samples.items():
        med = statistics.median(values)
        rows[name] = {"median_us": round(med, 2), "ratio_to_bare": round(med / bare, 3)}
    return {
        "benchmark": "guarded transition cost",
        "target": "each machine's median within 1.5x of the bare transition",
        "rounds": rounds,
        "calls_per_round": per_round,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "results": rows,
        "all_within_target": all(r["ratio_to_bare"] <= 1.5 for r in rows.values()),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--per-round", type=int, default=2000)
    parser.add_argument("--out", default="benchmarks/results/transitions.json")
    args = parser.parse_args(argv)
    report = measure(args.rounds, args.per_round)
    width = max(len(n) for n in report["results"])
    print(f"{'machine':<{width}}  median µs  x bare")
    for name, row in report["results"].items():
        print(f"{name:<{width}}  {row['median_us']:>9.1f}  {row['ratio_to_bare']:>6.2f}")
    verdict = "within" if report["all_within_target"] else "OUTSIDE"
    print(f"all machines {verdict} the 1.5x target")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {out}")
    return 0 if report["all_within_target"] else 1

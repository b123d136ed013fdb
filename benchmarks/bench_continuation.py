"""Benchmark continuation on CPU: tokens regenerated after a crash, and the crash step's lost
throughput, with requests continued from their last streamed token vs started over.

A real :class:`~rollsafe.fleet.fleet.RolloutFleet` of two 1-rank reference-engine groups (the
tiny Llama of ``make_tiny_model``, SGLang dialect) serves "steps": ``--requests`` concurrent
greedy rollouts of ``--tokens`` tokens each. For each of ``--crashes`` trials a normal step is
timed, then a crash step: once one request has streamed ``--kill-at`` tokens, its group's
engine is SIGKILLed (the group is recovered before the next trial). Two modes, one fleet each:

* **continue** (#17, the default): the router continues each interrupted request on the other
  group from its tokens so far;
* **start_over** (the behaviour before #17, ``router.keep_tokens = False``): an interrupted
  request starts again from its prompt; the tokens it had received are regenerated.

Per crash step: ``tokens_regenerated`` (tokens received and then generated again; the target
is 0: continuation keeps everything streamed, only tokens the dead engine had sampled but not
yet sent are lost), ``tokens_kept``, and the step's lost throughput ``1 - normal_s / crash_s``
(normal: the median no-crash step of that mode). Every crash-step result is checked against
the uninterrupted greedy run (same tokens); exits 1 if one differs. Writes
``benchmarks/results/continuation_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "continuation_cpu.json"


def _step(fleet: Any, prompts: list[list[int]], sp: dict[str, Any]) -> tuple[float, list[Any]]:
    outs: list[Any] = [None] * len(prompts)

    def one(i: int) -> None:
        outs[i] = fleet.generate(prompts[i], sampling_params=sp)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, outs


def _killer(fleet: Any, kill_at: int, killed: dict[str, int]) -> Any:
    """A progress hook that SIGKILLs the group of the first request to stream ``kill_at``."""
    lock = threading.Lock()

    def progress(gid: str, n: int) -> None:
        with lock:
            if n >= kill_at and not killed:
                killed[gid] = n
                for pid in fleet.launcher(gid).rank_pids:
                    os.kill(pid, signal.SIGKILL)

    return progress


def run_mode(mode: str, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    from rollsafe.fleet import FleetConfig, GroupSpec, RolloutFleet

    tmp = Path(tempfile.mkdtemp(prefix=f"rollsafe-bench-cont-{mode}-"))
    from transformers import AutoModelForCausalLM

    weights = {
        n: p.detach()
        for n, p in AutoModelForCausalLM.from_pretrained(str(model)).named_parameters()
    }
    cfg = FleetConfig(
        model_path=model,
        export_root=tmp / "exports",
        groups=[GroupSpec(1), GroupSpec(1)],
        enable_immediate_recovery=True,  # a killed group comes back with v1 (the demo's setup)
        warm_standby=True,
    )
    sp = {"max_new_tokens": args.tokens, "temperature": 0.0, "ignore_eos": True}
    prompts = [[1 + i, 2 + i, 3 + i, 4 + i] for i in range(args.requests)]
    trials: list[dict[str, Any]] = []
    normal: list[float] = []
    mismatches = 0
    with RolloutFleet(cfg) as fleet:
        fleet.router.keep_tokens = mode == "continue"
        if not fleet.sync_weights(weights, 1).ok:  # publish v1: recoveries restart from it
            raise SystemExit("the initial sync failed")
        _, want = _step(fleet, prompts, sp)  # the uninterrupted greedy runs (and a warm-up)
        for trial in range(args.crashes):
            normal_s, _ = _step(fleet, prompts, sp)
            normal.append(normal_s)
            before = fleet.router.stats()["continuation"]
            killed: dict[str, int] = {}
            fleet.router.on_progress = _killer(fleet, args.kill_at, killed)
            crash_s, outs = _step(fleet, prompts, sp)
            fleet.router.on_progress = None
            after = fleet.router.stats()["continuation"]
            same = [o.output_ids == w.output_ids for o, w in zip(outs, want, strict=True)]
            mismatches += same.count(False)
            trials.append(
                {
                    "trial": trial,
                    "killed": killed,
                    "normal_s": round(normal_s, 3),
                    "crash_s": round(crash_s, 3),
                    "tokens_regenerated": after["tokens_regenerated"]
                    - before["tokens_regenerated"],
                    "tokens_kept": after["tokens_kept"] - before["tokens_kept"],
                    "requests_interrupted": after["after_failure"] - before["after_failure"],
                    "all_equal_uninterrupted": all(same),
                }
            )
            print(f"{mode} trial {trial}: {trials[-1]}", flush=True)
            if not fleet.wait_recoveries(timeout=120):
                raise SystemExit("recovery did not finish")
            deadline = time.monotonic() + 60
            while any(g.state != "active" for g in fleet.registry.groups()):
                if time.monotonic() > deadline:
                    states = {g.group_id: g.state for g in fleet.registry.groups()}
                    recs = [r.as_dict() for r in fleet.recoveries()][-2:]
                    raise SystemExit(f"a group did not come back to active: {states} {recs}")
                time.sleep(0.1)
    normal_med = statistics.median(normal)
    for t in trials:
        t["lost_throughput"] = round(max(0.0, 1.0 - normal_med / t["crash_s"]), 3)
    return {
        "trials": trials,
        "normal_step_s_median": round(normal_med, 3),
        "crash_step_s_median": round(statistics.median(t["crash_s"] for t in trials), 3),
        "lost_throughput_median": round(statistics.median(t["lost_throughput"] for t in trials), 3),
        "tokens_regenerated_per_crash_median": statistics.median(
            t["tokens_regenerated"] for t in trials
        ),
        "tokens_kept_per_crash_median": statistics.median(t["tokens_kept"] for t in trials),
        "mismatches": mismatches,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--crashes", type=int, default=4)
    p.add_argument("--requests", type=int, default=4, help="concurrent rollouts per step")
    p.add_argument("--tokens", type=int, default=200, help="tokens per rollout")
    p.add_argument("--kill-at", type=int, default=100, help="streamed tokens before the kill")
    p.add_argument("--out", type=Path, default=RESULT)
    args = p.parse_args(argv)
    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model

    model = make_tiny_model(Path(tempfile.mkdtemp(prefix="rollsafe-bench-cont-model-")), seed=0)
    modes = {m: run_mode(m, model, args) for m in ("continue", "start_over")}
    result = {
        "benchmark": "continuation_cpu",
        "config": {
            "groups": 2,
            "ranks_per_group": 1,
            "dialect": "sglang",
            "crashes": args.crashes,
            "requests_per_step": args.requests,
            "tokens_per_request": args.tokens,
            "kill_at_tokens": args.kill_at,
            "cpus": os.cpu_count(),
        },
        "modes": modes,
        "target": {"tokens_regenerated_per_crash": 0},
        "target_met": modes["continue"]["tokens_regenerated_per_crash_median"] == 0
        and modes["continue"]["mismatches"] == 0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({m: {k: v for k, v in d.items() if k != "trials"} for m, d in modes.items()}))
    return 0 if all(d["mismatches"] == 0 for d in modes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

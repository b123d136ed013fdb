"""Control-plane benchmark: one health round over many groups, and registry transition rate.

Targets (fleet issue, "Performance"): one health round over 1,000 simulated groups with 10 ms
probe latency finishes within 3x a single probe's latency (probes are concurrent), and the
registry sustains at least 5,000 transitions per second.

* Health: 1,000 groups in ``active``; an async probe that answers after 10 ms
  (``asyncio.sleep``) runs on the HealthManager's loop. The figure is the median of several
  rounds measured by ``HealthManager.check_now`` (probe, results applied to the registry), and
  the ratio is to the same round over ONE group (single probe latency, measured in the same
  run). For information, the thread-pool path for sync probes (``time.sleep``) is also timed at
  two pool sizes; it has no target (1,000 threads on a small host is the wrong tool: use an
  async probe for large simulated fleets).
* Registry: ``FleetRegistry.send`` cycling ``fail -> claim -> restarted`` over 100 groups with
  a Router attached as listener (so listener delivery is included) and the member reports the
  guards need, from one thread and from two; compared with the bare machines' ``send``.

Run: ``.venv/bin/python benchmarks/bench_control_plane.py``; writes
``benchmarks/results/control_plane.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rollsafe.fleet.health import HealthManager
from rollsafe.fleet.router import Router
from rollsafe.registry import FleetRegistry, WorkerGroup
from rollsafe.statemachines import GroupEvent, WorkerGroupLifecycle

RESULTS = Path(__file__).resolve().parent / "results" / "control_plane.json"
PROBE_LATENCY_S = 0.010
HEALTH_TARGET_RATIO = 3.0
TRANSITIONS_TARGET = 5000.0


def _fleet(n_groups: int, ranks_per_group: int = 1, budget: int = 3) -> FleetRegistry:
    reg = FleetRegistry(fleet_version=1)
    for i in range(n_groups):
        gid = f"g{i}"
        ranks = range(i * ranks_per_group, (i + 1) * ranks_per_group)
        reg.add_group(gid, ranks, restart_budget=budget)
        for r in ranks:
            reg.report_member(gid, r, healthy=True, weights_version=1)
        reg.send(gid, GroupEvent.LAUNCHED)
    return reg


async def _async_probe(group: WorkerGroup, timeout_s: float) -> bool:
    await asyncio.sleep(PROBE_LATENCY_S)
    return True


def _sync_probe(group: WorkerGroup, timeout_s: float) -> bool:
    time.sleep(PROBE_LATENCY_S)
    return True


def _rounds(
    reg: FleetRegistry, probe: Any, rounds: int, cpu: list[float] | None = None, **kw: Any
) -> list[float]:
    """Wall time of ``rounds`` health rounds (and, into ``cpu``, this thread's CPU time:
    ``check_now`` runs the round's event loop on the calling thread)."""
    hm = HealthManager(reg, probe, interval_s=60.0, timeout_s=1.0, failure_threshold=3, **kw)
    try:
        hm.check_now()  # warm-up (pool threads, imports)
        out = []
        for _ in range(rounds):
            c0 = time.thread_time()
            r = hm.check_now()
            if cpu is not None:
                cpu.append(time.thread_time() - c0)
            assert r.probed == len(reg) and r.healthy == r.probed, r
            out.append(r.duration_s)
        return out
    finally:
        hm.stop()


def _asyncio_floor(n: int, rounds: int) -> list[float]:
    """The same n concurrent 10 ms sleeps with bare asyncio.gather: the event loop's own cost."""

    async def one() -> None:
        await asyncio.sleep(PROBE_LATENCY_S)

    async def gather_all() -> float:
        t0 = time.monotonic()
        await asyncio.gather(*(one() for _ in range(n)))
        return time.monotonic() - t0

    return [asyncio.run(gather_all()) for _ in range(rounds)]


def bench_health(n_groups: int, rounds: int) -> dict[str, Any]:
    single = _rounds(_fleet(1), _async_probe, rounds)
    big_reg = _fleet(n_groups)
    # Long-lived control-plane objects (1,000 machines) make every full GC pass walk them;
    # a long-running trainer would freeze them after start-up, as done here.
    gc.collect()
    gc.freeze()
    floor = statistics.median(_asyncio_floor(n_groups, rounds))
    cpu: list[float] = []
    many = _rounds(big_reg, _async_probe, rounds, cpu)
    single_med = statistics.median(single)
    many_med = statistics.median(many)
    res: dict[str, Any] = {
        "groups": n_groups,
        "probe_latency_s": PROBE_LATENCY_S,
        "rounds": rounds,
        "single_probe_round_median_s": round(single_med, 5),
        "round_median_s": round(many_med, 5),
        "round_max_s": round(max(many), 5),
        "round_cpu_median_s": round(statistics.median(cpu), 5),
        "asyncio_gather_floor_median_s": round(floor, 5),
        "ratio_to_asyncio_floor": round(many_med / floor, 3),
        "ratio_to_single_probe": round(many_med / single_med, 3),
        "target_ratio": HEALTH_TARGET_RATIO,
        "within_target": many_med / single_med <= HEALTH_TARGET_RATIO,
        "sync_pool_rounds_s": {},
    }
    # sync probes run one daemon thread each (rollsafe.concurrency.DaemonCall): no pool size
    sync = _rounds(big_reg, _sync_probe, max(2, rounds // 2))
    res["sync_pool_rounds_s"]["one thread per probe"] = round(statistics.median(sync), 4)
    return res


def _cycle_events(reg: FleetRegistry, gids: list[str], cycles: int) -> int:
    sent = 0
    for _ in range(cycles):
        for gid in gids:
            reg.send(gid, GroupEvent.FAIL)
            reg.send(gid, GroupEvent.CLAIM)
            reg.report_member(gid, reg.get(gid).ranks[0], healthy=True, weights_version=1)
            reg.send(gid, GroupEvent.RESTARTED)
            sent += 3
    return sent


def _bare_rate(n_groups: int, cycles: int) -> float:
    machines = []
    for i in range(n_groups):
        m = WorkerGroupLifecycle([i], restart_budget=10**9, group_id=f"g{i}")
        m.report_member(i, healthy=True, weights_version=1)
        m.send(GroupEvent.LAUNCHED, current_version=1)
        machines.append(m)
    t0 = time.perf_counter()
    n = 0
    for _ in range(cycles):
        for i, m in enumerate(machines):
            m.send(GroupEvent.FAIL)
            m.send(GroupEvent.CLAIM)
            m.report_member(i, healthy=True, weights_version=1)
            m.send(GroupEvent.RESTARTED, current_version=1)
            n += 3
    return n / (time.perf_counter() - t0)


def _registry_rate(n_groups: int, cycles: int, threads: int) -> float:
    reg = _fleet(n_groups, budget=10**9)
    router = Router(reg)  # a real listener: sticky-session bookkeeping on leaving routing
    gids = [g.group_id for g in reg.groups()]
    parts = [gids[i::threads] for i in range(threads)]
    counts = [0] * threads

    def work(k: int) -> None:
        counts[k] = _cycle_events(reg, parts[k], cycles)

    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - t0
    router.close()
    assert reg.listener_errors == 0
    return sum(counts) / elapsed


def bench_registry(n_groups: int, cycles: int, repeats: int) -> dict[str, Any]:
    """Bare machines and the registry, interleaved ``repeats`` times; medians reported."""
    bare: list[float] = []
    one: list[float] = []
    two: list[float] = []
    for _ in range(repeats):
        bare.append(_bare_rate(n_groups, cycles))
        one.append(_registry_rate(n_groups, cycles, 1))
        two.append(_registry_rate(n_groups, cycles, 2))
    res: dict[str, Any] = {
        "groups": n_groups,
        "event_cycle": "fail, claim, (report member), restarted",
        "repeats": repeats,
        "target_per_s": TRANSITIONS_TARGET,
        "bare_machines_per_s": round(statistics.median(bare)),
        "registry_1_thread_per_s": round(statistics.median(one)),
        "registry_2_threads_per_s": round(statistics.median(two)),
    }
    res["registry_cost_ratio_to_bare"] = round(
        res["bare_machines_per_s"] / res["registry_1_thread_per_s"], 3
    )
    res["within_target"] = res["registry_1_thread_per_s"] >= TRANSITIONS_TARGET
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--cycles", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    health = bench_health(args.groups, args.rounds)
    registry = bench_registry(100, args.cycles, args.repeats)
    ok = bool(health["within_target"] and registry["within_target"])
    report = {
        "benchmark": "control plane",
        "targets": {
            "health_round": f"{args.groups} groups, {PROBE_LATENCY_S * 1000:.0f} ms probes: "
            f"round <= {HEALTH_TARGET_RATIO}x one probe",
            "registry": f">= {TRANSITIONS_TARGET:.0f} transitions/s",
        },
        "python": platform.python_version(),
        "machine": platform.machine(),
        "health": health,
        "registry": registry,
        "all_within_target": ok,
    }
    rows = [
        (
            "health round, 1 group (single probe)",
            f"{health['single_probe_round_median_s'] * 1e3:.1f} ms",
            "",
        ),
        (
            f"health round, {args.groups} groups (async probes)",
            f"{health['round_median_s'] * 1e3:.1f} ms (max {health['round_max_s'] * 1e3:.1f})",
            f"{health['ratio_to_single_probe']}x single (target <= {HEALTH_TARGET_RATIO}x)",
        ),
    ]
    rows.append(
        (
            "  bare asyncio.gather of the same sleeps (floor)",
            f"{health['asyncio_gather_floor_median_s'] * 1e3:.1f} ms",
            f"round is {health['ratio_to_asyncio_floor']}x the floor",
        )
    )
    rows.append(
        (
            "  CPU time of that round (probe loop thread)",
            f"{health['round_cpu_median_s'] * 1e3:.1f} ms",
            "asyncio + rollsafe, per round",
        )
    )
    for k, v in health["sync_pool_rounds_s"].items():
        rows.append(
            (
                f"health round, {args.groups} groups, sync probes, {k}",
                f"{v * 1e3:.1f} ms",
                "info only",
            )
        )
    rows += [
        (
            "bare WorkerGroupLifecycle.send (same cycle)",
            f"{registry['bare_machines_per_s']:,}/s",
            "floor: the machines themselves",
        ),
        (
            "FleetRegistry.send, 1 thread (+Router listener)",
            f"{registry['registry_1_thread_per_s']:,}/s",
            f"target >= {TRANSITIONS_TARGET:,.0f}/s; "
            f"{registry['registry_cost_ratio_to_bare']}x bare cost",
        ),
        (
            "FleetRegistry.send, 2 threads",
            f"{registry['registry_2_threads_per_s']:,}/s",
            "GIL-bound; info only",
        ),
    ]
    w = max(len(r[0]) for r in rows)
    w2 = max(len(r[1]) for r in rows)
    print(f"{'measure':<{w}}  {'figure':<{w2}}  note")
    print("-" * (w + w2 + 40))
    for a, b, c in rows:
        print(f"{a:<{w}}  {b:<{w2}}  {c}")
    print(f"\nall within target: {ok}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

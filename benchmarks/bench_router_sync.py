"""Measure what :class:`rollsafe.gateway.router_sync.RouterSync` changes for a router users keep
in front of the engines (issue #35, item 5), on the 2-core CPU machine.

Behind each router (``sglang-router`` 0.3.2 with ``/generate``, ``vllm-router`` 0.1.17 with
``/v1/completions``; ``make routers``, round-robin, their other settings at their defaults):
two stub engines (``benchmarks/gateway/stub_engine.py``, ``--token-interval-ms`` per token)
under a steady closed-loop load of ``--clients`` clients. The fleet side is a real
:class:`~rollsafe.registry.FleetRegistry` with one group per engine, watched by rollsafe's
real :class:`~rollsafe.fleet.health.HealthManager` (its default settings: a probe every
0.5 s, 2 s timeout, 2 failures fail the group; the engine clients' ``GET /health``). Each
repeat runs every router in both modes, interleaved: ``router`` (no sync: the router is on its
own) and ``sync`` (a :class:`RouterSync` drives the router's worker API). Scenarios:

* ``sigkill``: one engine SIGKILLed ``--kill-at`` s into the load. Measured: connection
  attempts the router still made to the dead engine after the kill (SYN packets to its port on
  ``lo``, ``benchmarks/gateway/syn_counter.py``; needs root or CAP_NET_RAW) and the time of the
  last one, failed client requests, the fleet's detection (kill -> the group left ``active``)
  and, with the sync, the lag from leaving ``active`` to the router's answer confirming the
  removal;
* ``leaves_active``: the fleet takes a group out of ``active`` while its engine still runs (a
  failed weight update sends ``fail``; a drain or a stale version is the same to a router).
  Measured: requests that still reached that engine after the transition (its own counters)
  and the time of the last one, failed client requests, the removal's lag.

``--tail-s``: how long the run goes on after the kill or the transition (every attempt in it
is counted). Medians and p95 over ``--repeats`` (>= 5) runs per router, mode and scenario.
Writes ``benchmarks/results/router_sync_cpu.json`` (``--out``); every check is recorded there
and the script exits 1 when one is false. ``--smoke``: one short repeat, to a temporary file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "gateway"))
sys.path.insert(0, str(ROOT))

import fronts as F  # noqa: E402
import httpx  # noqa: E402
import loadgen as L  # noqa: E402
import stub_engine  # noqa: E402
from syn_counter import SynCounter  # noqa: E402

from rollsafe.adapters.engines.sglang import SGLangClient  # noqa: E402
from rollsafe.adapters.engines.vllm import VLLMClient  # noqa: E402
from rollsafe.fleet.health import HealthManager  # noqa: E402
from rollsafe.gateway import ExternalRouter  # noqa: E402
from rollsafe.gateway.router_sync import RouterSync  # noqa: E402
from rollsafe.registry import FleetListener, FleetRegistry, GroupTransition, WorkerGroup  # noqa: E402
from rollsafe.statemachines.events import GroupEvent  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "router_sync_cpu.json"
#: the source address of the fleet's own health probes (all of 127.0.0.0/8 is loopback)
FLEET_SOURCE = "127.0.0.2"
ROUTERS = ("sglang-router", "vllm-router")
MODES = ("router", "sync")
SCENARIOS = ("sigkill", "leaves_active")
WORKLOAD = {"sglang-router": "generate", "vllm-router": "completions"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="one short repeat, not the results")
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8, help="tokens per request")
    p.add_argument("--token-interval-ms", type=float, default=5.0)
    p.add_argument("--kill-at", type=float, default=2.0, help="s into the load")
    p.add_argument(
        "--tail-s",
        type=float,
        default=66.0,
        help="s of load after the kill (> 60: the routers try a dead worker again a minute on)",
    )
    p.add_argument(
        "--leave-tail-s", type=float, default=6.0, help="s of load after leaves_active's event"
    )
    p.add_argument("--burst-s", type=float, default=5.0, help="the first burst after the kill")
    p.add_argument("--no-make", action="store_true", help="do not run `make routers`")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.router_list = [r for r in args.routers.split(",") if r]
    if not args.router_list or set(args.router_list) - set(ROUTERS):
        p.error(f"--routers: a list of {list(ROUTERS)}; got {args.routers!r}")
    args.scenario_list = [s for s in args.scenarios.split(",") if s]
    if not args.scenario_list or set(args.scenario_list) - set(SCENARIOS):
        p.error(f"--scenarios: a list of {list(SCENARIOS)}; got {args.scenarios!r}")
    for name in ("repeats", "clients", "tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if min(args.kill_at, args.tail_s, args.leave_tail_s, args.burst_s) <= 0:
        p.error("--kill-at, --tail-s, --leave-tail-s and --burst-s must be > 0")
    if args.token_interval_ms < 0:
        p.error("--token-interval-ms must be >= 0")
    if args.smoke:
        args.repeats, args.kill_at, args.tail_s, args.leave_tail_s = 1, 1.0, 2.5, 2.5
        args.burst_s = min(args.burst_s, 2.0)
    elif args.repeats < 5:
        p.error("--repeats must be >= 5 for the results (medians and p95); --smoke for less")
    if args.out is None:
        args.out = (
            str(Path(tempfile.gettempdir()) / "rollsafe-router-sync-smoke.json")
            if args.smoke
            else str(RESULT)
        )
    return args


# --------------------------------------------------------------------------- one run


class Stub:
    def __init__(self, tmp: Path, tag: str, interval_ms: float) -> None:
        self.counters = tmp / f"{tag}.counters"
        cmd = [sys.executable, str(HERE / "gateway" / "stub_engine.py")]
        cmd += ["--counters", str(self.counters), "--token-interval-ms", str(interval_ms)]
        self.proc, ready = F.spawn(cmd, tmp / f"{tag}.log", stub_engine.READY_PREFIX)
        self.url: str = ready["url"]
        self.port = int(ready["port"])

    def arrived(self) -> int:
        c = stub_engine.read_counters(self.counters)
        return int(c["generate"] + c["completions"])

    def stop(self) -> None:
        F.kill_group(self.proc)


class LeftActive(FleetListener):
    """Records the wall time at which the victim group left ``active``, and the victim's
    arrival count then (a counter read: no I/O to speak of)."""

    def __init__(self, group_id: str, count: Any) -> None:
        self.group_id = group_id
        self.count = count
        self.at: float | None = None
        self.arrived_then: int | None = None

    def on_transition(self, group: WorkerGroup, record: GroupTransition) -> None:
        if group.group_id == self.group_id and record.left_routing and self.at is None:
            self.at = record.timestamp
            self.arrived_then = self.count()


class Arrivals:
    """Samples an engine's arrival counter every 5 ms on a thread: the wall times it rose."""

    def __init__(self, stub: Stub) -> None:
        self.stub = stub
        self.rises: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = self.stub.arrived()
        while not self._stop.wait(0.005):
            now = self.stub.arrived()
            if now > last:
                self.rises.append(time.time())
                last = now

    def __enter__(self) -> Arrivals:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2)


def one_run(
    kind: str, mode: str, scenario: str, args: argparse.Namespace, tmp: Path, tag: str
) -> dict[str, Any]:
    stubs = [Stub(tmp, f"{tag}-e{i}", args.token_interval_ms) for i in range(2)]
    victim = stubs[1]
    router: F.Router = F.SGLangRouter(tmp) if kind == "sglang-router" else F.VLLMRouter(tmp)
    client_cls = SGLangClient if kind == "sglang-router" else VLLMClient
    reg = FleetRegistry()
    # the fleet's probes leave from 127.0.0.2, so the SYN counter tells them from the router's
    clients = [
        client_cls(s.url, transport=httpx.HTTPTransport(local_address=FLEET_SOURCE)) for s in stubs
    ]
    for i, c in enumerate(clients):
        reg.add_group(f"g{i}", [i], clients=[c])
        reg.report_member(f"g{i}", i, healthy=True, weights_version=0)
        reg.send(f"g{i}", GroupEvent.LAUNCHED)
    left = LeftActive("g1", victim.arrived)
    reg.add_listener(left)
    health = HealthManager(reg)  # the fleet's defaults (HealthSettings)
    sync: RouterSync | None = None
    counter: SynCounter | None = None
    marks: dict[str, float] = {}
    try:
        router.start([s.url for s in stubs])
        health.start()
        if mode == "sync":
            sync = RouterSync(reg, ExternalRouter(router.url, kind))  # type: ignore[arg-type]
            sync.start()
            if not sync.wait_synced(30):
                raise RuntimeError(f"RouterSync not synced with {kind}: {sync.stats()}")
        if scenario == "sigkill":
            counter = SynCounter(victim.port).start()

        def on_start(_: float) -> None:
            def act() -> None:
                marks["wall"], marks["mono"] = time.time(), time.monotonic()
                if scenario == "sigkill":
                    os.kill(victim.proc.pid, signal.SIGKILL)
                else:  # what a failed weight update of this group sends
                    reg.send("g1", GroupEvent.FAIL)
                marks["send_returned_s"] = time.monotonic() - marks["mono"]

            asyncio.get_running_loop().call_later(args.kill_at, act)

        with Arrivals(victim) as arrivals:
            stats = asyncio.run(
                L.closed_loop(
                    [router.url],
                    WORKLOAD[kind],
                    concurrency=args.clients,
                    duration=args.kill_at
                    + (args.tail_s if scenario == "sigkill" else args.leave_tail_s),
                    tokens=args.tokens,
                    warmup=0.5,
                    pause_after_failure=0.01,
                    on_start=on_start,
                )
            )
        if counter is not None:
            counter.stop()
        s = stats.summary()
        out: dict[str, Any] = {
            "requests": s["requests"],
            "ok": s["ok"],
            "failed": s["failed"] + s["cut"],
            "errors": s["errors"],
            "acted": "wall" in marks,
            "left_active": left.at is not None,
        }
        t_act = marks.get("wall")
        if t_act is not None and left.at is not None and scenario == "sigkill":
            out["detection_s"] = round(left.at - t_act, 3)  # the fleet's HealthManager
        if sync is not None:
            st = sync.stats()
            out["sync"] = {k: st[k] for k in ("adds", "removes", "failures", "last_error")}
            lag = st["last_removal_lag_s"]
            out["removal_lag_s"] = None if lag is None else round(lag, 4)
            out["victim_listed_at_end"] = victim.url in (
                {w["url"] for w in router.workers()} if router.proc is not None else set()
            )
        if scenario == "sigkill" and counter is not None:
            if counter.error:
                out["attempts_error"] = counter.error
                out["attempts_after_kill"] = None
            else:
                after, fleet_probes = [], 0
                for t, src in zip(counter.times, counter.sources, strict=False):
                    if t_act and t > marks["mono"]:
                        if src == FLEET_SOURCE:
                            fleet_probes += 1
                        else:
                            after.append(t - marks["mono"])
                out["attempts_after_kill"] = len(after)
                burst = [a for a in after if a <= args.burst_s]
                out["burst_attempts"] = len(burst)
                out["burst_end_s"] = round(max(burst), 3) if burst else None
                out["later_attempts"] = len(after) - len(burst)
                out["fleet_probes_after_kill"] = fleet_probes
                out["last_attempt_after_kill_s"] = round(max(after), 3) if after else None
        if scenario == "leaves_active" and left.at is not None:
            after_t = [t - left.at for t in arrivals.rises if t > left.at]
            out["send_returned_s"] = round(marks.get("send_returned_s", -1), 4)
            out["requests_after_transition"] = victim.arrived() - (left.arrived_then or 0)
            # the sampler sees a rise up to 5 ms late: a request that arrived just before the
            # transition can show after it; with none counted after, there is no last one
            late = after_t and out["requests_after_transition"] > 0
            out["last_request_after_transition_s"] = round(max(after_t), 3) if late else None
            if sync is not None and out.get("removal_lag_s") is not None:
                confirmed = left.at + out["removal_lag_s"]
                out["requests_after_confirmation"] = sum(t > confirmed for t in arrivals.rises)
        return out
    finally:
        if counter is not None:
            counter.stop()
        if sync is not None:
            sync.close()
        health.stop()
        reg.remove_listener(left)
        router.stop()
        for c in clients:
            with contextlib.suppress(Exception):
                c.close()
        for s in stubs:
            s.stop()


# --------------------------------------------------------------------------- summary


def _med(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def _p95(values: list[float]) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return round(v[max(0, min(len(v) - 1, round(0.95 * len(v) + 0.5) - 1))], 4)


SUMMARIZED = (
    "attempts_after_kill",
    "burst_attempts",
    "burst_end_s",
    "later_attempts",
    "last_attempt_after_kill_s",
    "requests_after_transition",
    "last_request_after_transition_s",
    "requests_after_confirmation",
    "failed",
    "detection_s",
    "removal_lag_s",
    "send_returned_s",
)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"n": len(runs)}
    for key in SUMMARIZED:
        vals = [r[key] for r in runs if r.get(key) is not None]
        present = [r for r in runs if key in r]
        if not present:
            continue
        out[key] = {"median": _med(vals), "p95": _p95(vals), "n": len(vals)}
        if key.startswith("last_") or key.endswith("_end_s"):
            out[key]["runs_with_none"] = len(present) - len(vals)
    return out


def make_routers(args: argparse.Namespace) -> tuple[bool, str]:
    if args.smoke or args.no_make:
        return F.ROUTERS_PYTHON.exists(), "not run (--smoke/--no-make)"
    done = subprocess.run(["make", "routers"], cwd=ROOT, capture_output=True, text=True)
    return done.returncode == 0, (done.stdout + done.stderr)[-500:]


def add_checks(results: dict[str, Any], args: argparse.Namespace, checks: dict[str, bool]) -> None:
    runs = results["runs"]
    for kind, by_s in runs.items():
        for scenario, by_m in by_s.items():
            for mode, rs in by_m.items():
                tag = f"{kind} {scenario} {mode}"
                checks[f"{tag}: acted in every run"] = all(r.get("acted") for r in rs)
                checks[f"{tag}: the group left active in every run"] = all(
                    r.get("left_active") for r in rs
                )
                if scenario == "sigkill" and not (
                    args.smoke and any(r.get("attempts_error") for r in rs)
                ):
                    checks[f"{tag}: connection attempts counted"] = all(
                        r.get("attempts_after_kill") is not None for r in rs
                    )
                if mode == "sync":
                    checks[f"{tag}: every removal confirmed by the router"] = all(
                        r.get("removal_lag_s") is not None and not r.get("victim_listed_at_end")
                        for r in rs
                    )
                    checks[f"{tag}: no failed call to the router"] = all(
                        r["sync"]["failures"] == 0 for r in rs
                    )
            long_tail = args.tail_s > args.burst_s + 60
            if scenario == "sigkill" and long_tail and {"router", "sync"} <= set(by_m):
                checks[
                    f"{kind} sigkill: the router alone tried the dead engine again after its "
                    "first burst (self-test: health checks and circuit breaker, a minute on)"
                ] = all((r.get("later_attempts") or 0) > 0 for r in by_m["router"])
                checks[
                    f"{kind} sigkill: with the sync, no attempt after the first burst in any run"
                ] = all(r.get("later_attempts") == 0 for r in by_m["sync"])
            if scenario == "leaves_active" and {"router", "sync"} <= set(by_m):
                alone = results["summary"][kind][scenario]["router"]
                synced = results["summary"][kind][scenario]["sync"]
                a = alone["requests_after_transition"]["median"] or 0
                b = synced["requests_after_transition"]["median"] or 0
                checks[
                    f"{kind} leaves_active: the router alone kept sending to the group "
                    "(self-test: a group out of active gets traffic without the sync)"
                ] = a > 0
                checks[
                    f"{kind} leaves_active: with the sync, < 10% of the requests the router "
                    "alone sent after the transition"
                ] = b < 0.1 * a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    F.raise_own_nofile()
    checks: dict[str, bool] = {}
    load = os.getloadavg()
    results: dict[str, Any] = {
        "benchmark": "router_sync",
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_1min_at_start": round(load[0], 2),
            "platform": platform.platform(),
        },
        "config": {
            k: v for k, v in vars(args).items() if k not in ("router_list", "scenario_list")
        },
        "fleet_health": "HealthManager defaults: probe every 0.5 s, 2 s timeout, 2 failures",
        "runs": {},
    }
    ok, log = make_routers(args)
    results["make_routers"] = log
    checks["routers installed (make routers)"] = ok
    tmp = Path(tempfile.mkdtemp(prefix="rollsafe-bench-router-sync-"))
    t0 = time.monotonic()
    try:
        if ok:
            for rep in range(args.repeats):
                for kind in args.router_list:
                    for scenario in args.scenario_list:
                        for mode in MODES:
                            tag = f"r{rep}-{kind}-{scenario}-{mode}"
                            print(f"{tag} ...", flush=True)
                            try:
                                r = one_run(kind, mode, scenario, args, tmp, tag)
                            except (F.FrontUnavailable, RuntimeError) as exc:
                                r = {"error": str(exc)}
                                checks[f"{tag}: ran"] = False
                            results["runs"].setdefault(kind, {}).setdefault(
                                scenario, {}
                            ).setdefault(mode, []).append(r)
        results["summary"] = {
            kind: {
                sc: {mode: summarize(rs) for mode, rs in by_m.items()} for sc, by_m in by_s.items()
            }
            for kind, by_s in results["runs"].items()
        }
        add_checks(results, args, checks)
    finally:
        results["wall_s"] = round(time.monotonic() - t0, 1)
        results["checks"] = checks
        results["failed_checks"] = sorted(k for k, v in checks.items() if not v)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2, default=str) + "\n")
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    print_table(results)
    print(f"wrote {args.out}; {len(checks)} checks, {len(results['failed_checks'])} false")
    for k in results["failed_checks"]:
        print(f"  FALSE: {k}")
    return 1 if results["failed_checks"] else 0


def _fmt(s: dict[str, Any], key: str, unit: str = "") -> str:
    v = s.get(key)
    if not v or v["median"] is None:
        return "-"
    return f"{v['median']:g}{unit} / {v['p95']:g}{unit}"


def print_table(results: dict[str, Any]) -> None:
    for kind, by_s in results.get("summary", {}).items():
        for scenario, by_m in by_s.items():
            for mode, s in by_m.items():
                if scenario == "sigkill":
                    sent, last = "attempts_after_kill", "last_attempt_after_kill_s"
                    print(
                        f"{kind:14} {scenario:14} {mode:7} first burst: "
                        f"{_fmt(s, 'burst_attempts')} attempts, ending "
                        f"{_fmt(s, 'burst_end_s', ' s')}; later: {_fmt(s, 'later_attempts')}"
                    )
                else:
                    sent, last = "requests_after_transition", "last_request_after_transition_s"
                print(
                    f"{kind:14} {scenario:14} {mode:7} sent to it after: {_fmt(s, sent):14} "
                    f"last: {_fmt(s, last, ' s'):18} failed: {_fmt(s, 'failed'):8} "
                    f"detect: {_fmt(s, 'detection_s', ' s'):16} "
                    f"lag: {_fmt(s, 'removal_lag_s', ' s')}"
                )


if __name__ == "__main__":
    sys.exit(main())

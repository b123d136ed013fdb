"""Benchmark what sits between RL clients and the engines (issue #35, item 7), on the 2-core
CPU machine, everything in one run so the figures are ratios within it.

Fronts (``benchmarks/gateway/fronts.py``): ``direct`` (the client round-robins over the
engines), ``sglang-router`` 0.3.2 and ``vllm-router`` 0.1.17 (``make routers``, which this
script runs), rollsafe's ``gateway`` (``benchmarks/gateway/gateway_front.py``: registry,
router, data plane, health probes and request health, the gateway on uvloop, in a process of
its own; warmed by one request when started), and the server-stack candidates
for the gateway (``proxy-aiohttp``, ``proxy-aiohttp-uvloop``, ``proxy-starlette``,
``proxy-raw``: ``benchmarks/gateway/proxy_*.py``). Engines: two zero-work stubs
(``benchmarks/gateway/stub_engine.py``: a front's own cost, isolated) and, with ``--engines
stub,reference``, two reference engines (the tiny Llama).

Phases, each front in turn within every repeat (throughput and latency: one workload at a
time, the fronts back to back, their order reversed every other repeat: ``round_order``):

1. ``client_cost``: the load generator itself, aiohttp vs httpx, direct on the stubs;
2. ``throughput``: closed loop, ``--concurrency`` clients (swept), short non-streamed requests
   and streams of ``--tokens`` tokens: requests/s at saturation, CPU per request of the front;
3. ``latency``: open loop at ``--latency-frac`` of the slowest front's saturation rate:
   p50/p99 and what each adds over direct, timed in the same run (every other request of a
   front's run goes direct: the machine's speed, which drifts between runs, is then the same
   for both; ``summarize_latency``); ``--latency-duration`` s a run on the stubs,
   ``--reference-latency-duration`` (15) on the reference engines, where 3 s gave each side ~40
   requests of 13 to 27 ms and the routers' own added p50 moved by 3 ms between runs;
4. ``worker_api`` (routers): add a worker and remove one through the router's own API under
   load; how long until the added one gets traffic and the removed one stops getting it;
5. ``open_streams``: ``--streams`` streams held open through the front (stubs that send a
   token every 5 s): the front's RSS before and with them open (9,900 by default: a front holds
   two sockets per stream and this machine allows a process 20,000 open files);
6. ``crash``: ``--crash-clients`` clients (streams, then short requests) while one of the two
   stubs is SIGKILLed (at ``--crash-at`` s, or later, once the victim has a request in flight:
   a front under load may not have sent it one yet; ``killed_after_s``): whole / cut / failed
   requests, tokens the dead engine had generated for requests it never finished (regenerated
   by whoever retries them), tokens clients had
   received in cut streams, and connection attempts to the dead engine's port after the kill
   (SYN packets on ``lo``: ``benchmarks/gateway/syn_counter.py``; its port refuses them);
7. ``reference``: phases 2-3 and 6 again on two reference engines (SGLang dialect behind
   sglang-router, vLLM dialect behind vllm-router; the gateway with clients of the engines'
   dialect and the tiny model's tokenizer). Phases 2-3 there run with ``--reference-cpus
   split`` (the default): the engines on the last CPU, the fronts and the client on the
   others, so a front's CPU does not come out of the engines' (on a GPU host the engine's
   work is on the GPU; on two shared cores every front, the Rust routers too, added 2.5 to
   3 ms p50 there, most of it the engines' lost CPU); ``shared`` runs every process on every
   CPU. The split is recorded in ``reference.cpus``.

The gateway's own books (its router's continuation counters, request health, the groups'
states) are read when it stops: ``gateway_books`` per phase, ``gateway`` per crash run (there,
on the stubs, the tokens it regenerated are the dead engine's unfinished tokens it did not
receive; the others are carried into the continuation). Issue #35's targets for the gateway
are checks (``gateway_targets``).

Writes ``benchmarks/results/gateway_cpu.json`` (``--out``); every check is recorded there and
the script exits 1 when one is false. ``--smoke``: seconds, not minutes, on the stubs only
(direct, the gateway, ``proxy-aiohttp`` and the routers where ``.venv-routers`` exists), to
another file.
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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "gateway"))

import fronts as F  # noqa: E402
import loadgen as L  # noqa: E402
import stub_engine  # noqa: E402
from syn_counter import SynCounter  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "gateway_cpu.json"
#: seen by hand (issue #35): 8 streaming clients behind sglang-router, one of two engines SIGKILLed
ISSUE_BASELINE = {"front": "sglang-router", "clients": 8, "whole": 486, "cut": 6}
STREAM_WORKLOAD = {"generate": "generate-stream", "completions": "completions-stream"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="seconds on the stubs, not the results")
    p.add_argument("--fronts", default=",".join(F.FRONT_NAMES))
    p.add_argument("--engines", default="stub,reference")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--duration", type=float, default=3.0, help="seconds per throughput run")
    p.add_argument("--concurrency", default="16,64", help="closed-loop clients, swept")
    p.add_argument("--tokens", type=int, default=16, help="tokens per request")
    p.add_argument("--latency-frac", type=float, default=0.25)
    p.add_argument("--latency-duration", type=float, default=3.0)
    # the reference engines serve 60 to 130 requests a second, 13 to 27 ms each: 3 s at a
    # quarter of that is ~40 requests a side, whose median moved by 3 ms between runs
    p.add_argument(
        "--reference-latency-duration",
        type=float,
        default=15.0,
        help="seconds per latency run on the reference engines",
    )
    p.add_argument(
        "--reference-cpus",
        choices=("split", "shared"),
        default="split",
        help="the reference phase's CPUs: split (the engines on the last CPU, the fronts and "
        "the client on the others: a front's CPU does not come out of the engines', as on a "
        "GPU host) or shared (every process on every CPU)",
    )
    # 9,900, not 10,000: a front holds each stream twice (client side and engine side) and this
    # machine's hard limit on open files per process is 20,000 (RLIMIT_NOFILE, not raisable)
    p.add_argument("--streams", type=int, default=9_900)
    p.add_argument("--crash-clients", type=int, default=8)
    p.add_argument("--crash-duration", type=float, default=10.0)
    p.add_argument("--crash-at", type=float, default=3.0)
    p.add_argument("--crash-tokens", type=int, default=32)
    p.add_argument("--crash-token-interval-ms", type=float, default=20.0)
    p.add_argument("--proxy-python", default=sys.executable)
    p.add_argument("--no-make", action="store_true", help="do not run `make routers`")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    names = [n for n in args.fronts.split(",") if n]
    unknown = sorted(set(names) - set(F.FRONT_NAMES))
    if unknown:
        p.error(f"unknown fronts {unknown}; known: {list(F.FRONT_NAMES)}")
    if "direct" not in names:
        p.error("--fronts must include direct (the baseline)")
    args.front_names = names
    engines = [e for e in args.engines.split(",") if e]
    if not engines or set(engines) - {"stub", "reference"}:
        p.error(f"--engines: a list of stub, reference; got {args.engines!r}")
    args.engine_kinds = engines
    try:
        args.concurrency_list = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        p.error(f"--concurrency: integers separated by commas, got {args.concurrency!r}")
    for name in ("repeats", "tokens", "streams", "crash_clients", "crash_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.concurrency_list) < 1:
        p.error("--concurrency values must be >= 1")
    if args.latency_duration <= 0 or args.reference_latency_duration <= 0:
        p.error("--latency-duration and --reference-latency-duration must be > 0")
    if not 0 < args.latency_frac <= 1:
        p.error("--latency-frac must be in (0, 1]")
    if not 0 < args.crash_at < args.crash_duration:
        p.error("--crash-at must be inside (0, --crash-duration)")
    if args.smoke:
        args.engine_kinds = ["stub"]
        args.repeats, args.duration, args.latency_duration = 1, 0.5, 0.5
        args.concurrency_list = [4]
        args.streams = min(args.streams, 200)
        args.crash_duration, args.crash_at, args.crash_clients = 2.0, 0.7, 4
        args.crash_tokens = 16
        if args.fronts == ",".join(F.FRONT_NAMES):
            args.front_names = ["direct", "gateway", "proxy-aiohttp"] + (
                ["sglang-router", "vllm-router"] if F.ROUTERS_PYTHON.exists() else []
            )
    if args.out is None:
        args.out = (
            str(Path(tempfile.gettempdir()) / "rollsafe-gateway-smoke.json")
            if args.smoke
            else str(RESULT)
        )
    return args


# --------------------------------------------------------------------------- engines


@dataclass
class Engine:
    proc: subprocess.Popen[str]
    url: str
    counters: Path | None

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def read(self) -> dict[str, int]:
        assert self.counters is not None
        return stub_engine.read_counters(self.counters)

    def kill(self) -> None:
        F.kill_group(self.proc)


def start_stubs(tmp: Path, tag: str, interval_ms: float = 0.0, n: int = 2) -> list[Engine]:
    out = []
    for i in range(n):
        counters = tmp / f"{tag}-{i}.counters"
        cmd = [sys.executable, str(HERE / "gateway" / "stub_engine.py")]
        cmd += ["--counters", str(counters), "--token-interval-ms", str(interval_ms)]
        proc, ready = F.spawn(cmd, tmp / f"{tag}-{i}.log", stub_engine.READY_PREFIX)
        out.append(Engine(proc, ready["url"], counters))
    return out


def start_reference(
    tmp: Path, model: Path, dialect: str, n: int = 2, cpus: set[int] | None = None
) -> list[Engine]:
    from rollsafe.wire.lines import READY_PREFIX

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    out = []
    for i in range(n):
        cmd = [sys.executable, "-m", "rollsafe.adapters.reference_engine"]
        cmd += ["--model-path", str(model), "--ranks", "1", "--dialect", dialect]
        log = tmp / f"ref-{dialect}-{i}.log"
        proc, ready = F.spawn(cmd, log, READY_PREFIX, 180, env, cpus=cpus)
        out.append(Engine(proc, ready["url"], None))
    return out


def stop_all(engines: list[Engine]) -> None:
    for e in engines:
        e.kill()


def served(engines: list[Engine]) -> int:
    """Generation requests the stubs received (any route)."""
    return sum(c["generate"] + c["completions"] + c["chat"] for c in (e.read() for e in engines))


# --------------------------------------------------------------------------- measuring


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def measure_closed(
    front: F.Front, engines: list[Engine], workload: str, concurrency: int, args: argparse.Namespace
) -> dict[str, Any]:
    stubs = [e for e in engines if e.counters is not None]
    before = served(stubs) if stubs else 0
    bad_before = sum(e.read()["bad_request"] for e in stubs)
    pids = front.pids
    engine_pids = [p for e in engines for p in F.descendants(e.proc.pid)]
    cpu0, eng0, own0 = F.cpu_seconds(pids), F.cpu_seconds(engine_pids), time.process_time()
    stats = run(
        L.closed_loop(
            front.urls,
            workload,
            concurrency=concurrency,
            duration=args.duration,
            tokens=args.tokens,
        )
    )
    cpu1, eng1, own1 = F.cpu_seconds(pids), F.cpu_seconds(engine_pids), time.process_time()
    s = stats.summary()
    n = max(1, stats.sent)
    s["concurrency"] = concurrency
    s["front_cpu_us_per_req"] = round((cpu1 - cpu0) / n * 1e6, 1) if pids else 0.0
    s["engines_cpu_us_per_req"] = round((eng1 - eng0) / n * 1e6, 1)
    s["client_cpu_us_per_req"] = round((own1 - own0) / n * 1e6, 1)
    if stubs:
        s["engine_received"] = served(stubs) - before
        s["engine_bad_request"] = sum(e.read()["bad_request"] for e in stubs) - bad_before
    return s


def measure_open(
    front: F.Front,
    workload: str,
    rate: float,
    args: argparse.Namespace,
    pair: F.Front | None = None,
) -> dict[str, Any]:
    """One open-loop run through ``front``; with ``pair`` (direct), every other request goes
    through ``pair`` in the same run (``paired_direct``: what ``summarize_latency`` subtracts)."""
    stats = run(
        L.open_loop(
            front.urls,
            workload,
            rate=rate,
            duration=args.latency_duration,
            tokens=args.tokens,
            pair_urls=None if pair is None else pair.urls,
        )
    )
    s = stats.summary()
    s["rate"] = round(rate, 1)
    if stats.paired is not None:
        p = stats.paired.summary()
        s["paired_direct"] = {
            k: p[k] for k in ("requests", "ok", "failed", "cut", "p50_ms", "p99_ms")
        }
    return s


async def _httpx_closed(urls: list[str], concurrency: int, duration: float, tokens: int) -> L.Stats:
    import itertools

    import httpx

    body = json.dumps(L.request_body("generate", False, tokens)).encode()
    rr = itertools.cycle(urls)
    stats = L.Stats()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=30) as c:
        stop_at = time.perf_counter() + duration
        t0 = time.perf_counter()

        async def client() -> None:
            while time.perf_counter() < stop_at:
                stats.sent += 1
                t = time.perf_counter()
                r = await c.post(
                    next(rr) + "/generate",
                    content=body,
                    headers={"content-type": "application/json"},
                )
                kind = "ok" if r.status_code == 200 else "failed"
                stats.add(L.Outcome(kind, time.perf_counter() - t, None, 0, r.status_code))

        await asyncio.gather(*(client() for _ in range(concurrency)))
        stats.wall_s = time.perf_counter() - t0
    return stats


def client_cost(engines: list[Engine], args: argparse.Namespace) -> dict[str, Any]:
    urls = [e.url for e in engines]
    n = max(args.concurrency_list)
    out: dict[str, Any] = {}
    for _ in range(args.repeats):
        for name in ("aiohttp", "httpx"):
            own0 = time.process_time()
            if name == "aiohttp":
                st = run(
                    L.closed_loop(
                        urls,
                        "generate",
                        concurrency=n,
                        duration=args.duration,
                        tokens=args.tokens,
                        warmup=0,
                    )
                )
            else:
                st = run(_httpx_closed(urls, n, args.duration, args.tokens))
            cpu = time.process_time() - own0
            s = st.summary()
            out.setdefault(name, []).append(
                {
                    "req_per_s": s["req_per_s"],
                    "cpu_us_per_req": round(cpu / max(1, st.sent) * 1e6, 1),
                    "failed": s["failed"],
                }
            )
    summary = {
        name: {
            "req_per_s_median": statistics.median(r["req_per_s"] for r in runs),
            "cpu_us_per_req_median": statistics.median(r["cpu_us_per_req"] for r in runs),
            "runs": runs,
        }
        for name, runs in out.items()
    }
    summary["concurrency"] = n
    return summary


def workloads_of(front: F.Front) -> list[str]:
    return [w for w, (api, _) in L.WORKLOADS.items() if api in front.apis]


def round_order(fronts: list[F.Front], r: int) -> list[tuple[str, F.Front]]:
    """Round ``r``'s runs, one workload at a time (the fronts compared on it run back to back,
    minutes of drift on a shared machine falling on all of them alike), the fronts in their
    order on even rounds and reversed on odd ones (none always runs first or right after a
    given one)."""
    order = fronts if r % 2 == 0 else list(reversed(fronts))
    return [(w, f) for w in L.WORKLOADS for f in order if w in workloads_of(f)]


def throughput_and_latency(
    fronts: list[F.Front], engines: list[Engine], args: argparse.Namespace, results: dict[str, Any]
) -> None:
    for f in fronts:
        f.start([e.url for e in engines])
    try:
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for r in range(args.repeats):
            for w, f in round_order(fronts, r):
                for c in args.concurrency_list:
                    runs.setdefault(f.name, {}).setdefault(w, []).append(
                        measure_closed(f, engines, w, c, args)
                    )
        results["throughput"] = summarize_throughput(runs)
        rates = {}
        for w in L.WORKLOADS:
            best = [
                results["throughput"][f][w]["best_req_per_s"]
                for f in results["throughput"]
                if w in results["throughput"][f]
            ]
            if best:
                rates[w] = args.latency_frac * min(best)
        lat: dict[str, dict[str, list[dict[str, Any]]]] = {}
        direct = next((f for f in fronts if f.name == "direct"), None)
        for r in range(args.repeats):
            for w, f in round_order(fronts, r):
                pair = direct if direct is not None and f is not direct else None
                lat.setdefault(f.name, {}).setdefault(w, []).append(
                    measure_open(f, w, rates[w], args, pair)
                )
        results["latency"] = summarize_latency(lat)
        results["throughput_runs"] = runs
        results["latency_runs"] = lat
        keys = {}
        for e in engines:
            if e.counters is not None:
                _, text = F.http("GET", e.url + "/stub/stats")
                for route, seen in json.loads(text).get("keys_seen", {}).items():
                    keys.setdefault(route, set()).update(seen)
        results["keys_seen_by_engines"] = {r: sorted(k) for r, k in keys.items()}
    finally:
        for f in fronts:
            f.stop()
    for f in fronts:
        if isinstance(f, F.Gateway):  # its own books of the whole phase
            results["gateway_books"] = f.last_stats


def _med(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def _p95(values: list[float]) -> float:
    v = sorted(values)
    return round(v[max(0, min(len(v) - 1, round(0.95 * len(v) + 0.5) - 1))], 3)


def summarize_throughput(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for front, by_w in runs.items():
        for w, rs in by_w.items():
            by_c: dict[int, list[dict[str, Any]]] = {}
            for r in rs:
                by_c.setdefault(r["concurrency"], []).append(r)
            per_c = {
                c: {
                    "req_per_s_median": _med([r["req_per_s"] for r in v]),
                    "req_per_s_p95": _p95([r["req_per_s"] for r in v]),
                    "front_cpu_us_per_req_median": _med([r["front_cpu_us_per_req"] for r in v]),
                    "n": len(v),
                }
                for c, v in sorted(by_c.items())
            }
            best_c = max(per_c, key=lambda c: per_c[c]["req_per_s_median"])
            out.setdefault(front, {})[w] = {
                "best_concurrency": best_c,
                "best_req_per_s": per_c[best_c]["req_per_s_median"],
                "best_req_per_s_p95": per_c[best_c]["req_per_s_p95"],
                "front_cpu_us_per_req": per_c[best_c]["front_cpu_us_per_req_median"],
                "by_concurrency": per_c,
            }
    for by_w in out.values():
        for w, s in by_w.items():
            d = out.get("direct", {}).get(w)
            s["vs_direct"] = round(s["best_req_per_s"] / d["best_req_per_s"], 3) if d else None
    return out


def summarize_latency(lat: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for front, by_w in lat.items():
        for w, rs in by_w.items():
            s = {
                "rate": rs[0]["rate"],
                "p50_ms": _med([r["p50_ms"] for r in rs if r["p50_ms"] is not None] or [0.0]),
                "p99_ms": _med([r["p99_ms"] for r in rs if r["p99_ms"] is not None] or [0.0]),
                "p50_ms_p95": _p95([r["p50_ms"] for r in rs if r["p50_ms"] is not None] or [0.0]),
                "p99_ms_p95": _p95([r["p99_ms"] for r in rs if r["p99_ms"] is not None] or [0.0]),
                "failed": sum(r["failed"] + r["cut"] for r in rs),
                "n": len(rs),
            }
            out.setdefault(front, {})[w] = s
    for front, by_w in out.items():
        for w, s in by_w.items():
            rs = lat[front][w]
            pairs = [r for r in rs if r.get("paired_direct") and r["p50_ms"] is not None]
            if pairs and len(pairs) == len(rs):  # timed beside direct in each run
                for q in ("p50", "p99"):
                    added = [r[f"{q}_ms"] - r["paired_direct"][f"{q}_ms"] for r in pairs]
                    s[f"added_{q}_ms"] = _med(added)
                s["added_from"] = "paired"
                s["failed"] += sum(
                    r["paired_direct"]["failed"] + r["paired_direct"]["cut"] for r in rs
                )
                continue
            d = out.get("direct", {}).get(w)
            if d:
                s["added_p50_ms"] = round(s["p50_ms"] - d["p50_ms"], 3)
                s["added_p99_ms"] = round(s["p99_ms"] - d["p99_ms"], 3)
                s["added_from"] = "rounds"
    return out


# --------------------------------------------------------------------------- worker API


async def _watch(engine: Engine, since: float, until: float) -> list[float]:
    """Times at which ``engine``'s served count rose, polled every 10 ms until ``until``."""
    last = served([engine])
    rises = []
    while time.monotonic() < until:
        await asyncio.sleep(0.01)
        now = served([engine])
        if now > last:
            rises.append(time.monotonic() - since)
            last = now
    return rises


async def _worker_api(router: F.Router, a: Engine, b: Engine, settle: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    w = "generate" if "generate" in router.apis else "completions"
    stop = asyncio.Event()
    body = json.dumps(L.request_body(L.WORKLOADS[w][0], False, 4)).encode()
    failures = 0

    async def load() -> None:
        nonlocal failures
        async with L.session() as s:
            while not stop.is_set():
                o = await L.one_request(s, router.url, L.WORKLOADS[w][0], False, body)
                failures += o.kind != "ok"

    tasks = [asyncio.ensure_future(load()) for _ in range(4)]
    await asyncio.sleep(0.3)
    out: dict[str, Any] = {}
    b_before = served([b])
    t_add = time.monotonic()
    out["add"] = await loop.run_in_executor(None, router.add_worker, b.url)
    out["add"]["answered_s"] = round(time.monotonic() - t_add, 3)
    deadline = t_add + settle
    first_b = None
    while time.monotonic() < deadline:
        if served([b]) > b_before:
            first_b = time.monotonic() - t_add
            break
        await asyncio.sleep(0.01)
    out["add"]["first_request_s"] = None if first_b is None else round(first_b, 3)
    out["workers_after_add"] = await loop.run_in_executor(None, router.workers)
    await asyncio.sleep(0.3)
    t_rm = time.monotonic()
    a_at_call = served([a])
    out["remove"] = await loop.run_in_executor(None, router.remove_worker, a.url)
    answered = time.monotonic() - t_rm
    a_at_answer = served([a])
    rises = await _watch(a, t_rm, t_rm + settle)
    out["remove"].update(
        {
            "answered_s": round(answered, 3),
            "requests_during_call": a_at_answer - a_at_call,
            "requests_after_answer": served([a]) - a_at_answer,
            "last_request_after_call_s": round(rises[-1], 3) if rises else None,
        }
    )
    out["workers_after_remove"] = await loop.run_in_executor(None, router.workers)
    stop.set()
    await asyncio.gather(*tasks)
    out["failed_requests"] = failures
    return out


def worker_api(
    names: list[str], tmp: Path, args: argparse.Namespace, checks: dict[str, bool]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        router = F.make_front(name, tmp)
        assert isinstance(router, F.Router)
        a, b = start_stubs(tmp, f"wapi-{name}")
        try:
            router.start([a.url])
            r = run(_worker_api(router, a, b, settle=3.0 if args.smoke else 10.0))
            out[name] = r
            checks[f"worker_api {name}: added worker got traffic"] = (
                r["add"]["first_request_s"] is not None
            )
            checks[f"worker_api {name}: removed worker stopped getting traffic"] = (
                r["remove"]["requests_after_answer"] == 0
                or (r["remove"]["last_request_after_call_s"] or 0)
                < (3.0 if args.smoke else 10.0) - 1
            )
        finally:
            router.stop()
            stop_all([a, b])
    return out


# --------------------------------------------------------------------------- open streams


def open_streams(
    names: list[str], tmp: Path, args: argparse.Namespace, checks: dict[str, bool]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        front = F.make_front(name, tmp)
        engines = start_stubs(tmp, f"open-{name}", interval_ms=5000)
        try:
            front.start([e.url for e in engines])
            w = STREAM_WORKLOAD["generate" if "generate" in front.apis else "completions"]
            run(
                L.closed_loop(
                    front.urls,
                    w.replace("-stream", ""),
                    concurrency=4,
                    duration=0.3,
                    tokens=4,
                    warmup=0,
                )
            )
            time.sleep(0.5)
            idle = F.rss_bytes(front.pids)
            idle_fds = F.open_fds(front.pids)

            def at_open(front: F.Front = front, engines: list[Engine] = engines) -> dict[str, int]:
                return {
                    "front_rss": F.rss_bytes(front.pids),
                    "front_fds": F.open_fds(front.pids),
                    "engines_rss": F.rss_bytes([e.proc.pid for e in engines]),
                }

            r = run(
                L.open_streams(
                    front.urls, w, count=args.streams, tokens=100_000, while_open=at_open
                )
            )
            at = r.pop("at_open") or {}
            r["front_rss_idle_mb"] = round(idle / 2**20, 1)
            if at:
                r["front_rss_open_mb"] = round(at["front_rss"] / 2**20, 1)
                r["front_kb_per_stream"] = round((at["front_rss"] - idle) / 1024 / r["opened"], 2)
                r["front_fds_idle"], r["front_fds_open"] = idle_fds, at["front_fds"]
                r["front_fds_per_stream"] = round((at["front_fds"] - idle_fds) / r["opened"], 3)
                r["engines_rss_open_mb"] = round(at["engines_rss"] / 2**20, 1)
            out[name] = r
            if name.startswith("proxy-"):  # a candidate: how many it held is the finding
                checks[f"open_streams {name}: no stream failed"] = not r["failed"]
            else:
                checks[f"open_streams {name}: all {args.streams} streams open"] = (
                    r["opened"] == args.streams
                )
        except F.FrontUnavailable as exc:
            out[name] = {"unavailable": str(exc)}
            checks[f"open_streams {name}: started"] = False
        finally:
            front.stop()
            stop_all(engines)
    return out


# --------------------------------------------------------------------------- crash


def _in_flight(counters: dict[str, int], tokens: int) -> int:
    """Requests a stub was sent and has not finished (each of ``tokens`` tokens)."""
    return counters["generate"] + counters["completions"] - counters["tokens_in_finished"] // tokens


def crash_one(
    name: str,
    workload: str,
    engines: list[Engine],
    front: F.Front,
    args: argparse.Namespace,
    tmp: Path,
) -> dict[str, Any]:
    victim = engines[1]
    counter = SynCounter(victim.port).start()
    killed: dict[str, float] = {}

    # the kill waits, past --crash-at, until the victim has a request in flight (a stub
    # counts what it was sent): a front under load may not have sent it one yet, and a kill
    # of an idle engine measures nothing (the check "requests in flight at the kill")
    last_kill_at = args.crash_at + max(0.0, args.crash_duration - args.crash_at) / 2

    def on_start(_: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + last_kill_at

        def kill() -> None:
            idle = victim.counters is not None and _in_flight(victim.read(), args.crash_tokens) == 0
            if idle and loop.time() < deadline:
                loop.call_later(0.02, kill)
                return
            killed["at"] = time.monotonic()
            killed["after_s"] = loop.time() - (deadline - last_kill_at)
            os.kill(victim.proc.pid, signal.SIGKILL)

        loop.call_later(args.crash_at, kill)

    try:
        stats = run(
            L.closed_loop(
                front.urls,
                workload,
                concurrency=args.crash_clients,
                duration=args.crash_duration,
                tokens=args.crash_tokens,
                warmup=0,
                pause_after_failure=0.01,
                on_start=on_start,
            )
        )
    finally:
        counter.stop()
    with contextlib.suppress(subprocess.TimeoutExpired):
        victim.proc.wait(timeout=5)
    s = stats.summary()
    out: dict[str, Any] = {
        "workload": workload,
        "whole": s["ok"],
        "cut": s["cut"],
        "failed": s["failed"],
        "errors": s["errors"],
        "tokens_received_in_cut": s["tokens_in_cut"],
        "killed_after_s": round(killed["after_s"], 3) if "after_s" in killed else None,
    }
    if victim.counters is not None:
        dead = victim.read()
        out["dead_engine_at_kill"] = {
            "in_flight": _in_flight(dead, args.crash_tokens),
            "tokens_generated_unfinished": dead["tokens_generated"] - dead["tokens_in_finished"],
        }
        out["tokens_regenerated"] = out["dead_engine_at_kill"]["tokens_generated_unfinished"]
    if counter.error:
        out["attempts_to_dead_engine"] = None
        out["attempts_error"] = counter.error
    else:
        after = [t - killed["at"] for t in counter.times if "at" in killed and t > killed["at"]]
        out["attempts_to_dead_engine"] = len(after)
        out["last_attempt_after_kill_s"] = round(max(after), 3) if after else None
        kill_at = killed.get("after_s", args.crash_at)
        out["attempts_in_last_second"] = sum(a > args.crash_duration - kill_at - 1 for a in after)
    out["killed"] = "at" in killed
    if engines[0].counters is not None:  # the body keys the front sent (the survivor saw them)
        _, text = F.http("GET", engines[0].url + "/stub/stats")
        with contextlib.suppress(ValueError):
            out["keys_seen"] = json.loads(text).get("keys_seen", {})
    return out


def crash(
    names: list[str],
    tmp: Path,
    args: argparse.Namespace,
    checks: dict[str, bool],
    kind: str = "stub",
    model: Path | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        front = F.make_front(name, tmp)
        apis = front.apis if name != "direct" or args.smoke else ("generate", "completions")
        for api in apis[:1] if args.smoke else apis:
            for w in (STREAM_WORKLOAD[api], api):
                if kind == "stub":
                    engines = start_stubs(
                        tmp, f"crash-{name}-{w}", interval_ms=args.crash_token_interval_ms
                    )
                else:
                    assert model is not None
                    dialect = "sglang" if api == "generate" else "vllm"
                    engines = start_reference(tmp, model, dialect)
                    if isinstance(front, F.Gateway):
                        front.dialect, front.model_path = dialect, model
                try:
                    front.start([e.url for e in engines])
                    r = crash_one(name, w, engines, front, args, tmp)
                    out.setdefault(name, {})[w] = r
                    tag = f"crash[{kind}] {name} {w}"
                    checks[f"{tag}: engine killed under load"] = r["killed"]
                    if not (args.smoke and r.get("attempts_error")):  # smoke: root may be missing
                        checks[f"{tag}: connection attempts counted"] = (
                            r["attempts_to_dead_engine"] is not None
                        )
                    if kind == "stub" and not isinstance(front, F.Gateway):
                        checks[f"{tag}: requests in flight at the kill"] = (
                            r["dead_engine_at_kill"]["in_flight"] > 0
                        )
                    if (
                        name == "direct" and r["attempts_to_dead_engine"] is not None
                    ):  # self-test: a direct client keeps trying
                        checks[f"{tag}: attempts to the dead engine seen"] = bool(
                            r["attempts_to_dead_engine"]
                        )
                finally:
                    front.stop()
                    stop_all(engines)
                if isinstance(front, F.Gateway):
                    r = out[name][w]
                    gateway_crash_books(r, front.last_stats)
                    checks[f"{tag}: the dead engine's group left routing"] = (
                        r["gateway"].get("states", {}).get("g1") == "inactive"
                    )
                    # in flight at the kill: the stub's count, or the gateway's (a request it
                    # had sent may still sit unread in the killed stub's socket, uncounted)
                    checks[f"{tag}: requests in flight at the kill"] = (
                        r.get("dead_engine_at_kill", {}).get("in_flight", 0) > 0
                        or r["gateway"]["continuation"].get("after_failure", 0) > 0
                    )
    return out


def gateway_books_checks(where: str, res: dict[str, Any], checks: dict[str, bool]) -> None:
    """What the gateway's own books say of a throughput and latency phase: every group stayed
    routable (a loaded engine is not a failed one) and no request gave up."""
    books = res.get("gateway_books")
    if books is None:
        return
    states = books.get("states", {})
    checks[f"{where} gateway: every group stayed active under load"] = bool(states) and all(
        v == "active" for v in states.values()
    )
    cont = books.get("router", {}).get("continuation", {})
    checks[f"{where} gateway: no request gave up"] = cont.get("failed", 1) == 0


def gateway_crash_books(r: dict[str, Any], stats: dict[str, Any]) -> None:
    """The gateway's own books of a crash run (its counters, read when it stopped): requests
    continued, tokens carried over, the groups' states and why the dead one left routing. On
    the stubs, the tokens it regenerated are those the dead engine generated for unfinished
    requests minus those the gateway received and carried into a continuation (a token lost
    in flight at the kill is generated again; one received is not)."""
    cont = stats.get("router", {}).get("continuation", {})
    rh = stats.get("request_health", {})
    r["gateway"] = {
        "continuation": cont,
        "states": stats.get("states", {}),
        "groups_failed_by_requests": [g["group"] for g in rh.get("groups_failed", [])],
        "failed_requests_seen": rh.get("failed_requests", {}),
        "served_by_group": stats.get("router", {}).get("served_by_group", {}),
        "streams_continued": stats.get("gateway", {}).get("streams_continued"),
    }
    # answers read whole (Router.whole_up_to) that the dead engine had begun: sent again whole
    r["whole_lost"] = int(cont.get("whole_lost", 0)) if cont else 0
    if "dead_engine_at_kill" in r and cont:
        unfinished = r["dead_engine_at_kill"]["tokens_generated_unfinished"]
        r["tokens_regenerated"] = max(0, unfinished - int(cont.get("tokens_kept", 0)))
        r["tokens_kept_by_gateway"] = int(cont.get("tokens_kept", 0))
    elif cont:  # no engine counters (reference engines): the gateway's own count, which does
        # not know the tokens of an answer read whole that was lost (None: not counted)
        lost = r["whole_lost"] > 0
        r["tokens_regenerated"] = None if lost else int(cont.get("tokens_regenerated", 0))
        r["tokens_kept_by_gateway"] = int(cont.get("tokens_kept", 0))


# --------------------------------------------------------------------------- main


def host_info() -> dict[str, Any]:
    import resource

    load = os.getloadavg()
    return {
        "nofile_limit": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_1min_at_start": round(load[0], 2),
        "platform": platform.platform(),
    }


def phase(results: dict[str, Any], name: str, message: str) -> None:
    """Say which phase starts and record the machine's 1-min load then (the machine is shared:
    the load beside each phase's figures)."""
    print(message, flush=True)
    results.setdefault("load_1min_by_phase", {})[name] = round(os.getloadavg()[0], 2)


def make_routers(args: argparse.Namespace) -> tuple[bool, str]:
    if args.smoke or args.no_make:
        return F.ROUTERS_PYTHON.exists(), "not run (--smoke/--no-make)"
    done = subprocess.run(["make", "routers"], cwd=ROOT, capture_output=True, text=True)
    return done.returncode == 0, (done.stdout + done.stderr)[-500:]


def preflight(front: F.Front, api: str) -> tuple[bool, str]:
    """One request through ``front``; (ok, what came back)."""
    body = L.request_body(api, False, 4)
    status, text = F.http("POST", front.urls[0] + L.PATHS[api], body, timeout=60)
    return status == 200, f"{status}: {text[:300]}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    F.raise_own_nofile()
    checks: dict[str, bool] = {}
    results: dict[str, Any] = {
        "benchmark": "gateway",
        "host": host_info(),
        "config": {k: v for k, v in vars(args).items() if k not in ("front_names", "engine_kinds")},
        "fronts": args.front_names,
        "engines": args.engine_kinds,
        "issue_baseline": ISSUE_BASELINE,
    }
    ok, log = make_routers(args)
    results["make_routers"] = log
    wants_routers = [n for n in args.front_names if n.endswith("-router")]
    if wants_routers:
        checks["routers installed (make routers)"] = ok
    tmp = Path(tempfile.mkdtemp(prefix="rollsafe-bench-gateway-"))
    t_start = time.monotonic()
    try:
        fronts: list[F.Front] = []
        unavailable: dict[str, str] = {}
        probe_engines = start_stubs(tmp, "probe")
        try:
            for n in args.front_names:
                f = F.make_front(n, tmp, args.proxy_python)
                try:
                    f.start([e.url for e in probe_engines])
                    fronts.append(f)
                except F.FrontUnavailable as exc:
                    unavailable[n] = str(exc)
                    if n != "gateway":
                        checks[f"front {n} started"] = False
                finally:
                    f.stop()
            stubs = start_stubs(tmp, "tp")
            try:
                phase(results, "client_cost", "client cost ...")
                results["client_cost"] = client_cost(stubs, args)
            finally:
                stop_all(stubs)
        finally:
            stop_all(probe_engines)
        results["unavailable"] = unavailable
        names = [f.name for f in fronts]

        phase(results, "stub", f"throughput and latency on the stubs: {names} ...")
        stub_res: dict[str, Any] = {}
        stubs = start_stubs(tmp, "tp2")
        try:
            throughput_and_latency(fronts, stubs, args, stub_res)
        finally:
            stop_all(stubs)
        results["stub"] = stub_res
        for fname, by_w in stub_res["throughput_runs"].items():
            for w, rs in by_w.items():
                checks[f"stub {fname} {w}: no failed or cut request"] = all(
                    r["failed"] == 0 and r["cut"] == 0 for r in rs
                )
                checks[f"stub {fname} {w}: engines received exactly what was sent"] = all(
                    r["engine_received"] == r["sent"] for r in rs
                )
                checks[f"stub {fname} {w}: no 400 from the engines"] = all(
                    r["engine_bad_request"] == 0 for r in rs
                )
        for fname, by_w in stub_res["latency"].items():
            for w, s in by_w.items():
                checks[f"stub latency {fname} {w}: no failed request"] = s["failed"] == 0
        gateway_books_checks("stub", stub_res, checks)

        routers = [n for n in names if n.endswith("-router")]
        phase(results, "worker_api", f"worker API: {routers} ...")
        results["worker_api"] = worker_api(routers, tmp, args, checks)

        held = [n for n in names if n != "direct"]
        phase(results, "open_streams", f"{args.streams} open streams: {held} ...")
        results["open_streams"] = open_streams(held, tmp, args, checks)

        crashed = [n for n in names if n in ("direct", "sglang-router", "vllm-router", "gateway")]
        phase(results, "crash", f"crash: {crashed} ...")
        results["crash"] = crash(crashed, tmp, args, checks)

        if "reference" in args.engine_kinds:
            phase(results, "reference", "reference engines ...")
            results["reference"] = reference(fronts, tmp, args, checks)
        gateway_targets(results, checks, timed=not args.smoke)
    finally:
        results["wall_s"] = round(time.monotonic() - t_start, 1)
        results["host"]["load_1min_at_end"] = round(os.getloadavg()[0], 2)
        results["checks"] = checks
        results["failed_checks"] = sorted(k for k, v in checks.items() if not v)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8"
        )
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    print_table(results)
    print(f"wrote {args.out}; {len(checks)} checks, {len(results['failed_checks'])} false")
    for k in results["failed_checks"]:
        print(f"  FALSE: {k}")
    return 1 if results["failed_checks"] else 0


def reference(
    fronts: list[F.Front], tmp: Path, args: argparse.Namespace, checks: dict[str, bool]
) -> dict[str, Any]:
    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model

    model = make_tiny_model(tmp / "tiny", seed=0)
    out: dict[str, Any] = {}
    engine_cpus, front_cpus = split_cpus(args.reference_cpus)
    out["cpus"] = (
        {"engines": sorted(engine_cpus), "fronts_and_client": sorted(front_cpus)}
        if engine_cpus and front_cpus
        else "shared"
    )
    for dialect, api in (("sglang", "generate"), ("vllm", "completions")):
        sel = [
            f
            for f in fronts
            if f.name in ("direct", "sglang-router", "vllm-router", "gateway") and api in f.apis
        ]
        engines = start_reference(tmp, model, dialect, cpus=engine_cpus)
        for f in sel:
            if isinstance(f, F.Gateway):  # the engines' dialect, the model's tokenizer
                f.dialect, f.model_path = dialect, model
        try:
            usable = []
            for f in sel:
                f.start([e.url for e in engines])
                good, said = preflight(f, api)
                f.stop()
                checks[f"reference {dialect}: {f.name} request accepted by the engine"] = good
                out.setdefault("preflight", {})[f"{dialect} {f.name}"] = said
                if good:
                    usable.append(f)
            res: dict[str, Any] = {}
            if usable:
                saved = [x.apis for x in usable]
                for x in usable:
                    x.apis = (api,)
                try:
                    longer = argparse.Namespace(**vars(args))
                    longer.latency_duration = args.reference_latency_duration
                    with on_cpus(front_cpus):
                        throughput_and_latency(usable, engines, longer, res)
                finally:
                    for x, a in zip(usable, saved, strict=True):
                        x.apis = a
            out[dialect] = res
            gateway_books_checks(f"reference {dialect}", res, checks)
            for fname, by_w in res.get("throughput_runs", {}).items():
                for w, rs in by_w.items():
                    checks[f"reference {dialect} {fname} {w}: no failed or cut request"] = all(
                        r["failed"] == 0 and r["cut"] == 0 for r in rs
                    )
        finally:
            stop_all(engines)
            for f in sel:
                if isinstance(f, F.Gateway):
                    f.dialect, f.model_path = "sglang", None
    accepted = {
        f.name
        for f in fronts
        if f.name == "direct"
        or any(
            checks.get(f"reference {d}: {f.name} request accepted by the engine")
            for d in ("sglang", "vllm")
        )
    }
    names = [n for n in ("direct", "sglang-router", "vllm-router", "gateway") if n in accepted]
    out["crash"] = crash(names, tmp, args, checks, kind="reference", model=model)
    return out


def split_cpus(how: str) -> tuple[set[int] | None, set[int] | None]:
    """The reference phase's CPUs: (the engines', the fronts' and client's); (None, None) when
    shared, or with fewer than two CPUs to split."""
    cpus = sorted(os.sched_getaffinity(0))
    if how != "split" or len(cpus) < 2:
        return None, None
    return {cpus[-1]}, set(cpus[:-1])


@contextlib.contextmanager
def on_cpus(cpus: set[int] | None) -> Any:
    """Within it, the fronts started (``F.FRONT_CPUS``) and this thread (the client's event
    loop) run on ``cpus``; nothing changes for None."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    F.FRONT_CPUS = cpus
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        F.FRONT_CPUS = None
        os.sched_setaffinity(0, before)


#: issue #35's targets for rollsafe's gateway: (engines, minimum throughput vs each router)
THROUGHPUT_TARGETS = (("stub", 0.5), ("reference", 0.95))
ADDED_P50_TARGET_MS = 1.0


def gateway_targets(
    results: dict[str, Any], checks: dict[str, bool], *, timed: bool = True
) -> None:
    """Issue #35's targets as checks, where the gateway was measured: throughput at least 0.5x
    each router's on the stubs and 0.95x on real engines (same API), added p50 at most 1 ms,
    and no failed or cut request when an engine is SIGKILLed. ``timed=False`` (``--smoke``:
    seconds of load, figures not results) records the throughput and latency targets in
    ``results["targets_not_checked"]`` instead of ``checks``; the crash target stays a check."""
    timing = checks if timed else results.setdefault("targets_not_checked", {})
    ref = results.get("reference", {})
    merged: dict[str, dict[str, dict[str, Any]]] = {"throughput": {}, "latency": {}}
    for d in ("sglang", "vllm"):  # one front's workloads of both dialects, side by side
        for part, by_front in merged.items():
            for f, by_w in ref.get(d, {}).get(part, {}).items():
                by_front.setdefault(f, {}).update(by_w)
    where = {"stub": results.get("stub", {}), "reference": merged}
    for kind, floor in THROUGHPUT_TARGETS:
        tp = where[kind].get("throughput", {})
        gw = tp.get("gateway", {})
        for w, s in gw.items():
            for router in ("sglang-router", "vllm-router"):
                r = tp.get(router, {}).get(w)
                if r:
                    timing[f"target [{kind}] gateway {w}: >= {floor}x {router}"] = (
                        s["best_req_per_s"] >= floor * r["best_req_per_s"]
                    )
        for w, la in where[kind].get("latency", {}).get("gateway", {}).items():
            if "added_p50_ms" in la:
                timing[f"target [{kind}] gateway {w}: added p50 <= {ADDED_P50_TARGET_MS} ms"] = (
                    la["added_p50_ms"] <= ADDED_P50_TARGET_MS
                )
    crashes = [("stub", results.get("crash", {}))]
    crashes.append(("reference", results.get("reference", {}).get("crash", {})))
    for kind, by_front in crashes:
        for w, r in by_front.get("gateway", {}).items():
            checks[f"target [{kind}] gateway crash {w}: 0 failed or cut"] = (
                r["failed"] + r["cut"] == 0
            )


def print_table(results: dict[str, Any]) -> None:
    tp = results.get("stub", {}).get("throughput", {})
    lat = results.get("stub", {}).get("latency", {})
    head = ("front", "workload", "req/s", "x direct", "cpu us/req", "+p50 ms", "+p99 ms")
    print("{:24} {:20} {:>8} {:>8} {:>10} {:>8} {:>8}".format(*head))
    for front, by_w in tp.items():
        for w, s in by_w.items():
            la = lat.get(front, {}).get(w, {})
            print(
                f"{front:24} {w:20} {s['best_req_per_s']:8.0f} {s['vs_direct'] or 0:8.2f} "
                f"{s['front_cpu_us_per_req']:10.0f} {la.get('added_p50_ms', 0):8.2f} "
                f"{la.get('added_p99_ms', 0):8.2f}"
            )


if __name__ == "__main__":
    sys.exit(main())

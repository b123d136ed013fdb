"""Where the gateway's CPU goes per request: ``gateway_front.py`` in front of two stub engines,
driven by the benchmark's load generator, one workload at a time, up to three runs each:

1. plain: requests/s, and the gateway process's CPU per request (all its threads) and each
   thread's (``/proc/PID/task/TID/stat``);
2. sampled, with py-spy when it is given (``--py-spy PATH``; not a dependency of rollsafe:
   ``pip install py-spy`` anywhere): ``py-spy record --native --threads --format raw`` of the
   gateway process; the serving loop thread's samples that were not waiting in ``epoll``
   (busy); each Python function's share of them, its own (C code below it included, down to
   the next Python frame) and everything below it, turned into µs per request with the loop
   thread's own CPU per request in the plain run (its thread id from py-spy's samples).
   Samples inside a socket write are counted apart and left out of the shares: the write wakes
   the process that reads it, which takes the core, so on a loaded 2-core machine they are
   mostly a wait (the loop thread's system CPU stays a few percent of its total);
3. cProfile (``gateway_front.py --profile``): calls per request of each function (its times
   are the wall clock's and not used).

``python benchmarks/gateway/profile_gateway.py [--workloads generate,generate-stream,...]
[--concurrency 16] [--duration 5] [--tokens 16] [--top 25] [--py-spy PATH] [--json PATH]``.

``--in-process``: instead, the gateway's own Python work without sockets: the gateway, data plane
and router of ``gateway_front.py`` built in this process, ``Gateway.handle`` called with
hand-built requests one after the other, the engine replaced by one that yields its tokens at
once (one delta per token); the loop thread's CPU per request at 1 token and at ``--tokens``
gives a fixed cost and a cost per token. ``--gap-ms MS``: also the same request timed alone
back to back and each after the loop slept MS (idle, as while an engine works on an answer):
what the machine's wake-up costs the same Python work (docs/gateway.md, "Added latency at a
low rate"). What the process costs beyond that is its HTTP server,
the engine client (``rollsafe.adapters.engines.pool``, server-sent events) and the machine's
wake-ups.

``--against TREE [--rounds N]``: before/after instead: plain runs (1. above) of this checkout's
gateway and of the gateway of another checkout of rollsafe at ``TREE`` (e.g. ``git worktree add
/tmp/before <commit>``), interleaved in each of ``N`` rounds, on the same stubs; medians and p95
of the rounds, and the ratio of the medians of CPU per request (this / TREE).

``--workloads idle``: no requests; the gateway process's CPU a second while it waits for them
(its health probes, timers and housekeeping), over ``--duration`` s after it is up; with
``--against`` too.

``--reference sglang|vllm``: two reference engines of that dialect (the tiny model; the gateway
with the model's tokenizer and clients of that dialect) instead of the stubs, for the plain,
sampled and ``--against`` runs: what a token costs when events come one at a time, at an
engine's pace, with real events (cumulative SGLang ones, vLLM 0.32's version read).

``--engine-client``: the engine client alone (``AsyncSGLangEngine`` on uvloop against the
stubs): CPU per request of an answer fetched whole and read as a stream. ``--token-interval-ms
MS``: the stubs send a token every MS (events one at a time, as from a real engine).
``--compare sglang-router,vllm-router``: those fronts run plain too, for their CPU per request.

What a share means on a shared machine: py-spy samples a thread that runs or waits for a core
(its idle detection does not work here: a thread blocked in a wait is sampled too, hence the
busy filter), so time a loaded machine makes the gateway wait for a core is charged where it
waited (more often just after it woke another process: a socket write). The serving loop's own
C work (uvloop between Python callbacks: reading and writing sockets, running the ready
callbacks) is the own time of ``LoopThread.loop.<locals>.run``, the outermost Python frame of
that thread.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pstats
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import bench_gateway as B  # noqa: E402
import fronts as F  # noqa: E402
import loadgen as L  # noqa: E402

LOOP_THREAD = "rollsafe-dataplane"
#: the workload without requests (see the module)
IDLE = "idle"
_PY_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*\.py):\d+\)$")
_THREAD = re.compile(r"^thread \((?P<tid>\d+)\): (?P<name>.*)$")
#: innermost native frames of a loop thread waiting for events (not running)
_IDLE_LEAVES = ("epoll_wait", "epoll_pwait")
#: innermost native frames of a socket write: on this machine mostly a wait for a core (the
#: write wakes the reader, which takes the core; the thread's system time stays small)
_WRITE_LEAVES = ("write (", "writev (", "sendmsg (", "send (")


def drive(
    front: F.Front, workload: str, args: argparse.Namespace, during: Any = None
) -> dict[str, Any]:
    """One closed-loop run through ``front`` (``during()`` started with the measuring); for
    the ``idle`` workload, ``--duration`` s without a request."""
    pids = front.pids
    if workload == IDLE:
        cpu0, t0 = F.cpu_seconds(pids), time.monotonic()
        time.sleep(args.duration)
        per_s = (F.cpu_seconds(pids) - cpu0) / (time.monotonic() - t0)
        return {"cpu_ms_per_s": round(per_s * 1e3, 2), "failed": 0}
    cpu0 = F.cpu_seconds(pids)
    threads0 = thread_cpu(front.proc.pid) if front.proc is not None else {}
    started: dict[str, Any] = {}

    def on_start(_: float) -> None:
        if during is not None:
            started["it"] = during()

    stats = asyncio.run(
        L.closed_loop(
            front.urls,
            workload,
            concurrency=args.concurrency,
            duration=args.duration,
            tokens=args.tokens,
            on_start=on_start,
        )
    )
    cpu = F.cpu_seconds(pids) - cpu0
    threads1 = thread_cpu(front.proc.pid) if front.proc is not None else {}
    s = stats.summary()
    n = max(1, stats.sent)
    return {
        "req_per_s": s["req_per_s"],
        "sent": stats.sent,
        "measured": s["requests"],
        "failed": s["failed"] + s["cut"],
        "cpu_us_per_req": round(cpu / n * 1e6, 1),
        "thread_cpu_us_per_req": {
            tid: round((t - threads0.get(tid, 0.0)) / n * 1e6, 1)
            for tid, t in threads1.items()
            if t > threads0.get(tid, 0.0)
        },
        "started": started.get("it"),
    }


def thread_cpu(pid: int) -> dict[int, float]:
    """User + system CPU seconds of each thread of ``pid``, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def py_frames(stack: str) -> tuple[str, int | None, list[str], str]:
    """(thread name, thread id, the Python frames of one raw py-spy stack, outermost first, as
    ``func (file)``, and the innermost frame as py-spy wrote it)."""
    parts = stack.split(";")
    head = _THREAD.match(parts[0])
    thread = head["name"] if head else parts[0].split(": ", 1)[-1]
    tid = int(head["tid"]) if head else None
    frames = []
    for part in parts[1:]:
        m = _PY_FRAME.match(part)
        if m:
            frames.append(f"{m['func']} ({Path(m['file']).name})")
    return thread, tid, frames, parts[-1]


def spy_shares(raw: Path) -> dict[str, Any]:
    """Samples per thread; the loop thread's id, its busy and idle samples (idle: waiting in
    ``epoll``), and per Python function of its busy samples: own and below."""
    threads: Counter[str] = Counter()
    own: Counter[str] = Counter()
    below: Counter[str] = Counter()
    loop_tid: int | None = None
    idle = busy = in_write = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        thread, tid, frames, leaf = py_frames(stack)
        threads[thread] += n
        if thread != LOOP_THREAD:
            continue
        loop_tid = tid
        if leaf.startswith(_IDLE_LEAVES):
            idle += n
            continue
        if leaf.startswith(_WRITE_LEAVES):
            in_write += n
            continue
        busy += n
        if not frames:
            continue
        own[frames[-1]] += n
        for f in set(frames):
            below[f] += n
    return {
        "threads": threads,
        "own": own,
        "below": below,
        "loop_tid": loop_tid,
        "busy": busy,
        "idle": idle,
        "in_write": in_write,
    }


def calls_per_request(prof: Path, sent: int) -> dict[str, float]:
    """cProfile's calls per request, keyed ``func (file)`` (a method as its bare name)."""
    st = pstats.Stats(str(prof))
    out: Counter[str] = Counter()
    for (file, _line, fn), (_cc, nc, _tt, _ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        out[f"{fn} ({Path(file).name})"] += nc / sent
    return dict(out)


def _calls(calls: dict[str, float], name: str) -> float | None:
    func, _, file = name.rpartition(" (")
    bare = func.rsplit(".", 1)[-1]
    return calls.get(f"{bare} ({file}")


def report(
    workload: str,
    plain: dict[str, Any],
    spied: dict[str, Any] | None,
    shares: dict[str, Any] | None,
    calls: dict[str, float],
    top: int,
) -> dict[str, Any]:
    out: dict[str, Any] = {"workload": workload, "plain": plain}
    if spied is None or shares is None:
        return out
    threads = shares["threads"]
    loop = shares["busy"]
    # the loop thread's own CPU per request in the plain run (same process, same thread)
    loop_us = float(plain["thread_cpu_us_per_req"].get(shares["loop_tid"], 0.0))

    def rows(counter: Counter[str]) -> list[dict[str, Any]]:
        return [
            {
                "function": name,
                "own_pct": round(100 * shares["own"][name] / loop, 1),
                "below_pct": round(100 * shares["below"][name] / loop, 1),
                "own_us_per_req": round(loop_us * shares["own"][name] / loop, 1),
                "below_us_per_req": round(loop_us * shares["below"][name] / loop, 1),
                "calls_per_req": _calls(calls, name),
            }
            for name, _ in counter.most_common(top)
        ]

    out.update(
        {
            "spied": spied,
            "samples": {
                "loop_thread_busy": loop,
                "loop_thread_idle": shares["idle"],
                "loop_thread_in_socket_write": shares["in_write"],
            },
            "threads": dict(threads.most_common(8)),
            "loop_thread_us_per_req": round(loop_us, 1),
            "by_own": rows(shares["own"]) if loop else [],
            "by_below": rows(shares["below"]) if loop else [],
        }
    )
    return out


def print_report(r: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\n=== {r['workload']}: concurrency {args.concurrency}, {args.duration} s, "
        f"{args.tokens} tokens per request"
    )
    print(f"plain: {r['plain']}")
    if "spied" not in r:
        print("(no py-spy: pass --py-spy PATH for the shares)")
        return
    print(f"under py-spy: {r['spied']}; samples {r['samples']}; threads {r['threads']}")
    print(f"serving loop thread: {r['loop_thread_us_per_req']} us/req of CPU in the plain run")
    for key, title in (("by_own", "own"), ("by_below", "below")):
        print(f"-- by {title} (us per request, % of the loop thread's busy samples, calls/req)")
        for row in r[key]:
            calls = "" if row["calls_per_req"] is None else f"{row['calls_per_req']:.2f}"
            print(
                f"{row['own_us_per_req']:7.1f} {row['own_pct']:5.1f}%  "
                f"{row['below_us_per_req']:7.1f} {row['below_pct']:5.1f}%  {calls:>6}  "
                f"{row['function']}"
            )


class _InstantEngine:
    """An async engine whose stream yields ``tokens`` deltas of one token each, at once, and
    whose whole answer (a short request read whole, ``Router.whole_up_to``) holds them all."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.url = "http://in-process"

    async def generate(
        self,
        input_ids: Any = None,
        *,
        text: Any = None,
        sampling_params: Any = None,
        timeout: Any = None,
    ) -> Any:
        from rollsafe.ports import GenerateResult

        meta = {"weight_version": "1", "finish_reason": {"type": "length"}}
        return GenerateResult("x" * self.tokens, [7] * self.tokens, "1", "length", meta)

    async def generate_stream(
        self,
        input_ids: Any = None,
        *,
        text: Any = None,
        sampling_params: Any = None,
        timeout: Any = None,
    ) -> Any:
        from rollsafe.adapters.engines.streaming import StreamDelta

        last = self.tokens - 1
        for i in range(self.tokens):
            yield StreamDelta(
                (7,),
                "x",
                "1",
                finished=i == last,
                finish_reason="length" if i == last else None,
                meta={"id": "in-process"},
            )


def in_process(args: argparse.Namespace, engines: list[Any], model: Path) -> list[dict[str, Any]]:
    """The gateway's own CPU per request without sockets (see the module docstring)."""
    import gateway_front as G

    from rollsafe.fleet.dataplane import DataPlane
    from rollsafe.gateway.app import Gateway
    from rollsafe.gateway.http import Request, Response
    from rollsafe.gateway.settings import GatewaySettings

    ns = argparse.Namespace(
        upstream=[e.url for e in engines],
        dialect="sglang",
        request_timeout_s=60.0,
        wait_for_routable_s=30.0,
    )
    registry, router, _health, _request_health = G.build(ns)
    plane = DataPlane(router)
    gateway = Gateway(G.BenchFleet(registry, plane), GatewaySettings(), model_path=model)
    headers = {"content-type": "application/json"}
    reports = []
    try:
        for w in args.workloads.split(","):
            api, stream = L.WORKLOADS[w]
            row: dict[str, Any] = {"workload": w}
            for tokens in (1, args.tokens):
                engine = _InstantEngine(tokens)
                plane.engine_for = lambda group, engine=engine: engine  # type: ignore[method-assign]
                body = json.dumps(L.request_body(api, stream, tokens)).encode()

                async def one(body: bytes = body, path: str = L.PATHS[api]) -> int:
                    answer = await gateway.handle(Request("POST", path, headers, body))
                    if answer.status != 200:
                        raise RuntimeError(f"{path} answered {answer.status}")
                    if isinstance(answer, Response):
                        return len(answer.body)
                    return sum([len(b) async for b in answer.chunks])

                async def many(n: int, one: Any = one) -> float:
                    for _ in range(50):  # warm
                        await one()
                    t0 = time.thread_time()
                    for _ in range(n):
                        await one()
                    return time.thread_time() - t0

                async def spaced(n: int, gap_s: float, one: Any = one) -> float:
                    cpu = 0.0
                    for _ in range(n):
                        await asyncio.sleep(gap_s)  # the loop idle, as while an engine works
                        t0 = time.thread_time()
                        await one()
                        cpu += time.thread_time() - t0
                    return cpu

                n = max(200, int(args.duration * 1000))
                cpu = plane.loop_thread.run(many(n))
                row[f"us_per_req_{tokens}_tokens"] = round(cpu / n * 1e6, 1)
                if args.gap_ms > 0 and tokens == args.tokens:
                    # back to back, then each request after the loop slept --gap-ms
                    m = max(100, int(args.duration * 1000 / (args.gap_ms + 1)))
                    hot = plane.loop_thread.run(spaced(m, 0.0)) / m * 1e6
                    cold = plane.loop_thread.run(spaced(m, args.gap_ms / 1000)) / m * 1e6
                    row["us_per_req_back_to_back"] = round(hot, 1)
                    row["us_per_req_after_gap"] = round(cold, 1)
                    row["gap_ms"] = args.gap_ms
                    print(
                        f"{w}: {hot:.1f} us/req back to back, {cold:.1f} after a "
                        f"{args.gap_ms:g} ms sleep of the loop ({cold / hot:.2f}x; {m} requests "
                        f"each, {tokens} tokens)"
                    )
            a, b = row["us_per_req_1_tokens"], row[f"us_per_req_{args.tokens}_tokens"]
            row["us_per_token"] = round((b - a) / max(1, args.tokens - 1), 2)
            row["us_fixed"] = round(a - row["us_per_token"], 1)
            print(
                f"{w}: {a} us/req at 1 token, {b} at {args.tokens}: about {row['us_fixed']} us "
                f"a request and {row['us_per_token']} us a token (the loop thread's CPU)"
            )
            reports.append(row)
    finally:
        plane.close()
        router.close()
    return reports


def engine_client(args: argparse.Namespace, engines: list[Any]) -> list[dict[str, Any]]:
    """The engine client alone (what the gateway's data plane calls), in this process on
    uvloop: the CPU per request of a 16-token answer fetched whole (``generate``) and read as
    a stream (``generate_stream``), ``--concurrency`` at a time."""
    from rollsafe.adapters.engines import SGLangClient
    from rollsafe.adapters.engines.aio import AsyncHttp, async_engine
    from rollsafe.event_loop import new_event_loop

    sampling = {"max_new_tokens": args.tokens}

    async def measure() -> list[dict[str, Any]]:
        http = AsyncHttp()
        clients = [async_engine(SGLangClient(e.url), http) for e in engines]
        rows = []
        try:

            async def whole(i: int) -> None:
                await clients[i % len(clients)].generate([1, 2, 3, 4], sampling_params=sampling)

            async def stream(i: int) -> None:
                async for _ in clients[i % len(clients)].generate_stream(
                    [1, 2, 3, 4], sampling_params=sampling
                ):
                    pass

            for name, call in (("generate", whole), ("generate_stream", stream)):
                for i in range(20):  # warm: connections open
                    await call(i)
                n = max(args.concurrency, int(args.duration * 200))
                per = n // args.concurrency

                async def worker(k: int, call: Any = call, per: int = per) -> None:
                    for j in range(per):
                        await call(k + j)

                t0 = time.thread_time()
                await asyncio.gather(*(worker(k) for k in range(args.concurrency)))
                us = round((time.thread_time() - t0) / (per * args.concurrency) * 1e6, 1)
                print(f"engine client {name}, {args.tokens} tokens: {us} us of CPU a request")
                rows.append({"call": name, "tokens": args.tokens, "cpu_us_per_req": us})
        finally:
            await http.close()
        return rows

    loop = new_event_loop()
    try:
        return loop.run_until_complete(measure())
    finally:
        loop.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="generate,generate-stream,completions,completions-stream")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--py-spy", default=shutil.which("py-spy"))
    p.add_argument("--json", default=None)
    p.add_argument("--in-process", action="store_true", help="no sockets (see the docstring)")
    p.add_argument("--engine-client", action="store_true", help="see the docstring")
    p.add_argument("--token-interval-ms", type=float, default=0.0, help="the stubs' pace")
    p.add_argument(
        "--gap-ms",
        type=float,
        default=0.0,
        help="--in-process: also each request after the loop slept this long (see above)",
    )
    p.add_argument("--compare", default="", help="fronts also run plain, e.g. sglang-router")
    p.add_argument("--against", default=None, help="another checkout: before/after, see above")
    p.add_argument("--rounds", type=int, default=3, help="rounds of --against")
    p.add_argument(
        "--reference",
        choices=("sglang", "vllm"),
        default=None,
        help="two reference engines of this dialect (the tiny model) instead of the stubs",
    )
    args = p.parse_args(argv)
    if args.gap_ms < 0 or (args.gap_ms and not args.in_process):
        p.error("--gap-ms must be >= 0 and goes with --in-process")
    F.raise_own_nofile()
    tmp = Path(tempfile.mkdtemp(prefix="rollsafe-gw-profile-"))
    reports = []
    try:
        model: Path | None = None
        if args.reference:
            from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model

            model = make_tiny_model(tmp / "tiny", seed=0)
            engines = B.start_reference(tmp, model, args.reference)
        else:
            engines = B.start_stubs(tmp, "prof", interval_ms=args.token_interval_ms)
        try:
            if args.in_process:
                reports = in_process(args, engines, F.Gateway(tmp).stub_model())
                return _write(args, reports)
            if args.engine_client:
                reports = engine_client(args, engines)
                return _write(args, reports)
            if args.against:
                reports = against(args, engines, tmp, model)
                return _write(args, reports)
            for name in [n for n in args.compare.split(",") if n]:
                other = F.make_front(name, tmp)
                other.start([e.url for e in engines])
                try:
                    for w in args.workloads.split(","):
                        if w == IDLE or L.WORKLOADS[w][0] in other.apis:
                            r = drive(other, w, args)
                            r.pop("started", None)
                            r.pop("thread_cpu_us_per_req", None)
                            print(f"{name} {w}: {r}")
                            reports.append({"front": name, "workload": w, "plain": r})
                finally:
                    other.stop()
            for w in args.workloads.split(","):
                front = F.Gateway(tmp)
                if args.reference:
                    front.dialect, front.model_path = args.reference, model
                front.start([e.url for e in engines])
                if w == IDLE:
                    try:
                        idle = drive(front, w, args)
                    finally:
                        front.stop()
                    print(f"gateway idle: {idle}")
                    reports.append({"workload": w, "plain": idle})
                    continue
                try:
                    plain = drive(front, w, args)
                    spied = shares = None
                    if args.py_spy:
                        raw = tmp / f"{w}.spy.txt"
                        cmd = [args.py_spy, "record", "--pid", str(front.proc.pid)]  # type: ignore[union-attr]
                        cmd += ["--native", "--threads", "--rate", "250", "--format", "raw"]
                        cmd += ["--duration", str(max(1, int(args.duration))), "-o", str(raw)]

                        def spy(cmd: list[str] = cmd) -> subprocess.Popen[bytes]:
                            return subprocess.Popen(
                                cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                            )

                        spied = drive(front, w, args, during=spy)
                        proc = spied.pop("started")
                        if proc is not None:
                            proc.wait(timeout=60)
                        shares = spy_shares(raw) if raw.exists() else None
                finally:
                    front.stop()
                counted = F.Gateway(tmp, profile=True)
                if args.reference:
                    counted.dialect, counted.model_path = args.reference, model
                counted.start([e.url for e in engines])
                try:
                    cp = drive(counted, w, args)
                finally:
                    counted.stop()
                prof = counted.profiles[-1]
                deadline = time.monotonic() + 10
                while not prof.exists() and time.monotonic() < deadline:
                    time.sleep(0.1)
                plain.pop("started", None)
                r = report(w, plain, spied, shares, calls_per_request(prof, cp["sent"]), args.top)
                reports.append(r)
                print_report(r, args)
        finally:
            B.stop_all(engines)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _write(args, reports)


def against(
    args: argparse.Namespace, engines: list[Any], tmp: Path, model: Path | None = None
) -> list[dict[str, Any]]:
    """``--against``: this checkout's gateway and another's, interleaved (see the module)."""
    trees = {"this": F.ROOT, "against": Path(args.against).resolve()}
    workloads = args.workloads.split(",")
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        for w in workloads:
            for name, root in trees.items():
                front = F.Gateway(tmp, root=root)
                if args.reference:
                    front.dialect, front.model_path = args.reference, model
                front.start([e.url for e in engines])
                try:
                    x = drive(front, w, args)
                finally:
                    front.stop()
                x.pop("started", None)
                x.pop("thread_cpu_us_per_req", None)
                runs.setdefault((w, name), []).append(x)
                print(f"round {r + 1} {w} {name}: {x}", flush=True)
    reports = []
    for w in workloads:
        row: dict[str, Any] = {"workload": w, "rounds": args.rounds}
        for name, root in trees.items():
            xs = runs[(w, name)]
            row[name] = {"tree": str(root), "failed": sum(int(x["failed"]) for x in xs)}
            for key in ("req_per_s", "cpu_us_per_req", "cpu_ms_per_s"):
                if key in xs[0]:
                    row[name][key] = _median_p95([x[key] for x in xs])
        if w == IDLE:
            this, other = row["this"]["cpu_ms_per_s"], row["against"]["cpu_ms_per_s"]
            ratio = this["median"] / other["median"] if other["median"] else None
            row["cpu_per_s_ratio"] = None if ratio is None else round(ratio, 3)
            reports.append(row)
            print(
                f"{w}: CPU {this['median']} (p95 {this['p95']}) vs {other['median']} "
                f"(p95 {other['p95']}) ms/s = {row['cpu_per_s_ratio']}x (CPU time in clock ticks)"
            )
            continue
        this, other = row["this"]["cpu_us_per_req"], row["against"]["cpu_us_per_req"]
        row["cpu_per_req_ratio"] = round(this["median"] / other["median"], 3)
        reports.append(row)
        print(
            f"{w}: CPU/req {this['median']} (p95 {this['p95']}) vs {other['median']} "
            f"(p95 {other['p95']}) us = {row['cpu_per_req_ratio']}x; req/s "
            f"{row['this']['req_per_s']['median']} vs {row['against']['req_per_s']['median']}"
        )
    return reports


def _median_p95(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 1), "p95": round(B._p95(values), 1)}


def _write(args: argparse.Namespace, reports: list[dict[str, Any]]) -> int:
    if args.json:
        out = {"config": vars(args), "host": B.host_info(), "workloads": reports}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

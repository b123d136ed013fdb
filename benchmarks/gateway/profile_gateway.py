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
    """One closed-loop run through ``front`` (``during()`` started with the measuring)."""
    pids = front.pids
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="generate,generate-stream,completions,completions-stream")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--py-spy", default=shutil.which("py-spy"))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    F.raise_own_nofile()
    tmp = Path(tempfile.mkdtemp(prefix="rollsafe-gw-profile-"))
    reports = []
    try:
        engines = B.start_stubs(tmp, "prof")
        try:
            for w in args.workloads.split(","):
                front = F.Gateway(tmp)
                front.start([e.url for e in engines])
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
    if args.json:
        out = {"config": vars(args), "host": B.host_info(), "workloads": reports}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

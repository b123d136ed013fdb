"""Micro-benchmark: rollsafe's gateway HTTP server (``rollsafe.gateway.http``) beside the bare
shape the gateway benchmark chose it by (``proxy_raw.py``'s asyncio protocol on httptools and
uvloop), both answering by themselves with the same trivial answers, so the difference is what
the server's features cost (limits, timers, counters, a handler call per request).

Each server runs in its own process on uvloop; the load generator (``loadgen.py``'s aiohttp
closed loop, ``--concurrency`` clients per server) posts SGLang ``/generate`` bodies:
``generate`` (a JSON answer) and ``generate-stream`` (``--tokens`` SSE events as chunks, then
``[DONE]``). Each repeat, on each workload: each server alone (their order alternating between
repeats: requests/s, latency, CPU per request), then both at once, each from its own clients
(``side_by_side``: whatever else the shared machine does hits both alike, so the CPU ratio is
taken there, per repeat). Figures are medians over ``--repeats`` (3). CPU per request: the
server process's user + system time over the measured window over the requests answered.

Checks (exit 1 when one is false): every request answered whole by both servers; rollsafe's
own counters (read from its ``/stats`` route) equal the requests the client sent; and, except
with ``--smoke``, the median side-by-side ratio of rollsafe's CPU per request to the bare
protocol's at most ``--max-cpu-ratio`` (1.3) on each workload. ``--out PATH`` writes the
result as JSON; stdout has it too.

``python benchmarks/gateway/http_server_bench.py [--smoke]``
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import fronts as F  # noqa: E402
import loadgen as L  # noqa: E402

SERVERS = ("raw", "rollsafe")
WORKLOADS = ("generate", "generate-stream")
READY = "SERVER_READY "


# ---- the trivial answers, the same for both servers


def answers(tokens: int) -> tuple[bytes, list[bytes]]:
    """A whole ``/generate`` answer and the events of a streamed one (SGLang's shape)."""
    meta = {"finish_reason": {"type": "length", "length": tokens}, "weight_version": "0"}
    whole = {"text": "t" * tokens, "output_ids": list(range(tokens)), "meta_info": meta}
    events = [
        b"data: "
        + json.dumps({"text": "t" * (i + 1), "output_ids": list(range(i + 1)), "meta_info": meta})
        .replace(" ", "")
        .encode()
        + b"\n\n"
        for i in range(tokens)
    ]
    return json.dumps(whole).encode(), [*events, b"data: [DONE]\n\n"]


def wants_stream(body: bytes) -> bool:
    return b'"stream": true' in body


async def produce(events: list[bytes]) -> AsyncIterator[bytes]:
    for event in events:
        yield event


# ---- the servers (run with --serve)


def serve_rollsafe(port: int, tokens: int) -> None:
    from rollsafe.event_loop import new_event_loop
    from rollsafe.gateway.http import HttpServer, Request, Response, StreamResponse

    whole, events = answers(tokens)
    server: HttpServer | None = None

    async def handler(req: Request) -> Response | StreamResponse:
        if req.path == "/stats":
            assert server is not None
            return Response.json(server.stats.snapshot())
        if wants_stream(req.body):
            return StreamResponse(produce(events))
        return Response(200, whole)

    async def main() -> None:
        nonlocal server
        server = HttpServer(handler, port=port)
        await server.start()
        print(READY + json.dumps({"url": server.url}), flush=True)
        await asyncio.Event().wait()

    loop = new_event_loop()
    loop.run_until_complete(main())


class RawConn(asyncio.Protocol):
    """``proxy_raw.py``'s connection, answering itself instead of forwarding."""

    def __init__(self, whole: bytes, events: list[bytes]) -> None:
        import httptools

        self.whole, self.events = whole, events
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.pending: collections.deque[tuple[bytes, bool]] = collections.deque()
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.task is not None:
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        import httptools

        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def on_message_begin(self) -> None:
        self.url, self.body = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name.lower()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.pending.append((b"".join(self.body), self.parser.should_keep_alive()))
        if self.task is None:
            self.task = asyncio.ensure_future(self.run())

    async def run(self) -> None:
        try:
            while self.pending and self.transport is not None:
                await self.answer(*self.pending.popleft())
        finally:
            self.task = None

    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    async def answer(self, body: bytes, keep_alive: bool) -> None:
        conn = b"" if keep_alive else b"connection: close\r\n"
        status = b"HTTP/1.1 200 OK\r\n"
        if not wants_stream(body):
            data = self.whole
            self.write(
                status
                + b"content-type: application/json\r\ncontent-length: %d\r\n" % len(data)
                + conn
                + b"\r\n"
                + data
            )
        else:
            self.write(
                status
                + b"content-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                + conn
                + b"\r\n"
            )
            async for chunk in produce(self.events):
                self.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.write(b"0\r\n\r\n")
        if not keep_alive and self.transport is not None:
            self.transport.close()


def serve_raw(port: int, tokens: int) -> None:
    import uvloop

    whole, events = answers(tokens)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: RawConn(whole, events), "127.0.0.1", port, backlog=4096
        )
        port_ = server.sockets[0].getsockname()[1]
        print(READY + json.dumps({"url": f"http://127.0.0.1:{port_}"}), flush=True)
        await asyncio.Event().wait()

    loop = uvloop.new_event_loop()
    loop.run_until_complete(main())


# ---- the measurement


async def load(url: str, pid: int, workload: str, args: argparse.Namespace) -> dict[str, Any]:
    """One closed loop on one server; its CPU over the measured window."""
    marks: dict[str, float] = {}

    def on_start(_: float) -> None:
        marks["cpu0"] = F.cpu_seconds([pid])

    stats = await L.closed_loop(
        [url],
        workload,
        concurrency=args.concurrency,
        duration=args.duration,
        tokens=args.tokens,
        warmup=args.warmup,
        on_start=on_start,
    )
    cpu = F.cpu_seconds([pid]) - marks["cpu0"]
    summary = stats.summary()
    ok = summary["ok"]
    return {
        "req_per_s": summary["req_per_s"],
        "cpu_us_per_req": round(cpu / ok * 1e6, 1) if ok else None,
        "p50_ms": summary["p50_ms"],
        "p99_ms": summary["p99_ms"],
        "ok": ok,
        "sent": stats.sent,
        "cut": summary["cut"],
        "failed": summary["failed"],
        "errors": summary["errors"],
    }


def run_alone(url: str, pid: int, workload: str, args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(load(url, pid, workload, args))


def run_side_by_side(
    urls: dict[str, str], pids: dict[str, int], workload: str, args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """Both servers loaded at once, each by its own clients: whatever else the machine does
    hits both alike, so their CPU per request compares in one window."""

    async def both() -> list[dict[str, Any]]:
        return list(
            await asyncio.gather(*(load(urls[s], pids[s], workload, args) for s in SERVERS))
        )

    return dict(zip(SERVERS, asyncio.run(both()), strict=True))


def median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 3) if vals else None


def measure(args: argparse.Namespace) -> dict[str, Any]:
    F.raise_own_nofile()
    procs: dict[str, Any] = {}
    urls: dict[str, str] = {}
    logs = Path(tempfile.mkdtemp(prefix="http_server_bench_"))
    load0 = os.getloadavg()[0]
    try:
        for name in SERVERS:
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--serve",
                name,
                "--tokens",
                str(args.tokens),
            ]
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            proc, ready = F.spawn(cmd, logs / f"{name}.log", READY, env=env)
            procs[name], urls[name] = proc, ready["url"]
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {
            s: {w: [] for w in WORKLOADS} for s in SERVERS
        }
        paired: dict[str, dict[str, list[dict[str, Any]]]] = {
            s: {w: [] for w in WORKLOADS} for s in SERVERS
        }
        pids = {name: procs[name].pid for name in SERVERS}
        for r in range(args.repeats):
            order = SERVERS if r % 2 == 0 else tuple(reversed(SERVERS))
            for workload in WORKLOADS:
                for name in order:
                    runs[name][workload].append(run_alone(urls[name], pids[name], workload, args))
                for name, got in run_side_by_side(urls, pids, workload, args).items():
                    paired[name][workload].append(got)
        status, text = F.http("GET", urls["rollsafe"] + "/stats")
        server_stats = json.loads(text) if status == 200 else {"status": status}
    finally:
        for proc in procs.values():
            F.kill_group(proc)
        for path in logs.iterdir():
            path.unlink()
        logs.rmdir()

    table: dict[str, dict[str, Any]] = {}
    for name in SERVERS:
        for workload in WORKLOADS:
            rs = runs[name][workload]
            table[f"{name} {workload}"] = {
                "req_per_s": median([x["req_per_s"] for x in rs]),
                "cpu_us_per_req": median([x["cpu_us_per_req"] for x in rs]),
                "p50_ms": median([x["p50_ms"] for x in rs]),
                "p99_ms": median([x["p99_ms"] for x in rs]),
                "runs": rs,
            }
    ratios: dict[str, float | None] = {}
    alone_ratios: dict[str, float | None] = {}
    side_by_side: dict[str, Any] = {}
    for workload in WORKLOADS:
        ours = table[f"rollsafe {workload}"]["cpu_us_per_req"]
        base = table[f"raw {workload}"]["cpu_us_per_req"]
        alone_ratios[workload] = round(ours / base, 3) if ours and base else None
        each = [
            round(a["cpu_us_per_req"] / b["cpu_us_per_req"], 3)
            if a["cpu_us_per_req"] and b["cpu_us_per_req"]
            else None
            for a, b in zip(paired["rollsafe"][workload], paired["raw"][workload], strict=True)
        ]
        ratios[workload] = median(list(each))
        side_by_side[workload] = {
            "ratio_each_repeat": each,
            **{
                f"{s}_cpu_us_per_req": [x["cpu_us_per_req"] for x in paired[s][workload]]
                for s in SERVERS
            },
            **{f"{s}_req_per_s": [x["req_per_s"] for x in paired[s][workload]] for s in SERVERS},
        }

    sent_rollsafe = sum(
        x["sent"] for w in WORKLOADS for x in runs["rollsafe"][w] + paired["rollsafe"][w]
    )
    answered = server_stats.get("requests", {}).get("200", 0) if "requests" in server_stats else 0
    checks = {
        "every request answered whole": all(
            x["failed"] == 0 and x["cut"] == 0 and x["ok"] > 0
            for s in SERVERS
            for w in WORKLOADS
            for x in runs[s][w] + paired[s][w]
        ),
        "rollsafe's counters equal what the client sent": answered == sent_rollsafe
        and not server_stats.get("rejected")
        and server_stats.get("handler_errors") == 0,
    }
    if not args.smoke:
        for workload in WORKLOADS:
            ratio = ratios[workload]
            checks[
                f"{workload}: rollsafe CPU/request <= {args.max_cpu_ratio}x the bare protocol's"
            ] = ratio is not None and ratio <= args.max_cpu_ratio
    return {
        "what": "rollsafe.gateway.http vs proxy_raw's bare protocol, both answering trivially",
        "command": "python benchmarks/gateway/http_server_bench.py"
        + (" --smoke" if args.smoke else ""),
        "machine": {
            "cpus": os.cpu_count(),
            "load_1min_at_start": round(load0, 2),
            "python": platform.python_version(),
        },
        "settings": {
            k: getattr(args, k)
            for k in ("repeats", "duration", "warmup", "concurrency", "tokens", "max_cpu_ratio")
        },
        "results": table,
        "cpu_ratio_rollsafe_over_raw": ratios,
        "cpu_ratio_alone_runs": alone_ratios,
        "side_by_side": side_by_side,
        "rollsafe_server_stats": server_stats,
        "checks": checks,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", choices=SERVERS, help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true", help="seconds, no CPU-ratio check")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--duration", type=float, default=3.0, help="measured seconds per run")
    p.add_argument("--warmup", type=float, default=0.5)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--tokens", type=int, default=16, help="events per stream")
    p.add_argument("--max-cpu-ratio", type=float, default=1.3)
    p.add_argument("--out", default=None, help="also write the result JSON here")
    args = p.parse_args(argv)
    for name in ("repeats", "concurrency", "tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.duration <= 0 or args.warmup < 0:
        p.error("--duration must be > 0 and --warmup >= 0")
    if args.smoke:
        args.repeats, args.duration, args.warmup, args.concurrency = 1, 0.5, 0.2, 8
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve == "raw":
        serve_raw(0, args.tokens)
        return 0
    if args.serve == "rollsafe":
        serve_rollsafe(0, args.tokens)
        return 0
    result = measure(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    for key, row in result["results"].items():
        print(
            f"{key:28s} {row['req_per_s']:>8} req/s  {row['cpu_us_per_req']:>7} µs CPU/req  "
            f"p50 {row['p50_ms']} ms  p99 {row['p99_ms']} ms",
            file=sys.stderr,
        )
    failed = [name for name, ok in result["checks"].items() if not ok]
    for name in failed:
        print(f"CHECK FAILED: {name}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

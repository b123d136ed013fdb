"""The gateway benchmark's load generator: an aiohttp client (one pooled session) that drives a
front with SGLang ``/generate`` or OpenAI ``/v1/completions`` requests, streamed or not.

* :func:`closed_loop`: ``concurrency`` clients, each sending its next request as soon as the
  previous one ended (saturation throughput), for ``duration`` seconds;
* :func:`open_loop`: requests started at a fixed rate (Poisson arrivals), whatever the answers
  (latency at a fixed load);
* :func:`open_streams`: ``count`` streams opened and held until each has its first event
  (memory with many open streams).

Every request is classified: ``ok`` (200 and a whole answer: the JSON body, or a stream that
ended with ``data: [DONE]``), ``cut`` (a 200 stream that ended without ``[DONE]``: its tokens
are lost to the client) or ``failed`` (any other status, or a connection error before the
answer began). aiohttp rather than httpx: about twice the requests per CPU second in the
client (measured by the benchmark's ``client_cost`` phase), which matters when the client
shares two cores with the front and the engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

#: workload name -> (api, stream)
WORKLOADS = {
    "generate": ("generate", False),
    "generate-stream": ("generate", True),
    "completions": ("completions", False),
    "completions-stream": ("completions", True),
}
PATHS = {"generate": "/generate", "completions": "/v1/completions"}


def request_body(api: str, stream: bool, tokens: int) -> dict[str, Any]:
    """A greedy request for ``tokens`` tokens in ``api``'s shape (EOS ignored: fixed length)."""
    if api == "generate":
        return {
            "input_ids": [1, 2, 3, 4],
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
            "stream": stream,
        }
    return {
        "model": "stub-model",
        "prompt": [1, 2, 3, 4],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


@dataclass
class Outcome:
    kind: str  # ok | cut | failed
    latency_s: float
    first_s: float | None
    tokens: int
    status: int | None
    error: str | None = None


@dataclass
class Stats:
    """What one run of requests produced."""

    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0
    #: every request sent, warm-up included (what the engines should have received)
    sent: int = 0
    #: :func:`open_loop` with ``pair_urls``: the requests sent there, in the same run
    paired: Stats | None = None

    def add(self, o: Outcome) -> None:
        self.outcomes.append(o)

    def count(self, kind: str) -> int:
        return sum(o.kind == kind for o in self.outcomes)

    def summary(self) -> dict[str, Any]:
        ok = [o for o in self.outcomes if o.kind == "ok"]
        lat = sorted(o.latency_s for o in ok)
        first = sorted(o.first_s for o in ok if o.first_s is not None)
        errors: dict[str, int] = {}
        for o in self.outcomes:
            if o.kind != "ok":
                key = f"{o.kind}: {o.status if o.error is None else o.error}"
                errors[key] = errors.get(key, 0) + 1
        return {
            "requests": len(self.outcomes),
            "sent": self.sent,
            "ok": len(ok),
            "cut": self.count("cut"),
            "failed": self.count("failed"),
            "wall_s": round(self.wall_s, 3),
            "req_per_s": round(len(ok) / self.wall_s, 1) if self.wall_s else 0.0,
            "p50_ms": _ms(percentile(lat, 50)),
            "p99_ms": _ms(percentile(lat, 99)),
            "first_p50_ms": _ms(percentile(first, 50)),
            "first_p99_ms": _ms(percentile(first, 99)),
            "tokens_ok": sum(o.tokens for o in ok),
            "tokens_in_cut": sum(o.tokens for o in self.outcomes if o.kind == "cut"),
            "errors": errors,
        }


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 3)


def percentile(sorted_values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (nearest rank) of already sorted values."""
    if not sorted_values:
        return None
    k = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


def session(limit: int = 0) -> aiohttp.ClientSession:
    """A pooled keep-alive session (``limit`` connections, 0: unbounded)."""
    conn = aiohttp.TCPConnector(limit=limit, limit_per_host=0, keepalive_timeout=60)
    return aiohttp.ClientSession(
        connector=conn,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        headers={"content-type": "application/json"},
        skip_auto_headers=("User-Agent",),
    )


def _count_event(line: bytes) -> int:
    """1 for a ``data:`` event that carries a token, 0 otherwise (``[DONE]``, a usage chunk)."""
    if not line.startswith(b"data:"):
        return 0
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return 0
    if b'"choices":[]' in payload:  # an OpenAI usage-only chunk
        return 0
    return 1


async def one_request(
    s: aiohttp.ClientSession, url: str, api: str, stream: bool, body: bytes
) -> Outcome:
    """Send one request and classify its outcome (see the module docstring)."""
    t0 = time.perf_counter()
    first: float | None = None
    tokens = 0
    status: int | None = None
    try:
        async with s.post(url + PATHS[api], data=body) as resp:
            status = resp.status
            if status != 200:
                await resp.read()
                return Outcome("failed", time.perf_counter() - t0, None, 0, status)
            if not stream:
                data = await resp.read()
                first = time.perf_counter() - t0
                obj = json.loads(data)
                if api == "generate":
                    tokens = len(obj.get("output_ids") or ())
                else:
                    tokens = int((obj.get("usage") or {}).get("completion_tokens") or 0)
                return Outcome("ok", time.perf_counter() - t0, first, tokens, status)
            done = False
            try:
                async for line in resp.content:
                    if first is None and line.startswith(b"data:"):
                        first = time.perf_counter() - t0
                    if line.startswith(b"data: [DONE]"):
                        done = True
                        break
                    tokens += _count_event(line)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                return Outcome(
                    "cut", time.perf_counter() - t0, first, tokens, status, type(exc).__name__
                )
            kind = "ok" if done else "cut"
            return Outcome(
                kind, time.perf_counter() - t0, first, tokens, status, None if done else "no [DONE]"
            )
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        kind = "cut" if first is not None else "failed"
        return Outcome(kind, time.perf_counter() - t0, first, tokens, status, type(exc).__name__)


async def closed_loop(
    urls: list[str],
    workload: str,
    *,
    concurrency: int,
    duration: float,
    tokens: int,
    warmup: float = 0.5,
    pause_after_failure: float = 0.0,
    on_start: Any = None,
) -> Stats:
    """``concurrency`` clients back to back for ``duration`` s (after ``warmup`` s not counted),
    round-robin over ``urls``. ``on_start(t0)`` is called when measuring begins."""
    api, stream = WORKLOADS[workload]
    body = json.dumps(request_body(api, stream, tokens)).encode()
    rr = itertools.cycle(urls)
    stats = Stats()
    async with session(limit=0) as s:
        stop_at = time.perf_counter() + warmup + duration
        measure_from = time.perf_counter() + warmup

        async def client() -> None:
            while True:
                now = time.perf_counter()
                if now >= stop_at:
                    return
                stats.sent += 1
                o = await one_request(s, next(rr), api, stream, body)
                if now >= measure_from:
                    stats.add(o)
                if o.kind != "ok" and pause_after_failure:
                    await asyncio.sleep(pause_after_failure)

        async def starter() -> None:
            await asyncio.sleep(max(0.0, measure_from - time.perf_counter()))
            if on_start is not None:
                on_start(time.perf_counter())

        await asyncio.gather(starter(), *(client() for _ in range(concurrency)))
        stats.wall_s = time.perf_counter() - measure_from
    return stats


async def open_loop(
    urls: list[str],
    workload: str,
    *,
    rate: float,
    duration: float,
    tokens: int,
    seed: int = 0,
    pair_urls: list[str] | None = None,
) -> Stats:
    """Requests started at ``rate`` per second (Poisson) for ``duration`` s; waits for all.

    ``pair_urls``: every other request goes there instead (``Stats.paired``), so that a front
    and the direct path are timed in one run, under the same load and the same machine speed:
    what a front adds is then read within one run, not across runs minutes apart."""
    api, stream = WORKLOADS[workload]
    body = json.dumps(request_body(api, stream, tokens)).encode()
    groups = [urls, pair_urls] if pair_urls else [urls]
    targets = [(itertools.cycle(g), Stats()) for g in groups]
    rng = random.Random(seed)
    async with session(limit=0) as s:
        # warm the pool: one request per url (not counted)
        for g, (_, st) in zip(groups, targets, strict=True):
            for u in g:
                st.sent += 1
                await one_request(s, u, api, stream, body)
        tasks: list[tuple[Stats, asyncio.Future[Outcome]]] = []
        t0 = time.perf_counter()
        next_at = t0
        i = 0
        while next_at < t0 + duration:
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rr, st = targets[i % len(targets)]
            i += 1
            st.sent += 1
            tasks.append((st, asyncio.ensure_future(one_request(s, next(rr), api, stream, body))))
            next_at += rng.expovariate(rate)
        outcomes = await asyncio.gather(*(t for _, t in tasks))
        for (st, _), o in zip(tasks, outcomes, strict=True):
            st.add(o)
        wall = time.perf_counter() - t0
    for _, st in targets:
        st.wall_s = wall
    stats = targets[0][1]
    stats.paired = targets[1][1] if len(targets) > 1 else None
    return stats


async def open_streams(
    urls: list[str],
    workload: str,
    *,
    count: int,
    tokens: int,
    opening: int = 256,
    timeout: float = 120.0,
    while_open: Any = None,
) -> dict[str, Any]:
    """Open ``count`` streams (at most ``opening`` being opened at once), wait until every one
    has sent its first event or failed (or ``timeout``), call ``while_open()`` (its result is
    returned under ``"at_open"``), then close them all."""
    api, stream = WORKLOADS[workload]
    assert stream, workload
    body = json.dumps(request_body(api, True, tokens)).encode()
    rr = itertools.cycle(urls)
    gate = asyncio.Semaphore(opening)
    opened = 0
    failed: dict[str, int] = {}
    all_open = asyncio.Event()
    release = asyncio.Event()
    responses: list[aiohttp.ClientResponse] = []

    async with session(limit=0) as s:

        async def hold() -> None:
            nonlocal opened
            async with gate:
                try:
                    resp = await s.post(next(rr) + PATHS[api], data=body)
                    if resp.status != 200:
                        text = (await resp.text())[:120]
                        key = f"{resp.status}: {text}"
                        failed[key] = failed.get(key, 0) + 1
                        resp.release()
                        return
                    line = await resp.content.readline()
                    while line and not line.startswith(b"data:"):
                        line = await resp.content.readline()
                    if not line:
                        failed["closed"] = failed.get("closed", 0) + 1
                        return
                    responses.append(resp)
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                    key = f"{type(exc).__name__}: {str(exc)[:120]}"
                    failed[key] = failed.get(key, 0) + 1
                    return
            opened += 1
            if opened + sum(failed.values()) >= count:
                all_open.set()
            await release.wait()

        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(hold()) for _ in range(count)]

        async def watch() -> None:
            while opened + sum(failed.values()) < count:
                await asyncio.sleep(0.1)
            all_open.set()

        watcher = asyncio.ensure_future(watch())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(all_open.wait(), timeout)
        open_s = time.perf_counter() - t0
        at_open = while_open() if while_open is not None and opened else None
        release.set()
        for r in responses:
            r.close()
        for t in tasks:
            t.cancel()
        watcher.cancel()
        await asyncio.gather(*tasks, watcher, return_exceptions=True)
    return {"opened": opened, "failed": failed, "open_s": round(open_s, 2), "at_open": at_open}

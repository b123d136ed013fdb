"""Hardening of the reference engine's HTTP layer (issue 12, items 5, 6 and 8).

Request limits with named 4xx (prompts and new tokens per request, concurrent generations),
whole-batch validation, abandoned generations aborted, connection-level limits (slow headers,
slow bodies, a connection cap, ``Content-Length`` checked before reading, memory returned after
large bodies), hostile JSON, fault injection behind authentication, the API key from a file or
the environment, disk-update errors that do not reveal the host's files. Every test that
touches an engine checks it afterwards: alive, serving, its checksum and version unchanged.
Real engine processes and real sockets over loopback; every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import select
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from engine_helpers import (
    EngineProcess,
    all_gone,
    engine_command,
    repo_env,
    start_engine,
    tiny_model_dir,  # noqa: F401  (fixture)
    wait_for,
)

# small limits, so that each is reached with small requests
MAX_PROMPTS = 8
MAX_TOTAL_NEW = 8000
MAX_RUNNING = 16
MAX_CONNECTIONS = 40
HEADER_TIMEOUT = 1.5
BODY_TIMEOUT = 2.5
BODY_IDLE = 1.0
MAX_BODY = 4 << 20
MAX_INFLIGHT_BODY = 70 << 20  # the 32 concurrent 2 MiB bodies below fit
LIMIT_ARGS = [
    "--max-prompts-per-request",
    str(MAX_PROMPTS),
    "--max-total-new-tokens",
    str(MAX_TOTAL_NEW),
    "--max-concurrent-requests",
    str(MAX_RUNNING),
    "--max-connections",
    str(MAX_CONNECTIONS),
    "--header-timeout",
    str(HEADER_TIMEOUT),
    "--body-timeout",
    str(BODY_TIMEOUT),
    "--body-idle-timeout",
    str(BODY_IDLE),
    "--max-body-bytes",
    str(MAX_BODY),
    "--max-inflight-body-bytes",
    str(MAX_INFLIGHT_BODY),
]
LONG = {"max_new_tokens": 1000, "ignore_eos": True}  # ~1 s of decoding per prompt


def _engine(request: pytest.FixtureRequest, model_dir: Path, **kw: Any) -> EngineProcess:
    eng = start_engine(model_dir, **kw)

    def stop() -> None:
        pids = [eng.pid, *eng.rank_pids]
        eng.stop()
        assert all_gone(pids), f"engine processes left over: {pids}"

    request.addfinalizer(stop)
    return eng


@pytest.fixture(scope="module")
def engine(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return _engine(request, tiny_model_dir, extra_args=LIMIT_ARGS)


@pytest.fixture(scope="module")
def vengine(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return _engine(request, tiny_model_dir, extra_args=[*LIMIT_ARGS, "--dialect", "vllm"])


def info(eng: EngineProcess) -> dict[str, Any]:
    r = eng.get("/get_server_info")
    assert r.status_code == 200, r.text
    return dict(r.json())


def idle(eng: EngineProcess, timeout: float = 30.0) -> None:
    """Wait until nothing runs in ``eng`` (a previous test's generations finished)."""
    assert wait_for(lambda: info(eng)["running_requests"] == 0, timeout)


@pytest.fixture
def before(engine: EngineProcess) -> Iterator[dict[str, Any]]:
    """The engine's checksum (with version) before the test; after it, the engine must be
    healthy, answer a generation, and hold the same weights and version."""
    idle(engine)
    state = engine.checksum()
    yield state
    assert engine.get("/health").status_code == 200
    r = engine.post("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    assert engine.checksum() == state


def refused(r: httpx.Response, status: int, error: str, needle: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["success"] is False and body["error"] == error, body
    assert needle in body["message"], body["message"]


# ---- raw sockets ---------------------------------------------------------------------------
def connect(eng: EngineProcess, timeout: float = 10.0) -> socket.socket:
    url = urlsplit(eng.url)
    assert url.hostname is not None and url.port is not None
    return socket.create_connection((url.hostname, url.port), timeout=timeout)


def post_bytes(path: str, body: bytes, content_length: int | None = None) -> bytes:
    length = len(body) if content_length is None else content_length
    return (
        f"POST {path} HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode() + body


def read_all(sock: socket.socket, limit: float) -> tuple[bytes, float]:
    """Everything ``sock`` receives until the peer closes it (or ``limit`` seconds pass, which
    fails the test); ``(data, seconds)``."""
    t0 = time.monotonic()
    data = b""
    sock.settimeout(0.2)
    while time.monotonic() - t0 < limit:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    else:
        raise AssertionError(f"connection still open after {limit} s; got {data[:200]!r}")
    return data, time.monotonic() - t0


def status_and_json(data: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body) if body else {}


# ---- 1. request limits ---------------------------------------------------------------------
def test_too_many_prompts_is_a_named_400_before_any_runs(
    engine: EngineProcess, vengine: EngineProcess, before: dict[str, Any]
) -> None:
    tokens = info(engine)["tokens_generated"]
    many = MAX_PROMPTS + 1
    for body in (
        {"input_ids": [[1, 2]] * many, "sampling_params": {"max_new_tokens": 4}},
        {"text": ["hello"] * many, "sampling_params": {"max_new_tokens": 4}},
    ):
        r = engine.post("/generate", body)
        refused(r, 400, "LimitExceeded", "--max-prompts-per-request")
        assert f"{many} prompts" in r.json()["message"]
    r = vengine.post("/v1/completions", {"prompt": [[1, 2]] * many, "max_tokens": 4})
    refused(r, 400, "LimitExceeded", "--max-prompts-per-request")
    assert info(engine)["tokens_generated"] == tokens
    ok = engine.post("/generate", {"input_ids": [[1, 2]] * MAX_PROMPTS})
    assert ok.status_code == 200 and len(ok.json()) == MAX_PROMPTS


def test_total_new_tokens_is_a_named_400_before_any_runs(
    engine: EngineProcess, vengine: EngineProcess, before: dict[str, Any]
) -> None:
    tokens = info(engine)["tokens_generated"]
    per = MAX_TOTAL_NEW // 4 + 1  # four prompts, one token over the limit in all
    r = engine.post(
        "/generate", {"input_ids": [[1, 2]] * 4, "sampling_params": {"max_new_tokens": per}}
    )
    refused(r, 400, "LimitExceeded", "--max-total-new-tokens")
    assert str(4 * per) in r.json()["message"]
    # one object per prompt: the sum counts each prompt's own max_new_tokens
    sps = [{"max_new_tokens": 10}, {"max_new_tokens": MAX_TOTAL_NEW}]
    r = engine.post("/generate", {"input_ids": [[1], [2]], "sampling_params": sps})
    refused(r, 400, "LimitExceeded", "--max-total-new-tokens")
    r = vengine.post("/v1/completions", {"prompt": [[1, 2]] * 4, "max_tokens": per})
    refused(r, 400, "LimitExceeded", "--max-total-new-tokens")
    time.sleep(0.3)
    assert info(engine)["running_requests"] == 0
    assert info(engine)["tokens_generated"] == tokens


def test_a_batch_with_one_invalid_prompt_runs_none_of_it(
    engine: EngineProcess, before: dict[str, Any]
) -> None:
    tokens = info(engine)["tokens_generated"]
    vocab = 10**6  # outside any tiny vocabulary
    for prompts in ([[1, 2], [3, 4], [vocab]], [[1, 2], [3, 4], [5] * 2000]):  # id; context
        r = engine.post("/generate", {"input_ids": prompts, "sampling_params": LONG})
        refused(r, 400, "BadRequest", "")
        # the valid prompts before the bad one were never queued: nothing runs, no token made
        assert info(engine)["running_requests"] == 0
    time.sleep(0.5)
    assert info(engine)["tokens_generated"] == tokens


def _send_abandonable(eng: EngineProcess, prompts: int) -> socket.socket:
    """A long generation of ``prompts`` prompts sent on a raw socket (close it to abandon)."""
    sock = connect(eng)
    body = json.dumps({"input_ids": [[1, 2, 3]] * prompts, "sampling_params": LONG}).encode()
    sock.sendall(post_bytes("/generate", body))
    return sock


def test_concurrency_cap_is_503_not_queued_and_abandoned_requests_are_aborted(
    engine: EngineProcess, before: dict[str, Any]
) -> None:
    socks = [_send_abandonable(engine, MAX_PROMPTS) for _ in range(MAX_RUNNING // MAX_PROMPTS)]
    try:
        assert wait_for(lambda: info(engine)["running_requests"] == MAX_RUNNING, 10)
        r = engine.post(
            "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
        )
        refused(r, 503, "EngineBusy", "--max-concurrent-requests")
        assert info(engine)["running_requests"] == MAX_RUNNING  # the refused one was not queued
        assert engine.get("/health").status_code == 200  # the health probe is not refused
    finally:
        for s in socks:
            s.close()  # the clients go away: their generations must stop
    # aborted at once, long before they would have finished (16 x 1000 tokens)
    assert wait_for(lambda: info(engine)["running_requests"] == 0, 5)
    tokens = info(engine)["tokens_generated"]
    time.sleep(0.3)
    assert info(engine)["tokens_generated"] == tokens  # no work goes on behind them
    t0 = time.monotonic()
    r = engine.post("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 8}})
    assert r.status_code == 200 and time.monotonic() - t0 < 5


def test_many_abandoned_generations_leave_the_running_set(
    engine: EngineProcess, before: dict[str, Any]
) -> None:
    """Abandon request after request (one prompt each, up to the cap): each is removed from the
    engine when its client goes, so another client's request is served with none in front."""
    for _ in range(3):
        socks = [_send_abandonable(engine, 1) for _ in range(MAX_RUNNING)]
        assert wait_for(lambda: info(engine)["running_requests"] == MAX_RUNNING, 10)
        for s in socks:
            s.close()
        assert wait_for(lambda: info(engine)["running_requests"] == 0, 5)
    r = engine.post("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 200, r.text


# ---- 3. connection-level limits ------------------------------------------------------------
def test_slow_headers_are_closed(engine: EngineProcess, before: dict[str, Any]) -> None:
    socks = [connect(engine) for _ in range(10)]
    for s in socks:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: engine\r\n")
    stop = threading.Event()

    def trickle() -> None:  # one more header byte now and then, never the blank line
        while not stop.wait(0.3):
            for s in socks:
                try:
                    s.sendall(b"X")
                except OSError:
                    pass

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        for s in socks:
            data, _ = read_all(s, HEADER_TIMEOUT + 5)
            assert b"HTTP/1.1 200" not in data  # never served
    finally:
        stop.set()
        t.join(5)
        for s in socks:
            s.close()


def test_slow_body_is_a_408_and_closed(engine: EngineProcess, before: dict[str, Any]) -> None:
    """A body that keeps coming, but too slowly for --body-timeout (never idle for
    --body-idle-timeout), is a 408 naming the total deadline."""
    sock = connect(engine)
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(BODY_IDLE / 4):
            try:
                sock.sendall(b" ")
            except OSError:
                return

    t = threading.Thread(target=trickle, daemon=True)
    try:
        sock.sendall(post_bytes("/generate", b'{"input_ids"', content_length=1000))
        t.start()
        data, seconds = read_all(sock, BODY_TIMEOUT + 5)
    finally:
        stop.set()
        t.join(5)
        sock.close()
    status, body = status_and_json(data)
    assert status == 408 and body["error"] == "RequestTimeout", data
    assert "--body-timeout" in body["message"]
    assert seconds < BODY_TIMEOUT + 4


def test_slow_loris_bodies_are_cut_at_the_idle_deadline_and_others_are_served(
    engine: EngineProcess, before: dict[str, Any]
) -> None:
    """Twenty clients trickle 4 body bytes every 1.5 --body-idle-timeout (the probe of issue 27
    sent 4 bytes per 10 s and held 50 sockets for over 65 s): each is a 408 naming
    --body-idle-timeout and closed within the idle deadline and some slack, long before
    --body-timeout would matter, while another client is served meanwhile."""
    socks = [connect(engine) for _ in range(20)]
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(BODY_IDLE * 1.5):
            for s in socks:
                try:
                    s.sendall(b'{"a"')
                except OSError:
                    pass

    for s in socks:
        s.sendall(post_bytes("/generate", b'{"a"', content_length=100_000))
    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        served = engine.post(
            "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
        )
        assert served.status_code == 200, served.text
        for s in socks:
            data, seconds = read_all(s, BODY_IDLE + 6)
            status, body = status_and_json(data)
            assert status == 408 and body["error"] == "RequestTimeout", data
            assert "--body-idle-timeout" in body["message"], body
            assert seconds < BODY_IDLE + 5
    finally:
        stop.set()
        t.join(5)
        for s in socks:
            s.close()


def test_bodies_in_flight_are_bounded(engine: EngineProcess, before: dict[str, Any]) -> None:
    """Bodies held open (all but their last bytes sent) count against
    --max-inflight-body-bytes: past it a new body is a 503 BodyBudgetExceeded before it is read;
    once the held clients go away their budget is free again."""
    size = 3 << 20
    payload = b'{"unknown_key": "' + b"x" * (size - 20)
    held = [connect(engine) for _ in range(MAX_INFLIGHT_BODY // size)]  # one more: past it
    try:
        for s in held:
            s.sendall(post_bytes("/generate", payload, content_length=size))
        time.sleep(0.5)  # read by the engine, waiting for their last bytes
        sock = connect(engine)  # declares one more: refused before any of it is sent
        try:
            sock.sendall(post_bytes("/generate", b"", content_length=size))
            data, _ = read_all(sock, 5)
        finally:
            sock.close()
        status, body = status_and_json(data)
        assert status == 503 and body["error"] == "BodyBudgetExceeded", data
        assert "--max-inflight-body-bytes" in body["message"], body
        assert engine.get("/health").status_code == 200  # small requests are still served
    finally:
        for s in held:
            s.close()
    time.sleep(1.0)  # the handlers are cancelled
    ok = engine.post_once(
        "/generate",
        content=b'{"input_ids": [1, 2]' + b" " * (size - 40) + b"}",
        headers={"Content-Type": "application/json"},
    )
    assert ok.status_code == 200, ok.text  # the held bodies' budget was given back


def test_memory_of_held_large_bodies_is_given_back(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    """The probe of issue 27: eight 60 MiB bodies held open (all but their last bytes sent),
    then dropped, took the engine's RSS from 416 MB to 896 MB for good. Now four are read (the
    default --max-inflight-body-bytes, 256 MiB), four are refused 503 before reading, and once
    the clients go away the RSS is back near where it was (a cut body's buffer left to the
    garbage collector kept 122 MB here)."""
    # the held bodies stay incomplete on purpose: the idle and body time-outs (5 s / 60 s,
    # tested elsewhere) must not answer them 408 while a loaded machine sends the others
    eng = _engine(
        request,
        tiny_model_dir,
        extra_args=[
            "--max-body-bytes",
            str(64 << 20),
            "--body-idle-timeout",
            "300",
            "--body-timeout",
            "300",
        ],
    )
    size = 60 << 20
    payload = b'{"unknown_key": "' + b"x" * (size - 20)
    first = _rss_kib(eng.pid)
    held = [connect(eng) for _ in range(8)]
    answers: list[bytes] = []
    try:
        for s in held:
            try:
                s.sendall(post_bytes("/generate", payload, content_length=size))
            except OSError:  # refused before it was read: the engine closed the connection
                pass
        # the four read bodies are held (the engine may take a while to copy 240 MiB)
        assert wait_for(lambda: _rss_kib(eng.pid) - first > 200 << 10, 20)
        for s in held:
            s.settimeout(0.5)
            try:
                answers.append(s.recv(200))
            except OSError:
                answers.append(b"")
        refused = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
        assert len(refused) == 4, answers
    finally:
        for s in held:
            s.close()
    time.sleep(2.0)  # the handlers are cancelled; the memory trimmer runs
    grown = _rss_kib(eng.pid) - first
    assert grown < 40 << 10, f"RSS grew by {grown} KiB after the held bodies went away"
    r = eng.post("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text


def test_declared_huge_body_gets_an_immediate_413(
    engine: EngineProcess, before: dict[str, Any]
) -> None:
    sock = connect(engine)
    try:
        sock.sendall(post_bytes("/update_weights_from_tensor", b"", content_length=10 << 30))
        t0 = time.monotonic()
        sock.settimeout(5)
        data = sock.recv(65536)
        assert time.monotonic() - t0 < 2
    finally:
        sock.close()
    status, _ = status_and_json(data.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n")
    assert status == 413, data
    assert b"--max-body-bytes" in data and b"PayloadTooLarge" in data


def test_connections_past_the_cap_are_refused(
    engine: EngineProcess, before: dict[str, Any]
) -> None:
    socks = [connect(engine) for _ in range(MAX_CONNECTIONS + 6)]
    try:
        time.sleep(0.3)  # well within --header-timeout: the accepted ones are still open
        readable, _, _ = select.select(socks, [], [], 0)
        answers: list[bytes | None] = [s.recv(65536) if s in readable else None for s in socks]
        busy = [a for a in answers if a is not None and a.startswith(b"HTTP/1.1 503")]
        # the test client's own pooled connection may hold one slot
        assert 6 <= len(busy) <= 7, answers
        assert all(b"--max-connections" in a and b"TooManyConnections" in a for a in busy)
        assert sum(a is None for a in answers) >= MAX_CONNECTIONS - 1
    finally:
        for s in socks:
            s.close()
    assert wait_for(lambda: engine.healthy(), 10)


KEEPALIVE_S = 3  # the engines below: a short keep-alive, set as on the real servers


def _one_response(sock: socket.socket) -> bytes:
    """One whole HTTP/1.1 response (``Content-Length`` bodies) read from ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a whole head: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a whole body: {data!r}"
        body += chunk
    return head


@pytest.mark.parametrize(
    ("dialect", "variable"),
    [("sglang", "SGLANG_TIMEOUT_KEEP_ALIVE"), ("vllm", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE")],
)
def test_an_idle_kept_alive_connection_is_closed_after_the_servers_keep_alive(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,  # noqa: F811
    dialect: str,
    variable: str,
) -> None:
    """SGLang and vLLM (uvicorn's ``timeout_keep_alive``, 5 s unless the dialect's variable
    says otherwise) close a kept-alive connection that sends nothing for that long after a
    response; requests sent sooner keep it. A client reusing it later meets a closed socket,
    on the reference engine as on the real ones."""
    # the header time-out, aiohttp's own idle bound, far past the keep-alive and the wait
    args = ["--dialect", dialect, "--header-timeout", "120"]
    eng = _engine(request, tiny_model_dir, extra_args=args, env={variable: str(KEEPALIVE_S)})
    sock = connect(eng)
    try:
        for _ in range(4):  # 0.3 s apart, well inside the keep-alive: the same connection
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: engine\r\n\r\n")
            assert _one_response(sock).startswith(b"HTTP/1.1 200")
            time.sleep(0.3)
        sent = time.monotonic()  # the engine's timer starts after this request arrived
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: engine\r\n\r\n")
        assert _one_response(sock).startswith(b"HTTP/1.1 200")
        data, _ = read_all(sock, KEEPALIVE_S + 30)
        idle_s = time.monotonic() - sent
    finally:
        sock.close()
    assert data == b""  # closed by the engine, nothing sent
    assert idle_s >= KEEPALIVE_S  # not before the keep-alive ran out
    assert eng.get("/health").status_code == 200


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_memory_of_large_bodies_is_given_back(
    engine: EngineProcess, before: dict[str, Any]
) -> None:
    """Bursts of concurrent 2 MiB bodies (read, parsed, refused): with the memory given back to
    the OS after each, the engine's RSS is back under where it started (+2 MiB) after every
    burst (measured: 0.4-0.5 MiB *under* it). Without it, glibc keeps the freed bodies in its
    arenas and the RSS after a burst wanders (measured over 6 bursts, 3 fresh engines: up to
    14, 2.9 and 24 MiB above the start).

    The trim runs on the engine's event loop ~0.2 s after the answers and after the last large
    request is freed; on a loaded machine that loop runs late, so the RSS is read until it is
    back: memory kept is never given back, so the bound is on the memory and the wait only on
    the clock."""
    body = json.dumps({"unknown_key": "x" * (2 << 20)}).encode()

    def send() -> None:
        r = httpx.post(f"{engine.url}/generate", content=body, timeout=30)
        assert r.status_code == 400, r.text

    start = _rss_kib(engine.pid)
    for n in range(6):
        threads = [threading.Thread(target=send) for _ in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        seen: list[int] = []

        def back_under(seen: list[int] = seen) -> bool:
            seen.append(_rss_kib(engine.pid) - start)
            return seen[-1] < 2 << 10

        back = wait_for(back_under, 20)
        assert back, f"burst {n + 1}: RSS {seen[-1]} KiB above the start and stayed ({seen[:4]}...)"


def test_a_trim_follows_the_answers_and_each_freed_large_request() -> None:
    """A trim runs after a burst of answers (one for the burst) and again after each freed
    large request, however late that is (CI: the trim timed from the answers alone ran before
    the last bodies were freed, and 12 MiB stayed resident)."""
    from rollsafe.adapters.reference_engine.server import _MemoryTrimmer

    class Request:  # stands for an aiohttp request and what it holds
        pass

    async def main() -> None:
        trims: list[int] = []
        trimmer = _MemoryTrimmer(delay_s=0.01, trim=lambda pad: trims.append(pad) or 1)

        async def runs(n: int) -> None:
            while trimmer.runs < n:
                await asyncio.sleep(0.01)

        held = [Request(), Request()]
        trimmer.track(held[0])
        trimmer.track(held[1])  # answered in the same turn of the loop: one trim
        await runs(1)
        await asyncio.sleep(0.2)
        assert (trimmer.runs, trimmer.alive) == (1, 2)
        held.pop()  # freed late, long after its answer
        assert trimmer.alive == 1
        await runs(2)
        held.pop()
        gc.collect()
        assert trimmer.alive == 0
        await runs(3)
        await asyncio.sleep(0.2)
        assert trims == [0, 0, 0]

    asyncio.run(main())


# ---- 4. hostile JSON -----------------------------------------------------------------------
HOSTILE: list[tuple[str, bytes, str]] = [
    ("nan", b'{"input_ids":[1],"sampling_params":{"temperature":NaN}}', "NaN"),
    ("inf", b'{"input_ids":[1],"sampling_params":{"temperature":Infinity}}', "Infinity"),
    ("-inf", b'{"input_ids":[1],"sampling_params":{"top_p":-Infinity}}', "Infinity"),
    ("1e400", b'{"input_ids":[1],"sampling_params":{"temperature":1e400}}', "overflows"),
    ("subnormal", b'{"input_ids":[1],"sampling_params":{"temperature":5e-324}}', "subnormal"),
    (
        "seed",
        b'{"input_ids":[1],"sampling_params":{"sampling_seed":18446744073709551616}}',
        "int64",
    ),
    (
        "-seed",
        b'{"input_ids":[1],"sampling_params":{"sampling_seed":-9223372036854775809}}',
        "int64",
    ),
    (
        "digits",
        b'{"input_ids":[1],"sampling_params":{"sampling_seed":' + b"9" * 5000 + b"}}",
        "digits",
    ),
    ("surrogate", b'{"text":"ab\\ud800cd","sampling_params":{"max_new_tokens":2}}', "surrogate"),
    ("surrogate-list", b'{"text":["a","\\udfff"]}', "surrogate"),
    ("surrogate-key", b'{"\\ud800":1}', "surrogate"),
    ("surrogate-rid", b'{"text":"a","rid":"\\udc00"}', "surrogate"),
    ("deep", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ("deep-value", b'{"text":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    ("utf8", b'{"text":"\xff\xfe"}', "malformed JSON"),
    ("array", b"[1, 2]", "JSON object"),
    ("string", b'"text"', "JSON object"),
    ("number", b"3", "JSON object"),
]


@pytest.mark.parametrize(("name", "raw", "needle"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_json_is_a_named_400(
    engine: EngineProcess, before: dict[str, Any], name: str, raw: bytes, needle: str
) -> None:
    r = engine.post("/generate", content=raw, headers={"Content-Type": "application/json"})
    refused(r, 400, "BadRequest", needle)


def test_valid_surrogate_pairs_and_tiny_temperatures_still_work(
    engine: EngineProcess, before: dict[str, Any]
) -> None:
    raw = b'{"text":"\\ud83d\\ude00","sampling_params":{"max_new_tokens":2}}'  # one emoji
    r = engine.post("/generate", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    for temp in (1e-300, 1e-7, 2.2250738585072014e-308):  # normal, below the greedy threshold
        greedy = {"max_new_tokens": 6, "temperature": 0}
        tiny = {"max_new_tokens": 6, "temperature": temp}
        a = engine.post("/generate", {"input_ids": [5, 6], "sampling_params": greedy}).json()
        b = engine.post("/generate", {"input_ids": [5, 6], "sampling_params": tiny})
        assert b.status_code == 200, b.text
        assert b.json()["output_ids"] == a["output_ids"]
    seed = {"max_new_tokens": 3, "sampling_seed": 2**63 - 1}
    assert engine.post("/generate", {"input_ids": [1], "sampling_params": seed}).status_code == 200


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b'{"prompt":"a","seed":9223372036854775808}', "int64"),
        (b'{"prompt":"a","temperature":1e-320}', "subnormal"),
        (b'{"prompt":"\\ud800"}', "surrogate"),
        (b'{"prompt":"a","temperature":NaN}', "NaN"),
        (b'{"prompt":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    ],
)
def test_hostile_json_vllm_dialect(vengine: EngineProcess, raw: bytes, needle: str) -> None:
    r = vengine.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    refused(r, 400, "BadRequest", needle)
    assert vengine.get("/health").status_code == 200


# ---- 5. weight-update group arguments (issue 27) ---------------------------------------------
GROUP = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
BAD_GROUP: list[tuple[str, Any, str]] = [
    ("master_port", 70000, "1..65535"),
    ("master_port", -1, "1..65535"),
    ("master_port", 0, "1..65535"),
    ("master_port", True, "must be an int"),
    ("master_port", 2**70, "1..65535"),
    ("world_size", 2**40, "world_size must be in"),
    ("world_size", 1, "world_size must be in"),
    ("rank_offset", False, "must be an int"),
    ("rank_offset", 0, "does not fit"),
    ("master_address", "", "host name or an IP address"),
    ("master_address", "a b", "host name or an IP address"),
    ("master_address", "x" * 300, "host name or an IP address"),
]


@pytest.mark.parametrize(("key", "value", "needle"), BAD_GROUP, ids=lambda v: str(v)[:12])
def test_bad_group_arguments_are_a_named_400_and_change_nothing(
    engine: EngineProcess,
    vengine: EngineProcess,
    before: dict[str, Any],
    key: str,
    value: Any,
    needle: str,
) -> None:
    """The probe of issue 27 got a raw ``TypeError: __init__(): incompatible constructor
    arguments`` for ``master_port`` 70000: every value torch could not take is a 400 naming the
    key, in both dialects, and no group is made."""
    r = engine.post("/init_weights_update_group", {**GROUP, key: value, "group_name": "g"})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["error"] == "BadRequest" and key in body["message"], body
    assert needle in body["message"] or "does not match" in body["message"], body
    assert "TypeError" not in body["message"]
    # the group was not made: destroying it is refused as unknown
    gone = engine.post("/destroy_weights_update_group", {"group_name": "g"})
    assert gone.status_code == 400 and "no weight update group 'g'" in gone.text, gone.text
    r = vengine.post_once("/init_weight_transfer_engine", {"init_info": {**GROUP, key: value}})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["error"] == "BadRequest" and key in body["message"], body
    assert needle in body["message"] or "does not match" in body["message"], body
    assert "TypeError" not in body["message"]
    assert vengine.get("/health").status_code == 200


# ---- 6. child processes (issue 27) --------------------------------------------------------
def _children(pid: int) -> list[tuple[int, str, str]]:
    """``(pid, name, state)`` of every process whose parent is ``pid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        state, ppid = text[text.rindex(")") + 2 :].split()[:2]
        if int(ppid) == pid:
            found.append((int(text.split()[0]), name, state))
    return found


def test_a_shared_memory_update_leaves_no_child_of_the_engine(
    engine: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
    before: dict[str, Any],
) -> None:
    """A shared-memory update (SGLang's ``flattened_bucket`` payload, CPU segments named in it)
    maps the sender's segments read-only: the engine starts no ``torch_shm_manager`` and leaves
    no zombie child; its only children are its ranks. (The defunct manager issue 27 saw is the
    sender's: torch starts it in the process that shares memory, see docs/security.md.)"""
    from safetensors.torch import load_file

    from rollsafe.wire.bucket import pack_buckets, serialize_bucket

    state = load_file(str(tiny_model_dir / "model.safetensors"))
    for bucket in pack_buckets(state.items(), bucket_bytes=64 << 10):
        r = engine.post(
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": [serialize_bucket(bucket)],
                "load_format": "flattened_bucket",
            },
        )
        assert r.status_code == 200, r.text
    time.sleep(1.0)
    tree = [engine.pid, *engine.rank_pids]
    children = [c for pid in tree for c in _children(pid)]
    assert not [c for c in children if c[2] == "Z"], f"zombie children: {children}"
    assert not [c for c in children if "shm" in c[1]], f"shm manager in the engine: {children}"
    assert {c[0] for c in children} <= set(engine.rank_pids), children


def test_vllm_weight_version_is_type_checked(vengine: EngineProcess) -> None:
    before = vengine.checksum()
    for path, body in [
        ("/finish_weight_update", {"weight_version": 5}),
        ("/finish_weight_update", {"weight_version": ["v2"]}),
        ("/finish_weight_update", {"weight_version": {"v": 1}}),
        ("/update_weight_version", {"new_version": 5}),
        ("/update_weight_version", {"new_version": None}),
        ("/update_weight_version", {"new_version": True}),
    ]:
        r = vengine.post(path, body)
        assert r.status_code == 400, (path, body, r.text)
        assert ("weight_version" in r.text) or ("new_version" in r.text)
    assert vengine.get("/weight_info").json()["weight_version"] == before["weight_version"]
    assert vengine.checksum() == before


# ---- disk updates do not reveal the host's files -------------------------------------------
def _disk_messages(eng: EngineProcess, route: str, paths: list[str]) -> list[str]:
    out = []
    key = "model_path" if route == "/update_weights_from_disk" else "weights_path"
    for p in paths:
        if route == "/update_weights_from_disk":
            r = eng.post(route, {"model_path": p})
        else:
            r = eng.post_once(route, {"method": "reload_weights", "kwargs": {"weights_path": p}})
        if route == "/update_weights_from_disk":  # SGLang: a 400 naming the error
            assert r.status_code == 400, r.text
            assert r.json()["error"] == "WeightUpdateError"
            message = r.json()["message"]
        else:  # vLLM 0.32.0: collective_rpc wraps the worker's error in an OpenAI-style 500
            assert r.status_code == 500, r.text
            wrapped = re.fullmatch(
                r"Call to collective_rpc method failed: Worker failed with error '(.*)', "
                r"please check the stack trace above for the root cause",
                r.json()["error"]["message"],
                flags=re.S,
            )
            assert wrapped, r.text
            message = wrapped.group(1)
            # like vLLM, the failed reload took the old weights (the next forward pass would
            # kill the engine) while /health still answers 200; a complete reload restores them
            assert eng.get("/health").status_code == 200
            heal = eng.post_once(route, {"method": "reload_weights", "kwargs": {}})
            assert heal.status_code == 200, heal.text
        assert message.startswith(f"{key} {repr(p)[:40]}"), message  # the path as it was sent
        out.append(re.sub(rf"^{key} .*? is not", f"{key} <PATH> is not", message))
    return out


def test_disk_update_errors_do_not_tell_which_paths_exist(
    engine: EngineProcess, vengine: EngineProcess, tmp_path: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "model.safetensors").write_bytes(b"\0" * 16)
    locked.chmod(0)
    paths = [
        str(tmp_path / "missing"),  # does not exist
        str(empty),  # exists, holds no weights
        str(a_file),  # a file
        "/etc",  # a system directory
        "/proc/self/root/etc",
        str(tmp_path / "nul\u0000byte"),  # not a valid path
        "relative/dir/that/does/not/exist",
    ]
    if os.geteuid() != 0:  # root reads it anyway
        paths.append(str(locked))  # unreadable
    try:
        for eng, route in ((engine, "/update_weights_from_disk"), (vengine, "/collective_rpc")):
            before = eng.checksum()
            messages = _disk_messages(eng, route, paths)
            assert len(set(messages)) == 1, messages  # one message, whatever the reason
            assert "<PATH>" in messages[0]
            for m in messages:
                assert "/" not in m.replace("<PATH>", ""), m  # no path but the client's
            assert eng.checksum() == before
            assert eng.get("/health").status_code == 200
    finally:
        locked.chmod(0o700)


# ---- fault injection behind authentication; the API key kept out of ps ---------------------
KEY = "hardening-secret-key-7c1f"


def _cmdlines(pids: list[int]) -> str:
    out = []
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            out.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=False)
    return "\n".join(out) + ps.stdout


def test_api_key_file_hides_the_key_and_faults_need_it(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    eng = _engine(
        request, tiny_model_dir, faults=True, extra_args=["--api-key-file", str(key_file)]
    )
    assert KEY not in _cmdlines([eng.pid, *eng.rank_pids])
    anon = httpx.Client(base_url=eng.url, timeout=10)
    try:
        for path, body in [
            ("/fault/crash", {}),
            ("/fault/hang", {}),
            ("/fault/slow", {"seconds": 30}),
            ("/fault/fail_next", {"endpoint": "/health"}),
            ("/fault/stall", {"after_tokens": 1}),
        ]:
            r = anon.post(path, json=body)
            assert r.status_code == 401, (path, r.text)
        wrong = anon.post("/fault/crash", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert anon.get("/get_server_info").status_code == 401
    finally:
        anon.close()
    eng.api_key = KEY
    t0 = time.monotonic()
    assert eng.get("/health").status_code == 200  # not slowed, not failed, not hanging
    assert time.monotonic() - t0 < 5
    assert eng.post("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})
    assert eng.proc.poll() is None


def test_api_key_from_the_environment(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    eng = _engine(request, tiny_model_dir, env={"ROLLSAFE_API_KEY": KEY})
    assert KEY not in _cmdlines([eng.pid, *eng.rank_pids])
    assert httpx.get(f"{eng.url}/get_server_info", timeout=10).status_code == 401
    eng.api_key = KEY
    assert eng.get("/get_server_info").status_code == 200


def _usage(model_dir: Path, *args: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        engine_command(model_dir, extra_args=list(args)),
        capture_output=True,
        text=True,
        timeout=60,
        env=repo_env({**os.environ, **(env or {})}),
    )
    assert proc.returncode == 2, proc.stderr
    return proc.stderr


def test_bad_key_sources_and_limits_are_usage_errors(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    empty = tmp_path / "empty-key"
    empty.write_text("\n")
    assert "cannot be read" in _usage(tiny_model_dir, "--api-key-file", str(tmp_path / "nokey"))
    assert "is empty" in _usage(tiny_model_dir, "--api-key-file", str(empty))
    assert "not allowed with" in _usage(
        tiny_model_dir, "--api-key", "a", "--api-key-file", str(empty)
    )
    assert "ROLLSAFE_API_KEY" in _usage(tiny_model_dir, env={"ROLLSAFE_API_KEY": " "})
    assert "--max-connections" in _usage(tiny_model_dir, "--max-connections", "0")
    assert "--header-timeout" in _usage(tiny_model_dir, "--header-timeout", "nan")
    assert "--body-idle-timeout" in _usage(tiny_model_dir, "--body-idle-timeout", "0")
    assert "--max-inflight-body-bytes" in _usage(tiny_model_dir, "--max-inflight-body-bytes", "1")
    # the real servers' keep-alive variables: an int of seconds
    assert "$SGLANG_TIMEOUT_KEEP_ALIVE must be a whole number of seconds, got '2.5'" in _usage(
        tiny_model_dir, env={"SGLANG_TIMEOUT_KEEP_ALIVE": "2.5"}
    )
    assert "$VLLM_HTTP_TIMEOUT_KEEP_ALIVE must be >= 0, got -1" in _usage(
        tiny_model_dir, "--dialect", "vllm", env={"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "-1"}
    )
    # off loopback a key is required; one from the environment is enough (the next check,
    # of the limits, is reached)
    assert "without an API key" in _usage(tiny_model_dir, "--host", "0.0.0.0")
    out = _usage(
        tiny_model_dir,
        "--host",
        "0.0.0.0",
        "--max-body-bytes",
        "1",
        env={"ROLLSAFE_API_KEY": KEY},
    )
    assert "--max-body-bytes" in out


# ---- unit checks (no engine) ---------------------------------------------------------------
def test_limit_flag_defaults_are_the_server_defaults() -> None:
    from rollsafe.adapters.reference_engine.__main__ import parse_args, server_limits
    from rollsafe.adapters.reference_engine.server import ServerLimits

    assert server_limits(parse_args(["--model-path", "m"])) == ServerLimits()


def test_each_dialect_reads_its_servers_keep_alive_variable() -> None:
    from rollsafe.adapters.reference_engine.__main__ import keepalive_timeout

    assert keepalive_timeout("sglang", {}) == keepalive_timeout("vllm", {}) == 5
    assert keepalive_timeout("sglang", {"SGLANG_TIMEOUT_KEEP_ALIVE": "7"}) == 7
    assert keepalive_timeout("vllm", {"SGLANG_TIMEOUT_KEEP_ALIVE": "7"}) == 5  # not its own
    assert keepalive_timeout("vllm", {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": " 9 "}) == 9  # int() strips
    assert "got 'x'" in str(keepalive_timeout("vllm", {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "x"}))


def test_resolve_api_key_pops_the_environment(tmp_path: Path) -> None:
    from rollsafe.adapters.reference_engine.__main__ import resolve_api_key

    env = {"ROLLSAFE_API_KEY": " k1 \n", "OTHER": "x"}
    args = argparse.Namespace(api_key=None, api_key_file=None)
    assert resolve_api_key(args, env) is None and args.api_key == "k1"
    assert env == {"OTHER": "x"}  # not inherited by the ranks
    f = tmp_path / "k"
    f.write_text("k2\n")
    args = argparse.Namespace(api_key=None, api_key_file=str(f))
    env = {"ROLLSAFE_API_KEY": "k1"}
    assert resolve_api_key(args, env) is None and args.api_key == "k2"  # the flag wins
    assert env == {}


@pytest.mark.parametrize(
    "raw",
    [b"NaN", b"[-Infinity]", b"1e999", b'"\\udfff"', b'{"\\ud800": 0}', b"[" * 5000, b"\xc3("],
)
def test_parse_json_names_hostile_input(raw: bytes) -> None:
    from rollsafe.adapters.reference_engine.errors import BadRequest
    from rollsafe.adapters.reference_engine.server import parse_json

    with pytest.raises(BadRequest, match="malformed JSON body"):
        parse_json(raw)
    assert parse_json(b'{"a": [1.5, "\\ud83d\\ude00", -0.0]}') == {"a": [1.5, "\U0001f600", -0.0]}

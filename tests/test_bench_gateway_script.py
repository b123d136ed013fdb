"""``benchmarks/bench_gateway.py`` and its parts (``benchmarks/gateway/``): the stub engine's
answers and counters (which survive a SIGKILL), the SYN counter, the command line, the summary
arithmetic, issue #35's targets as checks, and the ``--smoke`` run end to end on the stubs
(direct, the aiohttp proxy, rollsafe's gateway; the two Rust routers too where ``make
routers`` has made ``.venv-routers``); ``benchmarks/gateway/profile_gateway.py``'s reading of
py-spy samples and its in-process mode. Nothing here is timed: the figures are not asserted,
only the checks and the shape.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_gateway.py"
ROUTERS_PYTHON = ROOT / ".venv-routers" / "bin" / "python"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_gateway", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gateway"] = module  # its dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def stub(bench: ModuleType, tmp_path: Path) -> Any:
    engines = bench.start_stubs(tmp_path, "t", n=1)
    yield engines[0]
    bench.stop_all(engines)


def _events(text: str) -> list[Any]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_stub_accepts_the_routers_extra_keys_and_counts(stub: Any) -> None:
    with httpx.Client(base_url=stub.url) as c:
        body = {
            "input_ids": [1, 2],
            "sampling_params": {"max_new_tokens": 3},
            "model": "m",  # sglang-router's
            "return_hidden_states": False,  # both routers'
        }
        r = c.post("/generate", json=body)
        assert r.status_code == 200
        assert r.json()["output_ids"] == [7, 7, 7]
        assert r.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
        r = c.post(
            "/v1/completions",
            json={"prompt": [1], "max_tokens": 2, "no_stop_trim": True, "stream": True},
        )
        events = _events(r.text)
        assert r.headers["content-type"] == "text/event-stream" and events[-1] == "[DONE]"
        assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None, "length"]
        stats = c.get("/stub/stats").json()
    assert stats["keys_seen"]["/generate"][:4] == [
        "input_ids",
        "sampling_params",
        "model",
        "return_hidden_states",
    ]
    assert "no_stop_trim" in stats["keys_seen"]["/v1/completions"]
    c = stats["counters"]
    assert (c["generate"], c["completions"], c["tokens_generated"], c["tokens_in_finished"]) == (
        1,
        1,
        5,
        5,
    )
    assert (c["streams_started"], c["streams_finished"]) == (1, 1)


@pytest.mark.parametrize(
    ("path", "body", "key"),
    [
        (
            "/generate",
            {"sampling_params": {"max_new_tokens": -1}},
            "sampling_params.max_new_tokens",
        ),
        (
            "/generate",
            {"sampling_params": {"max_new_tokens": "8"}},
            "sampling_params.max_new_tokens",
        ),
        ("/v1/completions", {"max_tokens": True}, "max_tokens"),
        ("/v1/completions", [1, 2], "body"),
    ],
)
def test_stub_bad_bodies_are_400_naming_the_key(stub: Any, path: str, body: Any, key: str) -> None:
    r = httpx.post(stub.url + path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == key
    assert stub.read()["bad_request"] == 1 and stub.read()["tokens_generated"] == 0


def test_stub_counters_survive_sigkill(bench: ModuleType, tmp_path: Path) -> None:
    (eng,) = bench.start_stubs(tmp_path, "k", interval_ms=1000, n=1)
    try:
        with (
            httpx.Client(base_url=eng.url, timeout=10) as c,
            c.stream(
                "POST",
                "/generate",
                json={"sampling_params": {"max_new_tokens": 50}, "stream": True},
            ) as r,
        ):
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(eng.proc.pid, signal.SIGKILL)
            eng.proc.wait(10)
            with pytest.raises(httpx.HTTPError):
                list(lines)
        got = eng.read()
        assert got["streams_started"] == 1 and got["streams_finished"] == 0
        assert got["tokens_generated"] == 1 and got["tokens_in_finished"] == 0
    finally:
        bench.stop_all([eng])


def test_syn_counter_counts_refused_connections_to_its_port_only() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks" / "gateway"))
    from fronts import free_port
    from syn_counter import SynCounter

    port, other = free_port(), free_port()
    counter = SynCounter(port).start()
    if counter.error:
        pytest.skip(f"no raw socket here (needs root or CAP_NET_RAW): {counter.error}")
    try:
        time.sleep(0.1)
        for p in (port, port, port, other):
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", p), timeout=2)
        deadline = time.monotonic() + 5
        while len(counter.times) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
    finally:
        counter.stop()
    assert len(counter.times) == 3


def test_arguments(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    args = bench.parse_args([])
    assert args.front_names[:4] == ["direct", "sglang-router", "vllm-router", "gateway"]
    assert args.engine_kinds == ["stub", "reference"] and args.streams == 9_900
    assert (args.latency_duration, args.reference_latency_duration) == (3.0, 15.0)
    assert args.reference_cpus == "split"
    assert args.out == str(ROOT / "benchmarks" / "results" / "gateway_cpu.json")
    smoke = bench.parse_args(["--smoke"])
    assert smoke.engine_kinds == ["stub"] and smoke.streams <= 200
    assert smoke.out != args.out and {"direct", "gateway"} <= set(smoke.front_names)
    for argv, says in (
        (["--fronts", "direct,nginx"], "unknown fronts ['nginx']"),
        (["--fronts", "sglang-router"], "must include direct"),
        (["--engines", "tgi"], "--engines"),
        (["--crash-at", "20"], "--crash-at"),
        (["--concurrency", "8,x"], "--concurrency"),
        (["--streams", "0"], "--streams must be >= 1"),
        (["--reference-latency-duration", "0"], "--reference-latency-duration must be > 0"),
    ):
        with pytest.raises(SystemExit) as exc:
            bench.parse_args(argv)
        assert exc.value.code == 2
        assert says in capsys.readouterr().err


def test_the_reference_phase_splits_the_cpus_between_engines_and_fronts(
    bench: ModuleType, tmp_path: Path
) -> None:
    """``--reference-cpus split``: the engines on the last CPU, the fronts and the client on the
    others; a process spawned on a set of CPUs, and every thread it starts, runs there."""
    cpus = sorted(os.sched_getaffinity(0))
    engines, fronts = bench.split_cpus("split")
    if len(cpus) < 2:
        assert (engines, fronts) == (None, None)
    else:
        assert engines == {cpus[-1]} and fronts == set(cpus[:-1])
    assert bench.split_cpus("shared") == (None, None)
    child = (
        "import json, os, threading, time\n"
        "seen = {}\n"
        "t = threading.Thread(target=lambda: seen.update(thread=sorted(os.sched_getaffinity(0))))\n"
        "t.start(); t.join()\n"
        "seen['main'] = sorted(os.sched_getaffinity(0))\n"
        "print('READY ' + json.dumps(seen), flush=True)\n"
        "time.sleep(60)\n"
    )
    proc, got = bench.F.spawn(
        [sys.executable, "-c", child], tmp_path / "p.log", "READY ", cpus={cpus[-1]}
    )
    proc.kill()
    proc.wait()
    assert got == {"thread": [cpus[-1]], "main": [cpus[-1]]}
    with bench.on_cpus({cpus[0]}):  # the fronts started inside it, and this thread
        assert os.sched_getaffinity(0) == {cpus[0]}
        pinned = subprocess.run(
            [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
            capture_output=True,
            text=True,
            check=True,
            preexec_fn=bench.F._child_setup(bench.F.FRONT_CPUS),
        )
        assert pinned.stdout.strip() == str([cpus[0]])
    assert os.sched_getaffinity(0) == set(cpus) and bench.F.FRONT_CPUS is None


def test_summaries_take_the_best_concurrency_and_ratios_to_direct(bench: ModuleType) -> None:
    def r(c: int, rps: float) -> dict[str, Any]:
        return {"concurrency": c, "req_per_s": rps, "front_cpu_us_per_req": 10.0}

    runs = {
        "direct": {"generate": [r(4, 100), r(16, 200), r(4, 110), r(16, 220)]},
        "x": {"generate": [r(4, 90), r(16, 50), r(4, 100), r(16, 60)]},
    }
    s = bench.summarize_throughput(runs)
    assert s["direct"]["generate"]["best_concurrency"] == 16
    assert s["direct"]["generate"]["best_req_per_s"] == 210
    assert (
        s["x"]["generate"]["best_concurrency"] == 4 and s["x"]["generate"]["best_req_per_s"] == 95
    )
    assert s["x"]["generate"]["vs_direct"] == round(95 / 210, 3)
    lat = {
        "direct": {"generate": [{"rate": 5, "p50_ms": 1.0, "p99_ms": 3.0, "failed": 0, "cut": 0}]},
        "x": {"generate": [{"rate": 5, "p50_ms": 1.5, "p99_ms": 2.0, "failed": 0, "cut": 1}]},
    }
    got = bench.summarize_latency(lat)["x"]["generate"]
    assert (got["added_p50_ms"], got["added_p99_ms"], got["failed"]) == (0.5, -1.0, 1)
    assert got["added_from"] == "rounds"


def test_added_latency_is_read_beside_direct_within_each_run(bench: ModuleType) -> None:
    """The machine's speed drifts between runs (direct's p50 10 ms, then 30): timed beside
    direct in each run, a front that adds 1 ms reads 1 ms, where subtracting medians of
    separate runs would read 11."""

    def run(p50: float, paired: float, failed: int = 0) -> dict[str, Any]:
        return {
            "rate": 5,
            "p50_ms": p50,
            "p99_ms": p50 * 2,
            "failed": 0,
            "cut": 0,
            "paired_direct": {"p50_ms": paired, "p99_ms": paired * 2, "failed": failed, "cut": 0},
        }

    lat = {
        "direct": {
            "generate": [
                {"rate": 5, "p50_ms": p, "p99_ms": 2 * p, "failed": 0, "cut": 0}
                for p in (10.0, 10.0, 30.0)
            ]
        },
        "x": {"generate": [run(31.0, 30.0), run(31.0, 30.0, failed=1), run(11.0, 10.0)]},
    }
    got = bench.summarize_latency(lat)["x"]["generate"]
    assert got["added_from"] == "paired"
    assert (got["added_p50_ms"], got["added_p99_ms"]) == (1.0, 2.0)
    assert got["failed"] == 1  # the paired direct requests count too
    assert got["p50_ms"] - bench.summarize_latency(lat)["direct"]["generate"]["p50_ms"] == 21.0


def test_rounds_run_one_workload_at_a_time_in_alternating_front_order(bench: ModuleType) -> None:
    class Front:
        def __init__(self, name: str, apis: tuple[str, ...]) -> None:
            self.name, self.apis = name, apis

    fronts = [
        Front("direct", ("generate", "completions")),
        Front("sglang-router", ("generate",)),
        Front("gateway", ("generate", "completions")),
    ]
    even = [(w, f.name) for w, f in bench.round_order(fronts, 0)]
    odd = [(w, f.name) for w, f in bench.round_order(fronts, 1)]
    assert even[:3] == [
        ("generate", "direct"),
        ("generate", "sglang-router"),
        ("generate", "gateway"),
    ]
    assert odd[:3] == [
        ("generate", "gateway"),
        ("generate", "sglang-router"),
        ("generate", "direct"),
    ]
    assert sorted(even) == sorted(odd)  # the same runs, every front on each of its workloads
    assert ("completions", "sglang-router") not in even
    assert [w for w, _ in even] == sorted((w for w, _ in even), key=list(bench.L.WORKLOADS).index)


def _smoke(tmp_path: Path, fronts: str) -> dict[str, Any]:
    out = tmp_path / "smoke.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--fronts", fronts, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(ROOT),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["failed_checks"] == [] and all(got["checks"].values())
    return got


def test_smoke_direct_and_proxy(tmp_path: Path) -> None:
    got = _smoke(tmp_path, "direct,proxy-aiohttp")
    assert got["unavailable"] == {}
    tp = got["stub"]["throughput"]
    assert set(tp) == {"direct", "proxy-aiohttp"}
    assert set(tp["direct"]) == {"generate", "generate-stream", "completions", "completions-stream"}
    assert tp["direct"]["generate"]["vs_direct"] == 1.0
    assert got["open_streams"]["proxy-aiohttp"]["opened"] == 200
    crash = got["crash"]["direct"]["generate-stream"]
    assert crash["killed"] and crash["dead_engine_at_kill"]["in_flight"] > 0
    assert crash["attempts_to_dead_engine"] is None or crash["attempts_to_dead_engine"] > 0


def test_smoke_gateway(tmp_path: Path) -> None:
    """rollsafe's gateway as a front (benchmarks/gateway/gateway_front.py): both APIs on the
    stubs, the open streams, and the crash: every request whole, the dead engine's group out
    of routing, its requests continued on the other engine."""
    got = _smoke(tmp_path, "direct,gateway")
    assert got["unavailable"] == {}
    workloads = {"generate", "generate-stream", "completions", "completions-stream"}
    assert set(got["stub"]["throughput"]["gateway"]) == workloads
    assert set(got["stub"]["latency"]["gateway"]) == workloads
    for w in workloads:  # timed beside direct in each run
        assert got["stub"]["latency"]["gateway"][w]["added_from"] == "paired"
        for r in got["stub"]["latency_runs"]["gateway"][w]:
            assert r["paired_direct"]["ok"] > 0 and r["ok"] > 0
    books = got["stub"]["gateway_books"]
    assert books["states"] == {"g0": "active", "g1": "active"}
    served = sum(books["router"]["served_by_group"].values())
    sent = sum(r["sent"] for rs in got["stub"]["throughput_runs"]["gateway"].values() for r in rs)
    assert served >= sent > 0  # the latency runs and the warm-up request come on top
    held = got["open_streams"]["gateway"]
    assert held["opened"] == 200 and not held["failed"]
    assert 1.9 <= held["front_fds_per_stream"] <= 2.1  # the client's socket and the engine's
    for w in ("generate-stream", "generate"):
        crash = got["crash"]["gateway"][w]
        assert crash["killed"] and (crash["failed"], crash["cut"]) == (0, 0)
        gw = crash["gateway"]
        assert gw["states"] == {"g0": "active", "g1": "inactive"}
        assert gw["continuation"]["after_failure"] >= 1 and gw["continuation"]["failed"] == 0
        assert (
            crash["tokens_regenerated"]
            <= crash["dead_engine_at_kill"]["tokens_generated_unfinished"]
        )
        assert got["checks"][f"target [stub] gateway crash {w}: 0 failed or cut"]
    # timing targets are not checked on seconds of load, only recorded
    assert "target [stub] gateway generate: added p50 <= 1.0 ms" in got["targets_not_checked"]
    assert not any("added p50" in k or "x sglang-router" in k for k in got["checks"])


@pytest.mark.slow
def test_smoke_routers(tmp_path: Path) -> None:
    if not ROUTERS_PYTHON.exists():
        pytest.skip(".venv-routers missing: `make routers` installs sglang-router and vllm-router")
    got = _smoke(tmp_path, "direct,sglang-router,vllm-router")
    assert set(got["stub"]["throughput"]) == {"direct", "sglang-router", "vllm-router"}
    for name, extra in (("sglang-router", "model"), ("vllm-router", "return_hidden_states")):
        keys = got["crash"][name]
        seen = next(iter(keys.values()))["keys_seen"]
        assert any(extra in k for k in seen.values()), (name, seen)
        wapi = got["worker_api"][name]
        assert wapi["add"]["status"] in (200, 202) and wapi["add"]["first_request_s"] is not None
        assert wapi["remove"]["status"] in (200, 202)


@pytest.mark.parametrize("stack", ["aiohttp", "raw", "starlette"])
def test_proxy_candidates_pass_answers_and_streams_through(
    bench: ModuleType, stub: Any, tmp_path: Path, stack: str
) -> None:
    needs = {"aiohttp": ["aiohttp"], "raw": ["uvloop", "httptools"], "starlette": ["uvicorn"]}
    for mod in needs[stack]:
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} missing: `pip install -e .[gateway-bench]` (make test installs it)")
    sys.path.insert(0, str(ROOT / "benchmarks" / "gateway"))
    import fronts

    proxy = fronts.make_front(f"proxy-{stack}", tmp_path)
    proxy.start([stub.url])
    try:
        body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 3}}
        with httpx.Client(timeout=30) as c:
            direct = c.post(stub.url + "/generate", json=body)
            via = c.post(proxy.url + "/generate", json=body)
            assert (via.status_code, via.json()) == (200, direct.json())
            streamed = c.post(proxy.url + "/generate", json={**body, "stream": True})
            assert streamed.headers["content-type"].startswith("text/event-stream")
            events = _events(streamed.text)
            assert events[-1] == "[DONE]" and [e["output_ids"] for e in events[:-1]] == [
                [7],
                [7, 7],
                [7, 7, 7],
            ]
            bad = c.post(proxy.url + "/generate", json={"sampling_params": {"max_new_tokens": -1}})
            assert bad.status_code == 400  # the engine's answer, passed through
        assert stub.read()["generate"] == 3 and stub.read()["bad_request"] == 1
    finally:
        proxy.stop()


def test_the_gateways_targets_become_checks(bench: ModuleType) -> None:
    def tp(rps: float) -> dict[str, Any]:
        return {"best_req_per_s": rps}

    results = {
        "stub": {
            "throughput": {
                "sglang-router": {"generate": tp(1000)},
                "vllm-router": {"completions": tp(1000)},
                "gateway": {"generate": tp(600), "completions": tp(400)},
            },
            "latency": {"gateway": {"generate": {"added_p50_ms": 0.8}, "completions": {}}},
        },
        "crash": {"gateway": {"generate-stream": {"failed": 0, "cut": 1}}},
        "reference": {
            "sglang": {
                "throughput": {
                    "sglang-router": {"generate": tp(100)},
                    "gateway": {"generate": tp(96)},
                },
                "latency": {"gateway": {"generate": {"added_p50_ms": 1.5}}},
            },
            "crash": {"gateway": {"generate": {"failed": 0, "cut": 0}}},
        },
    }
    checks: dict[str, bool] = {}
    bench.gateway_targets(results, checks)
    assert checks == {
        "target [stub] gateway generate: >= 0.5x sglang-router": True,
        "target [stub] gateway completions: >= 0.5x vllm-router": False,
        "target [stub] gateway generate: added p50 <= 1.0 ms": True,
        "target [reference] gateway generate: >= 0.95x sglang-router": True,
        "target [reference] gateway generate: added p50 <= 1.0 ms": False,
        "target [stub] gateway crash generate-stream: 0 failed or cut": False,
        "target [reference] gateway crash generate: 0 failed or cut": True,
    }
    none: dict[str, bool] = {}
    bench.gateway_targets({"stub": results["stub"] | {"throughput": {}, "latency": {}}}, none)
    assert none == {}  # no gateway measured: no target checked
    smoke: dict[str, bool] = {}
    bench.gateway_targets(results, smoke, timed=False)  # --smoke: the crash target only
    assert smoke == {k: v for k, v in checks.items() if "crash" in k}
    assert results["targets_not_checked"] == {k: v for k, v in checks.items() if "crash" not in k}


def test_reference_targets_take_both_dialects(bench: ModuleType) -> None:
    """One front's workloads of the two reference dialects are checked side by side (the
    SGLang dialect's are not overwritten by the vLLM dialect's)."""

    def tp(rps: float) -> dict[str, Any]:
        return {"best_req_per_s": rps}

    results = {
        "reference": {
            "sglang": {
                "throughput": {
                    "sglang-router": {"generate": tp(100)},
                    "gateway": {"generate": tp(90)},
                }
            },
            "vllm": {
                "throughput": {
                    "vllm-router": {"completions": tp(100)},
                    "gateway": {"completions": tp(99)},
                }
            },
        }
    }
    checks: dict[str, bool] = {}
    bench.gateway_targets(results, checks)
    assert checks == {
        "target [reference] gateway generate: >= 0.95x sglang-router": False,
        "target [reference] gateway completions: >= 0.95x vllm-router": True,
    }


def _profiler() -> ModuleType:
    sys.path.insert(0, str(ROOT / "benchmarks" / "gateway"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "profile_gateway", ROOT / "benchmarks" / "gateway" / "profile_gateway.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_profile_shares_count_the_loop_threads_busy_samples_only(tmp_path: Path) -> None:
    prof = _profiler()
    loop = "thread (41): rollsafe-dataplane;0x1 (libc.so.6);run (rollsafe/event_loop.py:9)"
    raw = tmp_path / "raw.txt"
    raw.write_text(
        "\n".join(
            [
                f"{loop};epoll_wait (libc.so.6) 50",  # waiting for events: idle
                f"{loop};handle (rollsafe/gateway/app.py:1);decode (tok.py:2) 6",
                f"{loop};handle (rollsafe/gateway/app.py:1) 3",
                f"{loop};send (rollsafe/gateway/http.py:3);write (libc.so.6) 7",  # a write
                "thread (42): MainThread;wait (threading.py:1) 90",  # another thread
            ]
        )
        + "\n"
    )
    shares = prof.spy_shares(raw)
    assert (shares["loop_tid"], shares["busy"], shares["idle"], shares["in_write"]) == (
        41,
        9,
        50,
        7,
    )
    assert shares["own"] == {"decode (tok.py)": 6, "handle (app.py)": 3}
    assert shares["below"]["run (event_loop.py)"] == 9
    assert shares["below"]["handle (app.py)"] == 9
    plain = {"cpu_us_per_req": 100.0, "thread_cpu_us_per_req": {41: 90.0, 43: 10.0}}
    r = prof.report("generate", plain, {"req_per_s": 1.0}, shares, {"decode (tok.py)": 2.0}, 5)
    assert r["loop_thread_us_per_req"] == 90.0  # the loop thread's own CPU, not the process's
    top = r["by_own"][0]
    assert top["function"] == "decode (tok.py)" and top["own_us_per_req"] == 60.0
    assert top["calls_per_req"] == 2.0


def _profile(tmp_path: Path, *args: str) -> list[dict[str, Any]]:
    """``profile_gateway.py ARGS --json FILE`` run to its end; the rows it wrote."""
    out = tmp_path / "prof.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = ROOT / "benchmarks" / "gateway" / "profile_gateway.py"
    done = subprocess.run(
        [sys.executable, str(script), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows: list[dict[str, Any]] = json.loads(out.read_text())["workloads"]
    return rows


def test_profile_in_process_gives_a_cost_per_request_and_per_token(tmp_path: Path) -> None:
    rows = _profile(
        tmp_path,
        *("--in-process", "--workloads", "generate,completions-stream", "--tokens", "4"),
        *("--duration", "0.2"),
    )
    assert [r["workload"] for r in rows] == ["generate", "completions-stream"]
    for r in rows:
        assert r["us_per_req_1_tokens"] > 0 and r["us_per_req_4_tokens"] > 0
        assert set(r) >= {"us_fixed", "us_per_token"}


def test_profile_in_process_with_a_gap_times_requests_after_the_loop_slept(
    tmp_path: Path,
) -> None:
    rows = _profile(
        tmp_path,
        *("--in-process", "--workloads", "generate", "--tokens", "4"),
        *("--duration", "0.1", "--gap-ms", "2"),
    )
    (row,) = rows
    assert row["gap_ms"] == 2.0
    assert row["us_per_req_back_to_back"] > 0 and row["us_per_req_after_gap"] > 0


@pytest.mark.parametrize("args", [("--gap-ms", "5"), ("--in-process", "--gap-ms", "-1")])
def test_profile_refuses_a_gap_without_in_process_or_below_zero(args: tuple[str, ...]) -> None:
    script = ROOT / "benchmarks" / "gateway" / "profile_gateway.py"
    done = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    assert done.returncode == 2
    assert "--gap-ms must be >= 0 and goes with --in-process" in done.stderr


def test_profile_idle_against_another_tree_reports_cpu_a_second(tmp_path: Path) -> None:
    """``--workloads idle --against TREE``: both gateways measured without a request, a CPU
    figure a second for each and their ratio (the same tree twice here: the shape only)."""
    (row,) = _profile(
        tmp_path,
        *("--workloads", "idle", "--against", str(ROOT), "--rounds", "1", "--duration", "1"),
    )
    assert row["workload"] == "idle" and row["rounds"] == 1
    for side in ("this", "against"):
        assert set(row[side]) == {"tree", "failed", "cpu_ms_per_s"}
        assert row[side]["cpu_ms_per_s"]["median"] >= 0 and row[side]["failed"] == 0
    assert "cpu_per_s_ratio" in row

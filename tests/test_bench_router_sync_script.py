"""``benchmarks/bench_router_sync.py``: its command line, its summary and checks, and the
``--smoke`` run end to end against the real routers (skipped without ``.venv-routers``, like
the router tests; see ``tests/test_router_sync.py``'s ``ROUTERS_REQUIRED_IN_CI``). Nothing
here is timed: the smoke run's figures are not asserted, only its checks and its shape.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from test_router_sync import ROUTERS_REQUIRED_IN_CI

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_router_sync.py"
ROUTERS_PYTHON = ROOT / ".venv-routers" / "bin" / "python"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_router_sync", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_router_sync"] = module
    spec.loader.exec_module(module)
    return module


def test_arguments(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    args = bench.parse_args([])
    assert args.router_list == ["sglang-router", "vllm-router"]
    assert args.scenario_list == ["sigkill", "leaves_active"]
    assert args.repeats == 5 and args.tail_s > 60  # past the routers' one-minute retries
    assert args.out == str(ROOT / "benchmarks" / "results" / "router_sync_cpu.json")
    smoke = bench.parse_args(["--smoke"])
    assert smoke.repeats == 1 and smoke.out != args.out and smoke.tail_s < 10
    for argv, says in (
        (["--routers", "nginx"], "--routers"),
        (["--scenarios", "sigstop"], "--scenarios"),
        (["--repeats", "3"], "--repeats must be >= 5"),
        (["--clients", "0"], "--clients must be >= 1"),
        (["--kill-at", "0"], "must be > 0"),
    ):
        with pytest.raises(SystemExit) as exc:
            bench.parse_args(argv)
        assert exc.value.code == 2
        assert says in capsys.readouterr().err


def test_summary_takes_medians_and_p95(bench: ModuleType) -> None:
    runs = [
        {"attempts_after_kill": n, "last_attempt_after_kill_s": last, "failed": 0}
        for n, last in ((8, 0.2), (10, 0.3), (6, None), (9, 0.25), (30, 60.5))
    ]
    s = bench.summarize(runs)
    assert s["n"] == 5
    assert s["attempts_after_kill"] == {"median": 9, "p95": 30, "n": 5}
    last = s["last_attempt_after_kill_s"]
    assert (last["median"], last["p95"], last["n"], last["runs_with_none"]) == (0.275, 60.5, 4, 1)
    assert "removal_lag_s" not in s  # not measured in these runs: not reported


def _run(**kw: Any) -> dict[str, Any]:
    base = {"acted": True, "left_active": True, "failed": 0}
    return base | kw


def test_the_checks_compare_the_modes(bench: ModuleType) -> None:
    args = bench.parse_args([])
    synced = {"sync": {"failures": 0}, "removal_lag_s": 0.002, "victim_listed_at_end": False}
    runs = {
        "vllm-router": {
            "sigkill": {
                "router": [_run(attempts_after_kill=12, later_attempts=4)] * 5,
                "sync": [_run(attempts_after_kill=8, later_attempts=0, **synced)] * 4
                + [_run(attempts_after_kill=9, later_attempts=1, **synced)],
            },
            "leaves_active": {
                "router": [_run(requests_after_transition=100)] * 5,
                "sync": [_run(requests_after_transition=3, **synced)] * 5,
            },
        }
    }
    results: dict[str, Any] = {"runs": runs}
    results["summary"] = {
        k: {sc: {m: bench.summarize(rs) for m, rs in by_m.items()} for sc, by_m in by_s.items()}
        for k, by_s in runs.items()
    }
    checks: dict[str, bool] = {}
    bench.add_checks(results, args, checks)
    false = sorted(k for k, v in checks.items() if not v)
    assert false == [
        "vllm-router sigkill: with the sync, no attempt after the first burst in any run"
    ]
    assert checks[
        "vllm-router leaves_active: with the sync, < 10% of the requests the router alone sent "
        "after the transition"
    ]
    assert checks["vllm-router sigkill sync: every removal confirmed by the router"]


@pytest.mark.slow
def test_smoke(tmp_path: Path) -> None:
    if not ROUTERS_PYTHON.exists():
        reason = ".venv-routers missing: `make routers` installs sglang-router and vllm-router"
        if ROUTERS_REQUIRED_IN_CI and os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    out = tmp_path / "smoke.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(ROOT),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["failed_checks"] == [] and all(got["checks"].values())
    for kind in ("sglang-router", "vllm-router"):
        for scenario in ("sigkill", "leaves_active"):
            (run,) = got["runs"][kind][scenario]["sync"]
            assert run["removal_lag_s"] is not None and run["victim_listed_at_end"] is False
            (alone,) = got["runs"][kind][scenario]["router"]
            assert "removal_lag_s" not in alone
        (la,) = got["runs"][kind]["leaves_active"]["router"]
        assert la["requests_after_transition"] > 0  # a router on its own keeps sending

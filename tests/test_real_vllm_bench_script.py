"""``benchmarks/bench_real_vllm.py`` without engines: its command line, the split of crash ->
``active`` into parts, the distributions, the checks that make it exit 1, the vLLM/reference
ratios and the printed table. The figures are the committed run's
(``benchmarks/results/real_vllm_cpu.json``), never this test's: nothing here is timed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from rollsafe.fleet import RecoveryResult, RecoveryStep

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_real_vllm.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_real_vllm", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recovery(failed_at: float, steps: dict[str, float]) -> RecoveryResult:
    return RecoveryResult(
        group_id="g0",
        status="active",
        strategy="immediate",
        reason="health",
        failed_at=failed_at,
        submitted_at=failed_at,
        started_at=failed_at,
        finished_at=failed_at + sum(steps.values()),
        active_at=failed_at + sum(steps.values()),
        attempts=1,
        export_version=3,
        fleet_version=3,
        steps=tuple(RecoveryStep(n, 1, failed_at, s, True) for n, s in steps.items()),
    )


def _kill(total: float, **over: Any) -> dict[str, Any]:
    kill = {
        "total_s": total,
        "detection_s": 1.0,
        "restart_s": total - 1.5,
        "health_s": 0.25,
        "other_s": 0.25,
        "status": "active",
        "strategy": "immediate",
        "state_when_checked": "active",
        "fleet_version": 5,
        "version_when_active": 5,
    }
    return {**kill, **over}


def test_defaults_and_engines_list(bench: ModuleType) -> None:
    args = bench.parse_args([])
    assert (args.kills, args.versions, args.restarts) == (10, 5, 2)
    assert args.engines == ["vllm", "reference"]
    assert args.out == str(ROOT / "benchmarks" / "results" / "real_vllm_cpu.json")
    args = bench.parse_args(["--engines", "reference", "--kills", "3", "--out", "/tmp/x.json"])
    assert args.engines == ["reference"] and args.kills == 3 and args.out == "/tmp/x.json"
    assert bench.parse_args(["--restarts", "0"]).restarts == 0  # no standalone engine


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--engines", "vllm,sglang"], "unknown engines ['sglang']"),
        (["--engines", "vllm,vllm"], "names an engine twice"),
        (["--engines", ","], "unknown engines []"),
        (["--kills", "0"], "--kills must be >= 1"),
        (["--versions", "-1"], "--versions must be >= 1"),
        (["--restarts", "-1"], "--restarts must be >= 0"),
    ],
)
def test_bad_arguments_are_usage_errors(
    bench: ModuleType, argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_bad_arguments_exit_2_before_any_engine(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--engines", "tgi", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "unknown engines ['tgi']" in done.stderr
    assert not out.exists()


def test_engine_options_same_fleet_shape_per_engine(bench: ModuleType, tmp_path: Path) -> None:
    v = bench.engine_options("vllm", "/x/python", tmp_path)
    r = bench.engine_options("reference", "/x/python", tmp_path)
    assert v["kind"] == "vllm" and v["python"] == "/x/python" and v["device"] == "cpu"
    assert v["max_model_len"] == 512
    want = {"kind": "reference", "dialect": "vllm", "log_dir": str(tmp_path)}
    assert r == {**want, "ready_timeout": v["ready_timeout"]}


def test_breakdown_parts_add_up(bench: ModuleType) -> None:
    rec = _recovery(100.5, {"claim": 0.01, "shutdown": 0.2, "restart": 30.0, "health": 0.3})
    parts = bench.breakdown(100.0, 131.25, rec)
    assert parts["total_s"] == pytest.approx(31.25)
    assert parts["detection_s"] == pytest.approx(0.5)
    assert parts["restart_s"] == pytest.approx(30.2)
    assert parts["health_s"] == pytest.approx(0.3)
    assert parts["other_s"] == pytest.approx(0.25)
    assert sum(parts[p] for p in bench.PARTS) == pytest.approx(parts["total_s"])


def test_dist_quantiles(bench: ModuleType) -> None:
    d = bench.dist([float(x) for x in range(1, 11)])
    assert d == {"n": 10, "p50": 5.5, "p95": 9.55, "max": 10.0, "min": 1.0}
    assert bench.dist([]) == {"n": 0, "p50": None, "p95": None, "max": None, "min": None}


def test_summarize_and_checks(bench: ModuleType) -> None:
    kills = [_kill(float(t)) for t in (10, 20, 30)]
    s = bench.summarize(kills)
    assert s["crash_to_active"]["p50"] == 20.0 and s["crash_to_active"]["n"] == 3
    assert s["parts"]["detection_s"]["p50"] == 1.0
    assert s["by_strategy"] == {"immediate": 3}
    good = {
        "kills": kills,
        "dispatch_counts": {"g0": {"active": 9}},
        "probes": [{"when": "after v1", "groups_agree": True}],
        "rollout": {"failed": 0, "errors": []},
    }
    assert bench.checks("vllm", good) == []
    bad = {
        "kills": [_kill(5.0, status="failed"), _kill(6.0, version_when_active=4)],
        "dispatch_counts": {"g1": {"active": 3, "recovering": 1}},
        "probes": [{"when": "after the sync of v2", "groups_agree": False}],
        "rollout": {"failed": 2, "errors": ["EngineUnavailable: x"]},
    }
    failures = bench.checks("vllm", bad)
    assert len(failures) == 5, failures
    assert "vllm kill #1: recovery ended failed" in failures
    assert any("kill #2" in f and "not active at v5" in f for f in failures)
    assert any("dispatched to g1" in f for f in failures)
    assert any("after the sync of v2" in f for f in failures)
    assert any("2 rollout requests failed" in f for f in failures)


def test_ratios_table_and_write(bench: ModuleType, tmp_path: Path) -> None:
    def engine(scale: float) -> dict[str, Any]:
        kills = [_kill(scale * t) for t in (2.0, 4.0)]
        return {
            "kills": kills,
            "summary": {
                "single_start": bench.dist([scale * 3]),
                "restart": bench.dist([scale * 2]),
                "cold_start": bench.dist([scale * 5]),
                "sync": bench.dist([scale * 0.1, scale * 0.3]),
                **bench.summarize(kills),
            },
            "dispatch_counts": {"g0": {"active": 4}},
            "probes": [],
            "rollout": {"failed": 0, "errors": []},
        }

    results = {"vllm": engine(10.0), "reference": engine(1.0)}
    r = bench.ratios(results)
    assert r["cold_start"] == {"p50": 10.0, "p95": 10.0}
    assert r["crash_to_active"]["p50"] == pytest.approx(10.0, rel=0.05)
    assert bench.ratios({"vllm": results["vllm"]}) == {}
    lines = bench.table(results)
    assert lines[0].split()[:4] == ["figure", "(s)", "p50", "p95"]
    assert any(line.startswith("vllm: cold_start") and "50.000" in line for line in lines)
    assert any(line.startswith("reference:   detection") for line in lines)

    out = tmp_path / "r.json"
    args = bench.parse_args(["--out", str(out)])
    bench.write(out, args, results, host={"loadavg_1m_at_start": 1.5}, complete=True)
    data = json.loads(out.read_text())
    assert data["benchmark"] == "real_vllm_cpu" and data["complete"] is True
    assert data["checks"] == {"ok": True, "failures": []}
    assert data["host"]["loadavg_1m_at_start"] == 1.5 and "loadavg_1m_now" in data["host"]
    assert data["ratio_vllm_over_reference"]["cold_start"]["p50"] == 10.0
    results["vllm"]["kills"][0]["status"] = "failed"
    bench.write(out, args, results, complete=False)
    data = json.loads(out.read_text())
    assert data["checks"]["ok"] is False and data["complete"] is False

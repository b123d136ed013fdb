"""``benchmarks/bench_spares.py`` without engines: its command line, the distributions, what a
spare costs, the checks that make it exit 1 (the 2 s target among them) and the printed table.
The figures are the committed run's (``benchmarks/results/spares_cpu.json``), never this
test's: nothing here is timed.
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

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_spares.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_spares", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _event(capacity: float, mode: str = "spare", **over: Any) -> dict[str, Any]:
    event: dict[str, Any] = {
        "killed": "g0",
        "fleet_version": 5,
        "capacity_version": 5,
        "back": "s0" if mode == "spare" else "g0",
        "capacity_event": "promote" if mode == "spare" else "restarted",
        "capacity_s": capacity,
        "detection_s": capacity / 2,
        "switch_s": capacity / 2,
    }
    if mode == "spare":
        event.update(promoted="g0", spare="s0", spare_tokens_before=0, refill_s=capacity * 20)
    return {**event, **over}


def _fleet(bench: ModuleType, mode: str, capacities: list[float], sync: float) -> dict[str, Any]:
    r: dict[str, Any] = {
        "events": [_event(c, mode) for c in capacities],
        "sync_s": [sync, sync * 1.1, sync * 0.9],
        "dispatch_counts": {"g0": {"active": 9}},
        "rollout": {"failed": 0, "errors": []},
        "violations": [],
    }
    if mode == "spare":
        r["spare_ids"] = ["s0"]
        r["memory_mb"] = {"g0": {"rss": 400.0, "pss": 300.0}, "s0": {"rss": 380.0, "pss": 290.0}}
    r["summary"] = bench.summarize(r)
    return r


def test_defaults_and_bad_arguments(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    args = bench.parse_args([])
    assert (args.events, args.syncs, args.target_s) == (10, 5, 2.0)
    assert args.engines == ["reference", "vllm"]
    assert args.out == str(ROOT / "benchmarks" / "results" / "spares_cpu.json")
    for argv, says in (
        (["--engines", "reference,tgi"], "unknown engines ['tgi']"),
        (["--engines", "vllm,vllm"], "names an engine twice"),
        (["--events", "0"], "--events must be >= 1"),
        (["--vllm-budget-s", "0"], "must be > 0"),
    ):
        with pytest.raises(SystemExit) as exc:
            bench.parse_args(argv)
        assert exc.value.code == 2 and says in capsys.readouterr().err


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


def test_summaries_and_costs(bench: ModuleType) -> None:
    spare = _fleet(bench, "spare", [1.0, 1.2, 1.4], 0.3)
    restart = _fleet(bench, "restart", [8.0, 9.0, 10.0], 0.2)
    s = spare["summary"]
    assert s["capacity_back"]["p50"] == 1.2 and s["capacity_back"]["n"] == 3
    assert s["refill"]["p50"] == 24.0 and "refill" not in restart["summary"]
    cost = bench.costs({"spare": spare, "restart": restart})
    assert cost["memory_per_spare_mb"] == {"rss": 380.0, "pss": 290.0}
    assert cost["sync_added_per_spare_s"] == pytest.approx(0.1)
    assert cost["sync_ratio_with_spare"] == pytest.approx(1.5)
    assert bench.costs({"spare": spare}) == {"memory_per_spare_mb": {"rss": 380.0, "pss": 290.0}}


def test_every_check_can_fail(bench: ModuleType) -> None:
    good = {
        "spare": _fleet(bench, "spare", [1.0, 1.5], 0.3),
        "restart": _fleet(bench, "restart", [8.0, 9.0], 0.2),
    }
    assert bench.checks("vllm", good, 2.0) == []
    bad = {
        "spare": _fleet(bench, "spare", [1.0, 2.5], 0.3),  # p95 above the target
        "restart": _fleet(bench, "restart", [8.0], 0.2),
    }
    events = bad["spare"]["events"]
    events[0].update(promoted=None, refill_s=None, spare_tokens_before=3, capacity_version=4)
    bad["restart"]["events"][0]["back"] = "g1"
    bad["restart"]["dispatch_counts"] = {"g0": {"active": 3, "recovering": 1}}
    bad["spare"]["rollout"] = {"failed": 2, "errors": ["EngineUnavailable: x"]}
    # without a spare the outage's requests may fail: counted, not a failed check
    bad["restart"]["rollout"] = {"failed": 5, "errors": ["NoRoutableGroup: x"]}
    bad["restart"]["violations"] = ["spares_never_routed: s0 is a spare and active"]
    failures = bench.checks("vllm", bad, 2.0)
    for want in (
        "vllm/spare kill #1: capacity back at v4, the fleet at v5",
        "vllm/spare kill #1: g0 was not covered by a promotion",
        "vllm/spare kill #1: the pool did not refill",
        "vllm/spare kill #1: the spare generated 3 token(s) before its promotion",
        "vllm/restart kill #1: capacity came back on g1",
        "vllm/restart: requests dispatched to g0 while ['active', 'recovering']",
        "vllm/spare: 2 rollout requests failed (['EngineUnavailable: x'])",
        "vllm/restart: invariants broken at the end: "
        "['spares_never_routed: s0 is a spare and active']",
        "vllm: capacity back with a spare p95 2.425s > 2.0s",
    ):
        assert want in failures, failures
    assert len(failures) == 9, failures
    assert bench.checks("vllm", {"spare": {**good["spare"], "events": []}}, 2.0)[0].endswith(
        "no kill event was measured"
    )


def test_table_and_write(bench: ModuleType, tmp_path: Path) -> None:
    results: dict[str, Any] = {
        "reference": {
            "spare": _fleet(bench, "spare", [1.0, 1.2], 0.3),
            "restart": _fleet(bench, "restart", [8.0, 9.0], 0.2),
        }
    }
    results["reference"]["costs"] = bench.costs(results["reference"])
    lines = bench.table(results)
    assert lines[0].split()[:4] == ["figure", "(s)", "p50", "p95"]
    assert any(line.startswith("reference spare: capacity_back") for line in lines)
    assert any(line.startswith("reference restart: capacity_back") for line in lines)
    assert any(line.startswith("reference memory_per_spare_mb") for line in lines)
    out = tmp_path / "r.json"
    args = bench.parse_args(["--out", str(out), "--engines", "reference"])
    bench.write(out, args, results, host={"loadavg_1m_at_start": 1.5}, complete=True)
    data = json.loads(out.read_text())
    assert data["benchmark"] == "spares_cpu" and data["complete"] is True
    assert data["checks"] == {"ok": True, "failures": []}
    assert data["host"]["loadavg_1m_at_start"] == 1.5 and "loadavg_1m_now" in data["host"]
    results["reference"]["spare"]["events"][0]["promoted"] = None
    bench.write(out, args, results, complete=False)
    data = json.loads(out.read_text())
    assert data["checks"]["ok"] is False and data["complete"] is False


def test_tree_memory_reads_proc(bench: ModuleType) -> None:
    mem = bench.tree_memory_mb(os.getpid())
    assert mem["processes"] >= 1 and mem["rss"] > 0 and mem["pss"] > 0

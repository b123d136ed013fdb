"""``rollsafe report PATH``: summary, recovery breakdown, invariant checks and the picture of a
recorded run; a truncated or hand-corrupted file is named with its first bad line, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from observe_helpers import run_rows, write_run_dir

from rollsafe.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_report_prints_summary_recovery_and_checks_and_writes_the_svg(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run_dir(tmp_path / "run")
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "2 group(s) ['g0', 'g1'], transport ipc" in out
    assert "final states: g0=active, g1=active" in out
    assert "syncs: 1 (v1 ok 0.200s)" in out
    assert "crash: g1 at t=2.800s" in out
    assert "g1: active via immediate; onset t=2.800s (crash_mark), detected +0.200s" in out
    assert "restart          0.450s" in out
    assert "[ok]     requests were admitted only to active groups" in out
    assert "report: every check held" in out
    ET.parse(run / "timeline.svg")  # parses as XML


def test_the_cli_entry_point_and_svg_option(tmp_path: Path) -> None:
    run = write_run_dir(tmp_path / "run")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollsafe.cli",
            "report",
            str(run / "timeline.jsonl"),
            "--svg",
            str(tmp_path / "pic.svg"),
        ],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "pic.svg").is_file() and not (run / "timeline.svg").exists()


def _report_fails(run: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["report", str(run)]) == 2
    captured = capsys.readouterr()
    assert not (run / "timeline.svg").exists()
    return captured.err


def test_truncated_mid_line_names_the_last_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run_dir(tmp_path / "run")
    f = run / "timeline.jsonl"
    data = f.read_bytes()
    n_lines = data.count(b"\n")
    f.write_bytes(data[: len(data) - 40])  # a writer killed mid-line
    err = _report_fails(run, capsys)
    assert f"timeline.jsonl line {n_lines}: truncated" in err and "bad input" in err


def test_truncated_at_a_line_boundary_misses_the_end_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run_dir(tmp_path / "run")
    f = run / "timeline.jsonl"
    lines = f.read_text().splitlines(keepends=True)
    f.write_text("".join(lines[:12]))
    err = _report_fails(run, capsys)
    assert "timeline.jsonl line 12: truncated" in err and "no 'end' row" in err


@pytest.mark.parametrize(
    ("corrupt", "problem"),
    [
        (lambda line: line.replace('"event": ', '"event" ', 1), "not valid JSON"),
        (lambda line: json.dumps({**json.loads(line), "timestamp": "soon"}), "'timestamp'"),
        (lambda line: json.dumps({**json.loads(line), "target": ""}), "'target'"),
        (lambda line: "[1, 2, 3]", "expected a JSON object"),
        (lambda line: "", "blank line"),
    ],
)
def test_hand_corrupted_line_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], corrupt: object, problem: str
) -> None:
    run = write_run_dir(tmp_path / "run")
    f = run / "timeline.jsonl"
    lines = f.read_text().splitlines()
    bad = next(i for i, line in enumerate(lines) if '"kind": "group"' in line and "fail" in line)
    lines[bad] = corrupt(lines[bad])  # type: ignore[operator]
    f.write_text("\n".join(lines) + "\n")
    err = _report_fails(run, capsys)
    assert f"timeline.jsonl line {bad + 1}: " in err and problem in err, err


def test_corrupt_side_file_and_missing_timeline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run_dir(tmp_path / "run")
    (run / "summary.json").write_text('{"ok": true,\n  "failures": [\n')
    err = _report_fails(run, capsys)
    assert "summary.json line 3: not valid JSON" in err
    (tmp_path / "empty").mkdir()
    err = _report_fails(tmp_path / "empty", capsys)
    assert "timeline.jsonl: not found" in err


def test_a_broken_invariant_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = run_rows()
    for r in rows:
        if r["kind"] == "group" and r["event"] == "restarted":
            r["event"] = "weights_loaded"  # recovering -> active by weights_loaded: no such edge
        if r["kind"] == "end":
            r["dispatch_counts"]["g1"]["inactive"] = 1
    run = write_run_dir(tmp_path / "run", rows)
    (run / "summary.json").write_text(json.dumps({"ok": False, "failures": ["boom"]}))
    assert main(["report", str(run), "--no-svg"]) == 1
    out = capsys.readouterr().out
    assert "[FAILED] every transition is an edge of its machine" in out
    assert "weights_loaded recovering -> active" in out
    assert "[FAILED] requests were admitted only to active groups: g1:" in out
    assert "[FAILED] the run's own invariants (summary.json): boom" in out

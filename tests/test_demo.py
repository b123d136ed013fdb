"""`rollsafe demo` end to end (small) as a subprocess, its trainer actor, and the embedding example.

The demo runs with its Ray trainer actor on a local Ray over both transports (``ipc``, ``nccl``
with gloo); each run checks the invariants in ``summary.json``, replays its recorded run through
the verifier's model (``rollsafe verify --trace``) and checks that nothing it started (engine
processes, the actor, the local Ray) outlives it. A SIGTERM mid-rollout must shut everything
down too. The trainer actor's body and its zero-copy snapshot are checked without Ray.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from trace_support import assert_run_replays

from rollsafe.observe.runfile import load_run
from rollsafe.verify.replay import replay_run

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--steps", "2", "--groups", "2", "--crash-at", "2", "--rollout-s", "3", "--workers", "1"]


def _demo_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "rollsafe.cli", "demo", *args]


def _assert_nothing_left(pids: list[int], dirs: list[str]) -> None:
    """The moment the demo has exited, nothing it started runs and its directories are gone:
    none of ``pids`` is alive, no process names one of ``dirs`` in its command line or holds a
    file under it (a removed log still open counts), and the dirs do not exist. A failure names
    what was left and which process held it."""
    from rollsafe.processes import pid_alive, process_info, processes_using

    problems = []
    for pid in pids:
        if pid_alive(pid):
            info = process_info(pid)
            problems.append(f"pid {pid} alive: {info.describe() if info else '?'}")
    for d in dirs:
        for info, files in processes_using(d):
            problems.append(f"{info.describe()} uses {d}: {files[:5] or 'in its command line'}")
        if Path(d).exists():
            left = sorted(str(p.relative_to(d)) for p in Path(d).rglob("*"))[:40]
            problems.append(f"{d} was not removed; in it: {left}")
    assert not problems, "left behind after the demo exited:\n" + "\n".join(problems)


@pytest.mark.parametrize("transport", ["ipc", "nccl"])
def test_demo_small_run_recovers_and_checksums_match(tmp_path: Path, transport: str) -> None:
    out = tmp_path / "report"
    result = subprocess.run(
        _demo_cmd(*SMALL, "--transport", transport, "--out", str(out)),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=str(ROOT),
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    for name in ("timeline.jsonl", "paths.md", "summary.json"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["failures"] == []
    assert summary["options"]["transport"] == transport
    # the trainer ran as a Ray actor in its own process, on a local Ray the demo started
    trainer = summary["trainer"]
    assert trainer["kind"] == "ray_actor" and trainer["started_local_ray"]
    assert isinstance(trainer["pid"], int) and trainer["pid"] != trainer["driver_pid"]
    assert trainer["round_trips"]["step"]["calls"] == 2
    # one fetch per sync, and one at the start: the engines' checkers against the weights
    assert trainer["round_trips"]["snapshot"]["calls"] == 3
    assert trainer["weights_fetched_zero_copy"]
    # every step trained, synced and was checked against the actor's own checksum
    assert [s["step"] for s in summary["steps"]] == [1, 2]
    assert all(s["sync"]["ok"] for s in summary["steps"])
    for step, checks in summary["checksums"]["per_step"].items():
        assert "match" in checks.values(), (step, checks)
        assert all(c == "match" or c.startswith("not serving") for c in checks.values())
    assert summary["checksums"]["all_matched"] and summary["checksums"]["unverified"] == []
    assert set(summary["checksums"]["final"].values()) == {"match"}
    rec = summary["recovery"]
    assert rec["crashed"] and rec["group"] == "g1" and rec["latency_s"] is not None
    assert rec["status"] == "active"
    # the demo runs with warm standbys: the recovery says where its engine came from
    assert rec["restart_source"] in ("ready_standby", "warming_standby", "fresh_spawn")
    assert rec["standby_at_restart"] in ("ready", "warming")
    assert {sb["state"] for sb in summary["standby"].values()} <= {"ready", "warming"}
    assert "/sb:" in result.stdout and "warm standbys" in result.stdout
    assert all(set(c) <= {"active"} for c in summary["dispatch_counts"].values())
    rows = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    g1 = [(r["event"], r["target"]) for r in rows if r["kind"] == "group" and r["subject"] == "g1"]
    assert ("fail", "inactive") in g1 and g1[-1][1] == "active"
    registrations = {r["subject"] for r in rows if r["kind"] == "registration"}
    assert registrations == {transport}
    # the recorded run is one of the verifier's model (#36): replayed with no divergence
    replayed = replay_run(load_run(out).rows)
    assert replayed.ok, replayed.divergence.format() if replayed.divergence else ""
    assert replayed.replayed == replayed.transitions
    assert "stateDiagram-v2" in (out / "paths.md").read_text()
    assert "recovery:" in result.stdout and "where time went:" in result.stdout
    # continued requests (#17): in the live line, the report and the summary
    cont = summary["continuation"]
    assert cont["mode"] == "continue" and cont["tokens_regenerated_after_crash"] == 0
    assert cont["total"]["tokens_regenerated"] == 0
    assert "continued requests (continue)" in result.stdout and "| continued " in result.stdout
    assert "train (trainer actor round trip)" in result.stdout
    assert "fetch weights (object store)" in result.stdout
    # nothing the demo started outlives it: engines, the actor, the local Ray
    _assert_nothing_left([trainer["pid"]], [summary["scratch_dir"], trainer["ray_temp_dir"]])
    # the local Ray's shutdown waited for every process of its session, none outlived SIGKILL
    ray_processes = trainer["ray_processes"]
    assert ray_processes["session"] >= 3 and ray_processes["left"] == [], ray_processes


def test_demo_sigterm_mid_rollout_shuts_everything_down(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        _demo_cmd(
            "--steps",
            "2",
            "--groups",
            "2",
            "--crash-at",
            "0",
            "--rollout-s",
            "60",
            "--workers",
            "1",
            "--out",
            str(tmp_path / "report"),
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=str(ROOT),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: queue.Queue[str] = queue.Queue()
    seen: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    pumping = threading.Thread(target=pump, daemon=True)
    pumping.start()
    actor_pid, dirs = None, []
    deadline = time.monotonic() + 240
    try:
        while True:
            assert time.monotonic() < deadline, "".join(seen)[-4000:]
            assert proc.poll() is None, "".join(seen)[-4000:]
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                continue
            seen.append(line)
            m = re.search(r"trainer actor up .*?: pid (\d+) .*scratch (\S+), Ray files (\S+)", line)
            if m:
                actor_pid, dirs = int(m.group(1)), [m.group(2), m.group(3)]
            if "step 1 rollout  2." in line:  # fleet up, rollout load running
                break
        assert actor_pid is not None, "".join(seen)[-4000:]
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    pumping.join(timeout=30)
    while not lines.empty():
        seen.append(lines.get())
    out = "".join(seen)
    # it ran its cleanup to the end: Ray's SIGTERM handler (``sys.exit(15)``) raised SystemExit,
    # the demo shut everything down and said so. Not the signal's default action (-15), not
    # SIGABRT (-6: Ray's C++ failure handler, in front of Python's, aborts 3 s after a SIGTERM
    # unless init_ray hands the signal back to Python), not an error in the cleanup (1)
    assert rc == 15, f"exit status {rc}\n{out[-4000:]}"
    assert "demo interrupted (SystemExit)" in out, out[-4000:]
    assert "SIGTERM received" not in out, out[-4000:]  # absl's failure handler did not run
    _assert_nothing_left([actor_pid], dirs)


def test_trainer_host_snapshot_round_trips_without_copy(tmp_path: Path) -> None:
    """The actor's body without Ray: a snapshot rebuilds to the trainer's exact weights."""
    import numpy as np

    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model
    from rollsafe.checksum import weights_checksum
    from rollsafe.demo_trainer import Trainer, TrainerHost, tensors_from_snapshot

    model_dir = make_tiny_model(tmp_path / "model", seed=0)
    host, local = TrainerHost(str(model_dir), seed=0), Trainer(model_dir, seed=0)
    assert host.checksum()["checksum"] == local.checksum()
    assert host.step()["loss"] == local.step()
    snap = host.snapshot()
    arrays = [a.copy() for a in snap["arrays"]]
    for a in arrays:
        a.flags.writeable = False  # as Ray hands them back from the object store
    tensors = tensors_from_snapshot({**snap, "arrays": arrays})
    assert weights_checksum(tensors)["model"] == snap["checksum"] == local.checksum()
    first = next(iter(tensors.values()))
    assert np.shares_memory(first.numpy(), arrays[0])  # views, not copies
    # a snapshot (and Trainer.weights()) is not changed by the next optimizer step
    before = local.weights()
    digest = weights_checksum(before)["model"]
    local.step()
    assert weights_checksum(before)["model"] == digest != local.checksum()


#: the example's bound: inside pytest's 300 s, so that what it printed comes back. It takes 13 s
#: on a quiet 2-core machine, 29 to 42 s beside six busy loops and 106 to 113 s beside 22 (its
#: three engines' start is most of it: step 1 at 77 to 87 s); stress pass 13 cut it at 120 s
EMBED_BOUND_S = 270


def test_embed_in_trainer_example_runs() -> None:
    argv = [sys.executable, "-u", str(ROOT / "examples" / "embed_in_trainer.py"), "--steps", "2"]
    try:
        result = subprocess.run(
            argv, capture_output=True, text=True, timeout=EMBED_BOUND_S, check=False, cwd=str(ROOT)
        )
    except subprocess.TimeoutExpired as exc:  # say how far it got (each phase prints a line)
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        pytest.fail(f"not done in {EMBED_BOUND_S}s; it printed:\n{out[-3000:]}\n{err[-3000:]}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("fleet up in ") and lines[0].endswith("groups ['g0', 'g1']")
    assert [line.split(":")[0] for line in lines[1:3]] == ["step 1", "step 2"]
    assert all(line.endswith("engines match trainer: True") for line in lines[1:3])
    assert lines[-1].startswith("fleet closed in ")


# ------------------------------------------------------------------ --engine vllm


def test_demo_refuses_ipc_with_vllm(tmp_path: Path) -> None:
    """ipc cannot reach a real vLLM: refused with exit status 2 before anything starts."""
    from rollsafe.demo import main

    out = tmp_path / "report"
    rc = main(["--engine", "vllm", "--transport", "ipc", "--out", str(out), "--quiet"])
    assert rc == 2
    assert not out.exists()  # nothing started, nothing written


def test_demo_refuses_warm_standby_with_vllm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rollsafe.demo import main

    assert main(["--engine", "vllm", "--warm-standby", "--out", str(tmp_path / "r")]) == 2
    assert "--warm-standby is not available with --engine vllm" in capsys.readouterr().out


def test_demo_vllm_without_an_interpreter_names_all_three_places(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No working vLLM interpreter: exit 2, and the message names the flag, the environment
    variable and the default path, each with why it did not work."""
    not_python = tmp_path / "not-python"
    not_python.write_text("")
    monkeypatch.setenv("ROLLSAFE_VLLM_PYTHON", str(tmp_path / "missing" / "python"))
    monkeypatch.chdir(tmp_path)  # no .venv-vllm here
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollsafe.cli",
            "demo",
            "--engine",
            "vllm",
            "--vllm-python",
            str(not_python),
            "--out",
            str(tmp_path / "report"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 2, result.stdout + result.stderr
    msg = result.stdout
    assert f"--vllm-python: {not_python} is not executable" in msg, msg
    assert f"$ROLLSAFE_VLLM_PYTHON: {tmp_path / 'missing' / 'python'} does not exist" in msg, msg
    assert f".venv-vllm/bin/python under {tmp_path}" in msg, msg
    assert not (tmp_path / "report").exists()


def test_demo_vllm_interpreter_without_vllm_is_refused(tmp_path: Path) -> None:
    """An interpreter that runs but has no vllm package is not taken for the real engine."""
    from rollsafe.demo.options import find_vllm_python

    path, why = find_vllm_python(sys.executable)  # rollsafe's venv: no vllm
    if path is None:
        assert f"--vllm-python: {sys.executable} has no vllm package" in why
    else:  # only if the environment or the current directory names a real one
        assert path != sys.executable


def test_demo_reference_defaults_unchanged() -> None:
    """Without --engine: the reference engine, 3 groups, ipc, warm standbys (as before)."""
    import argparse

    from rollsafe.demo.options import DemoOptions, add_arguments, options_problem

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    opts = parser.parse_args([], namespace=DemoOptions())
    assert options_problem(opts) is None
    assert (opts.engine, opts.groups, opts.transport, opts.warm_standby) == (
        "reference",
        3,
        "ipc",
        True,
    )


@pytest.mark.real_vllm
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_demo_on_real_vllm_recovers_and_verifies(tmp_path: Path, vllm_python: str) -> None:
    """`rollsafe demo --engine vllm`: two real vLLM groups, two steps synced over nccl/gloo,
    g1's server SIGKILLed mid-rollout of step 2; exit 0, g1 active again at v2, every step
    verified by the layout-aware digests and the probe (the recovered group answers like g0);
    the recorded run replays through the verifier's model (``rollsafe verify --trace``)."""
    out = tmp_path / "report"
    result = subprocess.run(
        _demo_cmd(
            "--engine",
            "vllm",
            "--vllm-python",
            vllm_python,
            "--steps",
            "2",
            "--crash-at",
            "2",
            "--rollout-s",
            "4",
            "--workers",
            "1",
            "--trainer",
            "inprocess",
            "--out",
            str(out),
        ),
        capture_output=True,
        text=True,
        timeout=1400,
        check=False,
        cwd=str(ROOT),
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["failures"] == []
    assert summary["engine"] == "vllm" and summary["vllm_python"] == vllm_python
    assert summary["options"]["transport"] == "nccl"
    assert summary["groups"] == {"g0": 1, "g1": 1}
    assert "engine vllm" in result.stdout and "engine: vllm" in result.stdout
    # the crash: g1's vLLM server, SIGKILLed during step 2's rollout, back active at v2
    rec = summary["recovery"]
    assert rec["crashed"] and rec["group"] == "g1" and rec["status"] == "active", rec
    assert rec["latency_s"] is not None
    assert summary["steps"][-1]["step"] == 2
    assert summary["final_snapshot"]["registry"]["fleet_version"] == 2
    g1 = summary["final_snapshot"]["registry"]["groups"]["g1"]
    assert g1["state"] == "active", g1
    assert summary["checksums"]["final"] == {"g0": "match", "g1": "match"}
    # verification: no tensor differs anywhere; the probe agrees after every step and at the
    # end, where the recovered g1 (a fresh engine on the export) answers like the survivor
    assert summary["checksums"]["all_matched"]
    for checks in summary["checksums"]["per_step"].values():
        assert all(
            c == "match" or c.startswith(("unverified", "not serving")) for c in checks.values()
        ), checks
    probe = summary["probe"]
    assert probe["all_alike"]
    assert probe["final"]["g0"] == "reference"
    assert probe["final"]["g1"].startswith("alike"), probe
    assert set(probe["per_step"]) == {"1", "2"} or set(probe["per_step"]) == {1, 2}
    assert all(s["sync"]["ok"] for s in summary["steps"])
    assert_run_replays(out)  # the report's timeline: a run of the verifier's model (#36)
    assert all(set(c) <= {"active"} for c in summary["dispatch_counts"].values())


def _bare_run(tmp_path: Path) -> Any:
    """A demo run with nothing started: its scratch holds two engine logs."""
    from rollsafe.demo.options import DemoOptions
    from rollsafe.demo.state import DemoRun

    work, out = tmp_path / "scratch", tmp_path / "report"
    (work / "logs").mkdir(parents=True)
    out.mkdir()
    (work / "logs" / "engine-1.log").write_text("rank 0: probe answered\n")
    (work / "logs" / "standby-1.log").write_text("imported\n")
    return DemoRun(DemoOptions(), out, work, [1], print, time.time(), time.monotonic())


@pytest.mark.parametrize("how", ["check broke", "phase raised", "passed"])
def test_a_failed_demo_keeps_its_engine_logs(tmp_path: Path, how: str) -> None:
    """The scratch directory (engine logs included) goes on every way out; a run that failed
    (a check broke, or a phase raised) first copies the engines' logs into its report directory
    (``engine-logs``), so that what an engine did when a check broke can be read afterwards
    (stress pass 5 failed a node-loss check, the engine's log was gone with the scratch)."""
    from rollsafe.demo.settle import ENGINE_LOGS, shutting_down

    run = _bare_run(tmp_path)
    with contextlib.suppress(RuntimeError), shutting_down(run):
        if how == "check broke":
            run.failures.append("node loss check failed: the other groups kept serving")
        elif how == "phase raised":
            raise RuntimeError("a phase failed")
    kept = run.out / ENGINE_LOGS
    assert not run.work.exists()  # the scratch goes whatever happened
    if how == "passed":
        assert not kept.exists()
    else:
        assert (kept / "engine-1.log").read_text() == "rank 0: probe answered\n"
        assert (kept / "standby-1.log").exists()

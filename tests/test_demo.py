"""`rollsafe demo` end to end (small) as a subprocess, its trainer actor, and the embedding example.

The demo runs with its Ray trainer actor on a local Ray over both transports (``ipc``, ``nccl``
with gloo); each run checks the invariants in ``summary.json`` and that nothing it started (engine
processes, the actor, the local Ray) outlives it. A SIGTERM mid-rollout must shut everything
down too. The trainer actor's body and its zero-copy snapshot are checked without Ray.
"""

from __future__ import annotations

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

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--steps", "2", "--groups", "2", "--crash-at", "2", "--rollout-s", "3", "--workers", "1"]


def _demo_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "rollsafe.cli", "demo", *args]


def _processes_mentioning(*needles: str) -> list[tuple[int, str]]:
    """(pid, cmdline) of every live process whose command line contains one of ``needles``."""
    found: list[tuple[int, str]] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X") and any(n in cmd for n in needles):
            found.append((int(entry.name), cmd[:300]))
    return found


def _assert_nothing_left(pids: list[int], dirs: list[str], timeout: float = 30.0) -> None:
    """No process with ``pids`` or naming one of ``dirs`` is alive, and the dirs are gone."""
    from rollsafe.adapters.engines import pid_alive

    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if pid_alive(p)]
        left = _processes_mentioning(*dirs)
        if not alive and not left:
            break
        assert time.monotonic() < deadline, f"leaked: pids {alive}, processes {left}"
        time.sleep(0.2)
    for d in dirs:
        assert not Path(d).exists(), f"{d} was not removed"


@pytest.mark.parametrize("transport", ["ipc", "nccl"])
def test_demo_small_run_recovers_and_checksums_match(tmp_path: Path, transport: str) -> None:
    out = tmp_path / "report"
    result = subprocess.run(
        _demo_cmd(*SMALL, "--transport", transport, "--out", str(out)),
        capture_output=True, text=True, timeout=300, check=False, cwd=str(ROOT),
    )  # fmt: skip
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
    assert trainer["round_trips"]["snapshot"]["calls"] == 2
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
    _assert_nothing_left(
        [trainer["pid"]], [summary["scratch_dir"], trainer["ray_temp_dir"]], timeout=15.0
    )


def test_demo_sigterm_mid_rollout_shuts_everything_down(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        _demo_cmd(
            "--steps", "2", "--groups", "2", "--crash-at", "0", "--rollout-s", "60",
            "--workers", "1", "--out", str(tmp_path / "report"),
        ),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(ROOT),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    seen: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
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
    # it exited through its cleanup (SystemExit), not killed by the signal's default action
    assert rc not in (0, -signal.SIGTERM), "".join(seen)[-4000:]
    _assert_nothing_left([actor_pid], dirs, timeout=15.0)


def test_trainer_host_snapshot_round_trips_without_copy(tmp_path: Path) -> None:
    """The actor's body without Ray: a snapshot rebuilds to the trainer's exact weights."""
    import numpy as np

    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model
    from rollsafe.checksum import weights_checksum
    from rollsafe.demo import Trainer
    from rollsafe.demo_trainer import TrainerHost, tensors_from_snapshot

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


def test_embed_in_trainer_example_runs() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "embed_in_trainer.py"), "--steps", "2"],
        capture_output=True, text=True, timeout=120, check=False, cwd=str(ROOT),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "step 2:" in result.stdout and "engines match trainer: True" in result.stdout

"""``rollsafe demo --nodes N``: the demo on a local multi-node Ray cluster, a worker node removed.

End to end as a subprocess on a real three-node Ray cluster (``ray_cluster`` marker: each node
its own raylet): the report's checks all ``ok``, the removed node's group re-placed on the
surviving worker and ``active`` at the fleet's version, no failed request, the node-loss picture
written, the recorded run replayed through the verifier's model (``rollsafe verify --trace``:
node losses and placements included), and nothing the demo started (raylets, GCS, engines,
actors) left running, also when it is interrupted with Ctrl-C mid-rollout. Without a cluster:
the flags it refuses, with a message naming the flag, before anything starts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from trace_support import assert_run_replays

from rollsafe.demo import main
from rollsafe.demo.options import DemoOptions, add_arguments, options_problem

ROOT = Path(__file__).resolve().parents[1]


def _demo(*args: str, **kw: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "rollsafe.cli", "demo", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=str(ROOT),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        **kw,  # type: ignore[call-overload]
    )


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _processes_mentioning(needle: str) -> list[tuple[int, str]]:
    """(pid, cmdline) of every live process whose command line contains ``needle``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X") and needle in cmd:
            found.append((int(entry.name), cmd[:200]))
    return found


def _assert_cluster_gone(dirs: list[str], pids: list[int], timeout: float = 30.0) -> None:
    """No process naming one of ``dirs`` (the cluster's RAY_TMPDIR: its raylets and GCS; the
    demo's scratch: the engines' logs) nor any of ``pids`` is alive, and the dirs are gone."""
    from rollsafe.processes import pid_alive

    deadline = time.monotonic() + timeout
    while True:
        left = [p for d in dirs for p in _processes_mentioning(d)]
        alive = [p for p in pids if pid_alive(p)]
        if not left and not alive:
            break
        assert time.monotonic() < deadline, f"left running: {left}, pids {alive}"
        time.sleep(0.3)
    for d in dirs:
        assert not Path(d).exists(), f"{d} was not removed"


def _parse(argv: list[str]) -> tuple[DemoOptions, str | None]:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    opts = parser.parse_args(argv, namespace=DemoOptions())
    return opts, options_problem(opts)


# ---------------------------------------------------------------------------- the flags


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nodes", "1"], "--nodes must be >= 2 (got 1)"),
        (["--nodes", "0"], "--nodes must be >= 2 (got 0)"),
        (["--nodes", "3", "--transport", "ipc"], "--transport ipc is not available with --nodes"),
        (["--nodes", "3", "--engine", "vllm"], "--engine vllm is not available with --nodes"),
        (["--nodes", "3", "--no-immediate-recovery"], "--no-immediate-recovery is not available"),
        (["--nodes", "3", "--crash-at", "0"], "--crash-at 0: with --nodes it names the step"),
        (["--nodes", "3", "--steps", "2", "--crash-at", "3"], "1..2 (--steps)"),
    ],
)
def test_demo_nodes_refuses_bad_flags_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    out = tmp_path / "report"
    assert main([*argv, "--out", str(out)]) == 2
    assert message in capsys.readouterr().out
    assert not out.exists()  # refused before the report directory, the cluster or Ray


def test_demo_nodes_defaults_and_the_default_demo_unchanged() -> None:
    opts, problem = _parse(["--nodes", "3"])
    assert problem is None
    assert (opts.nodes, opts.groups, opts.transport, opts.warm_standby) == (3, 2, "nccl", False)
    assert (opts.steps, opts.rollout_s, opts.crash_at, opts.engine) == (3, 5.0, 2, "reference")
    opts, problem = _parse(["--nodes", "3", "--warm-standby", "--groups", "3", "--steps", "5"])
    assert problem is None and (opts.warm_standby, opts.groups, opts.steps) == (True, 3, 5)
    opts, problem = _parse([])  # no --nodes: today's demo, no cluster
    assert problem is None
    assert (opts.nodes, opts.groups, opts.transport, opts.warm_standby) == (None, 3, "ipc", True)
    assert (opts.steps, opts.rollout_s) == (4, 8.0)


# ---------------------------------------------------------------------------- end to end


@pytest.mark.ray_cluster
@pytest.mark.timeout(600)
def test_demo_nodes_3_removes_a_worker_and_its_group_comes_back(tmp_path: Path) -> None:
    from ray_cluster import require_ray

    require_ray()
    out = tmp_path / "report"
    proc = _demo("--nodes", "3", "--out", str(out))
    stdout, _ = proc.communicate(timeout=540)
    assert proc.returncode == 0, stdout[-6000:]
    assert "demo OK" in stdout and "rollsafe's reference engines, not real vLLM" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["failures"] == [], summary["failures"]
    nodes = summary["nodes"]
    checks = {c["check"]: c["ok"] for c in nodes["checks"]}
    assert len(checks) == 10 and all(checks.values()), nodes["checks"]
    assert set(nodes["cluster"]) == {"head", "worker1", "worker2"}
    # the second group (2 ranks) lost its worker and was placed on the other one
    g1 = nodes["groups"]["g1"]
    assert g1["ranks"] == 2 and g1["from"] != g1["to"], g1
    assert g1["to"] in ("worker1", "worker2") and g1["to"] == nodes["placement"]["g0"]
    assert g1["state"] == "active" and g1["versions"] == [3], g1  # the fleet's last version
    assert g1["left_routing_by"] in ("fail", "node_lost") and g1["total"] is not None
    assert set(nodes["placement"].values()) == {g1["to"]}  # both groups on the survivor
    assert nodes["requests"]["failed"] == 0 and nodes["requests"]["served"] > 0
    assert summary["dispatch_counts"] and not any(
        set(c) - {"active"} for c in summary["dispatch_counts"].values()
    )
    # the live lines showed the group's way back, placed by node
    assert re.search(r"!! step 2: removed worker node worker\d", stdout), stdout[-4000:]
    assert re.search(r"g1=(inactive|unplaced|recovering)@", stdout), stdout[-4000:]
    # the group's lane went through unplaced (the node loss), then active again
    picture = (out / "node_loss.svg").read_text()
    assert 'data-state="unplaced"' in picture and 'class="crash"' in picture
    timeline = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    path = [r["target"] for r in timeline if r["kind"] == "group" and r["subject"] == "g1"]
    assert "unplaced" in path and path[-1] == "active", path
    assert_run_replays(out)  # the node loss and the re-placement: a run of the model (#36)
    _assert_cluster_gone([nodes["ray_tmpdir"], summary["scratch_dir"]], [])


@pytest.mark.ray_cluster
@pytest.mark.timeout(600)
def test_demo_nodes_2_loses_every_group_they_wait_unplaced_and_a_joined_node_takes_them(
    tmp_path: Path,
) -> None:
    """The one worker holds both groups: both wait ``unplaced`` (no room), the demo adds a
    worker, the fleet's watcher offers it the groups; requests wait instead of failing."""
    from ray_cluster import require_ray

    require_ray()
    out = tmp_path / "report"
    proc = _demo("--nodes", "2", "--steps", "2", "--out", str(out))
    stdout, _ = proc.communicate(timeout=540)
    assert proc.returncode == 0, stdout[-6000:]
    nodes = json.loads((out / "summary.json").read_text())["nodes"]
    assert all(c["ok"] for c in nodes["checks"]), nodes["checks"]
    assert "wait unplaced (no node has room): adding a worker node" in stdout
    for gid in ("g0", "g1"):
        group = nodes["groups"][gid]
        assert (group["from"], group["to"], group["state"]) == ("worker1", "worker2", "active")
        assert group["unplaced_at"] is not None and group["versions"] == [2], group
    assert nodes["requests"]["failed"] == 0 and nodes["requests"]["served"] > 0
    assert_run_replays(out)  # both groups lost, then placed on the joined node (#36)
    _assert_cluster_gone([nodes["ray_tmpdir"]], [])


@pytest.mark.ray_cluster
@pytest.mark.timeout(600)
def test_demo_nodes_ctrl_c_mid_rollout_shuts_the_cluster_down(tmp_path: Path) -> None:
    from ray_cluster import require_ray

    require_ray()
    # a shell started in the background (`cmd &`, as CI runners do) hands its children SIGINT
    # ignored, and Python then installs no KeyboardInterrupt handler: give the demo the default
    # disposition a terminal's Ctrl-C meets
    proc = _demo(
        "--nodes",
        "2",
        "--steps",
        "2",
        "--out",
        str(tmp_path / "report"),
        preexec_fn=_sigint_default,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    dirs: dict[str, str] = {}
    for line in proc.stdout:  # until the first rollout line: cluster, trainer and fleet up
        lines.append(line)
        for key, pattern in (("ray", r"files (/tmp/rs-ray-\S+?)\)"), ("work", r"scratch (\S+)")):
            found = re.search(pattern, line)
            if found:
                dirs[key] = found.group(1).rstrip(",;")
        if "step 1 rollout" in line:
            break
    assert set(dirs) == {"ray", "work"}, "".join(lines)
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    assert "demo interrupted (KeyboardInterrupt)" in rest, rest[-4000:]
    assert "and the 2-node Ray cluster shut down" in rest
    assert proc.returncode != 0
    _assert_cluster_gone(list(dirs.values()), [])

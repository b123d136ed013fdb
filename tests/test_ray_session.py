"""rollsafe.adapters.ray.session on a real local Ray: a SIGTERMed driver's cleanup runs to its end
(Ray's C++ failure handler would abort it 3 s after the signal), and ``stop_local_ray`` ends
every process of the session that outlived the shutdown, by pid, before its directory goes --
and nothing it did not start."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from rollsafe.adapters.ray import init_ray, stop_local_ray  # noqa: E402
from rollsafe.processes import (  # noqa: E402
    pid_alive,
    process_info,
    processes_using,
    same_process_alive,
)

ROOT = Path(__file__).resolve().parents[1]
RAY_KW = {"num_cpus": 1, "include_dashboard": False, "log_to_driver": False}


@pytest.fixture
def ray_dir() -> Iterator[str]:
    """A private temp dir for one local Ray (short: its socket paths must fit AF_UNIX's 107
    bytes); whatever still uses it afterwards is killed, then it is removed."""
    path = tempfile.mkdtemp(prefix="rs-ray-", dir="/tmp")
    yield path
    for info, _ in processes_using(path):
        with contextlib.suppress(ProcessLookupError):
            os.kill(info.pid, signal.SIGKILL)
    shutil.rmtree(path, ignore_errors=True)


# A driver that is SIGTERMed right after starting Ray and whose cleanup takes 4 s (longer than
# absl's 3 s alarm; on a loaded machine the demo's does): it says when the cleanup starts and
# when it is done.
_DRIVER = """
import os, signal, sys, time
import ray
from rollsafe.adapters.ray import init_ray
how, temp = sys.argv[1], sys.argv[2]
kw = dict(num_cpus=1, include_dashboard=False, log_to_driver=False, _temp_dir=temp)
init_ray(**kw) if how == "init_ray" else ray.init(address="local", **kw)
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)
except SystemExit as exc:
    print("cleanup started, exit status", exc.code, flush=True)
    time.sleep(4.0)
    ray.shutdown()
    print("cleanup done", flush=True)
    raise
"""


@pytest.mark.parametrize("how", ["init_ray", "ray.init"])
def test_a_sigtermed_driver_runs_its_cleanup_to_the_end(ray_dir: str, how: str) -> None:
    """Through ``init_ray`` the SIGTERM goes straight to Python: ``SystemExit(15)``, the whole
    cleanup, exit status 15. A bare ``ray.init`` (the pinned Ray's own behaviour, the cause of
    the demo's leftover Ray directory) prints absl's ``*** SIGTERM received ***`` and aborts
    3 s into the cleanup (SIGABRT)."""
    result = subprocess.run(
        [sys.executable, "-c", _DRIVER, how, ray_dir],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=str(ROOT),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    out = result.stdout + result.stderr
    assert "cleanup started, exit status 15" in out, out[-3000:]
    if how == "init_ray":
        assert result.returncode == 15, out[-3000:]
        assert "cleanup done" in out and "SIGTERM received" not in out, out[-3000:]
    else:
        assert result.returncode == -signal.SIGABRT, out[-3000:]
        assert "SIGTERM received" in out and "cleanup done" not in out, out[-3000:]


# Runs in a Ray actor: starts a child that starts a grandchild (like an engine launcher's rank
# processes) and returns the grandchild's pid. ``ignore_term``: the grandchild ignores SIGTERM.
_TREE = """
import subprocess, sys, time
p = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(p.pid, flush=True)
time.sleep(600)
"""


def test_stop_local_ray_ends_what_a_killed_raylet_orphaned_and_nothing_else(ray_dir: str) -> None:
    """``ray.shutdown()`` SIGKILLs a raylet that has not exited 1 s after its SIGTERM (a loaded
    machine): the processes its workers started are orphaned and run on. ``stop_local_ray``
    ends them (SIGTERM; SIGKILL for one that ignores it), leaves nothing of the session, and
    leaves alone a process it did not start that reads the session's logs."""

    def grandchild(ignore_term: bool) -> int:  # defined here: Ray ships it by value
        body = "import signal, time\n"
        if ignore_term:
            body += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        child = subprocess.Popen(
            [sys.executable, "-c", _TREE, body + "time.sleep(600)\n"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        return int(child.stdout.readline())

    if ray.is_initialized():
        ray.shutdown()
    assert init_ray(**RAY_KW, _temp_dir=ray_dir)
    spawn = ray.remote(num_cpus=0)(grandchild)
    orphans = [ray.get(spawn.remote(False)), ray.get(spawn.remote(True))]
    infos = [process_info(pid) for pid in orphans]
    raylets = [i for i, _ in processes_using(ray_dir) if "/raylet/raylet " in i.command]
    assert len(raylets) == 1 and all(infos), (raylets, infos)
    # a reader of the logs that is not this process's descendant (its parent is gone)
    log = next(Path(ray_dir).glob("session_*/logs/raylet.out"))
    opened = Path(tempfile.mkdtemp(prefix="rs-reader-")) / "opened"
    reader = subprocess.run(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', sys.argv[1],"
            " *sys.argv[2:]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)",
            "import sys, time; f = open(sys.argv[1]); open(sys.argv[2], 'w').close();"
            " time.sleep(600)",
            str(log),
            str(opened),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    reader_pid = int(reader.stdout)
    reader_info = process_info(reader_pid)
    assert reader_info is not None
    try:
        deadline = time.monotonic() + 60
        while not opened.exists():  # the reader has the log open
            assert time.monotonic() < deadline and same_process_alive(reader_info)
            time.sleep(0.05)

        def shutdown() -> None:
            os.kill(raylets[0].pid, signal.SIGKILL)
            ray.shutdown()

        stop = stop_local_ray(shutdown, ray_dir, grace_s=1.0)
        outlived = {p.pid for p in stop.outlived_shutdown}
        killed = {p.pid for p in stop.killed}
        assert set(orphans) <= outlived, stop
        assert killed == {orphans[1]}, stop  # the one that ignores SIGTERM
        assert stop.left == [] and stop.describe_left() == ""
        assert not any(same_process_alive(p) for p in stop.processes)
        assert all(info is not None and not same_process_alive(info) for info in infos)
        # nothing of the session uses the directory: removed, it stays gone
        assert [i.pid for i, _ in processes_using(ray_dir)] == [reader_pid]
        assert reader_pid not in {p.pid for p in stop.processes}
        assert same_process_alive(reader_info)
    finally:
        os.kill(reader_pid, signal.SIGKILL)
        shutil.rmtree(opened.parent, ignore_errors=True)
    deadline = time.monotonic() + 30
    while pid_alive(reader_pid):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    shutil.rmtree(ray_dir)
    assert not Path(ray_dir).exists()

"""One core binding per engine: ``EngineSpec.cpu_cores`` binds the engine's WHOLE process tree.

Real processes, read back with ``os.sched_getaffinity``: the leader a launcher spawns and the
children and threads it starts afterwards (as vLLM's API server spawns its EngineCore and Worker)
are all bound to the engine's cores; the launching thread gets its own affinity back; ``()``
binds nothing; a core the host cannot run on is a start error naming ``cpu_cores``. A reference
engine, its warm standby (zygote) and the engines it forks: ``tests/test_launcher_standby.py``
(the first test); the real vLLM's three processes: ``tests/test_launcher_vllm_real.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("torch")

from engine_helpers import all_gone, wait_for

from rollsafe.adapters.engines import EngineLauncher, EngineSpec, EngineStartError
from rollsafe.adapters.engines.launch.process_group import descendants, kill_group, spawn_group

# A process that starts a thread, a ``spawn``ed child (a fresh interpreter, as vLLM starts its
# engine core and worker) and a grandchild of that child, then waits.
TREE = textwrap.dedent(
    """
    import multiprocessing as mp, subprocess, sys, threading, time

    def child():
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        time.sleep(600)

    if __name__ == "__main__":
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
        mp.get_context("spawn").Process(target=child, daemon=False).start()
        print("started", flush=True)
        time.sleep(600)
    """
)

ALL = frozenset(os.sched_getaffinity(0))
CORE = max(ALL)  # not core 0 where the host has two: an unbound process would show both


def thread_affinities(pid: int) -> dict[int, frozenset[int]]:
    """Every thread of ``pid`` and the cores it may run on."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            found[int(tid)] = frozenset(os.sched_getaffinity(int(tid)))
        except OSError:  # the thread ended
            continue
    return found


def tree_cores(pid: int) -> dict[int, frozenset[int]]:
    """The union of the cores of each process of ``pid``'s tree (every thread of it)."""
    out = {}
    for p in [pid, *descendants(pid)]:
        try:
            out[p] = frozenset().union(*thread_affinities(p).values())
        except OSError:
            continue
    return out


def spawn_tree(tmp_path: Path, cores: tuple[int, ...] | None) -> subprocess.Popen[bytes]:
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    return spawn_group(
        [sys.executable, str(script)], dict(os.environ), stdin=subprocess.DEVNULL, cpu_cores=cores
    )


def test_spawn_group_binds_the_leader_its_threads_children_and_grandchildren(
    tmp_path: Path,
) -> None:
    proc = spawn_tree(tmp_path, (CORE,))
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"started\n"
        # leader + its thread, the spawned child (and multiprocessing's helper), the grandchild
        assert wait_for(lambda: len(descendants(proc.pid)) >= 2, 60.0)
        tree = tree_cores(proc.pid)
        assert len(tree) >= 3 and len(thread_affinities(proc.pid)) >= 2
        assert tree == {p: {CORE} for p in tree}
        # the spawning thread (this one) got its own affinity back
        assert os.sched_getaffinity(0) == ALL
    finally:
        pids = [proc.pid, *descendants(proc.pid)]
        kill_group(proc, pids, sig_first=9, timeout=0)
    assert all_gone(pids)


def test_no_cores_binds_nothing(tmp_path: Path) -> None:
    for cores in ((), None):
        proc = spawn_tree(tmp_path, cores)
        try:
            assert proc.stdout is not None and proc.stdout.readline() == b"started\n"
            assert wait_for(lambda p=proc: len(descendants(p.pid)) >= 2, 60.0)
            tree = tree_cores(proc.pid)
            assert tree == {p: ALL for p in tree}  # what the launcher runs on
        finally:
            pids = [proc.pid, *descendants(proc.pid)]
            kill_group(proc, pids, sig_first=9, timeout=0)
        assert all_gone(pids)


def test_a_core_the_host_cannot_run_on_is_a_start_error(
    tmp_path: Path, launchers: list[EngineLauncher]
) -> None:
    missing = 4095  # no such core here; refused before the engine would read its model
    launcher = EngineLauncher(EngineSpec(model_path=str(tmp_path), cpu_cores=(missing,)))
    launchers.append(launcher)
    started = time.monotonic()
    with pytest.raises(EngineStartError, match=r"cpu_cores=\[4095\]"):
        launcher.start()
    assert time.monotonic() - started < 30.0  # refused at the spawn, nothing to wait for
    assert not launcher.started and os.sched_getaffinity(0) == ALL


def test_sglang_takes_no_cores() -> None:
    with pytest.raises(ValueError, match=r"cpu_cores=\(0,\) applies to kind='vllm' only"):
        EngineSpec(model_path="/m", kind="sglang", cpu_cores=(0,))
    with pytest.raises(ValueError, match=r"cpu_cores names a core twice"):
        EngineSpec(model_path="/m", cpu_cores=(0, 0))

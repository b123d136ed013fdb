"""rollsafe.processes: processes read from ``/proc`` -- alive or not, one process named by pid and
start time, descendants, and the processes that use a directory (its name on their command line,
a file open under it, their working directory there), with real child processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollsafe.processes import (
    ProcessInfo,
    descendants,
    files_under,
    live_processes,
    pid_alive,
    process_info,
    processes_using,
    same_process_alive,
)

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")

#: a child that opens ``argv[1]`` for writing (when given), says so, and sleeps until killed
_CHILD = """
import sys, time
f = open(sys.argv[1], "w") if len(sys.argv) > 1 and sys.argv[1] != "-" else None
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def _start(
    children: list[subprocess.Popen[str]], *args: str, cwd: Path | None = None
) -> subprocess.Popen[str]:
    """A sleeping child, once it runs its own program (so /proc shows its command line)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, *args], stdout=subprocess.PIPE, text=True, cwd=cwd
    )
    children.append(proc)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_process_info_names_one_process_by_pid_and_start_time(
    children: list[subprocess.Popen[str]],
) -> None:
    proc = _start(children, "-", "a-marker")
    info = process_info(proc.pid)
    assert info is not None and info.pid == proc.pid and info.ppid == os.getpid()
    assert info.command.endswith("- a-marker") and info.state in ("R", "S")
    assert same_process_alive(info) and proc.pid in {d.pid for d in descendants(os.getpid())}
    assert proc.pid in live_processes()
    # the same pid with another start time is another process: not this one
    assert not same_process_alive(ProcessInfo(info.pid, info.ppid, info.start + 1, "S", ""))
    proc.kill()
    # a zombie (not reaped yet) is neither alive nor the same process alive
    deadline = time.monotonic() + 10
    while (now := process_info(proc.pid)) is not None and now.state != "Z":
        assert time.monotonic() < deadline, now
        time.sleep(0.01)
    assert not pid_alive(proc.pid) and not same_process_alive(info)
    assert proc.pid not in live_processes()
    proc.wait()
    assert process_info(proc.pid) is None and not same_process_alive(info)
    assert "state S" in ProcessInfo(1, 0, 0, "S", "ray::IDLE").describe()


def test_processes_using_a_directory_by_open_file_command_line_and_cwd(
    tmp_path: Path, children: list[subprocess.Popen[str]]
) -> None:
    target = tmp_path / "logs" / "worker.out"
    target.parent.mkdir()
    holder = _start(children, str(target))  # its command line names the file: see files
    namer = _start(children, "-", str(tmp_path))  # names the directory, holds nothing there
    in_cwd = _start(children, cwd=target.parent)
    elsewhere = _start(children)
    using = {info.pid: files for info, files in processes_using(tmp_path)}
    assert using[holder.pid] == [str(target)]
    assert using[namer.pid] == []  # its command line names the directory
    assert using[in_cwd.pid] == [f"{target.parent} (working directory)"]
    assert elsewhere.pid not in using and os.getpid() not in using
    assert files_under(holder.pid, tmp_path) == [str(target)]
    # a removed file still open keeps its holder: the path and " (deleted)"
    target.unlink()
    assert files_under(holder.pid, tmp_path) == [f"{target} (deleted)"]
    # a directory whose name only starts like it is not under it
    assert files_under(holder.pid, str(tmp_path)[:-1]) == []

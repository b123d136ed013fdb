"""Processes as ``/proc`` shows them: whether one is alive, which one a pid names, and which
processes use a directory. Shared by the engine launcher and the export retention (which keeps a
directory while the process that leased it lives), and by the shutdown of a local Ray (which
waits, by pid, for every process of its session before removing the session's directory).

* :func:`pid_alive` -- a pid names a live process (not a zombie);
* :class:`ProcessInfo` / :func:`process_info` -- one process: pid, parent, start time (with the
  pid it names exactly one process, even after the pid is reused), state and command line;
  :func:`same_process_alive` -- that very process still runs;
* :func:`live_processes` -- every live process (zombies left out), by pid; :func:`descendants`
  -- a process's children, grandchildren, ... among them;
* :func:`files_under` -- the files a process has open (or its working directory) under a
  directory; :func:`processes_using` -- every live process whose command line names a directory
  or that has a file under it, with those files: who holds a directory that should be gone.

Standard library only (layer 1 of docs/architecture.md). Linux: without ``/proc`` the readers
find nothing (``pid_alive`` still answers from signal 0).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = [
    "ProcessInfo",
    "descendants",
    "files_under",
    "live_processes",
    "pid_alive",
    "process_info",
    "processes_using",
    "same_process_alive",
]

#: the longest command line kept in a :class:`ProcessInfo` (characters)
COMMAND_CHARS = 300


def pid_alive(pid: int) -> bool:
    """True if process ``pid`` exists and is not a zombie (nor dead, ``X``). A process of
    another user counts as alive (signal 0 is refused, the process is there)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # gone between the two reads, or no /proc: signal 0 said it exists
        return True
    # the state is the first field after the parenthesised command name (which may hold ")")
    end = stat.rfind(b")")
    return end < 0 or stat[end + 2 : end + 3] not in (b"Z", b"X")


@dataclass(frozen=True)
class ProcessInfo:
    """One process as ``/proc/PID`` described it when read."""

    pid: int
    ppid: int
    #: when it started (clock ticks since boot, ``stat`` field 22): ``(pid, start)`` names one
    #: process for good, a pid alone may be reused once it is gone
    start: int
    #: ``R``, ``S``, ``D`` (uninterruptible: even SIGKILL waits), ``Z`` (zombie), ...
    state: str
    #: the command line, arguments joined by spaces, at most :data:`COMMAND_CHARS` characters
    #: (Ray's workers rename theirs: ``ray::IDLE``, ``ray::TrainerHost``)
    command: str

    def describe(self) -> str:
        """``pid 123 (ray::IDLE, state S)``: for messages."""
        return f"pid {self.pid} ({self.command[:120] or '?'}, state {self.state})"


def process_info(pid: int) -> ProcessInfo | None:
    """Process ``pid`` as ``/proc`` shows it now, or ``None`` when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    end = stat.rfind(b")")
    fields = stat[end + 2 :].split()
    try:
        state, ppid, start = fields[0].decode(), int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None
    command = raw.replace(b"\0", b" ").strip().decode(errors="replace")[:COMMAND_CHARS]
    return ProcessInfo(pid=pid, ppid=ppid, start=start, state=state, command=command)


def same_process_alive(info: ProcessInfo) -> bool:
    """True while the process ``info`` describes (its pid *and* start time) runs, not a zombie."""
    now = process_info(info.pid)
    return now is not None and now.start == info.start and now.state not in ("Z", "X")


def live_processes() -> dict[int, ProcessInfo]:
    """Every live process (zombies left out) as ``/proc`` shows it now, by pid."""
    try:
        pids = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return {}
    found: dict[int, ProcessInfo] = {}
    for pid in pids:
        info = process_info(pid)
        if info is not None and info.state not in ("Z", "X"):
            found[pid] = info
    return found


def descendants(pid: int, processes: dict[int, ProcessInfo] | None = None) -> list[ProcessInfo]:
    """The live descendants of ``pid`` (children, grandchildren, ...) among ``processes``
    (default: :func:`live_processes` now)."""
    procs = live_processes() if processes is None else processes
    children: dict[int, list[int]] = {}
    for info in procs.values():
        children.setdefault(info.ppid, []).append(info.pid)
    found: list[ProcessInfo] = []
    seen = {pid}
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in seen:
                seen.add(child)
                found.append(procs[child])
                todo.append(child)
    return found


def files_under(pid: int, root: str | os.PathLike[str]) -> list[str]:
    """The files process ``pid`` has open under directory ``root`` (a removed one keeps its path
    and `` (deleted)``), and its working directory when it is under ``root``; empty when there
    are none or they cannot be read."""
    root = os.path.abspath(os.fspath(root))
    found: list[str] = []
    prefix = root.rstrip("/") + "/"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        fds = []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target == root or target.startswith(prefix):
            found.append(target)
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        cwd = ""
    if cwd == root or cwd.startswith(prefix):
        found.append(f"{cwd} (working directory)")
    return sorted(set(found))


def processes_using(root: str | os.PathLike[str]) -> list[tuple[ProcessInfo, list[str]]]:
    """Every live process (not this one, not a zombie) whose command line names ``root`` or that
    has a file open or its working directory under it, with those files (empty when only its
    command line names it). Processes of other users whose files cannot be read count by their
    command line only."""
    path = os.path.abspath(os.fspath(root))
    me = os.getpid()
    found: list[tuple[ProcessInfo, list[str]]] = []
    for pid, info in live_processes().items():
        if pid == me:
            continue
        files = files_under(pid, path)
        if files or path in info.command:
            found.append((info, files))
    return found

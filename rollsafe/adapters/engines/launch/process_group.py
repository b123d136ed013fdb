"""An engine's process group: spawn it in its own session, watch it, kill it, leave nothing behind.

Owns the OS side of one engine (or warm standby) process: :func:`spawn_group` starts a command
as the leader of a new session (so one ``killpg`` reaches every process it starts), the
parent-death watchdog (a tiny ``python -I -S`` process, detached from the launching process,
that SIGKILLs the group when that process dies without cleaning up), :func:`kill_group` (a
polite signal, one deadline, then SIGKILL for whatever is left, ranks that left the group
included), :func:`reap` (the finalizer: SIGKILL everything, never raises), :func:`pid_alive` and
:func:`descendants` (read from ``/proc``), and :class:`Candidate` (an engine started but not
yet the launcher's).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollsafe.adapters.engines.errors import EngineStartError
from rollsafe.adapters.engines.launch.output import OutputPump, redact
from rollsafe.processes import pid_alive

if TYPE_CHECKING:
    from rollsafe.adapters.engines.launch.fork_server import Proc
    from rollsafe.adapters.engines.launch.spec import EngineSpec

__all__ = [
    "Candidate",
    "descendants",
    "group_members",
    "kill_group",
    "reap",
    "remove_dirs",
    "signal_group",
    "signal_pid",
    "spawn_candidate",
    "spawn_group",
    "start_watchdog",
    "stop_watchdog",
    "wait_gone",
    "watch_candidate",
]


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def signal_pid(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def wait_gone(pids: Sequence[int], deadline: float) -> bool:
    while True:
        if not any(pid_alive(p) for p in pids):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


# Runs with ``python -I -S -c``, detached: it forks once and the first process exits, so the
# watchdog is no child of the launching process. Ray's worker SIGKILLs its own children when it
# exits (``kill_child_processes_on_worker_exit``, on by default): a watchdog that was one died with
# the engine's leader, and the engine's other processes (vLLM's EngineCore and its workers) ran on
# after their Ray node was removed. It exits when the engine group is gone, and SIGKILLs the group
# once the launching process (its pid *and* start time: a reused pid is not it) is gone. With
# ``--unlink-shm`` (a real vLLM) it then removes the ``/dev/shm`` segments the group's processes
# mapped or held open and no other live process does (vLLM's shared-memory queues: a SIGKILLed
# vLLM leaves them, hundreds of MB each, as ``launch.real_engine.leftovers`` knows). Each
# ``--rmdir=PATH`` (a real vLLM's ipc-socket directory, :func:`spawn_candidate`) is removed once
# the group is gone, killed by the watchdog or not.
_WATCHDOG = """
import os, signal, sys, time
parent, start, pgid = int(sys.argv[1]), sys.argv[2].encode(), int(sys.argv[3])
clean = "--unlink-shm" in sys.argv[4:]
rmdirs = [a[8:] for a in sys.argv[4:] if a.startswith("--rmdir=")]
if os.fork() > 0:
    os._exit(0)
def stat(pid):
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2:].split()
def parent_alive():
    fields = stat(parent)
    return fields is not None and fields[19] == start and fields[0] not in (b"Z", b"X")
def pids(group=None):
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = stat(int(entry))
            if fields is not None and (group is None or int(fields[2]) == group):
                out.append(int(entry))
    return out
def rmdirs_and_exit():
    if rmdirs:
        import shutil
        for path in rmdirs:
            shutil.rmtree(path, ignore_errors=True)
    sys.exit(0)
def shm(of):
    found = set()
    for pid in of:
        try:
            with open("/proc/%d/maps" % pid, encoding="utf-8", errors="replace") as f:
                for line in f:
                    i = line.find("/dev/shm/")
                    if i >= 0:
                        found.add(line[i:].strip())
        except OSError:
            pass
        try:
            for fd in os.listdir("/proc/%d/fd" % pid):
                try:
                    target = os.readlink("/proc/%d/fd/%s" % (pid, fd))
                except OSError:
                    continue
                if target.startswith("/dev/shm/"):
                    found.add(target)
        except OSError:
            pass
    return found
while True:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        rmdirs_and_exit()
    except PermissionError:
        pass
    if not parent_alive():
        held = shm(pids(pgid)) if clean else set()
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
        if held or rmdirs:
            deadline = time.monotonic() + 10
            while pids(pgid) and time.monotonic() < deadline:
                time.sleep(0.1)
            for path in held - shm(p for p in pids() if p != os.getpid()):
                try:
                    os.unlink(path)
                except OSError:
                    pass
        rmdirs_and_exit()
    time.sleep(0.25)
"""


def _start_time(pid: int) -> str:
    """Field 22 of ``/proc/PID/stat``: when the process started (clock ticks since boot)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rfind(b")") + 2 :].split()[19].decode()


def _proc_stats() -> list[tuple[int, list[bytes]]]:
    """``(pid, the fields after the command name)`` of every process in ``/proc`` now (one
    that ends meanwhile is left out)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    stats: list[tuple[int, list[bytes]]] = []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            stats.append((int(entry), stat[stat.rindex(b")") + 2 :].split()))
        except (OSError, ValueError):
            continue
    return stats


def group_members(pgid: int) -> list[int]:
    """Every live process of process group ``pgid`` (its leader may be gone: a SIGKILLed
    server's workers stay in its group), read from ``/proc``."""
    found: list[int] = []
    for pid, fields in _proc_stats():
        try:
            if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
                found.append(pid)
        except (ValueError, IndexError):
            continue
    return found


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children, grandchildren, ...), read from ``/proc``."""
    children: dict[int, list[int]] = {}
    for child, fields in _proc_stats():
        try:
            ppid = int(fields[1])
        except (ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(child)
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


def spawn_group(
    cmd: list[str],
    env: dict[str, str],
    *,
    stdin: int,
    pass_fds: Sequence[int] = (),
    cpu_cores: Sequence[int] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` as the leader of a new session (the whole group can be signalled at once),
    stdout and stderr piped for an :class:`OutputPump`. With ``cpu_cores`` (non-empty) the
    process runs on those cores only from its first instruction, and so does every process it
    starts (affinity is inherited across fork, spawn and exec); an ``OSError`` when none of
    them can be used here. None or ``()`` binds nothing."""
    with _spawning_on(cpu_cores):
        return subprocess.Popen(
            cmd,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
            close_fds=True,
            pass_fds=tuple(pass_fds),
        )


@contextlib.contextmanager
def _spawning_on(cpu_cores: Sequence[int] | None) -> Iterator[None]:
    """Run the body (a ``Popen``) with the CALLING THREAD bound to ``cpu_cores``, then restore
    its affinity.

    Why this way: a child inherits the affinity of the thread that forks it, so binding the
    spawning thread for the duration of the ``Popen`` binds the engine from its first
    instruction, before it can start a thread or a child (vLLM's EngineCore and Worker are
    ``spawn``ed from the API server and inherit it; a warm standby's forks inherit the zygote's).
    ``preexec_fn`` is unsafe in the multi-threaded launcher; ``sched_setaffinity(pid)`` after
    ``Popen`` races the child (threads it started already keep the old mask); an exec wrapper
    costs an interpreter start per engine and turns "cannot execute" into an exit code.
    ``sched_setaffinity(0, ...)`` changes this thread only, never the launcher's other threads.
    """
    if not cpu_cores or not hasattr(os, "sched_setaffinity"):  # () binds nothing; not Linux
        yield
        return
    saved = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, set(cpu_cores))
    except OSError as exc:
        raise OSError(
            exc.errno,
            f"cannot bind the engine to cpu_cores={list(cpu_cores)} (this process may run on "
            f"cores {sorted(saved)}): {exc.strerror}",
        ) from exc
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


def start_watchdog(
    python: str, pgid: int, *, unlink_shm: bool = False, dirs: Sequence[str] = ()
) -> subprocess.Popen[bytes] | None:
    """Start the parent-death watchdog of group ``pgid`` (see ``_WATCHDOG``): detached from this
    process, it SIGKILLs the group once this process is gone (``unlink_shm``: and removes the
    ``/dev/shm`` segments only the group used) and exits once the group is gone, deleting
    ``dirs`` in both cases. The returned process is the one that forked it, already exited and
    reaped (None: no watchdog)."""
    flags = (["--unlink-shm"] if unlink_shm else []) + [f"--rmdir={d}" for d in dirs]
    try:
        proc = subprocess.Popen(
            [
                python,
                "-I",
                "-S",
                "-c",
                _WATCHDOG,
                str(os.getpid()),
                _start_time(os.getpid()),
                str(pgid),
                *flags,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
    except OSError:
        return None
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30.0)  # the fork's first half exits at once
    return proc


def stop_watchdog(watchdog: subprocess.Popen[bytes] | None) -> None:
    if watchdog is None:
        return
    with contextlib.suppress(OSError):
        watchdog.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        watchdog.wait(timeout=2.0)


def reap(
    proc: Proc,
    rank_pids: Sequence[int],
    watchdog: subprocess.Popen[bytes] | None,
    files: Sequence[str] = (),
    dirs: Sequence[str] = (),
) -> None:
    """Finalizer: SIGKILL the group and every known rank; reap the leader; delete ``files``
    (a real SGLang engine's API-key file) and ``dirs`` (a real vLLM's ipc-socket directory).
    Never raises."""
    try:
        signal_group(proc.pid, signal.SIGKILL)
        for pid in rank_pids:
            if pid_alive(pid):
                signal_pid(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            proc.wait(timeout=5)
        stop_watchdog(watchdog)
    except Exception:
        pass
    for path in files:
        with contextlib.suppress(OSError):
            os.unlink(path)
    remove_dirs(dirs)


def remove_dirs(dirs: Sequence[str]) -> None:
    """Delete ``dirs`` and what is in them (once the processes that wrote there are gone)."""
    for path in dirs:
        shutil.rmtree(path, ignore_errors=True)


def kill_group(proc: Proc, rank_pids: Sequence[int], *, sig_first: int, timeout: float) -> None:
    """Stop ``proc``'s process group and ``rank_pids`` (processes that may have left it):
    ``sig_first`` to the group; unless that is SIGKILL, wait up to ``timeout`` s (one deadline
    for the leader and every rank); then SIGKILL whatever is left, and reap the leader."""
    pgid = proc.pid
    signal_group(pgid, sig_first)
    if sig_first != signal.SIGKILL:
        # One deadline for the whole polite stop: rank 0 and every other rank share it.
        deadline = time.monotonic() + max(timeout, 0.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(timeout, 0.0))
        wait_gone(rank_pids, deadline)
    # whatever survived the polite signal (or everything, for kill()) dies now
    signal_group(pgid, signal.SIGKILL)
    for pid in rank_pids:
        if pid_alive(pid):
            signal_pid(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5.0)
    wait_gone(rank_pids, time.monotonic() + 5.0)


@dataclass
class Candidate:
    """An engine started but not installed yet (a fresh spawn, or a fork racing one): its
    process, output pump, watchdog, the finalizer that kills it if nobody installs it, and the
    directories to delete once its group is gone (``dirs``: a real vLLM's ipc sockets)."""

    proc: Proc
    pump: OutputPump
    watchdog: subprocess.Popen[bytes] | None
    finalizer: weakref.finalize[Any, Any]
    dirs: tuple[str, ...] = ()

    def discard(self) -> None:
        """SIGKILL its group and reap it."""
        self.finalizer.detach()
        signal_group(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5.0)
        stop_watchdog(self.watchdog)
        self.pump.close(timeout=1.0)
        remove_dirs(self.dirs)


def spawn_candidate(owner: object, spec: EngineSpec, cmd: list[str], log_path: str) -> Candidate:
    """Spawn ``cmd`` in ``spec``'s environment as a new group, its output pumped into
    ``log_path``, watched as :func:`watch_candidate` does; :class:`EngineStartError` if it
    cannot be executed.

    A real vLLM gets a directory of its own for its ZMQ ``ipc://`` sockets
    (``VLLM_RPC_BASE_PATH``, unless ``spec.env`` sets it; vLLM's default is the system's temp
    directory): a SIGKILLed vLLM leaves its socket files behind, and once its whole group is
    dead nothing names them any more. The directory goes with the group (stop, kill, the
    finalizer, the parent-death watchdog)."""
    env = spec.environment()
    dirs: tuple[str, ...] = ()
    if spec.kind == "vllm" and "VLLM_RPC_BASE_PATH" not in (spec.env or {}):
        # short: a unix socket's path has 107 bytes, and vLLM adds "/" + a uuid4 (37)
        dirs = (tempfile.mkdtemp(prefix="rollsafe-vllm-ipc-"),)
        env["VLLM_RPC_BASE_PATH"] = dirs[0]
    try:
        proc = spawn_group(cmd, env, stdin=subprocess.DEVNULL, cpu_cores=spec.cpu_cores)
    except OSError as exc:
        remove_dirs(dirs)
        raise EngineStartError(
            f"cannot execute the engine command: {exc}",
            command=[redact(a, spec.secrets()) for a in cmd],
            exit_code=None,
            output_tail="",
            log_path=log_path,
        ) from exc
    pump = OutputPump(proc, log_path, spec.secrets())
    try:
        return watch_candidate(owner, spec, proc, pump, dirs=dirs)
    except BaseException:  # nothing owns it yet: it and its directory go now
        signal_group(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5.0)
        pump.close(timeout=1.0)
        remove_dirs(dirs)
        raise


def watch_candidate(
    owner: object, spec: EngineSpec, proc: Proc, pump: OutputPump, *, dirs: tuple[str, ...] = ()
) -> Candidate:
    """``proc`` with a parent-death watchdog on its group (``spec.reap_on_parent_death``) and a
    finalizer that reaps it when ``owner`` is garbage-collected (``dirs`` deleted with it)."""
    watchdog = (
        start_watchdog(spec.interpreter(), proc.pid, unlink_shm=spec.kind == "vllm", dirs=dirs)
        if spec.reap_on_parent_death
        else None
    )
    finalizer = weakref.finalize(owner, reap, proc, [], watchdog, (), dirs)
    return Candidate(proc, pump, watchdog, finalizer, dirs)

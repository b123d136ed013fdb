"""Fork server ("zygote") mode of the warm standby: ``--standby --fork-server-fd FD``.

A warm standby that imported everything (``__main__.standby_imports``) stays resident and forks
one engine per request instead of becoming the engine itself, so a start after a crash costs a
``fork()`` (milliseconds) and the standby is still ready for the next crash: no re-import.

Protocol on ``FD``, one end of an ``AF_UNIX`` ``SOCK_SEQPACKET`` socket pair that the launcher
created and passed to this process only (no address exists, so nothing else can connect: the
same trust as the stdin hand-off). One JSON object per packet:

=============================  =================================================================
launcher -> zygote             ``{"id": N, "argv": [...], "env": {...}}`` with two file
                               descriptors attached (``SCM_RIGHTS``): the engine's stdout and
                               stderr. ``argv`` / ``env`` as in the stdin hand-off.
zygote -> launcher             ``{"op": "forked", "id": N, "pid": PID}`` once the child runs in
                               its own session; ``{"op": "error", "id": N, "error": "..."}`` if
                               it did not fork (bad request, not fork-safe).
zygote -> launcher (any time)  ``{"op": "exit", "pid": PID, "returncode": RC}``: a child
                               exited (``RC`` as ``Popen.returncode``: ``-SIG`` if killed); the
                               zygote reaps its children as soon as ``SIGCHLD`` arrives.
=============================  =================================================================

EOF on ``FD`` (the launcher released it or died) ends the zygote with status 0; its children
live on (each has its own session; the launcher's watchdogs reap them).

Why forking here is safe: the zygote only imports (no torch op runs, so no OpenMP / BLAS
thread pool exists) and never initialises CUDA (checked before every fork:
``torch.cuda.is_initialized()``), so no pool or driver state can be inherited half-way; it is
single-threaded (checked in ``/proc/self/task`` before every fork, as for the CPU ranks in
:mod:`.bootstrap`; a thread pool started by an import would fail this check; only
:data:`~.bootstrap.FORK_SAFE_THREADS`, jemalloc's purging thread whose own at-fork handlers
make it safe, is tolerated), so no other thread can hold a lock (malloc, import, logging) at
the fork; its only descriptors besides
stdio are the control socket and the ``SIGCHLD`` wake-up pipe, which the child closes before it
runs the engine. Python's own at-fork hooks run (``os.fork``). The imported objects are moved
to the permanent generation (``gc.freeze()``) so that the children's garbage collections do not
dirty the shared pages.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from rollsafe.adapters.reference_engine.bootstrap import other_threads
from rollsafe.errors import RollsafeError

__all__ = ["FORK_SERVER_FLAG", "MAX_PACKET", "ForkRequestError", "check_request", "serve_forks"]

#: The ``--standby`` option naming the control socket's file descriptor.
FORK_SERVER_FLAG = "--fork-server-fd"
#: The largest request packet read (the engine arguments and environment delta).
MAX_PACKET = 1 << 20
#: Seconds a forked child has to report that it runs in its own session.
_SETSID_TIMEOUT_S = 10.0


class ForkRequestError(RollsafeError, ValueError):
    """A fork request is malformed or cannot be served (answered with an ``error`` packet);
    ``req_id`` is the request's id when it could be read."""

    def __init__(self, message: str, req_id: int | None = None) -> None:
        super().__init__(message)
        self.req_id = req_id


def check_request(
    data: bytes, fds: list[int], check: Callable[[object], tuple[list[str], dict[str, str]]]
) -> tuple[int, list[str], dict[str, str]]:
    """``(id, argv, env)`` of a request packet; :class:`ForkRequestError` naming what is wrong.

    ``check`` validates the ``{"argv", "env"}`` part (``__main__.check_handoff``).
    """
    try:
        msg = json.loads(data)
    except ValueError as exc:
        raise ForkRequestError(f"not JSON ({exc})") from exc
    if not isinstance(msg, dict):
        raise ForkRequestError(f"expected a JSON object, got {type(msg).__name__}")
    req_id = msg.pop("id", None)
    if isinstance(req_id, bool) or not isinstance(req_id, int):
        raise ForkRequestError("'id' must be an integer")
    if len(fds) != 2:
        raise ForkRequestError(
            f"expected 2 file descriptors (stdout, stderr), got {len(fds)}", req_id
        )
    try:
        argv, env = check(msg)
    except ValueError as exc:
        raise ForkRequestError(str(exc), req_id) from exc
    return req_id, argv, env


def _send(sock: socket.socket, msg: dict[str, Any]) -> bool:
    try:
        sock.send(json.dumps(msg).encode())
    except OSError:
        return False
    return True


def _reap(sock: socket.socket) -> bool:
    """Reap every exited child and report it; False once the launcher is gone."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            return True
        code = os.waitstatus_to_exitcode(status)
        if not _send(sock, {"op": "exit", "pid": pid, "returncode": code}):
            return False


def _fork_problem() -> str | None:
    """Why forking now would be unsafe (see the module docstring), or None."""
    others = other_threads()
    if others is None:
        return "the zygote cannot list its threads (/proc/self/task is unreadable)"
    if others:
        return f"the zygote is not single-threaded ({len(others) + 1} threads: {sorted(others)})"
    torch = sys.modules.get("torch")
    if torch is not None and bool(torch.cuda.is_initialized()):
        return "the zygote initialised CUDA"
    return None


def serve_forks(
    sock: socket.socket,
    run: Callable[[list[str], float], int],
    check: Callable[[object], tuple[list[str], dict[str, str]]],
    exit_fast: Callable[[int], NoReturn],
) -> int:
    """Serve fork requests on ``sock`` until EOF; return the zygote's exit status.

    In each child (never returning here): ``run(argv, handoff_at)`` is the engine's ``main``,
    its status goes to ``exit_fast``. ``check`` validates a request's ``argv`` / ``env``.
    """
    gc.freeze()  # see the module docstring
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    previous = signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(wake_w)
    try:
        while True:
            readable, _, _ = select.select([sock.fileno(), wake_r], [], [])
            if wake_r in readable:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
            if not _reap(sock):
                return 0
            if sock.fileno() not in readable:
                continue
            try:
                data, fds, _flags, _addr = socket.recv_fds(sock, MAX_PACKET, 4)
            except OSError:
                return 0
            if not data:
                return 0  # EOF: released (or the launcher is gone)
            handoff_at = time.monotonic()
            try:
                req_id, argv, env = check_request(data, fds, check)
                problem = _fork_problem()
                if problem is not None:
                    raise ForkRequestError(problem, req_id)
            except ForkRequestError as exc:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                if not _send(sock, {"op": "error", "id": exc.req_id, "error": str(exc)}):
                    return 0
                continue
            pid = _fork(sock, (wake_r, wake_w), fds, argv, env, handoff_at, run, exit_fast)
            reply = (
                {"op": "forked", "id": req_id, "pid": pid}
                if pid > 0
                else {"op": "error", "id": req_id, "error": "the child did not start its session"}
            )
            if not _send(sock, reply):
                return 0
    finally:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, previous)


def _fork(
    sock: socket.socket,
    wake: tuple[int, int],
    fds: list[int],
    argv: list[str],
    env: dict[str, str],
    handoff_at: float,
    run: Callable[[list[str], float], int],
    exit_fast: Callable[[int], NoReturn],
) -> int:
    """Fork the engine child; return its pid once it runs in its own session (-1: it did not
    say so in time, and was killed)."""
    sync_r, sync_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(sync_r)
        _child(sock, wake, fds, sync_w, argv, env, handoff_at, run, exit_fast)
    os.close(sync_w)
    for fd in fds:
        os.close(fd)
    try:
        ready, _, _ = select.select([sync_r], [], [], _SETSID_TIMEOUT_S)
        ok = bool(ready) and os.read(sync_r, 1) == b"1"
    finally:
        os.close(sync_r)
    if not ok:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        return -1
    return pid


def _child(
    sock: socket.socket,
    wake: tuple[int, int],
    fds: list[int],
    sync_w: int,
    argv: list[str],
    env: dict[str, str],
    handoff_at: float,
    run: Callable[[list[str], float], int],
    exit_fast: Callable[[int], NoReturn],
) -> NoReturn:
    """The forked child: detach, take over stdio, then run the engine (never returns)."""
    code = 3
    try:
        os.setsid()  # its own session and process group, as a spawned engine has
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        for fd in wake:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        out, err = fds
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        os.write(sync_w, b"1")
        os.close(sync_w)
        os.environ.update(env)
        code = run(argv, handoff_at)
    except BaseException:
        with contextlib.suppress(Exception):
            traceback.print_exc()
    exit_fast(code)

"""The launcher's end of a warm standby's fork server: fork requests and forked engines.

A warm standby is a zygote (``rollsafe.adapters.reference_engine.zygote`` has the protocol and
the other end): a resident engine process that already imported torch and transformers and
forks engines on request over an ``AF_UNIX`` socket pair only the launcher holds. This module
owns that socket's client side: :class:`ZygoteLink` (sends requests, a reader thread collects
the answers and the exit statuses of the zygote's children), :func:`request_fork` and
:class:`PendingFork` (a request in flight, with the read ends of the engine's pipes), and
:class:`ForkedProcess` (a ``Popen``-like handle on a forked engine, which the launcher watches
as any process: :data:`Proc`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, TypeAlias

from rollsafe.adapters.engines.launch.process_group import signal_group
from rollsafe.processes import pid_alive

if TYPE_CHECKING:
    from rollsafe.adapters.engines.launch.spec import EngineSpec
    from rollsafe.adapters.engines.launch.standby import Standby

__all__ = [
    "EXIT_UNKNOWN",
    "FORK_TIMEOUT_S",
    "ForkTicket",
    "ForkedProcess",
    "PendingFork",
    "Proc",
    "ZygoteLink",
    "request_fork",
]

log = logging.getLogger("rollsafe.adapters.engines.launcher")  # one logger for the launcher


class _ZygoteError(Exception):
    """A warm standby (zygote) could not fork an engine: gone, refused, or no answer."""


class ForkTicket:
    """One fork request in flight: set once the zygote answered (``pid`` or ``error``)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.pid: int | None = None
        self.error: str | None = None
        self.abandoned = False


class ZygoteLink:
    """The launcher's end of a zygote's control socket (protocol:
    ``rollsafe.adapters.reference_engine.zygote``): sends fork requests, and a reader thread
    collects the answers and the exit statuses of the zygote's children (the zygote is their
    parent and reaps them). Holds no reference to the launcher."""

    def __init__(self, sock: socket.socket, zygote_pid: int) -> None:
        self._sock = sock
        self.zygote_pid = zygote_pid
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self._tickets: dict[int, ForkTicket] = {}
        self._exits: dict[int, int] = {}
        self.closed = False
        self.close_reason = ""
        self._thread = threading.Thread(
            target=self._read, daemon=True, name=f"rollsafe-zygote-{zygote_pid}"
        )
        self._thread.start()

    def request(self, argv: list[str], env: dict[str, str], fds: Sequence[int]) -> ForkTicket:
        """Ask for one engine with ``fds`` (its stdout, stderr) attached; answered later."""
        ticket = ForkTicket()
        with self._cond:
            if self.closed:
                raise _ZygoteError(self.close_reason)
            req_id = next(self._ids)
            self._tickets[req_id] = ticket
        data = json.dumps({"id": req_id, "argv": argv, "env": env}).encode()
        try:
            socket.send_fds(self._sock, [data], list(fds))
        except OSError as exc:
            with self._cond:
                self._tickets.pop(req_id, None)
            raise _ZygoteError(f"cannot send the fork request: {exc}") from exc
        return ticket

    def abandon(self, ticket: ForkTicket) -> None:
        """Nobody wants this fork any more: its engine is killed now or as soon as it forks."""
        with self._cond:
            ticket.abandoned = True
            pid = ticket.pid
        if pid is not None:
            signal_group(pid, signal.SIGKILL)

    def exit_code(self, pid: int, timeout: float) -> int | None:
        """The reported exit status of child ``pid``, waiting up to ``timeout`` s for it (None:
        not reported, or the zygote is gone)."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or self.closed, timeout)
            return self._exits.get(pid)  # kept: several threads may poll the same engine

    def close(self) -> None:
        """Release the zygote (EOF on its socket makes it exit)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def _read(self) -> None:
        reason = f"the standby (pid {self.zygote_pid}) closed its control socket (exited)"
        try:
            while True:
                data = self._sock.recv(65536)
                if not data:
                    break
                try:
                    msg = json.loads(data)
                except ValueError:
                    log.warning("zygote %d: unparsable packet %r", self.zygote_pid, data[:200])
                    continue
                if isinstance(msg, dict):
                    self._dispatch(msg)
        except OSError as exc:
            reason = f"the standby's (pid {self.zygote_pid}) control socket failed: {exc}"
        finally:
            with self._cond:
                self.closed = True
                self.close_reason = reason
                tickets = list(self._tickets.values())
                self._tickets.clear()
                self._cond.notify_all()
            for ticket in tickets:
                ticket.error = reason
                ticket.event.set()
            with contextlib.suppress(OSError):
                self._sock.close()

    def _dispatch(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "exit":
            with self._cond:
                self._exits[int(msg["pid"])] = int(msg["returncode"])
                self._cond.notify_all()
            return
        if op not in ("forked", "error"):
            return
        with self._cond:
            ticket = self._tickets.pop(msg.get("id", -1), None)
            if ticket is None:
                return
            if op == "forked":
                ticket.pid = int(msg["pid"])
            else:
                ticket.error = str(msg.get("error"))
            kill = ticket.abandoned and ticket.pid is not None
        if kill and ticket.pid is not None:
            signal_group(ticket.pid, signal.SIGKILL)
        ticket.event.set()


#: ``returncode`` of a forked engine whose exit status nobody could tell (its zygote was gone).
EXIT_UNKNOWN = 255


class ForkedProcess:
    """A ``Popen``-like handle on an engine a zygote forked. The launcher is not its parent: the
    zygote reaps it and reports its exit status over the control socket; liveness comes from
    ``/proc`` (a killed engine is a zombie at once, so a crash is seen without waiting for the
    report). Signalled by pid / process group like any engine."""

    stdin: None = None

    def __init__(self, pid: int, link: ZygoteLink, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.pid = pid
        self.link = link
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        code = self.link.exit_code(self.pid, 0.0)
        if code is None and not pid_alive(self.pid):
            # dead: the zygote reaps it on SIGCHLD and reports within milliseconds
            code = self.link.exit_code(self.pid, 1.0)
            if code is None:
                code = EXIT_UNKNOWN
        self.returncode = code
        return code

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self.poll()
            if code is not None:
                return code
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"forked engine (pid {self.pid})", timeout or 0.0)
            time.sleep(0.01)


#: A process the launcher watches: one it spawned, or an engine a zygote forked.
Proc: TypeAlias = "subprocess.Popen[bytes] | ForkedProcess"
#: Seconds a ready zygote has to answer a fork request before it counts as broken.
FORK_TIMEOUT_S = 10.0


def request_fork(sb: Standby, spec: EngineSpec) -> PendingFork:
    """Send ``sb`` a fork request for ``spec``'s engine (answered once it is imported): the
    engine's arguments, the environment where it differs from the zygote's, and the write ends
    of two new pipes for its stdout and stderr. :class:`_ZygoteError` if it cannot be sent."""
    env = spec.environment()
    delta = {k: v for k, v in env.items() if sb.env.get(k) != v}
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        ticket = sb.link.request(spec.engine_args(), delta, (out_w, err_w))
    except BaseException:
        os.close(out_r)
        os.close(err_r)
        raise
    finally:  # the zygote's child holds the write ends now: EOF comes when it is gone
        os.close(out_w)
        os.close(err_w)
    return PendingFork(sb, ticket, out_r, err_r)


@dataclass
class PendingFork:
    """A fork request sent to a zygote, and the read ends of the engine's stdout and stderr."""

    zygote: Standby
    ticket: ForkTicket
    out_r: int
    err_r: int
    taken: bool = False

    def abandon(self) -> None:
        """Kill the engine if it forks, close the pipes (unless a candidate owns them)."""
        self.zygote.link.abandon(self.ticket)
        if not self.taken:
            self.taken = True
            for fd in (self.out_r, self.err_r):
                with contextlib.suppress(OSError):
                    os.close(fd)

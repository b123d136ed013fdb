"""An engine's port black-holed: every TCP packet to or from it dropped, for real.

:class:`Blackhole` drops every packet to or from the ports it :meth:`~Blackhole.block`\\ s, so
new connections hang in ``SYN_SENT`` and established ones (the fleet's pooled connections, a
stream in flight) stop moving, as behind a dead switch port; nothing else on the machine is
touched. It does so the first way that works here (both need root):

* ``iptables``: one chain of this process (``RSSOAK<pid>``), jumped to from ``INPUT``
  (loopback traffic, which is all of a one-machine cluster's, passes ``INPUT``); a blocked port
  gets two ``DROP`` rules there (``--dport`` and ``--sport``). :meth:`~Blackhole.close` removes
  the chain.
* ``tc`` (iproute2, where iptables is missing or the kernel has no netfilter tables for it): a
  root ``htb`` qdisc on ``lo`` (handle ``dead:``) whose unclassified traffic passes straight
  through (htb's direct queue), one class ``dead:1`` whose queue holds nothing (``pfifo limit
  0``: every packet given to it is dropped), and for each blocked port one ``u32`` filter pair
  (preference = the port; TCP to it, TCP from it) that sends the port's packets there. A
  loopback packet leaves through ``lo``'s egress once, so both directions are dropped. Every
  process of the machine that blocks a port this way shares the qdisc; a lock file serialises
  their changes and the last port unblocked removes it, leaving ``lo`` as it was. A root qdisc
  on ``lo`` that is not this one is never replaced: blocking refuses, naming it.

A hole given an *owner* (the pid serving the port) ends when that process exits, whatever its
time left: the port is then free for any process to bind (the fleet re-spawns a failed engine
on a fresh port, and the old number may be handed to anything), and on a real network a new
host behind it would not sit behind the dead one's switch port.

A process killed outright (``SIGKILL``, a test's timeout) runs no cleanup: its *warden*, a
process of its own session started with the first block, learns each port over a pipe and, when
the pipe ends without the owner's goodbye, lifts what is still blocked, so no port of the machine
stays black-holed after a killed soak.

:func:`available` says whether either way works here; when neither does, the soak lists
``port_blackhole`` as not injectable with why.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

from rollsafe.processes import ProcessInfo, process_info, same_process_alive

__all__ = ["Blackhole", "available", "method"]

#: the tc way's root qdisc on ``lo``, its dropping class, and the lock its users share
TC_HANDLE = "dead:"
TC_CLASS = "dead:1"
TC_LOCK = "/run/lock/rollsafe-blackhole.lock"
#: how often a hole with an owner checks that the owner still runs (:meth:`Blackhole.block`)
OWNER_POLL_S = 0.2


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)


def _iptables(*args: str) -> subprocess.CompletedProcess[str]:
    return _run("iptables", "-w", "5", *args)


def _tc(command: str) -> subprocess.CompletedProcess[str]:
    """``tc`` with ``command``'s words (none holds a space)."""
    return _run("tc", *command.split())


def _checked(out: subprocess.CompletedProcess[str]) -> None:
    if out.returncode != 0:
        cmd = " ".join(str(a) for a in out.args)
        raise OSError(f"{cmd}: {(out.stderr or out.stdout).strip()[:200]}")


def _iptables_problem() -> str | None:
    if shutil.which("iptables") is None:
        return "iptables is not installed"
    probe = f"RSSOAKP{os.getpid()}"
    made = _iptables("-N", probe)
    if made.returncode != 0:
        return f"iptables -N failed: {made.stderr.strip()[:200]}"
    _iptables("-X", probe)
    return None


#: the qdisc and its dropping class, made by the first block (``tc`` commands)
_TC_SETUP = (
    f"qdisc add dev lo root handle {TC_HANDLE} htb",
    f"class add dev lo parent {TC_HANDLE} classid {TC_CLASS} htb rate 1mbit",
    f"qdisc add dev lo parent {TC_CLASS} pfifo limit 0",
)


def _tc_filter(port: int, field: str) -> str:
    """The ``tc`` command sending TCP packets whose ``field`` (dport, sport) is ``port`` to
    the dropping class (preference: the port, so one ``filter del`` removes both)."""
    return (
        f"filter add dev lo parent {TC_HANDLE} protocol ip pref {port} u32"
        f" match ip protocol 6 0xff match ip {field} {port} 0xffff flowid {TC_CLASS}"
    )


#: the tc way, end to end, on a scratch network namespace's ``lo`` (the machine's is untouched)
_TC_PROBE = " && ".join(f"tc {c}" for c in (*_TC_SETUP, _tc_filter(1, "dport")))


def _tc_problem() -> str | None:
    if os.geteuid() != 0:
        return "tc needs root"
    for tool in ("tc", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    out = _run("unshare", "--net", "sh", "-c", _TC_PROBE)
    if out.returncode != 0:
        return f"tc (htb, pfifo, u32) on a scratch lo failed: {out.stderr.strip()[:200]}"
    return None


def method() -> tuple[str | None, str]:
    """The way that works here (``"iptables"``, ``"tc"``), or None and why neither does."""
    why: list[str] = []
    for name, problem in (("iptables", _iptables_problem), ("tc", _tc_problem)):
        said = problem()
        if said is None:
            return name, ""
        why.append(said)
    return None, "; ".join(why)


def available() -> str | None:
    """None when a port can be black-holed here; else why not."""
    name, why = method()
    return None if name is not None else why


class _Iptables:
    def __init__(self, chain: str | None = None) -> None:
        self.chain = chain or f"RSSOAK{os.getpid()}"
        self._made = chain is not None  # a warden's: its owner made it

    def block(self, port: int) -> None:
        if not self._made:
            _checked(_iptables("-N", self.chain))
            _checked(_iptables("-I", "INPUT", "-j", self.chain))
            self._made = True
        for flag in ("--dport", "--sport"):
            _checked(_iptables("-A", self.chain, "-p", "tcp", flag, str(port), "-j", "DROP"))

    def unblock(self, port: int) -> None:
        for flag in ("--dport", "--sport"):
            _iptables("-D", self.chain, "-p", "tcp", flag, str(port), "-j", "DROP")

    def close(self) -> None:
        if self._made:
            _iptables("-D", "INPUT", "-j", self.chain)
            _iptables("-F", self.chain)
            _iptables("-X", self.chain)
            self._made = False


@contextlib.contextmanager
def _tc_lock() -> Iterator[None]:
    path = TC_LOCK if os.path.isdir(os.path.dirname(TC_LOCK)) else "/tmp/rollsafe-blackhole.lock"
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class _Tc:
    def block(self, port: int) -> None:
        with _tc_lock():
            root = _tc("qdisc show dev lo root")
            _checked(root)
            line = root.stdout.strip()
            if not line.startswith(f"qdisc htb {TC_HANDLE}"):
                if line and not line.startswith("qdisc noqueue"):
                    raise OSError(
                        f"lo has a root qdisc that is not the black hole's ({line!r}); "
                        "not replacing it"
                    )
                for made in _TC_SETUP:
                    _checked(_tc(made))
            for field in ("dport", "sport"):
                _checked(_tc(_tc_filter(port, field)))

    def unblock(self, port: int) -> None:
        with _tc_lock():
            _tc(f"filter del dev lo parent {TC_HANDLE} pref {port}")
            left = _tc(f"filter show dev lo parent {TC_HANDLE}")
            if left.returncode == 0 and not left.stdout.strip():
                _tc(f"qdisc del dev lo root handle {TC_HANDLE}")

    def close(self) -> None:
        """Nothing of the tc way outlives its ports (see :meth:`unblock`)."""


class Blackhole:
    """Drop every packet to or from the ports :meth:`block`\\ ed, until :meth:`unblock`.

    ``how``: ``"iptables"`` or ``"tc"``; None takes the first that works here (``OSError``
    naming why when none does). :meth:`close` (also run at interpreter exit) unblocks all.
    What a process killed outright left blocked, its warden lifts (:func:`_warden`).
    """

    def __init__(self, how: str | None = None) -> None:
        if how is None:
            how, why = method()
            if how is None:
                raise OSError(f"no way to black-hole a port here: {why}")
        if how not in ("iptables", "tc"):
            raise ValueError(f"how={how!r}: 'iptables' or 'tc'")
        self.how = how
        self._way: _Iptables | _Tc = _Iptables() if how == "iptables" else _Tc()
        self._lock = threading.Lock()
        #: blocked port -> its hold (a token: an owner's watch ends with the hold it watched)
        self._ports: dict[int, object] = {}
        #: the threads watching owners (:meth:`_lift_with`); :meth:`close` waits for them
        self._watches: list[threading.Thread] = []
        self._warden: subprocess.Popen[str] | None = None
        atexit.register(self.close)

    def _tell(self, line: str) -> None:
        if self._warden is None:
            chain = self._way.chain if isinstance(self._way, _Iptables) else "-"
            self._warden = subprocess.Popen(
                [sys.executable, __file__, "--warden", self.how, chain],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                text=True,
                start_new_session=True,  # a kill of this process group misses it
            )
        assert self._warden.stdin is not None
        self._warden.stdin.write(line + "\n")
        self._warden.stdin.flush()

    def block(
        self,
        port: int,
        owner: int | None = None,
        on_owner_exit: Callable[[str], None] | None = None,
    ) -> None:
        """Drop every packet of ``port`` until :meth:`unblock`; with ``owner`` (the pid of the
        process serving the port) only while that process runs: once it exits the hole is
        lifted and ``on_owner_exit`` hears why (:meth:`_lift_with`)."""
        info = process_info(owner) if owner is not None else None
        if owner is not None and (info is None or not same_process_alive(info)):
            raise ProcessLookupError(f"owner pid {owner} of port {port} is not running")
        hold = object()
        with self._lock:
            self._tell(f"+{port}")  # first: a kill right after the block is still lifted
            try:
                self._way.block(port)
            except OSError:
                self._way.unblock(port)  # nothing half-made stays
                self._tell(f"-{port}")
                raise
            self._ports[port] = hold
        if info is not None:
            watch = threading.Thread(
                target=self._lift_with,
                args=(port, hold, info, on_owner_exit),
                name=f"blackhole-{port}",
                daemon=True,
            )
            with self._lock:
                self._watches = [w for w in self._watches if w.is_alive()]
                self._watches.append(watch)
                watch.start()  # started before close() can see it

    def _lift_with(
        self,
        port: int,
        hold: object,
        owner: ProcessInfo,
        on_owner_exit: Callable[[str], None] | None,
    ) -> None:
        """Lift ``port``'s hole (this ``hold`` of it) once its owner exits: a freed port bound
        by another process (the fleet's re-spawned engine, anything) is a new host behind a
        working link, as on a real network, where the hole is the dead engine's switch port,
        not its number."""
        while True:
            time.sleep(OWNER_POLL_S)
            with self._lock:
                if self._ports.get(port) is not hold:
                    return  # lifted already (unblock, close), maybe blocked again since
                if same_process_alive(owner):
                    continue
                self._way.unblock(port)
                del self._ports[port]
                self._tell(f"-{port}")
            if on_owner_exit is not None:
                on_owner_exit(f"its owner (pid {owner.pid}) exited")
            return

    def unblock(self, port: int) -> bool:
        """Lift ``port``'s hole; False when it held none (never blocked, or lifted already)."""
        with self._lock:
            if port not in self._ports:
                return False
            self._way.unblock(port)
            del self._ports[port]
            self._tell(f"-{port}")
            return True

    @property
    def blocked(self) -> set[int]:
        with self._lock:
            return set(self._ports)

    def close(self) -> None:
        with self._lock:
            for port in sorted(self._ports):
                self._way.unblock(port)
            self._ports.clear()
            self._way.close()
            warden, self._warden = self._warden, None
            watches, self._watches = self._watches, []
            if warden is not None and warden.stdin is not None:
                with contextlib.suppress(OSError):
                    warden.stdin.write(".\n")  # all lifted: nothing for it to do
                    warden.stdin.close()
                warden.wait(timeout=60)
        for watch in watches:  # each ends at its next look: its hold is gone
            if watch is not threading.current_thread():
                watch.join()


def _warden(how: str, chain: str) -> None:
    """A black hole's warden, a process of its own session: its owner tells it each port it
    blocks (``+PORT``) and lifts (``-PORT``) on its stdin, and ``.`` once it closed. When the
    pipe ends without ``.`` (the owner was killed: the kernel closed its end), the warden lifts
    what is still blocked (and the owner's iptables chain), so a killed soak leaves no port of
    the machine black-holed."""
    ports: set[int] = set()
    for line in sys.stdin:
        line = line.strip()
        if line == ".":
            return
        if line[:1] in ("+", "-") and line[1:].isdigit():
            (ports.add if line[0] == "+" else ports.discard)(int(line[1:]))
    way: _Iptables | _Tc = _Iptables(chain) if how == "iptables" else _Tc()
    for port in sorted(ports):
        way.unblock(port)
    way.close()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--warden":
        _warden(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: blackhole.py --warden iptables|tc CHAIN (run by Blackhole)")

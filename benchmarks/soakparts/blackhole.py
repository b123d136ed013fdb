"""An engine's port black-holed: every TCP packet to or from it dropped, for real (iptables).

:class:`Blackhole` owns one iptables chain of this process (``RSSOAK<pid>``), jumped to from
``INPUT`` (loopback traffic, which is all of a one-machine cluster's, passes ``INPUT``): a
blocked port gets two ``DROP`` rules there (``--dport`` and ``--sport``), so new connections
hang in ``SYN_SENT`` and established ones (the fleet's pooled connections, a stream in flight)
stop moving, as behind a dead switch port. Nothing else on the machine is touched: only the
ports this process blocked, and :meth:`close` removes the chain (also at interpreter exit).

:func:`available` says whether iptables works here (root, the ``nf_tables`` or legacy
backend); when it does not, the soak lists ``port_blackhole`` as not injectable with why.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import threading

__all__ = ["Blackhole", "available"]


def _iptables(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["iptables", "-w", "5", *args], capture_output=True, text=True, timeout=30, check=False
    )


def available() -> str | None:
    """None when iptables can add and remove a chain here; else why not."""
    if shutil.which("iptables") is None:
        return "iptables is not installed"
    probe = f"RSSOAKP{os.getpid()}"
    made = _iptables("-N", probe)
    if made.returncode != 0:
        return f"iptables -N failed: {made.stderr.strip()[:200]}"
    _iptables("-X", probe)
    return None


class Blackhole:
    """Drop every packet to or from the ports :meth:`block`\\ ed, until :meth:`unblock`."""

    def __init__(self) -> None:
        self.chain = f"RSSOAK{os.getpid()}"
        self._lock = threading.Lock()
        self._ports: set[int] = set()
        self._made = False
        atexit.register(self.close)

    def _ensure(self) -> None:
        if self._made:
            return
        for args in (("-N", self.chain), ("-I", "INPUT", "-j", self.chain)):
            out = _iptables(*args)
            if out.returncode != 0:
                raise OSError(f"iptables {' '.join(args)}: {out.stderr.strip()[:200]}")
        self._made = True

    def block(self, port: int) -> None:
        with self._lock:
            self._ensure()
            for flag in ("--dport", "--sport"):
                out = _iptables("-A", self.chain, "-p", "tcp", flag, str(port), "-j", "DROP")
                if out.returncode != 0:
                    raise OSError(f"iptables -A {flag} {port}: {out.stderr.strip()[:200]}")
            self._ports.add(port)

    def unblock(self, port: int) -> None:
        with self._lock:
            if port not in self._ports:
                return
            for flag in ("--dport", "--sport"):
                _iptables("-D", self.chain, "-p", "tcp", flag, str(port), "-j", "DROP")
            self._ports.discard(port)

    @property
    def blocked(self) -> set[int]:
        with self._lock:
            return set(self._ports)

    def close(self) -> None:
        with self._lock:
            if not self._made:
                return
            _iptables("-D", "INPUT", "-j", self.chain)
            _iptables("-F", self.chain)
            _iptables("-X", self.chain)
            self._made = False
            self._ports.clear()

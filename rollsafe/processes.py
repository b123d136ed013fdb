"""Whether a process is alive: one reading of ``/proc``, shared by the engine launcher and the
export retention (which keeps a directory while the process that leased it lives).

Standard library only (layer 1 of docs/architecture.md)."""

from __future__ import annotations

import os

__all__ = ["pid_alive"]


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

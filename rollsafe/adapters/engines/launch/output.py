"""An engine's output: both pipes drained into a log file and a bounded tail, the secrets masked.

Owns :class:`OutputPump` (reader threads on stdout and stderr, so a chatty engine never blocks
on a full pipe; it spots the ``ROLLSAFE_READY`` line and a warm standby's ``ROLLSAFE_STANDBY``
line), :class:`EngineLogs` (one log file per process in the launcher's log directory, the
command line on its first line) and :func:`redact` (the API key replaced by ``***``).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING, Any

from rollsafe.wire.lines import READY_PREFIX, STANDBY_PREFIX

if TYPE_CHECKING:
    from rollsafe.adapters.engines.launch.fork_server import Proc

__all__ = ["EngineLogs", "OutputPump", "redact"]

log = logging.getLogger("rollsafe.adapters.engines.launcher")  # one logger for the launcher

TAIL_LINES = 200
REDACTED = "***"


class EngineLogs:
    """A launcher's log directory: a new file per engine or standby process it starts (and the
    SGLang API-key file), named by kind, pid, a process-wide counter and ``starts``.

    A directory the launcher made itself (``owned``: ``EngineSpec.log_dir`` unset) is removed
    by :meth:`close` at the launcher's last stop, unless something in it explains a failure
    (:meth:`keep`: an engine that exited before it was asked to, a start that failed): then it
    stays and its path is logged. A directory the user named is never removed."""

    _counter = itertools.count()

    def __init__(self, log_dir: str | None, *, owned: bool = False) -> None:
        """``log_dir`` None: an owned directory (``rollsafe-engine-*`` in the temporary
        directory) made with the first file, so a launcher that never starts leaves none."""
        self.dir = log_dir
        self.owned = owned
        self.starts = 0  # the launcher's start count, part of each file name
        #: why the directory outlives the launcher (the first reason given), None: it does not
        self.kept: str | None = None

    def path(self, kind: str, suffix: str) -> str:
        """A fresh path in the directory: ``KIND-PID-N-STARTS.SUFFIX`` (the directory made
        when missing: a named one not made yet, an owned one after a :meth:`close`)."""
        if self.dir is None:
            self.dir = tempfile.mkdtemp(prefix="rollsafe-engine-")
        else:
            os.makedirs(self.dir, exist_ok=True)
        name = f"{kind}-{os.getpid()}-{next(self._counter)}-{self.starts}.{suffix}"
        return os.path.join(self.dir, name)

    def keep(self, reason: str) -> None:
        """Keep the directory past :meth:`close`: it holds the log of a failure (``reason``)."""
        if self.kept is None:
            self.kept = reason
            log.info("engine logs in %s are kept: %s", self.dir, reason)

    def close(self) -> bool:
        """The launcher's last stop: remove an owned directory that explains no failure (an
        empty one always). Returns whether it was removed."""
        if not self.owned or self.dir is None or not os.path.isdir(self.dir):
            return False
        with contextlib.suppress(OSError):
            if self.kept is not None and os.listdir(self.dir):
                return False
            shutil.rmtree(self.dir)
            return True
        return False

    def new(self, kind: str, cmd: list[str], secrets: Sequence[str]) -> str:
        """A new log file for a ``kind`` process running ``cmd`` (written on its first line,
        ``secrets`` masked); returns its path."""
        log_path = self.path(kind, "log")
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(f"# {redact(' '.join(cmd), secrets)}\n")
        return log_path


def redact(text: str, secrets: Sequence[str]) -> str:
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    return text


def parse_line(line: str, prefix: str, required: str) -> dict[str, Any]:
    info = json.loads(line[len(prefix) :])
    if not isinstance(info, dict) or required not in info:
        raise ValueError(f"{prefix.strip()} line lacks {required!r}")
    return info


class OutputPump:
    """Drains a child's stdout and stderr into a log file and a bounded tail, spotting READY
    (and a warm standby's STANDBY line)."""

    def __init__(self, proc: Proc, log_path: str, secrets: Sequence[str] = ()) -> None:
        self.log_path = log_path
        self._secrets = [s for s in secrets if s]  # replaced by *** in the log and the tail
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.ready: dict[str, Any] | None = None
        self.ready_error: str | None = None
        self.ready_event = threading.Event()
        self.standby: dict[str, Any] | None = None
        self.standby_event = threading.Event()
        self._lock = threading.Lock()
        self._log: IO[str] = open(log_path, "a", encoding="utf-8", errors="replace")  # noqa: SIM115
        self._threads = [
            threading.Thread(
                target=self._pump,
                args=(stream, name),
                daemon=True,
                name=f"rollsafe-engine-{name}-{proc.pid}",
            )
            for stream, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))
            if stream is not None
        ]
        for t in self._threads:
            t.start()

    def _pump(self, stream: IO[bytes], name: str) -> None:
        try:
            for raw in iter(stream.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                if self._secrets:
                    line = redact(line, self._secrets)
                if name == "stdout" and line.startswith(READY_PREFIX) and self.ready is None:
                    try:
                        self.ready = parse_line(line, READY_PREFIX, "url")
                    except ValueError as exc:
                        self.ready_error = f"unparsable ready line {line[:500]!r}: {exc}"
                    self.ready_event.set()
                elif name == "stdout" and line.startswith(STANDBY_PREFIX) and self.standby is None:
                    with contextlib.suppress(ValueError):
                        self.standby = parse_line(line, STANDBY_PREFIX, "pid")
                    self.standby_event.set()
                with self._lock:
                    self.tail.append(f"[{name}] {line}"[:2000])
                    if not self._log.closed:
                        self._log.write(f"[{name}] {line}\n")
                        self._log.flush()
        except (OSError, ValueError):
            pass
        finally:
            with contextlib.suppress(OSError):
                stream.close()

    def text(self) -> str:
        with self._lock:
            return "\n".join(self.tail)

    def note(self, text: str) -> None:
        """Write a ``# ...`` line of the launcher's own into the log."""
        with self._lock:
            if not self._log.closed:
                self._log.write(f"# {text}\n")
                self._log.flush()

    def wait_eof(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for both pipes to reach EOF (the last lines are in)."""
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def close(self, timeout: float = 2.0) -> None:
        for t in self._threads:
            t.join(timeout)
        with self._lock:
            self._log.close()

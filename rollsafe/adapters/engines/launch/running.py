"""The engine group a launcher runs right now, and how it is stopped and forgotten.

Owns :class:`RunningEngine`: the installed engine's process, output pump, parent-death
watchdog and finalizer (which kills the group when the launcher is garbage-collected or the
interpreter exits), its ready info and client, a real SGLang engine's API-key file and a real
vLLM's ipc-socket directory.
:meth:`RunningEngine.stop` kills the group (its ranks and a real engine's workers included),
deletes what a killed vLLM leaves on disk and forgets all of it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import weakref
from typing import Any

from rollsafe.adapters.engines.launch import real_engine
from rollsafe.adapters.engines.launch.fork_server import Proc
from rollsafe.adapters.engines.launch.output import OutputPump
from rollsafe.adapters.engines.launch.process_group import (
    Candidate,
    kill_group,
    reap,
    remove_dirs,
    stop_watchdog,
)
from rollsafe.adapters.engines.launch.spec import EngineSpec
from rollsafe.adapters.engines.sglang import SGLangClient
from rollsafe.adapters.engines.vllm import VLLMClient
from rollsafe.adapters.engines.vllm_cpu import remove_files
from rollsafe.processes import pid_alive

__all__ = ["RunningEngine"]


class RunningEngine:
    """The engine a launcher runs (``proc`` None between a stop and the next start). Only its
    launcher holds it: the finalizers hang on it."""

    def __init__(self) -> None:
        self.proc: Proc | None = None
        self.pump: OutputPump | None = None
        self.watchdog: subprocess.Popen[bytes] | None = None
        self.finalizer: weakref.finalize[Any, RunningEngine] | None = None
        self.info: dict[str, Any] = {}  # the ready line's payload, or what polling learnt
        self.client: SGLangClient | VLLMClient | None = None
        self.api_key_file: str | None = None  # a real SGLang engine's --config file
        self.dirs: tuple[str, ...] = ()  # deleted once the group is gone (a vLLM's ipc sockets)
        self.held: list[str] = []  # what a real vLLM held when it became ready (note_held)
        self._rank_pids: list[int] = []

    def install(self, cand: Candidate) -> None:
        """Make ``cand`` the engine (its finalizer becomes this one's, the key file and its
        directories included)."""
        cand.finalizer.detach()
        self.proc, self.pump, self.watchdog = cand.proc, cand.pump, cand.watchdog
        self.dirs = cand.dirs
        self.held = []
        self._rank_pids = []
        self._finalize()

    def watch_ranks(self, rank_pids: list[int]) -> None:
        """The engine told its rank pids: its finalizer kills them too."""
        self._rank_pids = list(rank_pids)
        self._finalize()

    def note_held(self, spec: EngineSpec) -> None:
        """A real vLLM just became ready: remember the files its group holds now (its
        ``/dev/shm`` queues and semaphores), deleted when it is stopped or finalized even if
        the whole group died first (a SIGKILLed server's engine core and workers exit after
        it) and nothing names them any more."""
        if spec.kind != "vllm":
            return
        self.held = real_engine.leftovers(spec, self.require_proc().pid, self._rank_pids)[1]
        self._finalize()

    def _finalize(self) -> None:
        """(Re)arm the finalizer: it kills the group and its known ranks, then deletes the key
        file, the files noted at ready and the group's directories."""
        if self.finalizer is not None:
            self.finalizer.detach()
        files = [self.api_key_file] if self.api_key_file else []
        self.finalizer = weakref.finalize(
            self,
            reap,
            self.require_proc(),
            self._rank_pids,
            self.watchdog,
            [*files, *self.held],
            self.dirs,
        )

    def require_proc(self) -> Proc:
        if self.proc is None:
            raise RuntimeError("engine is not running: call start() first")
        return self.proc

    def require_info(self) -> dict[str, Any]:
        if not self.info:
            raise RuntimeError("engine is not running: call start() first")
        return self.info

    def stop(self, spec: EngineSpec, *, sig_first: int, timeout: float) -> str | None:
        """Stop the engine (see :func:`kill_group`) and forget it: its client, watchdog,
        finalizer, output pump, what a killed vLLM leaves on disk, the key file. Returns why
        the engine had already ended, when it had (its server exited, or a rank): its log then
        explains a failure; None when it was running."""
        proc = self.proc
        if proc is None:
            self.remove_files()
            return None
        rank_pids = [int(p) for p in self.info.get("rank_pids", [])]
        ended: str | None = None
        code = proc.poll()
        if code is not None:
            ended = f"engine pid {proc.pid} exited with code {code} before it was stopped"
        else:
            dead = [p for p in rank_pids if not pid_alive(p)]
            if dead:
                ended = f"rank pid(s) {dead} of engine pid {proc.pid} ended before it was stopped"
        held: list[str] = []
        if spec.real:  # also when the server died first: its workers hold the files
            rank_pids, held = real_engine.leftovers(spec, proc.pid, rank_pids)
        if self.client is not None:
            self.client.close()
        kill_group(proc, rank_pids, sig_first=sig_first, timeout=timeout)
        remove_files(sorted({*held, *self.held}))
        remove_dirs(self.dirs)
        self.dirs, self.held, self._rank_pids = (), [], []
        stop_watchdog(self.watchdog)
        self.watchdog = None
        if self.finalizer is not None:
            self.finalizer.detach()
            self.finalizer = None
        if self.pump is not None:
            self.pump.close(timeout=2.0)
        self.proc = None
        self.client = None
        self.info = {}
        self.remove_files()
        return ended

    def remove_files(self) -> None:
        """Delete the API-key file (SGLang read it at its start)."""
        path, self.api_key_file = self.api_key_file, None
        if path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)

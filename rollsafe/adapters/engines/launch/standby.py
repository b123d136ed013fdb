"""The warm-standby pool: resident fork servers that make a restart a fork, not a fresh import.

Warm standby (``EngineSpec.warm_standby``): importing torch and transformers is most of an
engine's start, so the launcher keeps a resident engine process that already did it, a fork
server or "zygote" (``python -m MODULE --standby --fork-server-fd FD``; it prints
``ROLLSAFE_STANDBY {json}``, then serves fork requests on an ``AF_UNIX`` socket pair only the
launcher holds, see ``rollsafe.adapters.reference_engine.zygote``). ``start()`` (and so
``restart()`` / ``reinit()``) asks it to fork the engine with the engine arguments instead of
spawning a fresh interpreter; the child detaches into its own session, writes to pipes the
launcher passed with the request (its own log, ``# forked by the warm standby`` noted) and then
starts exactly like a fresh spawn: ready line, health check, parent-death watchdog, finalizer.
The zygote reaps the child and reports its exit status; the launcher signals it by pid and
process group as any engine. A fork does not consume the zygote: it stays ``ready`` for the
next start, so back-to-back crashes all fork in milliseconds.

Table: which start source (:attr:`EngineLauncher.last_start_source`) and what is counted in
:attr:`EngineLauncher.standby_stats`.

===============================================  ===================  =======================
zygote when the start begins                      source               counted
===============================================  ===================  =======================
ready (imports done)                              ``ready_standby``    ``used_ready``
warming (imports running), its fork ready first   ``warming_standby``  ``used_warming``
warming, a fresh spawn ready first                ``fresh_spawn``      ``raced``, ``fallbacks``
dead, other interpreter / module / environment,   ``fresh_spawn``      ``fallbacks`` (replaced)
cores, refused or did not answer the fork request
none wanted (``warm_standby=False``)              ``fresh_spawn``      nothing
===============================================  ===================  =======================

A warming zygote gets the request (served once its imports are done) and is waited for alone at
most as long as a fresh spawn of this launcher took (:meth:`EngineLauncher.fresh_start_estimate`);
then a fresh engine is spawned next to it and whichever prints its ready line first is the
engine; the other engine is killed, the zygote is kept. After every successful start the
launcher tops the pool up on a background thread (``EngineSpec.standbys`` zygotes, spawned one
import at a time, so it never competes with the start itself). Each zygote runs in its own
session with its own parent-death watchdog and finalizer: ``stop()``, ``kill()``, context exit,
garbage collection and interpreter exit kill it too; ``stop(keep_standby=True)`` (what recovery
uses before a restart) keeps it. The stdin hand-off of a plain ``--standby`` (the process
becomes the engine) stays available to other callers. Real engines have no standby mode
(``warm_standby=True`` with a real ``kind`` is refused by :class:`EngineSpec`).


This module owns the pool (:class:`StandbyPool`: which zygotes exist, which one a start takes,
the background thread that tops the pool up, the counters) and the vocabulary
(:data:`StandbyState`, :data:`StartSource`). Starting an engine from a zygote is
:mod:`rollsafe.adapters.engines.launch.standby_start`; the socket protocol's client side is
:mod:`rollsafe.adapters.engines.launch.fork_server`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from rollsafe.adapters.engines.errors import EngineError
from rollsafe.adapters.engines.launch.fork_server import ZygoteLink
from rollsafe.adapters.engines.launch.output import EngineLogs, OutputPump
from rollsafe.adapters.engines.launch.process_group import (
    reap,
    signal_group,
    spawn_group,
    start_watchdog,
    stop_watchdog,
)
from rollsafe.adapters.engines.launch.spec import FORK_SERVER_FLAG, EngineSpec
from rollsafe.ports import StandbyState, StartSource

__all__ = [
    "STANDBY_STATES",
    "START_SOURCES",
    "Standby",
    "StandbyPool",
]

log = logging.getLogger("rollsafe.adapters.engines.launcher")  # one logger for the launcher

#: every value of :data:`~rollsafe.ports.StandbyState` / :data:`~rollsafe.ports.StartSource` (the
#: types live in rollsafe.ports, the port recovery reads them through)
STANDBY_STATES: tuple[StandbyState, ...] = ("none", "warming", "ready")
START_SOURCES: tuple[StartSource, ...] = ("ready_standby", "warming_standby", "fresh_spawn")


@dataclass
class Standby:
    """One warm standby: a resident zygote that forks engines (it is never consumed), and what
    it was started with."""

    proc: subprocess.Popen[bytes]
    pump: OutputPump
    watchdog: subprocess.Popen[bytes] | None
    finalizer: weakref.finalize[Any, Any]
    interpreter: str
    module: str
    env: dict[str, str]
    cpu_cores: tuple[int, ...]  # the zygote's binding, inherited by every engine it forks
    link: ZygoteLink
    spawned_at: float = dataclasses.field(default_factory=time.monotonic)
    forks: int = 0

    def alive(self) -> bool:
        return self.proc.poll() is None and not self.link.closed

    def announced(self) -> bool:
        return self.pump.standby is not None

    def discard(self) -> None:
        """Release and SIGKILL it (it is idle: nothing to shut down) and reap it. The engines it
        forked live on: each has its own session."""
        self.finalizer.detach()
        self.link.close()
        signal_group(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5.0)
        stop_watchdog(self.watchdog)
        self.pump.close(timeout=1.0)


class StandbyLost(EngineError):
    """The engine a warm standby started died (killed) before its ready line: not the engine's
    fault; the launcher starts it afresh (raised and caught inside a start)."""


class StandbyPool:
    """The warm standbys (zygotes) of one launcher, oldest first, and what they did.

    Shares the launcher's lock and log directory; ``spec`` is the launcher's current spec (the
    launcher sets it on a restart). ``wanted`` is set by a successful start and cleared by
    ``stop()`` / ``kill()``: while it is set, :meth:`schedule` keeps ``spec.standbys`` zygotes.
    The views (:meth:`next`, :meth:`state`, :meth:`status`, ...) take no lock: health checks and
    metrics read them while a restart holds the launcher. Each zygote's finalizer hangs on the
    pool, which only its launcher holds: garbage-collecting the launcher kills them.
    """

    def __init__(self, spec: EngineSpec, lock: threading.RLock, logs: EngineLogs) -> None:
        self.spec = spec
        self.base_model_path = spec.model_path  # the first model directory (stays put)
        self.standbys: list[Standby] = []
        self.wanted = False
        self.thread: threading.Thread | None = None
        counters = ("spawned", "used", "used_ready", "used_warming", "raced", "fallbacks")
        self.stats: dict[str, int] = dict.fromkeys(counters, 0)
        self.last_fallback: str | None = None
        self._lock = lock
        self._logs = logs

    # ------------------------------------------------------------------ views (lock-free)
    def next(self) -> Standby | None:
        """The standby the next start would take: the oldest ready one, else the oldest
        one still importing."""
        alive = [sb for sb in list(self.standbys) if sb.alive()]
        return next((sb for sb in alive if sb.announced()), alive[0] if alive else None)

    def pids(self) -> list[int]:
        """The pids of every standby alive."""
        return [sb.proc.pid for sb in list(self.standbys) if sb.alive()]

    def ready(self) -> bool:
        """True while a standby is alive and has finished its imports."""
        sb = self.next()
        return sb is not None and sb.announced()

    def state(self) -> StandbyState:
        """``ready``: a standby is alive and imported; ``warming``: one is being spawned or
        still importing (a start now waits for it, at most what a fresh spawn costs before
        racing it against one); ``none`` otherwise."""
        sb = self.next()
        if sb is not None:
            return "ready" if sb.announced() else "warming"
        if self.wanted and self.spec.warm_standby and not self.spec.real:
            t = self.thread
            if t is not None and t.is_alive():
                return "warming"  # the spawner thread is about to spawn it
        return "none"

    def counters(self) -> dict[str, Any]:
        """Standbys (fork servers) ``spawned``; starts forked from one (``used``;
        ``used_ready`` / ``used_warming``: it was ready, or still importing and ready first);
        ``raced``: starts that spawned a fresh engine next to a warming standby (it took longer
        than a fresh spawn would); ``fallbacks``: starts that expected a standby and ended on a
        fresh spawn (none spawned yet, dead, changed environment, refused fork, lost race);
        ``last_fallback`` (the reason, or None)."""
        return {**self.stats, "last_fallback": self.last_fallback}

    def status(self) -> dict[str, Any]:
        """``enabled``, ``state``, ``pool`` (``EngineSpec.standbys``), ``ready`` / ``warming``
        (how many standbys are in each state), and of the one the next start takes ``pid``,
        ``age_s`` (since its spawn) and ``import_s`` (once ready); then the :meth:`counters`.
        The fleet's snapshot, metrics and the demo read it."""
        sb = self.next()
        alive = [s for s in list(self.standbys) if s.alive()]
        announced = sb.pump.standby if sb is not None else None
        ready = sum(1 for s in alive if s.announced())
        return {
            "enabled": bool(self.spec.warm_standby),
            "state": self.state(),
            "pool": self.spec.standbys if self.spec.warm_standby else 0,
            "ready": ready,
            "warming": len(alive) - ready,
            "pid": sb.proc.pid if sb is not None else None,
            "age_s": round(time.monotonic() - sb.spawned_at, 3) if sb is not None else None,
            "import_s": announced.get("import_s") if announced else None,
            **self.counters(),
        }

    def wait_ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a standby to finish its imports; return whether."""
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() >= deadline or not self.wanted:
                return False  # past the deadline, or no standby will come (not started)
            sb = self.next()
            if sb is None:
                t = self.thread
                if self.standbys and (t is None or not t.is_alive()):
                    return False  # the standby died and none is being spawned
                time.sleep(0.02)
            else:
                sb.pump.standby_event.wait(min(0.1, max(0.0, deadline - time.monotonic())))
        return True

    # ------------------------------------------------------------------ a start's side
    def fallback(self, reason: str) -> None:
        """Count a start that expected a standby and ends on a fresh spawn."""
        self.stats["fallbacks"] += 1
        self.last_fallback = reason
        log.info("engine start without its warm standby (fresh spawn): %s", reason)

    def count_use(self, source: StartSource) -> None:
        """Count a start forked from a standby (``source`` is not ``fresh_spawn``)."""
        self.stats["used"] += 1
        self.stats["used_ready" if source == "ready_standby" else "used_warming"] += 1

    def take(self, spec: EngineSpec) -> Standby | None:
        """The zygote that takes this start (the oldest ready one, else the oldest still
        importing); it stays in the pool (a fork does not consume it). Unusable ones are
        discarded. None (counted as a fallback when a standby was expected) if none can."""
        pool = list(self.standbys)
        if not pool:
            if spec.warm_standby and self.wanted:
                self.fallback("no standby was spawned yet")
            return None
        usable: list[Standby] = []
        reason = None
        env = spec.environment()
        for sb in pool:
            why = _unusable(sb, spec, env)
            if why is None:
                usable.append(sb)
            else:
                reason = why
                self.drop(sb)
        chosen = next((sb for sb in usable if sb.announced()), usable[0] if usable else None)
        if chosen is None and spec.warm_standby:
            self.fallback(reason or "no standby alive")
        return chosen

    def drop(self, sb: Standby) -> None:
        """Remove ``sb`` from the pool and discard it (the spawner replaces it)."""
        with contextlib.suppress(ValueError):
            self.standbys.remove(sb)
        sb.discard()

    def discard_all(self) -> None:
        """Discard every standby (a stop or kill that does not keep them)."""
        pool, self.standbys = self.standbys, []
        for sb in pool:
            sb.discard()

    # ------------------------------------------------------------------ topping the pool up
    def schedule(self) -> None:
        """Start the spawner thread unless it runs (it works once the caller released the
        lock)."""
        t = self.thread
        if t is not None and t.is_alive():
            return
        t = threading.Thread(
            target=_spawner,
            args=(weakref.ref(self),),
            daemon=True,
            name="rollsafe-engine-standby-spawner",
        )
        self.thread = t
        t.start()

    def ensure(self) -> Standby | None:
        """On the spawner thread: spawn a standby unless the pool is full, one is still
        importing, or none is wanted. Returns a standby still importing when the pool wants
        another one after it (the thread waits for it, then calls again); None when done (the
        thread ends: decided under the lock, so a start scheduling a spawn starts a new one)."""
        with self._lock:
            spec = self.spec
            wanted = spec.standbys if self.wanted and spec.warm_standby else 0
            for dead in [sb for sb in self.standbys if not sb.alive()]:
                self.standbys.remove(dead)
                dead.discard()
            warming = next((sb for sb in self.standbys if not sb.announced()), None)
            if len(self.standbys) < wanted and warming is not None:
                return warming
            sb = None
            if len(self.standbys) < wanted and warming is None:
                sb = self._spawn(spec)
            if sb is not None:
                self.standbys.append(sb)
                self.stats["spawned"] += 1
                if len(self.standbys) < wanted:
                    return sb
            # done: the thread ends (decided under the lock)
            if threading.current_thread() is self.thread:
                self.thread = None
            return None

    def _spawn(self, spec: EngineSpec) -> Standby | None:
        """Spawn one zygote for ``spec`` (None, logged, if its command cannot run)."""
        # The model directory whose classes the standby imports ahead: the launcher's first
        # one, which stays put; the current one may be a recovery export that is deleted
        # while the standby imports (it would then import those classes only at the fork,
        # a second or more on CPU).
        base = self.base_model_path
        if base != spec.model_path and os.path.isdir(base):
            cmd = dataclasses.replace(spec, model_path=base).standby_command()
        else:
            cmd = spec.standby_command()
        env = spec.environment()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cmd += [FORK_SERVER_FLAG, str(theirs.fileno())]
        log_path = self._logs.new("standby", cmd, spec.secrets())
        try:
            # bound like the engine: the engines it forks inherit its cores
            proc = spawn_group(
                cmd,
                env,
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                cpu_cores=spec.cpu_cores,
            )
        except OSError as exc:
            ours.close()
            log.warning("cannot spawn a warm standby (%s): %s", " ".join(cmd), exc)
            return None
        finally:
            theirs.close()  # the zygote's end lives in the zygote only
        watchdog = (
            start_watchdog(spec.interpreter(), proc.pid) if spec.reap_on_parent_death else None
        )
        return Standby(
            proc=proc,
            pump=OutputPump(proc, log_path, spec.secrets()),
            watchdog=watchdog,
            finalizer=weakref.finalize(self, reap, proc, [], watchdog),
            interpreter=spec.interpreter(),
            module=spec.module,
            env=env,
            cpu_cores=tuple(spec.cpu_cores or ()),
            link=ZygoteLink(ours, proc.pid),
        )


def _unusable(sb: Standby, spec: EngineSpec, env: dict[str, str]) -> str | None:
    """Why ``sb`` cannot fork ``spec``'s engine (environment ``env``), or None if it can."""
    if not spec.warm_standby:
        return "warm_standby is off"
    if not sb.alive():
        code = sb.proc.poll()
        if code is not None:
            return f"the standby (pid {sb.proc.pid}) exited with code {code}"
        return f"the standby (pid {sb.proc.pid}) closed its control socket"
    if sb.interpreter != spec.interpreter() or sb.module != spec.module:
        return "the interpreter or module changed since the standby was spawned"
    if sb.env != env:
        changed = sorted(k for k in set(sb.env) | set(env) if sb.env.get(k) != env.get(k))
        return f"the environment changed since the standby was spawned: {changed[:10]}"
    if sb.cpu_cores != tuple(spec.cpu_cores or ()):
        return f"cpu_cores changed since the standby was spawned (it runs on {sb.cpu_cores})"
    return None


def _spawner(ref: weakref.ReferenceType[StandbyPool]) -> None:
    """Background thread body: fill the pool, one import at a time (weakly held between
    spawns: garbage collection still works)."""
    while True:
        pool = ref()
        if pool is None:
            return
        try:
            warming = pool.ensure()
        except Exception:  # never let a background spawn kill the thread noisily
            log.exception("spawning a warm standby failed")
            return
        del pool
        if warming is None:
            return
        # the pool wants another one: spawn it once this one is imported (or gone), so that two
        # imports never compete for the CPU
        while warming.alive() and not warming.announced():
            warming.pump.standby_event.wait(0.25)
            if ref() is None:
                return

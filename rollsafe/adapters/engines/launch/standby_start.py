"""Starting an engine from a warm standby: a fork of a ready zygote, or a race with a warming one.

Works on an :class:`~rollsafe.adapters.engines.launcher.EngineLauncher`'s behalf while it holds
its lock: :func:`start_forked` asks a ready zygote for the engine; :func:`race` starts while the
zygote still imports (it waits for that fork alone at most what a fresh spawn costs, then
spawns a fresh engine next to it and installs whichever prints its ready line first). Neither
waits for readiness itself: the launcher does that on the engine they installed. Every way a
zygote fails ends on a fresh spawn, counted as a fallback of the pool.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from rollsafe.adapters.engines.launch.fork_server import (
    FORK_TIMEOUT_S,
    ForkedProcess,
    PendingFork,
    Proc,
    _ZygoteError,
    request_fork,
)
from rollsafe.adapters.engines.launch.output import EngineLogs, OutputPump
from rollsafe.adapters.engines.launch.process_group import Candidate, watch_candidate
from rollsafe.adapters.engines.launch.readiness import StartAttempt
from rollsafe.adapters.engines.launch.spec import EngineSpec
from rollsafe.adapters.engines.launch.standby import Standby, StandbyPool
from rollsafe.ports import StartSource

__all__ = ["StartHost", "race", "start_forked"]

log = logging.getLogger("rollsafe.adapters.engines.launcher")  # one logger for the launcher


@dataclass(frozen=True)
class StartHost:
    """What a start from the standby needs of the launcher it works for. The launcher builds
    one per start (``EngineLauncher._host``); this module never reaches into the launcher."""

    owner: object  # whose garbage collection reaps an installed engine (watch_candidate)
    pool: StandbyPool
    logs: EngineLogs
    install: Callable[[Candidate], None]  # make a candidate the launcher's engine
    fresh_candidate: Callable[[EngineSpec, list[str]], Candidate]  # spawned, not installed
    attempt: Callable[[Proc, list[str]], StartAttempt]  # the installed engine's start
    fresh_start_estimate: Callable[[], float | None]  # what a fresh spawn costs (None: unknown)

    def launch_fresh(self, spec: EngineSpec, cmd: list[str]) -> None:
        """Spawn a fresh engine and install it."""
        self.install(self.fresh_candidate(spec, cmd))


def start_forked(launcher: StartHost, sb: Standby, spec: EngineSpec, cmd: list[str]) -> bool:
    """Fork the engine from the ready zygote ``sb`` and install it; False (zygote dropped,
    fallback counted) if it could not."""
    try:
        pending = request_fork(sb, spec)
        cand = _forked_candidate(launcher, pending, spec, cmd, FORK_TIMEOUT_S)
    except _ZygoteError as exc:
        launcher.pool.drop(sb)
        launcher.pool.fallback(f"the standby (pid {sb.proc.pid}) could not fork the engine: {exc}")
        return False
    launcher.install(cand)
    return True


def race(launcher: StartHost, sb: Standby, spec: EngineSpec, cmd: list[str]) -> StartSource:
    """A start while the zygote still imports: send it the fork request (served once its
    imports are done), wait for that engine alone at most
    ``host.fresh_start_estimate()`` seconds (what a fresh spawn would cost; no
    estimate: no wait), then also spawn a fresh engine; install whichever prints its ready line
    first, kill the other. The zygote stays either way (a fork it serves after losing is killed
    on arrival).

    The bounded wait keeps a zygote that is on its way from competing with a fresh import
    for the CPU (two imports on two cores take longer than one); the fresh spawn after it
    bounds what a stalled zygote costs. A contender that exits before its ready line drops
    out (e.g. the loser of a fixed port); when both did, the fresh one is installed so that
    the launcher's readiness wait reports its exit. Returns the installed engine's source.
    """
    return _Race(launcher, sb, spec, cmd).run()


def _forked_candidate(
    launcher: StartHost, pending: PendingFork, spec: EngineSpec, cmd: list[str], timeout: float
) -> Candidate:
    """The engine of an answered fork request (waiting up to ``timeout`` s for the answer);
    :class:`_ZygoteError` if the zygote did not fork it."""
    sb, ticket = pending.zygote, pending.ticket
    if not ticket.event.wait(timeout):
        pending.abandon()
        raise _ZygoteError(f"no answer to a fork request within {timeout:.1f}s")
    if ticket.error is not None or ticket.pid is None:
        pending.abandon()
        raise _ZygoteError(ticket.error or "no pid in the answer")
    pending.taken = True
    proc = ForkedProcess(
        ticket.pid, sb.link, os.fdopen(pending.out_r, "rb"), os.fdopen(pending.err_r, "rb")
    )
    log_path = launcher.logs.new("engine", cmd, spec.secrets())
    pump = OutputPump(proc, log_path, spec.secrets())
    sb.forks += 1
    pump.note(f"forked by the warm standby (zygote pid {sb.proc.pid}): pid {proc.pid}")
    return watch_candidate(launcher.owner, spec, proc, pump)


class _Race:
    """One race between a warming zygote's fork and a fresh spawn (see :func:`race`)."""

    def __init__(self, launcher: StartHost, sb: Standby, spec: EngineSpec, cmd: list[str]) -> None:
        self.launcher, self.pool = launcher, launcher.pool
        self.sb, self.spec, self.cmd = sb, spec, cmd
        self.forked: Candidate | None = None  # the zygote's engine, once forked
        self.running: dict[StartSource, Candidate | None] = {}  # the contenders still in
        self.zygote_failure: str | None = None  # why the zygote's contender dropped out

    def run(self) -> StartSource:
        try:
            self.pending = request_fork(self.sb, self.spec)
        except _ZygoteError as exc:
            self.pool.drop(self.sb)
            return self._fresh_instead(f"could not take the request: {exc}")
        bound = self.launcher.fresh_start_estimate()
        alone = self._zygote_alone(min(bound or 0.0, self.spec.ready_timeout))
        if alone is not None:
            return alone
        self._spawn_fresh_contender(bound)
        winner = self._first_ready()
        return self._install_winner(winner)

    def _fresh_instead(self, why: str) -> StartSource:
        """The zygote failed: count the fallback and install a fresh spawn."""
        self.pool.fallback(f"the standby (pid {self.sb.proc.pid}) {why}")
        self.launcher.launch_fresh(self.spec, self.cmd)
        return "fresh_spawn"

    def _zygote_turn(self) -> Candidate | str | None:
        """One look at the zygote's fork: its engine once forked, why it failed (the zygote is
        then dropped), or None while it still imports."""
        pending, sb = self.pending, self.sb
        if pending.ticket.event.is_set():
            try:
                return _forked_candidate(self.launcher, pending, self.spec, self.cmd, 0.0)
            except _ZygoteError as exc:
                self.pool.drop(sb)
                return f"could not fork the engine: {exc}"
        if not sb.alive():
            pending.abandon()
            self.pool.drop(sb)
            return f"exited with code {sb.proc.poll()} before it forked the engine"
        return None

    def _zygote_alone(self, seconds: float) -> StartSource | None:
        """Step 1: for ``seconds``, wait for the zygote's engine alone. Its source once it is
        installed (ready or exited: the readiness wait reports how it ended), ``fresh_spawn`` if
        the zygote failed, None when the time is up."""
        alone_until = time.monotonic() + seconds
        try:
            while time.monotonic() < alone_until:
                if self.forked is None:
                    turn = self._zygote_turn()
                    if isinstance(turn, str):
                        return self._fresh_instead(turn)
                    self.forked = turn
                forked = self.forked
                if forked is not None and (
                    forked.pump.ready_event.is_set() or forked.proc.poll() is not None
                ):
                    self.launcher.install(forked)
                    return "warming_standby"
                time.sleep(0.01)
        except BaseException:
            if self.forked is not None:
                self.forked.discard()
            self.pending.abandon()
            raise
        return None

    def _spawn_fresh_contender(self, bound: float | None) -> None:
        """Step 2: spawn a fresh engine next to the zygote's."""
        self.fresh = self.launcher.fresh_candidate(self.spec, self.cmd)
        self.pool.stats["raced"] += 1
        log.info(
            "engine start: the standby (pid %d) is still importing after %.1fs (what a fresh "
            "spawn takes); a fresh engine (pid %d) races it",
            self.sb.proc.pid,
            bound or 0.0,
            self.fresh.proc.pid,
        )
        self.running = {"warming_standby": self.forked, "fresh_spawn": self.fresh}

    def _first_ready(self) -> StartSource:
        """Step 3: the contender to install: the first to print its ready line; the last one
        in when the other exited; the fresh one when both exited; at the deadline, a fork
        still running alone, else the fresh one."""
        deadline = time.monotonic() + self.spec.ready_timeout
        try:
            while True:
                if "warming_standby" in self.running and self.running["warming_standby"] is None:
                    turn = self._zygote_turn()
                    if isinstance(turn, str):
                        self.zygote_failure = turn
                        del self.running["warming_standby"]
                    else:
                        self.running["warming_standby"] = turn
                winner = self._ready_or_last()
                if winner is None and not self.running:  # both dropped out: report the fresh one
                    winner = "fresh_spawn"
                if winner is not None:
                    return winner
                if time.monotonic() >= deadline:
                    # nobody ready: a fork still running is reported, else the fresh spawn
                    late = self.running.get("warming_standby")
                    alone = late is not None and "fresh_spawn" not in self.running
                    return "warming_standby" if alone else "fresh_spawn"
                time.sleep(0.01)
        except BaseException:
            for c in self.running.values():
                if c is not None:
                    c.discard()
            self.pending.abandon()
            raise

    def _ready_or_last(self) -> StartSource | None:
        """One look at the contenders: the first one ready, or one that exited and is the last
        in; a contender that exited before its ready line otherwise drops out."""
        for name, c in list(self.running.items()):
            if c is None:
                continue
            if c.pump.ready_event.is_set():
                return name
            if c.proc.poll() is None:
                continue
            c.pump.wait_eof(0.2)
            if c.pump.ready_event.is_set() or len(self.running) == 1:
                return name  # the readiness wait reports how it ended
            log.info(
                "engine start: the %s contender (pid %d) exited with code %s before its ready line",
                name,
                c.proc.pid,
                c.proc.returncode,
            )
            c.discard()
            del self.running[name]
            if name == "warming_standby":
                self.zygote_failure = (
                    f"forked an engine (pid {c.proc.pid}) that exited with code "
                    f"{c.proc.returncode} before its ready line"
                )
        return None

    def _install_winner(self, winner: StartSource) -> StartSource:
        """Step 4: kill the loser, count a lost zygote as a fallback, install the winner (a
        fresh spawn that exited and dropped out is installed so that its exit is reported)."""
        for name, c in self.running.items():
            if name != winner and c is not None:
                c.discard()
        if winner == "fresh_spawn":
            self.pending.abandon()
            why = self.zygote_failure or (
                "was still importing and a fresh engine started next to it was ready first"
            )
            self.pool.fallback(f"the standby (pid {self.sb.proc.pid}) {why}")
        chosen = self.running.get(winner) or self.fresh
        self.launcher.install(chosen)
        if not chosen.pump.ready_event.is_set() and chosen.proc.poll() is None:
            # nobody was ready in time
            raise self.launcher.attempt(chosen.proc, self.cmd).fail(
                f"no ready line within {self.spec.ready_timeout:.1f}s (standby and fresh spawn)",
                timeout=True,
            )
        return winner

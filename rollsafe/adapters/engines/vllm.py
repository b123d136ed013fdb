"""``VLLMClient``: the :class:`EngineClient` protocol mapped onto vLLM's HTTP endpoints.

=============================================  ==========================================
EngineClient call                              vLLM endpoint
=============================================  ==========================================
health                                         GET ``/health``
generate                                       POST ``/v1/completions`` (token-id prompt)
pause_generation / continue_generation         POST ``/pause`` / ``/resume``
flush_cache                                    POST ``/reset_prefix_cache``
release / resume_memory_occupation             POST ``/sleep?level=1`` / ``/wake_up?tags=``
init_weights_update_group                      POST ``/init_weight_transfer_engine``
update_weights_from_distributed                POST ``/start_weight_update``,
                                               ``/update_weights``, ``/finish_weight_update``
update_weights_from_disk                       POST ``/collective_rpc`` ``reload_weights``
update_weights_from_tensor / _from_ipc         POST ``/collective_rpc`` (method of the same
                                               name, from a worker extension)
destroy_weights_update_group                   no-op (the next init replaces the group)
weights_checksum                               GET ``/weights_checksum``
=============================================  ==========================================

The sleep/wake, collective-RPC and weight-transfer routes exist on a real vLLM only in dev mode
(``VLLM_SERVER_DEV_MODE=1``). SGLang-style sampling parameters are translated
(``max_new_tokens`` -> ``max_tokens``, ``min_new_tokens`` -> ``min_tokens``,
``sampling_seed`` -> ``seed``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from rollsafe.adapters.engines.base import (
    DEFAULT_HEALTH_TIMEOUT,
    DEFAULT_WEIGHTS_TIMEOUT,
    HttpEngineClient,
)
from rollsafe.adapters.engines.client import Dialect, GenerateResult, MemoryTag, PauseMode
from rollsafe.adapters.engines.errors import EngineNotSupported, EngineOperationFailed
from rollsafe.adapters.engines.http import RetryPolicy

_SAMPLING_RENAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "sampling_seed": "seed",
}
#: SGLang pause modes -> vLLM ``/pause`` modes.
_PAUSE_MODES = {"abort": "abort", "in_place": "keep", "retract": "wait"}


def to_vllm_sampling(sampling_params: Mapping[str, Any] | None) -> dict[str, Any]:
    """Translate SGLang-style sampling parameters into OpenAI/vLLM completion fields."""
    out: dict[str, Any] = {}
    for key, value in (sampling_params or {}).items():
        out[_SAMPLING_RENAMES.get(key, key)] = value
    return out


class VLLMClient(HttpEngineClient):
    """Drive one vLLM(-compatible) engine over HTTP with the SGLang-shaped protocol."""

    _dialect: Dialect = "vllm"

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        model: str | None = None,
        timeout: float = 60.0,
        health_timeout: float = DEFAULT_HEALTH_TIMEOUT,
        weights_timeout: float = DEFAULT_WEIGHTS_TIMEOUT,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(
            url,
            api_key=api_key,
            timeout=timeout,
            health_timeout=health_timeout,
            weights_timeout=weights_timeout,
            retry=retry,
            transport=transport,
        )
        #: served model name sent as ``model`` in completions (omitted when None)
        self.model = model

    # -- liveness and serving -------------------------------------------------------------
    def health(self, *, timeout: float | None = None, retry: bool = True) -> None:
        """GET ``/health`` (retried unless ``retry=False``); raises unless it answers 2xx."""
        limit = self.health_timeout if timeout is None else timeout
        self._get("/health", timeout=limit, idempotent=retry)

    def generate(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> GenerateResult:
        """POST ``/v1/completions`` once (never retried) and return the first choice."""
        if (input_ids is None) == (text is None):
            raise ValueError("generate needs exactly one of input_ids or text")
        path = "/v1/completions"
        body: dict[str, Any] = to_vllm_sampling(sampling_params)
        body["prompt"] = [int(t) for t in input_ids] if input_ids is not None else text
        body.setdefault("return_token_ids", True)
        if self.model is not None:
            body.setdefault("model", self.model)
        answer = self._post(path, body, timeout=timeout)
        choices = answer.get("choices") if isinstance(answer, Mapping) else None
        if not choices or not isinstance(choices[0], Mapping):
            raise EngineOperationFailed(self.url, path, 200, f"no choices in answer: {answer!r}")
        choice = choices[0]
        meta: dict[str, Any] = {k: v for k, v in answer.items() if k != "choices"}
        version = choice.get("weight_version", answer.get("weight_version"))
        reason = choice.get("finish_reason")
        return GenerateResult(
            text=str(choice.get("text", "")),
            output_ids=[int(t) for t in choice.get("token_ids") or []],
            weight_version=None if version is None else str(version),
            finish_reason=None if reason is None else str(reason),
            meta_info=meta,
        )

    def pause_generation(self, mode: PauseMode = "abort", *, timeout: float | None = None) -> None:
        """POST ``/pause?mode=`` (``abort`` -> abort, ``in_place`` -> keep, ``retract`` -> wait)."""
        if mode not in _PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {sorted(_PAUSE_MODES)}, got {mode!r}")
        self._checked(
            "/pause", self._post("/pause", params={"mode": _PAUSE_MODES[mode]}, timeout=timeout)
        )

    def continue_generation(self, *, timeout: float | None = None) -> None:
        """POST ``/resume``."""
        self._checked("/resume", self._post("/resume", timeout=timeout))

    def flush_cache(self, *, timeout: float | None = None) -> None:
        """POST ``/reset_prefix_cache``."""
        self._checked("/reset_prefix_cache", self._post("/reset_prefix_cache", timeout=timeout))

    def is_sleeping(self, *, timeout: float | None = None) -> bool:
        """GET ``/is_sleeping`` (retried)."""
        answer = self._get("/is_sleeping", timeout=timeout)
        return bool(answer.get("is_sleeping")) if isinstance(answer, Mapping) else bool(answer)

    # -- memory ---------------------------------------------------------------------------
    def release_memory_occupation(
        self, tags: Sequence[MemoryTag] | None = None, *, timeout: float | None = None
    ) -> None:
        """POST ``/sleep?level=1``: vLLM offloads weights and drops the KV cache together,
        so ``tags`` can only be None or both tags."""
        if tags is not None and set(tags) != {"weights", "kv_cache"}:
            raise EngineNotSupported(
                "vllm", f"release_memory_occupation(tags={list(tags)})",
                "vLLM's /sleep releases weights and KV cache together",
            )  # fmt: skip
        self._checked(
            "/sleep",
            self._post("/sleep", params={"level": 1}, timeout=self._weights_timeout(timeout)),
        )

    def resume_memory_occupation(
        self, tags: Sequence[MemoryTag] | None = None, *, timeout: float | None = None
    ) -> None:
        """POST ``/wake_up?tags=...`` (all when ``tags`` is None)."""
        params = None if tags is None else {"tags": list(tags)}
        self._checked(
            "/wake_up",
            self._post("/wake_up", params=params, timeout=self._weights_timeout(timeout)),
        )

    # -- weights --------------------------------------------------------------------------
    def collective_rpc(
        self,
        method: str,
        *,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        rpc_timeout: float | None = None,
        timeout: float | None = None,
    ) -> Any:
        """POST ``/collective_rpc`` {method, args, kwargs, timeout}; return ``results``."""
        body: dict[str, Any] = {"method": method, "args": list(args), "kwargs": dict(kwargs or {})}
        if rpc_timeout is not None:
            body["timeout"] = rpc_timeout
        answer = self._post("/collective_rpc", body, timeout=self._weights_timeout(timeout))
        self._checked("/collective_rpc", answer)
        return answer.get("results") if isinstance(answer, Mapping) else answer

    def _rpc_message(self, method: str, kwargs: Mapping[str, Any], timeout: float | None) -> str:
        results = self.collective_rpc(method, kwargs=kwargs, timeout=timeout)
        if isinstance(results, list):
            for item in results:
                if isinstance(item, Mapping) and item.get("success") is False:
                    raise EngineOperationFailed(
                        self.url, f"/collective_rpc:{method}", 200, str(item.get("message", ""))
                    )
        return "" if results is None else str(results)

    def get_weights_by_name(
        self, name: str, *, truncate_size: int = 100, timeout: float | None = None
    ) -> Any:
        """Not available: vLLM has no endpoint that returns a parameter's values."""
        raise EngineNotSupported("vllm", "get_weights_by_name", "use weights_checksum()")

    def update_weights_from_disk(
        self,
        model_path: str,
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        timeout: float | None = None,
    ) -> str:
        """``/collective_rpc`` method ``reload_weights`` {model_path, load_format, weight_version}.

        ``abort_all_requests`` pauses (abort) around the reload, then resumes.
        """
        kwargs: dict[str, Any] = {"model_path": model_path}
        if load_format is not None:
            kwargs["load_format"] = load_format
        if weight_version is not None:
            kwargs["weight_version"] = weight_version
        if abort_all_requests:
            self.pause_generation("abort", timeout=timeout)
            try:
                return self._rpc_message("reload_weights", kwargs, timeout)
            finally:
                self.continue_generation(timeout=timeout)
        return self._rpc_message("reload_weights", kwargs, timeout)

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
        timeout: float | None = None,
    ) -> str:
        """``/collective_rpc`` method ``update_weights_from_tensor``."""
        kwargs: dict[str, Any] = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "flush_cache": flush_cache,
        }
        if load_format is not None:
            kwargs["load_format"] = load_format
        if weight_version is not None:
            kwargs["weight_version"] = weight_version
        return self._rpc_message("update_weights_from_tensor", kwargs, timeout)

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
        """POST ``/init_weight_transfer_engine`` {init_info}; blocks until the trainer joins.

        vLLM has one weight-transfer group whose backend is fixed at server start, so
        ``group_name`` and ``backend`` are not sent.
        """
        init_info = {
            "master_address": master_address,
            "master_port": int(master_port),
            "rank_offset": int(rank_offset),
            "world_size": int(world_size),
        }
        return self._post_checked(
            "/init_weight_transfer_engine",
            {"init_info": init_info},
            timeout=self._weights_timeout(timeout),
        )

    def destroy_weights_update_group(
        self, group_name: str = "weight_update_group", *, timeout: float | None = None
    ) -> str:
        """No-op: vLLM keeps a single weight-transfer group and replaces it on the next
        :meth:`init_weights_update_group`; it has no endpoint to destroy it."""
        return "vLLM replaces its weight-transfer group on the next init; nothing to destroy"

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
        """``/start_weight_update``, ``/update_weights`` {update_info}, ``/finish_weight_update``.

        ``/update_weights`` blocks while the trainer broadcasts: call this concurrently.
        ``/finish_weight_update`` is sent even when the update fails, so the engine leaves its
        update mode.
        """
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(
                f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}"
            )
        wt = self._weights_timeout(timeout)
        self._post_checked("/start_weight_update", {"is_checkpoint_format": True}, timeout=wt)
        update_info: dict[str, Any] = {
            "names": list(names),
            "dtype_names": list(dtypes),
            "shapes": [[int(d) for d in s] for s in shapes],
            "packed": load_format == "flattened_bucket",
        }
        if weight_version is not None:
            update_info["weight_version"] = weight_version
        try:
            message = self._post_checked(
                "/update_weights", {"update_info": update_info}, timeout=wt
            )
        finally:
            finish: dict[str, Any] = {}
            if weight_version is not None:
                finish["weight_version"] = weight_version
            self._post_checked("/finish_weight_update", finish, timeout=wt)
        if flush_cache:
            self.flush_cache(timeout=timeout)
        return message

    def update_weights_from_ipc(
        self,
        zmq_handles: Mapping[str, str],
        *,
        flush_cache: bool = True,
        weight_version: str | None = None,
        timeout: float | None = None,
    ) -> str:
        """checkpoint-engine's vLLM path: ``/collective_rpc`` method ``update_weights_from_ipc``."""
        kwargs: dict[str, Any] = {"zmq_handles": dict(zmq_handles), "flush_cache": flush_cache}
        if weight_version is not None:
            kwargs["weight_version"] = weight_version
        return self._rpc_message("update_weights_from_ipc", kwargs, timeout)

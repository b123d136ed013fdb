"""``SGLangClient``: the :class:`EngineClient` protocol over SGLang's HTTP API.

Endpoints and payloads are SGLang's (``docs/design.md``, "Engine facts"), so the same client
drives a real SGLang server and rollsafe's reference engine in its ``sglang`` dialect. It speaks
SGLang 0.5.23 and 0.5.16, picked from the server's ``GET /server_info`` ``"version"`` (or pinned
with ``server_version=``); what differs and what the client does about it:
:mod:`rollsafe.adapters.engines.sglang_dialect`. A server that reports no version (the reference
engine reports the release it imitates) speaks the pinned release, 0.5.23.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import httpx

from rollsafe.adapters.engines.base import (
    DEFAULT_HEALTH_TIMEOUT,
    DEFAULT_WEIGHTS_TIMEOUT,
    HttpEngineClient,
)
from rollsafe.adapters.engines.contract import (
    PINNED_VERSIONS,
    UnsupportedVersion,
    contract_version_for,
)
from rollsafe.adapters.engines.errors import (
    EngineNotSupported,
    EngineOperationFailed,
    EngineRequestError,
)
from rollsafe.adapters.engines.http import RetryPolicy
from rollsafe.adapters.engines.sglang_dialect import SGLangDialect
from rollsafe.adapters.engines.streaming import StreamDelta, stream_deltas
from rollsafe.errors import InvalidArgument
from rollsafe.ports import Dialect, GenerateResult, MemoryTag, PauseMode
from rollsafe.wire.finite import FINITE_CHECKED_HEADER

#: SGLang's generation route (one prompt, or a batch; streamed with ``stream: true``)
GENERATE_PATH = "/generate"


def _finish_reason(meta: Mapping[str, Any]) -> str | None:
    reason = meta.get("finish_reason")
    if isinstance(reason, Mapping):
        kind = reason.get("type")
        return None if kind is None else str(kind)
    return None if reason is None else str(reason)


def generate_body(
    input_ids: Sequence[int] | None,
    text: str | None,
    sampling_params: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The ``/generate`` body of one prompt (token ids or text; rollsafe's ``return_logprob``
    sampling key becomes SGLang's request field of that name)."""
    if (input_ids is None) == (text is None):
        raise InvalidArgument("input_ids", "generate needs exactly one of input_ids or text")
    params = dict(sampling_params or {})
    # rollsafe's ``return_logprob`` sampling key is SGLang's request field of that name
    return_logprob = params.pop("return_logprob", None)
    body: dict[str, Any] = {"sampling_params": params}
    if return_logprob is not None:
        body["return_logprob"] = bool(return_logprob)
    if input_ids is not None:
        body["input_ids"] = [int(t) for t in input_ids]
    else:
        body["text"] = text
    return body


def refuse_unknown_sampling(url: str, dialect: SGLangDialect, body: Mapping[str, Any]) -> None:
    """On a release whose ``/generate`` answers an unknown ``sampling_params`` key with a
    500 (0.5.16: a ``TypeError`` it does not catch), refuse it here with the 400 0.5.23
    answers, nothing sent: a 500 would read as a failing engine."""
    if dialect.sampling_unknown_key_status < 500:
        return
    unknown = sorted(set(body.get("sampling_params") or {}) - dialect.sampling_keys)
    if unknown:
        raise EngineRequestError(
            url,
            GENERATE_PATH,
            400,
            f"unknown sampling parameter {unknown[0]!r} (refused by the client: SGLang "
            f"{dialect.version} would fail the request with a 500; known: "
            f"{', '.join(sorted(dialect.sampling_keys))})",
        )


def _token_logprob(item: Any) -> float | None:
    """The logprob of one ``output_token_logprobs`` entry (``[logprob, token id, text]``)."""
    value = item[0] if isinstance(item, Sequence) and not isinstance(item, str) else item
    return None if value is None else float(value)


def generate_result(url: str, answer: Any) -> GenerateResult:
    """The :class:`GenerateResult` of a ``/generate`` answer (one prompt's object, or a list
    of one)."""
    if isinstance(answer, list) and len(answer) == 1:
        answer = answer[0]
    if not isinstance(answer, Mapping):
        raise EngineOperationFailed(url, GENERATE_PATH, 200, f"unexpected answer: {answer!r}")
    meta = answer.get("meta_info") or {}
    version = meta.get("weight_version")
    raw_lps = meta.get("output_token_logprobs")  # [[logprob, token id, text], ...]
    logprobs = None
    if isinstance(raw_lps, Sequence):
        logprobs = tuple(_token_logprob(item) for item in raw_lps)
    return GenerateResult(
        text=str(answer.get("text", "")),
        output_ids=[int(t) for t in answer.get("output_ids") or []],
        weight_version=None if version is None else str(version),
        finish_reason=_finish_reason(meta),
        meta_info=dict(meta),
        output_logprobs=logprobs,
    )


#: where SGLang reports its release (``/get_server_info``: 0.5.x's older name, and the
#: reference engine's)
_VERSION_ROUTES = ("/server_info", "/get_server_info")


class SGLangClient(HttpEngineClient):
    """Drive one SGLang(-compatible) engine over HTTP."""

    _dialect: Dialect = "sglang"

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout: float = 60.0,
        health_timeout: float = DEFAULT_HEALTH_TIMEOUT,
        weights_timeout: float = DEFAULT_WEIGHTS_TIMEOUT,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
        server_version: str | None = None,
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
        self._dialect_lock = threading.Lock()
        self._server_dialect: SGLangDialect | None = None
        if server_version is not None:
            try:
                pinned = contract_version_for("sglang", server_version)
            except UnsupportedVersion as exc:
                raise UnsupportedVersion(f"SGLangClient(server_version=...): {exc}") from None
            self._server_dialect = SGLangDialect.of(pinned)

    # -- dialect --------------------------------------------------------------------------
    @property
    def known_dialect(self) -> SGLangDialect | None:
        """The release this server speaks when already known (pinned, or asked once by
        :meth:`server_dialect`); None before: reading it needs a request."""
        return self._server_dialect

    def server_dialect(self, *, timeout: float | None = None) -> SGLangDialect:
        """The SGLang release this server speaks: pinned by ``server_version=``, else asked once
        (``GET /server_info``, then ``/get_server_info`` where that is 404; retried) and cached.
        A server that reports no ``version`` speaks the pinned release (0.5.23); one no
        committed contract speaks is :class:`EngineNotSupported`."""
        dialect = self._server_dialect
        if dialect is not None:
            return dialect
        with self._dialect_lock:
            if self._server_dialect is not None:
                return self._server_dialect
            reported = None
            for path in _VERSION_ROUTES:
                try:
                    answer = self._get(path, timeout=timeout)
                except EngineRequestError as exc:
                    if exc.status_code != 404:
                        raise
                    continue
                if isinstance(answer, Mapping) and isinstance(answer.get("version"), str):
                    reported = answer["version"]
                break
            if reported is None:
                dialect = SGLangDialect.of(PINNED_VERSIONS["sglang"])
            else:
                try:
                    version = contract_version_for("sglang", reported)
                except UnsupportedVersion as exc:
                    raise EngineNotSupported(
                        "sglang",
                        f"a server reporting version {reported!r}",
                        f"{exc}; pin SGLangClient(server_version=...) to speak one of them",
                    ) from None
                dialect = SGLangDialect.of(version, reported)
            self._server_dialect = dialect
            return dialect

    # -- liveness and serving -------------------------------------------------------------
    def health(self, *, timeout: float | None = None, retry: bool = True) -> None:
        """GET ``/health`` (retried unless ``retry=False``: then exactly one request); raises
        unless it answers 2xx."""
        limit = self.health_timeout if timeout is None else timeout
        self._get("/health", timeout=limit, idempotent=retry, retries=retry)

    def health_generate(self, *, timeout: float | None = None) -> None:
        """GET ``/health_generate``: a health check that runs one tiny generation."""
        self._get("/health_generate", timeout=timeout)

    def generate(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> GenerateResult:
        """POST ``/generate`` once (never retried). On SGLang 0.5.16 an unknown sampling key is
        refused here (:mod:`.sglang_dialect`)."""
        body = generate_body(input_ids, text, sampling_params)
        refuse_unknown_sampling(self.url, self.server_dialect(), body)
        return generate_result(self.url, self._post(GENERATE_PATH, body, timeout=timeout))

    def generate_stream(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Iterator[StreamDelta]:
        """POST ``/generate`` with ``stream: true`` once; yield each event's new tokens
        (:mod:`~rollsafe.adapters.engines.streaming`). ``timeout`` bounds each wait for an event."""
        body = generate_body(input_ids, text, sampling_params)
        refuse_unknown_sampling(self.url, self.server_dialect(), body)
        body["stream"] = True
        return stream_deltas(self._http, GENERATE_PATH, body, timeout, "sglang")

    def pause_generation(self, mode: PauseMode = "abort", *, timeout: float | None = None) -> None:
        """POST ``/pause_generation`` {mode}."""
        self._checked(
            "/pause_generation", self._post("/pause_generation", {"mode": mode}, timeout=timeout)
        )

    def continue_generation(self, *, timeout: float | None = None) -> None:
        """POST ``/continue_generation``."""
        self._checked(
            "/continue_generation", self._post("/continue_generation", {}, timeout=timeout)
        )

    def flush_cache(self, *, timeout: float | None = None) -> None:
        """POST ``/flush_cache``."""
        self._checked("/flush_cache", self._post("/flush_cache", timeout=timeout))

    # -- memory ---------------------------------------------------------------------------
    def release_memory_occupation(
        self, tags: Sequence[MemoryTag] | None = None, *, timeout: float | None = None
    ) -> None:
        """POST ``/release_memory_occupation`` {tags} (all when ``tags`` is None)."""
        body = {} if tags is None else {"tags": list(tags)}
        self._post_checked(
            "/release_memory_occupation", body, timeout=self._weights_timeout(timeout)
        )

    def resume_memory_occupation(
        self, tags: Sequence[MemoryTag] | None = None, *, timeout: float | None = None
    ) -> None:
        """POST ``/resume_memory_occupation`` {tags} (all when ``tags`` is None)."""
        body = {} if tags is None else {"tags": list(tags)}
        self._post_checked(
            "/resume_memory_occupation", body, timeout=self._weights_timeout(timeout)
        )

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
        """POST ``/update_weights_from_disk`` {model_path, load_format, abort_all_requests,
        weight_version}."""
        body: dict[str, Any] = {"model_path": model_path, "abort_all_requests": abort_all_requests}
        if load_format is not None:
            body["load_format"] = load_format
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._post_checked(
            "/update_weights_from_disk", body, timeout=self._weights_timeout(timeout)
        )

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
        timeout: float | None = None,
        finite_checked: bool = False,
    ) -> str:
        """POST ``/update_weights_from_tensor`` {serialized_named_tensors (one per TP rank),
        load_format, flush_cache, weight_version}. ``finite_checked``: the sender checked every
        tensor finite (the ``ipc`` transport, once per version); sent as the
        :data:`~rollsafe.wire.finite.FINITE_CHECKED_HEADER` header, so the reference engine
        skips its own pass (SGLang ignores it)."""
        body: dict[str, Any] = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "flush_cache": flush_cache,
        }
        if load_format is not None:
            body["load_format"] = load_format
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._post_checked(
            "/update_weights_from_tensor",
            body,
            timeout=self._weights_timeout(timeout),
            headers={FINITE_CHECKED_HEADER: "1"} if finite_checked else None,
        )

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
        """POST ``/init_weights_update_group``; blocks until the trainer joins too."""
        body = {
            "master_address": master_address,
            "master_port": int(master_port),
            "rank_offset": int(rank_offset),
            "world_size": int(world_size),
            "group_name": group_name,
            "backend": backend,
        }
        return self._post_checked(
            "/init_weights_update_group", body, timeout=self._weights_timeout(timeout)
        )

    def destroy_weights_update_group(
        self, group_name: str = "weight_update_group", *, timeout: float | None = None
    ) -> str:
        """POST ``/destroy_weights_update_group`` {group_name}."""
        return self._post_checked(
            "/destroy_weights_update_group",
            {"group_name": group_name},
            timeout=self._weights_timeout(timeout),
        )

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
        """POST ``/update_weights_from_distributed``; blocks while the trainer broadcasts, so
        call it concurrently with the broadcast."""
        if not (len(names) == len(dtypes) == len(shapes)):
            raise InvalidArgument(
                "names",
                f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}",
            )
        body: dict[str, Any] = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [[int(d) for d in s] for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if load_format is not None:
            body["load_format"] = load_format
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._post_checked(
            "/update_weights_from_distributed", body, timeout=self._weights_timeout(timeout)
        )

    def update_weights_from_ipc(
        self,
        zmq_handles: Mapping[str, str],
        *,
        flush_cache: bool = True,
        weight_version: str | None = None,
        timeout: float | None = None,
    ) -> str:
        """POST ``/update_weights_from_ipc`` {zmq_handles, flush_cache, weight_version}."""
        body: dict[str, Any] = {"zmq_handles": dict(zmq_handles), "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._post_checked(
            "/update_weights_from_ipc", body, timeout=self._weights_timeout(timeout)
        )

    def get_weights_by_name(
        self, name: str, *, truncate_size: int = 100, timeout: float | None = None
    ) -> Any:
        """POST ``/get_weights_by_name`` {name, truncate_size}: a read, so it is retried."""
        return self._post(
            "/get_weights_by_name",
            {"name": name, "truncate_size": truncate_size},
            timeout=timeout,
            idempotent=True,
        )

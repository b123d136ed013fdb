"""Plumbing shared by the HTTP engine clients: the transport, result checks, context manager."""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any

import httpx

from rollsafe.adapters.engines.errors import EngineError, EngineOperationFailed
from rollsafe.adapters.engines.http import HttpTransport, RetryPolicy
from rollsafe.checksum import algorithm_for, model_digest, overall_checksum, per_engine_checksum
from rollsafe.ports import Dialect, WeightsChecksum

#: Default timeout for health probes: short, a health check must never hang a prober.
DEFAULT_HEALTH_TIMEOUT = 5.0
#: Default timeout for weight loads and group set-up, which can take minutes on real models.
DEFAULT_WEIGHTS_TIMEOUT = 600.0


def parse_weight_version(url: str, path: str, answer: Any) -> str | None:
    """The ``weight_version`` of a ``/model_info`` / ``/weight_info`` answer (None: unnamed);
    :class:`EngineOperationFailed` when the answer has none."""
    if not isinstance(answer, Mapping) or "weight_version" not in answer:
        raise EngineOperationFailed(url, path, 200, f"no weight_version in {answer!r}")
    version = answer["weight_version"]
    return None if version is None else str(version)


class HttpEngineClient:
    """Base of :class:`SGLangClient` and :class:`VLLMClient`; not an engine client by itself."""

    _dialect: Dialect

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
    ) -> None:
        self._http = HttpTransport(
            url, api_key=api_key, timeout=timeout, retry=retry, transport=transport
        )
        self.health_timeout = health_timeout
        self.weights_timeout = weights_timeout

    @property
    def url(self) -> str:
        return self._http.url

    @property
    def dialect(self) -> Dialect:
        return self._dialect

    @property
    def http(self) -> HttpTransport:
        """This client's transport: its URL, default timeout, retry policy and API key, which
        the asyncio companion (:func:`rollsafe.adapters.engines.aio.async_engine`) uses too."""
        return self._http

    @property
    def version_route(self) -> str:
        """Where the engine reports its weights version: SGLang ``/model_info``, vLLM
        ``/weight_info``."""
        return "/weight_info" if self._dialect == "vllm" else "/model_info"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # ------------------------------------------------------------------ helpers
    def _get(
        self,
        path: str,
        *,
        timeout: float | None = None,
        idempotent: bool = True,
        retries: bool = True,
    ) -> Any:
        return self._http.request(
            "GET", path, timeout=timeout, idempotent=idempotent, retries=retries
        )

    def _post(
        self,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        idempotent: bool = False,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        return self._http.request(
            "POST",
            path,
            json_body=body,
            params=params,
            timeout=timeout,
            idempotent=idempotent,
            headers=headers,
        )

    def _post_checked(
        self,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> str:
        """POST a state-changing call once and raise unless it reports success."""
        return self._checked(path, self._post(path, body, timeout=timeout, headers=headers))

    def _checked(self, path: str, answer: Any) -> str:
        """Raise :class:`EngineOperationFailed` on ``{"success": false}``; return the message."""
        if isinstance(answer, Mapping):
            message = answer.get("message", "")
            if answer.get("success") is False:
                raise EngineOperationFailed(self.url, path, 200, str(message))
            return str(message if message is not None else "")
        return "" if answer is None else str(answer)

    def _weights_timeout(self, timeout: float | None) -> float:
        return self.weights_timeout if timeout is None else timeout

    # ------------------------------------------------------------------ weight checkers
    #: The digest algorithm the engine reports with (:mod:`rollsafe.checksum`); ``None``: from
    #: the dialect (vLLM: ``"vllm"``) and, for SGLang, the ``device`` its ``/get_server_info``
    #: reports (``"sglang-gpu"`` on CUDA or when it reports none, ``"sglang-cpu"`` otherwise).
    checksum_algorithm: str | None = None

    def _checksum_algorithm(self, timeout: float | None) -> str:
        if self.checksum_algorithm is not None:
            return self.checksum_algorithm
        if self._dialect == "vllm":
            return "vllm"
        device: Any = None
        try:
            info = self._get("/get_server_info", timeout=timeout)
            if isinstance(info, Mapping) and isinstance(info.get("device"), str):
                device = info["device"]
        except EngineError:
            return "sglang-gpu"  # not cached: ask again next time
        self.checksum_algorithm = algorithm_for("sglang", device)
        return self.checksum_algorithm

    def _bad_checksum(self, path: str, answer: Any) -> EngineOperationFailed:
        return EngineOperationFailed(self.url, path, 200, f"unexpected checksum answer: {answer!r}")

    @staticmethod
    def _merge_ranks(ranks: list[dict[str, str]]) -> dict[str, str]:
        """One ``{name: digest}``: names every rank agrees on once, the others per rank."""
        merged: dict[str, str] = {}
        names = sorted({n for r in ranks for n in r})
        for name in names:
            values = [r.get(name) for r in ranks]
            if all(v == values[0] for v in values) and values[0] is not None:
                merged[name] = values[0]
            else:
                for i, v in enumerate(values):
                    if v is not None:
                        merged[f"rank{i}:{name}"] = v
        return merged

    def _parse_sglang_checksum(self, answer: Any, algorithm: str) -> WeightsChecksum:
        """SGLang ``/weights_checker`` ``{"success", "message", "ranks", "per_engine_checksum"}``
        (one ``ChecksumInfo`` ``{checksums, per_gpu_checksum, parallelism_info}`` per rank)."""
        path = "/weights_checker"
        if not isinstance(answer, Mapping):
            raise self._bad_checksum(path, answer)
        self._checked(path, answer)
        infos = answer.get("ranks")
        if not isinstance(infos, list) or not infos:
            raise self._bad_checksum(path, answer)
        ranks: list[dict[str, str]] = []
        per_gpu: list[str] = []
        for info in infos:
            if not isinstance(info, Mapping) or not isinstance(info.get("checksums"), Mapping):
                raise self._bad_checksum(path, answer)
            ranks.append({str(k): str(v) for k, v in info["checksums"].items()})
            per_gpu.append(str(info.get("per_gpu_checksum") or overall_checksum(ranks[-1])))
        per_engine = answer.get("per_engine_checksum")
        per_engine = str(per_engine) if per_engine is not None else per_engine_checksum(per_gpu)
        tensors = self._merge_ranks(ranks)
        model = per_gpu[0] if all(p == per_gpu[0] for p in per_gpu) else per_engine
        return WeightsChecksum(
            weight_version=None,
            model=model,
            tensors=tensors,
            algorithm=algorithm,
            ranks=tuple(ranks),
            per_engine=per_engine,
        )

    def _parse_vllm_checksum(self, answer: Any, algorithm: str) -> WeightsChecksum:
        """vLLM ``/weight_checker`` ``{"checksums": {"dp<d>:pp<p>:pcp<c>:tp<t>:name": hex}}``."""
        path = "/weight_checker"
        if not isinstance(answer, Mapping) or not isinstance(answer.get("checksums"), Mapping):
            raise self._bad_checksum(path, answer)
        by_rank: dict[str, dict[str, str]] = {}
        for key, value in answer["checksums"].items():
            parts = str(key).split(":", 4)
            if len(parts) != 5:
                raise self._bad_checksum(path, answer)
            by_rank.setdefault(":".join(parts[:4]), {})[parts[4]] = str(value)
        ranks = [by_rank[k] for k in sorted(by_rank)]
        tensors = self._merge_ranks(ranks) if ranks else {}
        return WeightsChecksum(
            weight_version=None,
            model=model_digest(tensors),
            tensors=tensors,
            algorithm=algorithm,
            ranks=tuple(ranks),
        )

    # ------------------------------------------------------------------ shared API
    def weights_checksum(self, *, timeout: float | None = None) -> WeightsChecksum:
        """Per-tensor digests of the served weights from the engine's own checker (retried).

        SGLang: ``POST /weights_checker {"action": "checksum"}``; vLLM: ``POST /weight_checker
        {"action": "checksum"}``. Neither reports the weight version (``weight_version`` is
        ``None``). Both report the engine's own parameters (fused ``qkv_proj`` /
        ``gate_up_proj``, one set per TP rank): compare with a trainer's weights laid out the
        same way, :func:`rollsafe.fleet.weights_check.expected_digests` (or ``check_engine``),
        with ``algorithm=<this result>.algorithm``.
        """
        algorithm = self._checksum_algorithm(timeout)
        if self._dialect == "vllm":
            answer = self._post(
                "/weight_checker", {"action": "checksum"}, timeout=timeout, idempotent=True
            )
            return self._parse_vllm_checksum(answer, algorithm)
        answer = self._post(
            "/weights_checker", {"action": "checksum"}, timeout=timeout, idempotent=True
        )
        return self._parse_sglang_checksum(answer, algorithm)

    def weight_version(self, *, timeout: float | None = None) -> str | None:
        """The weights version the engine reports (retried): SGLang ``GET /model_info``,
        vLLM ``GET /weight_info``. The checkers report none, so this is how to read it."""
        path = self.version_route
        return parse_weight_version(self.url, path, self._get(path, timeout=timeout))

    def is_healthy(self, *, timeout: float | None = None) -> bool:
        """True when :meth:`health` passes; False on any engine error."""
        try:
            self.health(timeout=timeout)
        except EngineError:
            return False
        return True

    def health(self, *, timeout: float | None = None, retry: bool = True) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Close the connection pool (the engine keeps running)."""
        self._http.close()

    def shutdown(self) -> None:
        """Close this client for good (processes are the launcher's to stop)."""
        self.close()

    def __enter__(self) -> HttpEngineClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

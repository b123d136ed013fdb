"""Plumbing shared by the HTTP engine clients: the transport, result checks, context manager."""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any

import httpx

from rollsafe.adapters.engines.client import Dialect, WeightsChecksum
from rollsafe.adapters.engines.errors import EngineError, EngineOperationFailed
from rollsafe.adapters.engines.http import HttpTransport, RetryPolicy

#: Default timeout for health probes: short, a health check must never hang a prober.
DEFAULT_HEALTH_TIMEOUT = 5.0
#: Default timeout for weight loads and group set-up, which can take minutes on real models.
DEFAULT_WEIGHTS_TIMEOUT = 600.0


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

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # ------------------------------------------------------------------ helpers
    def _get(self, path: str, *, timeout: float | None = None, idempotent: bool = True) -> Any:
        return self._http.request("GET", path, timeout=timeout, idempotent=idempotent)

    def _post(
        self,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        idempotent: bool = False,
    ) -> Any:
        return self._http.request(
            "POST", path, json_body=body, params=params, timeout=timeout, idempotent=idempotent
        )

    def _post_checked(
        self, path: str, body: Mapping[str, Any] | None = None, *, timeout: float | None = None
    ) -> str:
        """POST a state-changing call once and raise unless it reports success."""
        return self._checked(path, self._post(path, body, timeout=timeout))

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

    def _parse_checksum(self, answer: Any) -> WeightsChecksum:
        if not isinstance(answer, Mapping) or not isinstance(answer.get("tensors"), Mapping):
            raise EngineOperationFailed(
                self.url, "/weights_checksum", 200, f"unexpected checksum answer: {answer!r}"
            )
        version = answer.get("weight_version")
        model = answer.get("model")
        return WeightsChecksum(
            weight_version=None if version is None else str(version),
            model=None if model is None else str(model),
            tensors={str(k): str(v) for k, v in answer["tensors"].items()},
        )

    # ------------------------------------------------------------------ shared API
    def weights_checksum(self, *, timeout: float | None = None) -> WeightsChecksum:
        """Per-tensor digests of the served weights (idempotent: retried)."""
        return self._parse_checksum(self._get("/weights_checksum", timeout=timeout))

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

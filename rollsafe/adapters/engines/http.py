"""HTTP transport shared by the engine clients: timeouts, bounded retries, error mapping.

One :class:`HttpTransport` wraps one ``httpx.Client`` bound to an engine's base URL. It

* sends ``Authorization: Bearer <key>`` when an API key is given;
* applies a per-call timeout (the client default unless the call overrides it);
* retries with exponential backoff only when the caller marks the call idempotent
  (health, checksum, get-by-name), on connection errors, timeouts and 5xx answers. Generate and
  weight updates are sent exactly once;
* maps transport failures to :class:`EngineUnavailable` / :class:`EngineTimeout` and HTTP error
  statuses to :class:`EngineRequestError`, reading at most a few KB of an error body.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from rollsafe.adapters.engines.errors import (
    MAX_MESSAGE_CHARS,
    EngineRequestError,
    EngineTimeout,
    EngineUnavailable,
)

#: An idempotent call is retried on a server-side status (>= this): repeating a read is safe and a
#: 5xx is often transient (starting, overloaded, a proxy lost its upstream). 4xx is never retried.
RETRY_MIN_STATUS = 500


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with exponential backoff, used for idempotent calls only.

    ``attempts`` counts every try including the first, so ``attempts=1`` disables retries.
    """

    attempts: int = 3
    backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("RetryPolicy backoff values must be >= 0")

    def delay(self, retry_index: int) -> float:
        """Seconds to sleep before retry number ``retry_index`` (0-based)."""
        base = min(self.backoff_s * (2**retry_index), self.max_backoff_s)
        return float(base * (1.0 + self.jitter * random.random()))


NO_RETRY = RetryPolicy(attempts=1)


class HttpTransport:
    """A thread-safe JSON-over-HTTP channel to one engine."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout: float = 30.0,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"engine url must start with http:// or https://, got {url!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.retry = retry if retry is not None else RetryPolicy()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout, transport=transport
        )
        self._closed = False
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the connection pool; later calls raise :class:`EngineUnavailable`."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._client.close()

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ calls
    def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        idempotent: bool = False,
    ) -> Any:
        """Send one request and return the decoded JSON body (or text, or ``None`` if empty).

        Retries per :attr:`retry` only when ``idempotent`` is true.
        """
        attempts = self.retry.attempts if idempotent else 1
        last: Exception | None = None
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.retry.delay(attempt - 1))
            try:
                return self._once(method, path, json_body, params, timeout)
            except EngineRequestError as exc:
                if exc.status_code < RETRY_MIN_STATUS:
                    raise
                last = exc
            except EngineUnavailable as exc:
                if self._closed:
                    raise
                last = exc
        assert last is not None
        raise last

    def _once(
        self,
        method: str,
        path: str,
        json_body: Mapping[str, Any] | None,
        params: Mapping[str, Any] | None,
        timeout: float | None,
    ) -> Any:
        if self._closed:
            raise EngineUnavailable(self.url, path, "client is closed")
        call_timeout = self.timeout if timeout is None else timeout
        try:
            request = self._client.build_request(
                method, path, json=json_body, params=params, timeout=call_timeout
            )
            response = self._client.send(request, stream=True)
        except httpx.TimeoutException as exc:
            raise EngineTimeout(
                self.url, path, f"no answer within {call_timeout}s ({type(exc).__name__})"
            ) from exc
        except (httpx.TransportError, RuntimeError) as exc:
            # RuntimeError: the pool was closed concurrently by close().
            raise EngineUnavailable(self.url, path, f"{type(exc).__name__}: {exc}") from exc
        try:
            if response.status_code >= 400:
                raise EngineRequestError(
                    self.url, path, response.status_code, _read_bounded(response)
                )
            try:
                body = response.read()
            except httpx.TimeoutException as exc:
                raise EngineTimeout(
                    self.url, path, f"body not read within {call_timeout}s"
                ) from exc
            except httpx.TransportError as exc:
                raise EngineUnavailable(self.url, path, f"{type(exc).__name__}: {exc}") from exc
        finally:
            response.close()
        if not body:
            return None
        try:
            return json.loads(body)
        except ValueError:
            return body.decode("utf-8", errors="replace")


def _read_bounded(response: httpx.Response, limit: int = 2 * MAX_MESSAGE_CHARS) -> str:
    """Read at most ``limit`` bytes of an error body, then extract a readable message."""
    chunks: list[bytes] = []
    size = 0
    truncated = False
    try:
        for chunk in response.iter_bytes():
            chunks.append(chunk)
            size += len(chunk)
            if size >= limit:
                truncated = True
                break
    except httpx.HTTPError as exc:
        chunks.append(f" [error body unreadable: {type(exc).__name__}]".encode())
    raw = b"".join(chunks)[:limit].decode("utf-8", errors="replace")
    if truncated:
        return _message_from_truncated_json(raw) + " ...[truncated]"
    return _message_from_body(raw) or response.reason_phrase


_MESSAGE_KEY = re.compile(r'"(?:message|detail|error)"\s*:\s*"')


def _message_from_truncated_json(raw: str) -> str:
    """The start of a ``"message"`` string in a JSON body cut short, else the raw text."""
    match = _MESSAGE_KEY.search(raw)
    return raw[match.end() :] if match else raw


def _message_from_body(raw: str) -> str:
    """Pull ``message`` / ``detail`` / ``error`` out of a JSON error body, else return it as is."""
    try:
        data = json.loads(raw)
    except ValueError:
        return raw.strip()
    if isinstance(data, dict):
        for key in ("message", "detail", "error"):
            value = data.get(key)
            if isinstance(value, str) and value:
                return value
            if isinstance(value, dict) and isinstance(value.get("message"), str):
                return str(value["message"])
    return raw.strip()

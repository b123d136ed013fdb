"""HTTP transport shared by the engine clients: timeouts, bounded retries, error mapping.

One :class:`HttpTransport` wraps one ``httpx.Client`` bound to an engine's base URL. It

* sends ``Authorization: Bearer <key>`` when an API key is given;
* applies a per-call timeout (the client default unless the call overrides it);
* retries with exponential backoff (:class:`RetryPolicy`):

  ==========================================  ====================  =========================
  failure                                     idempotent call       generate, weight updates
                                                                    and every other call
  ==========================================  ====================  =========================
  no connection could be opened (connect      retried               retried: the request
  error, connect timeout)                                           provably never reached
                                                                    the engine
  connection broke after the request may      retried               sent once (the engine may
  have been written, read timeout                                   have acted on it)
  5xx answer                                  retried               sent once
  4xx answer                                  never                 never
  ==========================================  ====================  =========================

* recycles the connection after every 5xx answer: a real vLLM drops its keep-alive connection
  after a 500 without saying ``Connection: close``, so the pooled connection would fail the
  next request (ECONNRESET, "server disconnected") and rollsafe would report a healthy engine
  unavailable; the next request opens a fresh connection instead;
* maps transport failures to :class:`EngineUnavailable` / :class:`EngineTimeout` (with
  ``request_sent=False`` when no connection was opened) and HTTP error statuses to
  :class:`EngineRequestError`, reading at most a few KB of an error body.

The rules that do not depend on the HTTP library are module-level and shared with the asyncio
clients (:mod:`rollsafe.adapters.engines.aio`): which failure is retried (:func:`retryable`), how
much of an error body is read and what message is kept (:class:`BoundedBody`), how an answer's
body is decoded (:func:`decode_body`).
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

from rollsafe import json_codec
from rollsafe.adapters.engines.errors import EngineRequestError, EngineTimeout, EngineUnavailable
from rollsafe.errors import InvalidArgument
from rollsafe.text import MAX_MESSAGE_CHARS

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
            raise InvalidArgument(
                "RetryPolicy.attempts", f"RetryPolicy.attempts must be >= 1, got {self.attempts}"
            )
        for name in ("backoff_s", "max_backoff_s"):
            if getattr(self, name) < 0:
                raise InvalidArgument(
                    f"RetryPolicy.{name}",
                    f"RetryPolicy.{name} must be >= 0, got {getattr(self, name)}",
                )

    def delay(self, retry_index: int) -> float:
        """Seconds to sleep before retry number ``retry_index`` (0-based)."""
        base = min(self.backoff_s * (2**retry_index), self.max_backoff_s)
        return float(base * (1.0 + self.jitter * random.random()))


NO_RETRY = RetryPolicy(attempts=1)


def retryable(exc: Exception, *, idempotent: bool) -> bool:
    """Whether a failed try may be repeated (the table above): any call whose request provably
    never reached the engine, and an ``idempotent`` one also after a 5xx, a broken connection or
    a timeout. A 4xx never is."""
    if isinstance(exc, EngineRequestError):
        return idempotent and exc.status_code >= RETRY_MIN_STATUS
    if isinstance(exc, EngineUnavailable):
        return idempotent or exc.request_sent is False
    return False


def decode_body(body: bytes) -> Any:
    """An answer's body: its JSON (:func:`rollsafe.json_codec.loads`: orjson where installed,
    :mod:`json`'s values), else its text, ``None`` when empty."""
    if not body:
        return None
    try:
        return json_codec.loads(body)
    except ValueError:
        return body.decode("utf-8", errors="replace")


#: at most this many bytes of an error body are read (the message kept is shorter still)
ERROR_BODY_LIMIT = 2 * MAX_MESSAGE_CHARS


class BoundedBody:
    """The first :data:`ERROR_BODY_LIMIT` bytes of an error body, fed chunk by chunk, and the
    readable message they hold (``message``/``detail``/``error`` of a JSON body, else the text)."""

    def __init__(self, limit: int = ERROR_BODY_LIMIT) -> None:
        self.limit = limit
        self._chunks: list[bytes] = []
        self._size = 0
        self.truncated = False

    def add(self, chunk: bytes) -> bool:
        """Keep ``chunk``; True once the limit is reached (read no more)."""
        self._chunks.append(chunk)
        self._size += len(chunk)
        if self._size >= self.limit:
            self.truncated = True
        return self.truncated

    def unreadable(self, exc: BaseException) -> None:
        """The rest of the body could not be read: say so in the message."""
        self._chunks.append(f" [error body unreadable: {type(exc).__name__}]".encode())

    def message(self, reason: str) -> str:
        """The message to keep; ``reason`` (the status line's phrase) when the body is empty."""
        raw = b"".join(self._chunks)[: self.limit].decode("utf-8", errors="replace")
        if self.truncated:
            return _message_from_truncated_json(raw) + " ...[truncated]"
        return _message_from_body(raw) or reason


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
            raise InvalidArgument(
                "url", f"engine url must start with http:// or https://, got {url!r}"
            )
        if timeout <= 0:
            raise InvalidArgument("timeout", f"timeout must be > 0, got {timeout}")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.retry = retry if retry is not None else RetryPolicy()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._headers = headers
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

    @property
    def headers(self) -> dict[str, str]:
        """The headers every request carries (``Authorization`` when an API key is set)."""
        return dict(self._headers)

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
        retries: bool = True,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        """Send one request and return the decoded JSON body (or text, or ``None`` if empty).

        Retries per :attr:`retry`: any call whose request provably never reached the engine,
        and an ``idempotent`` one also after a 5xx, a broken connection or a timeout.
        ``retries=False`` sends exactly one request (a health probe that must fail fast).
        """
        last: Exception | None = None
        for attempt in range(self.retry.attempts if retries else 1):
            if attempt:
                time.sleep(self.retry.delay(attempt - 1))
            try:
                return self._once(method, path, json_body, params, timeout, headers)
            except (EngineRequestError, EngineUnavailable) as exc:
                if self._closed or not retryable(exc, idempotent=idempotent):
                    raise
                last = exc
        assert last is not None
        raise last

    def open(
        self,
        method: str,
        path: str,
        *,
        json_body: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        """Send one request and return the response with its body unread (the caller closes
        it, through :meth:`release` after an error status). A request that never reached the
        engine is retried per :attr:`retry`; nothing else is."""
        last: EngineUnavailable | None = None
        for attempt in range(self.retry.attempts):
            if attempt:
                time.sleep(self.retry.delay(attempt - 1))
            try:
                return self._send(method, path, json_body, params, timeout)
            except EngineUnavailable as exc:
                if self._closed or not retryable(exc, idempotent=False):
                    raise
                last = exc
        assert last is not None
        raise last

    def error_of(self, path: str, response: httpx.Response) -> EngineRequestError:
        """The :class:`EngineRequestError` of an error answer (its body read, bounded); the
        response is closed and, after a 5xx, its connection dropped from the pool."""
        try:
            return EngineRequestError(self.url, path, response.status_code, _read_bounded(response))
        finally:
            self.release(response)

    @staticmethod
    def release(response: httpx.Response) -> None:
        """Close ``response``; after a 5xx also close its connection, so the pool opens a fresh
        one for the next request instead of reusing one the server may drop silently."""
        if response.status_code >= RETRY_MIN_STATUS:
            _drop_connection(response)
        response.close()

    def _send(
        self,
        method: str,
        path: str,
        json_body: Mapping[str, Any] | None,
        params: Mapping[str, Any] | None,
        timeout: float | None,
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        if self._closed:
            raise EngineUnavailable(self.url, path, "client is closed", request_sent=False)
        call_timeout = self.timeout if timeout is None else timeout
        try:
            request = self._client.build_request(
                method, path, json=json_body, params=params, timeout=call_timeout, headers=headers
            )
            return self._client.send(request, stream=True)
        except httpx.ConnectTimeout as exc:
            raise EngineTimeout(
                self.url,
                path,
                f"no connection within {call_timeout}s (ConnectTimeout)",
                request_sent=False,
            ) from exc
        except httpx.TimeoutException as exc:
            raise EngineTimeout(
                self.url, path, f"no answer within {call_timeout}s ({type(exc).__name__})"
            ) from exc
        except httpx.ConnectError as exc:
            raise EngineUnavailable(
                self.url, path, f"{type(exc).__name__}: {exc}", request_sent=False
            ) from exc
        except (httpx.TransportError, RuntimeError) as exc:
            # RuntimeError: the pool was closed concurrently by close().
            raise EngineUnavailable(self.url, path, f"{type(exc).__name__}: {exc}") from exc

    def _once(
        self,
        method: str,
        path: str,
        json_body: Mapping[str, Any] | None,
        params: Mapping[str, Any] | None,
        timeout: float | None,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        call_timeout = self.timeout if timeout is None else timeout
        response = self._send(method, path, json_body, params, timeout, headers)
        if response.status_code >= 400:
            raise self.error_of(path, response)
        try:
            body = response.read()
        except httpx.TimeoutException as exc:
            raise EngineTimeout(self.url, path, f"body not read within {call_timeout}s") from exc
        except httpx.TransportError as exc:
            raise EngineUnavailable(self.url, path, f"{type(exc).__name__}: {exc}") from exc
        finally:
            response.close()
        return decode_body(body)


def _drop_connection(response: httpx.Response) -> None:
    """Close the socket under ``response`` (httpcore's documented ``network_stream``
    extension): when the response is closed, the pool finds the connection unusable and
    discards it instead of handing it to the next request."""
    stream = response.extensions.get("network_stream")
    close = getattr(stream, "close", None)
    if close is not None:
        try:
            close()
        except OSError:
            pass


def _read_bounded(response: httpx.Response) -> str:
    """Read at most :data:`ERROR_BODY_LIMIT` bytes of an error body; its readable message."""
    body = BoundedBody()
    try:
        for chunk in response.iter_bytes():
            if body.add(chunk):
                break
    except httpx.HTTPError as exc:
        body.unreadable(exc)
    return body.message(response.reason_phrase)


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

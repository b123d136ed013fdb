"""Named errors raised by engine clients and the engine launcher: the clients' error contract.

Every :class:`rollsafe.ports.EngineClient` call (``SGLangClient``, ``VLLMClient``) raises a
subclass of :class:`EngineError` on failure:

* :class:`EngineUnavailable` / :class:`EngineTimeout`: the engine could not be reached in time;
* :class:`EngineRequestError`: it answered an HTTP error (``status_code``, bounded ``message``);
* :class:`EngineOperationFailed`: it answered ``{"success": false}`` to a weight/memory call;
* :class:`EngineNotSupported`: the dialect has no such operation (:class:`NoWeightChecker`:
  the server has no weight checker, check its weights with :mod:`rollsafe.probe`);
* :class:`EngineAsleep`: a weight update refused because this client put the engine's weights
  to sleep (nothing was sent);
* :class:`EventLoopError`: an asyncio client (:mod:`~rollsafe.adapters.engines.aio`) made with
  no running event loop, or used from a loop other than its own.

Idempotent reads (health, checksum, get-by-name) are retried; generate and every
state-changing call are sent once, and resent only when the request provably never reached the
engine (no connection could be opened).

Every message a server sends back is cut to a few KB (head and tail kept) before it is stored in
an exception, so an engine that answers with a megabyte of traceback cannot make logs, routers or
state-machine error fields grow without bound.
"""

from __future__ import annotations

from collections.abc import Sequence

from rollsafe.errors import RollsafeError

# one definition of text bounding for the whole package
from rollsafe.text import MAX_MESSAGE_CHARS, bound_text


class EngineError(RollsafeError):
    """Base class of every error raised while talking to or running an engine."""


class EngineUnavailable(EngineError):
    """The engine could not be reached (connection refused/reset, DNS, closed socket).

    ``url`` is the engine's base URL and ``path`` the endpoint that was being called.
    ``request_sent`` is ``False`` when the request provably never reached the engine (no
    connection could be opened), ``None`` when that is unknown (the connection broke after the
    request may have been written, or no answer came in time).
    """

    def __init__(
        self, url: str, path: str, reason: str, *, request_sent: bool | None = None
    ) -> None:
        self.url = url
        self.path = path
        self.reason = bound_text(reason)
        self.request_sent = request_sent
        super().__init__(f"engine {url} unavailable on {path}: {self.reason}")


class EngineTimeout(EngineUnavailable):
    """The engine did not answer within the call's timeout.

    For a non-idempotent call (generate, weight updates) the outcome on the server is unknown.
    """


class EngineRequestError(EngineError):
    """The engine answered with an HTTP error status.

    ``message`` holds at most :data:`MAX_MESSAGE_CHARS` characters of the server's answer.
    """

    def __init__(self, url: str, path: str, status_code: int, message: str) -> None:
        self.url = url
        self.path = path
        self.status_code = status_code
        self.message = bound_text(message)
        super().__init__(f"engine {url} answered {status_code} on {path}: {self.message}")


class EngineOperationFailed(EngineRequestError):
    """The engine answered 2xx but reported ``{"success": false, "message": ...}``."""


class EngineNotSupported(EngineError):
    """The operation has no equivalent in this engine dialect."""

    def __init__(self, dialect: str, operation: str, hint: str = "") -> None:
        self.dialect = dialect
        self.operation = operation
        msg = f"{operation} is not supported by the {dialect} dialect"
        super().__init__(f"{msg}: {hint}" if hint else msg)


class NoWeightChecker(EngineNotSupported):
    """The server has no weight checker (vLLM 0.26.0 has no ``/weight_checker``): nothing was
    sent. Check what it serves with the behavioural probe instead (:mod:`rollsafe.probe`: a
    fresh engine on the same weights and the same prompts, compared token by token)."""

    def __init__(self, dialect: str, release: str) -> None:
        self.release = release
        super().__init__(
            dialect,
            "weights_checksum",
            f"{dialect} {release} has no weight checker; compare behaviour with rollsafe.probe",
        )


class EngineAsleep(EngineError):
    """A weight update refused before anything was sent: this client put the engine's weights
    to sleep (vLLM ``/sleep`` level >= 1) and has not woken them. vLLM 0.26.0 crashes on an
    update while asleep (vllm#57853); wake the weights first (``resume_memory_occupation``
    with ``["weights"]`` or all tags)."""

    def __init__(self, url: str, operation: str, level: int) -> None:
        self.url = url
        self.operation = operation
        self.level = level
        super().__init__(
            f"{operation} refused: engine {url} sleeps (level {level}, weights released by this "
            "client); wake its weights first (resume_memory_occupation), nothing was sent"
        )


class EventLoopError(EngineError, RuntimeError):
    """An :class:`~rollsafe.adapters.engines.aio.AsyncHttp` made outside a running event loop,
    or called from a loop other than the one it was made on (make one per loop)."""


class EngineStartError(EngineError):
    """An engine group failed to start: it exited, or was not ready and healthy in time.

    Carries the command line, the exit code (``None`` if it was still running and got killed),
    the log file path and the tail of the engine's output.
    """

    def __init__(
        self,
        reason: str,
        *,
        command: Sequence[str],
        exit_code: int | None,
        output_tail: str,
        log_path: str | None = None,
    ) -> None:
        self.reason = reason
        self.command = list(command)
        self.exit_code = exit_code
        self.output_tail = bound_text(output_tail, 4 * MAX_MESSAGE_CHARS)
        self.log_path = log_path
        lines = [
            f"engine failed to start: {reason}",
            f"  exit code: {exit_code}",
            f"  command: {' '.join(self.command)}",
        ]
        if log_path:
            lines.append(f"  log: {log_path}")
        lines.append("  output tail:")
        lines.extend("    " + line for line in self.output_tail.splitlines()[-40:])
        super().__init__("\n".join(lines))

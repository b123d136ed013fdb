"""Named errors of the reference engine and the HTTP status each one maps to."""

from __future__ import annotations

from rollsafe.errors import RollsafeError

__all__ = [
    "BadRequest",
    "BodyBudgetExceeded",
    "DeltaRefused",
    "EngineBusy",
    "EngineDead",
    "LimitExceeded",
    "RankFailure",
    "RequestTimeout",
    "ServerError",
    "ServerUnavailable",
    "StartupError",
    "Unsupported",
    "WeightUpdateError",
    "WorkerFailed",
]


class ServerError(RollsafeError):
    """Base class of what the reference engine's server refuses or fails with (the client-side
    counterpart is :class:`rollsafe.adapters.engines.EngineError`); ``status`` is the HTTP status
    the server answers with.

    ``drops_connection``: the server closes the connection once this error's answer is written,
    without a ``Connection: close`` header (as uvicorn does after an exception escaped a vLLM
    route), so a client's next request on that pooled connection fails.
    """

    status = 500
    drops_connection = False


class BadRequest(ServerError):
    """The request is malformed (bad JSON, unknown key, wrong type); nothing was changed."""

    status = 400


class LimitExceeded(BadRequest):
    """A request asks for more than a configured limit allows (names the limit and its flag);
    nothing of it was queued."""


class WeightUpdateError(BadRequest):
    """A weight update was refused before touching live weights (names the key/path/rank)."""


class DeltaRefused(WeightUpdateError):
    """A delta update (``rollsafe.wire.delta``) was refused: the message starts with the
    :class:`~rollsafe.wire.delta.DeltaError` class name (``DeltaBaseMismatch: ...``,
    ``DeltaFormatError: ...``, ``DeltaDigestMismatch: ...``) and names the key or the base.
    Nothing was applied, the weights and ``weight_version`` are unchanged, the engine serves on."""

    @property
    def kind(self) -> str:
        """The refusing :class:`~rollsafe.wire.delta.DeltaError` class name."""
        return str(self).split(":", 1)[0]


class Unsupported(BadRequest):
    """The request is valid but this engine/device cannot do it (e.g. CUDA IPC on CPU)."""


class RequestTimeout(ServerError):
    """The client did not send its request body within ``--body-timeout`` seconds."""

    status = 408


class ServerUnavailable(ServerError):
    """HTTP 503: the engine cannot serve right now (weights released, shutting down, hung)."""

    status = 503


class EngineBusy(ServerUnavailable):
    """The engine is at its ``--max-concurrent-requests`` limit; the request was not queued
    (retry later or elsewhere). The engine itself is healthy."""


class BodyBudgetExceeded(ServerUnavailable):
    """The request bodies being read or held, all connections together, would pass
    ``--max-inflight-body-bytes``; the body was not read (retry later)."""


class EnginePaused(ServerUnavailable):
    """vLLM 0.33.0: generation is paused in ``abort`` or ``wait`` mode; new requests get a 503
    (``engine_paused``, retry after ``/resume``) instead of queueing."""


class RankFailure(ServerUnavailable):
    """A rank process died or a collective among the ranks failed; the engine is unhealthy."""


class WorkerFailed(ServerError):
    """vLLM dialect: a worker call behind a dev/RL route raised (``collective_rpc``, the weight
    transfer routes). vLLM lets that exception escape the route: a 500 with
    ``{"error": {"message": "Call to collective_rpc method failed: Worker failed with error
    '...'", ...}}``, then the connection is dropped. Whether the weights survived is the
    route's business (a failed reload or a failed update poisons the engine)."""

    drops_connection = True

    def __init__(self, message: str) -> None:
        super().__init__(
            f"Call to collective_rpc method failed: Worker failed with error '{message}', "
            "please check the stack trace above for the root cause"
        )


class EngineDead(ServerError):
    """vLLM dialect: the engine core died (a forward pass over poisoned weights or in the middle
    of a weight update); what was in flight gets this 500 (vLLM's ``EngineDeadError``) and the
    server exits."""

    def __init__(self, reason: str = "") -> None:
        super().__init__(
            "EngineCore encountered an issue. See stack trace (above) for the root cause."
        )
        self.reason = reason


class StartupError(ServerError):
    """The engine cannot start as configured (bad device, rank layout or tokenizer)."""

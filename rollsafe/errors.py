"""One root for every rollsafe exception: ``except RollsafeError`` catches any of them.

Owns :class:`RollsafeError`, the errors of the wire layer (which sits below everything else)
and the two that any layer raises: :class:`MissingExtra` and :class:`InvalidArgument` (a
caller's bad input, naming its ``key``). Every other exception class stays in the module
that raises it and derives from :class:`RollsafeError` (directly or through its layer's
root), keeping the built-in base callers already catch (``ValueError``, ``RuntimeError``,
``KeyError``, ``TimeoutError``, python-statemachine's ``TransitionNotAllowed``). Imports nothing
but the standard library.

The tree (other bases in brackets, then where the class lives)::

    RollsafeError
    ├── MissingExtra [ImportError]                    rollsafe.errors
    ├── InvalidArgument [ValueError]                  rollsafe.errors (a caller's input)
    │   ├── InvalidArgumentType [TypeError]           rollsafe.errors (of the wrong type)
    │   ├── FleetConfigError                          rollsafe.fleet (also a FleetError)
    │   └── InvalidRequest                            rollsafe.gateway.requests (a 400)
    ├── BucketFormatError [ValueError]                rollsafe.errors (wire)
    ├── HFIndexError [ValueError]                     rollsafe.wire.hf_index
    ├── UnsafePayload [ValueError]                    rollsafe.wire.unpickle
    ├── SegmentError [ValueError]                     rollsafe.wire.shm
    ├── BadJSON [ValueError]                          rollsafe.wire.strict_json
    ├── VLLMRendezvousUnavailable [ImportError]       rollsafe.wire.vllm_group
    ├── DeltaError [ValueError]                       rollsafe.wire.delta (a refused delta)
    │   └── DeltaBaseMismatch, DeltaFormatError, DeltaDigestMismatch
    ├── DeadlineExceeded [TimeoutError]               rollsafe.concurrency
    ├── LoopClosed [RuntimeError]                     rollsafe.event_loop
    ├── TransitionRefused [TransitionNotAllowed]      rollsafe.statemachines
    │   └── MissingGuardInput [ValueError]
    ├── GuardInputMissing [ValueError]                rollsafe.statemachines
    ├── LeaseError [RuntimeError]                     rollsafe.statemachines.export
    ├── MachineTerminated [RuntimeError]              rollsafe.statemachines.base
    ├── OperationError [RuntimeError]                 rollsafe.operations (an executor bug)
    ├── StagingFailed [RuntimeError]                  rollsafe.transports.delta (sent full)
    ├── TransportError [RuntimeError]                 rollsafe.transports
    │   ├── RegisterError
    │   │   ├── NonFiniteWeights                      (the ipc / nccl sender's finite check)
    │   │   └── KeyCoverageError, ExpertGatherError   (checkpoint_engine)
    │   ├── StaleRegistration
    │   └── CheckpointEngineUnavailable, P2PUnavailable, ProcessGroupError
    ├── HFExportError                                 rollsafe.hf
    │   ├── ExportInputError [ValueError]
    │   │   └── EmptyExport, DuplicateTensorName, NotATensor, UnsupportedTensor
    │   ├── ExportExists, ExportBusy, ExportVerificationError
    │   ├── ExportFailed
    │   │   └── ExportAbandoned
    │   └── UnknownExport [KeyError]
    ├── WriteAborted                                  rollsafe.hf.writer
    ├── EngineError                                   rollsafe.adapters.engines (clients)
    │   ├── EngineUnavailable
    │   │   └── EngineTimeout
    │   ├── EngineRequestError
    │   │   └── EngineOperationFailed
    │   ├── EngineNotSupported
    │   │   └── NoWeightChecker
    │   ├── EngineAsleep
    │   ├── EventLoopError [RuntimeError]         (adapters.engines.aio: not on its loop)
    │   ├── HttpFailure                             (adapters.engines.pool; aio maps it)
    │   │   └── HttpTimeout
    │   ├── StreamProtocolError                     (adapters.engines.streaming)
    │   ├── StandbyLost                             (a standby's engine died: start afresh)
    │   └── EngineStartError
    │       └── EngineStartTimeout
    ├── ContractError, UnsupportedVersion [ValueError] rollsafe.adapters.engines.contract
    ├── ServerError                                   rollsafe.adapters.reference_engine (server)
    │   ├── BadRequest
    │   │   └── LimitExceeded, WeightUpdateError (DeltaRefused), Unsupported
    │   ├── RequestTimeout, StartupError, WorkerFailed, EngineDead
    │   └── ServerUnavailable
    │       └── EngineBusy, EnginePaused, RankFailure, BodyBudgetExceeded
    ├── HandoffError [ValueError]                     rollsafe.adapters.reference_engine
    ├── LayoutError [ValueError]                      rollsafe.engine_layout
    ├── ForkRequestError [ValueError]                 rollsafe.adapters.reference_engine.zygote
    ├── PlacementUnavailable [RuntimeError]           rollsafe.adapters.ray.placement
    ├── SharedExportUnreadable [RuntimeError]         rollsafe.adapters.ray.exports
    ├── ExportPullRefused [RuntimeError]              rollsafe.adapters.ray.exports
    ├── ExportPullTimeout [TimeoutError]              rollsafe.adapters.ray.exports
    ├── FleetError                                    rollsafe.registry (the fleet's root)
    │   ├── UnknownGroup [KeyError]
    │   ├── DuplicateGroup, OverlappingRanks, FleetVersionRegression [ValueError]
    │   ├── FleetConfigError [InvalidArgument], FleetNotStarted [RuntimeError]
    │   ├── RouterError
    │   │   └── NoRoutableGroup, RequestFailed
    │   │                          └── ContinuationFailed
    │   ├── SyncError
    │   │   └── SyncVersionError [ValueError]
    │   └── RecoveryError
    │       └── RecoveryClosed, StepTimeout [TimeoutError]
    ├── RunFileError [ValueError]                     rollsafe.observe.runfile
    ├── TraceError [ValueError]                       rollsafe.verify.replay
    │   └── TruncatedTraceError
    ├── DiagramCheckError [RuntimeError]              rollsafe.diagrams
    ├── TrainerError [RuntimeError]                   rollsafe.demo_trainer
    └── TRLIntegrationError                           rollsafe.integrations.trl
        ├── LogprobsUnavailable, FleetSyncFailed [RuntimeError]
        └── UnsupportedByFleet [ValueError]

``tests/test_errors.py`` imports every module and fails on a public exception class outside
this tree.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BucketFormatError",
    "InvalidArgument",
    "InvalidArgumentType",
    "MissingExtra",
    "RollsafeError",
]


def _rebuilt(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    """An exception unpickled: its message arguments and its fields, its ``__init__`` not run
    (see :meth:`RollsafeError.__reduce__`)."""
    error = cls.__new__(cls, *args)
    BaseException.__init__(error, *args)
    error.__dict__.update(state)
    return error


class RollsafeError(Exception):
    """Base class of every exception rollsafe raises on purpose.

    Every one survives pickling with its message and fields (an engine's launcher raises in a
    Ray actor, and Ray pickles what crosses the process): the default pickling calls
    ``__init__`` again with the message alone, which fails for any error whose ``__init__``
    takes its fields (Ray then reports an ``UnserializableException`` instead of the error)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuilt, (type(self), self.args, dict(self.__dict__)))


class MissingExtra(RollsafeError, ImportError):
    """An optional dependency is not installed; the message names the extra that provides it."""

    def __init__(self, module: str, extra: str) -> None:
        self.module = module
        self.extra = extra
        super().__init__(
            f"this part of rollsafe needs {module!r}, which is not installed: "
            f"pip install 'rollsafe[{extra}]'",
            name=module,
        )


class InvalidArgument(RollsafeError, ValueError):
    """A caller's input is refused before anything changed: an argument, a config value, a
    path or a rank. ``key`` names it (``bucket_bytes``, ``ranks``, ``export_root``); the
    message says what was wrong and names the key too. The one shape of "bad argument"
    everywhere in rollsafe; :class:`~rollsafe.fleet.FleetConfigError` is the fleet config's."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(message)


class InvalidArgumentType(InvalidArgument, TypeError):
    """An :class:`InvalidArgument` of the wrong type (an object that is not a listener, an
    exporter or an ``int``, or options given beside an object they would build): also a
    ``TypeError``, which callers already catch."""


class BucketFormatError(RollsafeError, ValueError):
    """A bucket or payload is malformed; the message names the offending tensor or field."""

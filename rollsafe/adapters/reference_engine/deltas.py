"""How one engine rank receives a delta (``rollsafe.wire.delta``) across the calls of an update.

Owns :class:`DeltaParts`, the rank's holding area for a delta in transit, and the rules that
tell a delta's calls from an ordinary update's:

* a call that carries :data:`~rollsafe.wire.delta.DELTA_HEADER_KEY` starts a delta (a delta
  still pending is dropped: the sender started over); the header must travel in the update's
  first call (the transports send the bucket holding it first), since a dense tensor of a delta
  is named like the weight itself and could not be told from a full update's otherwise;
* a call holding an index or value tensor (``.__delta_idx__`` / ``.__delta_val__``), or only
  names the pending header still expects, continues it;
* any other call is an ordinary update: a pending delta is dropped (the sender gave it up).

Held tensors are copies (the sender's shared memory and this rank's receive buffers are reused
by the next call). Nothing of a delta touches the live weights until the update's versioned
call: then every rank builds the new tensors with :func:`~rollsafe.wire.delta.apply_delta` onto
its current weights (base version, format and result digests checked) and stages them for the
engine's all-or-nothing commit (:meth:`ReferenceEngine._two_phase`). Every refusal is a
:class:`~.errors.DeltaRefused` (HTTP 400) whose message starts with the
:class:`~rollsafe.wire.delta.DeltaError` class name; the held parts are dropped with it.

:func:`check_delta_meta` checks a distributed call's announced ``(name, shape, dtype)`` list
before anything is received, as :meth:`ShardedCausalLM.validate` does for an ordinary one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch

from rollsafe.adapters.reference_engine.errors import DeltaRefused
from rollsafe.adapters.reference_engine.model import ParamSpec
from rollsafe.wire.delta import (
    DELTA_HEADER_KEY,
    IDX_SUFFIX,
    DeltaError,
    DeltaFormatError,
    DeltaHeader,
    delta_base_name,
    is_delta_name,
)

__all__ = ["DeltaParts", "check_delta_meta", "refused"]


def refused(exc: DeltaError) -> DeltaRefused:
    """The engine's 400 for a refused delta: ``"<DeltaError class>: <message>"``."""
    return DeltaRefused(f"{type(exc).__name__}: {exc}")


def check_delta_meta(
    meta: Iterable[tuple[str, tuple[int, ...], torch.dtype]], specs: Mapping[str, ParamSpec]
) -> None:
    """Refuse (:class:`~.errors.DeltaRefused`, naming the key) a delta tensor announced with a
    shape or dtype no delta of this model has; other names are left to the model's check."""
    for name, shape, dtype in meta:
        if not is_delta_name(name):
            continue
        try:
            if name == DELTA_HEADER_KEY:
                if dtype != torch.uint8 or len(shape) != 1:
                    raise DeltaFormatError(
                        f"{name}: the header is a 1-D uint8 tensor, got {dtype} {list(shape)}",
                        key=name,
                    )
                continue
            owner = delta_base_name(name)
            spec = specs.get(owner)
            if spec is None:
                raise DeltaFormatError(f"{name!r}: no weight {owner!r} here", key=owner)
            want = (torch.int32, torch.int64) if name.endswith(IDX_SUFFIX) else (spec.dtype,)
            if dtype not in want or len(shape) != 1 or shape[0] > math.prod(spec.shape):
                raise DeltaFormatError(
                    f"{name!r}: {dtype} {list(shape)} is not a 1-D "
                    f"{'/'.join(str(d) for d in want)} of at most {math.prod(spec.shape)} "
                    f"elements (the size of {owner!r})",
                    key=owner,
                )
        except DeltaError as exc:
            raise refused(exc) from exc


class DeltaParts:
    """One rank's delta in transit: its header and the tensors received so far (copies)."""

    def __init__(self) -> None:
        self.header: DeltaHeader | None = None
        self.parts: dict[str, torch.Tensor] = {}

    @property
    def pending(self) -> bool:
        return self.header is not None

    def belongs(self, names: Sequence[str]) -> bool:
        """Whether a call of ``names`` is (part of) a delta (see the module docstring)."""
        if any(is_delta_name(n) for n in names):
            return True
        if self.header is None or not names:
            return False
        expected = self.header.wire_names() - set(self.parts)
        return all(n in expected for n in names)

    def hold(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Keep a copy of one call's delta tensors; :class:`~.errors.DeltaRefused` (the held
        parts dropped) on a bad header, a part no header announced, or one received twice."""
        try:
            self._hold(named)
        except DeltaError as exc:
            self.drop()
            raise refused(exc) from exc

    def _hold(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        headers = [t for n, t in named if n == DELTA_HEADER_KEY]
        if len(headers) > 1:
            raise DeltaFormatError("a call carries two delta headers", key=DELTA_HEADER_KEY)
        if headers:
            self.drop()  # a new delta: the sender started over
            self.header = DeltaHeader.from_tensor(headers[0])
        header = self.header
        if header is None:
            first = next(n for n, _ in named)
            raise DeltaFormatError(
                f"{first!r} arrived before the delta's header ({DELTA_HEADER_KEY}), which "
                "must come in the update's first call; nothing was applied",
                key=delta_base_name(first),
            )
        wanted = header.wire_names()
        for name, t in named:
            if name == DELTA_HEADER_KEY:
                continue
            if name not in wanted:
                raise DeltaFormatError(
                    f"{name!r} is not listed by the pending delta's header", key=name
                )
            if name in self.parts:
                raise DeltaFormatError(f"{name!r} received twice in one delta", key=name)
            try:
                self.parts[name] = t.detach().clone(memory_format=torch.contiguous_format)
            except Exception as exc:  # a tensor whose data cannot be read (meta, sparse, ...)
                raise DeltaFormatError(
                    f"{name!r} cannot be read: {type(exc).__name__}: {exc}",
                    key=delta_base_name(name),
                ) from exc

    def take(self) -> list[tuple[str, torch.Tensor]]:
        """The whole delta as received (header first), dropped from here."""
        header = self.header
        if header is None:
            raise refused(DeltaFormatError("no delta is pending", key=DELTA_HEADER_KEY))
        out = [(DELTA_HEADER_KEY, header.to_tensor()), *self.parts.items()]
        self.drop()
        return out

    def drop(self) -> None:
        self.header = None
        self.parts = {}

    @property
    def touches(self) -> tuple[str, ...]:
        return self.header.touched if self.header is not None else ()

"""Canonical weight digests shared by trainers and engines.

This module owns the one definition of "the same weights": a SHA-256 over a tensor's dtype,
shape and raw contiguous CPU bytes, and a model digest over the sorted tensor names and their
digests. Trainers and engines call the same functions, so comparing a trainer's checksum with
an engine's ``/weights_checksum`` answer is an exact equality test, not a tolerance check.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any, TypedDict, cast

import torch

__all__ = ["WeightsChecksum", "dtype_name", "model_digest", "tensor_digest", "weights_checksum"]


class WeightsChecksum(TypedDict):
    """``{"model": hex, "tensors": {name: hex}}`` as returned by :func:`weights_checksum`."""

    model: str
    tensors: dict[str, str]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling used on the wire and in digests)."""
    return str(dtype).removeprefix("torch.")


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 hex digest over ``dtype``, ``shape`` and the raw bytes of ``tensor``.

    The header is ``b"rollsafe.tensor.v1\\0<dtype>\\0<json shape>\\0"``; the bytes are those of a
    contiguous CPU copy in native (little-endian) order. Views, non-contiguous tensors and GPU
    tensors digest the same as their contiguous CPU copies.
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    h = hashlib.sha256()
    h.update(b"rollsafe.tensor.v1\0")
    h.update(dtype_name(t.dtype).encode())
    h.update(b"\0")
    h.update(json.dumps(list(t.shape)).encode())
    h.update(b"\0")
    if t.numel() > 0:
        raw = t.reshape(-1).view(torch.uint8)
        h.update(cast(Any, raw.numpy()).data)
    return h.hexdigest()


def model_digest(tensor_digests: Mapping[str, str]) -> str:
    """Digest over the sorted ``name -> tensor digest`` pairs."""
    h = hashlib.sha256()
    h.update(b"rollsafe.model.v1\0")
    for name in sorted(tensor_digests):
        h.update(name.encode())
        h.update(b"\0")
        h.update(tensor_digests[name].encode())
        h.update(b"\n")
    return h.hexdigest()


def weights_checksum(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> WeightsChecksum:
    """``{"model": hex, "tensors": {name: hex}}`` for a full set of named tensors.

    Accepts a mapping (e.g. a ``state_dict``) or an iterable of ``(name, tensor)`` pairs (e.g.
    ``model.named_parameters()``). A duplicated name raises ``ValueError``.
    """
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    digests: dict[str, str] = {}
    for name, tensor in items:
        if name in digests:
            raise ValueError(f"weights_checksum: tensor name {name!r} appears twice")
        digests[name] = tensor_digest(tensor)
    return {"model": model_digest(digests), "tensors": digests}

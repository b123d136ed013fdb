"""Contiguous parameter storage: one flat buffer per (device, dtype) for a trainer's weights.

Owns :func:`flatten_parameters`. Tensors that lie back to back in one storage travel through
the ``ipc`` and ``nccl`` transports as slices of that storage (*direct* buckets, see
:func:`rollsafe.transports.pipeline.plan_buckets`): no packing copy and no pack buffer on the
trainer's side, and for ``ipc`` a whole run in one engine call. Megatron-style trainers already
keep their parameters in such buffers; for a plain ``torch.nn.Module``, call
:func:`flatten_parameters` once after building (or loading) the model. Values, ``requires_grad``
and the ``Parameter`` objects themselves are kept, so an optimizer built before or after keeps
working (it holds the same parameters; their ``.data`` now views the flat buffer). Register the
weights in ``named_parameters()`` order, e.g. ``dict(model.named_parameters())``, so consecutive
tensors are also consecutive in the buffer.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from rollsafe.errors import InvalidArgument
from rollsafe.transports.pipeline import alloc_buffer

__all__ = ["contiguous_copy", "flatten_parameters"]


def contiguous_copy(
    named: Mapping[str, torch.Tensor], *, shared_memory: bool = False
) -> dict[str, torch.Tensor]:
    """The same tensors, copied back to back into one flat buffer per (device, dtype), in the
    mapping's order: ``{name: view of that buffer}``. ``shared_memory`` allocates CPU buffers
    in shared memory. Sparse or meta tensors raise :class:`ValueError` naming the key."""
    return _copy_into_buffers(named, shared_memory, what="tensor")[0]


def flatten_parameters(
    module: torch.nn.Module, *, shared_memory: bool = False
) -> list[torch.Tensor]:
    """Move ``module``'s parameters into one contiguous 1-D buffer per (device, dtype).

    Parameters keep their order (``named_parameters()``), values and identity. ``shared_memory``
    allocates CPU buffers in shared memory (what the CPU ``ipc`` transport can hand over without
    a copy). Returns the flat buffers. Sparse or meta parameters raise :class:`ValueError`
    naming the parameter, before anything is moved.
    """
    params = dict(module.named_parameters())
    views, flats = _copy_into_buffers(
        {n: p.data for n, p in params.items()}, shared_memory, what="parameter"
    )
    for name, p in params.items():
        p.data = views[name]
    return flats


def _copy_into_buffers(
    named: Mapping[str, torch.Tensor], shared_memory: bool, *, what: str
) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """``(views by name, flat buffers)``; checks every tensor before copying any."""
    groups: dict[tuple[torch.device, torch.dtype], list[str]] = {}
    for name, t in named.items():
        if t.layout != torch.strided or t.device.type == "meta":
            raise InvalidArgument(
                name, f"{what} {name!r}: cannot flatten a {t.layout} tensor on {t.device}"
            )
        groups.setdefault((t.device, t.dtype), []).append(name)
    views: dict[str, torch.Tensor] = {}
    flats: list[torch.Tensor] = []
    with torch.no_grad():
        for (device, dtype), names in groups.items():
            numel = sum(named[n].numel() for n in names)
            itemsize = torch.empty((), dtype=dtype).element_size()
            raw = alloc_buffer(numel * itemsize, device, shared=shared_memory)
            flat = raw[: numel * itemsize].view(dtype)
            pos = 0
            for n in names:
                t = named[n]
                views[n] = flat[pos : pos + t.numel()].view(t.shape)
                views[n].copy_(t)
                pos += t.numel()
            flats.append(flat)
    return {n: views[n] for n in named}, flats

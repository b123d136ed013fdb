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

import torch

from rollsafe.transports.pipeline import alloc_buffer

__all__ = ["flatten_parameters"]


def flatten_parameters(
    module: torch.nn.Module, *, shared_memory: bool = False
) -> list[torch.Tensor]:
    """Move ``module``'s parameters into one contiguous 1-D buffer per (device, dtype).

    Parameters keep their order (``named_parameters()``), values and identity. ``shared_memory``
    allocates CPU buffers in shared memory (what the CPU ``ipc`` transport can hand over without
    a copy). Returns the flat buffers. Sparse or meta parameters raise :class:`ValueError`
    naming the parameter, before anything is moved.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[str, torch.nn.Parameter]]] = {}
    for name, p in module.named_parameters():
        if p.layout != torch.strided or p.device.type == "meta":
            raise ValueError(
                f"parameter {name!r}: cannot flatten a {p.layout} tensor on {p.device}"
            )
        groups.setdefault((p.device, p.dtype), []).append((name, p))
    flats: list[torch.Tensor] = []
    with torch.no_grad():
        for (device, dtype), params in groups.items():
            numel = sum(p.numel() for _, p in params)
            itemsize = torch.empty((), dtype=dtype).element_size()
            raw = alloc_buffer(numel * itemsize, device, shared=shared_memory)
            flat = raw[: numel * itemsize].view(dtype)
            pos = 0
            for _, p in params:
                n = p.numel()
                view = flat[pos : pos + n].view(p.shape)
                view.copy_(p.data)
                p.data = view
                pos += n
            flats.append(flat)
    return flats

"""Whether tensors hold NaN or inf: one read of each byte, one host sync per device.

Owns :func:`non_finite_index` (the index of the first tensor holding a NaN or inf),
:func:`describe_non_finite` (the count of each, for the error message) and
:data:`FINITE_CHECKED_HEADER` (how a sender says it checked a call's tensors). Both ends of a weight
transfer use them: the reference engine refuses a non-finite update before it applies any of it,
and the ``ipc`` transport checks a version once when it is registered, so its engines need not
check it again (``docs/transports.md``, "The finite check").

How a set is reduced: floating (and complex) tensors are grouped by device and dtype; contiguous
tensors that lie back to back in one storage (a flattened bucket's views, a flat trainer
buffer's slices) become one 1-D span, so hundreds of views cost one large reduction. Each
span's inf-norm (max ``|x|``) is finite exactly when every element is (it is one of the values;
NaN propagates): a span of at least :data:`BIG_SPAN_ELEMENTS` elements gets a
``torch.linalg.vector_norm`` of its own (one pass), the smaller ones of a group share one fused
``torch._foreach_norm``. The per-span flags of a device are read back with one transfer; only
when one is false are its members reduced again to find the first bad tensor. Integer and bool
tensors are always finite.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a tensor is checked: the header needs none
    import torch

__all__ = ["BIG_SPAN_ELEMENTS", "FINITE_CHECKED_HEADER", "describe_non_finite", "non_finite_index"]

#: HTTP header of a ``/update_weights_from_tensor`` call whose sender checked every tensor of it
#: finite (value ``"1"``): the reference engine then skips its own pass. A header, not a body
#: field, so the body stays exactly SGLang's (SGLang ignores the header).
FINITE_CHECKED_HEADER = "X-Rollsafe-Finite-Checked"

#: Spans of at least this many elements (512 MiB of bf16) are reduced alone by ``vector_norm``,
#: not in the fused multi-tensor launch, which splits a huge tensor into many small chunks (on an
#: H200, 8 GB flat: 2.3 ms alone against 5.1 ms fused); smaller ones are cheaper fused.
BIG_SPAN_ELEMENTS = 1 << 28


def _finite_flags(group: list[torch.Tensor]) -> torch.Tensor:
    """A 1-D bool tensor (on ``group``'s device): whether each tensor is all-finite, by its
    inf-norm (finite exactly when every element is: it is one of the values, NaN propagates).
    Spans of at least :data:`BIG_SPAN_ELEMENTS` elements get a ``vector_norm`` launch of their
    own; the rest share one ``_foreach_norm``; one ``stack`` gathers the norms."""
    import torch

    inf = float("inf")
    big = [i for i, t in enumerate(group) if t.numel() >= BIG_SPAN_ELEMENTS]
    small = [i for i in range(len(group)) if i not in set(big)]
    norms: list[torch.Tensor | None] = [None] * len(group)
    for i in big:
        norms[i] = _norm(group[i], inf)
    if small:
        try:
            got: Sequence[torch.Tensor] = torch._foreach_norm([group[i] for i in small], inf)
        except (RuntimeError, NotImplementedError):  # a dtype without a norm kernel (float8)
            got = [_norm(group[i], inf) for i in small]
        for i, n in zip(small, got, strict=True):
            norms[i] = n
    return torch.isfinite(torch.stack([n.reshape(()) for n in norms if n is not None]))


def _norm(t: torch.Tensor, order: float) -> torch.Tensor:
    import torch

    try:
        out: torch.Tensor = torch.linalg.vector_norm(t, order)
    except (RuntimeError, NotImplementedError):  # float8: no norm kernel
        out = torch.linalg.vector_norm(t.float(), order)
    return out


def non_finite_index(tensors: Sequence[torch.Tensor]) -> int | None:
    """Index of the first tensor holding a NaN or inf, or ``None`` (see the module docstring:
    each byte read once, one host sync per device when every tensor is finite)."""
    import torch

    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if (t.dtype.is_floating_point or t.dtype.is_complex) and t.numel() > 0:
            groups.setdefault((t.device, t.dtype), []).append(i)
    if not groups:
        return None
    flags: dict[torch.device, list[tuple[list[list[int]], torch.Tensor]]] = {}
    with torch.no_grad():
        for (device, _), idx in groups.items():
            spans = _spans(tensors, idx)
            ok = _finite_flags([view for view, _ in spans])
            flags.setdefault(device, []).append(([members for _, members in spans], ok))
    bad: list[int] = []
    for per_device in flags.values():
        every = torch.cat([ok for _, ok in per_device])
        if bool(every.all()):  # the one host sync of this device
            continue
        got = every.cpu().tolist()
        order = [members for spans, _ in per_device for members in spans]
        for members, fine in zip(order, got, strict=True):
            if fine:
                continue
            if len(members) == 1:
                bad.extend(members)
                continue
            with torch.no_grad():
                member_ok = _finite_flags([tensors[i] for i in members]).cpu().tolist()
            bad.extend(i for i, f in zip(members, member_ok, strict=True) if not f)
    return min(bad) if bad else None


def _spans(tensors: Sequence[torch.Tensor], idx: list[int]) -> list[tuple[torch.Tensor, list[int]]]:
    """The tensors ``idx`` (one device and dtype) as reduction inputs: contiguous tensors that
    lie back to back in one storage become one 1-D view spanning them; anything else stays on
    its own. Returns ``(view, member indices)`` pairs."""
    out: list[tuple[torch.Tensor, list[int]]] = []
    runs: list[tuple[torch.Tensor, list[int], int]] = []  # (first tensor, members, end address)
    alone = [i for i in idx if not tensors[i].is_contiguous()]
    chained = sorted(
        (i for i in idx if tensors[i].is_contiguous()), key=lambda i: tensors[i].data_ptr()
    )
    for i in chained:
        t = tensors[i]
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        if (
            runs
            and runs[-1][2] == start
            and (runs[-1][0].untyped_storage().data_ptr() == t.untyped_storage().data_ptr())
        ):
            first, members, _ = runs[-1]
            runs[-1] = (first, [*members, i], end)
        else:
            runs.append((t, [i], end))
    for first, members, end in runs:
        if len(members) == 1:
            out.append((first, members))
            continue
        numel = (end - first.data_ptr()) // first.element_size()
        out.append((first.as_strided((numel,), (1,), first.storage_offset()), members))
    out.extend((tensors[i], [i]) for i in alone)
    return out


def describe_non_finite(t: torch.Tensor) -> str:
    """How many NaN / inf values ``t`` holds (error path only)."""
    import torch

    with torch.no_grad():
        x = t if t.dtype.is_complex else t.float() if t.dtype.itemsize == 1 else t
        nan = int(torch.isnan(x).sum())
        inf = int(torch.isinf(x).sum())
    return f"holds non-finite values ({nan} NaN, {inf} inf of {t.numel()})"

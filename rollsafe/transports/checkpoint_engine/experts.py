"""Expert gather: full expert tensors rebuilt from expert-parallel slices before registration.

Owns :class:`ExpertGather` (which tensors, which group, which dimension),
:func:`expert_signatures` (every rank must hold the same expert names) and
:func:`gather_expert_shards` (all-gather and concatenate).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollsafe.transports.checkpoint_engine.agreement import dist_module
from rollsafe.transports.checkpoint_engine.errors import ExpertGatherError
from rollsafe.transports.checkpoint_engine.sharding import listed

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ExpertGather:
    """How to rebuild full expert tensors from expert-parallel slices before registration.

    ``is_expert(name)`` picks the tensors an EP rank holds only a slice of (fused experts, e.g.
    ``...mlp.experts.w1`` of shape ``[local_experts, ...]``); the slices of the ranks of ``group``
    (a torch.distributed group; None = the default group) are concatenated along ``dim`` in
    group-rank order. Slices may be uneven along ``dim``; every other dimension and the dtype
    must match, and every rank must hold the same expert names.
    """

    is_expert: Callable[[str], bool]
    group: Any = None
    dim: int = 0

    @classmethod
    def by_pattern(
        cls, pattern: str = r"\.experts\.", group: Any = None, dim: int = 0
    ) -> ExpertGather:
        """Experts are the keys matching the regular expression ``pattern``."""
        rx = re.compile(pattern)
        return cls(lambda name: rx.search(name) is not None, group, dim)


def expert_signatures(
    items: Sequence[tuple[str, torch.Tensor]], spec: ExpertGather
) -> dict[str, list[tuple[int, ...]]]:
    """Collective: ``{expert name: [slice shape of each group rank]}``, validated across ranks.

    Raises :class:`ExpertGatherError` naming the key and rank when ranks hold different expert
    names, dtypes, or shapes that differ outside ``dim``.
    """
    dist = dist_module()
    local = [
        (n, tuple(int(d) for d in t.shape), str(t.dtype)) for n, t in items if spec.is_expert(n)
    ]
    world = dist.get_world_size(spec.group)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, local, group=spec.group)
    names0 = [n for n, _, _ in every[0]]
    for r, sig in enumerate(every):
        names = [n for n, _, _ in sig]
        if names != names0:
            diff = sorted(set(names) ^ set(names0)) or names
            raise ExpertGatherError(
                f"expert gather: group rank {r} holds expert keys that differ from rank 0's "
                f"(or are in another order): {listed(diff)}"
            )
    out: dict[str, list[tuple[int, ...]]] = {}
    for i, name in enumerate(names0):
        shapes = [every[r][i][1] for r in range(world)]
        dtypes = {every[r][i][2] for r in range(world)}
        if len(dtypes) != 1:
            raise ExpertGatherError(
                f"expert gather: {name!r} has dtypes {sorted(dtypes)} across ranks"
            )
        s0 = shapes[0]
        d = spec.dim if spec.dim >= 0 else spec.dim + len(s0)
        if not 0 <= d < len(s0):
            raise ExpertGatherError(f"expert gather: {name!r} of shape {s0} has no dim {spec.dim}")
        for r, s in enumerate(shapes):
            if len(s) != len(s0) or any(
                a != b for j, (a, b) in enumerate(zip(s, s0, strict=True)) if j != d
            ):
                raise ExpertGatherError(
                    f"expert gather: {name!r} on group rank {r} has shape {s}, incompatible with "
                    f"rank 0's {s0} outside dim {d}"
                )
        out[name] = shapes
    return out


def full_shape(shapes: Sequence[tuple[int, ...]], dim: int) -> tuple[int, ...]:
    s0 = list(shapes[0])
    d = dim if dim >= 0 else dim + len(s0)
    s0[d] = sum(s[d] for s in shapes)
    return tuple(s0)


def gather_expert_shards(
    items: Sequence[tuple[str, torch.Tensor]],
    spec: ExpertGather,
    *,
    keep: Callable[[str], bool] | None = None,
    signatures: Mapping[str, Sequence[tuple[int, ...]]] | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """Collective over ``spec.group``: replace each expert slice by the full tensor.

    Every rank takes part in every gather; a rank keeps a gathered tensor only when
    ``keep(name)`` (default: all), so a rank that does not register that key frees it at once.
    Non-expert items pass through unchanged. ``signatures`` (from :func:`expert_signatures`)
    saves the metadata exchange when the caller already has it.
    """
    import torch

    dist = dist_module()
    sigs = signatures if signatures is not None else expert_signatures(items, spec)
    world = dist.get_world_size(spec.group)
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in items:
        if name not in sigs:
            out.append((name, t))
            continue
        shapes = sigs[name]
        d = spec.dim if spec.dim >= 0 else spec.dim + t.dim()
        sizes = [s[d] for s in shapes]
        width = max(sizes)
        src = t.contiguous()
        if t.shape[d] != width:  # uneven split: pad to the widest slice, trim after
            padded_shape = list(t.shape)
            padded_shape[d] = width
            src = t.new_zeros(padded_shape)
            src.narrow(d, 0, t.shape[d]).copy_(t)
        parts = [torch.empty_like(src) for _ in range(world)]
        dist.all_gather(parts, src, group=spec.group)
        if keep is None or keep(name):
            full = torch.cat([p.narrow(d, 0, n) for p, n in zip(parts, sizes, strict=True)], dim=d)
            out.append((name, full))
        del parts, src
    return out

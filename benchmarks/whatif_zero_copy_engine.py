"""What-if launcher: the reference engine with a zero-copy staging path (benchmarks only).

Runs ``python -m rollsafe.adapters.reference_engine`` (same arguments) after patching rank 0's
weight staging so the CPU benchmark can show what the engine-side copies cost. NOT the shipped
engine and never used by tests or the library:

* ``/update_weights_from_tensor``: stage the decoded shared-memory **views** instead of copying
  them into fresh private buffers; ``commit`` (same request, before the answer) copies them
  into the live weights once. Shipped engine: decode -> copy into freshly allocated staging
  (page faults) -> copy into the weights: two copies per byte.
* ``/update_weights_from_distributed`` (flattened): receive into a receive buffer kept between
  calls (no fresh allocation and page faults per call) and stage views of it (no second copy);
  commit copies once. Shipped engine: fresh buffer per call -> copy into fresh staging -> copy
  into the weights.

Only rank 0 is patched (``--ranks 1``): spawned rank processes import the unpatched modules.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch


def patch() -> None:
    from rollsafe.adapters.reference_engine import ranks, weights
    from rollsafe.adapters.reference_engine.model import LM_HEAD

    def stage_views(model: Any, named: list[tuple[str, torch.Tensor]], where: str) -> None:
        model.validate(((n, tuple(t.shape), t.dtype) for n, t in named), where=where)
        for name, t in named:
            model._staged[name] = t[model.row_start : model.row_end] if name == LM_HEAD else t

    def op_stage_tensor(self: Any, entry: Any) -> None:
        named = weights.decode_tensor_entry(entry, rank=self.rank)
        stage_views(self.model, named, f"serialized_named_tensors[{self.rank}]")

    buffers: dict[tuple[torch.dtype, str], torch.Tensor] = {}

    def op_stage_distributed(self: Any, group_name: str, meta: Any, flattened: bool) -> None:
        pg = self.weight_groups[group_name]
        if not flattened:
            named = weights.receive_broadcast(pg, meta, flattened=False, device=self.device)
            self.model.stage(named, where=f"rank {self.rank}")
            return
        dtype = meta[0][2]
        total = sum(math.prod(s) for _, s, _ in meta)
        key = (dtype, str(self.device))
        buf = buffers.get(key)
        if buf is None or buf.numel() < total:
            buf = torch.empty(total, dtype=dtype, device=self.device)
            buffers[key] = buf
        flat = buf[:total]
        pg.broadcast(flat, 0).wait()
        named, pos = [], 0
        for name, shape, _ in meta:
            n = math.prod(shape)
            named.append((name, flat[pos : pos + n].view(shape)))
            pos += n
        stage_views(self.model, named, f"rank {self.rank}")

    ranks.RankRuntime.op_stage_tensor = op_stage_tensor  # type: ignore[method-assign]
    ranks.RankRuntime.op_stage_distributed = op_stage_distributed  # type: ignore[method-assign]


if __name__ == "__main__":
    patch()
    from rollsafe.adapters.reference_engine.__main__ import main

    sys.exit(main())

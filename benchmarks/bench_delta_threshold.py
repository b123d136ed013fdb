"""Where a changed tensor should go dense in a delta (``rollsafe.wire.delta.DENSE_FRACTION``).

For one bf16 tensor (4 MiB by default) with a fraction of its elements changed (0.5 .. 50 %),
times side by side the work that differs between the two forms of a touched tensor (the change
count and the result digests are the same for both, so they are left out):

* sparse: the sender's ``changed_indices`` + ``gather_bits`` (:mod:`rollsafe.wire.delta`),
  the receiver's clone of its current tensor + ``scatter_bits``;
* dense: the receiver's copy of the whole received tensor;

and the bytes of each (index int32 + value bf16 per changed element, against the whole tensor).
End to end = that time + the bytes at ``--wire-gbps`` (default 2.0 GB/s, the gloo broadcast rate
measured in ``rollsafe.transports.nccl``). Prints one row per fraction and the largest fraction
at which sparse is still not slower end to end; bytes alone break even at
``itemsize / (itemsize + 4)`` (33 % for bf16). Best of ``--repeat`` runs (a shared host: the
minimum is the least disturbed run), one torch thread.

    python benchmarks/bench_delta_threshold.py [--mib 4] [--repeat 21] [--device cpu]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from rollsafe.wire.delta import changed_indices, gather_bits, scatter_bits

FRACTIONS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.33, 0.4, 0.5)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_s(fn: Callable[[], object], repeat: int, device: torch.device) -> float:
    times = []
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--mib", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=21)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--wire-gbps", type=float, nargs="+", default=[2.0, 1.25, 0.125])
    args = ap.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    numel = int(args.mib * (1 << 20)) // 2
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(numel, generator=gen).to(torch.bfloat16).to(device)
    print(f"bf16 tensor of {numel} elements ({args.mib} MiB) on {device}")
    print("fraction  sparse_ms  dense_ms  sparse_MB  dense_MB")
    rows: list[tuple[float, float, float, int, int]] = []
    for frac in FRACTIONS:
        new = base.clone()
        pick = torch.randperm(numel, generator=gen)[: int(frac * numel)].to(device)
        new[pick] = (new[pick].float() + 1.0).to(torch.bfloat16)
        b, n = base.view(torch.int16), new.view(torch.int16)
        changed = changed_indices(n, b).numel()

        def sparse(n: torch.Tensor = n, b: torch.Tensor = b) -> None:
            i = changed_indices(n, b, torch.int32)  # the wire form
            v = gather_bits(n, i)
            out = b.clone()
            scatter_bits(out, i, v)

        def dense(n: torch.Tensor = n) -> None:
            n.clone()

        s_s = _best_s(sparse, args.repeat, device)
        d_s = _best_s(dense, args.repeat, device)
        s_b, d_b = changed * (4 + 2), numel * 2
        rows.append((frac, s_s, d_s, s_b, d_b))
        print(
            f"{frac:8.3f}  {s_s * 1e3:9.3f}  {d_s * 1e3:8.3f}  {s_b / 1e6:9.3f}  {d_b / 1e6:8.3f}"
        )
    for gbps in args.wire_gbps:
        wire = gbps * 1e9
        best = 0.0
        for frac, s_s, d_s, s_b, d_b in rows:
            if s_s + s_b / wire <= d_s + d_b / wire:
                best = frac
        print(f"wire {gbps:g} GB/s: sparse not slower end to end up to {best:.3f} changed")


if __name__ == "__main__":
    main()

"""Check rollsafe's torch reimplementation of SGLang's ``gpu_tensor_hash`` on a GPU, and time it.

What CPU tests cannot show (``tests/test_checksum_upstream.py`` runs the CPU side):

1. ``rollsafe.checksum.sglang_gpu_hash`` gives the same value on CUDA as on the CPU (torch's
   int32 wrap-around, shifts and reductions behave alike on both devices);
2. where SGLang's Triton kernel can be imported, it gives the same value as ours: either from an
   installed ``sglang`` (``sglang.kernels.ops.memory.gpu_tensor_hash``) or from that one file
   extracted from the pinned wheel and passed as ``--kernel-file`` (it imports only torch and
   triton; rollsafe does not ship it). Without either, this part is reported as skipped;
3. the time to hash 8 GB on the GPU (issue 16 wants <= 0.5 s on an H200), one 8 GB bf16 tensor
   and the same bytes as ~400 tensors, with the peak extra GPU memory.

Usage: ``python3 benchmarks/gpu/check_sglang_gpu_hash.py --out result.json [--kernel-file
/path/to/sglang/kernels/ops/memory/gpu_tensor_hash.py] [--gb 8] [--smoke]``. Exit status 1 when
any compared value differs. ``--smoke`` runs small sizes only (works on CPU: CUDA parts skipped).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]


def _checksum_module() -> Any:
    """``rollsafe.checksum`` (by file path if the package's own dependencies are missing: the
    module needs only torch)."""
    sys.path.insert(0, str(ROOT))
    try:
        return importlib.import_module("rollsafe.checksum")
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "rollsafe_checksum", ROOT / "rollsafe/checksum.py"
        )
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod


_ck = _checksum_module()
sglang_gpu_hash: Callable[[torch.Tensor], int] = _ck.sglang_gpu_hash
weights_checksum: Callable[..., Any] = _ck.weights_checksum

TILE = 8192


def load_kernel(path: str | None) -> tuple[Callable[[torch.Tensor], int] | None, str]:
    """SGLang's ``gpu_tensor_hash`` and where it came from, or ``(None, why not)``."""
    try:
        if path:
            spec = importlib.util.spec_from_file_location("sglang_gpu_tensor_hash", path)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod.gpu_tensor_hash, f"file {path}"
        mod = importlib.import_module("sglang.kernels.ops.memory.gpu_tensor_hash")
        return mod.gpu_tensor_hash, "installed sglang"
    except Exception as exc:  # no triton, no sglang, no file: report, do not fail
        return None, f"not available: {type(exc).__name__}: {exc}"


def cases(smoke: bool) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out: list[tuple[str, torch.Tensor]] = []
    sizes = [1, 3, 4, 5, 8191, 8192, 8193, 3 * TILE + 17]
    if not smoke:
        # > 1024 tiles: SGLang's tree reduction takes two levels (three would need 32 GiB);
        # 2**24 + 1 words: one past our vectorised step; then several steps.
        sizes += [1024 * TILE + 1, (1 << 24) + 1, 5 * (1 << 24) + 12345]
    for n in sizes:
        for dtype in (torch.uint8, torch.bfloat16, torch.float32):
            if dtype.is_floating_point:
                t = (torch.randn(n, generator=gen) * 50).to(dtype)
            else:
                t = torch.randint(0, 256, (n,), generator=gen, dtype=torch.int64).to(dtype)
            out.append((f"{dtype}".removeprefix("torch.") + f"[{n}]", t))
    return out


def timed(fn: Callable[[], Any], repeats: int) -> tuple[Any, float]:
    value = fn()  # warm-up (allocator, kernels)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        value = fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return value, best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="sglang_gpu_hash.json")
    ap.add_argument("--kernel-file", default=None, help="SGLang's gpu_tensor_hash.py (optional)")
    ap.add_argument("--gb", type=float, default=8.0, help="bytes to time, in GB (1e9)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="small sizes; runs without CUDA")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    kernel, kernel_from = load_kernel(args.kernel_file) if cuda else (None, "no CUDA")
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "kernel": kernel_from,
        "cases": [],
    }
    bad = 0

    def save() -> None:
        Path(args.out).write_text(json.dumps(result, indent=1))

    for name, t in cases(args.smoke):
        row: dict[str, Any] = {"case": name, "cpu": f"{sglang_gpu_hash(t):016x}"}
        if cuda:
            tc = t.cuda()
            row["cuda"] = f"{sglang_gpu_hash(tc):016x}"
            if kernel is not None:
                row["sglang_kernel"] = f"{int(kernel(tc)):016x}"
        row["equal"] = len({v for k, v in row.items() if k not in ("case",)}) == 1
        bad += not row["equal"]
        result["cases"].append(row)
        print(json.dumps(row), flush=True)
        save()

    if cuda and not args.smoke:
        n_elems = int(args.gb * 1e9) // 2
        free0 = torch.cuda.mem_get_info()[0]
        big = torch.empty(n_elems, dtype=torch.bfloat16, device="cuda")
        big.view(torch.int16).random_(-(1 << 15), 1 << 15)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ours, s = timed(lambda: sglang_gpu_hash(big), args.repeats)
        timing: dict[str, Any] = {
            "bytes": big.numel() * 2,
            "ours_one_tensor_s": round(s, 4),
            "ours_GBps": round(big.numel() * 2 / s / 1e9, 1),
            "ours_peak_extra_bytes": torch.cuda.max_memory_allocated() - base,
            "free_before_bytes": free0,
        }
        if kernel is not None:
            theirs, ks = timed(lambda: int(kernel(big)), args.repeats)
            timing["sglang_kernel_s"] = round(ks, 4)
            timing["equal"] = theirs == ours
            bad += theirs != ours
        # the same bytes as ~400 tensors (a 4B model's layout), through the model digest
        step = n_elems // 398 + 1
        named = {f"w{i}": big[i * step : (i + 1) * step] for i in range(-(-n_elems // step))}
        _, ms = timed(lambda: weights_checksum(named, "sglang-gpu"), args.repeats)
        timing["ours_model_digest_398_tensors_s"] = round(ms, 4)
        result["timing_8gb"] = timing
        print(json.dumps(timing), flush=True)
        del big, named
    result["all_equal"] = bad == 0
    save()
    print(f"all equal: {bad == 0}; kernel: {kernel_from}")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark the ``ipc`` and ``nccl`` (gloo) weight transports on CPU against their baselines.

Builds a Llama config directory whose weights total about ``--size-gib`` GiB (no weight files:
the reference engine starts with ``--load-format dummy``), makes trainer tensors with exactly
the engine's names and shapes, and measures in one run:

* ``memcpy``: single-thread ``torch`` copy of one buffer of the same size (warm destination);
* ``ipc``: :class:`~rollsafe.transports.IPCTransport` pushing every tensor into the engine
  through ``/update_weights_from_tensor`` (shared memory, flattened buckets), per bucket size;
* ``gloo``: a raw gloo broadcast of one flat buffer of the same size between two processes
  (warm receive buffer);
* ``nccl``: :class:`~rollsafe.transports.NCCLTransport` (gloo backend) into the engine through
  ``/init_weights_update_group`` + ``/update_weights_from_distributed``, per bucket size;
* ``groups``: what per-target groups cost: a raw broadcast to two receivers in one group (world
  3) versus two concurrent broadcasts in two groups (world 2 each), same bytes.

Every transport run ends with the engine's ``/weights_checksum`` compared to the trainer's.
Timings are the best of ``--repeats`` updates after one warm-up. Ratios are taken within this
run. Prints a table and writes ``benchmarks/results/transports_cpu.json``.

    .venv/bin/python benchmarks/bench_transports_cpu.py [--size-gib 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

import engine_helpers  # noqa: E402
from engine_helpers import free_port, start_engine  # noqa: E402

from rollsafe.adapters.engines import SGLangClient  # noqa: E402
from rollsafe.fleet.weights_check import sglang_model_digest  # noqa: E402
from rollsafe.ports import EngineTarget  # noqa: E402
from rollsafe.transports import IPCTransport, NCCLTransport  # noqa: E402
from rollsafe.transports.contiguous import contiguous_copy  # noqa: E402
from rollsafe.transports.pipeline import direct_view  # noqa: E402
from rollsafe.wire.group import open_weight_update_group  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20


# ---------------------------------------------------------------------------- model shapes
def llama_config(size_bytes: int, dtype: str) -> Any:
    """A Llama config (hidden 1536, intermediate 4096, 12/4 heads, vocab 32000) whose number
    of layers brings the weights closest to ``size_bytes``."""
    from transformers import LlamaConfig

    hidden, inter, heads, kv, vocab = 1536, 4096, 12, 4, 32000
    head_dim = hidden // heads
    item = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    per_layer = 2 * hidden * hidden + 2 * hidden * kv * head_dim + 3 * hidden * inter + 2 * hidden
    fixed = 2 * vocab * hidden + hidden
    layers = max(1, round((size_bytes / item - fixed) / per_layer))
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        torch_dtype=dtype,
    )


def write_config_dir(config: Any, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    return path


def engine_named_shapes(config: Any) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of every parameter the engine holds (a meta-device instantiation)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        auto: Any = AutoModelForCausalLM
        model = auto.from_config(config)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def make_weights(
    shapes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes:
        t = torch.empty(shape, dtype=torch.float32)
        t.uniform_(-0.05, 0.05, generator=gen)
        out[name] = t.to(dtype)
    return out


def total_bytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


# ---------------------------------------------------------------------------- baselines
def memcpy_bandwidth(nbytes: int, repeats: int) -> dict[str, Any]:
    """Single-thread copy of one ``nbytes`` buffer into a warm destination (best of N)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.empty(nbytes, dtype=torch.uint8)
        src.fill_(1)
        dst = torch.empty_like(src)
        dst.fill_(0)
        times = []
        for _ in range(max(3, repeats)):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    best = min(times)
    return {"seconds": round(best, 4), "gb_s": round(nbytes / best / 1e9, 3)}


def _gloo_receiver(port: int, rank: int, world: int, group: str, numel: int, n: int) -> None:
    torch.set_num_threads(1)
    g = open_weight_update_group(
        master_address="127.0.0.1",
        master_port=port,
        rank=rank,
        world_size=world,
        group_name=group,
        timeout_s=300,
    )
    buf = torch.zeros(numel, dtype=torch.float32)  # warm: pages touched before timing
    for _ in range(n):
        g.broadcast(buf, 0).wait()
    g.close()


def gloo_broadcast(nbytes: int, repeats: int) -> dict[str, Any]:
    """Raw gloo broadcast of one flat buffer, trainer -> one receiver process (best of N)."""
    numel = nbytes // 4
    n = max(2, repeats) + 1
    ctx = mp.get_context("spawn")
    port = free_port()
    proc = ctx.Process(target=_gloo_receiver, args=(port, 1, 2, "raw", numel, n))
    proc.start()
    g = open_weight_update_group(
        master_address="127.0.0.1",
        master_port=port,
        rank=0,
        world_size=2,
        group_name="raw",
        timeout_s=300,
    )
    buf = torch.ones(numel, dtype=torch.float32)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        g.broadcast(buf, 0).wait()
        times.append(time.perf_counter() - t0)
    proc.join(60)
    g.close()
    best = min(times[1:])
    return {"seconds": round(best, 4), "gb_s": round(nbytes / best / 1e9, 3)}


def group_layouts(nbytes: int, repeats: int) -> dict[str, Any]:
    """Two receivers: one shared group (world 3) vs two per-target groups (world 2) in parallel."""
    numel = nbytes // 4
    n = max(2, repeats) + 1
    ctx = mp.get_context("spawn")
    buf = torch.ones(numel, dtype=torch.float32)
    out: dict[str, Any] = {}

    port = free_port()
    procs = [
        ctx.Process(target=_gloo_receiver, args=(port, r, 3, "shared", numel, n)) for r in (1, 2)
    ]
    for p in procs:
        p.start()
    g = open_weight_update_group(
        master_address="127.0.0.1",
        master_port=port,
        rank=0,
        world_size=3,
        group_name="shared",
        timeout_s=300,
    )
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        g.broadcast(buf, 0).wait()
        times.append(time.perf_counter() - t0)
    for p in procs:
        p.join(60)
    g.close()
    out["shared_group_s"] = round(min(times[1:]), 4)

    ports = [free_port(), free_port()]
    procs = [
        ctx.Process(target=_gloo_receiver, args=(ports[i], 1, 2, f"pt{i}", numel, n))
        for i in range(2)
    ]
    for p in procs:
        p.start()
    groups: list[Any] = [None, None]

    def join(i: int) -> None:
        groups[i] = open_weight_update_group(
            master_address="127.0.0.1",
            master_port=ports[i],
            rank=0,
            world_size=2,
            group_name=f"pt{i}",
            timeout_s=300,
        )

    joins = [threading.Thread(target=join, args=(i,)) for i in range(2)]
    for t in joins:
        t.start()
    for t in joins:
        t.join()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        works = [gr.broadcast(buf, 0) for gr in groups]
        for w in works:
            w.wait()
        times.append(time.perf_counter() - t0)
    for p in procs:
        p.join(60)
    for gr in groups:
        gr.close()
    out["per_target_groups_s"] = round(min(times[1:]), 4)
    out["per_target_cost_ratio"] = round(out["per_target_groups_s"] / out["shared_group_s"], 3)
    return out


# ---------------------------------------------------------------------------- transports
def run_transport(
    kind: str,
    model_dir: Path,
    weights: dict[str, torch.Tensor],
    want: str,
    bucket_bytes: int,
    repeats: int,
    engine_env: dict[str, str],
    engine_threads: int,
    whatif: bool = False,
    layout: str = "separate",
) -> dict[str, Any]:
    extra = ["--load-format", "dummy", "--weight-group-timeout", "300"]
    if engine_threads:
        extra += ["--threads", str(engine_threads)]
    shipped = engine_helpers.engine_command
    if whatif:  # the engine with zero-copy staging (benchmarks/whatif_zero_copy_engine.py)
        script = str(REPO / "benchmarks" / "whatif_zero_copy_engine.py")
        engine_helpers.engine_command = lambda model_dir, ranks=1, extra_args=(): [  # type: ignore[assignment]
            sys.executable,
            script,
            "--model-path",
            str(model_dir),
            "--ranks",
            str(ranks),
            *extra_args,
        ]
    try:
        eng = start_engine(model_dir, ranks=1, extra_args=extra, env=engine_env, timeout=600)
    finally:
        engine_helpers.engine_command = shipped
    try:
        client = SGLangClient(eng.url, timeout=600)
        target = EngineTarget("bench", (0,), client, 1)
        tr: IPCTransport | NCCLTransport
        if kind == "ipc":
            tr = IPCTransport(1, bucket_bytes=bucket_bytes)
        else:
            tr = NCCLTransport(1, bucket_bytes=bucket_bytes, group_timeout=300)
        src = (
            weights
            if layout == "separate"
            else contiguous_copy(weights, shared_memory=kind == "ipc")
        )
        tr.register(src, 1)
        buckets = len(tr.plans)
        direct = sum(
            1
            for plan in tr.plans
            if direct_view(
                list(src.items()), plan, device=torch.device("cpu"), shared=kind == "ipc"
            )
            is not None
        )
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            report = tr.update([target])
            dt = time.perf_counter() - t0
            if not report.ok:
                raise RuntimeError(f"{kind} update failed: {report.results}")
            if i:
                times.append(dt)
        got = client.weights_checksum(timeout=600)
        if got.model != want:
            raise RuntimeError(f"{kind}: engine checksum differs from the trainer's")
        nbytes = total_bytes(weights)
        best = min(times)
        tr.close()
        return {
            "transport": kind,
            "engine": "zero-copy what-if" if whatif else "shipped",
            "layout": layout,
            "bucket_mib": bucket_bytes // MiB,
            "buckets": buckets,
            "direct_buckets": direct,
            "seconds": round(best, 4),
            "all_seconds": [round(t, 4) for t in times],
            "gb_s": round(nbytes / best / 1e9, 3),
            "checksum_ok": True,
        }
    finally:
        eng.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ipc-buckets-mib", default="64,256")
    p.add_argument("--nccl-buckets-mib", default="64,256")
    p.add_argument(
        "--engine-env",
        default="THP_MEM_ALLOC_ENABLE=1",
        help="KEY=VALUE[,KEY=VALUE] set for the engine process ('' for none)",
    )
    p.add_argument("--engine-threads", type=int, default=0)
    p.add_argument("--skip-groups", action="store_true")
    p.add_argument(
        "--flat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run each best bucket size with the trainer's tensors in one flat buffer",
    )
    p.add_argument(
        "--whatif",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also run each best bucket size against the zero-copy what-if engine",
    )
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "transports_cpu.json"))
    args = p.parse_args()

    engine_env = dict(kv.split("=", 1) for kv in args.engine_env.split(",") if kv)
    dtype = getattr(torch, args.dtype)
    config = llama_config(int(args.size_gib * GiB), args.dtype)
    with tempfile.TemporaryDirectory(prefix="rollsafe-bench-transports-") as tmp:
        model_dir = write_config_dir(config, Path(tmp) / "model")
        t0 = time.perf_counter()
        weights = make_weights(engine_named_shapes(config), dtype, seed=1)
        nbytes = total_bytes(weights)
        want = sglang_model_digest(weights, config)  # one rank's SGLang parameters (fused)
        print(
            f"weights: {len(weights)} tensors, {nbytes / GiB:.3f} GiB {args.dtype}, "
            f"{config.num_hidden_layers} layers (built in {time.perf_counter() - t0:.1f}s)"
        )
        memcpy = memcpy_bandwidth(nbytes, args.repeats)
        gloo = gloo_broadcast(nbytes, args.repeats)
        rows: list[dict[str, Any]] = []
        for kind, sizes, base in (
            ("ipc", args.ipc_buckets_mib, memcpy),
            ("nccl", args.nccl_buckets_mib, gloo),
        ):
            mine: list[dict[str, Any]] = []
            for mib in [int(x) for x in sizes.split(",") if x]:
                mine.append(
                    run_transport(
                        kind,
                        model_dir,
                        weights,
                        want,
                        mib * MiB,
                        args.repeats,
                        engine_env,
                        args.engine_threads,
                    )
                )
            if args.flat and mine:
                best_mib = max(mine, key=lambda r: r["gb_s"])["bucket_mib"]
                mine.append(
                    run_transport(
                        kind,
                        model_dir,
                        weights,
                        want,
                        best_mib * MiB,
                        args.repeats,
                        engine_env,
                        args.engine_threads,
                        layout="flat",
                    )
                )
            if args.whatif and mine:
                best_mib = max(
                    (r for r in mine if r["layout"] == "separate"), key=lambda r: r["gb_s"]
                )["bucket_mib"]
                mine.append(
                    run_transport(
                        kind,
                        model_dir,
                        weights,
                        want,
                        best_mib * MiB,
                        args.repeats,
                        engine_env,
                        args.engine_threads,
                        whatif=True,
                    )
                )
            for row in mine:
                row["baseline"] = "memcpy" if kind == "ipc" else "gloo"
                row["ratio"] = round(row["gb_s"] / base["gb_s"], 3)
            rows.extend(mine)
        groups = None if args.skip_groups else group_layouts(nbytes, args.repeats)

    print(f"\nbaselines: memcpy 1 thread {memcpy['gb_s']} GB/s; raw gloo {gloo['gb_s']} GB/s")
    print(
        f"{'transport':<10}{'engine':<19}{'layout':<10}{'bucket MiB':>11}{'buckets':>9}"
        f"{'seconds':>9}{'GB/s':>8}{'baseline':>10}{'ratio':>7}"
    )
    for r in rows:
        print(
            f"{r['transport']:<10}{r['engine']:<19}{r['layout']:<10}{r['bucket_mib']:>11}"
            f"{r['buckets']:>9}"
            f"{r['seconds']:>9}{r['gb_s']:>8}{r['baseline']:>10}{r['ratio']:>7}"
        )
    if groups is not None:
        print(
            f"groups: shared (world 3) {groups['shared_group_s']}s, two per-target groups "
            f"{groups['per_target_groups_s']}s -> x{groups['per_target_cost_ratio']}"
        )
    best = {
        k: max(
            (r["ratio"] for r in rows if r["transport"] == k and r["engine"] == "shipped"),
            default=math.nan,
        )
        for k in ("ipc", "nccl")
    }
    result = {
        "benchmark": "transports_cpu",
        "model": {
            "config": "llama hidden 1536, intermediate 4096, heads 12/4, vocab 32000, untied",
            "layers": config.num_hidden_layers,
            "tensors": len(weights),
            "bytes": nbytes,
            "dtype": args.dtype,
        },
        "engine": {"ranks": 1, "env": engine_env, "threads": args.engine_threads or "default"},
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "machine": platform.machine(),
        },
        "baselines": {"memcpy_single_thread": memcpy, "gloo_broadcast_2proc": gloo},
        "results": rows,
        "groups": groups,
        "best_ratio": best,
        "best_ratio_by_layout": {
            k: {
                lay: max(
                    (
                        r["ratio"]
                        for r in rows
                        if r["transport"] == k and r["engine"] == "shipped" and r["layout"] == lay
                    ),
                    default=None,
                )
                for lay in ("separate", "flat")
            }
            for k in ("ipc", "nccl")
        },
        "targets": {"ipc_vs_memcpy": 0.6, "nccl_vs_gloo": 0.6},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"best ratios: {best}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

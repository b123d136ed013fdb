"""GPU benchmark of the ``ipc`` (CUDA IPC) and ``nccl`` transports with Qwen3-4B shapes.

Builds the 398 Qwen3-4B tensors (8.04 GB bf16, :mod:`qwen3_shapes`: hidden 2560, 36 layers,
intermediate 9728, 32/8 heads of 128, vocab 151936, q_norm/k_norm, tied embeddings) on
``cuda:0``, starts the reference engine with a matching ``Qwen3ForCausalLM`` config
(``--device cuda --load-format dummy --dtype bfloat16``) and measures through the real
endpoints, in one run:

* ``d2d``: device-to-device copy bandwidth of one buffer of the same size (baseline of ``ipc``);
* ``ipc``: :class:`~rollsafe.transports.IPCTransport` (CUDA IPC handles, flattened buckets) per
  bucket size with the trainer's tensors allocated one by one (``layout: separate``: every
  bucket is packed), then with the same tensors back to back in one flat buffer (``layout:
  flat``, as Megatron keeps them: one direct bucket, no packing copy, one engine call); extra
  GPU memory on the trainer side = peak allocated during the update minus allocated before it
  (expected <= 2 buckets, 0 for ``flat``);
* ``finite_check``: the all-or-nothing finite check alone on the same 8 GB, flat and separate:
  the old engine-side reduction (one ``_foreach_norm`` over the spans), today's
  :func:`rollsafe.wire.finite.non_finite_index` (a ``vector_norm`` per huge span), and the bare
  ``aminmax`` / ``vector_norm`` passes, each the median of ``--finite-repeats``; ``ipc`` rows
  register a new version before every timed update (as a trainer does every step), and say
  where the finite check ran (``check``: ``sender``, once per version at ``register``, the
  engine told so; ``engine``, ``check_finite=False``: the engine checks every call) and what
  it cost (``finite_check_s``, ``register_s``);
* ``per_call``: the fixed cost of one engine call (``/health``; a one-tensor update);
* ``nccl``: :class:`~rollsafe.transports.NCCLTransport` with the trainer (this process) and the
  engine as separate processes, plus a raw broadcast baseline between two processes. NCCL
  refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected", NCCL >= 2.5),
  so with >= 2 GPUs the engine runs on GPU 1 (backend nccl); with one GPU the same transport
  runs with backend gloo (CUDA tensors on both sides, host staging) and the row says so.

Every transport result is verified: the engine's ``/weights_checker`` model digest equals
:func:`rollsafe.fleet.weights_check.sglang_model_digest` of the trainer tensors (laid out as
SGLang holds them). The JSON at ``--out`` is
rewritten after every phase, so a time-out still leaves what was measured.

    python3 benchmarks/gpu/bench_transports_gpu.py --out /tmp/transports_gpu.json
    python3 benchmarks/gpu/bench_transports_gpu.py --smoke --out /tmp/smoke.json   # CPU, tiny
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(REPO), str(REPO / "tests"), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

from engine_helpers import free_port, start_engine  # noqa: E402
from qwen3_shapes import qwen3_4b_shapes, qwen3_config, shapes_from_config  # noqa: E402

from rollsafe.adapters.engines import SGLangClient  # noqa: E402
from rollsafe.fleet.weights_check import sglang_model_digest  # noqa: E402
from rollsafe.ports import EngineTarget  # noqa: E402
from rollsafe.transports import IPCTransport, NCCLTransport  # noqa: E402
from rollsafe.transports.contiguous import contiguous_copy  # noqa: E402
from rollsafe.wire.group import open_weight_update_group  # noqa: E402

MiB = 1 << 20

#: ``--smoke``: a tiny Qwen3 (same tensor names per layer, q_norm/k_norm, tied embeddings).
SMOKE_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
}


# ---------------------------------------------------------------------------- set-up
def model_config(smoke: bool) -> dict[str, Any]:
    cfg = qwen3_config()
    if smoke:
        cfg.update(SMOKE_CONFIG)
    return cfg


def shapes_for(cfg: dict[str, Any], smoke: bool) -> list[tuple[str, tuple[int, ...]]]:
    """The exact Qwen3-4B list (398 tensors) or, in smoke mode, the same layout, tiny."""
    return qwen3_4b_shapes() if not smoke else shapes_from_config(cfg)


def make_weights(
    shapes: list[tuple[str, tuple[int, ...]]], device: torch.device, seed: int
) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes:
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        t.uniform_(-0.05, 0.05, generator=gen)
        out[name] = t
    return out


def nbytes_of(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------- baselines
def copy_bandwidth(nbytes: int, device: torch.device, repeats: int) -> dict[str, Any]:
    """Device-to-device copy of one buffer of ``nbytes`` (median of N); CPU memcpy in smoke."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    times = []
    for _ in range(max(3, repeats)):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    best = statistics.median(times)
    return {"seconds": round(best, 4), "gb_s": round(nbytes / best / 1e9, 2)}


def _receiver(port: int, backend: str, numel: int, n: int, gpu: str | None) -> None:
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    dev = torch.device("cuda:0" if backend == "nccl" else "cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    g = open_weight_update_group(
        master_address="127.0.0.1",
        master_port=port,
        rank=1,
        world_size=2,
        group_name="raw",
        backend=backend,
        timeout_s=300,
    )
    buf = torch.zeros(numel, dtype=torch.bfloat16, device=dev)
    for _ in range(n):
        g.broadcast(buf, 0).wait()
    sync(dev)
    g.close()


def raw_broadcast(nbytes: int, backend: str, repeats: int) -> dict[str, Any]:
    """Raw broadcast of one flat buffer, this process -> one receiver (median after a warm-up)."""
    numel = nbytes // 2
    n = max(2, repeats) + 1
    port = free_port()
    gpu = "1" if backend == "nccl" else None
    proc = mp.get_context("spawn").Process(target=_receiver, args=(port, backend, numel, n, gpu))
    proc.start()
    dev = torch.device("cuda:0" if backend == "nccl" else "cpu")
    g = open_weight_update_group(
        master_address="127.0.0.1",
        master_port=port,
        rank=0,
        world_size=2,
        group_name="raw",
        backend=backend,
        timeout_s=300,
    )
    buf = torch.ones(numel, dtype=torch.bfloat16, device=dev)
    times = []
    for _ in range(n):
        sync(dev)
        t0 = time.perf_counter()
        g.broadcast(buf, 0).wait()
        sync(dev)
        times.append(time.perf_counter() - t0)
    proc.join(120)
    g.close()
    best = statistics.median(times[1:])
    return {"backend": backend, "seconds": round(best, 4), "gb_s": round(nbytes / best / 1e9, 2)}


# ---------------------------------------------------------------------------- transports
def timed_updates(
    tr: IPCTransport | NCCLTransport,
    target: EngineTarget,
    repeats: int,
    device: torch.device,
    register: Any = None,
) -> tuple[list[float], int]:
    """Warm-up + ``repeats`` updates; returns times and the peak extra bytes allocated.
    ``register(i)``, when given, runs (untimed) before update ``i``: a new version each time."""
    times: list[float] = []
    peak_extra = 0
    for i in range(repeats + 1):
        if register is not None:
            register(i)
        sync(device)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        report = tr.update([target])
        sync(device)
        dt = time.perf_counter() - t0
        if not report.ok:
            raise RuntimeError(f"{tr.name} update failed: {report.results}")
        if device.type == "cuda":
            peak_extra = max(peak_extra, torch.cuda.max_memory_allocated(device) - before)
        if i:
            times.append(dt)
    return times, peak_extra


def finite_check_bench(
    weights: dict[str, torch.Tensor], device: torch.device, repeats: int
) -> dict[str, Any]:
    """The finite check alone over the set, flat (one buffer) and separate; median seconds."""
    from rollsafe.wire import finite

    def old_engine_check(tensors: list[torch.Tensor]) -> bool:
        # the engine's reduction before issue #28: one _foreach_norm over the merged spans
        spans = finite._spans(tensors, list(range(len(tensors))))
        norms = torch._foreach_norm([v for v, _ in spans], float("inf"))
        return bool(torch.isfinite(torch.stack([n.reshape(()) for n in norms])).all())

    def timed(fn: Any) -> float:
        fn()
        sync(device)
        times = []
        for _ in range(repeats):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    out: dict[str, Any] = {"repeats": repeats}
    flat = contiguous_copy(weights)
    whole = next(iter(flat.values()))
    buf = whole.as_strided((sum(t.numel() for t in flat.values()),), (1,), 0)
    for layout, src in (("flat", flat), ("separate", weights)):
        tensors = list(src.values())
        rows: dict[str, Any] = {
            "old_foreach_norm_s": timed(lambda ts=tensors: old_engine_check(ts)),
            "non_finite_index_s": timed(lambda ts=tensors: finite.non_finite_index(ts)),
        }
        if layout == "flat":
            rows["bare_aminmax_s"] = timed(lambda b=buf: torch.aminmax(b))
            rows["bare_vector_norm_inf_s"] = timed(
                lambda b=buf: torch.linalg.vector_norm(b, float("inf"))
            )
            rows["bare_sum_s"] = timed(lambda b=buf: b.sum(dtype=torch.float32))
        nbytes = nbytes_of(src)
        out[layout] = {
            k: {"seconds": round(v, 5), "read_gb_s": round(nbytes / v / 1e9, 1)}
            for k, v in rows.items()
        }
    # a NaN in the last tensor of the flat buffer is found and named
    last = list(flat)[-1]
    flat[last].view(-1)[-1] = float("nan")
    out["flat_nan_found_at_last"] = finite.non_finite_index(list(flat.values())) == len(flat) - 1
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def per_call_overhead(
    client: SGLangClient, weights: dict[str, torch.Tensor], n: int = 20
) -> dict[str, Any]:
    """Fixed cost of one engine call: ``/health`` (HTTP alone) and ``/update_weights_from_tensor``
    with a one-tensor bucket (HTTP + payload decode + CUDA IPC open/close + commit + sync)."""
    from rollsafe.wire.bucket import pack_buckets, serialize_bucket

    name = min(weights, key=lambda k: weights[k].numel())
    bucket = next(iter(pack_buckets([(name, weights[name])], 1 << 20)))
    health, update = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        client.health(retry=False)
        health.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        client.update_weights_from_tensor(
            [serialize_bucket(bucket)], load_format="flattened_bucket", flush_cache=False
        )
        update.append(time.perf_counter() - t0)
    return {
        "tensor": name,
        "health_median_ms": round(sorted(health)[n // 2] * 1e3, 3),
        "tiny_update_median_ms": round(sorted(update)[n // 2] * 1e3, 3),
    }


def plans_of(tr: IPCTransport) -> tuple[Any, ...]:
    return tr.plans


def profile_client(tr: IPCTransport, target: EngineTarget, device: torch.device) -> list[str]:
    """cProfile of one more update on the trainer's side: the 25 costliest functions (own
    time), as text lines ``ncalls tottime cumtime where``; then the same update timed without
    the profiler, phase by phase (``phase ...`` lines)."""
    import cProfile
    import pstats

    tr.register(tr._items, (tr.version or 0) + 1)  # a first update, as the timed ones
    prof = cProfile.Profile()
    sync(device)
    prof.enable()
    tr.update([target])
    sync(device)
    prof.disable()
    st = pstats.Stats(prof)
    stats: Any = st.stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:25]
    return phase_times(tr, target, device) + [
        f"{cc} {tt * 1e3:.3f}ms {ct * 1e3:.3f}ms {Path(f).name}:{ln}({fn})"
        for (f, ln, fn), (cc, _nc, tt, ct, _callers) in rows
    ]


def phase_times(tr: IPCTransport, target: EngineTarget, device: torch.device) -> list[str]:
    """One more first update of a new version, its trainer-side phases timed by wrapping the
    transport's own steps (ms): staleness check, registration machine, set-up, the engine call
    (HTTP + the engine's handler), tear-down, and the rest."""
    import rollsafe.transports.base as base_mod

    marks: list[tuple[str, float]] = []
    orig: dict[str, Any] = {}

    def wrap(obj: Any, name: str, label: str) -> None:
        fn = getattr(obj, name)
        orig[f"{id(obj)}.{name}"] = (obj, name, fn)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                marks.append((label, time.perf_counter() - t0))

        setattr(obj, name, timed)

    tr.register(tr._items, (tr.version or 0) + 1)  # a first update, as the timed ones
    wrap(base_mod, "_first_moved", "staleness")
    wrap(tr, "_before_push", "before_push")
    wrap(tr, "_after_push", "after_push")
    wrap(target.client, "update_weights_from_tensor", "engine_call")
    try:
        sync(device)
        t0 = time.perf_counter()
        tr.update([target])
        sync(device)
        total = time.perf_counter() - t0
    finally:
        for obj, name, fn in orig.values():
            if obj is base_mod:
                setattr(obj, name, fn)
            else:
                del obj.__dict__[name]  # the instance attribute shadowing the method
    marks.append(("rest (registration machine, threads, sync)", total - sum(t for _, t in marks)))
    out = [f"phase {label} {secs * 1e3:.3f}ms" for label, secs in marks]
    return [*out, f"phase total {total * 1e3:.3f}ms"]


def verify(client: SGLangClient, want: str, what: str) -> bool:
    got = client.weights_checksum(timeout=900)
    if got.model != want:
        raise RuntimeError(f"{what}: engine checksum differs from the trainer's")
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny Qwen3: checks the script")
    ap.add_argument("--ipc-buckets-mib", default="256,1024,2048")
    ap.add_argument("--nccl-buckets-mib", default="512")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--no-flat",
        dest="flat",
        action="store_false",
        help="skip the flat-buffer layout row (trainer tensors back to back in one buffer)",
    )
    ap.add_argument("--skip-nccl", action="store_true")
    ap.add_argument(
        "--finite-modes",
        default="sender,engine",
        help="where the ipc finite check runs, one row each for the flat layout: sender "
        "(default, once per version) and engine (check_finite=False, every call)",
    )
    ap.add_argument("--finite-repeats", type=int, default=10)
    args = ap.parse_args()

    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke for the CPU check", file=sys.stderr)
        return 2
    device = torch.device("cpu" if smoke else "cuda:0")
    gpus = 0 if smoke else torch.cuda.device_count()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg = model_config(smoke)
    result: dict[str, Any] = {
        "benchmark": "transports_gpu" if not smoke else "transports_gpu_smoke",
        "model": "Qwen3ForCausalLM, Qwen3-4B shapes" if not smoke else "tiny Qwen3 (smoke)",
        "host": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)],
        },
        "phases": {},
    }

    def save() -> None:
        out.write_text(json.dumps(result, indent=2) + "\n")

    shapes = shapes_for(cfg, smoke)
    t0 = time.perf_counter()
    weights = make_weights(shapes, device, seed=1)
    sync(device)
    nbytes = nbytes_of(weights)
    result["tensors"], result["bytes"] = len(weights), nbytes
    print(
        f"{len(weights)} tensors, {nbytes / 1e9:.3f} GB bf16 on {device} "
        f"({time.perf_counter() - t0:.1f}s)"
    )
    t0 = time.perf_counter()
    want = sglang_model_digest(weights, cfg)  # what the engine's checker reports (fused)
    result["phases"]["trainer_checksum_s"] = round(time.perf_counter() - t0, 2)
    base = copy_bandwidth(nbytes, device, args.repeats)
    result["phases"]["d2d_copy" if not smoke else "memcpy"] = base
    print(f"copy baseline: {base}")
    save()
    result["phases"]["finite_check"] = finite_check_bench(weights, device, args.finite_repeats)
    print(f"finite check: {result['phases']['finite_check']}")
    save()

    with tempfile.TemporaryDirectory(prefix="rollsafe-gpu-transports-") as tmp:
        model_dir = Path(tmp) / "qwen3"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(cfg, indent=2))
        extra = ["--load-format", "dummy", "--dtype", "bfloat16", "--weight-group-timeout", "300"]
        if not smoke:
            extra += ["--device", "cuda"]
        t0 = time.perf_counter()
        eng = start_engine(
            model_dir,
            ranks=1,
            extra_args=extra,
            timeout=900,
            env={"ROLLSAFE_ENGINE_PROFILE": "1"},
        )
        result["phases"]["engine_start_s"] = round(time.perf_counter() - t0, 1)
        save()
        try:
            client = SGLangClient(eng.url, timeout=900)
            target = EngineTarget("engine", (0,), client, 1)
            rows = []
            runs = [("separate", int(x), "sender") for x in args.ipc_buckets_mib.split(",") if x]
            if args.flat:
                for mode in [m for m in args.finite_modes.split(",") if m]:
                    runs.append(("flat", runs[-1][1] if runs else 1024, mode))
            version = 0
            for layout, mib, mode in runs:
                src = weights if layout == "separate" else contiguous_copy(weights)
                log_mark = len(eng.stderr_path.read_text(errors="replace"))
                tr = IPCTransport(1, bucket_bytes=mib * MiB, check_finite=mode == "sender")
                reg_s: list[float] = []
                check_s: list[float] = []

                def register(
                    _i: int,
                    tr: IPCTransport = tr,
                    src: Any = src,
                    reg_s: list[float] = reg_s,
                    check_s: list[float] = check_s,
                ) -> None:
                    nonlocal version
                    version += 1
                    sync(device)
                    t0 = time.perf_counter()
                    tr.register(src, version)
                    sync(device)
                    reg_s.append(time.perf_counter() - t0)
                    if tr.finite_check_s is not None:
                        check_s.append(tr.finite_check_s)

                times, extra_mem = timed_updates(tr, target, args.repeats, device, register)
                best = statistics.median(times)  # the median of the repeats
                rows.append(
                    {
                        "layout": layout,
                        "check": mode,
                        "register_s_median": round(statistics.median(reg_s[1:]), 4),
                        "finite_check_s_median": (
                            round(statistics.median(check_s[1:]), 5) if check_s[1:] else None
                        ),
                        "p95_seconds": round(sorted(times)[-1 if len(times) < 20 else -2], 4),
                        "direct_buckets": tr.direct_buckets,
                        "bucket_mib": mib,
                        "buckets": len(tr.plans),
                        "seconds": round(best, 4),
                        "all_seconds": [round(t, 4) for t in times],
                        "gb_s": round(nbytes / best / 1e9, 2),
                        "ratio_vs_copy": round(nbytes / best / 1e9 / base["gb_s"], 3),
                        "peak_extra_gpu_bytes": extra_mem,
                        "peak_extra_buckets": round(extra_mem / (mib * MiB), 2),
                    }
                )
                if layout == "flat":
                    rows[-1]["client_profile"] = profile_client(tr, target, device)
                # the engine's own account of the last update (ROLLSAFE_ENGINE_PROFILE=1)
                log = eng.stderr_path.read_text(errors="replace")[log_mark:]
                prof = [ln.split(" ", 1)[1] for ln in log.splitlines() if "rollsafe-profile" in ln]
                ends = [i for i, ln in enumerate(prof) if "http/update_weights_from_tensor" in ln]
                start = ends[-(len(plans_of(tr)) + 1)] + 1 if len(ends) > len(plans_of(tr)) else 0
                rows[-1]["engine_profile_last_update"] = prof[start:]
                tr.close()
                del src
                print(f"ipc: {rows[-1]}")
                result["phases"]["ipc"] = rows
                save()
            result["phases"]["per_call"] = per_call_overhead(client, weights)
            print(f"per call: {result['phases']['per_call']}")
            save()
            if rows:
                # the tiny updates changed one tensor: push the whole set again before checking
                tr = IPCTransport(1, bucket_bytes=rows[-1]["bucket_mib"] * MiB)
                tr.register(weights, 1)
                if not tr.update([target]).ok:
                    raise RuntimeError("ipc re-push failed")
                tr.close()
            t0 = time.perf_counter()
            rows[-1]["checksum_ok"] = verify(client, want, "ipc")
            result["phases"]["engine_checksum_s"] = round(time.perf_counter() - t0, 2)
            save()
        finally:
            eng.stop()

        if not args.skip_nccl:
            backend = "nccl" if gpus >= 2 else "gloo"
            result["phases"]["nccl_note"] = (
                "engine on GPU 1, backend nccl"
                if backend == "nccl"
                else "one GPU (or smoke): NCCL refuses two ranks on one GPU ('Duplicate GPU "
                "detected'); the same transport ran with backend gloo over CUDA tensors"
            )
            raw = raw_broadcast(nbytes, backend, args.repeats)
            result["phases"]["raw_broadcast"] = raw
            save()
            env = {"CUDA_VISIBLE_DEVICES": "1"} if backend == "nccl" else None
            eng = start_engine(model_dir, ranks=1, extra_args=extra, env=env, timeout=900)
            try:
                client = SGLangClient(eng.url, timeout=900)
                target = EngineTarget("engine", (0,), client, 1)
                rows = []
                for mib in [int(x) for x in args.nccl_buckets_mib.split(",") if x]:
                    ntr = NCCLTransport(
                        1, backend=backend, bucket_bytes=mib * MiB, group_timeout=300
                    )
                    ntr.register(weights, 2)
                    times, _ = timed_updates(ntr, target, args.repeats, device)
                    best = statistics.median(times)  # the median of the repeats
                    rows.append(
                        {
                            "backend": backend,
                            "bucket_mib": mib,
                            "buckets": len(ntr.plans),
                            "seconds": round(best, 4),
                            "all_seconds": [round(t, 4) for t in times],
                            "gb_s": round(nbytes / best / 1e9, 2),
                            "ratio_vs_raw_broadcast": round(nbytes / best / 1e9 / raw["gb_s"], 3),
                        }
                    )
                    ntr.close()
                    print(f"nccl: {rows[-1]}")
                    result["phases"]["nccl"] = rows
                    save()
                rows[-1]["checksum_ok"] = verify(client, want, "nccl")
                save()
            finally:
                eng.stop()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

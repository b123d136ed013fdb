"""GPU benchmark (issue #28): checkpoint-engine P2P over Mooncake TCP per ``MC_TCP_SLICE_SIZE``,
while another engine on the same GPU serves.

One H200. Two reference engines on GPU 0 (``--device cuda --load-format dummy``, Qwen3-4B
shapes): ``serving`` answers ``--clients`` generate loops the whole time, ``receiver`` gets the
8.04 GB set by checkpoint-engine P2P (``update(..., p2p=True)``, ``ranks=[0]``) over Mooncake's
TCP transport. Mooncake reads ``MC_TCP_SLICE_SIZE`` once per process, at its first TCP
transfer, so each slice size runs in a trainer process of its own (a one-rank NCCL group, a
:class:`~rollsafe.transports.checkpoint_engine.CheckpointEngineTransport` built with
``tcp_slice_bytes``, the variable absent from its environment): it registers the set once, then
pushes it ``--repeats`` times after one warm-up push (Mooncake connects and registers memory on
its first transfer). Reported per slice: every push's seconds, the median and p95 of the
repeats, GB/s, the serving engine's completed / failed requests per second during the pushes
against before them, and the receiver's ``/weights_checksum`` against the trainer's after the
last push. The JSON (``--out``) is rewritten after every slice.

    source .mc/env.sh && python3 benchmarks/gpu/ce_tcp_slice_sweep.py --out $OUT/slices.json
    python3 benchmarks/gpu/ce_tcp_slice_sweep.py --smoke --out /tmp/slices.json   # no GPU
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _p in (str(REPO), str(REPO / "tests"), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

MiB = 1 << 20
GiB = 1 << 30
SLICE_VARIABLE = "MC_TCP_SLICE_SIZE"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--smoke", action="store_true", help="no GPU: check arguments, write JSON")
    p.add_argument(
        "--slices-kib",
        default="16384,1024,4096,65536",
        help="slice sizes in KiB, one trainer process each, in this order",
    )
    p.add_argument(
        "--baseline-kib",
        type=int,
        default=64,
        help="Mooncake's default (64 KiB): one push, no warm-up, if time is left (0: skip)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed pushes per slice (after warm-up)")
    p.add_argument("--layers", type=int, default=None, help="Qwen3-4B with fewer layers")
    p.add_argument("--clients", type=int, default=4, help="generate loops on the serving engine")
    p.add_argument("--bucket-gib", type=float, default=2.0)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--deadline-s", type=float, default=520.0, help="start no slice after this")
    args = p.parse_args(argv)
    args.slices = [int(x) * 1024 for x in str(args.slices_kib).split(",") if x.strip()]
    if not args.slices or any(s <= 0 for s in args.slices) or args.repeats < 1:
        p.error("--slices-kib needs positive sizes and --repeats >= 1")
    return args


def pct(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``xs``."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


class Load:
    """``n`` generate loops on one engine; counts completions and failures with timestamps."""

    def __init__(self, url: str, n: int, timeout_s: float) -> None:
        from rollsafe.adapters.engines import SGLangClient

        self.ok: list[float] = []
        self.failed: list[float] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._clients = [SGLangClient(url, timeout=timeout_s) for _ in range(n)]
        self._threads = [
            threading.Thread(target=self._run, args=(c,), daemon=True) for c in self._clients
        ]
        for t in self._threads:
            t.start()

    def _run(self, client: Any) -> None:
        while not self._stop.is_set():
            try:
                client.generate([1, 2, 3, 4], sampling_params={"max_new_tokens": 8})
                with self._lock:
                    self.ok.append(time.monotonic())
            except Exception:
                with self._lock:
                    self.failed.append(time.monotonic())
                self._stop.wait(0.05)

    def rate(self, t0: float, t1: float) -> dict[str, float]:
        with self._lock:
            ok = sum(1 for t in self.ok if t0 <= t < t1)
            bad = sum(1 for t in self.failed if t0 <= t < t1)
        span = max(t1 - t0, 1e-9)
        return {"ok_per_s": round(ok / span, 2), "failed": bad, "seconds": round(span, 2)}

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        for c in self._clients:
            c.close()


def trainer(
    slice_bytes: int | None,
    pushes: int,
    port: int,
    url: str,
    layers: int | None,
    bucket_bytes: int,
    timeout_s: float,
    queue: Any,
) -> None:
    """One trainer process: one slice size, ``pushes`` P2P pushes of one registration."""
    import torch
    import torch.distributed as dist
    from multi_gpu import build_weights, model_config, nbytes_of

    from rollsafe.adapters.engines import SGLangClient
    from rollsafe.fleet.weights_check import check_engine
    from rollsafe.ports import EngineTarget
    from rollsafe.transports.checkpoint_engine import CheckpointEngineTransport

    out: dict[str, Any] = {"slice_bytes": slice_bytes, "env": os.environ.get(SLICE_VARIABLE)}
    tr: Any = None
    try:
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
        dist.init_process_group(
            "nccl",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=dev,
        )
        cfg, shapes = model_config("qwen3-4b", layers)
        weights = build_weights(shapes, dev, seed=5)
        torch.cuda.synchronize(dev)
        out["bytes"] = nbytes_of(weights)
        tr = CheckpointEngineTransport(
            master_addr="127.0.0.1",
            max_bucket_bytes=bucket_bytes,
            request_timeout_s=timeout_s,
            socket_timeout_s=timeout_s,
            p2p_protocol="tcp",
            transfer_timeout_s=timeout_s,
            tcp_slice_bytes=slice_bytes,
        )
        out["p2p_env"] = {k: v for k, v in tr.p2p_env.items()}
        out["p2p_available"], out["p2p_reason"] = bool(tr.p2p_available), tr.p2p_reason
        t0 = time.perf_counter()
        tr.register(weights, 7)
        out["register_s"] = round(time.perf_counter() - t0, 3)
        client = SGLangClient(url, timeout=timeout_s)
        target = EngineTarget("receiver", (0,), client)
        runs: list[dict[str, Any]] = []
        out["runs"] = runs
        for _ in range(pushes):
            start = time.monotonic()
            t0 = time.perf_counter()
            report = tr.update([target], p2p=True)
            torch.cuda.synchronize(dev)
            seconds = time.perf_counter() - t0
            plan = getattr(tr, "last_plan", None)
            runs.append(
                {
                    "seconds": round(seconds, 3),
                    "ok": report.ok,
                    "mode": getattr(plan, "mode", None),
                    "reason": "; ".join(r.reason for r in report.results.values())[:500],
                    "start": start,
                    "end": time.monotonic(),
                }
            )
            if not report.ok:
                break
        t0 = time.perf_counter()
        # the engine's checker against the weights laid out as SGLang holds them (fused)
        out["checksum_equal"] = check_engine(client, weights, cfg, timeout=timeout_s).equal
        out["checksum_s"] = round(time.perf_counter() - t0, 2)
        client.close()
    except BaseException as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:4000]
        out["traceback"] = traceback.format_exc()[-3000:]
    finally:
        if tr is not None:
            with contextlib.suppress(Exception):
                tr.close()
        queue.put(out)
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()


def summarize(row: dict[str, Any], warmup: bool, load: Load | None) -> dict[str, Any]:
    runs = row.get("runs") or []
    timed = runs[1:] if warmup else runs
    secs = [r["seconds"] for r in timed if r.get("ok")]
    out: dict[str, Any] = {
        "slice_bytes": row.get("slice_bytes"),
        "slice_kib": (row.get("slice_bytes") or 0) // 1024,
        "warmup_s": runs[0]["seconds"] if warmup and runs else None,
        "seconds_all": [r["seconds"] for r in timed],
        "ok": bool(runs) and all(r.get("ok") for r in runs) and "error" not in row,
    }
    if secs:
        med = statistics.median(secs)
        out.update(
            {
                "median_s": round(med, 3),
                "p95_s": round(pct(secs, 0.95), 3),
                "min_s": round(min(secs), 3),
                "gb_s": round(row["bytes"] / med / 1e9, 3),
            }
        )
    if load is not None and timed:
        spans = [(r["start"], r["end"]) for r in timed]
        during = [load.rate(a, b) for a, b in spans]
        out["serving_during"] = during
        out["serving_ok_per_s_during_median"] = statistics.median(d["ok_per_s"] for d in during)
        out["serving_failed_during"] = sum(d["failed"] for d in during)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "ce_tcp_slice_sweep",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "host": {"python": platform.python_version()},
        "ambient_" + SLICE_VARIABLE: os.environ.get(SLICE_VARIABLE),
        "slices": [],
        "skipped": [],
        "errors": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        result["elapsed_s"] = round(time.perf_counter() - started, 1)
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    import torch

    result["host"]["torch"] = torch.__version__
    if args.smoke or not torch.cuda.is_available():
        result["smoke"] = True
        result["note"] = "no GPU run: arguments checked only"
        save()
        return 0 if args.smoke else 2
    import torch.multiprocessing as mp
    from engine_helpers import free_port, start_engine
    from multi_gpu import model_config, write_model_dir

    result["host"]["gpu"] = torch.cuda.get_device_name(0)
    # the variable must be absent in the trainers: each one sets its own through the transport
    os.environ.pop(SLICE_VARIABLE, None)
    cfg, _ = model_config("qwen3-4b", args.layers)
    extra = ["--device", "cuda", "--load-format", "dummy", "--dtype", "bfloat16"]
    engines: dict[str, Any] = {}
    load: Load | None = None
    with tempfile.TemporaryDirectory(prefix="rollsafe-slices-") as tmp:
        model_dir = write_model_dir(Path(tmp) / "qwen3", cfg)
        try:
            t0 = time.perf_counter()
            threads: dict[str, Any] = {}
            for name in ("serving", "receiver"):

                def start(name: str = name) -> None:
                    engines[name] = start_engine(model_dir, extra_args=extra, timeout=600)

                threads[name] = threading.Thread(target=start, daemon=True)
                threads[name].start()
            for th in threads.values():
                th.join(700)
            if set(engines) != {"serving", "receiver"}:
                raise RuntimeError(f"engines did not start: {sorted(engines)}")
            result["engine_start_s"] = round(time.perf_counter() - t0, 1)
            load = Load(engines["serving"].url, args.clients, args.timeout_s)
            time.sleep(3.0)
            a = time.monotonic()
            time.sleep(5.0)
            result["serving_idle"] = load.rate(a, time.monotonic())
            save()
            ctx = mp.get_context("spawn")
            plan: list[tuple[int | None, int, bool]] = [
                (s, args.repeats + 1, True) for s in args.slices
            ]
            if args.baseline_kib > 0:
                plan.append((args.baseline_kib * 1024, 1, False))
            for slice_bytes, pushes, warmup in plan:
                if time.perf_counter() - started > args.deadline_s:
                    result["skipped"].append({"slice_bytes": slice_bytes, "reason": "deadline"})
                    save()
                    continue
                queue = ctx.Queue()
                proc = ctx.Process(
                    target=trainer,
                    args=(
                        slice_bytes,
                        pushes,
                        free_port(),
                        engines["receiver"].url,
                        args.layers,
                        int(args.bucket_gib * GiB),
                        args.timeout_s,
                        queue,
                    ),
                )
                proc.start()
                try:
                    row = queue.get(timeout=args.timeout_s * (pushes + 2))
                except Exception as exc:
                    row = {"slice_bytes": slice_bytes, "error": f"no result: {exc}"}
                proc.join(60)
                if proc.is_alive():
                    proc.kill()
                summary = summarize(row, warmup, load)
                summary["raw"] = {k: v for k, v in row.items() if k != "runs"}
                result["slices"].append(summary)
                if "error" in row:
                    result["errors"].append(row)
                print(
                    f"slice {summary['slice_kib']} KiB: median {summary.get('median_s')} s "
                    f"p95 {summary.get('p95_s')} s ({summary.get('gb_s')} GB/s) all "
                    f"{summary['seconds_all']} warm-up {summary['warmup_s']} serving "
                    f"{summary.get('serving_ok_per_s_during_median')}/s checksum "
                    f"{row.get('checksum_equal')} {row.get('error', '')}",
                    flush=True,
                )
                save()
        except BaseException as exc:
            result["errors"].append(
                {"where": "main", "error": f"{type(exc).__name__}: {exc}"[:2000]}
            )
            result["traceback"] = traceback.format_exc()[-3000:]
        finally:
            if load is not None:
                load.stop()
                result["serving_total"] = {"ok": len(load.ok), "failed": len(load.failed)}
            for eng in engines.values():
                with contextlib.suppress(Exception):
                    eng.stop()
    timed = [s for s in result["slices"] if s.get("median_s") and s.get("warmup_s") is not None]
    if timed:
        best = min(timed, key=lambda s: s["median_s"])
        result["best_slice_kib"] = best["slice_kib"]
    save()
    print(f"wrote {args.out}; best slice {result.get('best_slice_kib')} KiB")
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())

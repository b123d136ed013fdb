"""Where the time of a CUDA-IPC flattened-bucket update goes (one GPU, no engine, no HTTP).

The ``ipc`` transport's end-to-end figure (``bench_transports_gpu.py``) mixes packing, CUDA IPC
handle export/open/close, the engine's copy into its parameters and HTTP. This script takes the
same 398 Qwen3-4B tensors (8.04 GB bf16) and times each part on its own, per bucket size, with a
receiver process standing in for the engine (its parameters: same shapes, on the same GPU) and a
``multiprocessing`` pipe instead of HTTP:

* ``pack_loop_s`` / ``pack_foreach_s``: all buckets packed into two alternating buffers, one
  ``copy_`` per tensor vs :func:`rollsafe.wire.copy.copy_pairs` (``_foreach_copy_``);
* ``serialize_s``: :func:`rollsafe.wire.bucket.serialize_bucket` of every bucket;
* receiver, per update: ``open_s`` (decode the payload: CUDA IPC handle open), ``copy_s`` (copy
  into the parameters, synchronized), ``close_s`` (drop the views: handle close), with handles
  ``fresh`` (dropped after each bucket, as SGLang does) or ``cached`` (the two buffers' storages
  kept open for the whole update);
* ``round_trip_s``: everything above end to end, per update.

    python3 benchmarks/gpu/profile_ipc_gpu.py --out /tmp/profile_ipc.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(REPO), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

from qwen3_shapes import qwen3_4b_shapes  # noqa: E402

from rollsafe.transports.pipeline import alloc_buffer, plan_buckets  # noqa: E402
from rollsafe.wire.bucket import FlatBucket, deserialize_payload, serialize_bucket  # noqa: E402
from rollsafe.wire.copy import copy_pairs  # noqa: E402

MiB = 1 << 20


def _sync() -> None:
    torch.cuda.synchronize()


def receiver(conn: Any, shapes: list[tuple[str, tuple[int, ...]]]) -> None:
    torch.cuda.set_device(0)
    params = {n: torch.empty(s, dtype=torch.bfloat16, device="cuda") for n, s in shapes}
    conn.send("ready")
    cache: list[torch.Tensor] = []
    while True:
        msg = conn.recv()
        if msg is None:
            return
        mode, payloads = msg
        copy_mode = "hybrid"
        if ":" in mode:
            mode, copy_mode = mode.split(":", 1)
        opened = copied = closed = 0.0
        for payload in payloads:
            t0 = time.perf_counter()
            bucket = deserialize_payload(payload)
            assert isinstance(bucket, FlatBucket)
            t1 = time.perf_counter()
            pairs = [(params[n], v) for n, v in bucket.named_views()]
            if copy_mode == "loop":
                for d, v in pairs:
                    d.copy_(v)
            elif copy_mode == "foreach":
                torch._foreach_copy_([d for d, _ in pairs], [v for _, v in pairs])
            else:
                copy_pairs(pairs)
            _sync()
            t2 = time.perf_counter()
            if mode == "cached":
                cache.append(bucket.flat)
                del cache[:-2]
            del pairs, bucket
            gc.collect(0)
            t3 = time.perf_counter()
            opened, copied, closed = opened + t1 - t0, copied + t2 - t1, closed + t3 - t2
        t0 = time.perf_counter()
        cache.clear()
        gc.collect(0)
        closed += time.perf_counter() - t0
        conn.send({"open_s": opened, "copy_s": copied, "close_s": closed})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--buckets-mib", default="256,1024,2048")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda:0")
    shapes = qwen3_4b_shapes()
    gen = torch.Generator(device=dev).manual_seed(1)
    items = []
    for n, s in shapes:
        t = torch.empty(s, dtype=torch.bfloat16, device=dev)
        t.uniform_(-0.05, 0.05, generator=gen)
        items.append((n, t))
    nbytes = sum(t.numel() * 2 for _, t in items)
    result: dict[str, Any] = {"tensors": len(items), "bytes": nbytes, "rows": []}
    out = Path(args.out)

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child, shapes), daemon=True)
    proc.start()
    assert parent.recv() == "ready"

    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    best = 1e9
    for _ in range(5):
        _sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync()
        best = min(best, time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    result["d2d_copy_s"] = round(best, 5)

    for mib in [int(x) for x in args.buckets_mib.split(",") if x]:
        plans = plan_buckets(items, mib * MiB)
        cap = max(p.nbytes for p in plans)
        bufs = [alloc_buffer(cap, dev, shared=True) for _ in range(2)]
        row: dict[str, Any] = {"bucket_mib": mib, "buckets": len(plans)}

        def pack(
            foreach: bool, plans: list[Any] = plans, bufs: list[torch.Tensor] = bufs
        ) -> list[FlatBucket]:
            out_: list[FlatBucket] = []
            for i, plan in enumerate(plans):
                flat = bufs[i % 2][: plan.nbytes].view(plan.dtype)
                pairs = [
                    (flat[m.start : m.end].view(m.shape), items[j][1])
                    for j, m in zip(plan.indices, plan.metas, strict=True)
                ]
                if foreach:
                    copy_pairs(pairs)
                else:
                    for d, s in pairs:
                        d.copy_(s)
                out_.append(FlatBucket(flat, plan.metas))
            _sync()
            return out_

        for foreach in (False, True):
            times = []
            for _ in range(args.repeats):
                _sync()
                t0 = time.perf_counter()
                buckets = pack(foreach)
                times.append(time.perf_counter() - t0)
            row["pack_foreach_s" if foreach else "pack_loop_s"] = round(min(times), 5)
        t0 = time.perf_counter()
        payloads = [serialize_bucket(b) for b in buckets]
        row["serialize_s"] = round(time.perf_counter() - t0, 5)
        for mode in ("fresh", "cached"):
            rts, parts = [], []
            for _ in range(args.repeats):
                _sync()
                t0 = time.perf_counter()
                payloads = [serialize_bucket(b) for b in buckets]
                parent.send((mode, payloads))
                got = parent.recv()
                rts.append(time.perf_counter() - t0)
                parts.append(got)
            k = rts.index(min(rts))
            row[mode] = {
                "round_trip_s": round(rts[k], 5),
                **{key: round(v, 5) for key, v in parts[k].items()},
            }
        del buckets, payloads, bufs, pack
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    # the whole set back to back in one buffer, sent as one direct bucket (no packing)
    plans = plan_buckets(items, 1 << 62)
    flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    metas = []
    for plan in plans:
        metas.extend(plan.metas)
    whole = FlatBucket(flat, tuple(metas))
    whole.validate()
    frow: dict[str, Any] = {"bucket_mib": "flat (one 8 GB bucket)", "buckets": 1}
    for mode in ("fresh:hybrid", "fresh:loop", "fresh:foreach", "fresh:hybrid"):
        rts, parts = [], []
        for _ in range(args.repeats):
            _sync()
            t0 = time.perf_counter()
            payload = serialize_bucket(whole)
            t1 = time.perf_counter()
            parent.send((mode, [payload]))
            got = parent.recv()
            rts.append(time.perf_counter() - t0)
            parts.append({**got, "serialize_s": t1 - t0})
        k = rts.index(min(rts))
        frow[mode + ("" if mode not in frow else "_again")] = {
            "round_trip_s": round(rts[k], 5),
            **{key: round(v, 5) for key, v in parts[k].items()},
        }
    result["rows"].append(frow)
    print(json.dumps(frow), flush=True)
    parent.send(None)
    proc.join(30)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

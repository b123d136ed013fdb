"""Benchmark the asynchronous HF export: blocking part of ``start`` vs whole export, and writer
throughput vs a raw sequential write+fsync of the same bytes on the same disk, in the same run.

Targets: blocking <= 15% of the whole export; writer throughput >= 70% of raw write+fsync.
"Writer" (write s) is the background phase that writes every shard from the snapshot and fsyncs
it. Each shard is then read back (compared byte for byte with the snapshot and hashed with
SHA-256 for the manifest) on a small pool while the next shard is written; "verify s" is what of
that read-back (plus the directory check) is left after the last shard is written. Commit
(index, config, manifest) and publish (rename, fsync, retention) are part of "total s".

    .venv/bin/python benchmarks/bench_hf_export.py [--gib 1.0] [--rounds 3] [--shard-mib 256]

Prints a table and writes ``benchmarks/results/hf_export_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rollsafe.hf import HFExporter
from rollsafe.hf.writer import _start_writeback

RESULTS = Path(__file__).resolve().parent / "results" / "hf_export_cpu.json"
CHUNK = 32 << 20


def make_tensors(total_bytes: int, tensor_mib: int) -> dict[str, torch.Tensor]:
    """Half the bytes fp32, half bf16, in tensors of about ``tensor_mib`` MiB."""
    gen = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    per = tensor_mib << 20
    made = 0
    i = 0
    while made < total_bytes:
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        cols = 1024
        rows = max(1, per // (cols * (4 if dtype == torch.float32 else 2)))
        t = torch.randn(rows, cols, generator=gen).to(dtype)
        tensors[f"model.layers.{i // 2}.w{i % 2}.weight"] = t
        made += t.numel() * t.element_size()
        i += 1
    return tensors


def raw_write(path: Path, tensors: dict[str, torch.Tensor], hint: bool = False) -> float:
    """Sequential write of the same bytes in large writes, then fsync; the file is removed.

    ``hint=True`` also asks Linux to start write-back after every chunk (``sync_file_range``),
    as the exporter's writer does: the best this disk does with this write pattern.
    """
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    pos = 0
    try:
        for t in tensors.values():
            view = memoryview(t.view(torch.uint8).reshape(-1).numpy())
            for off in range(0, len(view), CHUNK):
                chunk = view[off : off + CHUNK]
                n = len(chunk)
                while chunk:
                    chunk = chunk[os.write(fd, chunk) :]
                if hint:
                    _start_writeback(fd, pos, n)
                pos += n
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - t0
    path.unlink()
    return elapsed


def _settle(root: Path) -> None:
    """Let retention finish deleting the retired export (done right after ``wait`` returns), as
    the gap between two training steps would, so it does not overlap the next measurement."""
    deadline = time.monotonic() + 60
    while any(p.name.startswith(".") for p in root.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.005)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="size of the tensor set (GiB)")
    ap.add_argument("--tensor-mib", type=int, default=16, help="size of each tensor (MiB)")
    ap.add_argument("--shard-mib", type=int, default=256, help="shard_size_bytes (MiB)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds (round 0 allocates the arena)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--out", default=str(RESULTS), help="JSON results file")
    ap.add_argument("--device", default="cpu", help="where the exported tensors live (cpu, cuda)")
    args = ap.parse_args(argv)

    tensors = make_tensors(int(args.gib * 2**30), args.tensor_mib)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    sources = {k: v.to(args.device) for k, v in tensors.items()}  # what the exporter snapshots
    work = Path(tempfile.mkdtemp(prefix="rollsafe-bench-hf-", dir=args.dir))
    rounds: list[dict[str, Any]] = []
    try:
        exporter = HFExporter(work / "exports", shard_size_bytes=args.shard_mib << 20, keep_last=1)
        for r in range(args.rounds):
            # alternate the order so neither side always runs on a freshly trimmed page cache
            if r % 2 == 0:
                raw_s = raw_write(work / "raw.bin", tensors)
                hinted_s = raw_write(work / "raw.bin", tensors, hint=True)
            t0 = time.perf_counter()
            handle = exporter.start(sources, r)
            blocking_s = time.perf_counter() - t0
            handle.wait()
            total_s = time.perf_counter() - t0
            _settle(exporter.root)
            if r % 2 == 1:
                raw_s = raw_write(work / "raw.bin", tensors)
                hinted_s = raw_write(work / "raw.bin", tensors, hint=True)
            s = handle.stats
            rounds.append(
                {
                    "round": r,
                    "arena": "fresh" if r == 0 else "reused",
                    "raw_write_fsync_s": raw_s,
                    "raw_hinted_write_fsync_s": hinted_s,
                    "blocking_s": blocking_s,
                    "snapshot_s": s.snapshot_s,
                    "write_s": s.write_s,
                    "commit_s": s.commit_s,
                    "verify_s": s.verify_s,
                    "publish_s": s.publish_s,
                    "total_s": total_s,
                    "blocking_fraction": blocking_s / total_s,
                    "raw_gb_s": nbytes / raw_s / 1e9,
                    "writer_gb_s": nbytes / s.write_s / 1e9,
                    "writer_vs_raw": raw_s / s.write_s,
                    "writer_vs_raw_hinted": hinted_s / s.write_s,
                    "background_vs_raw": raw_s / (total_s - blocking_s),
                }
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    steady = rounds[1:] or rounds

    def med(key: str, rows: list[dict[str, Any]] = steady) -> float:
        return statistics.median(row[key] for row in rows)

    summary = {
        "blocking_fraction_median": med("blocking_fraction"),
        "writer_vs_raw_median": med("writer_vs_raw"),
        "writer_vs_raw_hinted_median": med("writer_vs_raw_hinted"),
        "background_vs_raw_median": med("background_vs_raw"),
        "blocking_fraction_fresh_arena": rounds[0]["blocking_fraction"],
        "targets": {"blocking_fraction_max": 0.15, "writer_vs_raw_min": 0.70},
    }
    summary["blocking_ok"] = summary["blocking_fraction_median"] <= 0.15
    summary["writer_ok"] = summary["writer_vs_raw_median"] >= 0.70

    cols = [
        ("round", "rnd", "{:>3}"),
        ("arena", "arena", "{:>6}"),
        ("raw_write_fsync_s", "raw s", "{:6.3f}"),
        ("raw_hinted_write_fsync_s", "raw+wb s", "{:8.3f}"),
        ("blocking_s", "block s", "{:7.3f}"),
        ("write_s", "write s", "{:7.3f}"),
        ("verify_s", "verify s", "{:8.3f}"),
        ("total_s", "total s", "{:7.3f}"),
        ("blocking_fraction", "block %", "{:7.1%}"),
        ("raw_gb_s", "raw GB/s", "{:8.2f}"),
        ("writer_gb_s", "wr GB/s", "{:7.2f}"),
        ("writer_vs_raw", "wr/raw", "{:6.0%}"),
        ("writer_vs_raw_hinted", "wr/raw+wb", "{:9.0%}"),
        ("background_vs_raw", "bg/raw", "{:6.0%}"),
    ]
    print(
        f"HF export: {nbytes / 2**30:.2f} GiB in {len(tensors)} tensors (fp32+bf16), "
        f"on {args.device}, shards of {args.shard_mib} MiB, {os.cpu_count()} CPU(s)"
    )
    print("  ".join(f"{h:>{len(fmt.format(rounds[0][k]))}}" for k, h, fmt in cols))
    for row in rounds:
        print("  ".join(fmt.format(row[k]) for k, _, fmt in cols))
    print(
        f"steady state (reused arena, median): blocking {summary['blocking_fraction_median']:.1%} "
        f"of the export (target <= 15%: {'ok' if summary['blocking_ok'] else 'MISSED'}); "
        f"writer {summary['writer_vs_raw_median']:.0%} of raw write+fsync (target >= 70%: "
        f"{'ok' if summary['writer_ok'] else 'MISSED'}; "
        f"{summary['writer_vs_raw_hinted_median']:.0%} of raw with the same write-back hints); "
        f"whole background part {summary['background_vs_raw_median']:.0%} of raw"
    )
    result = {
        "benchmark": "hf_export_cpu",
        "host": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
        },
        "config": {
            "bytes": nbytes,
            "tensors": len(tensors),
            "tensor_mib": args.tensor_mib,
            "shard_mib": args.shard_mib,
            "device": args.device,
            "rounds": args.rounds,
        },
        "rounds": rounds,
        "summary": summary,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

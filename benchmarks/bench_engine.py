"""Benchmark the reference engine on CPU: cold start and greedy generate latency.

For the tiny model with 1 and 2 ranks: process spawn -> ready line, ready line -> first
generate answered, and the median / p90 latency of N greedy generates of 16 tokens. Prints a
table and writes ``benchmarks/results/engine_cpu.json``.

    .venv/bin/python benchmarks/bench_engine.py [--runs 20] [--tokens 16]
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from engine_helpers import start_engine  # noqa: E402

from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model  # noqa: E402


def bench(model_dir: Path, ranks: int, runs: int, tokens: int) -> dict[str, Any]:
    t0 = time.monotonic()
    eng = start_engine(model_dir, ranks=ranks)
    t_ready = time.monotonic()
    try:
        body = {
            "input_ids": [1, 17, 42, 99, 7],
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
        }
        r = eng.post("/generate", body)
        r.raise_for_status()
        t_first = time.monotonic()
        lat = []
        for _ in range(runs):
            s = time.monotonic()
            eng.post("/generate", body).raise_for_status()
            lat.append(time.monotonic() - s)
        lat.sort()
        return {
            "ranks": ranks,
            "spawn_to_ready_s": round(t_ready - t0, 3),
            "ready_to_first_generate_s": round(t_first - t_ready, 3),
            "generate_median_s": round(statistics.median(lat), 4),
            "generate_p90_s": round(lat[int(0.9 * (len(lat) - 1))], 4),
            "tokens_per_s": round(tokens / statistics.median(lat), 1),
        }
    finally:
        eng.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "engine_cpu.json"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny", seed=0)
        rows = [bench(model, ranks, args.runs, args.tokens) for ranks in (1, 2)]
    print(
        f"{'ranks':>5} {'spawn->ready s':>15} {'ready->1st gen s':>17} "
        f"{'gen median s':>13} {'gen p90 s':>10} {'tok/s':>8}"
    )
    for r in rows:
        print(
            f"{r['ranks']:>5} {r['spawn_to_ready_s']:>15} {r['ready_to_first_generate_s']:>17} "
            f"{r['generate_median_s']:>13} {r['generate_p90_s']:>10} {r['tokens_per_s']:>8}"
        )
    result = {
        "benchmark": "reference_engine_cpu",
        "model": "tiny llama (hidden 64, 2 layers, vocab 512)",
        "tokens_per_generate": args.tokens,
        "runs": args.runs,
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "machine": platform.machine(),
        },
        "results": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

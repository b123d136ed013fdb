"""Benchmark the reference engine on CPU: cold start and greedy generate latency.

For the tiny model with 1 rank, 2 ranks (default start: forked after rank 0's imports) and 2
ranks with ``--rank-start-method spawn`` (the CUDA path): process spawn -> ready line (the
median of ``--starts`` cold starts, with the engine's own ``startup_s`` phases of the median
start), ready line -> first generate answered, and the median / p90 latency of N greedy
generates of 16 tokens. Prints a table and writes ``benchmarks/results/engine_cpu.json``.

    .venv/bin/python benchmarks/bench_engine.py [--runs 20] [--tokens 16] [--starts 3]
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

CONFIGS: dict[str, tuple[int, list[str]]] = {
    "1 rank": (1, []),
    "2 ranks (fork)": (2, []),
    "2 ranks (spawn)": (2, ["--rank-start-method", "spawn"]),
}


def bench(model_dir: Path, name: str, runs: int, tokens: int, starts: int) -> dict[str, Any]:
    ranks, extra = CONFIGS[name]
    body = {
        "input_ids": [1, 17, 42, 99, 7],
        "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
    }
    cold: list[tuple[float, dict[str, Any]]] = []
    for i in range(starts):
        t0 = time.monotonic()
        eng = start_engine(model_dir, ranks=ranks, extra_args=extra)
        t_ready = time.monotonic()
        cold.append((t_ready - t0, dict(eng.ready.get("startup_s", {}))))
        try:
            if i < starts - 1:
                continue
            r = eng.post("/generate", body)
            r.raise_for_status()
            t_first = time.monotonic()
            lat = []
            for _ in range(runs):
                s = time.monotonic()
                eng.post("/generate", body).raise_for_status()
                lat.append(time.monotonic() - s)
            lat.sort()
        finally:
            eng.stop()
    cold.sort(key=lambda c: c[0])
    spawn_to_ready, phases = cold[len(cold) // 2]
    return {
        "config": name,
        "ranks": ranks,
        "spawn_to_ready_s": round(spawn_to_ready, 3),
        "spawn_to_ready_all_s": [round(c[0], 3) for c in cold],
        "startup_phases_s": phases,
        "ready_to_first_generate_s": round(t_first - t_ready, 3),
        "generate_median_s": round(statistics.median(lat), 4),
        "generate_p90_s": round(lat[int(0.9 * (len(lat) - 1))], 4),
        "tokens_per_s": round(tokens / statistics.median(lat), 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--starts", type=int, default=3, help="cold starts per config (median)")
    p.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "engine_cpu.json"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny", seed=0)
        rows = [bench(model, c, args.runs, args.tokens, args.starts) for c in args.configs]
    print(
        f"{'config':>16} {'spawn->ready s':>15} {'ready->1st gen s':>17} "
        f"{'gen median s':>13} {'gen p90 s':>10} {'tok/s':>8}"
    )
    for r in rows:
        print(
            f"{r['config']:>16} {r['spawn_to_ready_s']:>15} {r['ready_to_first_generate_s']:>17} "
            f"{r['generate_median_s']:>13} {r['generate_p90_s']:>10} {r['tokens_per_s']:>8}"
        )
    for r in rows:
        print(f"{r['config']:>16} start-up phases (s since main): {r['startup_phases_s']}")
    result = {
        "benchmark": "reference_engine_cpu",
        "model": "tiny llama (hidden 64, 2 layers, vocab 512)",
        "tokens_per_generate": args.tokens,
        "runs": args.runs,
        "cold_starts_per_config": args.starts,
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
        },
        "results": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The CPU an SGLang stream costs its reader, per token, as the answer grows (issue #35).

SGLang's ``/generate`` stream (``incremental_streaming_output`` off, its default) carries in
every event all the text, ``output_ids`` and, with ``return_logprob``, ``output_token_logprobs``
so far: decoding each event whole costs O(tokens) an event, O(tokens²) an answer. The client's
``SGLangDeltas.decode`` decodes only what is new. This script feeds the same wire bytes (the
reference engine's compact JSON, one event a token, text with quotes and non-ASCII) through
``SSEEventReader`` and ``SGLangDeltas`` both ways, in one process, interleaved, and reports the
CPU (``time.process_time``) per token: median and p95 of ``--repeats`` runs per size.

Checks (exit 1 when one is false): both ways give the same deltas; at the largest size the
incremental way costs at most a fifth of the whole way's CPU per token, with and without
logprobs; its CPU per token at the largest size is at most 3x its own at the smallest (linear:
no growth with the answer's length beyond that).

``python benchmarks/bench_sglang_stream_decode.py [--sizes 256,1024,4096] [--repeats 5]
[--out benchmarks/results/sglang_stream_decode_cpu.json]``; ``--smoke``: sizes 64,256, 2
repeats, no file unless ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rollsafe.adapters.engines.streaming import SGLangDeltas, SSEEventReader  # noqa: E402
from rollsafe.adapters.reference_engine.streaming import sse_event  # noqa: E402

URL, PATH = "http://engine", "/generate"
PIECE = 'tok "é" '  # a quote and a non-ASCII character in every token's text


def wire(tokens: int, logprobs: bool) -> bytes:
    """A stream of ``tokens`` cumulative events as the reference engine writes them."""
    out: list[bytes] = []
    ids: list[int] = []
    lps: list[list[Any]] = []
    text = ""
    for i in range(tokens):
        ids.append(1000 + i % 30000)
        text += PIECE
        meta: dict[str, Any] = {
            "id": "r",
            "finish_reason": None,
            "prompt_tokens": 16,
            "weight_version": "3",
            "completion_tokens": len(ids),
        }
        if logprobs:
            lps.append([-0.125 * (i % 9), ids[-1], None])
            meta["output_token_logprobs"] = lps
            meta["output_token_logprobs_length"] = len(lps)
        if i == tokens - 1:
            meta["finish_reason"] = {"type": "length", "length": tokens}
            meta["weight_versions"] = [{"version": "3", "start": 0, "end": tokens}]
        out.append(sse_event({"text": text, "output_ids": ids, "meta_info": meta}))
    return b"".join(out) + b"data: [DONE]\n\n"


def read(data: bytes, incremental: bool) -> tuple[float, list[Any]]:
    """CPU seconds to read ``data`` into deltas (in 16 KiB chunks, as from a socket)."""
    deltas = SGLangDeltas(URL, PATH)
    reader = SSEEventReader(URL, PATH, deltas.decode if incremental else None)
    got: list[Any] = []
    t = time.process_time()
    for at in range(0, len(data), 16384):
        for event in reader.feed(data[at : at + 16384]):
            got.append(deltas(event))
    return time.process_time() - t, got


def p95(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.95 * (len(s) - 1)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="256,1024,4096", help="tokens per answer, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    sizes = [64, 256] if args.smoke else [int(x) for x in args.sizes.split(",")]
    repeats = 2 if args.smoke else args.repeats
    out = args.out
    if out is None and not args.smoke:
        out = REPO / "benchmarks" / "results" / "sglang_stream_decode_cpu.json"

    results: dict[str, dict[str, dict[str, float]]] = {}
    checks: dict[str, bool] = {}
    for logprobs in (False, True):
        mode = "logprobs" if logprobs else "plain"
        results[mode] = {}
        for n in sizes:
            data = wire(n, logprobs)
            runs: dict[str, list[float]] = {"whole": [], "incremental": []}
            same = True
            for _ in range(repeats):  # interleaved: both ways see the same machine
                whole_s, whole = read(data, incremental=False)
                fast_s, fast = read(data, incremental=True)
                runs["whole"].append(whole_s / n * 1e6)
                runs["incremental"].append(fast_s / n * 1e6)
                same = same and fast == whole
            checks[f"{mode} {n} tokens: the same deltas both ways"] = same
            row = {
                f"{way}_us_per_token_{stat}": round(f(xs), 2)
                for way, xs in runs.items()
                for stat, f in (("p50", statistics.median), ("p95", p95))
            }
            row["whole_over_incremental"] = round(
                row["whole_us_per_token_p50"] / row["incremental_us_per_token_p50"], 2
            )
            results[mode][str(n)] = row
            print(f"{mode:8} {n:5} tokens: {row}", flush=True)
        small, large = results[mode][str(sizes[0])], results[mode][str(sizes[-1])]
        checks[f"{mode} {sizes[-1]} tokens: incremental <= 1/5 of whole"] = (
            large["whole_over_incremental"] >= 5.0 or args.smoke
        )
        checks[f"{mode}: incremental per token at {sizes[-1]} <= 3x at {sizes[0]}"] = (
            large["incremental_us_per_token_p50"] <= 3 * small["incremental_us_per_token_p50"]
        )
    failed = [name for name, ok in checks.items() if not ok]
    doc = {
        "benchmark": "sglang_stream_decode",
        "command": "python benchmarks/bench_sglang_stream_decode.py "
        + " ".join(argv or sys.argv[1:]),
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_1min_at_start": round(os.getloadavg()[0], 2),
        },
        "config": {"sizes": sizes, "repeats": repeats, "piece": PIECE, "chunk_bytes": 16384},
        "results": results,
        "checks": checks,
        "failed_checks": failed,
    }
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {out}")
    for name in failed:
        print(f"CHECK FAILED: {name}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

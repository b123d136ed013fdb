"""Delta vs full weight sync, side by side in one run (issue #28).

Two reference engines of the same model, each fed by its own transport from the same trainer
tensors: one pushes every version whole (``delta=None``), the other pushes deltas
(``delta=DeltaSettings()``: only the elements whose bits changed since the engine's confirmed
base). Every step registers the new version with both, times both updates (the sender's encode
and base snapshot are part of the delta's time), reads the bytes each moved, and compares both
engines' weight checkers with the trainer's weights. The first version is a full push for both
(no base yet) and is not measured.

Two ways to make the versions:

* ``--train`` (the CPU default): a small Llama trained by AdamW on fp32 master weights at an
  RL-like learning rate (``--lr``, default 1e-6), synced as bf16 each step; the fraction of bf16
  elements whose bits changed is measured and reported per step;
* ``--fractions 0.5,2,10``: synthetic steps that change exactly that percentage of elements (the
  lowest mantissa bit flipped at random positions), ``--steps`` per fraction; with
  ``--device cuda`` the tensors are the 8 GB Qwen3-4B-shaped set (``gpu/qwen3_shapes.py``).

Checks (exit 1 when one is false): digests equal after every step, for both engines; a delta
sent for every measured step; per fraction (synthetic): at <= 2 % changed at least 5x fewer bytes
and at least 3x faster (median) than full; at 10 % never slower (median) than full.

    .venv/bin/python benchmarks/bench_delta.py --train --steps 8          # CPU, trained
    .venv/bin/python benchmarks/bench_delta.py --fractions 0.5,2,10       # CPU, synthetic
    python3 benchmarks/bench_delta.py --device cuda --fractions 0.5,2,10 \\
        --transport nccl --out benchmarks/results/gpu/delta_h200.json      # the H200 run
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
sys.path.insert(0, str(REPO))

from engine_helpers import start_engine  # noqa: E402

from rollsafe.adapters.engines import SGLangClient  # noqa: E402
from rollsafe.fleet.weights_check import check_engine, read_config  # noqa: E402
from rollsafe.ports import EngineTarget  # noqa: E402
from rollsafe.transports import DeltaSettings, IPCTransport, NCCLTransport  # noqa: E402
from rollsafe.transports.base import StagedTransport  # noqa: E402


# ---------------------------------------------------------------------------- statistics
def pct(values: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``values``."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))
    return s[k]


def dist(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "median": round(statistics.median(values), 6),
        "p95": round(pct(values, 95), 6),
        "min": round(min(values), 6),
        "max": round(max(values), 6),
    }


# ---------------------------------------------------------------------------- models
def tiny_llama(hidden: int, layers: int, vocab: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=512,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )


class Trainer:
    """fp32 master weights trained by AdamW on a policy-gradient-like loss (random tokens,
    random +-1 advantages); :meth:`step` writes the new bf16 weights into ``bf16`` in place."""

    def __init__(self, config: Any, lr: float, seed: int = 0) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        auto: Any = AutoModelForCausalLM
        self.model = auto.from_config(config).float()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.vocab = config.vocab_size
        self.bf16 = {n: p.detach().to(torch.bfloat16) for n, p in self.model.named_parameters()}

    def step(self) -> None:
        ids = torch.randint(0, self.vocab, (4, 64))
        adv = torch.randint(0, 2, (4, 1)).float() * 2 - 1
        logits = self.model(input_ids=ids).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(adv * logp).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                self.bf16[n].copy_(p)


def flip_fraction(weights: dict[str, torch.Tensor], fraction: float, gen: torch.Generator) -> None:
    """Flip the lowest mantissa bit of ``fraction`` of every tensor's elements (random
    positions): exactly those elements change, by one ulp."""
    with torch.no_grad():
        for t in weights.values():
            flat = t.view(-1).view(torch.int16)
            mask = torch.rand(flat.shape, generator=gen, device=t.device) < fraction
            flat.bitwise_xor_(mask.to(torch.int16))


# ---------------------------------------------------------------------------- the run
class Pair:
    """The two engines and their transports (full, delta)."""

    def __init__(
        self, model_dir: Path, device: torch.device, transport: str, backend: str, timeout: float
    ):
        extra = ["--load-format", "dummy", "--dtype", "bfloat16", "--weight-group-timeout", "300"]
        if device.type == "cuda":
            extra += ["--device", "cuda"]
        self.config = read_config(model_dir)
        self.engines = [start_engine(model_dir, extra_args=extra, timeout=timeout) for _ in "fd"]
        self.clients = [SGLangClient(e.url, timeout=timeout) for e in self.engines]
        self.targets = [
            EngineTarget(name, (0,), c, 1, applies_deltas=True)
            for name, c in zip(("full", "delta"), self.clients, strict=True)
        ]
        cls: Callable[..., StagedTransport] = IPCTransport if transport == "ipc" else NCCLTransport
        kw: dict[str, Any] = {"device": device} if transport == "ipc" else {"backend": backend}
        self.full = cls(1, **kw)
        self.delta = cls(1, delta=DeltaSettings(), **kw)

    def push(self, weights: dict[str, torch.Tensor], version: int) -> dict[str, Any]:
        out: dict[str, Any] = {"version": version}
        for key, tr, target in (
            ("full", self.full, self.targets[0]),
            ("delta", self.delta, self.targets[1]),
        ):
            _sync(weights)
            t0 = time.perf_counter()
            tr.register(weights, version)
            rep = tr.update([target])
            _sync(weights)
            out[f"{key}_s"] = time.perf_counter() - t0
            res = rep.results[target.name]
            if not res.ok:
                raise RuntimeError(f"{key} push of v{version} failed: {res.reason}")
            out[f"{key}_bytes"] = res.nbytes
        record = self.delta.deltas.last()
        assert record is not None
        row = record.targets[0]
        out["delta_kind"] = row.kind
        out["delta_reason"] = row.reason
        out["changed_fraction"] = record.changed_fraction
        out["encode_s"] = record.encode_s
        # each engine's checker against the weights laid out as it holds them (fused, per rank)
        out["digests_equal"] = [check_engine(c, weights, self.config).equal for c in self.clients]
        return out

    def close(self) -> None:
        for tr in (self.full, self.delta):
            tr.close()
        for c in self.clients:
            c.close()
        for e in self.engines:
            e.stop()


def _sync(weights: dict[str, torch.Tensor]) -> None:
    t = next(iter(weights.values()))
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def steps_of(args: argparse.Namespace, weights: dict[str, torch.Tensor], trainer: Trainer | None):
    """(label, fraction or None) per measured step; each yield follows the weights' change."""

    def gen() -> Iterator[tuple[str, float | None]]:
        if trainer is not None:
            for _ in range(args.steps):
                trainer.step()
                yield "train", None
            return
        g = torch.Generator(device=next(iter(weights.values())).device).manual_seed(7)
        for f in [float(x) for x in args.fractions.split(",") if x]:
            for _ in range(args.steps):
                flip_fraction(weights, f / 100, g)
                yield f"{f:g}%", f

    return gen()


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label in dict.fromkeys(r["label"] for r in rows):
        rs = [r for r in rows if r["label"] == label]
        full = [r["full_s"] for r in rs]
        delta = [r["delta_s"] for r in rs]
        fb = statistics.median(r["full_bytes"] for r in rs)
        db = statistics.median(r["delta_bytes"] for r in rs)
        out[label] = {
            "steps": len(rs),
            "changed_fraction": dist([r["changed_fraction"] or 0.0 for r in rs]),
            "full_s": dist(full),
            "delta_s": dist(delta),
            "encode_s": dist([r["encode_s"] for r in rs]),
            "full_bytes": int(fb),
            "delta_bytes": int(db),
            "bytes_ratio": round(fb / db, 2) if db else None,
            "speedup": round(statistics.median(full) / statistics.median(delta), 2),
            "kinds": sorted({r["delta_kind"] for r in rs}),
            "digests_equal": all(all(r["digests_equal"]) for r in rs),
        }
    return out


def checks_for(summary: dict[str, Any], synthetic: bool) -> dict[str, bool]:
    checks: dict[str, bool] = {}
    for label, s in summary.items():
        checks[f"{label}: digests equal after every step (both engines)"] = s["digests_equal"]
        checks[f"{label}: every measured step sent a delta"] = s["kinds"] == ["delta"]
        if not synthetic:
            checks[f"{label}: delta bytes < full bytes"] = s["delta_bytes"] < s["full_bytes"]
            continue
        frac = float(label.rstrip("%"))
        if frac <= 2:
            checks[f"{label}: >= 5x fewer bytes"] = (s["bytes_ratio"] or 0) >= 5
            checks[f"{label}: >= 3x faster (median)"] = s["speedup"] >= 3
        if frac >= 10:
            checks[f"{label}: never slower than full (median)"] = s["speedup"] >= 1
    return checks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--transport", default="nccl", choices=("nccl", "ipc"))
    ap.add_argument(
        "--backend",
        default="gloo",
        choices=("gloo", "nccl"),
        help="nccl transport's backend: gloo (host network path; the only one between two "
        "processes on one GPU) or nccl (needs the engine on another GPU)",
    )
    ap.add_argument("--train", action="store_true", help="versions from AdamW steps (CPU)")
    ap.add_argument("--fractions", default="", help="percent changed per synthetic step: 0.5,2,10")
    ap.add_argument("--steps", type=int, default=5, help="measured steps (per fraction)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--qwen-layers", type=int, default=None, help="cuda: fewer Qwen3 layers")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not args.train and not args.fractions:
        args.train = True
    if args.train and args.fractions:
        ap.error("--train and --fractions are two separate runs")
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    out_path = Path(
        args.out
        or REPO
        / "benchmarks"
        / "results"
        / f"delta_{args.device}{'_train' if args.train else ''}.json"
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "benchmark": "delta",
        "device": str(device),
        "transport": args.transport,
        "backend": args.backend if args.transport == "nccl" else None,
        "mode": "train" if args.train else "synthetic",
        "host": {"python": platform.python_version(), "torch": torch.__version__},
        "args": vars(args),
    }
    if device.type == "cuda":
        result["host"]["gpu"] = torch.cuda.get_device_name(0)

    def save() -> None:
        out_path.write_text(json.dumps(result, indent=2) + "\n")

    with tempfile.TemporaryDirectory(prefix="rollsafe-delta-") as tmp:
        model_dir = Path(tmp) / "model"
        trainer: Trainer | None = None
        if device.type == "cuda":
            import qwen3_shapes

            qwen3_shapes.write_config_dir(model_dir, args.qwen_layers)
            weights = qwen3_shapes.make_weights(device, seed=1, num_layers=args.qwen_layers)
            result["model"] = "Qwen3-4B shapes" + (
                f" ({args.qwen_layers} layers)" if args.qwen_layers else ""
            )
        else:
            config = tiny_llama(args.hidden, args.layers, args.vocab)
            config.save_pretrained(model_dir)
            if args.train:
                trainer = Trainer(config, args.lr)
                weights = trainer.bf16
            else:
                weights = Trainer(config, args.lr).bf16
            result["model"] = (
                f"Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}"
                + (f", AdamW lr {args.lr:g} on fp32 masters, synced as bf16" if args.train else "")
            )
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        result["bytes"] = nbytes
        print(f"{result['model']}: {len(weights)} tensors, {nbytes / 1e6:.1f} MB on {device}")
        t0 = time.perf_counter()
        pair = Pair(model_dir, device, args.transport, args.backend, timeout=900)
        result["engine_start_s"] = round(time.perf_counter() - t0, 1)
        rows: list[dict[str, Any]] = []
        try:
            first = pair.push(weights, 1)  # no base yet: both full (not measured)
            result["first"] = {k: v for k, v in first.items() if k != "version"}
            version = 1
            for label, _frac in steps_of(args, weights, trainer):
                version += 1
                row = pair.push(weights, version)
                row["label"] = label
                rows.append(row)
                print(
                    f"v{version} [{label}] changed {100 * (row['changed_fraction'] or 0):.3f}% "
                    f"full {row['full_s'] * 1e3:.1f} ms {row['full_bytes'] / 1e6:.1f} MB | "
                    f"{row['delta_kind']} {row['delta_s'] * 1e3:.1f} ms "
                    f"{row['delta_bytes'] / 1e6:.2f} MB (encode {row['encode_s'] * 1e3:.1f} ms) "
                    f"digests {'ok' if all(row['digests_equal']) else 'DIFFER'}",
                    flush=True,
                )
                result["rows"] = rows
                save()
        finally:
            pair.close()
    result["summary"] = summarize(rows)
    checks = checks_for(result["summary"], synthetic=not args.train)
    result["checks"] = checks
    save()
    print(json.dumps(result["summary"], indent=1))
    for name, ok in checks.items():
        print(f"  {'ok    ' if ok else 'FAILED'} {name}")
    print(f"wrote {out_path}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""A real vLLM 0.26 or SGLang 0.5.16 server on one GPU, driven by the fleet (issues 38 and 39).

``--engine vllm`` (issue 38, item 2) and ``--engine sglang`` (issue 39, items 2 and 3) run the
same phases against real servers started by the fleet's launcher (``FleetConfig(engine=
EngineSpec(kind=...))``) on a random-weight Llama (``make_tiny_model``, a few hundred MB), the
wheels carried by ``tools/carry.py`` (benchmarks/gpu/README.md, "Carrying an engine"):

``start``      a two-group fleet; each group's client names the release it speaks
``generate``   greedy completions through the fleet, at the start version
``sync``       ``--syncs`` versions over the fleet's transport (``nccl``: vLLM's own NCCL weight
               transfer, which the trainer joins as vLLM's rank 0 with vLLM's own
               ``StatelessProcessGroup`` + PyNccl, ``rollsafe.wire.vllm_group``: the carried
               vLLM on ``PYTHONPATH`` makes it importable / SGLang's
               ``/update_weights_from_distributed``), each group's version and greedy output
               checked against the trainer's after each (``rendezvous`` says which join ran)
``probe``      the behavioural probe (``rollsafe.probe``) of every group against a fresh server
               started from the trainer's weights of the last version
``checks``     ``RolloutFleet.checksums`` / ``check_weights`` (vLLM 0.26 has no checker: None,
               and ``NoWeightChecker`` from the client; SGLang: its ``/weights_checker``)
``sleep``      colocated steps: generation and health paused, every engine's memory released
               (vLLM ``/sleep`` levels 1 and 2; SGLang ``release_memory_occupation``), a weight
               update while asleep refused by the client (vLLM: ``EngineAsleep``, nothing sent,
               the server still healthy), a trainer step, wake, sync, resume; greedy checked
``kill``       ``--kills`` times: a group's engine SIGKILLed mid-rollout, the cut request
               continued elsewhere, the group recovered (immediate recovery) and serving the
               current version; kill -> ``active`` p50/p95
``failed``     an update that fails inside the engines (a tensor of the wrong shape): the
               groups are failed, never routed while poisoned, and recovered
``update_times`` (``--timing``) update time per version per transport on Qwen3 shapes (one
               group, dummy weights; median of ``--updates`` after a first, excluded), with the
               reference engine beside it on the same GPU when ``--with-reference``

What the fleet cannot do yet is recorded under ``not_run`` with the reason (vLLM's ``ipc``
weight-transfer engine has no rollsafe transport; a sleeping group is not taken out of routing
by the fleet itself: docs/engines.md, "What has run against a real engine").

    python3 benchmarks/gpu/real_engine_gpu.py --engine vllm --out $OUT/real_vllm_gpu.json
    python3 benchmarks/gpu/real_engine_gpu.py --engine sglang --timing qwen3-4b,qwen3-8b \\
        --out $OUT/real_sglang_gpu.json
    python3 benchmarks/gpu/real_engine_gpu.py --engine vllm --smoke --out /tmp/smoke.json  # CPU

``--smoke`` runs the same phases on the CPU with rollsafe's reference engine in the engine's
dialect (vLLM: ``--vllm-version 0.26.0``) and gloo for NCCL: it checks the script, not the
figures. The JSON is rewritten after every phase; the exit status is non-zero when any check is
false or a phase failed.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for path in (REPO, HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

#: NCCL settings of the trainer and of the engines: distinct host ids, so NCCL accepts two
#: ranks of one communicator on one GPU (benchmarks/gpu/trl_grpo_gpu.py explains)
TRAINER_NCCL_ENV = {
    "NCCL_HOSTID": "rollsafe-real-trainer",
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_IB_DISABLE": "1",
    "NCCL_NVLS_ENABLE": "0",
}
ENGINE_NCCL_ENV = {**TRAINER_NCCL_ENV, "NCCL_HOSTID": "rollsafe-real-engine"}
#: what each real server needs on the device image (the carry locks' "env" and flags)
SERVE_ENV = {"vllm": {"VLLM_USE_FLASHINFER_SAMPLER": "0"}, "sglang": {}}
PROMPT = [1, 17, 42, 99, 7, 3, 5]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0}
#: a bf16 near tie (logits): the engine's and the trainer's kernels round differently
GREEDY_TIE = 0.125
#: Qwen3-8B's shapes (Qwen/Qwen3-8B's config: untied embeddings); Qwen3-4B's: qwen3_shapes.py
QWEN3_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 36,
    "intermediate_size": 12288,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}
#: the smoke run's stand-in for them (same structure, a few MB)
QWEN3_TINY = {
    **QWEN3_8B,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "tie_word_embeddings": True,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("vllm", "sglang"), required=True)
    p.add_argument("--out", type=Path, required=True, help="the result JSON")
    p.add_argument("--smoke", action="store_true", help="CPU, reference engine: the script")
    p.add_argument("--syncs", type=int, default=3, help="versions pushed in the sync phase")
    p.add_argument("--kills", type=int, default=5, help="SIGKILLs in the kill phase")
    p.add_argument("--hidden", type=int, default=1024, help="the Llama's hidden size (GPU)")
    p.add_argument("--layers", type=int, default=8, help="the Llama's layers (GPU)")
    p.add_argument("--vocab", type=int, default=32000, help="the Llama's vocabulary (GPU)")
    p.add_argument("--mem", type=float, default=0.2, help="GPU memory fraction per server")
    p.add_argument("--timing", default="", help="update_times shapes: qwen3-4b,qwen3-8b")
    p.add_argument("--updates", type=int, default=5, help="timed updates (after a first)")
    p.add_argument("--with-reference", action="store_true", help="time the reference too")
    p.add_argument("--phases", default="", help="comma-separated subset of the phases")
    p.add_argument("--deadline-s", type=float, default=1e9, help="skip phases past this")
    p.add_argument("--work-dir", type=Path, default=None)
    args = p.parse_args(argv)
    if args.syncs < 1 or args.kills < 0 or args.updates < 2:
        p.error("--syncs >= 1, --kills >= 0, --updates >= 2")
    return args


# ---------------------------------------------------------------------------------- engines


def engine_options(args: argparse.Namespace, work: Path, *, real: bool) -> dict[str, Any]:
    """The fields of the fleet's ``EngineSpec``: the real server on the GPU, or the reference
    engine in the same dialect (``--smoke``: on the CPU; ``real=False`` on the GPU: the
    comparison)."""
    logs = str(work / "engine-logs")
    cuda = not args.smoke
    if not real:
        opts: dict[str, Any] = {
            "dialect": args.engine,
            "device": "cuda" if cuda else "cpu",
            "log_dir": logs,
        }
        if args.engine == "vllm":
            opts["extra_args"] = ["--vllm-version", "0.26.0"]
        if cuda:
            opts["env"] = ENGINE_NCCL_ENV
        return opts
    opts = {
        "kind": args.engine,
        "device": "cuda",
        "python": sys.executable,
        "log_dir": logs,
        "release_memory": True,
        "ready_timeout": 900.0,
        "client_timeout": 300.0,
        "env": {**ENGINE_NCCL_ENV, **SERVE_ENV[args.engine]},
    }
    if args.engine == "vllm":
        opts["max_model_len"] = 1024
        opts["extra_args"] = [
            "--attention-backend",
            "FLASH_ATTN",
            "--gpu-memory-utilization",
            str(args.mem),
        ]
    else:
        opts["extra_args"] = [
            "--attention-backend",
            "triton",
            "--sampling-backend",
            "pytorch",
            "--mem-fraction-static",
            str(args.mem),
            "--context-length",
            "1024",
        ]
    return opts


def group_pids(fleet: Any, gid: str) -> list[int]:
    launcher = fleet.launcher(gid)
    return list(launcher.rank_pids) or [launcher.pid]


def kill_group(fleet: Any, gid: str) -> list[int]:
    """SIGKILL the group's engine: its process group (a real server's worker processes too)."""
    pids = group_pids(fleet, gid)
    for pid in pids:
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return pids


# ----------------------------------------------------------------------------------- trainer


class Trainer:
    """The trainer side: an HF causal LM whose parameters are the weights pushed."""

    def __init__(self, model_dir: Path, device: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device)
        self.model.eval()
        self.device = device
        self.step = 0

    def weights(self) -> dict[str, Any]:
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def train_step(self, seed: int) -> None:
        """One optimizer-like step: a few parameters move (enough to change greedy tokens)."""
        import torch

        gen = torch.Generator(device=self.device).manual_seed(seed)
        with torch.no_grad():
            for _, p in list(self.model.named_parameters())[:6]:
                p.add_(
                    0.05 * torch.randn(p.shape, generator=gen, device=self.device, dtype=p.dtype)
                )
        self.step += 1

    def greedy_gap(self, ids: list[int]) -> float:
        """How far the engine's greedy tokens ``ids`` are from the trainer's own argmax, fed the
        engine's tokens (teacher-forced): the largest ``max logit - logit of the engine's token``
        over the positions, 0.0 where every token is the trainer's argmax too."""
        import torch

        seq = torch.tensor([PROMPT + list(ids)], device=self.device)
        with torch.no_grad():
            logits = self.model(seq).logits[0, len(PROMPT) - 1 : -1].float()
        chosen = logits.gather(1, torch.tensor(ids, device=self.device)[:, None])[:, 0]
        return float((logits.max(dim=1).values - chosen).max())

    def greedy_agrees(self, ids: list[int], n: int) -> dict[str, Any]:
        """The engine's greedy tokens against the trainer's: ``exact`` (the trainer's own
        ``generate`` gives the same ids) and ``ok``: exact, or (bf16 on the GPU, where the
        engine's kernels and the trainer's differ) every engine token within ``GREEDY_TIE``
        of the trainer's best logit at its position, a near tie either side may break. On the
        CPU (float32) only exact counts. The weights themselves are checked exactly elsewhere
        (the probe: tokens and logprobs equal to a fresh server's)."""
        exact = ids == self.greedy(n)
        gap = 0.0 if exact else self.greedy_gap(ids)
        tie = GREEDY_TIE if self.device == "cuda" else 0.0
        return {"exact": exact, "gap": round(gap, 4), "ok": exact or gap <= tie}

    def greedy(self, n: int) -> list[int]:
        import torch

        ids = torch.tensor([PROMPT], device=self.device)
        with torch.no_grad():
            out = self.model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)
        return [int(t) for t in out[0, len(PROMPT) :]]

    def save(self, path: Path) -> Path:
        self.model.save_pretrained(str(path))
        return path


def make_model(args: argparse.Namespace, work: Path) -> Path:
    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model

    if args.smoke:
        return make_tiny_model(work / "model", seed=0)
    heads = max(4, args.hidden // 64)
    return make_tiny_model(
        work / "model",
        seed=0,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_layers=args.layers,
        num_heads=heads,
        num_kv_heads=max(1, heads // 2),
        vocab_size=args.vocab,
        initializer_range=0.02,
        dtype="bfloat16",
    )


# ------------------------------------------------------------------------------------ phases


class Run:
    """The result document, its checks and the phases run so far."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.perf_counter()
        self.doc: dict[str, Any] = {
            "what": f"real {args.engine} on one GPU driven by the fleet"
            + (" (smoke: the reference engine on CPU)" if args.smoke else ""),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "env": versions(args.engine),
            "phases": {},
            "checks": {},
            "not_run": {},
            "ok": False,
        }
        self.wanted = {p for p in args.phases.split(",") if p}

    def check(self, name: str, ok: bool) -> None:
        self.doc["checks"][name] = bool(ok)

    def phase(self, name: str, fn: Callable[[dict[str, Any]], None]) -> None:
        if self.wanted and name not in self.wanted:
            return
        if time.perf_counter() - self.t0 > self.args.deadline_s:
            self.doc["not_run"][name] = "past --deadline-s"
            return
        row: dict[str, Any] = {}
        self.doc["phases"][name] = row
        t = time.perf_counter()
        try:
            fn(row)
        except Exception as exc:  # recorded: the next phases still run
            row["error"] = f"{type(exc).__name__}: {exc}"
            row["traceback"] = traceback.format_exc()[-4000:]
            self.check(f"{name}_ran", False)
        row["seconds"] = round(time.perf_counter() - t, 3)
        self.write()

    def write(self) -> None:
        self.doc["elapsed_s"] = round(time.perf_counter() - self.t0, 3)
        checks = self.doc["checks"]
        errors = [p for p, r in self.doc["phases"].items() if "error" in r]
        self.doc["ok"] = bool(checks) and all(checks.values()) and not errors
        self.args.out.parent.mkdir(parents=True, exist_ok=True)
        self.args.out.write_text(json.dumps(self.doc, indent=2, default=str))


def versions(engine: str) -> dict[str, Any]:
    import importlib.metadata as md

    out: dict[str, Any] = {"python": platform.python_version()}
    for name in ("torch", "transformers", engine, "sglang-kernel", "flashinfer-python"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return round(ordered[k], 3)


def wait_recovered(fleet: Any, killed: Mapping[str, Any], timeout: float = 900.0) -> list[Any]:
    """The victim's recovery records once its recovery after ``killed["at"]`` ended (the fleet
    notices a death on its next health round: the record may not exist yet)."""
    gid, at = killed.get("group"), killed.get("at", 0.0)
    deadline = time.monotonic() + timeout
    recs: list[Any] = []
    while time.monotonic() < deadline:
        recs = [
            x.as_dict()
            for x in fleet.recoveries()
            if x.group_id == gid and (x.as_dict().get("started_at") or 0) >= at - 1
        ]
        if recs and recs[-1]["status"] in ("active", "retired", "failed", "pending_weights"):
            fleet.wait_recoveries(timeout=max(1.0, deadline - time.monotonic()))
            return recs
        time.sleep(0.2)
    return recs


def greedy_of(fleet: Any) -> tuple[list[int], str | None, str]:
    out = fleet.generate(PROMPT, sampling_params=GREEDY)
    return list(out.result.output_ids), out.result.weight_version, out.group_id


def fleet_config(
    args: argparse.Namespace,
    work: Path,
    model_dir: Path,
    opts: dict[str, Any],
    transport: Any,
    groups: int,
    name: str,
) -> Any:
    from rollsafe.adapters.engines import EngineSpec
    from rollsafe.fleet import FleetConfig, GroupSpec, RecoverySettings

    return FleetConfig(
        model_path=model_dir,
        export_root=work / f"exports-{name}",
        groups=[GroupSpec(1) for _ in range(groups)],
        transport=transport,
        enable_immediate_recovery=True,
        # the fleet sets ranks and the start version (initial_version 0) per group
        engine=EngineSpec(model_path=str(model_dir), **opts),
        start_timeout_s=900.0,
        request_timeout_s=300.0,
        # every kill of the kill phase may land on the same group: the budget covers them all
        # (the fleet's default of 3 would retire it on the fourth, as it should)
        recovery=RecoverySettings(timeout_s=900.0, restart_budget=max(3, args.kills + 2)),
    )


def nccl_settings(args: argparse.Namespace) -> Any:
    from rollsafe.fleet import NcclSettings

    return NcclSettings(backend="gloo" if args.smoke else "nccl", group_timeout_s=90.0)


def run(args: argparse.Namespace, r: Run) -> None:
    import torch

    from rollsafe.adapters.engines import EngineLauncher, EngineSpec, NoWeightChecker
    from rollsafe.adapters.engines.errors import EngineAsleep
    from rollsafe.fleet import RolloutFleet
    from rollsafe.probe import probe_engines, record_answers

    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke on a CPU machine")
    if cuda:
        os.environ.update(TRAINER_NCCL_ENV)
        r.doc["env"]["gpu"] = torch.cuda.get_device_name(0)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix=f"rollsafe-real-{args.engine}-"))
    (work / "engine-logs").mkdir(parents=True, exist_ok=True)
    model_dir = make_model(args, work)
    trainer = Trainer(model_dir, "cuda" if cuda else "cpu")
    real = not args.smoke
    opts = engine_options(args, work, real=real)
    r.doc["engine"] = {k: v for k, v in opts.items() if k != "env"}
    config = fleet_config(args, work, model_dir, opts, nccl_settings(args), 2, "main")
    version = 0
    t = time.perf_counter()
    with RolloutFleet(config) as fleet:
        r.doc["phases"]["start"] = {"fleet_start_s": round(time.perf_counter() - t, 3)}

        class Clients:
            """Each group's current client (a recovered group has a new one)."""

            def items(self) -> Any:
                return {g.group_id: g.client for g in fleet.registry.groups()}.items()

            def values(self) -> Any:
                return [c for _, c in self.items()]

            def __iter__(self) -> Any:
                return iter([gid for gid, _ in self.items()])

            def __getitem__(self, gid: str) -> Any:
                return dict(self.items())[gid]

        clients: Any = Clients()

        def start(row: dict[str, Any]) -> None:
            spoken = {gid: c.server_dialect().version for gid, c in clients.items()}
            row["dialects"] = spoken
            want = "0.26.0" if args.engine == "vllm" else ("0.5.16" if real else "0.5.23")
            r.check("start_speaks_the_release", set(spoken.values()) == {want})

        def greedy_row(ids: list[int]) -> dict[str, Any]:
            agree = trainer.greedy_agrees(ids, int(GREEDY["max_new_tokens"]))
            return {
                "greedy_ok": agree["ok"],
                "greedy_exact": agree["exact"],
                "greedy_gap": agree["gap"],
            }

        def generate(row: dict[str, Any]) -> None:
            ids, got, gid = greedy_of(fleet)
            row.update(output_ids=ids, version=got, group=gid)
            r.check("generate_start_version", got == "0" and len(ids) == GREEDY["max_new_tokens"])
            row["greedy"] = greedy_row(ids)
            r.check("generate_equals_trainer", row["greedy"]["greedy_ok"])

        def sync(row: dict[str, Any]) -> None:
            nonlocal version
            rows = []
            for _ in range(args.syncs):
                version += 1
                trainer.train_step(seed=version)
                t0 = time.perf_counter()
                report = fleet.sync_weights(trainer.weights(), version)
                took = time.perf_counter() - t0
                ids, got, _ = greedy_of(fleet)
                labels = {gid: c.weight_version() for gid, c in clients.items()}
                rows.append(
                    {
                        "version": version,
                        "ok": report.ok,
                        "failed": list(report.failed),
                        "sync_s": round(took, 4),
                        "timings": {k: round(v, 4) for k, v in report.timings.items()},
                        "labels": labels,
                        **greedy_row(ids),
                        "served_version": got,
                    }
                )
            row["syncs"] = rows
            row["sync_s_median"] = statistics.median(x["sync_s"] for x in rows)
            # how the trainer joined the engines' weight-update groups: "vllm" for a real vLLM
            # over NCCL (vLLM's StatelessProcessGroup + PyNccl: rollsafe.wire.vllm_group)
            row["rendezvous"] = fleet.engine_traits.rendezvous
            r.check("sync_every_version_ok", all(x["ok"] and not x["failed"] for x in rows))
            r.check(
                "sync_labels_and_served_version",
                all(
                    set(x["labels"].values()) == {str(x["version"])}
                    and x["served_version"] == str(x["version"])
                    for x in rows
                ),
            )
            r.check("sync_greedy_equals_trainer", all(x["greedy_ok"] for x in rows))

        def probe(row: dict[str, Any]) -> None:
            fresh_dir = trainer.save(work / f"fresh-v{version}")
            shutil.copy2(model_dir / "tokenizer.json", fresh_dir / "tokenizer.json")
            for extra in ("tokenizer_config.json", "special_tokens_map.json"):
                if (model_dir / extra).exists():
                    shutil.copy2(model_dir / extra, fresh_dir / extra)
            spec_opts = {k: v for k, v in opts.items() if k not in ("log_dir",)}
            spec = EngineSpec(
                model_path=str(fresh_dir), log_dir=str(work / "engine-logs"), **spec_opts
            )
            t0 = time.perf_counter()
            with EngineLauncher(spec) as fresh:  # started on entering
                row["fresh_start_s"] = round(time.perf_counter() - t0, 3)
                reference = record_answers(fresh.client)
                verdicts = probe_engines(dict(clients.items()), reference)
            row["verdicts"] = {g: v.summary() for g, v in verdicts.items()}
            r.check("probe_equals_a_fresh_server", all(v.ok for v in verdicts.values()))

        def checks(row: dict[str, Any]) -> None:
            # SGLang's checker hashes every tensor on its scheduler: seconds on the GPU run
            sums = fleet.checksums(timeout=120)
            row["checksums"] = sums
            if args.engine == "vllm":
                refused = []
                for c in clients.values():
                    try:
                        c.weights_checksum()
                        refused.append(False)
                    except NoWeightChecker:
                        refused.append(True)
                r.check("vllm_0_26_has_no_checker", all(refused) and set(sums.values()) == {None})
            else:
                verdicts = fleet.check_weights(trainer.weights(), timeout=120)
                row["verdicts"] = {g: (v.verdict if v else None) for g, v in verdicts.items()}
                # which tensors were not equal, and how (missing, unexpected, no_data, differs)
                row["summaries"] = {g: (v.summary() if v else None) for g, v in verdicts.items()}
                r.check(
                    "sglang_checker_equals_trainer",
                    all(v is not None and v.verdict == "equal" for v in verdicts.values()),
                )

        def sleep(row: dict[str, Any]) -> None:
            nonlocal version
            levels = (1, 2) if args.engine == "vllm" else (1,)
            rows = []
            for level in levels:
                fleet.pause()
                t0 = time.perf_counter()
                for c in clients.values():
                    if args.engine == "vllm":
                        c.release_memory_occupation(level=level)  # type: ignore[call-arg]
                    else:
                        c.release_memory_occupation()
                sleep_s = time.perf_counter() - t0
                refused = None
                if args.engine == "vllm":
                    c0 = next(iter(clients.values()))
                    try:
                        c0.update_weights_from_distributed(["x"], ["float32"], [[1]])
                        refused = False
                    except EngineAsleep:
                        refused = True
                    c0.health()  # nothing reached the server: it still answers
                version += 1
                trainer.train_step(seed=1000 + version)  # the colocated trainer's step
                t0 = time.perf_counter()
                for c in clients.values():
                    c.resume_memory_occupation()
                wake_s = time.perf_counter() - t0
                report = fleet.sync_weights(trainer.weights(), version)
                fleet.resume()
                ids, got, _ = greedy_of(fleet)
                rows.append(
                    {
                        "level": level,
                        "sleep_s": round(sleep_s, 3),
                        "wake_s": round(wake_s, 3),
                        "sync_ok": report.ok and not report.failed,
                        "update_while_asleep_refused": refused,
                        **greedy_row(ids),
                        "served_version": got,
                    }
                )
            row["cycles"] = rows
            r.check(
                "sleep_cycles_sync_and_serve_the_new_version",
                all(
                    x["sync_ok"]
                    and x["greedy_ok"]
                    and x["served_version"] == str(version - (len(rows) - 1 - i))
                    for i, x in enumerate(rows)
                ),
            )
            if args.engine == "vllm":
                r.check(
                    "update_while_asleep_refused_by_the_client",
                    all(x["update_while_asleep_refused"] for x in rows),
                )
            r.doc["not_run"]["sleep_pending_weights"] = (
                "the fleet has no call that takes a sleeping group out of routing "
                "(pending_weights) and back: the phase pauses the whole fleet instead"
            )

        def kill(row: dict[str, Any]) -> None:
            kills = []
            length = 512  # long enough that the SIGKILL lands mid-rollout (a loaded CPU too)
            for k in range(args.kills):
                killed: dict[str, Any] = {}
                done: dict[str, Any] = {}

                def on_progress(gid: str, tokens: int, killed: dict[str, Any] = killed) -> None:
                    if tokens >= 3 and not killed:
                        killed.update(group=gid, at=time.time(), pids=kill_group(fleet, gid))

                fleet.router.on_progress = on_progress

                def rollout(done: dict[str, Any] = done) -> None:
                    try:
                        out = fleet.generate(
                            PROMPT,
                            sampling_params={
                                "max_new_tokens": length,
                                "temperature": 0.0,
                                "ignore_eos": True,
                            },
                        )
                        done.update(
                            tokens=len(out.result.output_ids),
                            continued=out.continued,
                            versions=list(out.weights_versions),
                        )
                    except Exception as exc:
                        done["error"] = f"{type(exc).__name__}: {exc}"

                th = threading.Thread(target=rollout)
                th.start()
                th.join(timeout=600)
                fleet.router.on_progress = None
                recs = wait_recovered(fleet, killed)
                active_at = recs[-1]["active_at"] if recs else None
                labels = {
                    g.group_id: g.client.weight_version() if g.client else None
                    for g in fleet.registry.groups()
                }
                kills.append(
                    {
                        "n": k,
                        **{key: v for key, v in killed.items() if key != "pids"},
                        **done,
                        "status": recs[-1]["status"] if recs else None,
                        "kill_to_active_s": round(active_at - killed["at"], 3)
                        if active_at and killed
                        else None,
                        "labels": labels,
                    }
                )
                row["kills"] = kills
                r.write()  # a time-out still leaves the kills so far
            row["kills"] = kills
            times = [x["kill_to_active_s"] for x in kills if x["kill_to_active_s"] is not None]
            row["kill_to_active_p50_s"] = pct(times, 0.5)
            row["kill_to_active_p95_s"] = pct(times, 0.95)
            ok = all(
                x.get("group")
                and x.get("continued")
                and x.get("tokens") == length
                and x["status"] == "active"
                and set(x["labels"].values()) == {str(version)}
                for x in kills
            )
            r.check("kill_cut_continued_recovered_at_the_version", ok and len(kills) == args.kills)

        def failed(row: dict[str, Any]) -> None:
            """One group's update fails: its weights released behind the fleet's back (vLLM:
            the client refuses the update, EngineAsleep; SGLang: the engine fails it), so
            the fleet fails that group, never routes it, and recovers it; the other group
            takes the version."""
            nonlocal version
            victim = sorted(clients)[0]
            c = clients[victim]
            if args.engine == "vllm":
                c.release_memory_occupation(level=1)  # type: ignore[call-arg]
            else:
                c.release_memory_occupation(["weights"])
            version += 1
            trainer.train_step(seed=2000 + version)
            at = time.time()
            report = fleet.sync_weights(trainer.weights(), version)
            synced_at = time.time()
            routable_after = [g.group_id for g in fleet.registry.routable()]
            row.update(
                ok=report.ok,
                failed=list(report.failed),
                failed_groups=list(report.failed_groups),
                updated=list(report.updated),
                targeted=list(report.targeted),
                not_targeted=dict(report.not_targeted),
                update_results={
                    g: {"ok": t.ok, "reason": t.reason} for g, t in report.update_results.items()
                },
                sync_s=round(synced_at - at, 3),
                timings={k: round(v, 4) for k, v in report.timings.items()},
                routable_right_after=routable_after,
            )
            recs = wait_recovered(fleet, {"group": victim, "at": at})
            # the victim's own transitions since the sync began: it must leave ``active`` in
            # the sync (the router sends only to ``active``) and enter it again only after
            # its recovery loaded the version (a quick recovery may end before the sync returns)
            moves = [
                {k: x[k] for k in ("event", "source", "target", "timestamp")}
                for x in fleet.timeline(from_memory=True)
                if x["kind"] == "group" and x["subject"] == victim and x["timestamp"] >= at
            ]
            left = next((m for m in moves if m["source"] == "active"), None)
            back = next((m for m in moves if m["target"] == "active"), None)
            row["victim_moves"] = moves
            never_routed = (
                left is not None
                and left["timestamp"] <= synced_at
                and back is not None
                and back["timestamp"] > left["timestamp"]
                and back["event"] == "weights_loaded"
            )
            states = {g.group_id: g.state for g in fleet.registry.groups()}
            labels = {
                g.group_id: g.client.weight_version() if g.client else None
                for g in fleet.registry.groups()
            }
            ids, got, _ = greedy_of(fleet)
            row.update(states=states, labels=labels, recovery=recs[-1] if recs else None)
            # SGLang's /health generates a token, which fails on released weights: the health
            # manager can fail the victim before the sync's update reaches it (the sync then
            # leaves it out), or the update fails it; either way it is not updated, it left
            # ``active`` before the sync returned, and the other group took the version
            r.check(
                "failed_update_fails_that_group",
                victim not in report.updated
                and left is not None
                and left["timestamp"] <= synced_at
                and (report.failed == [victim] or (not report.failed and bool(report.updated))),
            )
            r.check("failed_group_never_routed", never_routed)
            r.check(
                "failed_group_recovered_at_the_version",
                set(states.values()) == {"active"}
                and set(labels.values()) == {str(version)}
                and greedy_row(ids)["greedy_ok"]
                and got == str(version),
            )

        r.phase("start", start)
        r.phase("generate", generate)
        r.phase("sync", sync)
        r.phase("probe", probe)
        r.phase("checks", checks)
        r.phase("sleep", sleep)
        r.phase("kill", kill)
        r.phase("failed", failed)
    if args.engine == "vllm":
        r.doc["not_run"]["sync_ipc"] = (
            "vLLM's ipc weight-transfer engine (CUDA IPC handles through /update_weights, "
            "backend 'ipc'; its module imports ray) has no rollsafe transport yet: the fleet's "
            "'ipc' transport speaks SGLang's /update_weights_from_tensor"
        )
    if args.timing:
        r.phase("update_times", lambda row: update_times(args, work, row, r))


def timing_model(shape: str, work: Path, smoke: bool) -> tuple[Path, dict[str, Any]]:
    """A config-only model directory (dummy weights in the server) and the trainer's config."""
    from qwen3_shapes import QWEN3_4B, qwen3_config

    from rollsafe.adapters.reference_engine.tiny_model import make_tokenizer

    base = dict(QWEN3_TINY if smoke else (QWEN3_4B if shape == "qwen3-4b" else QWEN3_8B))
    config = {**qwen3_config(), **base, "num_hidden_layers": base["num_hidden_layers"]}
    if smoke:  # the CPU trainer's weights are float32
        config.update(torch_dtype="float32", dtype="float32")
    path = work / f"timing-{shape}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tok = make_tokenizer(min(512, int(config["vocab_size"])))
    tok.save(str(path / "tokenizer.json"))  # type: ignore[attr-defined]
    return path, config


def timing_weights(config: Mapping[str, Any], device: str) -> dict[str, Any]:
    import torch
    from qwen3_shapes import shapes_from_config

    shapes = shapes_from_config(dict(config))
    if not config["tie_word_embeddings"]:
        shapes.append(("lm_head.weight", (config["vocab_size"], config["hidden_size"])))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(1)
    out = {}
    for name, shape in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        t.normal_(0.0, 0.02, generator=gen)
        out[name] = t
    return out


def update_times(args: argparse.Namespace, work: Path, row: dict[str, Any], r: Run) -> None:
    """Update time per version per transport (median of ``--updates`` after a first)."""
    from rollsafe.fleet import IpcSettings, RolloutFleet

    transports: dict[str, Any] = {"nccl": nccl_settings(args)}
    if args.engine == "sglang":
        transports["ipc"] = IpcSettings()
        try:
            import checkpoint_engine  # noqa: F401

            from rollsafe.fleet import CheckpointEngineSettings

            if not args.smoke:
                transports["checkpoint_engine"] = CheckpointEngineSettings()
        except ImportError:
            r.doc["not_run"]["update_times_checkpoint_engine"] = "checkpoint_engine not installed"
    device = "cpu" if args.smoke else "cuda"
    kinds = [("real", True)] + ([("reference", False)] if args.with_reference else [])
    rows = []
    for shape in [s for s in args.timing.split(",") if s]:
        model_dir, config = timing_model(shape, work, args.smoke)
        weights = timing_weights(config, device)
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        for kind, real in kinds:
            for tname, transport in transports.items():
                opts = engine_options(args, work, real=real and not args.smoke)
                opts["load_format"] = "dummy"
                cfg = fleet_config(args, work, model_dir, opts, transport, 1, f"{shape}-{tname}")
                times = []
                with RolloutFleet(cfg) as fleet:
                    for v in range(1, args.updates + 2):
                        t0 = time.perf_counter()
                        report = fleet.sync_weights(weights, v)
                        times.append(time.perf_counter() - t0)
                        if not report.ok or report.failed or not report.updated:
                            raise RuntimeError(f"{shape} {tname} v{v}: {report}")
                rows.append(
                    {
                        "shape": shape,
                        "bytes": nbytes,
                        "engine": kind,
                        "transport": tname,
                        "first_s": round(times[0], 4),
                        "median_s": round(statistics.median(times[1:]), 4),
                        "times_s": [round(x, 4) for x in times],
                    }
                )
                row["rows"] = rows
                r.write()
    r.check("update_times_measured", bool(rows))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # the fleet's own account on stderr, INFO included (a recovery queued and ended, a group
    # served again), timestamped: what a hung or failed run did last
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    if args.deadline_s < 1e8:
        # a phase that hangs past the deadline (SGLang's first run: its sync until the call's
        # limit) leaves every thread's stack in the log 30 s past the deadline
        faulthandler.dump_traceback_later(args.deadline_s + 30)
    r = Run(args)
    try:
        run(args, r)
    except BaseException as exc:  # recorded, then the exit status
        r.doc["error"] = f"{type(exc).__name__}: {exc}"
        r.doc["traceback"] = traceback.format_exc()
        r.check("script_ran", False)
    r.write()
    summary = {"ok": r.doc["ok"], "checks": r.doc["checks"], "not_run": r.doc["not_run"]}
    print(json.dumps(summary, indent=1, default=str))
    if "traceback" in r.doc:
        print(r.doc["traceback"], file=sys.stderr)
    return 0 if r.doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

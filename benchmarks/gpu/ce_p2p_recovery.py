"""GPU proof (issue #13): a fleet on checkpoint-engine re-syncs a restarted group by P2P over TCP.

One H200, one trainer process (this one: the only parameter-server rank, a one-rank NCCL group),
a :class:`~rollsafe.fleet.RolloutFleet` with ``transport="checkpoint_engine"``,
``ce_p2p=True, ce_p2p_protocol="tcp"`` (Mooncake's TCP transport: the lent hosts have no RDMA
devices) and two 1-rank groups of reference engines on the same GPU (``--device cuda
--load-format dummy``), holding an 8.04 GB bf16 weight set with Qwen3-4B shapes.

1. ``syncs``: v1 and v2 pushed to both groups; each is two broadcast waves (one engine per
   parameter-server socket): the broadcast time of the set, per engine.
2. ``targeted``: client threads generate through the fleet; the victim group's engine is
   SIGKILLed while the export of the current version is still being written (no ready export),
   so the recovery restarts it on dummy weights (``pending_weights``) and pushes the registered
   version by P2P, ``ranks=[0]``, to that group only, while the other group serves; then
   ``active``. If the export was already ready at the kill (a tiny model), immediate recovery is
   switched off for this phase and that is recorded.
3. ``immediate``: the same crash once the export is ready: restarted from the export, no push.

Reported per phase: kill -> ``active``, the recovery's steps, the P2P push time and GB/s against
the broadcast time of the same set, every engine's checksum against the trainer's
(``client.weights_checksum()`` against the trainer's weights laid out as SGLang holds them,
``rollsafe.fleet.weights_check.sglang_rank_digests``),
requests the other group served meanwhile, and that no request reached the failed group while
it was not ``active`` (registry dispatch counts by state, a 5 ms state/dispatch sampler, client
records). The JSON (``--out``) is rewritten after every phase; a summary table is printed; the
exit status is non-zero when any check is false.

    source .mc/env.sh && python3 benchmarks/gpu/ce_p2p_recovery.py --out $OUT/ce_p2p.json
    python3 benchmarks/gpu/ce_p2p_recovery.py --smoke --out /tmp/ce_p2p_smoke.json

``--smoke``: a tiny Qwen3 (seconds on a GPU); on a host without CUDA it only checks what it can
(arguments, model directory, that the fleet would fall back to nccl here) and writes the JSON.
``run_device.sh ce_p2p`` is the device call (wheels and ``.mc`` carried).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _p in (str(REPO), str(REPO / "tests"), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
from multi_gpu import (  # noqa: E402  (also sets NCCL_NVLS_ENABLE=0 before NCCL starts)
    Rollout,
    build_weights,
    kill_and_measure,
    model_config,
    nbytes_of,
    on_sigterm,
    write_model_dir,
)

from rollsafe.adapters.engines import EngineSpec  # noqa: E402
from rollsafe.checksum import overall_checksum, sglang_engine_digest  # noqa: E402
from rollsafe.fleet.weights_check import sglang_rank_digests  # noqa: E402

GiB = 1 << 30
VICTIM = "g1-victim"
SERVING = "g0-serving"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--out", type=Path, required=True, help="JSON result file")
    p.add_argument("--smoke", action="store_true", help="tiny Qwen3; without CUDA: checks only")
    p.add_argument("--layers", type=int, default=None, help="Qwen3-4B with fewer layers")
    p.add_argument(
        "--bucket-gib",
        type=float,
        default=2.0,
        help="FleetConfig.ce_bucket_bytes in GiB (an update holds about 3 caps)",
    )
    p.add_argument(
        "--transfer-timeout-s",
        type=float,
        default=300.0,
        help="FleetConfig.ce_transfer_timeout_s (Mooncake's MC_TRANSFER_TIMEOUT)",
    )
    p.add_argument("--clients", type=int, default=4, help="rollout client threads")
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--engine-start-timeout-s", type=float, default=300.0)
    p.add_argument("--recovery-timeout-s", type=float, default=240.0)
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--deadline-s", type=float, default=540.0, help="skip phases after this")
    p.add_argument(
        "--no-warm-standby",
        dest="warm_standby",
        action="store_false",
        help="restart engines cold (default: FleetConfig.warm_standby=True)",
    )
    return p.parse_args(argv)


class Result:
    """The JSON document, rewritten atomically after every step."""

    def __init__(self, path: Path, args: argparse.Namespace) -> None:
        self.path = path
        self.t0 = time.monotonic()
        self.doc: dict[str, Any] = {
            "benchmark": "ce_p2p_recovery",
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "host": {"python": platform.python_version(), "torch": torch.__version__},
            "phases": {},
            "checks": {},
            "skipped": [],
            "errors": [],
            "ok": False,
        }

    def phase(self, name: str, value: dict[str, Any]) -> None:
        self.doc["phases"][name] = value
        self.flush()

    def check(self, name: str, value: object) -> bool:
        self.doc["checks"][name] = bool(value)
        self.flush()
        return bool(value)

    def error(self, where: str, exc: BaseException) -> None:
        self.doc["errors"].append(
            {
                "where": where,
                "error": f"{type(exc).__name__}: {exc}"[:4000],
                "traceback": traceback.format_exc()[-4000:],
            }
        )
        self.flush()

    def flush(self) -> None:
        self.doc["elapsed_s"] = round(time.monotonic() - self.t0, 2)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=2, default=str))
        os.replace(tmp, self.path)


def rounded(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


# ================================================================================ checksums
class Digests:
    """The trainer's digests as an SGLang engine holding its weights reports them (its fused
    parameters per TP rank), per algorithm and TP size (computed once each: 8 GB take
    seconds). ``config``: the model's config (``config.json`` as a dict)."""

    def __init__(self, weights: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        self.weights = weights
        self.config = config
        self.per_rank: dict[tuple[str, int], list[dict[str, str]]] = {}
        self.seconds: dict[str, float] = {}

    def ranks(self, algorithm: str, tp_size: int = 1) -> list[dict[str, str]]:
        key = (algorithm, tp_size)
        if key not in self.per_rank:
            t0 = time.perf_counter()
            self.per_rank[key] = sglang_rank_digests(
                self.weights, self.config, tp_size=tp_size, algorithm=algorithm
            )
            self.seconds[f"{algorithm}:tp{tp_size}"] = round(time.perf_counter() - t0, 2)
        return self.per_rank[key]

    def model(self, algorithm: str, tp_size: int = 1) -> str:
        ranks = self.ranks(algorithm, tp_size)
        return sglang_engine_digest([overall_checksum(r) for r in ranks])


def engine_checksums(fleet: Any, digests: Digests, timeout: float) -> dict[str, Any]:
    """Every group's engine checksum (its own checker) against the trainer's weights."""
    groups = {g.group_id: g.client for g in fleet.registry.groups()}

    def one(client: Any) -> Any:
        return client.weights_checksum(timeout=timeout)

    rows: dict[str, Any] = {}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, len(groups))) as pool:
        futures = {gid: pool.submit(one, c) for gid, c in groups.items() if c is not None}
        for gid, fut in futures.items():
            try:
                got = fut.result()
                tp = max(1, len(got.ranks))
                want = digests.model(got.algorithm, tp)
                rows[gid] = {
                    "equal": got.model == want,
                    "engine_model": got.model,
                    "trainer_model": want,
                    "algorithm": got.algorithm,
                }
                if got.model != want:  # name what differs
                    check = got.check(digests.ranks(got.algorithm, tp))
                    rows[gid]["differ"] = check.names("differs")[:20]
                    rows[gid]["only_engine"] = check.names("unexpected")[:10]
                    rows[gid]["only_trainer"] = check.names("missing")[:10]
            except Exception as exc:
                rows[gid] = {"equal": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
    return {
        "engines": rows,
        "equal": len(rows) == len(groups) and all(r["equal"] for r in rows.values()),
        "seconds": round(time.perf_counter() - t0, 2),
    }


# ================================================================================ one crash
def crash_and_recover(
    fleet: Any, rollout: Rollout, args: argparse.Namespace, *, expect: str
) -> dict[str, Any]:
    """SIGKILL the victim's engine; wait for its recovery; the figures and the proofs."""
    from rollsafe.transports.checkpoint_engine import CheckpointEngineFleetTransport

    tr = fleet.transport
    launcher = fleet.launcher(VICTIM)
    out: dict[str, Any] = {"expect": expect}
    if args.warm_standby:
        t0 = time.monotonic()
        out["standby_ready_before_kill"] = launcher.wait_standby(args.engine_start_timeout_s)
        out["standby_wait_s"] = round(time.monotonic() - t0, 2)
    version = fleet.registry.fleet_version
    out["fleet_version"] = version
    ready = fleet.exporter.latest_ready(version) is not None
    out["export_ready_at_kill"] = ready
    if expect == "targeted_push":
        # the export may be written before the crash is detected (a tiny model, a fast disk):
        # immediate recovery is off for this phase, so the push runs whatever the export does
        fleet.mode.disable()
        out["why_targeted"] = "immediate recovery off for this phase" + (
            "" if ready else f" (and no ready export of v{version} at the kill)"
        )
    pushes_before = len(tr.pushes) if isinstance(tr, CheckpointEngineFleetTransport) else 0
    figures, result = kill_and_measure(
        fleet, rollout, VICTIM, SERVING, timeout_s=args.recovery_timeout_s
    )
    out.update(figures)
    pushes = []
    if isinstance(tr, CheckpointEngineFleetTransport):
        pushes = list(tr.pushes)[pushes_before:]
    out.update(
        {
            "lease_step": next((s.as_dict() for s in result.steps if s.name == "lease"), None),
            "push_step": next((s.as_dict() for s in result.steps if s.name == "push"), None),
            "kill_to_left_routing_s": figures["detection_s"],
            "restart_step_s": rounded(result.step_seconds("restart")),
            "push_step_s": rounded(result.step_seconds("push")),
            "pushes_after_kill": [p.as_dict() for p in pushes],
        }
    )
    if expect == "targeted_push" and pushes:
        p2p = [p for p in pushes if p.targeted]
        push = p2p[-1] if p2p else pushes[-1]
        gb = push.nbytes / 1e9
        out["p2p_push"] = {
            "mode": push.mode,
            "ps_ranks": push.ps_ranks,
            "targets": push.targets,
            "seconds": round(push.seconds, 3),
            "gb": round(gb, 3),
            "gb_s": round(gb / push.seconds, 3) if push.seconds else None,
        }
    return out


# ================================================================================ the run
def run(args: argparse.Namespace, res: Result, tmp: Path) -> None:
    import torch.distributed as dist

    from rollsafe.fleet import (
        CheckpointEngineSettings,
        FleetConfig,
        GroupSpec,
        HealthSettings,
        RecoverySettings,
        RolloutFleet,
    )
    from rollsafe.transports.checkpoint_engine import (
        CheckpointEngineFleetTransport,
        checkpoint_engine_unavailable_reasons,
        fleet_fallback_reasons,
        mooncake_available,
    )

    deadline = time.monotonic() + args.deadline_s
    kind = "smoke" if args.smoke else "qwen3-4b"
    cfg, shapes = model_config(kind, None if args.smoke else args.layers)
    model_dir = write_model_dir(tmp / "model", cfg)
    cuda = torch.cuda.is_available()
    engine_options: dict[str, Any] = {
        "device": "cuda",
        "load_format": "dummy",
        "extra_args": ("--dtype", "bfloat16"),
        "ready_timeout": args.engine_start_timeout_s,
    }
    env = {
        "cuda": cuda,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "checkpoint_engine_unavailable": checkpoint_engine_unavailable_reasons(),
        "mooncake_importable": mooncake_available(),
        "MC_FORCE_TCP": os.environ.get("MC_FORCE_TCP"),
        "PS_P2P_STORE_RDMA_DEVICES": os.environ.get("PS_P2P_STORE_RDMA_DEVICES"),
        "rdma_devices": sorted(os.listdir("/sys/class/infiniband"))
        if os.path.isdir("/sys/class/infiniband")
        else [],
        "fleet_fallback_reasons": fleet_fallback_reasons(
            kind="reference", dialect="sglang", device=str(engine_options["device"])
        ),
        "model": {"kind": kind, "tensors": len(shapes), "layers": cfg["num_hidden_layers"]},
    }
    res.phase("env", env)
    if not cuda:
        res.doc["skipped"].append("fleet: no CUDA here (checkpoint-engine needs it)")
        res.check("smoke_without_cuda_would_fall_back", bool(env["fleet_fallback_reasons"]))
        return
    res.check("checkpoint_engine_usable", not env["checkpoint_engine_unavailable"])
    res.check("mooncake_importable", env["mooncake_importable"])

    torch.cuda.set_device(0)
    port = _free_port()
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0),
    )
    config = FleetConfig(
        model_path=model_dir,
        export_root=tmp / "exports",
        groups=[GroupSpec(1, group_id=SERVING), GroupSpec(1, group_id=VICTIM)],
        transport="checkpoint_engine",
        checkpoint_engine=CheckpointEngineSettings(
            bucket_bytes=int(args.bucket_gib * GiB),
            p2p=True,
            p2p_protocol="tcp",
            transfer_timeout_s=args.transfer_timeout_s,
            request_timeout_s=args.request_timeout_s,
            socket_timeout_s=args.request_timeout_s,
        ),
        health=HealthSettings(interval_s=0.2, timeout_s=2.0, failure_threshold=2),
        recovery=RecoverySettings(
            max_workers=2,
            timeout_s=args.recovery_timeout_s,
            restart_budget=4,
            targeted_push=True,
            expected_recovery_s=5.0,
            retry_delay_s=0.2,
        ),
        enable_immediate_recovery=True,
        engine=EngineSpec(model_path=str(model_dir), **engine_options),
        request_timeout_s=60.0,
        router_max_attempts=4,
        wait_for_routable_s=2.0,
        start_timeout_s=args.engine_start_timeout_s,
        warm_standby=args.warm_standby,
    )
    fleet = RolloutFleet(config)
    rollout: Rollout | None = None
    try:
        t0 = time.monotonic()
        weights = build_weights(shapes, torch.device("cuda", 0), seed=7)
        build_s = time.monotonic() - t0
        fleet.start()
        tr = fleet.transport
        setup = {
            "fleet_start_s": round(time.monotonic() - t0 - build_s, 1),
            "weights_build_s": round(build_s, 2),
            "weights_bytes": nbytes_of(weights),
            "weights_gb": round(nbytes_of(weights) / 1e9, 3),
            "transport": type(tr).__name__,
            "transport_fallback": fleet.transport_fallback,
            "p2p_available": getattr(tr, "p2p_available", None),
            "p2p_reason": getattr(tr, "p2p_reason", None),
            "p2p_protocol": getattr(tr, "p2p_protocol", None),
            "ce_world_size": getattr(tr, "world_size", None),
            "bucket_gib": args.bucket_gib,
            "warm_standby": args.warm_standby,
        }
        res.phase("setup", setup)
        exporter = fleet.exporter
        assert exporter is not None
        is_ce = isinstance(tr, CheckpointEngineFleetTransport)
        res.check("transport_is_checkpoint_engine", is_ce and fleet.transport_fallback is None)
        res.check("p2p_available", setup["p2p_available"])
        if not is_ce:
            return
        assert isinstance(tr, CheckpointEngineFleetTransport)

        # 1. syncs: two broadcast waves each --------------------------------------------------
        syncs: dict[str, Any] = {}
        digests: Digests | None = None

        def sync(version: int) -> dict[str, Any]:
            # the previous export ready first: a late one would suspend immediate recovery
            t_wait = time.monotonic()
            if version > 1:
                exporter.wait_hf_export(version - 1, timeout=max(1.0, deadline - t_wait))
            weights["model.norm.weight"].add_(0.5)  # every version differs from the last
            n = len(tr.pushes)
            t0 = time.monotonic()
            report = fleet.sync_weights(weights, version)
            row = {
                "ok": report.ok,
                "updated": report.updated,
                "failed": report.failed,
                "error": report.error,
                "seconds": round(time.monotonic() - t0, 3),
                "timings": {k: round(v, 3) for k, v in report.timings.items()},
                "waves": [p.as_dict() for p in list(tr.pushes)[n:]],
                "waited_for_previous_export_s": round(t0 - t_wait, 2),
                "mode_after": fleet.mode.state,
            }
            syncs[f"v{version}"] = row
            res.phase("syncs", syncs)
            return row

        for version in (1, 2):
            sync(version)
        res.check("syncs_ok", all(syncs[v]["ok"] and not syncs[v]["failed"] for v in ("v1", "v2")))
        broadcast = [w for w in syncs["v2"]["waves"] if w["mode"] == "broadcast"]
        res.check(
            "syncs_broadcast_one_engine_per_wave",
            len(broadcast) == 2 and all(len(w["targets"]) == 1 for w in broadcast),
        )

        rollout = Rollout(fleet, args.clients, args.max_new_tokens, int(cfg["vocab_size"])).start()
        warm = time.monotonic() + 60
        while time.monotonic() < warm and any(rollout.served(g) < 2 for g in (SERVING, VICTIM)):
            time.sleep(0.05)

        # 2. targeted push by P2P: crash right after sync v3, while its export is written -------
        if time.monotonic() < deadline:
            if args.warm_standby:  # the restart should find the standby ready
                fleet.launcher(VICTIM).wait_standby(args.engine_start_timeout_s)
            sync(3)  # its export is being written when the victim is killed
            res.check("sync_v3_ok", syncs["v3"]["ok"] and not syncs["v3"]["failed"])
            waves3 = [w for w in syncs["v3"]["waves"] if w["mode"] == "broadcast"]
            per_engine = [w["seconds"] for w in broadcast + waves3]
            syncs["broadcast_s_per_engine"] = [round(x, 3) for x in per_engine]
            best = min(per_engine, default=None)
            syncs["broadcast_s"] = rounded(best)
            gb = nbytes_of(weights) / 1e9
            syncs["broadcast_gb_s"] = rounded(gb / best if best else None)
            res.phase("syncs", syncs)
            digests = Digests(weights, cfg)  # v3: the registered version, untouched from here on
            a = crash_and_recover(fleet, rollout, args, expect="targeted_push")
            a["checksums"] = engine_checksums(fleet, digests, args.request_timeout_s)
            a["trainer_checksum_s"] = digests.seconds
            push = a.get("p2p_push") or {}
            if push.get("seconds") and syncs.get("broadcast_s"):
                a["p2p_over_broadcast_time"] = round(push["seconds"] / syncs["broadcast_s"], 2)
            res.phase("targeted", a)
            res.check(
                "targeted_active", a["status"] == "active" and a["strategy"] == "targeted_push"
            )
            res.check(
                "targeted_push_was_p2p_to_victim_only",
                [(p["mode"], p["ps_ranks"], p["targets"]) for p in a["pushes_after_kill"]]
                == [("p2p", [0], [VICTIM])],
            )
            res.check("targeted_checksums_equal", a["checksums"]["equal"])
            res.check("targeted_no_request_to_failed_group", a["no_request_to_failed_group"])
            res.check("targeted_other_group_served_meanwhile", a["served_by_other_meanwhile"] > 0)
            if fleet.mode.state == "disabled":
                fleet.mode.enable()
        else:
            res.doc["skipped"].append("targeted: past --deadline-s")

        # 3. immediate recovery from the ready export -------------------------------------------
        if time.monotonic() < deadline:
            version = fleet.registry.fleet_version
            t0 = time.monotonic()
            exporter.wait_hf_export(version, timeout=max(1.0, deadline - time.monotonic()))
            wait_export_s = round(time.monotonic() - t0, 2)
            b = crash_and_recover(fleet, rollout, args, expect="immediate")
            b["waited_for_export_s"] = wait_export_s
            b["mode_state"] = fleet.mode.state
            digests = digests or Digests(weights, cfg)
            b["checksums"] = engine_checksums(fleet, digests, args.request_timeout_s)
            res.phase("immediate", b)
            res.check("immediate_active", b["status"] == "active" and b["strategy"] == "immediate")
            res.check("immediate_no_push", b["pushes_after_kill"] == [])
            res.check("immediate_checksums_equal", b["checksums"]["equal"])
            res.check("immediate_no_request_to_failed_group", b["no_request_to_failed_group"])
        else:
            res.doc["skipped"].append("immediate: past --deadline-s")
    finally:
        if rollout is not None:
            rollout.stop()
        fleet.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ================================================================================ summary
def summary_rows(doc: dict[str, Any]) -> list[tuple[str, str]]:
    ph = doc["phases"]
    setup, syncs = ph.get("setup", {}), ph.get("syncs", {})
    a, b = ph.get("targeted", {}), ph.get("immediate", {})
    push = a.get("p2p_push") or {}

    def s(x: object, unit: str = "") -> str:
        return "-" if x is None else f"{x}{unit}"

    rows = [
        ("weights", s(setup.get("weights_gb"), " GB")),
        (
            "transport / P2P",
            f"{setup.get('transport', '-')} / {setup.get('p2p_protocol', '-')} "
            f"(available: {setup.get('p2p_available', '-')})",
        ),
        (
            "broadcast (sync v2, per engine)",
            f"{s(syncs.get('broadcast_s'), ' s')} ({s(syncs.get('broadcast_gb_s'), ' GB/s')})",
        ),
        (
            "P2P push to the restarted group",
            f"{s(push.get('seconds'), ' s')} "
            f"({s(push.get('gb_s'), ' GB/s')}, ranks "
            f"{push.get('ps_ranks', '-')})",
        ),
        ("kill -> active, targeted push", s(a.get("kill_to_active_s"), " s")),
        (
            "  restart step / push step",
            f"{s(a.get('restart_step_s'), ' s')} / {s(a.get('push_step_s'), ' s')}",
        ),
        ("  other group served meanwhile", s(a.get("served_by_other_meanwhile"))),
        ("kill -> active, immediate", s(b.get("kill_to_active_s"), " s")),
        ("  restart step", s(b.get("restart_step_s"), " s")),
    ]
    for name, ok in doc["checks"].items():
        rows.append((f"check: {name}", "ok" if ok else "FAILED"))
    for item in doc["skipped"]:
        rows.append(("skipped", str(item)))
    for err in doc["errors"]:
        rows.append((f"error in {err['where']}", err["error"][:100]))
    rows.append(("RESULT", "ok" if doc["ok"] else "FAILED"))
    return rows


def print_summary(doc: dict[str, Any]) -> None:
    rows = summary_rows(doc)
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, on_sigterm)
    res = Result(args.out, args)
    res.flush()
    tmp = Path(tempfile.mkdtemp(prefix="rollsafe-ce-p2p-"))
    step: Callable[[argparse.Namespace, Result, Path], None] = run
    try:
        step(args, res, tmp)
    except BaseException as exc:
        res.error("run", exc)
        if not isinstance(exc, Exception):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        checks = res.doc["checks"]
        res.doc["ok"] = bool(checks) and all(checks.values()) and not res.doc["errors"]
        res.flush()
        with contextlib.suppress(Exception):
            print_summary(res.doc)
        print(f"wrote {args.out}", flush=True)
    return 0 if res.doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

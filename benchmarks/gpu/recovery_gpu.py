"""GPU recovery at size (issue #16): an 8 GB engine SIGKILLed during rollout, back to ``active``.

One H200, the trainer (this process) holding an 8.04 GB bf16 weight set with Qwen3-4B shapes on
``cuda:0``, a :class:`~rollsafe.fleet.RolloutFleet` with ``transport="ipc"`` and two 1-rank
groups of reference engines on the same GPU (``--device cuda --load-format dummy``): ``serving``
and ``victim``. Versions 1 and 2 are pushed; v2's HF export is written by the fleet's exporter
to local disk. Client threads generate through the fleet throughout.

Phases (each one SIGKILL of the victim's engine during rollout):

============================  ===========================================================
``immediate``                 restart from the ready export of the current version (warm
                              page cache: the export was just written)
``immediate_cold_cache``      the same with the export's pages dropped from the page cache
                              first (``posix_fadvise(DONTNEED)``; ``/proc/sys/vm/drop_caches``
                              too where writable); recorded whether it took effect
``targeted``                  immediate recovery off: restart on dummy weights, then an
                              ``ipc`` push of the registered version to the victim only
``deferred``                  immediate recovery and targeted push off: restart on dummy
                              weights, wait in ``pending_weights``; the trainer's next sync
                              (v3, started as soon as the group is pending) brings it back
============================  ===========================================================

Every phase reports kill -> ``active`` and its parts: detection (kill -> the group leaves
``active``), the recovery's steps (restart, health, push), the engine's own start-up phases from
its ready line (from the standby handoff or the spawn: ``cuda_init``, ``model_built``,
``weights_read``, ``weights_loaded``, ``serving``), the export read in GB/s (``weights_read -
model_built``) and the copy onto the GPU (``weights_loaded - weights_read``); then every
engine's checksum against the trainer's (the SGLang digest computed on the GPU on both sides,
timed), the requests the serving group answered meanwhile, and that no request reached the
victim while it was not ``active``. Run it twice for both restart sources: with the warm
standby (default) and ``--no-warm-standby`` (fresh spawns).

    python3 benchmarks/gpu/recovery_gpu.py --out $OUT/recovery_gpu.json
    python3 benchmarks/gpu/recovery_gpu.py --no-warm-standby --phases immediate,targeted \\
        --out $OUT/recovery_gpu_fresh.json
    python3 benchmarks/gpu/recovery_gpu.py --smoke --out /tmp/recovery_smoke.json  # CPU, tiny

``--smoke`` runs every phase with a tiny Qwen3 on the CPU (engines ``--device cpu``): it checks
the script, not the figures. The JSON (``--out``) is rewritten after every phase; a summary
table is printed; the exit status is non-zero when any check is false.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _p in (str(REPO), str(REPO / "tests"), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
from ce_p2p_recovery import Digests, Result, engine_checksums  # noqa: E402
from multi_gpu import (  # noqa: E402  (also sets NCCL_NVLS_ENABLE=0)
    Rollout,
    build_weights,
    kill_and_measure,
    model_config,
    nbytes_of,
    on_sigterm,
    write_model_dir,
)

VICTIM = "victim"
SERVING = "serving"
PHASES = ("immediate", "immediate_cold_cache", "targeted", "deferred")
ENGINE_PHASES = (
    "preloaded",
    "cuda_init",
    "model_built",
    "weights_read",
    "weights_loaded",
    "rank0_loaded",
    "serving",
)


def _rate(gb_s: float) -> float:
    """A rate to three significant digits: the CPU smoke's export of a few MB, read on a
    loaded machine, is well under 0.005 GB/s and two decimals made it 0.0."""
    return float(f"{gb_s:.3g}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--out", type=Path, required=True, help="JSON result file")
    p.add_argument("--smoke", action="store_true", help="tiny Qwen3 on the CPU: checks the script")
    p.add_argument("--layers", type=int, default=None, help="Qwen3-4B with fewer layers")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {PHASES}")
    p.add_argument("--repeats", type=int, default=1, help="crashes per phase (interleaved)")
    p.add_argument("--clients", type=int, default=4, help="rollout client threads")
    p.add_argument("--checksum-repeats", type=int, default=5, help="timed digests of the set")
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--engine-start-timeout-s", type=float, default=300.0)
    p.add_argument("--recovery-timeout-s", type=float, default=240.0)
    p.add_argument("--deadline-s", type=float, default=540.0, help="skip phases after this")
    p.add_argument(
        "--export-dir",
        type=Path,
        default=None,
        help="where exports go (default: a temporary local directory)",
    )
    p.add_argument(
        "--no-warm-standby",
        dest="warm_standby",
        action="store_false",
        help="restart engines with a fresh spawn (default: warm standby)",
    )
    args = p.parse_args(argv)
    args.phase_list = [x for x in args.phases.split(",") if x]
    unknown = sorted(set(args.phase_list) - set(PHASES))
    if unknown:
        p.error(f"--phases: unknown {unknown}; choose from {PHASES}")
    return args


# ================================================================================ page cache
def drop_page_cache(paths: Sequence[Path], *, whole_host: bool) -> dict[str, Any]:
    """Evict ``paths`` from the page cache: ``posix_fadvise(DONTNEED)`` on each file (no
    privilege needed for clean pages), and with ``whole_host`` the global ``drop_caches``
    where it is writable (never in ``--smoke``: that would slow down a shared CI host)."""
    out: dict[str, Any] = {"files": len(paths), "bytes": 0, "fadvise": False, "drop_caches": None}
    try:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                out["bytes"] += os.fstat(fd).st_size
            finally:
                os.close(fd)
        out["fadvise"] = True
    except OSError as exc:
        out["fadvise_error"] = f"{type(exc).__name__}: {exc}"
    if whole_host:
        try:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
            out["drop_caches"] = True
        except OSError as exc:
            out["drop_caches"] = f"not writable here ({type(exc).__name__})"
    out["resident_after"] = resident_fraction(paths)
    return out


def resident_fraction(paths: Sequence[Path]) -> float | None:
    """Share of ``paths``' pages in the page cache (``mmap`` + ``mincore`` through ctypes)."""
    import ctypes
    import mmap

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        page = mmap.PAGESIZE
        total = resident = 0
        for path in paths:
            size = path.stat().st_size
            if size == 0:
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if addr is None or addr == ctypes.c_void_p(-1).value:
                    return None
                try:
                    pages = (size + page - 1) // page
                    vec = (ctypes.c_ubyte * pages)()
                    if libc.mincore(addr, size, vec) != 0:
                        return None
                    total += pages
                    resident += sum(1 for b in vec if b & 1)
                finally:
                    libc.munmap(addr, size)
            finally:
                os.close(fd)
        return round(resident / total, 3) if total else None
    except Exception:
        return None


def export_files(fleet: Any, version: int) -> tuple[Path | None, list[Path]]:
    rec = fleet.exporter.latest_ready(version)
    if rec is None:
        return None, []
    path = Path(rec.path)
    return path, sorted(path.glob("*.safetensors"))


# ================================================================================ one crash
def engine_breakdown(ready: dict[str, Any], export_bytes: int) -> dict[str, Any]:
    """The restarted engine's start-up phases (ready line) turned into durations."""
    marks = {k: v for k, v in (ready.get("startup_s") or {}).items() if isinstance(v, (int, float))}
    out: dict[str, Any] = {"marks_s": marks, "from_standby": ready.get("from_standby", False)}
    prev = 0.0
    for name in ENGINE_PHASES:
        if name in marks:
            out[f"{name}_part_s"] = round(marks[name] - prev, 3)
            prev = marks[name]
    if "weights_read" in marks and "model_built" in marks:
        read_s = marks["weights_read"] - marks["model_built"]
        out["export_read_s"] = round(read_s, 3)
        out["export_read_gb_s"] = _rate(export_bytes / 1e9 / read_s) if read_s > 0 else None
    if "weights_loaded" in marks and "weights_read" in marks:
        copy_s = marks["weights_loaded"] - marks["weights_read"]
        out["copy_to_device_s"] = round(copy_s, 3)
        if "model_built" in marks:
            total = marks["weights_loaded"] - marks["model_built"]
            out["export_to_device_s"] = round(total, 3)
            out["export_to_device_gb_s"] = _rate(export_bytes / 1e9 / total) if total > 0 else None
    return out


def crash(
    fleet: Any, rollout: Rollout, args: argparse.Namespace, *, expect: str, on_pending: Any = None
) -> dict[str, Any]:
    """SIGKILL the victim's engine during rollout; wait for it to be ``active`` again."""
    out: dict[str, Any] = {"expect": expect}
    if args.warm_standby:
        t0 = time.monotonic()
        launcher = fleet.launcher(VICTIM)
        out["standby_ready_before_kill"] = launcher.wait_standby(args.engine_start_timeout_s)
        out["standby_wait_s"] = round(time.monotonic() - t0, 2)
    figures, _result = kill_and_measure(
        fleet, rollout, VICTIM, SERVING, timeout_s=args.recovery_timeout_s, on_pending=on_pending
    )
    out.update(figures)
    return out


# ================================================================================ one phase
def one_phase(
    fleet: Any, rollout: Rollout, args: argparse.Namespace, name: str, sync: Any
) -> dict[str, Any]:
    """One crash of phase ``name`` (see the module docstring) and its measurements."""
    deadline = time.monotonic() + args.recovery_timeout_s
    version = fleet.registry.fleet_version
    fleet.exporter.wait_hf_export(version, timeout=max(1.0, deadline - time.monotonic()))
    _path, files = export_files(fleet, version)
    export_bytes = sum(f.stat().st_size for f in files)
    pre: dict[str, Any] = {
        "export_version": version,
        "export_files": len(files),
        "export_bytes": export_bytes,
        "export_gb": round(export_bytes / 1e9, 3),
        "resident_before": resident_fraction(files),
    }
    on_pending = None
    if name == "immediate_cold_cache":
        pre["page_cache"] = drop_page_cache(files, whole_host=not args.smoke)
        pre["page_cache_dropped"] = bool(
            pre["page_cache"].get("fadvise")
            and (pre["page_cache"].get("resident_after") or 0) < 0.05
        )
    if name in ("targeted", "deferred"):
        fleet.mode.disable()
    saved_transport = fleet.recovery.transport
    if name == "deferred":
        fleet.recovery.transport = None  # as with RecoverySettings(targeted_push=False)

        def on_pending() -> dict[str, Any]:
            return sync(fleet.registry.fleet_version + 1)  # type: ignore[no-any-return]

    expect = (
        "immediate"
        if name.startswith("immediate")
        else ("targeted_push" if name == "targeted" else "deferred")
    )
    try:
        row = crash(fleet, rollout, args, expect=expect, on_pending=on_pending)
    finally:
        fleet.recovery.transport = saved_transport
        if fleet.mode.state == "disabled":
            fleet.mode.enable()
    row.update(pre)
    ready = dict(fleet.launcher(VICTIM).ready_info)
    row["engine"] = engine_breakdown(ready, export_bytes if expect == "immediate" else 0)
    return row


def _dist(values: Sequence[float | None]) -> dict[str, Any]:
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return {"n": 0}
    p95 = xs[min(len(xs) - 1, max(0, math.ceil(0.95 * len(xs)) - 1))]
    return {
        "n": len(xs),
        "median": round(statistics.median(xs), 3),
        "p95": round(p95, 3),
        "max": round(xs[-1], 3),
        "min": round(xs[0], 3),
    }


def phase_summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median / p95 / max over a phase's runs: kill -> active and every timed part."""

    def col(get: Any) -> dict[str, Any]:
        return _dist([get(r) for r in runs])

    out: dict[str, Any] = {
        "kill_to_active_s": col(lambda r: r["kill_to_active_s"]),
        "detection_s": col(lambda r: r["detection_s"]),
        "restart_step_s": col(lambda r: r["steps_s"].get("restart")),
        "health_step_s": col(lambda r: r["steps_s"].get("health")),
        "push_step_s": col(lambda r: r["steps_s"].get("push")),
        "kill_to_pending_s": col(lambda r: r.get("kill_to_pending_s")),
        "next_sync_s": col(lambda r: (r.get("next_sync") or {}).get("seconds")),
        "restart_sources": sorted({str(r.get("restart_source")) for r in runs}),
    }
    for key in (
        "cuda_init_part_s",
        "model_built_part_s",
        "serving_part_s",
        "export_to_device_s",
        "export_to_device_gb_s",
        "export_read_s",
        "copy_to_device_s",
    ):
        out[f"engine_{key}"] = col(lambda r, k=key: r["engine"].get(k))
    marks = [r["engine"]["marks_s"] for r in runs]
    out["engine_preloaded_s"] = _dist([m.get("preloaded") for m in marks])
    out["engine_serving_s"] = _dist([m.get("serving") for m in marks])
    return out


# ================================================================================ the run
def run(args: argparse.Namespace, res: Result, tmp: Path) -> None:
    from rollsafe.adapters.engines import EngineSpec
    from rollsafe.fleet import (
        FleetConfig,
        GroupSpec,
        HealthSettings,
        RecoverySettings,
        RolloutFleet,
    )

    deadline = time.monotonic() + args.deadline_s
    kind = "smoke" if args.smoke else "qwen3-4b"
    cfg, shapes = model_config(kind, None if args.smoke else args.layers)
    model_dir = write_model_dir(tmp / "model", cfg)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if not cuda and not args.smoke:
        res.doc["skipped"].append("everything: no CUDA here (use --smoke on a CPU host)")
        res.check("cuda_available", False)
        return
    engine_options: dict[str, Any] = {
        "device": "cuda" if cuda else "cpu",
        "load_format": "dummy",
        "extra_args": ("--dtype", "bfloat16"),
        "ready_timeout": args.engine_start_timeout_s,
    }
    export_root = args.export_dir or (tmp / "exports")
    res.phase(
        "env",
        {
            "cuda": cuda,
            "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "model": {"kind": kind, "tensors": len(shapes), "layers": cfg["num_hidden_layers"]},
            "export_root": str(export_root),
            "warm_standby": args.warm_standby,
            "cpus": os.cpu_count(),
        },
    )
    config = FleetConfig(
        model_path=model_dir,
        export_root=export_root,
        groups=[GroupSpec(1, group_id=SERVING), GroupSpec(1, group_id=VICTIM)],
        transport="ipc",
        health=HealthSettings(interval_s=0.2, timeout_s=2.0, failure_threshold=2),
        recovery=RecoverySettings(
            max_workers=2,
            timeout_s=args.recovery_timeout_s,
            restart_budget=args.repeats * len(args.phase_list) + 2,  # every crash restarts
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
        weights = build_weights(shapes, device, seed=7)
        build_s = time.monotonic() - t0
        fleet.start()
        exporter = fleet.exporter
        assert exporter is not None
        res.phase(
            "setup",
            {
                "fleet_start_s": round(time.monotonic() - t0 - build_s, 1),
                "weights_gb": round(nbytes_of(weights) / 1e9, 3),
                "transport": type(fleet.transport).__name__,
            },
        )
        syncs: dict[str, Any] = {}

        def sync(version: int) -> dict[str, Any]:
            t_wait = time.monotonic()
            if version > 1:  # the previous export ready first (a late one suspends immediate)
                exporter.wait_hf_export(version - 1, timeout=max(1.0, deadline - t_wait))
            weights["model.norm.weight"].add_(0.5)  # every version differs from the last
            t1 = time.monotonic()
            report = fleet.sync_weights(weights, version)
            row = {
                "ok": report.ok,
                "updated": report.updated,
                "failed": report.failed,
                "error": report.error,
                "seconds": round(time.monotonic() - t1, 3),
                "timings": {k: round(v, 3) for k, v in report.timings.items()},
                "waited_for_previous_export_s": round(t1 - t_wait, 2),
            }
            syncs[f"v{version}"] = row
            res.phase("syncs", syncs)
            return row

        for version in (1, 2):
            sync(version)
        res.check("syncs_ok", all(syncs[v]["ok"] and not syncs[v]["failed"] for v in ("v1", "v2")))
        rollout = Rollout(fleet, args.clients, args.max_new_tokens, int(cfg["vocab_size"])).start()
        warm = time.monotonic() + 60
        while time.monotonic() < warm and any(rollout.served(g) < 2 for g in (SERVING, VICTIM)):
            time.sleep(0.05)
        digests: dict[int, Digests] = {}

        def check_weights(name: str, row: dict[str, Any]) -> None:
            version = fleet.registry.fleet_version
            if version not in digests:
                digests.clear()
                digests[version] = Digests(weights, cfg)
            d = digests[version]
            row["checksums"] = engine_checksums(fleet, d, 120.0)
            row["trainer_checksum_s"] = dict(d.seconds)
            key = f"{name}_checksums_equal"
            res.check(key, res.doc["checks"].get(key, True) and row["checksums"]["equal"])

        runs = [(rep, name) for rep in range(args.repeats) for name in args.phase_list]
        for rep, name in runs:
            if time.monotonic() > deadline:
                res.doc["skipped"].append(f"{name} (run {rep + 1}): past --deadline-s")
                continue
            row = one_phase(fleet, rollout, args, name, sync)
            check_weights(name, row)
            phase = res.doc["phases"].setdefault(name, {"runs": []})
            phase["runs"].append(row)
            phase["summary"] = phase_summary(phase["runs"])
            res.phase(name, phase)
            expect = row["expect"]
            ok = res.doc["checks"]
            for key, value in (
                ("active", row["kill_to_active_s"] is not None),
                (f"strategy_{expect}", row["strategy"] == expect),
                ("no_request_to_failed_group", row["no_request_to_failed_group"]),
                ("other_group_served", row["served_by_other_meanwhile"] > 0),
                *(
                    (("page_cache_dropped", row["page_cache_dropped"]),)
                    if name == "immediate_cold_cache"
                    else ()
                ),
            ):
                res.check(f"{name}_{key}", ok.get(f"{name}_{key}", True) and value)
        if time.monotonic() < deadline:
            res.phase("checksums", checksum_timings(fleet, weights, cfg, args.checksum_repeats))
            c = res.doc["phases"]["checksums"]
            res.check("checksums_trainer_equals_engines", c["equal"])
    finally:
        if rollout is not None:
            rollout.stop()
        fleet.close()


def checksum_timings(
    fleet: Any, weights: dict[str, torch.Tensor], cfg: dict[str, Any], repeats: int
) -> dict[str, Any]:
    """Per-tensor digests of the whole set, timed: the trainer's (laid out as SGLang holds it,
    the engines' algorithm, on the weights' device; the first call is cold) and each engine's
    own checker (over HTTP)."""
    from rollsafe.fleet.weights_check import sglang_model_digest

    clients = {g.group_id: g.client for g in fleet.registry.groups() if g.client is not None}
    engine: dict[str, Any] = {}
    for gid, client in clients.items():
        times, got = [], None
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            got = client.weights_checksum(timeout=120.0)
            times.append(round(time.perf_counter() - t0, 4))
        assert got is not None
        tp = max(1, len(got.ranks))
        engine[gid] = {"seconds": times, "algorithm": got.algorithm, "model": got.model, "tp": tp}
    first = next(iter(engine.values()), {"algorithm": "sglang", "tp": 1})
    algorithm, tp = first["algorithm"], first["tp"]
    trainer_times, model = [], None
    for _ in range(repeats):
        if weights and next(iter(weights.values())).is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model = sglang_model_digest(weights, cfg, tp_size=tp, algorithm=algorithm)
        trainer_times.append(round(time.perf_counter() - t0, 4))
    ordered = sorted(trainer_times[1:]) or trainer_times
    return {
        "algorithm": algorithm,
        "tensors": len(weights),
        "gb": round(nbytes_of(weights) / 1e9, 3),
        "trainer_seconds": trainer_times,
        "trainer_first_s": trainer_times[0],
        "trainer_warm_median_s": ordered[len(ordered) // 2],
        "engines": engine,
        "equal": bool(engine) and all(e["model"] == model for e in engine.values()),
    }


# ================================================================================ summary
def summary_rows(doc: dict[str, Any]) -> list[tuple[str, str]]:
    def s(x: object, unit: str = "") -> str:
        return "-" if x is None else f"{x}{unit}"

    ph = doc["phases"]
    rows = [
        ("weights", s(ph.get("setup", {}).get("weights_gb"), " GB")),
        ("restart source", "warm standby" if doc["args"].get("warm_standby") else "fresh spawn"),
    ]

    def d(x: dict[str, Any] | None, unit: str = " s") -> str:
        if not x or not x.get("n"):
            return "-"
        if x["n"] == 1:
            return f"{x['median']}{unit}"
        return f"{x['median']} / {x['p95']} / {x['max']}{unit} (n={x['n']})"

    for name in PHASES:
        sm = (ph.get(name) or {}).get("summary")
        if not sm:
            continue
        rows.append((f"{name}: kill -> active (median / p95 / max)", d(sm["kill_to_active_s"])))
        for label, key in (
            ("detection", "detection_s"),
            ("restart step", "restart_step_s"),
            ("  engine start to import done", "engine_preloaded_s"),
            ("  engine CUDA init", "engine_cuda_init_part_s"),
            ("  engine export -> GPU", "engine_export_to_device_s"),
            ("  engine export -> GPU GB/s", "engine_export_to_device_gb_s"),
            ("health step", "health_step_s"),
            ("push step", "push_step_s"),
            ("kill -> pending", "kill_to_pending_s"),
            ("next sync", "next_sync_s"),
        ):
            if (sm.get(key) or {}).get("n"):
                unit = "" if key.endswith("gb_s") else " s"
                rows.append((f"  {label}", d(sm[key], unit)))
    c = ph.get("checksums")
    if c:
        eng = [x for e in c["engines"].values() for x in e["seconds"]]
        rows.append(
            (
                f"checksum {c['algorithm']} ({c['gb']} GB)",
                f"trainer first {c['trainer_first_s']} s, warm median "
                f"{c['trainer_warm_median_s']} s; engine calls {min(eng, default='-')}-"
                f"{max(eng, default='-')} s",
            )
        )
    for name, ok in doc["checks"].items():
        rows.append((f"check: {name}", "ok" if ok else "FAILED"))
    for item in doc["skipped"]:
        rows.append(("skipped", str(item)))
    for err in doc["errors"]:
        rows.append((f"error in {err['where']}", err["error"][:100]))
    rows.append(("RESULT", "ok" if doc["ok"] else "FAILED"))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, on_sigterm)
    res = Result(args.out, args)
    res.doc["benchmark"] = "recovery_gpu"
    res.doc["args"].pop("phase_list", None)
    res.flush()
    tmp = Path(tempfile.mkdtemp(prefix="rollsafe-recovery-gpu-"))
    try:
        run(args, res, tmp)
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
            rows = summary_rows(res.doc)
            width = max(len(k) for k, _ in rows)
            print("\n".join(f"{k:<{width}}  {v}" for k, v in rows), flush=True)
        print(f"wrote {args.out}", flush=True)
    return 0 if res.doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Write ``benchmarks/README.md``: a table of every benchmark's latest figures.

Reads the JSON files under ``benchmarks/results/`` (each benchmark script writes its own) and
extracts the headline figures and targets. Run after re-running any benchmark:
``.venv/bin/python benchmarks/summarize.py``. A result file with no extractor is listed as such,
so a new benchmark is never silently missing from the table.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

Row = tuple[str, str, str, str]  # figure, measured, target, verdict


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("met" if ok else "NOT met")


def _transitions(d: dict[str, Any]) -> list[Row]:
    rows = []
    for name, r in d["results"].items():
        if name.startswith("bare"):
            rows.append((f"bare transition ({name})", f"{r['median_us']} µs", "baseline", "-"))
            continue
        ok = r["ratio_to_bare"] <= 1.5
        rows.append(
            (
                f"guarded transition, {name}",
                f"{r['median_us']} µs = {r['ratio_to_bare']}x bare",
                "<= 1.5x bare",
                _verdict(ok),
            )
        )
    return rows


def _engine(d: dict[str, Any]) -> list[Row]:
    rows = []
    for r in d["results"]:
        rows.append(
            (
                f"engine cold start, {r['config']} (spawn -> ready)",
                f"{r['spawn_to_ready_s']} s",
                "-",
                "-",
            )
        )
        rows.append(
            (
                f"ready -> first generate, {r['config']}",
                f"{r['ready_to_first_generate_s']} s",
                "-",
                "-",
            )
        )
        rows.append(
            (
                f"generate {d.get('tokens_per_generate', '?')} tokens, {r['config']} (median)",
                f"{r['generate_median_s'] * 1000:.1f} ms",
                "-",
                "-",
            )
        )
    return rows


def _hf_export(d: dict[str, Any]) -> list[Row]:
    s = d["summary"]
    where = d.get("config", {}).get("device", "cpu")
    host = d.get("host", {}).get("cpus", "?")
    tag = f"{where}, {host} cpus"
    return [
        (
            f"export blocking part of start / whole ({tag})",
            f"{s['blocking_fraction_median'] * 100:.1f}%",
            "<= 15%",
            _verdict(s.get("blocking_ok")),
        ),
        (
            f"export writer vs raw write+fsync ({tag})",
            f"{s['writer_vs_raw_median'] * 100:.0f}%",
            ">= 70%",
            _verdict(s.get("writer_ok")),
        ),
    ]


def _transports_cpu(d: dict[str, Any]) -> list[Row]:
    best = d["best_ratio"]
    tg = d["targets"]
    base = d["baselines"]
    by_layout = d.get("best_ratio_by_layout") or {k: {"separate": v} for k, v in best.items()}
    rows: list[Row] = []
    for kind, what, base_key, tkey in (
        (
            "ipc",
            "ipc (shared memory) vs single-thread memcpy",
            "memcpy_single_thread",
            "ipc_vs_memcpy",
        ),
        ("nccl", "nccl (gloo) vs raw gloo broadcast", "gloo_broadcast_2proc", "nccl_vs_gloo"),
    ):
        for layout, ratio in by_layout[kind].items():
            if ratio is None:
                continue
            where = "separate trainer tensors" if layout == "separate" else "one flat buffer"
            rows.append(
                (
                    f"{what}, 1 GiB, {where}",
                    f"{ratio:.2f}x of {base[base_key]['gb_s']} GB/s",
                    f">= {tg[tkey]}x",
                    _verdict(ratio >= tg[tkey]),
                ),
            )
    return rows


def _control_plane(d: dict[str, Any]) -> list[Row]:
    h, r = d["health"], d["registry"]
    return [
        (
            f"health round, {h['groups']} groups x {h['probe_latency_s'] * 1000:.0f} ms probes",
            f"{h['ratio_to_single_probe']}x one probe",
            "<= 3x",
            _verdict(h["within_target"]),
        ),
        (
            "registry transitions per second",
            f"{r['registry_1_thread_per_s']}/s",
            ">= 5000/s",
            _verdict(r["within_target"]),
        ),
    ]


def _transports_gpu(d: dict[str, Any]) -> list[Row]:
    p = d["phases"]
    copy = p["d2d_copy"]["gb_s"]
    rows = []
    for r in p.get("ipc", []):
        layout = r.get("layout", "separate")
        what = (
            "trainer tensors in one flat buffer (1 direct bucket, no copy)"
            if layout == "flat"
            else f"separate trainer tensors, {r['bucket_mib']} MiB buckets"
        )
        if "check" in r:  # issue #28: where the finite check ran, and its cost per version
            reg = r.get("register_s_median")
            chk = r.get("finite_check_s_median")
            what += (
                "; finite check once per version at register (sender"
                + (f", {chk * 1000:.1f} ms of register {reg * 1000:.1f} ms)" if chk else ")")
                if r["check"] == "sender"
                else "; finite check by the engine on every call (check_finite=False)"
            )
        runs = r.get("all_seconds") or [r["seconds"]]
        med = _median(runs)
        ratio = p["d2d_copy"]["seconds"] / med  # the median run, not the best one
        rows.append(
            (
                f"H200 ipc (CUDA IPC), 8 GB Qwen3-4B shapes, {what}",
                f"median of {len(runs)}: {med * 1000:.1f} ms = {ratio * 100:.1f}% of {copy:.0f}"
                f" GB/s d2d (best {min(runs) * 1000:.1f} ms); extra {r['peak_extra_buckets']}"
                " buckets",
                ">= 25% of d2d; <= 2 buckets",
                _verdict(ratio >= 0.25),
            ),
        )
    fc = p.get("finite_check")
    if fc:
        for layout in ("flat", "separate"):
            got = fc.get(layout, {})
            if "non_finite_index_s" in got:
                new_s = got["non_finite_index_s"]["seconds"]
                old_s = got["old_foreach_norm_s"]["seconds"]
                rows.append(
                    (
                        f"H200 finite check alone, 8 GB, {layout} (median of {fc['repeats']})",
                        f"{new_s * 1000:.2f} ms ({got['non_finite_index_s']['read_gb_s']} GB/s"
                        f" read); the engine's old _foreach_norm {old_s * 1000:.2f} ms",
                        "< 1 ms per push (the pass runs once per version)",
                        "-",
                    )
                )
    return rows


def _ce_tcp_slices(d: dict[str, Any]) -> list[Row]:
    rows = []
    for s in d.get("slices", []):
        if not s.get("median_s"):
            continue
        n = len(s["seconds_all"])
        rows.append(
            (
                f"H200 checkpoint-engine P2P over Mooncake TCP, 8.045 GB, MC_TCP_SLICE_SIZE ="
                f" {s['slice_kib']} KiB, another engine serving",
                f"median of {n}: {s['median_s']} s ({s['gb_s']} GB/s), p95 {s['p95_s']} s;"
                f" serving {s.get('serving_ok_per_s_during_median')} req/s;"
                f" checksum equal: {s['raw'].get('checksum_equal')}",
                "-",
                "-",
            )
        )
    if d.get("best_slice_kib") is not None:
        rows.append(
            ("H200 fastest slice in this run (median)", f"{d['best_slice_kib']} KiB", "-", "-")
        )
    return rows


def _recovery_gpu(d: dict[str, Any]) -> list[Row]:
    p = d["phases"]
    fresh = not d["args"].get("warm_standby", True)
    source = "fresh spawn" if fresh else "fork from a ready standby"
    gb = p.get("setup", {}).get("weights_gb")
    rows: list[Row] = []
    for name, label in (
        ("immediate", "immediate, warm page cache"),
        ("immediate_cold_cache", "immediate, page cache dropped"),
        ("targeted", "targeted ipc push"),
        ("deferred", "deferred to the next sync"),
    ):
        sm = (p.get(name) or {}).get("summary")
        if not sm or not sm["kill_to_active_s"].get("n"):
            continue
        k = sm["kill_to_active_s"]
        io = sm.get("engine_export_to_device_gb_s", {})
        extra = f"; export -> GPU {io['median']} GB/s" if io.get("n") else ""
        target, ok = "-", "-"
        if name == "immediate":
            limit = 15.0 if fresh else 5.0
            target, ok = f"<= {limit:.0f} s", _verdict(k["median"] <= limit)
        rows.append(
            (
                f"H200 recovery of a {gb} GB engine, {label} ({source}), kill -> active",
                f"median of {k['n']}: {k['median']} s (max {k['max']}){extra}",
                target,
                ok,
            ),
        )
    return rows


def _ce_p2p(d: dict[str, Any]) -> list[Row]:
    p = d["phases"]
    gb = p["setup"]["weights_gb"]
    t, i = p.get("targeted", {}), p.get("immediate", {})
    push = (t.get("pushes_after_kill") or [{}])[0]
    rows: list[Row] = [
        (
            f"H200 checkpoint-engine broadcast of {gb} GB to one engine (a sync)",
            f"{p['syncs']['broadcast_s']} s ({p['syncs']['broadcast_gb_s']} GB/s)",
            "-",
            "-",
        ),
    ]
    if push and gb:
        rows.append(
            (
                f"H200 checkpoint-engine P2P push of {gb} GB to the restarted group "
                f"({p['setup']['p2p_protocol']})",
                f"{push['seconds']:.1f} s ({gb / push['seconds']:.2f} GB/s)",
                "-",
                "-",
            ),
        )
    for name, ph in (("targeted P2P push", t), ("immediate, from the ready export", i)):
        if "kill_to_active_s" in ph:
            rows.append(
                (
                    f"H200 checkpoint-engine fleet, {gb} GB: kill -> active, {name}",
                    f"{ph['kill_to_active_s']} s; no request to the failed group: "
                    f"{ph['no_request_to_failed_group']}; checksums equal: "
                    f"{ph['checksums']['equal']}",
                    "-",
                    _verdict(bool(d.get("ok"))),
                ),
            )
    return rows


def _real_engine_gpu(d: dict[str, Any]) -> list[Row]:
    """``benchmarks/gpu/real_engine_gpu.py``: every check, the timings, and the phases not run
    (asked for but absent from ``phases``: cut by the device call's time limit)."""
    kind = str(d.get("args", {}).get("engine", ""))
    env = d.get("env", {})
    gpu = str(env.get("gpu") or "GPU").replace("NVIDIA ", "").split(" ")[0]
    engine = f"{gpu} real {kind} {env.get(kind) or ''}".strip()
    phases = d.get("phases", {})
    checks = d.get("checks", {})
    rows: list[Row] = [
        (f"{engine}: check {name}", str(value), "true", _verdict(bool(value)))
        for name, value in checks.items()
    ]
    syncs = phases.get("sync", {}).get("syncs", [])
    if syncs:
        times = ", ".join(f"{x['sync_s']:.2f}" for x in syncs)
        a = d.get("args", {})
        what = f"Llama hidden {a.get('hidden')}, {a.get('layers')} layers, vocab {a.get('vocab')}"
        rows.append((f"{engine}: sync over nccl, {what}, s (first .. last)", times, "-", "-"))
    kill = phases.get("kill", {})
    if kill.get("kills"):
        rows.append(
            (
                f"{engine}: SIGKILL mid-rollout -> group active, p50 / p95 "
                f"({len(kill['kills'])} kills, restart of a cold server)",
                f"{kill.get('kill_to_active_p50_s')} / {kill.get('kill_to_active_p95_s')} s",
                "-",
                "-",
            )
        )
    for phase, why in d.get("not_run", {}).items():
        rows.append((f"{engine}: {phase}", f"not run ({why})", "run", "-"))
    wanted = [p for p in str(d.get("args", {}).get("phases") or "").split(",") if p]
    order = ["start", "generate", "sync", "probe", "checks", "sleep", "kill", "failed"]
    for phase in wanted or order:
        if phase in order and phase not in phases and phase not in d.get("not_run", {}):
            rows.append(
                (f"{engine}: {phase}", "not run (the call's time limit cut it)", "run", "-")
            )
    return rows


def _sglang_gpu_hash(d: dict[str, Any]) -> list[Row]:
    cases = d.get("cases", [])
    timing = d.get("timing_8gb", {})
    kernel = str(d.get("kernel", ""))
    against = "SGLang's Triton kernel" if kernel.startswith("file") else "its own CPU result"
    rows: list[Row] = [
        (
            f"H200 SGLang gpu_tensor_hash in torch vs {against}",
            f"{sum(1 for c in cases if c.get('equal'))}/{len(cases)} cases equal"
            + (f"; 8 GB equal: {timing['equal']}" if "equal" in timing else ""),
            "all equal",
            _verdict(bool(d.get("all_equal"))),
        ),
    ]
    for key, what in (
        ("ours_one_tensor_s", "one 8 GB tensor"),
        ("ours_model_digest_398_tensors_s", "8 GB as 398 tensors (model digest)"),
    ):
        if key in timing:
            rows.append(
                (
                    f"H200 sglang-gpu digest of {what}",
                    f"{timing[key]} s",
                    "<= 0.5 s",
                    _verdict(timing[key] <= 0.5),
                )
            )
    return rows


def _checkpoint_engine_gpu(d: dict[str, Any]) -> list[Row]:
    ph = d["phases"]
    ov = ph["overhead"]
    rows = [
        (
            "H200 checkpoint-engine raw register / update (median)",
            f"{_median(ph['raw']['register_s']):.2f} s / {_median(ph['raw']['update_s']):.2f} s",
            "-",
            "-",
        ),
        (
            "H200 CheckpointEngineTransport register / update (median)",
            f"{_median(ph['ours']['register_s']):.2f} s / {_median(ph['ours']['update_s']):.2f} s",
            "-",
            "-",
        ),
        (
            "H200 CheckpointEngineTransport overhead over raw",
            f"{ov['ratio'] * 100:+.0f}%",
            "<= +10%",
            _verdict(ov["within_target"]),
        ),
    ]
    ipc = ph.get("ipc")
    if ipc and "checkpoint_engine_over_ipc" in ipc:
        rows.append(
            (
                "H200 ipc vs CheckpointEngineTransport, register+update, same run",
                f"{ipc['total_median_s'] * 1000:.0f} ms vs "
                f"{ipc['checkpoint_engine_total_median_s']:.2f} s = "
                f"{ipc['checkpoint_engine_over_ipc']:.0f}x",
                ">= 50x",
                _verdict(ipc["within_target"]),
            ),
        )
    for s in ph.get("bucket_sweep", []):
        rows.append(
            (
                "H200 checkpoint-engine peak extra GPU memory, bucket cap "
                f"{s['bucket_cap_gib']} GiB",
                f"{s['process_peak_extra_mib'] / 1024:.1f} GiB (update {s['update_s']:.2f} s)",
                "-",
                "-",
            ),
        )
    return rows


def _continuation(d: dict[str, Any]) -> list[Row]:
    cfg = d["config"]
    shape = (
        f"{cfg['requests_per_step']} x {cfg['tokens_per_request']}-token greedy rollouts, "
        f"SIGKILL at {cfg['kill_at_tokens']} streamed tokens, {cfg['crashes']} crashes"
    )
    cont, over = d["modes"]["continue"], d["modes"]["start_over"]
    regen_ok = cont["tokens_regenerated_per_crash_median"] == 0 and cont["mismatches"] == 0
    return [
        (
            f"tokens regenerated per crash, continue vs start over ({shape})",
            f"{cont['tokens_regenerated_per_crash_median']:g} vs "
            f"{over['tokens_regenerated_per_crash_median']:g} (kept "
            f"{cont['tokens_kept_per_crash_median']:g}; results equal uninterrupted: "
            f"{cont['mismatches'] + over['mismatches'] == 0})",
            "0 beyond the last streamed token",
            _verdict(regen_ok),
        ),
        (
            "crash step lost throughput, continue vs start over (median)",
            f"{cont['lost_throughput_median']:.1%} vs {over['lost_throughput_median']:.1%} "
            f"(step {cont['crash_step_s_median']:.2f} s vs {over['crash_step_s_median']:.2f} s; "
            f"normal {cont['normal_step_s_median']:.2f} s)",
            "-",
            "-",
        ),
    ]


def _recovery(d: dict[str, Any]) -> list[Row]:
    def ppm(x: dict[str, Any]) -> str:
        return f"{x['p50']:.2f} / {x['p95']:.2f} / {x['max']:.2f} s"

    cfg = d["config"]
    target = d["targets"]["warm_standby_p95_max_s"]
    rows: list[Row] = []
    for mode, r in d["modes"].items():
        s = r["summary"]
        name = {
            "warm_standby": "warm standby (1 per group, the demo's)",
            "warm_standby_x2": "2 warm standbys per group",
            "no_standby": "no standby",
        }.get(mode, mode)
        total = s["crash_to_active"]
        warm = mode.startswith("warm")
        rows.append(
            (
                f"{name}: crash -> active with current weights, p50 / p95 / max over {total['n']} "
                f"crashes at random points of {cfg['rollout_s']:g} s rollouts "
                f"({s['right_after_recovery']} right after the previous recovery), "
                f"{d['host']['cpus']} cpus",
                ppm(total),
                f"p95 <= {target:g} s" if warm else "-",
                _verdict(total["p95"] <= target) if warm else "-",
            )
        )
        parts = s["parts"]
        rows.append(
            (
                f"{name}: parts p50 / p95: detection, restart, weight load, push, other",
                ", ".join(
                    f"{parts[p]['p50']:.2f}/{parts[p]['p95']:.2f}"
                    for p in ("detection_s", "restart_s", "weight_load_s", "push_s", "other_s")
                )
                + " s",
                "-",
                "-",
            )
        )
        for src, x in s["by_restart_source"].items():
            rows.append(
                (
                    f"{name}: restart from {src} (n={x['crash_to_active']['n']}): crash -> active",
                    ppm(x["crash_to_active"]),
                    "-",
                    "-",
                )
            )
    checks = d["checks"]
    rows.append(
        (
            "recoveries ended active with the trainer's weights (checksums)",
            "all" if checks["ok"] else f"{len(checks['failures'])} failed",
            "all",
            _verdict(checks["ok"]),
        )
    )
    load = d["host"].get("loadavg_1m_at_crashes")
    if load:
        rows.append(
            (
                "recovery bench: 1-min load average at the crashes, p50 / max "
                f"({d['host']['cpus']} cpus shared with other work)",
                f"{load['p50']:.2f} / {load['max']:.2f}",
                "-",
                "-",
            )
        )
    return rows


def _real_vllm(d: dict[str, Any]) -> list[Row]:
    def pp(x: dict[str, Any]) -> str:
        if not x["n"]:
            return "not measured"
        return f"{x['p50']:.2f} / {x['p95']:.2f} s (n={x['n']})"

    host = d["host"]
    load = host.get("loadavg_1m_at_start")
    tag = f"{host['cpus']} cpus, 1-min load {load} at the start"
    if not d.get("complete", True):
        tag += "; run cut short"
    ratio = d.get("ratio_vllm_over_reference", {})
    names = {
        "cold_start": "fleet cold start (2 groups active)",
        "single_start": "one engine start (standalone launcher)",
        "restart": "launcher.restart() of one engine",
        "sync": "sync of one version over nccl (gloo)",
        "crash_to_active": "SIGKILL mid-request -> active at the current version",
    }
    rows: list[Row] = []
    for key, name in names.items():
        for engine, r in d["engines"].items():
            x = r["summary"][key]
            if not x["n"]:
                continue
            q = ratio.get(key)
            extra = (
                f"; vLLM/reference p50 x{q['p50']}, p95 x{q['p95']}"
                if q and engine == "vllm"
                else ""
            )
            rows.append((f"{engine}: {name}, p50 / p95 ({tag})", pp(x) + extra, "-", "-"))
        if key == "crash_to_active":
            for engine, r in d["engines"].items():
                parts = r["summary"]["parts"]
                if not r["summary"]["crash_to_active"]["n"]:
                    continue
                rows.append(
                    (
                        f"{engine}: crash parts p50 / p95: detection, restart, health, other",
                        ", ".join(
                            f"{parts[p]['p50']:.2f}/{parts[p]['p95']:.2f}"
                            for p in ("detection_s", "restart_s", "health_s", "other_s")
                        )
                        + " s",
                        "-",
                        "-",
                    )
                )
    checks = d["checks"]
    rows.append(
        (
            "real vLLM bench checks: recoveries active at the current version, no dispatch to a "
            "group not active, probes agree",
            "all held" if checks["ok"] else f"{len(checks['failures'])} failed",
            "all",
            _verdict(checks["ok"]),
        )
    )
    return rows


def _profile_ipc_gpu(d: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for r in d.get("run3_hybrid", []):
        f = r["fresh"]
        rows.append(
            (
                f"H200 CUDA-IPC parts without engine/HTTP, 8 GB, {r['bucket_mib']}"
                + (" MiB buckets" if isinstance(r["bucket_mib"], int) else ""),
                f"round trip {f['round_trip_s'] * 1000:.1f} ms: open {f['open_s'] * 1000:.1f}, "
                f"copy {f['copy_s'] * 1000:.1f}, close {f['close_s'] * 1000:.1f} ms "
                f"(d2d {d['d2d_copy_s'] * 1000:.1f} ms)",
                "-",
                "-",
            ),
        )
    return rows


def _multi_gpu(d: dict[str, Any]) -> list[Row]:
    s = d.get("summary", {})
    gpus = len(d.get("phases", {}).get("env", {}).get("gpus", [])) or "?"
    nbytes = d.get("phases", {}).get("nccl", {}).get("weights", {}).get("bytes")
    size = f", {nbytes / (1 << 30):.2f} GiB" if nbytes else ""
    note = " (one-GPU rehearsal: gloo, not NCCL)" if d.get("args", {}).get("one_gpu") else ""
    rows: list[Row] = []
    if "nccl_ratio_vs_raw_shared" in s:
        rows.append(
            (
                f"{gpus} GPU nccl transport vs raw broadcast{size}{note}",
                f"{s['nccl_ratio_vs_raw_shared']:.2f}x ({s['nccl_gb_s_total']} GB/s)",
                ">= 0.7x on 2+ GPUs",
                "-" if note else _verdict(s["nccl_within_70pct"]),
            ),
        )
    # the best row of each trainer layout (a flat buffer, or separately allocated tensors)
    sweep = [
        r
        for r in d.get("phases", {}).get("nccl", {}).get("transport", [])
        if "ratio_vs_raw_shared" in r and "error" not in r
    ]
    layouts = sorted({r.get("weights_layout", "separate") for r in sweep})
    for lay in layouts if len(layouts) > 1 else []:
        best = max(
            (r for r in sweep if r.get("weights_layout", "separate") == lay),
            key=lambda r: r["ratio_vs_raw_shared"],
        )
        rows.append(
            (
                f"{gpus} GPU nccl, best {lay} layout{size}{note}",
                f"{best['ratio_vs_raw_shared']:.2f}x with {best['bucket_mib']:g} MiB buckets "
                f"({best['buckets']} calls"
                + (
                    f", unpacked_min_bytes {best['unpacked_min_bytes']}"
                    if lay == "separate"
                    else ""
                )
                + f"); {best['update_s'] * 1000:.1f} ms",
                ">= 0.7x on 2+ GPUs",
                "-" if note else _verdict(best["ratio_vs_raw_shared"] >= 0.7),
            ),
        )
    if "ce_world" in s:
        rows.append(
            (
                f"{gpus} GPU checkpoint-engine, world {s['ce_world']}, broadcast: "
                "register / update",
                f"{s['ce_register_s']:.2f} s / {s['ce_update_s']:.2f} s; checksums equal: "
                f"{s['ce_checksums_equal']}; P2P: {str(s.get('ce_p2p', '-'))[:60]}",
                "-",
                "-",
            ),
        )
    if s.get("ce_p2p_s") is not None:
        ce = d.get("phases", {}).get("checkpoint_engine", {})
        checks = ce.get("checks", {})
        rows.append(
            (
                f"{gpus} GPU checkpoint-engine P2P of a new version to the engines past the first "
                f"only, vs the same run's broadcast{note and ' (one-GPU rehearsal: tiny set)'}",
                f"{s['ce_p2p_s']:.2f} s ({s['ce_p2p_gb_s']} GB/s) = "
                f"{s['ce_p2p_over_broadcast_time']}x the broadcast; first engine kept serving its "
                f"version: {checks.get('gpu0_version_unchanged')}",
                "checks: checksums, versions, first engine served",
                _verdict(bool(ce.get("ok"))),
            ),
        )
    if "recovery_kill_to_active_s" in s:
        rows.append(
            (
                f"{gpus} GPU targeted recovery kill -> active ({s['recovery_strategy']}){note}",
                f"{s['recovery_kill_to_active_s']:.1f} s; no request to the failed group: "
                f"{s['recovery_no_request_to_failed_group']}",
                "-",
                "-",
            ),
        )
    return rows


def _multi_gpu_check(d: dict[str, Any]) -> list[Row]:
    """A correctness run of the nccl phase: the checksum after its last (many-call) row."""
    nccl = d.get("phases", {}).get("nccl", {})
    gpus = len(d.get("phases", {}).get("env", {}).get("gpus", [])) or "?"
    check = nccl.get("checksum", {})
    rows = [r for r in nccl.get("transport", []) if "ratio_vs_raw_shared" in r]
    ratios = ", ".join(
        f"{r['bucket_mib']:g} MiB/{r['unpacked_min_bytes']}: {r['ratio_vs_raw_shared']:.2f}x"
        for r in rows
    )
    return [
        (
            f"{gpus} GPU nccl checksum check after {check.get('after', '?')}",
            f"checksums equal: {check.get('equal')}; ratios (bucket/unpacked_min_bytes) {ratios}",
            "-",
            "-",
        ),
    ]


def _trl_grpo_gpu(d: dict[str, Any]) -> list[Row]:
    """TRL GRPO through a fleet of vLLM-dialect engines on one GPU, synced over NCCL."""
    checks = d["checks"]
    held = sum(1 for v in checks.values() if v)
    gb = round(d["model"]["bytes_float32"] / 1e9, 2)
    syncs = ", ".join(f"{t} s" for t in d["sync_s"])
    crash = d["crash"]
    return [
        (
            f"{d['env']['gpu']}: TRL {d['env']['trl']} GRPO, {d['steps']} steps, checks "
            "(weights equal after every sync, SIGKILL recovered, versions, logprobs)",
            f"{held} of {len(checks)} true",
            "all",
            _verdict(held == len(checks)),
        ),
        (
            f"{d['env']['gpu']}: TRL sync of {gb} GB over nccl to 2 vLLM-dialect engines, per step",
            syncs,
            "-",
            "-",
        ),
        (
            "TRL run: engine SIGKILLed mid-generation, kill -> active",
            f"{crash['kill_to_active_s']} s ({crash['continued_completions']} completions "
            "continued)",
            "-",
            "-",
        ),
    ]


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _node_loss(d: dict[str, Any]) -> list[Row]:
    def pp(x: dict[str, Any]) -> str:
        if not x["n"]:
            return "not measured"
        return f"{x['p50']:.2f} / {x['p95']:.2f} s (n={x['n']})"

    tag = f"{d['machine']['cpus']} cpus, 1-min load {d['load1']['start']:.2f} at the start"
    names = {
        "node_removal": "Ray node removed -> its group active again",
        "single_process_crash": "SIGKILL of one engine rank -> active again",
    }
    if "ratio" in d:  # --span: a two-node group beside a one-node group of the same ranks
        names = {
            "two_node_group": "Ray node removed -> a two-node group (2 ranks, 1 per node) active "
            "again",
            "one_node_group": "Ray node removed -> a one-node group (2 ranks) active again",
            "single_process_crash": "SIGKILL of one engine rank -> active again",
        }
    rows: list[Row] = []
    for key, name in names.items():
        parts = d["summary"][key]
        if not parts["total"]["n"]:
            continue
        rows.append((f"{name}, p50 / p95 ({tag})", pp(parts["total"]), "-", "-"))
        rows.append(
            (
                f"{name}: detection, placement, restart, weights p50 / p95",
                ", ".join(
                    f"{parts[p]['p50']:.2f}/{parts[p]['p95']:.2f}"
                    for p in ("detection", "placement", "restart", "weights")
                    if parts[p]["n"]
                )
                + " s",
                "-",
                "-",
            )
        )
    if "ratio" in d:
        ratio = d["ratio"]
        met = all(ratio[q] is not None and ratio[q] <= ratio["max"] for q in ("p50", "p95"))
        rows.append(
            (
                "node loss of a two-node group / a one-node group's, total p50 / p95",
                f"{ratio['p50']}x / {ratio['p95']}x",
                f"<= {ratio['max']}x",
                _verdict(met),
            )
        )
    checks = d["checks"]
    rows.append(
        (
            "node-loss bench checks: every group active at the fleet's version with the trainer's "
            "checksum, no rollout request failed, no dispatch to a group not active",
            "all held" if checks["ok"] else f"{len(checks['failures'])} failed",
            "all",
            _verdict(checks["ok"]),
        )
    )
    return rows


def _spares(d: dict[str, Any]) -> list[Row]:
    def pp(x: dict[str, Any]) -> str:
        if not x["n"]:
            return "not measured"
        return f"{x['p50']:.3f} / {x['p95']:.3f} s (n={x['n']})"

    host = d["host"]
    tag = f"{host['cpus']} cpus, 1-min load {host['loadavg_1m_at_start']:.2f} at the start"
    target = d["config"]["target_s"]
    failures = d["checks"]["failures"]
    rows: list[Row] = []
    for engine, r in d["engines"].items():
        name = "real vLLM" if engine == "vllm" else "reference engine"
        spare, restart = r.get("spare"), r.get("restart")
        if spare is not None:
            cap = spare["summary"]["capacity_back"]
            ok = cap["p95"] is not None and cap["p95"] <= target
            rows.append(
                (
                    f"SIGKILL -> capacity back with a spare, {name}, p50 / p95 ({tag})",
                    pp(cap)
                    + f"; detection {pp(spare['summary']['detection'])}, switch "
                    + pp(spare["summary"]["switch"])
                    + f"; refill {pp(spare['summary'].get('refill', {'n': 0}))}",
                    f"<= {target:g} s p95",
                    _verdict(ok),
                )
            )
        if restart is not None:
            rows.append(
                (
                    f"SIGKILL -> capacity back without a spare (restart path), {name}, p50 / p95",
                    pp(restart["summary"]["capacity_back"])
                    + f"; {restart['rollout']['failed']} requests failed in the outages",
                    "-",
                    "-",
                )
            )
        cost = r.get("costs", {})
        if cost:
            mem = cost.get("memory_per_spare_mb", {})
            rows.append(
                (
                    f"cost of a spare, {name}: memory (RSS / PSS of its process tree), sync "
                    "time added (p50 with minus without)",
                    f"{mem.get('rss', '?')} / {mem.get('pss', '?')} MB; "
                    f"+{cost.get('sync_added_per_spare_s', '?')} s per sync",
                    "-",
                    "-",
                )
            )
    mine = [f for f in failures if "capacity back with a spare" not in f]
    rows.append(
        (
            "spares bench checks: every kill covered by a promotion at the current version and "
            "refilled (or restarted active at it), no failed request with a spare, no dispatch to "
            "a group not active, no token on a spare before its promotion, invariants",
            "all held" if not mine else f"{len(mine)} failed",
            "all",
            _verdict(not mine),
        )
    )
    return rows


def _delta(d: dict[str, Any]) -> list[Row]:
    where = "H200, " + d["model"] if d["device"].startswith("cuda") else "CPU, " + d["model"]
    link = f"{d['transport']}" + (f" ({d['backend']})" if d.get("backend") else "")
    rows: list[Row] = []
    for label, s in d["summary"].items():
        frac = 100 * s["changed_fraction"]["median"]
        rows.append(
            (
                f"delta vs full sync, {where}, {link}, {label} changed "
                f"({s['steps']} steps, median / p95)",
                f"{s['delta_s']['median']:.3f} / {s['delta_s']['p95']:.3f} s vs "
                f"{s['full_s']['median']:.3f} / {s['full_s']['p95']:.3f} s = "
                f"{s['speedup']}x faster; {s['bytes_ratio']}x fewer bytes "
                f"({s['delta_bytes'] / 1e6:.1f} vs {s['full_bytes'] / 1e6:.1f} MB; "
                f"{frac:.2f}% of elements changed; encode {1e3 * s['encode_s']['median']:.0f} ms); "
                f"digests equal: {s['digests_equal']}",
                ">= 5x fewer bytes, >= 3x faster at 2 %; never slower at 10 %"
                if d["mode"] == "synthetic"
                else "fewer bytes",
                "-",
            )
        )
    ok = all(d["checks"].values())
    rows.append(
        (
            f"delta bench checks ({where})",
            "all held" if ok else f"{sum(not v for v in d['checks'].values())} failed",
            "all",
            _verdict(ok),
        )
    )
    return rows


def _reference_parts(d: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(label, phase results) of the stub run and each reference-engine dialect run."""
    parts = [("stub engines", d.get("stub", {}))]
    for dialect in ("sglang", "vllm"):
        res = d.get("reference", {}).get(dialect)
        if res:
            parts.append((f"reference engines ({dialect} dialect)", res))
    return parts


def _count(value: Any) -> str:
    """A count, ``-`` where it was not counted (None or absent)."""
    return "-" if value is None else str(value)


def _whole_lost(r: dict[str, Any]) -> str:
    """`` (N answers read whole sent again)`` for a crash row that lost some."""
    n = r.get("whole_lost") or 0
    return f" ({n} answers read whole sent again)" if n else ""


def _gateway_targets(d: dict[str, Any]) -> list[Row]:
    """Issue #35's targets for the gateway, each with the figures it compares."""
    rows: list[Row] = []
    merged: dict[str, dict[str, dict[str, Any]]] = {}
    for label, res in _reference_parts(d):
        kind = "stub" if label.startswith("stub") else "reference"
        for part in ("throughput", "latency"):
            for front, by_w in res.get(part, {}).items():
                merged.setdefault(f"{kind} {part}", {}).setdefault(front, {}).update(by_w)
    for key, ok in d.get("checks", {}).items():
        if not key.startswith("target ["):
            continue
        kind = key[len("target [") : key.index("]")]
        w = key.split("] gateway ", 1)[1].split(":", 1)[0]
        measured = "-"
        if "x sglang-router" in key or "x vllm-router" in key:
            router = "sglang-router" if "sglang-router" in key else "vllm-router"
            tp = merged.get(f"{kind} throughput", {})
            gw, rt = tp["gateway"][w]["best_req_per_s"], tp[router][w]["best_req_per_s"]
            measured = f"{gw:.0f} vs {rt:.0f} req/s = {gw / rt:.3f}x"
            target = key.rsplit(": ", 1)[1].rsplit(" ", 1)[0]  # ">= 0.5x"
        elif "added p50" in key:
            la = merged.get(f"{kind} latency", {})["gateway"][w]
            measured = f"{_sgn(la['added_p50_ms'])} ms (p99 {_sgn(la['added_p99_ms'])} ms)"
            target = "<= 1 ms"
        else:
            where = (
                d.get("crash", {}) if kind == "stub" else d.get("reference", {}).get("crash", {})
            )
            r = where.get("gateway", {}).get(w.removeprefix("crash "), {})
            measured = f"{r.get('failed', '-')} failed, {r.get('cut', '-')} cut"
            target = "0"
        rows.append(
            (f"issue #35 target: {key.removeprefix('target ')}", measured, target, _verdict(ok))
        )
    return rows


def _gateway(d: dict[str, Any]) -> list[Row]:
    tag = f"{d['host']['cpus']} cpus, 1-min load {d['host']['load_1min_at_start']} at the start"
    rows: list[Row] = []
    for label, res in _reference_parts(d):
        tp, lat = res.get("throughput", {}), res.get("latency", {})
        for front in ("sglang-router", "vllm-router", "gateway"):
            for w, s in tp.get(front, {}).items():
                la = lat.get(front, {}).get(w, {})
                rows.append(
                    (
                        f"{label}, {front}, {w}: saturation vs direct; added p50 / p99 at "
                        f"{la.get('rate', '-')} req/s ({tag})",
                        f"{s['best_req_per_s']:.0f} req/s = {s['vs_direct']}x direct "
                        f"({s['front_cpu_us_per_req']:.0f} µs front CPU/req); "
                        f"{_sgn(la.get('added_p50_ms'))} / {_sgn(la.get('added_p99_ms'))} ms",
                        "-",
                        "-",
                    )
                )
    crashes = [("stub engines", d.get("crash", {}))]
    crashes.append(("reference engines", d.get("reference", {}).get("crash", {})))
    for label, by_front in crashes:
        for front, by_w in by_front.items():
            for w, r in by_w.items():
                rows.append(
                    (
                        f"{label}, {front}, {w}: one of 2 engines SIGKILLed under "
                        f"{d['config']['crash_clients']} clients",
                        f"{r['whole']} whole, {r['cut']} cut, {r['failed']} failed; "
                        f"{_count(r.get('tokens_regenerated'))} tokens regenerated"
                        f"{_whole_lost(r)}; "
                        f"{r['attempts_to_dead_engine']} connection attempts to the dead engine "
                        f"(last {r.get('last_attempt_after_kill_s') or '-'} s after the kill)",
                        "-",
                        "-",
                    )
                )
    rows += _gateway_targets(d)
    ok = not d["failed_checks"]
    rows.append(
        (
            "gateway bench checks (every phase ran; no request lost, duplicated or refused "
            "outside the crash; issue #35's targets for the gateway)",
            "all held" if ok else f"{len(d['failed_checks'])} of {len(d['checks'])} false",
            "all",
            _verdict(ok),
        )
    )
    return rows


def _gateway_stacks(d: dict[str, Any]) -> list[Row]:
    """The run that chose the gateway's server stack (every candidate front on the stubs)."""
    tag = f"{d['host']['cpus']} cpus, 1-min load {d['host']['load_1min_at_start']} at the start"
    rows: list[Row] = []
    for front, by_w in d["stub"]["throughput"].items():
        if front == "direct":
            continue
        for w, s in by_w.items():
            rows.append(
                (
                    f"server-stack run, stub engines, {front}, {w}: saturation vs direct ({tag})",
                    f"{s['best_req_per_s']:.0f} req/s = {s['vs_direct']}x direct "
                    f"({s['front_cpu_us_per_req']:.0f} µs front CPU/req)",
                    "-",
                    "-",
                )
            )
    return rows


def gateway_section(results: Path = RESULTS) -> list[str]:
    """The server-stack comparison for rollsafe's gateway (issue #35), from gateway_cpu.json."""
    path = results / "gateway_cpu.json"
    if not path.exists():
        return []
    d = json.loads(path.read_text(encoding="utf-8"))
    tp, lat, mem = d["stub"]["throughput"], d["stub"]["latency"], d.get("open_streams", {})
    cc = d.get("client_cost", {})
    paired = any(s.get("added_from") == "paired" for by_w in lat.values() for s in by_w.values())
    minus = (
        "minus direct's p50 timed in the same run (every other request sent direct), "
        "median of the rounds"
        if paired
        else "minus direct's"
    )
    lines = [
        "## Gateway: fronts and server stacks (`gateway_cpu.json`)",
        "",
        "Two zero-work stub engines (`benchmarks/gateway/stub_engine.py`), so each row is the "
        "front's own cost; the load generator, the front and the stubs share the 2 cores. "
        f"Medians of {d['config']['repeats']} rounds (fronts interleaved in each); saturation: "
        f"the best of {d['config']['concurrency']} closed-loop clients; added latency: open loop "
        f"at {d['config']['latency_frac']} of the slowest front's saturation rate, {minus}; "
        f"memory: RSS with {d['config']['streams']} streams held open. "
        f"`python benchmarks/bench_gateway.py` (`--smoke` for a quick pass). {_load(d)}",
        "",
        "| front | workload | req/s median / p95 | x direct | front CPU µs/req "
        "| added p50 / p99 ms | p50 ms median / p95 | RSS idle / open MB (per stream) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for front, by_w in tp.items():
        m = mem.get(front, {})
        for w, s in by_w.items():
            la = lat.get(front, {}).get(w, {})
            added = (
                f"{_sgn(la['added_p50_ms'])} / {_sgn(la['added_p99_ms'])}"
                if "added_p50_ms" in la
                else "-"
            )
            fds = f"; {m['front_fds_per_stream']} fds" if "front_fds_per_stream" in m else ""
            memory = (
                f"{m['front_rss_idle_mb']} / {m['front_rss_open_mb']} "
                f"({m['front_kb_per_stream']} KB{fds})"
                if "front_rss_open_mb" in m and w.endswith("stream")
                else "-"
            )
            lines.append(
                f"| {front} | {w} | {_rps(s)} | {s['vs_direct']} | "
                f"{s['front_cpu_us_per_req']:.0f} | {added} | {_p50(la)} | {memory} |"
            )
    if cc:
        lines += [
            "",
            f"Load generator: aiohttp {cc['aiohttp']['req_per_s_median']:.0f} req/s at "
            f"{cc['aiohttp']['cpu_us_per_req_median']:.0f} µs of client CPU per request, httpx "
            f"{cc['httpx']['req_per_s_median']:.0f} req/s at "
            f"{cc['httpx']['cpu_us_per_req_median']:.0f} µs (same stubs, "
            f"{cc['concurrency']} clients): the client is aiohttp.",
        ]
    lines += _reference_table(d) + _crash_table(d)
    stacks_path = results / STACKS_FILE
    stacks = json.loads(stacks_path.read_text(encoding="utf-8")) if stacks_path.exists() else d
    lines += ["", *_stack_note(d, stacks, stacks_path.exists()), ""]
    return lines


#: the run that chose the server stack: every candidate front (``--fronts`` all eight), kept
#: when a later run of gateway_cpu.json measures only the gateway beside the routers
STACKS_FILE = "gateway_stacks_cpu.json"


def _load(d: dict[str, Any]) -> str:
    """The machine's 1-min load over the run (shared with other work)."""
    host, phases = d["host"], d.get("load_1min_by_phase", {})
    during = f", {min(phases.values())} to {max(phases.values())} as phases began" if phases else ""
    end = f", {host['load_1min_at_end']} at the end" if "load_1min_at_end" in host else ""
    return (
        f"Run of {d.get('wall_s', '-')} s on {host['cpus']} cores shared with other work: "
        f"1-min load {host['load_1min_at_start']} at the start{during}{end}."
    )


def _sgn(v: float | None) -> str:
    """An added latency with its sign (``+0.4``, ``-1.1``: noise can make it negative)."""
    return "-" if v is None else f"{v:+}"


def _rps(s: dict[str, Any]) -> str:
    """Requests/s at saturation: the median of the rounds / their p95."""
    p95 = s.get("best_req_per_s_p95")
    return f"{s['best_req_per_s']:.0f}" + (f" / {p95:.0f}" if p95 is not None else "")


def _p50(la: dict[str, Any]) -> str:
    """Open-loop p50 latency: the median of the rounds / their p95."""
    if "p50_ms" not in la:
        return "-"
    return f"{la['p50_ms']} / {la.get('p50_ms_p95', '-')}"


def _reference_table(d: dict[str, Any]) -> list[str]:
    ref = d.get("reference", {})
    if not any(ref.get(x) for x in ("sglang", "vllm")):
        return []
    lines = [
        "",
        "Two reference engines (the tiny Llama, `rollsafe.adapters.reference_engine`; SGLang "
        "dialect behind sglang-router, vLLM dialect behind vllm-router; the gateway with "
        "clients of the engines' dialect), same phases:",
        "",
        "| engines | front | workload | req/s median / p95 | x direct | front CPU µs/req "
        "| added p50 / p99 ms | p50 ms median / p95 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for dialect in ("sglang", "vllm"):
        res = ref.get(dialect, {})
        for front, by_w in res.get("throughput", {}).items():
            for w, s in by_w.items():
                la = res.get("latency", {}).get(front, {}).get(w, {})
                added = (
                    f"{_sgn(la['added_p50_ms'])} / {_sgn(la['added_p99_ms'])}"
                    if "added_p50_ms" in la
                    else "-"
                )
                lines.append(
                    f"| {dialect} | {front} | {w} | {_rps(s)} | "
                    f"{s['vs_direct']} | {s['front_cpu_us_per_req']:.0f} | {added} | "
                    f"{_p50(la)} |"
                )
    return lines


def _crash_table(d: dict[str, Any]) -> list[str]:
    crashes = [("stub", d.get("crash", {})), ("reference", d.get("reference", {}).get("crash", {}))]
    if not any(c for _, c in crashes):
        return []
    cfg = d["config"]
    lines = [
        "",
        f"One of two engines SIGKILLed {cfg['crash_at']} s into a {cfg['crash_duration']} s run "
        f"of {cfg['crash_clients']} clients ({cfg['crash_tokens']} tokens a request; the stubs "
        f"take {cfg['crash_token_interval_ms']} ms a token). Tokens regenerated: the dead "
        "engine's tokens of requests it never finished, less those the gateway carried into a "
        "continuation (on the reference engines, which count nothing, the gateway's own count); "
        "attempts: connections opened to the dead engine's port after the kill.",
        "",
        "| engines | front | workload | whole | cut | failed | tokens regenerated | attempts to "
        "the dead engine (last, s after the kill) | gateway: continued, tokens kept, dead "
        "group |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kind, by_front in crashes:
        for front, by_w in by_front.items():
            for w, r in by_w.items():
                gw = r.get("gateway")
                books = "-"
                if gw:
                    cont = gw.get("continuation", {})
                    books = (
                        f"{cont.get('after_failure', '-')} continued, "
                        f"{cont.get('tokens_kept', '-')} kept, g1 "
                        f"{gw.get('states', {}).get('g1', '-')}"
                    )
                lines.append(
                    f"| {kind} | {front} | {w} | {r['whole']} | {r['cut']} | {r['failed']} | "
                    f"{_count(r.get('tokens_regenerated'))}{_whole_lost(r)} | "
                    f"{r['attempts_to_dead_engine']} "
                    f"({r.get('last_attempt_after_kill_s') or '-'}) | {books} |"
                )
    return lines


def _stack_note(d: dict[str, Any], stacks: dict[str, Any], apart: bool) -> list[str]:
    """The server-stack recommendation, with the figures of the run it follows from
    (``stacks``; ``apart``: another run than ``d``, whose gateway figure is quoted too)."""

    def fig(front: str, run: dict[str, Any] = stacks) -> str:
        tp, lat, mem = (
            run["stub"]["throughput"],
            run["stub"]["latency"],
            run.get("open_streams", {}),
        )
        if front not in tp:
            return f"{front}: not measured"
        la = lat.get(front, {})
        parts = []
        for w, s in tp[front].items():
            name = "streams" if w.endswith("-stream") else "short"
            if len(tp[front]) > 2:  # both APIs: name the workload
                name = w
            added = la.get(w, {}).get("added_p50_ms")
            parts.append(
                f"{name} {s['vs_direct']}x direct at {s['front_cpu_us_per_req']:.0f} µs/req"
                + (f", +{added} ms p50" if added is not None else "")
            )
        m = mem.get(front, {})
        if "front_kb_per_stream" in m:
            parts.append(f"{m['front_kb_per_stream']} KB per open stream ({m['opened']} held)")
        return f"{front}: " + "; ".join(parts)

    source = (
        f"from the run that chose it (`{STACKS_FILE}`: every candidate, "
        f"{stacks['host']['load_1min_at_start']} 1-min load at the start; the gateway there is "
        "the one before its CPU work, this run's is the last line)"
        if apart
        else "from the rows above"
    )
    now = [f"- the gateway in this run (`gateway_cpu.json`): {fig('gateway', d)}."] if apart else []
    return [
        "**Server stack for rollsafe's gateway: httptools' parser on uvloop in a bare asyncio "
        "protocol, and a pooled client to the engines on the same bare protocol** "
        "(`rollsafe[gateway]`; `benchmarks/gateway/proxy_raw.py` is the measured shape, with "
        "aiohttp's pooled client to the engines, which `rollsafe.adapters.engines.pool` has "
        "replaced since: [docs/gateway.md](../docs/gateway.md#the-gateways-cpu-work)). "
        f"Why, {source}:",
        "",
        f"- {fig('proxy-raw')}: the least CPU per request and the least memory per open stream "
        "of the Python candidates, the nearest to the Rust routers' CPU per request (requests "
        "per second of the candidates on uvloop are within one another's spread over the "
        "rounds);",
        f"- {fig('proxy-aiohttp-uvloop')}; {fig('proxy-aiohttp')}: aiohttp's own server "
        "costs more CPU per request and more memory per stream;",
        f"- {fig('proxy-starlette')}: starlette on uvicorn with an httpx client is an order of "
        "magnitude slower and could not open all the streams in 120 s; its httpx client is the "
        "cost (the load-generator line above: httpx against aiohttp, same stubs, same clients);",
        f"- the Rust routers, for scale: {fig('sglang-router')}; {fig('vllm-router')};",
        f"- rollsafe's {fig('gateway')}: on this stack, what it adds to the bare stack "
        "is its own work (checking the request, routing, reading the engine's answer as a "
        "stream so that a crash loses no token, detokenizing, rendering): where that CPU goes "
        "and the issue's targets: [docs/gateway.md](../docs/gateway.md#measured).",
        *now,
        "",
        "Added latencies are medians of the rounds on a machine shared with other work (the "
        "1-min load is in the rows above): read them as rough; the CPU per request is the "
        "steadier figure. What the choice costs: two compiled wheels (uvloop, httptools; "
        "manylinux wheels, both already in vLLM's own lock), and the gateway writes its "
        "HTTP/1.1 responses itself "
        "(status line, `content-length` or chunked SSE, keep-alive) and its limits (body size, "
        "idle-body timeout, requests in flight) where aiohttp's server would give them. "
        "Details of the routers (flags, worker API, retries, what they add to a request): "
        "[docs/routers.md](../docs/routers.md).",
    ]


def _mp(s: dict[str, Any], key: str, scale: float = 1.0, digits: int = 2) -> str:
    """``median / p95`` of one summarized figure (``-`` where not measured)."""
    v = s.get(key)
    if not v or v.get("median") is None:
        return "-"
    return f"{v['median'] * scale:.{digits}f} / {v['p95'] * scale:.{digits}f}"


def _router_sync(d: dict[str, Any]) -> list[Row]:
    tag = f"{d['host']['cpus']} cpus, 1-min load {d['host']['load_1min_at_start']} at the start"
    rows: list[Row] = []
    for kind, by_s in d["summary"].items():
        for scenario, by_m in by_s.items():
            alone, synced = by_m.get("router", {}), by_m.get("sync", {})
            if scenario == "sigkill":
                what = "connection attempts to a SIGKILLed engine after the kill"
                key = "attempts_after_kill"
            else:
                what = "requests to a group (engine up) after it left active"
                key = "requests_after_transition"
            rows.append(
                (
                    f"{kind}, {what}: router alone vs with RouterSync, median / p95 "
                    f"(n={alone.get('n', 0)}; {tag})",
                    f"{_mp(alone, key, digits=0)} vs {_mp(synced, key, digits=0)}; "
                    + (
                        f"after the first burst {_mp(alone, 'later_attempts', digits=0)} vs "
                        f"{_mp(synced, 'later_attempts', digits=0)}; "
                        if scenario == "sigkill"
                        else ""
                    )
                    + f"removal confirmed {_mp(synced, 'removal_lag_s', 1000, 1)} ms after the "
                    "group left active",
                    "-",
                    "-",
                )
            )
    ok = not d["failed_checks"]
    rows.append(
        (
            "router sync bench checks (every removal confirmed; no attempt after the first burst "
            "with the sync; < 10% of the router-alone requests to a group out of active)",
            "all held" if ok else f"{len(d['failed_checks'])} of {len(d['checks'])} false",
            "all",
            _verdict(ok),
        )
    )
    return rows


def router_sync_section(results: Path = RESULTS) -> list[str]:
    """The external routers kept in sync (issue #35, item 5), from router_sync_cpu.json."""
    path = results / "router_sync_cpu.json"
    if not path.exists():
        return []
    d = json.loads(path.read_text(encoding="utf-8"))
    c = d["config"]
    lines = [
        "## External routers kept in sync (`router_sync_cpu.json`)",
        "",
        f"sglang-router 0.3.2 (`/generate`) and vllm-router 0.1.17 (`/v1/completions`), "
        f"round-robin over two stub engines, {c['clients']} closed-loop clients "
        f"({c['tokens']} tokens at {c['token_interval_ms']} ms each). `router`: the router on "
        "its own; `sync`: `RouterSync` drives its worker API. `sigkill`: one engine SIGKILLed, "
        "detected by the fleet's `HealthManager` (defaults), attempts counted as SYN packets "
        f"to its port for {c['tail_s']} s (the fleet's own probes excluded; first burst: "
        f"within {c['burst_s']} s); `leaves_active`: the fleet sends `fail` to a group whose "
        f"engine still runs, requests counted at that engine for {c['leave_tail_s']} s. "
        f"Median / p95 over {c['repeats']} runs, modes interleaved; "
        f"1-min load {d['host']['load_1min_at_start']} at the start. "
        "`python benchmarks/bench_router_sync.py` (`--smoke` for a quick pass).",
        "",
        "| router | scenario | mode | sent to the failed group after | last one after (s) "
        "| first burst: attempts, end (s) | later attempts | failed client requests "
        "| fleet detection (s) | removal confirmed after (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kind, by_s in d["summary"].items():
        for scenario, by_m in by_s.items():
            for mode, s in by_m.items():
                if scenario == "sigkill":
                    sent = _mp(s, "attempts_after_kill", digits=0) + " attempts"
                    last = _mp(s, "last_attempt_after_kill_s")
                    burst = f"{_mp(s, 'burst_attempts', digits=0)}, {_mp(s, 'burst_end_s')}"
                    later = _mp(s, "later_attempts", digits=0)
                else:
                    sent = _mp(s, "requests_after_transition", digits=0) + " requests"
                    last = _mp(s, "last_request_after_transition_s")
                    burst = later = "-"
                lines.append(
                    f"| {kind} | {scenario} | {mode} | {sent} | {last} | {burst} | {later} "
                    f"| {_mp(s, 'failed', digits=0)} | {_mp(s, 'detection_s')} "
                    f"| {_mp(s, 'removal_lag_s', 1000, 1)} |"
                )
    lines += [
        "",
        "What the figures mean and what a router still cannot do: "
        "[docs/routers.md](../docs/routers.md#keeping-a-routers-workers-in-sync).",
        "",
    ]
    return lines


def _sglang_stream_decode(d: dict[str, Any]) -> list[Row]:
    tag = f"{d['host']['cpus']} cpus, 1-min load {d['host']['load_1min_at_start']} at the start"
    rows: list[Row] = []
    for mode, by_n in d["results"].items():
        sizes = sorted(by_n, key=int)
        largest = by_n[sizes[-1]]
        rows.append(
            (
                f"SGLang stream read, CPU per token ({mode}), whole vs incremental decode, p50 at "
                + ", ".join(f"{n}" for n in sizes)
                + f" tokens ({tag})",
                "; ".join(
                    f"{by_n[n]['whole_us_per_token_p50']} vs "
                    f"{by_n[n]['incremental_us_per_token_p50']} µs"
                    for n in sizes
                ),
                f"incremental <= 1/5 of whole at {sizes[-1]}",
                _verdict(largest["whole_over_incremental"] >= 5.0 and not d["failed_checks"]),
            )
        )
    return rows


def _soak(d: dict[str, Any]) -> list[Row]:
    """The seeded soak (``benchmarks/soak.py``, issue #36)."""
    faults = d["faults"]
    injected = sum(k["injected"] for k in faults.values())
    survived = sum(k["survived"] for k in faults.values())
    syncs, req, rss = d["syncs"], d["requests"], d["rss_mb"]
    leaks = d.get("leaks") or {}
    leaked = bool(leaks.get("processes") or leaks.get("shm") or leaks.get("ray_actors"))
    tag = f"soak, {d['minutes']:g} min, seed {d['seed']} ({d['host']['cpus']} cpus, shared)"
    if d.get("note"):
        tag += f" [{d['note'].split(' (')[0]}]"
    times = ", ".join(
        f"{kind} {v['time_to_active_s']['p50']}/{v['time_to_active_s']['p95']}"
        for kind, v in sorted(faults.items())
        if v["time_to_active_s"]["n"]
    )
    violations = d["violations"]
    first = f"; first: {violations[0]['check']} at {violations[0]['step']}" if violations else ""
    return [
        (
            f"{tag}: faults injected / survived ({len(faults)} kinds)",
            f"{injected} / {survived}",
            "-",
            "-",
        ),
        (
            f"{tag}: time to active p50/p95 s, by kind",
            times or ("not measured (see the note)" if d.get("note") else "-"),
            "-",
            "-",
        ),
        (
            f"{tag}: syncs ok of done (pushes), requests served / failed / continued",
            f"{syncs['ok']} of {syncs['done']} ({syncs['pushes']}); "
            f"{req['served']} / {req['failed']} / {req['continued']}",
            "-",
            "-",
        ),
        (
            f"{tag}: violations, leaks, driver RSS start -> end (slope)",
            f"{len(violations)}{first}; leaks: {'yes' if leaked else 'none'}; "
            f"{rss['start']} -> {rss['end']} MB ({rss['slope_mb_per_min']} MB/min)",
            "0 violations, no leak",
            _verdict(not violations and not leaked),
        ),
    ]


EXTRACTORS: dict[str, Callable[[dict[str, Any]], list[Row]]] = {
    "transitions.json": _transitions,
    "engine_cpu.json": _engine,
    "hf_export_cpu.json": _hf_export,
    "hf_export_h200host_cpu.json": _hf_export,
    "hf_export_h200_cuda.json": _hf_export,
    "transports_cpu.json": _transports_cpu,
    "control_plane.json": _control_plane,
    "recovery_cpu.json": _recovery,
    "real_vllm_cpu.json": _real_vllm,
    "node_loss_cpu.json": _node_loss,
    "node_loss_span_cpu.json": _node_loss,
    "node_loss_span_cpu_run2.json": _node_loss,
    "spares_cpu.json": _spares,
    "spares_real_vllm_cpu.json": _spares,
    "delta_cpu_train.json": _delta,
    "gpu/delta_h200.json": _delta,
    "continuation_cpu.json": _continuation,
    "gpu/transports_h200.json": _transports_gpu,
    "gpu/ipc_h200_hardened.json": _transports_gpu,
    "gpu/ipc_h200_hardened_run2.json": _transports_gpu,
    "gpu/ipc_h200_finite_run1.json": _transports_gpu,
    "gpu/ipc_h200_finite_run2.json": _transports_gpu,
    "gpu/ipc_h200_finite_run3.json": _transports_gpu,
    "gpu/ipc_h200_finite_run4.json": _transports_gpu,
    "gpu/ipc_h200_finite_run5.json": _transports_gpu,
    "gpu/ipc_h200_fingerprint_per_tensor.json": _transports_gpu,
    "gpu/ce_tcp_slices_h200_run1.json": _ce_tcp_slices,
    "gpu/ce_tcp_slices_h200_run2.json": _ce_tcp_slices,
    "gpu/recovery_h200_standby.json": _recovery_gpu,
    "gpu/recovery_h200_fresh.json": _recovery_gpu,
    "gpu/checkpoint_engine_h200.json": _checkpoint_engine_gpu,
    "gpu/ce_p2p_h200.json": _ce_p2p,
    "gpu/sglang_gpu_hash_h200.json": _sglang_gpu_hash,
    "gpu/profile_ipc_h200.json": _profile_ipc_gpu,
    "gpu/real_vllm_gpu_attempt1.json": _real_engine_gpu,
    "gpu/real_vllm_gpu_h100_run2.json": _real_engine_gpu,
    "gpu/real_vllm_gpu_h100_failed_phase.json": _real_engine_gpu,
    "gpu/real_vllm_gpu_h100_failed_phase_run2.json": _real_engine_gpu,
    "gpu/real_sglang_gpu_h100_attempt1.json": _real_engine_gpu,
    "gpu/real_sglang_gpu_h100_run2.json": _real_engine_gpu,
    "gpu/real_sglang_gpu_h100_run3.json": _real_engine_gpu,
    "gpu/real_sglang_gpu_h100_run4.json": _real_engine_gpu,
    "gpu/real_sglang_gpu_h100_run5.json": _real_engine_gpu,
    "gpu/real_sglang_gpu_h100_run6.json": _real_engine_gpu,
    "gpu/multi_gpu_h200_one_gpu_rehearsal.json": _multi_gpu,
    "gpu/multi_gpu_h200_one_gpu_ce_p2p_rehearsal.json": _multi_gpu,
    "gpu/multi_gpu_h200x2.json": _multi_gpu,
    "gpu/multi_gpu_h200x2_8gib.json": _multi_gpu,
    "gpu/multi_gpu_h200x2_packed_check.json": _multi_gpu_check,
    "trl_grpo_gpu.json": _trl_grpo_gpu,
    "trl_grpo_gpu_6steps.json": _trl_grpo_gpu,
    "gateway_cpu.json": _gateway,
    "gateway_cpu_6f38a3f.json": _gateway,
    "gateway_cpu_c2ecb07.json": _gateway,
    "gateway_stacks_cpu.json": _gateway_stacks,
    "router_sync_cpu.json": _router_sync,
    "sglang_stream_decode_cpu.json": _sglang_stream_decode,
    "soak_cpu.json": _soak,
    "soak_cpu_seed585735.json": _soak,
    "soak_cpu_seed1635132711.json": _soak,
    "soak_cpu_loaded.json": _soak,
    "soak_cpu_seed934291.json": _soak,
    "soak_cpu_10min.json": _soak,
    "soak_cpu_10min_run1.json": _soak,
    "soak_cpu_10min_run2.json": _soak,
}


def render(results: Path = RESULTS) -> str:
    lines = [
        "<!-- Generated by benchmarks/summarize.py from benchmarks/results/. Do not edit. -->",
        "# Benchmarks: latest figures",
        "",
        "Ratios are measured within one run (baseline and subject side by side). CPU figures come",
        "from the 2-core development machine, GPU figures from one NVIDIA H200. Re-run a",
        "benchmark, then `python benchmarks/summarize.py` to refresh this table.",
        "",
        "| result file | figure | measured | target | verdict |",
        "| --- | --- | --- | --- | --- |",
    ]
    for path in sorted(results.rglob("*.json")):
        rel = path.relative_to(results).as_posix()
        extractor = EXTRACTORS.get(rel)
        if extractor is None:
            lines.append(f"| `{rel}` | (no extractor in summarize.py) | - | - | - |")
            continue
        try:
            rows = extractor(json.loads(path.read_text(encoding="utf-8")))
        except (KeyError, TypeError, ValueError) as exc:
            lines.append(f"| `{rel}` | unreadable: {type(exc).__name__}: {exc} | - | - | - |")
            continue
        for figure, measured, target, verdict in rows:
            lines.append(f"| `{rel}` | {figure} | {measured} | {target} | {verdict} |")
    lines += ["", *gateway_section(results)]
    lines += router_sync_section(results)
    lines += [
        "How to rerun: `make bench` (transitions), `python benchmarks/bench_engine.py`,",
        "`python benchmarks/bench_hf_export.py`, `python benchmarks/bench_transports_cpu.py`,",
        "`python benchmarks/bench_control_plane.py`,",
        "`python benchmarks/bench_recovery.py`, `python benchmarks/bench_real_vllm.py`,",
        "`python benchmarks/bench_node_loss.py [--span]`, `python benchmarks/bench_spares.py`,",
        "`python benchmarks/bench_delta.py --train`,",
        "`python benchmarks/bench_gateway.py` (runs `make routers`),",
        "`python benchmarks/bench_router_sync.py` (runs `make routers`),",
        "`python benchmarks/soak.py --minutes 10 --seed S` (docs/reliability.md);",
        "GPU: `benchmarks/gpu/README.md`.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    out = HERE / "README.md"
    out.write_text(render(), encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

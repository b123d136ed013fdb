"""Prometheus metrics of a RolloutFleet: the optional extra, the documented names, a caller's
registry, and a real fleet's loopback endpoint scraped during a crash and recovery, whose values
move as the recorded timeline says."""

from __future__ import annotations

import itertools
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import tiny_model_dir  # noqa: F401  (fixture)

from rollsafe.adapters.engines import EngineSpec
from rollsafe.fleet import FleetConfig, GroupSpec, HealthSettings, RecoverySettings, RolloutFleet
from rollsafe.observe.metrics import INSTALL_HINT, METRICS, refusal_guard
from rollsafe.observe.runfile import load_run
from rollsafe.statemachines import WorkerGroupLifecycle
from rollsafe.statemachines.base import TransitionRefused

ROOT = Path(__file__).resolve().parents[1]
prom = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def config(model: Path, tmp_path: Path, **kw: Any) -> FleetConfig:
    args: dict[str, Any] = {
        "model_path": model,
        "export_root": tmp_path / "exports",
        "groups": [GroupSpec(1), GroupSpec(1)],
        "health": HealthSettings(interval_s=0.2, timeout_s=1.0, failure_threshold=2),
        "recovery": RecoverySettings(max_workers=2, timeout_s=120.0, restart_budget=3),
        "enable_immediate_recovery": True,
        "wait_for_routable_s": 2.0,
        "request_timeout_s": 20.0,
    }
    args.update(kw)
    args["engine"] = EngineSpec(model_path=str(model), log_dir=str(tmp_path / "logs"))
    (tmp_path / "logs").mkdir(exist_ok=True)
    return FleetConfig(**args)


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict[Any, float], name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def test_without_prometheus_client_metrics_raise_and_the_fleet_works(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    for kw in ({"metrics_port": 0}, {"metrics": True}):
        with pytest.raises(ImportError, match=re.escape(INSTALL_HINT)):
            RolloutFleet(config(tiny_model_dir, tmp_path), **kw)
    fleet = RolloutFleet(config(tiny_model_dir, tmp_path))
    assert fleet.metrics is None
    fleet.close()


def test_every_metric_is_documented_with_its_type_and_labels() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    for m in METRICS:
        assert m.name.startswith("rollsafe_"), m.name
        if m.type == "counter":
            assert m.name.endswith("_total"), m.name
        if m.type == "histogram":
            assert m.name.endswith("_seconds"), m.name
        row = next((line for line in doc.splitlines() if line.startswith(f"| `{m.name}`")), None)
        assert row is not None, f"{m.name} missing from docs/metrics.md"
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == m.type, (m.name, cells)
        assert cells[2] == (", ".join(f"`{lb}`" for lb in m.labels) or "-"), (m.name, cells)


def test_refusals_are_labelled_by_the_guard_that_blocked_them() -> None:
    group = WorkerGroupLifecycle([0], restart_budget=0, group_id="g")
    group.report_member(0, healthy=True, weights_version=0)
    group.launched(current_version=0)
    group.fail()
    with pytest.raises(TransitionRefused) as info:
        group.claim()
    assert refusal_guard(info.value) == "restart_budget_left"
    with pytest.raises(TransitionRefused) as info:
        group.send("weights_loaded", current_version=0)
    assert refusal_guard(info.value) == "not_allowed"


def test_metrics_into_a_callers_registry(tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    registry = prom.CollectorRegistry()
    fleet = RolloutFleet(config(tiny_model_dir, tmp_path, initial_version=3), metrics=registry)
    try:
        assert fleet.metrics is not None and fleet.metrics.registry is registry
        samples = parse(prom.generate_latest(registry).decode())
        assert value(samples, "rollsafe_fleet_weights_version") == 3.0
        assert value(samples, "rollsafe_immediate_recovery_state", state="enabled") == 1.0
        # a refused group event is counted by its guard
        fleet.registry.add_group("x", [7], restart_budget=0)
        with pytest.raises(TransitionRefused):
            fleet.registry.send("x", "claim")
        samples = parse(prom.generate_latest(registry).decode())
        key = {"machine": "WorkerGroupLifecycle", "event": "claim", "guard": "not_allowed"}
        assert value(samples, "rollsafe_refused_events_total", **key) == 1.0
        assert value(samples, "rollsafe_group_state", group="x", state="launching") == 1.0
    finally:
        fleet.close()


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:  # loopback
        return resp.read().decode()


def test_loopback_endpoint_during_a_crash_and_recovery_follows_the_timeline(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fleet = RolloutFleet(config(tiny_model_dir, tmp_path), metrics_port=0)
    scrapes: list[tuple[float, float, dict[Any, float]]] = []
    stop = threading.Event()
    try:
        fleet.start()
        assert fleet.metrics is not None and fleet.metrics.url is not None
        assert fleet.metrics.url.startswith("http://127.0.0.1:")
        assert fleet.metrics._server.server_address[0] == "127.0.0.1"
        url = fleet.metrics.url
        report = fleet.sync_weights(weights, 1)
        assert report.ok
        assert fleet.exporter is not None
        fleet.exporter.wait_hf_export(1, timeout=60)

        def load() -> None:
            while not stop.is_set():
                try:
                    fleet.generate([5, 6, 7], sampling_params={"max_new_tokens": 2})
                except Exception:
                    time.sleep(0.05)

        def scraper() -> None:
            while not stop.is_set():
                t0 = time.time()
                text = _scrape(url)
                scrapes.append((t0, time.time(), parse(text)))
                time.sleep(0.05)

        threads = [threading.Thread(target=load), threading.Thread(target=scraper)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        crashed = fleet.group_ids[1]
        pid = fleet.launcher(crashed).kill_rank(0)
        fleet.observer.mark_crash(crashed, rank=0, pid=pid)
        deadline = time.monotonic() + 120
        while not any(r.group_id == crashed and r.status == "active" for r in fleet.recoveries()):
            assert time.monotonic() < deadline, fleet.recoveries()
            time.sleep(0.1)
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(30)
        final = parse(_scrape(url))
        record = fleet.record(tmp_path / "run")
    finally:
        stop.set()
        fleet.close()
    with pytest.raises(urllib.error.URLError):  # closed with the fleet
        _scrape(url)

    run = load_run(record)
    g1 = [r for r in run.of("group") if r["subject"] == crashed]
    fails = [r for r in run.of("group") if r["event"] == "fail"]
    assert [r["event"] for r in fails] == ["fail"] and fails[0]["subject"] == crashed

    def state_at(ts: float) -> str:
        state = g1[0]["source"]
        for r in g1:
            if r["timestamp"] <= ts:
                state = r["target"]
        return state

    # every scrape shows the state the timeline has at some moment of that scrape
    seen = []
    for t0, t1, s in scrapes:
        shown = [
            dict(lb)["state"]
            for (name, lb), v in s.items()
            if name == "rollsafe_group_state" and dict(lb)["group"] == crashed and v == 1.0
        ]
        assert len(shown) == 1
        moments = [t0, t1] + [r["timestamp"] for r in g1 if t0 <= r["timestamp"] <= t1]
        assert shown[0] in {state_at(m) for m in moments}, (shown, t0, t1, g1)
        seen.append(shown[0])
    assert "active" in seen and set(seen) - {"active"}, seen  # scraped during the recovery
    # counters never go down between scrapes
    for name in ("rollsafe_requests_served_total", "rollsafe_transitions_total"):
        for a, b in itertools.pairwise(scrapes):
            for key, v in a[2].items():
                if key[0] == name:
                    assert b[2].get(key, 0.0) >= v, key

    # the final values are the timeline's
    group_machine = "WorkerGroupLifecycle"
    n_fail = value(final, "rollsafe_transitions_total", machine=group_machine, event="fail")
    assert n_fail == 1.0
    for event in {r["event"] for r in run.of("group")}:
        want = len([r for r in run.of("group") if r["event"] == event])
        got = value(final, "rollsafe_transitions_total", machine=group_machine, event=event)
        assert got == want, event
    (rec,) = [r for r in run.of("recovery") if r["group_id"] == crashed]
    assert rec["strategy"] == "immediate" and rec["onset_source"] == "crash_mark"
    assert (
        value(
            final,
            "rollsafe_recoveries_total",
            group=crashed,
            strategy="immediate",
            outcome="active",
        )
        == 1.0
    )
    # onset (the crash mark) -> the timeline's fail and active transitions (clocks read a few
    # microseconds apart: the registry's record and the machine's history)
    (mark,) = [m for m in run.of("mark") if m["event"] == "crash"]
    assert mark["timestamp"] == rec["onset"]
    active_at = next(
        r["timestamp"]
        for r in g1
        if r["target"] == "active" and r["timestamp"] > fails[0]["timestamp"]
    )
    assert value(final, "rollsafe_recovery_latency_seconds_count", strategy="immediate") == 1.0
    got = value(final, "rollsafe_recovery_latency_seconds_sum", strategy="immediate")
    assert got is not None and abs(got - (active_at - rec["onset"])) < 0.01
    got = value(final, "rollsafe_detection_latency_seconds_sum", onset="crash_mark")
    assert got is not None and abs(got - (fails[0]["timestamp"] - rec["onset"])) < 0.01
    assert value(final, "rollsafe_syncs_total", transport="ipc", outcome="ok") == 1.0
    assert (
        value(final, "rollsafe_sync_duration_seconds_count", transport="ipc", phase="total") == 1.0
    )
    assert value(final, "rollsafe_exports_total", outcome="ready") == 1.0
    assert value(final, "rollsafe_export_ready_version") == 1.0
    assert value(final, "rollsafe_fleet_weights_version") == 1.0
    for gid in fleet.group_ids:
        assert value(final, "rollsafe_group_state", group=gid, state="active") == 1.0
        assert value(final, "rollsafe_group_weights_version", group=gid) == 1.0
    assert value(final, "rollsafe_group_restart_budget_remaining", group=crashed) == 2.0
    last = run.of("requests")[-1]
    for gid in fleet.group_ids:
        served = value(final, "rollsafe_requests_served_total", group=gid)
        assert served is not None and served > 0
        assert last["served"][gid] >= served  # the record was taken after the last scrape
    # the picture of the same run has the crashed group's spans
    import xml.etree.ElementTree as ET

    root = ET.parse(record / "timeline.svg").getroot()
    ns = "{http://www.w3.org/2000/svg}"
    lanes = {g.get("data-group"): g for g in root.iter(f"{ns}g") if g.get("class") == "lane"}
    assert set(lanes) == set(fleet.group_ids)
    states = [r.get("data-state") for r in lanes[crashed].iter(f"{ns}rect")]
    assert states == [g1[0]["source"], *[r["target"] for r in g1]]
    assert any(e.get("class") == "crash" for e in lanes[crashed].iter())

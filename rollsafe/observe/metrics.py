"""Prometheus metrics of a :class:`~rollsafe.fleet.fleet.RolloutFleet` (the ``[metrics]`` extra).

Owns the fleet's metric names (:data:`METRICS`, documented in ``docs/metrics.md``), their
values and their exposition: :class:`FleetMetrics` registers one collector into a
``prometheus_client.CollectorRegistry`` (the caller's, or a fresh one) and, when asked, serves it
on ``127.0.0.1:<port>`` (``/metrics``). ``RolloutFleet(config, metrics=registry)`` or
``RolloutFleet(config, metrics_port=9400)`` build it; without prometheus-client both raise an
``ImportError`` naming ``pip install 'rollsafe[metrics]'`` and the fleet itself never needs it.

Where the values come from:

* gauges (group state, weights version, restart budget, standby, outstanding requests, fleet
  version, recovery mode) are read from the fleet when scraped;
* group transitions are counted by a registry listener (exact); the other machines' (exports,
  checkpoint registration, recovery mode) from their audit histories at each scrape;
* refused group events are counted where the registry's ``send`` raises ``TransitionRefused``
  (labelled by the guard that blocked the last candidate transition, or ``not_allowed``,
  ``final_state``, ``missing_input``, ``unknown_event``);
* recoveries, syncs and exports are observed once each, at the first scrape after they finished;
  recovery and detection latencies use the fleet observer's failure episodes (onset = crash
  mark, else first failed request, else detection).
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollsafe.errors import InvalidArgument
from rollsafe.registry import FleetListener, GroupTransition, WorkerGroup
from rollsafe.statemachines.base import MissingGuardInput, TransitionRefused
from rollsafe.statemachines.worker_group import WorkerGroupLifecycle

if TYPE_CHECKING:
    from rollsafe.observe.view import FleetView

__all__ = ["INSTALL_HINT", "METRICS", "FleetMetrics", "MetricSpec", "require_prometheus"]

INSTALL_HINT = "pip install 'rollsafe[metrics]'"

#: Latency buckets (seconds): sub-second recoveries up to minutes-long deferred ones.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: Duration buckets (seconds) for syncs, exports and recovery steps.
DURATION_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric: its name (``_total`` included for counters), type, labels, help."""

    name: str
    type: str  # "gauge" | "counter" | "histogram"
    labels: tuple[str, ...]
    help: str


def _m(name: str, kind: str, labels: str, text: str) -> MetricSpec:
    return MetricSpec(name, kind, tuple(labels.split()) if labels else (), text)


#: A group's warm standby states (``EngineLauncher.standby_state``; no engine import here).
_STANDBY_STATES = ("none", "warming", "ready")

#: Every metric a fleet exports, in exposition order (``docs/metrics.md`` is this table).
METRICS: tuple[MetricSpec, ...] = (
    _m(
        "rollsafe_group_state",
        "gauge",
        "group state",
        "1 for the group's current lifecycle state, 0 for every other state",
    ),
    _m(
        "rollsafe_group_weights_version",
        "gauge",
        "group",
        "Lowest weights version reported by the group's members (absent while unknown)",
    ),
    _m(
        "rollsafe_group_restart_budget_remaining",
        "gauge",
        "group",
        "Restarts the group may still take before it is retired",
    ),
    _m(
        "rollsafe_group_standby_ready",
        "gauge",
        "group",
        "1 while the group's warm standby engine process is idle and imported, else 0",
    ),
    _m(
        "rollsafe_group_standby_state",
        "gauge",
        "group state",
        "1 for the group's warm standby state (none, warming: still importing, ready), "
        "0 for the others",
    ),
    _m(
        "rollsafe_group_requests_outstanding",
        "gauge",
        "group",
        "Requests admitted to the group and not finished yet",
    ),
    _m(
        "rollsafe_fleet_weights_version",
        "gauge",
        "",
        "The weights version the fleet serves (never decreases)",
    ),
    _m(
        "rollsafe_immediate_recovery_state",
        "gauge",
        "state",
        "1 for the immediate-recovery mode's current state (disabled, enabled, suspended)",
    ),
    _m(
        "rollsafe_export_ready_version",
        "gauge",
        "",
        "Newest weights version with a ready recovery export (absent before the first)",
    ),
    _m(
        "rollsafe_transitions_total",
        "counter",
        "machine event",
        "Machine transitions taken, by machine class and event",
    ),
    _m(
        "rollsafe_refused_events_total",
        "counter",
        "machine event guard",
        "Group events the lifecycle machine refused, by the guard that blocked them",
    ),
    _m(
        "rollsafe_recoveries_total",
        "counter",
        "group strategy outcome",
        "Finished recoveries by strategy (immediate, targeted_push, deferred, none) and outcome",
    ),
    _m(
        "rollsafe_requests_routed_total",
        "counter",
        "group",
        "Requests the router admitted to the group (only ever while it is active)",
    ),
    _m("rollsafe_requests_served_total", "counter", "group", "Requests the group answered"),
    _m(
        "rollsafe_requests_failed_total",
        "counter",
        "group",
        "Requests that failed on the group (each failed attempt counts)",
    ),
    _m(
        "rollsafe_requests_retried_total",
        "counter",
        "group",
        "Requests that failed on the group and went on to another group",
    ),
    _m(
        "rollsafe_requests_continued_total",
        "counter",
        "group",
        "Requests the group completed after they had failed on another group",
    ),
    _m(
        "rollsafe_syncs_total",
        "counter",
        "transport outcome",
        "Weight syncs by transport and outcome (ok, failed)",
    ),
    _m(
        "rollsafe_sync_bytes_total",
        "counter",
        "transport kind",
        "Bytes pushed to engines by weight syncs, by kind: full (the whole model) or delta",
    ),
    _m(
        "rollsafe_delta_fallbacks_total",
        "counter",
        "reason",
        "Full pushes where deltas are on and the target had a confirmed base: not_smaller (the "
        "delta was not smaller than a full sync), refused (the engine refused the delta: "
        "wrong base or digest; nothing changed, the full push followed) or engine_capability "
        "(the engine kind does not apply deltas)",
    ),
    _m(
        "rollsafe_delta_changed_fraction",
        "gauge",
        "",
        "Fraction of elements whose bits changed since the base, in the last sync that encoded "
        "a delta",
    ),
    _m(
        "rollsafe_exports_total",
        "counter",
        "outcome",
        "Finished recovery exports by final lifecycle state (ready, failed, abandoned...)",
    ),
    _m(
        "rollsafe_standby_starts_total",
        "counter",
        "group result",
        "Engine (re)starts by where the engine came from: a ready standby (ready_standby), a "
        "standby still importing at the start (warming_standby), or "
        "a fresh spawn while a standby was expected (fallback)",
    ),
    _m(
        "rollsafe_recovery_latency_seconds",
        "histogram",
        "strategy",
        "Failure onset (crash) to the group active again with the current weights",
    ),
    _m(
        "rollsafe_detection_latency_seconds",
        "histogram",
        "onset",
        "Failure onset (crash mark or first failed request) to the group out of routing",
    ),
    _m(
        "rollsafe_recovery_step_duration_seconds",
        "histogram",
        "step",
        "Duration of each recovery step (claim, shutdown, restart, health, push...)",
    ),
    _m(
        "rollsafe_sync_duration_seconds",
        "histogram",
        "transport phase",
        "Weight sync duration by phase (register, update, versions, export_start, total...)",
    ),
    _m(
        "rollsafe_export_duration_seconds",
        "histogram",
        "",
        "Recovery export duration, start to ready (or failed)",
    ),
    _m(
        "rollsafe_export_blocking_seconds",
        "histogram",
        "",
        "The part of an export that blocked the trainer (validation and snapshot)",
    ),
)
_SPEC = {m.name: m for m in METRICS}


def require_prometheus() -> Any:
    """Import prometheus_client, or raise an ImportError saying how to install it."""
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImportError(
            f"rollsafe metrics need prometheus-client: {INSTALL_HINT} "
            "(the fleet works without metrics)"
        ) from exc
    return prometheus_client


class _Histogram:
    """Cumulative-bucket histogram, one series per label tuple."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        counts, total = self.series.setdefault(labels, ([0] * (len(self.buckets) + 1), [0.0]))
        counts[bisect.bisect_left(self.buckets, value)] += 1
        total[0] += value

    def rows(self) -> Iterator[tuple[tuple[str, ...], list[tuple[str, float]], float]]:
        for labels, (counts, total) in sorted(self.series.items()):
            acc, out = 0, []
            for bound, n in zip((*self.buckets, float("inf")), counts, strict=True):
                acc += n
                out.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(acc)))
            yield labels, out, total[0]


def refusal_guard(exc: TransitionRefused) -> str:
    """The guard that blocked a refused event (the last candidate transition's first one)."""
    if isinstance(exc, MissingGuardInput):
        return "missing_input"
    try:
        reasons = exc.reasons
    except Exception:
        return "unknown"
    blocked = [r for r in reasons if r.startswith("-> ") and " blocked by " in r]
    if blocked:
        return blocked[-1].split(" blocked by ", 1)[1].split(",")[0].strip() or "unknown"
    text = " ".join(reasons)
    if "final state" in text:
        return "final_state"
    if text.startswith("unknown event"):
        return "unknown_event"
    return "not_allowed"


class FleetMetrics(FleetListener):
    """The Prometheus view of one fleet; see the module doc. Thread-safe."""

    def __init__(
        self,
        fleet: FleetView,
        *,
        registry: Any = None,
        port: int | None = None,
    ) -> None:
        prom = require_prometheus()
        if port is not None and (
            isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535
        ):
            raise InvalidArgument(
                "metrics_port", f"metrics_port must be an int in 0..65535, got {port!r}"
            )
        self.fleet = fleet
        self.registry = registry if registry is not None else prom.CollectorRegistry()
        self.requested_port = port
        self.port: int | None = None
        self._server: Any = None
        self._server_thread: threading.Thread | None = None
        self._lock = threading.RLock()
        self._transitions: Counter[tuple[str, str]] = Counter()
        self._refused: Counter[tuple[str, str, str]] = Counter()
        self._recoveries: Counter[tuple[str, str, str]] = Counter()
        self._syncs: Counter[tuple[str, str]] = Counter()
        self._exports: Counter[tuple[str]] = Counter()
        self._sync_bytes: Counter[tuple[str, str]] = Counter()
        self._delta_fallbacks: Counter[tuple[str]] = Counter()
        self._changed_fraction: float | None = None
        self._recovery_latency = _Histogram(LATENCY_BUCKETS)
        self._detection_latency = _Histogram(LATENCY_BUCKETS)
        self._step_duration = _Histogram(DURATION_BUCKETS)
        self._sync_duration = _Histogram(DURATION_BUCKETS)
        self._export_duration = _Histogram(DURATION_BUCKETS)
        self._export_blocking = _Histogram(DURATION_BUCKETS)
        self._machine_seq: dict[tuple[str, str], int] = {}
        self._seen_recoveries: set[tuple[str, float, float]] = set()
        self._seen_syncs: set[tuple[int, float]] = set()
        self._seen_exports: set[int] = set()
        self._seen_detections: set[tuple[str, float]] = set()
        self._seen_latencies: set[tuple[str, float]] = set()
        self._collector = _Collector(self, prom)
        self.registry.register(self._collector)
        fleet.registry.add_listener(self)

    # ------------------------------------------------------------------ server
    def serve(self) -> int:
        """Serve ``/metrics`` on 127.0.0.1 (the requested port; 0 picks a free one); return it."""
        if self.requested_port is None:
            raise InvalidArgument("metrics_port", "no metrics_port was given")
        with self._lock:
            if self._server is not None:
                assert self.port is not None
                return self.port
            prom = require_prometheus()
            server, thread = prom.start_http_server(
                self.requested_port, addr="127.0.0.1", registry=self.registry
            )
            self._server, self._server_thread = server, thread
            self.port = int(server.server_address[1])
            return self.port

    @property
    def url(self) -> str | None:
        """``http://127.0.0.1:PORT/metrics`` while served, else None."""
        return None if self.port is None else f"http://127.0.0.1:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving (the registry keeps the collector: a last scrape still reads it)."""
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            with contextlib.suppress(Exception):
                server.shutdown()
                server.server_close()
        if self._server_thread is not None:
            self._server_thread.join(timeout=5.0)
            self._server_thread = None

    def unregister(self) -> None:
        """Take this fleet's collector out of the registry and its hooks out of the fleet."""
        self.close()
        with contextlib.suppress(KeyError):
            self.registry.unregister(self._collector)
        self.fleet.registry.remove_listener(self)

    # ------------------------------------------------------------------ event hooks
    def on_transition(self, group: WorkerGroup, record: GroupTransition) -> None:
        with self._lock:
            self._transitions[(type(group.machine).__name__, record.event)] += 1

    def on_refused(self, group: WorkerGroup, event: str, error: TransitionRefused) -> None:
        """The registry refused ``event`` for ``group`` (its machine's guard said no)."""
        # the class name only: the machine's label carries the group id
        label = error.machine_label.split("(")[0] or WorkerGroupLifecycle.__name__
        with self._lock:
            self._refused[(label, event, refusal_guard(error))] += 1

    # ------------------------------------------------------------------ refresh
    def refresh(self) -> None:
        """Fold in what finished since the last scrape (recoveries, syncs, exports...)."""
        with self._lock:
            self._refresh_machines()
            self._refresh_recoveries()
            self._refresh_syncs()
            self._refresh_exports()

    def _count_history(self, key: tuple[str, str], machine: Any) -> None:
        last = machine.last_transition
        if last is None or last.seq <= self._machine_seq.get(key, 0):
            return
        seen = self._machine_seq.get(key, 0)
        name = type(machine).__name__
        for rec in machine.history:
            if rec.seq > seen:
                self._transitions[(name, rec.event)] += 1
        self._machine_seq[key] = last.seq

    def _refresh_machines(self) -> None:
        fleet = self.fleet
        self._count_history(("mode", "immediate_recovery"), fleet.mode)
        if fleet.transport is not None:
            self._count_history(
                ("registration", fleet.transport.name), fleet.transport.registration
            )
        held: set[tuple[str, str]] = set()
        for version, lifecycle in self._export_machines():
            held.add(("export", str(version)))
            self._count_history(("export", str(version)), lifecycle)
        # an export no longer held is not read again: one entry per export held, not per sync
        for key in [k for k in self._machine_seq if k[0] == "export" and k not in held]:
            del self._machine_seq[key]

    def _export_machines(self) -> list[tuple[int, Any]]:
        exporter = self.fleet.exporter
        if exporter is None:
            return []
        out: dict[int, Any] = {}
        with contextlib.suppress(Exception):
            for record in exporter.exports():
                out.setdefault(record.version, record.lifecycle)
        for version in self.fleet.export_states():
            with contextlib.suppress(Exception):
                out.setdefault(version, exporter.handle(version).lifecycle)
        return sorted(out.items())

    def _refresh_recoveries(self) -> None:
        results = self.fleet.recoveries()
        episodes = self.fleet.observer.episodes()
        keys = set()
        for res in results:
            key = (res.group_id, res.submitted_at, res.finished_at)
            keys.add(key)
            if key in self._seen_recoveries:
                continue
            strategy = res.strategy or "none"
            self._recoveries[(res.group_id, strategy, res.status)] += 1
            for step in res.steps:
                self._step_duration.observe((step.name,), step.seconds)
        self._seen_recoveries = keys
        now = time.time()
        for ep in episodes:
            ekey = (ep.group_id, ep.detected_at)
            if ekey not in self._seen_detections and ep.onset_source != "detection":
                self._seen_detections.add(ekey)
                self._detection_latency.observe((ep.onset_source,), ep.detection_s)
            if ep.latency_s is None or ekey in self._seen_latencies:
                continue
            match = [
                r
                for r in results
                if r.group_id == ep.group_id and abs(r.failed_at - ep.detected_at) <= 30.0
            ]
            if not match and ep.active_at is not None and now - ep.active_at < 5.0:
                continue  # its RecoveryResult is being written: take it at the next scrape
            strategy = (match[0].strategy if match else None) or "none"
            self._seen_latencies.add(ekey)
            self._recovery_latency.observe((strategy,), ep.latency_s)

    def _refresh_syncs(self) -> None:
        sync = self.fleet.sync
        if sync is None:
            return
        name = self.fleet.transport.name if self.fleet.transport is not None else "unknown"
        keys = set()
        for rep in sync.reports():
            key = (rep.version, rep.started_at)
            keys.add(key)
            if key in self._seen_syncs:
                continue
            self._syncs[(name, "ok" if rep.ok else "failed")] += 1
            for phase, seconds in rep.timings.items():
                self._sync_duration.observe((name, phase.removesuffix("_s")), seconds)
            self._count_delta(name, rep.delta)
        self._seen_syncs = keys

    def _count_delta(self, name: str, delta: Mapping[str, Any] | None) -> None:
        """Bytes by kind, fallbacks by reason and the changed fraction of one sync's deltas."""
        if not delta:
            return
        for row in delta.get("targets", {}).values():
            self._sync_bytes[(name, row["kind"])] += int(row["nbytes"])
            if row["kind"] != "full":
                continue
            if row.get("refused"):
                self._delta_fallbacks[("refused",)] += 1
            elif "not smaller" in str(row.get("reason", "")):
                self._delta_fallbacks[("not_smaller",)] += 1
            elif "cannot apply" in str(row.get("reason", "")):
                self._delta_fallbacks[("engine_capability",)] += 1
        if delta.get("changed_fraction") is not None:
            self._changed_fraction = float(delta["changed_fraction"])

    def _refresh_exports(self) -> None:
        exporter = self.fleet.exporter
        if exporter is None:
            return
        states = self.fleet.export_states()
        self._seen_exports &= states.keys()  # bounded by what the fleet still lists
        for version in states:
            if version in self._seen_exports:
                continue
            try:
                handle = exporter.handle(version)
            except Exception:
                continue
            if not handle.done():
                continue
            self._seen_exports.add(version)
            self._exports[(handle.lifecycle.state,)] += 1
            self._export_duration.observe((), handle.stats.total_s)
            self._export_blocking.observe((), handle.stats.blocking_s)


class _Collector:
    """The prometheus_client collector: builds every family from :class:`FleetMetrics`."""

    def __init__(self, metrics: FleetMetrics, prom: Any) -> None:
        import prometheus_client.core

        self.metrics = metrics
        self.core = prometheus_client.core

    def describe(self) -> list[Any]:
        return []  # no duplicate-name check against the registry: names are ours

    def _family(self, name: str) -> Any:
        spec = _SPEC[name]
        core = self.core
        if spec.type == "gauge":
            return core.GaugeMetricFamily(name, spec.help, labels=spec.labels)
        if spec.type == "counter":
            return core.CounterMetricFamily(name, spec.help, labels=spec.labels)
        return core.HistogramMetricFamily(name, spec.help, labels=spec.labels)

    def collect(self) -> Iterator[Any]:
        m = self.metrics
        fleet = m.fleet
        m.refresh()
        fam = {spec.name: self._family(spec.name) for spec in METRICS}
        groups = fleet.registry.groups()
        states = [s.id for s in WorkerGroupLifecycle.states]
        for g in groups:
            gid = g.group_id
            info = g.describe()
            for s in states:
                fam["rollsafe_group_state"].add_metric([gid, s], 1.0 if info["state"] == s else 0)
            versions = [mem["weights_version"] for mem in info["members"].values()]
            if versions and all(v is not None for v in versions):
                fam["rollsafe_group_weights_version"].add_metric([gid], float(min(versions)))
            fam["rollsafe_group_restart_budget_remaining"].add_metric(
                [gid], float(info["restart_budget"])
            )
            req = info["requests"]
            fam["rollsafe_group_requests_outstanding"].add_metric([gid], float(req["outstanding"]))
            fam["rollsafe_requests_routed_total"].add_metric(
                [gid], float(sum(req["dispatched_by_state"].values()))
            )
            fam["rollsafe_requests_served_total"].add_metric([gid], float(req["served"]))
            fam["rollsafe_requests_failed_total"].add_metric([gid], float(req["failed"]))
            retried, continued = fleet.observer.request_counts(gid)
            fam["rollsafe_requests_retried_total"].add_metric([gid], float(retried))
            fam["rollsafe_requests_continued_total"].add_metric([gid], float(continued))
            standby = info.get("standby") or {"state": "none"}
            sb_state = str(standby.get("state", "none"))
            fam["rollsafe_group_standby_ready"].add_metric(
                [gid], 1.0 if sb_state == "ready" else 0.0
            )
            for s in _STANDBY_STATES:
                fam["rollsafe_group_standby_state"].add_metric(
                    [gid, s], 1.0 if sb_state == s else 0.0
                )
            if "fallbacks" in standby:
                for result, key in (
                    ("ready_standby", "used_ready"),
                    ("warming_standby", "used_warming"),
                    ("fallback", "fallbacks"),
                ):
                    fam["rollsafe_standby_starts_total"].add_metric(
                        [gid, result], float(standby.get(key) or 0)
                    )
        fam["rollsafe_fleet_weights_version"].add_metric([], float(fleet.registry.fleet_version))
        for s in (st.id for st in type(fleet.mode).states):
            fam["rollsafe_immediate_recovery_state"].add_metric(
                [s], 1.0 if fleet.mode.state == s else 0.0
            )
        exporter = fleet.exporter
        if exporter is not None:
            with contextlib.suppress(Exception):
                newest = exporter.latest_ready()
                if newest is not None:
                    fam["rollsafe_export_ready_version"].add_metric([], float(newest.version))
        with m._lock:
            counters: list[tuple[str, Counter[Any]]] = [
                ("rollsafe_transitions_total", m._transitions),
                ("rollsafe_refused_events_total", m._refused),
                ("rollsafe_recoveries_total", m._recoveries),
                ("rollsafe_syncs_total", m._syncs),
                ("rollsafe_exports_total", m._exports),
                ("rollsafe_sync_bytes_total", m._sync_bytes),
                ("rollsafe_delta_fallbacks_total", m._delta_fallbacks),
            ]
            for name, counter in counters:
                for labels, value in sorted(counter.items()):
                    fam[name].add_metric(list(labels), float(value))
            if m._changed_fraction is not None:
                fam["rollsafe_delta_changed_fraction"].add_metric([], m._changed_fraction)
            hists: list[tuple[str, _Histogram]] = [
                ("rollsafe_recovery_latency_seconds", m._recovery_latency),
                ("rollsafe_detection_latency_seconds", m._detection_latency),
                ("rollsafe_recovery_step_duration_seconds", m._step_duration),
                ("rollsafe_sync_duration_seconds", m._sync_duration),
                ("rollsafe_export_duration_seconds", m._export_duration),
                ("rollsafe_export_blocking_seconds", m._export_blocking),
            ]
            for name, hist in hists:
                for labels, buckets, total in hist.rows():
                    fam[name].add_metric(list(labels), buckets, total)
        yield from fam.values()

"""FleetObserver: what a fleet saw over time beyond its machines' audit histories.

Owns three time series a :class:`~rollsafe.fleet.fleet.RolloutFleet` keeps for metrics,
recorded runs and their timeline picture:

* **request samples**: every group's served / failed request counts, sampled by a daemon thread
  every ``sample_interval_s`` (a sample is kept only when a count changed, plus the first and the
  last), so the served-requests rate per group can be drawn afterwards;
* **marks**: points in time the caller knows and the fleet cannot (``mark_crash(group)`` right
  after killing an engine, or any ``mark(kind, ...)``);
* **failure episodes**: per group, from the failure's *onset* to ``active`` again (or
  ``retired``). The onset is a crash mark of the group, else the first request that failed on it
  (the router's ``on_group_error`` hook), else the detection itself, within ``onset_window_s``
  before the group's ``fail``; *detection* is the ``fail`` transition (out of routing).

It is a registry listener (``on_transition``, duck-typed), the router's ``on_group_error``
hook and the data plane's request log (``request_served`` / ``request_gave_up``: retried and
continued requests per group); all only take a lock and append, as listeners must. Nothing
here needs prometheus-client.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollsafe.errors import InvalidArgument

if TYPE_CHECKING:  # no runtime import: rollsafe.fleet imports this module
    from rollsafe.registry import FleetRegistry, GroupTransition, WorkerGroup

__all__ = ["Episode", "FleetObserver", "RequestSample"]


#: Onset sources, most trusted first.
ONSET_SOURCES = ("crash_mark", "request_error", "detection")


@dataclass(frozen=True)
class RequestSample:
    """Cumulative request counts per group at one wall-clock time."""

    timestamp: float
    served: Mapping[str, int]
    failed: Mapping[str, int]


@dataclass
class Episode:
    """One failure of one group: onset -> detection (``fail``) -> ``active`` (or retired)."""

    group_id: str
    onset: float
    onset_source: str
    detected_at: float
    detected_from: str
    active_at: float | None = None
    retired_at: float | None = None
    transitions: list[str] = field(default_factory=list)

    @property
    def detection_s(self) -> float:
        return self.detected_at - self.onset

    @property
    def latency_s(self) -> float | None:
        """Onset -> ``active`` (None while open or when the group was retired)."""
        return None if self.active_at is None else self.active_at - self.onset

    @property
    def open(self) -> bool:
        return self.active_at is None and self.retired_at is None

    def as_dict(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "onset": self.onset,
            "onset_source": self.onset_source,
            "detected_at": self.detected_at,
            "detected_from": self.detected_from,
            "detection_s": self.detection_s,
            "active_at": self.active_at,
            "retired_at": self.retired_at,
            "latency_s": self.latency_s,
        }


class FleetObserver:
    """Samples request counts, keeps marks and failure episodes of one registry's groups."""

    def __init__(
        self,
        registry: FleetRegistry,
        *,
        sample_interval_s: float = 0.25,
        onset_window_s: float = 10.0,
        max_samples: int = 100_000,
        max_episodes: int = 10_000,
    ) -> None:
        if sample_interval_s <= 0:
            raise InvalidArgument(
                "sample_interval_s", f"sample_interval_s must be > 0, got {sample_interval_s}"
            )
        self.registry = registry
        self.sample_interval_s = sample_interval_s
        self.onset_window_s = onset_window_s
        self._lock = threading.Lock()
        self._samples: deque[RequestSample] = deque(maxlen=max_samples)
        self._pending_sample: RequestSample | None = None  # last unchanged sample, not kept yet
        self._marks: deque[dict[str, Any]] = deque(maxlen=max_episodes)
        self._episodes: deque[Episode] = deque(maxlen=max_episodes)
        self._open: dict[str, Episode] = {}
        self._first_error: dict[str, float] = {}
        self._retried: dict[str, int] = {}
        self._continued: dict[str, int] = {}
        self._subscribers: list[Callable[[Episode], None]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started_at: float | None = None
        self.stopped_at: float | None = None

    # ------------------------------------------------------------------ sampling
    def start(self) -> FleetObserver:
        """Start the sampling thread (idempotent)."""
        with self._lock:
            if self._thread is not None:
                return self
            self.started_at = time.time()
            self._thread = threading.Thread(target=self._run, name="rollsafe-observer", daemon=True)
        self.sample_now()
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Stop sampling (after one last sample); idempotent."""
        self._stop.set()
        if self.stopped_at is None:
            self.stopped_at = time.time()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self.sample_now(final=True)

    def _run(self) -> None:
        while not self._stop.wait(self.sample_interval_s):
            try:
                self.sample_now()
            except Exception:  # a group removed mid-read: try again next time
                continue

    def sample_now(self, *, final: bool = False) -> RequestSample:
        """Take one sample now (kept if a count changed, or if it is the first/``final``)."""
        served: dict[str, int] = {}
        failed: dict[str, int] = {}
        for group in self.registry.groups():
            req = group.describe()["requests"]
            served[group.group_id] = int(req["served"])
            failed[group.group_id] = int(req["failed"])
        sample = RequestSample(time.time(), served, failed)
        with self._lock:
            last = self._samples[-1] if self._samples else None
            changed = last is None or last.served != served or last.failed != failed
            if changed and self._pending_sample is not None:
                # the counts held until the sample before this one: keep it, so a rate drawn
                # from the kept samples is exact to one sampling interval
                self._samples.append(self._pending_sample)
            if changed or final:
                self._samples.append(sample)
                self._pending_sample = None
            else:
                self._pending_sample = sample
        return sample

    def samples(self) -> list[RequestSample]:
        """The kept samples, oldest first (the latest unchanged one included)."""
        with self._lock:
            out = list(self._samples)
            if self._pending_sample is not None:
                out.append(self._pending_sample)
        return out

    # ------------------------------------------------------------------ marks
    def mark(
        self, kind: str, group_id: str | None = None, *, at: float | None = None, **info: Any
    ) -> dict[str, Any]:
        """Record a point in time the fleet cannot see itself (wall clock ``at``, default now)."""
        row = {
            "kind": kind,
            "group": group_id,
            "timestamp": time.time() if at is None else at,
            **info,
        }
        with self._lock:
            self._marks.append(row)
        return row

    def mark_crash(self, group_id: str, *, at: float | None = None, **info: Any) -> dict[str, Any]:
        """Record that ``group_id`` crashed (call it right after killing an engine): the onset of
        the failure episode the health manager detects next."""
        return self.mark("crash", group_id, at=at, **info)

    def marks(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(m) for m in self._marks]

    # ------------------------------------------------------------------ episodes
    def subscribe(self, callback: Callable[[Episode], None]) -> None:
        """Call ``callback(episode)`` (quickly) whenever an episode ends."""
        with self._lock:
            self._subscribers.append(callback)

    def request_served(self, group_id: str, failed_on: Sequence[str]) -> None:
        """A routed request was served by ``group_id`` after failing on ``failed_on`` (the
        data plane's request log): each failed group counts one ``retried`` request and the
        group that finished it one ``continued``."""
        if not failed_on:
            return
        with self._lock:
            for gid in failed_on:
                self._retried[gid] = self._retried.get(gid, 0) + 1
            self._continued[group_id] = self._continued.get(group_id, 0) + 1

    def request_gave_up(self, error: BaseException) -> None:
        """A routed request ended with ``error``: every group it failed on but the last (whose
        failure ended it) counts one ``retried`` request."""
        attempts = getattr(error, "attempts", None) or ()  # RequestFailed: (group, error)s
        with self._lock:
            for gid, *_ in list(attempts)[:-1]:
                self._retried[gid] = self._retried.get(gid, 0) + 1

    def request_counts(self, group_id: str) -> tuple[int, int]:
        """(retried, continued) requests of ``group_id`` (see :meth:`request_served`)."""
        with self._lock:
            return self._retried.get(group_id, 0), self._continued.get(group_id, 0)

    def request_failed(self, group_id: str, exc: BaseException | None = None) -> None:
        """A request failed on ``group_id`` (the router's ``on_group_error`` hook)."""
        now = time.time()
        with self._lock:
            if group_id in self._open:
                return
            first = self._first_error.get(group_id)
            if first is None or now - first > self.onset_window_s:
                self._first_error[group_id] = now

    def on_transition(self, group: WorkerGroup, record: GroupTransition) -> None:
        gid, ts = group.group_id, record.timestamp
        ended: Episode | None = None
        with self._lock:
            episode = self._open.get(gid)
            if episode is None and record.target == "inactive" and record.source != "inactive":
                onset, source = ts, "detection"
                crash = [
                    float(m["timestamp"])
                    for m in self._marks
                    if m["kind"] == "crash"
                    and m["group"] == gid
                    and ts - self.onset_window_s <= float(m["timestamp"]) <= ts
                ]
                error = self._first_error.pop(gid, None)
                if crash:
                    onset, source = min(crash), "crash_mark"
                elif error is not None and ts - self.onset_window_s <= error <= ts:
                    onset, source = error, "request_error"
                episode = Episode(gid, onset, source, ts, record.event)
                self._open[gid] = episode
                self._episodes.append(episode)
            if episode is not None:
                episode.transitions.append(f"{record.event}:{record.source}->{record.target}")
                if record.target == "active":
                    episode.active_at = ts
                elif record.target == "retired":
                    episode.retired_at = ts
                if not episode.open:
                    del self._open[gid]
                    self._first_error.pop(gid, None)
                    ended = episode
            subscribers = list(self._subscribers)
        if ended is not None:
            for callback in subscribers:
                callback(ended)

    def episodes(self) -> list[Episode]:
        """Every failure episode, oldest first (open ones included)."""
        with self._lock:
            return list(self._episodes)

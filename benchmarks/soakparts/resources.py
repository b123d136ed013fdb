"""What the soak's driver and everything it started hold: processes, threads, file descriptors,
shared-memory segments, Ray actors, and the driver's RSS; sampled, bounded, checked for leaks.

:func:`mark_processes` puts a marker in the driver's environment (``ROLLSAFE_SOAK_RUN``)
before it starts anything: every process the soak starts inherits it (Ray's GCS and raylets,
their workers, the engines, vLLM's EngineCore and workers), so "every process of the soak" is
every process whose ``/proc/PID/environ`` holds the marker, also one orphaned by a SIGKILLed
parent (a removed Ray node's workers, an engine whose actor died) and adopted by init.

:class:`Resources` takes a :class:`Sample` (:meth:`Resources.sample`) each time the watcher asks;
``/dev/shm`` segments count as the soak's when one of its processes maps or holds them open
(looked up every :data:`SHM_EVERY` samples: reading every process's maps costs). After the
warm-up, :meth:`Resources.check` bounds each count by its warm-up maximum (times
:data:`GROWTH`, plus a slack per kind: engines restart, so processes come and go) and the
driver's RSS by a slope (least squares over the samples since the warm-up, MB per minute),
reported once they span :data:`RSS_MIN_SPAN_S` and judged once they span
:data:`RSS_JUDGE_SPAN_S`. :meth:`Resources.leaks` is the end's check: no process, shared-memory
segment or Ray actor of the soak left once everything is closed, and the driver's threads and
descriptors back near where they were before the rig started.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from rollsafe.processes import ProcessInfo, live_processes

__all__ = ["MARKER", "Resources", "Sample", "mark_processes", "marked_processes"]

#: sample the shared-memory segments every this many samples
SHM_EVERY = 10
#: a count may grow to this multiple of its warm-up maximum, plus its slack
GROWTH = 1.5
SLACK = {"processes": 12, "threads": 40, "fds": 80, "shm": 16, "ray_actors": 4}
#: the driver's RSS may grow by at most this many MB per minute after the warm-up
RSS_SLOPE_MB_PER_MIN = 4.0
#: ... judged once the samples after the warm-up span this long (s)
RSS_MIN_SPAN_S = 180.0
#: ... and judged (a violation past the bound) once they span this long: a one-off step (a
#: cache filled by a fault's first recovery: ~20 MB in the 5-minute runs) reads as a steep
#: slope over a few minutes and as nothing over an hour
RSS_JUDGE_SPAN_S = 600.0
#: the environment variable every process of the soak inherits
MARKER = "ROLLSAFE_SOAK_RUN"


def mark_processes() -> str:
    """Set the marker (this run's id) in the driver's environment; returns it."""
    value = f"{os.getpid()}-{time.time_ns()}"
    os.environ[MARKER] = value
    return value


def marked_processes(value: str | None = None) -> list[ProcessInfo]:
    """The live processes (but the driver) whose environment holds the marker."""
    want = f"{MARKER}={value or os.environ.get(MARKER, '')}".encode()
    me = os.getpid()
    found: list[ProcessInfo] = []
    for pid, info in live_processes().items():
        if pid == me:
            continue
        with contextlib.suppress(OSError), open(f"/proc/{pid}/environ", "rb") as f:
            if want in f.read().split(b"\0"):
                found.append(info)
    return found


@dataclass
class Sample:
    t: float  # seconds since the soak started
    processes: int
    threads: int
    fds: int
    rss_mb: float
    shm: int | None = None
    ray_actors: int | None = None


@dataclass
class Resources:
    """The soak's resources over time (see the module)."""

    t0: float = field(default_factory=time.monotonic)
    samples: list[Sample] = field(default_factory=list)
    warm_at: float | None = None  # seconds since t0 when the warm-up ended
    #: whether the RSS slope is a violation (the 5-minute ``--smoke`` only reports it: it never
    #: spans :data:`RSS_JUDGE_SPAN_S`)
    judge_rss: bool = True
    before: dict[str, int] = field(default_factory=dict)  # the driver before the rig started
    shm_seen: set[str] = field(default_factory=set)
    shm_at_start: set[str] = field(default_factory=set)
    fds_at_start: set[str] = field(default_factory=set)
    _n: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        """Before the rig starts: the driver's threads and descriptors, /dev/shm as it was."""
        self.before = {"threads": threading.active_count(), "fds": _fds()}
        self.fds_at_start = _fd_targets()
        self.shm_at_start = _shm_names()

    def sample(self, ray_actors: int | None = None) -> Sample:
        self._n += 1
        mine = marked_processes()
        shm: int | None = None
        if self._n % SHM_EVERY == 1:
            names = _shm_of([os.getpid(), *(p.pid for p in mine)])
            with self._lock:
                self.shm_seen |= names
            shm = len(names)
        s = Sample(
            t=round(time.monotonic() - self.t0, 1),
            processes=len(mine),
            threads=threading.active_count(),
            fds=_fds(),
            rss_mb=round(_rss_mb(), 1),
            shm=shm,
            ray_actors=ray_actors,
        )
        with self._lock:
            self.samples.append(s)
        return s

    def warm(self) -> None:
        """The warm-up ends now: bounds are taken from the samples so far."""
        self.warm_at = time.monotonic() - self.t0

    def _warm_max(self, key: str) -> float | None:
        values = [
            getattr(s, key)
            for s in self.samples
            if getattr(s, key) is not None and (self.warm_at is None or s.t <= self.warm_at)
        ]
        return max(values) if values else None

    def check(self) -> list[str]:
        """What grew beyond its bound (empty before the warm-up ends)."""
        if self.warm_at is None or not self.samples:
            return []
        last = self.samples[-1]
        problems: list[str] = []
        for key, slack in SLACK.items():
            value = getattr(last, key)
            warm = self._warm_max(key)
            if value is None or warm is None:
                continue
            bound = warm * GROWTH + slack
            if value > bound:
                problems.append(f"{key} grew to {value} (warm-up max {warm}, bound {bound:.0f})")
        slope = self.rss_slope()
        if (
            self.judge_rss
            and slope is not None
            and slope > RSS_SLOPE_MB_PER_MIN
            and self._warm_span() >= RSS_JUDGE_SPAN_S
        ):
            problems.append(
                f"driver RSS grows {slope:.2f} MB/min since the warm-up "
                f"(bound {RSS_SLOPE_MB_PER_MIN} MB/min)"
            )
        return problems

    def _warm_span(self) -> float:
        """Seconds the samples since the warm-up span."""
        if self.warm_at is None or not self.samples:
            return 0.0
        warm = [x.t for x in self.samples if x.t >= self.warm_at]
        return warm[-1] - warm[0] if warm else 0.0

    def rss_slope(self) -> float | None:
        """MB per minute (least squares) over the samples since the warm-up, once they span
        :data:`RSS_MIN_SPAN_S`; None before."""
        if self.warm_at is None:
            return None
        pts = [(s.t, s.rss_mb) for s in self.samples if s.t >= self.warm_at]
        if len(pts) < 10 or pts[-1][0] - pts[0][0] < RSS_MIN_SPAN_S:
            return None
        n = len(pts)
        mt = sum(t for t, _ in pts) / n
        mr = sum(r for _, r in pts) / n
        var = sum((t - mt) ** 2 for t, _ in pts)
        if var == 0:
            return None
        cov = sum((t - mt) * (r - mr) for t, r in pts)
        return cov / var * 60.0

    def leaks(self, ray_actors: int | None, settle_s: float = 30.0) -> dict[str, Any]:
        """After everything is closed: what of the soak is still there (waits up to
        ``settle_s`` for processes to be reaped and segments to be unlinked)."""
        deadline = time.monotonic() + settle_s
        while True:
            left = marked_processes()
            shm = sorted((self.shm_seen - self.shm_at_start) & _shm_names())
            if (not left and not shm) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        threads = threading.active_count()
        fds = _fds()
        return {
            "processes": [p.describe() for p in left],
            "shm": shm,
            "ray_actors": ray_actors,
            "threads": {"before": self.before.get("threads"), "after": threads},
            "fds": {
                "before": self.before.get("fds"),
                "after": fds,
                "new": sorted(_fd_targets() - self.fds_at_start)[:40],
            },
            "thread_names": sorted(t.name for t in threading.enumerate())[:40],
        }

    def summary(self) -> dict[str, Any]:
        def series(key: str) -> dict[str, Any]:
            values = [getattr(s, key) for s in self.samples if getattr(s, key) is not None]
            if not values:
                return {}
            return {
                "start": values[0],
                "warm_max": self._warm_max(key),
                "max": max(values),
                "end": values[-1],
            }

        return {
            "samples": len(self.samples),
            "warm_at_s": None if self.warm_at is None else round(self.warm_at, 1),
            **{k: series(k) for k in ("processes", "threads", "fds", "shm", "ray_actors")},
            "rss_mb": series("rss_mb"),
            "rss_slope_mb_per_min": _round(self.rss_slope()),
        }

    def series_rows(self, every: int = 10) -> list[dict[str, Any]]:
        return [asdict(s) for s in self.samples[::every]]


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _fds() -> int:
    with contextlib.suppress(OSError):
        return len(os.listdir("/proc/self/fd"))
    return -1


def _fd_targets() -> set[str]:
    """What the driver's descriptors point at (``fd -> target``)."""
    out: set[str] = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                out.add(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
    return out


def _rss_mb() -> float:
    with open("/proc/self/statm", encoding="ascii") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _shm_names() -> set[str]:
    with contextlib.suppress(OSError):
        return set(os.listdir("/dev/shm"))
    return set()


def _shm_of(pids: list[int]) -> set[str]:
    """``/dev/shm`` names mapped or held open by ``pids``."""
    names: set[str] = set()
    for pid in pids:
        with (
            contextlib.suppress(OSError),
            open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f,
        ):
            for line in f:
                i = line.find("/dev/shm/")
                if i >= 0:
                    names.add(line[i + 9 :].strip().split(" ")[0])
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("/dev/shm/"):
                        names.add(target[9:].split(" ")[0])
    return names

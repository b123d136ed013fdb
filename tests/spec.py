"""Independent reference models of the four machines, written from docs/design.md's machine tables.

The property tests drive a real machine and one of these side by side: after every event the
real machine must be in the state the spec predicts, and a refused event must change nothing.
These are plain functions over plain data, deliberately not sharing code with rollsafe.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

REFUSED = None  # a spec step returns REFUSED when the event must be refused


# ---------------------------------------------------------------------- WorkerGroupLifecycle
_LIVE = ("launching", "active", "standby", "inactive", "recovering", "pending_weights")


@dataclass
class GroupSpec:
    ranks: tuple[int, ...]
    budget: int
    state: str = "launching"
    spare: bool = False  # the role: a spare is ready in standby, a serving group in active
    healthy: dict[int, bool] = field(default_factory=dict)
    version: dict[int, int | None] = field(default_factory=dict)
    known: dict[int, bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for r in self.ranks:
            self.healthy[r] = False
            self.version[r] = None
            self.known[r] = True

    def report(self, rank: int, healthy: bool, version: int | None) -> None:
        self.healthy[rank] = healthy
        self.known[rank] = True
        if version is not None:
            self.version[rank] = version

    def forget(self, rank: int) -> None:
        self.healthy[rank] = False
        self.version[rank] = None
        self.known[rank] = False

    def _healthy(self) -> bool:
        return all(self.healthy[r] for r in self.ranks)

    def _current(self, v: int) -> bool:
        return all(self.version[r] == v for r in self.ranks)

    def step(self, event: str, v: int) -> str | None:
        s = self.state
        nxt: str | None = REFUSED
        ready = "standby" if self.spare else "active"
        starting = (event, s) in (("launched", "launching"), ("restarted", "recovering"))
        if starting:
            if self._healthy():
                nxt = ready if self._current(v) else "pending_weights"
        elif event == "fail" and s in ("launching", "active", "standby", "pending_weights"):
            nxt = "inactive"
        elif event == "claim" and s == "inactive":
            if all(self.known[r] for r in self.ranks) and self.budget > 0:
                nxt = "recovering"
                self.budget -= 1
                for r in self.ranks:
                    self.healthy[r] = False
                    self.version[r] = None
        elif event == "restart_failed" and s == "recovering":
            nxt = "inactive"
        elif event == "mark_stale" and s in ("active", "standby"):
            if not self._current(v):
                nxt = "pending_weights"
        elif event == "weights_loaded" and s == "pending_weights":
            if self._healthy() and self._current(v):
                nxt = ready
        elif event == "promote" and s == "standby":
            if self.spare and self._healthy() and self._current(v):
                nxt = "active"
                self.spare = False
        elif event == "enlist" and s in ("inactive", "recovering", "unplaced", "pending_weights"):
            if not self.spare:
                nxt = s
                self.spare = True
        elif event == "retire" and s != "retired":
            nxt = "retired"
        elif event == "node_lost" and s in _LIVE:
            nxt = "unplaced"
            for r in self.ranks:
                self.forget(r)
        elif event == "placed" and s == "unplaced":
            nxt = "recovering"
            for r in self.ranks:
                self.healthy[r], self.version[r], self.known[r] = False, None, True
        elif event == "drain" and s in (*_LIVE, "unplaced"):
            nxt = "draining"
        if nxt is not None:
            self.state = nxt
        return nxt


# ---------------------------------------------------------------------- ExportLifecycle
@dataclass
class ExportSpec:
    version: int
    world_size: int = 1
    state: str = "requested"
    leases: int = 0

    def step(self, event: str, **kw: object) -> str | None:
        s = self.state
        nxt: str | None = REFUSED
        if event == "adopt" and s == "requested":
            if kw.get("verified") is True and kw.get("version") == self.version:
                nxt = "ready"
        elif event == "snapshot" and s == "requested":
            nxt = "snapshotting"
        elif event == "snapshot_done" and s == "snapshotting":
            nxt = "writing"
        elif event == "shards_written" and s == "writing":
            ranks = kw.get("ranks_ok")
            if isinstance(ranks, Collection) and set(ranks) == set(range(self.world_size)):
                nxt = "committing"
        elif event == "publish" and s == "committing":
            missing = kw.get("index_missing_keys")
            if (
                isinstance(missing, Collection)
                and len(missing) == 0
                and kw.get("checksums_verified") is True
                and kw.get("renamed") is True
            ):
                nxt = "ready"
        elif event == "supersede" and s == "ready":
            newer = kw.get("newer_version")
            if isinstance(newer, int) and newer > self.version:
                nxt = "superseded"
        elif event == "delete" and s == "superseded":
            if self.leases == 0:
                nxt = "deleted"
        elif event == "fail" and s in ("snapshotting", "writing", "committing"):
            nxt = "failed"
        elif event == "abandon" and s in ("snapshotting", "writing", "committing"):
            nxt = "abandoned"
        if nxt is not None:
            self.state = nxt
        return nxt


# ---------------------------------------------------------------------- CheckpointRegistration
@dataclass
class RegistrationSpec:
    world_size: int
    allow: tuple[str, ...] = ("mtp.",)
    state: str = "empty"
    published: tuple[str, int] | None = None
    pending: tuple[str, int] | None = None
    last_version: int | None = None

    def step(self, event: str, **kw: object) -> str | None:
        s = self.state
        nxt: str | None = REFUSED
        if event == "begin_register" and s in ("empty", "registered", "failed"):
            version = kw.get("version")
            if isinstance(version, int) and (
                self.last_version is None or version >= self.last_version
            ):
                nxt = "registering"
                self.published = None
                self.pending = (str(kw.get("name")), version)
        elif event == "register_ok" and s == "registering":
            ranks = kw.get("ranks_ok")
            expected = set(kw.get("expected_keys") or ())  # type: ignore[call-overload]
            got = set(kw.get("registered_keys") or ())  # type: ignore[call-overload]
            ranks_ok = isinstance(ranks, Collection) and set(ranks) == set(range(self.world_size))
            coverage = not (got - expected) and all(
                k.startswith(self.allow) for k in expected - got
            )
            if ranks_ok and coverage:
                nxt = "registered"
                self.published = self.pending
                assert self.pending is not None
                self.last_version = self.pending[1]
        elif event == "register_failed" and s == "registering":
            nxt = "failed"
            self.published = None
        elif event == "begin_update" and s == "registered":
            if _targets_ok(kw.get("targets"), self.world_size):  # type: ignore[arg-type]
                nxt = "updating"
        elif event == "update_done" and s == "updating":
            nxt = "registered"
        if nxt is not None:
            self.state = nxt
        return nxt

    @property
    def visible(self) -> tuple[str, int] | None:
        return self.published if self.state in ("registered", "updating") else None


def _targets_ok(targets: Sequence[Sequence[int]] | None, world_size: int) -> bool:
    if not targets:
        return False
    flat = [r for group in targets for r in group]
    if any(len(group) == 0 for group in targets):
        return False
    return len(flat) == len(set(flat)) and all(0 <= r < world_size for r in flat)


# ---------------------------------------------------------------------- ImmediateRecoveryMode
@dataclass
class ModeSpec:
    rearm_after: int
    state: str = "disabled"
    streak: int = 0

    def step(self, event: str) -> str | None:
        s = self.state
        nxt: str | None = REFUSED
        if event == "enable" and s == "disabled":
            nxt = "enabled"
        elif event == "disable" and s in ("enabled", "suspended"):
            nxt = "disabled"
        elif event == "export_late" and s in ("enabled", "suspended"):
            nxt = "suspended"
            self.streak = 0
        elif event == "export_on_time" and s == "enabled":
            nxt = "enabled"
        elif event == "export_on_time" and s == "suspended":
            self.streak += 1
            if self.streak >= self.rearm_after:
                nxt = "enabled"
                self.streak = 0
            else:
                nxt = "suspended"
        if nxt is not None:
            self.state = nxt
        return nxt

"""``NodeWatcher``: which Ray nodes died or joined, from one GCS call per round for a whole fleet.

One daemon thread per fleet calls ``ray.nodes()`` (the GCS's node table: no call to any raylet,
no ``ray.util.state``) once every ``interval_s``, compares the alive nodes with the last round's
and hands every change of the round to ``on_event`` in **one** call, as data
(:class:`NodeEvent`: ``"dead"`` or ``"joined"``, the node id and its address). A node loss is
therefore one callback for every group on that node, whatever their number.

Rules:

* The first successful round is the baseline: the nodes alive then are not reported as joined.
* A node is ``dead`` when it was alive last round and is now marked not alive or is missing
  from the table; ``joined`` when it is alive now and was not last round.
* A Ray call that raises, or does not answer within ``call_timeout_s``, ends its round without
  a change (``failed_rounds``, ``last_error``, one log line); while such a call still hangs no
  second one is started (``stalled_rounds``), so a stuck GCS costs one thread, not one per round.
* ``on_event`` runs on the watcher's thread; an exception from it is logged and counted
  (``callback_errors``) and the watcher goes on (the changes are not delivered again).

Ray is imported by :meth:`NodeWatcher.start` (or never, with ``ray_module=``: any object with
a ``nodes()`` that returns Ray's list of node dicts, for tests).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rollsafe.concurrency import DaemonCall
from rollsafe.errors import InvalidArgument

__all__ = ["NodeEvent", "NodeInfo", "NodeWatcher", "alive_nodes", "node_changes"]

log = logging.getLogger(__name__)

NodeEventKind = Literal["dead", "joined"]


@dataclass(frozen=True)
class NodeInfo:
    """One alive node as the GCS reported it: its id (hex), the raylet's ``address`` (IP),
    ``hostname`` and total ``resources``."""

    node_id: str
    address: str
    hostname: str = ""
    resources: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeEvent:
    """A change between two rounds: node ``node_id`` (at ``address``) is ``"dead"`` or
    ``"joined"``."""

    kind: NodeEventKind
    node_id: str
    address: str


def alive_nodes(table: Iterable[Mapping[str, Any]]) -> dict[str, NodeInfo]:
    """``{node_id: NodeInfo}`` of the alive entries of ``ray.nodes()``'s list, in its order."""
    out: dict[str, NodeInfo] = {}
    for entry in table:
        if not entry.get("Alive"):
            continue
        node_id = str(entry["NodeID"])
        out[node_id] = NodeInfo(
            node_id=node_id,
            address=str(entry.get("NodeManagerAddress", "")),
            hostname=str(entry.get("NodeManagerHostname", "")),
            resources={str(k): float(v) for k, v in dict(entry.get("Resources") or {}).items()},
        )
    return out


def node_changes(before: Mapping[str, NodeInfo], now: Mapping[str, NodeInfo]) -> list[NodeEvent]:
    """The events from one round's alive nodes to the next: every ``dead`` one first (in
    ``before``'s order, with the address it had), then every ``joined`` one (in ``now``'s)."""
    dead = [NodeEvent("dead", n, info.address) for n, info in before.items() if n not in now]
    joined = [NodeEvent("joined", n, info.address) for n, info in now.items() if n not in before]
    return dead + joined


class NodeWatcher:
    """Watches the Ray cluster's nodes for one fleet (see the module doc).

    ``on_event(events)``: called once per round that saw a change, with all of them;
    ``interval_s``: the time between two rounds' starts; ``call_timeout_s``: the bound of one
    ``ray.nodes()`` call (default: ``max(5, 5 * interval_s)``); ``ray_module``: what to call
    ``nodes()`` on (default: ``ray``)."""

    def __init__(
        self,
        on_event: Callable[[list[NodeEvent]], None],
        *,
        interval_s: float = 1.0,
        ray_module: Any = None,
        call_timeout_s: float | None = None,
        name: str = "rollsafe-node-watcher",
    ) -> None:
        if not callable(on_event):
            raise InvalidArgument("on_event", f"must be callable, got {on_event!r}")
        if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)):
            raise InvalidArgument("interval_s", f"must be a number > 0, got {interval_s!r}")
        if interval_s <= 0:
            raise InvalidArgument("interval_s", f"must be > 0, got {interval_s!r}")
        timeout = max(5.0, 5.0 * interval_s) if call_timeout_s is None else call_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise InvalidArgument("call_timeout_s", f"must be a number > 0, got {timeout!r}")
        self.on_event = on_event
        self.interval_s = float(interval_s)
        self.call_timeout_s = float(timeout)
        self.name = name
        self._ray = ray_module
        self._lock = threading.Lock()
        self._alive: dict[str, NodeInfo] = {}
        self._baseline = False
        self._pending: DaemonCall[Sequence[Mapping[str, Any]]] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: rounds run (each made at most one Ray call)
        self.rounds = 0
        #: ``ray.nodes()`` calls made (== rounds, unless a call hung across rounds)
        self.calls = 0
        #: rounds whose call raised or outlived ``call_timeout_s``
        self.failed_rounds = 0
        #: rounds that made no call because the previous one still hung
        self.stalled_rounds = 0
        #: exceptions raised by ``on_event``
        self.callback_errors = 0
        #: events handed to ``on_event``
        self.events_delivered = 0
        #: the last failed round's reason (None: none failed yet)
        self.last_error: str | None = None
        #: seconds the last answered ``ray.nodes()`` call took (None: none answered yet)
        self.last_call_s: float | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> NodeWatcher:
        """Run the first round (the baseline) now, then the rest on a daemon thread; idempotent.
        A failed first round is not an error: the next successful one is the baseline."""
        with self._lock:
            if self._thread is not None:
                return self
            if self._ray is None:
                import ray

                self._ray = ray
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self.run_round()
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the thread; True when it ended within ``timeout`` s (a callback still running
        keeps it up to then). A hanging Ray call is left to its own daemon thread."""
        self._stop.set()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout)
        return not thread.is_alive()

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive() and not self._stop.is_set()

    def alive_nodes(self) -> dict[str, NodeInfo]:
        """The alive nodes of the last successful round (no Ray call)."""
        with self._lock:
            return dict(self._alive)

    def stats(self) -> dict[str, Any]:
        """Counters for a snapshot or metrics (no Ray call)."""
        with self._lock:
            alive = len(self._alive)
        return {
            "alive_nodes": alive,
            "rounds": self.rounds,
            "calls": self.calls,
            "failed_rounds": self.failed_rounds,
            "stalled_rounds": self.stalled_rounds,
            "callback_errors": self.callback_errors,
            "events_delivered": self.events_delivered,
            "last_error": self.last_error,
            "last_call_s": self.last_call_s,
        }

    # ------------------------------------------------------------------ rounds
    def run_round(self) -> list[NodeEvent]:
        """One round now on the caller's thread (the watcher's loop calls it): at most one
        ``ray.nodes()`` call, bounded by ``call_timeout_s``; the changes go to ``on_event`` and
        are returned. Never raises for a failing Ray call or callback."""
        self.rounds += 1
        table = self._fetch()
        if table is None:
            return []
        try:
            now = alive_nodes(table)
        except Exception as exc:  # a malformed table: a failed round, not a dead thread
            self._failed(f"unreadable ray.nodes() answer: {exc!r}")
            return []
        with self._lock:
            events = node_changes(self._alive, now) if self._baseline else []
            self._alive = now
            self._baseline = True
        if events:
            self.events_delivered += len(events)
            try:
                self.on_event(events)
            except Exception:
                self.callback_errors += 1
                log.exception("%s: on_event raised for %s; the watcher goes on", self.name, events)
        return events

    def _fetch(self) -> Sequence[Mapping[str, Any]] | None:
        """This round's ``ray.nodes()`` answer, or None (the round failed or stalled)."""
        pending = self._pending
        if pending is not None and not pending.done():
            self.stalled_rounds += 1
            return None
        ray = self._ray
        self.calls += 1
        call: DaemonCall[Sequence[Mapping[str, Any]]] = DaemonCall.start(
            lambda: list(ray.nodes()), name=f"{self.name}-call"
        )
        started = time.monotonic()
        deadline = started + self.call_timeout_s
        while not call.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
            if self._stop.is_set() or time.monotonic() >= deadline:
                self._pending = call
                if not self._stop.is_set():
                    self._failed(f"ray.nodes() did not answer within {self.call_timeout_s:g} s")
                return None
        self._pending = None
        self.last_call_s = time.monotonic() - started
        outcome = call.outcome()
        if outcome.error is not None:
            self._failed(f"ray.nodes() failed: {outcome.error!r}")
            return None
        return outcome.value

    def _failed(self, why: str) -> None:
        self.failed_rounds += 1
        self.last_error = why
        log.warning("%s: round %d: %s", self.name, self.rounds, why)

    def _loop(self) -> None:
        next_at = time.monotonic() + self.interval_s
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            next_at = time.monotonic() + self.interval_s
            try:
                self.run_round()
            except Exception:  # never let the thread die
                log.exception("%s: round %d failed", self.name, self.rounds)

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"NodeWatcher({state}, {len(self._alive)} alive, {self.rounds} rounds)"

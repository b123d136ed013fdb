"""The strict, audited base every rollsafe machine is built on.

Owns three things the four lifecycle machines share:

* strictness: python-statemachine's ``StateMachine`` (not ``StateChart``), so an illegal or
  guard-blocked event raises and an exception in an action propagates with the state unchanged;
* a clearer refusal: :class:`TransitionRefused` (a ``TransitionNotAllowed``) names the machine,
  the event, the state and, lazily, which guard blocked it with what inputs;
* a bounded audit trail: every transition appends a :class:`TransitionRecord` (event, source,
  target, wall-clock timestamp, guard inputs) to a ring buffer used by audits and the demo
  timeline.

Machines here import nothing heavier than python-statemachine: guards read plain data that the
fleet passes in (event keyword arguments) or recorded with ``report_*`` methods.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from statemachine import StateMachine
from statemachine.exceptions import TransitionNotAllowed

from rollsafe.errors import RollsafeError

__all__ = [
    "GuardInputMissing",
    "GuardedMachine",
    "MissingGuardInput",
    "TransitionRecord",
    "TransitionRefused",
    "summarize",
]

_MAX_ITEMS_KEPT = 16


def summarize(value: Any) -> Any:
    """Return a small, immutable stand-in for ``value`` fit for the bounded history.

    Large collections (expected key lists, say) are reduced to their size and a few items, so a
    history entry stays bounded whatever the caller passed.
    """
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, Mapping):
        items = list(value.items())
        if len(items) > _MAX_ITEMS_KEPT:
            return f"<mapping of {len(items)} items>"
        return tuple((summarize(k), summarize(v)) for k, v in items)
    if isinstance(value, (list, tuple, set, frozenset)):
        seq = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else list(value)
        if len(seq) > _MAX_ITEMS_KEPT:
            head = ", ".join(repr(v) for v in seq[:3])
            return f"<{len(seq)} items: {head}, ...>"
        return tuple(summarize(v) for v in seq)
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


@dataclass(frozen=True)
class TransitionRecord:
    """One transition taken by a machine, as kept in its audit history."""

    seq: int
    machine: str
    event: str
    source: str
    target: str
    timestamp: float
    inputs: tuple[tuple[str, Any], ...]

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly view (used by the demo timeline)."""
        return {
            "seq": self.seq,
            "machine": self.machine,
            "event": self.event,
            "source": self.source,
            "target": self.target,
            "timestamp": self.timestamp,
            "inputs": {k: _jsonable(v) for k, v in self.inputs},
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


class GuardInputMissing(RollsafeError, ValueError):
    """Raised inside a guard whose input (``current_version=``...) was not passed.

    The machine turns it into :class:`MissingGuardInput`, a refusal; ``can()`` and ``explain()``
    count the guard as failed.
    """


class TransitionRefused(RollsafeError, TransitionNotAllowed):
    """An event was refused: not allowed in this state, or blocked by a guard. Nothing changed.

    ``reasons`` lists, per candidate transition, which named guard failed and what it saw; it is
    computed lazily (only when the message is read) so refusals stay cheap on hot paths.
    """

    def __init__(
        self,
        original: TransitionNotAllowed,
        machine_label: str,
        state: str,
        event: str,
        explain: Callable[[], list[str]],
    ) -> None:
        super().__init__(original.event, original.configuration)
        self.machine_label = machine_label
        self.state = state
        self.event_name = event
        self._explain = explain
        self._reasons: list[str] | None = None

    @property
    def reasons(self) -> list[str]:
        """Why each candidate transition was refused (guard name and what it saw)."""
        if self._reasons is None:
            self._reasons = self._explain()
        return self._reasons

    def __str__(self) -> str:
        why = "; ".join(self.reasons)
        return f"{self.machine_label} refused {self.event_name!r} in state {self.state!r}: {why}"


class MissingGuardInput(TransitionRefused, ValueError):
    """An event needing a guard input (``current_version=``, ``ranks_ok=``...) came without it.

    A refusal (a ``TransitionNotAllowed``: nothing changed) and a ``ValueError`` (bad call).
    """


class GuardedMachine(StateMachine):
    """Base for rollsafe's machines: strict, thread-safe, audited.

    Subclasses define states, events and named guard methods, and may override
    :meth:`guard_facts` to add model data (per-member facts, lease counts) to each history record.
    Events are sent as ``machine.send("event", **kw)`` or ``machine.event(**kw)``.
    """

    history_limit: ClassVar[int] = 256

    def __init__(self, *, start_value: str | None = None) -> None:
        self._lock = threading.RLock()
        self._history: deque[tuple[Any, ...]] = deque(maxlen=self.history_limit)
        self._seq = 0
        self._last_trigger: tuple[str, Mapping[str, Any]] = ("", {})
        self._held_for_loop = 0
        super().__init__(start_value=start_value)

    # ------------------------------------------------------------------ public API
    @property
    def state(self) -> str:
        """The id of the current state (``"active"``, ``"ready"``...)."""
        return str(self.current_state_value)

    @property
    def label(self) -> str:
        """How this machine is named in errors and timelines."""
        return type(self).__name__

    @property
    def history(self) -> tuple[TransitionRecord, ...]:
        """The last ``history_limit`` transitions, oldest first."""
        with self._lock:
            raw = tuple(self._history)
        label = self.label
        return tuple(_record(label, entry, self.facts_from_token) for entry in raw)

    @property
    def last_transition(self) -> TransitionRecord | None:
        """The most recent transition (cheap: builds one record, not the whole history)."""
        with self._lock:
            if not self._history:
                return None
            entry = self._history[-1]
        return _record(self.label, entry, self.facts_from_token)

    def guard_facts(self) -> dict[str, Any]:
        """Model data the guards read, recorded with every transition. Override to add facts."""
        return self.facts_from_token(self.facts_token())

    def facts_token(self) -> Any:
        """A cheap, immutable capture of the guard facts, kept raw in the history.

        Override together with :meth:`facts_from_token` when building the facts dict is costly:
        the history then stores the token and formats it only when read.
        """
        return None

    def facts_from_token(self, token: Any) -> dict[str, Any]:
        """Turn a :meth:`facts_token` into the facts dict shown in history and refusals."""
        return {}

    def can(self, event: str, **kwargs: Any) -> bool:
        """Whether ``event`` would be taken now with these inputs (nothing changes)."""
        with self._lock:
            try:
                return any(ok for _, ok, _ in self._candidates(event, kwargs))
            except GuardInputMissing:
                return False  # sending it would raise MissingGuardInput, a refusal

    def explain(self, event: str, **kwargs: Any) -> list[str]:
        """Why ``event`` would be refused now (empty if it would be taken)."""
        with self._lock:
            return self._refusal_reasons(event, kwargs)

    def restore_state(self, state_id: str) -> None:
        """Put the machine into ``state_id`` directly, bypassing guards, actions and history.

        For model checking only (the explorer restores snapshots); never used by the fleet.
        """
        with self._lock:
            state = type(self).states_map[state_id]
            self.current_state_value = state_id
            self._engine.running = not state.final

    def state_ids(self) -> list[str]:
        """All state ids of this machine, in definition order."""
        return [s.id for s in type(self).states]

    # ------------------------------------------------------------------ internals
    def _put_nonblocking(self, trigger_data: Any, internal: bool = False) -> None:
        # Hold the lock from queuing an event until its processing loop ends, so events sent
        # from several threads run one at a time, each in its caller's thread: every caller gets
        # its own result or refusal, and every transition is recorded once, in order.
        if internal:
            super()._put_nonblocking(trigger_data, internal=internal)
            return
        self._lock.acquire()
        try:
            self._last_trigger = (str(trigger_data.event), trigger_data.kwargs)
            super()._put_nonblocking(trigger_data, internal=internal)
        except TransitionNotAllowed as exc:  # final state: the engine no longer runs
            self._lock.release()
            event, state = str(trigger_data.event), self.state
            raise TransitionRefused(
                exc, self.label, state, event, lambda: [f"{state!r} is a final state"]
            ) from None
        except BaseException:
            self._lock.release()
            raise
        self._held_for_loop += 1

    def _processing_loop(self, caller_future: Any | None = None) -> Any:
        with self._lock:
            try:
                return self._process_one(caller_future)
            finally:
                if self._held_for_loop:
                    self._held_for_loop -= 1
                    self._lock.release()

    def _process_one(self, caller_future: Any | None) -> Any:
        source = self.current_state_value
        try:
            result = super()._processing_loop(caller_future)
        except TransitionRefused:
            raise
        except GuardInputMissing as missing:
            event, _ = self._last_trigger
            state = self.state
            text = str(missing)
            raise MissingGuardInput(
                TransitionNotAllowed(None, self.configuration),
                self.label,
                state,
                event,
                lambda: [text],
            ) from None
        except TransitionNotAllowed as exc:
            event, kwargs = self._last_trigger
            state = self.state
            raise TransitionRefused(
                exc,
                self.label,
                state,
                event,
                lambda: self._refusal_reasons(event, kwargs, state),
            ) from None
        # Strict machine: no exception means exactly one transition was taken. Record it raw;
        # TransitionRecord objects are built only when the history is read.
        self._seq += 1
        event, kwargs = self._last_trigger
        self._history.append(
            (
                self._seq,
                event,
                source,
                self.current_state_value,
                time.time(),
                kwargs,
                self.facts_token(),
            )
        )
        return result

    def _candidates(
        self, event: str, kwargs: Mapping[str, Any]
    ) -> Iterable[tuple[Any, bool, list[str]]]:
        """(transition, enabled, failed guard names) for each transition of ``event`` from here."""
        for state in self.configuration:
            for transition in state.transitions:
                if not transition.match(event):
                    continue
                failed = [
                    name for name in _guard_names(transition) if not self._guard(name, kwargs)
                ]
                yield transition, not failed, failed

    def _guard(self, name: str, kwargs: Mapping[str, Any]) -> bool:
        method = getattr(self, name)
        code = method.__code__
        accepted = code.co_varnames[1 : code.co_argcount + code.co_kwonlyargcount]
        return bool(method(**{k: v for k, v in kwargs.items() if k in accepted}))

    def _refusal_reasons(
        self, event: str, kwargs: Mapping[str, Any], state: str | None = None
    ) -> list[str]:
        state = state or self.state
        known = sorted(str(e) for e in type(self)._events)
        if event not in known:
            return [f"unknown event {event!r}; events are {known}"]
        reasons: list[str] = []
        facts = {**{k: summarize(v) for k, v in kwargs.items()}, **self.guard_facts()}
        any_candidate = False
        try:
            candidates = list(self._candidates(event, kwargs))
        except GuardInputMissing as missing:
            return [str(missing)]
        for transition, ok, failed in candidates:
            any_candidate = True
            if ok:
                continue
            target = transition.target.id if transition.target is not None else state
            reasons.append(f"-> {target} blocked by {', '.join(failed)}")
        if not any_candidate:
            legal = sorted(
                {str(e) for s in self.configuration for e in s.transitions.unique_events}
            )
            return [f"not allowed from {state!r} (allowed here: {legal})"]
        if reasons and facts:
            shown = ", ".join(f"{k}={v!r}" for k, v in facts.items())
            reasons.append(f"inputs: {shown}")
        return reasons


def _record(
    label: str, entry: tuple[Any, ...], facts_from_token: Callable[[Any], dict[str, Any]]
) -> TransitionRecord:
    seq, event, source, target, timestamp, kwargs, token = entry
    inputs = {k: summarize(v) for k, v in kwargs.items()}
    for key, value in facts_from_token(token).items():
        inputs.setdefault(key, value)
    return TransitionRecord(seq, label, event, source, target, timestamp, tuple(inputs.items()))


def _guard_names(transition: Any) -> list[str]:
    """The named condition methods on a transition (``cond=`` entries), in order."""
    return [str(spec) for spec in transition.cond]

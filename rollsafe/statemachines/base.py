"""The strict, audited base every rollsafe machine is built on.

Owns three things the four lifecycle machines share:

* strictness: python-statemachine's ``StateMachine`` (not ``StateChart``), so an illegal or
  guard-blocked event raises and an exception in an action propagates with the state unchanged;
* a clearer refusal: :class:`TransitionRefused` (a ``TransitionNotAllowed``) names the machine,
  the event, the state and, lazily, which guard blocked it with what inputs;
* a bounded audit trail: every transition appends a :class:`TransitionRecord` (event, source,
  target, wall-clock timestamp, guard inputs) to a ring buffer of the last
  :attr:`GuardedMachine.history_limit` transitions, used by audits and the demo timeline; a
  **subscriber** (:meth:`GuardedMachine.subscribe`) gets every transition as it is taken, so a
  run's whole record can be streamed to disk (``rollsafe.observe.stream``) while the memory
  stays bounded.

It uses python-statemachine's public seams only: ``send`` (under one lock), the
``after_transition`` listener callback (the history), ``validators=`` (missing guard inputs),
``enabled_events`` (``can``), ``current_state_value`` / ``is_terminated`` (model checking's
``restore_state``).

Machines here import nothing heavier than python-statemachine: guards read plain data that the
fleet passes in (event keyword arguments) or recorded with ``report_*`` methods.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from statemachine import StateMachine
from statemachine.exceptions import TransitionNotAllowed

from rollsafe.errors import RollsafeError
from rollsafe.statemachines.events import AnyEvent, event_name

__all__ = [
    "GuardInputMissing",
    "GuardedMachine",
    "MachineTerminated",
    "MissingGuardInput",
    "TransitionRecord",
    "TransitionRefused",
    "TransitionSubscriber",
    "event_names",
    "summarize",
]

_MAX_ITEMS_KEPT = 16

log = logging.getLogger(__name__)

#: what :meth:`GuardedMachine.subscribe` calls with each transition
TransitionSubscriber = Callable[["TransitionRecord"], None]


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
    """Raised by a validator when an input an event needs (``current_version=``...) is absent.

    The machine turns it into :class:`MissingGuardInput`, a refusal; ``can()`` answers False and
    ``explain()`` returns its message.
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
    """Base for rollsafe's machines: strict, thread-safe, audited, on public seams only.

    Subclasses define states, events, named guard methods (``cond=``) and, for events that need
    an input, validators (``validators=``) that raise :class:`GuardInputMissing` when it is
    absent; they may override :meth:`facts_token` / :meth:`facts_from_token` to add model data
    (per-member facts, lease counts) to each history record.

    Events are sent as ``machine.send(GroupEvent.CLAIM, **kw)`` (a constant from
    :mod:`rollsafe.statemachines.events`), ``machine.send("claim", **kw)`` or
    ``machine.claim(**kw)``; all three go through :meth:`send`, which holds the machine's lock
    for the whole event, so events sent from several threads run one at a time, each in its
    caller's thread (every caller gets its own result or refusal). The history is kept by the
    ``after_transition`` callback python-statemachine calls on every listener, the machine
    itself first.
    """

    #: how many transitions :attr:`history` keeps (the oldest go first); a subclass or a test
    #: may set another bound (read when a machine is built). A run's whole record is streamed
    #: by a subscriber instead (:meth:`subscribe`)
    history_limit: ClassVar[int] = 256

    def __init__(self, *, start_value: str | None = None) -> None:
        self._lock = threading.RLock()
        self._history: deque[tuple[Any, ...]] = deque(maxlen=self.history_limit)
        self._subscribers: tuple[TransitionSubscriber, ...] = ()
        self._seq = 0
        self._last_trigger: tuple[str, Mapping[str, Any]] = ("", {})
        super().__init__(start_value=start_value)
        # Calling an event as a method (``machine.claim()``) goes through send() as well.
        for name in event_names(type(self)):
            object.__setattr__(self, name, _SerializedEvent(self, getattr(type(self), name)))

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

    def subscribe(self, subscriber: TransitionSubscriber) -> int:
        """Call ``subscriber`` with every transition still in :attr:`history` (oldest first),
        then with each new one as it is taken (in the sending thread, under the machine's lock,
        so in ``seq`` order and never twice). Returns the ``seq`` of the first record it got
        then: 1 when the history was whole, more when older ones had already left the ring
        buffer (0: none taken yet). An exception in ``subscriber`` is logged and ignored: it
        never changes the machine. Adding the same subscriber twice does nothing (and returns 0)."""
        with self._lock:
            if any(s == subscriber for s in self._subscribers):
                return 0
            raw = tuple(self._history)
            label = self.label
            for entry in raw:
                self._notify(subscriber, _record(label, entry, self.facts_from_token))
            self._subscribers = (*self._subscribers, subscriber)
            return int(raw[0][0]) if raw else 0

    def unsubscribe(self, subscriber: TransitionSubscriber) -> None:
        """Stop calling ``subscriber`` (no error if it was not subscribed)."""
        with self._lock:
            self._subscribers = tuple(s for s in self._subscribers if s != subscriber)

    def _notify(self, subscriber: TransitionSubscriber, record: TransitionRecord) -> None:
        try:
            subscriber(record)
        except Exception:
            log.exception("%s: a transition subscriber failed (ignored)", self.label)

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

    def send(self, event: AnyEvent | str, *args: Any, **kwargs: Any) -> Any:
        """Send ``event`` (a constant of :mod:`~rollsafe.statemachines.events` or its name).

        Raises :class:`TransitionRefused` (nothing changed) when the event is not allowed here
        or a guard blocks it, :class:`MissingGuardInput` when a needed input was not passed.
        """
        name = event_name(event)
        with self._lock:
            self._last_trigger = (name, kwargs)
            state = self.state
            try:
                return super().send(name, *args, **kwargs)
            except TransitionRefused:
                raise
            except GuardInputMissing as missing:
                text = str(missing)
                raise MissingGuardInput(
                    TransitionNotAllowed(None, self.configuration),
                    self.label,
                    state,
                    name,
                    lambda: [text],
                ) from None
            except TransitionNotAllowed as exc:
                terminated = self.is_terminated

                def reasons() -> list[str]:
                    if terminated:
                        return [f"{state!r} is a final state"]
                    return self._refusal_reasons(name, kwargs, state)

                raise TransitionRefused(exc, self.label, state, name, reasons) from None

    def can(self, event: AnyEvent | str, **kwargs: Any) -> bool:
        """Whether ``event`` would be taken now with these inputs (nothing changes)."""
        name = event_name(event)
        with self._lock:
            if self._missing_input(name, kwargs) is not None:
                return False  # sending it would raise MissingGuardInput, a refusal
            return any(e.id == name for e in self.enabled_events(**kwargs))

    def explain(self, event: AnyEvent | str, **kwargs: Any) -> list[str]:
        """Why ``event`` would be refused now (empty if it would be taken)."""
        with self._lock:
            return self._refusal_reasons(event_name(event), kwargs)

    def restore_state(self, state_id: str) -> None:
        """Put the machine into ``state_id`` directly, bypassing guards, actions and history.

        For model checking and benchmarks only; never used by the fleet. A machine that reached
        a final state by a transition has terminated and cannot be restored: build a new one
        (:class:`MachineTerminated`).
        """
        with self._lock:
            state = type(self).states_map[state_id]
            if self.is_terminated and not state.final:
                raise MachineTerminated(
                    f"{self.label} terminated in {self.state!r}; build a new machine instead of "
                    f"restoring it to {state_id!r}"
                )
            self.current_state_value = state_id

    def revive(self, state_id: str) -> None:
        """Put a machine that terminated (it reached a final state by a transition) back into
        ``state_id``, as :meth:`restore_state` does for a live one: the model checker reuses
        its machines (building one costs milliseconds, and a removal's ``retire`` ends one in
        every branch that takes it). Nothing of the machine changed when it terminated but its
        engine's running flag (python-statemachine stops the engine at a top-level final
        state), which is set again here. For model checking only; never used by the fleet."""
        with self._lock:
            self._engine.running = True
            self.current_state_value = type(self).states_map[state_id].id

    def state_ids(self) -> list[str]:
        """All state ids of this machine, in definition order."""
        return [s.id for s in type(self).states]

    # ------------------------------------------------------------------ internals
    def after_transition(self, source: Any, target: Any) -> None:
        """python-statemachine's ``after_transition`` callback (the machine is its own first
        listener): append the transition to the history. ``send`` holds the lock."""
        self._seq += 1
        event, kwargs = self._last_trigger
        entry = (self._seq, event, source.id, target.id, time.time(), kwargs, self.facts_token())
        self._history.append(entry)
        if self._subscribers:
            record = _record(self.label, entry, self.facts_from_token)
            for subscriber in self._subscribers:
                self._notify(subscriber, record)

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

    def _missing_input(self, event: str, kwargs: Mapping[str, Any]) -> str | None:
        """The message of the first validator of ``event`` that finds an input missing."""
        for state in self.configuration:
            for transition in state.transitions:
                if not transition.match(event):
                    continue
                for name in _validator_names(transition):
                    try:
                        self._guard(name, kwargs)
                    except GuardInputMissing as missing:
                        return str(missing)
        return None

    def _guard(self, name: str, kwargs: Mapping[str, Any]) -> bool:
        method = getattr(self, name)
        code = method.__code__
        accepted = code.co_varnames[1 : code.co_argcount + code.co_kwonlyargcount]
        return bool(method(**{k: v for k, v in kwargs.items() if k in accepted}))

    def _refusal_reasons(
        self, event: str, kwargs: Mapping[str, Any], state: str | None = None
    ) -> list[str]:
        state = state or self.state
        known = sorted(event_names(type(self)))
        if event not in known:
            return [f"unknown event {event!r}; events are {known}"]
        missing = self._missing_input(event, kwargs)
        if missing is not None:
            return [missing]
        reasons: list[str] = []
        facts = {**{k: summarize(v) for k, v in kwargs.items()}, **self.guard_facts()}
        any_candidate = False
        for transition, ok, failed in list(self._candidates(event, kwargs)):
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


class MachineTerminated(RollsafeError, RuntimeError):
    """:meth:`GuardedMachine.restore_state` was asked to revive a machine in a final state."""


class _SerializedEvent:
    """``machine.claim(**kw)``: the event called as a method, routed through ``send``."""

    __slots__ = ("delay", "id", "internal", "machine", "name")

    def __init__(self, machine: GuardedMachine, event: Any) -> None:
        self.machine = machine
        self.id = str(event.id)
        self.name = event.name
        self.delay = event.delay
        self.internal = event.internal

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.machine.send(self.id, *args, **kwargs)

    def __str__(self) -> str:
        return self.id

    def __repr__(self) -> str:
        return f"<event {self.id!r} of {self.machine.label}>"


def event_names(cls: type[StateMachine]) -> list[str]:
    """Every event name of a machine class, in definition order (from its public structure)."""
    names: dict[str, None] = {}
    for state in cls.states:
        for transition in state.transitions:
            for event in transition.events:
                names[str(event)] = None
    return list(names)


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


def _validator_names(transition: Any) -> list[str]:
    """The named validator methods on a transition (``validators=`` entries), in order."""
    return [str(spec) for spec in transition.validators]

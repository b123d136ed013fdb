"""A recorded run replayed through the verifier's model (``rollsafe verify --trace RUN_DIR``).

``rollsafe verify`` proves properties of :class:`~rollsafe.verify.model.FleetModel`; this
module checks that a real run *is* a run of that model. A recorded run (the ``stream.jsonl`` a
fleet with ``FleetConfig.run_dir`` appends to as it runs, :mod:`rollsafe.observe.stream`, or
the ``timeline.jsonl`` written by :meth:`RolloutFleet.record
<rollsafe.fleet.fleet.RolloutFleet.record>`, the demo and the tests) holds every transition of
every machine the fleet owns (groups, exports, the transport's registration, the
immediate-recovery mode), each group event with the policy
function that decided it (``inputs.decided_by``), and the outcome-bearing steps (each sync's
version and per-group results, each recovery's steps). :func:`replay_run` builds the model the
run's ``run`` row describes (its groups and ranks, initial version, settings: see
:func:`model_config_of`) and steps it:

1. the model starts as the fleet did: the start checkpoint is the ready export of the initial
   version (the run's first export transition, ``adopt``, is replayed by the model's start);
2. the earliest recorded transition not replayed yet is the **anchor**; from its machine, event
   and ``decided_by`` the replay derives the model actions that could have sent it (a probe,
   a request-health ``fail`` answered as a probe that timed out, a sync with the recorded
   version, registration and per-group results (and a recovering group whose restart ended
   while its update ran), a recovery's claim, restart or push with the
   recorded outcome, a node loss with the groups it took, a placement, a removal, the
   exporter's writer, retention), each with the silent steps the run cannot show (the ranks
   coming up, a node dying, a timed-out restart ending in the background);
3. each candidate runs on the model (the real machines, guards, policy, operations and
   registry handlers, as in ``rollsafe verify``); it is **allowed** when every transition the
   model takes is the next recorded transition of that machine (machines are ordered on their
   own; transitions of different machines may interleave as the fleet's threads did) and the
   anchor is among them; otherwise the model is restored and the next candidate tried;
4. every invariant of :mod:`rollsafe.invariants` is checked in every state reached;
5. at the end the model's groups and version must be the run's last ones.

The first recorded transition no candidate allows (or a broken invariant) is a
:class:`Divergence`: the step, the recorded event and what the model expected or allowed
there.

A record must hold the whole run. The machines keep only their last ``history_limit``
transitions in memory (the coordinators their last syncs and recoveries), so a record written
from memory after a long run is cut: its ``run`` row's ``cut`` says what left (or, in an older
record, a machine's transitions do not start at its first), and the replay refuses it with
:class:`TruncatedTraceError` instead of diverging at its first step. A streamed run is whole
however long; one the fleet never closed (a crash) ends early: its prefix is replayed and
:attr:`ReplayResult.partial` says so.

What a replay does not see (the model abstracts it or the run does not record it): member
health reports and failure counts (a recorded probe ``fail`` is the probe that reached the
fleet's threshold: the replayed model's threshold is 1), requests and routing, the delta bases
(the model keeps its own, unchecked against the run), leases (the model takes and releases
them as its policy decides; they shape which retention steps it allows), the bytes of a moved
export's pull (the model takes the recorded pull's outcome: moved and checked, or failed), and
the hooks a sync runs (always succeed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import rollsafe.policy as policy
from rollsafe.errors import RollsafeError
from rollsafe.statemachines import (
    CheckpointRegistration,
    ExportLifecycle,
    GuardedMachine,
    ImmediateRecoveryMode,
    WorkerGroupLifecycle,
)
from rollsafe.verify.model import Action, FleetModel, ModelConfig

__all__ = [
    "TRANSITION_KINDS",
    "Divergence",
    "RecordedTransition",
    "ReplayResult",
    "ReplayStep",
    "TraceError",
    "TruncatedTraceError",
    "model_config_of",
    "model_facts",
    "replay_run",
    "rows_of_model_run",
]

#: the recorded rows that are machine transitions
TRANSITION_KINDS = ("group", "export", "registration", "mode")
#: a node's loss takes all its groups in one registry step: their rows lie this close
_TOGETHER_S = 1.0
#: how close a recovery's timed-out step ends to the ``restart_failed`` it caused
_STEP_SLACK_S = 2.0
#: a divergence's context: recorded transitions before and after the one the model refused
_CONTEXT_BEFORE, _CONTEXT_AFTER = 12, 8
_TIMED_OUT = "did not finish within its deadline"
_RESTART_STEPS = ("launcher", "shutdown", "restart", "health")
#: how far a sync's registration transitions reach: its register (2), then an update pair per
#: payload (a delta per base, the full push, a refused delta's full push again)
_SYNC_REGISTRATION_STEPS = 12

Key = tuple[str, str]
#: a transition the model took: its machine, event, source, target and the inputs a recording
#: keeps of it (``decided_by``, a register's ``version``, an update's ``targets`` and
#: ``results``)
Emitted = tuple[Key, str, str, str, dict[str, Any]]
_KEPT_INPUTS = ("decided_by", "version", "targets", "results")


class TraceError(RollsafeError, ValueError):
    """A recorded run the replay cannot map onto the model: no ``model`` facts in its ``run``
    row (recorded before ``rollsafe verify --trace`` existed), a group or machine it does not
    know, or a machine whose history was cut (``line`` names the row when there is one)."""

    def __init__(self, message: str, line: int | None = None) -> None:
        self.line = line
        super().__init__(f"line {line}: {message}" if line is not None else message)


class TruncatedTraceError(TraceError):
    """The record is knowingly cut: written from the fleet's memory at the end of a run longer
    than memory keeps (its ``run`` row's ``cut`` names what left it), or a machine's recorded
    transitions do not start at its first (an older record written from memory). The replay
    needs every transition: stream the run (``FleetConfig.run_dir``) and replay its run
    directory. ``cut`` lists what is missing."""

    def __init__(self, message: str, cut: Sequence[str], line: int | None = None) -> None:
        self.cut = tuple(cut)
        super().__init__(message, line)


@dataclass(frozen=True)
class RecordedTransition:
    """One recorded machine transition, with its line in ``timeline.jsonl`` (1-based)."""

    line: int
    kind: str
    subject: str  # as recorded (the fleet's group id, ``v3``, the transport's name)
    key: Key  # the model's machine: ("group", "g0"), ("export", "v3"), ("registration", "")
    event: str
    source: str
    target: str
    t: float
    timestamp: float
    seq: int
    inputs: Mapping[str, Any] = field(default_factory=dict)
    index: int = 0  # its place among the recorded transitions (time order)

    @property
    def decided_by(self) -> str | None:
        by = self.inputs.get("decided_by")
        return str(by) if by is not None else None

    def __str__(self) -> str:
        by = f" (decided by {self.decided_by})" if self.decided_by else ""
        return (
            f"line {self.line}, t={self.t:.3f} s: {self.kind} {self.subject} {self.event} "
            f"{self.source} -> {self.target}{by}"
        )


@dataclass(frozen=True)
class ReplayStep:
    """One replayed step: the model actions taken and the recorded transitions they took."""

    number: int
    actions: tuple[Action, ...]
    consumed: tuple[RecordedTransition, ...]


@dataclass(frozen=True)
class Divergence:
    """Where the run left the model: at step ``step``, the recorded transition ``recorded``
    (None: at the end) no model action allows (``expected``: what each candidate would have
    done), or a state that breaks ``violations``."""

    step: int
    recorded: RecordedTransition | None
    what: str
    expected: tuple[str, ...] = ()
    violations: tuple[str, ...] = ()
    #: what the run recorded around ``recorded`` (its transitions just before and after, the
    #: syncs and recoveries that span them): a CI log's only view of the run
    context: tuple[str, ...] = ()

    def format(self) -> str:
        lines = [f"divergence at step {self.step}: {self.what}"]
        if self.recorded is not None:
            lines.append(f"  recorded: {self.recorded}")
        lines += [f"  model: {e}" for e in self.expected]
        lines += [f"  violated: {v}" for v in self.violations]
        if self.context:
            lines.append("  the run around it (>: this transition, +: replayed already):")
            lines += [f"    {c}" for c in self.context]
        return "\n".join(lines)


@dataclass
class ReplayResult:
    """What a replay saw."""

    config: ModelConfig
    transitions: int  # recorded machine transitions in the run
    steps: list[ReplayStep] = field(default_factory=list)
    replayed: int = 0  # recorded transitions the model took
    states_checked: int = 0
    divergence: Divergence | None = None
    #: why the record ends before the run did (a streamed run the fleet never closed: its
    #: prefix is replayed, the run's end not checked); None: the record holds the whole run
    partial: str | None = None

    @property
    def ok(self) -> bool:
        return self.divergence is None

    def summary(self) -> str:
        verdict = "0 divergences" if self.ok else "1 divergence"
        after = max(len(self.steps) - 1, 0)  # step 0 is the model's start
        said = (
            f"replayed {self.replayed} of {self.transitions} recorded transitions: the start "
            f"and {after} model steps, every invariant checked in {self.states_checked} "
            f"states: {verdict}"
        )
        if self.partial is not None:
            said += (
                f"\npartial replay: the record ends before the run did ({self.partial}); the "
                "prefix it holds was replayed and the run's end was not checked"
            )
        return said


# ====================================================================== the run's model
def model_config_of(facts: Mapping[str, Any]) -> ModelConfig:
    """The :class:`ModelConfig` of a recorded fleet (the ``run`` row's ``model``): its groups'
    rank counts (its spares, ``spare_groups``, are the last groups), initial version, restart
    budget, re-arm count, immediate recovery, update failure setting's engine semantics (a
    failed update keeps the weights: ``reference``, else ``vllm``), deltas, targeted push and
    the exporter's ``keep_last``. The probe threshold is
    1: a recorded ``fail`` is the probe that reached the fleet's threshold."""
    try:
        groups = [len(g["ranks"]) for g in facts["groups"]]
        spares = int(facts.get("spare_groups") or 0)  # the last groups recorded
        serving = groups[: len(groups) - spares]
        return ModelConfig(
            groups=len(serving),
            ranks=max(serving),
            group_ranks=tuple(serving),
            spares=spares,
            restart_budget=int(facts["restart_budget"]),
            rearm_after=int(facts["rearm_after"]),
            keep_last=int(facts.get("keep_last") or 2),
            failure_threshold=1,
            engine="reference" if facts["failed_update_keeps_weights"] else "vllm",
            node_loss=True,
            removals=len(groups),
            deltas=bool(facts["deltas"]),
            initial_version=int(facts["initial_version"]),
            immediate_recovery=bool(facts["immediate_recovery"]),
            targeted_push=bool(facts["targeted_push"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise TraceError(f"the run row's model facts are incomplete: {exc!r}", 1) from None


def _tapped(base: type[GuardedMachine], log: list[Emitted], key: Callable[[Any], Key]) -> Any:
    """A subclass of machine class ``base`` that appends each transition it takes to ``log``."""

    class Tapped(base):  # type: ignore[valid-type, misc]
        def after_transition(self, source: Any, target: Any) -> None:
            super().after_transition(source, target)
            event, kwargs = self._last_trigger
            kept = {k: kwargs[k] for k in _KEPT_INPUTS if k in kwargs}
            log.append((key(self), event, source.id, target.id, kept))

    Tapped.__name__ = Tapped.__qualname__ = base.__name__
    return Tapped


# ====================================================================== the recorded run
class _Trace:
    """The recorded transitions, in file (time) order and per machine (seq order)."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], group_ids: Mapping[str, str]) -> None:
        self.items: list[RecordedTransition] = []
        self.queues: dict[Key, list[int]] = {}
        for line, row in enumerate(rows, 1):
            kind = row.get("kind")
            if kind not in TRANSITION_KINDS:
                continue
            subject = str(row.get("subject"))
            if kind == "group":
                if subject not in group_ids:
                    raise TraceError(f"group {subject!r} is not in the run row's groups", line)
                key: Key = ("group", group_ids[subject])
            elif kind == "export":
                key = ("export", subject)
            else:
                key = (str(kind), "")
            inputs = row.get("inputs")
            item = RecordedTransition(
                line,
                str(kind),
                subject,
                key,
                str(row["event"]),
                str(row["source"]),
                str(row["target"]),
                float(row.get("t", 0.0)),
                float(row["timestamp"]),
                int(row.get("seq", 0)),
                dict(inputs) if isinstance(inputs, Mapping) else {},
                len(self.items),
            )
            self.queues.setdefault(key, []).append(len(self.items))
            self.items.append(item)
        for queue in self.queues.values():
            queue.sort(key=lambda i: self.items[i].seq)
            seqs = [self.items[i].seq for i in queue]
            if seqs != list(range(1, len(seqs) + 1)):
                first = self.items[queue[0]]
                raise TruncatedTraceError(
                    f"{first.kind} {first.subject}: its recorded transitions are numbered "
                    f"{seqs[:6]}{'...' if len(seqs) > 6 else ''}, not 1, 2, 3...: the "
                    "machine's history was cut (memory keeps its last "
                    f"{GuardedMachine.history_limit} transitions: a record written from memory "
                    "after a long run) or rows are missing; the replay needs every transition: "
                    "stream the run (FleetConfig.run_dir) and replay its run directory",
                    [f"{first.kind} {first.subject}: starts at transition {seqs[0]}"],
                    first.line,
                )
        self.ptr: dict[Key, int] = dict.fromkeys(self.queues, 0)
        self.done = [False] * len(self.items)
        self._next = 0

    def head(self, key: Key, ptr: Mapping[Key, int] | None = None) -> RecordedTransition | None:
        queue = self.queues.get(key, [])
        at = (ptr if ptr is not None else self.ptr).get(key, 0)
        return self.items[queue[at]] if at < len(queue) else None

    def anchor(self) -> RecordedTransition | None:
        while self._next < len(self.items) and self.done[self._next]:
            self._next += 1
        return self.items[self._next] if self._next < len(self.items) else None

    def following(self, key: Key, n: int) -> list[RecordedTransition]:
        """The next ``n`` transitions of machine ``key`` not replayed yet."""
        queue, at = self.queues.get(key, []), self.ptr.get(key, 0)
        return [self.items[i] for i in queue[at : at + n]]

    def match(
        self, emitted: Sequence[Emitted], anchor: RecordedTransition
    ) -> tuple[list[int] | None, str, int]:
        """The recorded transitions ``emitted`` takes, in order (None, why: not allowed), and
        how many it steps around: transitions of the machines it touches, recorded before its
        last one, left for a later step (the fleet's threads interleave: a recovery claims a
        group a sync just failed before that sync starts its export; the fewer, the likelier
        the step)."""
        ptr = dict(self.ptr)
        taken: list[int] = []
        for key, event, source, target, _inputs in emitted:
            head = self.head(key, ptr)
            shown = f"{_key_name(key)} {event} {source} -> {target}"
            if head is None:
                return None, f"takes {shown}, but the run has no more transitions of it", 0
            if (head.event, head.source, head.target) != (event, source, target):
                return None, f"takes {shown}, but the run's next one there is {head}", 0
            taken.append(self.queues[key][ptr[key]])
            ptr[key] += 1
        if not taken:
            return None, "changes nothing (refused, or nothing to do)", 0
        if anchor.index not in taken:
            return (
                None,
                "takes "
                + ", ".join(f"{_key_name(e[0])} {e[1]}" for e in emitted)
                + f", but not the recorded {anchor.kind} {anchor.subject} {anchor.event}",
                0,
            )
        last, chosen = max(taken), set(taken)
        around = sum(
            1
            for key in {self.items[i].key for i in taken}
            for i in self.queues[key]
            if i < last and not self.done[i] and i not in chosen
        )
        return taken, "", around

    def consume(self, taken: Iterable[int]) -> None:
        for i in taken:
            self.done[i] = True
            self.ptr[self.items[i].key] += 1


def _key_name(key: Key) -> str:
    return f"{key[0]} {key[1]}".strip()


# ====================================================================== the replay
class _Replayer:
    def __init__(self, rows: Sequence[Mapping[str, Any]], partial: str | None) -> None:
        header = rows[0] if rows and rows[0].get("kind") == "run" else None
        facts = header.get("model") if header is not None else None
        if not isinstance(facts, Mapping):
            raise TraceError(
                "the run row has no 'model' facts (recorded before rollsafe verify --trace "
                "existed, or not by RolloutFleet.record): record the run again",
                1 if header is not None else None,
            )
        assert header is not None
        cut = header.get("cut")
        if isinstance(cut, list) and cut:
            lost = "; ".join(map(str, cut))
            raise TruncatedTraceError(
                "the record is cut: it was written from the fleet's memory, which keeps only "
                f"the last transitions, syncs and recoveries, after a longer run ({lost}); "
                "the replay needs every transition: stream the run (FleetConfig.run_dir) and "
                "replay its run directory",
                [str(c) for c in cut],
                1,
            )
        self.config = model_config_of(facts)
        self.recorded_ids = [str(g["id"]) for g in facts["groups"]]
        self.recorded_ranks = [tuple(int(r) for r in g["ranks"]) for g in facts["groups"]]
        self.group_ids = {gid: f"g{i}" for i, gid in enumerate(self.recorded_ids)}
        self.trace = _Trace(rows, self.group_ids)
        self.syncs = sorted(
            (r for r in rows if r.get("kind") == "sync"), key=lambda r: float(r["timestamp"])
        )
        self._syncs_used: set[int] = set()  # sync rows a replayed sync took (in order)
        self._sync_row: int | None = None  # the row the current sync candidate reads
        self.recoveries = [r for r in rows if r.get("kind") == "recovery"]
        self.end = next((r for r in rows if r.get("kind") == "end"), None)
        self.on_failure = str(facts.get("on_update_failure", "fail"))
        self.log: list[Emitted] = []
        self.model = _tapped_model(self.config, self.log)
        if partial is None and self.end is None:
            partial = "it has no 'end' row: the fleet did not close it"
        self.result = ReplayResult(self.config, len(self.trace.items), partial=partial)

    # ------------------------------------------------------------------ the loop
    def run(self) -> ReplayResult:
        result, trace = self.result, self.trace
        if not self._start():
            return result
        self._check(None)
        while result.divergence is None:
            anchor = trace.anchor()
            if anchor is None:
                break
            tried: list[str] = []
            # the allowed candidate that steps around the fewest recorded transitions, and of
            # those the one that takes the most (a failed push that leaves no group event is
            # not the push whose group's ``weights_loaded`` follows)
            best: tuple[tuple[int, int], tuple[Action, ...], int | None] | None = None
            for actions in self._candidates(anchor):
                taken, why, around = self._try(actions, anchor, keep=False)
                if taken is None:
                    tried.append(f"{_actions(actions)}: {why}")
                elif best is None or (around, -len(taken)) < best[0]:
                    best = ((around, -len(taken)), actions, self._sync_row)
            if best is None:
                result.divergence = Divergence(
                    len(result.steps) + 1,
                    anchor,
                    "no action of the model takes the recorded transition",
                    (*tried, *self._where(anchor)),
                    context=self._context(anchor),
                )
                break
            _rank, actions, sync_row = best
            taken, _why, _around = self._try(actions, anchor, keep=True)
            assert taken is not None  # the model is deterministic: allowed again
            if any(a.name == "sync" for a in actions) and sync_row is not None:
                self._syncs_used.add(sync_row)
            trace.consume(taken)
            consumed = tuple(trace.items[i] for i in taken)
            result.steps.append(ReplayStep(len(result.steps) + 1, actions, consumed))
            result.replayed += len(taken)
            self._check(anchor)
        if result.divergence is None:
            self._check_end()
        return result

    def _start(self) -> bool:
        """The model's start: the start checkpoint is the ready export of the initial version
        (``adopt``); the run's first transition of that export must say the same."""
        version = self.config.initial_version
        key: Key = ("export", f"v{version}")
        head = self.trace.head(key)
        if head is None or (head.event, head.source, head.target) != (
            "adopt",
            "requested",
            "ready",
        ):
            self.result.divergence = Divergence(
                0,
                head,
                f"the model starts with the start checkpoint adopted as the ready export of "
                f"v{version}; the run recorded {'no transition of it' if head is None else head}",
            )
            return False
        index = self.trace.queues[key][0]
        self.trace.consume([index])
        self.result.replayed += 1
        self.result.steps.append(ReplayStep(0, (), (head,)))
        return True

    def _try(
        self, actions: tuple[Action, ...], anchor: RecordedTransition, *, keep: bool
    ) -> tuple[list[int] | None, str, int]:
        """Run ``actions`` on the model and match what it took; the model is restored unless
        ``keep`` and allowed."""
        model = self.model
        before = model.snapshot()
        self.log.clear()
        for action in actions:
            model.apply(action)
        taken, why, around = self.trace.match(list(self.log), anchor)
        if taken is None or not keep:
            model.restore(before)
        return taken, why, around

    def _check(self, anchor: RecordedTransition | None) -> None:
        self.result.states_checked += 1
        broken = self.model.check()
        if broken:
            self.result.divergence = Divergence(
                max(len(self.result.steps), 1) if anchor is not None else 0,
                anchor,
                "the replayed state breaks an invariant of rollsafe.invariants",
                violations=tuple(str(v) for v in broken),
                context=self._context(anchor) if anchor is not None else (),
            )

    def _check_end(self) -> None:
        end, model = self.end, self.model
        if end is None:
            return
        expected: list[str] = []
        states = end.get("groups") or {}
        for gid, state in states.items():
            mine = self.group_ids.get(gid)
            if mine is None:
                continue
            got = model.groups[int(mine[1:])].state
            if got != state:
                expected.append(f"group {gid} ends {state} in the run, {got} in the model")
        version = end.get("fleet_version")
        if isinstance(version, int) and version != model.version:
            expected.append(f"the run ends at v{version}, the model at v{model.version}")
        if expected:
            self.result.divergence = Divergence(
                len(self.result.steps) + 1,
                None,
                "the run's end is not the model's",
                tuple(expected),
            )

    # ------------------------------------------------------------------ what could send it
    def _candidates(self, anchor: RecordedTransition) -> Iterator[tuple[Action, ...]]:
        seen: set[tuple[Action, ...]] = set()
        for actions in self._raw_candidates(anchor):
            if actions and actions not in seen:
                seen.add(actions)
                yield actions

    def _raw_candidates(self, a: RecordedTransition) -> Iterator[tuple[Action, ...]]:
        if a.kind == "group":
            yield from self._group_candidates(a)
        elif a.kind == "registration":
            if a.event == "begin_register":
                yield from self._sync()
            yield from self._pushes(a)
        elif a.kind == "mode":
            yield from self._sync(a)
        elif a.kind == "export":
            version = int(a.subject.removeprefix("v"))
            if a.event in ("shards_written", "publish"):
                yield (Action("export_step", (version, a.event)),)
            elif a.event == "fail":
                yield (Action("export_fail"),)
            elif a.event in ("supersede", "delete"):
                yield (Action("retention"),)
                yield (*self._late_ends(), Action("retention"))
            else:  # snapshot, snapshot_done (a sync starts the export), abandon (judged late)
                yield from self._sync(a)

    def _group_candidates(self, a: RecordedTransition) -> Iterator[tuple[Action, ...]]:
        model = self.model
        g = int(a.key[1][1:])
        by, ev = a.decided_by, a.event
        if ev == "launched":
            alive = model.truth[g]
            yield tuple(Action("launch", (g, r)) for r, (up, _) in enumerate(alive) if not up)
        elif ev == "fail":
            if by in (None, "settle_update"):
                yield from self._sync()
            if by in (None, "after_push"):
                yield (Action("push", (g, False)),)
            if by in (None, "judge_probe", "judge_request_failures"):
                if any(not up for up, _ in model.truth[g]):
                    yield (Action("probe", (g,)),)
                yield (Action("probe_timeout", (g,)),)
        elif ev == "claim" or (ev == "retire" and by in (None, "gate_recovery")):
            yield (*self._late_end(g), Action("recover", self._lease_args(g, a)))
            writer = self._writer_before_lease(g, a)
            if writer:
                yield (*self._late_end(g), *writer, Action("recover", self._lease_args(g, a)))
        elif ev == "node_lost" and by == "gate_recovery":
            yield (*self._late_end(g), Action("node_dies", ((g,),)), Action("recover", (g,)))
        elif ev in ("node_lost", "retire") and by in (None, "on_node_lost"):
            yield (Action("node_dies", (self._lost_together(a),)), Action("node_lost"))
        elif ev == "placed":
            yield (*self._late_end(g), Action("place", self._lease_args(g, a)))
            writer = self._writer_before_lease(g, a)
            if writer:
                yield (*self._late_end(g), *writer, Action("place", self._lease_args(g, a)))
        elif ev == "restarted":
            yield (Action("restart", (g, True)),)
        elif ev == "restart_failed":
            timed_out = self._timed_out(a)
            first, second = Action("restart_timeout", (g,)), Action("restart", (g, False))
            yield from ((first,), (second,)) if timed_out else ((second,), (first,))
        elif ev == "weights_loaded":
            if by in (None, "after_push"):
                yield (Action("push", (g, True)),)
            if by in (None, "settle_update"):
                yield from self._sync()
        elif ev == "mark_stale":
            yield from self._sync()
        elif ev == "promote" or (ev == "fail" and by == "judge_spare"):
            # a cover: of the serving group the same step enlists, or of one out of routing
            yield from self._covers()
        elif ev == "enlist":
            yield (Action("cover", (g,)),)
        elif ev == "drain":
            yield (Action("remove", (g,)),)
        elif ev == "retire" and by == "after_drain":
            yield (Action("finish_removal", (g,)),)

    def _covers(self) -> Iterator[tuple[Action, ...]]:
        """A spare's cover of each serving group out of routing (the promotion's other half,
        the covered group's ``enlist``, names which; a spare failed by its version check does
        not)."""
        enlisted = [
            t
            for t in (self.trace.head(("group", f"g{g}")) for g in range(len(self.model.groups)))
            if t is not None and t.event == "enlist"
        ]
        for t in enlisted:
            yield (Action("cover", (int(t.key[1][1:]),)),)
        for g, group in enumerate(self.model.groups):
            if not group.spare and group.state in policy.COVERABLE:
                yield (Action("cover", (g,)),)

    def _sync(self, anchor: RecordedTransition | None = None) -> Iterator[tuple[Action, ...]]:
        """The sync whose register is the registration's next recorded transition, with its
        recorded version, register outcome and per-group update results; and first, at an
        export's judgement (``anchor``), the sync there whose register raised before it began
        (:meth:`_sync_unbegun`): the registration's next transition is then another's."""
        unbegun = self._sync_unbegun(anchor) if anchor is not None else None
        if unbegun is not None:  # the anchor is inside that sync: it is no other's
            yield unbegun
            return
        following: list[RecordedTransition | None] = [
            *self.trace.following(("registration", ""), 2),
            None,
            None,
        ]
        begin, then = following[:2]
        if begin is None or begin.event != "begin_register":
            return
        version = begin.inputs.get("version")
        if not isinstance(version, int):
            return
        everywhere = then is None or then.event != "register_failed"
        # the first sync row of that version not replayed yet (a sync whose register failed
        # leaves the fleet's version where it was: the next one registers it again)
        # (not a row whose register failed when this one's went through: a sync of the same
        # version whose register raised before it began, taken at its own judgement)
        index = next(
            (
                i
                for i, r in enumerate(self.syncs)
                if r.get("version") == version
                and i not in self._syncs_used
                and not (everywhere and _register_failed(r, version))
            ),
            None,
        )
        self._sync_row = index
        row = self.syncs[index] if index is not None else None
        failed = row.get("failed") if row is not None else None
        failing = tuple(
            (int(self.group_ids[gid][1:]), 0)
            for gid in (failed if isinstance(failed, list) else [])
            if gid in self.group_ids
        )
        hook = _failed_hook(row.get("error") if row is not None else None)
        not_smaller = _deltas_not_smaller(row)

        def sync(
            fails: tuple[tuple[int, int], ...] = failing, during: int | None = None
        ) -> tuple[Action]:
            args: tuple[Any, ...] = (everywhere, None, self.on_failure, version, fails)
            tail: list[Any] = [during, hook, not_smaller]
            while tail and (tail[-1] is None or tail[-1] is False):
                tail.pop()  # the model's defaults left out
            return (Action("sync", (*args, *tail)),)

        yield sync()
        # the previous export's writer moved on after this sync judged it late and before the
        # sync abandoned it (CI, test_chaos_exports: its ``shards_written`` in the judgement's
        # millisecond): the writer's steps first, then the sync, which judges the export where
        # the writer left it (``committing``: still late) and abandons it from there
        writer = self._writer_before_abandon()
        if writer:
            yield (*writer, *sync())
        # Groups that moved inside this sync before it read them, each taken first (they touch
        # nothing the register reads); ``moved`` keeps each with the time of its first
        # recorded transition, for the candidate that takes them all
        moved: list[tuple[float, tuple[Action, ...]]] = []
        # a serving group failed (its probes or its requests) and claimed inside this sync,
        # before the sync read the groups: the health thread's round in flight when the sync
        # paused it, while the sync's pause waited on the same hung engine (the hour's seed
        # 1635132711: a SIGSTOPped vLLM). The sync read it ``recovering`` and left it out; the
        # model takes the loss and the claim first
        for g in range(self.config.total_groups):
            claim = self._lost_before_read(g, begin)
            if claim is not None:
                probe = Action("probe_timeout", (g,))
                steps: tuple[Action, ...] = (probe, Action("recover", self._lease_args(g, claim)))
                moved.append((self._next_t(g), steps))
                yield (*steps, *sync())
        # a recovery's restart that ended there (into ``pending_weights``: the sync read the
        # group waiting for weights and updated it)
        for g in range(self.config.total_groups):
            head = self.trace.head(("group", f"g{g}"))
            if (
                head is not None
                and head.event == "restarted"
                and head.target == "pending_weights"
                and head.t >= begin.t
                and self._before_read(head)
            ):
                steps = (Action("restart", (g, True)),)
                moved.append((head.t, steps))
                yield (*steps, *sync())
        # likewise a node lost there (the hour's seed 1027985072: the sync's pause waited on
        # the engines of a node being removed): its groups ``node_lost``, then placed again
        placed = self._placed_before_read(begin)
        if placed:
            lost = tuple(sorted(placed))
            places = (Action("place", self._lease_args(g, placed[g])) for g in lost)
            steps = (Action("node_dies", (lost,)), Action("node_lost"), *places)
            moved.append((min(self._next_t(g) for g in lost), steps))
            yield (*steps, *sync())
        # all of them, as recorded: more than one in the same sync (the soak smoke, seed
        # 656784: a node's loss re-placed one group while the SIGSTOPped engine of the other
        # was failed by its probes and claimed, all while the sync's pause waited), or any
        # with a restart that ended or a loss inside the update (below)
        moved.sort(key=lambda m: m[0])
        before = tuple(a for _, steps in moved for a in steps)
        if len(moved) > 1:
            yield (*before, *sync())
        if hook in _HOOKS_BEFORE_UPDATE:  # a trainer-side exception before the update
            return  # nothing was updated: no restart or loss can have ended inside it
        # a recovering group whose restart ended while this sync's update ran (the model's
        # ``during``): its next recorded transition is ``restarted`` into ``active`` (a spare:
        # into ``standby``); or a
        # serving group lost while the update ran, failed by its probes, claimed and restarted
        # before the update ended: ``fail``, ``claim``, ``restarted`` into ``active`` next, and
        # its ranks' update failed (the update went to the engine it lost)
        for g in range(self.config.total_groups):
            head = self.trace.head(("group", f"g{g}"))
            inside: tuple[Action] | None = None
            if (
                head is not None
                and head.event == "restarted"
                and head.target in ("active", "standby")
            ):
                inside = sync(during=g)
            elif head is not None and head.event == "fail" and self._lost_in_update(g):
                inside = sync(tuple(sorted({*failing, (g, 0)})), g)
            if inside is not None:
                yield inside
                if before:
                    yield (*before, *inside)

    def _sync_unbegun(self, anchor: RecordedTransition) -> tuple[Action, ...] | None:
        """The sync whose register raised before the registration began (the trainer's tensors
        could not be read: a gather that failed part-way), when ``anchor`` (its export's
        judgement, its only transitions) lies inside it: its row says ``register of vN
        failed`` and spans ``anchor``'s time (syncs never overlap). The model's sync with
        ``registered_everywhere=None``; None when no such sync holds ``anchor``."""
        for i, row in enumerate(self.syncs):
            version = row.get("version")
            if i in self._syncs_used or not isinstance(version, int):
                continue
            if not _register_failed(row, version):
                continue
            start, seconds = float(row.get("t", -1.0)), float(row.get("seconds") or 0.0)
            if start <= anchor.t <= start + seconds + _CLOCK_SLACK_S:
                self._sync_row = i
                return (Action("sync", (None, None, self.on_failure, version, ())),)
        return None

    def _writer_before_abandon(self) -> tuple[Action, ...]:
        """The writer's steps (``export_step``) of an export whose next recorded transitions
        are ``shards_written`` and then ``abandon``; empty when none."""
        for key in self.trace.queues:
            if key[0] != "export":
                continue
            events = [t.event for t in self.trace.following(key, 2)]
            if events == ["shards_written", "abandon"]:
                return (Action("export_step", (int(key[1].removeprefix("v")), events[0])),)
        return ()

    def _writer_before_lease(self, g: int, a: RecordedTransition) -> tuple[Action, ...]:
        """The writer's steps (``export_step``) recorded after the claim or placement ``a`` of
        group ``g`` and before that attempt's ``lease`` step: the recovery's thread claims,
        then reads the strategy's facts and leases (:func:`rollsafe.operations.recover.
        take_lease`), and an export the writer published in between is the one it leased
        (the soak smoke, CI 2026-12-07, seed 489439: a loaded machine, the group failed by a
        sync's update, claimed while that sync's export was still being written). Empty when
        the attempt recorded no lease step or no writer step lies before it."""
        lease_at = self._lease_step_at(g, a)
        if lease_at is None:
            return ()
        steps: list[tuple[float, Action]] = []
        for key in self.trace.queues:
            if key[0] != "export":
                continue
            version = int(key[1].removeprefix("v"))
            for t in self.trace.following(key, 2):
                if t.event not in ("shards_written", "publish") or t.timestamp > lease_at:
                    break
                steps.append((t.timestamp, Action("export_step", (version, t.event))))
        return tuple(action for _, action in sorted(steps, key=lambda s: s[0]))

    def _lease_step_at(self, g: int, a: RecordedTransition) -> float | None:
        """When the attempt that began with ``a`` (group ``g``'s claim or placement) recorded
        its ``lease`` step (None: it recorded none)."""
        step = self._attempt_step(g, a, "lease", _CLOCK_SLACK_S)
        return float(step.get("started_at", 0.0)) if step is not None else None

    def _attempt_step(
        self, g: int, a: RecordedTransition, name: str, slack: float
    ) -> Mapping[str, Any] | None:
        """The step ``name`` of group ``g``'s recorded recoveries that began within ``slack``
        of the attempt that ``a`` (its claim or placement) began, before the group's next
        transition after ``a``; None: no such step."""
        gid = self.recorded_ids[g]
        after = self.trace.following(a.key, 2)
        until = after[1].timestamp if len(after) > 1 else float("inf")
        for rec in self.recoveries:
            if rec.get("group_id") != gid:
                continue
            for step in rec.get("steps") or ():
                if not isinstance(step, Mapping) or step.get("name") != name:
                    continue
                started = float(step.get("started_at", 0.0))
                if a.timestamp - slack <= started <= until + slack:
                    return step
        return None

    def _next_t(self, g: int) -> float:
        """The time of group ``g``'s next recorded transition (infinity: none left)."""
        head = self.trace.head(("group", f"g{g}"))
        return head.t if head is not None else float("inf")

    def _lost_before_read(self, g: int, begin: RecordedTransition) -> RecordedTransition | None:
        """The ``claim`` of serving group ``g`` when its next transitions are a ``fail`` (by
        its probes or its requests) and that ``claim``, both after this sync's
        ``begin_register`` and before its first update (or, when it updated nothing, before
        the next sync's register): the sync read the group after the claim."""
        steps = self.trace.following(("group", f"g{g}"), 2)
        if len(steps) < 2 or [(t.event, t.target) for t in steps] != [
            ("fail", "inactive"),
            ("claim", "recovering"),
        ]:
            return None
        if steps[0].decided_by not in (None, "judge_probe", "judge_request_failures"):
            return None
        if steps[0].t < begin.t:
            return None  # failed before the sync began: the model's usual order takes it
        return steps[1] if self._before_read(steps[1]) else None

    def _before_read(self, t: RecordedTransition) -> bool:
        """Whether ``t`` came before this sync's first update (or, when it updated nothing,
        before the next sync's register): before the sync read the groups."""
        later = self.trace.following(("registration", ""), _SYNC_REGISTRATION_STEPS)[1:]
        end = next((x for x in later if x.event in ("begin_update", "begin_register")), None)
        return end is None or t.t < end.t

    def _placed_before_read(self, begin: RecordedTransition) -> dict[int, RecordedTransition]:
        """The groups whose next transitions are ``node_lost`` (by ``on_node_lost``) and
        ``placed``, both inside this sync before it read the groups (as
        :meth:`_lost_before_read`), each with its ``placed``."""
        out: dict[int, RecordedTransition] = {}
        for g in range(self.config.total_groups):
            steps = self.trace.following(("group", f"g{g}"), 2)
            if len(steps) < 2 or [(t.event, t.target) for t in steps] != [
                ("node_lost", "unplaced"),
                ("placed", "recovering"),
            ]:
                continue
            if steps[0].decided_by not in (None, "on_node_lost") or steps[0].t < begin.t:
                continue
            if self._before_read(steps[1]):
                out[g] = steps[1]
        return out

    def _lost_in_update(self, g: int) -> bool:
        """Whether group ``g``'s next transitions are ``fail``, ``claim`` and ``restarted``
        into ``active``, all before the ``update_done`` of this sync that names ``g``'s ranks
        (one per payload: with deltas, a base's delta and the full push are two updates),
        which failed one of them."""
        steps = self.trace.following(("group", f"g{g}"), 3)
        if [(t.event, t.target) for t in steps if t is not None] != [
            ("fail", "inactive"),
            ("claim", "recovering"),
            ("restarted", "active"),
        ]:
            return False
        ranks = self.recorded_ranks[g]
        for t in self.trace.following(("registration", ""), _SYNC_REGISTRATION_STEPS)[1:]:
            if t.event == "begin_register":
                return False  # the next sync: none of this one's updates named g
            results = _rank_results(t.inputs.get("results")) if t.event == "update_done" else {}
            if any(rank in results for rank in ranks):
                return t.t >= steps[-1].t and any(not results[r] for r in ranks if r in results)
        return False

    def _pushes(self, a: RecordedTransition) -> Iterator[tuple[Action, ...]]:
        """A recovery's targeted push into a group waiting for weights (loaded, or failed):
        the group whose fleet ranks the update targeted, when it says (``inputs.targets``)."""
        targets = a.inputs.get("targets")
        named: set[int] | None = None
        if isinstance(targets, list) and all(isinstance(t, list) for t in targets):
            wanted = {tuple(t) for t in targets}
            named = {g for g, ranks in enumerate(self.recorded_ranks) if ranks in wanted}
        for g, group in enumerate(self.model.groups):
            if group.state == "pending_weights" and (named is None or g in named):
                yield (Action("push", (g, True)),)
                yield (Action("push", (g, False)),)

    def _late_end(self, g: int) -> tuple[Action, ...]:
        """A timed-out restart of ``g`` still running in the model ended first (the fleet
        starts no new attempt on the group before it has)."""
        return (Action("restart_ends", (g,)),) if g in self.model.late else ()

    def _late_ends(self) -> tuple[Action, ...]:
        return tuple(Action("restart_ends", (g,)) for g in sorted(self.model.late))

    def _lost_together(self, a: RecordedTransition) -> tuple[int, ...]:
        """The groups one node's loss took, in one registry step: the anchor's group and those
        whose ``node_lost`` (or a draining group's ``retire``) by ``on_node_lost`` follows it
        in the recording with no other transition of a group between (and within a second)."""
        lost: list[int] = []
        trace = self.trace
        for item in trace.items[a.index :]:
            if item.kind != "group" or trace.done[item.index]:
                continue
            together = (
                item.event in ("node_lost", "retire")
                and item.decided_by in (None, "on_node_lost")
                and abs(item.timestamp - a.timestamp) <= _TOGETHER_S
                and trace.head(item.key) is item
            )
            g = int(item.key[1][1:])
            if not together or g in lost:
                break
            lost.append(g)
        return tuple(sorted(lost))

    def _lease_args(self, g: int, a: RecordedTransition) -> tuple[int] | tuple[int, bool]:
        """A ``recover`` / ``place`` action's arguments for the claim or placement ``a``: with
        the outcome of the recorded ``pull`` of that attempt's export, when the run had to move
        it to the group's node (a Ray fleet whose node cannot read the trainer's path; a pull
        that failed or ran out of its share of the attempt leaves dummy weights and a push)."""
        pull = self._attempt_step(g, a, "pull", _STEP_SLACK_S)
        return (g,) if pull is None else (g, bool(pull.get("ok")))

    def _timed_out(self, a: RecordedTransition) -> bool:
        """Whether the recovery step that ended in ``a`` (a ``restart_failed``) timed out."""
        gid = self.recorded_ids[int(a.key[1][1:])]
        for rec in self.recoveries:
            if rec.get("group_id") != gid:
                continue
            for step in rec.get("steps") or ():
                if step.get("name") not in _RESTART_STEPS or step.get("ok"):
                    continue
                ended = float(step.get("started_at", 0.0)) + float(step.get("seconds", 0.0))
                near = abs(ended - a.timestamp) <= _STEP_SLACK_S
                if near and _TIMED_OUT in str(step.get("detail", "")):
                    return True
        return False

    def _context(self, anchor: RecordedTransition) -> tuple[str, ...]:
        """The recorded transitions around ``anchor`` and the sync and recovery rows whose time
        spans them (a recovery with its steps), times as the run's ``t``."""
        items, done = self.trace.items, self.trace.done
        lo = max(anchor.index - _CONTEXT_BEFORE, 0)
        hi = min(anchor.index + _CONTEXT_AFTER + 1, len(items))
        lines = [
            f"{'>' if item is anchor else '+' if done[item.index] else ' '} {item}"
            for item in items[lo:hi]
        ]
        offset = anchor.t - anchor.timestamp  # the run's t of an absolute timestamp
        start = items[lo].timestamp - _STEP_SLACK_S
        end = items[hi - 1].timestamp + _STEP_SLACK_S

        def at(timestamp: Any) -> str:
            return f"t={float(timestamp) + offset:.3f}"

        for row in self.syncs:
            begun, took = float(row.get("timestamp", 0.0)), float(row.get("seconds") or 0.0)
            if begun <= end and begun + took >= start:
                lines.append(
                    f"sync v{row.get('version')} {at(begun)} {took:.3f}s: "
                    f"ok={row.get('ok')} updated={row.get('updated')} "
                    f"failed={row.get('failed')} error={row.get('error')}"
                )
        for row in self.recoveries:
            steps = [s for s in row.get("steps") or () if isinstance(s, Mapping)]
            began = [float(s.get("started_at", 0.0)) for s in steps]
            ended = [
                float(s.get("started_at", 0.0)) + float(s.get("seconds") or 0.0) for s in steps
            ]
            if not steps or min(began) > end or max(ended) < start:
                continue
            lines.append(
                f"recovery {row.get('group_id')}: {row.get('status')} ({row.get('reason')})"
            )
            lines += [
                f"  {s.get('name')}#{s.get('attempt')} {at(s.get('started_at', 0.0))} "
                f"{'ok' if s.get('ok') else 'FAILED'}: {s.get('detail')}"
                for s in steps
            ]
        return tuple(lines)

    def _where(self, a: RecordedTransition) -> list[str]:
        """The model's side of the anchor's machine: its state and the events it allows."""
        model = self.model
        machine: GuardedMachine | None
        if a.key[0] == "group":
            machine = model.groups[int(a.key[1][1:])]
        elif a.key[0] == "export":
            machine = model.exports.get(int(a.subject.removeprefix("v")))
        elif a.key[0] == "registration":
            machine = model.registration
        else:
            machine = model.mode
        if machine is None:
            return [f"has no {a.kind} {a.subject} (never started, or deleted and forgotten)"]
        allowed = sorted(
            {str(e) for s in machine.configuration for e in s.transitions.unique_events}
        )
        return [
            f"its {a.kind} {a.subject} is {machine.state!r}, where its machine allows "
            f"{allowed}; fleet at v{model.version}"
        ]


def _actions(actions: Sequence[Action]) -> str:
    return " then ".join(str(a) for a in actions)


def _tapped_model(config: ModelConfig, log: list[Emitted]) -> FleetModel:
    """A :class:`FleetModel` whose machines append every transition they take to ``log``."""

    def group_key(m: Any) -> Key:
        return ("group", str(m.group_id))

    def export_key(m: Any) -> Key:
        return ("export", f"v{m.version}")

    model = FleetModel(
        config,
        group_cls=_tapped(WorkerGroupLifecycle, log, group_key),
        export_cls=_tapped(ExportLifecycle, log, export_key),
        registration_cls=_tapped(CheckpointRegistration, log, lambda m: ("registration", "")),
        mode_cls=_tapped(ImmediateRecoveryMode, log, lambda m: ("mode", "")),
    )
    model.tap = log.append
    return model


def _rank_results(results: object) -> dict[int, bool]:
    """An ``update_done``'s per-rank results as recorded: the fleet's ``[[rank, [ok,
    message]], ...]`` or a model run's ``{rank: ok}`` (JSON keys are strings)."""
    out: dict[int, bool] = {}
    if isinstance(results, Mapping):
        for rank, ok in results.items():
            with contextlib.suppress(TypeError, ValueError):
                out[int(rank)] = bool(ok[0] if isinstance(ok, list | tuple) else ok)
    elif isinstance(results, list):
        for item in results:
            if isinstance(item, list) and len(item) == 2:
                rank, ok = item
                with contextlib.suppress(TypeError, ValueError):
                    out[int(rank)] = bool(ok[0] if isinstance(ok, list | tuple) and ok else ok)
    return out


def _deltas_not_smaller(row: Mapping[str, Any] | None) -> bool:
    """Whether the recorded sync (its ``sync`` row) sent no delta because none was smaller
    than the full weights (``delta``: no delta target, a fallback: every weight changed)."""
    delta = (row or {}).get("delta")
    if not isinstance(delta, Mapping):
        return False
    return delta.get("delta_targets") == 0 and bool(delta.get("fallbacks"))


#: the colocated hooks a sync runs before its update (``rollsafe.operations.sync``): one that
#: fails ends the sync, nothing updated
_HOOKS_BEFORE_UPDATE = ("offload_trainer", "onload_engines")
#: every colocated hook a sync runs; a sync row whose error names one failed there (after the
#: update, ``onload_trainer``: the fleet moved on, no export started)
_HOOKS = (*_HOOKS_BEFORE_UPDATE, "onload_trainer")


#: how far past a sync row's ``t + seconds`` a transition of it may be stamped (the row's
#: seconds and the transitions' times are read from different clocks' calls)
_CLOCK_SLACK_S = 0.05


def _register_failed(row: Mapping[str, Any], version: int) -> bool:
    """Whether a sync row says its register of ``version`` failed."""
    error = row.get("error")
    return isinstance(error, str) and error.startswith(f"register of v{version} failed:")


def _failed_hook(error: object) -> str | None:
    """The hook a recorded sync failed in (its row's ``error`` is ``"<hook> failed: ..."``)."""
    if not isinstance(error, str):
        return None
    return next((h for h in _HOOKS if error.startswith(f"{h} failed:")), None)


def model_facts(config: ModelConfig, on_update_failure: str = "fail") -> dict[str, Any]:
    """The ``run`` row's ``model`` facts of a fleet shaped like ``config`` (groups ``g0``,
    ``g1``... on consecutive ranks): what :func:`model_config_of` reads back."""
    first = 0
    groups = []
    for g, n in enumerate(config.rank_counts):
        groups.append({"id": f"g{g}", "ranks": list(range(first, first + n))})
        first += n
    return {
        "groups": groups,
        "initial_version": config.initial_version,
        "restart_budget": config.restart_budget,
        "rearm_after": config.rearm_after,
        "immediate_recovery": config.immediate_recovery,
        "failure_threshold": config.failure_threshold,
        "on_update_failure": on_update_failure,
        "targeted_push": config.targeted_push,
        "engine": config.traits.kind,
        "failed_update_keeps_weights": config.traits.failed_update_keeps_weights,
        "deltas": config.deltas,
        "keep_last": config.keep_last,
        "spare_groups": config.spares,
    }


def rows_of_model_run(
    config: ModelConfig, actions: Iterable[Action], *, on_update_failure: str = "fail"
) -> list[dict[str, Any]]:
    """The recording a fleet would write had it run exactly ``actions`` of the model: the
    ``run`` row with :func:`model_facts`, every transition (each group event with its
    ``decided_by``), a ``sync`` row per sync (version, the groups whose update failed), a
    ``recovery`` row per timed-out restart, the ``end`` row. Actions that changed nothing
    leave nothing. Every run of the model replays with no divergence (``tests/
    test_trace_replay.py`` replays random walks): the replay's self-check."""
    log: list[Emitted] = []
    model = _tapped_model(config, log)
    rows: list[dict[str, Any]] = []
    seq: dict[Key, int] = {}
    clock = [0.0]

    def row(kind: str, subject: str, **fields: Any) -> dict[str, Any]:
        clock[0] += 0.001
        return {"kind": kind, "subject": subject, "timestamp": clock[0], "t": clock[0], **fields}

    def transition(key: Key, event: str, source: str, target: str, inputs: Any) -> None:
        seq[key] = seq.get(key, 0) + 1
        subject = key[1] or ("immediate_recovery" if key[0] == "mode" else "model")
        fields = {"seq": seq[key], "event": event, "source": source, "target": target}
        rows.append(row(key[0], subject, **fields, inputs=dict(inputs)))

    transition(("export", f"v{config.initial_version}"), "adopt", "requested", "ready", {})
    for action in actions:
        log.clear()
        unbegun = action.name == "sync" and action.args[0] is None
        if unbegun:  # the version its register would have published
            named = action.args[3] if len(action.args) > 3 else None
            attempted = model.version + 1 if named is None else int(named)
        if not model.apply(action) and not log:
            continue
        if unbegun and log:  # its row first, its export's judgement inside it (as recorded)
            error = f"register of v{attempted} failed: the trainer's tensors could not be read"
            fields = {"version": attempted, "ok": False, "error": error, "failed": []}
            rows.append(row("sync", "model", seconds=0.001 * len(log), **fields))
        for key, event, source, target, inputs in log:
            transition(key, event, source, target, inputs)
        begun = [i for k, e, _s, _t, i in log if k[0] == "registration" and e == "begin_register"]
        if action.name == "sync" and begun:
            failed = [f"g{g}" for g, ok in model._pushed.items() if not all(ok.values())]
            rows.append(row("sync", "model", version=begun[0]["version"], ok=True, failed=failed))

        if action.name == "restart_timeout":
            g = int(action.args[0])
            t = clock[0]
            detail = f"group 'g{g}': step 'restart' did not finish within its deadline"
            step = {"name": "restart", "ok": False, "started_at": t, "seconds": 0.0}
            rows.append(
                row(
                    "recovery",
                    f"g{g}",
                    group_id=f"g{g}",
                    status="failed",
                    failed_at=t,
                    finished_at=t,
                    steps=[{**step, "detail": detail}],
                )
            )
        if action.name in ("place", "recover") and len(action.args) > 1:  # a recorded pull
            g, ok = int(action.args[0]), bool(action.args[1])
            t = clock[0]
            step = {"name": "pull", "ok": ok, "started_at": t, "seconds": 0.0, "detail": ""}
            rows.append(row("recovery", f"g{g}", group_id=f"g{g}", steps=[step]))
    header = {
        "kind": "run",
        "subject": "fleet",
        "timestamp": 0.0,
        "t": 0.0,
        "format": "rollsafe-timeline/1",
        "groups": [f"g{g}" for g in range(config.groups)],
        "model": model_facts(config, on_update_failure),
    }
    end = row(
        "end",
        "fleet",
        groups={g.group_id: g.state for g in model.groups},
        fleet_version=model.version,
    )
    return [header, *rows, end]


def replay_run(rows: Sequence[Mapping[str, Any]], *, partial: str | None = None) -> ReplayResult:
    """Replay the recorded run ``rows`` (in time order, the ``run`` row first:
    :func:`rollsafe.observe.stream.load_recorded` reads a run directory's streamed record, or
    its ``timeline.jsonl``) through the verifier's model; see the module. ``partial``: why the
    record ends before the run did (``RunData.partial``; a record with no ``end`` row is
    partial anyway): the replay covers the prefix and says so (:attr:`ReplayResult.partial`).
    Raises :class:`TruncatedTraceError` for a knowingly cut record, :class:`TraceError` when
    the run cannot be mapped onto the model."""
    return _Replayer(rows, partial).run()

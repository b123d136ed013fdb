"""The vLLM releases ``VLLMClient`` speaks, and how it makes 0.26 and 0.32 servers look like 0.33.

Owns two things the client needs per server:

* :class:`VLLMDialect`: the facts that differ between the supported releases, read from the
  committed contracts (``contracts/vllm-<version>.json``, ``"dialect"``; generated from the
  wheels by ``tools/upstream_contract.py``). Which contract applies is decided by the server's
  own ``GET /version`` (:func:`rollsafe.adapters.engines.contract.contract_version_for`).
* :class:`PauseLedger`: what this client did to the engine (pauses, resumes, weight changes),
  so that on a 0.32 server it can refuse its own generates while it has the engine paused
  (0.33 answers 503; 0.32 would queue them and the engine would look hung) and can tell
  whether the weight version it read from ``/weight_info`` is the one that produced a
  completion (0.32 completions carry no ``weight_versions``).

What differs (0.26.0 / 0.32.0 / 0.33.0):

* ``weight_versions`` in completions: absent (the client keeps the label) / absent (the client
  reads ``GET /weight_info``) / per choice with ``return_weight_versions``;
* ``/update_weight_version`` and ``/weight_info``: absent (the label is the client's) / present
  / present;
* ``/weight_checker``: absent (check with ``rollsafe.probe``) / present / present;
* ``/shutdown_weight_transfer_engine``: absent (the group lives until the next init) / present
  / present;
* ``/finish_weight_update`` body: none / ``{weight_version?}`` / ``{weight_version?}``;
* NCCL ``packed`` settings: in every ``update_info`` / ``init_info`` / ``init_info``;
* a new request while paused (``abort``/``wait``): queued until ``/resume`` / queued / 503
  (``engine_paused``, retryable);
* ``update_info`` lists: required / required / default ``[]``;
* ``skip_special_tokens`` default: true / true / the generation config, else true;
* ``/sleep`` levels: 0, 1, 2 on all three;
* stop strings per completion: any number / at most 4 / at most 4 (``VLLM_MAX_STOP_STRINGS``);
  several matched in one step: the first of the list / the one completing first / the same;
  ``stop_token_ids`` outside the vocabulary: taken / 400 / 400 (the ``"stops"`` section).

vLLM 0.26.0 keeps no weight version at all: :class:`~rollsafe.adapters.engines.VLLMClient`
keeps the label itself (set by the update that carried it, or by ``update_weight_version``,
which sends nothing there), and the same reasoning as for 0.32's ``/weight_info`` makes it the
version of a completion: the label changes only through this client, with generation paused.

Why reading ``/weight_info`` is correct (:func:`read_version_holds`): rollsafe changes an
engine's weights and their label only through the client that routes to it, with generation
paused (every vLLM update runs paused), and a paused 0.32 engine runs nothing new. So when
none of this client's pauses, resumes or unpaused weight changes happened between the version
read (made just before the completion is sent) and the answer, the weights did not change in
between and the version read is the one that produced every token. When the engine was paused
by this client during the request and has not been resumed when the answer arrives, the
request ran before the pause (a paused engine answers a queued request only after
``/resume``): the version read before still holds. Otherwise (a whole pause/resume, or a weight
change without a pause, overlapped the request) the client reads the version again after the
answer: equal versions mean no change happened; different ones cannot be split into spans as
0.33 does, and the result is marked ``weight_version_exact=False``.

Those reads are written once, as steps (:data:`VersionSteps`: generators that yield where they
need the engine's version read and receive it), so the blocking client runs them with
:func:`run_steps` and the asyncio companion with an awaited read, around the same
:class:`PauseLedger`. The asyncio companion sends its first read *beside* the completion, not
before it (one round trip less a request): the ledger's mark is taken before both are sent,
and the read stands for one made before the request only when the mark is unchanged once the
read is in. Then the version held from that mark to the read: a request sent before the read
ran on it, one sent after is covered by the comparison after the answer as above. When the
mark moved during the read, nothing is trusted: no version, ``weight_version_exact=False``.

Remembered versions (0.32): most requests need no read at all. The ledger's *steady stretch*
(:class:`Steady`) is a stretch with no pause held and no weight change of this client in
flight; it ends when a pause, a resume or a weight change begins or ends. Within one, by the
same premise, the weights and their label do not change; so a version read whose stretch is
the same when the read began and when its answer came in is the version of the whole stretch
(:meth:`PauseLedger.learned`), and a request that starts in that stretch takes it as its read
before (:meth:`PauseLedger.start`), checked after the answer exactly as a read would be. The
first request after each sync (and after any other change) reads again. A label or weights
changed behind the client's back (another process posting ``/update_weight_version``) is seen
at the client's next pause, resume or weight change, or after ``VLLMClient.forget_version``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import TypeVar

from rollsafe.adapters.engines.contract import PINNED_VERSIONS, load_contract

__all__ = [
    "PauseLedger",
    "Start",
    "Steady",
    "VLLMDialect",
    "VersionSteps",
    "read_version_holds",
    "run_steps",
]

#: vLLM ``/pause`` modes in which 0.33 answers new requests with 503 (``keep`` queues them)
REFUSING_MODES = frozenset({"abort", "wait"})


@dataclass(frozen=True)
class VLLMDialect:
    """What a vLLM release does differently (the ``"dialect"`` section of its contract)."""

    #: the committed contract this server speaks (``"0.32.0"``, ``"0.33.0"``)
    version: str
    #: what the server's ``GET /version`` said; None when pinned by the user or not served
    server_version: str | None = None
    #: completions report ``weight_versions`` when asked (``return_weight_versions``)
    completion_weight_versions: bool = True
    #: a paused engine queues new requests (0.32) instead of answering 503 (0.33)
    pause_queues_new_requests: bool = False
    #: ``update_info`` must carry ``names``, ``dtype_names`` and ``shapes``
    update_info_lists_required: bool = False
    #: ``CompletionRequest.skip_special_tokens`` default (None: the server's generation config)
    skip_special_tokens_default: bool | None = None
    #: ``/update_weight_version`` and ``/weight_info`` exist (0.32+; 0.26: the client keeps
    #: the label)
    weight_version_routes: bool = True
    #: ``/weight_checker`` exists (0.32+; 0.26: weights are checked with ``rollsafe.probe``)
    weight_checker: bool = True
    #: ``/shutdown_weight_transfer_engine`` exists (0.32+)
    shutdown_route: bool = True
    #: ``/finish_weight_update`` takes ``{weight_version}`` (0.32+; 0.26: no body)
    finish_takes_version: bool = True
    #: where the NCCL packing settings go: ``"init_info"`` (0.32+) or ``"update_info"`` (0.26)
    packed_in: str = "init_info"
    #: the ``/sleep`` levels the release documents
    sleep_levels: tuple[int, ...] = (0, 1, 2)
    #: the most stop strings a completion may carry (``VLLM_MAX_STOP_STRINGS``, 0.32+); None:
    #: no limit (0.26)
    max_stop_strings: int | None = 4
    #: several stop strings matched by one step: the one completing first wins (0.32+), else
    #: the first of the request's list (0.26)
    earliest_stop_wins: bool = True
    #: ``stop_token_ids`` outside the vocabulary are a 400 (0.32+; 0.26 takes them)
    stop_token_ids_checked: bool = True

    @classmethod
    def of(cls, version: str | None = None, server_version: str | None = None) -> VLLMDialect:
        """The dialect of the committed contract ``version`` (the pinned one when None)."""
        contract = load_contract("vllm", version or PINNED_VERSIONS["vllm"])
        facts = contract.data["dialect"]
        stops = contract.data.get("stops", {})
        return cls(
            version=contract.version,
            server_version=server_version,
            completion_weight_versions=bool(facts["completion_weight_versions"]),
            pause_queues_new_requests=facts["paused_new_requests"] == "queued",
            update_info_lists_required=bool(facts["update_info_lists_required"]),
            skip_special_tokens_default=facts["skip_special_tokens_default"],
            weight_version_routes=bool(facts.get("weight_version_routes", True)),
            weight_checker=bool(facts.get("weight_checker", True)),
            shutdown_route=bool(facts.get("shutdown_weight_transfer_engine", True)),
            finish_takes_version=bool(facts.get("finish_weight_update_takes_version", True)),
            packed_in=str(facts.get("packed_in", "init_info")),
            sleep_levels=tuple(int(x) for x in facts.get("sleep_levels", (0, 1, 2))),
            max_stop_strings=stops.get("max_stop_strings"),
            earliest_stop_wins=stops.get("stop_string_choice") == "earliest_end",
            stop_token_ids_checked=bool(stops.get("stop_token_ids_checked_against_vocab")),
        )


@dataclass(frozen=True)
class Mark:
    """The ledger's counters at one instant (compared by :func:`read_version_holds`)."""

    pauses: int
    resumes: int
    unpaused_changes: int
    paused: bool


def read_version_holds(before: Mark, after: Mark) -> bool:
    """Whether a version read at ``before`` (right before a request was sent) is the one that
    produced its answer, received at ``after`` (see the module for why)."""
    if (before.pauses, before.resumes, before.unpaused_changes) == (
        after.pauses,
        after.resumes,
        after.unpaused_changes,
    ):
        return True
    return (
        after.paused
        and after.resumes == before.resumes
        and after.unpaused_changes == before.unpaused_changes
    )


_T = TypeVar("_T")

#: Steps that read the engine's weights version where they yield (the read's result is sent
#: back in) and return their outcome.
VersionSteps = Generator[None, "str | None", _T]


def run_steps(steps: VersionSteps[_T], read: Callable[[], str | None]) -> _T:
    """Run ``steps`` to the end, answering each of its yields with ``read()``."""
    try:
        next(steps)
        while True:
            steps.send(read())
    except StopIteration as stop:
        result: _T = stop.value
        return result


#: a steady stretch of the ledger (no pause held, no weight change in flight): its counters
Steady = tuple[int, int, int, int]


@dataclass(frozen=True)
class Start:
    """The ledger as a request starts (:meth:`PauseLedger.start`): its mark, its steady stretch
    (None while paused or while a weight change is in flight), and the version remembered for
    that stretch (``known``; ``version`` may be None: the engine reported none)."""

    mark: Mark
    steady: Steady | None
    known: bool = False
    version: str | None = None


class PauseLedger:
    """This client's pauses, resumes and weight changes of its engine (thread-safe), and the
    version read in the current steady stretch (see the module: *Remembered versions*)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mode: str | None = None
        self._pauses = 0
        self._resumes = 0
        self._unpaused_changes = 0
        self._in_flight = 0
        self._settled = 0
        self._known: tuple[Steady, str | None] | None = None

    @property
    def mode(self) -> str | None:
        """The vLLM ``/pause`` mode this client has the engine paused in (None: not paused)."""
        return self._mode

    def mark(self) -> Mark:
        with self._lock:
            return self._mark()

    def _mark(self) -> Mark:
        return Mark(self._pauses, self._resumes, self._unpaused_changes, self._mode is not None)

    def _steady(self) -> Steady | None:
        if self._mode is not None or self._in_flight:
            return None
        return (self._pauses, self._resumes, self._unpaused_changes, self._settled)

    def start(self) -> Start:
        """The mark, the steady stretch and the version remembered for it, read at once."""
        with self._lock:
            steady, known = self._steady(), self._known
            if steady is not None and known is not None and known[0] == steady:
                return Start(self._mark(), steady, True, known[1])
            return Start(self._mark(), steady)

    def learned(self, since: Steady | None, version: str | None) -> None:
        """Remember ``version``, read from the engine after ``since`` was taken, for the steady
        stretch ``since`` when the ledger is still in it (no pause, resume or weight change
        began or ended during the read)."""
        with self._lock:
            if since is not None and self._steady() == since:
                self._known = (since, version)

    def forget(self) -> None:
        """Drop the remembered version (the next request reads it again)."""
        with self._lock:
            self._known = None

    def refusing_mode(self) -> str | None:
        """The mode when new requests must be refused (0.33 would answer 503), else None."""
        mode = self._mode
        return mode if mode in REFUSING_MODES else None

    def pausing(self, mode: str) -> None:
        """Called before ``/pause`` is sent: from now on new generates are refused."""
        with self._lock:
            self._mode = mode
            self._pauses += 1

    def resumed(self) -> None:
        """Called once ``/resume`` was sent (whatever it answered), or when ``/pause`` failed."""
        with self._lock:
            if self._mode is not None:
                self._mode = None
                self._resumes += 1

    @contextlib.contextmanager
    def changing_weights(self) -> Iterator[None]:
        """Around a request that may change the weights or their version label: the mark
        moves as it begins (when not paused), and no version is remembered from then until
        it has ended."""
        with self._lock:
            if self._mode is None:
                self._unpaused_changes += 1
            self._in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1
                self._settled += 1

"""DeltaLedger: the per-target base versions a transport keeps for delta sync (issue #28)."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading

import pytest
from statemachine.exceptions import TransitionNotAllowed

from rollsafe.errors import InvalidArgument, InvalidArgumentType
from rollsafe.policy import PushPlan
from rollsafe.registry.delta_ledger import DeltaLedger
from rollsafe.statemachines import TransitionRefused

ON = {"delta_enabled": True, "engine_applies_deltas": True, "force_full": False}


def _based(ledger: DeltaLedger, target: str, version: int) -> None:
    ledger.plan(target, version, {version}, **ON)
    ledger.settle(target, version, ok=True, refused=False)


def test_first_push_is_full_then_deltas_from_the_confirmed_base() -> None:
    ledger = DeltaLedger()
    assert ledger.base("g0") is None and ledger.state("g0") == "no_base"
    plan = ledger.plan("g0", 1, set(), **ON)
    assert plan == PushPlan("full", None, "no base")
    assert ledger.state("g0") == "sending_full" and ledger.base("g0") is None
    ledger.settle("g0", 1, ok=True, refused=False)
    assert ledger.base("g0") == 1 and ledger.bases() == {"g0": 1}
    plan = ledger.plan("g0", 2, {1, 2}, **ON)
    assert plan == PushPlan("delta", 1, "delta v1 -> v2")
    assert ledger.state("g0") == "sending_delta" and ledger.bases() == {"g0": 1}
    ledger.settle("g0", 2, ok=True, refused=False)
    assert ledger.base("g0") == 2


def test_a_failed_or_refused_delta_never_moves_the_base() -> None:
    ledger = DeltaLedger()
    _based(ledger, "g0", 1)
    ledger.plan("g0", 2, {1}, **ON)
    ledger.settle("g0", 2, ok=False, refused=False)  # lost
    assert (ledger.state("g0"), ledger.base("g0")) == ("based", 1)
    ledger.plan("g0", 2, {1}, **ON)
    ledger.settle("g0", 2, ok=False, refused=True)  # DeltaBaseMismatch, nothing changed
    assert (ledger.state("g0"), ledger.base("g0")) == ("based", 1)
    # the transport retries the refused target in full in the same update
    plan = ledger.plan("g0", 2, {1}, **{**ON, "force_full": True})
    assert plan.kind == "full" and plan.reason == "forced"
    ledger.settle("g0", 2, ok=False, refused=False)
    assert (ledger.state("g0"), ledger.base("g0")) == ("no_base", None)
    assert ledger.bases() == {}


def test_fallback_full_sends_the_same_version_in_full() -> None:
    ledger = DeltaLedger()
    _based(ledger, "g0", 3)
    ledger.plan("g0", 4, {3}, **ON)
    plan = ledger.fallback_full("g0", "delta not smaller")
    assert plan == PushPlan("full", None, "delta not smaller")
    assert ledger.state("g0") == "sending_full" and ledger.base("g0") is None
    with pytest.raises(TransitionRefused, match="confirms_the_push"):
        ledger.settle("g0", 5, ok=True, refused=False)  # not the version in flight
    ledger.settle("g0", 4, ok=True, refused=False)
    assert ledger.base("g0") == 4
    with pytest.raises(TransitionNotAllowed):
        ledger.fallback_full("g0", "no delta in flight")
    assert ledger.base("g0") == 4


@pytest.mark.parametrize(
    ("held", "flags", "reason"),
    [
        ({1}, {"force_full": True}, "forced"),
        ({1}, {"delta_enabled": False}, "disabled"),
        ({1}, {"engine_applies_deltas": False}, "engine cannot apply deltas"),
        (set(), {}, "base v1 not held"),
    ],
)
def test_full_with_its_reason(held: set[int], flags: dict[str, bool], reason: str) -> None:
    ledger = DeltaLedger()
    _based(ledger, "g0", 1)
    plan = ledger.plan("g0", 2, held, **{**ON, **flags})
    assert (plan.kind, plan.reason) == ("full", reason)


def test_reset_a_restarted_target_and_forget_its_push() -> None:
    ledger = DeltaLedger()
    _based(ledger, "g0", 1)
    _based(ledger, "g1", 1)
    ledger.plan("g0", 2, {1}, **ON)
    ledger.reset("g0")
    assert ledger.state("g0") == "no_base" and ledger.bases() == {"g1": 1}
    with pytest.raises(InvalidArgument, match="no push to 'g0' is in flight"):
        ledger.settle("g0", 2, ok=True, refused=False)
    ledger.reset("g9")  # a target added: nothing known
    assert ledger.plan("g9", 2, {1}, **ON).reason == "no base"


def test_bad_input_is_named_and_changes_nothing() -> None:
    ledger = DeltaLedger()
    _based(ledger, "g0", 1)
    ledger.plan("g0", 2, {1}, **ON)
    with pytest.raises(TransitionRefused, match="in state 'sending_delta'"):
        ledger.plan("g0", 3, {1}, **ON)  # a push to g0 is still in flight
    with pytest.raises(InvalidArgument, match="unknown target 'g7'") as info:
        ledger.settle("g7", 2, ok=True, refused=False)
    assert info.value.key == "target"
    with pytest.raises(InvalidArgumentType, match="version") as typed:
        ledger.plan("g1", True, {1}, **ON)
    assert typed.value.key == "version"
    with pytest.raises(InvalidArgument, match=">= 0"):
        ledger.plan("g1", -1, {1}, **ON)
    with pytest.raises(InvalidArgumentType, match="target"):
        ledger.plan(3, 2, {1}, **ON)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="non-empty"):
        ledger.reset("")
    assert (ledger.state("g0"), ledger.base("g0"), ledger.state("g1")) == (
        "sending_delta",
        1,
        "no_base",
    )
    ledger.settle("g0", 2, ok=True, refused=False)
    assert ledger.base("g0") == 2


def test_machine_history_is_the_audit_trail() -> None:
    ledger = DeltaLedger()
    _based(ledger, "g0", 1)
    machine = ledger.machine("g0")
    assert machine is not None and ledger.machine("nope") is None
    assert [(r.event, r.target) for r in machine.history] == [
        ("send_full", "sending_full"),
        ("confirm", "based"),
    ]


def test_threads_pushing_to_their_targets() -> None:
    """Several updates plan and settle concurrently: every target ends on its last confirmed
    version, and a target pushed from two threads at once takes one push at a time."""
    ledger = DeltaLedger()
    errors: list[BaseException] = []
    refusals = [0]
    lock = threading.Lock()

    def worker(target: str) -> None:
        try:
            for version in range(1, 60):
                try:
                    plan = ledger.plan(target, version, {version - 1}, **ON)
                except TransitionRefused:  # the shared target's push of another thread
                    with lock:
                        refusals[0] += 1
                    continue
                ok = version % 7 != 0
                ledger.settle(target, version, ok=ok, refused=False)
                if ok:
                    assert plan.kind == "full" or plan.base == version - 1
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(f"g{i}",)) for i in range(4)]
    threads += [threading.Thread(target=worker, args=("shared",)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    for i in range(4):
        assert ledger.base(f"g{i}") == 59
    shared = ledger.machine("shared")
    assert shared is not None and shared.state in ("based", "no_base")
    hist = shared.history
    assert all(a.target == b.source for a, b in itertools.pairwise(hist))


def test_the_ledger_imports_no_torch() -> None:
    code = (
        "import sys, rollsafe.registry.delta_ledger as m; "
        "assert 'torch' not in sys.modules, 'torch loaded'; print(m.DeltaLedger.__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "DeltaLedger"

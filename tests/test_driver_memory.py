"""The driver's memory stays bounded over weight syncs (issue #36, "driver RSS flat over the hour").

Two causes grew the driver with every sync; each is checked here by counting, never by RSS or
timing:

* export verification read through a fresh 16 MiB ``bytearray`` (and asked ``os.pread`` for
  16 MiB) in short-lived threads: glibc kept each one resident in a per-thread arena. Its read
  buffers now live in their own mapping: tracemalloc sees no such buffer on the heap;
* the fleet's :class:`~rollsafe.fleet.inspection.ExportHistory` kept the lifecycle machine of
  every export ever started (about 70 KiB each: callbacks, event queues, conditions). It now
  keeps a machine only while the exporter holds it, then the machine's state and transitions for
  the last ``_RETIRED_KEPT`` versions: weak references count the machines still alive.
"""

from __future__ import annotations

import gc
import hashlib
import tracemalloc
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import tiny_model_dir  # noqa: F401  (fixture)
from hf_support import small_tensors

import rollsafe.hf.exporter as exporter_module
import rollsafe.hf.verify as verify_module
from rollsafe.errors import RollsafeError
from rollsafe.fleet import FleetConfig, RolloutFleet
from rollsafe.fleet.inspection import _RETIRED_KEPT, ExportHistory
from rollsafe.hf import ExportVerificationError, HFExporter, verify_hf_dir
from rollsafe.hf.verify import readback_file, sha256_file
from rollsafe.statemachines import ExportLifecycle

#: far below the 16 MiB read buffer each verification allocated on the heap before
_HEAP_PEAK_BOUND = 4 << 20


@contextmanager
def heap_peak() -> Iterator[list[int]]:
    """The peak of Python heap allocations (every thread) above the level at entry, in bytes."""
    out = [0]
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        yield out
        out[0] = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()


def count_tensors() -> int:
    """Tensors alive now (after a collection; no list of objects is kept)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def pattern(n: int) -> bytes:
    return (bytes(range(251)) * (n // 251 + 1))[:n]


# ----------------------------------------------------------------------------- read buffers
def test_hashing_and_read_back_of_a_big_file_keep_their_buffer_off_the_heap(
    tmp_path: Path,
) -> None:
    data = pattern(20 << 20)  # more than one 16 MiB read
    path = tmp_path / "shard.safetensors"
    path.write_bytes(data)
    want = hashlib.sha256(data).hexdigest()
    with heap_peak() as peak:
        assert sha256_file(path) == want
        assert readback_file(path, [memoryview(data)[: 7 << 20], memoryview(data)[7 << 20 :]]) == (
            want
        )
    assert peak[0] < _HEAP_PEAK_BOUND, f"{peak[0]} bytes allocated on the heap"


def test_an_export_and_its_verification_keep_their_read_buffers_off_the_heap(
    tmp_path: Path,
) -> None:
    """The driver's path: the exporter writes, reads back and verifies in its own threads."""
    exporter = HFExporter(tmp_path)
    weights = small_tensors()
    with heap_peak() as peak:
        path = exporter.start(weights, 1).wait(60)
        verify_hf_dir(path, expected_keys=set(weights))
    assert peak[0] < _HEAP_PEAK_BOUND, f"{peak[0]} bytes allocated on the heap"


@pytest.mark.parametrize(
    ("on_disk", "problem"),
    [
        (lambda d: bytes([d[0] ^ 1]) + d[1:], "content differs from the snapshot in bytes 0"),
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "content differs from the snapshot"),
        (lambda d: d[:-5], "bytes on disk"),
        (lambda d: d + b"x", "longer than"),
    ],
    ids=["first-byte", "last-byte", "shorter", "longer"],
)
def test_read_back_still_names_what_differs_in_every_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_disk: Any, problem: str
) -> None:
    monkeypatch.setattr(verify_module, "_READ_BYTES", 4096)  # many chunks, parts across them
    data = pattern(50_000)
    path = tmp_path / "shard.safetensors"
    path.write_bytes(on_disk(data))
    parts = [memoryview(data)[:10_001], memoryview(data)[10_001:]]
    with pytest.raises(ExportVerificationError, match=problem) as info:
        readback_file(path, parts)
    assert isinstance(info.value, RollsafeError)
    path.write_bytes(data)
    assert readback_file(path, parts) == hashlib.sha256(data).hexdigest()


# ----------------------------------------------------------------------------- export machines
@dataclass
class _Record:
    version: int
    lifecycle: ExportLifecycle


class _Exporter:
    """Holds the lifecycles of the last ``keep`` versions, as the exporter holds its records."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.records: list[_Record] = []

    def add(self, version: int) -> ExportLifecycle:
        machine = ExportLifecycle(version)
        machine.snapshot()
        self.records = [*self.records, _Record(version, machine)][-self.keep :]
        return machine

    def exports(self) -> list[_Record]:
        return list(self.records)

    def handle(self, version: int | None = None) -> _Record:
        return self.records[-1]


def test_export_history_keeps_machines_only_while_the_exporter_holds_them() -> None:
    exporter = _Exporter(keep=2)
    history = ExportHistory()
    refs: dict[int, weakref.ref[ExportLifecycle]] = {}
    n = _RETIRED_KEPT + 10
    for version in range(n):
        refs[version] = weakref.ref(exporter.add(version))
        history.harvest(exporter)  # type: ignore[arg-type]
    gc.collect()
    alive = sorted(v for v, ref in refs.items() if ref() is not None)
    assert alive == [n - 2, n - 1]  # the exporter's two, nothing more
    states = history.states()
    assert len(states) == 2 + _RETIRED_KEPT
    assert min(states) == n - 2 - _RETIRED_KEPT  # the oldest retired ones dropped
    assert set(states.values()) == {"snapshotting"}
    # a retired export keeps its transitions for the timeline
    retired = dict(history.machines())[n - 3]
    assert [r.event for r in retired.history] == ["snapshot"]
    assert retired.last_transition == retired.history[-1]


def test_a_retired_export_held_again_is_read_from_its_machine() -> None:
    exporter = _Exporter(keep=1)
    history = ExportHistory()
    first = exporter.add(1)
    history.harvest(exporter)  # type: ignore[arg-type]
    exporter.add(2)
    history.harvest(exporter)  # type: ignore[arg-type]
    assert not isinstance(dict(history.machines())[1], ExportLifecycle)
    first.snapshot_done()
    exporter.records.insert(0, _Record(1, first))  # held again (e.g. adopted once more)
    history.harvest(exporter)  # type: ignore[arg-type]
    assert dict(history.machines())[1] is first and history.states()[1] == "writing"


def test_a_fleet_holds_a_bounded_number_of_versions_over_many_syncs(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real fleet (one reference engine, deltas on): after N syncs only the current version's
    weights, a steady number of tensors and the machines the exporter holds (its recent handles
    and kept records) are alive."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(exporter_module, "_HANDLES_KEPT", 2)  # the bound, small enough to pass
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    del model
    n = 6
    tensors: dict[int, list[weakref.ref[torch.Tensor]]] = {}
    machines: dict[int, weakref.ref[ExportLifecycle]] = {}
    live_tensors: list[int] = []
    config = FleetConfig(model_path=tiny_model_dir, export_root=tmp_path / "exports")
    with RolloutFleet(config) as fleet:
        exporter = fleet.exporter
        assert exporter is not None
        for version in range(1, n + 1):
            weights = {k: t + 0.001 * version for k, t in base.items()}
            tensors[version] = [weakref.ref(t) for t in weights.values()]
            assert fleet.sync_weights(weights, version).ok
            del weights
            exporter.wait_hf_export(version, timeout=60)
            machines[version] = weakref.ref(exporter.handle(version).lifecycle)
            live_tensors.append(count_tensors())
        fleet.export_states()  # a last harvest
        gc.collect()
        weights_alive = sorted(
            v for v, refs in tensors.items() if any(r() is not None for r in refs)
        )
        # the transport registers the current version's tensors (no copy): that one only
        assert weights_alive == [n]
        # and every tensor the driver holds (delta bases, the exporter's snapshot) is reused or
        # replaced: as many after the last sync as after the third
        assert live_tensors[-1] <= live_tensors[2], live_tensors
        alive = sorted(v for v, ref in machines.items() if ref() is not None)
        held = {r.version for r in exporter.exports()} | {n - 1, n}  # records and 2 handles
        assert set(alive) <= held and len(alive) <= len(held), (alive, held)
        # what the fleet reports back is unchanged: every export's state, the old ones' transitions
        states = fleet.export_states()
        assert set(range(1, n + 1)) <= set(states)
        assert states[1] == "deleted" and states[n] == "ready"
        rows = fleet.timeline()
        assert {"v1", f"v{n}"} <= {r["subject"] for r in rows if r["kind"] == "export"}

"""The ``moved`` export mode in recovery, without a cluster: the attempt's steps with a pull
(``rollsafe.operations.recover.take_lease``), the policy's fallback, and the fleet's
:class:`~rollsafe.adapters.ray.exports.ExportMover` (one publication per version, reused by
every recovery of it, dropped once the export is retired; a refused pull counted and raised).

The mover runs here on real export directories (``HFExporter``-shaped: files plus
``rollsafe-manifest.json``) with an in-memory object store standing in for Ray's (``put`` /
``get``), and a group handle that runs :func:`receive_export` as the actor does.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from test_operations_recover import Group, run

import rollsafe.operations.effects as fx
import rollsafe.policy as policy
from rollsafe.adapters.ray.exports import (
    ExportMover,
    ExportPullRefused,
    ExportPullTimeout,
    publish_export,
    receive_export,
)
from rollsafe.hf.layout import MANIFEST_NAME


def moved_export(version: int = 3) -> fx.Outcome:
    export = policy.ExportFacts(version, "ready")
    return fx.Ok(fx.StrategyFacts("enabled", version, export, True, moved=True))


def test_a_moved_export_is_pulled_before_the_restart_which_loads_the_copy() -> None:
    copy = fx.Pulled("/node/rollsafe-moved/f/n/hf-v3", 1234, node_id="n1")
    seen, end = run(
        {fx.ReadStrategy: lambda e: moved_export(), fx.PullExport: lambda e: fx.Ok(copy)},
        traits=policy.engine_traits("vllm"),
    )
    kinds = [type(e) for e in seen]
    pull = kinds.index(fx.PullExport)
    assert kinds.index(fx.TakeLease) < pull < kinds.index(fx.StopEngine)
    (restart,) = [e for e in seen if isinstance(e, fx.Restart)]
    assert restart.model_path == copy.path and restart.weight_version == 3
    assert end.status == "active" and end.strategy == "immediate" and end.export_version == 3
    releases = [e for e in seen if isinstance(e, fx.ReleaseLease)]
    assert len(releases) == 1 and releases[0].lease.path == copy.path  # released once, after


@pytest.mark.parametrize("outcome", [fx.Failed("ExportPullRefused: file x"), fx.TimedOut(1.0)])
def test_a_refused_pull_falls_back_to_dummy_weights_and_the_push(outcome: fx.Outcome) -> None:
    seen, end = run(
        {fx.ReadStrategy: lambda e: moved_export(), fx.PullExport: lambda e: outcome},
        group=Group(),
    )
    (restart,) = [e for e in seen if isinstance(e, fx.Restart)]
    assert restart.dummy  # never the unverified bytes, never the trainer's path
    notes = [e for e in seen if isinstance(e, fx.NoteStep) and e.name == "strategy"]
    assert len(notes) == 1 and not notes[0].ok
    assert "could not be moved" in notes[0].detail and "push" in notes[0].detail
    kinds = [type(e) for e in seen]
    assert kinds.index(fx.ReleaseLease) < kinds.index(fx.Restart)  # the lease let go first
    assert end.status == "active" and end.strategy == "targeted_push"


def test_an_export_read_in_place_is_not_pulled() -> None:
    seen, end = run()  # StrategyFacts.moved False: local or shared exports
    assert not any(isinstance(e, fx.PullExport) for e in seen)
    assert end.strategy == "immediate"


def test_the_policy_names_the_access_and_the_fallback() -> None:
    access = policy.export_access
    assert access(placement="local", shared=False) is policy.ExportAccess.LOCAL
    assert access(placement="ray", shared=True) is policy.ExportAccess.SHARED
    assert access(placement="ray", shared=False) is policy.ExportAccess.MOVED
    ok = policy.after_pull(True, "", version=2, can_push=True)
    assert ok.strategy is policy.Strategy.IMMEDIATE and ok.export_version == 2
    no = policy.after_pull(False, "refused", version=2, can_push=False)
    assert no.strategy is policy.Strategy.DEFERRED and "refused" in no.reason


# --------------------------------------------------------------------------- the mover
def write_export(root: Path, version: int, size: int = 5000) -> Path:
    d = root / f"hf-v{version}"
    d.mkdir(parents=True)
    files = {}
    for name in ("model.safetensors", "config.json"):
        data = bytes((i * (version + 7)) % 251 for i in range(size))
        (d / name).write_bytes(data)
        files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (d / MANIFEST_NAME).write_text(json.dumps({"files": files}))
    return d


class Store:
    """An object store in memory (what ``ray.put`` / ``ray.get`` are to the mover)."""

    def __init__(self) -> None:
        self.objects: dict[int, bytes] = {}
        #: refs whose object never arrives (``get`` waits its timeout, then raises as Ray's)
        self.never: set[int] = set()
        self.timeouts: list[float | None] = []

    def put(self, data: bytes) -> int:
        ref = len(self.objects)
        self.objects[ref] = data
        return ref

    def get(self, ref: int, timeout: float | None = None) -> bytes:
        self.timeouts.append(timeout)
        if ref in self.never:
            assert timeout is not None, "an unbounded get of an object that never arrives"
            time.sleep(timeout)
            raise TimeoutError(f"object {ref} not ready after {timeout} s")  # as ray.get's
        return self.objects[ref]


class Handle:
    """A group handle whose pull runs :func:`receive_export` on "its node" (a directory)."""

    def __init__(self, store: Store, node: str) -> None:
        self.store = store
        self.node = node
        self.asked: list[tuple[str | None, str | None]] = []

    def pull_export(
        self, parcel: Any, dest_root: str | None, *, fleet: str, timeout_s: float | None = None
    ) -> dict[str, Any]:
        self.asked.append((dest_root, fleet))
        assert dest_root is not None
        got = receive_export(
            parcel, Path(dest_root) / fleet / self.node, get=self.store.get, timeout_s=timeout_s
        )
        return {"path": got.path, "nbytes": got.nbytes, "reused": got.reused, "node_id": self.node}


def test_the_mover_publishes_once_per_version_and_drops_retired_exports(tmp_path: Path) -> None:
    store = Store()
    v1, v2 = write_export(tmp_path / "exports", 1), write_export(tmp_path / "exports", 2)
    handles = {"g0": Handle(store, "node-a"), "g1": Handle(store, "node-b")}
    ready = {1, 2}
    published: list[str] = []

    def publish(path: str) -> Any:
        published.append(Path(path).name)
        return publish_export(path, chunk_bytes=1024, put=store.put)

    mover = ExportMover(
        handles.__getitem__,
        keep=lambda v: v in ready,
        dest_root=str(tmp_path / "nodes"),
        fleet="f1",
        publish=publish,
    )
    threads = [threading.Thread(target=mover.pull, args=(g, 1, str(v1))) for g in ("g0", "g1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert published == ["hf-v1"]  # one publication for two recoveries of v1 at once
    again = mover.pull("g1", 1, str(v1))  # that node has a checked copy: nothing moved
    assert again.reused and again.nbytes == 0 and again.node_id == "node-b"
    assert Path(again.path) == tmp_path / "nodes" / "f1" / "node-b" / "hf-v1"
    assert (Path(again.path) / "model.safetensors").read_bytes() == (
        v1 / "model.safetensors"
    ).read_bytes()
    first = mover.pull("g0", 2, str(v2))
    assert first.nbytes == 10000 and not first.reused and mover.published() == [1, 2]
    ready.discard(1)  # v1 retired: its parcel is dropped at the next look
    assert mover.prune() == [1] and mover.published() == [2]
    stats = mover.stats()
    assert stats["publishes"] == 2 and stats["pulls"] == 4 and stats["failed_pulls"] == 0
    assert stats["bytes_pulled"] == 10000 * 3  # v1 to two nodes, v2 to one


def test_a_damaged_chunk_is_refused_counted_and_leaves_no_copy(tmp_path: Path) -> None:
    store = Store()
    v1 = write_export(tmp_path / "exports", 1)

    def tampering(path: str) -> Any:
        parcel = publish_export(path, chunk_bytes=1024, put=store.put)
        store.objects[parcel.chunks["model.safetensors"][1]] = b"\0" * 1024  # on the way
        return parcel

    handle = Handle(store, "node-a")
    mover = ExportMover(
        lambda g: handle, dest_root=str(tmp_path / "nodes"), fleet="f", publish=tampering
    )
    with pytest.raises(ExportPullRefused) as err:
        mover.pull("g0", 1, str(v1))
    assert err.value.file == "model.safetensors"
    assert not (tmp_path / "nodes" / "f" / "node-a" / "hf-v1").exists()
    stats = mover.stats()
    assert stats["failed_pulls"] == 1 and "ExportPullRefused" in str(stats["last_error"])
    assert stats["bytes_pulled"] == 0


def test_a_chunk_that_never_arrives_is_a_named_timeout_that_leaves_nothing(tmp_path: Path) -> None:
    store = Store()
    v1 = write_export(tmp_path / "exports", 1)
    parcel = publish_export(v1, chunk_bytes=1024, put=store.put)
    store.never.add(parcel.chunks["model.safetensors"][2])
    handle = Handle(store, "node-a")
    mover = ExportMover(
        lambda g: handle, dest_root=str(tmp_path / "nodes"), fleet="f", publish=lambda p: parcel
    )
    t0 = time.monotonic()
    with pytest.raises(ExportPullTimeout) as err:
        mover.pull("g0", 1, str(v1), timeout_s=0.3)
    assert time.monotonic() - t0 < 5.0  # bounded by the pull's timeout, not by the object
    assert err.value.phase == "transfer" and err.value.file == "model.safetensors"
    assert "did not arrive" in str(err.value) and "hf-v1" in str(err.value)
    node_dir = tmp_path / "nodes" / "f" / "node-a"
    assert list(node_dir.iterdir()) == []  # neither the copy nor its temporary directory
    left = [t for t in store.timeouts if t is not None]
    assert left and all(0 < t <= 0.3 for t in left)  # every chunk asked with what was left
    assert left == sorted(left, reverse=True)
    assert mover.stats()["failed_pulls"] == 1
    assert "ExportPullTimeout" in str(mover.stats()["last_error"])
    store.never.clear()  # the object arrives after all: the next pull moves it
    again = mover.pull("g0", 1, str(v1), timeout_s=5.0)
    assert again.nbytes == 10000 and not again.reused


def test_without_a_timeout_a_chunk_is_asked_unbounded_and_a_bad_timeout_is_refused(
    tmp_path: Path,
) -> None:
    store = Store()
    v1 = write_export(tmp_path / "exports", 1)
    parcel = publish_export(v1, chunk_bytes=1024, put=store.put)
    got = receive_export(parcel, tmp_path / "a", get=store.get)
    assert got.nbytes == 10000 and set(store.timeouts) == {None}
    for bad in (0, -1.0, True, "5"):
        with pytest.raises(ValueError, match="timeout_s"):
            receive_export(parcel, tmp_path / "b", get=store.get, timeout_s=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "b").exists()


def test_a_pull_timeout_names_its_phase_and_survives_pickling() -> None:
    actor = ExportPullTimeout("hf-v3", "actor", 12.5)
    assert "actor did not answer" in str(actor) and "12.5 s" in str(actor)
    transfer = pickle.loads(pickle.dumps(ExportPullTimeout("hf-v3", "transfer", 4.0, "m.st")))
    assert (transfer.export, transfer.phase, transfer.timeout_s, transfer.file) == (
        "hf-v3",
        "transfer",
        4.0,
        "m.st",
    )
    assert isinstance(transfer, TimeoutError) and "'m.st' did not arrive" in str(transfer)


def test_the_pull_may_take_half_of_what_is_left_of_the_attempt() -> None:
    assert policy.pull_budget_s(120.0) == pytest.approx(120.0 * policy.PULL_SHARE)
    assert 0 < policy.PULL_SHARE < 1  # the fallback always keeps a share
    assert policy.pull_budget_s(-3.0) == 0.0

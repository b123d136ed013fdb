"""``NodeWatcher``'s rounds and the shared-exports check's parts, without a Ray cluster.

A fake ``ray_module`` (any object with ``nodes()``) stands in for the GCS: the diffing of two
rounds, a failing or hanging call, a raising callback. The probe file's writing, reading and
judging run on the real file system. The same pieces on a real multi-node cluster:
``tests/test_ray_nodes.py``.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from rollsafe.adapters.ray.exports import (
    PROBE_PREFIX,
    SharedExportUnreadable,
    judge_reads,
    read_probe,
    write_probe,
)
from rollsafe.adapters.ray.nodes import NodeEvent, NodeInfo, NodeWatcher, node_changes
from rollsafe.errors import InvalidArgument


def entry(node_id: str, alive: bool = True, ip: str = "10.0.0.1") -> dict[str, Any]:
    return {
        "NodeID": node_id,
        "Alive": alive,
        "NodeManagerAddress": ip,
        "NodeManagerHostname": f"host-{node_id}",
        "Resources": {"CPU": 1.0},
    }


class FakeRay:
    """``nodes()`` answers the table set last; ``fail``: raise; ``hang``: block until set."""

    def __init__(self, table: list[dict[str, Any]]) -> None:
        self.table = table
        self.calls = 0
        self.fail: Exception | None = None
        self.hang = threading.Event()
        self.hang.set()
        self.lock = threading.Lock()

    def nodes(self) -> list[dict[str, Any]]:
        with self.lock:
            self.calls += 1
        self.hang.wait()
        if self.fail is not None:
            raise self.fail
        return list(self.table)


class Events:
    def __init__(self, raise_first: int = 0) -> None:
        self.calls: list[list[NodeEvent]] = []
        self.raise_first = raise_first

    def __call__(self, events: list[NodeEvent]) -> None:
        self.calls.append(list(events))
        if len(self.calls) <= self.raise_first:
            raise RuntimeError("the fleet's handler failed")


def info(node_id: str, ip: str = "10.0.0.1") -> NodeInfo:
    return NodeInfo(node_id, ip)


def test_node_changes_reports_deaths_then_joins() -> None:
    before = {"a": info("a", "10.0.0.1"), "b": info("b", "10.0.0.2")}
    now = {"b": info("b", "10.0.0.2"), "c": info("c", "10.0.0.3")}
    assert node_changes(before, now) == [
        NodeEvent("dead", "a", "10.0.0.1"),
        NodeEvent("joined", "c", "10.0.0.3"),
    ]
    assert node_changes(now, now) == []


def test_the_first_round_is_the_baseline_and_later_rounds_report_each_change_once() -> None:
    fake = FakeRay([entry("head", ip="10.0.0.1"), entry("w1", ip="10.0.0.2"), entry("old", False)])
    got = Events()
    watcher = NodeWatcher(got, interval_s=10.0, ray_module=fake)
    assert watcher.run_round() == []  # baseline: nothing "joined"
    assert set(watcher.alive_nodes()) == {"head", "w1"}  # a node dead already is not alive
    assert watcher.alive_nodes()["w1"].address == "10.0.0.2"
    assert watcher.alive_nodes()["w1"].resources == {"CPU": 1.0}

    fake.table = [entry("head"), entry("w1", alive=False, ip="10.0.0.2"), entry("w2", ip="10.9")]
    events = watcher.run_round()
    assert events == [NodeEvent("dead", "w1", "10.0.0.2"), NodeEvent("joined", "w2", "10.9")]
    assert got.calls == [events]  # one callback with the round's every change
    assert watcher.run_round() == [] and len(got.calls) == 1  # reported once
    fake.table = [entry("head")]  # a node missing from the table is dead as well
    assert watcher.run_round() == [NodeEvent("dead", "w2", "10.9")]
    assert (watcher.rounds, watcher.calls, fake.calls) == (4, 4, 4)  # one call per round
    assert watcher.events_delivered == 3 and watcher.failed_rounds == 0
    assert watcher.stats()["last_call_s"] is not None and watcher.stats()["rounds"] == 4


def test_a_failing_call_or_callback_never_stops_the_watcher() -> None:
    fake = FakeRay([entry("a"), entry("b")])
    got = Events(raise_first=1)
    watcher = NodeWatcher(got, interval_s=0.02, ray_module=fake).start()
    try:
        assert set(watcher.alive_nodes()) == {"a", "b"}  # start() ran the baseline round
        fake.fail = ConnectionError("GCS unreachable")
        deadline = time.monotonic() + 10
        while watcher.failed_rounds < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watcher.failed_rounds >= 3 and watcher.running
        assert "GCS unreachable" in str(watcher.last_error)
        assert set(watcher.alive_nodes()) == {"a", "b"}  # a failed round changes nothing
        fake.table = [entry("a")]
        fake.fail = None
        while len(got.calls) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got.calls == [[NodeEvent("dead", "b", "10.0.0.1")]]
        assert watcher.callback_errors == 1 and watcher.running  # the raise was survived
        fake.table = [entry("a"), entry("c")]
        while len(got.calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got.calls[1] == [NodeEvent("joined", "c", "10.0.0.1")]
        assert watcher.callback_errors == 1
    finally:
        assert watcher.stop(timeout=5)
    assert not watcher.running


def test_a_hanging_call_is_bounded_and_not_repeated_while_it_hangs() -> None:
    fake = FakeRay([entry("a")])
    got = Events()
    watcher = NodeWatcher(got, interval_s=0.02, ray_module=fake, call_timeout_s=0.1)
    assert watcher.run_round() == []
    fake.hang.clear()  # the GCS stops answering
    t0 = time.monotonic()
    assert watcher.run_round() == []
    assert time.monotonic() - t0 < 2.0  # bounded by call_timeout_s, not by the call
    assert watcher.failed_rounds == 1 and "did not answer" in str(watcher.last_error)
    assert watcher.run_round() == [] and watcher.run_round() == []
    assert watcher.stalled_rounds == 2 and fake.calls == 2  # no second call while it hangs
    fake.table = [entry("b")]
    fake.hang.set()
    deadline = time.monotonic() + 5
    while watcher.run_round() == [] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got.calls == [[NodeEvent("dead", "a", "10.0.0.1"), NodeEvent("joined", "b", "10.0.0.1")]]


def test_stop_ends_the_thread_even_while_a_call_hangs() -> None:
    fake = FakeRay([entry("a")])
    watcher = NodeWatcher(Events(), interval_s=0.01, ray_module=fake, call_timeout_s=60).start()
    fake.hang.clear()
    deadline = time.monotonic() + 5
    while fake.calls < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake.calls >= 2  # the loop's call is in flight, hanging
    t0 = time.monotonic()
    assert watcher.stop(timeout=5) and time.monotonic() - t0 < 2.0
    fake.hang.set()


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        ({"interval_s": 0}, "interval_s"),
        ({"interval_s": True}, "interval_s"),
        ({"call_timeout_s": -1}, "call_timeout_s"),
    ],
)
def test_bad_watcher_settings_name_the_key(kw: dict[str, Any], key: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        NodeWatcher(Events(), ray_module=FakeRay([]), **kw)
    assert err.value.key == key
    with pytest.raises(InvalidArgument) as err:
        NodeWatcher("not callable", ray_module=FakeRay([]))  # type: ignore[arg-type]
    assert err.value.key == "on_event"


def test_the_probe_is_written_durably_and_read_back_equal(tmp_path: Path) -> None:
    root = tmp_path / "exports"  # created when missing
    probe = write_probe(root, 1000)
    path = Path(probe.path)
    assert path.parent == root.resolve() and path.name.startswith(PROBE_PREFIX)
    assert os.listdir(root) == [path.name]  # no temporary file left
    assert probe.sha256 == hashlib.sha256(path.read_bytes()).hexdigest() and probe.size == 1000
    read = read_probe(probe.path)
    assert read["size"] == 1000 and read["sha256"] == probe.sha256
    judge_reads(probe, {"n1": read, "n2": dict(read)})  # equal everywhere: passes
    with pytest.raises(InvalidArgument) as err:
        write_probe(root, 0)
    assert err.value.key == "nbytes"


def test_a_node_that_reads_other_bytes_or_fails_is_named(tmp_path: Path) -> None:
    probe = write_probe(tmp_path, 64)
    good = read_probe(probe.path)
    other = {**good, "sha256": hashlib.sha256(b"other").hexdigest()}
    with pytest.raises(SharedExportUnreadable) as err:
        judge_reads(probe, {"n1": good, "n2": other})
    assert err.value.node_id == "n2" and err.value.path == probe.path
    assert "n2" in str(err.value) and probe.path in str(err.value) and "sha256" in str(err.value)
    with pytest.raises(SharedExportUnreadable) as err:
        judge_reads(probe, {"n3": FileNotFoundError(2, "No such file"), "n1": good})
    assert err.value.node_id == "n3" and set(err.value.failures) == {"n3"}
    with pytest.raises(SharedExportUnreadable) as err:  # a read that ran on another node
        judge_reads(probe, {"n1": {**good, "node_id": "n9"}})
    assert err.value.node_id == "n1" and "n9" in str(err.value)
    os.unlink(probe.path)
    with pytest.raises(OSError):
        read_probe(probe.path)


def test_the_errors_keep_their_fields_through_pickling() -> None:
    """Both are raised where Ray pickles them (a task, an actor): the fields survive."""
    import pickle

    from rollsafe.adapters.ray.exports import ExportPullRefused

    err = pickle.loads(pickle.dumps(SharedExportUnreadable("n1", "/p", {"n1": "gone"})))
    assert (err.node_id, err.path, err.failures) == ("n1", "/p", {"n1": "gone"})
    pulled = pickle.loads(pickle.dumps(ExportPullRefused("v1", "a.safetensors", "bad sha256")))
    assert (pulled.export, pulled.file, pulled.reason) == ("v1", "a.safetensors", "bad sha256")
    assert "a.safetensors" in str(pulled)


def fake_export(root: Path, files: dict[str, bytes]) -> Path:
    """A directory with ``files`` and a ``rollsafe-manifest.json`` listing their sizes and
    sha256 (what :class:`~rollsafe.hf.HFExporter` writes, minus the tensors' structure)."""
    import json

    from rollsafe.hf import MANIFEST_NAME

    root.mkdir(parents=True)
    for name, data in files.items():
        (root / name).write_bytes(data)
    manifest = {
        "format": "rollsafe.hf-export.v1",
        "version": 3,
        "files": {
            n: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in files.items()
        },
        "keys": [],
    }
    (root / MANIFEST_NAME).write_text(json.dumps(manifest))
    return root


def test_a_moved_export_is_checked_against_its_manifest_before_it_is_kept(
    tmp_path: Path,
) -> None:
    from rollsafe.adapters.ray.exports import (
        ExportPullRefused,
        publish_export,
        receive_export,
    )
    from rollsafe.hf import MANIFEST_NAME

    files = {"model.safetensors": os.urandom(5000), "config.json": b'{"a": 1}'}
    src = fake_export(tmp_path / "src" / "v000003", files)
    store: dict[int, bytes] = {}

    def put(data: bytes) -> int:  # an object store of our own: ref -> bytes
        store[len(store)] = data
        return len(store) - 1

    parcel = publish_export(src, chunk_bytes=1024, put=put)
    assert parcel.name == "v000003" and parcel.nbytes == 5008
    assert len(parcel.chunks["model.safetensors"]) == 5  # 5000 bytes in 1024-byte chunks
    dest = tmp_path / "node-local"
    pulled = receive_export(parcel, dest, get=store.__getitem__)
    assert pulled.path == str(dest / "v000003") and pulled.nbytes == 5008 and not pulled.reused
    for name, data in files.items():
        assert (dest / "v000003" / name).read_bytes() == data
    assert (dest / "v000003" / MANIFEST_NAME).read_bytes() == (src / MANIFEST_NAME).read_bytes()
    again = receive_export(parcel, dest, get=lambda ref: pytest.fail("fetched again"))
    assert again.reused and again.nbytes == 0  # a matching copy is used as it is

    store[parcel.chunks["model.safetensors"][2]] = b"x" * 1024  # a chunk damaged on the way
    other = tmp_path / "other-node"
    with pytest.raises(ExportPullRefused) as err:
        receive_export(parcel, other, get=store.__getitem__)
    assert err.value.file == "model.safetensors" and err.value.export == "v000003"
    assert "sha256" in str(err.value)
    assert os.listdir(other) == []  # nothing left behind, nothing to load
    (dest / "v000003" / "config.json").write_bytes(b'{"a": 2}')  # a damaged local copy...
    with pytest.raises(ExportPullRefused):  # ...is not reused, and the pull is refused
        receive_export(parcel, dest, get=store.__getitem__)
    assert os.listdir(dest) == []  # the damaged copy is gone too: nothing a restart could load
    (src / "config.json").write_bytes(b"changed")  # a source that no longer matches
    with pytest.raises(ExportPullRefused) as err:
        publish_export(src, put=put)
    assert err.value.file == "config.json"


def test_a_clusters_ray_logs_are_copied_when_asked_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollsafe.adapters.ray.local import KEEP_LOGS, _keep_logs

    tmp = tmp_path / "rs-ray-abc"
    logs = tmp / "ray" / "session_2026-12-02_1" / "logs"
    (logs / "old").mkdir(parents=True)
    (logs / "raylet.out").write_text("raylet says")
    (logs / "old" / "worker-1.err").write_text("a worker died")
    (tmp / "ray" / "session_2026-12-02_1" / "sockets").mkdir()
    (tmp / "ray" / "session_2026-12-02_1" / "sockets" / "plasma").write_text("not a log")
    monkeypatch.delenv(KEEP_LOGS, raising=False)
    _keep_logs(str(tmp))  # not asked: nothing copied anywhere
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rs-ray-abc"]
    keep = tmp_path / "kept"
    monkeypatch.setenv(KEEP_LOGS, str(keep))
    _keep_logs(str(tmp))
    copied = keep / "rs-ray-abc" / "ray" / "session_2026-12-02_1" / "logs"
    assert (copied / "raylet.out").read_text() == "raylet says"
    assert not (copied / "old").exists()  # only the logs directory's own files
    assert not (keep / "rs-ray-abc" / "ray" / "session_2026-12-02_1" / "sockets").exists()

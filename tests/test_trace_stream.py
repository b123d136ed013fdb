"""A fleet's run streamed to its run directory, whole past the in-memory bound (#36 item 3).

One real run of a reference-engine fleet (two 1-rank groups) streams to ``FleetConfig.run_dir``
with the memory bounds set small for the module: each machine keeps its last 3 transitions,
the sync coordinator its last 2 reports, the recovery coordinator its last result. The run
(a SIGKILL before the first sync, five syncs, a SIGKILL after them, a last sync) goes well past
every bound: the machines' in-memory histories no longer start at their first transition, yet
``rollsafe verify --trace RUN_DIR`` replays the streamed record whole, with no divergence, and
so does the ``timeline.jsonl`` ``record()`` writes from it. The same fleet's record written from
memory is knowingly cut: the replay refuses it by name (``TruncatedTraceError``), as it does an
older record whose cut shows only in its numbering. A crashed fleet's stream (a prefix, its last
line cut mid-write) replays as a stated partial replay. The writer alone: a group added at
runtime joins the record's groups, a full disk (``/dev/full``) stops the stream without
touching the machines; the subscriber seam the stream rides on
(:meth:`GuardedMachine.subscribe`) is checked on a bare machine; a bad ``run_dir`` is named.
Waits are bounded by deadlines; nothing asserts a duration.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chaos_support import WAIT_S, RequestLoop, chaos_fleet, wait_for, wait_recovery
from engine_helpers import (
    tiny_model_dir,  # noqa: F401  (fixture)
    tiny_model_dir_b,  # noqa: F401  (fixture)
)
from trace_support import FromMemory, assert_run_replays
from transport_helpers import Trainer

import rollsafe.fleet.recovery as recovery_module
import rollsafe.fleet.sync as sync_module
from rollsafe.cli import main
from rollsafe.fleet import FleetConfig, FleetConfigError, GroupSpec, RolloutFleet
from rollsafe.observe.runfile import FORMAT, TRANSITION_KINDS, build_rows, load_run, write_run
from rollsafe.observe.stream import STREAM, RunStream, load_recorded, load_stream
from rollsafe.registry import FleetRegistry
from rollsafe.statemachines import GuardedMachine, ImmediateRecoveryMode
from rollsafe.statemachines.base import TransitionRecord
from rollsafe.verify.replay import TraceError, TruncatedTraceError, replay_run

HISTORY = 3  # transitions each machine keeps in memory in this module's run
SYNCS = 6


class Recorded:
    """The module's run: the fleet (closed), its run directory, what it did."""

    def __init__(self, fleet: RolloutFleet, run_dir: Path, tmp: Path) -> None:
        self.fleet = fleet
        self.run_dir = run_dir
        self.tmp = tmp


@pytest.fixture(scope="module")
def recorded(
    tiny_model_dir: Path,  # noqa: F811
    tiny_model_dir_b: Path,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Recorded]:
    """The streamed run (see the module), the fleet closed."""
    tmp = tmp_path_factory.mktemp("stream")
    run_dir = tmp / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GuardedMachine, "history_limit", HISTORY)
        mp.setattr(sync_module, "_REPORTS_KEPT", 2)
        mp.setattr(recovery_module, "_RESULTS_KEPT", 1)
        fleet, _journal = chaos_fleet(
            tiny_model_dir, tmp, [GroupSpec(1), GroupSpec(1)], run_dir=run_dir
        )
        try:
            trainer = Trainer(tiny_model_dir_b)
            with RequestLoop(fleet) as loop:
                assert wait_for(lambda: loop.served_total() >= 3)
                fleet.launcher("g1").kill_rank(0)  # before the first sync
                assert wait_recovery(fleet, "g1").status == "active"
                assert fleet.exporter is not None
                for version in range(1, SYNCS):
                    trainer.perturb(version)
                    assert fleet.sync_weights(trainer.weights(), version).ok
                    fleet.exporter.wait_hf_export(version, timeout=WAIT_S)
                fleet.launcher("g0").kill_rank(0)  # after them
                again = wait_recovery(fleet, "g0")
                assert again.status == "active" and again.export_version == SYNCS - 1, again
                trainer.perturb(SYNCS)
                assert fleet.sync_weights(trainer.weights(), SYNCS).ok
                fleet.exporter.wait_hf_export(SYNCS, timeout=WAIT_S)
            assert fleet.wait_recoveries(WAIT_S)
        finally:
            fleet.close()
        yield Recorded(fleet, run_dir, tmp)


def stream_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / STREAM).read_text().splitlines()]


def verify(path: Path) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["verify", "--trace", str(path)])
    return code, out.getvalue() + err.getvalue()


# ====================================================================== the whole run
def test_a_run_past_the_memory_bound_replays_whole_from_its_stream(recorded: Recorded) -> None:
    fleet = recorded.fleet
    # the run went past every in-memory bound
    assert fleet.transport is not None
    assert fleet.transport.registration.history[0].seq > 1
    assert len(fleet.transport.registration.history) == HISTORY
    firsts = {g.group_id: g.machine.history[0].seq for g in fleet.registry.groups()}
    assert all(seq > 1 for seq in firsts.values()), firsts
    assert fleet.sync is not None and fleet.sync.reports_dropped == SYNCS - 2
    assert fleet.recoveries_dropped == 1
    # the stream holds every transition of every machine, numbered from 1, and every row
    rows = stream_rows(recorded.run_dir)
    assert rows[0]["kind"] == "run" and rows[0]["record"] == "streamed"
    assert rows[-1]["kind"] == "end" and rows[-1]["fleet_version"] == SYNCS
    seqs: dict[tuple[str, str], list[int]] = {}
    for r in rows:
        if r["kind"] in TRANSITION_KINDS:
            seqs.setdefault((r["kind"], r["subject"]), []).append(r["seq"])
    for key, numbers in seqs.items():
        assert numbers == list(range(1, len(numbers) + 1)), key
    assert len(seqs[("registration", fleet.transport.name)]) > 2 * HISTORY
    assert [r["version"] for r in rows if r["kind"] == "sync"] == list(range(1, SYNCS + 1))
    assert sorted(r["group_id"] for r in rows if r["kind"] == "recovery") == ["g0", "g1"]
    # rollsafe verify --trace RUN_DIR replays the stream: every transition, no divergence
    said = assert_run_replays(recorded.run_dir)
    transitions = sum(len(n) for n in seqs.values())
    assert f"replayed {transitions} of {transitions}" in said and "partial" not in said
    # the fleet's timeline and record() read the stream too: whole
    assert len(fleet.timeline()) == transitions
    out = fleet.record(recorded.tmp / "recorded", svg=False)
    header = load_run(out).rows[0]
    assert header["record"] == "streamed" and header["cut"] == []
    assert_run_replays(out)


# ====================================================================== knowingly cut
def test_a_record_written_from_memory_is_refused_as_cut(recorded: Recorded) -> None:
    rows = build_rows(FromMemory(recorded.fleet))  # type: ignore[arg-type]
    header = rows[0]
    assert header["record"] == "memory"
    cut = header["cut"]
    assert any(c.startswith("registration ") for c in cut), cut
    assert any(c.startswith("syncs: the first 4") for c in cut), cut
    assert any(c.startswith("recoveries: the first 1") for c in cut), cut
    with pytest.raises(TruncatedTraceError, match="the record is cut") as info:
        replay_run(rows)
    assert info.value.line == 1 and list(info.value.cut) == cut
    path = recorded.tmp / "from-memory"
    write_run(path, rows)
    code, said = verify(path)
    assert code == 2 and "the record is cut" in said and "FleetConfig.run_dir" in said, said
    assert "divergence" not in said
    # an older record (no 'cut' in its run row): the numbering names the cut machine
    del rows[0]["cut"]
    with pytest.raises(TruncatedTraceError, match="history was cut") as older:
        replay_run(rows)
    assert isinstance(older.value, TraceError) and older.value.line is not None
    assert older.value.cut and "starts at transition" in older.value.cut[0]


# ====================================================================== a crashed fleet
def test_a_crashed_fleets_stream_replays_as_a_stated_partial_replay(
    recorded: Recorded, tmp_path: Path
) -> None:
    lines = (recorded.run_dir / STREAM).read_bytes().split(b"\n")
    rows = [json.loads(line) for line in lines if line]
    # the fleet dies right after its third sync's row: that line is the last whole one, and
    # the next was being written
    third = [n for n, r in enumerate(rows) if r["kind"] == "sync"][2]
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    half = lines[third + 1][: len(lines[third + 1]) // 2]
    (crashed / STREAM).write_bytes(b"\n".join(lines[: third + 1]) + b"\n" + half)
    run = load_stream(crashed)
    assert run.end is None and run.partial is not None and "cut mid-write" in run.partial
    assert load_recorded(crashed).partial == run.partial
    result = replay_run(run.rows, partial=run.partial)
    assert result.ok and result.replayed == result.transitions > 0, result.divergence
    assert result.partial == run.partial
    code, said = verify(crashed)
    assert code == 0 and "divergences: 0" in said, said
    assert "partial replay: the record ends before the run did" in said
    assert "the run's end was not checked" in said
    # with no cut line, the missing 'end' row alone makes it partial
    (crashed / STREAM).write_bytes(b"\n".join(lines[: third + 1]) + b"\n")
    assert "no 'end' row" in str(load_stream(crashed).partial)
    # a stream whose first line is not the run row is no record at all
    (crashed / STREAM).write_bytes(lines[1] + b"\n")
    code, said = verify(crashed)
    assert code == 2 and "the first line must be the 'run' row" in said, said


# ====================================================================== the seam
def test_a_subscriber_gets_every_transition_once_in_order_and_never_breaks_the_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(GuardedMachine, "history_limit", 3)
    mode = ImmediateRecoveryMode(enabled=False, rearm_after=1)
    early: list[TransitionRecord] = []
    assert mode.subscribe(early.append) == 0  # nothing taken yet
    events = ["enable", "disable"] * 4
    for event in events:
        mode.send(event)
    assert [r.seq for r in early] == list(range(1, len(events) + 1))
    assert [r.event for r in early] == events
    # subscribed late: it gets what the ring buffer still holds, and says where that starts
    late: list[TransitionRecord] = []
    assert mode.subscribe(late.append) == len(events) - 2
    assert [r.seq for r in late] == [len(events) - 2, len(events) - 1, len(events)]
    assert mode.subscribe(late.append) == 0  # the same subscriber again: nothing

    def broken(record: TransitionRecord) -> None:
        raise RuntimeError("a subscriber that fails")

    mode.subscribe(broken)
    mode.send("enable")  # taken despite it
    assert mode.state == "enabled" and early[-1].seq == len(events) + 1
    mode.unsubscribe(early.append)
    mode.unsubscribe(early.append)  # not subscribed: no error
    mode.send("disable")
    assert early[-1].seq == len(events) + 1 and late[-1].seq == len(events) + 2


# ====================================================================== bad input
def test_a_bad_run_dir_is_named_and_changes_nothing(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    def config(run_dir: Any) -> FleetConfig:
        return FleetConfig(model_path=tiny_model_dir, export_root=tmp_path / "e", run_dir=run_dir)

    with pytest.raises(FleetConfigError) as info:
        config(3)
    assert info.value.key == "run_dir" and "must be a path" in str(info.value)
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    with pytest.raises(FleetConfigError) as info:
        config(afile).validate()
    assert info.value.key == "run_dir" and "is not a directory" in str(info.value)
    with pytest.raises(FleetConfigError) as info:
        config(tmp_path / "no" / "such" / "run").validate()
    assert info.value.key == "run_dir" and "does not exist" in str(info.value)
    assert afile.read_text() == "not a directory" and not (tmp_path / "no").exists()
    config(tmp_path / "run").validate()  # made at start, not by the check
    assert not (tmp_path / "run").exists()


# ====================================================================== the writer alone
def _header(groups: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "kind": "run",
        "format": FORMAT,
        "subject": "fleet",
        "timestamp": time.time(),
        "groups": [g["id"] for g in groups],
        "model": {"groups": groups},
    }


def test_a_group_added_at_runtime_joins_the_streamed_records_groups(tmp_path: Path) -> None:
    registry = FleetRegistry()
    stream = RunStream(tmp_path, _header([{"id": "g0", "ranks": [0]}]))
    registry.add_listener(stream)
    for gid, rank in (("g0", 0), ("g1", 1)):  # g1: not in the run row, added later
        registry.add_group(gid, [rank], clients=())
        registry.report_member(gid, rank, healthy=True, weights_version=0)
        registry.send(gid, "launched", decided_by="launch_events")
    stream.close({"kind": "end", "subject": "fleet", "timestamp": time.time(), "groups": {}})
    run = load_stream(tmp_path)
    assert run.partial is None and run.rows[-1]["kind"] == "end"
    assert run.header is not None
    assert run.header["model"]["groups"] == [{"id": "g0", "ranks": [0]}, {"id": "g1", "ranks": [1]}]
    launched = [(r["subject"], r["seq"]) for r in run.rows if r["kind"] == "group"]
    assert launched == [("g0", 1), ("g1", 1)]
    assert [g["id"] for g in stream.groups] == ["g0", "g1"]
    # closed: a later transition is not written, and nothing breaks
    registry.send("g0", "fail", decided_by="judge_probe")
    assert len(load_stream(tmp_path).rows) == len(run.rows)


def test_a_stream_whose_disk_is_full_stops_and_never_raises(tmp_path: Path) -> None:
    (tmp_path / STREAM).symlink_to("/dev/full")
    stream = RunStream(tmp_path, _header([]))  # the header's write already fails
    assert stream.failed is not None and "No space left" in stream.failed
    mode = ImmediateRecoveryMode()
    stream.watch("mode", "immediate_recovery", mode)
    mode.send("enable")  # the machine is unaffected
    assert mode.state == "enabled" and stream.rows_written == 0
    stream.close({"kind": "end", "subject": "fleet", "timestamp": time.time(), "groups": {}})
    assert stream.closed and stream.rows_written == 0

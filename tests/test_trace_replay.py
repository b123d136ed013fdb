"""``rollsafe verify --trace``: a recorded run replayed through the verifier's model (#36).

One real run of a small reference-engine fleet (a 2-rank and a 1-rank group) is recorded once
for the module: a SIGKILL before the first sync (recovered from the start checkpoint), a sync, a
SIGKILL after it (recovered from its export), a second sync. The fleet streams it
(``FleetConfig.run_dir``) and ``record()`` writes it from the stream; the same run written from
memory (shorter than memory's bounds) is the same run and replays the same. Its replay takes
every recorded transition with no divergence, every invariant checked in every state; edited
copies of it plant what the model cannot produce (a restart that lands elsewhere than the
model's, a launch at another version) and the divergence is named at the step the clean replay
took that transition; a recording the replay cannot map is refused with exit 2. Seeded random
walks of the model itself, written as recordings (every action kind: crashes, probes, node
losses, placements, removals, timed-out restarts, pushes, syncs with failed registers and
updates, exports finishing, failing, abandoned, retention), replay with no divergence. Waits are
bounded by deadlines; nothing asserts a duration.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from chaos_support import WAIT_S, RequestLoop, chaos_fleet, wait_for, wait_recovery
from engine_helpers import (
    tiny_model_dir,  # noqa: F401  (fixture)
    tiny_model_dir_b,  # noqa: F401  (fixture)
)
from trace_support import FromMemory
from transport_helpers import Trainer

from rollsafe.cli import main
from rollsafe.fleet import GroupSpec, NcclSettings
from rollsafe.observe.runfile import build_rows, load_run, write_run
from rollsafe.verify import Action, FleetModel, ModelConfig
from rollsafe.verify.replay import ReplayResult, TraceError, replay_run, rows_of_model_run

#: two 1-rank groups launched, synced to v1, its export ready: the start of several runs below
_TWO_UP_AT_V1 = (
    Action("launch", (0, 0)),
    Action("launch", (1, 0)),
    Action("sync", (True, None, "fail")),
    Action("export_finish"),
)


@pytest.fixture(scope="module")
def recorded(
    tiny_model_dir: Path,  # noqa: F811
    tiny_model_dir_b: Path,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    """The recorded run (see the module)."""
    tmp = tmp_path_factory.mktemp("trace")
    fleet, _journal = chaos_fleet(tiny_model_dir, tmp, [GroupSpec(2), GroupSpec(1)])
    try:
        trainer = Trainer(tiny_model_dir_b)
        with RequestLoop(fleet) as loop:
            assert wait_for(lambda: loop.served_total() >= 3)
            fleet.launcher("g1").kill_rank(0)  # before the first sync
            first = wait_recovery(fleet, "g1")
            assert first.status == "active" and first.strategy == "immediate", first
            trainer.perturb(1)
            assert fleet.sync_weights(trainer.weights(), 1).ok
            assert fleet.exporter is not None
            fleet.exporter.wait_hf_export(1, timeout=WAIT_S)
            fleet.launcher("g0").kill_rank(1)  # after it
            second = wait_recovery(fleet, "g0")
            assert second.status == "active" and second.export_version == 1, second
            trainer.perturb(2)
            assert fleet.sync_weights(trainer.weights(), 2).ok
            fleet.exporter.wait_hf_export(2, timeout=WAIT_S)
        assert fleet.wait_recoveries(WAIT_S)
    finally:
        fleet.close()
    # the same run written from memory (how it is recorded without FleetConfig.run_dir)
    write_run(tmp / "memory", build_rows(FromMemory(fleet)))  # type: ignore[arg-type]
    return fleet.record(tmp / "run", svg=False)  # from the run it streamed


def replay(path: Path) -> ReplayResult:
    return replay_run(load_run(path).rows)


def edited(recorded: Path, tmp_path: Path, edit: Callable[[list[dict[str, Any]]], None]) -> Path:
    """A copy of the recorded run with ``edit`` applied to its rows."""
    out = shutil.copytree(recorded, tmp_path / "edited")
    path = out / "timeline.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    edit(rows)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def line_of(recorded: Path, match: Callable[[dict[str, Any]], bool]) -> int:
    rows = [json.loads(line) for line in (recorded / "timeline.jsonl").read_text().splitlines()]
    (line,) = [n for n, r in enumerate(rows, 1) if match(r)]
    return line


def step_of(result: ReplayResult, line: int) -> int:
    """The step of the clean replay that took the transition on ``line``."""
    (step,) = [s.number for s in result.steps if any(c.line == line for c in s.consumed)]
    return step


# ====================================================================== the clean run
def test_a_recorded_run_replays_through_the_model_with_no_divergence(
    recorded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = replay(recorded)
    assert result.ok, result.divergence.format() if result.divergence else ""
    assert result.replayed == result.transitions > 20  # every recorded transition taken
    assert result.steps[0].number == 0  # the model's start: the start checkpoint adopted
    assert result.states_checked == len(result.steps)  # the start and every step after it
    cfg = result.config
    assert cfg.rank_counts == (2, 1) and cfg.initial_version == 0 and cfg.engine == "reference"
    taken = [a for s in result.steps for a in s.actions]
    names = [a.name for a in taken]
    # the crash before the first sync: detected, claimed, restarted from the start checkpoint
    assert names.count("recover") == 2 and names.count("restart") == 2
    syncs = [a for a in taken if a.name == "sync"]
    assert [a.args[3] for a in syncs] == [1, 2]  # the recorded versions
    assert any(a.name == "export_step" for a in taken)  # the exporter's writer
    # the start export: adopted at step 0, superseded and deleted once v2 was ready
    start = [c for c in result.steps[0].consumed]
    assert [(c.subject, c.event) for c in start] == [("v0", "adopt")]
    retired = [
        (c.event, c.target)
        for s in result.steps
        for c in s.consumed
        if c.kind == "export" and c.subject == "v0"
    ]
    assert retired == [("adopt", "ready"), ("supersede", "superseded"), ("delete", "deleted")]
    # the command line says the same, exit 0
    assert main(["verify", "--trace", str(recorded)]) == 0
    out = capsys.readouterr().out
    assert "divergences: 0" in out and f"replayed {result.replayed} of" in out


def test_the_run_written_from_memory_is_the_same_run(recorded: Path) -> None:
    """A run shorter than memory's bounds: its record from memory is whole (``cut`` empty) and
    replays exactly as the streamed one does."""
    streamed, memory = load_run(recorded), load_run(recorded.parent / "memory")
    assert streamed.rows[0]["record"] == "streamed" and memory.rows[0]["record"] == "memory"
    assert streamed.rows[0]["cut"] == memory.rows[0]["cut"] == []

    def transitions(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
        kinds = ("group", "export", "registration", "mode")
        keys = ("kind", "subject", "seq", "event", "source", "target", "timestamp")
        return sorted(tuple(r[k] for k in keys) for r in rows if r["kind"] in kinds)

    assert transitions(streamed.rows) == transitions(memory.rows)
    assert [r["version"] for r in streamed.of("sync")] == [r["version"] for r in memory.of("sync")]
    a, b = replay(recorded), replay(recorded.parent / "memory")
    assert a.ok and b.ok and a.replayed == b.replayed == a.transitions == b.transitions
    assert [s.actions for s in a.steps] == [s.actions for s in b.steps]


# ====================================================================== planted divergences
def test_a_restart_the_model_cannot_take_is_named_at_its_step(
    recorded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def is_g0_restart(r: dict[str, Any]) -> bool:
        return r["kind"] == "group" and r["subject"] == "g0" and r["event"] == "restarted"

    line = line_of(recorded, is_g0_restart)
    step = step_of(replay(recorded), line)

    def land_pending(rows: list[dict[str, Any]]) -> None:
        for r in rows:
            if is_g0_restart(r):  # restarted from the ready export of v1: the model says active
                r["target"] = "pending_weights"

    bad = edited(recorded, tmp_path, land_pending)
    result = replay(bad)
    div = result.divergence
    assert div is not None and div.step == step, div
    assert div.recorded is not None and div.recorded.line == line
    assert (div.recorded.event, div.recorded.target) == ("restarted", "pending_weights")
    assert any("restarted recovering -> active" in e for e in div.expected), div.expected
    # the run around it, a CI log's only view of the run: the refused transition marked, the
    # ones before it replayed, and g0's recovery with its steps (the lease it took)
    marked = [c for c in div.context if c.startswith(">")]
    assert marked == [f"> {div.recorded}"], div.context
    before = div.context[: div.context.index(marked[0])]
    assert before and all(c.startswith("+") for c in before), div.context
    assert any(c.startswith("recovery g0: active") for c in div.context), div.context
    assert any(c.strip().startswith("lease#") and "ok: export v1" in c for c in div.context)
    assert main(["verify", "--trace", str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"divergence at step {step}" in out and f"line {line}" in out
    assert "the run around it" in out and f"> {div.recorded}" in out


def test_a_launch_at_another_version_is_named_at_its_step(recorded: Path, tmp_path: Path) -> None:
    def is_g1_launch(r: dict[str, Any]) -> bool:
        return r["kind"] == "group" and r["subject"] == "g1" and r["event"] == "launched"

    line = line_of(recorded, is_g1_launch)
    step = step_of(replay(recorded), line)

    def pending(rows: list[dict[str, Any]]) -> None:
        for r in rows:
            if is_g1_launch(r):  # the engines start on the start checkpoint, at the fleet's v0
                r["target"] = "pending_weights"

    div = replay(edited(recorded, tmp_path, pending)).divergence
    assert div is not None and div.step == step and div.recorded is not None
    assert div.recorded.line == line
    assert any("launched launching -> active" in e for e in div.expected), div.expected


def test_retiring_the_only_ready_export_is_a_divergence(recorded: Path, tmp_path: Path) -> None:
    """The start export superseded and deleted right after g1's claim, before any sync: it is
    then the only ready export (and the recovery's lease is on it); retention never does that."""

    def early(rows: list[dict[str, Any]]) -> None:
        claim = next(
            r
            for r in rows
            if r["kind"] == "group" and r["subject"] == "g1" and r["event"] == "claim"
        )
        for r in rows:
            if r["kind"] == "export" and r["subject"] == "v0" and r["event"] != "adopt":
                r["timestamp"] = claim["timestamp"] + 1e-4
                r["t"] = claim["t"] + 1e-4
        rows[1:-1] = sorted(rows[1:-1], key=lambda r: float(r["timestamp"]))

    div = replay(edited(recorded, tmp_path, early)).divergence
    assert div is not None and div.recorded is not None, div
    assert (div.recorded.subject, div.recorded.event) == ("v0", "supersede")
    assert any("retention" in e for e in div.expected), div.expected


def test_a_run_recorded_between_a_publish_and_its_retention_replays(
    recorded: Path, tmp_path: Path
) -> None:
    """The exporter publishes under its lock and runs retention under a second hold of it: a
    run recorded in between (the CI case: ``fleet.record`` while the writer of v2 had just
    published) has v2's ``publish`` and none of the retention after it. The model takes the
    publish alone; retention is its own step, which the run never took."""
    publish = line_of(
        recorded,
        lambda r: r["kind"] == "export" and r["subject"] == "v2" and r["event"] == "publish",
    )

    def stop_after_publish(rows: list[dict[str, Any]]) -> None:
        after = [
            r
            for r in rows[publish:]
            if r["kind"] == "export" and r["event"] in ("supersede", "delete")
        ]
        assert after, "the recorded run has retention after v2's publish"
        for r in after:
            rows.remove(r)

    result = replay(edited(recorded, tmp_path, stop_after_publish))
    assert result.divergence is None, result.format()
    assert result.ok


# ====================================================================== recordings it refuses
def test_a_recording_without_model_facts_or_with_a_cut_history_is_refused(
    recorded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_facts(rows: list[dict[str, Any]]) -> None:
        del rows[0]["model"]

    old = edited(recorded, tmp_path, no_facts)
    with pytest.raises(TraceError, match="no 'model' facts"):
        replay(old)
    assert main(["verify", "--trace", str(old)]) == 2
    assert "record the run again" in capsys.readouterr().err

    def cut(rows: list[dict[str, Any]]) -> None:
        first = next(r for r in rows if r["kind"] == "registration")
        rows.remove(first)  # the machine's history starts at its 2nd transition

    shutil.rmtree(tmp_path / "edited")
    with pytest.raises(TraceError, match="history was cut") as info:
        replay(edited(recorded, tmp_path, cut))
    assert info.value.line is not None
    assert main(["verify", "--trace", str(tmp_path / "nowhere")]) == 2
    assert "timeline.jsonl" in capsys.readouterr().err


# ====================================================================== the model's own runs
#: actions a fleet never takes (stray and racing events are the guards' tests)
_NOT_THE_FLEETS = {"stray", "stray_delete", "mode_toggle"}
WALK_CONFIGS = [
    ModelConfig(),
    ModelConfig(engine="reference", deltas=False),
    ModelConfig(group_ranks=(2, 1), initial_version=5, keep_last=2, targeted_push=False),
    ModelConfig(groups=3, ranks=1, immediate_recovery=False, removals=2),
    # the spares' promotions and refills (#37), without removals and node deaths to lose them
    ModelConfig(groups=1, ranks=1, spares=1, node_loss=False, removals=0),
]


def walk(config: ModelConfig, seed: int, length: int) -> list[Action]:
    """A seeded random run of the model: ``length`` actions that each changed something. A
    spare's cover, when one can happen, happens half the time (the fleet's pool covers a group
    the moment it leaves routing)."""
    rnd = random.Random(seed)
    model = FleetModel(config)
    taken: list[Action] = []
    for _ in range(length):
        actions = [
            a
            for a in model.enabled_actions()
            if a.name not in _NOT_THE_FLEETS and not (a.name == "sync" and a.args[2] != "fail")
        ]
        covers = [a for a in actions if a.name == "cover"]
        action = rnd.choice(covers if covers and rnd.random() < 0.5 else actions)
        if model.apply(action):
            taken.append(action)
    return taken


def test_every_run_of_the_model_replays_with_no_divergence() -> None:
    seen: set[str] = set()
    during = 0  # syncs whose update a recovering group's restart ended in (issue #36's race)
    for config in WALK_CONFIGS:
        for seed in range(8):  # enough walks that every action of a fleet is in one
            actions = walk(config, seed, 60)
            seen |= {a.name for a in actions}
            during += sum(1 for a in actions if a.name == "sync" and len(a.args) > 5)
            result = replay_run(rows_of_model_run(config, actions))
            assert result.ok, (config, seed, [str(a) for a in actions], result.divergence)
            assert result.replayed == result.transitions
    assert during > 0
    # every action a fleet takes was in some walk
    fleets = {a.name for c in WALK_CONFIGS for a in FleetModel(c).actions()} - _NOT_THE_FLEETS
    assert seen == fleets, sorted(fleets - seen)


def test_a_failed_pull_of_a_moved_export_replays_as_dummy_weights_and_a_push() -> None:
    """A Ray fleet whose node cannot read the trainer's path moves the export there; a pull
    that fails (or runs out of its share of the attempt under load) leaves dummy weights and a
    targeted push: the group comes back ``pending_weights``, then ``active``. The replay reads
    the recorded pull's outcome from the recovery row; without it the model (export ready,
    leased) says ``active`` at the restart, and the divergence is named there."""
    config = ModelConfig(groups=2, ranks=1, removals=0)
    run = [
        *_TWO_UP_AT_V1,
        Action("node_dies", ((1,),)),
        Action("node_lost"),
        Action("place", (1, False)),  # the pull of export v1 to g1's new node failed
        Action("restart", (1, True)),
        Action("push", (1, True)),
    ]
    model = FleetModel(config)
    states = []
    for action in run:
        assert model.apply(action), action
        states.append(model.groups[1].state)
    assert states[-2:] == ["pending_weights", "active"]
    rows = rows_of_model_run(config, run)
    assert any(r["kind"] == "recovery" for r in rows)
    result = replay_run(rows)
    assert result.ok and result.replayed == result.transitions, result.divergence
    # the same run with the pull's record lost: the model leases v1 and restarts from it
    bare = [r for r in rows if r["kind"] != "recovery"]
    div = replay_run(bare).divergence
    assert div is not None and div.recorded is not None
    assert (div.recorded.event, div.recorded.target) == ("restarted", "pending_weights")
    assert any("restarted recovering -> active" in e for e in div.expected), div.expected


@pytest.mark.parametrize("hook", ["offload_trainer", "onload_trainer"])
def test_a_sync_whose_trainer_hook_raises_replays(
    tiny_model_dir: Path,  # noqa: F811
    tiny_model_dir_b: Path,  # noqa: F811
    tmp_path: Path,
    hook: str,
) -> None:
    """A trainer-side exception in a colocated hook (the soak's fault). In ``offload_trainer``
    (after the register, before the update) nothing is updated and the fleet stays at its
    version; the next sync registers the same version again. In ``onload_trainer`` (after the
    update) the fleet moved on but no export is started. The replay reads the hook from the
    sync row's error and fails the model's ``Hook`` there; without that reading the model
    takes another sync and the divergence is named at that sync."""
    fleet, _journal = chaos_fleet(tiny_model_dir, tmp_path, [GroupSpec(1), GroupSpec(1)])
    try:
        trainer = Trainer(tiny_model_dir_b)
        trainer.perturb(1)
        assert fleet.sync_weights(trainer.weights(), 1).ok
        assert fleet.sync is not None

        def raising() -> None:
            raise RuntimeError(f"the trainer raised in {hook}")

        setattr(fleet.sync, hook, raising)
        trainer.perturb(2)
        failed = fleet.sync_weights(trainer.weights(), 2)
        assert failed.error is not None and failed.error.startswith(f"{hook} failed:"), failed
        after = 1 if hook == "offload_trainer" else 2
        assert failed.ok == (after == 2) and fleet.registry.fleet_version == after
        assert not failed.export_started
        setattr(fleet.sync, hook, None)
        trainer.perturb(after + 1)
        assert fleet.sync_weights(trainer.weights(), after + 1).ok
        assert fleet.wait_recoveries(WAIT_S)
    finally:
        fleet.close()
    run = fleet.record(tmp_path / "run", svg=False)
    result = replay(run)
    assert result.ok and result.replayed == result.transitions, result.divergence

    def forget_the_hook(rows: list[dict[str, Any]]) -> None:
        for r in rows:
            if r.get("kind") == "sync" and r.get("error"):
                r["error"] = None

    div = replay(edited(run, tmp_path, forget_the_hook)).divergence
    assert div is not None, "the model took the failed sync as an update"


class _GatherFailsHalfway(Mapping[str, torch.Tensor]):
    """A trainer's tensors whose gather raises part-way (the soak's ``trainer_exception`` in
    the register): read while the transport lists them, before its register begins."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._weights = weights

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._weights[name]

    def __len__(self) -> int:
        return len(self._weights)

    def __iter__(self) -> Iterator[str]:
        for i, name in enumerate(self._weights):
            if i == len(self._weights) // 2:
                raise RuntimeError(f"the trainer failed gathering {name!r}")
            yield name


def test_a_sync_whose_register_raised_before_it_began_replays(
    tiny_model_dir: Path,  # noqa: F811
    tiny_model_dir_b: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The trainer's gather raises while the transport lists the tensors, before its
    register begins: the registration records nothing, the version it published stays
    published, the fleet stays, and the sync's only transition is its judgement of the
    previous export. The replay reads the sync row's ``register of vN failed`` at that
    judgement and takes the model's sync whose register never began (no register follows
    here; in the hour soak a recovery's push came first); without the row's error it finds
    no sync to take (the hour soak's trace violation, seed 934291)."""
    fleet, _journal = chaos_fleet(tiny_model_dir, tmp_path, [GroupSpec(1), GroupSpec(1)])
    try:
        trainer = Trainer(tiny_model_dir_b)
        trainer.perturb(1)
        assert fleet.sync_weights(trainer.weights(), 1).ok
        assert fleet.exporter is not None
        fleet.exporter.wait_hf_export(1, timeout=WAIT_S)  # judged on time by the next sync
        published = fleet.transport.registration.published
        trainer.perturb(2)
        failed = fleet.sync_weights(_GatherFailsHalfway(trainer.weights()), 2)
        assert failed.error is not None and failed.error.startswith("register of v2 failed:")
        assert fleet.registry.fleet_version == 1 and not failed.export_started
        assert fleet.transport.registration.published == published
        assert fleet.wait_recoveries(WAIT_S)
    finally:
        fleet.close()
    run = fleet.record(tmp_path / "run", svg=False)
    rows = [json.loads(line) for line in (run / "timeline.jsonl").read_text().splitlines()]
    registers = [r["inputs"]["version"] for r in rows if r.get("event") == "begin_register"]
    assert 2 not in registers  # the register of v2 never began
    failed_at = next(r["t"] for r in rows if r.get("kind") == "sync" and r.get("version") == 2)
    # the run ends there: no register follows that the replay could take the sync from
    assert not [r for r in rows if r.get("kind") == "registration" and r["t"] > failed_at]
    result = replay(run)
    assert result.ok and result.replayed == result.transitions, result.divergence

    def forget_the_error(rows: list[dict[str, Any]]) -> None:
        for r in rows:
            if r.get("kind") == "sync" and r.get("version") == 2:
                r["error"] = None

    div = replay(edited(run, tmp_path, forget_the_error)).divergence
    assert div is not None and div.recorded is not None and div.recorded.kind == "mode"


def test_a_sync_with_a_delta_and_a_full_push_replays_as_two_updates(
    tiny_model_dir: Path,  # noqa: F811
    tiny_model_dir_b: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """With deltas on, each payload of a sync is one update of the registration (its own
    ``begin_update`` / ``update_done``): a group restarted from the ready export of the fleet's
    version holds no confirmed base, so the next sync sends the other group a delta and it the
    full version, two updates (the soak smoke's seed 425854). A sync that changed every weight
    sends no delta (not smaller than the full weights: every target falls back) and is one
    update again (seed 202352690): the replay reads that from the sync row's ``delta``. The
    model's syncs take both."""
    fleet, _journal = chaos_fleet(
        tiny_model_dir, tmp_path, [GroupSpec(1), GroupSpec(1)], transport=NcclSettings(delta=True)
    )
    try:
        trainer = Trainer(tiny_model_dir_b)
        assert fleet.exporter is not None
        for version in (1, 2):
            trainer.perturb(version)
            assert fleet.sync_weights(trainer.weights(), version).ok
            fleet.exporter.wait_hf_export(version, timeout=WAIT_S)
        fleet.launcher("g1").kill_rank(0)
        back = wait_recovery(fleet, "g1")
        assert back.status == "active" and back.export_version == 2, back  # no push: no base
        trainer.perturb(3)
        report = fleet.sync_weights(trainer.weights(), 3)
        assert report.ok, report
        kinds = {t: d["kind"] for t, d in report.delta["targets"].items()}
        assert kinds == {"g0": "delta", "g1": "full"}, report.delta
        fleet.exporter.wait_hf_export(3, timeout=WAIT_S)
        trainer.perturb(4, names=1_000)  # every weight
        report = fleet.sync_weights(trainer.weights(), 4)
        assert report.ok, report
        fell_back = {
            t: (d["kind"], "not smaller" in str(d["reason"]))
            for t, d in report.delta["targets"].items()
        }
        assert fell_back == {"g0": ("full", True), "g1": ("full", True)}, report.delta
        fleet.exporter.wait_hf_export(4, timeout=WAIT_S)
    finally:
        fleet.close()
    run = fleet.record(tmp_path / "run", svg=False)
    rows = load_run(run).rows
    updates = [
        r["inputs"]["targets"]
        for r in rows
        if r.get("kind") == "registration"
        and r.get("event") == "begin_update"
        and r["inputs"].get("targets") is not None
    ]
    # v3: g0's delta, then g1's full push; v4: both full together
    assert updates[-3:] == [[[0]], [[1]], [[0], [1]]], updates
    result = replay_run(rows)
    assert result.ok, result.divergence.format() if result.divergence else ""
    assert result.replayed == result.transitions


def test_a_group_lost_and_back_during_an_update_replays_as_a_new_incarnation() -> None:
    """A serving group stops answering while a sync's update runs (the soak's black-holed
    port): its probes time out, it fails, is claimed and restarts from the export of the
    fleet's version before the update ends; the update to the engine it lost failed. The sync
    credits nothing to the new incarnation (``moved``) and, once the fleet is at N, marks it
    stale (``settle_latecomers``); a push brings it to N. The replay offers that ``during``
    from the recording (the group's fail, claim and restart before the registration's
    ``update_done``, which failed its rank). With deltas on (the model's default) the sender
    planned the push before the loss: one delta payload to both groups, one update, and the
    lost group's base is forgotten only when the push reaches it (soak smoke seed 1983931085,
    where the model had planned a full push for it and a delta for the other: two updates)."""
    config = ModelConfig(groups=2, ranks=1, removals=0, failure_threshold=1)
    run = [
        *_TWO_UP_AT_V1,
        Action("sync", (True, None, "fail", None, ((0, 0),), 0)),  # g0 lost and back meanwhile
        Action("push", (0, True)),
    ]
    model = FleetModel(config)
    seen = []
    for action in run:
        assert model.apply(action), action
        seen.append((model.version, model.groups[0].state, model.delta[0].base))
    # the second sync: g0 restarted at v1 during it, then marked stale at v2, its delta base
    # forgotten (the next push to it is full); the push: active, based on v2
    assert seen[-2:] == [(2, "pending_weights", None), (2, "active", 2)], seen
    assert not model.check()
    rows = rows_of_model_run(config, run)
    g0 = [(r["event"], r["target"]) for r in rows if r["kind"] == "group" and r["subject"] == "g0"]
    assert ("mark_stale", "pending_weights") in g0 and ("restarted", "active") in g0, g0
    # the registration's updates per sync (a sync's ``sync`` row follows its transitions)
    per_sync: list[list[Any]] = []
    updates: list[Any] = []
    for r in rows:
        if r["kind"] == "registration" and r["event"] == "begin_update":
            updates.append(r["inputs"]["targets"])
        elif r["kind"] == "sync":
            per_sync.append(updates)
            updates = []
    assert per_sync[1] == [[[0], [1]]], per_sync  # one payload to both, planned before the loss
    assert model.delta[1].base == 2  # the other group took the delta
    result = replay_run(rows)
    assert result.ok and result.replayed == result.transitions, result.divergence


def _recorded_after(
    rest: list[dict[str, Any]], index: int, moved: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """A model run's rows with ``moved`` recorded right after ``rest[index]`` (a sync's
    ``register_ok``), each row's time rewritten to the order the run recorded them in."""
    recorded = [*rest[: index + 1], *moved, *rest[index + 1 :]]
    for i, r in enumerate(recorded):
        r["t"] = r["timestamp"] = i / 1000
    return recorded


def test_a_group_lost_after_a_syncs_register_and_before_it_read_the_groups_replays() -> None:
    """A serving engine hangs (the hour's seed 1635132711: a SIGSTOPped vLLM): a sync starts
    and registers, its pause of generation waits on the hung engine, and meanwhile the health
    round in flight fails the group and the recovery claims it; the sync then reads it
    ``recovering`` and updates nothing. The recording has the group's ``fail`` and ``claim``
    between the sync's ``register_ok`` and its next step; the replay takes them before the
    sync (they touch nothing the register reads). Fails without that candidate: no action of
    the model takes the sync's transitions (its sync would update the group)."""
    config = ModelConfig(groups=1, ranks=1, removals=0, failure_threshold=1)
    run = [
        Action("launch", (0, 0)),
        Action("sync", (True, None, "fail")),
        Action("export_finish"),
        Action("probe_timeout", (0,)),
        Action("recover", (0,)),
        Action("sync", (True, None, "fail")),
    ]
    rows = rows_of_model_run(config, run)
    lost = [r for r in rows if r["kind"] == "group" and r["event"] in ("fail", "claim")]
    assert [r["event"] for r in lost] == ["fail", "claim"]
    rest = [r for r in rows if all(r is not x for x in lost)]
    register_ok = max(i for i, r in enumerate(rest) if r.get("event") == "register_ok")
    assert not any(r.get("event") == "begin_update" for r in rest[register_ok:]), rest
    result = replay_run(_recorded_after(rest, register_ok, lost))
    assert result.ok and result.replayed == result.transitions, result.divergence


def test_a_node_lost_and_a_group_failed_inside_one_sync_before_it_read_them_replay() -> None:
    """Two groups moved inside one sync after its register and before it read them (the soak
    smoke's seed 656784: the sync's pause waited on a SIGSTOPped engine, g0's; a node's loss
    took g1 out and placed it again, then g0's probes failed it and the recovery claimed it).
    The replay takes each alone before a sync; it must take both: without that candidate the
    sync it offers updates one of them, and the run's next registration transition is the
    next sync's register."""
    config = ModelConfig(groups=2, ranks=1, removals=0, failure_threshold=1)
    run = [
        *_TWO_UP_AT_V1,
        Action("node_dies", ((1,),)),
        Action("node_lost"),
        Action("place", (1,)),
        Action("probe_timeout", (0,)),
        Action("recover", (0,)),
        Action("sync", (True, None, "fail")),
        Action("export_finish"),
        Action("sync", (True, None, "fail")),
    ]
    rows = rows_of_model_run(config, run)
    moved = [
        r
        for r in rows
        if r["kind"] == "group" and r["event"] in ("node_lost", "placed", "fail", "claim")
    ]
    assert [(r["subject"], r["event"]) for r in moved] == [
        ("g1", "node_lost"),
        ("g1", "placed"),
        ("g0", "fail"),
        ("g0", "claim"),
    ]
    rest = [r for r in rows if all(r is not x for x in moved)]
    registers = [i for i, r in enumerate(rest) if r.get("event") == "register_ok"]
    second = registers[1]  # the sync that read both groups out of routing: no update
    assert rest[second + 1].get("event") != "begin_update", rest[second + 1]
    result = replay_run(_recorded_after(rest, second, moved))
    assert result.ok and result.replayed == result.transitions, result.divergence


def test_a_group_lost_before_a_sync_read_and_another_back_during_its_update_replay() -> None:
    """Both kinds of move inside one sync: g1's engine hangs, its probes fail it and the
    recovery claims it after the sync's register and before the sync read the groups, and
    g0's restart (claimed earlier) ends while the sync updates g2 (the model's ``during``).
    The replay takes the loss before the sync and the restart inside it, in one candidate."""
    config = ModelConfig(groups=3, ranks=1, removals=0, failure_threshold=1)
    run = [
        Action("launch", (0, 0)),
        Action("launch", (1, 0)),
        Action("launch", (2, 0)),
        Action("sync", (True, None, "fail")),
        Action("export_finish"),
        Action("probe_timeout", (0,)),
        Action("recover", (0,)),
        Action("probe_timeout", (1,)),
        Action("recover", (1,)),
        Action("sync", (True, None, "fail", None, (), 0)),  # g0's restart ends in the update
    ]
    model = FleetModel(config)
    for action in run:
        assert model.apply(action), action
    assert [g.state for g in model.groups] == ["pending_weights", "recovering", "active"]
    rows = rows_of_model_run(config, run)
    lost = [
        r
        for r in rows
        if r["kind"] == "group" and r["subject"] == "g1" and r["event"] in ("fail", "claim")
    ]
    assert [r["event"] for r in lost] == ["fail", "claim"]
    rest = [r for r in rows if all(r is not x for x in lost)]
    registers = [i for i, r in enumerate(rest) if r.get("event") == "register_ok"]
    second = registers[1]
    after = [r["event"] for r in rest[second + 1 :] if r["kind"] in ("group", "registration")]
    assert after[:3] == ["restarted", "begin_update", "update_done"], after  # g2 updated
    result = replay_run(_recorded_after(rest, second, lost))
    assert result.ok and result.replayed == result.transitions, result.divergence


@pytest.mark.parametrize(
    ("archive", "interleaving"),
    [
        # a SIGSTOPped vLLM: failed by its probes and claimed while the sync's pause waited
        ("seed1635132711_vllm.tgz", ("fail", "claim")),
        # a node removed while the sync's pause waited on its engines; a restart into
        # ``pending_weights`` after a register, read by that sync and updated
        ("seed1027985072_vllm.tgz", ("node_lost", "placed", "restarted")),
        # the soak smoke (CI, 2026-12-06): both at once in sync v10, a node's loss re-placing
        # v1 and the SIGSTOPped v0 failed by its probes and claimed
        ("seed656784_vllm.tgz", ("node_lost", "placed", "fail", "claim")),
        # the third hour (seed 934291): a sync whose register raised before it began (the
        # trainer's gather), a recovery's push the registration's next transition
        ("seed934291_vllm.tgz", ("fail", "claim", "restarted")),
    ],
)
def test_the_hours_recorded_vllm_fleets_replay_with_no_divergence(
    tmp_path: Path, archive: str, interleaving: tuple[str, ...]
) -> None:
    """The vLLM fleets of three hour-long soaks (``benchmarks/soak.py --minutes 60``, the
    seeds in the names; ``fleet.json`` and the streamed ``stream.jsonl``, about 1,700
    transitions each) and of one smoke soak (``--smoke``, 178) replay whole with no
    divergence. Each has groups that moved inside a sync, after its register and before it
    read the groups (the transitions named), which the replay takes before that sync;
    without those candidates the first two and the smoke diverged (the soak's trace
    violation); the third diverged at a sync whose register never began
    (``test_a_sync_whose_register_raised_before_it_began_replays``)."""
    import tarfile

    with tarfile.open(Path(__file__).parent / "data" / "soak_runs" / archive) as tar:
        tar.extractall(tmp_path, filter="data")
    from rollsafe.observe.stream import load_recorded

    run = load_recorded(tmp_path / "vllm")
    assert run.partial is None
    rows = run.rows
    syncs = [r for r in rows if r.get("kind") == "registration" and r["event"] == "begin_register"]
    inside = set()
    for begin, nxt in itertools.pairwise(syncs):
        updates = [
            r["t"]
            for r in rows
            if r.get("kind") == "registration"
            and r["event"] == "begin_update"
            and begin["t"] < r["t"] < nxt["t"]
        ]
        end = min(updates, default=nxt["t"])
        inside |= {
            r["event"] for r in rows if r.get("kind") == "group" and begin["t"] < r["t"] < end
        }
    assert set(interleaving) <= inside, inside
    result = replay_run(rows, partial=run.partial)
    assert result.ok, result.divergence.format() if result.divergence else ""
    assert result.replayed == result.transitions > (100 if "656784" in archive else 1500)


def test_a_late_export_whose_writer_moved_on_before_the_abandon_replays() -> None:
    """Sync v3 judges the export of v2 late (``writing``): the mode is suspended, and the writer
    reaches ``committing`` before the sync's abandon (CI, ``test_chaos_exports``: the writer's
    ``shards_written`` in the judgement's millisecond, recorded after the mode's
    ``export_late``). The replay takes the writer's step, then the sync, which abandons the
    export from ``committing``; without that candidate the sync abandons it from ``writing``
    and diverges there."""
    config = ModelConfig(groups=2, ranks=1, removals=0)
    run = [
        *_TWO_UP_AT_V1,
        Action("sync", (True, None, "fail")),
        Action("export_step", (2, "shards_written")),
        Action("sync", (True, None, "fail")),
    ]
    model = FleetModel(config)
    for action in run:
        assert model.apply(action), action
    rows = rows_of_model_run(config, run)
    v2 = [(r["event"], r["source"]) for r in rows if r["kind"] == "export" and r["subject"] == "v2"]
    assert v2[-2:] == [("shards_written", "writing"), ("abandon", "committing")], v2
    written = next(
        i
        for i, r in enumerate(rows)
        if r["kind"] == "export" and r["subject"] == "v2" and r["event"] == "shards_written"
    )
    late = next(
        i for i, r in enumerate(rows) if r["kind"] == "mode" and r["event"] == "export_late"
    )
    assert written < late
    recorded = [*rows[:written], rows[late], *rows[written:late], *rows[late + 1 :]]
    for i, r in enumerate(recorded):  # the order the run recorded them in
        r["t"] = r["timestamp"] = i / 1000
    result = replay_run(recorded)
    assert result.ok and result.replayed == result.transitions, result.divergence


def test_an_export_published_between_a_claim_and_its_lease_replays() -> None:
    """A sync's update fails a group; the recovery claims it while that sync's export is still
    being written, and the writer publishes before the recovery reads the strategy's facts: the
    recovery leases the new export and the restart lands ``active`` (the soak smoke, CI
    2026-12-07, seed 489439, on a loaded machine). The recording has the claim, then the
    writer's ``shards_written`` and ``publish``, then the attempt's ``lease`` step. The replay
    takes the writer's steps before the recovery; without that candidate the model's recovery
    finds the export still ``writing``, restarts on dummy weights and lands
    ``pending_weights``, and the run's ``restarted`` into ``active`` diverges."""
    config = ModelConfig(groups=2, ranks=1, removals=0, failure_threshold=1)
    run = [
        *_TWO_UP_AT_V1,
        Action("sync", (True, None, "fail")),  # v2: its export is being written
        Action("probe_timeout", (0,)),
        Action("export_finish"),
        Action("recover", (0,)),  # leases the export of v2
        Action("restart", (0, True)),
    ]
    model = FleetModel(config)
    for action in run:
        assert model.apply(action), action
    assert model.version == 2 and model.groups[0].state == "active"
    rows = rows_of_model_run(config, run)

    def index(kind: str, subject: str, event: str) -> int:
        return next(
            i
            for i, r in enumerate(rows)
            if (r["kind"], r["subject"], r.get("event")) == (kind, subject, event)
        )

    claim = index("group", "g0", "claim")
    writer = [index("export", "v2", "shards_written"), index("export", "v2", "publish")]
    assert writer[1] < claim
    moved = [rows[i] for i in writer]
    rest = [r for i, r in enumerate(rows) if i not in writer]
    at = rest.index(rows[claim]) + 1
    recorded = [*rest[:at], *moved, *rest[at:]]
    for i, r in enumerate(recorded):  # the order the run recorded them in
        r["t"] = r["timestamp"] = i / 1000
    claimed_at, published_at = rows[claim]["timestamp"], moved[-1]["timestamp"]
    steps = [
        {"name": "claim", "ok": True, "started_at": claimed_at, "seconds": 0.0, "detail": ""},
        {"name": "lease", "ok": True, "started_at": published_at + 0.0001, "seconds": 0.0},
    ]
    recovery = {"kind": "recovery", "subject": "g0", "group_id": "g0", "steps": steps}
    with_lease = [*recorded[:-1], {**recovery, "t": 0.5, "timestamp": 0.5}, recorded[-1]]
    result = replay_run(with_lease)
    assert result.ok and result.replayed == result.transitions, result.divergence
    # without the attempt's lease step the replay cannot know: the restart diverges
    div = replay_run(recorded).divergence
    assert div is not None and div.recorded is not None, div
    assert (div.recorded.event, div.recorded.target) == ("restarted", "active"), div.format()

"""Diagrams: generated from the classes, complete, current on disk, and valid for mermaid itself."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from rollsafe import diagrams
from rollsafe.cli import main
from rollsafe.statemachines import MACHINES

ROOT = Path(__file__).resolve().parents[1]
VALIDATOR = ROOT / "tools" / "mermaid" / "validate.mjs"
NODE_MODULES = ROOT / "tools" / "mermaid" / "node_modules" / "mermaid"


def _mermaid(*files: Path) -> subprocess.CompletedProcess[str]:
    node = shutil.which("node")
    if node is None or not NODE_MODULES.exists():
        pytest.fail(
            "mermaid's parser is required: install Node.js and run `make test` "
            "(it runs `npm ci` in tools/mermaid)"
        )
    return subprocess.run(
        [node, str(VALIDATOR), *map(str, files)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("cls", MACHINES, ids=lambda c: c.__name__)
def test_diagram_has_every_state_event_and_guard(cls: type) -> None:
    text = diagrams.machine_mermaid(cls)
    assert text.startswith("stateDiagram-v2")
    for state in cls.states:
        assert f'state "{state.id}" as {state.id}' in text
    for source, target, event, guards in diagrams.transitions_of(cls):
        label = event + (f" [{' and '.join(guards)}]" if guards else "")
        assert f"{source} --> {target} : {label}" in text
    assert "Invariants" in text


def test_overview_covers_every_event_of_every_machine() -> None:
    text = diagrams.overview_mermaid()
    for cls in MACHINES:
        for event in cls._events:
            assert str(event) in text, f"{cls.__name__}.{event} is fed by nobody"


def test_feed_table_is_checked_against_the_classes() -> None:
    bogus = (*diagrams.FEEDS, diagrams.Feed("X", "WorkerGroupLifecycle", ("no_such_event",)))
    with pytest.raises(diagrams.DiagramCheckError, match="no_such_event"):
        diagrams.overview_mermaid(feeds=bogus)
    partial = tuple(f for f in diagrams.FEEDS if f.component != "RolloutFleet")
    with pytest.raises(diagrams.DiagramCheckError, match="launched"):
        diagrams.overview_mermaid(feeds=partial)


def test_committed_diagrams_are_current() -> None:
    assert diagrams.check(ROOT / "diagrams", ROOT / "README.md") == []


def test_check_names_a_stale_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "diagrams"
    assert main(["diagrams", "--out", str(out), "--no-readme"]) == 0
    assert main(["diagrams", "--out", str(out), "--no-readme", "--check"]) == 0
    stale = out / "export_lifecycle.md"
    stale.write_text(stale.read_text().replace("publish", "publysh"))
    assert main(["diagrams", "--out", str(out), "--no-readme", "--check"]) == 1
    err = capsys.readouterr().err
    assert "export_lifecycle.md" in err and "differs" in err
    (out / "worker_group_lifecycle.md").unlink()
    assert main(["diagrams", "--out", str(out), "--no-readme", "--check"]) == 1
    assert "worker_group_lifecycle.md (missing)" in capsys.readouterr().err


def test_every_generated_diagram_parses_in_mermaid(tmp_path: Path) -> None:
    diagrams.write_all(tmp_path)
    files = sorted(tmp_path.glob("*.md"))
    assert len(files) == len(MACHINES) + 1
    result = _mermaid(*files, ROOT / "README.md")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok ") == len(files) + len(MACHINES)


def test_mermaid_parser_rejects_a_broken_diagram(tmp_path: Path) -> None:
    # Negative control: the validator must be able to fail.
    broken = tmp_path / "broken.md"
    text = diagrams.machine_markdown(MACHINES[0]).replace("-->", "-- >", 1)
    broken.write_text(text.replace("stateDiagram-v2", "stateDiagram-v2\n    state {{{"))
    result = _mermaid(broken)
    assert result.returncode == 1
    assert "error" in result.stdout


def test_sender_table_is_generated_from_the_policy_declarations() -> None:
    from rollsafe import policy

    table = diagrams.sender_table()
    assert table in diagrams.overview_markdown()
    for sender in policy.SENDERS:
        assert f"`{sender.module}`" in table
        if sender.decided_by is not None:
            assert callable(getattr(policy, sender.decided_by))
            assert f"`policy.{sender.decided_by}`" in table
    # The rows the old hand-written table got wrong: who really sends these.
    rows = {(s.component, s.machine): s for s in policy.SENDERS}
    transport = rows[("WeightTransport", "CheckpointRegistration")]
    assert transport.module == "rollsafe/transports/base.py"
    assert rows[("RolloutFleet", "WorkerGroupLifecycle")].events == ("launched",)
    assert rows[("RolloutFleet", "WorkerGroupLifecycle")].module == "rollsafe/fleet/fleet.py"

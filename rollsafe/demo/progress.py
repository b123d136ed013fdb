"""What the demo prints while it runs: the live rollout line and each step's line.

Owns the short snippets both lines share: the groups' states (with their warm standbys and,
with ``--nodes``, the node each group is placed on), the requests continued so far and the last
exports' states.
"""

from __future__ import annotations

from typing import Any

from rollsafe.demo.state import DemoRun, StepRecord

__all__ = ["continued", "exports", "print_step", "rollout_line", "states"]


def states(fleet: Any, node_names: dict[str, str] | None = None) -> str:
    """``g0=active g1=inactive ...``; with warm standbys each group's standby state too
    (``g0=active/sb:ready``: ``ready``, ``warming`` while it imports, ``none``); with
    ``node_names`` (``--nodes``: node id -> ``worker1``...) the node each group is placed on
    (``g1=recovering@worker2``; ``@-`` while it holds no placement)."""
    standby = bool(getattr(fleet.config, "warm_standby", False))
    return " ".join(
        f"{g.group_id}={g.state}"
        + (f"/sb:{g.standby_state}" if standby else "")
        + (_node(fleet, g.group_id, node_names) if node_names else "")
        for g in fleet.registry.groups()
    )


def _node(fleet: Any, gid: str, node_names: dict[str, str]) -> str:
    node_id = getattr(fleet.engine(gid), "node_id", None)
    return "@" + ("-" if node_id is None else node_names.get(node_id, str(node_id)[:8]))


def continued(fleet: Any) -> str:
    """``continued 3 (kept 412 tok, regenerated 0, resent whole 1)``: requests continued
    after their group failed or a sync aborted them, the tokens they kept, the tokens started
    over (baseline), and the short requests read whole that a failure made send again
    (``Router.whole_up_to``: the tokens their engine had made are not known)."""
    c = fleet.router.stats()["continuation"]
    return (
        f"continued {c['after_failure'] + c['after_abort']} (kept {c['tokens_kept']} tok,"
        f" regenerated {c['tokens_regenerated']}, resent whole {c['whole_lost']})"
    )


def exports(fleet: Any) -> str:
    by_version = fleet.export_states()
    return ", ".join(f"v{v} {s}" for v, s in list(by_version.items())[-2:]) or "none"


def rollout_line(run: DemoRun, step: int, elapsed: float) -> str:
    """The live line, once a second of a step's rollout."""
    n_ok, n_bad = run.load.so_far()
    return (
        f"  step {step} rollout {elapsed:4.1f}s | {states(run.fleet, run.node_names)} |"
        f" served {n_ok} failed {n_bad} | {continued(run.fleet)} |"
        f" export {exports(run.fleet)}"
    )


def print_step(run: DemoRun, record: StepRecord) -> None:
    """The line after each step: loss, requests, the sync, states, exports, checksums (and with
    ``--engine vllm`` the probe)."""
    print(
        f"step {record['step']}/{run.opts.steps}: loss {record['loss']:.3f} |"
        f" served {record['served']} failed {record['failed']} | sync v{record['step']}"
        f" {'ok' if record['sync'].get('ok') else 'FAILED'}"
        f" {sum(record['sync'].get('timings', {}).values()):.2f}s |"
        f" {states(run.fleet, run.node_names)} | export {exports(run.fleet)} |"
        f" checksums {sorted(set(record['checksums'].values()))}"
        + (f" | probe {_probe(record['probe'])}" if "probe" in record else "")
    )


def _probe(verdicts: dict[str, str]) -> str:
    """``alike`` when every probed group answered like the reference group, else the verdicts."""
    if all(v == "reference" or v.startswith("alike") for v in verdicts.values()):
        return f"alike ({len(verdicts)} groups)"
    return str(verdicts)

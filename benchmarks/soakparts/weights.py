"""Every engine's weights equal to the trainer's: after each sync, and when a group comes back.

:func:`check_groups` checks the ``active`` groups of one fleet against the trainer's tensors of
the fleet's version:

* the reference engine: its weight checker against the trainer's tensors, tensor by tensor in
  SGLang's layout (``fleet.check_weights``: every tensor ``equal``);
* the real vLLM: the layout-aware digests (``fleet.check_weights``: nothing ``differs`` or is
  missing; what a CPU vLLM reports no data for is ``no_data``) and the behavioural probe
  (:func:`rollsafe.probe.record_answers`: the greedy tokens of the fixed prompts), replayed on
  the trainer's version by the token check (each token the argmax of that version).

A group that fails its check is looked at again: when it left ``active`` or the fleet moved to
another version meanwhile (a fault hit it during the check) the check is void, not a violation.
An engine that did not answer at all (a SIGKILL that landed after its update was acknowledged)
is given the fleet's detection bound (:func:`detection_bound_s`) to leave ``active`` first; one
still routable after it is asked again and judged by that answer (an engine cut off for less
than the bound, a black-holed port, answers again); still silent, or wrong, is a violation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from tokens import Answer, TokenCheck

__all__ = ["check_groups"]


#: how a problem that is an engine not answering starts (see :func:`check_groups`)
_SILENT = ("no answer", "probe failed")


def detection_bound_s(fleet: Any) -> float:
    """How long the fleet's health probes may take to take a dead engine out of routing: a
    failed probe each interval, each bounded by its timeout, ``failure_threshold`` of them,
    plus one interval and a second of slack."""
    hs = fleet.config.health
    return hs.failure_threshold * (hs.interval_s + hs.timeout_s) + hs.interval_s + 1.0


def check_groups(
    name: str,
    fleet: Any,
    trainer: Any,
    tokens: TokenCheck,
    violation: Callable[[str, str], None],
    groups: Sequence[str] | None = None,
) -> dict[str, int]:
    """Check ``groups`` (default: every group) of ``fleet`` that are ``active`` now; returns
    ``{"equal": n, "void": n, "unequal": n}``."""
    registry = fleet.registry
    version = registry.fleet_version
    weights = trainer.at(version)
    counts = {"equal": 0, "void": 0, "unequal": 0}
    if weights is None:
        return counts
    wanted = [g for g in (groups or fleet.group_ids) if registry.get(g).state == "active"]
    if not wanted:
        return counts
    problems = _problems(name, fleet, weights, version, tokens, wanted)
    # an engine that did not answer may have died after the read above (a fault's SIGKILL that
    # lands once its update was acknowledged): that is the fleet's detection window, not wrong
    # weights, as long as the health probes take it out within their bound
    silent = {g for g, why in problems.items() if why.startswith(_SILENT)}
    deadline = time.monotonic() + detection_bound_s(fleet)
    while silent and time.monotonic() < deadline:
        silent = {g for g in silent if registry.get(g).state == "active"}
        if silent:
            time.sleep(0.1)
    # one still routable after the bound is asked again: an engine cut off for less than the
    # bound (a port black-holed while the check asked it: the seed 489439's smoke on a loaded
    # machine, 36 s of black hole, three probes of 12 s) answers again, and is judged by that
    # answer; one that is still silent, or wrong, is a violation
    if silent and registry.fleet_version == version:
        again = _problems(name, fleet, weights, version, tokens, sorted(silent))
        for gid in silent:
            if gid in again:
                problems[gid] = f"{problems[gid]}; asked again after the bound: {again[gid]}"
            else:
                del problems[gid]
    for gid in wanted:
        if gid not in problems:
            counts["equal"] += 1
            continue
        group = registry.get(gid)
        if group.state != "active" or registry.fleet_version != version:
            counts["void"] += 1
            continue
        counts["unequal"] += 1
        violation("weights", f"{name}/{gid} at v{version}: {problems[gid]}")
    return counts


def _problems(
    name: str,
    fleet: Any,
    weights: Any,
    version: int,
    tokens: TokenCheck,
    wanted: Sequence[str],
) -> dict[str, str]:
    """What is wrong with each of ``wanted`` (absent: nothing) against ``weights`` of
    ``version``: no answer, digests that differ, or a probe's tokens."""
    from rollsafe.probe import record_answers

    registry = fleet.registry
    problems: dict[str, str] = {}
    checks = fleet.check_weights(weights)
    if fleet.config.engine_spec.kind == "reference":
        for gid in wanted:
            check = checks.get(gid)
            if check is None:
                problems[gid] = f"{_SILENT[0]} from its weight checker (v{version})"
            elif not check.equal:
                problems[gid] = f"digests: {check.summary()} (v{version})"
    else:
        for gid in wanted:
            check = checks.get(gid)
            if check is None:
                problems[gid] = f"{_SILENT[0]} from its weight checker"
                continue
            kinds = set(check.counts())
            if not kinds <= {"equal", "no_data"} or "equal" not in kinds:
                problems[gid] = f"digests: {check.summary()}"
                continue
            group = registry.get(gid)
            try:
                answers = record_answers(group.client, timeout=120)
            except Exception as exc:
                problems[gid] = f"{_SILENT[1]}: {type(exc).__name__}: {exc}"
                continue
            bad: list[str] = []
            for a in answers.answers:
                segment = {
                    "group": gid,
                    "weights_version": str(version),
                    "token_range": [0, len(a.output_ids)],
                }
                tokens.check_now(
                    Answer(name, "probe", a.prompt, a.output_ids, (segment,)), bad.append
                )
            if bad:
                problems[gid] = f"probe: {bad[0]}"
    return problems

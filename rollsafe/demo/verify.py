"""Verify: the invariants the demo checks; each break is appended to ``run.failures``.

* :func:`check_start`: the engines start on the trainer's weights;
* :func:`check_step`: after each step's sync, every ``active`` engine serves the trainer's
  weights: its own weight checker, tensor by tensor in its own layout, against the weights the
  sync fetched from the trainer (``RolloutFleet.check_weights``; the fetch itself is checked
  against the digest the trainer actor computed): SGLang's fused parameters per TP rank,
  vLLM's likewise, ``unverified`` where a checker reported no data for some tensors (a CPU
  vLLM's linear weights) and none differed; with ``--engine vllm`` also the behavioural probe
  (:mod:`rollsafe.probe`): every ``active`` group answers the fixed prompts with the same
  greedy tokens and logprobs as the first one that did not crash, so the weights the digests
  leave unverified are shown to act alike;
* :func:`check_final`: once the recoveries finished, every group is ``active`` on the trainer's
  weights (vLLM: and the recovered group answers the probe like the survivors), the last
  version's export became ready, and no request was admitted to a non-``active`` group;
* :func:`check_recovered`: the crashed group became ``active`` again.

Any failure makes the demo exit with status 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rollsafe.demo.setup import VLLM_START_S
from rollsafe.demo.state import DemoRun, StepRecord

if TYPE_CHECKING:
    from rollsafe.digest_check import DigestCheck

__all__ = ["check_final", "check_probe", "check_recovered", "check_start", "check_step"]

#: seconds one probe request may take (a real vLLM on a loaded 2-core machine)
PROBE_TIMEOUT_S = 120.0


def _trainer_weights(run: DemoRun) -> Mapping[str, Any]:
    """The trainer's current weights: those the last sync fetched (the trainer has not stepped
    since), else fetched now (the start)."""
    if run.weights is None:
        with run.timed("fetch weights (object store)" if run.actor else "weights snapshot"):
            run.weights = run.trainer.weights()
    return run.weights


def _checks(run: DemoRun) -> dict[str, DigestCheck | None]:
    """Every group's engine against the trainer's weights, tensor by tensor in the engine's
    own layout (None: no answer)."""
    return run.fleet.check_weights(_trainer_weights(run))


def _verdict(check: DigestCheck | None) -> str:
    """``match``, ``MISMATCH`` or ``unverified (<summary>)`` for one active group."""
    if check is None or check.verdict == "differs":
        return "MISMATCH"
    return "match" if check.equal else f"unverified ({check.summary()})"


def _summary(check: DigestCheck | None) -> str:
    return "no checksum answer" if check is None else check.summary()


def check_probe(run: DemoRun, where: str) -> dict[str, str]:
    """vLLM only (else ``{}``): the probe on every ``active`` group against the first ``active``
    group that did not crash; per group ``reference``, ``alike (...)`` or ``DIFFERS (...)``
    (appended to ``run.failures`` with ``where``)."""
    if not run.vllm:
        return {}
    from rollsafe.probe import probe_engines, record_answers

    fleet = run.fleet
    crashed = run.crash["group"] if run.crash else None
    active = {
        g.group_id: g.client
        for g in fleet.registry.groups()
        if g.state == "active" and g.client is not None
    }
    if not active:
        run.failures.append(f"{where}: no active group to probe")
        return {}
    ref_gid = next((gid for gid in active if gid != crashed), next(iter(active)))
    out: dict[str, str] = {}
    with run.timed("verify probe (greedy tokens, logprobs)"):
        try:
            reference = record_answers(active[ref_gid], timeout=PROBE_TIMEOUT_S)
        except Exception as exc:
            run.failures.append(f"{where}: probe: {ref_gid} did not answer: {exc}")
            return {ref_gid: f"DIFFERS (no answer: {exc})"}
        out[ref_gid] = "reference"
        others = {gid: c for gid, c in active.items() if gid != ref_gid}
        for gid, verdict in probe_engines(others, reference, timeout=PROBE_TIMEOUT_S).items():
            summary = verdict.summary().split(": ", 1)[-1]
            out[gid] = f"alike ({summary})" if verdict.ok else f"DIFFERS ({summary})"
            if not verdict.ok:
                run.failures.append(f"{where}: probe: {gid} answers unlike {ref_gid}: {summary}")
    return out


def check_start(run: DemoRun) -> None:
    """The engines start on the trainer's weights."""
    bad = {gid: _summary(c) for gid, c in _checks(run).items() if _verdict(c) == "MISMATCH"}
    if bad:
        run.failures.append(f"step 0: engines do not start on the trainer's weights: {bad}")
    run.probes["start"] = check_probe(run, "step 0")


def check_step(run: DemoRun, record: StepRecord) -> None:
    """Every ``active`` engine == the trainer after the step's sync; per group in the record
    (``match``, ``MISMATCH``, ``unverified (...)`` where the engine's checker reported no data
    for some tensors and none differed, or ``not serving (<state>)``)."""
    step, fleet = record["step"], run.fleet
    with run.timed(f"verify checksums (engines, {run.who})"):
        checks: dict[str, str] = {}
        for gid, check in _checks(run).items():
            state = fleet.registry.get(gid).state
            if state != "active":
                checks[gid] = f"not serving ({state})"
                continue
            checks[gid] = _verdict(check)
            if checks[gid] == "MISMATCH":
                run.failures.append(
                    f"step {step}: {gid}'s checksums are not the trainer's: {_summary(check)}"
                )
        record["checksums"] = checks
    if run.vllm:
        record["probe"] = check_probe(run, f"step {step}")


def check_final(run: DemoRun) -> None:
    """After the load stopped: wait for the recoveries, then every group back and on the
    trainer's weights, the last export ready (timed together as settle), and no request
    admitted to a non-``active`` group."""
    fleet, steps = run.fleet, run.opts.steps
    with run.timed("settle (recoveries, last export)"):
        fleet.wait_recoveries(timeout=VLLM_START_S if run.vllm else 120.0)
        for gid, got in _checks(run).items():
            state = fleet.registry.get(gid).state
            verdict = _verdict(got)
            check = "match" if state == "active" and verdict != "MISMATCH" else f"{state}/{verdict}"
            run.final_checks[gid] = check
            if check != "match":
                run.failures.append(f"final: {gid} is {state} with checksums {_summary(got)}")
        # the recovered group (a fresh engine on the export) answers like the survivors
        run.probes["final"] = check_probe(run, "final")
        exporter = fleet.exporter
        if exporter is not None:
            try:
                exporter.wait_hf_export(steps, timeout=60)
            except Exception as exc:
                run.failures.append(f"final export v{steps} did not become ready: {exc}")
    run.dispatch = fleet.registry.dispatch_counts()
    run.bad_dispatch = {g: c for g, c in run.dispatch.items() if set(c) - {"active"}}
    if run.bad_dispatch:
        run.failures.append(f"requests admitted to non-active groups: {run.bad_dispatch}")

    # The named invariants the verifier and the property tests check, on the live fleet
    # (while it is up and before report.collect reads its timeline).
    from rollsafe.invariants import check_all

    run.failures.extend(f"invariant {v}" for v in check_all(fleet.picture()))


def check_recovered(run: DemoRun, recovery: dict[str, Any]) -> None:
    """The crashed group became ``active`` again after the crash (``recovery``: the report's
    recovery figures)."""
    if run.crash is not None and recovery["active_again_at"] is None:
        run.failures.append(
            f"{run.crash['group']} never became active again after the crash"
            + "".join(_recovery_steps(recovery.get("coordinator") or []))
        )


def _recovery_steps(recoveries: list[dict[str, Any]]) -> list[str]:
    """Each recovery of the group and its steps, one line each (what to read first when a
    group did not come back)."""
    lines = []
    for rec in recoveries:
        lines.append(
            f"\n      recovery: {rec.get('status')} ({rec.get('strategy')}), "
            f"{rec.get('attempts')} attempt(s): {rec.get('reason')}"
        )
        for st in rec.get("steps") or []:
            mark = "ok" if st.get("ok") else "FAILED"
            detail = f": {st['detail']}" if st.get("detail") else ""
            lines.append(
                f"\n        #{st.get('attempt')} {st.get('name'):<10} {mark:<6}"
                f" {float(st.get('seconds') or 0.0):7.2f}s{detail}"
            )
    return lines

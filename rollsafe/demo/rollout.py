"""Rollout: the load generator and each step's rollout phase, where the crash happens.

Owns :class:`RolloutLoad` (client threads sending completions to the fleet's rollout gateway
with the ``openai`` SDK, token-id prompts as an RL framework sends them, while a step's rollout
is on; each answer's ``x-rollsafe-group`` header names the group that served it),
:func:`start_load` and :func:`rollout`: one step's rollout phase (``--rollout-s`` seconds of
load, the live line once a second, and at ``--crash-at`` the SIGKILL of rank 1 of the 2-rank
group, or with ``--engine vllm`` of the second group's vLLM server process: a real engine does
not say which process is which rank), which opens the step's record. With ``--nodes`` the crash
is the removal of the second group's worker node (:func:`rollsafe.demo.nodes.remove_node`), and
that step's rollout goes on past ``--rollout-s`` until every group that was on the node is
``active`` again (at most :data:`~rollsafe.demo.nodes.BACK_TIMEOUT_S`), a line a second showing
where each group is.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from typing import Any

from rollsafe.demo.options import CRASH_DELAY_S, CRASH_GROUP_INDEX
from rollsafe.demo.progress import rollout_line
from rollsafe.demo.state import DemoRun, StepRecord

__all__ = ["THINK_S", "RolloutLoad", "rollout", "start_load"]

THINK_S = 0.02  # pause between one client's requests


class RolloutLoad:
    """Background threads sending completions through the fleet's gateway while ``active`` is
    set (one ``openai.OpenAI`` client, shared: it is thread-safe)."""

    def __init__(self, fleet: Any, workers: int, seed: int = 0, max_new_tokens: int = 8) -> None:
        import openai

        self.fleet = fleet
        self.max_new_tokens = max_new_tokens
        self.client = openai.OpenAI(
            base_url=f"{fleet.gateway_url}/v1",
            api_key="rollsafe-demo",  # the demo's gateway asks for none; the SDK wants one
            max_retries=0,  # a failed request counts as failed: the gateway did the retrying
            timeout=fleet.config.request_timeout_s + 60.0,
        )
        models = self.client.models.list()
        self.model = models.data[0].id
        self.active = threading.Event()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.served: Counter[str] = Counter()
        self.failed = 0
        self.errors: list[str] = []
        self.threads = [
            threading.Thread(target=self._run, args=(seed + i,), daemon=True, name=f"rollout-{i}")
            for i in range(workers)
        ]
        for t in self.threads:
            t.start()

    def _run(self, seed: int) -> None:
        import openai

        rng = random.Random(seed)
        while not self.stop.is_set():
            if not self.active.wait(0.1):
                continue
            prompt = [rng.randrange(1, 500) for _ in range(8)]
            try:
                raw = self.client.completions.with_raw_response.create(
                    model=self.model,
                    prompt=prompt,
                    max_tokens=self.max_new_tokens,
                    extra_body={"return_token_ids": True},
                )
                raw.parse()
            except openai.OpenAIError as exc:
                with self.lock:
                    self.failed += 1
                    if len(self.errors) < 20:
                        self.errors.append(str(exc)[:300])
                time.sleep(0.05)
                continue
            with self.lock:
                self.served[raw.headers.get("x-rollsafe-group", "?")] += 1
            time.sleep(THINK_S)  # leave CPU to the engines (and a restarting one) on 2 cores

    def so_far(self) -> tuple[int, int]:
        """(served, failed) since the last :meth:`take`."""
        with self.lock:
            return sum(self.served.values()), self.failed

    def take(self) -> tuple[dict[str, int], int]:
        with self.lock:
            served, failed = dict(self.served), self.failed
            self.served.clear()
            self.failed = 0
        return served, failed

    def close(self) -> None:
        self.stop.set()
        self.active.clear()
        for t in self.threads:
            t.join(timeout=60)


def start_load(run: DemoRun) -> None:
    """The client threads (through the fleet's gateway), idle until the first rollout; requests
    continue from their last streamed token unless ``--no-continuation``."""
    opts = run.opts
    run.fleet.router.keep_tokens = not getattr(opts, "no_continuation", False)
    run.load_or_none = RolloutLoad(
        run.fleet, opts.workers, max_new_tokens=getattr(opts, "max_new_tokens", 8)
    )


def rollout(run: DemoRun, step: int) -> StepRecord:
    """Step ``step``'s rollout phase; returns the step's record with what the load got."""
    fleet, load, opts = run.fleet, run.load, run.opts
    record: StepRecord = {"step": step, "version_served": fleet.registry.fleet_version}
    t = time.monotonic()
    load.active.set()
    end = t + opts.rollout_s
    crashed_now = False
    back = True  # --nodes: every group the removed node held is active again
    next_print = t
    while time.monotonic() < end or not back:
        now = time.monotonic()
        if step == opts.crash_at and not crashed_now and now - t >= CRASH_DELAY_S:
            if run.nodes:
                from rollsafe.demo import nodes

                nodes.remove_node(run, step)
                back = False
            else:
                _crash(run, step)
            crashed_now = True
        if not back:
            from rollsafe.demo import nodes

            back = nodes.tend(run) or now - t > nodes.BACK_TIMEOUT_S
        if now >= next_print:
            run.say(rollout_line(run, step, now - t))
            next_print = now + 1.0
        time.sleep(0.05)
    load.active.clear()
    served, failed = load.take()
    cont_now = fleet.router.stats()["continuation"]
    record["continuation"] = {k: v - run.cont_seen.get(k, 0) for k, v in cont_now.items()}
    run.cont_seen = cont_now
    rollout_s = time.monotonic() - t
    run.timings["rollout"] += rollout_s
    record.update(
        served_by_group=served, served=sum(served.values()), failed=failed, rollout_s=rollout_s
    )
    return record


def _crash(run: DemoRun, step: int) -> None:
    """SIGKILL rank 1 of the 2-rank group (the vLLM server of the second group), and mark the
    onset of the failure."""
    fleet = run.fleet
    crash_gid = fleet.group_ids[CRASH_GROUP_INDEX]
    launcher = fleet.launcher(crash_gid)
    rank: int | None
    if run.vllm:
        pid, rank, what = launcher.pid, None, "the vLLM server"
        os.kill(pid, signal.SIGKILL)
    else:
        pid, rank, what = launcher.kill_rank(1), 1, "rank 1"
    at = time.time()
    run.crash = {"group": crash_gid, "step": step, "rank": rank, "what": what, "pid": pid, "at": at}
    # the onset of the failure for the metrics, timeline.jsonl and its picture
    fleet.observer.mark_crash(crash_gid, at=run.crash["at"], rank=rank, pid=pid)
    run.say(f"  !! step {step}: SIGKILL {what} (pid {pid}) of {crash_gid}")

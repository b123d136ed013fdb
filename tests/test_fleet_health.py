"""HealthManager: thresholds, pause/resume, hung probes, hand-off, and real engines killed.

Unit tests drive rounds with ``check_now`` (deterministic) or wait on conditions with generous
bounds (deadlock detection, never timing assertions). The last test runs two real reference
engines, SIGKILLs one, and checks that its group leaves routing while the router keeps serving.
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import threading
import time
import types
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
from engine_helpers import (
    EngineProcess,
    engine_factory,  # noqa: F401  (fixture)
    tiny_model_dir,  # noqa: F401  (fixture)
    wait_for,
)
from fleet_sim import generate, make_fleet

from rollsafe.adapters.engines import EngineUnavailable, SGLangClient
from rollsafe.fleet import NoRoutableGroup
from rollsafe.fleet.health import GroupFailure, HealthManager, ProbeResult
from rollsafe.fleet.router import Router
from rollsafe.fleet.weights_check import engine_checksums
from rollsafe.registry import FleetListener, FleetRegistry, WorkerGroup

WAIT_S = 15.0  # bound for waiting on a condition; never asserted as a duration


class Switchboard:
    """A probe whose answer per group is set by the test (default healthy)."""

    def __init__(self) -> None:
        self.answers: dict[str, ProbeResult | Exception] = {}
        self.gates: dict[str, threading.Event] = {}
        self.threads: set[str] = set()
        self.calls: dict[str, int] = {}

    def __call__(self, group: WorkerGroup, timeout_s: float) -> ProbeResult:
        gid = group.group_id
        self.calls[gid] = self.calls.get(gid, 0) + 1
        self.threads.add(threading.current_thread().name)
        gate = self.gates.get(gid)
        if gate is not None:
            gate.wait()
        answer = self.answers.get(gid, True)
        if isinstance(answer, Exception):
            raise answer
        return answer


def manager(reg: FleetRegistry, probe: Callable[..., object], **kw: object) -> HealthManager:
    kw.setdefault("interval_s", 60.0)
    kw.setdefault("timeout_s", 5.0)
    kw.setdefault("failure_threshold", 3)
    return HealthManager(reg, probe, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- threshold
def test_consecutive_failures_reach_the_threshold_then_fail_the_group() -> None:
    reg, _ = make_fleet((2, 1))
    probe = Switchboard()
    failures: queue.Queue[GroupFailure] = queue.Queue()
    hm = manager(reg, probe, failure_threshold=3, on_group_failed=failures.put)
    try:
        probe.answers["g0"] = EngineUnavailable("http://g0", "/health", "Connection refused")
        for n in (1, 2):
            r = hm.check_now()
            assert r.failed_probes == ("g0",) and r.failed_groups == ()
            assert reg.get("g0").state == "active"
            assert hm.failure_counts() == {"g0": {0: n, 1: n}}
        r = hm.check_now()
        assert r.failed_groups == ("g0",)
        assert reg.get("g0").state == "inactive"
        assert [m.healthy for m in reg.get("g0").machine.members.values()] == [False, False]
        assert reg.get("g1").state == "active"
        failure = failures.get(timeout=WAIT_S)
        assert failure.group_id == "g0" and failure.unhealthy_ranks == (0, 1)
        assert failure.consecutive_failures == 3
        assert "Connection refused" in failure.reason
        # an inactive group is the recovery coordinator's: no longer probed
        calls = probe.calls["g0"]
        assert hm.check_now().probed == 1
        assert probe.calls["g0"] == calls
    finally:
        assert hm.stop()


def test_a_group_loading_weights_is_not_probed_and_late_answers_are_dropped() -> None:
    """A targeted push of gigabytes keeps a real SGLang engine's /health queued behind the load
    for its whole duration: the group being loaded is neither probed nor failed meanwhile."""
    reg, _ = make_fleet((1, 1))
    probe = Switchboard()
    hm = manager(reg, probe, failure_threshold=1)
    try:
        probe.answers["g0"] = EngineUnavailable("http://g0", "/health", "timed out")
        with reg.get("g0").loading():
            assert reg.get("g0").loading_weights
            r = hm.check_now()
            assert r.probed == 1 and "g0" not in probe.calls  # only g1
            assert reg.get("g0").state == "active"
        assert not reg.get("g0").loading_weights
        assert hm.check_now().failed_groups == ("g0",)  # probed again once the load ended
        # an answer that lands while a load started meanwhile is about to end is dropped
        gate = probe.gates["g1"] = threading.Event()
        probe.answers["g1"] = EngineUnavailable("http://g1", "/health", "timed out")
        done = threading.Thread(target=hm.check_now)
        done.start()
        assert wait_for(lambda: probe.calls.get("g1", 0) >= 3, WAIT_S)  # at the gate
        with reg.get("g1").loading():
            gate.set()
            done.join(WAIT_S)
        assert reg.get("g1").state == "active"
    finally:
        assert hm.stop()


def test_a_group_under_a_weights_check_is_not_probed_nor_failed() -> None:
    """SGLang runs its weights checker on the scheduler and its /health waits behind it (a 5 s
    checksum on the GPU run: two 2 s probes failed the group, restarted mid-check): the fleet's
    checks hold the group as a load does, and probe it again once done."""
    reg, clients = make_fleet((1, 1))
    probe = Switchboard()
    hm = manager(reg, probe, failure_threshold=1)
    rounds: dict[str, tuple[bool, int]] = {}

    def checksum(gid: str) -> Callable[..., object]:
        def slow_checker(timeout: float | None = None) -> object:
            # the engine's /health would time out now
            probe.answers[gid] = EngineUnavailable(f"http://{gid}", "/health", "timed out")
            r = hm.check_now()
            rounds[gid] = (reg.get(gid).loading_weights, r.probed)
            probe.answers[gid] = True
            return types.SimpleNamespace(model=f"digest-{gid}")

        return slow_checker

    try:
        for gid, client in clients.items():
            client.weights_checksum = checksum(gid)  # type: ignore[method-assign]
        assert engine_checksums(reg) == {"g0": "digest-g0", "g1": "digest-g1"}
        assert rounds == {"g0": (True, 1), "g1": (True, 1)}  # only the other group probed
        assert [g.state for g in reg.groups()] == ["active", "active"]
        assert not any(g.loading_weights for g in reg.groups())
        assert hm.check_now().probed == 2
    finally:
        assert hm.stop()


def test_a_healthy_answer_resets_the_count() -> None:
    reg, _ = make_fleet((1,))
    probe = Switchboard()
    hm = manager(reg, probe, failure_threshold=2)
    probe.answers["g0"] = False
    hm.check_now()
    probe.answers["g0"] = True
    hm.check_now()
    assert hm.failure_counts() == {}
    probe.answers["g0"] = False
    hm.check_now()
    assert reg.get("g0").state == "active"
    hm.check_now()
    assert reg.get("g0").state == "inactive"
    hm.stop()


def test_per_rank_answers_report_members_and_fail_the_whole_group() -> None:
    reg, _ = make_fleet((3,))
    probe = Switchboard()
    hm = manager(reg, probe, failure_threshold=1)
    probe.answers["g0"] = {0: True, 1: False, 2: True}
    r = hm.check_now()
    assert r.outcomes[0].unhealthy == (1,)
    assert reg.get("g0").state == "inactive"
    members = reg.get("g0").machine.members
    assert (members[0].healthy, members[1].healthy, members[2].healthy) == (True, False, True)
    hm.stop()


def test_healthy_probe_reports_members_healthy_again() -> None:
    reg, _ = make_fleet((2,))
    reg.report_member("g0", 1, healthy=False)
    hm = manager(reg, Switchboard())
    hm.check_now()
    assert all(m.healthy for m in reg.get("g0").machine.members.values())
    hm.stop()


def test_bad_probe_answers_count_as_failures() -> None:
    reg, _ = make_fleet((1, 1, 1))  # ranks 0, 1, 2
    answers: dict[str, object] = {"g0": "yes", "g1": {1: True}, "g2": {0: True}}

    def probe(group: WorkerGroup, timeout_s: float) -> object:
        return answers[group.group_id]

    hm = manager(reg, probe, failure_threshold=1)
    r = hm.check_now()
    assert sorted(r.failed_groups) == ["g0", "g2"]  # a rank missing from a mapping is unhealthy
    errors = {o.group_id: o.error or "" for o in r.outcomes}
    assert "expected bool or rank mapping" in errors["g0"]
    assert "rank(s) [2] unhealthy" in errors["g2"]
    hm.stop()


def test_constructor_validates() -> None:
    reg = FleetRegistry()
    for bad in ({"interval_s": 0}, {"timeout_s": -1}, {"failure_threshold": 0}):
        with pytest.raises(ValueError):
            HealthManager(reg, Switchboard(), **bad)  # type: ignore[arg-type]


def test_default_probe_uses_the_groups_clients() -> None:
    reg, clients = make_fleet((1, 1))
    clients["g1"].health_error = EngineUnavailable(clients["g1"].url, "/health", "refused")
    hm = HealthManager(reg, interval_s=60.0, timeout_s=5.0, failure_threshold=1)
    r = hm.check_now()
    assert r.failed_groups == ("g1",)
    assert clients["g0"].health_calls == 1
    reg2 = FleetRegistry()
    reg2.add_group("bare", [0])
    reg2.report_member("bare", 0, healthy=True, weights_version=0)
    reg2.send("bare", "launched")
    r2 = HealthManager(reg2, failure_threshold=1).check_now()
    assert "no engine clients" in (r2.outcomes[0].error or "")
    hm.stop()


# ---------------------------------------------------------------------- HTTP clients on the loop
class HealthServer:
    """A bare HTTP/1.1 server on a thread of its own answering ``GET /health`` (keep-alive):
    ``mode`` "ok" (200), "down" (503) or "hang" (reads the request, never answers). It counts
    the connections it accepted and keeps every request head it read."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.connections = 0
        self.heads: list[str] = []
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        assert started.wait(WAIT_S)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self._server = server
        started.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head.decode("latin-1"))
                if self.mode == "hang":
                    await asyncio.sleep(3600)
                status = b"200 OK" if self.mode == "ok" else b"503 Service Unavailable"
                writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        async def shut() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(WAIT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(WAIT_S)
        self._loop.close()


def _http_group(reg: FleetRegistry, gid: str, rank: int, client: object) -> None:
    reg.add_group(gid, [rank], clients=[client])
    reg.report_member(gid, rank, healthy=True, weights_version=reg.fleet_version)
    reg.send(gid, "launched")


def _probe_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if "-probe-" in t.name]


def test_the_default_probe_of_http_clients_runs_on_the_loop_over_one_connection() -> None:
    """SGLang and vLLM clients are probed from the probe loop: no thread per probe, one
    keep-alive connection per engine across rounds, the API key sent; a 503 and an engine that
    never answers fail their group as the blocking probe does."""
    from rollsafe.adapters.engines import VLLMClient

    servers = {gid: HealthServer() for gid in ("s", "v")}
    reg = FleetRegistry(fleet_version=0)
    clients = {
        "s": SGLangClient(servers["s"].url, api_key="k-s"),
        "v": VLLMClient(servers["v"].url, api_key="k-v"),
    }
    for rank, gid in enumerate(("s", "v")):
        _http_group(reg, gid, rank, clients[gid])
    failures: queue.Queue[GroupFailure] = queue.Queue()
    # a 2 s bound: a healthy local answer never comes near it, even on a loaded machine (a
    # probe cut at its bound closes its connection; the next one opens another)
    hm = HealthManager(reg, None, 0.05, 2.0, 2, on_group_failed=failures.put)
    try:
        with hm:
            assert wait_for(lambda: hm.rounds >= 6, WAIT_S)
            assert _probe_threads() == [] and hm.stats()["probe_threads"] == 0
            for gid, server in servers.items():
                assert len(server.heads) >= 6
                # kept alive across the rounds: 1 (a connection a probe would be one a request)
                assert server.connections <= len(server.heads) // 3
                assert all(h.startswith("GET /health HTTP/1.1") for h in server.heads)
                assert f"authorization: bearer k-{gid}" in server.heads[0].lower()
            assert reg.get("s").state == reg.get("v").state == "active"
            servers["s"].mode = "down"
            failure = failures.get(timeout=WAIT_S)
            assert failure.group_id == "s" and reg.get("s").state == "inactive"
            assert "503" in failure.reason
            servers["v"].mode = "hang"
            failure = failures.get(timeout=WAIT_S)
            assert failure.group_id == "v" and reg.get("v").state == "inactive"
            assert _probe_threads() == []
    finally:
        hm.stop()
        for c in clients.values():
            c.close()
        for server in servers.values():
            server.close()


def test_a_client_overriding_health_and_an_offline_round_use_the_blocking_probe() -> None:
    """Only the clients' own ``GET /health`` moves onto the loop: a subclass with its own
    ``health`` is still called (on a probe thread), and ``check_now`` without the loop running
    probes through the blocking clients."""
    server = HealthServer()
    calls: list[str] = []

    class Audited(SGLangClient):
        def health(self, *, timeout: float | None = None, retry: bool = True) -> None:
            calls.append(threading.current_thread().name)
            super().health(timeout=timeout, retry=retry)

    reg = FleetRegistry(fleet_version=0)
    audited, plain = Audited(server.url), SGLangClient(server.url)
    _http_group(reg, "a", 0, audited)
    _http_group(reg, "p", 1, plain)
    hm = HealthManager(reg, None, 0.05, 5.0, 2)  # nothing hangs here: a bound for load only
    try:
        offline = hm.check_now()
        assert offline.healthy == 2 and calls and "-probe-a" in calls[-1]
        heads = len(server.heads)
        with hm:
            assert wait_for(lambda: len(calls) >= 3, WAIT_S)
            assert all("-probe-a" in name for name in calls)
            assert wait_for(lambda: len(server.heads) >= heads + 6, WAIT_S)
        assert reg.get("a").state == reg.get("p").state == "active"
    finally:
        hm.stop()
        audited.close()
        plain.close()
        server.close()


# ---------------------------------------------------------------------- pause / resume / wake
def test_pause_applies_nothing_and_resume_starts_counting_afresh() -> None:
    reg, _ = make_fleet((1,))
    probe = Switchboard()
    hm = manager(reg, probe, failure_threshold=2)
    probe.answers["g0"] = False
    hm.check_now()
    hm.pause()
    for _ in range(3):
        r = hm.check_now()
        assert r.discarded == 1 and r.failed_groups == ()
    assert reg.get("g0").state == "active"
    hm.resume()
    assert hm.failure_counts() == {}
    hm.check_now()
    assert reg.get("g0").state == "active"  # 1 failure since resume, threshold 2
    hm.check_now()
    assert reg.get("g0").state == "inactive"
    hm.stop()


def test_background_loop_pauses_resumes_and_wakes() -> None:
    reg, _ = make_fleet((1, 1))
    probe = Switchboard()
    hm = manager(reg, probe, interval_s=60.0)  # only wake() triggers rounds after the first
    with hm:
        assert wait_for(lambda: hm.rounds >= 1, WAIT_S)
        n = hm.rounds
        hm.wake()
        assert wait_for(lambda: hm.rounds > n, WAIT_S)
        hm.pause()
        n = hm.rounds
        hm.wake()
        time.sleep(0.1)  # give a (wrong) round the chance to run
        assert hm.rounds == n
        hm.resume()  # resume wakes the loop
        assert wait_for(lambda: hm.rounds > n, WAIT_S)
        assert hm.running
        # check_now also works against the running loop
        assert hm.check_now(timeout=WAIT_S).probed == 2
    assert not hm.running


def test_pause_returns_only_after_an_in_flight_apply_and_blocks_later_ones() -> None:
    reg, _ = make_fleet((1,))
    probe = Switchboard()
    probe.gates["g0"] = gate = threading.Event()
    probe.answers["g0"] = False
    hm = manager(reg, probe, failure_threshold=1)
    result: list[object] = []
    t = threading.Thread(target=lambda: result.append(hm.check_now()))
    t.start()
    assert wait_for(lambda: probe.calls.get("g0", 0) == 1, WAIT_S)
    hm.pause()  # the probe answers after pause: the answer must be dropped
    gate.set()
    t.join(WAIT_S)
    assert reg.get("g0").state == "active"
    hm.stop()


# ---------------------------------------------------------------------- hung probes
def test_a_hung_probe_does_not_stall_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import rollsafe.fleet.health as health_module

    # the manager's clock, held still or moved on by the test (the round deadlines run on the
    # event loop's own clock, so rounds still end)
    now = [100.0]
    monkeypatch.setattr(
        health_module, "time", types.SimpleNamespace(monotonic=lambda: now[0], time=time.time)
    )
    reg, _ = make_fleet((1, 1, 1))
    probe = Switchboard()
    probe.gates["g0"] = hang = threading.Event()  # g0's engine never answers
    hm = manager(reg, probe, timeout_s=0.2, failure_threshold=2)
    try:
        r1 = hm.check_now()
        assert r1.timed_out == ("g0",)
        assert {o.group_id for o in r1.outcomes if o.ok} == {"g1", "g2"}
        # a round before another timeout_s has passed: g0's probe is still stuck, it is not
        # started again and not counted again (one slow probe is one failure, not one a round)
        now[0] += 0.19
        r_soon = hm.check_now()
        assert "g0" not in {o.group_id for o in r_soon.outcomes} and r_soon.healthy == 2
        assert reg.get("g0").state == "active"
        # a full timeout_s after the first count and still stuck: the second failure
        now[0] += 0.05
        r2 = hm.check_now()
        stuck = next(o for o in r2.outcomes if o.group_id == "g0")
        assert stuck.still_running and not stuck.ok
        assert probe.calls["g0"] == 1
        assert r2.failed_groups == ("g0",) and reg.get("g0").state == "inactive"
        assert {g.group_id for g in reg.routable()} == {"g1", "g2"}
        for _ in range(3):  # the stuck thread never starves the rest
            assert hm.check_now().healthy == 2
    finally:
        hang.set()
        monkeypatch.undo()
        assert hm.stop()


def test_a_time_out_while_the_checker_itself_stood_still_is_not_counted() -> None:
    """Found under load: the fleet's process stood still for 3-4 s (every thread of the
    driver) and the probes in flight "timed out", failing a serving group. A time-out counts
    only when the probe loop ran through the probe's window; a hung engine is still failed."""
    reg, _ = make_fleet((1, 1))
    probe = Switchboard()
    hm = manager(reg, probe, timeout_s=0.2, failure_threshold=1)
    hm.start()
    try:
        assert wait_for(lambda: hm.stats()["rounds"] >= 1, WAIT_S)  # the start's round: healthy
        loop = hm._loop
        assert loop is not None
        # the heartbeat sees a real stall of the loop's thread
        loop.call_soon_threadsafe(time.sleep, 0.5)
        assert wait_for(lambda: hm._stalls.longest(0.0, loop.time()) >= 0.4, WAIT_S)
        probe.gates["g0"] = threading.Event()  # g0's engine stops answering
        now = loop.time()
        hm._stalls.note(now, now + 0.8)  # the checker stands still through the next window
        r1 = hm.check_now()
        assert r1.inconclusive == ("g0",) and r1.timed_out == () and r1.failed_groups == ()
        assert reg.get("g0").state == "active" and hm.stats()["inconclusive"] == 1
        # still stuck a timeout_s later, the stall inside that window: not counted either
        time.sleep(0.25)
        r2 = hm.check_now()
        assert "g0" not in {o.group_id for o in r2.outcomes} and reg.get("g0").state == "active"
        # the checker runs again: the hung engine is failed once a whole timeout_s without
        # an answer was watched (a window that still held part of the stall does not count)
        assert wait_for(lambda: loop.time() > now + 0.8, WAIT_S)
        rounds = []
        for _ in range(4):
            time.sleep(0.25)
            rounds.append(hm.check_now())
            if rounds[-1].failed_groups:
                break
        last = rounds[-1]
        stuck = next(o for o in last.outcomes if o.group_id == "g0")
        assert stuck.still_running and last.failed_groups == ("g0",), rounds
        assert reg.get("g0").state == "inactive" and reg.get("g1").state == "active"
    finally:
        probe.gates.get("g0", threading.Event()).set()
        hm.stop()


def test_a_hung_async_probe_is_cancelled_at_its_timeout() -> None:
    reg, _ = make_fleet((1, 1))
    cancelled: list[str] = []

    async def probe(group: WorkerGroup, timeout_s: float) -> bool:
        if group.group_id == "g0":
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(group.group_id)
                raise
        await asyncio.sleep(0.001)
        return True

    hm = manager(reg, probe, timeout_s=0.2, failure_threshold=1)
    r = hm.check_now()
    assert r.timed_out == ("g0",) and r.failed_groups == ("g0",)
    assert cancelled == ["g0"]
    assert reg.get("g1").state == "active"
    hm.stop()


def test_stop_joins_even_with_a_probe_stuck_in_a_hung_engine() -> None:
    reg, _ = make_fleet((1,))
    probe = Switchboard()
    probe.gates["g0"] = hang = threading.Event()
    hm = manager(reg, probe, interval_s=0.05, timeout_s=0.1)
    hm.start()
    assert wait_for(lambda: probe.calls.get("g0", 0) >= 1, WAIT_S)
    done: list[bool] = []
    t = threading.Thread(target=lambda: done.append(hm.stop(timeout=1.0)))
    t.start()
    t.join(WAIT_S)
    assert done == [False]  # returned, reporting the stuck probe thread
    assert not hm.running
    hang.set()


# ---------------------------------------------------------------------- hand-off
def test_callback_runs_off_the_probe_loop_and_a_slow_one_blocks_nothing() -> None:
    reg, _ = make_fleet((1, 1, 1))
    probe = Switchboard()
    release = threading.Event()
    seen: list[tuple[str, str]] = []

    def slow_callback(failure: GroupFailure) -> None:
        seen.append((failure.group_id, threading.current_thread().name))
        release.wait()  # misbehaving: a callback that does real work

    hm = manager(reg, probe, interval_s=0.02, failure_threshold=1, on_group_failed=slow_callback)
    with hm:
        probe.answers["g0"] = False
        assert wait_for(lambda: seen != [], WAIT_S)
        rounds = hm.rounds
        # the callback is stuck, yet probing goes on and detects the next failure
        assert wait_for(lambda: hm.rounds >= rounds + 3, WAIT_S)
        probe.answers["g1"] = False
        assert wait_for(lambda: reg.get("g1").state == "inactive", WAIT_S)
        release.set()
        assert wait_for(lambda: len(seen) == 2, WAIT_S)
    assert [gid for gid, _ in seen] == ["g0", "g1"]
    assert all(name.endswith("-notify") for _, name in seen)
    assert not (probe.threads & {name for _, name in seen})


def test_probes_continue_while_recoveries_run() -> None:
    """The recovery coordinator's pattern: the callback only enqueues, workers recover."""
    reg, _ = make_fleet((1, 1, 1), restart_budget=5)
    probe = Switchboard()
    work: queue.Queue[GroupFailure] = queue.Queue()
    recovering = threading.Event()
    finish = threading.Event()

    def recover_worker() -> None:
        failure = work.get()
        reg.send(failure.group_id, "claim")
        recovering.set()
        finish.wait()  # a long restart
        probe.answers[failure.group_id] = True
        for r in reg.get(failure.group_id).ranks:
            reg.report_member(failure.group_id, r, healthy=True, weights_version=1)
        reg.send(failure.group_id, "restarted")

    worker = threading.Thread(target=recover_worker)
    worker.start()
    hm = manager(reg, probe, interval_s=0.02, failure_threshold=1, on_group_failed=work.put)
    with hm:
        probe.answers["g2"] = False
        assert recovering.wait(WAIT_S)
        n = hm.rounds
        assert wait_for(lambda: hm.rounds >= n + 3, WAIT_S)  # probing while recovering
        assert reg.get("g2").state == "recovering"
        finish.set()
        worker.join(WAIT_S)
        assert wait_for(lambda: reg.get("g2").state == "active", WAIT_S)
    assert {g.state for g in reg.groups()} == {"active"}


def test_a_listener_of_the_fail_may_pause_the_manager_from_another_thread() -> None:
    """``fail`` is sent outside the manager's lock: a listener waiting on pause() is fine."""
    reg, _ = make_fleet((1,))
    probe = Switchboard()
    hm = manager(reg, probe, failure_threshold=1)
    paused: list[bool] = []

    class PauseOnFailure(FleetListener):
        def on_group_inactive(self, group: WorkerGroup) -> None:
            t = threading.Thread(target=hm.pause)
            t.start()
            t.join(WAIT_S)
            paused.append(not t.is_alive())

    reg.add_listener(PauseOnFailure())
    probe.answers["g0"] = False
    done: list[object] = []
    t = threading.Thread(target=lambda: done.append(hm.check_now()))
    t.start()
    t.join(WAIT_S)
    assert done and paused == [True] and hm.paused
    hm.stop()


def test_an_answer_about_a_group_that_moved_meanwhile_is_dropped() -> None:
    reg, _ = make_fleet((1,))

    def probe(group: WorkerGroup, timeout_s: float) -> bool:
        reg.send(group.group_id, "fail")  # someone else failed it during the probe
        reg.send(group.group_id, "claim")
        return False

    hm = manager(reg, probe, failure_threshold=1)
    r = hm.check_now()
    assert r.discarded == 1 and r.failed_groups == ()
    assert reg.get("g0").state == "recovering"  # no stale fail/report on the new incarnation
    assert hm.failure_counts() == {}
    hm.stop()


# ---------------------------------------------------------------------- real engines
def _launch(reg: FleetRegistry, gid: str, rank: int, eng: EngineProcess) -> SGLangClient:
    client = SGLangClient(eng.url, timeout=10.0, health_timeout=1.0)
    reg.add_group(gid, [rank], clients=[client], metadata={"pid": eng.pid})
    reg.report_member(gid, rank, healthy=True, weights_version=reg.fleet_version)
    reg.send(gid, "launched")
    return client


def test_real_engine_killed_leaves_routing_and_the_router_keeps_serving(
    engine_factory: Callable[..., EngineProcess],  # noqa: F811
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    engines: dict[str, EngineProcess] = {}

    def start(gid: str) -> None:
        engines[gid] = engine_factory(tiny_model_dir)

    starters = [threading.Thread(target=start, args=(g,)) for g in ("a", "b")]
    for t in starters:
        t.start()
    for t in starters:
        t.join(180)
    assert set(engines) == {"a", "b"}

    reg = FleetRegistry(fleet_version=0)
    clients = {gid: _launch(reg, gid, i, engines[gid]) for i, gid in enumerate(("a", "b"))}
    failures: queue.Queue[GroupFailure] = queue.Queue()
    hm = HealthManager(reg, None, 0.2, 1.0, 2, on_group_failed=failures.put)
    router = Router(reg, on_group_error=lambda gid, exc: hm.wake())
    sampling: Mapping[str, object] = {"max_new_tokens": 4, "temperature": 0.0}
    try:
        with hm:
            served = {
                generate(router, [5, 17, 42], sampling_params=sampling).group_id for _ in range(6)
            }
            assert served == {"a", "b"}
            os.killpg(engines["a"].proc.pid, signal.SIGKILL)
            # requests keep succeeding throughout detection (retried on b when a is hit)
            deadline = time.monotonic() + 30
            while reg.get("a").state == "active" and time.monotonic() < deadline:
                out = generate(router, [5, 17, 42], sampling_params=sampling, session_id="s")
                assert out.output_ids
            assert reg.get("a").state == "inactive"
            failure = failures.get(timeout=WAIT_S)
            assert failure.group_id == "a" and failure.unhealthy_ranks == (0,)
            for _ in range(5):
                assert generate(router, [5, 17, 42], sampling_params=sampling).group_id == "b"
            assert router.session_group("s") == "b"
            assert [g.group_id for g in reg.routable()] == ["b"]
            assert reg.get("b").state == "active"
        for counts in reg.dispatch_counts().values():
            assert set(counts) <= {"active"}
        reg.send("b", "fail")
        with pytest.raises(NoRoutableGroup):
            generate(router, [1, 2])
    finally:
        hm.stop()
        router.close()
        for c in clients.values():
            c.close()

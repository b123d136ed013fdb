"""Warm standby: ``EngineSpec.warm_standby`` and the reference engine's ``--standby`` mode.

Real processes throughout: a launcher keeps an idle, already-imported engine process that takes
the next (re)start: it stays resident and forks the engine (a zygote), so it is still ready for
the next crash. Every test checks nothing is left running.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("torch")

from engine_helpers import (  # noqa: F401  (fixture)
    all_gone,
    repo_env,
    sglang_digests,
    tiny_model_dir,
    wait_for,
)

from rollsafe.adapters.engines import EngineLauncher, EngineSpec
from rollsafe.fleet import FleetConfig, FleetConfigError, GroupSpec, HealthSettings, RolloutFleet
from rollsafe.processes import pid_alive

STANDBY_WAIT_S = 120.0


def proc_stat(pid: int) -> tuple[str, int]:
    """The process state letter and its CPU ticks (user + system) from ``/proc``."""
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    fields = stat[stat.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[11]) + int(fields[12])


def is_idle(pid: int) -> bool:
    """Sleeping and using no CPU over a short window (blocked reading its handoff line)."""
    state, ticks = proc_stat(pid)
    time.sleep(0.3)
    later_state, later_ticks = proc_stat(pid)
    return state == later_state == "S" and later_ticks == ticks


def standby_launcher(model: Path, **kw: object) -> EngineLauncher:
    return EngineLauncher(EngineSpec(model_path=str(model), warm_standby=True, **kw))  # type: ignore[arg-type]


#: the core the first test binds its engine to (not core 0 where the host has two)
ALL = os.sched_getaffinity(0)
CORE = max(ALL)


def thread_cores(pid: int) -> set[frozenset[int]]:
    """The core sets the threads of ``pid`` may run on (one set when they all agree)."""
    found = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # the thread ended
            found.add(frozenset(os.sched_getaffinity(int(tid))))
    return found


def parent_pid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return int(stat[stat.rindex(b")") + 2 :].split()[1])


def test_restarts_fork_from_the_resident_standby_which_stays_ready(
    tiny_model_dir: Path,  # noqa: F811
    launchers: list[EngineLauncher],
) -> None:
    # cpu_cores: the engine, the zygote and every engine it forks run on that core only
    launcher = standby_launcher(tiny_model_dir, cpu_cores=(CORE,))
    launchers.append(launcher)
    launcher.start()
    assert thread_cores(launcher.pid) == {frozenset({CORE})}
    assert not launcher.last_start_from_standby  # nothing to fork from the first time
    assert not launcher.ready_info["from_standby"]
    assert launcher.wait_standby(STANDBY_WAIT_S)
    standby = launcher.standby_pid
    assert standby is not None and standby not in (launcher.pid, *launcher.rank_pids)
    assert os.getsid(standby) == standby  # its own session, like an engine group
    assert thread_cores(standby) == {frozenset({CORE})}
    assert wait_for(lambda: is_idle(standby), 10.0)  # blocked on its control socket
    old = [launcher.pid, *launcher.rank_pids]

    assert launcher.standby_state == "ready"
    launcher.restart(weight_version="7")
    assert launcher.last_start_from_standby
    assert launcher.last_start_source == "ready_standby"
    assert launcher.last_start_standby_state == "ready"
    engine = launcher.pid
    assert engine != standby and launcher.rank_pids == [engine]
    assert parent_pid(engine) == standby  # forked by the standby...
    assert os.getsid(engine) == engine  # ...into a session of its own
    assert thread_cores(engine) == {frozenset({CORE})}  # the zygote's core, inherited
    assert os.sched_getaffinity(0) == ALL  # the launcher itself is not bound
    info = launcher.ready_info
    assert info["from_standby"] and info["standby"]["import_s"] > 0
    assert info["standby"]["zygote_pid"] == standby
    assert info["weight_version"] == "7"
    assert all_gone(old)
    out = launcher.client.generate(
        input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4, "ignore_eos": True}
    )
    assert len(out.output_ids) == 4 and out.weight_version == "7"
    log_text = Path(str(launcher.log_path)).read_text()
    assert "# forked by the warm standby" in log_text and "ROLLSAFE_READY" in log_text

    # the standby was not consumed: still ready, so a crash right now forks again
    assert launcher.standby_state == "ready" and launcher.standby_pid == standby
    launcher.kill_rank(0)
    assert all_gone([engine])
    assert not launcher.is_alive()
    launcher.restart()
    assert launcher.last_start_source == "ready_standby"
    assert launcher.last_start_standby_state == "ready"
    assert launcher.pid not in (engine, standby) and parent_pid(launcher.pid) == standby
    assert launcher.client.is_healthy()
    stats = launcher.standby_stats
    assert stats["spawned"] == 1 and stats["used"] == stats["used_ready"] == 2
    assert stats["fallbacks"] == 0
    pids = [launcher.pid, *launcher.rank_pids, standby]
    launcher.stop()
    assert not launcher.started and launcher.standby_pid is None
    assert all_gone(pids)


def test_dead_standby_falls_back_to_a_fresh_spawn_and_gc_reaps_everything(
    tiny_model_dir: Path,  # noqa: F811
    launchers: list[EngineLauncher],
) -> None:
    launcher = standby_launcher(tiny_model_dir)
    launchers.append(launcher)
    launcher.start()
    deadline = time.monotonic() + 30.0  # no closure over ``launcher``: it is deleted below
    while launcher.standby_pid is None and time.monotonic() < deadline:
        time.sleep(0.02)
    doomed = launcher.standby_pid
    assert doomed is not None
    os.kill(doomed, signal.SIGKILL)
    assert all_gone([doomed])

    launcher.restart()
    assert not launcher.last_start_from_standby
    assert launcher.last_start_source == "fresh_spawn"
    assert launcher.pid != doomed and launcher.client.is_healthy()
    stats = launcher.standby_stats
    assert stats["fallbacks"] == 1 and "exited" in str(stats["last_fallback"])
    assert launcher.wait_standby(STANDBY_WAIT_S)  # a fresh standby replaces the dead one

    pids = [launcher.pid, *launcher.rank_pids, launcher.standby_pid]
    launchers.remove(launcher)
    del launcher
    gc.collect()  # the finalizers kill the engine group and the standby
    assert all_gone([p for p in pids if p is not None])


def test_two_ranks_start_from_a_standby_by_fork(
    tiny_model_dir: Path,  # noqa: F811
    launchers: list[EngineLauncher],
) -> None:
    launcher = standby_launcher(tiny_model_dir, ranks=2, dialect="vllm")
    launchers.append(launcher)
    launcher.start()
    assert launcher.wait_standby(STANDBY_WAIT_S)
    standby = launcher.standby_pid
    launcher.restart()
    assert launcher.last_start_from_standby and parent_pid(launcher.pid) == standby
    info = launcher.ready_info
    assert info["ranks"] == 2 and info["rank_start_method"] == "fork"
    assert len(launcher.rank_pids) == 2 and launcher.rank_pids[0] == launcher.pid
    assert parent_pid(launcher.rank_pids[1]) == launcher.pid  # forked by the forked engine
    out = launcher.client.generate(
        input_ids=[5, 6], sampling_params={"max_new_tokens": 3, "ignore_eos": True}
    )
    assert len(out.output_ids) == 3
    killed = launcher.kill_rank(1)  # the forked rank is a real member of the group
    assert all_gone([killed])
    assert wait_for(lambda: not launcher.client.is_healthy(timeout=1.0), 10.0)
    pids = [*launcher.rank_pids, *([launcher.standby_pid] if launcher.standby_pid else [])]
    launcher.kill()
    assert launcher.standby_pid is None
    assert all_gone(pids)


def _standby_process(model: Path | None = None) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "rollsafe.adapters.reference_engine", "--standby"]
    if model is not None:
        cmd += ["--model-path", str(model)]
    return subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_standby_protocol_garbage_exits_2_and_eof_exits_0(tiny_model_dir: Path) -> None:  # noqa: F811
    garbage, eof = _standby_process(tiny_model_dir), _standby_process()
    try:
        for proc in (garbage, eof):
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("ROLLSAFE_STANDBY "), line
            info = json.loads(line.split(" ", 1)[1])
            assert info["pid"] == proc.pid and info["cuda_initialized"] is False
        out, err = garbage.communicate("this is not json\n", timeout=30)
        assert garbage.returncode == 2
        assert "bad standby handoff line" in err and "not JSON" in err
        out, err = eof.communicate("", timeout=30)
        assert eof.returncode == 0 and err == "" and out == ""
    finally:
        for proc in (garbage, eof):
            proc.kill()
            proc.wait()


def test_handoff_lines_are_checked() -> None:
    from rollsafe.adapters.reference_engine.__main__ import HandoffError, parse_handoff

    assert parse_handoff('{"argv": ["--model-path", "/m"]}') == (["--model-path", "/m"], {})
    assert parse_handoff('{"argv": [], "env": {"A": "1"}}') == ([], {"A": "1"})
    for bad, why in [
        ("[1, 2]", "JSON object"),
        ('{"argv": "--model-path /m"}', "'argv'"),
        ('{"argv": [], "env": {"A": 1}}', "'env'"),
        ('{"argv": [], "extra": 1}', "unknown keys"),
        ('{"argv": ["--standby"]}', "--standby"),
    ]:
        with pytest.raises(HandoffError, match=why):
            parse_handoff(bad)


def test_fork_server_protocol(tiny_model_dir: Path) -> None:  # noqa: F811
    """``--standby --fork-server-fd FD``: bad requests are answered with an error and the
    zygote goes on; a good one forks an engine onto the passed stdout; its exit is reported;
    EOF ends the zygote with 0 while its engine lives on in its own session."""
    import socket

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    cmd = [
        sys.executable,
        "-m",
        "rollsafe.adapters.reference_engine",
        "--standby",
        "--fork-server-fd",
        str(theirs.fileno()),
    ]
    zygote = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(theirs.fileno(),)
    )
    theirs.close()
    engines: list[int] = []
    try:
        assert zygote.stdout is not None
        line = zygote.stdout.readline().decode()
        info = json.loads(line.split(" ", 1)[1])
        assert info["pid"] == zygote.pid and info["fork_server"] is True

        def ask(msg: object, fds: list[int]) -> dict[str, object]:
            socket.send_fds(ours, [json.dumps(msg).encode()], fds)
            answer = json.loads(ours.recv(65536))
            assert isinstance(answer, dict)
            return answer

        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        bad = ask({"id": 1, "argv": ["--standby"]}, [out_w, err_w])
        assert bad["op"] == "error" and bad["id"] == 1 and "--standby" in str(bad["error"])
        assert ask({"id": 2, "argv": []}, [])["error"] == (
            "expected 2 file descriptors (stdout, stderr), got 0"
        )
        argv = ["--model-path", str(tiny_model_dir), "--weight-version", "5"]
        forked = ask({"id": 3, "argv": argv, "env": {"ROLLSAFE_TEST": "1"}}, [out_w, err_w])
        os.close(out_w)
        os.close(err_w)
        assert forked["op"] == "forked" and forked["id"] == 3
        pid = int(str(forked["pid"]))
        engines.append(pid)
        assert os.getsid(pid) == pid and pid_alive(pid)
        with os.fdopen(out_r, "rb") as out:
            ready = json.loads(out.readline().decode().split(" ", 1)[1])
        os.close(err_r)
        assert ready["pid"] == pid and ready["weight_version"] == "5"
        assert ready["from_standby"] and ready["standby"]["zygote_pid"] == zygote.pid
        os.kill(pid, signal.SIGKILL)
        assert json.loads(ours.recv(65536)) == {"op": "exit", "pid": pid, "returncode": -9}

        # a second engine, then EOF: the zygote exits 0 and the engine lives on
        out_r, out_w = os.pipe()
        forked = ask({"id": 4, "argv": argv}, [out_w, out_w])
        os.close(out_w)
        engines.append(int(str(forked["pid"])))
        ours.close()
        assert zygote.wait(timeout=30) == 0
        assert pid_alive(engines[-1])
        with os.fdopen(out_r, "rb") as out:
            assert out.readline().startswith(b"ROLLSAFE_READY ")
    finally:
        for pid in engines:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        zygote.kill()
        zygote.wait()
        ours.close()
    assert all_gone(engines)


def test_the_standby_dies_with_a_killed_parent(tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """A launcher process killed with SIGKILL cannot clean up; the watchdogs reap the standby
    and the engine it forked."""
    pid_file = tmp_path / "pids"
    script = textwrap.dedent(
        f"""
        import time
        from rollsafe.adapters.engines import EngineLauncher, EngineSpec
        spec = EngineSpec(model_path={str(tiny_model_dir)!r}, warm_standby=True)
        launcher = EngineLauncher(spec).start()
        assert launcher.wait_standby({STANDBY_WAIT_S})
        first = launcher.pid
        launcher.restart()  # an engine forked by the standby: not the launcher's child
        assert launcher.last_start_source == "ready_standby"
        with open({str(pid_file)!r}, "w") as f:
            f.write(" ".join(map(str, [launcher.pid, launcher.standby_pid, first])))
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        assert wait_for(lambda: pid_file.exists() and pid_file.read_text() != "", 180.0)
        *pids, first = [int(p) for p in pid_file.read_text().split()]
        assert len(pids) == 2 and all(pid_alive(p) for p in pids) and not pid_alive(first)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    assert all_gone(pids, timeout=10.0)


def test_fleet_config_plumbs_warm_standby(tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    base = {"model_path": tiny_model_dir, "export_root": tmp_path / "exports"}
    for kw, key in [
        ({"warm_standby": "yes"}, "warm_standby"),
        ({"groups": [GroupSpec(1, warm_standby=1)]}, "groups[0].warm_standby"),  # type: ignore[arg-type]
        (
            {"engine": EngineSpec(model_path=str(tiny_model_dir), warm_standby=True)},
            "engine.warm_standby",
        ),
    ]:
        with pytest.raises(FleetConfigError) as info:
            RolloutFleet(FleetConfig(**base, **kw))  # type: ignore[arg-type]
        assert info.value.key == key

    specs: dict[str, EngineSpec] = {}

    def factory(gid: str, spec: EngineSpec) -> EngineLauncher:
        specs[gid] = spec
        if len(specs) == 2:
            raise RuntimeError("not launching in this test")
        return EngineLauncher(spec)  # never started: the next call raises first

    groups = [GroupSpec(1), GroupSpec(1, warm_standby=False)]
    fleet = RolloutFleet(
        FleetConfig(**base, groups=groups, warm_standby=True, launcher_factory=factory)  # type: ignore[arg-type]
    )
    with pytest.raises(RuntimeError, match="not launching"):
        fleet.start()
    assert specs["g0"].warm_standby is True and specs["g1"].warm_standby is False


def test_fleet_recovery_restarts_on_the_standby(tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    weights = {n: p.detach() for n, p in model.named_parameters()}
    cfg = FleetConfig(
        model_path=tiny_model_dir,
        export_root=tmp_path / "exports",
        groups=[GroupSpec(1)],
        health=HealthSettings(interval_s=0.2, timeout_s=1.0, failure_threshold=2),
        enable_immediate_recovery=True,
        warm_standby=True,
    )
    with RolloutFleet(cfg) as fleet:
        launcher = fleet.launcher("g0")
        assert fleet.sync_weights(weights, 1).ok
        assert fleet.exporter is not None
        fleet.exporter.wait_hf_export(1, timeout=60)
        assert launcher.wait_standby(STANDBY_WAIT_S)
        assert fleet.snapshot()["registry"]["groups"]["g0"]["standby"]["state"] == "ready"
        standby = launcher.standby_pid
        crashed = launcher.pid
        launcher.kill_rank(0)
        assert wait_for(lambda: bool(fleet.recoveries()), 120.0)
        assert fleet.wait_recoveries(120.0)
        result = fleet.recoveries()[0]
        assert result.status == "active" and result.strategy == "immediate", result
        assert result.standby_at_restart == "ready" and result.restart_source == "ready_standby"
        assert launcher.last_start_from_standby and launcher.pid not in (standby, crashed)
        assert launcher.standby_pid == standby and launcher.standby_state == "ready"
        assert fleet.checksums() == {"g0": sglang_digests(weights)["model"]}
        assert fleet.generate([1, 2], sampling_params={"max_new_tokens": 2}).group_id == "g0"
        assert launcher.wait_standby(STANDBY_WAIT_S)
        pids = [launcher.pid, launcher.standby_pid]
    assert all_gone([p for p in pids if p is not None])


def test_fork_check_tolerates_only_jemallocs_purging_thread() -> None:
    """On GPU hosts an import starts jemalloc's background thread (``jemalloc_bg_thd``): its
    own at-fork handlers make the fork safe, so the zygote must still fork; any other extra
    thread refuses it, naming the thread. Checked in a fresh interpreter (as the zygote is)."""
    script = textwrap.dedent(
        """
        import threading
        from rollsafe.adapters.reference_engine.zygote import _fork_problem

        def named_thread(name):
            ready, stop = threading.Event(), threading.Event()
            def run():
                with open("/proc/thread-self/comm", "w") as f:  # as a native thread names itself
                    f.write(name)
                ready.set()
                stop.wait(30)
            threading.Thread(target=run, daemon=True).start()
            assert ready.wait(10)
            return stop

        print("alone", _fork_problem())
        named_thread("jemalloc_bg_thd")
        print("jemalloc", _fork_problem())
        named_thread("omp_worker")
        print("pool", _fork_problem())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=repo_env()
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.strip().splitlines())
    assert lines["alone"] == "None"
    assert lines["jemalloc"] == "None"
    assert "not single-threaded" in lines["pool"] and "omp_worker" in lines["pool"]
    assert "jemalloc_bg_thd" not in lines["pool"]

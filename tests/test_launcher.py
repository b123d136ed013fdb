"""EngineLauncher against real reference-engine processes: start, readiness errors, chaos, restart.

Every engine here is a real OS process group; every test checks that nothing is left running.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("torch")

from engine_helpers import all_gone, wait_for

from rollsafe.adapters.engines import (
    EngineLauncher,
    EngineSpec,
    EngineStartError,
    SGLangClient,
    VLLMClient,
)
from rollsafe.processes import pid_alive


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def group_pids(launcher: EngineLauncher) -> list[int]:
    return [launcher.pid, *launcher.rank_pids]


def test_spec_validates_early() -> None:
    with pytest.raises(ValueError, match="ranks"):
        EngineSpec(model_path="x", ranks=0)
    with pytest.raises(ValueError, match="dialect"):
        EngineSpec(model_path="x", dialect="tgi")  # type: ignore[arg-type]
    spec = EngineSpec(model_path="/m", ranks=2, dialect="vllm", api_key="k")
    cmd = spec.command()
    assert cmd[1:3] == ["-m", "rollsafe.adapters.reference_engine"]
    assert cmd[cmd.index("--ranks") + 1] == "2"
    assert "k" not in cmd and "--api-key" not in cmd  # out of `ps`: in the environment
    assert spec.environment()["ROLLSAFE_API_KEY"] == "k"
    assert "--tokenizer-path" not in EngineSpec(model_path="/m", tokenizer_path="/m").command()
    assert "--tokenizer-path" in EngineSpec(model_path="/m", tokenizer_path="/t").command()


def test_one_rank_reinit_on_dummy_weights_then_disk_restores_checksum(
    model_dir: Path, launchers: list[EngineLauncher]
) -> None:
    launcher = EngineLauncher(EngineSpec(model_path=str(model_dir)))
    launchers.append(launcher)
    with launcher:
        assert launcher.is_alive()
        assert launcher.url.startswith("http://127.0.0.1:")
        assert isinstance(launcher.client, SGLangClient)
        assert launcher.client.is_healthy()
        assert launcher.ready_info["ranks"] == 1
        reference = launcher.client.weights_checksum()
        first_pids = group_pids(launcher)

        # Recovery as XTuner does it: restart on dummy weights, then load the real ones from disk.
        launcher.reinit(
            model_path=str(model_dir), tokenizer_path=str(model_dir), skip_load_weights=True
        )
        assert launcher.spec.load_format == "dummy"
        assert all_gone(first_pids)
        assert launcher.client.is_healthy()
        assert not launcher.client.weights_checksum().same_weights(reference)
        launcher.client.update_weights_from_disk(str(model_dir), weight_version="restored")
        restored = launcher.client.weights_checksum()
        assert restored.same_weights(reference)
        assert launcher.client.weight_version() == "restored"
        pids = group_pids(launcher)
        log_path = launcher.log_path
        assert log_path is not None and "ROLLSAFE_READY" in Path(log_path).read_text()
    assert not launcher.is_alive() and not launcher.started
    assert all_gone(pids)
    # a clean stop removes the log directory the launcher made (nothing failed in it)
    assert log_path.startswith(os.path.join(tempfile.gettempdir(), "rollsafe-engine-"))
    assert not Path(log_path).parent.exists()


def test_two_ranks_kill_rank_fails_health_and_kill_reaps_group(
    model_dir: Path, launchers: list[EngineLauncher]
) -> None:
    launcher = EngineLauncher(EngineSpec(model_path=str(model_dir), ranks=2, dialect="vllm"))
    launchers.append(launcher)
    launcher.start()
    assert isinstance(launcher.client, VLLMClient)
    assert len(launcher.rank_pids) == 2 and launcher.ready_info["ranks"] == 2
    assert launcher.client.is_healthy()
    pids = group_pids(launcher)

    log_path = launcher.log_path
    assert log_path is not None

    killed = launcher.kill_rank(1)
    assert all_gone([killed], timeout=5.0)
    assert wait_for(lambda: not launcher.client.is_healthy(timeout=1.0), timeout=10.0)
    assert not launcher.is_alive()

    launcher.kill()
    assert not launcher.started
    assert all_gone(pids, timeout=5.0)
    # a rank ended before the stop: the log that explains it stays
    assert "ROLLSAFE_READY" in Path(log_path).read_text()
    shutil.rmtree(Path(log_path).parent)


def test_a_log_directory_the_user_named_stays_and_one_made_again_after_a_stop(
    model_dir: Path, tmp_path: Path, launchers: list[EngineLauncher]
) -> None:
    named = EngineLauncher(EngineSpec(model_path=str(model_dir), log_dir=str(tmp_path / "logs")))
    launchers.append(named)
    with named:
        pass
    assert [p.suffix for p in (tmp_path / "logs").iterdir()] == [".log"]
    # a launcher started again after its last stop writes into its directory made anew
    launcher = EngineLauncher(EngineSpec(model_path=str(model_dir)))
    launchers.append(launcher)
    for _ in range(2):
        with launcher:
            log_path = launcher.log_path
            assert log_path is not None and Path(log_path).is_file()
        assert not Path(log_path).parent.exists()


def test_a_launcher_that_never_starts_leaves_no_log_directory(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directory is made with the first log: a fleet that refuses its configuration, or a
    launcher stopped before it started, leaves nothing in the temporary directory."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    launcher = EngineLauncher(EngineSpec(model_path=str(model_dir)))
    launcher.stop()
    assert launcher.log_path is None
    assert list(tmp_path.iterdir()) == []


def test_bad_model_path_raises_start_error_with_output_tail(
    tmp_path: Path, launchers: list[EngineLauncher]
) -> None:
    missing = tmp_path / "no-such-model"
    launcher = EngineLauncher(EngineSpec(model_path=str(missing), ready_timeout=60.0))
    launchers.append(launcher)
    with pytest.raises(EngineStartError) as info:
        launcher.start()
    err = info.value
    assert err.exit_code not in (None, 0)
    assert "no-such-model" in err.output_tail
    assert err.command == launcher.command()
    assert "no-such-model" in str(err)
    assert not launcher.started
    # the failed start's log outlives the launcher's last stop (the error names it)
    assert err.log_path is not None
    launcher.stop()
    assert "no-such-model" in Path(err.log_path).read_text()
    shutil.rmtree(Path(err.log_path).parent)


def test_missing_interpreter_raises_start_error(tmp_path: Path) -> None:
    spec = EngineSpec(model_path=str(tmp_path), python=str(tmp_path / "no-python"))
    with pytest.raises(EngineStartError, match="cannot execute"):
        EngineLauncher(spec).start()


def test_ready_timeout_kills_the_group(model_dir: Path, launchers: list[EngineLauncher]) -> None:
    launcher = EngineLauncher(EngineSpec(model_path=str(model_dir), ready_timeout=0.3))
    launchers.append(launcher)
    with pytest.raises(EngineStartError, match="no ready line") as info:
        launcher.start()
    assert info.value.exit_code is None  # it was still starting, so it was killed
    assert not launcher.started


def test_engine_dies_with_a_killed_parent(model_dir: Path, tmp_path: Path) -> None:
    """A launcher process killed with SIGKILL cannot clean up; the watchdog reaps its engine."""
    pid_file = tmp_path / "pids"
    script = textwrap.dedent(
        f"""
        import time
        from rollsafe.adapters.engines import EngineLauncher, EngineSpec
        launcher = EngineLauncher(EngineSpec(model_path={str(model_dir)!r})).start()
        with open({str(pid_file)!r}, "w") as f:
            f.write(" ".join(map(str, [launcher.pid, *launcher.rank_pids])))
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        assert wait_for(lambda: pid_file.exists() and pid_file.read_text() != "", 90.0)
        pids = [int(p) for p in pid_file.read_text().split()]
        assert all(pid_alive(p) for p in pids)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    assert all_gone(pids, timeout=10.0)


def test_the_watchdog_reaps_the_group_when_its_parent_dies_with_its_children(
    tmp_path: Path,
) -> None:
    """Ray's worker SIGKILLs its own children when it exits
    (``kill_child_processes_on_worker_exit``): the engine's leader dies with it, and so would a
    watchdog that were its child. The watchdog is detached, so it still SIGKILLs the group: the
    leader's own children (vLLM's EngineCore) go too, none is left running; with
    ``unlink_shm`` the ``/dev/shm`` segment only the group held is removed, one that another
    live process holds too is kept."""
    from rollsafe.processes import live_processes

    tag = f"rs-watchdog-{os.getpid()}"
    only, shared = Path(f"/dev/shm/{tag}-only"), Path(f"/dev/shm/{tag}-shared")
    pids_file, ready = tmp_path / "grandchild", tmp_path / "leader"
    grandchild_sh = f"exec 3>>{only} 4>>{shared}; sleep 600"
    script = textwrap.dedent(
        f"""
        import subprocess, sys, time
        from rollsafe.adapters.engines.launch.process_group import start_watchdog
        leader = subprocess.Popen(
            ["sh", "-c", "sh -c '{grandchild_sh}' & echo $! > {pids_file}; wait"],
            start_new_session=True,
        )
        start_watchdog(sys.executable, leader.pid, unlink_shm=True)
        with open({str(ready)!r}, "w") as f:
            f.write(str(leader.pid))
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    grandchild = None
    try:
        with open(shared, "ab"):  # this process holds it too: it must stay
            assert wait_for(
                lambda: (
                    ready.exists()
                    and ready.read_text() != ""
                    and pids_file.exists()
                    and pids_file.read_text().strip() != ""
                    and only.exists()
                ),
                60.0,
            )
            leader, grandchild = int(ready.read_text()), int(pids_file.read_text())
            assert pid_alive(leader) and pid_alive(grandchild)
            # as Ray does: the parent and every direct child of it SIGKILLed at once
            children = [p.pid for p in live_processes().values() if p.ppid == parent.pid]
            assert leader in children
            for pid in children:
                os.kill(pid, signal.SIGKILL)
            parent.send_signal(signal.SIGKILL)
            parent.wait()
            assert all_gone([leader, grandchild], timeout=10.0)
            assert wait_for(lambda: not only.exists(), 15.0), "the group's segment was left"
            assert shared.exists()  # held by a live process outside the group
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if grandchild is not None and pid_alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)
        for path in (only, shared):
            path.unlink(missing_ok=True)


def test_leftovers_of_a_real_engine_whose_server_died_first() -> None:
    """A SIGKILLed vLLM server's workers live on in its process group holding their
    ``/dev/shm`` queues: the launcher's stop still finds them and the files (found by the soak:
    each SIGKILL of a vLLM server left its queues, hundreds of MB)."""
    import types

    from rollsafe.adapters.engines.launch.real_engine import leftovers

    shm = Path(f"/dev/shm/rs-leftover-{os.getpid()}")
    leader = subprocess.Popen(
        ["sh", "-c", f"sh -c 'exec 3>>{shm}; sleep 600' & exit 0"], start_new_session=True
    )
    leader.wait()  # the server is gone; its worker is not
    try:
        assert wait_for(shm.exists, 30.0)
        spec = types.SimpleNamespace(kind="vllm")
        pids, held = leftovers(spec, leader.pid, [])  # type: ignore[arg-type]
        assert pids and all(pid_alive(p) for p in pids)
        assert str(shm) in held
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(leader.pid, signal.SIGKILL)
        shm.unlink(missing_ok=True)


#: a stand-in vLLM server: tells where ``VLLM_RPC_BASE_PATH`` points (argv[1]), holds a
#: ``/dev/shm`` segment (argv[2]) and binds a unix socket in that directory (as vLLM's ZMQ
#: ``ipc://`` endpoints do), then waits
_STAND_IN_VLLM = """
import os, pathlib, socket, sys, time
base = os.environ["VLLM_RPC_BASE_PATH"]
segment = open(sys.argv[2], "ab")
s = socket.socket(socket.AF_UNIX)
s.bind(base + "/sock")
s.listen()
pathlib.Path(sys.argv[1]).write_text(base)
time.sleep(600)
"""


class _Owner:
    """What a candidate's finalizer hangs on (a launcher, in rollsafe)."""


def test_a_vllm_group_that_died_first_leaves_no_ipc_socket_or_shm_segment(tmp_path: Path) -> None:
    """A real vLLM binds its ZMQ ``ipc://`` sockets under ``VLLM_RPC_BASE_PATH`` (default: the
    temp directory) and maps ``/dev/shm`` queues; SIGKILLed, it removes neither, and once its
    whole group is dead nothing names them (found in ``/tmp``: ~1,000 socket files a day of
    test runs). The launcher gives each vLLM a directory of its own for the sockets and notes
    its segments when it is ready: ``stop`` deletes both although the group died first. A
    stand-in server (Python holding a unix socket in that directory and a segment) runs as a
    ``kind="vllm"`` candidate."""
    from rollsafe.adapters.engines.launch.process_group import spawn_candidate
    from rollsafe.adapters.engines.launch.running import RunningEngine

    shm = Path(f"/dev/shm/rs-vllm-queue-{os.getpid()}")
    where = tmp_path / "rpc_base"
    cmd = [sys.executable, "-c", _STAND_IN_VLLM, str(where), str(shm)]
    # no watchdog: it would delete the directory of a dead group too (the next test)
    spec = EngineSpec(
        model_path="m", kind="vllm", python=sys.executable, reap_on_parent_death=False
    )
    owner = _Owner()
    cand = spawn_candidate(owner, spec, cmd, str(tmp_path / "log"))
    running = RunningEngine()
    running.install(cand)
    try:
        assert wait_for(lambda: where.exists() and where.read_text() != "", 30.0)
        rpc_dir = Path(where.read_text())
        sock = rpc_dir / "sock"
        assert sock.exists() and rpc_dir.name.startswith("rollsafe-vllm-ipc-") and shm.exists()
        assert len(str(sock)) - len("sock") + 37 <= 107  # vLLM's "/" + uuid4 fits a socket path
        running.note_held(spec)
        assert str(shm) in running.held and str(sock) in running.held
        os.killpg(running.require_proc().pid, signal.SIGKILL)  # the whole group, first
        assert all_gone([running.require_proc().pid], timeout=10.0)
        running.stop(spec, sig_first=signal.SIGTERM, timeout=5.0)
        assert not rpc_dir.exists(), "the ipc-socket directory was left"
        assert not shm.exists(), "the segment noted at ready was left"
    finally:
        if running.proc is not None:
            running.stop(spec, sig_first=signal.SIGKILL, timeout=5.0)
        shm.unlink(missing_ok=True)


def test_the_watchdog_deletes_the_groups_directories_when_the_group_ends(tmp_path: Path) -> None:
    """The parent-death watchdog's ``dirs`` (a vLLM's ipc-socket directory) go once the group
    is gone: when it ends by itself, and when the watchdog killed it because its launching
    process died (which then cannot delete them)."""
    from rollsafe.adapters.engines.launch.process_group import start_watchdog

    own = tmp_path / "ended-by-itself"
    own.mkdir()
    (own / "sock").write_text("")
    leader = subprocess.Popen(["sleep", "1"], start_new_session=True)
    start_watchdog(sys.executable, leader.pid, dirs=[str(own)])
    leader.wait()
    assert wait_for(lambda: not own.exists(), 15.0), "the directory of an ended group was left"

    orphaned, ready = tmp_path / "orphaned", tmp_path / "leader"
    orphaned.mkdir()
    script = textwrap.dedent(
        f"""
        import subprocess, sys, time
        from rollsafe.adapters.engines.launch.process_group import start_watchdog
        leader = subprocess.Popen(["sleep", "600"], start_new_session=True)
        start_watchdog(sys.executable, leader.pid, dirs=[{str(orphaned)!r}])
        with open({str(ready)!r}, "w") as f:
            f.write(str(leader.pid))
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        assert wait_for(lambda: ready.exists() and ready.read_text() != "", 60.0)
        group_leader = int(ready.read_text())
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert all_gone([group_leader], timeout=10.0)
        assert wait_for(lambda: not orphaned.exists(), 15.0), "the killed group's directory"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_weight_version_reaches_the_engine_command() -> None:
    from rollsafe.adapters.engines import EngineSpec

    spec = EngineSpec(model_path="/m", weight_version="7")
    cmd = spec.command()
    assert cmd[cmd.index("--weight-version") + 1] == "7"
    assert "--weight-version" not in EngineSpec(model_path="/m").command()


def test_real_servers_on_the_same_gpus_start_one_at_a_time() -> None:
    """``start_slot``: a second start on the same GPUs waits until the first left its slot
    (vLLM profiles device memory while it starts); other GPUs and CPU engines do not wait."""
    import threading

    from rollsafe.adapters.engines.launch.real_engine import gpu_key, start_slot

    def spec(device: str, visible: str | None = None) -> EngineSpec:
        env = {"CUDA_VISIBLE_DEVICES": visible} if visible is not None else None
        return EngineSpec(model_path="m", kind="vllm", device=device, env=env)

    assert gpu_key(spec("cpu")) is None
    assert gpu_key(spec("cuda", "1")) == "1"
    entered = {name: threading.Event() for name in ("second", "other_gpu", "cpu")}

    def start(name: str, s: EngineSpec) -> threading.Thread:
        def body() -> None:
            with start_slot(s):
                entered[name].set()

        t = threading.Thread(target=body, daemon=True)
        t.start()
        return t

    with start_slot(spec("cuda", "0")):
        second = start("second", spec("cuda", "0"))
        others = [start("other_gpu", spec("cuda", "1")), start("cpu", spec("cpu"))]
        assert entered["other_gpu"].wait(10) and entered["cpu"].wait(10)
        assert not entered["second"].wait(0.5)  # still held by the first start
    assert entered["second"].wait(10)
    for t in (second, *others):
        t.join(10)


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line holds ``text``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/cmdline", "rb") as f:
                if text.encode() in f.read() and pid_alive(int(entry)):
                    found.append(int(entry))
    return found


def test_a_candidate_nobody_can_watch_is_killed_with_its_directory(tmp_path: Path) -> None:
    """When watching a spawned vLLM fails (here: an owner its finalizer cannot hang on), the
    engine and its ipc-socket directory go at once: nothing else would end them."""
    from rollsafe.adapters.engines.launch.process_group import spawn_candidate

    where = tmp_path / "rpc_base"
    shm = Path(f"/dev/shm/rs-unwatched-{os.getpid()}")
    cmd = [sys.executable, "-c", _STAND_IN_VLLM, str(where), str(shm)]
    spec = EngineSpec(
        model_path="m", kind="vllm", python=sys.executable, reap_on_parent_death=False
    )
    before = set(Path(tempfile.gettempdir()).glob("rollsafe-vllm-ipc-*"))
    try:
        with pytest.raises(TypeError, match="weak reference"):
            spawn_candidate(object(), spec, cmd, str(tmp_path / "log"))
        assert set(Path(tempfile.gettempdir()).glob("rollsafe-vllm-ipc-*")) == before
        assert _processes_naming(str(where)) == []  # the stand-in was killed, not left running
    finally:
        shm.unlink(missing_ok=True)

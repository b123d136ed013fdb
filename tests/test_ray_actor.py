"""EngineActor on a real local Ray: start, serve, observe, kill and restart one engine group."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("torch")

from rollsafe.adapters.engines import EngineSpec  # noqa: E402
from rollsafe.adapters.ray import EngineActor, engine_actor, init_ray  # noqa: E402
from rollsafe.ports import GenerateResult  # noqa: E402
from rollsafe.processes import pid_alive  # noqa: E402

PROMPT = [3, 14, 15, 92, 65]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0}


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    if ray.is_initialized():
        ray.shutdown()
    # short: Ray's socket paths under it must stay within AF_UNIX's 107 bytes
    temp = tempfile.mkdtemp(prefix="rs-ray-", dir="/tmp")
    started = init_ray(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        _temp_dir=temp,
    )
    assert started
    assert not init_ray()  # second call is a no-op
    yield
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def wait_pids_gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_engine_actor_lifecycle(local_ray: None, model_dir: Path) -> None:
    actor: Any = EngineActor.remote(EngineSpec(model_path=str(model_dir)))
    try:
        info = ray.get(actor.start.remote(), timeout=120)
        assert info["url"] == ray.get(actor.url.remote())
        assert ray.get(actor.health.remote())
        node = ray.get(actor.node_id.remote())
        assert node == ray.get_runtime_context().get_node_id()

        first: GenerateResult = ray.get(actor.generate.remote(PROMPT, sampling_params=GREEDY))
        assert len(first.output_ids) == 6
        checksum = ray.get(actor.weights_checksum.remote())
        pids = ray.get(actor.pids.remote())
        group = [pids["pid"], *pids["rank_pids"]]
        # the local Ray init_ray started runs its workers (and the engines they start) at
        # niceness 0, not Ray's 15 (which starved them beside busy processes: 180 s starts)
        nice = {p: os.getpriority(os.PRIO_PROCESS, p) for p in group}
        assert set(nice.values()) == {0}, nice

        ray.get(actor.kill.remote())
        assert not ray.get(actor.health.remote())
        assert ray.get(actor.url.remote()) is None
        assert wait_pids_gone(group)

        # a threaded actor answers health while a restart runs (recovery_never_on_health_thread)
        restarting = actor.restart.remote()
        assert ray.get(actor.health.remote(timeout=1.0), timeout=30) in (False, True)
        still_running, _ = ray.wait([restarting], timeout=0)
        assert not still_running, "health waited for the restart to finish"
        info = ray.get(restarting, timeout=120)
        assert info["url"] == ray.get(actor.url.remote())
        assert ray.get(actor.health.remote())
        assert ray.get(actor.weights_checksum.remote()).same_weights(checksum)
        again = ray.get(actor.generate.remote(PROMPT, sampling_params=GREEDY))
        assert again.output_ids == first.output_ids
        ray.get(actor.call.remote("flush_cache"))
        pids = ray.get(actor.pids.remote())
        group = [pids["pid"], *pids["rank_pids"]]
    finally:
        # SIGKILL of the actor process: no finalizer runs there; the launcher's watchdog reaps
        ray.kill(actor)
    assert wait_pids_gone(group, timeout=15.0)


def test_actor_stop_is_graceful_and_idempotent(local_ray: None, model_dir: Path) -> None:
    actor: Any = engine_actor(num_cpus=0, max_concurrency=2).remote(
        EngineSpec(model_path=str(model_dir), dialect="vllm")
    )
    try:
        assert ray.get(actor.url.remote()) is None and not ray.get(actor.health.remote())
        ray.get(actor.start.remote(), timeout=120)
        pids = ray.get(actor.pids.remote())
        assert ray.get(actor.spec.remote())["dialect"] == "vllm"
        ray.get(actor.stop.remote(timeout=5.0))
        ray.get(actor.stop.remote())  # stopping a stopped engine is a no-op
        assert ray.get(actor.pids.remote()) == {"pid": None, "rank_pids": []}
        assert wait_pids_gone([pids["pid"], *pids["rank_pids"]])
    finally:
        ray.kill(actor)

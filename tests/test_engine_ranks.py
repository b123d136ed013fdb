"""Process-level tests of the multi-rank reference engine and its fault injection.

The module engine has two rank processes; its last test kills rank 1, so it runs last.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from engine_helpers import (
    EngineProcess,
    engine_factory,  # noqa: F401  (fixture)
    free_port,
    module_engine,
    pid_alive,
    tiny_model_dir,  # noqa: F401  (fixture)
    tiny_model_dir_b,  # noqa: F401  (fixture)
    wait_for,
)
from test_engine_sglang import GREEDY, PROMPT, hf_greedy, hf_state

from rollsafe.adapters.reference_engine.collective import open_weight_update_group
from rollsafe.checksum import weights_checksum
from rollsafe.transports.bucket import pack_buckets, serialize_bucket

PROBE_DEADLINE_S = 5.0


@pytest.fixture(scope="module")
def engine2(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(request, tiny_model_dir, ranks=2, faults=True)


def test_two_ranks_generate_like_transformers(
    engine2: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    assert engine2.ready["ranks"] == 2 and len(set(engine2.rank_pids)) == 2
    assert all(pid_alive(p) for p in engine2.rank_pids)
    r = engine2.post("/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == hf_greedy(tiny_model_dir, PROMPT, 12)
    got = engine2.checksum()  # lm_head is gathered from both ranks
    assert got["model"] == weights_checksum(hf_state(tiny_model_dir))["model"]


def test_two_ranks_tensor_update_one_entry_per_rank(
    engine2: EngineProcess,
    tiny_model_dir_b: Path,  # noqa: F811
) -> None:
    state = hf_state(tiny_model_dir_b)
    for b in pack_buckets(state.items(), bucket_bytes=256 << 10):
        entry = serialize_bucket(b)
        r = engine2.post(
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": [entry, entry],
                "load_format": "flattened_bucket",
                "weight_version": "T2",
            },
        )
        assert r.status_code == 200, r.text
    assert engine2.checksum()["model"] == weights_checksum(state)["model"]
    r = engine2.post("/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert r.json()["output_ids"] == hf_greedy(tiny_model_dir_b, PROMPT, 12)


def test_two_ranks_distributed_update(
    engine2: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    state = hf_state(tiny_model_dir)
    port = free_port()
    res: dict[str, httpx.Response] = {}

    def call(key: str, path: str, body: dict[str, Any]) -> None:
        res[key] = engine2.post(path, body, timeout=60)

    t = threading.Thread(
        target=call,
        args=(
            "init",
            "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1,
                "world_size": 3,
                "group_name": "g2",
                "backend": "gloo",
            },
        ),
    )
    t.start()
    pg = open_weight_update_group(
        master_address="127.0.0.1",
        master_port=port,
        rank=0,
        world_size=3,
        group_name="g2",
        timeout_s=60,
    )
    t.join(60)
    assert res["init"].status_code == 200, res["init"].text
    names = list(state)
    body = {
        "names": names,
        "dtypes": ["float32"] * len(names),
        "shapes": [list(state[n].shape) for n in names],
        "group_name": "g2",
        "load_format": "flattened_bucket",
        "weight_version": "D2",
    }
    t = threading.Thread(target=call, args=("upd", "/update_weights_from_distributed", body))
    t.start()
    pg.broadcast(torch.cat([state[n].reshape(-1) for n in names]), 0).wait()
    t.join(60)
    assert res["upd"].status_code == 200, res["upd"].text
    got = engine2.checksum()
    assert got["model"] == weights_checksum(state)["model"] and got["weight_version"] == "D2"
    assert engine2.post("/destroy_weights_update_group", {"group_name": "g2"}).status_code == 200


def test_fail_next_and_slow(engine2: EngineProcess) -> None:
    assert engine2.post("/fault/fail_next", {"endpoint": "/health"}).status_code == 200
    assert engine2.get("/health").status_code == 500
    assert engine2.get("/health").status_code == 200
    assert engine2.post("/fault/slow", {"seconds": 0.3}).status_code == 200
    t0 = time.monotonic()
    assert engine2.get("/health").status_code == 200
    assert time.monotonic() - t0 >= 0.3
    assert engine2.post("/fault/slow", {"seconds": 0}).status_code == 200


def test_kill_nonzero_rank_fails_health_and_inflight(engine2: EngineProcess) -> None:
    """Runs last in this module: it leaves engine2 without rank 1."""
    inflight: dict[str, Any] = {}

    def long_generate() -> None:
        try:
            inflight["r"] = engine2.post(
                "/generate",
                {
                    "input_ids": PROMPT,
                    "sampling_params": {
                        "max_new_tokens": 900,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                },
                timeout=30,
            )
        except httpx.HTTPError as exc:
            inflight["r"] = exc

    t = threading.Thread(target=long_generate)
    t.start()
    time.sleep(0.3)  # let the request start decoding (not an assertion)
    os.kill(engine2.rank_pids[1], signal.SIGKILL)
    assert wait_for(lambda: not engine2.healthy(timeout=1.0), PROBE_DEADLINE_S)
    t.join(PROBE_DEADLINE_S)
    assert not t.is_alive(), "in-flight generate hung after a rank died"
    r = inflight["r"]
    assert isinstance(r, httpx.Response) and r.status_code == 503, r
    assert "rank 1" in r.json()["message"]
    health = engine2.get("/health")
    assert health.status_code == 503 and "rank 1" in health.json()["message"]
    assert engine2.post("/generate", {"input_ids": PROMPT}).status_code == 503


def test_fault_crash_takes_all_ranks(
    engine_factory: Any,  # noqa: F811
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    eng = engine_factory(tiny_model_dir, ranks=2, faults=True)
    with pytest.raises(httpx.HTTPError):
        eng.post("/fault/crash", {}, timeout=5)
    assert wait_for(lambda: not eng.healthy(timeout=1.0), PROBE_DEADLINE_S)
    assert wait_for(lambda: not any(pid_alive(p) for p in eng.rank_pids), PROBE_DEADLINE_S)


def test_fault_hang_stops_answering(
    engine_factory: Any,  # noqa: F811
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    eng = engine_factory(tiny_model_dir, faults=True)
    with pytest.raises(httpx.TimeoutException):
        eng.post("/fault/hang", {}, timeout=0.5)
    assert not eng.healthy(timeout=1.0)
    assert pid_alive(eng.pid)

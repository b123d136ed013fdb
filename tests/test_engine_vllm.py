"""Process-level tests of the reference engine's vLLM dialect (one rank)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from engine_helpers import (
    EngineProcess,
    free_port,
    module_engine,
    tiny_model_dir,  # noqa: F401  (fixture)
    tiny_model_dir_b,  # noqa: F401  (fixture)
)
from test_engine_sglang import PROMPT, hf_greedy, hf_state

from rollsafe.adapters.reference_engine.collective import open_weight_update_group
from rollsafe.checksum import weights_checksum


@pytest.fixture(scope="module")
def vllm(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(request, tiny_model_dir, extra_args=["--dialect", "vllm"])


def test_completions_greedy(vllm: EngineProcess, tiny_model_dir: Path) -> None:  # noqa: F811
    assert vllm.ready["dialect"] == "vllm"
    r = vllm.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == hf_greedy(tiny_model_dir, PROMPT, 8)
    assert r.json()["usage"]["prompt_tokens"] == len(PROMPT)
    r = vllm.post("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and isinstance(r.json()["choices"][0]["text"], str)
    assert vllm.post("/generate", {"input_ids": PROMPT}).status_code == 404  # SGLang-only


def test_sleep_wake_pause(vllm: EngineProcess) -> None:
    before = vllm.checksum()
    assert vllm.post("/sleep?level=1").status_code == 200
    assert vllm.get("/is_sleeping").json() == {"is_sleeping": True}
    assert vllm.post("/v1/completions", {"prompt": PROMPT}).status_code == 503
    assert vllm.post("/wake_up").status_code == 200
    assert vllm.get("/is_sleeping").json() == {"is_sleeping": False}
    assert vllm.checksum() == before  # level 1 keeps a host copy
    assert vllm.post("/pause?mode=keep").status_code == 200
    assert vllm.get("/is_paused").json() == {"is_paused": True}
    assert vllm.post("/resume").status_code == 200
    assert vllm.post("/reset_prefix_cache").status_code == 200
    r = vllm.post("/collective_rpc", {"method": "update_weights_from_ipc", "args": [{}]})
    assert r.status_code == 400 and "CUDA" in r.json()["message"]
    r = vllm.post("/collective_rpc", {"method": "rm_rf"})
    assert r.status_code == 400 and "'rm_rf'" in r.json()["message"]
    r = vllm.post(
        "/collective_rpc", {"method": "reload_weights", "kwargs": {"model_path": "/" + "x" * 5000}}
    )
    assert r.status_code == 400 and "File name too long" in r.json()["message"]
    assert vllm.checksum() == before


def test_native_weight_transfer(vllm: EngineProcess, tiny_model_dir_b: Path) -> None:  # noqa: F811
    state = hf_state(tiny_model_dir_b)
    port = free_port()
    res: dict[str, httpx.Response] = {}

    def call(key: str, path: str, body: dict[str, Any]) -> None:
        res[key] = vllm.post(path, body, timeout=60)

    t = threading.Thread(
        target=call,
        args=(
            "init",
            "/init_weight_transfer_engine",
            {
                "init_info": {
                    "master_address": "127.0.0.1",
                    "master_port": port,
                    "rank_offset": 1,
                    "world_size": 2,
                }
            },
        ),
    )
    t.start()
    pg = open_weight_update_group(
        master_address="127.0.0.1",
        master_port=port,
        rank=0,
        world_size=2,
        group_name="vllm_weight_transfer",
        timeout_s=60,
    )
    t.join(60)
    assert res["init"].status_code == 200, res["init"].text
    names = list(state)
    info = {
        "names": names,
        "dtype_names": ["float32"] * len(names),
        "shapes": [list(state[n].shape) for n in names],
        "packed": False,
    }
    r = vllm.post("/update_weights", {"update_info": info})
    assert r.status_code == 400 and "start_weight_update" in r.json()["message"]
    assert vllm.post("/start_weight_update", {"is_checkpoint_format": True}).status_code == 200
    t = threading.Thread(target=call, args=("upd", "/update_weights", {"update_info": info}))
    t.start()
    for n in names:
        pg.broadcast(state[n].contiguous(), 0).wait()
    t.join(60)
    assert res["upd"].status_code == 200, res["upd"].text
    assert vllm.post("/finish_weight_update", {"weight_version": "V"}).status_code == 200
    got = vllm.checksum()
    assert got["model"] == weights_checksum(state)["model"] and got["weight_version"] == "V"
    assert torch.is_tensor(state[names[0]])

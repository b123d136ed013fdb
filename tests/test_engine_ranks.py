"""Process-level tests of the multi-rank reference engine, its start-up and fault injection.

``engine2`` (two ranks, forked after rank 0's imports) serves most tests; its last test kills
rank 1, so it runs after the others that use it. ``slow_engine2`` starts its ranks with
``spawn`` (the CUDA path), rank 1 held back by an injected start-up delay longer than the
collective timeout; its last test crashes it.
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
    EngineStartError,
    join_weight_group,
    module_engine,
    pid_alive,
    sglang_digests,
    start_engine,
    tiny_model_dir,  # noqa: F401  (fixture)
    tiny_model_dir_b,  # noqa: F401  (fixture)
    wait_for,
)
from test_engine_sglang import GREEDY, PROMPT, hf_greedy, hf_state

from rollsafe.adapters.reference_engine.bootstrap import START_FAULT_ENV
from rollsafe.wire.bucket import pack_buckets, serialize_bucket, serialize_named_tensors

PROBE_DEADLINE_S = 5.0


RANK1_START_DELAY_S = 2.5
SHORT_COLLECTIVE_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def engine2(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(request, tiny_model_dir, ranks=2, faults=True)


@pytest.fixture(scope="module")
def slow_engine2(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(
        request,
        tiny_model_dir,
        ranks=2,
        faults=True,
        env={START_FAULT_ENV: f"1:{RANK1_START_DELAY_S}"},
        extra_args=[
            "--rank-start-method",
            "spawn",
            "--collective-timeout",
            str(SHORT_COLLECTIVE_TIMEOUT_S),
        ],
    )


def test_two_ranks_generate_like_transformers(
    engine2: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    assert engine2.ready["ranks"] == 2 and len(set(engine2.rank_pids)) == 2
    assert engine2.ready["rank_start_method"] == "fork"
    assert all(pid_alive(p) for p in engine2.rank_pids)
    r = engine2.post("/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == hf_greedy(tiny_model_dir, PROMPT, 12)
    got = engine2.checksum()  # each rank its own shards, as a real SGLang with TP 2
    want = sglang_digests(hf_state(tiny_model_dir), ranks=2)
    assert got["ranks"] == want["ranks"] and got["model"] == want["model"]


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
    assert engine2.checksum()["model"] == sglang_digests(state, ranks=2)["model"]
    r = engine2.post("/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert r.json()["output_ids"] == hf_greedy(tiny_model_dir_b, PROMPT, 12)


def test_two_ranks_distributed_update(
    engine2: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    state = hf_state(tiny_model_dir)
    res: dict[str, httpx.Response] = {}

    def call(key: str, path: str, body: dict[str, Any]) -> None:
        res[key] = engine2.post(path, body, timeout=60)

    pg = join_weight_group(engine2, world_size=3, group_name="g2")
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
    assert got["model"] == sglang_digests(state, ranks=2)["model"]
    assert got["weight_version"] == "D2"
    assert engine2.post("/destroy_weights_update_group", {"group_name": "g2"}).status_code == 200


def test_two_ranks_bad_entry_on_one_rank_changes_no_rank(
    engine2: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
    tiny_model_dir_b: Path,  # noqa: F811
) -> None:
    r = engine2.post(
        "/update_weights_from_disk", {"model_path": str(tiny_model_dir), "weight_version": "A2"}
    )
    assert r.status_code == 200, r.text
    before = engine2.checksum()
    named = list(hf_state(tiny_model_dir_b).items())
    (good,) = pack_buckets(named, bucket_bytes=1 << 30)
    mid = len(named) // 2
    bad_named = [*named[:mid], (named[mid][0], named[mid][1].double()), *named[mid + 1 :]]
    bad = serialize_named_tensors(bad_named)  # rank 1's entry: one tensor of the wrong dtype
    r = engine2.post(
        "/update_weights_from_tensor",
        {
            "serialized_named_tensors": [serialize_bucket(good), bad],
            "load_format": "flattened_bucket",
            "weight_version": "bad",
        },
    )
    assert r.status_code == 400 and repr(named[mid][0]) in r.json()["message"], r.text
    assert engine2.checksum() == before  # rank 0's valid entry was not applied either
    r = engine2.post("/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert r.json()["output_ids"] == hf_greedy(tiny_model_dir, PROMPT, 12)  # both trunks: A


@pytest.mark.parametrize(
    ("model_path", "needle"),
    [
        ("/" + "a" * 5000, "File name too long"),
        ("/tmp/" + "b" * 300, "File name too long"),
        ("/tmp/nul\u0000byte", "is not a directory"),
        (str(Path(__file__)), "is not a directory"),
    ],
    ids=["path-too-long", "name-too-long", "nul-byte", "a-file"],
)
def test_two_ranks_bad_disk_path_is_400_and_keeps_serving(
    engine2: EngineProcess, model_path: str, needle: str
) -> None:
    before = engine2.checksum()
    r = engine2.post(
        "/update_weights_from_disk", {"model_path": model_path, "weight_version": "bad"}
    )
    assert r.status_code == 400, r.text
    message = r.json()["message"]
    assert needle in message and model_path[:8] in message  # names the path
    assert engine2.checksum() == before  # old weights and version still served
    assert engine2.get("/health").status_code == 200
    assert all(pid_alive(p) for p in engine2.rank_pids)
    r = engine2.post("/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert (
        r.status_code == 200 and r.json()["meta_info"]["weight_version"] == before["weight_version"]
    )


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


def test_slow_rank_start_does_not_race_the_collective_timeout(
    slow_engine2: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    """Rank 1 is ready 2.5 s after rank 0 while collectives time out after 1 s: start still works.

    Ranks meet in the group only after every rank has loaded, and the waits before that are
    bounded by the start timeout, not the collective timeout.
    """
    eng = slow_engine2
    assert eng.ready["rank_start_method"] == "spawn" and len(set(eng.rank_pids)) == 2
    phases = eng.ready["startup_s"]
    assert phases["group_joined"] - phases["ranks_started"] >= RANK1_START_DELAY_S
    body = {"input_ids": PROMPT, "sampling_params": GREEDY}
    r = eng.post("/generate", body)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == hf_greedy(tiny_model_dir, PROMPT, 12)


def test_rank_failing_at_start_is_reported_at_once(
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    t0 = time.monotonic()
    with pytest.raises(EngineStartError) as info:
        start_engine(tiny_model_dir, ranks=2, faults=True, env={START_FAULT_ENV: "1:fail"})
    assert "rank 1 failed to start" in str(info.value) and "injected" in str(info.value)
    assert time.monotonic() - t0 < 60  # not the 180 s start timeout


def test_fault_crash_takes_all_ranks(slow_engine2: EngineProcess) -> None:
    """Runs last for ``slow_engine2``: SIGKILL of rank 0 takes rank 1 with it (PDEATHSIG)."""
    eng = slow_engine2
    assert all(pid_alive(p) for p in eng.rank_pids)
    with pytest.raises(httpx.HTTPError):
        eng.post("/fault/crash", {}, timeout=5)
    assert wait_for(lambda: not eng.healthy(timeout=1.0), PROBE_DEADLINE_S)
    assert wait_for(lambda: not any(pid_alive(p) for p in eng.rank_pids), PROBE_DEADLINE_S)

"""Process-level tests of the reference engine's vLLM dialect (one rank).

The module engine imitates vLLM 0.32.0 (the default, ``--vllm-version``); ``vllm033`` imitates
0.33.0 where the two differ. A vLLM route that fails answers 500 and drops its connection, so
requests that may fail go through ``post_once``. Poison and death: tests/test_vllm_behaviour.py.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from engine_helpers import (
    EngineProcess,
    assert_vllm_digests,
    free_port,
    module_engine,
    tiny_model_dir,  # noqa: F401  (fixture)
    tiny_model_dir_b,  # noqa: F401  (fixture)
)
from test_engine_sglang import (
    PROMPT,
    fresh_token,
    hf_greedy,
    hf_state,
    next_stop,
    spanning_stop,
    tokenizer_of,
)

from rollsafe.wire.group import open_weight_update_group
from rollsafe.wire.group_names import VLLM_WEIGHT_TRANSFER_GROUP


@pytest.fixture(scope="module")
def vllm(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(request, tiny_model_dir, extra_args=["--dialect", "vllm"])


@pytest.fixture(scope="module")
def vllm033(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(
        request, tiny_model_dir, extra_args=["--dialect", "vllm", "--vllm-version", "0.33.0"]
    )


def test_completions_greedy(vllm: EngineProcess, tiny_model_dir: Path) -> None:  # noqa: F811
    assert vllm.ready["dialect"] == "vllm" and vllm.ready["vllm_version"] == "0.32.0"
    assert vllm.get("/version").json() == {"version": "0.32.0"}
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    r = vllm.post("/v1/completions", {**body, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == hf_greedy(tiny_model_dir, PROMPT, 8)
    assert choice["prompt_token_ids"] == PROMPT
    assert "weight_versions" not in choice  # 0.32.0 has none
    assert r.json()["usage"]["prompt_tokens"] == len(PROMPT)
    # vLLM: the ids only with return_token_ids
    choice = vllm.post("/v1/completions", body).json()["choices"][0]
    assert choice["token_ids"] is None and choice["prompt_token_ids"] is None
    # 0.32.0 has no return_weight_versions: it keeps the unknown field and ignores it (logged),
    # as the reference engine does: no spans come
    r = vllm.post("/v1/completions", {**body, "return_weight_versions": True})
    assert r.status_code == 200 and "weight_versions" not in r.json()["choices"][0]
    r = vllm.post("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and isinstance(r.json()["choices"][0]["text"], str)
    assert vllm.post("/generate", {"input_ids": PROMPT}).status_code == 404  # SGLang-only


def test_vllm_version_flag_needs_the_vllm_dialect(tiny_model_dir: Path) -> None:  # noqa: F811
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollsafe.adapters.reference_engine",
            "--model-path",
            str(tiny_model_dir),
            "--vllm-version",
            "0.33.0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "--vllm-version 0.33.0 needs --dialect vllm" in out.stderr


def test_0_33_refuses_new_requests_while_paused_and_reports_spans(
    vllm033: EngineProcess,
) -> None:
    assert vllm033.get("/version").json() == {"version": "0.33.0"}
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "return_token_ids": True}
    r = vllm033.post("/v1/completions", {**body, "return_weight_versions": True})
    assert r.json()["choices"][0]["weight_versions"] == [
        {"version": "default", "start": 0, "end": 3}
    ]
    # vLLM 0.33.0: abort/wait pauses turn new requests away with a 503 until /resume; keep
    # queues them (0.32.0 queues in every mode: tests/test_vllm_behaviour.py)
    for mode in ("abort", "wait"):
        assert vllm033.post(f"/pause?mode={mode}").json() == {"status": "paused"}
        r = vllm033.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 503 and "paused" in r.json()["message"]
        assert vllm033.post("/resume").json() == {"status": "resumed"}
        r = vllm033.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200


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
    rpc = "/collective_rpc"
    r = vllm.post(rpc, {"method": "update_weights_from_ipc", "kwargs": {"zmq_handles": {}}})
    assert r.status_code == 400 and "CUDA" in r.json()["message"]
    r = vllm.post(rpc, {"method": "update_weights_from_ipc", "args": [{}]})
    assert r.status_code == 400 and "args[0]" in r.json()["message"]  # vLLM: args are strings
    r = vllm.post(rpc, {"method": "rm_rf"})
    assert r.status_code == 400 and "'rm_rf'" in r.json()["message"]
    # vLLM's reload_weights takes weights_path: model_path is the worker's TypeError (a 500
    # that drops the connection), raised before anything was touched: the engine serves on
    r = vllm.post_once(rpc, {"method": "reload_weights", "kwargs": {"model_path": "/m"}})
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert "unexpected keyword argument 'model_path'" in message
    assert r.headers.get("connection") is None  # dropped without saying so
    assert vllm.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).status_code == 200
    assert vllm.checksum() == before


# ---- stop strings and stop tokens (vLLM's rules: rollsafe/.../stops.py) ---------------------
#: greedy completions of 12 tokens with their ids (the stop tests' base)
STOP_BASE = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "return_token_ids": True}


def _choice(engine: EngineProcess, **extra: Any) -> dict[str, Any]:
    r = engine.post("/v1/completions", {**STOP_BASE, **extra})
    assert r.status_code == 200, r.text
    choice: dict[str, Any] = r.json()["choices"][0]
    return choice


def _stream(engine: EngineProcess, **extra: Any) -> list[dict[str, Any]]:
    import json

    r = engine.post("/v1/completions", {**STOP_BASE, **extra, "stream": True})
    assert r.status_code == 200, r.text
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x)["choices"][0] for x in lines[:-1]]


def test_a_stop_string_across_two_tokens_ends_the_completion(
    vllm: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    """vLLM keeps every token through the one completing the stop string in ``token_ids``,
    cuts the text before the string (after it with ``include_stop_str_in_output``) and names
    it in ``stop_reason``; the stream sends the same text, holding back the longest stop
    string but one character until the end."""
    tok = tokenizer_of(tiny_model_dir)
    greedy = hf_greedy(tiny_model_dir, PROMPT, 12)
    stop, k = spanning_stop(tok, greedy)
    text = tok.decode(greedy[:k])
    at = text.find(stop)
    for extra, kept in (({}, False), ({"include_stop_str_in_output": True}, True)):
        choice = _choice(vllm, stop=stop, **extra)
        assert choice["token_ids"] == greedy[:k]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
        assert choice["text"] == (text[: at + len(stop)] if kept else text[:at])
        chunks = _stream(vllm, stop=[stop], **extra)
        assert [t for c in chunks for t in c["token_ids"]] == greedy[:k]
        assert "".join(c["text"] for c in chunks) == choice["text"]
        assert (chunks[-1]["finish_reason"], chunks[-1]["stop_reason"]) == ("stop", stop)
        assert all(c["finish_reason"] is None for c in chunks[:-1])
        hold = 0 if kept else len(stop) - 1
        for i in range(1, len(chunks)):  # what was sent never reaches into the hold-back
            sent = "".join(c["text"] for c in chunks[:i])
            assert len(sent) <= max(0, len(tok.decode(greedy[:i])) - hold)
    # without stop strings the stream's text is the completion's, token by token
    plain = _choice(vllm)
    assert plain["token_ids"] == greedy and plain["text"] == tok.decode(greedy)
    assert "".join(c["text"] for c in _stream(vllm)) == plain["text"]


def test_stop_strings_count_only_after_min_tokens(
    vllm: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    """A stop string completed within the first ``min_tokens`` tokens does not end the
    completion (vLLM's detokenizer looks only after them)."""
    tok = tokenizer_of(tiny_model_dir)
    greedy = hf_greedy(tiny_model_dir, PROMPT, 12)
    stop, k = spanning_stop(tok, greedy)
    assert _choice(vllm, stop=stop, min_tokens=k - 1)["token_ids"] == greedy[:k]
    late = _choice(vllm, stop=stop, min_tokens=k)
    m = next_stop(tok, greedy, stop, k)  # its next completion, or the length
    assert late["token_ids"] == greedy[: m or len(greedy)]
    assert late["stop_reason"] == (stop if m else None)


def test_a_stop_token_id_ends_the_completion_even_with_ignore_eos(
    vllm: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    """The stop token stays in ``token_ids`` and is the ``stop_reason``; its text is left out
    unless ``include_stop_str_in_output``. ``ignore_eos`` ignores EOS only: a stop token id
    still ends the completion (unlike SGLang)."""
    tok = tokenizer_of(tiny_model_dir)
    greedy = hf_greedy(tiny_model_dir, PROMPT, 12)
    j = fresh_token(tokenizer_of(tiny_model_dir), greedy)
    for extra in ({}, {"ignore_eos": True}):
        choice = _choice(vllm, stop_token_ids=[greedy[j]], **extra)
        assert choice["token_ids"] == greedy[: j + 1]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", greedy[j])
        assert choice["text"] == tok.decode(greedy[:j])
    kept = _choice(vllm, stop_token_ids=[greedy[j]], include_stop_str_in_output=True)
    assert kept["text"] == tok.decode(greedy[: j + 1])
    chunks = _stream(vllm, stop_token_ids=[greedy[j]])
    assert [t for c in chunks for t in c["token_ids"]] == greedy[: j + 1]
    assert "".join(c["text"] for c in chunks) == tok.decode(greedy[:j])
    assert chunks[-1]["stop_reason"] == greedy[j]


def test_min_tokens_keeps_stop_tokens_from_being_sampled(
    vllm: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    """Before ``min_tokens`` vLLM masks EOS and the stop token ids out of the logits: greedy
    takes the next best token, as ``transformers`` does with the same minimum."""
    greedy = hf_greedy(tiny_model_dir, PROMPT, 12)
    j = fresh_token(tokenizer_of(tiny_model_dir), greedy)
    stop_id, minimum = greedy[j], j + 3
    choice = _choice(vllm, stop_token_ids=[stop_id], min_tokens=minimum)
    want = hf_greedy(tiny_model_dir, PROMPT, 12, min_new_tokens=minimum, eos_token_id=[stop_id, 2])
    assert choice["token_ids"] == want and want[j] != stop_id
    if want[-1] == stop_id:
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_id)


def test_which_stop_string_wins_and_the_limits_differ_by_release(
    vllm: EngineProcess,
    vllm026: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    """Two stop strings completed by the same token: 0.32 names the one ending first, 0.26 the
    first of the request's list. 0.32 takes at most 4 stop strings and refuses stop token ids
    outside the vocabulary; 0.26 takes both."""
    tok = tokenizer_of(tiny_model_dir)
    greedy = hf_greedy(tiny_model_dir, PROMPT, 12)
    stop, k = spanning_stop(tok, greedy, added_chars=2)  # its prefix also ends in token k
    both = [stop, stop[:-1]]
    assert _choice(vllm, stop=both)["stop_reason"] == stop[:-1]
    assert _choice(vllm026, stop=both)["stop_reason"] == stop
    for engine in (vllm, vllm026):
        assert _choice(engine, stop=both)["token_ids"] == greedy[:k]
    five = [stop, "a1", "b2", "c3", "d4"]
    r = vllm.post("/v1/completions", {**STOP_BASE, "stop": five})
    assert r.status_code == 400 and "at most 4 items" in r.json()["message"], r.text
    assert _choice(vllm026, stop=five)["stop_reason"] == stop
    r = vllm.post("/v1/completions", {**STOP_BASE, "stop_token_ids": [512]})
    assert r.status_code == 400 and "out-of-vocab" in r.json()["message"], r.text
    assert _choice(vllm026, stop_token_ids=[512])["token_ids"] == greedy


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"stop": ["ok", ""]}, "stop cannot contain an empty string."),
        ({"stop": 5}, "'stop'"),
        ({"include_stop_str_in_output": "yes"}, "'include_stop_str_in_output'"),
        ({"min_tokens": 13}, "min_tokens must be less than or equal to max_tokens=12, got 13."),
    ],
)
def test_stop_parameters_vllm_refuses_are_refused(
    vllm: EngineProcess, extra: dict[str, Any], needle: str
) -> None:
    r = vllm.post("/v1/completions", {**STOP_BASE, **extra})
    assert r.status_code == 400 and needle in r.json()["message"], r.text


@pytest.fixture(scope="module")
def vllm026(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(
        request, tiny_model_dir, extra_args=["--dialect", "vllm", "--vllm-version", "0.26.0"]
    )


def test_vllm_0_26_routes_and_packing_per_update(
    vllm026: EngineProcess,
    tiny_model_dir_b: Path,  # noqa: F811
) -> None:
    """vLLM 0.26.0: no version, checker or shutdown routes (404); ``init_info`` takes no
    packing (refused, named) and each ``update_info`` carries its own; ``/finish_weight_update``
    reads no body, so no version is ever set."""
    assert vllm026.get("/version").json() == {"version": "0.26.0"}
    for method, path in (
        ("GET", "/weight_info"),
        ("POST", "/update_weight_version"),
        ("POST", "/weight_checker"),
        ("POST", "/shutdown_weight_transfer_engine"),
    ):
        r = vllm026.client.request(method, path, json={"new_version": "x", "action": "checksum"})
        assert r.status_code == 404, (path, r.text)
    state = hf_state(tiny_model_dir_b)
    port = free_port()
    init_info: dict[str, Any] = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
    }
    bad = vllm026.post("/init_weight_transfer_engine", {"init_info": {**init_info, "packed": True}})
    assert bad.status_code == 400 and "'packed'" in bad.json()["message"]
    res: dict[str, httpx.Response] = {}

    def call(key: str, path: str, body: dict[str, Any]) -> None:
        res[key] = vllm026.post(path, body, timeout=60)

    t = threading.Thread(
        target=call, args=("init", "/init_weight_transfer_engine", {"init_info": init_info})
    )
    t.start()
    pg = open_weight_update_group(
        master_address="127.0.0.1",
        master_port=port,
        rank=0,
        world_size=2,
        group_name=VLLM_WEIGHT_TRANSFER_GROUP,
        timeout_s=60,
    )
    t.join(60)
    assert res["init"].status_code == 200, res["init"].text
    names = list(state)
    threshold = 3000
    info = {
        "names": names,
        "dtype_names": ["float32"] * len(names),
        "shapes": [list(state[n].shape) for n in names],
        "packed": True,
        "packed_buffer_size_bytes": threshold,
    }
    assert vllm026.post("/start_weight_update").status_code == 200
    t = threading.Thread(target=call, args=("upd", "/update_weights", {"update_info": info}))
    t.start()
    sends = _vllm_chunks([state[n] for n in names], threshold)
    assert len(sends) > 1
    for x in sends:
        pg.broadcast(x, 0).wait()
    t.join(60)
    assert res["upd"].status_code == 200, res["upd"].text
    before = vllm026.get("/get_server_info").json()["weight_version"]
    r = vllm026.post("/finish_weight_update", {"weight_version": "V"})  # body not read
    assert r.status_code == 200, r.text
    info_after = vllm026.get("/get_server_info").json()
    assert info_after["weight_version"] == before  # 0.26 keeps no version
    assert info_after["poisoned"] is None
    # no checker to ask: what the weights do says they are B's (the probe's check)
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    r = vllm026.post("/v1/completions", body)
    assert r.json()["choices"][0]["token_ids"] == hf_greedy(tiny_model_dir_b, PROMPT, 8)
    pg.close()


def test_sleep_levels_0_to_2(vllm026: EngineProcess) -> None:
    """Level 0 pauses scheduling only (a request waits until ``/wake_up``), levels 1 and 2
    release the weights; the level comes from the query alone, as vLLM reads it."""
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    assert vllm026.post("/sleep", params={"level": "0"}).status_code == 200
    assert vllm026.get("/is_sleeping").json() == {"is_sleeping": True}
    waiting: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: waiting.update(r=vllm026.post("/v1/completions", body)))
    t.start()
    t.join(1.0)
    assert t.is_alive()  # queued while scheduling is paused
    assert vllm026.post("/wake_up", params={"tags": "scheduling"}).status_code == 200
    t.join(30)
    assert waiting["r"].status_code == 200
    assert vllm026.get("/is_sleeping").json() == {"is_sleeping": False}
    r = vllm026.post("/sleep", {"level": 0}, params={"level": "3"})
    assert r.status_code == 400 and "0, 1 or 2" in r.json()["message"]
    assert vllm026.post("/sleep", params={"level": "1"}).status_code == 200
    assert vllm026.get("/is_sleeping").json() == {"is_sleeping": True}
    assert vllm026.post("/wake_up").status_code == 200
    assert vllm026.post("/v1/completions", body).status_code == 200


def _vllm_chunks(tensors: list[torch.Tensor], threshold: int) -> list[torch.Tensor]:
    """The uint8 buffers vLLM's ``packed_nccl_broadcast_producer`` broadcasts: tensors are packed
    until the chunk's size exceeds ``threshold`` (written here from vLLM's description, not
    with rollsafe's own chunker, so the engine's receive rule is checked independently)."""
    out: list[torch.Tensor] = []
    part: list[torch.Tensor] = []
    for t in tensors:
        part.append(t.contiguous().reshape(-1).view(torch.uint8))
        if sum(p.numel() for p in part) > threshold:
            out.append(torch.cat(part))
            part = []
    if part:
        out.append(torch.cat(part))
    return out


@pytest.mark.parametrize("packed", [False, True])
def test_native_weight_transfer(
    vllm: EngineProcess,
    tiny_model_dir_b: Path,  # noqa: F811
    packed: bool,
) -> None:
    state = hf_state(tiny_model_dir_b)
    version_before = vllm.get("/weight_info").json()
    port = free_port()
    res: dict[str, httpx.Response] = {}
    threshold = 3000  # bytes: several chunks per call

    def call(key: str, path: str, body: dict[str, Any]) -> None:
        res[key] = vllm.post(path, body, timeout=60)

    init_info: dict[str, Any] = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "packed": packed,
        "packed_buffer_size_bytes": threshold,
    }
    bad = vllm.post("/init_weight_transfer_engine", {"init_info": {**init_info, "foo": 1}})
    assert bad.status_code == 400 and "'foo'" in bad.json()["message"]
    t = threading.Thread(
        target=call, args=("init", "/init_weight_transfer_engine", {"init_info": init_info})
    )
    t.start()
    pg = open_weight_update_group(
        master_address="127.0.0.1",
        master_port=port,
        rank=0,
        world_size=2,
        group_name=VLLM_WEIGHT_TRANSFER_GROUP,  # vLLM sends no name: the fixed one
        timeout_s=60,
    )
    t.join(60)
    assert res["init"].status_code == 200, res["init"].text
    names = list(state)
    info = {
        "names": names,
        "dtype_names": ["float32"] * len(names),
        "shapes": [list(state[n].shape) for n in names],
    }
    # vLLM's worker refuses an update outside start .. finish (a 500, nothing changed)
    r = vllm.post_once("/update_weights", {"update_info": info})
    assert r.status_code == 500 and "start_weight_update must be called" in r.text
    # packing belongs to init_info, the version to finish; start declares no body (vLLM never
    # reads one: tests/test_engine_unknown_keys.py)
    assert vllm.post("/start_weight_update").status_code == 200
    r = vllm.post_once("/start_weight_update")
    assert r.status_code == 500 and "already active" in r.text
    r = vllm.post_once("/shutdown_weight_transfer_engine")
    assert r.status_code == 500 and "during a weight update" in r.text
    # a key vLLM's nccl update_info does not take fails inside the update: vLLM ends the
    # update with the layers on the meta device (poisoned; /health says nothing of it)
    r = vllm.post_once("/update_weights", {"update_info": {**info, "packed": packed}})
    assert r.status_code == 500 and "'packed'" in r.json()["error"]["message"]
    assert vllm.get("/health").status_code == 200
    assert vllm.get("/get_server_info").json()["poisoned"] is not None
    r = vllm.post_once("/finish_weight_update", {"weight_version": "V"})
    assert r.status_code == 500 and "without a matching start_weight_update" in r.text
    assert vllm.get("/weight_info").json() == version_before
    # a complete update afterwards restores every layer (vLLM's finalize_layerwise_reload)
    assert vllm.post("/start_weight_update").status_code == 200
    t = threading.Thread(target=call, args=("upd", "/update_weights", {"update_info": info}))
    t.start()
    tensors = [state[n] for n in names]
    sends = _vllm_chunks(tensors, threshold) if packed else [x.contiguous() for x in tensors]
    if packed:
        assert len(sends) > 1
    for x in sends:
        pg.broadcast(x, 0).wait()
    t.join(60)
    assert res["upd"].status_code == 200, res["upd"].text
    assert vllm.post("/finish_weight_update", {"weight_version": "V"}).status_code == 200
    assert vllm.get("/get_server_info").json()["poisoned"] is None
    got = vllm.checksum()
    assert_vllm_digests(got, state)  # fused names, no data for the linear weights (CPU)
    assert got["weight_version"] == "V"
    r = vllm.post("/update_weight_version", {"new_version": "V2"})
    assert r.status_code == 200 and r.json() == {"success": True, "new_version": "V2"}
    assert vllm.get("/weight_info").json() == {"weight_version": "V2"}
    assert vllm.post("/shutdown_weight_transfer_engine").status_code == 200
    pg.close()

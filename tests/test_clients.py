"""SGLangClient and VLLMClient against real reference-engine processes (both dialects).

Two engines on the same tiny model: an SGLang-dialect one and a vLLM-dialect one behind an API
key, both with fault injection enabled so error paths and retries run against the real server.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")

from rollsafe.adapters.engines import (  # noqa: E402
    NO_RETRY,
    EngineLauncher,
    EngineRequestError,
    EngineSpec,
    EngineTimeout,
    EngineUnavailable,
    RetryPolicy,
    SGLangClient,
    VLLMClient,
)
from rollsafe.ports import EngineClient  # noqa: E402
from rollsafe.text import MAX_MESSAGE_CHARS, bound_text  # noqa: E402

API_KEY = "rollsafe-test-key"
PROMPT = [5, 17, 42, 99, 7]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {
        "base": make_tiny_model(root / "base", seed=0),
        "other": make_tiny_model(root / "other", seed=1),
    }


@pytest.fixture(scope="module")
def sglang_engine(models: dict[str, Path]) -> Iterator[EngineLauncher]:
    spec = EngineSpec(model_path=str(models["base"]), dialect="sglang", fault_injection=True)
    with EngineLauncher(spec) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def vllm_engine(models: dict[str, Path]) -> Iterator[EngineLauncher]:
    spec = EngineSpec(
        model_path=str(models["base"]), dialect="vllm", api_key=API_KEY, fault_injection=True
    )
    with EngineLauncher(spec) as launcher:
        yield launcher


@pytest.fixture(params=["sglang", "vllm"])
def engine(request: pytest.FixtureRequest) -> EngineLauncher:
    """Each dialect's engine in turn (started lazily, so one dialect's failure stays its own)."""
    launcher: EngineLauncher = request.getfixturevalue(f"{request.param}_engine")
    return launcher


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fault(launcher: EngineLauncher, path: str, body: dict[str, object]) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{launcher.url}{path}", json=body, headers=headers, timeout=10)
    r.raise_for_status()


# ---------------------------------------------------------------------------------- basics
def test_clients_satisfy_protocol(engine: EngineLauncher) -> None:
    assert isinstance(engine.client, EngineClient)
    engine.client.health()
    assert engine.client.is_healthy()


def test_greedy_generate_is_deterministic_and_same_across_dialects(
    sglang_engine: EngineLauncher, vllm_engine: EngineLauncher
) -> None:
    a = sglang_engine.client.generate(PROMPT, sampling_params=GREEDY)
    b = sglang_engine.client.generate(PROMPT, sampling_params=GREEDY)
    c = vllm_engine.client.generate(PROMPT, sampling_params=GREEDY)
    assert len(a.output_ids) == 8
    assert a.output_ids == b.output_ids == c.output_ids
    assert a.text == c.text


def served_version(engine: EngineLauncher) -> str:
    """The engine's weight version, read as from a real engine (``/model_info``,
    ``/weight_info``) and cross-checked with the reference engine's ``/get_server_info``."""
    key = engine.spec.api_key
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(f"{engine.url}/get_server_info", headers=headers, timeout=30)
    r.raise_for_status()
    version = engine.client.weight_version()
    assert version == str(r.json()["weight_version"])
    return str(version)


def test_update_weights_from_disk_changes_and_restores_checksum(
    engine: EngineLauncher, models: dict[str, Path]
) -> None:
    client = engine.client
    before = client.weights_checksum()
    out_before = client.generate(PROMPT, sampling_params=GREEDY).output_ids
    client.update_weights_from_disk(str(models["other"]), weight_version="v1")
    moved = client.weights_checksum()
    assert not moved.same_weights(before)
    assert moved.weight_version is None  # the engines' checkers report no version
    assert served_version(engine) == "v1"
    client.update_weights_from_disk(str(models["base"]), weight_version="v2")
    back = client.weights_checksum()
    assert back.same_weights(before) and served_version(engine) == "v2"
    again = client.generate(PROMPT, sampling_params=GREEDY)
    assert again.output_ids == out_before
    assert again.weight_version in (None, "v2")


def test_release_and_resume_memory(engine: EngineLauncher, models: dict[str, Path]) -> None:
    """The colocated RL step: release, (train), resume, reload weights, serve again."""
    client = engine.client
    expected = client.generate(PROMPT, sampling_params=GREEDY).output_ids
    client.release_memory_occupation()
    if isinstance(client, VLLMClient):
        assert client.is_sleeping()
    client.resume_memory_occupation()
    if isinstance(client, VLLMClient):
        assert not client.is_sleeping()
    # released weights come back uninitialized (as in SGLang without CPU backup): reload them
    client.update_weights_from_disk(str(models["base"]))
    assert client.generate(PROMPT, sampling_params=GREEDY).output_ids == expected


def test_pause_and_continue_generation(engine: EngineLauncher) -> None:
    client = engine.client
    client.pause_generation("abort")
    client.continue_generation()
    client.flush_cache()
    assert client.generate(PROMPT, sampling_params=GREEDY).output_ids


# ---------------------------------------------------------------------------------- errors
def test_http_error_maps_to_request_error_with_bounded_message(engine: EngineLauncher) -> None:
    huge = "x" * 100_000  # the engine echoes the unknown key in its 400 message
    if isinstance(engine.client, VLLMClient):
        # vLLM keeps an unknown completion field and ignores it (logged): so does the
        # reference engine, and the request is served
        assert engine.client.generate(PROMPT, sampling_params={huge: 1, **GREEDY}).output_ids
        huge = "max_new_tokens"  # a known key of the wrong type is refused, named
    with pytest.raises(EngineRequestError) as info:
        engine.client.generate(PROMPT, sampling_params={huge: "1"})
    assert info.value.status_code == 400
    assert ("unknown" in info.value.message) or ("max_tokens" in info.value.message)
    assert len(info.value.message) <= MAX_MESSAGE_CHARS + 50
    assert len(str(info.value)) <= MAX_MESSAGE_CHARS + 500
    engine.client.health()  # the failed update changed nothing


def test_connection_refused_is_engine_unavailable() -> None:
    client = SGLangClient(f"http://127.0.0.1:{free_port()}", retry=NO_RETRY)
    with pytest.raises(EngineUnavailable) as info:
        client.health()
    assert not isinstance(info.value, EngineRequestError)
    assert not client.is_healthy()
    with pytest.raises(EngineUnavailable):
        client.generate(PROMPT, sampling_params=GREEDY)


def test_sampling_translation_and_retry_policy_validation() -> None:
    from rollsafe.adapters.engines.vllm import to_vllm_sampling

    assert to_vllm_sampling({"max_new_tokens": 4, "sampling_seed": 1, "top_k": 5}) == {
        "max_tokens": 4,
        "seed": 1,
        "top_k": 5,
    }
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError, match="http"):
        SGLangClient("127.0.0.1:30000")


def test_bound_text_keeps_head_and_tail() -> None:
    text = "HEAD" + "m" * 10_000 + "TAIL"
    cut = bound_text(text, 200)
    assert len(cut) <= 200 and cut.startswith("HEAD") and cut.endswith("TAIL")
    assert bound_text("short") == "short"


def generate_path(launcher: EngineLauncher) -> str:
    return "/v1/completions" if launcher.spec.dialect == "vllm" else "/generate"


def test_idempotent_calls_are_retried_but_generate_is_not(engine: EngineLauncher) -> None:
    client = engine.client
    # one injected 500 each: health and checksum retry through it
    fault(engine, "/fault/fail_next", {"endpoint": "/health"})
    client.health()
    checker = "/weight_checker" if engine.spec.dialect == "vllm" else "/weights_checker"
    fault(engine, "/fault/fail_next", {"endpoint": checker})
    assert client.weights_checksum().tensors
    # generate sees the injected failure: it is sent once, never retried
    fault(engine, "/fault/fail_next", {"endpoint": generate_path(engine)})
    with pytest.raises(EngineRequestError) as info:
        client.generate(PROMPT, sampling_params=GREEDY)
    assert info.value.status_code == 500
    assert "injected failure" in info.value.message
    assert client.generate(PROMPT, sampling_params=GREEDY).output_ids  # failure was consumed


def test_health_without_retry_sends_one_request(engine: EngineLauncher) -> None:
    client = engine.client
    fault(engine, "/fault/fail_next", {"endpoint": "/health"})
    with pytest.raises(EngineRequestError) as info:
        client.health(retry=False)  # what the health manager's probe uses
    assert info.value.status_code == 500
    client.health(retry=False)  # the one injected failure was consumed by that one request


def test_retry_budget_is_bounded(engine: EngineLauncher) -> None:
    api_key = engine.spec.api_key
    cls = VLLMClient if engine.spec.dialect == "vllm" else SGLangClient
    with cls(engine.url, api_key=api_key, retry=RetryPolicy(attempts=2, backoff_s=0.01)) as c:
        for _ in range(2):
            fault(engine, "/fault/fail_next", {"endpoint": "/health"})
        with pytest.raises(EngineRequestError):
            c.health()
        c.health()


def test_timeout_maps_to_engine_timeout(sglang_engine: EngineLauncher) -> None:
    client = sglang_engine.client
    fault(sglang_engine, "/fault/slow", {"seconds": 1.0})
    try:
        with pytest.raises(EngineTimeout):
            client.generate(PROMPT, sampling_params=GREEDY, timeout=0.2)
    finally:
        fault(sglang_engine, "/fault/slow", {"seconds": 0})
    client.health()


def _info(engine: EngineLauncher) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.get(f"{engine.url}/get_server_info", headers=headers, timeout=30)
    r.raise_for_status()
    info: dict[str, Any] = r.json()
    return info


def _stalled_at_3(engine: EngineLauncher) -> tuple[threading.Thread, dict[str, Any]]:
    """A greedy generation started in a thread and held by ``/fault/stall`` at 3 tokens (its
    result lands in the returned dict's ``"out"``)."""
    client = engine.client
    sampled = _info(engine)["tokens_generated"]
    fault(engine, "/fault/stall", {"after_tokens": 3})
    box: dict[str, Any] = {}
    worker = threading.Thread(
        target=lambda: box.setdefault("out", client.generate(PROMPT, sampling_params=GREEDY))
    )
    worker.start()
    deadline = time.monotonic() + 60  # a hang detector, nothing timed
    while _info(engine)["tokens_generated"] < sampled + 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert worker.is_alive() and _info(engine)["tokens_generated"] == sampled + 3
    return worker, box


def test_a_stall_holds_one_generation_until_a_pause_aborts_it(engine: EngineLauncher) -> None:
    """``/fault/stall``: the next generation stops at that many tokens, held (not finished),
    until ``pause_generation("abort")`` ends it with exactly those; it stalls one generation
    once, and a disarmed stall holds none."""
    client = engine.client
    worker, box = _stalled_at_3(engine)
    client.pause_generation("abort")
    client.continue_generation()
    worker.join(60)
    held = box["out"]
    assert len(held.output_ids) == 3 and held.finish_reason == "abort"
    assert len(client.generate(PROMPT, sampling_params=GREEDY).output_ids) == 8  # used up
    fault(engine, "/fault/stall", {"after_tokens": 3})
    fault(engine, "/fault/stall", {"after_tokens": None})
    assert len(client.generate(PROMPT, sampling_params=GREEDY).output_ids) == 8  # disarmed
    for bad in (0, "3", True, 1.5):
        with pytest.raises(httpx.HTTPStatusError) as info:
            fault(engine, "/fault/stall", {"after_tokens": bad})
        assert info.value.response.status_code == 400 and "after_tokens" in info.value.response.text


def test_a_retract_queues_a_stalled_generation_again(sglang_engine: EngineLauncher) -> None:
    """A pause in ``retract`` mode (SGLang's; vLLM has none) puts a stalled generation back on
    the schedule, as every retracted request: after ``continue_generation`` it finishes
    whole, not aborted."""
    engine = sglang_engine
    client = engine.client
    worker, box = _stalled_at_3(engine)
    client.pause_generation("retract")
    client.continue_generation()
    worker.join(60)
    assert not worker.is_alive()
    out = box["out"]
    assert len(out.output_ids) == 8 and out.finish_reason == "length", out


def test_api_key_header(vllm_engine: EngineLauncher) -> None:
    with VLLMClient(vllm_engine.url) as anonymous:
        with pytest.raises(EngineRequestError) as info:
            anonymous.generate(PROMPT, sampling_params=GREEDY)
        assert info.value.status_code == 401
    with VLLMClient(vllm_engine.url, api_key=API_KEY) as keyed:
        assert keyed.generate(PROMPT, sampling_params=GREEDY).output_ids


def test_closed_client_raises_unavailable(sglang_engine: EngineLauncher) -> None:
    client = SGLangClient(sglang_engine.url)
    client.close()
    with pytest.raises(EngineUnavailable, match="closed"):
        client.health()


# ---------------------------------------------------------------------------------- weight paths
def test_update_weights_from_distributed_over_gloo(
    engine: EngineLauncher, models: dict[str, Path]
) -> None:
    """Trainer rank 0 broadcasts the ``other`` weights; the engine must end up serving them."""
    import threading

    from safetensors.torch import load_file

    from rollsafe.adapters.reference_engine.vllm_api import WEIGHT_TRANSFER_GROUP
    from rollsafe.wire.group import open_weight_update_group

    client = engine.client
    group = "rollsafe_test_group" if engine.spec.dialect == "sglang" else WEIGHT_TRANSFER_GROUP
    port = free_port()
    errors: list[BaseException] = []

    def in_thread(fn: object) -> threading.Thread:
        def run() -> None:
            try:
                fn()  # type: ignore[operator]
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    # one broadcast per tensor below: vLLM's packing is chosen at init (packed=false)
    unpacked: dict[str, Any] = {"packed": False} if isinstance(client, VLLMClient) else {}
    joining = in_thread(
        lambda: client.init_weights_update_group(
            "127.0.0.1", port, 1, 2, group_name=group, backend="gloo", timeout=60, **unpacked
        )
    )
    trainer = open_weight_update_group(
        master_address="127.0.0.1",
        master_port=port,
        rank=0,
        world_size=2,
        group_name=group,
        timeout_s=60,
    )
    joining.join(60)
    assert not errors, errors

    tensors = {
        name: t.contiguous()
        for name, t in load_file(str(models["other"] / "model.safetensors")).items()
    }
    names = list(tensors)
    receiving = in_thread(
        lambda: client.update_weights_from_distributed(
            names,
            [str(tensors[n].dtype).removeprefix("torch.") for n in names],
            [list(tensors[n].shape) for n in names],
            group_name=group,
            weight_version="dist-1",
            timeout=60,
        )
    )
    for name in names:
        trainer.broadcast(tensors[name], 0).wait()
    receiving.join(60)
    trainer.close()
    assert not errors, errors
    client.destroy_weights_update_group(group)

    received = client.weights_checksum()
    assert served_version(engine) == "dist-1"
    client.update_weights_from_disk(str(models["other"]))
    assert client.weights_checksum().same_weights(received)
    client.update_weights_from_disk(str(models["base"]))


def test_tensor_and_ipc_payloads_reach_the_engine(sglang_engine: EngineLauncher) -> None:
    """Malformed payloads are refused by the engine itself (400), not by our wire format."""
    client = sglang_engine.client
    with pytest.raises(EngineRequestError) as info:
        client.update_weights_from_tensor(["not-a-payload"], load_format="flattened_bucket")
    assert info.value.status_code == 400 and "serialized_named_tensors" in info.value.message
    with pytest.raises(EngineRequestError) as info:
        client.update_weights_from_ipc({"cpu-0": "ipc:///nonexistent"})
    assert info.value.status_code == 400 and "unknown key" not in info.value.message


def test_shutdown_closes_the_client_for_good() -> None:
    from rollsafe.adapters.engines import EngineUnavailable, SGLangClient
    from rollsafe.ports import EngineClient

    client = SGLangClient("http://127.0.0.1:9")
    assert isinstance(client, EngineClient)
    client.shutdown()
    with pytest.raises(EngineUnavailable, match="closed"):
        client.health(timeout=0.5)

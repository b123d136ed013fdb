"""Layout-aware digests and the behavioural probe against the real vLLM 0.32 (CPU).

* The trainer-side digests in vLLM's layout (:mod:`rollsafe.engine_layout`) against a real
  server's ``/weight_checker``: the same keys (fused ``qkv_proj`` / ``gate_up_proj``, the rank
  prefix), every non-empty digest equal (embeddings padded to 64 rows, norms, ``lm_head``), and
  every linear weight reported empty, which :mod:`rollsafe.digest_check` calls ``no_data``
  (overall ``unverified``, never ``equal``).
* Bit-exact for the fused parameters too: vLLM's own ``compute_weight_checksums`` on an engine
  built with its linear weights kept (``vllm_digest_dump.py``) equals the trainer side for all
  15 tensors.
* The probe: a real server after ``reload_weights`` to model A answers like a fresh real server
  on A (tokens and logprobs bit for bit), and unlike its own answers on B, naming the prompt.

One real server for the module, started on model A: "a fresh real server on A" is its answers
recorded right after its start (the same weights, the same build and flags: a second start
would only repeat them), taken before any test runs.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from real_vllm import make_vllm_model
from safetensors.torch import load_file

from rollsafe.adapters.engines import EngineLauncher, EngineSpec
from rollsafe.adapters.engines.vllm import VLLMClient
from rollsafe.digest_check import compare_digests
from rollsafe.engine_layout import (
    EngineLayout,
    vllm_checker_digests,
    vllm_cpu_emptied,
    vllm_rank_digests,
)
from rollsafe.fleet.weights_check import check_engine, read_config
from rollsafe.probe import DEFAULT_PROMPTS, ProbeAnswers, probe_engines, record_answers

pytestmark = pytest.mark.real_vllm

DUMP = Path(__file__).with_name("vllm_digest_dump.py")


def start_real_vllm(vllm_python: str, model_dir: str | Path) -> EngineLauncher:
    """The one place these tests start a real vLLM: the launcher's CPU defaults (entry point,
    dtype, eager mode, KV size, one core per engine)."""
    spec = EngineSpec(
        model_path=str(model_dir),
        kind="vllm",
        python=vllm_python,
        max_model_len=512,
        ready_timeout=600.0,
        client_timeout=300.0,
    )
    launcher = EngineLauncher(spec)
    try:
        launcher.start()
    except BaseException:
        launcher.kill()
        raise
    return launcher


def _model(path: Path, seed: int, vocab_size: int = 512) -> tuple[str, dict, dict]:
    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model

    if vocab_size == 512:
        make_vllm_model(path, seed=seed)
    else:  # same shape as make_vllm_model, a vocabulary vLLM pads (300 -> 320 rows)
        make_tiny_model(path, seed=seed, num_heads=2, num_kv_heads=1, vocab_size=vocab_size)
    return str(path), load_file(str(path / "model.safetensors")), read_config(path)


Model = tuple[str, dict[str, Any], dict[str, Any]]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Model, Model]:
    """Models A and B: the same shape, a vocabulary vLLM pads (300 -> 320 rows), other seeds."""
    root = tmp_path_factory.mktemp("checksum-real")
    return _model(root / "a", seed=3, vocab_size=300), _model(root / "b", seed=4, vocab_size=300)


@pytest.fixture(scope="module")
def server(
    vllm_python: str, models: tuple[Model, Model]
) -> Iterator[tuple[EngineLauncher, ProbeAnswers]]:
    """The module's real server on model A and its answers recorded fresh (before any test)."""
    launcher = start_real_vllm(vllm_python, models[0][0])
    try:
        fresh = record_answers(launcher.client)
        yield launcher, fresh
    finally:
        launcher.kill()


def test_layout_digests_against_a_real_server(
    server: tuple[EngineLauncher, ProbeAnswers], models: tuple[Model, Model]
) -> None:
    (_, state, config), (_, other, _) = models
    layout = EngineLayout.from_config(config)
    launcher = server[0]
    client = launcher.client
    assert isinstance(client, VLLMClient)
    answer = httpx.post(launcher.url + "/weight_checker", json={"action": "checksum"}, timeout=120)
    assert answer.status_code == 200, answer.text
    raw = answer.json()["checksums"]
    want = vllm_checker_digests(state, layout)
    assert set(raw) == set(want)  # fused names, rank prefix, no HF q/k/v/gate/up names
    assert any(k.endswith("self_attn.qkv_proj.weight") for k in raw)
    check = compare_digests(raw, want)
    linear = sorted(k for k in want if vllm_cpu_emptied(k))
    assert len(linear) == 8 and check.names("no_data") == linear
    assert check.names("equal") == sorted(set(want) - set(linear))
    assert "dp0:pp0:pcp0:tp0:model.embed_tokens.weight" in check.names("equal")  # padded rows
    assert "dp0:pp0:pcp0:tp0:lm_head.weight" in check.names("equal")
    assert check.verdict == "unverified" and not check.equal
    # through the client and the fleet's helper: the same verdicts, without the prefix
    fleet_check = check_engine(client, state, config)
    assert fleet_check.counts() == {"equal": 7, "no_data": 8}
    assert fleet_check.verdict == "unverified"
    # other weights are caught by the tensors that carry data
    wrong = client.weights_checksum().check(vllm_rank_digests(other, layout))
    assert wrong.verdict == "differs" and len(wrong.names("differs")) == 7


def _vllm_own_digests(vllm_python: str, model: str, tp: int, tmp_path: Path) -> dict[str, str]:
    """vLLM's ``compute_weight_checksums`` of ``model`` at TP ``tp`` with the linear weights
    kept (``vllm_digest_dump.py``), merged over the workers."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "from vllm_digest_dump import keep_linear_weights\nkeep_linear_weights()\n"
    )
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(c) for c in range(tp)),
        "PYTHONPATH": f"{site}{os.pathsep}{DUMP.parent}",
    }
    out = subprocess.run(
        [vllm_python, str(DUMP), model, str(tp)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("DIGESTS ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    merged: dict[str, str] = {}
    for worker in json.loads(lines[0].removeprefix("DIGESTS ")):
        merged.update(worker)
    return merged


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_digests_bit_exact_with_weights_kept(
    vllm_python: str, tmp_path: Path, tp: int
) -> None:
    """Every tensor, fused and sharded ones included: TP 2 with one KV head shares it between
    the ranks and splits the vocabulary and the row-parallel columns."""
    model, state, config = _model(tmp_path / "m", seed=0)
    reported = _vllm_own_digests(vllm_python, model, tp, tmp_path)
    want = vllm_checker_digests(state, EngineLayout.from_config(config, tp_size=tp))
    check = compare_digests(reported, want)
    assert check.verdict == "equal", check.summary(20)
    assert len(check.names("equal")) == 15 * tp
    assert any(k.endswith("mlp.gate_up_proj.weight") for k in check.names("equal"))


def test_probe_after_reload_equals_a_fresh_server(
    server: tuple[EngineLauncher, ProbeAnswers], models: tuple[Model, Model]
) -> None:
    (model_a, state_a, config), (model_b, _, _) = models
    launcher, fresh_on_a = server
    synced = launcher.client
    assert all(a.logprobs is not None for a in fresh_on_a.answers)
    synced.update_weights_from_disk(model_b)  # collective_rpc reload_weights, nothing in flight
    on_b = record_answers(synced)  # the synced engine's answers on model B
    synced.update_weights_from_disk(model_a)  # the sync under test: back to A
    verdicts = probe_engines({"synced": synced}, fresh_on_a)
    assert verdicts["synced"].ok, verdicts["synced"].summary()
    assert verdicts["synced"].logprobs_compared  # bit for bit, tokens and logprobs
    stale = probe_engines({"synced": synced}, on_b)["synced"]
    assert not stale.ok and stale.error is None
    first = stale.mismatches[0]
    assert first.prompt_index == 0 and first.prompt == DEFAULT_PROMPTS[0]
    assert f"prompt 0 {list(DEFAULT_PROMPTS[0])}" in stale.summary()
    # and the digests after the reload: A's, where the engine has data
    check = check_engine(synced, state_a, config)
    assert check.counts() == {"equal": 7, "no_data": 8}

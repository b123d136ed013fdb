"""The behavioural weights probe (:mod:`rollsafe.probe`) against reference engines.

* Two engines on the same weights answer the probe alike, tokens and (vLLM dialect) logprobs
  bit for bit; an engine on other weights is named with the prompt and token that differ.
* An engine that does not answer gets a verdict with the error, not an exception.
* :func:`compare_answers` on hand-made recordings: first differing token, length, logprob
  (exact and with a tolerance), and recordings of different prompts refused.
* ``fleet.check_weights`` / the probe on the real vLLM: ``test_checksum_real_vllm.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import (
    EngineProcess,
    module_engine,
    tiny_model_dir,  # noqa: F401  (fixture)
    tiny_model_dir_b,  # noqa: F401  (fixture)
)

from rollsafe.adapters.engines.sglang import SGLangClient
from rollsafe.adapters.engines.vllm import VLLMClient
from rollsafe.probe import (
    DEFAULT_PROMPTS,
    ProbeAnswer,
    ProbeAnswers,
    compare_answers,
    probe_engines,
    probe_sampling,
    record_answers,
)


@pytest.fixture(scope="module")
def vllm_a(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(request, tiny_model_dir, extra_args=["--dialect", "vllm"])


@pytest.fixture(scope="module")
def vllm_b(request: pytest.FixtureRequest, tiny_model_dir_b: Path) -> EngineProcess:  # noqa: F811
    return module_engine(request, tiny_model_dir_b, extra_args=["--dialect", "vllm"])


def test_probe_vllm_dialect(
    vllm_a: EngineProcess,
    vllm_b: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    a, b = VLLMClient(vllm_a.url), VLLMClient(vllm_b.url)
    try:
        reference = record_answers(a, max_new_tokens=6)
        assert len(reference.answers) == len(DEFAULT_PROMPTS)
        for ans in reference.answers:
            assert len(ans.output_ids) == 6 and ans.logprobs is not None
            assert len(ans.logprobs) == 6 and all(lp <= 0.0 for lp in ans.logprobs)
        verdicts = probe_engines({"same": a, "other": b}, reference)
        assert verdicts["same"].ok and verdicts["same"].logprobs_compared
        assert verdicts["same"].summary() == "same: tokens and logprobs equal"
        other = verdicts["other"]
        assert not other.ok and other.error is None
        assert {m.prompt_index for m in other.mismatches} == set(range(len(DEFAULT_PROMPTS)))
        first = other.mismatches[0]
        assert first.prompt == DEFAULT_PROMPTS[0] and first.position == 0
        assert first.want_token == reference.answers[0].output_ids[0] != first.got_token
        assert "prompt 0 [1, 2, 3, 4]: token 0" in other.summary()
        # after a reload of model A, engine B answers like A again
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(tiny_model_dir)}}
        r = vllm_b.post("/collective_rpc", body)
        assert r.status_code == 200, r.text
        assert probe_engines({"b": b}, reference)["b"].ok
    finally:
        a.close()
        b.close()


def test_probe_engine_that_does_not_answer(vllm_a: EngineProcess) -> None:
    a = VLLMClient(vllm_a.url)
    dead = VLLMClient("http://127.0.0.1:9", timeout=2.0)
    try:
        reference = record_answers(a, DEFAULT_PROMPTS[:1], max_new_tokens=2)
        verdict = probe_engines({"dead": dead}, reference, timeout=2.0)["dead"]
        assert not verdict.ok and verdict.error and "dead: no answer" in verdict.summary()
    finally:
        a.close()
        dead.close()


def test_probe_sglang_dialect_tokens(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    eng = module_engine(request, tiny_model_dir)
    client = SGLangClient(eng.url)
    try:
        ref = record_answers(client, max_new_tokens=4)
        assert all(len(a.output_ids) == 4 for a in ref.answers)
        verdict = probe_engines({"s": client}, ref)["s"]
        assert verdict.ok  # tokens equal; SGLang's generate reports no logprobs here
    finally:
        client.close()


def _answers(*rows: tuple[tuple[int, ...], tuple[float, ...] | None]) -> ProbeAnswers:
    return ProbeAnswers(
        tuple(ProbeAnswer((i + 1,), ids, lps) for i, (ids, lps) in enumerate(rows)), 3
    )


def test_compare_answers_names_what_differs() -> None:
    ref = _answers(((5, 6, 7), (-1.0, -2.0, -3.0)), ((8, 9, 10), (-1.5, -0.5, -0.25)))
    assert compare_answers(ref, ref, engine="e").ok
    got = _answers(((5, 6, 7), (-1.0, -2.0, -3.0)), ((8, 4, 10), (-1.5, -0.7, -0.25)))
    v = compare_answers(ref, got, engine="e")
    assert not v.ok and len(v.mismatches) == 1
    m = v.mismatches[0]
    assert (m.prompt_index, m.prompt, m.position) == (1, (2,), 1)
    assert (m.want_token, m.got_token, m.want_logprob, m.got_logprob) == (9, 4, -0.5, -0.7)
    # same tokens, one logprob off by one ulp-ish amount: exact compare fails, tolerance passes
    near = _answers(((5, 6, 7), (-1.0, -2.0, -3.0000001)), ((8, 9, 10), (-1.5, -0.5, -0.25)))
    v = compare_answers(ref, near)
    assert (
        not v.ok
        and v.mismatches[0].position == 2
        and "logprob of token 2 (7)" in str(v.mismatches[0])
    )
    assert compare_answers(ref, near, logprob_tolerance=1e-6).ok
    short = _answers(((5, 6), (-1.0, -2.0)), ((8, 9, 10), (-1.5, -0.5, -0.25)))
    assert "2 tokens, reference 3" in compare_answers(ref, short).summary()
    no_lp = _answers(((5, 6, 7), None), ((8, 9, 10), None))
    v = compare_answers(ref, no_lp)
    assert v.ok and not v.logprobs_compared
    with pytest.raises(ValueError, match="different prompts"):
        compare_answers(ref, ProbeAnswers(ref.answers[:1], 3))
    with pytest.raises(ValueError, match="max_new_tokens"):
        probe_sampling("vllm", 0)
    assert probe_sampling("vllm")["logprobs"] == 0 and "logprobs" not in probe_sampling("sglang")

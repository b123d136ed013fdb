"""A trainer's HF tensors in vLLM's parameter layout, and per-tensor digest verdicts (unit tests
on a real tiny Llama's tensors; the real server's answers are in ``test_checksum_real_vllm.py``).

* fused ``qkv_proj`` / ``gate_up_proj`` rows are the HF parts stacked in the rule's order, and
  the digests are SHA-256 of those bytes (the same as :func:`rollsafe.checksum.vllm_digest`);
* TP shards: every rank's pieces put back together give the full tensors, KV heads shared when
  there are fewer than ranks, vocabulary rows padded to 64 with zeros;
* bad input (a missing part, an unknown architecture, shapes that do not split) is a
  ``LayoutError`` naming it;
* :mod:`rollsafe.digest_check` never says ``equal`` without data.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollsafe.checksum import vllm_digest
from rollsafe.digest_check import EMPTY_DIGESTS, compare_digests, compare_ranks
from rollsafe.engine_layout import (
    EMPTY_SHA256,
    VLLM_PACKED_MODULES,
    EngineLayout,
    LayoutError,
    checker_key,
    engine_name,
    iter_rank_tensors,
    packed_modules,
    vllm_checker_digests,
    vllm_cpu_emptied,
    vllm_rank_digests,
    vllm_tensors,
)
from rollsafe.errors import RollsafeError
from rollsafe.ports import WeightsChecksum


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], dict]:
    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("layout"), num_heads=4, num_kv_heads=2)
    return load_file(str(Path(path) / "model.safetensors")), json.loads(
        (Path(path) / "config.json").read_text()
    )


L0 = "model.layers.0"


def test_fused_parameters_stack_the_hf_parts(tiny: tuple[dict, dict]) -> None:
    state, config = tiny
    layout = EngineLayout.from_config(config)
    assert layout.packed == VLLM_PACKED_MODULES["LlamaForCausalLM"] and layout.tp_size == 1
    out = vllm_tensors(state, layout)
    parts = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj")
    hf_parts = {f"model.layers.{i}.{p}.weight" for i in range(2) for p in (*parts, "mlp.up_proj")}
    fused = {
        f"model.layers.{i}.{m}.weight"
        for i in range(2)
        for m in ("self_attn.qkv_proj", "mlp.gate_up_proj")
    }
    assert hf_parts <= set(state) and not hf_parts & set(out)
    assert set(out) == (set(state) - hf_parts) | fused
    qkv = out[f"{L0}.self_attn.qkv_proj.weight"]
    q, k, v = (state[f"{L0}.self_attn.{p}_proj.weight"] for p in "qkv")
    assert qkv.shape == (q.shape[0] + k.shape[0] + v.shape[0], q.shape[1])
    assert torch.equal(qkv[: q.shape[0]], q)
    assert torch.equal(qkv[q.shape[0] : q.shape[0] + k.shape[0]], k)
    assert torch.equal(qkv[q.shape[0] + k.shape[0] :], v)
    gate_up = out[f"{L0}.mlp.gate_up_proj.weight"]
    gate, up = state[f"{L0}.mlp.gate_proj.weight"], state[f"{L0}.mlp.up_proj.weight"]
    assert torch.equal(gate_up, torch.cat([gate, up]))
    assert not torch.equal(gate_up, torch.cat([up, gate]))  # the order matters
    # untouched tensors are the HF ones (vocab 512 is a multiple of 64: no padding)
    assert torch.equal(out["model.embed_tokens.weight"], state["model.embed_tokens.weight"])
    digests = vllm_rank_digests(state, layout)
    assert len(digests) == 1
    assert digests[0] == {n: vllm_digest(t) for n, t in out.items()}
    want = hashlib.sha256(torch.cat([q, k, v]).numpy().tobytes()).hexdigest()
    assert digests[0][f"{L0}.self_attn.qkv_proj.weight"] == want
    keyed = vllm_checker_digests(state, layout)
    assert keyed == {checker_key(n): d for n, d in digests[0].items()}
    assert all(k.startswith("dp0:pp0:pcp0:tp0:") for k in keyed)


def test_tp_shards_put_back_together(tiny: tuple[dict, dict]) -> None:
    state, config = tiny
    for tp, kv_heads in ((2, 2), (4, 2)):  # 4 ranks > 2 KV heads: ranks share KV heads
        layout = EngineLayout.from_config(config, tp_size=tp)
        assert layout.num_kv_heads == kv_heads
        ranks = [vllm_tensors(state, layout, r) for r in range(tp)]
        q, k, v = (state[f"{L0}.self_attn.{p}_proj.weight"] for p in "qkv")
        qr, kvr = q.shape[0] // tp, k.shape[0] // kv_heads
        for r, shard in enumerate(ranks):
            qkv = shard[f"{L0}.self_attn.qkv_proj.weight"]
            assert qkv.shape[0] == qr + 2 * kvr
            head = r // (tp // kv_heads)
            assert torch.equal(qkv[:qr], q[r * qr : (r + 1) * qr])
            assert torch.equal(qkv[qr : qr + kvr], k[head * kvr : (head + 1) * kvr])
            assert torch.equal(qkv[qr + kvr :], v[head * kvr : (head + 1) * kvr])
            # replicated norms
            assert torch.equal(shard["model.norm.weight"], state["model.norm.weight"])
        for name, dim in (
            (f"{L0}.self_attn.o_proj.weight", 1),
            (f"{L0}.mlp.down_proj.weight", 1),
            ("model.embed_tokens.weight", 0),
            ("lm_head.weight", 0),
        ):
            assert torch.equal(torch.cat([s[name] for s in ranks], dim=dim), state[name]), name
        gate, up = state[f"{L0}.mlp.gate_proj.weight"], state[f"{L0}.mlp.up_proj.weight"]
        gr = gate.shape[0] // tp
        for r, shard in enumerate(ranks):
            want = torch.cat([gate[r * gr : (r + 1) * gr], up[r * gr : (r + 1) * gr]])
            assert torch.equal(shard[f"{L0}.mlp.gate_up_proj.weight"], want)
        digests = vllm_rank_digests(state, layout)
        assert len(digests) == tp and digests[0] != digests[1]
        keyed = vllm_checker_digests(state, layout)
        assert {k.split(":")[3] for k in keyed} == {f"tp{r}" for r in range(tp)}


def test_vocab_rows_padded_to_64_with_zeros() -> None:
    emb = torch.randn(100, 8)
    state = {"model.embed_tokens.weight": emb, "lm_head.weight": emb + 1}
    layout = EngineLayout(VLLM_PACKED_MODULES["LlamaForCausalLM"])
    out = vllm_tensors(state, layout)
    assert out["model.embed_tokens.weight"].shape == (128, 8)
    assert torch.equal(out["model.embed_tokens.weight"][:100], emb)
    assert not out["model.embed_tokens.weight"][100:].any()
    two = EngineLayout(VLLM_PACKED_MODULES["LlamaForCausalLM"], tp_size=2, num_kv_heads=2)
    r0, r1 = (vllm_tensors(state, two, r)["lm_head.weight"] for r in range(2))
    assert r0.shape == r1.shape == (64, 8)
    assert torch.equal(r0, emb[:64] + 1) and torch.equal(r1[:36], emb[64:] + 1)
    assert not r1[36:].any()


def test_sglang_pads_the_vocabulary_to_split_over_the_ranks() -> None:
    """SGLang's ``VocabParallelEmbedding``: where the vocabulary padded to 64 does not split
    evenly over the ranks, it is padded to a multiple of ``64 * tp`` instead (vLLM refuses
    such a TP size); where it splits, both engines hold the same rows."""
    emb = torch.randn(100, 8)
    rule = VLLM_PACKED_MODULES["LlamaForCausalLM"]
    config = {"architectures": ["LlamaForCausalLM"], "num_key_value_heads": 1}
    three = EngineLayout.from_config(config, tp_size=3, engine="sglang")
    assert three.vocab_pad_per_rank and three.packed == rule
    shards = [vllm_tensors({"lm_head.weight": emb}, three, r)["lm_head.weight"] for r in range(3)]
    assert [s.shape for s in shards] == [(64, 8)] * 3  # 100 -> 192 rows (128 does not split)
    assert torch.equal(torch.cat(shards)[:100], emb) and not torch.cat(shards)[100:].any()
    two = EngineLayout.from_config(config, tp_size=2, engine="sglang")
    vllm_two = EngineLayout.from_config(config, tp_size=2)
    assert not vllm_two.vocab_pad_per_rank
    for r in range(2):
        a, b = (vllm_tensors({"lm_head.weight": emb}, lay, r) for lay in (two, vllm_two))
        assert torch.equal(a["lm_head.weight"], b["lm_head.weight"])
    with pytest.raises(LayoutError, match="engine"):
        EngineLayout.from_config(config, engine="trt")
    # a config saved on its own (no architectures): the class transformers builds for its type
    bare = EngineLayout.from_config({"model_type": "llama", "num_key_value_heads": 2})
    assert bare.packed == rule
    with pytest.raises(LayoutError, match="architectures"):
        EngineLayout.from_config({"model_type": "no-such-model"})


def test_rank_tensors_one_parameter_at_a_time(tiny: tuple[dict, dict]) -> None:
    state, config = tiny
    layout = EngineLayout.from_config(config, tp_size=2, engine="sglang")
    for r in range(2):
        parts = list(iter_rank_tensors(state, layout, r))
        assert all(len(p) == 1 for p in parts)
        whole = vllm_tensors(state, layout, r)
        merged = {n: t for p in parts for n, t in p.items()}
        assert merged.keys() == whole.keys()
        assert all(torch.equal(merged[n], whole[n]) for n in whole)
    # each rank's parameters on the HF tensors' own device (device=None), or the host
    kept = vllm_tensors(state, layout, 0, device=None)
    assert {t.device.type for t in kept.values()} == {"cpu"}
    tied = EngineLayout.from_config({**config, "tie_word_embeddings": True}, engine="sglang")
    assert {"lm_head.weight"} & {n for p in iter_rank_tensors(state, tied) for n in p} == set()
    rule = layout.packed
    assert engine_name(f"{L0}.self_attn.k_proj.weight", rule) == f"{L0}.self_attn.qkv_proj.weight"
    assert engine_name(f"{L0}.mlp.up_proj.weight", rule) == f"{L0}.mlp.gate_up_proj.weight"
    assert engine_name("lm_head.weight", rule) == "lm_head.weight"


def test_tied_embeddings_and_dtype(tiny: tuple[dict, dict]) -> None:
    state, config = tiny
    tied = EngineLayout.from_config({**config, "tie_word_embeddings": True})
    assert "lm_head.weight" not in vllm_tensors(state, tied)
    half = EngineLayout.from_config(config, dtype=torch.bfloat16)
    out = vllm_tensors(state, half)
    assert {t.dtype for t in out.values()} == {torch.bfloat16}
    assert vllm_rank_digests(state, half)[0]["model.norm.weight"] == vllm_digest(
        state["model.norm.weight"].to(torch.bfloat16)
    )


def test_bad_input_names_the_problem(tiny: tuple[dict, dict]) -> None:
    state, config = tiny
    layout = EngineLayout.from_config(config)
    partial = {n: t for n, t in state.items() if n != f"{L0}.self_attn.k_proj.weight"}
    with pytest.raises(LayoutError, match=r"qkv_proj.*\['k_proj'\] missing") as err:
        vllm_tensors(partial, layout)
    assert isinstance(err.value, RollsafeError)
    with pytest.raises(LayoutError, match="'GPT2LMHeadModel'"):
        packed_modules("GPT2LMHeadModel")
    with pytest.raises(LayoutError, match="architectures"):
        EngineLayout.from_config({"hidden_size": 64})
    with pytest.raises(LayoutError, match="num_kv_heads"):
        EngineLayout(VLLM_PACKED_MODULES["LlamaForCausalLM"], tp_size=2)
    with pytest.raises(LayoutError, match="tp_size"):
        EngineLayout(VLLM_PACKED_MODULES["LlamaForCausalLM"], tp_size=0)
    with pytest.raises(LayoutError, match=r"tp_rank 2"):
        vllm_tensors(state, EngineLayout.from_config(config, tp_size=2), 2)
    three = EngineLayout.from_config(config, tp_size=3)  # 64 columns do not split in 3
    with pytest.raises(LayoutError, match=r"layers\.\d\.\w+\.\w+_proj\.weight: .* 3 ranks"):
        vllm_tensors(state, three, 0)


def test_cpu_emptied_names() -> None:
    for name in (
        f"{L0}.self_attn.qkv_proj.weight",
        f"{L0}.self_attn.o_proj.weight",
        f"{L0}.mlp.gate_up_proj.weight",
        f"{L0}.mlp.down_proj.weight",
    ):
        assert vllm_cpu_emptied(name), name
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        f"{L0}.input_layernorm.weight",
        f"{L0}.self_attn.qkv_proj.bias",
    ):
        assert not vllm_cpu_emptied(name), name


# ------------------------------------------------------------------ digest verdicts
def test_compare_never_says_equal_without_data() -> None:
    assert EMPTY_SHA256 in EMPTY_DIGESTS and hashlib.sha256(b"").hexdigest() == EMPTY_SHA256
    a, b = "a" * 64, "b" * 64
    check = compare_digests({"x": a, "y": a}, {"x": a, "y": a})
    assert check.verdict == "equal" and check.equal and check.names("equal") == ["x", "y"]
    check = compare_digests({"x": a, "lin": EMPTY_SHA256}, {"x": a, "lin": b})
    assert check.verdict == "unverified" and not check.equal
    assert check.names("no_data") == ["lin"] and check.tensors["lin"].expected == b
    assert "1 no_data (lin)" in check.summary()
    # even an empty expected digest is no data
    assert compare_digests({"e": EMPTY_SHA256}, {"e": EMPTY_SHA256}).verdict == "unverified"
    check = compare_digests({"x": a, "lin": EMPTY_SHA256}, {"x": b, "lin": b})
    assert check.verdict == "differs" and check.names("differs") == ["x"]
    check = compare_digests({"x": a}, {"x": a, "gone": a})
    assert check.verdict == "unverified" and check.names("missing") == ["gone"]
    check = compare_digests({"x": a, "extra": a}, {"x": a})
    assert check.verdict == "unverified" and check.names("unexpected") == ["extra"]
    assert compare_digests({}, {}).verdict == "unverified"
    assert compare_digests({"s": "0" * 16}, {"s": "1" * 16}).names("no_data") == ["s"]
    per_rank = compare_ranks([{"x": a}, {"x": b}], [{"x": a}, {"x": a}])
    assert per_rank.verdict == "differs" and per_rank.names("differs") == ["tp1:x"]
    assert compare_ranks([{"x": a}], [{"x": a}, {"x": a}]).names("missing") == ["tp1:x"]


def test_weights_checksum_check(tiny: tuple[dict, dict]) -> None:
    state, config = tiny
    layout = EngineLayout.from_config(config)
    want = vllm_rank_digests(state, layout)[0]
    engine = {n: EMPTY_SHA256 if vllm_cpu_emptied(n) else d for n, d in want.items()}
    got = WeightsChecksum(None, None, engine, "vllm", ranks=(engine,))
    check = got.check(want)
    assert check.verdict == "unverified"
    assert check.names("no_data") == sorted(n for n in want if vllm_cpu_emptied(n))
    assert set(check.names("equal")) == {n for n in want if not vllm_cpu_emptied(n)}
    assert got.check([want]).verdict == "unverified"
    full = WeightsChecksum(None, None, want, "vllm", ranks=(want,))
    assert full.check(want).verdict == "equal"
    # the old HF-named trainer digests do not compare with the fused names: never "equal"
    from rollsafe.checksum import weights_checksum

    hf = weights_checksum(state, "vllm")["tensors"]
    check = full.check(hf)
    assert check.verdict == "unverified" and check.names("missing") and check.names("unexpected")
    two = EngineLayout.from_config(config, tp_size=2)
    shards = vllm_rank_digests(state, two)
    sharded = WeightsChecksum(None, None, {}, "vllm", ranks=shards)
    assert sharded.check(list(shards)).verdict == "equal"
    assert sharded.check([shards[1], shards[0]]).verdict == "differs"

"""Weight digests as SGLang 0.5.23 / vLLM 0.33.0 compute them, and the reference engine's checkers.

* Known-answer vectors for every algorithm of :mod:`rollsafe.checksum` (the SGLang GPU hash one
  traced step by step on a one-word input, with the intermediate values spelled out).
* The vectorised torch reimplementation of SGLang's ``gpu_tensor_hash`` against a slow scalar
  reimplementation written here independently (a Python loop over tiles and words, unbounded
  ints masked to 32/64 bits), on several dtypes and sizes, tile and chunk boundaries included.
* The reference engine's SGLang ``/weights_checker`` and vLLM ``/weight_checker``: upstream's
  response shapes, 400s naming bad actions and values (unknown keys ignored, as upstream),
  snapshot/reset/compare, and the trainer's digest equal to the engine's after a weight update
  (through the clients).
"""

from __future__ import annotations

import hashlib
import re
import struct
from pathlib import Path

import pytest
import torch
from engine_helpers import (
    EngineProcess,
    module_engine,
    sglang_digests,
    tiny_model_dir,  # noqa: F401  (fixture)
    tiny_model_dir_b,  # noqa: F401  (fixture)
)
from test_engine_sglang import hf_state
from transport_helpers import Trainer, target

import rollsafe.checksum as ck
from rollsafe.adapters.engines.sglang import SGLangClient
from rollsafe.adapters.engines.vllm import VLLMClient
from rollsafe.checksum import (
    overall_checksum,
    per_engine_checksum,
    sglang_gpu_hash,
    tensor_digest,
    weights_checksum,
)
from rollsafe.engine_layout import EngineLayout, vllm_cpu_emptied, vllm_rank_digests
from rollsafe.fleet.weights_check import (
    check_engine,
    read_config,
    sglang_model_digest,
    sglang_rank_digests,
)
from rollsafe.transports import IPCTransport
from rollsafe.wire.bucket import pack_buckets, serialize_bucket

M32 = 0xFFFFFFFF
M64 = (1 << 64) - 1
HEX16 = re.compile(r"^[0-9a-f]{16}$")
HEX64 = re.compile(r"^[0-9a-f]{64}$")


# ============================================================== slow independent reference
def _fmix32(x: int) -> int:
    x &= M32
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def _rotl32(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & M32


def slow_gpu_hash(t: torch.Tensor, seed: int = 0x243F6A88) -> int:
    """SGLang's kernel, one word at a time: tiles of 8192 words, each tile's two lane sums
    finalised with the padded byte count, tiles summed mod 2**64, then splitmix64's finaliser."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    raw += b"\0" * (-len(raw) % 4)
    n = len(raw) // 4
    if n == 0:
        return 0
    words = struct.unpack(f"<{n}I", raw)
    s1 = seed & M32
    s2 = ((seed * 0x9E3779B1) ^ 0xDEADBEEF) & M32
    nbytes = (n * 4) & M32
    acc = 0
    for tile in range((n + 8191) // 8192):
        a = b = 0
        for i in range(tile * 8192, min(n, tile * 8192 + 8192)):
            p1 = ((i * 0x27D4EB2D + s1) & M32) ^ _rotl32(i, 15)
            p2 = ((i * 0x165667B1 + s2) & M32) ^ _rotl32(i, 13)
            a = (a + _fmix32(words[i] ^ p1)) & M32
            b = (b + _fmix32(words[i] ^ p2)) & M32
        acc = (acc + ((_fmix32(a ^ nbytes) << 32) | _fmix32(b ^ nbytes))) & M64
    x = acc
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


# ============================================================== known answers
def test_sglang_gpu_hash_hand_traced_one_word() -> None:
    # bytes 01 02 03 (+ one zero pad byte) -> one little-endian word 0x00030201; n = 1, NB = 4
    t = torch.tensor([1, 2, 3], dtype=torch.uint8)
    s1, s2 = 0x243F6A88, 0x02C74EE7  # seed; ((seed * 0x9E3779B1) ^ 0xDEADBEEF) mod 2**32
    assert s2 == ((0x243F6A88 * 0x9E3779B1) ^ 0xDEADBEEF) & M32
    # word index 0: p1 = (0 * A + s1) ^ rotl(0, 15) = s1, p2 = s2
    k1, k2 = _fmix32(0x00030201 ^ s1), _fmix32(0x00030201 ^ s2)
    assert (k1, k2) == (0xD6D2C61A, 0xAE7FA89E)
    h1, h2 = _fmix32(k1 ^ 4), _fmix32(k2 ^ 4)  # the tile's sums are the single terms
    assert (h1, h2) == (0x7D076200, 0xB7923815)
    # one tile: total = h1 << 32 | h2, then the splitmix64 finaliser
    assert sglang_gpu_hash(t) == 0x78FB8B5EBCE4F7DF == slow_gpu_hash(t)
    assert tensor_digest(t, "sglang-gpu") == "78fb8b5ebce4f7df"


def test_known_answers_every_algorithm() -> None:
    t = torch.tensor([1, 2, 3], dtype=torch.uint8)
    # SGLang host path: first 8 bytes of sha256(b"\x01\x02\x03"), big-endian, 16 hex digits
    assert tensor_digest(t, "sglang-cpu") == "039058c6f2c0cb49"
    # vLLM: the whole sha256 hex digest
    assert tensor_digest(t, "vllm") == (
        "039058c6f2c0cb492c533b0a4d14ef77cc0f78abccced5287d84a1a2011cfb81"
    )
    assert tensor_digest(t, "sglang") == "039058c6f2c0cb49"  # a CPU tensor: SGLang's host path
    # empty tensors: the kernel returns 0; sha256 of no bytes
    assert tensor_digest(torch.empty(0), "sglang-gpu") == "0" * 16
    assert tensor_digest(torch.empty(0), "sglang-cpu") == "e3b0c44298fc1c14"
    # two float32 words 0x3f800000, 0xc0000000 (word 1 exercises the index mixing)
    two = torch.tensor([1.0, -2.0])
    assert tensor_digest(two, "sglang-gpu") == "9ad4ce438405fb8c" == f"{slow_gpu_hash(two):016x}"
    # overall_checksum: sha256 over name + digest in sorted name order, no separators
    want = "8a36148044cbd728215c25feba3eaf5fb24d7ed3a3cfdd93f2d2e625ee8c9841"
    assert overall_checksum({"b": "01", "a": "02"}) == want
    assert hashlib.sha256(b"a02b01").hexdigest() == want
    assert per_engine_checksum(["ab", "cd"]) == hashlib.sha256(b"abcd").hexdigest()


def test_digests_ignore_dtype_and_shape_like_upstream() -> None:
    t = torch.arange(8, dtype=torch.float32)
    as_int = t.view(torch.int32).reshape(2, 4)
    for algo in ("sglang-cpu", "sglang-gpu", "vllm"):
        assert tensor_digest(t, algo) == tensor_digest(as_int, algo)


def test_unknown_algorithm_is_refused() -> None:
    with pytest.raises(ValueError, match="sha1"):
        tensor_digest(torch.zeros(1), "sha1")
    with pytest.raises(ValueError, match="sha1"):
        weights_checksum({"x": torch.zeros(1)}, "sha1")


# ============================================================== vectorised vs scalar
CASES = [
    (torch.float32, 1),
    (torch.float32, 8192),  # exactly one tile
    (torch.float32, 8193),  # one word into the second tile
    (torch.bfloat16, 3),  # 6 bytes: padded to 2 words
    (torch.bfloat16, 8192 * 2 + 1),
    (torch.float16, 5000),
    (torch.uint8, 1),
    (torch.uint8, 7),
    (torch.uint8, 8192 * 4 + 3),  # byte count not a multiple of 4 across a tile boundary
    (torch.int8, 33),
    (torch.int64, 9001),
    (torch.bool, 13),
]


@pytest.mark.parametrize(("dtype", "numel"), CASES)
def test_gpu_hash_matches_slow_reference(dtype: torch.dtype, numel: int) -> None:
    gen = torch.Generator().manual_seed(numel)
    if dtype.is_floating_point:
        t = (torch.randn(numel, generator=gen) * 100).to(dtype)
    elif dtype == torch.bool:
        t = torch.randint(0, 2, (numel,), generator=gen).bool()
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(info.min, info.max, (numel,), generator=gen, dtype=torch.int64).to(dtype)
    assert sglang_gpu_hash(t) == slow_gpu_hash(t)


def test_gpu_hash_chunking_and_views(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(7)
    t = torch.randn(3 * 8192 + 100, generator=gen)
    want = slow_gpu_hash(t)
    assert sglang_gpu_hash(t) == want
    # several vectorised steps (each a whole number of tiles): the same value
    monkeypatch.setattr(ck, "_CHUNK_WORDS", ck.SGLANG_TILE_WORDS)
    assert sglang_gpu_hash(t) == want
    # views: non-contiguous and odd byte offsets hash as their contiguous copies
    m = torch.randn(64, 33, generator=gen).to(torch.bfloat16)
    assert sglang_gpu_hash(m.t()) == slow_gpu_hash(m.t().contiguous())
    odd = torch.randint(0, 255, (40,), generator=gen, dtype=torch.uint8)[1:30]
    assert sglang_gpu_hash(odd) == slow_gpu_hash(odd.clone())


def test_default_resolves_by_device_like_sglang() -> None:
    t = torch.randn(10)
    assert ck.resolve_algorithm("sglang", t) == "sglang-cpu"
    assert ck.algorithm_for("sglang", "cuda:1") == "sglang-gpu"
    assert ck.algorithm_for("sglang", "cpu") == "sglang-cpu"
    assert ck.algorithm_for("sglang", None) == "sglang-gpu"
    assert ck.algorithm_for("vllm", "cuda") == "vllm"
    got = weights_checksum({"a": t, "rotary.inv_freq": t}, "sglang-gpu")
    assert set(got["tensors"]) == {"a"}  # SGLang never hashes non-persistent buffers
    assert got["model"] == overall_checksum(got["tensors"]) and got["algorithm"] == "sglang-gpu"
    assert set(weights_checksum({"rotary.inv_freq": t}, "vllm")["tensors"]) == {"rotary.inv_freq"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_hash_cuda_equals_cpu() -> None:
    t = torch.randn(3 * 8192 + 5, dtype=torch.float32)
    assert sglang_gpu_hash(t.cuda()) == sglang_gpu_hash(t) == slow_gpu_hash(t)


# ============================================================== the reference engine's checkers
@pytest.fixture(scope="module")
def sgl(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(request, tiny_model_dir, ranks=2)


@pytest.fixture(scope="module")
def vll(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(request, tiny_model_dir, extra_args=["--dialect", "vllm"])


PARALLELISM_KEYS = {"role", "tp_rank", "tp_size", "dp_rank", "dp_size", "pp_rank", "pp_size"}


def _rank_shard(t: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    """Rows ``[rank * n / ranks, (rank + 1) * n / ranks)`` of ``t`` (a column-parallel shard)."""
    step = t.shape[0] // ranks
    return t[rank * step : (rank + 1) * step]


def test_sglang_weights_checker_checksum_shape(
    sgl: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    """As a real SGLang with TP 2 answers: per rank its model's own parameters (``qkv_proj``,
    ``gate_up_proj`` fused), that rank's shards, SGLang's host hash on a CPU engine."""
    state = hf_state(tiny_model_dir)
    want = sglang_digests(state, ranks=2)  # trainer side: rollsafe.fleet.weights_check
    hf_parts = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    for r in (sgl.get("/weights_checker"), sgl.post("/weights_checker", {"action": "checksum"})):
        assert r.status_code == 200, r.text
        body = r.json()
        assert set(body) == {"success", "message", "ranks", "per_engine_checksum"}
        assert body["success"] is True and body["message"] == "Success."
        assert len(body["ranks"]) == 2  # one ChecksumInfo per TP rank
        for tp_rank, info in enumerate(body["ranks"]):
            assert set(info) == {"checksums", "per_gpu_checksum", "parallelism_info"}
            checksums = info["checksums"]
            assert all(HEX16.match(v) for v in checksums.values())
            assert len(checksums) == 15  # 2 layers of 6 parameters, embed_tokens, norm, lm_head
            assert not any(f".{p}." in n for n in checksums for p in hf_parts)
            assert checksums == want["ranks"][tp_rank]
            # this rank's own shard, stacked here by hand: q (4 heads) and k, v (2 KV heads)
            # each cut in two, gate and up each cut in two, then stacked; o_proj by columns
            layer = "model.layers.1"
            qkv = torch.cat(
                [
                    _rank_shard(state[f"{layer}.self_attn.{p}_proj.weight"], tp_rank, 2)
                    for p in "qkv"
                ]
            )
            gate_up = torch.cat(
                [
                    _rank_shard(state[f"{layer}.mlp.{p}_proj.weight"], tp_rank, 2)
                    for p in ("gate", "up")
                ]
            )
            o_proj = _rank_shard(state[f"{layer}.self_attn.o_proj.weight"].t(), tp_rank, 2).t()
            lm_head = _rank_shard(state["lm_head.weight"], tp_rank, 2)  # vocab 512: no padding
            for name, t in (
                (f"{layer}.self_attn.qkv_proj.weight", qkv),
                (f"{layer}.mlp.gate_up_proj.weight", gate_up),
                (f"{layer}.self_attn.o_proj.weight", o_proj),
                ("lm_head.weight", lm_head),
                ("model.norm.weight", state["model.norm.weight"]),  # replicated
            ):
                assert checksums[name] == tensor_digest(t.contiguous(), "sglang-cpu"), name
            assert info["per_gpu_checksum"] == overall_checksum(checksums)
            (par,) = info["parallelism_info"]  # one entry per runner role
            assert set(par) == PARALLELISM_KEYS | {"rank", "size"}
            assert par["role"] == "target" and par["tp_rank"] == tp_rank and par["tp_size"] == 2
        per_gpu = [i["per_gpu_checksum"] for i in body["ranks"]]
        assert per_gpu[0] != per_gpu[1]  # different shards
        assert body["per_engine_checksum"] == per_engine_checksum(per_gpu) == want["model"]


def test_sglang_skip_tensor_list_matches_sglang_names(
    sgl: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    """``skip_tensor_list`` substrings match SGLang's own (fused) names, for checksum, reset and
    compare alike, as upstream's one skip rule: ``"qkv_proj"`` and ``"v_proj"`` (a substring of
    ``qkv_proj``) leave the fused parameter out, ``"q_proj"`` matches nothing."""
    full = sgl.checksum()["ranks"]

    def checksum(skip: list[str]) -> list[dict[str, str]]:
        r = sgl.post("/weights_checker", {"action": "checksum", "skip_tensor_list": skip})
        assert r.status_code == 200, r.text
        return [info["checksums"] for info in r.json()["ranks"]]

    without_qkv = [{n: d for n, d in rank.items() if "qkv_proj" not in n} for rank in full]
    assert len(without_qkv[0]) == len(full[0]) - 2
    assert checksum(["qkv_proj"]) == without_qkv == checksum(["v_proj"])
    assert checksum(["q_proj", "gate_proj"]) == full  # HF names: no SGLang name holds them
    ok = {"success": True, "message": "Success."}
    try:
        assert sgl.post("/weights_checker", {"action": "snapshot"}).json() == ok
        reset = {"action": "reset_tensors", "skip_tensor_list": ["qkv_proj", "lm_head"]}
        assert sgl.post("/weights_checker", reset).json() == ok
        after = sgl.checksum()["ranks"]
        for before, now in zip(full, after, strict=True):
            kept = {n for n in before if before[n] == now[n]}
            assert kept == {n for n in before if "qkv_proj" in n or "lm_head" in n}
        # compare names SGLang's parameters that differ, none of the kept ones
        r = sgl.post("/weights_checker", {"action": "compare"})
        assert r.status_code == 400 and r.json()["success"] is False
        message = r.json()["message"]
        assert "name=model.layers.0.mlp.gate_up_proj.weight " in message
        assert "qkv_proj" not in message and "lm_head" not in message
        assert "mlp.up_proj" not in message  # SGLang's names, never the HF parts
        # skipping every changed parameter by its SGLang name, compare passes (and consumes it)
        skip = ["gate_up_proj", "down_proj", "o_proj", "norm", "embed_tokens"]
        assert (
            sgl.post("/weights_checker", {"action": "compare", "skip_tensor_list": skip}).json()
            == ok
        )
        r = sgl.post("/weights_checker", {"action": "compare"})
        assert r.status_code == 400 and "no snapshot" in r.json()["message"]
    finally:
        r = sgl.post("/update_weights_from_disk", {"model_path": str(tiny_model_dir)})
        assert r.status_code == 200, r.text
    assert sgl.checksum()["ranks"] == full


def test_sglang_weights_checker_rejects_with_named_400(sgl: EngineProcess) -> None:
    cases = [
        ({"action": "bogus"}, "bogus"),
        ({"selector": "drafts"}, "drafts"),
        ({"skip_tensor_list": "lm_head"}, "skip_tensor_list"),
        ({"allow_quant_error": 1}, "allow_quant_error"),
    ]
    # an unknown key is ignored, as SGLang's CheckWeightsReqInput parse ignores it
    r = sgl.post("/weights_checker", {"action": "snapshot", "actoin": "x"})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    for body, named in cases:
        r = sgl.post("/weights_checker", body)
        assert r.status_code == 400, (body, r.text)
        # SGLang's shape; the server's contract middleware may add its "error" class name
        assert {"success", "message"} <= set(r.json()) <= {"success", "message", "error"}
        assert r.json()["success"] is False and named in r.json()["message"]
    # vLLM's route is not served in the SGLang dialect, nor the old rollsafe route
    assert sgl.post("/weight_checker", {"action": "checksum"}).status_code == 404
    assert sgl.get("/weights_checksum").status_code == 404


def test_sglang_snapshot_reset_compare(
    sgl: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    ok = {"success": True, "message": "Success."}
    assert sgl.post("/weights_checker", {"action": "snapshot"}).json() == ok
    assert sgl.post("/weights_checker", {"action": "compare"}).json() == ok
    # compare consumed the snapshot (as upstream): take another, then scramble the weights
    assert sgl.post("/weights_checker", {"action": "snapshot"}).json() == ok
    body = {"action": "reset_tensors", "skip_tensor_list": ["norm"]}
    assert sgl.post("/weights_checker", body).json() == ok
    after = sgl.checksum()
    before = sglang_digests(hf_state(tiny_model_dir), 2, after["algorithm"])
    for want, got in zip(before["ranks"], after["ranks"], strict=True):
        changed = {n for n in want if want[n] != got[n]}
        assert changed and not any("norm" in n for n in changed)
        assert all(("norm" in n) or (n in changed) for n in want)
    r = sgl.post("/weights_checker", {"action": "compare"})
    assert r.status_code == 400 and r.json()["success"] is False
    assert r.json()["message"].startswith("check tensor equality failed")
    # restore; the snapshot survived the failed compare
    r = sgl.post("/update_weights_from_disk", {"model_path": str(tiny_model_dir)})
    assert r.status_code == 200, r.text
    assert sgl.post("/weights_checker", {"action": "compare"}).json() == ok
    # a draft runner does not exist here: nothing runs, nothing is reported
    assert sgl.post("/weights_checker", {"selector": "draft"}).json() == ok


def test_sglang_compare_answers_tp_rank_0s_outcome(
    sgl: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    """Every rank compares its own parameters, but only TP rank 0 answers (upstream's
    scheduler: only rank 0 talks to the tokenizer manager): a change in rank 1's shard alone
    is not in the answer."""
    ok = {"success": True, "message": "Success."}
    state = hf_state(tiny_model_dir)
    try:
        assert sgl.post("/weights_checker", {"action": "snapshot"}).json() == ok
        head = state["lm_head.weight"].clone()
        head[400:] += 1  # vocabulary 512 over 2 ranks: rows 256-511 are rank 1's
        (bucket,) = pack_buckets([("lm_head.weight", head)])
        entry = serialize_bucket(bucket)
        body = {"serialized_named_tensors": [entry, entry], "load_format": "flattened_bucket"}
        assert sgl.post("/update_weights_from_tensor", body).status_code == 200
        ranks = sgl.checksum()["ranks"]
        want = sglang_digests(state, 2)["ranks"]
        assert ranks[0] == want[0] and ranks[1]["lm_head.weight"] != want[1]["lm_head.weight"]
        assert sgl.post("/weights_checker", {"action": "compare"}).json() == ok
    finally:
        r = sgl.post("/update_weights_from_disk", {"model_path": str(tiny_model_dir)})
        assert r.status_code == 200, r.text


def test_sglang_client_checksum_equals_trainer_after_update(
    sgl: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
    tiny_model_dir_b: Path,  # noqa: F811
) -> None:
    client = SGLangClient(sgl.url)
    try:
        r = sgl.post("/update_weights_from_disk", {"model_path": str(tiny_model_dir_b)})
        assert r.status_code == 200, r.text
        got = client.weights_checksum()
        assert got.algorithm == "sglang-cpu" and got.weight_version is None
        state = hf_state(tiny_model_dir_b)
        config = read_config(tiny_model_dir_b)
        want = sglang_rank_digests(state, config, tp_size=2, algorithm=got.algorithm)
        assert [dict(r) for r in got.ranks] == want and got.per_engine is not None
        assert got.model == got.per_engine == sglang_model_digest(state, config, tp_size=2)
        # the HF-named digests never pass for SGLang's layout
        hf = weights_checksum(state, got.algorithm)["tensors"]
        assert got.check(hf).verdict == "unverified"
    finally:
        sgl.post("/update_weights_from_disk", {"model_path": str(tiny_model_dir)})
        client.close()


def test_fleet_check_of_a_two_rank_sglang_engine_after_a_sync(
    sgl: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
    tiny_model_dir_b: Path,  # noqa: F811
) -> None:
    """The fleet's check (``check_engine``: the engine's checker against the trainer's weights
    laid out as SGLang holds them) says equal after a sync into a TP 2 engine, tensor by
    tensor per rank under SGLang's names, and names the fused parameter a change lands in."""
    trainer = Trainer(tiny_model_dir_b)
    trainer.perturb(5)
    transport = IPCTransport(2, bucket_bytes=96 << 10)
    client = SGLangClient(sgl.url)
    config = read_config(tiny_model_dir_b)
    try:
        transport.register(trainer.weights(), 7)
        report = transport.update([target("sgl", sgl, (0, 1), client)])
        assert report.ok, report.results
        check = check_engine(client, trainer.weights(), config)
        assert check.verdict == "equal", check.summary()
        assert len(check.names("equal")) == 2 * 15
        assert "tp1:model.layers.0.self_attn.qkv_proj.weight" in check.names("equal")
        changed = dict(trainer.weights())
        changed["model.layers.1.self_attn.k_proj.weight"] = (
            changed["model.layers.1.self_attn.k_proj.weight"] + 1
        )
        check = check_engine(client, changed, config)
        assert check.verdict == "differs"
        assert check.names("differs") == [
            "tp0:model.layers.1.self_attn.qkv_proj.weight",
            "tp1:model.layers.1.self_attn.qkv_proj.weight",
        ]
    finally:
        transport.close()
        client.close()
        sgl.post("/update_weights_from_disk", {"model_path": str(tiny_model_dir)})


def test_vllm_weight_checker_shapes(
    vll: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    """As real vLLM 0.32 on CPU answers: vLLM's fused parameter names under the rank prefix,
    SHA-256 of each parameter's bytes, and the empty-bytes digest for the linear weights."""
    state = hf_state(tiny_model_dir)
    r = vll.post("/weight_checker", {"action": "checksum"})
    assert r.status_code == 200, r.text
    checksums = r.json()["checksums"]
    assert set(r.json()) == {"checksums"}
    fused = {
        f"model.layers.{i}.self_attn.qkv_proj.weight": [
            state[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"
        ]
        for i in range(2)
    } | {
        f"model.layers.{i}.mlp.gate_up_proj.weight": [
            state[f"model.layers.{i}.mlp.{p}_proj.weight"] for p in ("gate", "up")
        ]
        for i in range(2)
    }
    stacked = {n.rsplit(".", 2)[0] + f".{p}_proj.weight" for n in fused for p in "qkv"} | {
        n.rsplit(".", 2)[0] + f".{p}_proj.weight" for n in fused for p in ("gate", "up")
    }
    empty = hashlib.sha256(b"").hexdigest()
    linear = (".qkv_proj.", ".o_proj.", ".gate_up_proj.", ".down_proj.")
    want = {n: torch.cat(parts) for n, parts in fused.items()} | {
        n: t for n, t in state.items() if n not in stacked
    }
    assert checksums == {
        f"dp0:pp0:pcp0:tp0:{n}": empty
        if any(m in n for m in linear)
        else hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        for n, t in want.items()
    }
    assert len(checksums) == 15 and all(HEX64.match(v) for v in checksums.values())
    r = vll.post("/weight_checker", {"action": "compare", "baseline": checksums})
    assert r.json() == {"match": True, "mismatches": []}
    key = sorted(checksums)[0]
    baseline = {**checksums, key: "0" * 64, "dp0:pp0:pcp0:tp0:extra": "1"}
    r = vll.post("/weight_checker", {"action": "compare", "baseline": baseline})
    assert r.json() == {"match": False, "mismatches": sorted([key, "dp0:pp0:pcp0:tp0:extra"])}


def test_vllm_weight_checker_rejects_with_named_400(vll: EngineProcess) -> None:
    for body, named in [
        ({"action": "checksums"}, "checksums"),
        ({"action": "checksum", "baseline": {"k": 1}, "extra": 1}, "baseline"),
        ({}, "action"),
        ({"action": "compare"}, "baseline"),
    ]:
        r = vll.post("/weight_checker", body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        if isinstance(err, dict):  # vLLM's ErrorResponse, from the checker itself
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400
            assert named in err["message"]
        else:  # refused earlier by the server's contract middleware (its own shape)
            assert named in r.json()["message"]
    assert vll.post("/weights_checker", {"action": "checksum"}).status_code == 404
    # vLLM reads only its named Body parameters: another key is ignored
    r = vll.post("/weight_checker", {"action": "checksum", "extra": 1})
    assert r.status_code == 200 and "checksums" in r.json(), r.text


def test_vllm_reset_then_update_matches_trainer(
    vll: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    assert vll.post("/weight_checker", {"action": "reset"}).json() == {"status": "reset"}
    state = hf_state(tiny_model_dir)
    layout = EngineLayout.from_config(read_config(tiny_model_dir))
    zeros = vllm_rank_digests({n: torch.zeros_like(t) for n, t in state.items()}, layout)
    client = VLLMClient(vll.url)
    try:
        got = client.weights_checksum()
        assert got.algorithm == "vllm"
        check = got.check(zeros)
        assert check.verdict == "unverified" and not check.names("differs")
        assert check.names("equal") == sorted(n for n in zeros[0] if not vllm_cpu_emptied(n))
        assert got.check(vllm_rank_digests(state, layout)).verdict == "differs"
        # a weight update through vLLM's collective_rpc reload brings the model back
        r = vll.post("/collective_rpc", {"method": "reload_weights"})
        assert r.status_code == 200, r.text
        got = client.weights_checksum()
        check = got.check(vllm_rank_digests(state, layout))
        assert check.verdict == "unverified", check.summary()
        assert check.names("no_data") == sorted(n for n in zeros[0] if vllm_cpu_emptied(n))
        assert check.counts() == {"equal": 7, "no_data": 8}
        # the trainer's HF-named digests never pass for the fused layout
        assert got.check(weights_checksum(state, "vllm")["tensors"]).verdict == "unverified"
    finally:
        client.close()


def _llama(vocab: int = 128, hidden: int = 8, inter: int = 16, layers: int = 2) -> tuple:
    """A Llama's HF tensors (2 heads of 4, 1 KV head) and its config."""
    g = torch.Generator().manual_seed(3)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden)}
    shapes["model.norm.weight"] = (hidden,)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (4, hidden),
            p + "self_attn.v_proj.weight": (4, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    weights = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "tie_word_embeddings": False,
    }
    return weights, config


def test_a_real_sglangs_fused_parameters_are_checked_in_its_layout() -> None:
    """A real SGLang's checker hashes its model's own parameters: ``qkv_proj`` (q, k, v stacked
    along dim 0) and ``gate_up_proj`` (gate, up), as its GPU run reported them (35 HF-named
    tensors equal, 40 HF parts missing, 16 fused ones unexpected before this layout). The
    trainer's side, stacked here by hand, must then compare equal; one changed part differs;
    HF-named digests (what the reference engine reported before it answered as SGLang does)
    are never "equal"."""
    from rollsafe.fleet.weights_check import expected_digests
    from rollsafe.ports import WeightsChecksum

    weights, config = _llama()
    fused: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        for parts, into in (
            (("q_proj", "k_proj", "v_proj"), "qkv_proj"),
            (("gate_proj", "up_proj"), "gate_up_proj"),
        ):
            if f".{parts[0]}." in name:
                fused[name.replace(parts[0], into)] = torch.cat(
                    [weights[name.replace(parts[0], p)] for p in parts], dim=0
                )
        if not any(
            f".{p}." in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
        ):
            fused[name] = t
    engine = dict(ck.weights_checksum(fused, "sglang-gpu")["tensors"])
    assert "model.layers.0.self_attn.qkv_proj.weight" in engine
    reported = WeightsChecksum(None, None, engine, "sglang-gpu", ranks=(engine,))
    check = reported.check(expected_digests(weights, reported, config, dialect="sglang"))
    assert check.verdict == "equal", check.summary()
    assert len(check.tensors) == 3 + 2 * 6  # 5 HF parts a layer fused into 2

    changed = dict(weights)
    changed["model.layers.1.mlp.up_proj.weight"] = changed["model.layers.1.mlp.up_proj.weight"] + 1
    check = reported.check(expected_digests(changed, reported, config, dialect="sglang"))
    assert check.verdict == "differs"
    assert check.names("differs") == ["model.layers.1.mlp.gate_up_proj.weight"]

    hf = dict(ck.weights_checksum(weights, "sglang-gpu")["tensors"])
    as_hf = WeightsChecksum(None, None, hf, "sglang-gpu", ranks=(hf,))
    check = as_hf.check(expected_digests(weights, as_hf, config, dialect="sglang"))
    assert check.verdict == "unverified" and check.names("missing") and check.names("unexpected")

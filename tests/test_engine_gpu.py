"""GPU tests of the reference engine with ``--device cuda`` (skipped cleanly without CUDA).

The module engine is parametrized over one rank and two ranks sharing the one GPU (their rank
group is gloo over host copies: NCCL refuses two ranks on one device). Everything runs in fp32,
so greedy ids equal ``transformers`` greedy on the same GPU; a difference is accepted only where
the reference itself has a near-tie (top-2 logits within ``TIE_TOLERANCE``), after which the two
sequences legitimately diverge. Weight updates are sent from this process as flattened buckets
of CUDA tensors (CUDA IPC handles, :mod:`rollsafe.wire.bucket`), one entry per rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engine_helpers import (
    EngineProcess,
    EngineStartError,
    module_engine,
    sglang_digests,
    start_engine,
    tiny_model_dir,  # noqa: F401  (fixture)
    tiny_model_dir_b,  # noqa: F401  (fixture)
)
from test_engine_sglang import PROMPT, hf_state

from rollsafe.wire.bucket import pack_buckets, serialize_bucket

pytestmark = pytest.mark.gpu

NEW_TOKENS = 16
TIE_TOLERANCE = 1e-4
CUDA_ARGS = ["--device", "cuda", "--dtype", "float32"]
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0}


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks-one-gpu"])
def cuda_engine(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,  # noqa: F811
) -> EngineProcess:
    return module_engine(request, tiny_model_dir, ranks=request.param, extra_args=CUDA_ARGS)


def hf_cuda_greedy_logits(
    model_dir: Path, prompt: list[int], n: int
) -> tuple[list[int], list[torch.Tensor]]:
    """``transformers`` greedy ids (stopping at EOS, like the engine) and each step's logits,
    in fp32 on ``cuda:0``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).float().to("cuda:0").eval()
    out = model.generate(
        torch.tensor([prompt], device="cuda:0"),
        max_new_tokens=n,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    ids = [int(t) for t in out.sequences[0, len(prompt) :]]
    return ids, [step[0].float().cpu() for step in out.logits]


def assert_greedy_matches(got: list[int], model_dir: Path, prompt: list[int]) -> None:
    """``got`` equals transformers greedy, or first differs where the reference has a near-tie."""
    want, logits = hf_cuda_greedy_logits(model_dir, prompt, NEW_TOKENS)
    for step, (g, w) in enumerate(zip(got, want, strict=False)):
        if g == w:
            continue
        margin = float(logits[step][w] - logits[step][g])
        assert margin <= TIE_TOLERANCE, (
            f"step {step}: engine chose {g}, transformers {w} (logit margin {margin:.3g}); "
            f"engine {got} vs transformers {want}"
        )
        return  # a near-tie: from here on the sequences differ legitimately
    assert got == want  # same tokens, so the same length (both stop at EOS or the limit)


def generate(engine: EngineProcess) -> list[int]:
    r = engine.post("/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    return [int(t) for t in r.json()["output_ids"]]


@pytest.fixture
def cuda_state_b(tiny_model_dir_b: Path) -> Iterator[dict[str, torch.Tensor]]:  # noqa: F811
    yield {n: t.to("cuda:0") for n, t in hf_state(tiny_model_dir_b).items()}
    torch.cuda.synchronize()


def test_engine_serves_on_cuda(cuda_engine: EngineProcess) -> None:
    ranks = cuda_engine.ready["ranks"]
    assert cuda_engine.ready["device"] == "cuda"
    assert cuda_engine.ready["rank_start_method"] == ("spawn" if ranks > 1 else None)
    info = cuda_engine.get("/get_server_info").json()
    assert info["device"] == "cuda" and info["ranks"] == ranks and info["healthy"]
    assert cuda_engine.get("/health_generate").status_code == 200


def test_greedy_matches_transformers_on_cuda(
    cuda_engine: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    got = generate(cuda_engine)
    assert got == generate(cuda_engine)  # deterministic
    assert_greedy_matches(got, tiny_model_dir, PROMPT)


def test_checksum_on_cuda_matches_the_checkpoint(
    cuda_engine: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    got = cuda_engine.checksum()  # each rank's own parameters, SGLang's GPU hash
    want = sglang_digests(hf_state(tiny_model_dir), len(got["ranks"]), got["algorithm"])
    assert got["algorithm"] == "sglang-gpu"
    assert got["ranks"] == want["ranks"] and got["model"] == want["model"]


def test_cuda_ipc_flattened_buckets_update(
    cuda_engine: EngineProcess,
    cuda_state_b: dict[str, torch.Tensor],
    tiny_model_dir_b: Path,  # noqa: F811
) -> None:
    ranks = int(cuda_engine.ready["ranks"])
    buckets = list(pack_buckets(cuda_state_b.items(), bucket_bytes=64 << 10))
    assert len(buckets) > 1 and all(b.flat.is_cuda for b in buckets)
    torch.cuda.synchronize()  # the buckets are written before their handles are sent
    for i, bucket in enumerate(buckets):  # ``buckets`` stays alive until every answer came
        entry = serialize_bucket(bucket)
        r = cuda_engine.post(
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": [entry] * ranks,
                "load_format": "flattened_bucket",
                "flush_cache": i == len(buckets) - 1,
                "weight_version": "cuda-ipc",
            },
        )
        assert r.status_code == 200, r.text
    got = cuda_engine.checksum()
    assert (
        got["model"] == sglang_digests(cuda_state_b, len(got["ranks"]), got["algorithm"])["model"]
    )
    assert got["weight_version"] == "cuda-ipc"
    assert_greedy_matches(generate(cuda_engine), tiny_model_dir_b, PROMPT)


def test_release_resume_and_disk_reload_on_cuda(
    cuda_engine: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    assert cuda_engine.post("/release_memory_occupation", {"tags": ["weights"]}).status_code == 200
    r = cuda_engine.post("/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert r.status_code == 503
    assert cuda_engine.post("/resume_memory_occupation", {"tags": ["weights"]}).status_code == 200
    r = cuda_engine.post(
        "/update_weights_from_disk", {"model_path": str(tiny_model_dir), "weight_version": "A"}
    )
    assert r.status_code == 200, r.text
    got = cuda_engine.checksum()
    want = sglang_digests(hf_state(tiny_model_dir), len(got["ranks"]), got["algorithm"])
    assert got["model"] == want["model"]
    assert_greedy_matches(generate(cuda_engine), tiny_model_dir, PROMPT)


def test_sampling_on_cuda_is_seeded(cuda_engine: EngineProcess) -> None:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {
            "max_new_tokens": 8,
            "temperature": 0.8,
            "top_p": 0.9,
            "sampling_seed": 3,
        },
    }
    a = cuda_engine.post("/generate", body)
    assert a.status_code == 200, a.text
    assert a.json()["output_ids"] == cuda_engine.post("/generate", body).json()["output_ids"]


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() > 1,
    reason="needs exactly one visible GPU",
)
def test_nccl_rank_group_refused_on_one_gpu(tiny_model_dir: Path) -> None:  # noqa: F811
    with pytest.raises(EngineStartError, match="NCCL refuses two ranks on one device"):
        start_engine(tiny_model_dir, ranks=2, extra_args=[*CUDA_ARGS, "--rank-backend", "nccl"])


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two GPUs (one per rank)",
)
def test_nccl_rank_group_on_two_gpus(tiny_model_dir: Path) -> None:  # noqa: F811
    eng = start_engine(tiny_model_dir, ranks=2, extra_args=[*CUDA_ARGS, "--rank-backend", "nccl"])
    try:
        assert_greedy_matches(generate(eng), tiny_model_dir, PROMPT)
        got = eng.checksum()
        assert (
            got["model"] == sglang_digests(hf_state(tiny_model_dir), 2, got["algorithm"])["model"]
        )
    finally:
        eng.stop()


class _SlowCudaGroup:
    """A receiving weight-update group on one GPU that behaves like NCCL's: the broadcast is
    queued on the current stream (the engine's receive stream) after a spin, and ``wait`` makes
    the caller's stream wait for it. It fills the buffer with ``value``."""

    def __init__(self, value: float, spin_cycles: int) -> None:
        self.value = value
        self.spin_cycles = spin_cycles

    def broadcast(self, t: torch.Tensor, root: int) -> object:
        torch.cuda._sleep(self.spin_cycles)
        # flattened calls receive SGLang's uint8 layout: fill the float32 values it carries
        (t.view(torch.float32) if t.dtype == torch.uint8 else t).fill_(self.value)
        done = torch.cuda.Event()
        done.record()

        class Work:
            def wait(self) -> None:
                torch.cuda.current_stream().wait_event(done)

        return Work()


def test_receive_overlaps_the_previous_copy_without_overwriting_it() -> None:
    """An intermediate nccl call is answered with its copies still queued (the engine does not
    sync); the next call is received on a side stream meanwhile. The kept buffer the queued
    copies read must not be received into: every destination gets its own call's values."""
    from rollsafe.adapters.reference_engine.weights import ReceiveBuffers, receive_broadcast

    dev = torch.device("cuda:0")
    meta = [("a", (1024, 1024), torch.float32), ("b", (4096,), torch.float32)]
    side = torch.cuda.Stream(device=dev)

    def run(bufs: ReceiveBuffers, *, tell_copies: bool) -> list[bool]:
        dests = []
        for call in range(6):
            named = receive_broadcast(
                _SlowCudaGroup(float(call + 1), 2_000_000),
                meta,
                flattened=True,
                device=dev,
                buffers=bufs,
                stream=side,
            )
            # the commit: a copy that starts late on the current stream, not waited for
            torch.cuda._sleep(20_000_000)
            dest = {n: torch.empty_like(t) for n, t in named}
            for n, t in named:
                dest[n].copy_(t)
            copied = torch.cuda.Event()
            copied.record()
            bufs.mark_read(copied if tell_copies else None)
            dests.append(dest)
        torch.cuda.synchronize(dev)
        return [
            all(bool((t == call + 1).all()) for t in dest.values())
            for call, dest in enumerate(dests)
        ]

    bufs = ReceiveBuffers(slots=2)
    assert run(bufs, tell_copies=True) == [True] * 6  # every call kept its own data
    assert bufs.buffers == 2  # two slots alternate; nothing else was allocated
    # control: buffers not told about the queued copies are received into while being read
    assert not all(run(ReceiveBuffers(slots=2), tell_copies=False))

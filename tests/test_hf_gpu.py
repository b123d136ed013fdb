"""The CUDA snapshot path: tensors copied one by one through a pinned host chunk, so the extra
device memory stays at most one tensor (only a non-contiguous tensor is made contiguous)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollsafe.hf import HFExporter, verify_hf_dir
from rollsafe.hf.snapshot import PinnedStaging


@pytest.mark.gpu
def test_cuda_tensors_export_through_a_pinned_chunk(tmp_path: Path) -> None:
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    base = torch.randn(2048, 1024, device=device, generator=gen)  # 8 MiB
    tensors = {
        "big.bf16": torch.randn(8192, 4096, device=device, generator=gen).to(torch.bfloat16),
        "transposed": base.t(),  # non-contiguous, 8 MiB
        "small": torch.arange(10, device=device),
        "scalar": torch.tensor(2.5, device=device),
    }
    expected = {k: v.cpu() for k, v in tensors.items()}
    torch.cuda.synchronize()
    exporter = HFExporter(tmp_path, shard_size_bytes=32 << 20)
    exporter._staging = PinnedStaging(6 << 20)  # two 3 MiB chunks: several per tensor
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    handle = exporter.start(tensors, 1)
    extra = torch.cuda.max_memory_allocated(device) - before
    assert extra <= base.numel() * base.element_size() + (1 << 20), extra  # one tensor at most
    base.mul_(0)  # after start returns, the export no longer reads device memory
    path = handle.wait(120)

    loaded: dict[str, torch.Tensor] = {}
    for f in verify_hf_dir(path, expected_keys=tensors).weight_files:
        loaded.update(load_file(path / f))
    assert set(loaded) == set(expected)
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key

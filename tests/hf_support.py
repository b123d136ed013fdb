"""Helpers shared by the HF export tests: small tensor sets and a gated (pausable) writer."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import rollsafe.hf.exporter as exporter_module


def small_tensors(seed: int = 0, n: int = 6) -> dict[str, torch.Tensor]:
    """A few fp32/bf16 tensors (about 20 KiB in all)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for i in range(n):
        t = torch.randn(16, 32, generator=gen)
        out[f"layers.{i}.weight"] = t if i % 2 == 0 else t.to(torch.bfloat16)
    return out


def hidden_entries(root: Path) -> list[str]:
    """Names of hidden temp/trash entries under an export root."""
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


@dataclass
class WriterGate:
    """Holds the exporter's writer before each shard until ``release()``."""

    started: threading.Event = field(default_factory=threading.Event)
    gate: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        self.gate.set()


@contextmanager
def gated_writer(monkeypatch: pytest.MonkeyPatch) -> Iterator[WriterGate]:
    """Patch the exporter so its writer blocks before writing each shard until released."""
    gate = WriterGate()
    original = exporter_module.write_shard

    def write_shard(*args: Any, **kwargs: Any) -> int:
        gate.started.set()
        assert gate.gate.wait(30), "test never released the writer"
        return original(*args, **kwargs)

    monkeypatch.setattr(exporter_module, "write_shard", write_shard)
    try:
        yield gate
    finally:
        gate.release()

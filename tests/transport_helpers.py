"""Helpers shared by the weight-transport tests: trainer models, checks and a killing client.

``Trainer`` holds an HF model whose parameters are the trainer's weights; ``assert_serves``
checks an engine's weight checker against what an SGLang holding the trainer tensors reports
(:func:`engine_helpers.sglang_digests`: its fused parameters per TP rank) and its greedy output
against ``transformers`` greedy on the trainer model.
``KillingClient`` wraps an engine client and SIGKILLs the engine's process group during its
``n``-th weight call (the call itself then fails), for mid-update crash tests.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import torch
from engine_helpers import EngineProcess, sglang_digests

from rollsafe.adapters.engines import SGLangClient
from rollsafe.fleet.weights_check import sglang_model_digest
from rollsafe.ports import EngineTarget

GREEDY = {"max_new_tokens": 8, "temperature": 0}
PROMPT = [1, 17, 42, 99, 7]


class Trainer:
    """The trainer side: an HF causal LM whose named parameters are the weights to push."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def perturb(self, seed: int, names: int = 4) -> None:
        """Change a few parameters in place (a training step)."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, p in list(self.model.named_parameters())[:names]:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))

    def fused_step(self, seed: int) -> None:
        """One step of ``AdamW(fused=True)`` (TRL's default optimizer): it writes every
        parameter without bumping the tensors' version counters."""
        torch.manual_seed(seed)
        opt = torch.optim.AdamW(self.model.parameters(), lr=0.05, fused=True)
        ids = torch.tensor([PROMPT])
        self.model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        self.model.zero_grad(set_to_none=True)

    def checksum(self, ranks: int = 1) -> str:
        """The model digest an SGLang-dialect engine of ``ranks`` TP ranks holding these
        weights reports (``RolloutFleet.checksums()``, ``WeightsChecksum.model``)."""
        return sglang_model_digest(self.weights(), self.model.config, tp_size=ranks)

    def greedy(self, prompt: list[int] = PROMPT, n: int = GREEDY["max_new_tokens"]) -> list[int]:
        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0
            )
        return [int(t) for t in out[0, len(prompt) :]]


def target(
    name: str, eng: EngineProcess | None, ranks: tuple[int, ...], client: Any = None
) -> EngineTarget:
    """An :class:`EngineTarget` for ``eng`` (or for ``client`` when given)."""
    if client is None:
        assert eng is not None
        client = SGLangClient(eng.url)
    return EngineTarget(name, ranks, client, tp_size=len(ranks))


def engine_greedy(eng: EngineProcess, prompt: list[int] = PROMPT) -> tuple[list[int], str]:
    r = eng.post("/generate", {"input_ids": prompt, "sampling_params": GREEDY})
    r.raise_for_status()
    body = r.json()
    return [int(t) for t in body["output_ids"]], str(body["meta_info"]["weight_version"])


def assert_serves(eng: EngineProcess, trainer: Trainer, version: int) -> None:
    """The engine holds exactly the trainer's weights, at ``version``, and generates like it."""
    got = eng.checksum()
    want = sglang_digests(
        trainer.weights(), len(got["ranks"]), got["algorithm"], trainer.model.config
    )
    assert got["ranks"] == want["ranks"]
    assert got["model"] == want["model"]
    assert got["weight_version"] == str(version)
    ids, served = engine_greedy(eng)
    assert served == str(version)
    assert ids == trainer.greedy()


class KillingClient:
    """Forwards to ``client``; SIGKILLs ``eng`` (all ranks) ``delay`` s into its ``n``-th call of
    ``method`` (so the kill lands while that call, and the transfer behind it, is running)."""

    def __init__(
        self, client: Any, eng: EngineProcess, method: str, n: int = 2, delay: float = 0.0
    ) -> None:
        self._client = client
        self._eng = eng
        self._method = method
        self._n = n
        self._delay = delay
        self.calls = 0
        self.killed = threading.Event()

    def _kill(self) -> None:
        try:
            os.killpg(self._eng.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.killed.set()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if name != self._method:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls == self._n:
                if self._delay > 0:
                    threading.Timer(self._delay, self._kill).start()
                else:
                    self._kill()
            return attr(*args, **kwargs)

        return call


def transport_threads() -> list[str]:
    """Names of live threads started by the transports (packers, joins, reapers, HTTP pools)."""
    prefixes = ("rollsafe-bucket-packer", "rollsafe-join", "nccl-http", "ipc-push", "nccl-push")
    return [t.name for t in threading.enumerate() if t.name.startswith(prefixes)]

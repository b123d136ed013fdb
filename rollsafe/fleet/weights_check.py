"""Checking an engine's weights against the trainer's, in the engine's own layout.

:func:`expected_digests` computes, from HF-named tensors, what an engine's checker reports when
it holds exactly those weights, one ``{name: digest}`` per TP rank, in the engine's own layout
(:mod:`rollsafe.engine_layout`): for SGLang (a real one or the reference engine, which answers
alike) its digests of each rank's fused, TP-sharded parameters (:func:`sglang_rank_digests`;
:func:`sglang_model_digest` is the model digest it reports); for vLLM its SHA-256 of the same
layout.
:func:`check_engine` asks the engine and compares (:mod:`rollsafe.digest_check`): its verdict is
``"equal"`` only when every tensor carried data and matched; vLLM on CPU reports no data for its
linear weights, so there the verdict is ``"unverified"`` at best, and the behavioural probe
(:mod:`rollsafe.probe`) is the check that covers them.

A check holds the engine the way a weight load does (:meth:`WorkerGroup.loading`): SGLang
runs its weights checker on the scheduler, and its ``/health`` (a one-token generate) waits
behind it, so a fleet that probed a group under check failed it (SGLang's GPU run: a 5 s
checksum, two 2 s probes, the group restarted mid-check).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollsafe.checksum import overall_checksum, sglang_engine_digest, weights_checksum
from rollsafe.digest_check import DigestCheck
from rollsafe.engine_layout import EngineLayout, iter_rank_tensors, vllm_rank_digests
from rollsafe.errors import InvalidArgument

if TYPE_CHECKING:
    import torch

    from rollsafe.ports import EngineClient, WeightsChecksum
    from rollsafe.registry import FleetRegistry

__all__ = [
    "check_engine",
    "check_engines",
    "engine_checksums",
    "expected_digests",
    "read_config",
    "sglang_model_digest",
    "sglang_rank_digests",
]


def read_config(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """``config.json`` of an HF model directory, as a dict (the layout is read from it)."""
    path = Path(model_dir) / "config.json"
    with path.open() as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise InvalidArgument("path", f"{path}: not a JSON object")
    return config


def expected_digests(
    weights: Mapping[str, torch.Tensor],
    reported: WeightsChecksum,
    config: Mapping[str, Any],
    *,
    dialect: str,
) -> list[dict[str, str]]:
    """What an engine of ``dialect`` that reported ``reported`` would report for ``weights``:
    one ``{name: digest}`` per TP rank (the TP size: the ranks it reported), in its own layout;
    SGLang's digests in ``reported.algorithm`` (:func:`sglang_rank_digests`)."""
    tp = max(1, len(reported.ranks))
    if dialect == "vllm":
        layout = EngineLayout.from_config(config, tp_size=tp)
        return list(vllm_rank_digests(weights, layout))
    return sglang_rank_digests(weights, config, tp_size=tp, algorithm=reported.algorithm)


def sglang_rank_digests(
    weights: Mapping[str, torch.Tensor],
    config: Mapping[str, Any] | Any,
    *,
    tp_size: int = 1,
    algorithm: str = "sglang",
) -> list[dict[str, str]]:
    """What an SGLang with ``tp_size`` ranks holding the HF-named ``weights`` reports in its
    ``/weights_checker`` ``checksum``: per TP rank, ``{name: digest}`` of that rank's own
    parameters (``named_parameters()``: ``qkv_proj`` and ``gate_up_proj`` fused, each rank's
    shard, the vocabulary padded, a tied ``lm_head`` listed once; :mod:`rollsafe.engine_layout`)
    under ``algorithm`` (:mod:`rollsafe.checksum`; ``"sglang"`` resolves by each tensor's
    device, as SGLang does). ``config``: the model's HF config (a dict or a
    ``PretrainedConfig``). The tensors are laid out one parameter at a time, where they are."""
    layout = EngineLayout.from_config(config, tp_size=tp_size, engine="sglang")
    out: list[dict[str, str]] = []
    for rank in range(tp_size):
        digests: dict[str, str] = {}
        for part in iter_rank_tensors(weights, layout, rank, device=None):
            digests.update(weights_checksum(part, algorithm)["tensors"])
        out.append(digests)
    return out


def sglang_model_digest(
    weights: Mapping[str, torch.Tensor],
    config: Mapping[str, Any] | Any,
    *,
    tp_size: int = 1,
    algorithm: str = "sglang",
) -> str:
    """The model digest (``WeightsChecksum.model``, ``RolloutFleet.checksums()``) an SGLang
    with ``tp_size`` ranks holding ``weights`` reports: its ``per_gpu_checksum`` when every rank
    reports the same, else its ``per_engine_checksum`` (:func:`sglang_rank_digests`)."""
    ranks = sglang_rank_digests(weights, config, tp_size=tp_size, algorithm=algorithm)
    return sglang_engine_digest([overall_checksum(r) for r in ranks])


def check_engine(
    client: EngineClient,
    weights: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    *,
    timeout: float | None = None,
) -> DigestCheck:
    """Ask ``client``'s checker and compare with ``weights`` in its layout (raises the client's
    ``EngineError`` when it does not answer)."""
    reported = client.weights_checksum(timeout=timeout)
    return reported.check(expected_digests(weights, reported, config, dialect=client.dialect))


def check_engines(
    registry: FleetRegistry,
    weights: Mapping[str, torch.Tensor],
    model_dir: str | os.PathLike[str],
    *,
    timeout: float | None = None,
) -> dict[str, DigestCheck | None]:
    """Every group's engine checked against ``weights`` (the layout read from ``model_dir``'s
    ``config.json``); None for a group whose engine did not answer or has no client."""
    config = read_config(model_dir)
    out: dict[str, DigestCheck | None] = {}
    for group in registry.groups():
        client = group.client
        try:
            with group.loading():  # SGLang's scheduler checks inline: its /health waits
                out[group.group_id] = (
                    check_engine(client, weights, config, timeout=timeout) if client else None
                )
        except Exception:
            out[group.group_id] = None
    return out


def engine_checksums(
    registry: FleetRegistry, *, timeout: float | None = None
) -> dict[str, str | None]:
    """Each group's engine model digest from its own weight checker (None if it did not
    answer). Equal model digests say two engines of one kind report the same; against a
    trainer use :func:`check_engines` (per tensor, in the engine's layout, never "equal"
    without data). :func:`sglang_model_digest` of a trainer's weights equals an SGLang
    engine's (the HF-named ``rollsafe.checksum.weights_checksum`` does not: SGLang reports its
    fused parameters); vLLM on CPU reports empty digests for linear weights, so its model digest
    is not a trainer's."""
    out: dict[str, str | None] = {}
    for group in registry.groups():
        client = group.client
        try:
            with group.loading():  # SGLang's scheduler checks inline: its /health waits
                out[group.group_id] = (
                    client.weights_checksum(timeout=timeout).model if client else None
                )
        except Exception:
            out[group.group_id] = None
    return out

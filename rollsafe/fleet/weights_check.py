"""Checking an engine's weights against the trainer's, in the engine's own layout.

:func:`expected_digests` computes, from HF-named tensors, what an engine's checker reports when
it holds exactly those weights: SGLang's per-tensor digests, under HF names for an engine that
reports them (the reference engine) or, for a real SGLang, of its fused, TP-sharded parameters
as vLLM lays them out; vLLM's fused, TP-sharded parameters (:mod:`rollsafe.engine_layout`).
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

from rollsafe.checksum import weights_checksum
from rollsafe.digest_check import DigestCheck
from rollsafe.engine_layout import EngineLayout, LayoutError, vllm_rank_digests, vllm_tensors
from rollsafe.errors import InvalidArgument

if TYPE_CHECKING:
    import torch

    from rollsafe.ports import EngineClient, WeightsChecksum
    from rollsafe.registry import FleetRegistry

__all__ = ["check_engine", "check_engines", "engine_checksums", "expected_digests", "read_config"]


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
    one ``{name: digest}`` per rank for vLLM (TP size: the ranks it reported) and for an SGLang
    that reports fused parameters (a real one), one merged mapping in HF names for an SGLang
    that reports those (the reference engine); SGLang's digests in ``reported.algorithm``."""
    tp = max(1, len(reported.ranks))
    if dialect == "vllm":
        layout = EngineLayout.from_config(config, tp_size=tp)
        return list(vllm_rank_digests(weights, layout))
    fused = _sglang_fused_layout(reported, config, tp)
    if fused is not None:  # a real SGLang: its own parameters, as vLLM lays them out
        return [
            dict(weights_checksum(vllm_tensors(weights, fused, r), reported.algorithm)["tensors"])
            for r in range(fused.tp_size)
        ]
    return [dict(weights_checksum(weights, reported.algorithm)["tensors"])]


def _sglang_fused_layout(
    reported: WeightsChecksum, config: Mapping[str, Any], tp: int
) -> EngineLayout | None:
    """The layout of an SGLang that reports its model's own parameters: a real SGLang hashes
    ``named_parameters()``, where the stacking rule fused ``q/k/v_proj`` into ``qkv_proj`` and
    ``gate/up_proj`` into ``gate_up_proj``, sharded per TP rank and the vocabulary padded as
    vLLM does (SGLang's linear and embedding layers are vLLM's; its GPU run reported exactly
    those names); None for one that reports HF names (the reference engine)."""
    fused = {n.rsplit(".", 2)[-2] for n in reported.tensors if n.count(".") >= 2}
    try:
        layout = EngineLayout.from_config(config, tp_size=tp)
    except LayoutError:
        return None
    return layout if fused & set(layout.packed) else None


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
    without data). ``rollsafe.checksum.weights_checksum(w, algorithm)["model"]`` equals an
    SGLang-dialect engine's; vLLM reports fused parameter names and, on CPU, empty digests for
    linear weights, so its model digest is not a trainer's."""
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

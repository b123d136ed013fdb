"""A trainer's HF-named tensors in an engine's own parameter layout, and their digests.

vLLM's ``/weight_checker`` does not hash the tensors a trainer holds: it hashes the model's
``named_parameters()`` (read from vLLM 0.32's ``model_executor/model_loader/weight_checksum.py``
and ``v1/worker/gpu_worker.py``; no upstream code is copied here):

* **Fused parameters.** The model's stacking rule (``packed_modules_mapping``, also the
  ``hf_to_vllm_mapper`` of Llama) loads HF ``q_proj``/``k_proj``/``v_proj`` into one
  ``qkv_proj`` and ``gate_proj``/``up_proj`` into one ``gate_up_proj``, concatenated along the
  output dimension (dim 0) in the mapping's order; the bias (Qwen2) the same way.
* **Per TP rank.** Each worker hashes its own shard: column-parallel rows (``q``/``k``/``v`` by
  heads, ``gate``/``up`` each cut in ``tp`` pieces, then stacked), row-parallel columns
  (``o_proj``, ``down_proj``), vocabulary rows (``embed_tokens``, ``lm_head``) padded to a
  multiple of 64 with zero rows (also with one rank) and cut in ``tp`` pieces; the rest
  (norms) is replicated. With
  fewer KV heads than ranks, ranks share KV heads (rank ``r`` holds KV head
  ``r // (tp / kv_heads)``).
* **Keys.** ``"dp<d>:pp<p>:pcp<c>:tp<t>:" + name`` (:func:`checker_key`); the digest is SHA-256
  of the parameter's raw bytes in the engine's dtype (:func:`rollsafe.checksum.vllm_digest`).
* **Tied embeddings.** ``tie_word_embeddings``: ``lm_head`` shares ``embed_tokens``' parameter
  and ``named_parameters()`` lists it once, so there is no ``lm_head.weight`` key.
* **On CPU** every ``LinearBase`` weight (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
  ``down_proj``) is replaced by an empty tensor after oneDNN / sgl-kernel prepacking
  (``layers/utils.py`` ``dispatch_cpu_unquantized_gemm(remove_weight=True)``), so the engine
  reports the SHA-256 of empty bytes (:data:`EMPTY_SHA256`) for them: no data to compare
  (:mod:`rollsafe.digest_check` says so). Embeddings and ``lm_head`` keep their weights
  (``remove_weight=False``) and norms are not linear layers: those digests are real.

**SGLang** hashes the same parameters in its ``/weights_checker`` (read from SGLang 0.5.23's
``srt/utils/weight_checker.py``: ``named_parameters()`` then ``named_buffers()`` of the model on
each TP rank): its Llama-family models stack ``q/k/v_proj`` and ``gate/up_proj`` the same way
(``stacked_params_mapping``), its linear and vocabulary layers shard as vLLM's, and ``lm_head``
is ``embed_tokens`` when tied. One difference: where the vocabulary padded to 64 does not split
evenly over the ranks, SGLang pads it to a multiple of ``64 * tp`` (``VocabParallelEmbedding``),
where vLLM refuses to start; ``EngineLayout.from_config(..., engine="sglang")`` sets that rule
(:attr:`EngineLayout.vocab_pad_per_rank`). Its digests are SGLang's own
(:mod:`rollsafe.checksum`); :func:`iter_rank_tensors` hands a rank's parameters out one at a
time, so a caller hashing them never holds a second copy of the model.

Which architectures are covered: the stacking rule is read from the vLLM model class when vLLM
is importable (:func:`packed_modules`); otherwise from :data:`VLLM_PACKED_MODULES`, the table
read from vLLM 0.32 for ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` and
``Qwen3ForCausalLM`` (identical rules, SGLang's too). Other architectures raise
:class:`LayoutError`. Only TP size 1 has been compared with a real server (vLLM on CPU, SGLang
on a GPU); the TP > 1 shards follow the source.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollsafe.errors import RollsafeError

if TYPE_CHECKING:
    import torch

__all__ = [
    "EMPTY_SHA256",
    "VLLM_CPU_EMPTIED",
    "VLLM_PACKED_MODULES",
    "VLLM_ROW_PARALLEL",
    "VLLM_VOCAB_PADDING",
    "VLLM_VOCAB_PARALLEL",
    "EngineLayout",
    "LayoutError",
    "checker_key",
    "engine_name",
    "iter_rank_tensors",
    "packed_modules",
    "vllm_checker_digests",
    "vllm_cpu_emptied",
    "vllm_rank_digests",
    "vllm_tensors",
]

#: SHA-256 of zero bytes: what vLLM reports for a parameter it emptied (CPU linear weights).
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()

_LLAMA_RULE: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
#: ``packed_modules_mapping`` of vLLM 0.32's model classes, by HF architecture (the fallback
#: when vLLM is not importable): fused module -> its HF parts in stacking order.
VLLM_PACKED_MODULES: dict[str, dict[str, tuple[str, ...]]] = {
    "LlamaForCausalLM": _LLAMA_RULE,
    "MistralForCausalLM": _LLAMA_RULE,
    "Qwen2ForCausalLM": _LLAMA_RULE,
    "Qwen3ForCausalLM": _LLAMA_RULE,
}
#: Row-parallel modules (sharded along the input dimension, dim 1) of those architectures.
VLLM_ROW_PARALLEL: tuple[str, ...] = ("o_proj", "down_proj")
#: Vocabulary-parallel modules (rows padded to :data:`VLLM_VOCAB_PADDING`, then sharded).
VLLM_VOCAB_PARALLEL: tuple[str, ...] = ("embed_tokens", "lm_head")
#: vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``.
VLLM_VOCAB_PADDING = 64
#: Modules whose ``.weight`` vLLM on CPU empties after prepacking (``LinearBase`` layers).
VLLM_CPU_EMPTIED: tuple[str, ...] = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LayoutError(RollsafeError, ValueError):
    """The tensors do not fit the engine layout (a missing part, an unknown architecture, a
    shape that does not divide); the message names the tensor or the field."""


def packed_modules(architecture: str) -> dict[str, tuple[str, ...]]:
    """The stacking rule (fused module -> HF parts in order) of ``architecture``.

    Read from the vLLM model class (``packed_modules_mapping``) when vLLM is importable in this
    interpreter, else from :data:`VLLM_PACKED_MODULES`; :class:`LayoutError` for an
    architecture neither knows.
    """
    rule = _packed_from_vllm(architecture)
    if rule is not None:
        return rule
    if architecture not in VLLM_PACKED_MODULES:
        raise LayoutError(
            f"architecture {architecture!r}: no stacking rule (vLLM is not importable here and "
            f"rollsafe's table covers {sorted(VLLM_PACKED_MODULES)})"
        )
    return dict(VLLM_PACKED_MODULES[architecture])


def _packed_from_vllm(architecture: str) -> dict[str, tuple[str, ...]] | None:
    try:
        registry = importlib.import_module("vllm.model_executor.models.registry")
        module_name, class_name = registry._VLLM_MODELS[architecture]
        module = importlib.import_module(f"vllm.model_executor.models.{module_name}")
        mapping = getattr(module, class_name).packed_modules_mapping
    except Exception:  # vLLM absent, or an architecture/registry it does not have
        return None
    return {str(k): tuple(str(p) for p in v) for k, v in dict(mapping).items()}


@dataclass(frozen=True)
class EngineLayout:
    """How an engine lays out one model: stacking rule, TP size, heads, dtype.

    ``packed``: fused module -> HF parts (:func:`packed_modules`); ``tp_size`` ranks;
    ``num_kv_heads`` (needed when ``tp_size`` > 1); ``dtype``: the engine's parameter dtype
    (``--dtype``; None: the tensors' own); ``tie_word_embeddings`` drops ``lm_head``;
    ``vocab_pad_per_rank``: SGLang's rule, the vocabulary padded to a multiple of
    ``64 * tp_size`` where its padding to 64 does not split evenly over the ranks.
    """

    packed: Mapping[str, tuple[str, ...]]
    tp_size: int = 1
    num_kv_heads: int | None = None
    dtype: torch.dtype | None = None
    tie_word_embeddings: bool = False
    vocab_pad_per_rank: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise LayoutError(f"tp_size must be an int >= 1, got {self.tp_size!r}")
        if self.tp_size > 1 and not self.num_kv_heads:
            raise LayoutError("num_kv_heads is needed to shard q/k/v when tp_size > 1")

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any] | Any,
        *,
        tp_size: int = 1,
        dtype: torch.dtype | None = None,
        engine: str = "vllm",
    ) -> EngineLayout:
        """From an HF config (``config.json`` as a dict, or a ``PretrainedConfig``), for an
        ``engine`` of ``"vllm"`` or ``"sglang"`` (its vocabulary padding)."""
        if engine not in ("vllm", "sglang"):
            raise LayoutError(f"engine must be 'vllm' or 'sglang', got {engine!r}")

        def get(key: str, default: Any = None) -> Any:
            if isinstance(config, Mapping):
                return config.get(key, default)
            return getattr(config, key, default)

        archs = get("architectures") or []
        if not archs:  # a config saved on its own: the causal LM class of its model type
            archs = [a for a in (_causal_lm_of(get("model_type")),) if a]
        if not archs:
            raise LayoutError(
                "config has no 'architectures' (nor a 'model_type' transformers knows) to read "
                "the stacking rule from"
            )
        heads = get("num_key_value_heads") or get("num_attention_heads")
        return cls(
            packed=packed_modules(str(archs[0])),
            tp_size=tp_size,
            num_kv_heads=int(heads) if heads else None,
            dtype=dtype,
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            vocab_pad_per_rank=engine == "sglang",
        )


def _causal_lm_of(model_type: Any) -> str | None:
    """The causal LM class transformers builds for ``model_type`` (what ``AutoModelForCausalLM``
    and so the reference engine instantiate), or None (unknown, or transformers absent)."""
    if not isinstance(model_type, str):
        return None
    try:
        auto = importlib.import_module("transformers.models.auto.modeling_auto")
        name = auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    except Exception:  # transformers absent or reorganised
        return None
    return name if isinstance(name, str) else None


def checker_key(name: str, tp_rank: int = 0, *, dp: int = 0, pp: int = 0, pcp: int = 0) -> str:
    """vLLM's ``/weight_checker`` key: ``"dp0:pp0:pcp0:tp<r>:" + name``."""
    return f"dp{dp}:pp{pp}:pcp{pcp}:tp{tp_rank}:{name}"


def vllm_cpu_emptied(name: str) -> bool:
    """True for an engine parameter vLLM on CPU empties (a linear layer's ``weight``)."""
    module, _, leaf = name.rpartition(".")
    return leaf == "weight" and module.rpartition(".")[2] in VLLM_CPU_EMPTIED


def engine_name(name: str, packed: Mapping[str, tuple[str, ...]]) -> str:
    """The engine parameter the HF tensor ``name`` goes into: its fused parameter for a stacked
    part (``...self_attn.k_proj.weight`` -> ``...self_attn.qkv_proj.weight``), else ``name``."""
    part = _split_part(name, packed)
    return name if part is None else part[0]


def _split_part(name: str, packed: Mapping[str, tuple[str, ...]]) -> tuple[str, str, int] | None:
    """``(fused name, fused module, index)`` when ``name``'s module is a stacked part."""
    prefix, _, leaf = name.rpartition(".")
    head, _, module = prefix.rpartition(".")
    for fused, parts in packed.items():
        if module in parts:
            return (
                f"{head}.{fused}.{leaf}" if head else f"{fused}.{leaf}",
                fused,
                parts.index(module),
            )
    return None


def _chunk(t: torch.Tensor, dim: int, parts: int, index: int, name: str) -> torch.Tensor:
    size = t.shape[dim]
    if size % parts:
        raise LayoutError(f"{name}: dim {dim} of size {size} does not split into {parts} ranks")
    step = size // parts
    return t.narrow(dim, index * step, step)


def _vocab_shard(
    t: torch.Tensor, layout: EngineLayout, rank: int, device: torch.device
) -> torch.Tensor:
    import torch

    rows, tp_size = t.shape[0], layout.tp_size
    pad = VLLM_VOCAB_PADDING
    if layout.vocab_pad_per_rank and (-(-rows // pad) * pad) % tp_size:
        pad *= tp_size  # SGLang: padded to split evenly over the ranks
    padded = -(-rows // pad) * pad
    per = -(-padded // tp_size)
    out = torch.zeros((per, *t.shape[1:]), dtype=t.dtype, device=device)
    start = rank * per
    take = max(0, min(rows, start + per) - start)
    if take:
        out[:take] = t[start : start + take].to(device)
    return out


def vllm_tensors(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    layout: EngineLayout,
    tp_rank: int = 0,
    *,
    device: str | torch.device | None = "cpu",
) -> dict[str, torch.Tensor]:
    """The parameters vLLM (or SGLang) rank ``tp_rank`` holds for these HF-named tensors, on
    ``device`` (the host by default; None: each on its HF tensor's device).

    Stacked parts become their fused parameter (every part must be present: a missing one is a
    :class:`LayoutError` naming it); ``lm_head`` is dropped for tied embeddings.
    """
    import torch

    if not 0 <= tp_rank < layout.tp_size:
        raise LayoutError(f"tp_rank {tp_rank} outside [0, {layout.tp_size})")
    items = dict(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    tp, kv_heads = layout.tp_size, layout.num_kv_heads or 1
    groups: dict[str, dict[int, tuple[str, torch.Tensor]]] = {}
    fused_of: dict[str, str] = {}
    out: dict[str, torch.Tensor] = {}
    where: dict[str, torch.device] = {}
    for name, tensor in items.items():
        t = tensor.detach()
        if layout.dtype is not None:
            t = t.to(layout.dtype)
        where[name] = t.device if device is None else torch.device(device)
        part = _split_part(name, layout.packed)
        if part is not None:
            fused_name, fused, index = part
            groups.setdefault(fused_name, {})[index] = (name, t)
            fused_of[fused_name] = fused
            continue
        module = name.rpartition(".")[0].rpartition(".")[2]
        if module == "lm_head" and layout.tie_word_embeddings:
            continue
        if module in VLLM_VOCAB_PARALLEL:  # padded even with one rank
            t = _vocab_shard(t, layout, tp_rank, where[name])
        elif tp > 1 and module in VLLM_ROW_PARALLEL and name.endswith(".weight"):
            t = _chunk(t, 1, tp, tp_rank, name)
        out[name] = t.to(where[name])
    for fused_name, got in groups.items():
        parts = layout.packed[fused_of[fused_name]]
        missing = [i for i in range(len(parts)) if i not in got]
        if missing:
            have = next(iter(got.values()))[0]
            raise LayoutError(
                f"{fused_name}: HF part(s) {[parts[i] for i in missing]} missing "
                f"(found {have!r}); vLLM stacks {list(parts)}"
            )
        pieces = []
        to = where[got[0][0]]
        for i in range(len(parts)):
            name, t = got[i]
            if tp > 1:
                if parts[i] in ("k_proj", "v_proj") and kv_heads < tp:
                    if tp % kv_heads:
                        raise LayoutError(f"{name}: {kv_heads} KV heads over {tp} ranks")
                    t = _chunk(t, 0, kv_heads, tp_rank // (tp // kv_heads), name)
                else:
                    t = _chunk(t, 0, tp, tp_rank, name)
            pieces.append(t.to(to))
        out[fused_name] = torch.cat(pieces, dim=0)
    return out


def iter_rank_tensors(
    named_tensors: Mapping[str, torch.Tensor],
    layout: EngineLayout,
    tp_rank: int = 0,
    *,
    device: str | torch.device | None = "cpu",
) -> Iterator[dict[str, torch.Tensor]]:
    """:func:`vllm_tensors` one engine parameter at a time (each a ``{name: tensor}`` of one
    entry, or none for a tied ``lm_head``), in the order of the HF names' first parts: what a
    rank holds, built and dropped piece by piece (a whole rank at once would copy the model)."""
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors.items():
        groups.setdefault(engine_name(name, layout.packed), {})[name] = tensor
    for group in groups.values():
        yield vllm_tensors(group, layout, tp_rank, device=device)


def _sha256_hex(t: torch.Tensor) -> str:
    """vLLM's per-parameter digest (:func:`rollsafe.checksum.vllm_digest`, restated here: the
    two units of layer 2 do not import each other): SHA-256 of the contiguous host bytes."""
    import torch

    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return EMPTY_SHA256
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def vllm_rank_digests(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    layout: EngineLayout,
) -> tuple[dict[str, str], ...]:
    """One ``{engine name: sha256 hex}`` per TP rank: what each vLLM worker hashes, if it kept
    the data (CPU empties linear weights; compare with :mod:`rollsafe.digest_check`)."""
    items = dict(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    return tuple(
        {n: _sha256_hex(t) for n, t in vllm_tensors(items, layout, r).items()}
        for r in range(layout.tp_size)
    )


def vllm_checker_digests(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    layout: EngineLayout,
) -> dict[str, str]:
    """The whole ``/weight_checker`` ``checksums`` object vLLM would answer for these weights
    (keys :func:`checker_key`; data-parallel, pipeline and context ranks 0)."""
    ranks = vllm_rank_digests(named_tensors, layout)
    return {checker_key(n, r): d for r, digests in enumerate(ranks) for n, d in digests.items()}

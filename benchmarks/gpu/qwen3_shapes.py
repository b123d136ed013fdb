"""The exact parameter list of Qwen3-4B (398 tensors, ~8.05 GB in bf16), for GPU benchmarks.

Shapes follow ``Qwen/Qwen3-4B``'s config: hidden 2560, 36 layers, intermediate 9728, 32 attention
heads and 8 KV heads of head_dim 128, vocabulary 151936, per-head ``q_norm``/``k_norm``, tied
embeddings (no ``lm_head.weight``). Names are the ``transformers`` ``Qwen3ForCausalLM`` state-dict
keys, so a reference engine started from :func:`qwen3_config` serves exactly these tensors.
Nothing here touches a GPU; :func:`make_weights` builds the tensors where asked.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "QWEN3_4B",
    "make_weights",
    "qwen3_4b_shapes",
    "qwen3_config",
    "total_bytes",
    "write_config_dir",
]

QWEN3_4B: dict[str, Any] = {
    "hidden_size": 2560,
    "num_hidden_layers": 36,
    "intermediate_size": 9728,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}


def qwen3_4b_shapes(num_layers: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every Qwen3-4B parameter (398 of them), in state-dict order."""
    return shapes_from_config(QWEN3_4B, num_layers)


def shapes_from_config(
    c: dict[str, Any], num_layers: int | None = None
) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every parameter of a Qwen3-style config (tied embeddings)."""
    h, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for i in range(c["num_hidden_layers"] if num_layers is None else num_layers):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.self_attn.q_proj.weight", (q, h)),
            (f"{p}.self_attn.k_proj.weight", (kv, h)),
            (f"{p}.self_attn.v_proj.weight", (kv, h)),
            (f"{p}.self_attn.o_proj.weight", (h, q)),
            (f"{p}.self_attn.q_norm.weight", (hd,)),
            (f"{p}.self_attn.k_norm.weight", (hd,)),
            (f"{p}.mlp.gate_proj.weight", (inter, h)),
            (f"{p}.mlp.up_proj.weight", (inter, h)),
            (f"{p}.mlp.down_proj.weight", (h, inter)),
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
        ]
    out.append(("model.norm.weight", (h,)))
    return out


def total_bytes(shapes: list[tuple[str, tuple[int, ...]]], itemsize: int = 2) -> int:
    """Bytes of the tensors of ``shapes`` at ``itemsize`` bytes per element (bf16: 2)."""
    return sum(math.prod(s) for _, s in shapes) * itemsize


def qwen3_config(num_layers: int | None = None) -> dict[str, Any]:
    """A ``config.json`` for ``Qwen3ForCausalLM`` with these shapes (bf16)."""
    c = QWEN3_4B
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"],
        "num_hidden_layers": c["num_hidden_layers"] if num_layers is None else num_layers,
        "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": c["num_key_value_heads"],
        "head_dim": c["head_dim"],
        "vocab_size": c["vocab_size"],
        "tie_word_embeddings": c["tie_word_embeddings"],
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


def write_config_dir(path: str | Path, num_layers: int | None = None) -> Path:
    """Write ``config.json`` (only) into ``path``: enough for ``--load-format dummy``."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    (p / "config.json").write_text(json.dumps(qwen3_config(num_layers), indent=2))
    return p


def make_weights(
    device: str | torch.device = "cuda",
    *,
    seed: int = 1,
    num_layers: int | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Deterministic random tensors of these shapes (bf16 by default) on ``device``."""
    import torch

    dt = dtype or torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in qwen3_4b_shapes(num_layers):
        t = torch.empty(shape, dtype=dt, device=device)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
            t.add_(
                torch.rand(shape, generator=gen, device=device, dtype=torch.float32).to(dt),
                alpha=0.01,
            )
        else:
            t.normal_(0.0, 0.02, generator=gen)
        out[name] = t
    return out

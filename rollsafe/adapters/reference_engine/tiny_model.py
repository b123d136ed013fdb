"""Deterministic tiny Llama checkpoints for tests, benchmarks and the CPU demo.

Owns :func:`make_tiny_model`: a few-MB random ``LlamaForCausalLM`` written with
``save_pretrained`` (``config.json`` + safetensors) plus a byte-level BPE tokenizer trained with
the ``tokenizers`` library on a fixed in-code corpus, and :data:`CHAT_TEMPLATE`, the ChatML-style
chat template written into its ``tokenizer_config.json`` (``chat_template``), so the rollout
gateway's ``/v1/chat/completions`` and any engine's chat endpoint can render conversations.
Nothing is downloaded; the same seed gives byte-identical weights and tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["CHAT_TEMPLATE", "TINY_CORPUS", "make_tiny_model", "make_tokenizer"]

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]

TINY_CORPUS: tuple[str, ...] = (
    "The rollout engine serves tokens while the trainer computes gradients.",
    "A weight update moves the new parameters from the trainer to every engine rank.",
    "When an engine crashes the fleet recovers it from a verified export.",
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "Reinforcement learning from human feedback trains a policy with rewards.",
    "Tensor parallel ranks all gather their logits before sampling the next token.",
    "State machines guard every transition so half recovered groups never get traffic.",
    "Checkpoints are written atomically: temp dir, fsync, rename, fsync parent.",
)


#: ChatML-style: ``<|im_start|>ROLE\nCONTENT<|im_end|>\n`` per message (plain text markers: the
#: tiny vocabulary has no such special tokens), tools listed as JSON in the system turn, an
#: assistant's tool calls as ``<tool_call>{json}</tool_call>`` lines, tool results in ``tool``
#: turns, and ``<|im_start|>assistant\n`` when ``add_generation_prompt``. (transformers renders
#: with ``trim_blocks``: a newline right after a block tag is written ``{{ '\n' }}``.)
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (loop.first and tools and message.role == 'system') %}"
    "<|im_start|>{{ message.role }}\n"
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{% if message.role == 'assistant' and message.tool_calls %}"
    "{% for call in message.tool_calls %}"
    "{% if message.content or not loop.first %}{{ '\\n' }}{% endif %}<tool_call>"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}"
    "</tool_call>{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(vocab_size: int = 512) -> object:
    """Train a deterministic byte-level BPE ``tokenizers.Tokenizer`` of <= ``vocab_size``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(TINY_CORPUS) * 4, trainer=trainer)
    return tok


def make_tiny_model(
    path: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 512,
    max_position_embeddings: int = 1024,
    initializer_range: float = 0.1,
    dtype: str = "float32",
) -> Path:
    """Write a tiny random Llama (HF layout, ``tie_word_embeddings=False``) into ``path``.

    Returns ``path``. The directory loads with ``AutoModelForCausalLM.from_pretrained`` and with
    the reference engine (``--model-path``). Deterministic for a fixed ``seed``.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            # Re-draw every parameter from our own generator so the weights do not depend on
            # transformers' init order; norms stay near 1 so activations stay well scaled.
            for name, p in sorted(model.named_parameters()):
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.05 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(initializer_range * torch.randn(p.shape, generator=gen))
    model = model.to(torch_dtype)
    model.save_pretrained(out)

    tok = make_tokenizer(vocab_size)
    tok.save(str(out / "tokenizer.json"))  # type: ignore[attr-defined]
    tokenizer_cls: Any = PreTrainedTokenizerFast
    fast = tokenizer_cls(
        tokenizer_file=str(out / "tokenizer.json"),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    # into tokenizer_config.json (transformers 5 would write chat_template.jinja beside it)
    fast.save_pretrained(out, save_jinja_files=False)
    (out / "rollsafe-tiny.json").write_text(json.dumps({"seed": seed, "generator": "rollsafe"}))
    return out

"""Tiny BF16 Qwen3 and Qwen3-MoE checkpoints with a word-level tokenizer (``t3``, ``t4``, ...),
saved for verl to load: the verl engine tests' models and the verl sync benchmark's."""

from __future__ import annotations

from pathlib import Path

import torch


def save_model(path: Path, *, moe: bool = False, vocab: int = 48, hidden: int = 32,
               intermediate: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               head_dim: int = 8, positions: int = 64, experts: int = 4,
               moe_intermediate: int = 16) -> None:
    """Save a BF16 Qwen3 (``moe``: Qwen3-MoE, ``experts`` of ``moe_intermediate``, 2 per
    token) made with seed 0, and its tokenizer (``<pad>`` 0, ``<s>`` 1, ``</s>`` 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(0)
    shape = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                 num_hidden_layers=layers, num_attention_heads=heads,
                 num_key_value_heads=kv_heads, head_dim=head_dim,
                 max_position_embeddings=positions, tie_word_embeddings=False, bos_token_id=1,
                 eos_token_id=2, pad_token_id=0)
    if moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, moe_intermediate_size=moe_intermediate,
                                                   num_experts=experts, num_experts_per_tok=2))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**shape))
    model.to(torch.bfloat16).save_pretrained(path)
    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)

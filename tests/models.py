"""Small models shared by the tests."""

from __future__ import annotations

import torch
import torch.nn as nn


class TinyBlockLM(nn.Module):
    """A Llama-style toy LM with the usual projection names (plain PyTorch, no attention)."""

    def __init__(self, vocab=32, hidden=24, inter=40, layers=2, dtype=torch.float32):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden, dtype=dtype)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            block = nn.Module()
            block.q_proj = nn.Linear(hidden, hidden, bias=False, dtype=dtype)
            block.o_proj = nn.Linear(hidden, hidden, bias=False, dtype=dtype)
            block.gate_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
            block.up_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
            block.down_proj = nn.Linear(inter, hidden, bias=False, dtype=dtype)
            block.norm = nn.LayerNorm(hidden, dtype=dtype)
            self.blocks.append(block)
        self.lm_head = nn.Linear(hidden, vocab, bias=False, dtype=dtype)

    def forward(self, ids):
        h = self.embed(ids)
        for b in self.blocks:
            a = b.norm(h)
            h = h + b.o_proj(torch.tanh(b.q_proj(a)))
            h = h + b.down_proj(nn.functional.silu(b.gate_proj(a)) * b.up_proj(a))
        return self.lm_head(h)


def tiny_qwen3(dtype=torch.float32, seed=0, **overrides):
    """transformers' Qwen3ForCausalLM with a tiny random config."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=64, tie_word_embeddings=False)
    config.update(overrides)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**config, attn_implementation="eager"))
    return model.to(dtype)


class TwoLayerNet(nn.Module):
    """``down_proj(norm(tanh(up_proj(x))))``: two targets, a biased one, and a LayerNorm."""

    def __init__(self, d_in: int, hidden: int, d_out: int):
        super().__init__()
        self.up_proj = nn.Linear(d_in, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.down_proj = nn.Linear(hidden, d_out, bias=False)

    def forward(self, x):
        return self.down_proj(self.norm(torch.tanh(self.up_proj(x))))

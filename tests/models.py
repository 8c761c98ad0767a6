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


#: The mixture-of-experts families rgc.wrap covers, as transformers' model_type names.
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "qwen3_5_moe", "mixtral", "olmoe", "deepseek_v3",
                "glm4_moe", "gpt_oss")


def tiny_moe(family="qwen3_moe", dtype=torch.float32, seed=0, *, hidden=32, experts=4,
             expert_inter=16, top_k=2, layers=2, vocab=64, **overrides):
    """A transformers mixture-of-experts causal LM of ``family`` with a tiny random config.

    Every family has ``layers`` decoder layers of ``experts`` routed experts (``top_k`` per
    token) of width ``expert_inter``; DeepSeek-V3 and GLM4-MoE add a dense first layer, Qwen2-
    and Qwen3.5-MoE a shared expert, Qwen3.5-MoE linear-attention layers, gpt-oss its
    transposed experts with biases and sliding-window layers.
    """
    import transformers as tf

    attn = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                tie_word_embeddings=False)
    routed = dict(num_experts_per_tok=top_k)
    if family == "qwen3_moe":
        cls, config = tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
            **attn, head_dim=8, intermediate_size=64, moe_intermediate_size=expert_inter,
            num_experts=experts, **routed, **overrides)
    elif family == "qwen2_moe":
        cls, config = tf.Qwen2MoeForCausalLM, tf.Qwen2MoeConfig(
            **attn, intermediate_size=64, moe_intermediate_size=expert_inter,
            shared_expert_intermediate_size=24, num_experts=experts, **routed, **overrides)
    elif family == "qwen3_5_moe":
        cls, config = tf.Qwen3_5MoeForCausalLM, tf.Qwen3_5MoeTextConfig(
            **attn, head_dim=8, moe_intermediate_size=expert_inter,
            shared_expert_intermediate_size=24, num_experts=experts, **routed,
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
            linear_value_head_dim=8,
            layer_types=(["linear_attention", "full_attention"] * layers)[:layers], **overrides)
    elif family in ("mixtral", "olmoe"):
        cls = tf.MixtralForCausalLM if family == "mixtral" else tf.OlmoeForCausalLM
        make = tf.MixtralConfig if family == "mixtral" else tf.OlmoeConfig
        count = {"num_local_experts" if family == "mixtral" else "num_experts": experts}
        config = make(**attn, intermediate_size=expert_inter, **count, **routed, **overrides)
    elif family in ("deepseek_v3", "glm4_moe"):
        shared = dict(intermediate_size=48, moe_intermediate_size=expert_inter,
                      n_routed_experts=experts, n_shared_experts=1, first_k_dense_replace=1,
                      n_group=2, topk_group=1, **routed)
        if family == "deepseek_v3":
            attn.update(num_hidden_layers=layers + 1, num_key_value_heads=4)
            cls, config = tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(
                **attn, **shared, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
                qk_rope_head_dim=4, v_head_dim=8, **overrides)
        else:
            attn.update(num_hidden_layers=layers + 1)
            cls, config = tf.Glm4MoeForCausalLM, tf.Glm4MoeConfig(**attn, head_dim=8, **shared,
                                                                   **overrides)
    elif family == "gpt_oss":
        cls, config = tf.GptOssForCausalLM, tf.GptOssConfig(
            **attn, head_dim=8, intermediate_size=expert_inter, num_local_experts=experts,
            **routed, sliding_window=16,
            layer_types=(["sliding_attention", "full_attention"] * layers)[:layers],
            **overrides)
    else:
        raise ValueError(f"unknown family {family!r}; one of {MOE_FAMILIES}")
    config.pad_token_id = config.eos_token_id = config.bos_token_id = 0
    torch.manual_seed(seed)
    model = cls(config)
    if family == "gpt_oss":  # its init leaves the router and expert biases at zero
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "bias" in name or "sinks" in name:
                    p.normal_(0, 0.1)
    return model.to(dtype).eval()

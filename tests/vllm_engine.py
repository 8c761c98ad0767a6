"""A tiny Qwen3 checkpoint and vLLM engines for the vLLM integration tests (nothing downloads).

vLLM's CPU attention needs a head size that is a multiple of 32; 2 query heads and 1 key/value
head give tensor parallelism 2 both sharded and replicated heads; 66 tokens give a
vocabulary-parallel embedding whose two shards both hold tokens (64 and 2).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

CHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
PROMPTS = ["0123", "abc", "Zy9", "hello"]
# Deleting an in-process engine tears down vLLM's process-wide parallel groups, which the
# other engines of the process use: they all live until the process exits.
_ENGINES = []


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>", padding_side="left")


def tiny_config(tokenizer, **overrides):
    from transformers import Qwen3Config

    config = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=32, max_position_embeddings=64, tie_word_embeddings=False,
                  pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id)
    config.update(overrides)
    return Qwen3Config(**config)


def save_base(path: Path, dtype: torch.dtype, seed: int = 0, **overrides) -> Path:
    """A random tiny Qwen3 in ``dtype`` and its tokenizer, saved to ``path``."""
    from transformers import Qwen3ForCausalLM

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_config(tokenizer, **overrides)).to(dtype)
    # random norms, so that a norm's update is not the same on every element
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_trainer(path: Path, dtype: torch.dtype):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")


def start_engine(path: Path, dtype: torch.dtype, *, extension: bool = True, **kwargs):
    """A ``vllm.LLM`` on the CPU; in this process unless ``tensor_parallel_size`` > 1."""
    from vllm import LLM

    if kwargs.get("tensor_parallel_size", 1) > 1:
        cores = os.sched_getaffinity(0)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(
            str(c) for c in sorted(cores)[:kwargs["tensor_parallel_size"]]))
    if extension:
        kwargs["worker_extension_cls"] = "rgc.integrations.vllm.RGCWorkerExtension"
    llm = LLM(model=str(path), dtype=str(dtype).removeprefix("torch."), enforce_eager=True,
              max_model_len=64, kv_cache_memory_bytes=16 << 20, seed=0, **kwargs)
    _ENGINES.append(llm)
    return llm


def greedy(llm, prompts=PROMPTS, tokens=6):
    """``[(token ids, logprobs of those tokens)]`` of greedy completions."""
    from vllm import SamplingParams

    outputs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                   logprobs=0, ignore_eos=True),
                           use_tqdm=False)
    result = []
    for out in outputs:
        ids = list(out.outputs[0].token_ids)
        lps = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, ids)]
        result.append((ids, lps))
    return result

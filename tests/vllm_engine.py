"""A tiny Qwen3 checkpoint and vLLM engines for the vLLM integration tests (nothing downloads).

vLLM's CPU attention needs a head size that is a multiple of 32; 2 query heads and 1 key/value
head give tensor parallelism 2 both sharded and replicated heads; 66 tokens give a
vocabulary-parallel embedding whose two shards both hold tokens (64 and 2).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

# vLLM's own log handler would outlive pytest's captured streams (errors at exit)
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
# vLLM reads its settings once per process (after the first engine starts), so they are set
# here for every engine: each of up to two ranks may use every core of this process (vLLM's
# automatic binding wants a NUMA node per rank).
_CORES = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{_CORES}|{_CORES}")

CHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
PROMPTS = ["0123", "abc", "Zy9", "hello"]
DENSE = ("model.embed_tokens.weight", "model.norm.weight",
         "model.layers.0.self_attn.q_norm.weight")
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


def _tiny_fields(tokenizer) -> dict:
    """The config fields the tiny dense and mixture-of-experts Qwen3s share."""
    return dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                head_dim=32, max_position_embeddings=64, tie_word_embeddings=False,
                pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id)


def tiny_config(tokenizer, **overrides):
    from transformers import Qwen3Config

    return Qwen3Config(**{**_tiny_fields(tokenizer), **overrides})


def _save(path: Path, model, tokenizer) -> Path:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


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
    return _save(path, model, tokenizer)


def load_trainer(path: Path, dtype: torch.dtype):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")


def tiny_moe_config(tokenizer, **overrides):
    """A tiny Qwen3-MoE: 4 experts of width 32 (vLLM's CPU MoE kernels want the hidden and
    expert widths to be multiples of 32, else they pad the experts), 2 per token."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**_tiny_fields(tokenizer), "moe_intermediate_size": 32,
                             "num_experts": 4, "num_experts_per_tok": 2, **overrides})


def save_moe_base(path: Path, dtype: torch.dtype, seed: int = 0, **overrides) -> Path:
    """A random tiny Qwen3-MoE in ``dtype`` and its tokenizer, saved to ``path``."""
    from transformers import Qwen3MoeForCausalLM

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_moe_config(tokenizer, **overrides)).to(dtype)
    return _save(path, model, tokenizer)


def load_moe_trainer(path: Path, dtype: torch.dtype):
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")


def _expert_group_for(path: Path) -> None:
    """Before an in-process engine of a mixture-of-experts checkpoint: vLLM makes its process-
    wide parallel groups with the first engine of the process, and the expert-parallel group
    only if that model has experts; a later MoE engine would find none. Make it (one rank)."""
    import json

    from vllm.distributed import parallel_state as ps

    config = json.loads((Path(path) / "config.json").read_text())
    if not any(config.get(k) for k in ("num_experts", "num_local_experts")):
        return
    if ps.model_parallel_is_initialized() and ps._EP is None:
        world = ps.get_world_group()
        ps._EP = ps.init_model_parallel_group(
            [[0]], world.local_rank, torch.distributed.get_backend(world.device_group),
            group_name="ep")


def start_engine(path: Path, dtype: torch.dtype, *, extension: bool = True, **kwargs):
    """A ``vllm.LLM`` on the CPU; with ``tensor_parallel_size`` > 1 one worker process per
    rank. The engine runs in this process if it is the first one of the process and has one
    rank (vLLM then keeps that setting for the process)."""
    from vllm import LLM

    tp = kwargs.get("tensor_parallel_size", 1)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if tp > 1 else "0"
    if tp == 1:
        _expert_group_for(path)
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


def make_trainer(base: Path, dtype: torch.dtype, opt_name: str, *, chunk_rows: int = 24,
                 load=load_trainer, dense=DENSE):
    """The trainer: the checkpoint (read by ``load``) wrapped by rgc, the ``dense`` tensors
    trained as well."""
    import rgc

    model = load(base, dtype)
    rgc.wrap(model, rank=8, seed=3, preset="rgc" if opt_name == "rgc" else "logra")
    for name in dense:
        model.get_parameter(name).requires_grad_(True)
    if opt_name == "rgc":
        opt = rgc.RGCOptimizer(model.parameters(), lr=3e-2, chunk_rows=chunk_rows,
                               keep_updates=True)
    else:
        opt = rgc.RowAdam(model.parameters(), lr=1e-2, weight_decay=0.1, chunk_rows=chunk_rows,
                          keep_updates=True)
    return model, opt


def train_step(model, opt, step: int) -> None:
    ids = torch.randint(4, model.config.vocab_size, (4, 12),
                        generator=torch.Generator().manual_seed(step))
    opt.zero_grad()
    model(ids, labels=ids).loss.backward()
    opt.step()


@torch.no_grad()
def assert_generations_match_trainer(model, base: Path, generations, tol: float) -> None:
    """The engine's greedy completions under the trainer model: each token's logprob agrees
    to ``tol`` (the engine's kernels differ from transformers'), and each token is the
    trainer's argmax unless the trainer's top two logits are closer than ``tol``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    for prompt, (ids, lps) in zip(PROMPTS, generations, strict=True):
        prompt_ids = tokenizer(prompt)["input_ids"]
        logits = model(torch.tensor([prompt_ids + ids[:-1]])).logits[0, len(prompt_ids) - 1:]
        logp = torch.log_softmax(logits.float(), -1)
        for i, (t, lp) in enumerate(zip(ids, lps, strict=True)):
            assert abs(logp[i, t].item() - lp) < tol, (prompt, i, logp[i, t].item(), lp)
            top2 = logits[i].float().topk(2).values
            assert t == int(logits[i].argmax()) or (top2[0] - top2[1]).item() < tol


def assert_step_order_refusals_then_resync(llm, model, opt, other_base, unchanged,
                                           assert_engine_equals) -> None:
    """After the engine applied step 1: a payload that skips a step, and one sent to an engine
    on ``other_base`` weights, are refused with the engine unchanged (``unchanged(call, error,
    match)`` checks that); ``push_weights`` with the step number resyncs, and the next payload
    applies."""
    from rgc.integrations.vllm import push_update, push_weights

    train_step(model, opt, 2)
    train_step(model, opt, 3)
    skipped = opt.export_update(model)  # step 3; the engine applied step 1
    unchanged(lambda: push_update(llm, skipped), ValueError, "wrong step order")
    push_weights(llm, other_base)  # another base, any next step
    unchanged(lambda: push_update(llm, skipped), ValueError, "fingerprint mismatch")
    push_weights(llm, model, step=3)  # the resync the errors ask for
    train_step(model, opt, 4)
    push_update(llm, opt.export_update(model))
    assert_engine_equals(llm, model, "after the resync and step 4")

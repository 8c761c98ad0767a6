"""The policy model (a small random Qwen3) and its supervised warm start, cached on disk."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from grpo.task import EOS, MAX_ANSWER_LEN, PAD, PROMPT_LEN, VOCAB_SIZE, answer_ids, prompt_ids
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

import rgc.compute


@dataclass(frozen=True)
class ModelConfig:
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 384

    def build(self, seed: int, dtype=torch.bfloat16) -> Qwen3ForCausalLM:
        """A Qwen3ForCausalLM with random weights drawn from ``seed``, in ``dtype``."""
        config = Qwen3Config(
            vocab_size=VOCAB_SIZE, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, head_dim=self.hidden // self.heads,
            max_position_embeddings=PROMPT_LEN + MAX_ANSWER_LEN, tie_word_embeddings=False,
            pad_token_id=PAD, bos_token_id=1, eos_token_id=2, attn_implementation="eager")
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(config).to(dtype).eval()


@dataclass(frozen=True)
class WarmStart:
    """Supervised warm start with dense AdamW (FP32), stopped once the base is good enough.

    Trains on the training questions at a constant ``lr`` (after a linear warm-up) and stops at
    the first check where greedy dev accuracy reaches ``target_dev`` (or after ``max_steps``):
    a base clearly below the ceiling, so that the GRPO methods have room to differ.
    """
    max_steps: int = 3000
    target_dev: float = 0.4
    check_every: int = 50
    batch: int = 64
    lr: float = 2e-3
    warmup: int = 50


def answer_logprobs(model, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """(n, T) FP32 log-probabilities of ``responses`` (n, T) after ``prompts`` (n, L)."""
    tokens = torch.cat([prompts, responses], dim=1)
    logits = model(input_ids=tokens).logits[:, prompts.shape[1] - 1:-1].float()
    return torch.gather(F.log_softmax(logits, dim=-1), 2, responses[..., None])[..., 0]


def response_mask(responses: torch.Tensor) -> torch.Tensor:
    """(n, T) FP32: 1 for tokens up to and including the first end token, else 0."""
    ended_before = torch.cumsum((responses == EOS).to(torch.int64), dim=1) - (
        responses == EOS).to(torch.int64)
    return (ended_before == 0).to(torch.float32)


def warm_start(model_config: ModelConfig, warm: WarmStart, train, dev, seed: int,
               cache_dir: Path, progress: bool = True,
               compute: rgc.compute.ComputeMode | None = None) -> tuple[dict, Path]:
    """The base policy's BF16 state_dict, trained once and then loaded from ``cache_dir``.

    Training is in FP32; the dev checks decode the BF16 copy in the ``compute`` mode (the
    GRPO phase's). The cache key hashes every setting that changes the result (model, warm
    start, seed, questions, torch/transformers versions, and the compute mode if not native).
    """
    settings = {"model": asdict(model_config), "warm": asdict(warm), "seed": seed,
                "train": [(q.a, q.b, q.op) for q in train],
                "dev": [(q.a, q.b, q.op) for q in dev],
                "torch": torch.__version__, "transformers": transformers.__version__}
    if compute is not None and compute.dtype is not None:
        settings["compute"] = compute.name
    key = json.dumps(settings, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"base-{digest}.safetensors"
    if path.exists():
        return load_file(path), path

    from grpo.rollout import accuracy
    from tqdm import tqdm

    model = model_config.build(seed, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=warm.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm.warmup))
    gen = torch.Generator().manual_seed(seed)
    prompts_all, answers_all = prompt_ids(train), answer_ids(train)
    bar = tqdm(range(1, warm.max_steps + 1), desc="warm start (dense AdamW, SFT)",
               disable=not progress, leave=False)
    for step in bar:
        idx = torch.randint(len(train), (warm.batch,), generator=gen)
        answers = answers_all[idx]
        mask = (answers != PAD).to(torch.float32)
        loss = -(answer_logprobs(model, prompts_all[idx], answers) * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % warm.check_every == 0:
            # Greedy decoding of the BF16 copy: the base exactly as GRPO will start from it.
            state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
            base = model_config.build(seed)
            base.load_state_dict(state)
            rgc.compute.use_compute_dtype(base, compute)
            dev_acc = float(accuracy(base, dev).mean())
            bar.set_postfix(loss=f"{loss.item():.3f}", dev=f"{dev_acc:.3f}")
            if dev_acc >= warm.target_dev:
                break
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, path, metadata={"warm_start_steps": str(step)})
    return state, path

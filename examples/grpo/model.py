"""The policy model (a small random Qwen3 or Qwen3-MoE) and its warm start, cached on disk."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
import transformers
from grpo.task import EOS, MAX_ANSWER_LEN, PAD, PROMPT_LEN, VOCAB_SIZE, answer_ids, prompt_ids
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import rgc.compute


@dataclass(frozen=True)
class ModelConfig:
    """A small Qwen3: ``intermediate`` is the width of each layer's MLP."""
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 384

    model_class: ClassVar[type] = Qwen3ForCausalLM

    def hf_config(self) -> transformers.PretrainedConfig:
        return Qwen3Config(**self._shared())

    def _shared(self) -> dict:
        return dict(
            vocab_size=VOCAB_SIZE, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, head_dim=self.hidden // self.heads,
            max_position_embeddings=PROMPT_LEN + MAX_ANSWER_LEN, tie_word_embeddings=False,
            pad_token_id=PAD, bos_token_id=1, eos_token_id=2, attn_implementation="eager")

    def describe(self) -> str:
        return f"Qwen3, {self._attention()}, MLP {self.intermediate}"

    def _attention(self) -> str:
        return (f"hidden {self.hidden}, {self.layers} layers, {self.heads} query / "
                f"{self.kv_heads} key-value heads")

    def build(self, seed: int, dtype=torch.bfloat16) -> transformers.PreTrainedModel:
        """A causal LM of this config with random weights drawn from ``seed``, in ``dtype``."""
        config = self.hf_config()
        torch.manual_seed(seed)
        return self.model_class(config).to(dtype).eval()


@dataclass(frozen=True)
class MoEConfig(ModelConfig):
    """A small Qwen3-MoE: every layer's MLP is ``experts`` experts of width ``intermediate``,
    ``top_k`` of them per token (weights renormalised over the chosen), and a router; no
    shared expert. Expert weights are transformers' 3-D stacks ``mlp.experts.gate_up_proj``
    [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I]."""
    intermediate: int = 192
    experts: int = 8
    top_k: int = 2

    model_class: ClassVar[type] = Qwen3MoeForCausalLM

    def hf_config(self) -> transformers.PretrainedConfig:
        return Qwen3MoeConfig(**self._shared(), moe_intermediate_size=self.intermediate,
                              num_experts=self.experts, num_experts_per_tok=self.top_k,
                              norm_topk_prob=True)

    def describe(self) -> str:
        return (f"Qwen3-MoE, {self._attention()}, {self.experts} experts of width "
                f"{self.intermediate} per layer, top {self.top_k}")


@dataclass(frozen=True)
class WarmStart:
    """Supervised warm start with dense AdamW (FP32), stopped once the base is good enough.

    Trains on the training questions at a constant ``lr`` (after a linear warm-up) and stops at
    the first check where greedy dev accuracy reaches ``target_dev``: a base clearly below the
    ceiling, so that the GRPO methods have room to differ. ``max_steps`` is a cap, not a
    stopping rule: a warm start that reaches it below the target raises
    :class:`WarmStartError` and saves nothing, so GRPO never starts from a broken base.
    """
    max_steps: int = 3000
    target_dev: float = 0.4
    check_every: int = 50
    batch: int = 64
    lr: float = 2e-3
    warmup: int = 50

    def __post_init__(self):
        if self.max_steps < 1 or self.check_every < 1 or not 0.0 <= self.target_dev <= 1.0:
            raise ValueError(f"WarmStart needs max_steps >= 1, check_every >= 1 and target_dev "
                             f"in [0, 1], got {self.max_steps}, {self.check_every}, "
                             f"{self.target_dev}")


class WarmStartError(RuntimeError):
    """The warm start reached its step cap with dev accuracy below its target."""


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
               compute: rgc.compute.ComputeMode | None = None) -> tuple[dict, Path, dict]:
    """The base policy's BF16 state_dict, its file, and how it was made (steps, dev accuracy).

    Trained once, then loaded from ``cache_dir``. Training is in FP32; the dev checks decode
    the BF16 copy in the ``compute`` mode (the GRPO phase's). The cache key hashes every
    setting that changes the result (model, warm start, seed, questions, torch/transformers
    versions, and the compute mode if not native). Raises :class:`WarmStartError` if
    ``warm.max_steps`` pass without a dev check reaching ``warm.target_dev``, or if a cached
    file records a dev accuracy below it.
    """
    settings = {"model": asdict(model_config), "warm": asdict(warm), "seed": seed,
                "train": [(q.a, q.b, q.op) for q in train],
                "dev": [(q.a, q.b, q.op) for q in dev],
                "torch": torch.__version__, "transformers": transformers.__version__,
                "format": 2}  # 2: the file records its dev accuracy, checked on load
    if compute is not None and compute.dtype is not None:
        settings["compute"] = compute.name
    key = json.dumps(settings, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"base-{digest}.safetensors"
    if path.exists():
        with safe_open(path, "pt") as f:
            info = {k: float(v) for k, v in f.metadata().items()}
        if info["dev_accuracy"] < warm.target_dev:
            raise WarmStartError(f"the cached base policy {path} records dev accuracy "
                                 f"{info['dev_accuracy']:.3f}, below the target "
                                 f"{warm.target_dev:.3f}; delete it and rerun")
        return load_file(path), path, info

    from grpo.rollout import accuracy
    from tqdm import tqdm

    model = model_config.build(seed, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=warm.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm.warmup))
    gen = torch.Generator().manual_seed(seed)
    prompts_all, answers_all = prompt_ids(train), answer_ids(train)
    checks = []  # (step, dev accuracy, loss)
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
        if step % warm.check_every == 0 or step == warm.max_steps:
            # Greedy decoding of the BF16 copy: the base exactly as GRPO will start from it.
            state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
            base = model_config.build(seed)
            base.load_state_dict(state)
            rgc.compute.use_compute_dtype(base, compute)
            checks.append((step, float(accuracy(base, dev).mean()), loss.item()))
            bar.set_postfix(loss=f"{checks[-1][2]:.3f}", dev=f"{checks[-1][1]:.3f}")
            if checks[-1][1] >= warm.target_dev:
                break
    if not checks or checks[-1][1] < warm.target_dev:
        raise WarmStartError(_not_reached(warm, seed, checks))
    info = {"warm_start_steps": float(step), "dev_accuracy": checks[-1][1]}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, path, metadata={k: repr(v) for k, v in info.items()})
    return state, path, info


def _not_reached(warm: WarmStart, seed: int, checks: list[tuple[int, float, float]]) -> str:
    best = max(checks, key=lambda c: c[1], default=(0, float("nan"), float("nan")))
    last = checks[-1] if checks else best
    return (f"the warm start (seed {seed}) ran its cap of {warm.max_steps} steps without "
            f"reaching the dev accuracy target {warm.target_dev:.3f}: best {best[1]:.3f} at "
            f"step {best[0]}, last {last[1]:.3f} (training loss {last[2]:.3f}); no base policy "
            "was saved and GRPO did not start. Try another base seed (--base-seed), or in "
            "the preset a larger WarmStart.max_steps, a smaller WarmStart.lr (a loss that "
            "stalls or rises) or a lower target_dev.")

"""TRL's GRPOTrainer with ``use_vllm=True`` (colocate) syncs its vLLM engine with rgc payloads.

TRL builds the engine in this process on the CPU, for a dense Qwen3 and for a Qwen3-MoE whose
expert stacks rgc sketches. After training, the engine's weights equal the trainer's bit for
bit, one full sync and then only payloads were sent, and the completions TRL sampled from the
engine scored like the trainer model's (TRL logs the difference).
"""

from __future__ import annotations

import pytest
import torch

import tests.vllm_engine  # noqa: F401  (before vLLM: its logging set-up)

pytest.importorskip("vllm")
pytest.importorskip("trl")

import rgc  # noqa: E402
from rgc.integrations import with_rgc  # noqa: E402
from rgc.integrations.vllm import read_weights  # noqa: E402
from tests.vllm_engine import (  # noqa: E402
    CHARS,
    _expert_group_for,
    load_moe_trainer,
    load_trainer,
    save_base,
    save_moe_base,
)

STEPS = 4


def reward_digits(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_grpo_colocate_sends_payloads(tmp_path, monkeypatch, moe):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default is sized for servers
    save, load = (save_moe_base, load_moe_trainer) if moe else (save_base, load_trainer)
    base = save(tmp_path / "base", torch.bfloat16)
    model = load(base, torch.bfloat16)
    rgc.wrap(model, rank=8, seed=1)
    sketched = len(rgc.sketched_weights(model))
    assert sketched == (2 * (4 + 2) if moe else 2 * 7)  # MoE: attention and two stacks
    _expert_group_for(base)  # TRL's engine may not be the process's first
    prompts = [CHARS[i:i + 5] for i in range(0, 40, 5)]
    config = GRPOConfig(
        output_dir=str(tmp_path / "run"), max_steps=STEPS, per_device_train_batch_size=8,
        num_generations=4, max_completion_length=6, learning_rate=2e-2, beta=0.0,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, bf16=False, disable_tqdm=True, seed=0, use_vllm=True,
        vllm_mode="colocate", vllm_max_model_length=64, vllm_gpu_memory_utilization=0.1)
    trainer = with_rgc(GRPOTrainer)(
        model=model, args=config, reward_funcs=reward_digits,
        processing_class=AutoTokenizer.from_pretrained(base),
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        rgc_optimizer=lambda params: rgc.RGCOptimizer(params, lr=2e-2))
    assert trainer.rgc_vllm is not None and trainer.rgc_vllm.active
    trainer.train()
    trainer.vllm_generation.sync_weights()  # the last step's payload (TRL syncs before generating)

    stats = trainer.rgc_vllm.stats
    assert stats["full_syncs"] == 1 and stats["payloads"] == STEPS
    assert stats["payload_bytes"] / STEPS < stats["full_bytes"] / 2
    engine = read_weights(trainer.vllm_generation.llm, [n for n, _ in model.named_parameters()])
    start = dict(load(base, torch.bfloat16).named_parameters())
    moved = 0
    for name, p in model.named_parameters():
        assert torch.equal(engine[name].reshape(p.shape), p.detach()), name
        moved += not torch.equal(p.detach(), start[name])
    assert moved == sketched
    logs = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/max" in h]
    assert len(logs) == STEPS
    assert max(h["sampling/sampling_logp_difference/max"] for h in logs) < 0.1

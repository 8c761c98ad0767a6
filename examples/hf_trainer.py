"""Supervised fine-tuning with transformers' Trainer and rgc, on CPU, nothing downloaded.

A tiny random BF16 Qwen3 learns to continue digit sequences that count up modulo 10
("3 4 5 6 ..."). ``with_rgc(Trainer)`` builds the optimizer itself (``create_optimizer``, the
path FSDP needs): ``RGCOptimizer`` with ``lr = rgc.calibrate_lr(model, args.learning_rate)``;
the logged ``grad_norm`` is the norm of the sketched gradient estimate. The checkpoints the
Trainer writes are plain Qwen3 checkpoints.

    python examples/hf_trainer.py               # 30 steps
    python examples/hf_trainer.py --steps 100
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Trainer, TrainingArguments

import rgc
from rgc.integrations import with_rgc

VOCAB, SEQ = 16, 16  # tokens 0-9 are digits


def counting_data(n: int, seed: int) -> list[dict]:
    """``n`` sequences ``s, s+1, ...`` (mod 10) from random starts; labels = inputs."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 10, (n, 1), generator=gen)
    ids = (starts + torch.arange(SEQ)) % 10
    return [{"input_ids": row, "labels": row} for row in ids]


@torch.no_grad()
def mean_loss(model, data: list[dict]) -> float:
    ids = torch.stack([d["input_ids"] for d in data])
    return float(model(input_ids=ids, labels=ids).loss)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--adamw-lr", type=float, default=3e-3,
                        help="learning_rate; RGC's tau is calibrated from it")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="default: a temporary directory")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="rgc_hf_trainer_"))

    torch.manual_seed(args.seed)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=SEQ, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    rgc.wrap(model, rank=args.rank, seed=args.seed)

    train, held_out = counting_data(256, args.seed), counting_data(32, args.seed + 1)
    before = mean_loss(model, held_out)
    training_args = TrainingArguments(
        output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=8,
        learning_rate=args.adamw_lr, lr_scheduler_type="cosine", max_grad_norm=0.0,
        logging_steps=5, save_strategy="steps", save_steps=args.steps, report_to="none",
        use_cpu=True, seed=args.seed, disable_tqdm=True)
    trainer = with_rgc(Trainer)(model=model, args=training_args, train_dataset=train)
    trainer.train()

    after = mean_loss(model, held_out)
    checkpoint = out / f"checkpoint-{args.steps}"
    grad_norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    print(f"held-out loss {before:.3f} -> {after:.3f}; tau = {trainer.optimizer.defaults['lr']:.3g}"
          f"; grad_norm {grad_norms[0]:.3g} -> {grad_norms[-1]:.3g}; checkpoint: {checkpoint}")
    return {"loss_before": before, "loss_after": after, "grad_norms": grad_norms,
            "checkpoint": str(checkpoint), "model": model}


if __name__ == "__main__":
    main()

"""GRPO with TRL's GRPOTrainer and rgc: RowAdam + predicted-KL step control, a reference model.

Runs on a CPU in about a minute with nothing downloaded: a tiny random Qwen3 and a character
tokenizer are built and saved locally (the reference model is loaded from that directory, as
TRL does for a model given by path), and the reward is a program: the fraction of digits
(rather than letters) in the completion. The script prints the probability that a completion
starts with a digit before and after training, and saves a checkpoint that loads without rgc.

    python examples/trl_grpo.py                # 12 steps, RowAdam + PredictedKL
    python examples/trl_grpo.py --optimizer rgc  # RGCOptimizer instead
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
from trl import GRPOConfig, GRPOTrainer

import rgc
from rgc.integrations import with_rgc

CHARS = "0123456789abcdefghij"
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over :data:`CHARS`, built in memory."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>", padding_side="left")


def build_base(path: Path, seed: int) -> None:
    """Save a tiny random BF16 Qwen3 and its tokenizer to ``path``."""
    tokenizer = build_tokenizer()
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=64, tie_word_embeddings=False,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)


def reward_digits(completions, **kwargs) -> list[float]:
    """Fraction of digits in each completion (a verifiable, programmatic reward)."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


@torch.no_grad()
def first_token_digit_prob(model, tokenizer, prompts) -> float:
    """Mean probability that the completion of each prompt starts with a digit."""
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    probs = torch.softmax(model(**batch).logits[:, -1].float(), -1)
    return float(probs[:, tokenizer.convert_tokens_to_ids(list("0123456789"))].sum(-1).mean())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--optimizer", choices=["rowadam", "rgc"], default="rowadam")
    parser.add_argument("--lr", type=float, default=None,
                        help="RowAdam: Adam's lr (default 2e-2); rgc: tau (default 2e-2)")
    parser.add_argument("--kl-budget", type=float, default=5e-3,
                        help="PredictedKL budget per step (RowAdam only)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="default: a temporary directory")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="rgc_trl_grpo_"))
    base = out / "base"
    build_base(base, args.seed)

    tokenizer = PreTrainedTokenizerFast.from_pretrained(base)
    model = Qwen3ForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    rgc.wrap(model, rank=args.rank, seed=args.seed)

    rng = random.Random(args.seed)
    prompts = ["".join(rng.choice(CHARS) for _ in range(6)) for _ in range(64)]
    probe = prompts[:16]
    before = first_token_digit_prob(model, tokenizer, probe)

    lr = args.lr if args.lr is not None else 2e-2
    if args.optimizer == "rowadam":
        def make_optimizer(params):
            return rgc.RowAdam(params, lr=lr, step_control=rgc.PredictedKL(budget=args.kl_budget,
                                                                           max_scale=1.0))
    else:
        def make_optimizer(params):
            return rgc.RGCOptimizer(params, lr=lr)

    config = GRPOConfig(
        output_dir=str(out / "run"), max_steps=args.steps, per_device_train_batch_size=8,
        num_generations=4, max_completion_length=6, temperature=1.0, beta=0.02,
        learning_rate=lr, lr_scheduler_type="constant", max_grad_norm=1.0, logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=True, seed=args.seed, bf16=False,
        disable_tqdm=True)
    trainer = with_rgc(GRPOTrainer)(
        model=model, args=config, reward_funcs=reward_digits, processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": prompts}), rgc_optimizer=make_optimizer)
    assert trainer.ref_model is not None  # beta > 0: TRL loaded the reference from `base`
    trainer.train()

    after = first_token_digit_prob(model, tokenizer, probe)
    trainer.save_model(str(out / "final"))  # the plain Qwen3 checkpoint (same keys)
    logs = [h for h in trainer.state.log_history if "reward" in h]
    result = {"p_digit_before": before, "p_digit_after": after, "reward_first": logs[0]["reward"],
              "reward_last": logs[-1]["reward"], "grad_norm_last": logs[-1]["grad_norm"],
              "out": str(out / "final")}
    control = trainer.optimizer.optimizer.step_control if args.optimizer == "rowadam" else None
    if control is not None:
        result["alpha_last"] = control.last["alpha"]
    print(f"P(completion starts with a digit): {before:.3f} -> {after:.3f}; reward "
          f"{result['reward_first']:.3f} -> {result['reward_last']:.3f}; checkpoint: "
          f"{result['out']}")
    return result


if __name__ == "__main__":
    main()

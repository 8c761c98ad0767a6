"""How to normalise the RGC update of a stack of experts: the whole stack, or each expert.

A tiny Qwen3-MoE policy (BF16, E experts, top-k routing) learns next-token prediction on a fixed
synthetic language (a random first-order Markov chain over the vocabulary, so the loss has a
known floor: the chain's entropy rate) with ``RGCOptimizer`` at the same tau under both rules of
``expert_norm``:

* ``stack``: ``W <- W - tau ||W|| H / ||H||`` with the norms of the whole [E, d, k] tensor;
* ``expert``: each expert ``e`` by its own ``||W_e|| / ||H_e||``.

Reported per rule and seed: the held-out loss after N steps (minus the chain's entropy rate),
and the spread of the relative update size over experts (how much an expert that saw few tokens
moved compared with a busy one).

    python benchmarks/moe_expert_norm.py [--steps 150] [--seeds 0 1 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import rgc  # noqa: E402
from benchmarks.common import write_results  # noqa: E402

VOCAB = 48


def markov_chain(seed: int) -> tuple[torch.Tensor, float]:
    """A random transition matrix (rows of uniform draws raised to the power 1/0.3, normalised:
    peaked rows) and its entropy rate in nats."""
    g = torch.Generator().manual_seed(1000 + seed)
    weights = torch.rand(VOCAB, VOCAB, generator=g, dtype=torch.float64) ** (1 / 0.3)
    probs = weights / weights.sum(1, keepdim=True)
    # stationary distribution by power iteration
    pi = torch.full((VOCAB,), 1.0 / VOCAB, dtype=torch.float64)
    for _ in range(500):
        pi = pi @ probs
    entropy = float(-(pi[:, None] * probs * probs.clamp_min(1e-300).log()).sum())
    return probs, entropy


def sample(probs: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    ids = torch.empty(batch, length, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (batch,), generator=gen)
    for t in range(1, length):
        ids[:, t] = torch.multinomial(probs[ids[:, t - 1]].float(), 1, generator=gen)[:, 0]
    return ids


def tiny_moe(seed: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, max_position_embeddings=64, tie_word_embeddings=False,
                            attn_implementation="eager")
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config).to(torch.bfloat16)


def run(rule: str, seed: int, steps: int, tau_scale: float, batch: int) -> dict:
    probs, entropy = markov_chain(seed)
    model = tiny_moe(seed)
    rgc.wrap(model, rank=8, seed=seed)
    tau = tau_scale * rgc.calibrate_lr(model, adamw_lr=1e-3)
    opt = rgc.RGCOptimizer(model.parameters(), lr=tau, expert_norm=rule, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    held_out = sample(probs, 32, 24, torch.Generator().manual_seed(10_000 + seed))
    experts = [p for n, p in model.named_parameters() if p.dim() == 3]
    moves = []
    for _ in range(steps):
        ids = sample(probs, batch, 24, gen)
        before = [p.detach().float().clone() for p in experts]
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        for p, b in zip(experts, before, strict=True):
            step = (p.detach().float() - b).flatten(1).norm(dim=1) / b.flatten(1).norm(dim=1)
            moves.extend(step.tolist())
    with torch.no_grad():
        loss = float(model(input_ids=held_out, labels=held_out).loss)
    moved = [m for m in moves if m > 0]
    return dict(rule=rule, seed=seed, batch=batch, steps=steps, tau=tau, held_out_loss=loss,
                excess_over_entropy=loss - entropy,
                expert_step_p10=statistics.quantiles(moved, n=10)[0] if moved else 0.0,
                expert_step_p90=statistics.quantiles(moved, n=10)[-1] if moved else 0.0)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tau-scale", type=float, default=1.0)
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 2],
                        help="sequences of 24 tokens per step (2: some experts see few tokens)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [run(rule, seed, args.steps, args.tau_scale, batch) for batch in args.batches
            for seed in args.seeds for rule in ("stack", "expert")]
    by_rule = {(rule, b): [r["excess_over_entropy"] for r in rows
                           if r["rule"] == rule and r["batch"] == b]
               for b in args.batches for rule in ("stack", "expert")}
    notes = (f"Tiny Qwen3-MoE (8 experts, top-2, hidden 64, BF16), RGC r=8, tau = "
             f"{args.tau_scale} x calibrate_lr(adamw_lr=1e-3), {args.steps} steps of "
             "(batch) x 24 tokens from a random Markov chain; held-out loss on 32 x 24 "
             "tokens, minus the chain's entropy rate (the floor). expert_step_p10/p90: the "
             "10th and 90th percentiles over experts and steps of ||dW_e|| / ||W_e|| "
             "(updated experts only). "
             "Mean excess: " + ", ".join(
                 f"{rule} at batch {b}: {statistics.mean(v):.4f} (seeds "
                 f"{', '.join(f'{x:.4f}' for x in v)})" for (rule, b), v in by_rule.items()) + ".")
    kwargs = {} if args.out is None else dict(directory=args.out)
    write_results("moe_expert_norm", rows, title="RGC on a stack of experts: stack vs "
                  "per-expert normalisation", notes=notes, **kwargs)
    return rows


if __name__ == "__main__":
    main()

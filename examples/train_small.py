"""A small end-to-end run: a tiny Qwen3 learns a counting task with RGC, beside dense AdamW.

Prints each method's loss curve and the optimizer-related memory it keeps (exact byte counts of
the tensors each method holds for training, on top of the BF16 weights). On a CPU without fast
BF16 matmuls both models compute in FP32 on their BF16 weights (``rgc.compute``; the line
"compute mode" says which was chosen).
Usage: python examples/train_small.py [--steps 40] [--rank 8]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import rgc


def make_model(seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=192,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=64, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    return Qwen3ForCausalLM(config).to(torch.bfloat16)


def counting_batch(n: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    start = torch.randint(0, vocab, (n, 1), generator=torch.Generator().manual_seed(seed))
    stride = torch.randint(1, 4, (n, 1), generator=torch.Generator().manual_seed(seed + 1))
    return (start + stride * torch.arange(length)) % vocab


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def run_rgc(steps: int, rank: int, data: torch.Tensor,
            mode: rgc.compute.ComputeMode) -> tuple[list[float], int]:
    model = make_model(seed=0)
    rgc.wrap(model, rank=rank, seed=0)
    rgc.compute.use_compute_dtype(model, mode)
    # tau matched to a first AdamW step at 1e-3 (3x that oscillates on this task).
    tau = rgc.calibrate_lr(model, adamw_lr=1e-3)
    opt = rgc.RGCOptimizer(model.parameters(), lr=tau)
    losses = []
    for _ in range(steps):
        loss = model(data, labels=data).loss
        loss.backward()
        state = nbytes(m.sketch for _, m in rgc.compressed_layers(model))
        state += nbytes(m.projection for _, m in rgc.compressed_layers(model))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, state


def run_adamw(steps: int, data: torch.Tensor,
              mode: rgc.compute.ComputeMode) -> tuple[list[float], int]:
    model = make_model(seed=0)
    rgc.compute.use_compute_dtype(model, mode)
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    params = [p for n, p in model.named_parameters() if n.rsplit(".", 2)[-2] in names]
    for p in model.parameters():
        p.requires_grad_(False)
    master = [p.detach().float().requires_grad_(True) for p in params]  # FP32 master copy
    opt = torch.optim.AdamW(master, lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        for p, m in zip(params, master):
            p.requires_grad_(True)
            p.data.copy_(m.detach())
        loss = model(data, labels=data).loss
        loss.backward()
        for p, m in zip(params, master):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = nbytes(master) * 2 + nbytes(v for s in opt.state.values() for v in s.values()
                                        if v.dim() > 0)
    return losses, state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    data = counting_batch(32, 24, 64, seed=0)
    start = time.time()
    mode = rgc.compute.choose_compute_mode()
    print(f"compute mode: {mode}")
    rgc_losses, rgc_state = run_rgc(args.steps, args.rank, data, mode)
    adamw_losses, adamw_state = run_adamw(args.steps, data, mode)
    print(f"{'step':>5} {'RGC r=' + str(args.rank):>12} {'AdamW':>10}")
    for i in range(0, args.steps, max(1, args.steps // 10)):
        print(f"{i:>5} {rgc_losses[i]:>12.4f} {adamw_losses[i]:>10.4f}")
    print(f"{'final':>5} {rgc_losses[-1]:>12.4f} {adamw_losses[-1]:>10.4f}")
    print(f"training state beyond the BF16 weights: RGC {rgc_state / 2**10:.1f} KiB "
          f"(sketches + projections), AdamW {adamw_state / 2**10:.1f} KiB "
          f"(FP32 master + grads + 2 moments); ratio {adamw_state / rgc_state:.1f}x")
    print(f"done in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()

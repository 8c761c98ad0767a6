"""Data parallel or FSDP2 training with rgc on torch.distributed, RGC or LoGRA's recipe.

    torchrun --nproc-per-node 2 examples/distributed.py                 # RGC, data parallel
    torchrun --nproc-per-node 2 examples/distributed.py --fsdp          # RGC, FSDP2 row shards
    torchrun --nproc-per-node 2 examples/distributed.py --recipe logra --checkpoint runs/ckpt

``--recipe logra`` is LoGRA's published setup at small scale: FSDP2, RowAdam on rank-256
sketches of fixed Rademacher projections, and predicted-KL step control whose budget anneals
from 2e-4 to 2e-5; each rank probes the KL on its share of the step's batch.

The same command runs on CPUs (gloo) and on GPUs (nccl, one process per GPU). The model is a
small stack of Llama-style MLP blocks learning a synthetic next-token rule; only the
compressed projections train. Each rank takes its share of every global batch; the optimizer
averages the d x r sketches (data parallel) or reduce-scatters them to the rows each rank owns
(FSDP2), so the result does not depend on the number of processes beyond rounding.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import rgc


class Block(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 256, intermediate: int = 512,
                 layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, intermediate) for _ in range(layers))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(x)


def global_batch(step: int, batch: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch on every rank (seeded by the step); target = (3 * token + 1) mod vocab."""
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (batch, 16), generator=gen)
    return tokens.to(device), ((3 * tokens + 1) % vocab).to(device)


def build_optimizer(recipe: str, model: nn.Module, steps: int, lr: float):
    """RGC: normalised SGD at a calibrated step. LoGRA: RowAdam under annealed predicted KL."""
    if recipe == "rgc":
        return rgc.DistributedRGCOptimizer(model.parameters(), lr=lr, seed=0), None
    control = rgc.PredictedKL(budget=2e-4, final_budget=2e-5, anneal_steps=max(steps - 1, 1))
    optimizer = rgc.DistributedRowAdam(model.parameters(), lr=lr, seed=0,
                                       step_control=control)
    return optimizer, control


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", choices=("rgc", "logra"), default="rgc",
                        help="rgc: RGCOptimizer; logra: FSDP2 + RowAdam + annealed predicted KL")
    parser.add_argument("--fsdp", action="store_true", help="shard with FSDP2's fully_shard "
                        "(always on for --recipe logra)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    parser.add_argument("--rank", type=int, default=None,
                        help="sketch rank r (default 16 for rgc, 256 for logra)")
    parser.add_argument("--checkpoint", default=None, help="save a torch.distributed.checkpoint")
    args = parser.parse_args()
    fsdp = args.fsdp or args.recipe == "logra"
    rank_r = args.rank or (256 if args.recipe == "logra" else 16)

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {world} processes")
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda" if use_cuda else "cpu")

    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyLM().to(device=device, dtype=torch.bfloat16)
    rgc.wrap(model, rank_r, seed=0, preset=args.recipe)  # same seed everywhere; checked
    # RGC's step relative to ||W||, calibrated on the whole weights; RowAdam's is Adam's lr
    lr = rgc.calibrate_lr(model, adamw_lr=1e-3) if args.recipe == "rgc" else 1e-3
    if fsdp:  # after rgc.wrap: fully_shard then shards the compressed weights by rows
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer, control = build_optimizer(args.recipe, model, args.steps, lr)

    share = args.batch // world
    for step in range(args.steps):
        tokens, targets = global_batch(step, args.batch, 64, device)
        mine = slice(rank * share, (rank + 1) * share)
        logits = model(tokens[mine])
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets[mine].flatten())
        loss.backward()
        if control is not None:  # every rank probes its own share: kappa is their mean
            control.set_probe(model, tokens[mine])
        optimizer.step()
        optimizer.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            line = (f"step {step:3d}  loss {float(mean_loss) / world:.4f}  "
                    f"sent {optimizer.last_comm_bytes} B/rank")
            if control is not None:
                last = control.last
                line += (f"  predicted KL {last['predicted_kl']:.2e} (budget "
                         f"{last['budget']:.1e}, alpha {last['alpha']:.3f})  realised "
                         f"{last['realised_kl']:.2e}")
            print(line, flush=True)

    # Every rank holds the same weights (data parallel) or the same global tensors (FSDP2).
    first = model.blocks[0].gate_proj.weight
    local = first.full_tensor() if hasattr(first, "full_tensor") else first
    checks = [torch.empty(1, dtype=torch.float64, device=device) for _ in range(world)]
    dist.all_gather(checks, local.double().sum().reshape(1))
    if rank == 0:
        print("weights agree across ranks:", len({float(c) for c in checks}) == 1)

    if args.checkpoint:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if control is not None:  # the annealing step travels with the checkpoint
            state["control"] = control.state_dict()
        dcp.save(state, checkpoint_id=args.checkpoint)
        if rank == 0:
            print("saved", args.checkpoint)
    # Let every rank finish its collectives before the group is torn down: gloo can abort a
    # process ("terminate called without an active exception") that exits while a peer's
    # last operation is still in flight.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Measured peak per rank under FSDP2 against ``estimate_memory(..., fsdp=N)``.

A dense Qwen3, a Qwen3-MoE and a Mixtral (their expert stacks sharded over experts) of the
size of ``tests/test_memory_estimate.py``'s MoE checks, BF16, wrapped with rgc at rank 8,
``fully_shard`` per decoder layer and on the model, trained for two steps (batch 2 x 20 tokens
per rank) with ``DistributedRGCOptimizer`` or ``DistributedRowAdam`` on 2 gloo processes; the
second step's peak is measured on every rank with ``rgc.memory.track`` (which follows FSDP2's
resizing of gathered parameters' storages) and set beside the estimate of the same
configuration. ``tests/test_memory_estimate.py`` asserts the same within 3%.

    python benchmarks/fsdp_memory.py [--world 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import rgc  # noqa: E402
from benchmarks.common import write_results  # noqa: E402
from rgc.memory import estimate_memory, track  # noqa: E402

#: (model family, method) pairs measured.
CASES = [("qwen3", "rgc"), ("qwen3", "rowadam"), ("qwen3_moe", "rgc"),
         ("qwen3_moe", "rowadam"), ("mixtral", "rgc"), ("mixtral", "rowadam")]
MOE = dict(hidden=64, experts=8, expert_inter=32, top_k=2, layers=2, vocab=2000)
BATCH, SEQ, RANK = 2, 20, 8


def _model(family: str):
    from tests.models import tiny_moe, tiny_qwen3

    if family == "qwen3":
        return tiny_qwen3(torch.bfloat16, vocab_size=MOE["vocab"], hidden_size=64,
                          intermediate_size=128, num_hidden_layers=2)
    extra = {"norm_topk_prob": True} if family == "qwen3_moe" else {}
    return tiny_moe(family, torch.bfloat16, **MOE, **extra)


def measure_rank(rank: int, world: int, out: Path, cases=CASES) -> None:
    """On one rank of an initialised process group: each case's second-step peak and its
    estimate, saved to ``out / f"peaks{rank}.pt"``."""
    from torch.distributed.fsdp import fully_shard

    rows = {}
    for family, method in cases:
        gen = torch.Generator().manual_seed(rank)
        with track() as t:
            ids = torch.randint(0, MOE["vocab"], (BATCH, SEQ), generator=gen)
            model = _model(family).train()
            config = model.config.to_dict()
            rgc.wrap(model, RANK)
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            make = rgc.DistributedRowAdam if method == "rowadam" else rgc.DistributedRGCOptimizer
            opt = make([p for p in model.parameters() if p.requires_grad], lr=1e-3)
            for step in range(2):
                if step:
                    t.reset_peak()
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
        est = estimate_memory(config, method=method, rank=RANK, batch=BATCH, seq_len=SEQ,
                              fsdp=world)
        rows[(family, method)] = {"measured": t.peak, "estimated": est.total,
                                  "phase": est.phase}
    torch.save(rows, out / f"peaks{rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    from tests.test_distributed import spawn

    with tempfile.TemporaryDirectory() as tmp:
        spawn(measure_rank, Path(tmp), args.world)
        per_rank = [torch.load(Path(tmp) / f"peaks{r}.pt") for r in range(args.world)]
    rows = []
    for (family, method), row in per_rank[0].items():
        peaks = [ranks[(family, method)]["measured"] for ranks in per_rank]
        worst = max(peaks, key=lambda p: abs(row["estimated"] - p) / p)
        rows.append({"model": family, "method": method, "ranks": args.world,
                     "measured peak MiB (largest rank)": round(max(peaks) / 2**20, 4),
                     "estimated MiB": round(row["estimated"] / 2**20, 4),
                     "error (worst rank)": f"{(row['estimated'] - worst) / worst * 100:+.3f}%",
                     "estimated phase": row["phase"]})
    write_results("fsdp_memory_cpu", rows, title="FSDP2: measured peak per rank vs estimate",
                  notes=__doc__.split("\n\n")[1].replace("\n", " "))


if __name__ == "__main__":
    main()

"""Gradient communication per optimizer step: rgc sketches vs dense gradients, Qwen3 shapes.

Counts what one rank hands to the collectives each step for the attention and MLP projections
(q/k/v/o, gate/up/down of every decoder layer), the matrices rgc compresses:

* dense data parallel (DDP): the d x k gradient of each, all-reduced in the gradient dtype
  (BF16 for a BF16 model; FP32 with FP32 master weights/gradients);
* rgc (``DistributedRGCOptimizer``, data parallel): the d x r FP32 sketch of each plus one
  4-byte presence flag, all-reduced in buckets.

Under FSDP2 the same quantities go to a reduce-scatter instead (rgc pads d to a multiple of the
world size, as FSDP does), so the ratios are the same. A ring all-reduce puts 2 (N-1)/N times
the payload on each rank's link, a reduce-scatter (N-1)/N: also the same for both methods.
``tests/test_distributed.py`` measures these byte counts on real collectives (2 CPU ranks);
this script applies the same formula to the published model shapes.

    python benchmarks/comm_volume.py      # writes benchmarks/results/comm_volume.{csv,md,json}
    python benchmarks/comm_volume.py --measure   # also counts one real decoder layer's bytes

``--measure`` starts 2 CPU processes (gloo) holding one decoder layer's projections at the real
shapes, and counts the bytes handed to the collectives per step: ``all_reduce`` calls made by
``rgc.distributed.all_reduce_sketches`` (the data-parallel step of ``DistributedRGCOptimizer``),
and the buckets of a DDP comm hook for the same layer uncompressed (about 3 GiB of RAM for the
8B layer). Results go to ``comm_volume_measured.*``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass

import torch

from benchmarks.common import write_results

MIB = 2**20


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int

    def projections(self) -> list[tuple[str, int, int]]:
        """(name, d = out_features, k = in_features) of one decoder layer's projections."""
        h, q, kv, i = (self.hidden, self.q_heads * self.head_dim, self.kv_heads * self.head_dim,
                       self.intermediate)
        return [("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q),
                ("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)]


MODELS = (
    Shape("Qwen3-1.7B", hidden=2048, layers=28, q_heads=16, kv_heads=8, head_dim=128,
          intermediate=6144),
    Shape("Qwen3-8B", hidden=4096, layers=36, q_heads=32, kv_heads=8, head_dim=128,
          intermediate=12288),
)
RANKS = (64, 128, 256)


def dense_bytes(shape: Shape, grad_bytes: int) -> int:
    return shape.layers * sum(d * k * grad_bytes for _, d, k in shape.projections())


def rgc_bytes(shape: Shape, rank: int) -> int:
    """FP32 sketches (d x r) plus one FP32 presence flag per compressed weight."""
    return shape.layers * sum(d * rank * 4 + 4 for _, d, _ in shape.projections())


def k_mean(shape: Shape) -> float:
    """sum(d k) / sum(d): dense bytes / sketch bytes = 2 k_mean / (4 r) for BF16 gradients."""
    return (sum(d * k for _, d, k in shape.projections())
            / sum(d for _, d, _ in shape.projections()))


def main() -> None:
    rows = []
    for shape in MODELS:
        bf16, fp32 = dense_bytes(shape, 2), dense_bytes(shape, 4)
        methods = [("dense DDP, BF16 grads", bf16), ("dense DDP, FP32 grads", fp32)]
        methods += [(f"rgc r={rank}", rgc_bytes(shape, rank)) for rank in RANKS]
        for method, sent in methods:
            rows.append({"model": shape.name, "method": method,
                         "matrices": shape.layers * len(shape.projections()),
                         "bytes_per_step": sent, "MiB_per_step": round(sent / MIB),
                         "dense_bf16_over_this": round(bf16 / sent, 2),
                         "dense_fp32_over_this": round(fp32 / sent, 2)})
    notes = (
        "Payload one rank passes to all-reduce (data parallel) or reduce-scatter (FSDP2) per "
        "optimizer step, for the q/k/v/o/gate/up/down projections of every decoder layer "
        "(embeddings and norms are frozen under rgc and excluded from every row). "
        "dense_*_over_this: how many times fewer bytes than dense; about 2 k_mean / (4 r) for "
        "BF16 gradients, with k_mean = sum(d k) / sum(d) = "
        + ", ".join(f"{s.name}: {k_mean(s):.0f}" for s in MODELS)
        + ". Gradient accumulation does not change it: sketches accumulate locally and are "
        "reduced once per optimizer step, like DDP under no_sync().")
    write_results("comm_volume", rows, title="Gradient communication per optimizer step",
                  notes=notes)


class _Projections(torch.nn.Module):
    """One decoder layer's projections; forward: a loss from one input per projection."""

    def __init__(self, shape: Shape):
        super().__init__()
        for name, d, k in shape.projections():
            setattr(self, name, torch.nn.Linear(k, d, bias=False, dtype=torch.bfloat16))

    def forward(self, inputs: dict) -> torch.Tensor:
        return sum(getattr(self, n)(x).float().square().mean() for n, x in inputs.items())


def _measure_worker(rank: int, store: str, results: dict) -> None:
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import rgc

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    sent: list[int] = []
    original = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        sent.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    for shape in MODELS:
        layer = _Projections(shape)
        inputs = {name: torch.randn(2, k, dtype=torch.bfloat16)
                  for name, _, k in shape.projections()}

        ddp = nn.parallel.DistributedDataParallel(layer)
        dense: list[int] = []

        def hook(state, bucket, dense=dense):
            dense.append(bucket.buffer().numel() * bucket.buffer().element_size())
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(dist.group.WORLD, hook)
        ddp(inputs).backward()
        del ddp
        for p in layer.parameters():
            p.grad = None
        row = {"dense DDP, BF16 grads": (sum(dense), len(dense))}
        for r in RANKS:
            rgc.wrap(layer, r, targets=lambda name, m: isinstance(m, nn.Linear))
            layer(inputs).backward()
            sent.clear()
            dist.all_reduce = counted
            try:
                rgc.distributed.all_reduce_sketches(layer)
            finally:
                dist.all_reduce = original
            row[f"rgc r={r}"] = (sum(sent), len(sent))
            rgc.unwrap(layer)
        if rank == 0:
            results[shape.name] = row
        del layer
    dist.destroy_process_group()


def measure() -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        manager = mp.Manager()
        results = manager.dict()
        mp.spawn(_measure_worker, args=(os.path.join(tmp, "store"), results), nprocs=2)
        results = dict(results)
    rows = []
    for shape in MODELS:
        one_layer = Shape(shape.name, shape.hidden, 1, shape.q_heads, shape.kv_heads,
                          shape.head_dim, shape.intermediate)
        dense = results[shape.name]["dense DDP, BF16 grads"][0]
        for method, (measured, calls) in results[shape.name].items():
            formula = (dense_bytes(one_layer, 2) if method.startswith("dense")
                       else rgc_bytes(one_layer, int(method.split("=")[1])))
            rows.append({"model": shape.name, "method": method, "collective_calls": calls,
                         "measured_bytes": measured, "formula_bytes": formula,
                         "dense_over_this": round(dense / measured, 2)})
    write_results("comm_volume_measured", rows,
                  title="Gradient bytes per step of one decoder layer, counted on 2 gloo ranks",
                  notes="One decoder layer's seven projections at the real shapes (BF16). "
                        "measured_bytes: sum of the tensors handed to all_reduce by "
                        "rgc.distributed.all_reduce_sketches, or of the buckets DDP's comm "
                        "hook receives; formula_bytes: the formula of comm_volume.md for one "
                        "layer. collective_calls: number of all-reduces (buckets).")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="gradient communication per step")
    parser.add_argument("--measure", action="store_true",
                        help="also count the bytes of one decoder layer on 2 gloo processes")
    if parser.parse_args().measure:
        measure()
    main()

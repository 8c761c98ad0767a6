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
"""

from __future__ import annotations

from dataclasses import dataclass

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


if __name__ == "__main__":
    main()

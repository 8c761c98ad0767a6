"""GPU: rgc's expert path on Qwen3-30B-A3B layer shapes, against dense grouped GEMMs and copy
bandwidth.

One decoder layer's experts as transformers builds them (``Qwen3MoeExperts``, BF16: E = 128
experts, ``gate_up_proj`` [E, 1536, 2048], ``down_proj`` [E, 2048, 768]) on ``--tokens``
tokens, each routed to 8 experts drawn uniformly at random (seed 0), with routing weights
summing to one. Rows of ``gpu_experts``:

* ``sketched``: the layer wrapped by ``rgc.wrap(rank=r)``: forward saves one ``X P`` per token
  for gate/up and one per routed row for down, backward returns the exact input gradient and
  ``C_e = D_e^T (X_e P)`` ([E, d, r] FP32) per stack, no weight gradient;
* ``dense``: transformers' ``grouped_mm`` experts with trainable weights, whose backward forms
  both stacks' dense BF16 gradients [E, d, k] by grouped GEMMs (what LoRA's merged stacks and
  full fine-tuning pay);
* ``frozen``: the same with frozen weights: forward and the input gradient alone, the floor of
  any method that trains the experts.

Per row: the forward, and forward + backward, times (median, L2 flushed before each, CUDA
events); the peak memory of one forward + backward above what was allocated before it (the
saved activations, the weight gradients or sketches, the transients); the host
synchronisations (``aten._local_scalar_dense``) of one forward + backward.

Rows of ``gpu_experts_step``: ``RGCOptimizer.step()`` and ``RowAdam.step()`` on the two sketched
stacks after one backward (untimed), and ``torch.optim.AdamW(fused=True)`` on the same stacks
with their dense BF16 gradients; GB/s counts 4 bytes per weight element (read and write the
BF16 weight once), also as a fraction of the measured copy bandwidth (``floor_ms``: that pass
at the copy bandwidth); host synchronisations and the CUDA kernels of one step.

    python benchmarks/gpu_experts.py [--reps 20] [--tokens 4096] [--rank 64] [--out DIR]
    python benchmarks/gpu_experts.py --smoke   # tiny shapes on the CPU (reference path)

``--smoke`` checks the script on the CPU: rgc's reference path (the Triton kernels on expert
stacks are checked in the interpreter by ``tests/test_ops_triton.py``), no memory figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from benchmarks.common import write_results  # noqa: E402
from benchmarks.gpu_kernels import (  # noqa: E402
    Timer,
    _CountSyncs,
    copy_bandwidth,
    profiled_launches,
)

#: One Qwen3-30B-A3B decoder layer's experts (benchmarks/configs/qwen3-30b-a3b.json).
QWEN3_30B_A3B = dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8)
SMOKE = dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
MIB = 2**20


def experts_layer(numbers: dict, device, *, sketch_rank: int | None = None,
                  trainable: bool = True) -> torch.nn.Module:
    """A module holding one ``Qwen3MoeExperts`` (``.experts``), BF16 on ``device``, weights
    N(0, 0.02) from seed 0; transformers' ``grouped_mm`` experts, or sketched by ``rgc.wrap``
    at ``sketch_rank``."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    import rgc

    config = Qwen3MoeConfig(**numbers, num_hidden_layers=1, experts_implementation="grouped_mm")
    torch.manual_seed(0)
    layer = torch.nn.Module()
    with torch.device(device):  # built and initialised on the device (1.2 GB at 30B)
        layer.experts = Qwen3MoeExperts(config)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
    layer = layer.to(torch.bfloat16).requires_grad_(trainable)
    if sketch_rank is not None:
        rgc.wrap(layer, sketch_rank, seed=1)
    return layer


def routed_batch(numbers: dict, tokens: int, device) -> tuple[torch.Tensor, ...]:
    """(hidden states [n, H] BF16 requiring grad, top-k experts [n, K] int64, routing weights
    [n, K] BF16 summing to one, output gradient [n, H] BF16), seed 0."""
    g = torch.Generator().manual_seed(0)
    h, e, k = (numbers[key] for key in ("hidden_size", "num_experts", "num_experts_per_tok"))
    x = torch.randn(tokens, h, generator=g).to(device, torch.bfloat16).requires_grad_()
    index = torch.rand(tokens, e, generator=g).topk(k, dim=-1).indices.to(device)
    weights = torch.rand(tokens, k, generator=g).softmax(-1).to(device, torch.bfloat16)
    grad = torch.randn(tokens, h, generator=g).to(device, torch.bfloat16)
    return x, index, weights, grad


def peak_bytes(fn, device) -> int | None:
    """Most bytes allocated during ``fn()`` above what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def clear_gradients(layer, x) -> None:
    """Drop weight gradients, sketches and the input gradient (as ``zero_grad(None)``)."""
    import rgc

    x.grad = None
    for p in layer.parameters():
        p.grad = None
    for _, owner in rgc.sketched_weights(layer):
        owner.sketch = None


def bench_pass(timer: Timer, name: str, layer, batch) -> dict:
    """Forward, forward + backward, peak memory and host syncs of one experts layer."""
    x, index, weights, grad = batch

    def forward():
        return layer.experts(x, index, weights)

    def forward_backward():
        forward().backward(grad)

    t_forward = timer(forward)
    t_both = timer(forward_backward)
    clear_gradients(layer, x)
    peak = peak_bytes(forward_backward, timer.device)
    clear_gradients(layer, x)
    with _CountSyncs() as syncs:
        forward_backward()
    return dict(path=name, forward_ms=t_forward * 1e3, forward_backward_ms=t_both * 1e3,
                backward_ms=(t_both - t_forward) * 1e3,
                peak_MiB=None if peak is None else peak / MIB, syncs=syncs.count)


def step_time(timer: Timer, backward, step) -> float:
    """Median time of ``step()`` alone, an untimed ``backward()`` before each."""
    times = []
    for _ in range(timer.reps + 1):  # the first is a warm-up (compilation)
        backward()
        times.append(timer.once(step))
    return statistics.median(times[1:])


def bench_steps(timer: Timer, numbers: dict, rank: int, batch) -> list[dict]:
    """RGCOptimizer and RowAdam on the sketched stacks, fused AdamW on the dense ones."""
    import rgc

    x, index, weights, grad = batch
    rows = []
    makers = [("rgc", lambda ps: rgc.RGCOptimizer(ps, lr=1e-3, seed=5)),
              ("rowadam", lambda ps: rgc.RowAdam(ps, lr=1e-3, seed=5)),
              ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-6, fused=timer.device.type
                                                     == "cuda"))]
    for name, make in makers:
        layer = experts_layer(numbers, timer.device,
                              sketch_rank=None if name == "adamw" else rank)
        opt = make([p for p in layer.parameters() if p.requires_grad])
        numel = layer.experts.gate_up_proj.numel() + layer.experts.down_proj.numel()

        def backward(layer=layer, opt=opt):
            opt.zero_grad(set_to_none=True)
            layer.experts(x, index, weights).backward(grad)

        seconds = step_time(timer, backward, opt.step)
        backward()
        with _CountSyncs() as syncs:
            opt.step()
        backward()
        launches = profiled_launches(opt.step)
        gbps = 4 * numel / seconds / 1e9
        rows.append(dict(method=name, r=rank if name != "adamw" else "-", weights=numel,
                         step_ms=seconds * 1e3, GBps=gbps,
                         vs_copy=gbps / (timer.copy_bps / 1e9),
                         floor_ms=4 * numel / timer.copy_bps * 1e3, syncs=syncs.count,
                         **launches))
        del layer, opt
    return rows


def main(argv=None) -> tuple[list[dict], list[dict]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on the CPU, rgc's reference path")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens routed through the layer")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None, help="results directory")
    args = ap.parse_args(argv)
    kwargs = {} if args.out is None else dict(directory=args.out)
    if args.smoke:
        device, numbers, tokens, rank, reps, nbytes = (torch.device("cpu"), SMOKE, 16, 8, 1,
                                                       2**20)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --smoke for the CPU interpreter check")
        device, numbers, tokens, rank, reps, nbytes = (torch.device("cuda"), QWEN3_30B_A3B,
                                                       args.tokens, args.rank, args.reps, 2**30)
    timer = Timer(device, reps)
    timer.copy_bps = copy_bandwidth(timer, nbytes)
    print(f"copy bandwidth: {timer.copy_bps / 1e9:.1f} GB/s")
    batch = routed_batch(numbers, tokens, device)
    passes = [bench_pass(timer, name, experts_layer(numbers, device, **options), batch)
              for name, options in [("sketched", dict(sketch_rank=rank)), ("dense", {}),
                                    ("frozen", dict(trainable=False))]]
    steps = bench_steps(timer, numbers, rank, batch)

    mode = ("smoke run (CPU, tiny shapes, reference path: timings meaningless)"
            if args.smoke else "GPU")
    shape = ", ".join(f"{k}={v}" for k, v in numbers.items())
    suffix = "_smoke" if args.smoke else ""
    write_results(
        "gpu_experts" + suffix, passes, title="One experts layer: sketched vs dense grouped GEMMs",
        notes=f"{mode}. Qwen3MoeExperts ({shape}), BF16, {tokens} tokens x "
              f"{numbers['num_experts_per_tok']} experts, r = {rank}. Median of {reps} "
              "timings, L2 flushed before each; peak_MiB: above the allocations before one "
              "forward + backward (weight gradients or sketches included); syncs: host reads "
              "of device values in one forward + backward. Copy bandwidth "
              f"{timer.copy_bps / 1e9:.1f} GB/s.", **kwargs)
    write_results(
        "gpu_experts_step" + suffix, steps, title="The update of two expert stacks",
        notes=f"{mode}. The gate_up and down stacks of one layer ({shape}), BF16; rgc and "
              "RowAdam on their sketches (one backward before each step, untimed), "
              "AdamW(fused=True) on their dense gradients. GBps: 4 bytes per weight element; "
              f"vs_copy: over the copy bandwidth ({timer.copy_bps / 1e9:.1f} GB/s); floor_ms: "
              "that pass at the copy bandwidth. cuda_kernels, memcpys, memsets: one step, "
              "counted by the torch profiler (empty without CUDA).", **kwargs)
    return passes, steps


if __name__ == "__main__":
    main()

"""``python -m rgc.memory CONFIG_JSON --rank 64 128 256``: predicted memory of every method.

Prints each method's training state and predicted peak (rgc, RowAdam, LoRA, GaLore and APOLLO
once per rank; dense AdamW, its BF16, 8-bit and 4-bit variants and APOLLO-Mini once), and the
saving of RGC over LoRA. The state saving (LoRA's adapters + gradients + AdamW moments minus
RGC's sketches + projections, over the target projections of every layer) is the RGC
preprint's "predicted saving"; with ``--batch`` and ``--seq-len`` the peaks include saved
activations; ``--fsdp 8`` gives per-GPU figures under FSDP2 over 8 GPUs.
"""

from __future__ import annotations

import argparse
import sys

import torch

from rgc.memory.estimate import METHODS, RANKED, estimate_memory, spec_from_config

GIB = 2**30


def _fmt(b: int) -> str:
    return f"{b / GIB:.2f}"


def table(config, ranks, *, batch=None, seq_len=None, targets=None, dtype=torch.bfloat16,
          methods=METHODS, fsdp=1, implementation="torch") -> str:
    """The CLI's output as a string (GiB = 2**30 bytes)."""
    kw = dict(batch=batch, seq_len=seq_len, targets=targets, dtype=dtype, fsdp=fsdp,
              implementation=implementation)
    spec = spec_from_config(config, dtype=dtype)
    experts = sum(s.experts * s.d * s.k for s in spec.linears if s.experts > 1)
    lines = [f"{config}: {spec.num_params / 1e9:.3f} B parameters"
             + (f" ({experts / 1e9:.3f} B in expert stacks)" if experts else "")
             + f", weights {_fmt(spec.weight_bytes)} GiB"
             + (f", batch {batch} x seq_len {seq_len}" if batch else ", no batch activations")
             + (f", per GPU of FSDP2 over {fsdp}" if fsdp > 1 else ""),
             "",
             "| method | rank | state GiB | peak GiB | peak at |",
             "|---|---|---|---|---|"]

    def row(method, rank):
        try:
            e = estimate_memory(config, method=method, rank=rank, **kw)
        except ValueError as err:
            if "FSDP2" in str(err):
                lines.append(f"| {method} | {rank or '-'} | n/a | n/a | no FSDP2 support |")
            elif "expert stacks" in str(err):
                lines.append(f"| {method} | {rank or '-'} | n/a | n/a | no expert support |")
            elif "in_features" in str(err):
                lines.append(f"| {method} | {rank} | n/a | n/a | rank > in_features "
                             "(rgc.wrap refuses it) |")
            else:
                raise
            return None
        lines.append(f"| {method} | {rank or '-'} | {_fmt(e.state)} | {_fmt(e.total)} | "
                     f"{e.phase} |")
        return e

    for m in methods:
        if m not in RANKED:
            row(m, None)
    savings = []
    for r in ranks:
        est = {m: row(m, r) for m in methods if m in RANKED}
        lora, rgc = est.get("lora"), est.get("rgc")
        if lora and rgc:
            savings.append(f"| {r} | {_fmt(lora.state - rgc.state)} | "
                           f"{_fmt(lora.total - rgc.total)} | {rgc.state / lora.state:.3f} |")
    if savings:
        lines += ["", "RGC's saving over LoRA (state: LoRA adapters + grads + AdamW moments "
                  "minus RGC sketches + projections)", "",
                  "| rank | state saving GiB | peak saving GiB | RGC state / LoRA state |",
                  "|---|---|---|---|", *savings]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rgc.memory", description=__doc__)
    parser.add_argument("config", help="path of a local Hugging Face config.json")
    parser.add_argument("--rank", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--targets", nargs="+", default=None,
                        help="layer names to compress/adapt (default: rgc.wrap's targets)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16",
                                                                 "float32"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                        metavar="METHOD", help=f"methods to show (default all: {METHODS})")
    parser.add_argument("--fsdp", type=int, default=1,
                        help="per-GPU figures under FSDP2 over this many GPUs")
    parser.add_argument("--implementation", default="torch", choices=["torch", "triton"],
                        help="'torch': reference/CPU steps; 'triton': GPU kernels")
    args = parser.parse_args(argv)
    try:
        print(table(args.config, args.rank, batch=args.batch, seq_len=args.seq_len,
                    targets=args.targets, dtype=getattr(torch, args.dtype),
                    methods=args.methods, fsdp=args.fsdp,
                    implementation=args.implementation))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

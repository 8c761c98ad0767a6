"""``python -m rgc.memory CONFIG_JSON --rank 64 128 256``: predicted memory of every method.

Prints, per rank, each method's training state, predicted peak and the saving of RGC over
LoRA. The state saving (LoRA's adapters + gradients + AdamW moments minus RGC's sketches +
projections, over the target projections of every layer) is the RGC preprint's "predicted saving";
with ``--batch`` and ``--seq-len`` the peaks include saved activations.
"""

from __future__ import annotations

import argparse
import sys

import torch

from rgc.memory.estimate import METHODS, estimate_memory, spec_from_config

GIB = 2**30


def _fmt(b: int) -> str:
    return f"{b / GIB:.2f}"


def table(config, ranks, *, batch=None, seq_len=None, targets=None,
          dtype=torch.bfloat16) -> str:
    """The CLI's output as a string (GiB = 2**30 bytes)."""
    kw = dict(batch=batch, seq_len=seq_len, targets=targets, dtype=dtype)
    spec = spec_from_config(config, dtype=dtype)
    lines = [f"{config}: {spec.num_params / 1e9:.3f} B parameters, weights "
             f"{_fmt(spec.weight_bytes)} GiB"
             + (f", batch {batch} x seq_len {seq_len}" if batch else ", no activations"),
             "",
             "| method | rank | state GiB | peak GiB | peak at |",
             "|---|---|---|---|---|"]
    dense = estimate_memory(config, method="adamw", **kw)
    lines.append(f"| adamw | - | {_fmt(dense.state)} | {_fmt(dense.total)} | {dense.phase} |")
    savings = []
    for r in ranks:
        est = {m: estimate_memory(config, method=m, rank=r, **kw) for m in METHODS[:3]}
        for m, e in est.items():
            lines.append(f"| {m} | {r} | {_fmt(e.state)} | {_fmt(e.total)} | {e.phase} |")
        lora, rgc = est["lora"], est["rgc"]
        savings.append(f"| {r} | {_fmt(lora.state - rgc.state)} | "
                       f"{_fmt(lora.total - rgc.total)} | {rgc.state / lora.state:.3f} |")
    lines += ["", "RGC's saving over LoRA (state: LoRA adapters + grads + AdamW moments minus "
              "RGC sketches + projections)", "",
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
    args = parser.parse_args(argv)
    try:
        print(table(args.config, args.rank, batch=args.batch, seq_len=args.seq_len,
                    targets=args.targets, dtype=getattr(torch, args.dtype)))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

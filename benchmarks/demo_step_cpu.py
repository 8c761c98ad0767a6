"""CPU: seconds per training step of the GRPO demo's policy under rgc, for two checkouts side by
side.

The demo's default policy (a random-init Qwen3: hidden 128, 4 layers, 4 heads, 2 key/value
heads, intermediate 384, vocabulary 64, BF16) is wrapped with ``rgc.wrap(rank=16)`` and
trained with ``RGCOptimizer``: one step is the forward and backward of a GRPO batch (64
sequences of 32 tokens, the demo's 16 prompts x 4 samples) and ``opt.step()``. Rollout
generation is the unwrapped model's and is not timed. Each checkout runs in its own process
(``PYTHONPATH=<checkout>/src``), the checkouts alternating ``--rounds`` times so that a shared
machine disturbs both alike; the ratio of the medians is what to read.

    python benchmarks/demo_step_cpu.py --baseline /path/to/other/checkout [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORKER = r"""
import json, sys, time, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
import rgc
torch.set_num_threads(1)
steps, warmup = int(sys.argv[1]), int(sys.argv[2])
config = Qwen3Config(vocab_size=64, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     max_position_embeddings=64, tie_word_embeddings=False,
                     attn_implementation="eager")
torch.manual_seed(0)
model = rgc.wrap(Qwen3ForCausalLM(config).to(torch.bfloat16), rank=16)
opt = rgc.RGCOptimizer(model.parameters(), lr=1e-3)
ids = torch.randint(3, 64, (64, 32), generator=torch.Generator().manual_seed(1))
times = []
for step in range(warmup + steps):
    t = time.perf_counter()
    logits = model(ids).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64),
                                             ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step >= warmup:
        times.append(time.perf_counter() - t)
print(json.dumps(times))
"""


def run_checkout(src: Path, steps: int, warmup: int) -> list[float]:
    from benchmarks.common import python_last_line

    env = dict(os.environ, PYTHONPATH=str(src))
    return json.loads(python_last_line(WORKER, str(steps), str(warmup), env=env))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="the other checkout")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    from benchmarks.common import write_results

    checkouts = {"this checkout": ROOT / "src", "baseline": args.baseline.resolve() / "src"}
    medians: dict[str, list[float]] = {name: [] for name in checkouts}
    for _ in range(args.rounds):
        for name, src in checkouts.items():
            medians[name].append(statistics.median(run_checkout(src, args.steps, args.warmup)))
    base = statistics.median(medians["baseline"])
    rows = [{"checkout": name, "s_per_step": round(statistics.median(m), 4),
             "vs_baseline": round(statistics.median(m) / base, 3),
             "round_medians": " ".join(f"{v:.4f}" for v in m)} for name, m in medians.items()]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.baseline,
                            capture_output=True, text=True, check=False).stdout.strip()
    write_results("demo_step_cpu", rows, title="GRPO demo policy: s/step under rgc, two checkouts",
                  notes=f"Baseline: commit {commit or args.baseline}. Forward + backward of "
                        "64 x 32 tokens and RGCOptimizer.step(), rank 16, one torch thread, wall "
                        f"time, {args.rounds} alternating rounds of {args.steps} steps.")


if __name__ == "__main__":
    main()

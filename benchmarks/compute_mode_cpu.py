"""CPU: BF16-stored models with native BF16 matmuls vs the FP32 compute mode (rgc.compute).

Two parts, each timed side by side (interleaved repetitions, medians) so that the ratio is
meaningful on a loaded machine:

* one ``F.linear`` of (64 x 128) by (128 x 384) (the demo's MLP shape): BF16, FP32, and BF16
  operands upcast to FP32 for the product (what the compute mode does);
* one whole GRPO step of the demo (``examples/grpo_arithmetic.py``, default model: 64 sampled
  responses, forward and backward, the update) for each method, native vs FP32 compute, in
  process CPU seconds (one thread: the work done, less sensitive than wall time to other jobs
  on a shared machine, though contention still inflates it).

The result file is named after the CPU capability PyTorch uses (e.g. ``compute_mode_cpu_avx2``):
run it once as is and once with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` to see a
CPU without native BF16 on one with it.

    python benchmarks/compute_mode_cpu.py [--reps 3] [--threads 1] [--methods rgc adamw ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "examples"))

from benchmarks.common import write_results  # noqa: E402
from rgc import compute  # noqa: E402


def time_linear(reps: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 128, generator=gen), torch.randn(384, 128, generator=gen)
    xb, wb = x.bfloat16(), w.bfloat16()
    cases = {"bf16": lambda: F.linear(xb, wb), "fp32": lambda: F.linear(x, w),
             "bf16 upcast to fp32": lambda: F.linear(xb.float(), wb.float()).bfloat16()}
    times = {k: [] for k in cases}
    for _ in range(reps):
        for name, fn in cases.items():
            fn()
            t0 = time.perf_counter()
            for _ in range(10):
                fn()
            times[name].append((time.perf_counter() - t0) / 10)
    base = statistics.median(times["bf16"])
    return [{"what": "F.linear (64x128)x(128x384)", "mode": k,
             "median s": statistics.median(v), "bf16 / this": base / statistics.median(v)}
            for k, v in times.items()]


def time_grpo_steps(methods: list[str], reps: int) -> list[dict]:
    from grpo.loss import group_advantages, grpo_loss
    from grpo.methods import METHODS
    from grpo.model import ModelConfig, answer_logprobs, response_mask
    from grpo.rollout import generate
    from grpo.task import make_splits, prompt_ids, rewards

    config = ModelConfig()
    train, _, _ = make_splits(0, 2000, 10, 10)
    questions = [q for q in train[:8] for _ in range(8)]
    prompts = prompt_ids(questions)
    base_state = config.build(0).state_dict()

    def step(method):
        gen = torch.Generator().manual_seed(0)
        t0 = time.process_time()
        method.policy.eval()
        responses = generate(method.policy, prompts, generator=gen)
        adv = group_advantages(rewards(questions, responses), 8)
        method.policy.train()
        logprobs = answer_logprobs(method.policy, prompts, responses)
        loss, _ = grpo_loss(logprobs, logprobs.detach(), adv, response_mask(responses))
        loss.backward()
        method.step(torch.cat([prompts, responses], dim=1))
        return time.process_time() - t0

    rows = []
    for kind in methods:
        built = {}
        for name in ("native", "float32"):
            lr = 1e-3 if kind == "lora" else 1e-4
            method = METHODS[kind](base_state, config, lr=lr, rank=16, seed=0, steps=100)
            compute.use_compute_dtype(method.policy, name)
            step(method)  # warm-up
            built[name] = method
        times = {name: [] for name in built}
        for _ in range(reps):
            for name, method in built.items():
                times[name].append(step(method))
        native = statistics.median(times["native"])
        for name, ts in times.items():
            rows.append({"what": f"GRPO step, {kind} (CPU s)", "mode": name,
                         "median s": statistics.median(ts),
                         "bf16 / this": native / statistics.median(ts)})
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--methods", nargs="+", default=["rgc", "adamw", "lora", "rowadam"])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    mode = compute.choose_compute_mode(override="auto")
    rows = time_linear(max(args.reps, 5)) + time_grpo_steps(args.methods, args.reps)
    capability = torch.backends.cpu.get_cpu_capability()
    flags = {k: os.environ.get(k, "unset") for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    try:
        load = "load average {:.1f} {:.1f} {:.1f} at the end".format(*os.getloadavg())
    except OSError:
        load = ""
    flag_text = ", ".join(f"{k}={v}" for k, v in flags.items())
    notes = (f"CPU capability used by PyTorch: {capability} ({flag_text}). "
             f"Automatic choice: {mode}. Medians of {args.reps} interleaved repetitions "
             f"({max(args.reps, 5)} for F.linear, 10 calls each), {args.threads} thread(s); "
             f"{load}. 'bf16 / this' is the speed-up over native BF16 matmuls.")
    write_results(f"compute_mode_cpu_{capability.lower()}", rows,
                  title=f"BF16 matmuls vs FP32 compute mode, CPU capability {capability}",
                  notes=notes)


if __name__ == "__main__":
    main()

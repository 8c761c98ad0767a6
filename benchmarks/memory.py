"""Measured vs predicted training memory of dense AdamW, LoRA, RGC and RowAdam, side by side.

One model (a randomly initialised transformers Qwen3ForCausalLM in BF16), one fixed batch.
For each method: build the model inside :func:`rgc.memory.track`, run one warm-up step
(optimizer state is created lazily), reset the peak, run one measured step (forward with the
loss, backward, optimizer step, ``zero_grad``), and put :func:`rgc.estimate_memory` beside the
measured peak. Three more steps outside the tracker give the step time (the fastest).

The AdamW recipe (the one the estimator assumes): BF16 weights for forward and backward, an
FP32 master copy, FP32 gradient buffers kept between steps (each BF16 gradient is added in by a
post-accumulate hook and dropped at once), fused AdamW on the master copy, which is then
copied back into the BF16 weights. LoRA: peft with FP32 adapters (peft's default) on the seven
projections, fused AdamW. RGC: :func:`rgc.wrap` + :class:`rgc.RGCOptimizer`. RowAdam:
``rgc.RowAdam`` on the same wrapped model, if this version of rgc has it.

    PYTHONPATH=src python benchmarks/memory.py            # full run, writes results/memory.*
    PYTHONPATH=src python benchmarks/memory.py --quick    # tiny model, seconds
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

import rgc
from rgc.memory import estimate_memory, track

try:
    from benchmarks.common import RESULTS, markdown_table, write_results
except ImportError:  # run as a script from benchmarks/
    from common import RESULTS, markdown_table, write_results

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GIB = 2**30
MIB = 2**20

#: About 110M parameters: 12 layers of width 768, a 32k vocabulary, tied embeddings; a batch
#: of 2 x 64 tokens keeps a step near 10 s on two CPU cores.
FULL = dict(vocab_size=32000, hidden_size=768, intermediate_size=2304, num_hidden_layers=12,
            num_attention_heads=12, num_key_value_heads=6, head_dim=64, tie_word_embeddings=True,
            batch=2, seq_len=64)
QUICK = dict(vocab_size=1000, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
             batch=2, seq_len=16)


def qwen3_config(numbers: dict):
    from transformers import Qwen3Config

    cfg = {k: v for k, v in numbers.items() if k not in ("batch", "seq_len")}
    return Qwen3Config(**cfg, attn_implementation="sdpa", use_cache=False)


class DenseAdamW:
    """Mixed-precision AdamW: FP32 master weights, FP32 gradient buffers, fused AdamW."""

    def __init__(self, model: torch.nn.Module, lr: float = 1e-5):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().to(torch.float32).requires_grad_(False) for p in self.params]
        for p, m in zip(self.params, self.master, strict=True):
            m.grad = torch.zeros_like(m)
            p.register_post_accumulate_grad_hook(self._hook(m))
        self.opt = torch.optim.AdamW(self.master, lr=lr, fused=True)

    @staticmethod
    def _hook(master):
        def hook(p):
            master.grad.add_(p.grad)
            p.grad = None
        return hook

    @torch.no_grad()
    def step(self):
        self.opt.step()
        for p, m in zip(self.params, self.master, strict=True):
            p.copy_(m)

    def zero_grad(self):
        for m in self.master:
            m.grad.zero_()


def new_model(numbers: dict, seed: int = 0) -> torch.nn.Module:
    """The random-init BF16 Qwen3 of ``numbers``, in training mode."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM._from_config(qwen3_config(numbers), dtype=torch.bfloat16)
    return model.train()


def fixed_batch(numbers: dict) -> torch.Tensor:
    """The batch every method trains on: ``batch x seq_len`` int64 token ids, seed 1."""
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, numbers["vocab_size"], (numbers["batch"], numbers["seq_len"]),
                         generator=gen)


def build(method: str, rank: int | None, numbers: dict, seed: int = 0):
    """The model and optimizer of one method (call inside the tracker)."""
    model = new_model(numbers, seed)
    if method == "adamw":
        return model, DenseAdamW(model)
    if method == "lora":
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=rank,
                                                           lora_dropout=0.0,
                                                           target_modules=TARGETS))
        params = [p for p in model.parameters() if p.requires_grad]
        return model, torch.optim.AdamW(params, lr=1e-4, fused=True)
    rgc.wrap(model, rank, targets=TARGETS, seed=seed)
    params = [p for p in model.parameters() if p.requires_grad]
    if method == "rgc":
        return model, rgc.RGCOptimizer(params, lr=1e-3)
    return model, rgc.RowAdam(params, lr=1e-3)


def train_step(model, opt, ids: torch.Tensor) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def measure(method: str, rank: int | None, numbers: dict, timed_steps: int = 3) -> dict:
    """Measured peak (bytes) of one steady-state step, and the fastest of three timed steps."""
    with track(record=False) as t:
        ids = fixed_batch(numbers)
        model, opt = build(method, rank, numbers)
        train_step(model, opt, ids)
        t.reset_peak()
        train_step(model, opt, ids)
    peak, breakdown = t.peak, t.peak_breakdown
    times = []
    for _ in range(timed_steps):
        start = time.perf_counter()
        train_step(model, opt, ids)
        times.append(time.perf_counter() - start)
    seconds = min(times)  # the least disturbed by other work on a shared machine
    del model, opt
    gc.collect()
    return {"peak": peak, "breakdown": breakdown, "seconds": seconds}


def estimate(method: str, rank: int | None, numbers: dict):
    cfg = qwen3_config(numbers).to_dict()
    return estimate_memory(cfg, method=method, rank=rank, targets=TARGETS,
                           batch=numbers["batch"], seq_len=numbers["seq_len"])


def run(numbers: dict, ranks: list[int]) -> tuple[list[dict], dict, list[str]]:
    """Rows of the table, ``{(method, rank): (estimate, measurement)}`` and notes."""
    runs = [("adamw", None)] + [(m, r) for m in ("lora", "rgc", "rowadam") for r in ranks]
    has_rowadam = hasattr(rgc, "RowAdam")
    notes = [] if has_rowadam else ["RowAdam rows skipped: this rgc has no rgc.RowAdam."]
    rows, results = [], {}
    for method, rank in runs:
        if method == "rowadam" and not has_rowadam:
            continue
        est = estimate(method, rank, numbers)
        got = measure(method, rank, numbers)
        results[(method, rank)] = (est, got)
        print(f"{method:8s} r={rank}: measured {got['peak'] / MIB:8.1f} MiB, "
              f"estimated {est.total / MIB:8.1f} MiB, {got['seconds']:.2f} s/step", flush=True)
    base_time = results[("adamw", None)][1]["seconds"]
    for (method, rank), (est, got) in results.items():
        rows.append({
            "method": method, "rank": rank if rank is not None else "-",
            "measured MiB": got["peak"] / MIB, "estimated MiB": est.total / MIB,
            "error %": 100 * (est.total - got["peak"]) / got["peak"],
            "state MiB": est.state / MIB, "peak phase (est.)": est.phase,
            "step s": got["seconds"], "time / AdamW": got["seconds"] / base_time,
        })
    return rows, results, notes


def savings(results: dict, ranks: list[int]) -> list[dict]:
    out = []
    for r in ranks:
        lora_est, lora_got = results[("lora", r)]
        rgc_est, rgc_got = results[("rgc", r)]
        out.append({
            "rank": r,
            "RGC saving predicted MiB": (lora_est.total - rgc_est.total) / MIB,
            "RGC saving measured MiB": (lora_got["peak"] - rgc_got["peak"]) / MIB,
            "state saving MiB": (lora_est.state - rgc_est.state) / MIB,
            "RGC state / LoRA state": rgc_est.state / lora_est.state,
        })
    return out


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["method"] + ("" if r["rank"] == "-" else f"\nr={r['rank']}") for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.9), 4))
    ax.bar([i - 0.2 for i in x], [r["measured MiB"] for r in rows], 0.4, label="measured")
    ax.bar([i + 0.2 for i in x], [r["estimated MiB"] for r in rows], 0.4, label="estimated")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("training-step peak (MiB)")
    ax.set_title("Peak memory of one training step, Qwen3 ~110M, BF16, CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, no result files")
    parser.add_argument("--rank", type=int, nargs="+", default=None)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared machine, OpenMP threads "
                             "that wait for each other made step times vary 100-fold)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    numbers = QUICK if args.quick else FULL
    ranks = args.rank or ([4, 8] if args.quick else [64, 128, 256])
    rows, results, notes = run(numbers, ranks)
    saving_rows = savings(results, ranks)
    if args.quick:
        print(markdown_table(rows))
        print(markdown_table(saving_rows))
        return
    worst = max(rows, key=lambda r: abs(r["error %"]))
    below = all(r["RGC saving measured MiB"] > 0 for r in saving_rows)
    notes.insert(0, f"Largest estimate error: {worst['error %']:+.2f}% ({worst['method']} "
                      f"r={worst['rank']}). RGC's measured peak below LoRA's at every rank: "
                      f"{'yes' if below else 'no'}.")
    shape = ", ".join(f"{k}={v}" for k, v in numbers.items())
    text = ("Model and batch: " + shape + ".\n\n" + markdown_table(saving_rows) + "\n\n"
            + "".join(note + "\n\n" for note in notes)
            + "Measured: peak bytes of live tensor storages during the second training step "
            "(rgc.memory.track, which sees every tensor an operator returns), model built "
            "inside the tracker. Step time: the fastest of three untracked steps after those two, "
            f"{torch.get_num_threads()} torch thread(s) (the machine is shared: times are noisy, "
            "compare the ratios).\n\n![peak memory](memory.png)")
    write_results("memory", rows, title="Training-step memory: measured vs estimated",
                  notes=text)
    plot(rows, RESULTS / "memory.png")


if __name__ == "__main__":
    main()

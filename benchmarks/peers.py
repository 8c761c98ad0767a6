"""rgc among memory-efficient optimizers: peak and held memory, speed and loss, side by side.

One model (the ~110M random-init BF16 Qwen3 of ``benchmarks/memory.py``), one fixed batch, one
process. For each method: build the model and optimizer inside ``torch.profiler`` with
``profile_memory=True``, run a warm-up step (optimizer state is created lazily), then one
measured step (forward with the loss, backward, optimizer step, ``zero_grad``). The profiler's
memory events are the allocator's own (every allocation and free of the CPU allocator,
including those made inside custom operators and compiled kernels), so every method is counted
alike: ``held`` is what is live just before the measured step, ``peak`` the most live during it.
Then the same model trains on, to 20 updates on the same batch; the loss after 20 updates over
the loss before the first is a check that each method is set up to learn. Over the last steps a
reference dense AdamW model takes one step after each step of the method, so the step-time and
optimizer-step-time ratios are measured side by side (median of the per-pair ratios).

Methods (the seven projections are the targets wherever a method targets layers; there every
other parameter is frozen, as under rgc and LoRA; the AdamW variants train every parameter):

* ``adamw``: the FP32-master mixed-precision recipe of ``benchmarks/memory.py``;
* ``adamw-bf16``: ``torch.optim.AdamW(fused=True)`` on the BF16 parameters (BF16 moments);
* ``lora``: peft LoRA r=64 with FP32 adapters (``benchmarks/memory.py``);
* ``galore``: galore-torch ``GaLoreAdamW`` r=64 (SVD projection, gap 200, scale 0.25);
* ``apollo`` / ``apollo-mini``: apollo-torch ``APOLLOAdamW``, random projection, r=64
  channel-wise scaling (scale 1), and r=1 tensor-wise scaling (scale 128), as their paper;
* ``adamw8bit`` / ``adamw4bit`` / ``adamw-bf16-sr``: torchao ``AdamW8bit``, ``AdamW4bit`` and
  ``_AdamW(bf16_stochastic_round=True)`` on the BF16 parameters, whose per-parameter step
  torchao compiles with ``torch.compile`` (inductor's CPU backend here);
* ``bnb-adamw8bit``: bitsandbytes ``AdamW8bit`` on the BF16 parameters;
* ``rgc`` and ``rowadam`` at r = 64, 128, 256.

Every Adam-like method uses lr 1e-4 (LoRA and the projected methods included); rgc's tau is
``rgc.calibrate_lr(model, adamw_lr=1e-4)``. A peer package that is missing, or a method that
fails, gives a row whose note says why.

A mixture-of-experts run (``--moe``) puts the methods that cover expert stacks side by side
on a small random-init BF16 Qwen3-MoE (:data:`MOE_FULL`), measured the same way: ``adamw``,
``adamw-bf16``, ``lora`` (peft r=64 on the attention projections and, through peft's
``target_parameters``, on every expert stack), ``rgc`` and ``rowadam`` r=64 (``rgc.wrap``'s
default targets: the attention projections and every expert stack); the routers are frozen
wherever the method has targets.

    PYTHONPATH=src python benchmarks/peers.py            # full run, writes results/peers.*
    PYTHONPATH=src python benchmarks/peers.py --quick    # tiny model, no result files
    PYTHONPATH=src python benchmarks/peers.py --moe      # the MoE run, results/peers_moe.*
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
import traceback

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import rgc
from rgc.memory import estimate_memory

try:
    from benchmarks.common import RESULTS, environment, markdown_table
    from benchmarks.memory import (
        FULL,
        QUICK,
        TARGETS,
        DenseAdamW,
        build,
        fixed_batch,
        new_model,
        qwen3_config,
    )
except ImportError:  # run as a script from benchmarks/
    from common import RESULTS, environment, markdown_table
    from memory import FULL, QUICK, TARGETS, DenseAdamW, build, fixed_batch, new_model, qwen3_config

MIB = 2**20
LR = 1e-4
STEPS = 20
MARK = "peers::measured_step"

#: (method, rank, estimator method or None, note)
RUNS = [
    ("adamw", None, "adamw", "FP32 master copy and gradient buffers, fused AdamW"),
    ("adamw-bf16", None, "adamw-bf16", "torch AdamW(fused) on BF16 params, BF16 moments"),
    ("lora", 64, "lora", "peft, FP32 adapters, fused AdamW"),
    ("galore", 64, "galore", "galore-torch GaLoreAdamW, SVD projector (gap 200, scale 0.25)"),
    ("apollo", 64, "apollo", "apollo-torch APOLLOAdamW, random projector, channel scaling"),
    ("apollo-mini", 1, "apollo-mini", "apollo-torch APOLLOAdamW r=1, tensor scaling x128"),
    ("adamw8bit", None, "adamw8bit", "torchao AdamW8bit on BF16 params"),
    ("adamw4bit", None, "adamw4bit", "torchao AdamW4bit on BF16 params"),
    ("adamw-bf16-sr", None, "adamw-bf16-sr",
     "torchao _AdamW(bf16_stochastic_round=True), BF16 moments"),
    ("bnb-adamw8bit", None, "bnb-adamw8bit", "bitsandbytes AdamW8bit on BF16 params"),
    *[(m, r, m, "rgc.wrap, reference (CPU) step") for m in ("rgc", "rowadam")
      for r in (64, 128, 256)],
]
PEER_PACKAGES = {"galore": "galore_torch", "apollo": "apollo_torch", "apollo-mini": "apollo_torch",
                 "adamw8bit": "torchao", "adamw4bit": "torchao", "adamw-bf16-sr": "torchao",
                 "bnb-adamw8bit": "bitsandbytes", "lora": "peft"}

#: A small Qwen3-MoE (88.5 M parameters, 85% of them in expert stacks): 6 layers of 32 experts
#: of width 256, 4 routed per token, renormalised; hidden 512, a 16k vocabulary, tied.
MOE_FULL = dict(vocab_size=16000, hidden_size=512, intermediate_size=1024,
                moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4,
                norm_topk_prob=True, num_hidden_layers=6, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64, tie_word_embeddings=True, batch=2,
                seq_len=64)
MOE_QUICK = dict(MOE_FULL, vocab_size=1000, hidden_size=128, moe_intermediate_size=64,
                 num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, seq_len=16)
MOE_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MOE_STACKS = ["gate_up_proj", "down_proj"]
#: (method, rank, estimator method, note) of the MoE run.
MOE_RUNS = [
    *RUNS[:2],  # adamw, adamw-bf16
    ("lora", 64, "lora", "peft, attention + target_parameters on the expert stacks"),
    ("rgc", 64, "rgc", "rgc.wrap default targets (attention + expert stacks), reference step"),
    ("rowadam", 64, "rowadam", "rgc.wrap default targets, reference step"),
]


def moe_config(numbers: dict):
    from transformers import Qwen3MoeConfig

    cfg = {k: v for k, v in numbers.items() if k not in ("batch", "seq_len")}
    return Qwen3MoeConfig(**cfg, attn_implementation="sdpa", use_cache=False)


def build_moe(method: str, rank: int | None, numbers: dict, seed: int = 0):
    """The small Qwen3-MoE and the optimizer of one MoE row (call inside the profiler)."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM._from_config(moe_config(numbers), dtype=torch.bfloat16).train()
    if method == "adamw":
        return model, DenseAdamW(model, lr=LR)
    if method == "adamw-bf16":
        return model, torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    if method == "lora":
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(
            r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=MOE_ATTENTION,
            target_parameters=[f"mlp.experts.{s}" for s in MOE_STACKS]))
        params = [p for p in model.parameters() if p.requires_grad]
        return model, torch.optim.AdamW(params, lr=LR, fused=True)
    rgc.wrap(model, rank, seed=seed)
    params = [p for p in model.parameters() if p.requires_grad]
    make = rgc.RGCOptimizer if method == "rgc" else rgc.RowAdam
    return model, make(params, lr=rgc.calibrate_lr(model, adamw_lr=LR))


def estimated_moe_peak(method: str, rank, numbers) -> int:
    targets = MOE_ATTENTION + MOE_STACKS if method == "lora" else None
    return estimate_memory(moe_config(numbers).to_dict(), method=method, rank=rank,
                           targets=targets, batch=numbers["batch"],
                           seq_len=numbers["seq_len"]).total


def _targets_only(model) -> list:
    """Freeze every parameter but the target projections' weights; return those weights."""
    chosen = []
    for name, p in model.named_parameters():
        hit = name.rsplit(".", 2)[-2] in TARGETS
        p.requires_grad_(hit)
        if hit:
            chosen.append(p)
    return chosen


def build_method(method: str, rank: int | None, numbers: dict):
    """The model and optimizer of one row (call inside the profiler)."""
    if method in ("adamw", "lora", "rgc", "rowadam"):
        model, opt = build(method, rank, numbers)
        if method in ("rgc", "rowadam"):
            lr = rgc.calibrate_lr(model, adamw_lr=LR)
        else:
            lr = LR
        for group in (opt.opt if method == "adamw" else opt).param_groups:
            group["lr"] = lr
        return model, opt
    model = new_model(numbers)
    if method == "adamw-bf16":
        return model, torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    if method in ("galore", "apollo", "apollo-mini"):
        weights = _targets_only(model)
        if method == "galore":
            from galore_torch import GaLoreAdamW

            group = dict(params=weights, rank=rank, update_proj_gap=200, scale=0.25,
                         proj_type="std")
            return model, GaLoreAdamW([group], lr=LR)
        from apollo_torch import APOLLOAdamW

        group = dict(params=weights, rank=1 if method == "apollo-mini" else rank, proj="random",
                     update_proj_gap=200,
                     proj_type="std", scale_type="channel" if method == "apollo" else "tensor",
                     scale=1 if method == "apollo" else 128)
        return model, APOLLOAdamW([group], lr=LR)
    if method in ("adamw8bit", "adamw4bit", "adamw-bf16-sr"):
        import torchao.optim as ao

        make = {"adamw8bit": ao.AdamW8bit, "adamw4bit": ao.AdamW4bit,
                "adamw-bf16-sr": lambda ps, lr: ao._AdamW(ps, lr=lr,
                                                           bf16_stochastic_round=True)}[method]
        return model, make(model.parameters(), lr=LR)
    if method == "bnb-adamw8bit":
        import bitsandbytes as bnb

        return model, bnb.optim.AdamW8bit(model.parameters(), lr=LR)
    raise ValueError(f"unknown method {method!r}")


def timed_step(model, opt, ids) -> tuple[float, float, float]:
    """(loss, whole-step seconds, optimizer step + zero_grad seconds)."""
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    mid = time.perf_counter()
    opt.step()
    opt.zero_grad()
    end = time.perf_counter()
    return loss.item(), end - start, end - mid


def allocator_bytes(prof) -> tuple[int, int]:
    """(held before, peak during) the step marked ``MARK``, from the profiler's memory events.

    Frees of blocks allocated before profiling began are not reported by the profiler, but
    for blocks allocated under an earlier profiler (its size table keeps them): the running
    sum counts what was allocated inside the profiled block once :func:`measure_memory` has
    collected such garbage first.
    """
    events = prof.profiler.kineto_results.events()
    mark = next(e for e in events if e.name() == MARK)
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    live, held, peak = 0, None, 0
    for t, nbytes in memory:
        if t > mark.end_ns():
            break
        if held is None and t >= mark.start_ns():
            held = peak = live
        live += nbytes
        if held is not None:
            peak = max(peak, live)
    return (live if held is None else held), peak


def measure_memory(method: str, rank: int | None, numbers: dict, builder=None) -> dict:
    """Build one method (``builder``, default :func:`build_method`), take a warm-up and a
    measured step; allocator bytes held and peak.

    Returns ``held_bytes``, ``peak_bytes``, the ``model``, ``opt`` and ``ids`` (for more
    steps) and ``first_loss`` (the warm-up's, before any update).
    """
    gc.collect()  # an earlier measurement's cycles, freed in this window, would count negative
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        ids = fixed_batch(numbers)
        model, opt = (builder or build_method)(method, rank, numbers)
        first_loss = timed_step(model, opt, ids)[0]  # warm-up: lazy state, compilation
        with record_function(MARK):
            timed_step(model, opt, ids)
    held, peak = allocator_bytes(prof)
    return {"held_bytes": held, "peak_bytes": peak, "model": model, "opt": opt, "ids": ids,
            "first_loss": first_loss}


def run_method(method, rank, numbers, reference, timed_pairs: int, builder=None) -> dict:
    """Measure one row; ``reference`` is the (model, optimizer) of the timing baseline."""
    got = measure_memory(method, rank, numbers, builder)
    model, opt, ids, first_loss = got["model"], got["opt"], got["ids"], got["first_loss"]
    held, peak = got["held_bytes"], got["peak_bytes"]
    del got
    seconds, ratios_step, ratios_opt = [], [], []
    for i in range(2, STEPS):
        _, step_s, opt_s = timed_step(model, opt, ids)
        if i >= STEPS - timed_pairs:
            _, ref_step, ref_opt = timed_step(*reference, ids)
            seconds.append(step_s)
            ratios_step.append(step_s / ref_step)
            ratios_opt.append(opt_s / ref_opt)
    with torch.no_grad():
        last_loss = model(input_ids=ids, labels=ids).loss.item()
    del model, opt
    gc.collect()
    return {"peak_bytes": peak, "held_bytes": held, "step_s": statistics.median(seconds),
            "opt_step_vs_adamw": statistics.median(ratios_opt),
            "step_vs_adamw": statistics.median(ratios_step),
            "loss_ratio_20": last_loss / first_loss}


def estimated_peak(method: str | None, rank, numbers) -> int | None:
    if method is None:
        return None
    try:
        est = estimate_memory(qwen3_config(numbers).to_dict(), method=method, rank=rank,
                              targets=TARGETS, batch=numbers["batch"],
                              seq_len=numbers["seq_len"])
    except ValueError:
        return None
    return est.total


def run(numbers: dict, timed_pairs: int, only: list[str] | None = None,
        partial=None, moe: bool = False) -> list[dict]:
    """The rows of :data:`RUNS` (or, ``moe``, of :data:`MOE_RUNS` on the small MoE)."""
    import importlib.util

    runs, builder, estimate = ((MOE_RUNS, build_moe, estimated_moe_peak) if moe
                               else (RUNS, build_method, estimated_peak))
    reference = builder("adamw", None, numbers)
    rows = []
    for method, rank, est_method, note in runs:
        if only and method not in only:
            continue
        row = {"method": method, "rank": rank, "peak_bytes": None, "held_bytes": None,
               "step_s": None, "opt_step_vs_adamw": None, "step_vs_adamw": None,
               "loss_ratio_20": None, "note": note,
               "estimated_peak_bytes": estimate(est_method, rank, numbers)}
        package = PEER_PACKAGES.get(method)
        if package and importlib.util.find_spec(package) is None:
            row["note"] = f"not run: {package} is not installed (pip install 'rgc-torch[peers]')"
        else:
            start = time.perf_counter()
            try:
                row |= run_method(method, rank, numbers, reference, timed_pairs, builder)
            except Exception as e:  # a failing peer is a row that says why
                traceback.print_exc()
                row["note"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            print(f"{method:14s} r={rank}: {_fmt_row(row)} ({time.perf_counter() - start:.0f} s)",
                  flush=True)
        rows.append(row)
        if partial is not None:  # rows so far, for runs split over processes
            partial.write_text(json.dumps({"rows": rows}, indent=2))
    return rows


def _fmt_row(row: dict) -> str:
    if row["peak_bytes"] is None:
        return row["note"]
    return (f"peak {row['peak_bytes'] / MIB:.1f} MiB, held {row['held_bytes'] / MIB:.1f} MiB, "
            f"step x{row['step_vs_adamw']:.2f}, opt x{row['opt_step_vs_adamw']:.2f}, "
            f"loss x{row['loss_ratio_20']:.3f}")


def table_rows(rows: list[dict]) -> list[dict]:
    """The markdown table: MiB, ratios, the estimate beside the measured peak."""
    out = []
    for r in rows:
        measured, est = r["peak_bytes"], r["estimated_peak_bytes"]

        def mib(b):
            return "-" if b is None else f"{b / MIB:.1f}"

        def num(x):
            return "-" if x is None else f"{x:.3g}"

        err = ("-" if measured is None or est is None
               else f"{100 * (est - measured) / measured:+.2f}%")
        out.append({"method": r["method"], "rank": "-" if r["rank"] is None else r["rank"],
                    "peak MiB": mib(measured), "held MiB": mib(r["held_bytes"]),
                    "estimated peak MiB": mib(est), "estimate error": err,
                    "step / AdamW": num(r["step_vs_adamw"]),
                    "opt step / AdamW": num(r["opt_step_vs_adamw"]),
                    "loss after 20 / start": num(r["loss_ratio_20"]), "note": r["note"]})
    return out


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r["peak_bytes"] is not None]
    labels = [r["method"] + ("" if r["rank"] is None else f"\nr={r['rank']}") for r in done]
    x = range(len(done))
    fig, ax = plt.subplots(figsize=(max(7, len(done) * 0.8), 4.2))
    ax.bar([i - 0.2 for i in x], [r["peak_bytes"] / MIB for r in done], 0.4,
           label="peak during a step")
    ax.bar([i + 0.2 for i in x], [r["held_bytes"] / MIB for r in done], 0.4,
           label="held between steps")
    ax.set_xticks(list(x), labels, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("MiB (allocator)")
    ax.set_title("Qwen3 ~110M, BF16, batch 2 x 64, CPU: memory of one training step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


AXES = {"peak_bytes": "peak", "held_bytes": "held", "step_vs_adamw": "step time",
        "opt_step_vs_adamw": "optimizer step time"}


def winners(rows: list[dict]) -> dict[int, list[str]]:
    """Row index -> the axes (lowest peak, held, step and optimizer-step time) it is best on."""
    out: dict[int, list[str]] = {}
    for key, axis in AXES.items():
        done = [(r[key], i) for i, r in enumerate(rows) if r[key] is not None]
        if done:
            out.setdefault(min(done)[1], []).append(axis)
    return out


NOTES = """Peak: the most bytes live in the CPU allocator during the measured step (profiler
memory events: every allocation, custom operators and compiled kernels included); held: live
just before it (weights, optimizer state, projections; gradients are freed by ``zero_grad``).
The estimate is ``rgc.estimate_memory`` with ``implementation='torch'`` (the CPU paths).
Times are ratios to a reference dense AdamW step taken right after each of the last timed
steps of the method (median), with one torch thread on a shared 2-core machine: indicative
only. "loss after 20 / start": the loss on the training batch after 20 updates over the loss
before the first; every method trains the same batch at lr 1e-4 (rgc: the calibrated tau).
GaLore and APOLLO: the measured step is a steady one (their projections are refreshed every
200 steps; GaLore's refresh adds an FP32 SVD of each gradient, not in this peak). The
estimator's step temporaries of the torchao and bitsandbytes steps are measured figures
(``rgc.memory.estimate.DENSE_STEP_TEMPORARIES``, per element of the largest parameter,
measured on a 2000 x 128 embedding and confirmed here on a 32000 x 768 one).

Run time bounds what was measured: the timing ratios use only the last 4 of the 20 steps
(``--timed-pairs 4``), one torch thread; the torchao 8- and 4-bit rows took about 15 minutes
each (their compiled CPU steps are slow). Rows can come from separate runs of the script
(``--only``, ``--partial``, then ``--merge``), each timing against its own reference AdamW;
rows whose note says "recorded to 0.1 MiB" were taken from the printed summary of a run
stopped before it wrote its files."""


def render(rows: list[dict], numbers: dict, env: dict) -> str:
    """peers.md: the table (with the estimate beside each measured peak) and the notes."""
    for r in rows:  # the estimate of the current estimator
        est_method = next((e for m, rk, e, _ in RUNS if m == r["method"] and rk == r["rank"]),
                          None)
        r["estimated_peak_bytes"] = estimated_peak(est_method, r["rank"], numbers)
    table = table_rows(rows)
    best = winners(rows)
    for i, t in enumerate(table):
        t["lowest of all"] = ", ".join(best.get(i, [])) or "-"
    shape = ", ".join(f"{k}={v}" for k, v in numbers.items())
    env_lines = "\n".join(f"- {k}: {v}" for k, v in env.items())
    return ("# rgc among memory-efficient optimizers (measured)\n\n"
            f"Model and batch: {shape}.\n\n{markdown_table(table)}\n\n{NOTES}\n\n"
            f"![memory](peers.png)\n\n## Environment\n\n{env_lines}\n")


MOE_NOTES = """Measured as the dense table (``peers.md``): profiler allocator events of one steady
step on the CPU, the estimate (``rgc.estimate_memory``, ``implementation='torch'``) beside each
measured peak. "step s" is the median wall time of the method's last timed steps (forward,
backward, optimizer step, ``zero_grad``); the ratios are to a reference dense AdamW step on the
same MoE taken right after each of them. One torch thread on a 2-core machine shared with
other jobs (the load averages below): the times are indicative only (three runs of this
script on the same code read rgc's step at 1.46x, 2.31x and 2.47x AdamW's, this table the
last), the memory figures are exact. rgc and RowAdam run the reference (CPU) step, expert by
expert; on a GPU the fused kernel updates all experts of a shape in one launch
(``benchmarks/gpu_experts.py`` measures it). Every method
trains the same batch at lr 1e-4 (rgc and RowAdam: the calibrated tau). LoRA, rgc and RowAdam
train the attention projections and every expert stack, the routers frozen; the AdamW rows
train every parameter. LoRA on an expert stack is peft's ``target_parameters``
parametrization, which forms the merged ``W + B A`` of every stack in each forward and keeps it
for backward: one more copy of the expert weights beside the adapters' state. rgc's peak comes
in the backward of the first decoder layer (its activations and backward transients beside the
sketches of all layers), which the estimate, taking the sketches plus the step's temporaries,
misses by 1.4 MiB (-0.6%)."""


def render_moe(rows: list[dict], numbers: dict, env: dict) -> str:
    """peers_moe.md: the MoE table (with the current estimator's estimates) and the notes."""
    for r in rows:
        est_method = next(e for m, rk, e, _ in MOE_RUNS if m == r["method"] and rk == r["rank"])
        r["estimated_peak_bytes"] = estimated_moe_peak(est_method, r["rank"], numbers)
    table, best = [], winners(rows)
    for i, (r, t) in enumerate(zip(rows, table_rows(rows), strict=True)):
        step = "-" if r.get("step_s") is None else f"{r['step_s']:.3g}"
        table.append({k: v for k, v in t.items() if k != "note"}
                     | {"step s": step, "note": t["note"],
                        "lowest of all": ", ".join(best.get(i, [])) or "-"})
    shape = ", ".join(f"{k}={v}" for k, v in numbers.items())
    env_lines = "\n".join(f"- {k}: {v}" for k, v in env.items())
    return ("# rgc among full-weight and LoRA training of a mixture of experts (measured)\n\n"
            f"Qwen3-MoE, BF16, random init: {shape}.\n\n{markdown_table(table)}\n\n"
            f"{MOE_NOTES}\n\n## Environment\n\n{env_lines}\n")


#: The predicted table: configs, tokens per GPU, the methods (estimator name, rank).
SCALE_CONFIGS = ("qwen3-1.7b", "qwen3-8b", "llama-3-70b")
SCALE_BATCH, SCALE_SEQ, SCALE_GPUS, BUDGET = 1, 2048, 8, 80 * 10**9
SCALE_METHODS = [("adamw", None), ("adamw-bf16", None), ("adamw8bit", None),
                 ("adamw4bit", None), ("bnb-adamw8bit", None), ("lora", 64), ("galore", 64),
                 ("apollo", 64), ("apollo-mini", None), ("rgc", 64), ("rgc", 256),
                 ("rowadam", 64)]


#: Mixture-of-experts configs of the predicted table.
SCALE_MOE_CONFIGS = ("qwen3-30b-a3b", "qwen3-235b-a22b")


def predict(names=SCALE_CONFIGS) -> tuple[list[dict], list[dict]]:
    """Per config and method: state and peak per GPU on one GPU and FSDP2 over 8 (GiB), and
    per method the largest of the configs whose peak fits in 80 GB."""
    configs = RESULTS.parent / "configs"
    rows, fits = [], {}
    for name in names:
        cfg = configs / f"{name}.json"
        per_model = []
        for method, rank in SCALE_METHODS:
            row = {"model": name, "method": method, "rank": "-" if rank is None else rank}
            for gpus in (1, SCALE_GPUS):
                col = "1 GPU" if gpus == 1 else f"FSDP2 x{gpus}"
                try:
                    e = estimate_memory(cfg, method=method, rank=rank, batch=SCALE_BATCH,
                                        seq_len=SCALE_SEQ, implementation="triton", fsdp=gpus)
                except ValueError:  # no FSDP2 model, or no expert support, for this method
                    row[f"state GiB, {col}"] = row[f"peak GiB, {col}"] = None
                    fits[(method, rank, col)] = "n/a"
                    continue
                row[f"state GiB, {col}"] = e.state / 2**30
                row[f"peak GiB, {col}"] = e.total / 2**30
                if e.total <= BUDGET:
                    fits[(method, rank, col)] = name  # the configs grow in size
            per_model.append(row)
        for key in [k for k in per_model[0] if "GiB" in k]:
            done = [(r[key], i) for i, r in enumerate(per_model) if r[key] is not None]
            per_model[min(done)[1]].setdefault("lowest", []).append(key)
        rows += per_model
    table = []
    for r in rows:
        cells = {k: ("n/a" if v is None else f"{v:.2f}" if isinstance(v, float) else v)
                 for k, v in r.items() if k != "lowest"}
        cells["lowest of all"] = "; ".join(r.get("lowest", [])) or "-"
        table.append(cells)
    largest = [{"method": m, "rank": "-" if rk is None else rk,
                "largest that fits, 1 GPU": fits.get((m, rk, "1 GPU"), "none"),
                f"largest that fits, FSDP2 x{SCALE_GPUS}":
                    fits.get((m, rk, f"FSDP2 x{SCALE_GPUS}"), "none")}
               for m, rk in SCALE_METHODS]
    return table, largest


SCALE_NOTES = f"""Predicted by ``rgc.estimate_memory`` (GPU paths: ``implementation='triton'``,
bitsandbytes' CUDA kernel) at batch {SCALE_BATCH} x {SCALE_SEQ} tokens per GPU, BF16 weights,
no activation checkpointing, SDPA attention; GiB = 2**30 bytes, the 80 GB budget is 80e9
bytes. "state" is everything a method adds to the weights except activations and transients
(optimizer state, master copy, gradients, adapters, sketches, projections). FSDP2: weights,
gradients, master copy, optimizer state and adapters sharded over the GPUs; rgc's sketches and
projections are whole on every GPU (the sketches are reduce-scattered at the step); the root
module's parameters (embedding, lm_head) and two decoder layers are gathered during forward and
backward. RowAdam, galore-torch and apollo-torch do not run on FSDP2's sharded parameters
(n/a). Configs: ``benchmarks/configs/`` (public architecture numbers; the 70B is Llama-3-70B's
shape). "largest that fits" is the largest of these three models whose predicted peak fits.
Dense AdamW is the FP32-master recipe; the 8-bit and 4-bit AdamW variants train every
parameter in BF16; LoRA, GaLore, APOLLO and rgc train the seven projections only."""


SCALE_MOE_NOTES = f"""Mixture-of-experts models (Qwen3-30B-A3B: 28.99 of 30.53 B parameters in
expert stacks; Qwen3-235B-A22B: 227.1 of 235.1 B), at the same {SCALE_BATCH} x {SCALE_SEQ} tokens
per GPU, with the activation model of Qwen3-MoE decoders (router, routed rows, the experts'
products; measured to the byte on tiny models, ``tests/test_memory_estimate.py``). Every method
trains what ``rgc.wrap``'s default targets cover: the attention projections and every expert
stack (``gate_up_proj``, ``down_proj``; LoRA through peft's ``target_parameters``), the routers
frozen; dense AdamW and its BF16, 8-bit and 4-bit variants train all parameters. LoRA's peak
includes peft's merged ``W + B A`` copy of every expert stack, formed in each forward and kept
for backward (batch-independent; measured with peft 0.21 on BF16 experts). GaLore and APOLLO
update 2-D weights only (n/a). FSDP2 x{SCALE_GPUS} for rgc shards the
stacks over experts (FSDP2's default, trained on CPU by ``tests/test_distributed_experts.py``);
the per-rank estimate is within 0.01% of the measured peak of each rank of a 2-process CPU run
of small Qwen3-MoE and Mixtral models (``fsdp_memory_cpu.md``)."""


def write_predictions() -> None:
    table, largest = predict()
    moe_table, moe_largest = predict(SCALE_MOE_CONFIGS)
    text = ("# rgc among memory-efficient optimizers (predicted at LLM scale)\n\n"
            f"{markdown_table(table)}\n\n{markdown_table(largest)}\n\n{SCALE_NOTES}\n\n"
            "## Mixture of experts\n\n"
            f"{markdown_table(moe_table)}\n\n{markdown_table(moe_largest)}\n\n"
            f"{SCALE_MOE_NOTES}\n")
    (RESULTS / "peers_scale.md").write_text(text)
    (RESULTS / "peers_scale.json").write_text(json.dumps(
        {"rows": table, "largest": largest, "moe_rows": moe_table, "moe_largest": moe_largest,
         "env": environment()}, indent=2))
    print(text)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, no result files")
    parser.add_argument("--timed-pairs", type=int, default=4,
                        help="steps (of the 20) each followed by a timed reference AdamW step")
    parser.add_argument("--only", nargs="+", default=None, help="run only these methods")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--partial", default=None,
                        help="also write the rows so far to this JSON file after each row")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="write peers.json from the rows of runs split over processes "
                             "(files written by --partial), then render it")
    parser.add_argument("--render", action="store_true",
                        help="rewrite peers.md and peers.png from peers.json (no measuring)")
    parser.add_argument("--predict", action="store_true",
                        help="write the predicted table, peers_scale.md/.json (no measuring)")
    parser.add_argument("--moe", action="store_true",
                        help="the mixture-of-experts rows (MOE_RUNS), results/peers_moe.*")
    args = parser.parse_args(argv)
    if args.moe:
        run_moe(args)
        return
    if args.predict:
        write_predictions()
        return
    if args.merge:
        order = {(m, r): i for i, (m, r, _, _) in enumerate(RUNS)}
        rows = [row for f in args.merge for row in json.loads(open(f).read())["rows"]]
        rows.sort(key=lambda row: order[(row["method"], row["rank"])])
        env = environment() | {pkg: _version(pkg) for pkg in
                               ("galore-torch", "apollo-torch", "torchao", "bitsandbytes")}
        (RESULTS / "peers.json").write_text(json.dumps({"rows": rows, "env": env}, indent=2))
    if args.render or args.merge:
        saved = json.loads((RESULTS / "peers.json").read_text())
        (RESULTS / "peers.md").write_text(render(saved["rows"], FULL, saved["env"]))
        (RESULTS / "peers.json").write_text(json.dumps(saved, indent=2))
        plot(saved["rows"], RESULTS / "peers.png")
        return
    torch.set_num_threads(args.threads)
    # torchao compiles its step once per parameter shape; the default limit of 8 recompiles
    # would silently send the remaining shapes to eager mode.
    torch._dynamo.config.cache_size_limit = 64
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    numbers = QUICK if args.quick else FULL
    from pathlib import Path

    rows = run(numbers, args.timed_pairs, args.only,
               Path(args.partial) if args.partial else None)
    print(markdown_table(table_rows(rows)))
    if args.quick:
        return
    env = environment() | {pkg: _version(pkg) for pkg in
                           ("galore-torch", "apollo-torch", "torchao", "bitsandbytes")}
    (RESULTS / "peers.md").write_text(render(rows, numbers, env))
    (RESULTS / "peers.json").write_text(json.dumps({"rows": rows, "env": env}, indent=2))
    plot(rows, RESULTS / "peers.png")


def run_moe(args) -> None:
    """``--moe``: measure (or, with ``--render``, rewrite from peers_moe.json) the MoE table."""
    md, js = RESULTS / "peers_moe.md", RESULTS / "peers_moe.json"
    if args.render:
        saved = json.loads(js.read_text())
        md.write_text(render_moe(saved["rows"], MOE_FULL, saved["env"]))
        return
    torch.set_num_threads(args.threads)
    numbers = MOE_QUICK if args.quick else MOE_FULL
    start_load = _load_average()
    rows = run(numbers, args.timed_pairs, args.only, moe=True)
    env = environment() | {"load average (1, 5, 15 min) at start": start_load,
                           "load average at end": _load_average()}
    text = render_moe(rows, numbers, env)
    print(text)
    if not args.quick:
        md.write_text(text)
        js.write_text(json.dumps({"rows": rows, "env": env}, indent=2))


def _load_average() -> str:
    """The machine's 1, 5 and 15 minute load averages (other work beside the benchmark)."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _version(pkg: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


if __name__ == "__main__":
    main()

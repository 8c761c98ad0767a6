"""GRPO on signed 3-digit arithmetic: RGC vs dense AdamW vs peft LoRA, over GRPO seeds, on CPU.

    bash scripts/demo.sh                                         # the default preset
    PYTHONPATH=src python examples/grpo_arithmetic.py            # the same, in this venv
    PYTHONPATH=src python examples/grpo_arithmetic.py --quick    # about a minute (smoke run)
    PYTHONPATH=src python examples/grpo_arithmetic.py --full     # longer: 5 seeds, + RowAdam
    PYTHONPATH=src python examples/grpo_arithmetic.py --moe      # a Qwen3-MoE policy (--quick too)
    PYTHONPATH=src .venv-vllm/bin/python examples/grpo_arithmetic.py --moe --vllm  # vLLM rollouts

One base policy (a small random-init Qwen3, or a Qwen3-MoE with --moe, warm-started with dense
AdamW to a stated dev accuracy, cached under .cache/grpo) is trained by every method with GRPO
over several seeds (prompts, sampling and each method's own randomness change with the seed;
the base and the questions do not). Every method tries the same learning-rate multipliers,
chosen on dev before the test set is read. The verdict pools the paired test differences over
seeds and questions.
See docs/demo.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from dataclasses import asdict, replace
from pathlib import Path

import torch

import rgc.compute

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo.experiment import Preset, run_experiment  # noqa: E402
from grpo.model import ModelConfig, MoEConfig, WarmStart, WarmStartError  # noqa: E402
from grpo.report import plot, seed_rows, verdict, verdict_lines, verdict_table  # noqa: E402
from grpo.train import GRPOSettings  # noqa: E402

from benchmarks.common import environment, markdown_table  # noqa: E402

PRESETS = {
    # A pipeline check, not a learning one: this tiny model scores 0-2% on dev after a few
    # hundred supervised steps, so its warm start has no accuracy to reach (target 0).
    "quick": Preset(model=ModelConfig(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128),
                    warm=WarmStart(max_steps=40, check_every=40, target_dev=0.0),
                    grpo=GRPOSettings(steps=3, prompts_per_step=4, group_size=4, eval_every=3,
                                      memory_steps=1),
                    seeds=(0, 1), n_train=5000, n_dev=64, n_test=500, rank=8),
    # Dev every 50 steps: 7 points per curve; each check of 1,000 questions costs about 1% of
    # a run, and the last one (step 300) is the one the choice of rates reads.
    "default": Preset(model=ModelConfig(), warm=WarmStart(), grpo=GRPOSettings(eval_every=50)),
    "full": Preset(model=ModelConfig(), warm=WarmStart(), grpo=GRPOSettings(eval_every=50),
                   seeds=(0, 1, 2, 3, 4), selection="per_seed"),
}
# The MoE policy: RGC, dense AdamW and LoRA train the same attention projections and expert
# stacks (dense AdamW also the embeddings, norms and head; no method the routers).
MOE_METHODS = ("adamw", "lora", "rgc", "rowadam")
PRESETS["moe_quick"] = replace(PRESETS["quick"], methods=MOE_METHODS, model=MoEConfig(
    hidden=64, layers=2, heads=2, kv_heads=1, intermediate=64, experts=4))
PRESETS["moe"] = Preset(model=MoEConfig(), warm=WarmStart(), grpo=GRPOSettings(eval_every=50),
                        methods=MOE_METHODS)


def write_results(out: Path, record: dict) -> None:
    """results.md, results.json and dev_accuracy.png in ``out``, from one experiment's record.

    record: ``preset`` (name), ``settings`` (the preset as plain data), ``env``, and what
    :func:`run_experiment` returned; the verdict and tables are (re)computed from it.
    """
    settings, timing = record["settings"], record["timing"]
    rows, judged = seed_rows(record), verdict(record)
    table = markdown_table(rows)
    vtable = markdown_table(verdict_table(judged, settings["seeds"]))
    summary = verdict_lines(judged, record)
    notes = [f"policy: {record['policy']}"] if "policy" in record else []
    notes += [f"preset `{record['preset']}`: GRPO seeds {list(settings['seeds'])}, base seed "
             f"{settings['base_seed']}; methods {', '.join(settings['methods'])}; every method "
             f"tries {list(settings['multipliers'])} x its rate, chosen on dev "
             + ("on the first seed" if settings["selection"] == "first_seed" else "on each seed"),
             f"time: {timing['wall_s']:.0f} s wall, {timing['cpu_s']:.0f} s CPU on "
             f"{timing['workers']} worker(s); of which warm start (or cache load) and base "
             f"evaluation {timing['warm_start_and_base_eval_s']:.0f} s wall"
             + (f", {timing['warm_start_and_base_eval_cpu_s']:.0f} s CPU"
                if "warm_start_and_base_eval_cpu_s" in timing else "")]
    followed = [r for r in record["runs"] if "engine" in r]
    if followed:
        payloads = sum(r["engine"]["payloads"] for r in followed)
        loads = sum(r["engine"]["full_loads"] for r in followed)
        exact = all(r["engine"]["bit_exact_at_end"] for r in followed)
        notes.append(f"rollouts sampled by a vLLM engine that followed every policy: "
                     f"{payloads} rgc payloads and {loads} full loads in {len(followed)} runs; "
                     f"the engine held each policy's weights bit for bit at the end of its "
                     f"run: {exact}")
    env_lines = "\n".join(f"- {k}: {v}" for k, v in record["env"].items())
    (out / "results.md").write_text(
        f"# GRPO on arithmetic ({record['preset']})\n\n## Verdict\n\n{summary[0]}\n\n"
        + "\n".join(f"- {line.strip()}" for line in summary[1:])
        + f"\n\n{vtable}\n\n## Every seed\n\n{table}\n\n"
        + "\n".join(f"- {n}" for n in notes)
        + f"\n\n![dev accuracy](dev_accuracy.png)\n\n## Environment\n\n{env_lines}\n")
    (out / "results.json").write_text(json.dumps(
        {**record, "verdict": judged, "table": rows}, indent=1, default=str))
    plot(record, out / "dev_accuracy.png")
    print(table, vtable, "\n".join(notes), "\n".join(summary), sep="\n\n")
    print(f"results in {out}")


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smoke run, about a minute")
    size.add_argument("--full", action="store_true", help="5 seeds, rates chosen per seed, "
                      "RowAdam too")
    size.add_argument("--report", type=Path, metavar="DIR",
                      help="train nothing: rewrite DIR's tables and plot from its results.json")
    parser.add_argument("--moe", action="store_true",
                        help="a Qwen3-MoE policy (8 experts, top 2) instead of the dense one; "
                             "with --quick, its smoke run")
    parser.add_argument("--vllm", action="store_true",
                        help="sample the rollouts with a vLLM engine (installed: "
                             "scripts/setup_vllm.sh) that follows each policy, by rgc payloads "
                             "for RGC and RowAdam; runs the methods it can follow (no LoRA)")
    parser.add_argument("--seed", type=int, nargs="+", help="GRPO seeds; overrides the preset's")
    parser.add_argument("--base-seed", type=int,
                        help="seed of the base policy and of the questions (preset: 0)")
    parser.add_argument("--out", type=Path, help="output folder (default runs/grpo_<preset>)")
    parser.add_argument("--cache-dir", type=Path, default=ROOT / ".cache" / "grpo",
                        help="where warm-started base policies are kept")
    parser.add_argument("--workers", type=int, default=2,
                        help="GRPO runs in parallel, one process each (default 2; the results "
                             "do not depend on it)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads per process (default 1: these matrices are too "
                             "small to gain from more, and one thread keeps timings steady)")
    parser.add_argument("--compute", choices=["auto", "float32", "native"],
                        help="matmul dtype for the BF16 policies: float32 (for CPUs without fast "
                             "BF16 matmuls), native, or auto (measured); default: "
                             f"${rgc.compute.ENV_VAR} if set, else auto")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.report:
        write_results(args.report, json.loads((args.report / "results.json").read_text()))
        return args.report
    torch.set_num_threads(args.threads)
    compute = rgc.compute.choose_compute_mode(override=args.compute)
    print(f"compute mode: {compute}", flush=True)
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")

    name = "quick" if args.quick else "full" if args.full else "default"
    if args.moe:
        if args.full:
            parser.error("--moe has a default and a --quick preset, no --full")
        name = "moe_quick" if args.quick else "moe"
    preset = PRESETS[name]
    if args.seed:
        preset = replace(preset, seeds=tuple(args.seed))
    if args.base_seed is not None:
        preset = replace(preset, base_seed=args.base_seed)
    if args.vllm:
        from grpo.engine import ENGINE_METHODS

        left_out = [m for m in preset.methods if m not in ENGINE_METHODS]
        if left_out:
            print(f"--vllm: {', '.join(left_out)} left out (the engine cannot follow its "
                  "weights)", flush=True)
        preset = replace(preset, methods=tuple(m for m in preset.methods
                                               if m in ENGINE_METHODS))
        name += "_vllm"
    out = args.out or ROOT / "runs" / f"grpo_{name}"
    out.mkdir(parents=True, exist_ok=True)

    def log(line):
        print(line, flush=True)

    try:
        outcome = run_experiment(preset, cache_dir=args.cache_dir, compute=compute,
                                 workers=args.workers, threads=args.threads,
                                 progress=not args.no_progress, vllm=args.vllm, log=log)
    except WarmStartError as e:
        sys.exit(f"error: {e}")
    settings = {k: (asdict(v) if hasattr(v, "__dataclass_fields__") else v)
                for k, v in vars(preset).items()}
    env = environment() | {"compute mode": str(compute)}
    write_results(out, {"preset": name, "policy": preset.model.describe(), "settings": settings,
                        "env": env, **outcome})
    return out


if __name__ == "__main__":
    main()

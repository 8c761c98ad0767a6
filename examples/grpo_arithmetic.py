"""GRPO on signed 3-digit arithmetic: RGC vs dense AdamW vs peft LoRA (vs RowAdam), on CPU.

    PYTHONPATH=src python examples/grpo_arithmetic.py            # about 5 minutes, 2 cores
    PYTHONPATH=src python examples/grpo_arithmetic.py --quick    # under a minute (smoke run)
    PYTHONPATH=src python examples/grpo_arithmetic.py --full     # longer, two seeds

Every method starts from the same supervised base policy (a small random-init Qwen3 warm-started
with dense AdamW, cached under .cache/grpo), trains with the same GRPO rollouts, and is scored
by greedy exact match on held-out questions. RGC tries tau and 3 tau from ``rgc.calibrate_lr``
and keeps the one with the better dev accuracy before the test set is touched. See docs/demo.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import rgc.compute

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo.methods import METHODS  # noqa: E402
from grpo.model import ModelConfig, WarmStart, warm_start  # noqa: E402
from grpo.rollout import accuracy  # noqa: E402
from grpo.stats import paired_difference  # noqa: E402
from grpo.task import make_splits  # noqa: E402
from grpo.train import GRPOSettings, run_grpo  # noqa: E402

from benchmarks.common import environment, markdown_table  # noqa: E402


@dataclass(frozen=True)
class Preset:
    model: ModelConfig
    warm: WarmStart
    grpo: GRPOSettings
    n_train: int = 20000
    n_dev: int = 1000
    n_test: int = 2000
    rank: int = 16
    adamw_lr: float = 1e-4
    lora_lr: float = 1e-3
    # Learning-rate multipliers tried per method; the best final dev accuracy is kept.
    candidates: dict = field(default_factory=lambda: {
        "adamw": (1.0,), "lora": (1.0,), "rgc": (1.0, 3.0), "rowadam": (1.0,)})
    seeds: tuple = (0,)


PRESETS = {
    "quick": Preset(model=ModelConfig(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128),
                    warm=WarmStart(max_steps=40, check_every=20), n_train=5000, n_dev=64,
                    n_test=500, rank=8,
                    grpo=GRPOSettings(steps=3, prompts_per_step=4, group_size=4, eval_every=3,
                                      memory_steps=1)),
    "default": Preset(model=ModelConfig(), warm=WarmStart(), grpo=GRPOSettings()),
    "full": Preset(model=ModelConfig(), warm=WarmStart(), grpo=GRPOSettings(steps=400),
                   seeds=(0, 1), candidates={"adamw": (1.0, 3.0), "lora": (1.0, 3.0),
                                             "rgc": (1.0, 3.0), "rowadam": (1.0, 3.0)}),
}


def build_method(kind: str, mult: float, base_state: dict, preset: Preset, seed: int,
                 compute: rgc.compute.ComputeMode):
    cls = METHODS[kind]
    kwargs = dict(rank=preset.rank, seed=seed, steps=preset.grpo.steps)
    if kind == "rgc":  # tau = mult * calibrate_lr(model, adamw_lr)
        method = cls(base_state, preset.model, lr=preset.adamw_lr, tau_scale=mult, **kwargs)
    else:
        lr = (preset.lora_lr if kind == "lora" else preset.adamw_lr) * mult
        method = cls(base_state, preset.model, lr=lr, **kwargs)
    # After rgc.wrap / peft: the compute mode covers the policy as it will be called.
    rgc.compute.use_compute_dtype(method.policy, compute)
    return method


def run_seed(preset: Preset, seed: int, cache_dir: Path, progress: bool,
             compute: rgc.compute.ComputeMode) -> dict:
    train, dev, test = make_splits(seed, preset.n_train, preset.n_dev, preset.n_test)
    base_state, base_path = warm_start(preset.model, preset.warm, train, dev, seed, cache_dir,
                                       progress=progress, compute=compute)
    base = preset.model.build(seed)
    base.load_state_dict(base_state)
    rgc.compute.use_compute_dtype(base, compute)
    base_dev = float(accuracy(base, dev).mean())
    base_test = accuracy(base, test)
    reference = base if preset.grpo.kl_coef > 0 else None
    print(f"seed {seed}: base policy {base_path.name}: dev {base_dev:.3f}, "
          f"test {float(base_test.mean()):.3f}")

    runs, chosen = [], {}
    for kind, mults in preset.candidates.items():
        if kind not in METHODS:
            continue
        best = None
        for mult in mults:
            method = build_method(kind, mult, base_state, preset, seed, compute)
            result = run_grpo(method, train, dev, preset.grpo, seed=seed, base_dev=base_dev,
                              reference=reference, progress=progress)
            runs.append(result)
            if best is None or result["final_dev"] > best[0]["final_dev"]:
                best = (result, method)
        chosen[kind] = best

    # Only now, with every choice made on dev, is the test set used.
    methods = {}
    after = {}
    for kind, (result, method) in chosen.items():
        after[kind] = accuracy(method.policy, test)
        stat = paired_difference(base_test, after[kind], seed=seed)
        methods[kind] = {**result, "test_after": float(after[kind].mean()), "vs_base": stat,
                         "test_correct": _bits(after[kind])}
    if "rgc" in after and "adamw" in after:
        methods["rgc"]["vs_adamw"] = paired_difference(after["adamw"], after["rgc"], seed=seed)
    return {"seed": seed, "base": {"dev": base_dev, "test": float(base_test.mean()),
                                   "test_correct": _bits(base_test), "cache": base_path.name},
            "runs": runs, "methods": methods}


def _bits(correct: torch.Tensor) -> str:
    """Per-question 0/1 correctness as a string, kept in the JSON for re-analysis."""
    return "".join(str(int(c)) for c in correct.tolist())


def _unbits(bits: str) -> torch.Tensor:
    return torch.tensor([float(c) for c in bits])


def summary_notes(results: list[dict]) -> list[str]:
    """RGC - AdamW per seed and, over several seeds, pooled over all test questions."""
    notes = []
    pairs = []
    for res in results:
        m = res["methods"]
        if "rgc" in m and "adamw" in m:
            pairs.append((_unbits(m["adamw"]["test_correct"]), _unbits(m["rgc"]["test_correct"])))
            notes.append(f"seed {res['seed']}: " + _diff_text(m["rgc"]["vs_adamw"]))
    if len(pairs) > 1:
        adamw, rgc_ = (torch.cat(x) for x in zip(*pairs, strict=True))
        notes.append(f"pooled over {len(pairs)} seeds: "
                     + _diff_text(paired_difference(adamw, rgc_, seed=0)))
        for kind in results[0]["methods"]:
            accs = [100 * r["methods"][kind]["test_after"] for r in results]
            base = [100 * r["base"]["test"] for r in results]
            notes.append(f"{kind}: mean test accuracy {sum(accs) / len(accs):.1f}% "
                         f"(base {sum(base) / len(base):.1f}%)")
    return notes


def _diff_text(s: dict) -> str:
    return (f"RGC - AdamW test accuracy {s['diff_points']:+.1f} pts "
            f"[{s['ci_low']:+.1f}, {s['ci_high']:+.1f}], McNemar p {s['mcnemar_p']:.2g}")


def table_rows(results: list[dict]) -> list[dict]:
    rows = []
    for res in results:
        for m in res["methods"].values():
            s = m["vs_base"]
            rows.append({
                "seed": res["seed"], "method": m["label"],
                "test before %": round(100 * res["base"]["test"], 1),
                "test after %": round(100 * m["test_after"], 1),
                "change [95% CI] (pts)": f"{s['diff_points']:+.1f} "
                                         f"[{s['ci_low']:+.1f}, {s['ci_high']:+.1f}]",
                "McNemar p": f"{s['mcnemar_p']:.2g}",
                "train peak MiB": round(m["train_peak_bytes"] / 2**20, 2),
                "loop peak MiB": round(m["loop_peak_bytes"] / 2**20, 2),
                "s/step": round(m["s_per_step"], 3),
                "trainable params": m["trainable_params"],
                "extra state KiB": round(m["extra_state_bytes"] / 2**10, 1),
            })
    return rows


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.2), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        chosen = {m["label"] for m in res["methods"].values()}
        colors = {}
        for run in res["runs"]:
            color = colors.setdefault(run["kind"], f"C{len(colors)}")
            steps, acc = zip(*run["dev_curve"], strict=True)
            kept = run["label"] in chosen
            ax.plot(steps, [100 * a for a in acc], marker="o" if kept else ".", ms=3,
                    color=color, ls="-" if kept else ":", alpha=1.0 if kept else 0.6,
                    label=run["label"] + ("" if kept else " (not kept)"))
        ax.axhline(100 * res["base"]["dev"], color="grey", lw=0.8, label="base")
        ax.set(xlabel="GRPO step", ylabel="dev accuracy (%)", title=f"seed {res['seed']}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smoke run, under a minute")
    size.add_argument("--full", action="store_true", help="longer run over two seeds")
    parser.add_argument("--seed", type=int, nargs="+", help="seed(s); overrides the preset's")
    parser.add_argument("--out", type=Path, help="output folder (default runs/grpo_<preset>)")
    parser.add_argument("--cache-dir", type=Path, default=ROOT / ".cache" / "grpo",
                        help="where warm-started base policies are kept")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: these matrices are too small to "
                             "gain from more, and one thread keeps timings steady)")
    parser.add_argument("--compute", choices=["auto", "float32", "native"],
                        help="matmul dtype for the BF16 policies: float32 (for CPUs without fast "
                             "BF16 matmuls), native, or auto (measured); default: "
                             f"${rgc.compute.ENV_VAR} if set, else auto")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    compute = rgc.compute.choose_compute_mode(override=args.compute)
    print(f"compute mode: {compute}", flush=True)
    # peft 0.21 calls a transformers 5 API that warns of its own deprecation on every step.
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")

    name = "quick" if args.quick else "full" if args.full else "default"
    preset = PRESETS[name]
    seeds = tuple(args.seed) if args.seed else preset.seeds
    out = args.out or ROOT / "runs" / f"grpo_{name}"
    out.mkdir(parents=True, exist_ok=True)

    results = [run_seed(preset, s, args.cache_dir, not args.no_progress, compute)
               for s in seeds]
    rows = table_rows(results)
    table = markdown_table(rows)
    env = environment() | {"compute mode": str(compute)}
    notes = [f"preset `{name}`, seeds {list(seeds)}; methods run: "
             f"{', '.join(k for k in preset.candidates if k in METHODS)}"]
    notes += summary_notes(results)
    env_lines = "\n".join(f"- {k}: {v}" for k, v in env.items())
    (out / "results.md").write_text(
        f"# GRPO on arithmetic ({name})\n\n{table}\n\n" + "\n".join(f"- {n}" for n in notes)
        + f"\n\n![dev accuracy](dev_accuracy.png)\n\n## Environment\n\n{env_lines}\n")
    settings = {k: (asdict(v) if hasattr(v, "__dataclass_fields__") else v)
                for k, v in vars(preset).items()}
    (out / "results.json").write_text(json.dumps(
        {"preset": name, "settings": settings, "seeds": list(seeds), "env": env,
         "results": results, "table": rows}, indent=1, default=str))
    plot(results, out / "dev_accuracy.png")
    print(table)
    print("\n".join(notes))
    print(f"results in {out}")
    return out


if __name__ == "__main__":
    main()

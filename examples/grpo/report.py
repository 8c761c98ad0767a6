"""What an experiment's results say: per-seed rows, the pooled verdict, the dev-accuracy plot.

Every comparison is paired: the same test questions, scored by two policies (or by a policy
and the shared base). Per seed, the interval is a bootstrap over questions and the p-value
McNemar's; pooled, the interval is a bootstrap over seeds and questions
(:func:`grpo.stats.seeds_and_questions_bootstrap`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from grpo.experiment import unbits
from grpo.methods import METHODS
from grpo.stats import paired_difference, seeds_and_questions_bootstrap


def comparisons(kinds) -> list[tuple[str, str]]:
    """(a, b) pairs reported as ``a - b``: RGC against every other method, RowAdam + predicted
    KL (the LoGRA recipe) against dense AdamW and LoRA, and dense AdamW on the projections
    against dense AdamW on every parameter (does the trainable set matter)."""
    pairs = [("rgc", k) for k in kinds if k != "rgc"] if "rgc" in kinds else []
    if "rowadam" in kinds:
        pairs += [("rowadam", k) for k in ("adamw", "adamw_proj", "lora") if k in kinds]
    if {"adamw", "adamw_proj"} <= set(kinds):
        pairs.append(("adamw_proj", "adamw"))
    return pairs


def _ci(s: dict) -> str:
    return f"{s['diff_points']:+.1f} [{s['ci_low']:+.1f}, {s['ci_high']:+.1f}]"


def verdict(outcome: dict, *, seed: int = 0) -> list[dict]:
    """One row per comparison: each seed's difference (points, 95% CI over questions, McNemar
    p) and the pooled one (95% CI over seeds and questions). Rows ``X - base`` first.

    Each seed's bootstrap draws from that GRPO seed (as :func:`seed_rows` does, so the two
    tables agree); the pooled bootstrap from ``seed``.
    """
    chosen = outcome["chosen"]
    kinds = list(chosen[0]["methods"])
    base = unbits(outcome["base"]["test_correct"])
    correct = {k: [unbits(c["methods"][k]["test_correct"]) for c in chosen] for k in kinds}
    rows = []
    pairs = [(k, None) for k in kinds] + comparisons(kinds)
    for a, b in pairs:
        before = [base] * len(chosen) if b is None else correct[b]
        per_seed = [paired_difference(x, y, seed=c["seed"])
                    for x, y, c in zip(before, correct[a], chosen, strict=True)]
        diffs = np.stack([(y - x).double().numpy() for x, y in zip(before, correct[a],
                                                                  strict=True)])
        pooled = seeds_and_questions_bootstrap(diffs, shared_questions=True, seed=seed)
        against = "base" if b is None else METHODS[b].name
        rows.append({"comparison": f"{METHODS[a].name} - {against}", "a": a, "b": b,
                     "per_seed": per_seed, "pooled": pooled})
    return rows


def verdict_table(rows: list[dict], seeds) -> list[dict]:
    """The verdict as markdown-table rows (points, 95% CI)."""
    out = []
    for r in rows:
        cells = {"comparison (test pts)": r["comparison"]}
        for s, st in zip(seeds, r["per_seed"], strict=True):
            cells[f"seed {s}"] = f"{_ci(st)}, p {st['mcnemar_p']:.2g}"
        cells[f"pooled, {len(seeds)} seeds"] = _ci(r["pooled"])
        out.append(cells)
    return out


def verdict_lines(rows: list[dict], outcome: dict) -> list[str]:
    """The pooled verdict in words: one line per comparison against RGC and per trainable set."""
    n_seeds, n = rows[0]["pooled"]["seeds"], rows[0]["pooled"]["n"]
    lines = [f"Pooled over {n_seeds} GRPO seeds x {n} test questions (one shared base, test "
             f"{100 * outcome['base']['test']:.1f}%; 95% CI over seeds and questions):"]
    for r in rows:
        if r["b"] is not None:
            spread = [s["diff_points"] for s in r["per_seed"]]
            lines.append(f"  {r['comparison']}: {_ci(r['pooled'])} pts "
                         f"(per seed {min(spread):+.1f} to {max(spread):+.1f})")
    gains = [r for r in rows if r["b"] is None]
    lines.append("  gain over the base: " + "; ".join(
        f"{METHODS[r['a']].name} {r['pooled']['diff_points']:+.1f}" for r in gains) + " pts")
    lines.append(f"  with {n_seeds} seeds, read each interval beside its per-seed range: when "
                 "seeds disagree it covers less than 95% (docs/demo.md)")
    return lines


def seed_rows(outcome: dict) -> list[dict]:
    """One markdown row per (seed, method): the kept run's accuracy, change and costs."""
    base = unbits(outcome["base"]["test_correct"])
    rows = []
    for c in outcome["chosen"]:
        for m in c["methods"].values():
            s = paired_difference(base, unbits(m["test_correct"]), seed=c["seed"])
            rows.append({
                "seed": c["seed"], "method": m["label"],
                "test before %": round(100 * outcome["base"]["test"], 1),
                "test after %": round(100 * m["test_after"], 1),
                "change [95% CI] (pts)": _ci(s),
                "McNemar p": f"{s['mcnemar_p']:.2g}",
                "train peak MiB": round(m["train_peak_bytes"] / 2**20, 2),
                "loop peak MiB": round(m["loop_peak_bytes"] / 2**20, 2),
                "s/step": round(m["s_per_step"], 3),
                "trainable params": m["trainable_params"],
                "extra state KiB": round(m["extra_state_bytes"] / 2**10, 1),
            })
    return rows


def plot(outcome: dict, path: Path) -> None:
    """Dev accuracy vs GRPO step, one panel per seed (3 a row); runs not kept dotted, base grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = outcome["chosen"]
    cols = min(3, len(chosen))
    rows = -(-len(chosen) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows), squeeze=False,
                             sharey=True)
    for ax in axes.flat[len(chosen):]:
        ax.set_visible(False)
    colors = {}
    for ax, c in zip(axes.flat, chosen):
        kept = {m["label"] for m in c["methods"].values()}
        for run in (r for r in outcome["runs"] if r["seed"] == c["seed"]):
            color = colors.setdefault(run["kind"], f"C{len(colors)}")
            steps, acc = zip(*run["dev_curve"], strict=True)
            on = run["label"] in kept
            ax.plot(steps, [100 * a for a in acc], marker="o" if on else ".", ms=3,
                    color=color, ls="-" if on else ":", alpha=1.0 if on else 0.6,
                    label=run["label"] + ("" if on else " (not kept)"))
        ax.axhline(100 * outcome["base"]["dev"], color="grey", lw=0.8, label="base")
        ax.set(xlabel="GRPO step", title=f"seed {c['seed']}")
        ax.legend(fontsize=7)
    for ax in axes[:, 0]:
        ax.set_ylabel("dev accuracy (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""Which update rule learns best: the demo's GRPO over {rule x rate x GRPO seed x base seed}.

    PYTHONPATH=src .venv/bin/python benchmarks/quality.py                  # the grid below
    PYTHONPATH=src .venv/bin/python benchmarks/quality.py --rules adamw_proj rgc rgc_momentum \\
        --seeds 0 1 2 3 --bases 1 2 --out benchmarks/results/quality/run1

For each base seed (a base policy warm-started from it, and its own questions) the demo's
experiment (:func:`grpo.experiment.run_experiment`) runs every rule: every rule tries the
same rate multipliers on the first GRPO seed, keeps the one with the best final dev accuracy,
and runs it on the other seeds; test is read only for the kept runs. Each base's record is
written as soon as it finishes (``base<b>.json``, reusable with ``--report``). The summary
sets every rule against the ``--reference`` rule (default: dense AdamW on the seven
projections), paired on the same questions: per base (bootstrap over seeds and questions) and
pooled over bases (each base weighted equally, resampled within itself: a stratified
bootstrap), with per-seed tables.

Cost on a 2-core machine (Intel Xeon, AVX-512) with 2 workers at the default preset (300 GRPO
steps): 33 to 52 s of one core per run (41 s on average), about 22 s of wall time per run with
both cores busy, so a grid of R rules, S seeds, M multipliers and B bases
(``B * R * (S + M - 1)`` runs) takes about ``22 s * B * R * (S + M - 1)``, plus 2 to 5 minutes
per new base's warm start: 8 rules x 8 seeds x 2 multipliers x 2 bases is 144 runs, about 55
minutes. Not every base seed warm-starts to the target within the cap (seeds 2, 4 and 5 did
not; 0, 1 and 3 did): such a base is left out with its reason printed. ``--steps`` shortens
every run (and changes what is measured: say so).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

from grpo.experiment import run_experiment, unbits  # noqa: E402
from grpo.methods import METHODS  # noqa: E402
from grpo.model import WarmStartError  # noqa: E402
from grpo.stats import paired_difference, stratified_bootstrap  # noqa: E402
from grpo_arithmetic import PRESETS  # noqa: E402

import rgc.compute  # noqa: E402
from benchmarks.common import environment, markdown_table  # noqa: E402

RULES = ("adamw_proj", "rgc", "rgc_momentum", "rgc_nesterov", "rgc_rows", "rgc_nesterov_rows",
         "rowadam_plain", "rowadam")
OUT = ROOT / "benchmarks" / "results" / "quality"


def preset_for(name: str, base: int, rules, seeds, multipliers, steps: int | None):
    """The demo's preset ``name`` for one base seed, with these rules, seeds and rates
    (and ``steps`` GRPO steps, if given)."""
    preset = replace(PRESETS[name], seeds=tuple(seeds), base_seed=base, methods=tuple(rules),
                     multipliers=tuple(multipliers))
    if steps is not None:
        preset = replace(preset, grpo=replace(preset.grpo, steps=steps,
                                              eval_every=min(preset.grpo.eval_every, steps)))
    return preset


def _ci(s: dict) -> str:
    return f"{s['diff_points']:+.2f} [{s['ci_low']:+.2f}, {s['ci_high']:+.2f}]"


def kept_correct(record: dict, rule: str) -> np.ndarray:
    """(seeds, questions) 0/1 test correctness of ``rule``'s kept runs in one base's record."""
    return np.stack([unbits(c["methods"][rule]["test_correct"]).numpy()
                     for c in record["chosen"]])


def summarize(records: list[dict], reference: str) -> tuple[list[dict], list[dict], list[str]]:
    """(pooled rows, per-seed rows, lines) of every rule against ``reference``."""
    rules = list(records[0]["chosen"][0]["methods"])
    pooled, per_seed = [], []
    for rule in rules:
        row = {"rule": METHODS[rule].name}
        strata = []
        for rec in records:
            base = rec["base"]
            gain = kept_correct(rec, rule) - unbits(base["test_correct"]).numpy()[None]
            mults = sorted({c["methods"][rule]["mult"] for c in rec["chosen"]})
            row[f"base {base['seed']}: rate x"] = ", ".join(f"{m:g}" for m in mults)
            row[f"base {base['seed']}: test gain (pts)"] = f"{100 * gain.mean():+.1f}"
            against = f"base {base['seed']}: - {reference}"
            row[against] = "(reference)"
            if rule != reference:
                diffs = kept_correct(rec, rule) - kept_correct(rec, reference)
                strata.append(diffs)
                row[against] = _ci(stratified_bootstrap([diffs], seed=0))
            for c in rec["chosen"]:
                run = c["methods"][rule]
                cells = {"base": base["seed"], "seed": c["seed"], "rule": run["label"],
                         "test after %": round(100 * run["test_after"], 1),
                         "final dev %": round(100 * run["final_dev"], 1)}
                cells[f"- {reference} (pts)"] = "(reference)"
                if rule != reference:
                    ref = c["methods"][reference]
                    d = paired_difference(unbits(ref["test_correct"]),
                                          unbits(run["test_correct"]), seed=c["seed"])
                    cells[f"- {reference} (pts)"] = _ci(d)
                cells["s/step"] = round(run["s_per_step"], 3)
                cells["extra state KiB"] = round(run["extra_state_bytes"] / 2**10, 1)
                per_seed.append(cells)
        row[f"pooled - {reference} (pts)"] = (_ci(stratified_bootstrap(strata, seed=0))
                                              if strata else "(reference)")
        pooled.append(row)
    n_seeds = len(records[0]["chosen"])
    lines = [f"{len(records)} base(s) ({', '.join(str(r['base']['seed']) for r in records)}) "
             f"x {n_seeds} GRPO seeds; each rule's rate chosen on dev of the first seed of each "
             f"base from the same multipliers; test read only for the kept runs; pooled: "
             f"the mean over bases of each base's mean paired difference, 95% interval from a "
             f"bootstrap over seeds and questions within each base"]
    return pooled, per_seed, lines


def write_summary(out: Path, records: list[dict], reference: str, args_line: str) -> None:
    pooled, per_seed, lines = summarize(records, reference)
    timing = [f"base {r['base']['seed']}: {r['timing']['wall_s']:.0f} s wall, "
              f"{r['timing']['cpu_s']:.0f} s CPU ({len(r['runs'])} runs, "
              f"{r['timing']['warm_start_and_base_eval_s']:.0f} s warm start and base eval)"
              for r in records]
    env = "\n".join(f"- {k}: {v}" for k, v in records[-1]["env"].items())
    text = (f"# Update rules on sketches against {METHODS[reference].name}\n\n"
            f"`{args_line}`\n\n" + "\n".join(f"- {x}" for x in lines + timing)
            + f"\n\n## Pooled\n\n{markdown_table(pooled)}\n\n## Every seed\n\n"
            f"{markdown_table(per_seed)}\n\n## Environment\n\n{env}\n")
    (out / "quality.md").write_text(text)
    (out / "quality.json").write_text(json.dumps({"pooled": pooled, "per_seed": per_seed},
                                                 indent=1))
    print(text)


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=sorted(METHODS))
    parser.add_argument("--reference", default="adamw_proj", choices=sorted(METHODS))
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(8)),
                        help="GRPO seeds (default 0-7)")
    parser.add_argument("--bases", type=int, nargs="+", default=[2, 3],
                        help="base seeds (default 2 3: the recorded demo uses base 0, and the "
                             "rules' base rates were set after a pilot on base 1)")
    parser.add_argument("--multipliers", type=float, nargs="+", default=[1.0, 3.0])
    parser.add_argument("--preset", default="default", choices=["default", "quick"],
                        help="the demo's preset the runs follow ('quick': a pipeline check)")
    parser.add_argument("--steps", type=int, help="GRPO steps per run (default: the preset's)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--cache-dir", type=Path, default=ROOT / ".cache" / "grpo")
    parser.add_argument("--report", action="store_true",
                        help="train nothing: summarise the base<b>.json records in --out")
    args = parser.parse_args(argv)
    rules = list(dict.fromkeys([args.reference, *args.rules]))
    args.out.mkdir(parents=True, exist_ok=True)
    args_line = "benchmarks/quality.py " + " ".join(sys.argv[1:] if argv is None else argv)
    records = []
    for b in args.bases:
        path = args.out / f"base{b}.json"
        if args.report or path.exists():
            records.append(json.loads(path.read_text()))
            print(f"base {b}: read {path}", flush=True)
            continue
        preset = preset_for(args.preset, b, rules, args.seeds, args.multipliers, args.steps)
        compute = rgc.compute.choose_compute_mode()
        try:
            outcome = run_experiment(preset, cache_dir=args.cache_dir, compute=compute,
                                     workers=args.workers, progress=False,
                                     log=lambda line: print(line, flush=True))
        except WarmStartError as e:  # this base never reached its target: say so, go on
            print(f"base {b} left out: {e}", flush=True)
            continue
        outcome["base"]["seed"] = b
        settings = {k: (asdict(v) if hasattr(v, "__dataclass_fields__") else v)
                    for k, v in vars(preset).items()}
        record = {"settings": settings, "env": environment() | {"compute mode": str(compute)},
                  **outcome}
        path.write_text(json.dumps(record, default=str))
        records.append(record)
    if not records:
        sys.exit("no base policy reached its warm-start target: nothing to summarise")
    write_summary(args.out, records, args.reference, args_line)
    return args.out


if __name__ == "__main__":
    main()

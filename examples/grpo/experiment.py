"""The experiment: one base policy, every method over several GRPO seeds, rates chosen on dev.

A :class:`Preset` says what to run. :func:`run_experiment` warm-starts (or loads) one base
policy, runs every (method, rate, seed) GRPO run it needs in worker processes (one torch thread
each), picks each method's rate on dev accuracy, and only then reads the chosen runs' test
results. The outcome does not depend on the number of workers: every run draws its randomness
from its own seed.
"""

from __future__ import annotations

import os
import resource
import time
import warnings
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

import torch
from grpo.methods import METHODS, RGC
from grpo.model import ModelConfig, WarmStart, warm_start
from grpo.rollout import accuracy
from grpo.task import make_splits
from grpo.train import GRPOSettings, run_grpo

import rgc.compute


@dataclass(frozen=True)
class Preset:
    """Everything one run of the demo does, besides where it writes.

    ``lr``: each method's base rate (for RGC the AdamW rate that ``rgc.calibrate_lr`` turns
    into tau). Every method tries the same ``multipliers`` of its base rate. ``selection``:
    ``"first_seed"`` tries them on the first seed only and runs the rate that seed chose on
    dev on the other seeds; ``"per_seed"`` tries them on every seed and chooses on each.
    """
    model: ModelConfig
    warm: WarmStart
    grpo: GRPOSettings
    seeds: tuple[int, ...] = (0, 1, 2)
    base_seed: int = 0
    methods: tuple[str, ...] = ("adamw", "adamw_proj", "lora", "rgc", "rowadam")
    multipliers: tuple[float, ...] = (1.0, 3.0)
    selection: str = "first_seed"
    n_train: int = 20000
    n_dev: int = 1000
    n_test: int = 2000
    rank: int = 16
    lr: dict = field(default_factory=lambda: {
        "adamw": 1e-4, "adamw_proj": 1e-4, "lora": 1e-3, "rgc": 1e-4, "rowadam": 1e-4,
        "rgc_momentum": 1e-4 / 3, "rgc_nesterov": 1e-4 / 3, "rgc_rows": 1e-4,
        "rgc_nesterov_rows": 1e-4 / 3, "rowadam_plain": 1e-4})

    def __post_init__(self):
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown methods {unknown}; choose from {sorted(METHODS)}")
        if self.selection not in ("first_seed", "per_seed"):
            raise ValueError(f"selection must be 'first_seed' or 'per_seed', got "
                             f"{self.selection!r}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct and at least one, got {self.seeds}")


@dataclass(frozen=True)
class Run:
    kind: str
    mult: float
    seed: int


@dataclass(frozen=True)
class _Context:
    """What a worker needs to run any :class:`Run` (picklable: sent once to each worker)."""
    preset: Preset
    base_path: Path
    base_dev: float
    compute: rgc.compute.ComputeMode
    threads: int
    progress: bool
    vllm: bool = False


_worker: dict = {}


def _init_worker(ctx: _Context) -> None:
    """Load the base, the questions and the settings once per worker process."""
    from safetensors.torch import load_file

    torch.set_num_threads(ctx.threads)
    # peft 0.21 calls a transformers 5 API that warns of its own deprecation on every step.
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    p = ctx.preset
    train, dev, test = make_splits(p.base_seed, p.n_train, p.n_dev, p.n_test)
    state = load_file(ctx.base_path)
    reference = None
    if p.grpo.kl_coef > 0:
        reference = p.model.build(p.base_seed)
        reference.load_state_dict(state)
        rgc.compute.use_compute_dtype(reference, ctx.compute)
    engine = None
    if ctx.vllm:  # one engine per worker, loaded with the base (grpo.engine)
        from grpo.engine import EngineRollouts

        base = p.model.build(p.base_seed)
        base.load_state_dict(state)
        engine = EngineRollouts(base)
    _worker.update(ctx=ctx, state=state, train=train, dev=dev, test=test, reference=reference,
                   engine=engine)


def build_method(run: Run, base_state: dict, preset: Preset, compute: rgc.compute.ComputeMode):
    """The method of ``run`` on a fresh copy of the base, in the compute mode."""
    cls = METHODS[run.kind]
    kwargs = dict(rank=preset.rank, seed=run.seed, steps=preset.grpo.steps)
    if issubclass(cls, RGC):  # tau = mult * calibrate_lr(model, lr)
        method = cls(base_state, preset.model, lr=preset.lr[run.kind], tau_scale=run.mult,
                     **kwargs)
    else:
        method = cls(base_state, preset.model, lr=preset.lr[run.kind] * run.mult, **kwargs)
    # After rgc.wrap / peft: the compute mode covers the policy as it will be called.
    rgc.compute.use_compute_dtype(method.policy, compute)
    return method


def _run_one(run: Run) -> dict:
    """One GRPO run in this worker; its dev curve, costs, and per-question test correctness.

    Every candidate is scored on test here (cheaper than sending policies back), but nothing
    reads a candidate's test result before the rates are chosen on dev.
    """
    w, t0, c0 = _worker, time.perf_counter(), time.process_time()
    ctx = w["ctx"]
    method = build_method(run, w["state"], ctx.preset, ctx.compute)
    result = run_grpo(method, w["train"], w["dev"], ctx.preset.grpo, seed=run.seed,
                      base_dev=ctx.base_dev, reference=w["reference"], progress=ctx.progress,
                      engine=w["engine"])
    test = accuracy(method.policy, w["test"])
    return {**result, "seed": run.seed, "mult": run.mult, "test_after": float(test.mean()),
            "test_correct": bits(test), "wall_s": time.perf_counter() - t0,
            "cpu_s": time.process_time() - c0}


class _InProcess:
    """The executor interface of concurrent.futures, running each call at submission."""

    def __init__(self, ctx: _Context):
        _init_worker(ctx)

    def submit(self, fn, *args) -> Future:
        future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # re-raised by future.result(), as a pool would
            future.set_exception(e)
        return future

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def choose(candidates: list[dict]) -> dict:
    """The run with the highest final dev accuracy (the first listed on a tie)."""
    return max(candidates, key=lambda r: r["final_dev"])


def run_all(preset: Preset, ctx: _Context, workers: int, log=print) -> list[dict]:
    """Every run the preset needs, on ``workers`` processes; results in plan order."""
    first, rest = preset.seeds[0], preset.seeds[1:]
    tried = rest if preset.selection == "per_seed" else ()
    plan = [Run(k, m, s) for s in (first, *tried) for k in preset.methods
            for m in preset.multipliers]
    waiting = {k: len(preset.multipliers) for k in preset.methods}  # first-seed runs left
    results: dict[Run, dict] = {}
    executor = (_InProcess(ctx) if workers <= 1 else ProcessPoolExecutor(
        workers, mp_context=get_context("spawn"), initializer=_init_worker, initargs=(ctx,)))
    with executor:
        futures = {executor.submit(_run_one, run): run for run in plan}
        try:
            while futures:
                done, _ = wait(futures, return_when=FIRST_COMPLETED)
                for future in [f for f in futures if f in done]:  # in submission order
                    run = futures.pop(future)
                    r = results[run] = future.result()
                    log(f"  seed {run.seed} {r['label']}: final dev {r['final_dev']:.3f} "
                        f"({r['wall_s']:.0f} s, {r['cpu_s']:.0f} s CPU)")
                    if preset.selection == "first_seed" and run.seed == first:
                        waiting[run.kind] -= 1
                        if not waiting[run.kind]:  # its rate is chosen: run it on the rest
                            mult = choose([results[Run(run.kind, m, first)]
                                           for m in preset.multipliers])["mult"]
                            for later in (Run(run.kind, mult, s) for s in rest):
                                futures[executor.submit(_run_one, later)] = later
        except BaseException:
            for future in futures:  # do not wait for runs that have not started
                future.cancel()
            raise
    order = {k: i for i, k in enumerate(preset.methods)}
    return [results[r] for r in sorted(results, key=lambda r: (preset.seeds.index(r.seed),
                                                                 order[r.kind], r.mult))]


def planned_runs(preset: Preset) -> int:
    tried = len(preset.seeds) if preset.selection == "per_seed" else 1
    return len(preset.methods) * (len(preset.multipliers) * tried + len(preset.seeds) - tried)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished workers."""
    own, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run_experiment(preset: Preset, *, cache_dir: Path, compute: rgc.compute.ComputeMode,
                   workers: int = 2, threads: int = 1, progress: bool = True,
                   vllm: bool = False, log=print) -> dict:
    """Warm start, every GRPO run, the choice of rates on dev; then the test results.
    ``vllm``: rollouts from a vLLM engine that follows each policy (:mod:`grpo.engine`).

    Returns ``base`` (accuracy and file of the shared base policy), ``runs`` (every run, each
    with its dev curve, costs and test correctness), ``chosen`` (per seed, the run kept for
    each method, in ``preset.methods`` order) and ``timing`` (wall and CPU seconds).
    """
    t0, c0 = time.perf_counter(), cpu_seconds()
    train, dev, test = make_splits(preset.base_seed, preset.n_train, preset.n_dev,
                                   preset.n_test)
    state, path, made = warm_start(preset.model, preset.warm, train, dev, preset.base_seed,
                                   cache_dir, progress=progress, compute=compute)
    base = preset.model.build(preset.base_seed)
    base.load_state_dict(state)
    rgc.compute.use_compute_dtype(base, compute)
    base_dev, base_test = float(accuracy(base, dev).mean()), accuracy(base, test)
    t_warm, c_warm = time.perf_counter() - t0, cpu_seconds() - c0
    log(f"base policy {path.name} (base seed {preset.base_seed}, "
        f"{made['warm_start_steps']:.0f} warm-start steps): dev {base_dev:.3f} "
        f"(target {preset.warm.target_dev:.3f}), test {float(base_test.mean()):.3f}")
    log(f"GRPO: {planned_runs(preset)} runs of {preset.grpo.steps} steps on {workers} worker(s), "
        f"seeds {list(preset.seeds)}")
    ctx = _Context(preset, path, base_dev, compute, threads, progress and workers <= 1, vllm)
    runs = run_all(preset, ctx, workers, log)
    chosen = []  # per seed, in preset.seeds order: {"seed": s, "methods": {kind: run}}
    for s in preset.seeds:
        kept = {k: choose([r for r in runs if r["seed"] == s and r["kind"] == k])
                for k in preset.methods}
        if preset.selection == "first_seed" and s != preset.seeds[0]:
            for r in kept.values():
                r["rate_chosen_on_seed"] = preset.seeds[0]
        chosen.append({"seed": s, "methods": kept})
    return {"base": {"dev": base_dev, "test": float(base_test.mean()),
                     "test_correct": bits(base_test), "file": path.name, **made},
            "runs": runs, "chosen": chosen,
            "timing": {"warm_start_and_base_eval_s": t_warm,
                       "warm_start_and_base_eval_cpu_s": c_warm,
                       "grpo_s": time.perf_counter() - t0 - t_warm,
                       "wall_s": time.perf_counter() - t0, "cpu_s": cpu_seconds() - c0,
                       "workers": workers, "cpu_count": os.cpu_count()}}


def bits(correct: torch.Tensor) -> str:
    """Per-question 0/1 correctness as a string, kept in the JSON for re-analysis."""
    return "".join(str(int(c)) for c in correct.tolist())


def unbits(text: str) -> torch.Tensor:
    return torch.tensor([float(c) for c in text])

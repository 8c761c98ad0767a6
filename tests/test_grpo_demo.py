"""The GRPO demo's smoke run: the whole pipeline, not its accuracy (that is a recorded run)."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
# the demo's packages, looked up without importing them here (peft alone takes ~2 s): the
# demo runs in its own processes
for _package in ("transformers", "peft", "matplotlib", "tqdm"):
    if importlib.util.find_spec(_package) is None:
        pytest.skip(f"the demo needs {_package}", allow_module_level=True)
# A guard against hangs, not a speed check: on a 2-core machine shared with other jobs one
# quick run took 68 s (12 s of CPU).
TIMEOUT = 600


def _demo_env() -> dict:
    """The demo's processes run rgc's CPU loops eagerly (TORCHDYNAMO_DISABLE): each would
    otherwise trace the compiled ones again, ~7 s of CPU apiece, and nothing checked here
    depends on it (the two kinds of loop are compared in tests/test_rounding_bits.py; the
    compiled ones run in a fresh process in tests/test_benchmarks_cpu.py)."""
    return {**os.environ, "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.slow
def test_quick_run_writes_table_plot_and_json(tmp_path):
    env = _demo_env()
    import rgc.compute

    # Chosen once here as the demo would, then fixed for both runs (they must be identical).
    mode = rgc.compute.choose_compute_mode().name
    cmd = [sys.executable, str(ROOT / "examples" / "grpo_arithmetic.py"), "--quick",
           "--no-progress", "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "c"),
           "--compute", mode]
    first = subprocess.run(cmd + ["--workers", "2"], env=env, capture_output=True, text=True,
                           timeout=TIMEOUT)
    assert first.returncode == 0, first.stderr[-3000:]
    out = tmp_path / "out"
    assert f"results in {out}" in first.stdout
    assert f"compute mode: {'native' if mode == 'native' else 'float32 matmuls'}" in first.stdout
    # The base's accuracy is printed before any GRPO run starts.
    assert first.stdout.index("base policy") < first.stdout.index("GRPO:")
    assert "target 0.000" in first.stdout
    assert "Pooled over 2 GRPO seeds x 500 test questions" in first.stdout
    assert (out / "dev_accuracy.png").stat().st_size > 0
    result = json.loads((out / "results.json").read_text())
    kinds = ["adamw", "adamw_proj", "lora", "rgc", "rowadam"]
    assert [c["seed"] for c in result["chosen"]] == [0, 1]
    for c in result["chosen"]:
        assert list(c["methods"]) == kinds
        for m in c["methods"].values():
            assert 0.0 <= m["test_after"] <= 1.0
            assert m["test_correct"].count("1") == round(500 * m["test_after"])
            assert m["train_peak_bytes"] > 0 and m["loop_peak_bytes"] >= m["train_peak_bytes"]
            assert m["extra_state_bytes"] > 0
            assert len(m["dev_curve"]) >= 2
    # Every method tried the same two rates on the first seed and kept the better on dev; the
    # second seed ran each method once, at the rate the first seed chose.
    first_seed, second_seed = result["chosen"]
    for kind in kinds:
        tried = [r for r in result["runs"] if r["kind"] == kind and r["seed"] == 0]
        assert [r["mult"] for r in tried] == [1.0, 3.0]
        assert first_seed["methods"][kind]["final_dev"] == max(r["final_dev"] for r in tried)
        again = [r for r in result["runs"] if r["kind"] == kind and r["seed"] == 1]
        assert [r["mult"] for r in again] == [first_seed["methods"][kind]["mult"]]
    methods = first_seed["methods"]
    # Dense AdamW holds 12 bytes per parameter beyond the BF16 weights (FP32 master + moments),
    # plus one scalar step count per tensor; on the projections it trains RGC's weights.
    for kind in ("adamw", "adamw_proj"):
        n = methods[kind]["trainable_params"]
        assert 12 * n <= methods[kind]["extra_state_bytes"] < 12 * n + 1024
    assert methods["adamw_proj"]["trainable_params"] == methods["rgc"]["trainable_params"]
    assert methods["rowadam"]["trainable_params"] == methods["rgc"]["trainable_params"]
    assert methods["adamw_proj"]["trainable_params"] < methods["adamw"]["trainable_params"]
    assert methods["rgc"]["train_peak_bytes"] < methods["adamw"]["train_peak_bytes"]
    # The verdict: every method against the base, RGC against each other method, RowAdam +
    # predicted KL against AdamW and LoRA, and the two trainable sets of dense AdamW; a
    # per-seed and a pooled figure for each.
    names = [v["comparison"] for v in result["verdict"]]
    assert "RGC - dense AdamW" in names and "RGC - LoRA" in names
    assert "RowAdam + predicted KL - dense AdamW, 7 projections" in names
    assert "dense AdamW, 7 projections - dense AdamW" in names
    assert all(len(v["per_seed"]) == 2 and v["pooled"]["seeds"] == 2 for v in result["verdict"])

    # The tables can be rewritten from the JSON alone, to the same verdict.
    _import_demo()
    import grpo_arithmetic

    (out / "results.md").unlink()
    assert grpo_arithmetic.main(["--report", str(out)]) == out
    assert (out / "results.md").read_text().count("| 0 | ") >= len(kinds)
    assert json.loads((out / "results.json").read_text())["verdict"] == result["verdict"]

    # Deterministic for a seed whatever the number of workers, and the cached base is reused.
    (tmp_path / "out").rename(tmp_path / "first")
    second = subprocess.run(cmd + ["--workers", "1"], env=env, capture_output=True, text=True,
                            timeout=TIMEOUT)
    assert second.returncode == 0, second.stderr[-3000:]
    again = json.loads((out / "results.json").read_text())
    assert len(list((tmp_path / "c").iterdir())) == 1
    for r1, r2 in zip(result["runs"], again["runs"], strict=True):
        assert (r2["label"], r2["seed"]) == (r1["label"], r1["seed"])
        assert r2["test_correct"] == r1["test_correct"] and r2["dev_curve"] == r1["dev_curve"]
        assert r2["train_peak_bytes"] == r1["train_peak_bytes"]


@pytest.mark.slow
def test_moe_quick_run_trains_attention_and_experts(tmp_path):
    """``--moe --quick``: a Qwen3-MoE policy through the whole pipeline. RGC, RowAdam (with
    predicted-KL step control through the experts) and LoRA train the attention projections
    and the expert stacks, dense AdamW those and the embeddings, norms and head, no method the
    routers; the report has every method's rows, and an RGC step moves every expert."""
    env = _demo_env()
    import rgc.compute

    mode = rgc.compute.choose_compute_mode().name
    out, cache = tmp_path / "out", tmp_path / "cache"
    cmd = [sys.executable, str(ROOT / "examples" / "grpo_arithmetic.py"), "--moe", "--quick",
           "--no-progress", "--out", str(out), "--cache-dir", str(cache), "--compute", mode,
           "--workers", "1"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    assert result["preset"] == "moe_quick" and result["policy"].startswith("Qwen3-MoE")
    kinds = ["adamw", "lora", "rgc", "rowadam"]
    assert [list(c["methods"]) for c in result["chosen"]] == [kinds, kinds]
    report = (out / "results.md").read_text()
    assert "policy: Qwen3-MoE" in report
    for seed in (0, 1):
        for label in ("adamw lr=", "lora r=8", "rgc r=8", "rowadam r=8"):
            assert f"| {seed} | {label}" in report
    names = [v["comparison"] for v in result["verdict"]]
    assert "RGC - dense AdamW" in names and "RGC - LoRA" in names

    # The quick preset's sizes, counted here: 2 layers of attention (q, o 64 x 64; k, v 32 x 64)
    # and of 4 experts (gate/up 128 x 64, down 64 x 64 each), LoRA rank 8 on each matrix.
    layers, experts, hidden, rank = 2, 4, 64, 8
    attention, expert = [(64, 64), (32, 64), (32, 64), (64, 64)], [(128, 64), (64, 64)]
    weights = layers * (sum(d * k for d, k in attention) + experts * sum(d * k for d, k in expert))
    adapters = layers * (sum(rank * (d + k) for d, k in attention)
                         + experts * sum(rank * (d + k) for d, k in expert))
    methods = result["chosen"][0]["methods"]
    assert methods["rgc"]["trainable_params"] == methods["rowadam"]["trainable_params"] == weights
    assert methods["lora"]["trainable_params"] == adapters
    # Dense AdamW: also the embedding and the head (16 x 64 each) and the norms (per layer two
    # of hidden size, q_norm and k_norm of head size 32; a final one), not the routers.
    others = 2 * 16 * hidden + layers * (2 * hidden + 2 * 32) + hidden
    assert methods["adamw"]["trainable_params"] == weights + others
    for kind in ("adamw", "lora"):
        assert methods["rgc"]["train_peak_bytes"] < methods[kind]["train_peak_bytes"]

    # One RGC update from the cached base moves every expert that received a token (this warm
    # start has no load-balancing loss: an expert may receive none, and then keeps its bits),
    # and nothing frozen.
    grpo = _import_demo()
    torch = pytest.importorskip("torch")
    import grpo_arithmetic
    from grpo.experiment import Run, build_method
    from grpo.task import PAD, answer_ids, make_splits, prompt_ids
    from safetensors.torch import load_file

    preset = grpo_arithmetic.PRESETS["moe_quick"]
    (base_file,) = cache.iterdir()
    method = build_method(Run("rgc", 1.0, 0), load_file(base_file), preset,
                          rgc.compute.choose_compute_mode(override=mode))
    routed = {}  # layer's experts module name -> tokens routed to each expert

    def count(name):
        def hook(router, args, out):
            routed[name] = torch.bincount(out[2].flatten(), minlength=experts)
        return hook

    for name, module in method.policy.named_modules():
        if name.endswith(".mlp.gate"):
            module.register_forward_hook(count(name.replace(".gate", ".experts")))
    before = {n: p.detach().clone() for n, p in method.policy.named_parameters()}
    questions = make_splits(0, 32, 0, 0)[0]
    prompts, answers = prompt_ids(questions), answer_ids(questions)
    mask = (answers != PAD).float()
    method.policy.train()
    logprobs = grpo.model.answer_logprobs(method.policy, prompts, answers)
    (-(logprobs * mask).sum() / mask.sum()).backward()
    method.step(torch.cat([prompts, answers], dim=1))
    assert len(routed) == layers and all(c.sum() == 2 * prompts.numel() + 2 * answers.numel()
                                         for c in routed.values())
    for name, p in method.policy.named_parameters():
        module, _, leaf = name.rpartition(".")
        if leaf in ("gate_up_proj", "down_proj"):
            assert module in routed, name
            for e in range(experts):
                changed = not torch.equal(p[e], before[name][e])
                assert changed == bool(routed[module][e] > 0), (name, e, routed[module])
        elif ".mlp.gate." in name or "embed" in name or "norm" in name or "lm_head" in name:
            assert torch.equal(p, before[name]), name
    with pytest.raises(SystemExit):  # no --full preset for the MoE policy
        grpo_arithmetic.main(["--moe", "--full"])


def _import_demo():
    sys.path.insert(0, str(ROOT / "examples"))
    import grpo.loss
    import grpo.memory
    import grpo.model
    import grpo.stats
    return grpo


def test_grpo_loss_gradient_matches_plain_policy_gradient():
    grpo = _import_demo()
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1])  # second group: no signal
    adv = grpo.loss.group_advantages(rewards, 4)
    r = rewards.double().view(2, 4)
    expect = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)
    assert torch.allclose(adv.double(), expect, atol=1e-6)
    assert adv[4:].abs().max() == 0
    logprobs = torch.randn(8, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(8, 5, dtype=torch.float64)
    mask[:, 3:] = 0
    loss, _ = grpo.loss.grpo_loss(logprobs, logprobs.detach(), adv.double(), mask)
    loss.backward()
    # d loss / d log p = -A_i / (number of response tokens in the batch), on unmasked tokens.
    assert torch.allclose(logprobs.grad, -expect[:, None] * mask / mask.sum(), atol=1e-6)


def test_response_mask_keeps_tokens_through_the_first_end():
    grpo = _import_demo()
    torch = pytest.importorskip("torch")
    from grpo.task import EOS, PAD
    responses = torch.tensor([[5, 6, EOS, PAD, PAD], [5, 5, 5, 5, 5], [EOS, PAD, PAD, PAD, PAD]])
    expect = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]).float()
    assert torch.equal(grpo.model.response_mask(responses), expect)


def test_mcnemar_exact_p_and_bootstrap_interval():
    grpo = _import_demo()
    torch = pytest.importorskip("torch")
    # 2 questions lost, 10 gained, 88 unchanged: p = 2 * P(Bin(12, 1/2) <= 2) = 2 * 79 / 4096.
    before = torch.tensor([1.0] * 2 + [0.0] * 10 + [1.0] * 40 + [0.0] * 48)
    after = torch.tensor([0.0] * 2 + [1.0] * 10 + [1.0] * 40 + [0.0] * 48)
    assert grpo.stats.mcnemar_p(before, after) == pytest.approx(2 * 79 / 4096, rel=1e-12)
    s = grpo.stats.paired_difference(before, after, seed=0)
    assert s["diff_points"] == pytest.approx(8.0)
    # The bootstrap interval of a mean of 100 values in {-1, 0, 1}: about +-1.96 sd / sqrt(n).
    sd = float((after - before).double().std())
    assert s["ci_low"] == pytest.approx(8.0 - 196 * sd / 10, abs=1.0)
    assert s["ci_high"] == pytest.approx(8.0 + 196 * sd / 10, abs=1.0)


def _mcnemar_log_space(b: int, c: int) -> float:
    """2 P(Bin(b + c, 1/2) <= min(b, c)), summed in log space with lgamma (no big integers)."""
    n, k = b + c, min(b, c)
    logs = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) - n * math.log(2)
            for i in range(k + 1)]
    top = max(logs)
    return min(1.0, 2 * math.exp(top) * math.fsum(math.exp(v - top) for v in logs))


def _discordant(b: int, c: int, same: int):
    torch = pytest.importorskip("torch")
    before = torch.tensor([1.0] * b + [0.0] * c + [1.0] * same)
    after = torch.tensor([0.0] * b + [1.0] * c + [1.0] * same)
    return before, after


@settings(max_examples=60, deadline=None)
@given(b=st.integers(0, 4000), c=st.integers(0, 4000))
def test_mcnemar_exact_for_any_number_of_discordant_pairs(b, c):
    grpo = _import_demo()
    p = grpo.stats.mcnemar_p(*_discordant(b, c, 7))
    if b + c <= 1000:  # small enough for the plain formula in floating point
        plain = min(1.0, 2 * sum(math.comb(b + c, i) for i in range(min(b, c) + 1))
                    / 2.0 ** (b + c)) if b + c else 1.0
        assert p == pytest.approx(plain, rel=1e-12)
    reference = _mcnemar_log_space(b, c) if b + c else 1.0
    if reference > 1e-300:
        assert p == pytest.approx(reference, rel=1e-9)
    else:  # below the smallest normal double: both read as (next to) zero
        assert p < 1e-290


def test_mcnemar_past_the_float_exponent_range():
    grpo = _import_demo()
    # 2,000 and 2,100 discordant questions: 2 ** 4100 is no float, the p-value is.
    p = grpo.stats.mcnemar_p(*_discordant(2000, 2100, 0))
    assert p == pytest.approx(_mcnemar_log_space(2000, 2100), rel=1e-9)
    assert 0.01 < p < 0.5
    assert grpo.stats.mcnemar_p(*_discordant(3000, 3000, 5)) == 1.0


def _additive(s: int, n: int, rng):
    """(S, n) differences seed effect + question effect, and the two centred effects.

    The question effects take three values (as 0/1 correctness differences do), so that the
    bootstrap's draws over distinct columns stay few and fast.
    """
    seed_eff = rng.normal(0.0, 0.05, s)
    q_eff = rng.choice([-0.6, 0.0, 0.6], n)
    diffs = 0.3 + seed_eff[:, None] + q_eff[None, :]
    return diffs, seed_eff - seed_eff.mean(), q_eff - q_eff.mean()


def _sd_from_interval(stat: dict) -> float:
    return (stat["ci_high"] - stat["ci_low"]) / 100 / (2 * 1.959964)


def test_bootstrap_over_crossed_seeds_and_questions_has_the_known_spread():
    grpo = _import_demo()
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(1)
    diffs, seed_eff, q_eff = _additive(30, 300, rng)
    # Additive cells: the resampled mean is the grand mean + the mean of the drawn seed effects
    # + the mean of the drawn question effects, two independent draws; its variance is exactly
    # mean(seed_eff^2) / S + mean(q_eff^2) / n (centred effects, population variances).
    crossed = math.sqrt((seed_eff ** 2).mean() / 30 + (q_eff ** 2).mean() / 300)
    stat = grpo.stats.seeds_and_questions_bootstrap(diffs, shared_questions=True, seed=0,
                                                    resamples=20000)
    assert stat["diff_points"] == pytest.approx(100 * diffs.mean(), rel=1e-12)
    assert _sd_from_interval(stat) == pytest.approx(crossed, rel=0.05)
    centre = (stat["ci_low"] + stat["ci_high"]) / 200
    assert abs(centre - diffs.mean()) < 0.1 * crossed
    # Drawing questions afresh per seed would count the question effect S times too small:
    # mean(seed_eff^2) / S + mean(q_eff^2) / (n S), here a third of the spread.
    nested = math.sqrt((seed_eff ** 2).mean() / 30 + (q_eff ** 2).mean() / (300 * 30))
    stat = grpo.stats.seeds_and_questions_bootstrap(diffs, shared_questions=False, seed=0,
                                                    resamples=20000)
    assert _sd_from_interval(stat) == pytest.approx(nested, rel=0.05)
    assert nested < 0.4 * crossed


def test_bootstrap_over_seeds_then_their_own_questions_has_the_known_spread():
    grpo = _import_demo()
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(2)
    s, n = 25, 200
    diffs = rng.normal(0.0, 0.1, (s, 1)) + rng.choice([-1.0, 0.0, 1.0], (s, n), p=[.2, .5, .3])
    # Each slot draws a seed uniformly, then n of its questions: the slot's mean has variance
    # var(seed means) + mean(within-seed variance) / n; the overall mean averages S slots.
    means, within = diffs.mean(1), diffs.var(1)
    expect = math.sqrt((((means - means.mean()) ** 2).mean() + within.mean() / n) / s)
    stat = grpo.stats.seeds_and_questions_bootstrap(diffs, shared_questions=False, seed=3,
                                                    resamples=20000)
    assert _sd_from_interval(stat) == pytest.approx(expect, rel=0.05)


def test_bootstrap_stratified_over_bases_has_the_known_spread():
    """The equal-weight mean of two bases' crossed bootstraps: its variance is the sum of the
    two bases' variances (as in the crossed test above) over 4."""
    grpo = _import_demo()
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(4)
    strata, variances = [], []
    for s, n in ((20, 300), (30, 200)):
        diffs, seed_eff, q_eff = _additive(s, n, rng)
        strata.append(diffs)
        variances.append((seed_eff ** 2).mean() / s + (q_eff ** 2).mean() / n)
    stat = grpo.stats.stratified_bootstrap(strata, seed=0, resamples=20000)
    assert stat["diff_points"] == pytest.approx(100 * np.mean([d.mean() for d in strata]))
    assert _sd_from_interval(stat) == pytest.approx(math.sqrt(sum(variances)) / 2, rel=0.05)
    assert (stat["strata"], stat["seeds"]) == (2, 50)


@pytest.mark.slow
def test_quality_harness_smoke_run(tmp_path):
    """benchmarks/quality.py end to end on the quick preset: one base, two seeds, every rule
    against the reference in the pooled table and per seed."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "quality.py"), "--preset", "quick",
           "--rules", "rgc", "rgc_nesterov_rows", "--seeds", "0", "1", "--bases", "0",
           "--steps", "2", "--workers", "1", "--out", str(tmp_path / "q"),
           "--cache-dir", str(tmp_path / "cache")]
    subprocess.run(cmd, check=True, cwd=ROOT, env=_demo_env(), timeout=TIMEOUT,
                   capture_output=True)
    out = tmp_path / "q"
    record = json.loads((out / "base0.json").read_text())
    assert [list(c["methods"]) for c in record["chosen"]] == [
        ["adamw_proj", "rgc", "rgc_nesterov_rows"]] * 2
    summary = json.loads((out / "quality.json").read_text())
    assert [r["rule"] for r in summary["pooled"]] == [
        "dense AdamW, 7 projections", "RGC", "RGC + Nesterov, rows"]
    assert summary["pooled"][0]["pooled - adamw_proj (pts)"] == "(reference)"
    assert all(r["pooled - adamw_proj (pts)"].count("[") == 1 for r in summary["pooled"][1:])
    assert len(summary["per_seed"]) == 3 * 2
    text = (out / "quality.md").read_text()
    assert "## Pooled" in text and "## Environment" in text
    # --report summarises the records again without training
    subprocess.run(cmd + ["--report"], check=True, cwd=ROOT, env=_demo_env(), timeout=TIMEOUT,
                   capture_output=True)
    assert json.loads((out / "quality.json").read_text()) == summary


def test_bootstrap_over_one_seed_is_the_question_bootstrap():
    grpo = _import_demo()
    torch = pytest.importorskip("torch")
    before, after = _discordant(300, 600, 3000)
    n = before.numel()
    one = grpo.stats.paired_difference(before, after, seed=0)
    both = grpo.stats.seeds_and_questions_bootstrap((after - before).numpy()[None], seed=1,
                                                    shared_questions=True)
    assert both["diff_points"] == pytest.approx(one["diff_points"])
    # Same resampling scheme, independent draws: the limits agree to Monte Carlo error (a
    # quantile of 10,000 resamples moves by about 0.03 sd) and the grid of means (steps 1/n).
    sd = float((after - before).double().std()) / math.sqrt(n)
    for end in ("ci_low", "ci_high"):
        assert both[end] == pytest.approx(one[end], abs=100 * (0.15 * sd + 2 / n))
    with pytest.raises(ValueError, match="seeds, questions"):
        grpo.stats.seeds_and_questions_bootstrap(torch.zeros(5).numpy(), seed=0,
                                                 shared_questions=True)


def _tiny_warm_start(tmp_path, **warm):
    grpo = _import_demo()
    from grpo.task import make_splits
    config = grpo.model.ModelConfig(hidden=16, layers=1, heads=2, kv_heads=1, intermediate=32)
    train, dev, _ = make_splits(0, 300, 16, 0)
    return lambda: grpo.model.warm_start(config, grpo.model.WarmStart(**warm), train, dev, 0,
                                         tmp_path, progress=False)


def test_warm_start_below_its_target_raises_and_saves_nothing(tmp_path):
    grpo = _import_demo()
    run = _tiny_warm_start(tmp_path, max_steps=3, check_every=2, target_dev=0.9)
    with pytest.raises(grpo.model.WarmStartError) as err:
        run()
    message = str(err.value)
    assert "cap of 3 steps" in message and "target 0.900" in message
    assert "best 0.000 at step" in message and "GRPO did not start" in message
    assert "--base-seed" in message and "max_steps" in message
    assert list(tmp_path.iterdir()) == []


def test_cached_base_below_its_target_is_refused(tmp_path):
    grpo = _import_demo()
    from safetensors.torch import save_file
    run = _tiny_warm_start(tmp_path, max_steps=2, check_every=2, target_dev=0.0)
    state, path, info = run()
    assert info == {"warm_start_steps": 2.0, "dev_accuracy": 0.0}
    assert run()[1] == path  # loaded from the cache
    # A file recording a dev accuracy below the target (as older versions could save).
    save_file(state, path, metadata={"warm_start_steps": "2", "dev_accuracy": "-0.5"})
    with pytest.raises(grpo.model.WarmStartError, match="records dev accuracy -0.500"):
        run()


def test_tracker_counts_live_tensor_bytes():
    grpo = _import_demo()
    torch = pytest.importorskip("torch")
    w = torch.ones(256, 256)
    with grpo.memory.track([w]) as m:
        a = torch.ones(1000)                     # 4000 bytes
        b = a.view(10, 100)                      # a view: no new bytes
        del a, b
        c = torch.ones(500, dtype=torch.float64)  # 4000 bytes, after the first is freed
    assert m.baseline == 256 * 256 * 4
    assert m.peak == m.baseline + 4000
    assert m.live == 4000
    del c

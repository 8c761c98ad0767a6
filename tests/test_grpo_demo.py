"""The GRPO demo's smoke run: the whole pipeline, not its accuracy (that is a recorded run)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")
# A guard against hangs, not a speed check: on a 2-core machine shared with other jobs one
# quick run took 68 s (12 s of CPU).
TIMEOUT = 600


def test_quick_run_writes_table_plot_and_json(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    import rgc.compute

    # Chosen once here as the demo would, then fixed for both runs (they must be identical).
    mode = rgc.compute.choose_compute_mode().name
    cmd = [sys.executable, str(ROOT / "examples" / "grpo_arithmetic.py"), "--quick",
           "--no-progress", "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "c"),
           "--compute", mode]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert first.returncode == 0, first.stderr[-3000:]
    out = tmp_path / "out"
    assert f"results in {out}" in first.stdout
    assert f"compute mode: {'native' if mode == 'native' else 'float32 matmuls'}" in first.stdout
    assert (out / "dev_accuracy.png").stat().st_size > 0
    result = json.loads((out / "results.json").read_text())
    methods = result["results"][0]["methods"]
    assert {"adamw", "lora", "rgc"} <= set(methods)
    for m in methods.values():
        assert 0.0 <= m["test_after"] <= 1.0
        assert m["test_correct"].count("1") == round(500 * m["test_after"])
        assert m["train_peak_bytes"] > 0 and m["loop_peak_bytes"] >= m["train_peak_bytes"]
        assert m["extra_state_bytes"] > 0
        assert len(m["dev_curve"]) >= 2
    # RGC tried tau and 3 tau; the one kept is the better on dev.
    rgc_runs = [r for r in result["results"][0]["runs"] if r["kind"] == "rgc"]
    assert len(rgc_runs) == 2
    assert methods["rgc"]["final_dev"] == max(r["final_dev"] for r in rgc_runs)
    # Dense AdamW holds 12 bytes per parameter beyond the BF16 weights (FP32 master + moments),
    # plus one scalar step count per tensor.
    n = methods["adamw"]["trainable_params"]
    assert 12 * n <= methods["adamw"]["extra_state_bytes"] < 12 * n + 1024
    assert methods["rgc"]["train_peak_bytes"] < methods["adamw"]["train_peak_bytes"]

    # Deterministic for a seed, and the cached base policy is reused.
    (tmp_path / "out").rename(tmp_path / "first")
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert second.returncode == 0, second.stderr[-3000:]
    again = json.loads((out / "results.json").read_text())
    assert len(list((tmp_path / "c").iterdir())) == 1
    for kind, m in methods.items():
        m2 = again["results"][0]["methods"][kind]
        assert m2["test_after"] == m["test_after"] and m2["dev_curve"] == m["dev_curve"]
        assert m2["train_peak_bytes"] == m["train_peak_bytes"]


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

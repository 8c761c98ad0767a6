import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
pytestmark = pytest.mark.slow  # each runs a benchmark, some in a fresh process


def test_optimizer_step_benchmark_runs(tmp_path):
    from benchmarks import optimizer_step_cpu

    rows = optimizer_step_cpu.main(["--scale", "64", "--layers", "1", "--rank", "4", "--reps",
                                    "1", "--out", str(tmp_path)])
    assert [row["method"] for row in rows][-1] == "adamw foreach, fp32 params"
    assert all(row["step_ms"] > 0 for row in rows)
    assert "## Environment" in (tmp_path / "optimizer_step_cpu.md").read_text()


def test_cpu_loop_costs_benchmark_runs(tmp_path):
    from benchmarks import cpu_loop_costs

    rows = cpu_loop_costs.main(["--scale", "64", "--layers", "1", "--rank", "4", "--reps", "1",
                                "--out", str(tmp_path)])
    times = {row["piece"]: row["time"] for row in rows}
    assert all(times[name] > 0 for name in times if not name.startswith("update pass"))
    # the per-Gaussian row is the refresh's timing over its Gaussians: 7 projections of k x 4
    gaussians = 4 * sum(k for _, _, k in cpu_loop_costs.layer_shapes(64))
    refresh_ms = times["Box-Muller Gaussians (compiled), per refresh"]
    # both rows are rounded to 3 decimals (ms and ns)
    assert abs(times["  per Gaussian"] - refresh_ms * 1e6 / gaussians) <= (
        0.0005 * 1e6 / gaussians + 0.0005)
    assert "## Environment" in (tmp_path / "cpu_loop_costs.md").read_text()


def test_first_refresh_process_reports_its_cpu_time():
    # the --first-use rows' new process, with dynamo off: nothing to compile, a second or two
    from benchmarks import cpu_loop_costs

    first, later = cpu_loop_costs.first_refresh([16, 24], 4, {"TORCHDYNAMO_DISABLE": "1"})
    assert first > 0 and later > 0
    assert later < first  # the first refresh also pays its libraries' first calls


def test_step_model_counts():
    # The model's floor is 4 bytes per projection weight, counted here from the config by
    # hand; every phase costs bytes and launches; the update moves at least the floor.
    import json

    from benchmarks import step_model

    config = json.loads((step_model.CONFIGS / "qwen3-1.7b.json").read_text())
    h, i, q, kv = 2048, 6144, 16 * 128, 8 * 128
    per_layer = q * h + 2 * kv * h + h * q + 3 * i * h
    rows = {row["phase"]: row for row in step_model.step_rows("x", config, 64)}
    assert rows["floor (read + write BF16 W once)"]["GB"] == pytest.approx(
        4 * 28 * per_layer / 1e9)
    assert rows["update (fused)"]["GB"] > rows["floor (read + write BF16 W once)"]["GB"]
    total = rows["total RGC step"]
    assert total["GB"] == pytest.approx(sum(
        row["GB"] for p, row in rows.items() if p not in ("total RGC step", "floor (read + "
                                                          "write BF16 W once)")
        and not p.startswith("AdamW")))
    # counted on a scaled copy of the layers: a few launches per distinct shape, not per layer
    assert 0 < total["launches"] < 100


def test_gpu_experts_smoke_mode(tmp_path):
    pytest.importorskip("transformers")
    from benchmarks import gpu_experts

    passes, steps = gpu_experts.main(["--smoke", "--out", str(tmp_path)])
    assert [row["path"] for row in passes] == ["sketched", "dense", "frozen"]
    assert all(row["forward_ms"] > 0 and row["forward_backward_ms"] > 0 for row in passes)
    assert [row["method"] for row in steps] == ["rgc", "rowadam", "adamw"]
    # the two stacks of one layer: gate_up E x 2I x H and down E x H x I
    e, h, i = (gpu_experts.SMOKE[k] for k in ("num_experts", "hidden_size",
                                               "moe_intermediate_size"))
    assert all(row["weights"] == e * 3 * i * h and row["step_ms"] > 0 for row in steps)
    for name in ("gpu_experts_smoke", "gpu_experts_step_smoke"):
        assert "## Environment" in (tmp_path / f"{name}.md").read_text()


def test_memory_benchmark_runs_the_compiled_cpu_loops():
    """The quick memory benchmark (every method, a model built and trained as a user would) in
    a fresh process where any RuntimeWarning is an error: no CPU loop falls back from
    torch.compile to eager ops (a weight view made under no_grad once made the compiled norm
    refuse its input), and every peak is within 1% of its estimate."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "benchmarks/memory.py",
                          "--quick"], cwd=root, env=dict(os.environ, PYTHONPATH=str(root / "src")),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    errors = [float(line.split("|")[5]) for line in out.stdout.splitlines()
              if line.startswith(("| rgc ", "| rowadam ", "| lora ", "| adamw "))]
    assert len(errors) >= 4 and all(abs(e) < 1 for e in errors)

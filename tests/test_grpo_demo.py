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


def test_quick_run_writes_table_plot_and_json(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(ROOT / "examples" / "grpo_arithmetic.py"), "--quick",
           "--no-progress", "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "c")]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    out = tmp_path / "out"
    assert f"results in {out}" in first.stdout
    assert (out / "dev_accuracy.png").stat().st_size > 0
    result = json.loads((out / "results.json").read_text())
    methods = result["results"][0]["methods"]
    assert {"adamw", "lora", "rgc"} <= set(methods)
    for m in methods.values():
        assert 0.0 <= m["test_after"] <= 1.0
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
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr[-3000:]
    again = json.loads((out / "results.json").read_text())
    assert len(list((tmp_path / "c").iterdir())) == 1
    for kind, m in methods.items():
        m2 = again["results"][0]["methods"][kind]
        assert m2["test_after"] == m["test_after"] and m2["dev_curve"] == m["dev_curve"]
        assert m2["train_peak_bytes"] == m["train_peak_bytes"]

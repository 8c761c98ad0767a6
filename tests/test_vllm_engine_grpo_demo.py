"""The GRPO demo with ``--vllm``: rollouts from a vLLM engine that follows each policy.

The MoE smoke run on two worker processes (each builds its own in-process CPU engine): the
RGC runs sync their engine with one full load and then a payload per step, dense AdamW with
the whole weights, and every engine holds its policy's weights bit for bit at the end.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.test_grpo_demo import ROOT, TIMEOUT, _demo_env

pytest.importorskip("vllm")
pytest.importorskip("matplotlib")


def test_moe_quick_run_with_engine_rollouts(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "grpo_arithmetic.py"), "--moe", "--quick",
         "--vllm", "--no-progress", "--workers", "2", "--out", str(out), "--cache-dir",
         str(tmp_path / "cache")],
        env={**_demo_env(), "VLLM_CPU_KVCACHE_SPACE": "1"}, capture_output=True, text=True,
        timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "--vllm: lora left out" in run.stdout
    result = json.loads((out / "results.json").read_text())
    steps = result["settings"]["grpo"]["steps"]
    assert {r["kind"] for r in result["runs"]} == {"adamw", "rgc", "rowadam"}
    for r in result["runs"]:
        engine = r["engine"]
        assert engine["bit_exact_at_end"], r["label"]
        if r["kind"] in ("rgc", "rowadam"):
            assert (engine["payloads"], engine["full_loads"]) == (steps, 1)
        else:
            assert (engine["payloads"], engine["full_loads"]) == (0, steps + 1)
    assert "held each policy's weights bit for bit at the end of its run: True" in \
        (out / "results.md").read_text()

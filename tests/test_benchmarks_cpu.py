import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def test_optimizer_step_benchmark_runs(tmp_path):
    from benchmarks import optimizer_step_cpu

    rows = optimizer_step_cpu.main(["--scale", "64", "--layers", "1", "--rank", "4", "--reps",
                                    "1", "--out", str(tmp_path)])
    assert [row["method"] for row in rows][-1] == "adamw foreach, fp32 params"
    assert all(row["step_ms"] > 0 for row in rows)
    assert "## Environment" in (tmp_path / "optimizer_step_cpu.md").read_text()

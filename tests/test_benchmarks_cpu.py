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


def test_projection_benchmark_runs(tmp_path):
    import pytest

    from benchmarks import projection_cpu
    from rgc import _native

    if _native.library() is None or not _native.library().fast_fma:
        pytest.skip("needs the compiled loops with hardware fused multiply-adds")
    rows = projection_cpu.main(["--reps", "2", "--shapes", "64x8,70x17", "--out", str(tmp_path)])
    assert [(row["k"], row["r"]) for row in rows] == [(64, 8), (70, 17)]
    assert all(row["cholesky_qr_compiled_us"] > 0 for row in rows)
    assert "## Environment" in (tmp_path / "projection_cpu.md").read_text()

"""Shared by the benchmark scripts: the environment stamp and result writing."""

from __future__ import annotations

import csv
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict:
    """Machine, versions, date and commit: stamped on every result file."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False, cwd=RESULTS.parent).stdout.strip()
    except OSError:
        commit = ""
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit or "unknown",
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        # The instruction set PyTorch's CPU kernels use (AVX2, AVX512, ...), after any
        # ATEN_CPU_CAPABILITY cap; results differ in their last bits between them.
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "peft": _version("peft"),
    }
    for flag in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        if flag in os.environ:
            env[flag] = os.environ[flag]
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env


def python_last_line(code: str, *args: str, env: dict[str, str] | None = None) -> str:
    """The last line a new ``python -c code *args`` prints (with ``env`` as its environment,
    default this one's); its stderr's tail in the error where it fails."""
    run = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                         text=True, check=False)
    if run.returncode:
        raise RuntimeError(f"a benchmark's child process failed (exit {run.returncode}):\n"
                           f"{run.stderr[-2000:]}")
    return run.stdout.strip().splitlines()[-1]


def markdown_table(rows: list[dict]) -> str:
    """A markdown table of ``rows`` (dicts with the same keys)."""
    if not rows:
        return ""
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        cells = [f"{row[k]:.4g}" if isinstance(row[k], float) else str(row[k]) for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(name: str, rows: list[dict], *, title: str, notes: str = "",
                  directory: Path = RESULTS) -> Path:
    """Write ``name.csv``, ``name.md`` (table + environment) and ``name.json``; print the table."""
    directory.mkdir(parents=True, exist_ok=True)
    env = environment()
    table = markdown_table(rows)
    print(table)
    with open(directory / f"{name}.csv", "w", newline="") as f:
        if rows:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    env_lines = "\n".join(f"- {k}: {v}" for k, v in env.items())
    md = f"# {title}\n\n{table}\n\n{notes}\n\n## Environment\n\n{env_lines}\n"
    (directory / f"{name}.md").write_text(md)
    (directory / f"{name}.json").write_text(json.dumps({"env": env, "rows": rows}, indent=2))
    return directory / f"{name}.md"

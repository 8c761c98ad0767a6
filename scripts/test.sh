#!/usr/bin/env bash
# Fresh-machine test command: sets up .venv, lints, runs the whole test suite (on two
# pytest-xdist workers: pyproject.toml's addopts). Without arguments the tests that run a vLLM
# engine follow, in their own environment, one at a time (scripts/setup_vllm.sh;
# RGC_SKIP_VLLM=1 leaves them out), then the tests that train through verl's engine, in theirs
# (scripts/setup_verl.sh; RGC_SKIP_VERL=1 leaves them out).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
ruff check src tests benchmarks examples tools
python -m pytest -q "$@"
if [ $# -eq 0 ] && [ "${RGC_SKIP_VLLM:-0}" != 1 ]; then
  bash scripts/setup_vllm.sh
  .venv-vllm/bin/python -m pytest -q -n 0 tests/test_vllm_engine*.py
fi
if [ $# -eq 0 ] && [ "${RGC_SKIP_VERL:-0}" != 1 ]; then
  bash scripts/setup_verl.sh
  .venv-verl/bin/python -m pytest -q -n 0 tests/test_verl*.py
fi

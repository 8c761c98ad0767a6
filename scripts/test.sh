#!/usr/bin/env bash
# Fresh-machine test command: sets up .venv, lints, runs the whole test suite (on two
# pytest-xdist workers: pyproject.toml's addopts). Without arguments the tests that run a vLLM
# engine follow, in their own environment, one at a time (scripts/setup_vllm.sh;
# RGC_SKIP_VLLM=1 leaves them out), then the tests that train through verl's engine, in theirs
# (scripts/setup_verl.sh; RGC_SKIP_VERL=1 leaves them out). Those two environments are set up
# while the main suite runs (pip mostly waits on downloads); their output is shown if that fails.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
ruff check src tests benchmarks examples tools
vllm=0 verl=0
if [ $# -eq 0 ]; then
  [ "${RGC_SKIP_VLLM:-0}" = 1 ] || vllm=1
  [ "${RGC_SKIP_VERL:-0}" = 1 ] || verl=1
fi
setup_log=$(mktemp) setup_pid=
kill_tree() {  # a process and its descendants (pip and what it runs)
  local child
  for child in $(pgrep -P "$1" || true); do kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}
trap 'if [ -n "$setup_pid" ]; then kill_tree "$setup_pid"; fi; rm -f "$setup_log"' EXIT
if [ $((vllm + verl)) -gt 0 ]; then
  ( if [ $vllm = 1 ]; then bash scripts/setup_vllm.sh; fi
    if [ $verl = 1 ]; then bash scripts/setup_verl.sh; fi ) > "$setup_log" 2>&1 &
  setup_pid=$!
fi
python -m pytest -q "$@"
if [ -n "$setup_pid" ]; then
  if ! wait "$setup_pid"; then
    cat "$setup_log" >&2
    echo "setting up the vLLM or verl environment failed (output above)" >&2
    exit 1
  fi
  setup_pid=
fi
if [ $vllm = 1 ]; then
  .venv-vllm/bin/python -m pytest -q -n 0 tests/test_vllm_engine*.py
fi
if [ $verl = 1 ]; then
  .venv-verl/bin/python -m pytest -q -n 0 tests/test_verl*.py
fi

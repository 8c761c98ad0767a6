#!/usr/bin/env bash
# Fresh-machine test command: sets up .venv, lints, runs the whole test suite.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
ruff check src tests benchmarks examples
python -m pytest -q "$@"

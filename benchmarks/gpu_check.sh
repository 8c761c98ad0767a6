#!/usr/bin/env bash
# One call on a machine with a CUDA GPU: the compiled-kernel tests, then the kernel benchmark
# (results under benchmarks/results/, or the directory given with --out).
#   benchmarks/gpu_check.sh [gpu_kernels.py options, e.g. --reps 20 --no-sweep]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python || command -v python3)}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET RGC_IMPL
export TRITON_DEFAULT_FP_FUSION=1
"$PY" -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
"$PY" -m pytest tests/test_kernels_gpu.py -q -x -p no:cacheprovider
"$PY" benchmarks/gpu_kernels.py "$@"

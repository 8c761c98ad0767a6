#!/usr/bin/env bash
# One call on a machine with a CUDA GPU runs every GPU check and writes the results under
# benchmarks/results/ (or DIR with --out DIR):
#   1. the compiled-kernel tests (tests/test_ops_gpu.py, among them the row shards of FSDP2
#      ranks updated with their offsets against the unsharded update, bit for bit) and the
#      ahead-of-time spill check (tests/test_ops_aot.py), pytest output in gpu_check_tests.txt;
#   2. the kernel benchmark against copy bandwidth, the torch path and fused AdamW, one and
#      eight stacks per launch (gpu_kernels.{md,csv,json}, gpu_kernels_sweep.*);
#   3. a whole RGCOptimizer.step() on Qwen3-1.7B's projections (rgc.wrap + rgc.RGCOptimizer)
#      against torch.optim.AdamW(fused=True), with host synchronisations counted and the CUDA
#      kernels, memcpys and memsets of one step counted by the torch profiler, at full and at
#      half depth (gpu_step.*): the grouping by shape measured, not only modelled;
#   4. the distributed step on NCCL (docs/distributed.md, "NCCL and the GPU"): RGC data
#      parallel, RGC under FSDP2 and LoGRA's recipe (FSDP2, RowAdam r=256, annealed predicted
#      KL, a DCP checkpoint) of examples/distributed.py, 10 steps each under torchrun, each
#      required to print that the ranks' weights agree (gpu_check_distributed.txt). Two
#      processes on two GPUs when there are two or more; with one GPU a group of one (NCCL
#      refuses two ranks on one device): FSDP2, the kernels and the probe then run on the
#      device, but no collective carries data, and NCCL's reduction order is not exercised.
#   5. the expert path on one Qwen3-30B-A3B layer (128 experts, BF16, 4096 tokens x 8
#      experts): sketched forward/backward against transformers' dense grouped-GEMM backward
#      and the frozen (input-gradient-only) floor, with peak memory and host syncs, and the
#      update of the two stacks (RGCOptimizer, RowAdam) against fused AdamW and the copy
#      bandwidth (gpu_experts.*, gpu_experts_step.*).
#   6. the large-model recipe on NCCL: examples/large_model.py (meta init, FSDP2 with the
#      expert stacks sharded over experts, a sync payload per step applied to a replica),
#      MoE and dense, 10 steps each, required to print that the replica is bit-identical
#      (gpu_check_distributed.txt);
#   7. where vLLM is installed: the engine tests with expert stacks and dense weights
#      (tests/test_vllm_engine_moe.py, tests/test_vllm_engine.py) on the GPU engine
#      (gpu_check_vllm.txt);
#   8. where verl and vLLM are installed: a verl GRPO smoke run with rgc's engine, RowAdam and
#      the payload sync into verl's vLLM rollout (benchmarks/verl_grpo_smoke.py,
#      verl_grpo_smoke.txt).
# Every step runs even when an earlier one fails; the exit status is the first failure's.
#   benchmarks/gpu_check.sh [--out DIR] [--reps N] [--no-sweep]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python || command -v python3)}
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET RGC_IMPL
export TRITON_DEFAULT_FP_FUSION=1

OUT=benchmarks/results
BENCH_ARGS=()
STEP_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --reps) BENCH_ARGS+=(--reps "$2"); STEP_ARGS+=(--reps "$2"); shift 2 ;;
    --no-sweep) BENCH_ARGS+=(--no-sweep); shift ;;
    *) echo "unknown option $1 (use --out DIR, --reps N, --no-sweep)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"

status=0
run() {  # run a step, remember the first failure, keep going
  echo "== $*"
  "$@"
  local rc=$?
  if [ $rc -ne 0 ]; then
    echo "== FAILED ($rc): $*"
    [ $status -eq 0 ] && status=$rc
  fi
}

"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
torch.cuda.get_device_name(), 'CUDA', torch.version.cuda)" || exit 1
# -o addopts: one process on the GPU, not pyproject's two pytest-xdist workers (nor needing them)
run bash -c "set -o pipefail; '$PY' -m pytest tests/test_ops_gpu.py tests/test_ops_aot.py \
  -q -p no:cacheprovider -o addopts=-ra 2>&1 | tee '$OUT/gpu_check_tests.txt'"
run "$PY" benchmarks/gpu_kernels.py --out "$OUT" ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"}
run "$PY" benchmarks/gpu_kernels.py --step --config benchmarks/configs/qwen3-1.7b.json \
  --out "$OUT" ${STEP_ARGS[@]+"${STEP_ARGS[@]}"}
run "$PY" benchmarks/gpu_experts.py --out "$OUT" ${STEP_ARGS[@]+"${STEP_ARGS[@]}"}
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
NPROC=$(( NGPU >= 2 ? 2 : 1 ))
: > "$OUT/gpu_check_distributed.txt"
CKPT=$(mktemp -d)
for args in "--recipe rgc" "--recipe rgc --fsdp" "--recipe logra --checkpoint $CKPT/logra"; do
  run bash -c "set -o pipefail; '$PY' -m torch.distributed.run --standalone \
    --nproc-per-node $NPROC examples/distributed.py --steps 10 $args 2>&1 \
    | tee -a '$OUT/gpu_check_distributed.txt' | grep 'weights agree across ranks: True' >/dev/null"
done
rm -rf "$CKPT"
for args in "" "--dense"; do
  run bash -c "set -o pipefail; '$PY' -m torch.distributed.run --standalone \
    --nproc-per-node $NPROC examples/large_model.py --steps 10 $args 2>&1 \
    | tee -a '$OUT/gpu_check_distributed.txt' \
    | grep 'replica bit-identical to the trained policy: True' >/dev/null"
done
if "$PY" -c "import vllm" 2>/dev/null; then
  run bash -c "set -o pipefail; '$PY' -m pytest tests/test_vllm_engine_moe.py \
    tests/test_vllm_engine.py -q -p no:cacheprovider -o addopts=-ra 2>&1 \
    | tee '$OUT/gpu_check_vllm.txt'"
else
  echo "== vLLM not installed: the GPU engine checks are skipped" | tee "$OUT/gpu_check_vllm.txt"
fi
if "$PY" -c "import verl, vllm" 2>/dev/null; then
  run "$PY" benchmarks/verl_grpo_smoke.py --steps 3 --out "$OUT"
else
  echo "== verl or vLLM not installed: the verl GRPO smoke run is skipped" \
    | tee "$OUT/verl_grpo_smoke.txt"
fi
echo "== results in $OUT (status $status)"
exit $status

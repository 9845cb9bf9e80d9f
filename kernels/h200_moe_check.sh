#!/usr/bin/env bash
# One device call on an H200: the 1-token sweep of hand-picked fused-MoE configs (writes a table
# with the winner), the micro-benchmark of every token count with that table and the measured
# ceilings, then the GPU tests of the fused MoE kernels. Results land in $OUT.
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/safeserve-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
timeout "${SWEEP_TIMEOUT:-100}" python3 kernels/sweep_fused_moe.py --tokens 1 \
  --candidates kernels/configs/sweep_t1.json --out "$OUT/best.json" --json "$OUT/sweep.json" \
  2>&1 | tee "$OUT/sweep.log"
timeout "${BENCH_TIMEOUT:-130}" python3 kernels/bench_fused_moe.py --configs "$OUT/best.json" \
  --ceilings --json "$OUT/bench_final.json" 2>&1 | tee "$OUT/bench_final.log"
bash kernels/gpu_pytest.sh "${TEST_TIMEOUT:-400}" "$OUT/pytest.log" tests/kernels/test_fused_moe.py -m gpu

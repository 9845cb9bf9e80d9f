#!/usr/bin/env bash
# One device call on an H200: profile a decode step (kernels/profile_decode.py) of the tree in
# BASELINE (a copy of an older `safeserve` package, optional) and of this tree, then the GPU tests
# of the fused kernels. Results land in $OUT.
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/safeserve-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
ARGS="--concurrency ${CONCURRENCY:-1,64} --steps ${STEPS:-20} --trace-steps 2"
if [ -n "${BASELINE:-}" ]; then
  PYTHONPATH="$BASELINE" timeout "${PROFILE_TIMEOUT:-110}" python3 kernels/profile_decode.py \
    $ARGS --label baseline --json "$OUT/profile_baseline.json" 2>&1 | grep -v USDT | tee "$OUT/profile_baseline.log"
fi
PYTHONPATH=. timeout "${PROFILE_TIMEOUT:-110}" python3 kernels/profile_decode.py \
  $ARGS --label current --json "$OUT/profile_current.json" 2>&1 | grep -v USDT | tee "$OUT/profile_current.log"
bash kernels/gpu_pytest.sh "${TEST_TIMEOUT:-100}" "$OUT/pytest.log" -x \
  tests/kernels/test_norm_rope.py tests/kernels/test_engine_kernels_gpu.py

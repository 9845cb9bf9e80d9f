#!/usr/bin/env bash
# One device call on an H200: sweeps of hand-picked fused-MoE configs at 1-2 tokens
# (kernels/configs/sweep_decode.json) and at 4,096 tokens (sweep_t4096.json; SWEEP_4096=0 skips
# it), each writing a table with the winners; the micro-benchmark of every token count with the
# final table, the measured ceilings, a paired matmul from 1,024 tokens and (BREAKDOWN=1) the
# per-launch times; then the GPU tests of the fused MoE kernels in parallel shards (SHARDS,
# TEST_K). Results land in $OUT.
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/safeserve-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
timeout "${SWEEP_TIMEOUT:-150}" python3 kernels/sweep_fused_moe.py --tokens 1,2 \
  --candidates kernels/configs/sweep_decode.json --out "$OUT/best_decode.json" \
  --json "$OUT/sweep_decode.json" 2>&1 | tee "$OUT/sweep_decode.log"
if [ "${SWEEP_4096:-1}" = 1 ]; then
  timeout "${SWEEP_TIMEOUT:-150}" python3 kernels/sweep_fused_moe.py --tokens 4096 \
    --candidates kernels/configs/sweep_t4096.json --base "$OUT/best_decode.json" \
    --out "$OUT/best.json" --json "$OUT/sweep_4096.json" 2>&1 | tee "$OUT/sweep_4096.log"
else
  cp "$OUT/best_decode.json" "$OUT/best.json"
fi
# from 1,024 tokens (compute-bound) an 8192^3 matmul rides in the same replay rotation
timeout "${BENCH_TIMEOUT:-150}" python3 kernels/bench_fused_moe.py --configs "$OUT/best.json" \
  --tokens "${TOKENS:-1,2,4,8,16,32,64,128,256,512,1024,2048,4096}" --ceilings \
  --paired-matmul 1024 ${BREAKDOWN:+--breakdown} --json "$OUT/bench_final.json" 2>&1 |
  tee "$OUT/bench_final.log"
SHARDS=${SHARDS:-6} bash kernels/gpu_pytest.sh "${TEST_TIMEOUT:-240}" "$OUT/pytest.log" \
  tests/kernels/test_fused_moe.py tests/kernels/test_moe_align.py tests/kernels/test_topk_softmax.py \
  tests/kernels/test_moe_config.py -m gpu ${TEST_K:+-k "$TEST_K"}

#!/usr/bin/env bash
# One device call on one H200 for the block-FP8 kernels: their GPU tests (the quantizer, the
# W8A8 fused MoE and dense linear against the dequantizing reference; the model runner's FP8 calls,
# logits and bf16 in tests/engine/test_fp8_weights_kernels.py), then
# kernels/bench_fused_moe_fp8.py on the Qwen3-30B-A3B layer (FP8 against bf16 in the same run,
# the floors, the FP8 matrix rate) and, with SWEEP=1, its tile sweep written as a table.
# Results in $OUT.
#   usage: [SWEEP=1] [TOKENS=1,8,64,512,4096] kernels/h200_fp8_check.sh
source "$(dirname "$0")/device_env.sh"
date -u +%FT%TZ | tee "$OUT/gpu.txt"
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_fused_moe_fp8.py tests/kernels/test_fp8_linear.py \
  tests/kernels/test_fp8_kv_kernels.py tests/engine/test_fp8_weights_kernels.py \
  -m "gpu or kernel" >"$OUT/pytest.log" 2>&1
echo "== tests rc=$?"; tail -4 "$OUT/pytest.log" | cut -c1-300
sweep=()
[ "${SWEEP:-0}" = 1 ] && sweep=(--sweep --table-out "$OUT/fp8_table.json")
timeout "${BENCH_TIMEOUT:-300}" python3 kernels/bench_fused_moe_fp8.py \
  --tokens "${TOKENS:-1,2,4,8,16,32,64,128,256,512,1024,2048,4096}" --fp8-ceiling \
  --json "$OUT/bench_fused_moe_fp8.json" "${sweep[@]}" 2>&1 | tee "$OUT/bench_fused_moe_fp8.log"
echo "== bench rc=${PIPESTATUS[0]}"

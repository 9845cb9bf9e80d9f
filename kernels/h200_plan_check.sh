#!/usr/bin/env bash
# One device call on one H200 for `safeserve plan`'s calibration and its check: `safeserve bench`
# (dummy weights, bf16, 512-token prompts, 64 out) on the Qwen3-30B-A3B shape at every batch size
# 1-64 (the calibration run), on the same shape with 24 layers (a config the calibration does not
# see), and on the Moonlight and Mixtral shapes. Bench JSON and full logs (the ranks' KV-sizing
# lines) land in $OUT; `python kernels/calibrate_plan.py` fits and checks from them.
#   usage: kernels/h200_plan_check.sh [qwen3|all]
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
date -u +%F | tee -a "$OUT/gpu.txt"
bench() {  # name, config dir, concurrency, extra flags
  bench_dummy "$@"
  grep -E "KV cache from device memory|step .* floor|read ceiling" "$OUT/bench_$1.log" | cut -c1-220
}
bench qwen3 qwen3-30b-a3b 1,2,4,8,16,32,64
bench qwen3_24l qwen3-30b-a3b-24-layers 1,2,4,8,16,32,64
if [ "${1:-all}" = all ]; then
  bench moonlight moonlight-16b-a3b 1,8,64 --max-model-len 4096
  bench mixtral mixtral-8x7b 1,8,64 --max-model-len 4096
fi

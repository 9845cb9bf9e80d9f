#!/usr/bin/env bash
# Device calls on one H200 for the model families: `tests` runs the whole GPU suite (every
# `gpu` or `kernel` test, sharded); `bench` runs `safeserve bench` with dummy weights on the
# Qwen3-30B-A3B, Moonlight-16B-A3B (DeepSeek-V3 architecture) and Mixtral-8x7B shapes, and the
# MLA decode-attention microbenchmark. Results land in $OUT.
#   usage: kernels/h200_families_check.sh tests|bench
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/gpu.txt"
date -u +%F | tee -a "$OUT/gpu.txt"
case "${1:-tests}" in
tests)
  SHARDS=${SHARDS:-8} bash kernels/gpu_pytest.sh "${TEST_TIMEOUT:-450}" "$OUT/pytest.log" \
    tests -m "gpu or kernel"
  ;;
bench)
  bench() {  # name, config dir, concurrency, extra flags
    timeout "${BENCH_TIMEOUT:-240}" python3 -m safeserve.cli bench --model "kernels/configs/$2" \
      --load-format dummy --device cuda --dtype bfloat16 --concurrency "$3" \
      --input-len 512 --output-len 64 --json "$OUT/bench_$1.json" "${@:4}" \
      2>&1 | tail -40 | tee "$OUT/bench_$1.log"
  }
  # the same command as the last recorded Qwen3 run (kernels/RESULTS.md), for the A/B
  bench qwen3 qwen3-30b-a3b 1,64
  bench moonlight moonlight-16b-a3b "${MOONLIGHT_CONC:-1,8,32,64}" --max-model-len 4096
  bench mixtral mixtral-8x7b "${MIXTRAL_CONC:-1,8,32,64}" --max-model-len 4096
  if [ -f kernels/bench_mla_decode.py ]; then
    timeout 120 python3 kernels/bench_mla_decode.py --out "$OUT/bench_mla_decode.json" 2>&1 |
      tee "$OUT/bench_mla_decode.log"
  fi
  ;;
esac

#!/usr/bin/env bash
# Device checks on one H200 for block-FP8 weights and the FP8 KV cache, by mode (several modes
# run in the order given). Results in $OUT.
#   tests   the GPU tests: the quantizer, the W8A8 fused MoE and dense linear, the FP8 KV kernels
#           against their dequantizing references; the model runner's FP8 calls, logits and bf16
#           (tests/engine/test_fp8_weights_kernels.py); the FP8 KV engine tests
#   bench   kernels/bench_fused_moe_fp8.py on the Qwen3-30B-A3B layer (FP8 against bf16 in the
#           same run, the floors, the FP8 matrix rate); with SWEEP=1 its tile sweep as a table;
#           where .peer/sglang exists (kernels/fetch_peer_sglang.sh, carried with the run) it passes
#           --peer-dir .peer/sglang: SGLang's Triton fused MoE (block FP8) timed in the same run
#           (BENCH_TIMEOUT then defaults to 420 s, else 300 s)
#   engine  `safeserve bench` decode, bf16 then FP8 weights + FP8 KV, same tree and call,
#           512-token prompts, 128 out, concurrency $CONC (default 1,8,16,32,64)
#   prefill `safeserve bench` of one 8,192-token prompt, bf16 then FP8 weights + FP8 KV
#   usage: [SWEEP=1] [TOKENS=...] [CONC=...] [MODEL=qwen3-30b-a3b] kernels/h200_fp8_check.sh MODE...
source "$(dirname "$0")/device_env.sh"
date -u +%FT%TZ | tee "$OUT/gpu.txt"
model=${MODEL:-qwen3-30b-a3b}
fp8=(--quantization fp8 --kv-cache-dtype fp8_e4m3)
modes=("$@")
[ ${#modes[@]} -gt 0 ] || modes=(tests bench)
for mode in "${modes[@]}"; do
  case $mode in
    tests)
      SHARDS=${SHARDS:-4} bash kernels/gpu_pytest.sh "${TEST_TIMEOUT:-300}" "$OUT/pytest.log" \
        tests/kernels/test_fused_moe_fp8.py tests/kernels/test_fp8_linear.py \
        tests/kernels/test_fp8_kv_kernels.py \
        tests/engine/test_fp8_weights_kernels.py -m "gpu or kernel"
      ;;
    bench)
      sweep=()
      [ "${SWEEP:-0}" = 1 ] && sweep=(--sweep --table-out "$OUT/fp8_table.json")
      peer=()
      bench_timeout=${BENCH_TIMEOUT:-300}
      if [ -d .peer/sglang ]; then
        peer=(--peer-dir .peer/sglang)
        bench_timeout=${BENCH_TIMEOUT:-420}  # the peer's compiles and timings on top
      fi
      timeout "$bench_timeout" python3 kernels/bench_fused_moe_fp8.py \
        --tokens "${TOKENS:-1,2,4,8,16,32,64,128,256,512,1024,2048,4096}" --fp8-ceiling \
        --json "$OUT/bench_fused_moe_fp8.json" "${sweep[@]}" "${peer[@]}" 2>&1 |
        tee "$OUT/bench_fused_moe_fp8.log"
      echo "== bench rc=${PIPESTATUS[0]}"
      ;;
    engine)
      for run in bf16 fp8; do
        extra=()
        [ $run = fp8 ] && extra=("${fp8[@]}")
        BENCH_TIMEOUT=${BENCH_TIMEOUT:-240} bench_dummy "decode_$run" "$model" \
          "${CONC:-1,8,16,32,64}" --output-len 128 "${extra[@]}"
        tail -3 "$OUT/bench_decode_$run.log" | cut -c1-300
      done
      ;;
    prefill)
      for run in bf16 fp8; do
        extra=()
        [ $run = fp8 ] && extra=("${fp8[@]}")
        BENCH_TIMEOUT=${BENCH_TIMEOUT:-240} bench_dummy "prefill8k_$run" "$model" 1 \
          --input-len 8192 --output-len 8 --max-model-len 16384 "${extra[@]}"
        tail -3 "$OUT/bench_prefill8k_$run.log" | cut -c1-300
      done
      ;;
    *) echo "unknown mode $mode" >&2; exit 2 ;;
  esac
done

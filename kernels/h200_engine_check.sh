#!/usr/bin/env bash
# One device call on an H200: the GPU correctness tests of the engine's CUDA path (decode
# attention, fused MoE subset incl. float32, fused norm/RoPE kernels, engine on CUDA vs CPU, CUDA
# graphs), then the Qwen3-30B-A3B bench (dummy weights) with the transformers peer. Results land
# in $OUT.
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/safeserve-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/gpu.txt"
bash kernels/gpu_pytest.sh "${TEST_TIMEOUT:-170}" "$OUT/pytest.log" \
  tests/kernels/test_paged_attention.py tests/kernels/test_engine_kernels_gpu.py \
  tests/kernels/test_fused_moe.py tests/kernels/test_topk_softmax.py tests/kernels/test_norm_rope.py \
  -k "not interpreter and (paged or engine or E60 or E37 or E16 or replay or topk or dropped or norm)"
timeout "${BENCH_TIMEOUT:-300}" python3 -m safeserve.cli bench \
  --model kernels/configs/qwen3-30b-a3b --load-format dummy --device cuda --dtype bfloat16 \
  --concurrency "${CONCURRENCY:-1,2,4,8,16,32,64}" --input-len 512 --output-len 128 \
  --peer transformers --peer-output-len "${PEER_OUTPUT_LEN:-16}" --json "$OUT/bench.json" \
  2>&1 | tee "$OUT/bench.log"

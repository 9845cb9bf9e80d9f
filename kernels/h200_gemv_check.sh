#!/usr/bin/env bash
# One device call on an H200: the decode-size sweep of the fused MoE down projection (dot tile vs
# gemv), then the GPU tests of the fused kernels (norm/RoPE, top-k, gemv down, engine on CUDA).
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/safeserve-out}
mkdir -p "$OUT"
timeout "${SWEEP_TIMEOUT:-120}" python3 kernels/sweep_down_gemv.py --tokens 1,2,4 \
  --out "$OUT/best.json" --json "$OUT/sweep.json" 2>&1 | tee "$OUT/sweep.log"
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_norm_rope.py tests/kernels/test_engine_kernels_gpu.py \
  tests/kernels/test_fused_moe.py -k "not interpreter and (norm or engine or gemv or topk or replay)" \
  2>&1 | tee "$OUT/pytest.log"

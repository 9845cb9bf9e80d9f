#!/usr/bin/env bash
# One device call on one H200 for --enable-deterministic-inference: its GPU tests (the engine's
# logits alone vs batched vs continued, the invariant kernels), then `safeserve bench` (dummy
# weights, bf16, Qwen3-30B-A3B shapes, 512-token prompts, 64 out) at concurrency 1 and 64 with
# the flag off and on; with VARIANTS=1 also on with other invariant tile choices
# (INVARIANT_BLOCK_M of the linears, INVARIANT_TOKENS of the fused-MoE table entry), set in
# process. Results in $OUT.
#   usage: [VARIANTS=1] kernels/h200_deterministic_check.sh
source "$(dirname "$0")/device_env.sh"
date -u +%FT%TZ | tee "$OUT/gpu.txt"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_deterministic_gpu.py tests/kernels/test_linear.py \
  tests/kernels/test_paged_attention.py tests/kernels/test_fused_moe.py \
  -k "invariant or logits_do_not" -m "gpu or kernel" >"$OUT/pytest.log" 2>&1
echo "== tests rc=$?"; tail -4 "$OUT/pytest.log" | cut -c1-300
bench_dummy det_off qwen3-30b-a3b 1,64
bench_dummy det_on qwen3-30b-a3b 1,64 --enable-deterministic-inference
variant() {  # name, linear block rows, fused-MoE table token count
  timeout "${BENCH_TIMEOUT:-200}" python3 - "$OUT/bench_$1.json" "$2" "$3" >"$OUT/bench_$1.log" 2>&1 <<'PY'
import sys
import safeserve.kernels.linear as lin
import safeserve.kernels.moe_config as mc
out, lin.INVARIANT_BLOCK_M, mc.INVARIANT_TOKENS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
from safeserve.cli import main
sys.argv = ["safeserve", "bench", "--model", "kernels/configs/qwen3-30b-a3b", "--load-format",
            "dummy", "--device", "cuda", "--dtype", "bfloat16", "--concurrency", "1,64",
            "--input-len", "512", "--output-len", "64", "--json", out,
            "--enable-deterministic-inference"]
sys.exit(main())
PY
  echo "== $1 rc=$?"
}
if [ "${VARIANTS:-0}" = 1 ]; then
  variant det_on_bm64 64 512
  variant det_on_moe64 16 64
fi
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
for f in sorted(Path(sys.argv[1]).glob("bench_*.json")):
    for p in json.loads(f.read_text())["points"]:
        print(f"{f.stem:28s} c={p['concurrency']:3d} step {p['decode_step_ms']:.2f} ms "
              f"out {p['output_tok_s']:.0f} tok/s ttft {p['ttft_ms']:.0f} ms floor x{p['step_over_floor']:.2f}")
PY

#!/usr/bin/env bash
# One device call on one H200: tune the fused-MoE tile tables of the Mixtral-8x7B and
# Moonlight-16B-A3B shapes (kernels/tune_fused_moe.py; decode buckets first, the prefill ones while
# the budget lasts, the rest keep the heuristic), then `safeserve bench` on each shape with its new
# table (SAFESERVE_FUSED_MOE_CONFIG). Tables, JSON and logs land in $OUT.
#   usage: kernels/h200_tune_families.sh   (env MIXTRAL_BUDGET_S, MOONLIGHT_BUDGET_S)
source "$(dirname "$0")/device_env.sh"
TOKENS=1,2,4,8,16,32,64,128,256,512,1024,2048,4096
tune() {  # name, experts, hidden, inter, top_k, budget
  timeout $(($6 + 120)) python3 kernels/tune_fused_moe.py --experts "$2" --hidden "$3" \
    --inter "$4" --top-k "$5" --tokens "$TOKENS" --budget-s "$6" --out "$OUT/table_$1.json" \
    >"$OUT/tune_$1.log" 2>&1
  echo "== tune $1 rc=$?"
  grep -E "^T=|budget|compiled" "$OUT/tune_$1.log" | cut -c1-160
}
bench() {  # name, config dir, table
  SAFESERVE_FUSED_MOE_CONFIG="$3" timeout 200 python3 -m safeserve.cli bench \
    --model "kernels/configs/$2" --load-format dummy --device cuda --dtype bfloat16 \
    --concurrency 1,8,64 --input-len 512 --output-len 64 --max-model-len 4096 \
    --json "$OUT/bench_$1.json" >"$OUT/bench_$1.log" 2>&1
  echo "== bench $1 rc=$?"
  grep -E "step .* floor" "$OUT/bench_$1.log"
}
tune mixtral 8 4096 14336 2 "${MIXTRAL_BUDGET_S:-200}"
tune moonlight 64 2048 1408 6 "${MOONLIGHT_BUDGET_S:-150}"
bench mixtral_tuned mixtral-8x7b "$OUT/table_mixtral.json"
bench moonlight_tuned moonlight-16b-a3b "$OUT/table_moonlight.json"

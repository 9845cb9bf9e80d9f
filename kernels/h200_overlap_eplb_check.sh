#!/usr/bin/env bash
# One device call on one H200 for what the overlap and EPLB flags cost a decode step on one rank,
# and for the step-time spread against the last recorded Qwen3 run:
#   - `safeserve bench` (dummy weights, bf16, 512-token prompts, 64 out) on Qwen3-30B-A3B at
#     concurrency 1 and 64: flags off, --enable-two-batch-overlap, flags off again (A/B/A, so the
#     spread of one tree shows beside the flag's effect);
#   - Moonlight-16B-A3B (shared experts) at 1 and 64: off, then two-batch and single-batch overlap;
#   - kernels/eplb_gpu_check.py: a rebalance's weight moves under the decode CUDA graphs (outputs
#     against eager, the longest stall at concurrency 64) and the step with EPLB's counting on
#     against off.
# Each bench JSON holds, per point, the decode steps that replayed a CUDA graph. Results in $OUT.
#   usage: kernels/h200_overlap_eplb_check.sh
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
date -u +%FT%TZ | tee -a "$OUT/gpu.txt"
bench() {  # name, config dir, concurrency, extra flags
  bench_dummy "$@"
  grep -E "TPOT .* floor|do nothing" "$OUT/bench_$1.log" | cut -c1-200
}
bench qwen3_a qwen3-30b-a3b 1,64
bench qwen3_tbo qwen3-30b-a3b 1,64 --enable-two-batch-overlap
bench qwen3_b qwen3-30b-a3b 1,64
bench moonlight moonlight-16b-a3b 1,64 --max-model-len 4096
bench moonlight_overlap moonlight-16b-a3b 1,64 --max-model-len 4096 \
  --enable-two-batch-overlap --enable-single-batch-overlap
timeout "${EPLB_TIMEOUT:-200}" python3 kernels/eplb_gpu_check.py \
  --model kernels/configs/qwen3-30b-a3b-24-layers --redundant 16 --batch 64 --steps 40 \
  >"$OUT/eplb_gpu_check.jsonl" 2>"$OUT/eplb_gpu_check.err"
echo "== eplb rc=$?"
tail -1 "$OUT/eplb_gpu_check.jsonl"
tail -3 "$OUT/eplb_gpu_check.err"
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in ["qwen3_a", "qwen3_tbo", "qwen3_b", "moonlight", "moonlight_overlap"]:
    f = out / f"bench_{name}.json"
    if not f.exists():
        print(name, "missing")
        continue
    for p in json.loads(f.read_text())["points"]:
        print(f"{name:18s} c={p['concurrency']:3d} step {p['decode_step_ms']:.3f} ms "
              f"mean {p['decode_step_mean_ms']:.3f} floor x{p.get('step_over_floor', 0):.2f} "
              f"graph replays {p.get('decode_graph_replays')}")
PY
